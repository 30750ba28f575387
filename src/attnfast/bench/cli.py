"""``attnfast bench``: prefill, decode and generation timings, judged against this machine.

One run measures, at each requested thread count:

* the machine's limits (:mod:`attnfast.bench.limits`): memory-read bandwidth and float32 GEMM
  throughput at the same thread count;
* (a) prefill: causal ``attention`` over T tokens, time and GFLOP/s;
* (b) decode: one ``KVCache.step`` (append one token, attend over L keys), time and GB/s, with a
  least-squares line time = slope * L + intercept and its R^2;
* (c) generation: N tokens after a prompt, with the KV cache against recomputing full causal
  attention over the whole sequence for every token (what a model without a cache does).

It prints tables, writes the raw numbers as JSON and, when matplotlib is installed, a PNG of the
per-token cost against the context length. Only the installed package is needed: no repo files.
The rates follow the cost model of :mod:`attnfast.bench.costs`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from .costs import attention_flops, kv_bytes_per_token
from .limits import (MIB, SETTLE_S, available_cpus, blas_description, busy_warning, cpu_flags,
                     cpu_name, last_level_cache_bytes, load_average, measure_gemm,
                     measure_read_bandwidth)
from .options import CACHE_ONLY_DTYPES, KV_DTYPES, parse_dtypes, parse_heads, parse_int_list
from .plot import bench_plot
from .report import bench_report, fmt_len, write_json
from .timing import (DecodeBench, Progress, Threads, activation_dtype, linear_fit, median,
                     random_array, run_generation, time_call)

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``attnfast bench``."""
    cpus = available_cpus()
    default_threads = "1" if cpus == 1 else f"1,{cpus}"
    p = argparse.ArgumentParser(
        prog="attnfast bench",
        description="Time attnfast prefill, KV-cache decode and cached-vs-recompute generation "
                    "on this machine, against its measured memory bandwidth and GEMM throughput.",
        epilog="Lengths accept a k suffix (1k = 1024). Defaults take about 2-4 minutes on 2 cores.")
    p.add_argument("--threads", default=default_threads,
                   help=f"comma list of thread counts (default {default_threads})")
    p.add_argument("--prefill-T", default="256,512,1k,2k,4k,8k",
                   help="prefill lengths T, causal (default 256,512,1k,2k,4k,8k)")
    p.add_argument("--prefill-heads", type=parse_heads, default=(8, 8), metavar="H[/Hkv]",
                   help="heads for the prefill sweep (default 8/8)")
    p.add_argument("--decode-L", default="1k,2k,4k,8k,16k,32k,64k",
                   help="decode context lengths L (default 1k,2k,4k,8k,16k,32k,64k)")
    p.add_argument("--heads", type=parse_heads, default=(32, 8), metavar="H/Hkv",
                   help="query/KV heads for decode and generation (default 32/8, Llama 3 8B)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension D = Dv (default 128)")
    p.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    p.add_argument("--dtype", type=parse_dtypes, default=[np.dtype(np.float32)],
                   help="KV cache dtypes, a comma list of " + ", ".join(KV_DTYPES) + " (default "
                        "float32): decode table and linear fit per dtype (GB/s "
                        "from the bytes read, scales included); prefill, (c) run in the "
                        "first dtype that is not a cache-only one")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated in (c) (default 32)")
    p.add_argument("--prompt", type=int, default=1024,
                   help="prompt length before generating in (c) (default 1024)")
    p.add_argument("--recompute-max-L", default="2k",
                   help="longest context for the recompute-per-token curve (default 2k; it "
                        "costs O(L^2) per point)")
    p.add_argument("--bandwidth-mib", type=int, default=1024,
                   help="buffer for the memory-bandwidth measurement in MiB (default 1024)")
    p.add_argument("--budget", type=float, default=0.5,
                   help="seconds of repeats per measurement (default 0.5; at least 3 repeats)")
    p.add_argument("--out-dir", default=".", help="directory for the PNG and JSON (default .)")
    p.add_argument("--png", default=None,
                   help="plot path (default OUT_DIR/attnfast_bench.png; 'none' to skip)")
    p.add_argument("--json", default=None,
                   help="raw results path (default OUT_DIR/attnfast_bench.json; 'none' to skip)")
    p.add_argument("--quick", action="store_true",
                   help="small shapes for a smoke run (well under a minute); explicit options "
                        "still win")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--seed", type=int, default=0)
    return p


_QUICK = {"prefill_T": "256,512,1k", "decode_L": "1k,4k,16k", "tokens": 8, "prompt": 256,
          "recompute_max_L": "1k", "bandwidth_mib": 256, "budget": 0.2}


def parse_args(argv):
    """Parsed options of ``attnfast bench`` (lists parsed, --quick defaults applied)."""
    parser = build_parser()
    # --quick replaces the defaults only: options given explicitly keep their values.
    if "--quick" in argv:
        parser.set_defaults(**_QUICK)
    args = parser.parse_args(argv)
    try:
        args.threads = parse_int_list(args.threads, "--threads")
        args.prefill_T = parse_int_list(args.prefill_T, "--prefill-T")
        args.decode_L = parse_int_list(args.decode_L, "--decode-L")
        args.recompute_max_L = parse_int_list(args.recompute_max_L, "--recompute-max-L")[0]
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    for name in ("head_dim", "batch", "tokens", "prompt", "bandwidth_mib"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv=None) -> int:
    """Entry point of ``attnfast bench``; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)

    import attnfast as af
    from .. import _runtime

    dtypes = args.dtype
    # prefill, recompute and generation run in the first dtype that is not a cache-only one
    dtype = next((dt for dt in dtypes if dt.name not in CACHE_ONLY_DTYPES), np.dtype(np.float32))
    try:  # a dtype the kernels do not take fails here, with attnfast's own message
        for dt in dtypes:
            tiny = af.KVCache(1, 1, args.head_dim, 2, dtype=dt)
            x = np.zeros((1, 1, 1, args.head_dim), activation_dtype(dt))
            tiny.step(x, x, x)
    except (NotImplementedError, TypeError, ValueError) as e:
        print(f"attnfast bench: --dtype {dt.name} --head-dim {args.head_dim}: {e}",
              file=sys.stderr)
        return 2
    d = dv = args.head_dim
    b = args.batch
    h, hkv = args.heads
    ph, phkv = args.prefill_heads
    rng = np.random.default_rng(args.seed)
    llc = last_level_cache_bytes()
    decode_L = sorted(set(args.decode_L))
    recompute_L = [L for L in decode_L if L <= args.recompute_max_L] or [min(decode_L)]
    threads = args.threads

    load_before = load_average()
    warning = busy_warning(load_before, available_cpus())
    if warning:
        print(warning, file=sys.stderr)
    n_steps = len(threads) * (2 + len(args.prefill_T) + len(dtypes) * len(decode_L)
                              + len(recompute_L) + 1) + len(dtypes)
    progress = Progress(n_steps, enabled=not args.no_progress)
    info = _runtime.config()
    results = {
        "command": "attnfast bench " + " ".join(argv),
        "attnfast": info, "numpy": np.__version__, "blas": blas_description(),
        "cpu": cpu_name(), "cpu_flags": cpu_flags(), "cpus": available_cpus(),
        "last_level_cache_bytes": llc, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average_before": load_before, "busy_warning": warning,
        "dtype": dtype.name, "dtypes": [dt.name for dt in dtypes], "batch": b, "head_dim": d,
        "prefill_heads": [ph, phkv], "heads": [h, hkv],
        "limits": {}, "prefill": [], "decode": [], "decode_fit": {}, "recompute": [],
        "generation": {},
    }

    decodes = {}
    for dt in dtypes:
        progress.step(f"filling a {dt.name} KV cache of {fmt_len(max(decode_L))} tokens")
        decodes[dt.name] = DecodeBench(af, rng, b, h, hkv, d, dt, max(decode_L))
    decode = decodes[dtype.name] if dtype.name in decodes else None

    for n in threads:
        progress.step(f"memory-read bandwidth, {n} thread(s)")
        bw = measure_read_bandwidth(n, args.bandwidth_mib * MIB)
        progress.step(f"GEMM throughput, {n} thread(s)")
        gemm = measure_gemm(n, 1024 if args.quick else 2048)
        results["limits"][n] = {"read_bandwidth": bw, "gemm": gemm}
        time.sleep(SETTLE_S)

        with Threads(n):
            for T in args.prefill_T:
                progress.step(f"prefill T={fmt_len(T)} H={ph}/{phkv}, {n} thread(s)")
                q = random_array(rng, (b, ph, T, d), dtype)
                k = random_array(rng, (b, phkv, T, d), dtype)
                v = random_array(rng, (b, phkv, T, dv), dtype)
                out = np.empty((b, ph, T, dv), dtype)
                times = time_call(lambda: af.attention(q, k, v, causal=True, out=out),
                                  budget=args.budget)
                flops = attention_flops(b, ph, T, T, d, dv, True)
                results["prefill"].append({"threads": n, "T": T, "times_s": times,
                                           "median_s": median(times), "flops": flops,
                                           "gflops": flops / median(times) / 1e9})

            for dt in dtypes:
                for L in decode_L:
                    progress.step(f"decode step {dt.name} L={fmt_len(L)} H={h}/{hkv}, {n} thread(s)")
                    times = decodes[dt.name].step_at(L, args.budget, 5)
                    nbytes = b * L * kv_bytes_per_token(hkv, d, dv, dt)
                    results["decode"].append({"dtype": dt.name, "threads": n, "L": L,
                                              "times_s": times, "median_s": median(times),
                                              "bytes": nbytes, "gbps": nbytes / median(times) / 1e9,
                                              "fits_in_cache": llc is not None and nbytes <= llc})

            for L in recompute_L:
                progress.step(f"recompute causal attention T={fmt_len(L)} H={h}/{hkv}, {n} thread(s)")
                if decode is None:
                    continue
                kc, vc = decode.context(L)
                q = random_array(rng, (b, h, L, d), dtype)
                times = time_call(lambda: af.attention(q, kc, vc, causal=True),
                                  budget=args.budget)
                results["recompute"].append({"threads": n, "L": L, "times_s": times,
                                             "median_s": median(times)})

            progress.step(f"generate {args.tokens} tokens after {args.prompt}, cached vs "
                          f"recompute, {n} thread(s)")
            results["generation"][n] = run_generation(af, rng, b, h, hkv, d, dtype,
                                                      args.prompt, args.tokens)

        for dt in dtypes:
            rows = [r for r in results["decode"] if r["threads"] == n and r["dtype"] == dt.name]
            results["decode_fit"][f"{dt.name}/{n}"] = dict(
                linear_fit([r["L"] for r in rows], [r["median_s"] for r in rows]),
                dtype=dt.name, threads=n)
    progress.finish()
    del decode, decodes

    print(bench_report(results))

    png = args.png if args.png is not None else os.path.join(args.out_dir, "attnfast_bench.png")
    js = args.json if args.json is not None else os.path.join(args.out_dir, "attnfast_bench.json")
    if js.lower() != "none":
        write_json(js, results)
        print(f"\nraw results: {js}")
    if png.lower() != "none":
        written = bench_plot(results, png)
        print(f"plot: {png}" if written else f"plot skipped: {written.reason}")
    return 0


