"""The int4 KV-cache format: 4-bit values in blocks of 32 along the head dim, each block with
its own float16 scale and minimum (asymmetric; ggml's q4_1 layout).

A row of D values is stored as ceil(D / 32) blocks of 20 bytes (a uint8 array whose last axis
has 20 * ceil(D / 32) bytes; the cache's dtype is uint8)::

    bytes 0-1    float16 scale s        (little-endian, as every float16 here)
    bytes 2-3    float16 minimum m
    bytes 4-19   byte i: value i of the block in the low nibble, value i + 16 in the high one

and value i is ``s * n_i + m`` with ``n_i`` in 0..15 (a last block with fewer than 32 values is
padded with copies of the row's last value, never read). ``s = (max - min) / 15`` of the block
and ``m = min``, both rounded to float16, then ``n_i = round((x_i - m) / s)`` clipped to 0..15:
the error of a value is at most ``s / 2`` plus the float16 rounding of m, about 1/30 of the
block's range. A row holding NaN or inf, or a block whose minimum or scale is beyond
float16's range (65504), is stored with NaN scales, so it reads back as NaN (the NaN rule of
the int8 and float8 caches).

Keys are rotated before they are quantised (attnfast._rotation, the caches' default): per
block scales then do not lose their range to outlier channels (measured on MiniLM and
synthetic outliers: docs/user_guide/lowbit_accuracy.md).
"""
from __future__ import annotations

import numpy as np

GROUP = 32        # values per block
BLOCK_BYTES = 20  # bytes per block
STORAGE = np.dtype(np.uint8)  # an int4 cache's array dtype (its packed blocks)
_NAN16 = np.array(np.nan, np.float16)


def packed_size(dim: int) -> int:
    """Bytes of one stored row of `dim` values."""
    return -(-dim // GROUP) * BLOCK_BYTES


def quantize(x: np.ndarray) -> np.ndarray:
    """x (..., D), float32 or 16-bit -> the packed rows (..., packed_size(D)) uint8."""
    x = np.asarray(x, dtype=np.float32)
    D = x.shape[-1]
    groups = -(-D // GROUP)
    lead = x.shape[:-1]
    with np.errstate(invalid="ignore", over="ignore"):
        bad = ~np.isfinite(x).all(axis=-1, keepdims=True)            # (..., 1)
        xp = np.pad(np.where(bad, 0.0, x), [(0, 0)] * len(lead) + [(0, groups * GROUP - D)],
                    mode="edge") if D else x
        xg = xp.reshape(lead + (groups, GROUP))
        lo, hi = xg.min(axis=-1), xg.max(axis=-1)                   # (..., G)
        scale16 = ((hi - lo) / np.float32(15.0)).astype(np.float16)
        min16 = lo.astype(np.float16)
        # float16 overflow (|x| > 65504) is a non-finite row, as NaN and inf are
        bad = bad[..., 0] | ~(np.isfinite(scale16) & np.isfinite(min16)).all(axis=-1)
        scale = scale16.astype(np.float32)[..., None]
        safe = np.where(scale > 0, scale, np.float32(1.0))
        n = np.rint((xg - min16.astype(np.float32)[..., None]) / safe)
        n = np.clip(np.where(scale > 0, n, 0.0), 0, 15).astype(np.uint8)
    scale16 = np.where(bad[..., None], _NAN16, scale16)
    min16 = np.where(bad[..., None], _NAN16, min16)
    n = np.where(bad[..., None, None], np.uint8(0), n)
    out = np.empty(lead + (groups, BLOCK_BYTES), STORAGE)
    out[..., 0:2] = scale16.astype("<f2").view(np.uint8).reshape(lead + (groups, 2))
    out[..., 2:4] = min16.astype("<f2").view(np.uint8).reshape(lead + (groups, 2))
    out[..., 4:] = n[..., :16] | (n[..., 16:] << np.uint8(4))
    return out.reshape(lead + (groups * BLOCK_BYTES,))


def dequantize(packed: np.ndarray, dim: int) -> np.ndarray:
    """The float32 values (..., dim) packed rows stand for (what the kernels read)."""
    packed = np.asarray(packed, STORAGE)
    groups = -(-dim // GROUP)
    blocks = packed.reshape(packed.shape[:-1] + (groups, BLOCK_BYTES))
    scale = np.ascontiguousarray(blocks[..., 0:2]).view("<f2")[..., 0].astype(np.float32)
    minimum = np.ascontiguousarray(blocks[..., 2:4]).view("<f2")[..., 0].astype(np.float32)
    nib = blocks[..., 4:]
    n = np.concatenate([nib & np.uint8(15), nib >> np.uint8(4)], axis=-1).astype(np.float32)
    values = n * scale[..., None] + minimum[..., None]
    return values.reshape(packed.shape[:-1] + (groups * GROUP,))[..., :dim]
