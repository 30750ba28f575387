"""One-row paged decode (8/8 heads, D = 128, L = 16k), before and after HISTORY 37, in ONE process.

    python paged_decode_before_after.py DIR_BEFORE

A paged pool keeps the V prefetch; HISTORY 37 changes its score loop (one key at a time).
Pools as bench/bench_paged.py's (vLLM's block-major layout, blocks scattered, 2x the blocks
needed); before and after alternated, order swapped each round, medians of 9.
"""
import os
import statistics
import sys
import time

import ml_dtypes
import numpy as np

import attnfast as after

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bench_paged import paged_copy  # noqa: E402


def main():
    sys.path.insert(0, sys.argv[1])
    import attnfast_before as before
    rng = np.random.default_rng(0)
    L, d = 16384, 128
    print(f"tier {after._ext.runtime_info()['isa']}")
    print("| dtype | block | threads | before ms | after ms | after speed / before | same bits |")
    print("|---|---|---|---|---|---|---|")
    for name, dt in (("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16)):
        k = rng.standard_normal((1, 8, L, d), dtype=np.float32).astype(dt)
        v = rng.standard_normal((1, 8, L, d), dtype=np.float32).astype(dt)
        q = rng.standard_normal((1, 8, 1, d), dtype=np.float32).astype(dt)
        lens = np.array([L], np.int32)
        for bs in (16, 256):
            kp, vp, table = paged_copy(rng, k, v, bs, head_major=False, shuffled=True)
            for n in (1, 2):
                fa = lambda: after.attention_with_kvcache(q, kp, vp, lens, block_table=table, num_threads=n)
                fb = lambda: before.attention_with_kvcache(q, kp, vp, lens, block_table=table, num_threads=n)
                same = np.array_equal(np.asarray(fa()).view(np.uint8), np.asarray(fb()).view(np.uint8))
                ta, tb = [], []
                for r in range(9):
                    for lst, fn in (((tb, fb), (ta, fa)) if r % 2 == 0 else ((ta, fa), (tb, fb))):
                        t0 = time.perf_counter()
                        for _ in range(5):
                            fn()
                        lst.append((time.perf_counter() - t0) / 5)
                mb, ma = statistics.median(tb), statistics.median(ta)
                print(f"| {name} | {bs} | {n} | {mb * 1e3:.2f} | {ma * 1e3:.2f} | {mb / ma:.2f}x | {same} |", flush=True)


if __name__ == "__main__":
    main()
