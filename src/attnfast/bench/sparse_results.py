"""Sparse attention's stored runs: ``bench/results/sparse/<cpu-kind>.json`` and its section of
the results page.

``bench/bench_mla.py --top-k K --json F`` and ``bench/bench_sparse.py [--indexer | --backward |
--model M] --json F`` each store their part of one file (``"mla"``, ``"indexer"``, ``"prefill"``,
``"backward"``, ``"model"``), with the CPU, its
flags, the kernel tier, the date, the commit and the command; the other parts are kept. The
results page (:mod:`attnfast.bench.results`) renders one table per part.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

__all__ = ["run_meta", "store_part", "part_table", "render_sparse_section", "load_sparse_runs",
           "load_part_runs"]


def run_meta() -> dict:
    """The CPU, its flags, attnfast's tier, the date, the commit and the command of this run."""
    import attnfast
    from .limits import cpu_flags, cpu_name, load_average
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip() or None
    except OSError:
        commit = None
    return {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "tier": attnfast._ext.runtime_info()["isa"],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "load_average": load_average(),
            "command": "python " + " ".join(sys.argv)}


def store_part(path: str, part: str, rows: list, **extra) -> None:
    """Writes ``{part: {meta, rows, **extra}}`` into the JSON file at ``path``, keeping its other
    parts."""
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data[part] = dict(meta=run_meta(), rows=rows, **extra)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def load_part_runs(results_dir: str, subdir: str, prefix: str = "") -> dict:
    """{cpu kind: JSON} of every ``<subdir>/<prefix><cpu kind>.json`` under ``results_dir``,
    sorted by name (none: {})."""
    where = os.path.join(results_dir, subdir)
    runs = {}
    if os.path.isdir(where):
        for name in sorted(os.listdir(where)):
            if name.startswith(prefix) and name.endswith(".json"):
                with open(os.path.join(where, name)) as f:
                    runs[name[len(prefix):-len(".json")]] = json.load(f)
    return runs


def load_sparse_runs(results_dir: str) -> dict:
    """{cpu kind: sparse JSON} of every ``sparse/*.json`` under ``results_dir``."""
    return load_part_runs(results_dir, "sparse")


def _run_line(meta: dict) -> str:
    load = meta.get("load_average")
    return (f"{meta['cpu']}, tier `{meta['tier']}`, {meta['date']}, commit `{meta.get('commit')}`"
            + (f", load average {load:.1f}" if load is not None else "") + ":\n\n    "
            + meta["command"] + "\n")


def part_table(title: str, part: dict, note: str, columns: list, cells) -> str:
    """One part's subsection: its title, the run, a note, and a row of ``cells(row)`` for every
    stored row (``cells`` returns None to leave a row out)."""
    lines = [f"\n### {title}\n\n" + _run_line(part["meta"]) + "\n" + note,
             "| " + " | ".join(columns) + " |\n", "|" + "---|" * len(columns) + "\n"]
    for r in part["rows"]:
        row = cells(r)
        if row is not None:
            lines.append("| " + " | ".join(row) + " |\n")
    return "".join(lines)


def _mla_cells(r: dict):
    if not r.get("top_k"):
        return None
    return [str(r["threads"]), str(r["L"]), r["dtype"], str(r["top_k"]), f"{r['sparse_ms']:.2f}",
            f"{100 * r['sparse_of_roofline']:.0f} %", f"{r['attnfast_ms']:.1f}",
            f"{r['dense_over_sparse']:.1f}x", f"{r['torch_sparse_ms']:.2f}",
            f"{r['torch_sparse_ms'] / r['sparse_ms']:.2f}x"]


def _indexer_cells(r: dict):
    return [str(r["threads"]), f"{r['heads']} x {r['dim']}", r.get("q_dtype", "float32"), r["key_dtype"],
            str(r["L"]), str(r["topk"]),
            f"{r['ms']:.1f}", f"{r['gflops']:.0f}", f"{100 * r['of_roofline']:.0f} %",
            f"{100 * r['topk_share']:.1f} %"]


def _chunk_cells(r: dict):
    return [str(r["threads"]), str(r["heads"]), str(r["D"]), str(r["new"]), str(r["prompt"]),
            str(r["topk"]), f"{r['sparse_s']:.2f}", f"{r['dense_s']:.2f}",
            f"{r['dense_s'] / r['sparse_s']:.1f}x"]


def _model_cells(r: dict):
    return [str(r["threads"]), r["model"], str(r["prompt"]), str(r["topk"]),
            f"{r['decode_tokens_s']:.2f}", f"{r['sdpa_decode_tokens_s']:.2f}",
            f"{r['decode_tokens_s'] / r['sdpa_decode_tokens_s']:.2f}x", f"{r['prefill_s']:.1f}",
            f"{r['sdpa_prefill_s']:.1f}", f"{r['sdpa_prefill_s'] / r['prefill_s']:.2f}x",
            "yes" if r["same_tokens"] else "no"]


_CHUNK_COLUMNS = ["threads", "heads", "D", "new tokens", "after", "top-k", "sparse s", "dense masked s",
                  "dense / sparse"]
# (part, title, note, columns, cells) in page order.
_PARTS = (
    ("mla", "MLA decode over the top-k keys (`key_index=`), one query token",
     "Roofline: max(bytes / read, FLOPs / GEMM of the dtype), both measured in the same run; "
     "with 128 heads the step is compute-bound.\n\n",
     ["threads", "L", "dtype", "top-k", "sparse ms", "% of its roofline", "dense ms", "dense / sparse",
      "torch gather + matmul ms", "torch / sparse"], _mla_cells),
    ("indexer", "The lightning indexer (`index_topk`), one decode query",
     "Roofline: max((key bytes + 4-byte scale) x L / read, 2 x heads x dim x L / bfloat16 GEMM); "
     "\"top-k share\": the time above the same call with top-1.\n\n",
     ["threads", "heads x dim", "q", "keys", "L", "top-k", "ms", "GFLOP/s", "% of roofline", "top-k share"],
     _indexer_cells),
    ("prefill", "Prefill of a chunk, each query over its own top-k", "", _CHUNK_COLUMNS, _chunk_cells),
    ("backward", "The backward of that chunk (`attention_backward(key_index=)`)", "", _CHUNK_COLUMNS,
     _chunk_cells),
    ("model", "A transformers DeepSeek-V3.2 generating: `attnfast` against `sdpa`",
     "Random weights, 2 layers, 16 heads (MLA 128 + 64 / 128), the model's own lightning indexer; "
     "greedy decode tokens/s and the prompt's prefill (s), sdpa folding the top-k into a dense "
     "mask.\n\n",
     ["threads", "model", "prompt", "top-k", "attnfast tokens/s", "sdpa tokens/s", "speed-up",
      "attnfast prefill s", "sdpa prefill s", "speed-up", "same greedy tokens"], _model_cells),
)


def render_sparse_section(kind: str, data: dict) -> str:
    """The "Sparse attention" section of one CPU kind: MLA decode over the selected keys
    against the dense step and a torch gather + matmul; the lightning indexer; a sparse
    prefill chunk (and its backward) against the same attention as a dense masked call."""
    return (f"## Sparse attention (DeepSeek-V3.2 / GLM-5): {kind}\n"
            + "".join(part_table(title, data[part], note, columns, cells)
                      for part, title, note, columns, cells in _PARTS if data.get(part)))
