"""Cost of each model option against plain causal prefill, in one process.

    python bench/bench_options.py                       # T=4096, H=8, D=128, float32, 1 and 2 threads
    python bench/bench_options.py --threads 1 --tokens 2048

Times attention(q, k, v, causal=True, **option) for each option alone (softcap, ALiBi, sinks,
a boolean (B, 1, Tq, Tk) mask, an additive float32 mask) and all together, against the same
call without options, as medians of interleaved repeats (plain and option timed in turns, so
a drift of the machine hits both alike). Prints the ratio option / plain per thread count.
"""
import argparse
import statistics
import time

import numpy as np

import attnfast as af


def options(rng, b, h, t):
    """The options measured, each built once (their construction is not timed)."""
    return {
        "softcap=30": dict(softcap=30.0),
        "alibi_slopes (H,)": dict(alibi_slopes=(2.0 ** -np.arange(1, h + 1)).astype(np.float32)),
        "sinks (H,)": dict(sinks=rng.standard_normal(h).astype(np.float32)),
        "bool mask (B,1,T,T)": dict(mask=rng.random((b, 1, t, t)) < 0.9),
        "float32 mask (B,1,T,T)": dict(mask=np.where(rng.random((b, 1, t, t)) < 0.9, 0.0,
                                                     -np.inf).astype(np.float32)),
        "all four (bool mask)": dict(softcap=30.0,
                                     alibi_slopes=(2.0 ** -np.arange(1, h + 1)).astype(np.float32),
                                     sinks=rng.standard_normal(h).astype(np.float32),
                                     mask=rng.random((b, 1, t, t)) < 0.9),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with the process's CPU time instead of the wall clock (steadier on a "
                        "shared machine: time spent descheduled is not counted; with several threads "
                        "it sums them, idle waits included)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved pairs per option (median)")
    args = p.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    rng = np.random.default_rng(0)
    b, h, t, d = 1, args.heads, args.tokens, args.head_dim
    q, k, v = (rng.standard_normal((b, h, t, d)).astype(np.float32) for _ in range(3))
    out = np.empty_like(q)
    opts = options(rng, b, h, t)
    cfg = af.show_config()
    print(f"T={t}, H={h}, D={d}, float32, causal; kernel tier {cfg['isa']}; "
          f"{'CPU' if args.cpu_time else 'wall'} time")
    print(f"{'option':26s} {'threads':>7s} {'plain':>10s} {'option':>10s} {'ratio':>7s}")
    for n in [int(x) for x in args.threads.split(",")]:
        af.attention(q, k, v, causal=True, out=out, num_threads=n)  # warm up
        for name, kw in opts.items():
            plain, timed = [], []
            af.attention(q, k, v, causal=True, out=out, num_threads=n, **kw)
            for _ in range(args.repeats):
                t0 = clock()
                af.attention(q, k, v, causal=True, out=out, num_threads=n)
                plain.append(clock() - t0)
                t0 = clock()
                af.attention(q, k, v, causal=True, out=out, num_threads=n, **kw)
                timed.append(clock() - t0)
            mp, mo = statistics.median(plain), statistics.median(timed)
            print(f"{name:26s} {n:7d} {mp * 1e3:8.1f}ms {mo * 1e3:8.1f}ms {mo / mp:6.2f}x")


if __name__ == "__main__":
    main()
