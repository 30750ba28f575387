"""The results page: ``docs/results.md`` and its plots, from the stored compare_peers runs.

    python -m attnfast.bench.results            # from the repository's root

reads every ``bench/results/<cpu-kind>.json`` (a ``bench/compare_peers.py --json`` file) and
``bench/results/sparse/<cpu-kind>.json`` (:mod:`attnfast.bench.sparse_results`) and
``bench/results/lowbit/decode-<cpu-kind>.json`` (:mod:`attnfast.bench.lowbit_results`) and
``bench/results/many_rows/<cpu-kind>.json`` (:mod:`attnfast.bench.many_rows_results`), and
writes one section per CPU kind: the CPU and its flags, the run's date, commit and command, the
machine limits of the run, the prefill and decode tables of each dtype with the peers alongside,
and two plots (per-token decode cost against L; prefill GFLOP/s against T per engine). A new
run of a CPU kind replaces its file, so the page always shows the current numbers only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .peer_report import PeerReport
from .generate_results import load_generate_runs, render_generate_section
from .lowbit_results import load_lowbit_runs, render_lowbit_section
from .many_rows_results import load_many_rows_runs, render_many_rows_section
from .sparse_results import load_sparse_runs, render_sparse_section

__all__ = ["main", "render_page", "render_section", "load_runs", "plot_ref", "peer_summary",
           "simd_flags"]

INTRO = """\
# Results

The current numbers, from one run of `bench/compare_peers.py` per CPU kind, each with the
machine limits measured in the same run (the best memory read and the best GEMM the machine
does at that thread count), so every percentage compares like with like. The GEMM limit is a
library GEMM, not the FMA peak, so a kernel can pass 100 % of it. Peers: PyTorch (SDPA;
"torch-fold" is SDPA with the GQA query heads folded into rows), OpenVINO, ONNX Runtime
(GroupQueryAttention / MultiHeadAttention) and a NumPy implementation. Speed-ups are the peer's
time over attnfast's (> 1: attnfast faster). Every output is checked against a float64
reference in the same run: "wrong" marks a peer that missed the tolerance.

This page is generated from `bench/results/*.json` by `python -m attnfast.bench.results`
(see the development guide); the history of earlier measurements is in `bench/HISTORY.md`.
"""

# Flags worth naming for attention kernels: the SIMD and matrix extensions.
_SIMD_PREFIXES = ("sse4", "avx", "fma", "f16c", "amx", "asimd", "sve", "neon", "bf16", "i8mm")


def simd_flags(flags) -> list[str]:
    """The SIMD and matrix-extension flags among a CPU's flags, in their order."""
    return [f for f in flags if f.lower().startswith(_SIMD_PREFIXES)]


def peer_summary(report: PeerReport, kind: str, dtype: str):
    """How attnfast compares with the fastest correct peer, cell by cell.

    Returns
    -------
    tuple or None
        (cells where attnfast is at least as fast as every peer, cells with a peer, smallest
        and largest ratio fastest-peer time / attnfast time); None without such cells.
    """
    ratios = []
    for a in report.results:
        if (a["kind"], a["engine"], a.get("dtype", "float32")) != (kind, "attnfast", dtype) \
                or "median_s" not in a:
            continue
        peers = [r["median_s"] for r in report.results
                 if r["engine"] != "attnfast" and r.get("ok") and "median_s" in r
                 and (r["kind"], r["case"], r["threads"], r.get("dtype", "float32"))
                 == (kind, a["case"], a["threads"], dtype)]
        if peers:
            ratios.append(min(peers) / a["median_s"])
    if not ratios:
        return None
    return sum(x >= 1.0 for x in ratios), len(ratios), min(ratios), max(ratios)


def render_section(kind: str, data: dict, plots=()) -> str:
    """One CPU kind's section of the page (markdown), from its compare_peers JSON.

    Parameters
    ----------
    kind : str
        The CPU kind (the JSON file's name without ``.json``).
    data : dict
        The compare_peers JSON: ``meta``, ``limits``, ``results``.
    plots : sequence of (str, str)
        (description, path relative to the page) of each plot of this kind.
    """
    report = PeerReport.from_json(data)
    m = report.meta
    isa = m.get("attnfast_isa") or m.get("versions", {}).get("attnfast", "?")
    out = [f"## {m['cpu']}: {kind}", ""]
    out.append(f"{m['cpus']} CPUs, last-level cache {m['last_level_cache_mib']} MiB; attnfast "
               f"tier `{isa}`; NumPy BLAS {m['blas']}. SIMD flags: "
               + (" ".join(f"`{f}`" for f in simd_flags(m.get("cpu_flags", []))) or "not recorded")
               + ".")
    out.append("")
    when = f"Run {m['date']}" + (f" at commit `{m['commit']}`" if m.get("commit") else "")
    if m.get("source"):
        when += f" ({m['source']})"
    out += [when + ":", "", f"    {m['command']}", ""]
    out.append("Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".")
    if m.get("isa_env"):
        out.append("ISA environment: " + " ".join(f"`{k}={v}`" for k, v in m["isa_env"].items())
                   + ".")
    if m.get("busy_warning"):
        out.append(m["busy_warning"] + ".")
    summary = []
    for dtype in report.dtypes:
        for what in ("prefill", "decode"):
            s = peer_summary(report, what, dtype)
            if s:
                summary.append(f"{what} {dtype}: at least as fast as the fastest peer in {s[0]} "
                               f"of {s[1]} cells (fastest peer's time / attnfast's "
                               f"{s[2]:.2f}x-{s[3]:.2f}x)")
    if summary:
        out += ["", "attnfast against the peers, " + "; ".join(summary) + "."]
    out += ["", "### Machine limits, measured in this run", "", report.limits_table(markdown=True)]
    for dtype in report.dtypes:
        out += report.kind_tables(dtype, markdown=True, h2="### ")
    if plots:
        out += ["", "### Plots"]
        for alt, path in plots:
            out += ["", f"![{alt}]({path})"]
    return "\n".join(out) + "\n"


PLOT_TITLES = {"decode": "Per-token decode cost against context length",
               "prefill": "Prefill GFLOP/s against sequence length"}


def plot_ref(kind: str, what: str, image_dir: str) -> tuple[str, str]:
    """(description, path relative to the page) of the ``what`` plot ("decode" or "prefill")
    of a CPU kind, as :func:`render_section` takes them."""
    return f"{PLOT_TITLES[what]}, {kind}", f"{image_dir}/{kind}-{what}.png"


def render_page(runs: dict, plots=None, sparse=None, lowbit=None, generate=None, many_rows=None) -> str:
    """The whole page: the introduction, then one section per CPU kind in ``runs`` order
    (``plots``: {kind: [(description, path)]}, see :func:`render_section`), then the
    end-to-end generation sections (``generate``: {kind: generation JSON}, see
    :func:`~attnfast.bench.generate_results.render_generate_section`), the low-bit cache
    sections (``lowbit``: {kind: low-bit decode JSON}, see
    :func:`~attnfast.bench.lowbit_results.render_lowbit_section`), the many-rows sections
    (``many_rows``: {kind: many-rows JSON}, see
    :func:`~attnfast.bench.many_rows_results.render_many_rows_section`), then the sparse attention
    sections (``sparse``: {kind: sparse JSON}, see
    :func:`~attnfast.bench.sparse_results.render_sparse_section`)."""
    plots = plots or {}
    return (INTRO + "".join("\n" + render_section(kind, data, plots.get(kind, ()))
                            for kind, data in runs.items())
            + "".join("\n" + render_generate_section(kind, data)
                      for kind, data in (generate or {}).items())
            + "".join("\n" + render_lowbit_section(kind, data) for kind, data in (lowbit or {}).items())
            + "".join("\n" + render_many_rows_section(kind, data) for kind, data in (many_rows or {}).items())
            + "".join("\n" + render_sparse_section(kind, data) for kind, data in (sparse or {}).items()))


def load_runs(results_dir: str) -> dict:
    """{cpu kind: compare_peers JSON} of every ``*.json`` in ``results_dir``, sorted by name."""
    runs = {}
    for name in sorted(os.listdir(results_dir)):
        if name.endswith(".json"):
            with open(os.path.join(results_dir, name)) as f:
                runs[name[:-len(".json")]] = json.load(f)
    return runs


def main(argv=None) -> int:
    """Write the page and the plots; returns the process exit code."""
    p = argparse.ArgumentParser(prog="python -m attnfast.bench.results",
                                description="Write docs/results.md and its plots from the "
                                            "compare_peers JSON files in bench/results/.")
    p.add_argument("--results-dir", default=os.path.join("bench", "results"),
                   help="directory of <cpu-kind>.json files (default bench/results)")
    p.add_argument("--out", default=os.path.join("docs", "results.md"),
                   help="page written (default docs/results.md)")
    p.add_argument("--images", default="images",
                   help="directory of the plots, relative to the page's (default images)")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    args = p.parse_args(argv)
    if not os.path.isdir(args.results_dir):
        p.error(f"no directory {args.results_dir} (run from the repository's root)")
    runs = load_runs(args.results_dir)
    if not runs:
        p.error(f"no .json files in {args.results_dir}")
    plots = {}
    if not args.no_plots:
        from .plot import decode_plot, prefill_plot
        base = os.path.join(os.path.dirname(os.path.abspath(args.out)), args.images)
        for kind, data in runs.items():
            report = PeerReport.from_json(data)
            title = f"attnfast and peers on {report.meta['cpu']} ({kind})"
            for what, plot in (("decode", decode_plot), ("prefill", prefill_plot)):
                written = plot(report, os.path.join(base, f"{kind}-{what}.png"), title)
                if written:
                    plots.setdefault(kind, []).append(plot_ref(kind, what, args.images))
                else:
                    print(f"{what} plot of {kind} not written: {written.reason}", file=sys.stderr)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(render_page(runs, plots, load_sparse_runs(args.results_dir), load_lowbit_runs(args.results_dir),
                            load_generate_runs(args.results_dir), load_many_rows_runs(args.results_dir)))
    print(f"{args.out}: {', '.join(runs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
