"""Greedy generation with vLLM's offline LLM on a tiny random-weight Llama, printed as JSON.

    python tests/vllm_generate.py MODEL_DIR DTYPE [--attnfast] [--kv-cache-dtype=fp8]

MODEL_DIR holds a config.json and random weights that write_checkpoint saved there (seeded;
tests/test_vllm_backend.py calls it). vLLM's load_format="dummy" is not used on purpose: its
weights are uniform in +-1e-3 (the same draw for every tensor), so every attention row is
nearly uniform and greedy tokens do not depend on the attention (checked: attention with its
scale off by 10% gave the same tokens); these weights keep activations of unit scale with
peaked attention, and the same check changes the tokens. Prompts are token ids
(skip_tokenizer_init), nothing is downloaded. Without --attnfast this is vLLM's own CPU
backend; with it, ATTNFAST_VLLM_BACKEND=1 lets attnfast's entry point select its backend. The
engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that paged_attention's
calls can be counted (printed, to show which backend ran).
"""
import json
import os
import sys

PROMPTS = [[1, 17, 42, 99, 5, 7, 300, 12], [1, 250] * 20, list(range(3, 70))]


# Larger than unit variance where attention enters: peaked softmax rows, and attention's share of
# the residual stream large enough that its exact values decide the greedy tokens.
GAIN = {"q_proj": 2.0, "k_proj": 2.0, "o_proj": 4.0}


def write_checkpoint(model_dir, config):
    """A Llama with seeded random weights (norms 1, matrices N(0, gain^2 / fan_in), gain 1
    but in GAIN; embeddings N(0, 1)) saved as config.json + model.safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(**config))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
            else:
                fan_in = 1 if "embed" in name else p.shape[-1]
                gain = next((v for k, v in GAIN.items() if k in name), 1.0)
                p.copy_(torch.randn(p.shape, generator=g) * gain * fan_in ** -0.5)
    model.save_pretrained(model_dir)


def main(model_dir, dtype, use_attnfast, kv_cache_dtype="auto"):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if use_attnfast:
        os.environ["ATTNFAST_VLLM_BACKEND"] = "1"
    import attnfast.integrations.vllm as afv
    calls = [0]
    inner = afv.paged_attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    afv.paged_attention = counted
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=dtype,
              enforce_eager=True, max_model_len=512, seed=0, max_num_seqs=4,
              kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                            detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    print("RESULT " + json.dumps({"tokens": tokens, "attnfast_calls": calls[0]}), flush=True)


if __name__ == "__main__":
    flags = sys.argv[3:]
    kv = [f.split("=", 1)[1] for f in flags if f.startswith("--kv-cache-dtype=")]
    main(sys.argv[1], sys.argv[2], "--attnfast" in flags, *kv)
