"""Float64 NumPy reference quantisers for the low-bit KV-cache accuracy study
(bench/lowbit_accuracy.py) and its tests (tests/test_lowbit_accuracy.py).

Every quantiser takes a float array of keys or values shaped (..., T, D) (T tokens of one
head, D channels) and returns the dequantised float64 array of the same shape: what a kernel
reading the stored format would see. The stored metadata are rounded to their storage type
(float32 scales for int8 / fp8, float16 scale and zero point for int4), so the round trip is
the format's, not an idealised one. The formats (the contract of issue 21):

========================  =====================================================================
``bfloat16``, ``float16``  plain rounding to the 16-bit type (round to nearest even)
``fp8``                    float8_e4m3fn codes, one float32 scale per token row: amax / 448
``fp8 e5m2``               float8_e5m2 codes, one float32 scale per token row: amax / 57344
``int8``                   symmetric int8 codes in [-127, 127], one float32 scale per token row:
                           amax / 127
``int8-channel``           the same, one scale per channel over the sequence's T tokens
``int4-g32``               asymmetric 4-bit codes in [0, 15] per group of 32 channels along D:
                           float16 zero point (the group's minimum, rounded down to float16)
                           and float16 scale ((max - zero) / 15, rounded up to float16), so no
                           element is clipped and each element is within scale / 2
``int4-kivi``              the same asymmetric rule per channel over groups of 32 tokens along
                           T (KIVI's keys); a last partial group uses its own tokens
========================  =====================================================================

Keys may be rotated first (``rotated(fn)``): k -> k H with H the normalised block Hadamard
matrix along D (blocks of the largest power of two dividing D), quantised, then rotated back.
H is orthonormal, so q . k is unchanged by the rotation; it spreads an outlier channel over a
block, which is what lets per-token scales survive outlier channels.
"""
from __future__ import annotations

import numpy as np

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_E5M2_MAX = 57344.0  # the largest finite float8_e5m2
INT8_MAX = 127
INT4_LEVELS = 15  # codes 0..15
GROUP = 32


# ----------------------------------------------------------------------------- helpers

def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _safe(scale: np.ndarray) -> np.ndarray:
    """A zero scale (an all-zero row or group) divides as 1: its codes are all zero anyway."""
    return np.where(scale == 0, 1.0, scale)


def _round_f16(x: np.ndarray, direction: str) -> np.ndarray:
    """x rounded to a float16 value (as float64), to nearest or directed ("down" / "up")."""
    h = x.astype(np.float16)
    back = h.astype(np.float64)
    if direction == "down":
        h = np.where(back > x, np.nextafter(h, np.float16(-np.inf)), h)
    elif direction == "up":
        h = np.where(back < x, np.nextafter(h, np.float16(np.inf)), h)
    return h.astype(np.float64)


def block_size(d: int) -> int:
    """The Hadamard block along D: the largest power of two dividing d."""
    if d < 1:
        raise ValueError(f"d must be >= 1, got {d}")
    return d & -d


def hadamard(d: int) -> np.ndarray:
    """The normalised block Hadamard matrix (d, d): Sylvester blocks of block_size(d) on the
    diagonal, each divided by sqrt(block). Symmetric and orthonormal (H @ H = I)."""
    b = block_size(d)
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    h /= np.sqrt(b)
    return np.kron(np.eye(d // b), h)


# ----------------------------------------------------------------------------- quantisers

def bfloat16(x) -> np.ndarray:
    import ml_dtypes
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def float16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float64)


def fp8_token(x, return_parts=False):
    """float8_e4m3fn codes with one float32 scale per token row (amax / 448)."""
    import ml_dtypes
    x = _f64(x)
    scale = (np.abs(x).max(-1, keepdims=True) / FP8_MAX).astype(np.float32).astype(np.float64)
    scaled = x / _safe(scale)
    # float32 rounding of the scale can put amax a hair above 448; e4m3fn has no inf, so
    # saturate explicitly rather than let the cast decide
    codes = np.clip(scaled, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    out = codes.astype(np.float64) * scale
    return (out, codes, scale) if return_parts else out


def fp8_e5m2_token(x, return_parts=False):
    """float8_e5m2 codes with one float32 scale per token row (amax / 57344)."""
    import ml_dtypes
    x = _f64(x)
    scale = (np.abs(x).max(-1, keepdims=True) / FP8_E5M2_MAX).astype(np.float32).astype(np.float64)
    # saturate: a value rounding past 57344 would become inf
    codes = np.clip(x / _safe(scale), -FP8_E5M2_MAX, FP8_E5M2_MAX).astype(ml_dtypes.float8_e5m2)
    out = codes.astype(np.float64) * scale
    return (out, codes, scale) if return_parts else out


def _int8(x, axis, return_parts):
    x = _f64(x)
    scale = (np.abs(x).max(axis, keepdims=True) / INT8_MAX).astype(np.float32).astype(np.float64)
    codes = np.clip(np.rint(x / _safe(scale)), -INT8_MAX, INT8_MAX).astype(np.int8)
    out = codes.astype(np.float64) * scale
    return (out, codes, scale) if return_parts else out


def int8_token(x, return_parts=False):
    """Symmetric int8, one float32 scale per token row (amax / 127)."""
    return _int8(x, -1, return_parts)


def int8_channel(x, return_parts=False):
    """Symmetric int8, one float32 scale per channel over all T tokens of the array."""
    return _int8(x, -2, return_parts)


def _int4_asym(x, axis, return_parts):
    """Asymmetric 4-bit over `axis` of x (the group axis): zero point rounded down and scale
    rounded up to float16, so every code is in [0, 15] without clipping."""
    lo = x.min(axis, keepdims=True)
    hi = x.max(axis, keepdims=True)
    zero = _round_f16(lo, "down")
    scale = _round_f16((hi - zero) / INT4_LEVELS, "up")
    codes = np.clip(np.rint((x - zero) / _safe(scale)), 0, INT4_LEVELS).astype(np.uint8)
    out = codes * scale + zero
    return (out, codes, scale, zero) if return_parts else out


def int4_g32(x, group=GROUP, return_parts=False):
    """Asymmetric int4 per group of `group` consecutive channels along D (D % group == 0)."""
    x = _f64(x)
    d = x.shape[-1]
    if d % group:
        raise ValueError(f"int4_g32: D={d} is not a multiple of group={group}")
    g = x.reshape(*x.shape[:-1], d // group, group)
    parts = _int4_asym(g, -1, True)
    out = parts[0].reshape(x.shape)
    return (out, *parts[1:]) if return_parts else out


def int4_kivi(x, group=GROUP):
    """Asymmetric int4 per channel over groups of `group` tokens along T (KIVI's key format);
    a last partial group is quantised over its own tokens."""
    x = _f64(x)
    out = np.empty_like(x)
    for t0 in range(0, x.shape[-2], group):
        sl = (..., slice(t0, t0 + group), slice(None))
        out[sl] = _int4_asym(x[sl], -2, False)
    return out


def rotated(fn):
    """The keys' quantiser fn applied in the Hadamard-rotated basis: (fn(x H)) H^T."""
    def rot(x):
        x = _f64(x)
        h = hadamard(x.shape[-1])
        return fn(x @ h) @ h.T
    rot.__name__ = f"rotated_{fn.__name__}"
    return rot


# name -> (key quantiser, value quantiser); values are never rotated
FORMATS = {
    "bfloat16": (bfloat16, bfloat16),
    "float16": (float16, float16),
    "fp8 per token": (fp8_token, fp8_token),
    "fp8 e5m2 per token": (fp8_e5m2_token, fp8_e5m2_token),
    "int8 per token": (int8_token, int8_token),
    "int8 per token, rotated keys": (rotated(int8_token), int8_token),
    "int8 per channel keys": (int8_channel, int8_token),
    "int4 g32": (int4_g32, int4_g32),
    "int4 g32, rotated keys": (rotated(int4_g32), int4_g32),
    "int4 KIVI keys": (int4_kivi, int4_g32),
}


def attention(q, k, v, scale) -> np.ndarray:
    """Exact float64 softmax(scale q k^T) v over the last two axes (no mask)."""
    s = np.einsum("...qd,...kd->...qk", _f64(q), _f64(k)) * scale
    s -= s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return p @ _f64(v)
