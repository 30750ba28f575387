"""Paged against contiguous KV-cache decode, in one process (issue 8).

    python bench/bench_paged.py                      # L=16k, 32/8 heads, D=128, float32 + bfloat16
    python bench/bench_paged.py --threads 1 --block-sizes 16,256 --dtypes float32

One decode step (Tq = 1) of attention_with_kvcache over a cache of L tokens, B = 1, for a
contiguous (B, Hkv, L, D) cache and for a pool of blocks (num_blocks, Hkv, block_size, D)
holding the same tokens through a shuffled block table (blocks scattered over a pool of
twice the needed size, as in a server whose pool is fragmented). Contiguous and paged calls
are timed in turns (medians of interleaved repeats, so a drift of the machine hits both
alike) and the ratio paged / contiguous is printed. The two results are also checked to be
bit-identical (they must be).
"""
import argparse
import statistics
import time

import ml_dtypes
import numpy as np

import attnfast as af

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float16": np.dtype(np.float16)}


def paged_copy(rng, k, v, block_size):
    """The (1, Hkv, L, D) cache k, v as shuffled pools of blocks and a (1, max_blocks) table."""
    _, hkv, length, d = k.shape
    blocks = -(-length // block_size)
    pool = 2 * blocks
    table = rng.permutation(pool)[:blocks].reshape(1, blocks).astype(np.int32)
    k_pool = np.zeros((pool, hkv, block_size, d), k.dtype)
    v_pool = np.zeros((pool, hkv, block_size, v.shape[3]), v.dtype)
    for i, blk in enumerate(table[0]):
        rows = slice(i * block_size, min((i + 1) * block_size, length))
        n = rows.stop - rows.start
        k_pool[blk, :, :n] = k[0, :, rows]
        v_pool[blk, :, :n] = v[0, :, rows]
    return k_pool, v_pool, table


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-sizes", default="16,64,256")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=15, help="interleaved rounds (median)")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    h, hkv, length, d = args.heads, args.kv_heads, args.length, args.head_dim
    print(f"decode Tq=1, L={length}, H={h}, Hkv={hkv}, D={d}, B=1; kernel tier {af.show_config()['isa']}")
    print(f"{'dtype':9s} {'block':>5s} {'threads':>7s} {'contiguous':>11s} {'paged':>9s} {'ratio':>6s}")
    for name in args.dtypes.split(","):
        dt = DTYPES[name]
        k = rng.standard_normal((1, hkv, length, d), dtype=np.float32).astype(dt)
        v = rng.standard_normal((1, hkv, length, d), dtype=np.float32).astype(dt)
        q = rng.standard_normal((1, h, 1, d), dtype=np.float32).astype(dt)
        lens = np.array([length])
        for bs in [int(x) for x in args.block_sizes.split(",")]:
            k_pool, v_pool, table = paged_copy(rng, k, v, bs)
            for n in [int(x) for x in args.threads.split(",")]:
                out_c = np.empty((1, h, 1, d), dt)
                out_p = np.empty((1, h, 1, d), dt)

                def contiguous():
                    af.attention_with_kvcache(q, k, v, lens, out=out_c, num_threads=n)

                def paged():
                    af.attention_with_kvcache(q, k_pool, v_pool, lens, block_table=table,
                                              out=out_p, num_threads=n)
                contiguous(), paged()  # warm up
                if not np.array_equal(out_c.view(np.uint8), out_p.view(np.uint8)):
                    raise SystemExit(f"paged result differs from contiguous ({name}, block {bs})")
                tc, tp = [], []
                for _ in range(args.repeats):  # interleaved: 3 of each per round
                    tc += timed(contiguous, 3)
                    tp += timed(paged, 3)
                c, pg = statistics.median(tc), statistics.median(tp)
                print(f"{name:9s} {bs:5d} {n:7d} {c * 1e3:9.3f}ms {pg * 1e3:7.3f}ms {pg / c:6.3f}")


if __name__ == "__main__":
    main()
