"""Greedy generation with vLLM's offline LLM on a tiny random-weight Llama, printed as JSON.

    python tests/vllm_generate.py MODEL_DIR DTYPE [--attnfast]

MODEL_DIR holds a config.json (tests/test_vllm_backend.py writes it); the weights are
vLLM's dummy ones (seeded, so every run gets the same), prompts are token ids, nothing is
downloaded. Without --attnfast this is vLLM's own CPU backend. With it, the engine runs in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and ATTNFAST_VLLM_BACKEND=1 lets attnfast's
entry point select its backend; the number of paged_attention calls is printed too, to show
which backend ran. Run as a script: vLLM may start its engine in a spawned process, which
re-imports the main module.
"""
import json
import os
import sys

PROMPTS = [[1, 17, 42, 99, 5, 7, 300, 12], [1, 250] * 20, list(range(3, 70))]


def main(model_dir, dtype, use_attnfast):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    calls = [0]
    if use_attnfast:
        os.environ["ATTNFAST_VLLM_BACKEND"] = "1"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import attnfast.integrations.vllm as afv
        inner = afv.paged_attention

        def counted(*args, **kwargs):
            calls[0] += 1
            return inner(*args, **kwargs)

        afv.paged_attention = counted
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype=dtype,
              enforce_eager=True, max_model_len=512, seed=0, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                            detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    print("RESULT " + json.dumps({"tokens": tokens, "attnfast_calls": calls[0]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--attnfast" in sys.argv[3:])
