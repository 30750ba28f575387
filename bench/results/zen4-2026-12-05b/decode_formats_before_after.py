"""One-row decode over each cache format, before and after HISTORY 36-37, in ONE process.

    python decode_formats_before_after.py DIR_BEFORE [--threads 1,2] [--repeats 9] [--head-dim 128]

"after" is the installed attnfast; "before" the previous build's package renamed
attnfast_before in DIR_BEFORE (see ../zen4-2026-12-04/before_after.py). Both read
ATTNFAST_ISA. For every format a KVCache of each build holds the same tokens (B = 1, 8 KV
heads, D = --head-dim); a step of 8/8 heads (one query row per KV head: the case HISTORY 36 changes)
and, as a control the change cannot touch, 32/8 heads (bfloat16 only). Before, after and the
native read kernel over a buffer the size of the float32 cache are timed in turns, order swapped
every round; medians. "% read" is the cache's bytes (K and V, scales included) over the step's
time, against the read kernel's rate of the same rounds.
"""
import argparse
import os
import statistics
import sys
import time

import ml_dtypes
import numpy as np

import attnfast as after
from attnfast import _ext

FORMATS = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
           "int8": "int8", "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "int4": "int4"}


def timed(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def cache_bytes(cache):
    return sum(np.asarray(getattr(cache, n)).nbytes for n in ("k", "v", "k_scale", "v_scale")
               if getattr(cache, n, None) is not None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir_before")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--lengths", default="16384,65536")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    sys.path.insert(0, args.dir_before)
    import attnfast_before as before

    rng = np.random.default_rng(0)
    print(f"tier: after {_ext.runtime_info()['isa']}, before {before._ext.runtime_info()['isa']}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"head_dim {args.head_dim}")
    print("| L | threads | heads | format | read GB/s | before ms | before % read | after ms | "
          "after % read | after speed / before | same bits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for length in [int(x) for x in args.lengths.split(",")]:
        d = args.head_dim
        kv = rng.standard_normal((1, 8, length, d), dtype=np.float32)
        buf = np.ones(2 * kv.nbytes, dtype=np.uint8)
        for name in args.formats.split(","):
            fmt = FORMATS[name]
            stored = name in ("float32", "bfloat16", "float16")
            qdt = fmt if stored else np.float32
            caches = []
            for mod in (before, after):
                c = mod.KVCache(1, 8, d, length, dtype=fmt)
                c.append(kv.astype(qdt), kv.astype(qdt))
                caches.append(c)
            nbytes = cache_bytes(caches[1])
            for h in ((8, 32) if name == "bfloat16" else (8,)):
                q = rng.standard_normal((1, h, 1, d), dtype=np.float32).astype(qdt)
                same = np.array_equal(caches[0].attend(q).view(np.uint8), caches[1].attend(q).view(np.uint8))
                for n in [int(x) for x in args.threads.split(",")]:
                    calls = max(2, int(1.5e8 // nbytes))
                    fb = lambda: caches[0].attend(q, num_threads=n)
                    fa = lambda: caches[1].attend(q, num_threads=n)
                    fr = lambda: _ext.read_bytes(buf, n)
                    ts = {"read": [], "a": [], "b": []}
                    fa(), fb(), fr()
                    for r in range(args.repeats):
                        order = (("read", fr, 1), ("b", fb, calls), ("a", fa, calls))
                        for key, fn, c in (order if r % 2 == 0 else order[::-1]):
                            ts[key].append(timed(fn, c))
                    read = buf.nbytes / statistics.median(ts["read"]) / 1e9
                    tb, ta = statistics.median(ts["b"]), statistics.median(ts["a"])
                    pb, pa = 100 * nbytes / tb / 1e9 / read, 100 * nbytes / ta / 1e9 / read
                    print(f"| {length // 1024}k | {n} | {h}/8 | {name} | {read:.1f} | {tb * 1e3:.2f} | "
                          f"{pb:.0f} % | {ta * 1e3:.2f} | {pa:.0f} % | {tb / ta:.2f}x | {same} |", flush=True)
            del caches


if __name__ == "__main__":
    main()
