"""Tables, number formats and JSON for the benchmarks, and the report of ``attnfast bench``."""
from __future__ import annotations

import json
import os

import numpy as np

from .costs import kv_bytes_per_token
from .limits import MIB
from .options import parse_dtype

__all__ = ["table", "fmt_time", "fmt_len", "write_json", "bench_report"]


def table(headers, rows, markdown: bool = False) -> str:
    """A table as text (aligned columns, rendered by tabulate) or as GitHub markdown.

    Cells are printed as given (already formatted strings). Markdown is always plain pipes,
    so a page generated from the same runs is the same bytes with or without tabulate; text
    is aligned by tabulate (first column left, the others right) where it is installed (the
    ``bench`` extra installs it), else written as the same pipes.

    Parameters
    ----------
    headers : sequence of str
    rows : sequence of sequences
    markdown : bool
        GitHub markdown instead of plain text.

    Returns
    -------
    str
    """
    rows = [[str(c) for c in r] for r in rows]
    if markdown:
        return _pipe_table(headers, rows)
    try:
        from tabulate import tabulate
    except ImportError:
        return _pipe_table(headers, rows)
    align = ["left"] + ["right"] * (len(headers) - 1)
    return tabulate(rows, headers=list(headers), tablefmt="simple", disable_numparse=True,
                    colalign=align)


def _pipe_table(headers, rows) -> str:
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def fmt_time(seconds: float) -> str:
    """Seconds as a short string in the most readable unit (s, ms or us)."""
    if seconds >= 1.0:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def fmt_len(n: int) -> str:
    """A token count, in k (1024) when it is a multiple of 1024: 4096 -> '4k'."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _json_default(obj):
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    return str(obj)


def write_json(path: str, data) -> None:
    """Write ``data`` as indented JSON (NumPy scalars as numbers), creating the directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=_json_default)
        f.write("\n")


def bench_report(results: dict) -> str:
    """The text tables ``attnfast bench`` prints at the end of a run, from its results dict."""
    out = []
    info = results["attnfast"]
    out.append(f"attnfast {info['version']}  kernel tier {info['isa']}  OpenMP {info['openmp_runtime']}")
    out.append(f"CPU: {results['cpu']} ({results['cpus']} CPUs available)"
               + (f", last-level cache {results['last_level_cache_bytes'] // MIB} MiB"
                  if results["last_level_cache_bytes"] else ""))
    out.append(f"numpy {results['numpy']}, BLAS: {results['blas']}")
    out.append(f"dtype {results['dtype']}, batch {results['batch']}, D = Dv = {results['head_dim']}; "
               f"times are medians of repeats")
    out.append(f"command: {results['command']}")
    if results.get("busy_warning"):
        out.append(results["busy_warning"])

    out.append("\nMachine limits (same thread counts as attnfast)")
    rows = []
    for n, lim in results["limits"].items():
        bw = lim["read_bandwidth"]
        detail = ", ".join(f"{k} {v:.1f}" for k, v in bw["kernels"].items())
        gemm = lim["gemm"]
        rows.append([n, f"{bw['gbps']:.1f}", f"{bw['kernel']} ({detail})",
                     f"{gemm['gflops']:.1f}" if gemm else "n/a (no threadpoolctl)"])
    out.append(table(["threads", "read GB/s", "best read kernel (GB/s each)", "GEMM GFLOP/s"], rows))

    ph, phkv = results["prefill_heads"]
    out.append(f"\n(a) Prefill, causal, H={ph}/{phkv}: GFLOP/s counts useful FLOPs "
               f"2*B*H*(D+Dv)*T*(T+1)/2")
    rows = []
    for r in results["prefill"]:
        gemm = results["limits"][r["threads"]]["gemm"]
        rows.append([fmt_len(r["T"]), r["threads"], fmt_time(r["median_s"]), f"{r['gflops']:.1f}",
                     f"{100 * r['gflops'] / gemm['gflops']:.0f}%" if gemm else "n/a"])
    out.append(table(["T", "threads", "time", "GFLOP/s", "% of GEMM"], rows))

    h, hkv = results["heads"]
    out.append(f"\n(b) Decode step (KVCache.step: append 1 token, attend over L keys), H={h}/{hkv}: "
               f"bytes = B*Hkv*L*(D+Dv)*itemsize (+ 8 bytes of scales per token and KV head for int8)")
    rows = []
    first = {}  # (threads, L) -> the first dtype's time, for the speed-up column
    for r in results["decode"]:
        first.setdefault((r["threads"], r["L"]), r["median_s"])
    for r in results["decode"]:
        bw = results["limits"][r["threads"]]["read_bandwidth"]["gbps"]
        flag = " *" if r["fits_in_cache"] else ""
        rows.append([r["dtype"], fmt_len(r["L"]), r["threads"], fmt_time(r["median_s"]),
                     f"{r['gbps']:.1f}", f"{100 * r['gbps'] / bw:.0f}%{flag}",
                     fmt_time(r["median_s"] / max(1, r["L"]) * 1024),
                     f"{first[(r['threads'], r['L'])] / r['median_s']:.2f}x"])
    first_name = results["decode"][0]["dtype"] if results["decode"] else ""
    out.append(table(["dtype", "L", "threads", "time/step", "GB/s", "% of read BW",
                      "per 1k ctx", f"vs {first_name}"], rows))
    if any(r["fits_in_cache"] for r in results["decode"]):
        out.append("  * K/V bytes fit in the last-level cache: read from cache, not DRAM, so the "
                   "fraction can pass 100%")
    rows = []
    for fit in results["decode_fit"].values():
        per_key = results["batch"] * kv_bytes_per_token(hkv, results["head_dim"],
                                                        results["head_dim"], parse_dtype(fit["dtype"]))
        slope_gbps = per_key / fit["slope"] / 1e9 if fit["slope"] > 0 else float("nan")
        rows.append([fit["dtype"], fit["threads"], f"{fit['slope'] * 1e9 * 1024 / 1e3:.2f} us/1k keys",
                     fmt_time(fit["intercept"]) if fit["intercept"] >= 0
                     else "-" + fmt_time(-fit["intercept"]),
                     f"{fit['r2']:.5f}", f"{slope_gbps:.1f}"])
    out.append("\nLinear fit of decode time vs L: time = slope * L + intercept")
    out.append(table(["dtype", "threads", "slope", "intercept", "R^2", "GB/s from slope"], rows))

    out.append(f"\n(c) Per-token cost without a cache: full causal attention over the context "
               f"(H={h}/{hkv}) against one cached decode step")
    rows = []
    step_at = {(r["threads"], r["L"]): r["median_s"] for r in results["decode"]
               if r["dtype"] == results["dtype"]}
    for r in results["recompute"]:
        cached = step_at.get((r["threads"], r["L"]))
        rows.append([fmt_len(r["L"]), r["threads"], fmt_time(r["median_s"]),
                     fmt_time(cached) if cached else "-",
                     f"{r['median_s'] / cached:.0f}x" if cached else "-"])
    out.append(table(["context", "threads", "recompute", "cached step", "ratio"], rows))

    rows = []
    for n, g in results["generation"].items():
        rows.append([n, g["prompt"], g["tokens"], fmt_time(g["prompt_prefill_s"]),
                     fmt_time(g["cached_total_s"]), fmt_time(g["recompute_total_s"]),
                     f"{g['speedup']:.1f}x", f"{g['max_abs_diff']:.1e}"])
    out.append("\n    Generating N tokens after a P-token prompt (totals over the N tokens; "
               "max diff = cached vs recomputed outputs)")
    out.append(table(["threads", "P", "N", "prompt prefill", "cached", "recompute",
                      "cached speedup", "max diff"], rows))
    return "\n".join(out)
