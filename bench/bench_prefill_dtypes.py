"""Prefill speed of each storage dtype against float32, in one process.

    python bench/bench_prefill_dtypes.py                        # T=1024,4096, H=8, D=128, 1 and 2 threads
    ATTNFAST_ISA=avx2 python bench/bench_prefill_dtypes.py --tokens 2048 --threads 1

Times attention(q, k, v, causal=...) with q, k, v in each dtype (float16, bfloat16, and
float32 q over a bfloat16 / int8 cache), causal and not, against the same call in float32,
as medians of interleaved repeats (float32 and the dtype timed in turns, so a drift of the
machine hits both alike). Prints the median times and the speed ratio float32 time / dtype
time (>= 1: the dtype is as fast or faster), and the same ratio of the fastest repeats
(steadier on a shared machine).
"""
import argparse
import statistics
import time

import ml_dtypes
import numpy as np

import attnfast as af


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1024,4096")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--dtypes", default="bfloat16,float16,f32q-bfloat16,f32q-int8")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with the process's CPU time instead of the wall clock (steadier on a "
                        "shared machine: time spent descheduled is not counted; with several threads "
                        "it sums them, idle waits included)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved pairs per case (median)")
    args = p.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    rng = np.random.default_rng(0)
    cfg = af.show_config()
    print(f"H={args.heads}, D={args.head_dim}; kernel tier {cfg['isa']}; "
          f"{'CPU' if args.cpu_time else 'wall'} time")
    print(f"{'dtype':16s} {'T':>5s} {'causal':>6s} {'threads':>7s} {'float32':>10s} {'dtype':>10s} {'speed':>6s} {'(min)':>6s}")
    for t in [int(x) for x in args.tokens.split(",")]:
        shape = (1, args.heads, t, args.head_dim)
        q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
        for name in args.dtypes.split(","):
            kw = {}
            if name == "f32q-int8":
                scale = np.abs(k).max(-1) / 127, np.abs(v).max(-1) / 127
                kk = np.rint(k / scale[0][..., None]).astype(np.int8)
                vv = np.rint(v / scale[1][..., None]).astype(np.int8)
                args_ = (q, kk, vv)
                # the int8 prefill is reached through attention_with_kvcache (a prompt chunk)
                call = lambda causal, n: af.attention_with_kvcache(
                    q, kk, vv, t, causal=causal, num_threads=n, k_scale=scale[0].astype(np.float32),
                    v_scale=scale[1].astype(np.float32))
            else:
                kv = name.split("-")[-1]
                kvt = np.dtype(ml_dtypes.bfloat16) if kv == "bfloat16" else np.dtype(kv)
                qt = np.float32 if name.startswith("f32q") else kvt
                args_ = (q.astype(qt), k.astype(kvt), v.astype(kvt))
                call = lambda causal, n, a=args_: af.attention(*a, causal=causal, num_threads=n)
            for causal in (True, False):
                for n in [int(x) for x in args.threads.split(",")]:
                    base = lambda: af.attention(q, k, v, causal=causal, num_threads=n)
                    base(); call(causal, n)  # warm up
                    tb, td = [], []
                    for _ in range(args.repeats):
                        t0 = clock(); base(); tb.append(clock() - t0)
                        t0 = clock(); call(causal, n); td.append(clock() - t0)
                    mb, md = statistics.median(tb), statistics.median(td)
                    print(f"{name:16s} {t:5d} {str(causal):>6s} {n:7d} {mb * 1e3:8.1f}ms {md * 1e3:8.1f}ms {mb / md:5.2f}x {min(tb) / min(td):5.2f}x",
                          flush=True)


if __name__ == "__main__":
    main()
