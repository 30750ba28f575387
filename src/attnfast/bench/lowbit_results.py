"""Low-bit KV caches' stored decode runs: ``bench/results/lowbit/decode-<cpu-kind>.json`` and
their section of the results page.

``bench/bench_lowbit_decode.py --json F`` stores one run (part ``"decode"``: a row per heads
layout, length and thread count, each with the read kernel's GB/s of the same rounds and, per
cache dtype, the step's median ms, its share of the read kernel and the kernel that ran), with
the CPU, its flags, the tier, the date, the commit and the command
(:func:`~attnfast.bench.sparse_results.store_part`). The results page
(:mod:`attnfast.bench.results`) renders it as one table per CPU kind.
"""
from __future__ import annotations

from .sparse_results import load_part_runs, part_table

__all__ = ["load_lowbit_runs", "render_lowbit_section"]

# Column order and names of the cache dtypes bench_lowbit_decode.py times.
_DTYPES = (("float32", "float32"), ("bfloat16", "bfloat16"), ("int8", "int8"),
           ("int8-widen", "int8, widened"), ("fp8", "float8 e4m3"), ("fp8-e5m2", "float8 e5m2"),
           ("int4", "int4"))

_NOTE = ("One decode step (B = 1, Tq = 1, D = 128, `KVCache.attend`) per cache dtype, timed in "
         "turns with the native read kernel over as many bytes; each cell: median ms, the speed-up "
         "over the float32 step of the same rounds, and the bytes the step reads (values and row "
         "scales) per second as a share of the read kernel's. Issue 46's targets: bfloat16 >= 1.8x "
         "float32; int8 and float8 >= 3.3x at 8/8 heads and >= 2.8x at 32/8; int4 >= 5.5x and "
         ">= 4x.\n\n")


def load_lowbit_runs(results_dir: str) -> dict:
    """{cpu kind: low-bit decode JSON} of every ``lowbit/decode-*.json`` under ``results_dir``."""
    return load_part_runs(results_dir, "lowbit", "decode-")


def _columns(rows: list) -> list:
    seen = {name for r in rows for name in r["dtypes"]}
    return [(name, title) for name, title in _DTYPES if name in seen]


def render_lowbit_section(kind: str, data: dict) -> str:
    """The "Low-bit KV caches" section of one CPU kind: a decode step per cache dtype against
    float32 and the read kernel, per heads layout, length and thread count."""
    part = data.get("decode")
    if not part:
        return ""
    columns = _columns(part["rows"])

    def cells(r):
        base = r["dtypes"].get("float32", {}).get("ms")
        out = [r["heads"], str(r["L"]), str(r["threads"]), f"{r['read_gbs']:.1f}"]
        for name, _ in columns:
            c = r["dtypes"].get(name)
            if c is None:
                out.append("-")
                continue
            speed = f" = {base / c['ms']:.2f}x" if base else ""
            out.append(f"{c['ms']:.2f}{speed} ({100 * c['of_read']:.0f} %)")
        return out

    return (f"## Low-bit KV caches: {kind}\n"
            + part_table("One decode step per cache dtype against float32", part, _NOTE,
                         ["heads", "L", "threads", "read kernel GB/s"]
                         + [f"{title} ms" for _, title in columns], cells))
