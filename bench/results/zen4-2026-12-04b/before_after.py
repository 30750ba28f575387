"""Issue 20 before / after: the build before the issue (f83a37f) and main, in ONE process.

    python before_after.py DIR_BEFORE decode|prefill [--threads 1,2] [--repeats 9]

"after" is the installed attnfast; "before" a copy of the f83a37f package renamed
attnfast_before in DIR_BEFORE (its modules import each other relatively; each _ext .so loads
RTLD_LOCAL, so neither build's symbols reach the other). Both read ATTNFAST_ISA, so one
process runs one tier in both builds. Calls alternate before / after (order swapped every
round); medians of the rounds.

decode: a step (B = 1, Tq = 1, D = 128) for each layout, dtype and L, with the native read
kernel (csrc/probe.cpp, over a buffer the size of the cache) timed in the same rounds: the
percentages compare numbers of the same minutes.
prefill: compare_peers' shape (B = 1, H = 8, D = 128), causal and not, T = 1k and 4k.
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


def timed(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def same_bits(a, b):
    return np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir_before")
    p.add_argument("what", choices=["decode", "prefill"])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--lengths", default="16384,65536")
    p.add_argument("--T", default="1024,4096")
    args = p.parse_args()
    sys.path.insert(0, args.dir_before)
    import attnfast_before as before

    dtypes = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
    rng = np.random.default_rng(0)
    print(f"tier: after {_ext.runtime_info()['isa']}, before "
          f"{before._ext.runtime_info()['isa']}; load average {os.getloadavg()[0]:.1f}", flush=True)
    threads = [int(x) for x in args.threads.split(",")]
    if args.what == "decode":
        print("| L | threads | heads | dtype | read GB/s | before ms | before % read | after ms "
              "| after % read | after speed / before | same bits |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for length in [int(x) for x in args.lengths.split(",")]:
            for name, dt in dtypes.items():
                for h, hkv in ((8, 8), (32, 8)):
                    k = rng.standard_normal((1, hkv, length, 128), dtype=np.float32).astype(dt)
                    v = rng.standard_normal((1, hkv, length, 128), dtype=np.float32).astype(dt)
                    q = rng.standard_normal((1, h, 1, 128), dtype=np.float32).astype(dt)
                    sl = np.array([length], dtype=np.int32)
                    nbytes = k.nbytes + v.nbytes
                    buf = np.ones(nbytes, dtype=np.uint8)
                    same = same_bits(after.attention_with_kvcache(q, k, v, sl),
                                     before.attention_with_kvcache(q, k, v, sl))
                    for n in threads:
                        calls = max(2, int(3e8 // nbytes))
                        fa = lambda: after.attention_with_kvcache(q, k, v, sl, num_threads=n)
                        fb = lambda: before.attention_with_kvcache(q, k, v, sl, num_threads=n)
                        fr = lambda: _ext.read_bytes(buf, n)
                        ts = {"read": [], "a": [], "b": []}
                        fa(), fb(), fr()
                        for r in range(args.repeats):
                            order = (("read", fr), ("b", fb), ("a", fa))
                            for key, fn in (order if r % 2 == 0 else order[::-1]):
                                ts[key].append(timed(fn, calls))
                        read = nbytes / statistics.median(ts["read"]) / 1e9
                        tb, ta = statistics.median(ts["b"]), statistics.median(ts["a"])
                        pb, pa = 100 * nbytes / tb / 1e9 / read, 100 * nbytes / ta / 1e9 / read
                        print(f"| {length // 1024}k | {n} | {h}/{hkv} | {name} | {read:.1f} | "
                              f"{tb * 1e3:.2f} | {pb:.0f} % | {ta * 1e3:.2f} | {pa:.0f} % | "
                              f"{tb / ta:.2f}x | {same} |", flush=True)
                    del k, v, buf
    else:
        print("| T | causal | dtype | threads | before ms | after ms | after speed / before | same bits |")
        print("|---|---|---|---|---|---|---|---|")
        for t in [int(x) for x in args.T.split(",")]:
            for name, dt in dtypes.items():
                q, k, v = (rng.standard_normal((1, 8, t, 128), dtype=np.float32).astype(dt)
                           for _ in range(3))
                for causal in (False, True):
                    same = same_bits(after.attention(q, k, v, causal=causal),
                                     before.attention(q, k, v, causal=causal))
                    for n in threads:
                        fa = lambda: after.attention(q, k, v, causal=causal, num_threads=n)
                        fb = lambda: before.attention(q, k, v, causal=causal, num_threads=n)
                        fa(), fb()
                        calls = max(1, int(0.15 / timed(fa, 1)))
                        ta, tb = [], []
                        for r in range(args.repeats):
                            pair = ((tb, fb), (ta, fa)) if r % 2 == 0 else ((ta, fa), (tb, fb))
                            for lst, fn in pair:
                                lst.append(timed(fn, calls))
                        mb, ma = statistics.median(tb), statistics.median(ta)
                        print(f"| {t} | {causal} | {name} | {n} | {mb * 1e3:.1f} | {ma * 1e3:.1f} | "
                              f"{mb / ma:.2f}x | {same} |", flush=True)


if __name__ == "__main__":
    main()
