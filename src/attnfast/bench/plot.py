"""Figures (matplotlib, imported only here): the per-token cost plot of ``attnfast bench``, and
the results page's decode and prefill plots of a compare_peers run."""
from __future__ import annotations

import os

from .costs import kv_bytes_per_token
from .limits import MIB
from .options import parse_dtype
from .report import fmt_len

__all__ = ["NotWritten", "bench_plot", "decode_plot", "prefill_plot"]


class NotWritten:
    """Falsy result of a plot function that wrote nothing, with the ``reason``."""

    def __init__(self, reason):
        self.reason = reason

    def __bool__(self):
        return False


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or a NotWritten when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return NotWritten("matplotlib is not installed (pip install 'attnfast[bench]')")
    return plt


def _token_axis(ax):
    from matplotlib.ticker import FuncFormatter
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: fmt_len(int(round(x))) if x >= 1 else ""))


def _save(fig, path):
    import matplotlib.pyplot as plt
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench_plot(results: dict, path: str):
    """A PNG of an ``attnfast bench`` run.

    Left: time per generated token against context length, cached decode (per dtype) against
    recomputing causal attention, per thread count. Right: decode GB/s against the measured
    read bandwidth.

    Returns
    -------
    True, or a :class:`NotWritten` (falsy) when matplotlib is missing.
    """
    plt = _pyplot()
    if not plt:
        return plt
    h, hkv = results["heads"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, n in enumerate(results["limits"]):
        c = colors[i % len(colors)]
        names = results["dtypes"]
        markers = "os^vD"
        for j, name in enumerate(names):  # one line per dtype
            dec = [r for r in results["decode"] if r["threads"] == n and r["dtype"] == name]
            ax.plot([r["L"] for r in dec], [r["median_s"] * 1e3 for r in dec],
                    markers[j % len(markers)] + "-", color=c, alpha=1.0 - 0.15 * j,
                    label=f"KV cache ({name}): one decode step, {n} thr")
            ax2.plot([r["L"] for r in dec], [r["gbps"] for r in dec],
                     markers[j % len(markers)] + "-", color=c, alpha=1.0 - 0.15 * j,
                     label=f"decode {name}, {n} thr")
        dec = [r for r in results["decode"] if r["threads"] == n
               and r["dtype"] == names[0]]
        rec = [r for r in results["recompute"] if r["threads"] == n]
        xs = [r["L"] for r in dec]
        if rec:
            ax.plot([r["L"] for r in rec], [r["median_s"] * 1e3 for r in rec], "s--", color=c,
                    label=f"no cache: recompute causal attention, {n} thr")
            last = rec[-1]
            tail = [L for L in xs if L >= last["L"]]
            if len(tail) > 1:
                ax.plot(tail, [last["median_s"] * 1e3 * (L / last["L"]) ** 2 for L in tail], ":",
                        color=c, alpha=0.7, label=f"recompute extrapolated ~L^2, {n} thr")
        bw = results["limits"][n]["read_bandwidth"]["gbps"]
        ax2.axhline(bw, color=c, ls="--", alpha=0.7, label=f"measured read BW, {n} thr ({bw:.0f})")
    llc = results.get("last_level_cache_bytes")
    if llc:
        per_token = results["batch"] * kv_bytes_per_token(hkv, results["head_dim"], results["head_dim"],
                                                          parse_dtype(results["dtype"]))
        fits = llc / per_token  # longest context whose K+V fit in the last-level cache
        for a in (ax, ax2):
            a.axvline(fits, color="grey", lw=0.8, ls="-.")
        ax2.text(fits, 0.02, f" K+V = last-level cache ({llc // MIB} MiB)", rotation=90,
                 va="bottom", ha="right", fontsize=7, color="grey",
                 transform=ax2.get_xaxis_transform())
    for a in (ax, ax2):
        _token_axis(a)
    ax.set_yscale("log")
    ax.set_xlabel("context length L (tokens)")
    ax.set_ylabel("time per generated token (ms), attention only")
    ax.set_title(f"Per-token cost, H={h}/{hkv}, D={results['head_dim']}, {results['dtype']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax2.set_xlabel("context length L (tokens)")
    ax2.set_ylabel("decode GB/s (K+V bytes read per step / time)")
    ax2.set_title("Decode bandwidth vs measured memory-read bandwidth")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize=7)
    fig.suptitle(f"attnfast {results['attnfast']['version']} on {results['cpu']}", fontsize=9)
    _save(fig, path)
    return True


def _engine_style(engine: str, dtype: str, engines: list, dtypes: list) -> dict:
    """One colour per engine, one marker per dtype; attnfast drawn solid and thicker."""
    import matplotlib.pyplot as plt
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {"color": colors[engines.index(engine) % len(colors)],
            "marker": "os^vD"[dtypes.index(dtype) % 5],
            "ls": "-" if engine == "attnfast" else "--",
            "lw": 2.2 if engine == "attnfast" else 1.0}


def _panel_grid(plt, groups, threads, title):
    """Axes for every (thread count, group): rows by thread count, columns by group."""
    fig, axes = plt.subplots(len(threads), len(groups), squeeze=False,
                             figsize=(3.6 * len(groups) + 1.5, 3.0 * len(threads) + 0.6))
    fig.suptitle(title, fontsize=9)
    return fig, axes


def _draw_lines(report, kind, axes, groups, threads, group_of, x_of, y_of):
    """One line per (engine, dtype) in every panel."""
    rows = [r for r in report.results if r["kind"] == kind and "median_s" in r and r.get("ok")]
    engines = report.engines  # the same colour for an engine in every plot
    dtypes = report.dtypes
    for i, n in enumerate(threads):
        for j, group in enumerate(groups):
            ax = axes[i][j]
            for engine in engines:
                for dtype in dtypes:
                    line = sorted((x_of(r), y_of(r)) for r in rows
                                  if r["threads"] == n and r["engine"] == engine
                                  and r.get("dtype", "float32") == dtype and group_of(r) == group)
                    if line:
                        label = engine + (f" {dtype}" if report.multi else "")
                        ax.plot(*zip(*line), label=label,
                                **_engine_style(engine, dtype, engines, dtypes))
            _token_axis(ax)
            ax.grid(True, which="both", alpha=0.3)


def decode_plot(report, path: str, title: str = ""):
    """Per-token decode cost against context length L, from a compare_peers run.

    One panel per (thread count, query/KV heads); in each, one line per engine and dtype:
    milliseconds per decode step (one generated token) against L.

    Parameters
    ----------
    report : PeerReport
    path : str
        PNG written.
    title : str
        Figure title.

    Returns
    -------
    True, or a :class:`NotWritten` (falsy): no matplotlib, or no decode rows.
    """
    plt = _pyplot()
    if not plt:
        return plt
    decode = [r for r in report.results if r["kind"] == "decode" and "median_s" in r]
    if not decode:
        return NotWritten("no decode rows")

    def heads(r):
        s = r["shape"]
        return (s["h"], s["hkv"], s["d"])

    groups = list(dict.fromkeys(heads(r) for r in decode))
    threads = sorted({r["threads"] for r in decode})
    fig, axes = _panel_grid(plt, groups, threads, title)
    _draw_lines(report, "decode", axes, groups, threads, heads,
                lambda r: r["shape"]["tk"], lambda r: r["median_s"] * 1e3)
    for i, n in enumerate(threads):
        for j, (h, hkv, d) in enumerate(groups):
            ax = axes[i][j]
            ax.set_yscale("log")
            ax.set_title(f"H={h}/{hkv} D={d}, {n} thread(s)", fontsize=8)
            ax.set_xlabel("context length L (tokens)", fontsize=8)
            ax.set_ylabel("ms per token (one decode step)", fontsize=8)
    axes[0][0].legend(fontsize=7)
    _save(fig, path)
    return True


def prefill_plot(report, path: str, title: str = ""):
    """Prefill rate against sequence length T per engine, from a compare_peers run.

    One panel per (thread count, head dimension and mask); in each, one line per engine and
    dtype: useful GFLOP/s against T, and the measured float32 GEMM limit as a dotted line.

    Parameters
    ----------
    report : PeerReport
    path : str
        PNG written.
    title : str
        Figure title.

    Returns
    -------
    True, or a :class:`NotWritten` (falsy): no matplotlib, or no prefill rows.
    """
    plt = _pyplot()
    if not plt:
        return plt
    prefill = [r for r in report.results if r["kind"] == "prefill" and "median_s" in r]
    if not prefill:
        return NotWritten("no prefill rows")

    def variant(r):
        s = r["shape"]
        return (s["d"], s["h"], s["causal"])

    groups = list(dict.fromkeys(variant(r) for r in prefill))
    threads = sorted({r["threads"] for r in prefill})
    fig, axes = _panel_grid(plt, groups, threads, title)
    _draw_lines(report, "prefill", axes, groups, threads, variant,
                lambda r: r["shape"]["tq"], lambda r: r["rate"])
    for i, n in enumerate(threads):
        gemm = report.limits[n]["gemm_gflops"]
        for j, (d, h, causal) in enumerate(groups):
            ax = axes[i][j]
            if gemm:
                ax.axhline(gemm, color="grey", ls=":", lw=1, label="float32 GEMM limit")
            ax.set_ylim(bottom=0)
            ax.set_title(f"D={d} H={h} {'causal' if causal else 'full'}, {n} thread(s)", fontsize=8)
            ax.set_xlabel("sequence length T (tokens)", fontsize=8)
            ax.set_ylabel("useful GFLOP/s", fontsize=8)
    axes[0][0].legend(fontsize=7)
    _save(fig, path)
    return True
