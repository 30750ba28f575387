"""Paged against contiguous KV-cache decode, in one process.

    python bench/bench_paged.py                      # L=16k, 32/8 heads, D=128, float32 + bfloat16
    python bench/bench_paged.py --threads 1 --block-sizes 16,256 --dtypes float32

One decode step (Tq = 1, B = 1) of attention_with_kvcache over a cache of L tokens: a
contiguous (1, Hkv, L, D) cache against pools of blocks holding the same tokens through a
block table, three ways (each pool twice the blocks needed, as in a server):

  in order   PagedKVCache's layout (storage (Hkv, num_blocks, block_size, D)), the sequence's
             blocks taken in order from the free list (what one sequence growing alone gets);
  shuffled   the same layout, the blocks scattered over the pool (a fragmented pool);
  vllm       storage (num_blocks, Hkv, block_size, D) (vLLM's / a block-major pool),
             blocks scattered.

Calls are timed in turns (medians of interleaved repeats, so a drift of the machine hits all
alike); each ratio is paged / contiguous. All results are checked bit-identical first.
"""
import argparse
import statistics
import time

import ml_dtypes
import numpy as np

import attnfast as af

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float16": np.dtype(np.float16)}


def paged_copy(rng, k, v, block_size, *, head_major, shuffled):
    """The (1, Hkv, L, D) cache k, v as pools of 2x the blocks needed and a (1, blocks) table."""
    _, hkv, length, d = k.shape
    blocks = -(-length // block_size)
    pool = 2 * blocks
    ids = rng.permutation(pool)[:blocks] if shuffled else np.arange(blocks)
    table = ids.reshape(1, blocks).astype(np.int32)
    pools = []
    for x in (k, v):
        if head_major:
            p = np.zeros((hkv, pool, block_size, x.shape[3]), x.dtype).transpose(1, 0, 2, 3)
        else:
            p = np.zeros((pool, hkv, block_size, x.shape[3]), x.dtype)
        for i, blk in enumerate(ids):
            rows = slice(i * block_size, min((i + 1) * block_size, length))
            p[blk, :, :rows.stop - rows.start] = x[0, :, rows]
        pools.append(p)
    return pools[0], pools[1], table


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-sizes", default="16,64,256")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=10, help="interleaved rounds (median)")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    h, hkv, length, d = args.heads, args.kv_heads, args.length, args.head_dim
    print(f"decode Tq=1, L={length}, H={h}, Hkv={hkv}, D={d}, B=1; kernel tier {af._ext.runtime_info()['isa']}")
    print(f"{'dtype':9s} {'block':>5s} {'threads':>7s} {'contiguous':>11s} {'in order':>9s} "
          f"{'shuffled':>9s} {'vllm':>9s}   (paged / contiguous, medians)")
    layouts = {"in order": dict(head_major=True, shuffled=False),
               "shuffled": dict(head_major=True, shuffled=True),
               "vllm": dict(head_major=False, shuffled=True)}
    for name in args.dtypes.split(","):
        dt = DTYPES[name]
        k = rng.standard_normal((1, hkv, length, d), dtype=np.float32).astype(dt)
        v = rng.standard_normal((1, hkv, length, d), dtype=np.float32).astype(dt)
        q = rng.standard_normal((1, h, 1, d), dtype=np.float32).astype(dt)
        lens = np.array([length])
        for bs in [int(x) for x in args.block_sizes.split(",")]:
            pools = {lay: paged_copy(rng, k, v, bs, **kw) for lay, kw in layouts.items()}
            for n in [int(x) for x in args.threads.split(",")]:
                outs = {c: np.empty((1, h, 1, d), dt) for c in ["contiguous", *layouts]}
                calls = {"contiguous": lambda: af.attention_with_kvcache(
                    q, k, v, lens, out=outs["contiguous"], num_threads=n)}
                for lay, (kp, vp, table) in pools.items():
                    calls[lay] = (lambda kp=kp, vp=vp, table=table, lay=lay:
                                  af.attention_with_kvcache(q, kp, vp, lens, block_table=table,
                                                            out=outs[lay], num_threads=n))
                for c, f in calls.items():
                    f()  # warm up
                    if not np.array_equal(outs[c].view(np.uint8), outs["contiguous"].view(np.uint8)):
                        raise SystemExit(f"{c} result differs from contiguous ({name}, block {bs})")
                times = {c: [] for c in calls}
                for _ in range(args.repeats):
                    for c, f in calls.items():
                        for _ in range(3):
                            t0 = time.perf_counter()
                            f()
                            times[c].append(time.perf_counter() - t0)
                med = {c: statistics.median(t) for c, t in times.items()}
                base = med["contiguous"]
                print(f"{name:9s} {bs:5d} {n:7d} {base * 1e3:9.2f}ms "
                      + " ".join(f"{med[lay] / base:9.3f}" for lay in layouts))


if __name__ == "__main__":
    main()
