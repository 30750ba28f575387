"""attnfast against other CPU attention implementations, in ONE process, same inputs, same threads.

    python bench/compare_peers.py                      # all shapes, 1 and 2 threads
    python bench/compare_peers.py --quick              # a smoke run
    python bench/compare_peers.py --markdown bench/out/peers.md --json bench/out/peers.json
    python bench/compare_peers.py --dtype float32,bfloat16,float16   # 16-bit rows in the same run
    python bench/compare_peers.py --json bench/results/KIND.json   # a run for docs/results.md

The engines and how each one is run (float32 and 16-bit): bench/peers.py. The timing, machine
limits, tables and JSON are attnfast.bench's, the same pieces ``attnfast bench`` uses.

The engines of one cell (shape, dtype, thread count) are all prepared, then timed in turns:
``--rounds`` rounds (default 4), each engine ``--budget / --rounds`` seconds a turn, the order
rotated every round, so a machine that slows down for a minute (this one's second core comes
and goes) slows every engine of the cell alike; the ratios compare times of the same minutes.

Every output is checked against an independent float64 reference on a sample of query rows
(bench_common.py). The machine's limits are measured in the same run at each thread count,
before and again after that count's engines, each source at its better reading (a shared
machine can slow down for minutes): memory-read bandwidth (attnfast.bench.limits.measure_read_bandwidth:
the best of a threaded NumPy sum, threaded BLAS dot and attnfast's native read kernel over
1 GiB, each the best of its repeats) and float32 GEMM throughput (the best of NumPy's BLAS and
torch.mm on 2048^3). Prefill GFLOP/s counts useful FLOPs (half the square when causal);
decode GB/s counts each K/V byte once: B * Hkv * L * (D + Dv) * 4.

16-bit rows (``--dtype``, a comma list of float32 (default), bfloat16, float16): the same
float32 random inputs, rounded once (untimed) to the dtype, go to every peer, and each output is
checked against the float64 reference of those SAME rounded inputs with a per-dtype tolerance
(peers.TOLERANCES: the output itself is rounded to 16 bits, and attnfast's bfloat16 kernel rounds
P to bfloat16 for vdpbf16ps). A peer that misses it is reported "wrong", never accepted.

16-bit limits: the GEMM limit of a 16-bit dtype is the best of torch.mm on (gemm_n)^2 tensors of
that dtype and the float32 GEMM (converting tiles to float32 is always available, so no 16-bit
row is held to a bar below float32's); the limits table shows each source. Decode GB/s counts
the bytes of the stored dtype: B * Hkv * L * (D + Dv) * itemsize (2 for 16-bit).

If OPENBLAS_CORETYPE is set (it is on some machines here, for old OpenBLAS builds) NumPy's GEMM
can be slower than the CPU allows; run with `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE`.

To judge a lower attnfast tier (ATTNFAST_ISA=avx2) on a CPU that has more, hold the peers and
the GEMM limit to the same ISA in the environment: PyTorch's own kernels
ATEN_CPU_CAPABILITY=avx2, its MKL GEMM (and torch.mm, a GEMM-limit candidate)
MKL_ENABLE_INSTRUCTIONS=AVX2 (without it SDPA's blocks and torch.mm run AVX-512),
oneDNN (PyTorch, OpenVINO) ONEDNN_MAX_CPU_ISA=AVX2, NumPy's OpenBLAS OPENBLAS_CORETYPE=Haswell
(with OPENBLAS_L2_SIZE unset). The report's metadata records these variables.
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time

import numpy as np

import attnfast as af
from attnfast.bench import limits as lim
from attnfast.bench.options import parse_dtype, parse_heads, parse_int_list
from attnfast.bench.peer_report import PeerReport
from attnfast.bench.report import write_json
from attnfast.bench.timing import Progress, median, time_call

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import max_abs_error, sample_rows  # noqa: E402
from peers import (DTYPES, ENGINES, TOLERANCE, TOLERANCES, AttnfastEngine, Case,  # noqa: E402,F401
                   NoKernel, parse_dtype_list)

# Re-exported for callers of this script's module (tests): the limits are attnfast.bench's.
best_limits, limits_from, measure_limits = lim.best_limits, lim.limits_from, lim.measure_limits


def source_commit() -> str | None:
    """The commit of the checkout this script runs from (``+dirty`` with local changes)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("+dirty" if dirty else "")) or None


def interleaved_times(calls, *, rounds, budget, min_repeats, settle):
    """Wall times of each named call, the calls timed in turns.

    ``rounds`` rounds; in each, every call runs for ``budget / rounds`` seconds (at least one
    call; ``min_repeats`` calls over all rounds), the order rotated from round to round, after
    a pause of ``settle`` seconds so the previous engine's idle thread pool stops spinning
    (OpenBLAS and OpenMP pools busy-wait for a while; measured: torch at 2 threads runs at 60 %
    right after a NumPy GEMM). Each call's first turn starts with an untimed warm-up call.

    Returns a list, per call: its seconds, or the exception its call raised (it is not called
    again).
    """
    per_round = -(-min_repeats // rounds)
    times = [[] for _ in calls]
    for r in range(rounds):
        shift = r % len(calls) if calls else 0
        for i in list(range(shift, len(calls))) + list(range(shift)):
            if isinstance(times[i], Exception):
                continue
            time.sleep(settle)
            try:
                times[i] += time_call(calls[i][1], budget=budget / rounds, min_repeats=per_round,
                                      warmup=1 if r == 0 else 0)
            except Exception as exc:  # reported with the engine, not fatal for the others
                times[i] = exc
    return times


def build_parser():
    """The argument parser of compare_peers.py."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Lengths accept a k suffix (1k = 1024).")
    p.add_argument("--threads", default="1,2", help="comma list (default 1,2)")
    p.add_argument("--prefill-T", default="256,1k,4k,8k", help="default 256,1k,4k,8k")
    p.add_argument("--prefill-D", default="64,128", help="default 64,128")
    p.add_argument("--prefill-heads", type=int, default=8, help="default 8")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--decode-L", default="1k,4k,16k,64k", help="default 1k,4k,16k,64k")
    p.add_argument("--decode-heads", default="32/8,8/8", help="comma list of H/Hkv (default 32/8,8/8)")
    p.add_argument("--decode-D", type=int, default=128, help="default 128")
    p.add_argument("--peers", default="torch,torch-fold,openvino,onnxruntime,numpy",
                   help="comma list of peers to run (default: all installed)")
    p.add_argument("--dtype", type=parse_dtype_list, default=["float32"],
                   help="comma list of float32 (default), bfloat16, float16: one set of rows "
                        "per dtype, on the same (rounded) inputs")
    p.add_argument("--skip", default="", help="'prefill' or 'decode' to run only the other half")
    p.add_argument("--budget", type=float, default=1.0,
                   help="seconds of repeats per engine and cell (default 1.0; at least --min-repeats)")
    p.add_argument("--rounds", type=int, default=4,
                   help="the engines of a cell take turns this many times, each with budget / rounds "
                        "seconds (default 4; 1: one engine after the other)")
    p.add_argument("--min-repeats", type=int, default=3)
    p.add_argument("--settle", type=float, default=0.3,
                   help="seconds of pause before each turn, so other thread pools go idle "
                        "(default 0.3)")
    p.add_argument("--bandwidth-mib", type=int, default=1024)
    p.add_argument("--gemm-n", type=int, default=2048)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: T 256,1k; D 128; L 1k,16k; budget 0.2 s (explicit options win)")
    p.add_argument("--markdown", metavar="FILE", help="also write the report as markdown")
    p.add_argument("--json", metavar="FILE", help="also write raw results as JSON")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p


QUICK = {"prefill_T": "256,1k", "prefill_D": "128", "decode_L": "1k,16k", "budget": 0.2,
         "bandwidth_mib": 256, "gemm_n": 1024}


def make_cases(args) -> list[Case]:
    """The shapes the options ask for: prefill (per D, T and mask), then decode (per heads, L)."""
    cases = []
    if "prefill" not in args.skip:
        causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
        for d in parse_int_list(args.prefill_D, "--prefill-D"):
            for T in parse_int_list(args.prefill_T, "--prefill-T"):
                for causal in causals:
                    h = args.prefill_heads
                    cases.append(Case("prefill", 1, h, h, T, T, d, d, causal))
    if "decode" not in args.skip:
        for heads in args.decode_heads.split(","):
            h, hkv = parse_heads(heads.strip())
            for L in parse_int_list(args.decode_L, "--decode-L"):
                cases.append(Case("decode", 1, h, hkv, 1, L, args.decode_D, args.decode_D, False))
    return cases


def main(argv=None) -> int:
    """Run the comparison; 1 if an attnfast output missed its tolerance, else 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if "--quick" in argv:
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    threads_list = parse_int_list(args.threads, "--threads")
    cases = make_cases(args)
    wanted = {"attnfast"} | {p.strip() for p in args.peers.split(",") if p.strip()}
    engines, skipped = [], {}
    for e in ENGINES:
        if e.name not in wanted:
            continue
        why = e.available()
        if why:
            skipped[e.name] = why
        else:
            engines.append(e)
    names = [e.name for e in engines]
    have_torch = "torch" in names or "torch-fold" in names
    dtypes = args.dtype
    if any(d != "float32" for d in dtypes):
        try:
            import ml_dtypes  # noqa: F401
        except ImportError:
            if "bfloat16" in dtypes:
                parser.error("--dtype bfloat16 needs ml_dtypes (pip install ml_dtypes)")
    # (engine, dtype) pairs an engine cannot run at all, with the reason
    def dtype_skip(engine, dtype):  # an engine without dtype_skip runs float32 only
        ask = getattr(engine, "dtype_skip", None)
        if ask is None:
            return None if dtype == "float32" else "not wired for 16-bit inputs"
        return ask(dtype)

    dtype_skipped = {e.name: {d: dtype_skip(e, d) for d in dtypes if dtype_skip(e, d)}
                     for e in engines}
    dtype_skipped = {k: v for k, v in dtype_skipped.items() if v}

    load_before = lim.load_average()
    warning = lim.busy_warning(load_before, lim.available_cpus())
    if warning:
        print(warning, file=sys.stderr)
    meta = {
        "load_average_before": load_before, "busy_warning": warning,
        "command": "python bench/compare_peers.py " + " ".join(argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": source_commit(), "attnfast_isa": af._runtime.config()["isa"],
        "cpu": lim.cpu_name(), "cpu_flags": lim.cpu_flags(), "cpus": lim.available_cpus(),
        "last_level_cache_mib": (lim.last_level_cache_bytes() or 0) // lim.MIB,
        "blas": lim.blas_description(),
        "versions": {e.name: e.version() for e in engines},
        "attnfast_16bit": af._runtime.config().get("lowp_instructions"),
        "skipped": skipped,
        "dtypes": dtypes,
        "tolerances": {d: TOLERANCES[d] for d in dtypes},
        "dtype_skipped": dtype_skipped,
        "isa_env": {k: os.environ.get(k) for k in (
            "ATTNFAST_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
            "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if os.environ.get(k) is not None},
    }
    if os.environ.get("OPENBLAS_CORETYPE"):
        print("warning: OPENBLAS_CORETYPE is set; NumPy's GEMM (a machine-limit candidate and the "
              "numpy peer) may be slower than this CPU allows. For the record run: "
              "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/compare_peers.py ...",
              file=sys.stderr)

    def runs(engine, case, dtype):
        return (getattr(engine, "applies", lambda _: True)(case)
                and dtype not in dtype_skipped.get(engine.name, {}))

    steps = len(threads_list) * (2 + sum(
        1 for c in cases for d in dtypes for e in engines if runs(e, c, d)))
    progress = Progress(steps, enabled=not args.no_progress)
    rng = np.random.default_rng(args.seed)
    limits, results = {}, []
    for n in threads_list:
        progress.step(f"machine limits, {n} thread(s)")
        time.sleep(args.settle)
        limits[n] = lim.measure_limits(n, args.bandwidth_mib * lim.MIB, args.gemm_n, have_torch,
                                   args.settle, dtypes)
        for case in cases:
            q32 = rng.standard_normal((case.b, case.h, case.tq, case.d), dtype=np.float32)
            k32 = rng.standard_normal((case.b, case.hkv, case.tk, case.d), dtype=np.float32)
            v32 = rng.standard_normal((case.b, case.hkv, case.tk, case.dv), dtype=np.float32)
            rows = sample_rows(case.tq)
            for dtype in dtypes:
                # the same inputs rounded once to the dtype (untimed); the reference uses these
                ndt = parse_dtype(dtype)
                q, k, v = ((q32, k32, v32) if dtype == "float32"
                           else tuple(a.astype(ndt) for a in (q32, k32, v32)))
                tolerance = TOLERANCES[dtype]
                tag = "" if dtypes == ["float32"] else f" {dtype}"
                # Every engine of the cell is prepared first, then timed in turns (A B C A B C
                # ...), so a machine that slows down for a minute slows every engine alike.
                timed = []  # (entry, run, output) of the engines that prepared
                for engine in engines:
                    if not runs(engine, case, dtype):
                        continue
                    progress.step(f"{case.kind} {case.label}{tag}, {engine.name}, {n} thread(s)")
                    entry = {"kind": case.kind, "case": case.label, "threads": n,
                             "engine": engine.name, "shape": case.__dict__.copy(),
                             "work": case.work_for(ndt.itemsize), "dtype": dtype}
                    results.append(entry)
                    engine.note = None
                    try:
                        run, output = engine.prepare(case, (q, k, v), n)
                        if engine.note:
                            entry["note"] = engine.note
                        timed.append((entry, run, output))
                    except NoKernel as exc:  # the peer itself says it has no kernel for the dtype
                        entry.update(skipped=str(exc)[:200])
                    except Exception as exc:  # a peer that cannot run a shape is reported, not fatal
                        entry.update(error=f"{type(exc).__name__}: {exc}"[:200])
                min_repeats = args.min_repeats if case.kind == "prefill" else max(args.min_repeats, 5)
                times = interleaved_times([(e["engine"], run) for e, run, _ in timed],
                                          rounds=args.rounds, budget=args.budget,
                                          min_repeats=min_repeats, settle=args.settle)
                for (entry, run, output), ts in zip(timed, times):
                    if isinstance(ts, Exception):
                        entry.update(error=f"{type(ts).__name__}: {ts}"[:200])
                        continue
                    try:
                        err = max_abs_error(output(), q, k, v, causal=case.causal, rows=rows)
                    except Exception as exc:
                        entry.update(error=f"{type(exc).__name__}: {exc}"[:200])
                        continue
                    entry.update(times_s=ts, median_s=median(ts), rounds=args.rounds,
                                 rate=entry["work"] / median(ts) / 1e9,
                                 max_abs_error=err, ok=bool(err <= tolerance))
                timed = times = run = output = None
        # Measured again after this thread count's engines: each source at its better reading.
        progress.step(f"machine limits again, {n} thread(s)")
        time.sleep(args.settle)
        limits[n] = lim.best_limits(limits[n], lim.measure_limits(n, args.bandwidth_mib * lim.MIB, args.gemm_n,
                                                          have_torch, args.settle, dtypes))
    progress.finish()

    report = PeerReport(meta, limits, results, names)
    print(report.render(markdown=False))
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(report.render(markdown=True) + "\n")
        print(f"\nmarkdown: {args.markdown}")
    if args.json:
        write_json(args.json, {"meta": meta, "limits": limits, "results": results})
        print(f"json: {args.json}")
    failed = [r for r in results if r.get("engine") == "attnfast" and not r.get("ok")]
    return 1 if failed else 0



if __name__ == "__main__":
    sys.exit(main())
