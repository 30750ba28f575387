"""Prefill throughput probe: attnfast GFLOP/s next to NumPy float32 GEMM at the same threads.

Self-contained (no other bench/ module). Useful FLOPs = 2 * B * H * Tq * Tk * (D + Dv), halved
when causal (Tq == Tk). Each figure is the median of --reps timed calls after one warm-up.

    python bench/prefill_probe.py                    # T in {1024, 4096}, D in {64, 128}, 1 and 2 threads
    python bench/prefill_probe.py --T 1024 --D 128 --threads 1 --isa avx2
    python bench/prefill_probe.py --torch            # also time torch SDPA if installed

OPENBLAS_CORETYPE, when set, can pin OpenBLAS to a slower kernel; the GEMM line says which
OpenBLAS core type is in use (threadpoolctl) so that the comparison is honest.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def median_seconds(fn, reps: int) -> float:
    fn()  # warm-up: page faults, thread pool start
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_gflops(threads: int, n: int, reps: int) -> tuple[float, str]:
    """Median float32 n x n GEMM GFLOP/s with OpenBLAS limited to `threads`."""
    from threadpoolctl import threadpool_info, threadpool_limits

    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    with threadpool_limits(limits=threads, user_api="blas"):
        sec = median_seconds(lambda: a @ b, reps)
    cores = ",".join(sorted({str(i.get("architecture")) for i in threadpool_info()
                             if i.get("user_api") == "blas"}))
    return 2.0 * n**3 / sec / 1e9, cores


def prefill_flops(b, h, t, d, dv, causal):
    flops = 2.0 * b * h * t * t * (d + dv)
    return flops / 2 if causal else flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--D", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--Hkv", type=int, default=None, help="KV heads (GQA); default H")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gemm-n", type=int, default=4096)
    ap.add_argument("--isa", default="", help="force a kernel tier (generic, avx2, avx512)")
    ap.add_argument("--torch", action="store_true", help="also time torch SDPA (if installed)")
    args = ap.parse_args()

    import attnfast as af
    from attnfast import _ext

    if args.isa:
        _ext.force_isa(args.isa)
    torch = None
    if args.torch:
        try:
            import torch  # noqa: F811
        except ImportError:
            print("torch not installed: skipping SDPA")
    from attnfast._runtime import config

    info = config()
    print(f"attnfast {info['version']} tier={info['isa']} OPENBLAS_CORETYPE="
          f"{os.environ.get('OPENBLAS_CORETYPE')!r}")
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    hkv = args.Hkv or args.H
    rng = np.random.default_rng(1)
    for threads in args.threads:
        g, core = gemm_gflops(threads, args.gemm_n, max(3, args.reps // 2))
        print(f"\nthreads={threads}: numpy float32 GEMM {args.gemm_n}^3 = {g:.1f} GFLOP/s (OpenBLAS {core})")
        print(f"{'T':>6} {'D':>4} {'causal':>6} {'ms':>9} {'GFLOP/s':>8} {'%GEMM':>6}"
              + (f" {'torch ms':>9} {'x torch':>7}" if torch else ""))
        if torch:
            torch.set_num_threads(threads)
        for t in args.T:
            for d in args.D:
                q = rng.standard_normal((args.B, args.H, t, d), dtype=np.float32)
                k = rng.standard_normal((args.B, hkv, t, d), dtype=np.float32)
                v = rng.standard_normal((args.B, hkv, t, d), dtype=np.float32)
                out = np.empty_like(q)
                for causal in causals:
                    sec = median_seconds(lambda: af.attention(q, k, v, causal=causal, out=out,
                                                              num_threads=threads), args.reps)
                    gf = prefill_flops(args.B, args.H, t, d, d, causal) / sec / 1e9
                    line = f"{t:>6} {d:>4} {str(causal):>6} {sec * 1e3:>9.2f} {gf:>8.1f} {100 * gf / g:>5.0f}%"
                    if torch:
                        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
                        kw = {"enable_gqa": True} if hkv != args.H else {}
                        ts = median_seconds(lambda: torch.nn.functional.scaled_dot_product_attention(
                            tq, tk, tv, is_causal=causal, **kw), args.reps)
                        line += f" {ts * 1e3:>9.2f} {ts / sec:>6.2f}x"
                    print(line, flush=True)


if __name__ == "__main__":
    main()
