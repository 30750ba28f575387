"""The KV-cache storage formats: one entry per format, read by the checks, both cache
classes, the Ray shards, the C bridge (attnfast._ext) and the benchmarks.

Each `KVFormat` says how a format is stored (the arrays' dtype, bytes per row, whether rows
carry a float32 scale), how rows are quantised when written and what they read back as,
and the C++ code of the format (csrc/attnfast.hpp, DType: the kernels' description of the
same format is csrc/simd/storage.hpp). A new format is one entry here plus those two C++
files.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np

from . import _int4

__all__ = ["KVFormat", "FORMATS", "format_named", "format_of_storage", "names"]

FLOAT32 = np.dtype(np.float32)
FLOAT64 = np.dtype(np.float64)
FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FLOAT8_E5M2 = np.dtype(ml_dtypes.float8_e5m2)
# q dtypes a quantised cache may be read with (float32 arithmetic)
_FLOAT32_ACCUMULATED = (FLOAT32, FLOAT16, BFLOAT16)


@dataclass(frozen=True)
class KVFormat:
    """One KV-cache storage format.

    name:        what KVCache / PagedKVCache(dtype=...) accept as a string, and errors say
    storage:     the dtype of the cache arrays (int4: uint8, its packed blocks)
    code:        the C++ DType (csrc/attnfast.hpp)
    row_scaled:  one float32 dequantisation scale per (sequence, KV head, token) row, in
                 k_scale / v_scale
    block:       (values, bytes) of one stored block: rows are ceil(D / values) blocks
                 (int4: (32, 20); a plain type: (1, itemsize))
    quantize:    rows (..., D) float32 -> stored rows, or (stored rows, float32 row scales)
                 for a row-scaled format; None: stored as given (a cast)
    dequantize:  (stored rows, row scales or None, D) -> the float32 values they stand for
    rotate_keys: keys rotated by default (key_rotation="auto": "hadamard")
    accuracy:    what the format keeps of a value (docs/user_guide/lowbit.md measures it)
    """
    name: str
    storage: np.dtype
    code: int
    row_scaled: bool = False
    block: tuple[int, int] | None = None
    quantize: Callable | None = None
    dequantize: Callable | None = None
    rotate_keys: bool = False
    accuracy: str = "exact"

    @property
    def quantized(self) -> bool:
        """Quantised when tokens are written (a KV-cache storage format only, never q's)."""
        return self.quantize is not None

    @property
    def packed(self) -> bool:
        """Rows are blocks whose length in bytes is not the head dim (int4)."""
        return self.block is not None and self.block[0] > 1

    @property
    def query_dtypes(self) -> tuple[np.dtype, ...]:
        """The q dtypes that may read a cache of this format."""
        if self.quantized:
            return _FLOAT32_ACCUMULATED
        if self.storage in (FLOAT16, BFLOAT16):
            return (self.storage, FLOAT32)
        return (self.storage,)

    def stored_dim(self, dim: int) -> int:
        """Length of the storage arrays' last axis for rows of `dim` values."""
        if not self.packed:
            return dim
        values, nbytes = self.block
        return -(-dim // values) * nbytes

    def row_bytes(self, dim: int) -> int:
        """Bytes of one stored row of `dim` values (a row-scaled row's scale not included)."""
        return self.stored_dim(dim) * self.storage.itemsize

    def label(self) -> str:
        """The format as an error message or repr names it ('int4' for the packed format)."""
        return repr(self.name) if self.packed else self.name


# ---- quantisers (per row: the last axis) ----

def _row_peaks(x: np.ndarray) -> np.ndarray:
    return (np.max(np.abs(x), axis=-1, initial=0.0) if x.shape[-1]
            else np.zeros(x.shape[:-1], np.float32))


def _row_scales(x: np.ndarray, top: float):
    """(scale, safe divisor, finite) per row: scale = max|x| / top; a row holding NaN or inf
    gets a NaN scale (it reads back as NaN, never as numbers), an all-zero row scale 0."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        scale = (_row_peaks(x) / np.float32(top)).astype(np.float32)
        finite = np.isfinite(scale)
        scale = np.where(finite, scale, np.float32(np.nan)).astype(np.float32)
        safe = np.where(finite & (scale > 0), scale, np.float32(1.0))
    return scale, safe, finite


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per row (last axis): scale = max|x| / 127, values round(x / scale).
    Returns (int8 values, float32 scales of x.shape[:-1]). An all-zero row has scale 0; a
    row holding NaN or inf gets a NaN scale, so it reads back as NaN (never as numbers)."""
    x = np.asarray(x, dtype=np.float32)
    scale, safe, finite = _row_scales(x, 127.0)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        values = np.rint(np.where(finite[..., None], x, 0) / safe[..., None])
    return np.clip(values, -127, 127).astype(np.int8), scale


def quantize_float8(x: np.ndarray, dtype=FLOAT8_E4M3) -> tuple[np.ndarray, np.ndarray]:
    """A float8 format (default float8_e4m3fn) per row (last axis) with a float32 scale:
    scale = max|x| / (the format's largest finite value: 448 for e4m3fn, 57344 for e5m2),
    values x / scale rounded to nearest even (ml_dtypes' cast). Returns (float8 values,
    float32 scales of x.shape[:-1]). As quantize_int8: an all-zero row has scale 0, a row
    holding NaN or inf a NaN scale (and zero values), so it reads back as NaN."""
    dtype = np.dtype(dtype)
    top = float(ml_dtypes.finfo(dtype).max)
    x = np.asarray(x, dtype=np.float32)
    scale, safe, finite = _row_scales(x, top)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        # |x / scale| <= top up to one float32 rounding: clip so it never rounds past it
        values = np.clip(np.where(finite[..., None], x, 0) / safe[..., None], -top, top)
    return values.astype(dtype), scale


def _dequantize_rows(stored, scale, dim):
    """A row-scaled format's values: stored * scale, in float32."""
    return stored.astype(np.float32) * np.asarray(scale, np.float32)[..., None]


def _dequantize_plain(stored, scale, dim):
    return np.asarray(stored).astype(np.float32)


def _float8(name: str, dtype: np.dtype, code: int, accuracy: str) -> KVFormat:
    return KVFormat(name, dtype, code, row_scaled=True,
                    quantize=lambda x: quantize_float8(x, dtype),
                    dequantize=_dequantize_rows, accuracy=accuracy)


# Ordered as errors list them. code: csrc/attnfast.hpp's DType.
FORMATS: dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("float32", FLOAT32, 0, dequantize=_dequantize_plain),
    KVFormat("float64", FLOAT64, 1, dequantize=lambda s, scale, dim: np.asarray(s, np.float64)),
    KVFormat("float16", FLOAT16, 2, dequantize=_dequantize_plain,
             accuracy="11 significant bits: relative rounding <= 2^-11 per element; |x| <= 65504"),
    KVFormat("bfloat16", BFLOAT16, 3, dequantize=_dequantize_plain,
             accuracy="8 significant bits: relative rounding <= 2^-8 per element"),
    KVFormat("int8", np.dtype(np.int8), 4, row_scaled=True, quantize=quantize_int8,
             dequantize=_dequantize_rows, rotate_keys=True,
             accuracy="symmetric, 127 steps of max|row| / 127: error <= max|row| / 254"),
    _float8("float8_e4m3fn", FLOAT8_E4M3, 5,
            "3 mantissa bits: relative rounding <= 2^-4 per element (subnormal steps "
            "2^-9 * scale below 2^-6 * scale); row scale max|row| / 448"),
    _float8("float8_e5m2", FLOAT8_E5M2, 7,
            "2 mantissa bits: relative rounding <= 2^-3 per element (subnormal steps "
            "2^-16 * scale below 2^-14 * scale); row scale max|row| / 57344"),
    KVFormat("int4", _int4.STORAGE, 6, block=(_int4.GROUP, _int4.BLOCK_BYTES),
             quantize=_int4.quantize, dequantize=lambda s, scale, dim: _int4.dequantize(s, dim),
             rotate_keys=True,
             accuracy="16 levels per block of 32 (bfloat16 scale and minimum): error <= "
                      "(max - min) / 30 of the block, plus the bfloat16 rounding"),
)}

_BY_STORAGE = {f.storage: f for f in FORMATS.values()}
_BY_TYPE_NUM = {f.storage.num: f for f in FORMATS.values()}


def names(formats=None, last: str = "or") -> str:
    """'float32, float64, ... or int4': the formats (default all) as messages list them."""
    labels = [f.name for f in (FORMATS.values() if formats is None else formats)]
    return labels[0] if len(labels) == 1 else f"{', '.join(labels[:-1])} {last} {labels[-1]}"


def quantized_formats() -> list[KVFormat]:
    return [f for f in FORMATS.values() if f.quantized]


def format_of_storage(dtype) -> KVFormat | None:
    """The format whose cache arrays have `dtype` (uint8: int4's packed blocks), or None."""
    return _BY_STORAGE.get(dtype)


def c_codes_by_type_num() -> dict[int, int]:
    """{NumPy type number of a storage dtype: C DType code}, for attnfast._ext."""
    return {num: f.code for num, f in _BY_TYPE_NUM.items()}


def format_named(spec) -> KVFormat | None:
    """The format `spec` names: its name ("int4", "float8_e5m2", ...), or a dtype or type
    whose storage is a format's (uint8 excepted: int4 is named, never given as its
    storage). None when it names none."""
    if isinstance(spec, str):
        found = FORMATS.get(spec)
        if found is not None:
            return found
    try:
        dt = np.dtype(spec)
    except TypeError:
        return None
    found = _BY_STORAGE.get(dt)
    return None if found is None or found.packed else found
