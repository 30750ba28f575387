"""Many query rows per KV head: stored runs of ``bench/bench_many_rows.py --json F``
(``bench/results/many_rows/<cpu-kind>.json``) and their section of the results page.

The run (part ``"many_rows"``) holds a row per dtype, thread count, heads layout and Tq: the
kernel that ran, the step's median ms, its GFLOP/s and its share of the roofline, with the read
rate and the multiply-add peak measured in the same run, and the CPU, its flags, the tier, the
date, the commit and the command (:func:`~attnfast.bench.sparse_results.store_part`).
"""
from __future__ import annotations

from .sparse_results import load_part_runs, part_table

__all__ = ["load_many_rows_runs", "render_many_rows_section"]

_NOTE = ("One causal step of Tq query tokens over L cached keys (`attention`, B = 1, the kernel "
         "the planner picks), timed in turns with the native read kernel over the step's K and V "
         "bytes. Roofline: max(K/V bytes / read rate, 4 x H x Tq x L x D FLOPs / the multiply-add "
         "peak of q's dtype, attnfast's probe), both from the same run. Issue 46's targets: every "
         "Tq from 1 to 64 >= 80 % of the roofline, and ms per token never rising with Tq by more "
         "than 5 %.\n\n")
_COLUMNS = ["dtype", "threads", "heads", "L", "Tq", "kernel", "ms", "ms per token", "GFLOP/s",
            "% of roofline", "read GB/s", "peak GFLOP/s"]


def load_many_rows_runs(results_dir: str) -> dict:
    """{cpu kind: many-rows JSON} of every ``many_rows/*.json`` under ``results_dir``."""
    return load_part_runs(results_dir, "many_rows")


def _cells(r: dict) -> list:
    return [r["dtype"], str(r["threads"]), r["heads"], str(r["L"]), str(r["tq"]), f"`{r['kernel']}`",
            f"{r['ms']:.2f}", f"{r['ms'] / r['tq']:.2f}", f"{r['gflops']:.0f}",
            f"{100 * r['of_roofline']:.0f} %", f"{r['read_gbs']:.1f}", f"{r['peak_gflops']:.0f}"]


def render_many_rows_section(kind: str, data: dict) -> str:
    """The "Many query rows per KV head" section of one CPU kind."""
    part = data.get("many_rows")
    if not part:
        return ""
    return (f"## Many query rows per KV head: {kind}\n"
            + part_table("Tq query tokens against one KV cache, per heads layout", part, _NOTE,
                         _COLUMNS, _cells))
