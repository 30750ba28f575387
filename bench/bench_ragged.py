"""A ragged serving step over one paged pool: one attention_varlen call against one
attention_with_kvcache call per sequence, in one process.

    python bench/bench_ragged.py                      # 32/8 heads, D = 128, float32 + bfloat16
    python bench/bench_ragged.py --dtypes float32 --threads 1 --repeats 9

The batch: 8 decode rows (one query each) at contexts spread over 4k-16k, and 2 prompt chunks
of 512 new tokens (over 1k and 2k cached tokens before them), all in one pool of 16-token
blocks scattered over it (a fragmented pool, as a server's). Causal. Calls are timed in turns
(medians of interleaved repeats); the result of the one call is checked bit-identical to the
per-sequence calls first. speedup = sum of per-sequence calls / one call.
"""
import argparse
import statistics
import time

import ml_dtypes
import numpy as np

import attnfast as af

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def build(rng, dtype, heads, kv_heads, dim, block_size, decode_contexts, chunks):
    """Pools, table, seqused_k, cu_seqlens_q and packed q of the step."""
    q_lens = [1] * len(decode_contexts) + [c for c, _ in chunks]
    k_lens = list(decode_contexts) + [c + cached for c, cached in chunks]
    blocks = [-(-n // block_size) for n in k_lens]
    num_blocks = 2 * sum(blocks)
    ids = rng.permutation(num_blocks)
    table = np.zeros((len(k_lens), max(blocks)), np.int32)
    at = 0
    for b, n in enumerate(blocks):
        table[b, :n] = ids[at:at + n]
        at += n
    k_pool = rng.standard_normal((num_blocks, kv_heads, block_size, dim), dtype=np.float32).astype(dtype)
    v_pool = rng.standard_normal((num_blocks, kv_heads, block_size, dim), dtype=np.float32).astype(dtype)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]), heads, dim), dtype=np.float32).astype(dtype)
    return q, k_pool, v_pool, cu_q, np.array(k_lens, np.int32), table


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="32/8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7, help="interleaved rounds (median)")
    args = p.parse_args()
    h, hkv = (int(x) for x in args.heads.split("/"))
    n = args.threads
    contexts = [4096, 5120, 6144, 8192, 10240, 12288, 14336, 16384]
    chunks = [(512, 1024), (512, 2048)]
    print(f"ragged step: 8 decode rows at {contexts[0]}..{contexts[-1]} keys + 2 chunks of 512 "
          f"queries; H={h}, Hkv={hkv}, D={args.head_dim}, block_size={args.block_size}, {n} threads; "
          f"tier {af._ext.runtime_info()['isa']}")
    print(f"{'dtype':9s} {'one call':>10s} {'per-seq sum':>12s} {'speedup':>8s}   (medians)")
    for name in args.dtypes.split(","):
        dt = DTYPES[name]
        rng = np.random.default_rng(0)
        q, kp, vp, cu_q, used, table = build(rng, dt, h, hkv, args.head_dim, args.block_size,
                                             contexts, chunks)
        out_one = np.empty((q.shape[0], h, args.head_dim), dt)
        out_seq = np.empty_like(out_one)

        def one():
            af.attention_varlen(q, kp, vp, cu_q, seqused_k=used, block_table=table, causal=True,
                                out=out_one, num_threads=n)

        def per_sequence():
            for b in range(len(used)):
                q0, q1 = cu_q[b], cu_q[b + 1]
                o = af.attention_with_kvcache(q[q0:q1].transpose(1, 0, 2)[None], kp, vp,
                                              used[b:b + 1], block_table=table[b:b + 1],
                                              causal=True, num_threads=n)
                out_seq[q0:q1] = o[0].transpose(1, 0, 2)

        one()
        per_sequence()
        if not np.array_equal(out_one.view(np.uint8), out_seq.view(np.uint8)):
            raise SystemExit(f"one call differs from the per-sequence calls ({name})")
        times = {"one": [], "seq": []}
        for _ in range(args.repeats):
            for key, f in (("one", one), ("seq", per_sequence)):
                t0 = time.perf_counter()
                f()
                times[key].append(time.perf_counter() - t0)
        a, b = statistics.median(times["one"]), statistics.median(times["seq"])
        print(f"{name:9s} {a * 1e3:8.2f}ms {b * 1e3:10.2f}ms {b / a:8.3f}", flush=True)


if __name__ == "__main__":
    main()
