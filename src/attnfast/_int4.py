"""The int4 KV-cache format: 4-bit values in blocks of 32 along the head dim, each block with
its own bfloat16 scale and minimum (asymmetric; ggml's q4_1 nibble order).

A row of D values is stored as ceil(D / 32) blocks of 20 bytes (a uint8 array whose last axis
has 20 * ceil(D / 32) bytes; the cache's dtype is uint8)::

    bytes 0-1    bfloat16 scale s       (little-endian: the 4 bytes are one uint32,
    bytes 2-3    bfloat16 minimum m      s in its low half, m in its high half)
    bytes 4-19   byte i: value i of the block in the low nibble, value i + 16 in the high one

and value i is ``s * n_i + m`` with ``n_i`` in 0..15 (a last block with fewer than 32 values is
padded with copies of the row's last value, never read). ``m`` is the block's minimum rounded
down to bfloat16 and ``s = (max - m) / 15`` rounded up, so ``n_i = round((x_i - m) / s)`` never
leaves 0..15: the error of a value is at most ``s / 2``, about 1/30 of the block's range (plus
the bfloat16 rounding of s, below 1 % of s). bfloat16 rather than float16 because the kernels
decode the header with one broadcast load and two integer operations (a float16 pair costs
conversions and shuffles per block), and it cannot overflow. A row holding NaN or inf is stored
with NaN scales, so it reads back as NaN (the NaN rule of the int8 and float8 caches).

Keys are rotated before they are quantised (attnfast._rotation, the caches' default): per
block scales then do not lose their range to outlier channels (measured on MiniLM and
synthetic outliers: docs/user_guide/lowbit_accuracy.md).
"""
from __future__ import annotations

import numpy as np

GROUP = 32        # values per block
BLOCK_BYTES = 20  # bytes per block
STORAGE = np.dtype(np.uint8)  # an int4 cache's array dtype (its packed blocks)
_BF16_NAN = np.uint32(0x7FC0)


def packed_size(dim: int) -> int:
    """Bytes of one stored row of `dim` values."""
    return -(-dim // GROUP) * BLOCK_BYTES


def _bf16_bits(x: np.ndarray, up: bool) -> np.ndarray:
    """The bfloat16 bits (uint32, < 2^16) of finite float32 x rounded toward +inf (up) or
    toward -inf: the upper half of its float32 bits, one ulp further out when bits are cut
    and the rounding is away from zero for x's sign."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    cut = (bits & np.uint32(0xFFFF)) != 0
    negative = (bits >> np.uint32(31)) == 1
    away = cut & (negative != up)  # magnitude grows: up for x > 0, down for x < 0
    return (bits >> np.uint32(16)) + away.astype(np.uint32)


def _bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def quantize(x: np.ndarray) -> np.ndarray:
    """x (..., D), float32 or 16-bit -> the packed rows (..., packed_size(D)) uint8."""
    x = np.asarray(x, dtype=np.float32)
    D = x.shape[-1]
    groups = -(-D // GROUP)
    lead = x.shape[:-1]
    with np.errstate(invalid="ignore", over="ignore"):
        bad = ~np.isfinite(x).all(axis=-1)                           # (...,)
        xp = np.where(bad[..., None], np.float32(0.0), x)
        if D:
            xp = np.pad(xp, [(0, 0)] * len(lead) + [(0, groups * GROUP - D)], mode="edge")
        xg = xp.reshape(lead + (groups, GROUP))
        lo, hi = xg.min(axis=-1), xg.max(axis=-1)                   # (..., G)
        min_bits = _bf16_bits(lo, up=False)
        minimum = _bf16_value(min_bits)
        scale_bits = _bf16_bits((hi - minimum) / np.float32(15.0), up=True)
        scale = _bf16_value(scale_bits)
        bad |= ~np.isfinite(scale).all(axis=-1)  # (a range beyond float32: as non-finite)
        safe = np.where(scale > 0, scale, np.float32(1.0))[..., None]
        n = np.rint((xg - minimum[..., None]) / safe)
        n = np.clip(np.where(scale[..., None] > 0, n, 0.0), 0, 15).astype(np.uint8)
    header = scale_bits | (min_bits << np.uint32(16))
    header = np.where(bad[..., None], _BF16_NAN | (_BF16_NAN << np.uint32(16)), header)
    n = np.where(bad[..., None, None], np.uint8(0), n)
    out = np.empty(lead + (groups, BLOCK_BYTES), STORAGE)
    out[..., 0:4] = header.astype("<u4").view(np.uint8).reshape(lead + (groups, 4))
    out[..., 4:] = n[..., :16] | (n[..., 16:] << np.uint8(4))
    return out.reshape(lead + (groups * BLOCK_BYTES,))


def dequantize(packed: np.ndarray, dim: int) -> np.ndarray:
    """The float32 values (..., dim) packed rows stand for (what the kernels read)."""
    packed = np.asarray(packed, STORAGE)
    groups = -(-dim // GROUP)
    blocks = packed.reshape(packed.shape[:-1] + (groups, BLOCK_BYTES))
    header = np.ascontiguousarray(blocks[..., 0:4]).view("<u4")[..., 0]
    scale = _bf16_value(header & np.uint32(0xFFFF))
    minimum = _bf16_value(header >> np.uint32(16))
    nib = blocks[..., 4:]
    n = np.concatenate([nib & np.uint8(15), nib >> np.uint8(4)], axis=-1).astype(np.float32)
    values = n * scale[..., None] + minimum[..., None]
    return values.reshape(packed.shape[:-1] + (groups * GROUP,))[..., :dim]
