"""One causal attention step of Tq query tokens against L cached keys (GQA), with the kernel
the planner picks: where the decode path's kernels and the prefill kernel meet (bench/HISTORY.md
27), in one process, against the machine's limits measured in the same run.

    python bench/bench_many_rows.py                          # 32/8 and 8/8 heads, Tq 1..64
    python bench/bench_many_rows.py --tq 16,17 --dtype bfloat16 --repeats 9
    python bench/bench_many_rows.py --dtype float32,bfloat16 --json bench/results/many_rows/<cpu-kind>.json

Each round times every Tq's step and the native read kernel over the step's K and V bytes, in
turns; medians of the rounds. Printed per Tq: the kernel (attnfast.explain), the median time,
the time per query token, the FLOP rate (4 x H x Tq x L x D, the causal part of the last Tq
keys ignored) and the share of the roofline, max(K/V bytes / read rate, FLOPs / multiply-add
peak), the peak from attnfast's native probe for q's dtype (attnfast.bench.limits.measure_peak).
Issue 46's targets: every Tq from 1 to 64 >= 80 % of the roofline, and the time per token never
rising with Tq by more than 5 %. ``--json F`` stores the run for the results page
(attnfast.bench.many_rows_results).
"""
import argparse
import statistics
import time

import ml_dtypes
import numpy as np

import attnfast as af
from attnfast import _ext
from attnfast.bench.limits import measure_peak

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--heads", default="32/8,8/8")
    ap.add_argument("--tq", default="1,2,4,8,16,17,20,32,64")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or both, comma separated")
    ap.add_argument("--threads", default="1", help="thread counts, comma separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None,
                    help="store the run here (bench/results/many_rows/<cpu-kind>.json) for the results page")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    L, D = args.length, args.d
    tqs = [int(x) for x in args.tq.split(",")]
    stored = []
    print(f"L={L} D={D} repeats={args.repeats} (medians); tier {_ext.runtime_info()['isa']}")
    for dtype_name in args.dtype.split(","):
        dtype = DTYPES[dtype_name]
        for threads in (int(x) for x in args.threads.split(",")):
            bf16 = dtype_name == "bfloat16"
            peak = measure_peak(threads, bf16=bf16)
            measured = []  # (layout, h, tq, median, read, kernel)
            for layout in args.heads.split(","):
                h, hkv = (int(x) for x in layout.split("/"))
                k = rng.standard_normal((1, hkv, L, D), np.float32).astype(dtype)
                v = rng.standard_normal((1, hkv, L, D), np.float32).astype(dtype)
                qs = {tq: rng.standard_normal((1, h, tq, D), np.float32).astype(dtype) for tq in tqs}
                kv_bytes = k.nbytes + v.nbytes
                buffer = np.ones(kv_bytes, np.uint8)
                times = {tq: [] for tq in tqs}
                reads = []
                for tq in tqs:  # warm
                    af.attention(qs[tq], k, v, causal=True, num_threads=threads)
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    _ext.read_bytes(buffer, threads)
                    reads.append(kv_bytes / (time.perf_counter() - t0))
                    for tq in tqs:
                        t0 = time.perf_counter()
                        af.attention(qs[tq], k, v, causal=True, num_threads=threads)
                        times[tq].append(time.perf_counter() - t0)
                read = statistics.median(reads)
                for tq in tqs:
                    kernel = af.explain(qs[tq], k, v, causal=True, num_threads=threads)["kernel"]
                    measured.append((layout, h, tq, statistics.median(times[tq]), read, kv_bytes, kernel))
            # The peak again after the timings, the better of the two: a probe that shared its
            # cores with another process reads low, and the limit must not (a kernel above
            # 100 % of it says the limit is wrong).
            peak = max(peak, measure_peak(threads, bf16=bf16))
            print(f"{dtype_name}, {threads} thread(s): multiply-add peak {peak:.0f} GFLOP/s")
            for layout, h, tq, med, read, kv_bytes, kernel in measured:
                flops = 4.0 * h * tq * L * D
                roofline = max(kv_bytes / read, flops / (peak * 1e9))
                print(f"  {layout:5s} Tq={tq:3d} {kernel:13s} {med * 1e3:8.2f} ms {med * 1e3 / tq:7.2f} ms/token "
                      f"{flops / med / 1e9:6.1f} GFLOP/s read {read / 1e9:.1f} GB/s "
                      f"{100 * roofline / med:4.0f} % of roofline", flush=True)
                stored.append(dict(dtype=dtype_name, threads=threads, heads=layout, L=L, D=D, tq=tq,
                                   kernel=kernel, ms=1e3 * med, gflops=flops / med / 1e9,
                                   read_gbs=read / 1e9, peak_gflops=peak, of_roofline=roofline / med))
    if args.json:
        from attnfast.bench.sparse_results import store_part
        store_part(args.json, "many_rows", stored)


if __name__ == "__main__":
    main()
