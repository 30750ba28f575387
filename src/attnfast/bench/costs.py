"""The cost model the rates are computed from.

Prefill FLOPs = 2 * B * H * (D + Dv) * (visible query-key pairs): Tq * Tk without a mask and
T * (T + 1) / 2 causal with Tq == Tk (QK^T and PV, each one multiply-add per pair and element).
Decode bytes per step = B * Hkv * L * (D + Dv) * itemsize: every cached K and V byte read once.
"""
from __future__ import annotations

import numpy as np

__all__ = ["visible_pairs", "attention_flops", "decode_bytes", "kv_bytes_per_token"]


def visible_pairs(tq: int, tk: int, causal: bool) -> int:
    """Query-key pairs that carry work.

    Causal is bottom-right aligned: row i sees the keys j <= i + (tk - tq), so with tq == tk
    this is tq * (tq + 1) / 2.
    """
    if not causal:
        return tq * tk
    seen = np.clip(np.arange(tq, dtype=np.int64) + (tk - tq) + 1, 0, tk)
    return int(seen.sum())


def attention_flops(b: int, h: int, tq: int, tk: int, d: int, dv: int, causal: bool) -> int:
    """Useful FLOPs of one attention call: 2 * B * H * (D + Dv) * visible pairs."""
    return 2 * b * h * (d + dv) * visible_pairs(tq, tk, causal)


def decode_bytes(b: int, hkv: int, length: int, d: int, dv: int, itemsize: int) -> int:
    """Bytes a decode step must read: every cached K and V element of the L keys, once."""
    return b * hkv * length * (d + dv) * itemsize


def kv_bytes_per_token(kv_heads: int, d: int, dv: int, dt: np.dtype) -> int:
    """Bytes of K and V one cached token holds over all KV heads (int8: plus its 2 float32
    scales per KV head; int4: its packed blocks, scales included)."""
    from .._formats import FORMATS
    fmt = FORMATS.get(dt.name)
    if fmt is None:
        return kv_heads * (d + dv) * dt.itemsize
    scales = 2 * 4 if fmt.row_scaled else 0
    return kv_heads * (fmt.row_bytes(d) + fmt.row_bytes(dv) + scales)
