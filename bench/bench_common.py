"""Shared by the bench/ suites and compare_peers.py: an independent float64 reference for a
sample of query rows, and the sample itself.

Like tests/reference.py it is plain NumPy and shares no code with attnfast; it computes only
some query rows so that shapes with T = 8k..128k can still be checked (a full T x T float64
reference would need tens of GB).
"""
from __future__ import annotations

import numpy as np


def sample_rows(tq: int, count: int = 48) -> np.ndarray:
    """All rows when tq <= count, else ``count`` rows spread over [0, tq) with the first and last."""
    if tq <= count:
        return np.arange(tq)
    return np.unique(np.linspace(0, tq - 1, count).round().astype(np.int64))


def reference_rows(q, k, v, rows, *, causal=False, scale=None) -> np.ndarray:
    """float64 attention output of the query ``rows`` only: (B, H, len(rows), Dv).

    q (B, H, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv); query head h reads KV head
    h // (H // Hkv); causal is bottom-right aligned (row i sees key j iff j <= i + Tk - Tq).
    A row that sees no key gives zeros.
    """
    b, h, tq, d = q.shape
    hkv, tk, dv = k.shape[1], k.shape[2], v.shape[3]
    group = h // hkv
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    rows = np.asarray(rows)
    out = np.zeros((b, h, len(rows), dv))
    keys = np.arange(tk)
    for bi in range(b):
        for hi in range(h):
            kk = np.asarray(k[bi, hi // group], dtype=np.float64)
            vv = np.asarray(v[bi, hi // group], dtype=np.float64)
            s = np.asarray(q[bi, hi, rows], dtype=np.float64) @ kk.T * scale
            if causal:
                visible = keys[None, :] <= (rows[:, None] + (tk - tq))
                s = np.where(visible, s, -np.inf)
            top = s.max(axis=1, keepdims=True)
            top = np.where(np.isfinite(top), top, 0.0)
            e = np.exp(s - top)
            total = e.sum(axis=1, keepdims=True)
            out[bi, hi] = (e / np.where(total > 0, total, 1.0)) @ vv
    return out


def max_abs_error(out, q, k, v, *, causal=False, rows=None) -> float:
    """Largest |out - reference| over the sampled rows (out is (B, H, Tq, Dv))."""
    rows = sample_rows(q.shape[2]) if rows is None else rows
    ref = reference_rows(q, k, v, rows, causal=causal)
    return float(np.abs(np.asarray(out[:, :, rows], dtype=np.float64) - ref).max())


def bench_threads() -> list[int]:
    """Thread counts for the pytest-benchmark suites: ATTNFAST_BENCH_THREADS (e.g. "1,2"),
    else 1 and every CPU this process may use."""
    import os

    raw = os.environ.get("ATTNFAST_BENCH_THREADS", "").strip()
    if raw:
        return sorted({int(x) for x in raw.split(",") if x.strip()})
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return sorted({1, cpus})
