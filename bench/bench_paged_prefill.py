"""Paged against contiguous KV-cache prefill, in one process.

    python bench/bench_paged_prefill.py                     # the default grid below
    python bench/bench_paged_prefill.py --threads 1 --dtypes float32 --block-sizes 16

A causal prefill over a cache of T tokens (its Tq new tokens included, the last ones) through
attention_with_kvcache: a contiguous (1, Hkv, T, D) cache against a pool of blocks
(num_blocks, Hkv, block_size, D), twice the blocks needed, the sequence's blocks scattered
over it (a fragmented pool), read through a block table. Cells: T = 1k, 4k, 16k with a chunk
of Tq = 512 new tokens, and the whole prompt (Tq = T) at T = 1k and 4k (--full-max).

Calls are timed in turns (medians of interleaved repeats, so a drift of the machine hits both
alike); the ratio is paged / contiguous. Both results are checked bit-identical first.
"""
import argparse
import statistics
import time

import ml_dtypes
import numpy as np

import attnfast as af

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def scattered_pool(x, block_size, ids):
    """The (1, Hkv, T, D) cache x as a (2 * blocks, Hkv, block_size, D) pool, its blocks at ids."""
    _, hkv, length, d = x.shape
    blocks = len(ids)
    pool = np.zeros((2 * blocks, hkv, block_size, d), x.dtype)
    for i, blk in enumerate(ids):
        rows = slice(i * block_size, min((i + 1) * block_size, length))
        pool[blk, :, :rows.stop - rows.start] = x[0, :, rows]
    return pool


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,4096,16384")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--full-max", type=int, default=4096, help="longest T also run as a whole prompt")
    p.add_argument("--heads", default="8/8,32/8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-sizes", default="16,128")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds (median)")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    d, n = args.head_dim, args.threads
    print(f"causal prefill over a cache, D={d}, B=1, {n} threads; kernel tier {af._ext.runtime_info()['isa']}")
    print(f"{'dtype':9s} {'heads':>5s} {'T':>6s} {'Tq':>6s} {'block':>5s} {'contiguous':>11s} "
          f"{'paged':>10s} {'ratio':>6s}   (medians; ratio = paged / contiguous)")
    for name in args.dtypes.split(","):
        dt = DTYPES[name]
        for heads in args.heads.split(","):
            h, hkv = (int(x) for x in heads.split("/"))
            for length in [int(x) for x in args.lengths.split(",")]:
                k = rng.standard_normal((1, hkv, length, d), dtype=np.float32).astype(dt)
                v = rng.standard_normal((1, hkv, length, d), dtype=np.float32).astype(dt)
                lens = np.array([length])
                chunks = [args.chunk] + ([length] if length <= args.full_max and length != args.chunk else [])
                for tq in chunks:
                    q = rng.standard_normal((1, h, tq, d), dtype=np.float32).astype(dt)
                    for bs in [int(x) for x in args.block_sizes.split(",")]:
                        blocks = -(-length // bs)
                        ids = rng.permutation(2 * blocks)[:blocks]
                        kp, vp = scattered_pool(k, bs, ids), scattered_pool(v, bs, ids)
                        table = ids.reshape(1, blocks).astype(np.int32)
                        outs = {c: np.empty((1, h, tq, d), dt) for c in ("contiguous", "paged")}
                        calls = {
                            "contiguous": lambda: af.attention_with_kvcache(
                                q, k, v, lens, causal=True, out=outs["contiguous"], num_threads=n),
                            "paged": lambda: af.attention_with_kvcache(
                                q, kp, vp, lens, block_table=table, causal=True, out=outs["paged"],
                                num_threads=n),
                        }
                        for f in calls.values():
                            f()  # warm up
                        if not np.array_equal(outs["paged"].view(np.uint8), outs["contiguous"].view(np.uint8)):
                            raise SystemExit(f"paged result differs from contiguous ({name} {heads} T={length})")
                        times = {c: [] for c in calls}
                        for _ in range(args.repeats):
                            for c, f in calls.items():
                                t0 = time.perf_counter()
                                f()
                                times[c].append(time.perf_counter() - t0)
                        med = {c: statistics.median(t) for c, t in times.items()}
                        print(f"{name:9s} {heads:>5s} {length:6d} {tq:6d} {bs:5d} {med['contiguous'] * 1e3:9.2f}ms "
                              f"{med['paged'] * 1e3:8.2f}ms {med['paged'] / med['contiguous']:6.3f}", flush=True)


if __name__ == "__main__":
    main()
