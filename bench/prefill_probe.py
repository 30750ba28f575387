"""Prefill throughput probe: attnfast GFLOP/s next to the machine's float32 GEMM throughput.

Self-contained (uses no other bench/ module). For each thread count it prints the NumPy
float32 n x n GEMM throughput, then attnfast per shape: median time, useful GFLOP/s and its
percentage of the GEMM figure (optionally PyTorch SDPA's time and the speed-up over it).

    python bench/prefill_probe.py                      # T in {1024, 4096}, D in {64, 128}, 1 and 2 threads
    python bench/prefill_probe.py --T 1024 --D 128 --threads 1 --isa avx2
    python bench/prefill_probe.py --torch              # also PyTorch SDPA, if installed

Useful FLOPs = 2 * B * H * Tq * Tk * (D + Dv), halved when causal (Tq == Tk). Times are
medians of --reps calls after one warm-up.

GEMM reference: OpenBLAS picks its kernel from the CPU (or from OPENBLAS_CORETYPE, read once
at load), and on some CPUs another of its kernels is faster (on AMD Zen 4 its AVX2 "Haswell"
kernel beats its AVX-512 "SkylakeX" one). So the GEMM is timed in a subprocess per core type
(the inherited environment, plus Haswell on x86-64) and the best is the reference. The
subprocess also keeps OpenBLAS's worker threads, which busy-wait for a while after each call,
from stealing cores from the attention timings in this process.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

_GEMM_CODE = r"""
import json, statistics, sys, time
import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits
threads, n, reps = map(int, sys.argv[1:4])
rng = np.random.default_rng(0)
a = rng.standard_normal((n, n), dtype=np.float32)
b = rng.standard_normal((n, n), dtype=np.float32)
with threadpool_limits(limits=threads, user_api="blas"):
    a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
arch = sorted({str(i.get("architecture")) for i in threadpool_info() if i.get("user_api") == "blas"})
print(json.dumps({"gflops": 2.0 * n ** 3 / statistics.median(times) / 1e9, "arch": ",".join(arch)}))
"""


def median_seconds(fn, reps: int) -> float:
    """Median wall time of `reps` calls of fn after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_gflops(threads: int, n: int, reps: int) -> tuple[float, list[str]]:
    """Best median float32 GEMM GFLOP/s over OpenBLAS core types, and one note per type."""
    variants = [None]
    if platform.machine().lower() in ("x86_64", "amd64"):
        variants.append("Haswell")
    best, notes = 0.0, []
    for coretype in variants:
        env = dict(os.environ)
        if coretype is not None:
            env["OPENBLAS_CORETYPE"] = coretype
        res = subprocess.run([sys.executable, "-c", _GEMM_CODE, str(threads), str(n), str(reps)],
                             env=env, capture_output=True, text=True)
        label = f"OPENBLAS_CORETYPE={env.get('OPENBLAS_CORETYPE', '(unset)')}"
        if res.returncode != 0:
            notes.append(f"{label}: failed ({res.stderr.strip().splitlines()[-1:]})")
            continue
        r = json.loads(res.stdout)
        notes.append(f"{label}: {r['gflops']:.1f} GFLOP/s (OpenBLAS kernel {r['arch']})")
        best = max(best, r["gflops"])
    return best, notes


def prefill_flops(b, h, tq, tk, d, dv, causal):
    flops = 2.0 * b * h * tq * tk * (d + dv)
    return flops / 2 if causal else flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, nargs="+", default=[1024, 4096], help="sequence lengths (Tq = Tk)")
    ap.add_argument("--D", type=int, nargs="+", default=[64, 128], help="head dims (D = Dv)")
    ap.add_argument("--H", type=int, default=8, help="query heads")
    ap.add_argument("--Hkv", type=int, default=None, help="KV heads (GQA); default H")
    ap.add_argument("--B", type=int, default=1, help="batch")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per shape (median)")
    ap.add_argument("--gemm-n", type=int, default=4096)
    ap.add_argument("--isa", default="", help="force a kernel tier (generic, avx2, avx512)")
    ap.add_argument("--torch", action="store_true", help="also time torch SDPA (if installed)")
    args = ap.parse_args()

    import attnfast as af
    from attnfast import _ext
    from attnfast._runtime import config

    if args.isa:
        _ext.force_isa(args.isa)
    torch = None
    if args.torch:
        try:
            import torch
        except ImportError:
            print("torch not installed: skipping SDPA")
    info = config()
    print(f"attnfast {info['version']}, kernel tier {info['isa']}, python {platform.python_version()}, "
          f"numpy {np.__version__}" + (f", torch {torch.__version__}" if torch else ""))
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    hkv = args.Hkv or args.H
    rng = np.random.default_rng(1)
    for threads in args.threads:
        gemm, notes = gemm_gflops(threads, args.gemm_n, max(3, args.reps))
        print(f"\nthreads={threads}: float32 GEMM {args.gemm_n}^3, best {gemm:.1f} GFLOP/s  ["
              + "; ".join(notes) + "]")
        print(f"{'B':>3} {'H':>3} {'Hkv':>3} {'T':>6} {'D':>4} {'causal':>6} {'ms':>9} {'GFLOP/s':>8} "
              f"{'%GEMM':>6}" + (f" {'torch ms':>9} {'vs torch':>8}" if torch else ""))
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
                    gf = prefill_flops(args.B, args.H, t, t, d, d, causal) / sec / 1e9
                    line = (f"{args.B:>3} {args.H:>3} {hkv:>3} {t:>6} {d:>4} {str(causal):>6} "
                            f"{sec * 1e3:>9.2f} {gf:>8.1f} {100 * gf / gemm:>5.0f}%")
                    if torch:
                        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
                        kw = {"enable_gqa": True} if hkv != args.H else {}
                        with torch.inference_mode():
                            ts = median_seconds(lambda: torch.nn.functional.scaled_dot_product_attention(
                                tq, tk, tv, is_causal=causal, **kw), args.reps)
                        line += f" {ts * 1e3:>9.2f} {ts / sec:>7.2f}x"
                    print(line, flush=True)


if __name__ == "__main__":
    main()
