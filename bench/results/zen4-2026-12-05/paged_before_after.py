"""Paged against contiguous prefill, before and after, in ONE process.

    python paged_before_after.py DIR_BEFORE [--threads 1] [--dtype float32] [--repeats 7]

"after" is the installed attnfast; "before" a copy of an older package renamed
attnfast_before in DIR_BEFORE (as ../zen4-2026-12-04/before_after.py). Each cell is a causal
prefill of Tq new tokens over a cache of L tokens (B = 1, D = 128) through
attention_with_kvcache: a contiguous cache, and a pool of blocks (num_blocks, Hkv, block, D)
twice the blocks needed, the sequence's blocks scattered over it, read through a block
table. The four calls (two builds x two caches) alternate in every round; medians of the
rounds. Both builds' paged results are checked bit-identical to their contiguous ones.
"""
import argparse
import importlib
import os
import statistics
import sys
import time

import ml_dtypes
import numpy as np

import attnfast as after

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bench_paged_prefill import scattered_pool  # noqa: E402  (the grid's pool layout)

CELLS = [  # heads, kv heads, L, Tq, block size
    (8, 8, 16384, 512, 16), (32, 8, 16384, 512, 16), (8, 8, 4096, 4096, 16),
    (32, 8, 1024, 1024, 16), (8, 8, 16384, 512, 128), (8, 8, 4096, 512, 128),
]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir_before")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    sys.path.insert(0, args.dir_before)
    before = importlib.import_module("attnfast_before")
    builds = {"before": before, "after": after}
    dt = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bfloat16" else np.dtype(np.float32)
    rng = np.random.default_rng(0)
    d, n = 128, args.threads
    print(f"# paged / contiguous causal prefill, {args.dtype}, D = {d}, B = 1, {n} thread(s), "
          f"tier {after._ext.runtime_info()['isa']}; medians of {args.repeats} rounds, ms\n")
    print("| heads | L | Tq | block | before contiguous | before paged | before ratio "
          "| after contiguous | after paged | after ratio | contiguous after/before |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for h, hkv, length, tq, bs in CELLS:
        k = rng.standard_normal((1, hkv, length, d), dtype=np.float32).astype(dt)
        v = rng.standard_normal((1, hkv, length, d), dtype=np.float32).astype(dt)
        q = rng.standard_normal((1, h, tq, d), dtype=np.float32).astype(dt)
        blocks = -(-length // bs)
        ids = rng.permutation(2 * blocks)[:blocks]

        kp, vp = scattered_pool(k, bs, ids), scattered_pool(v, bs, ids)
        table = ids.reshape(1, blocks).astype(np.int32)
        lens = np.array([length])
        outs, calls = {}, {}
        for name, m in builds.items():
            for cache in ("contiguous", "paged"):
                o = outs[name, cache] = np.empty((1, h, tq, d), dt)
                if cache == "contiguous":
                    calls[name, cache] = lambda m=m, o=o: m.attention_with_kvcache(
                        q, k, v, lens, causal=True, out=o, num_threads=n)
                else:
                    calls[name, cache] = lambda m=m, o=o: m.attention_with_kvcache(
                        q, kp, vp, lens, block_table=table, causal=True, out=o, num_threads=n)
        for f in calls.values():
            f()
        for name in builds:
            if not np.array_equal(outs[name, "paged"].view(np.uint8), outs[name, "contiguous"].view(np.uint8)):
                raise SystemExit(f"{name}: paged result differs from contiguous ({h}/{hkv} L={length})")
        times = {c: [] for c in calls}
        for r in range(args.repeats):
            order = list(calls) if r % 2 == 0 else list(reversed(calls))
            for c in order:
                t0 = time.perf_counter()
                calls[c]()
                times[c].append(time.perf_counter() - t0)
        md = {c: statistics.median(t) * 1e3 for c, t in times.items()}
        cells = []
        for name in builds:
            c, pg = md[name, "contiguous"], md[name, "paged"]
            cells += [f"{c:.1f}", f"{pg:.1f}", f"{pg / c:.3f}"]
        ratio = md["after", "contiguous"] / md["before", "contiguous"]
        print(f"| {h}/{hkv} | {length} | {tq} | {bs} | " + " | ".join(cells) + f" | {ratio:.3f} |", flush=True)


if __name__ == "__main__":
    main()
