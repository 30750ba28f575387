"""One causal attention step of Tq query tokens against L cached keys (GQA), with the kernel
the planner picks: where the decode path's kernels and the prefill kernel meet (bench/HISTORY.md
27), in one process.

    python bench/bench_many_rows.py                          # 32/8 and 8/8 heads, Tq 2..64
    python bench/bench_many_rows.py --tq 16,17 --dtype bfloat16 --repeats 9

Prints per Tq the kernel (attnfast.explain), the median time, the time per query token and
the FLOP rate (4 x H x Tq x L x D, the causal part of the last Tq keys ignored).
"""
import argparse
import time

import ml_dtypes
import numpy as np

import attnfast as af


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--heads", default="32/8,8/8")
    ap.add_argument("--tq", default="2,4,8,16,17,20,32,64")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dtype = np.float32 if args.dtype == "float32" else ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    L, D = args.length, args.d
    print(f"L={L} D={D} {args.dtype} threads={args.threads} repeats={args.repeats} (medians); "
          f"tier {af._ext.runtime_info()['isa']}")
    for layout in args.heads.split(","):
        h, hkv = (int(x) for x in layout.split("/"))
        k = rng.standard_normal((1, hkv, L, D), np.float32).astype(dtype)
        v = rng.standard_normal((1, hkv, L, D), np.float32).astype(dtype)
        for tq in (int(x) for x in args.tq.split(",")):
            q = rng.standard_normal((1, h, tq, D), np.float32).astype(dtype)
            af.attention(q, k, v, causal=True, num_threads=args.threads)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                af.attention(q, k, v, causal=True, num_threads=args.threads)
                times.append(time.perf_counter() - t0)
            med = float(np.median(times))
            kernel = af.explain(q, k, v, causal=True)["kernel"]
            print(f"{layout:5s} Tq={tq:3d} {kernel:13s} {med * 1e3:8.2f} ms {med * 1e3 / tq:7.2f} ms/token "
                  f"{4.0 * h * tq * L * D / med / 1e9:6.1f} GFLOP/s", flush=True)


if __name__ == "__main__":
    main()
