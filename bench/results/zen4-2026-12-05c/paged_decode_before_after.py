"""One-row paged decode before and after HISTORY 38, against the contiguous cache, in ONE process.

    python paged_decode_before_after.py DIR_BEFORE [--blocks 16,32,64,128,256] [--threads 1,2]

"after" is the installed attnfast; "before" the previous build's package renamed
attnfast_before in DIR_BEFORE (see run.sh). 8/8 heads, D = 128, L = 16k, B = 1; pools as
bench/bench_paged.py's paged_copy (2x the blocks needed, scattered in a random order), in
both layouts: block-major (num_blocks, Hkv, block, D), and head-major storage (attnfast's
PagedKVCache). Before, after, the same tokens as a contiguous cache (after), and the native
read kernel over a buffer of twice the cache's bytes are timed in turns, order reversed every
round; medians of --repeats. "% read" is the cache's bytes over the step's time, against the
read kernel's rate of the same rounds.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bench_paged import paged_copy  # noqa: E402


def timed(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir_before")
    p.add_argument("--blocks", default="16,32,64,128,256")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--layouts", default="block-major,head-major")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    sys.path.insert(0, args.dir_before)
    import attnfast_before as before

    rng = np.random.default_rng(0)
    L, d = 16384, 128
    print(f"tier: after {_ext.runtime_info()['isa']}, before {before._ext.runtime_info()['isa']}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    print("| dtype | layout | block | threads | read GB/s | contiguous % read | before % read | "
          "after % read | after speed / before | same bits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, dt in (("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16)):
        k = rng.standard_normal((1, 8, L, d), dtype=np.float32).astype(dt)
        v = rng.standard_normal((1, 8, L, d), dtype=np.float32).astype(dt)
        q = rng.standard_normal((1, 8, 1, d), dtype=np.float32).astype(dt)
        lens = np.array([L], np.int32)
        nbytes = k.nbytes + v.nbytes
        buf = np.ones(2 * nbytes, np.uint8)
        for layout in args.layouts.split(","):
            for bs in [int(x) for x in args.blocks.split(",")]:
                kp, vp, table = paged_copy(rng, k, v, bs, head_major=layout == "head-major", shuffled=True)
                same = np.array_equal(
                    np.asarray(after.attention_with_kvcache(q, kp, vp, lens, block_table=table)).view(np.uint8),
                    np.asarray(before.attention_with_kvcache(q, kp, vp, lens, block_table=table)).view(np.uint8))
                for n in [int(x) for x in args.threads.split(",")]:
                    fns = {
                        "read": (lambda: _ext.read_bytes(buf, n), 1),
                        "contig": (lambda: after.attention_with_kvcache(q, k, v, lens, num_threads=n), 4),
                        "before": (lambda: before.attention_with_kvcache(q, kp, vp, lens, block_table=table,
                                                                         num_threads=n), 4),
                        "after": (lambda: after.attention_with_kvcache(q, kp, vp, lens, block_table=table,
                                                                       num_threads=n), 4),
                    }
                    ts = {key: [] for key in fns}
                    for fn, _ in fns.values():
                        fn()
                    for r in range(args.repeats):
                        for key in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                            ts[key].append(timed(*fns[key]))
                    read = buf.nbytes / statistics.median(ts["read"]) / 1e9
                    pct = {key: 100 * nbytes / statistics.median(ts[key]) / 1e9 / read for key in fns if key != "read"}
                    speed = statistics.median(ts["before"]) / statistics.median(ts["after"])
                    print(f"| {name} | {layout} | {bs} | {n} | {read:.1f} | {pct['contig']:.0f} % | "
                          f"{pct['before']:.0f} % | {pct['after']:.0f} % | {speed:.2f}x | {same} |", flush=True)


if __name__ == "__main__":
    main()
