"""Arrays as the kernels take them: the dtypes they compute in, conversions that copy only
when they must, and the 4-D (B, H, T, D) views every call is run with."""
from __future__ import annotations

import numpy as np

from ._formats import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, FORMATS, format_of_storage, names, quantized_formats

# KV-cache storage formats: attnfast._formats (one entry per format). A packed format's
# arrays (int4's uint8 blocks) do not say their head dims: KVCache / PagedKVCache own such
# arrays and know them; attention_with_kvcache takes q's and v_head_dim.
_KERNEL_DTYPES = (FLOAT32, FLOAT64, FLOAT16, BFLOAT16)
LOWP_DTYPES = (FLOAT16, BFLOAT16)  # 16-bit storage; arithmetic in float32
_DTYPE_NAMES = "float32, float64, float16 or bfloat16"


def is_quantized(dtype: np.dtype) -> bool:
    """Whether a cache of `dtype` is quantised when tokens are written (int8, float8, int4)."""
    fmt = format_of_storage(dtype)
    return fmt is not None and fmt.quantized


def is_row_scaled(dtype: np.dtype) -> bool:
    """Whether a cache of `dtype` has one float32 scale per row (k_scale / v_scale)."""
    fmt = format_of_storage(dtype)
    return fmt is not None and fmt.row_scaled


def _format_label(dtype: np.dtype) -> str:
    """A cache dtype as messages name it: its format's name (int4 for uint8 storage)."""
    fmt = format_of_storage(dtype)
    return fmt.name if fmt is not None else str(dtype)


def _row_scaled_names() -> tuple[str, str]:
    """('int8', 'float8_e4m3fn or float8_e5m2'): the row-scaled formats, the first apart."""
    scaled = [f for f in FORMATS.values() if f.row_scaled]
    return scaled[0].name, names(scaled[1:])


def as_float_array(x, name: str) -> np.ndarray:
    """`x` as an ndarray of a dtype the kernels take (no copy when it already is one)."""
    arr = np.asarray(x)
    dt = arr.dtype
    if dt.kind == "f" and not dt.isnative:
        arr = arr.astype(dt.newbyteorder("="))
        dt = arr.dtype
    if dt in _KERNEL_DTYPES:
        return arr
    raise TypeError(f"{name} must be {_DTYPE_NAMES}, got dtype {dt}")


def check_query_kv_dtypes(q_dtype: np.dtype, kv_dtype: np.dtype, kv_names: str) -> None:
    """q shares the dtype of k and v, except that a float32 q may read a float16 /
    bfloat16 cache, and a float32 / 16-bit q a quantised one (int8, float8, int4): the
    formats' query_dtypes (attnfast._formats)."""
    fmt = format_of_storage(kv_dtype)
    if fmt is not None and q_dtype in fmt.query_dtypes:
        return
    raise TypeError(f"q has dtype {q_dtype} and {kv_names} {kv_dtype}: they must share a dtype, "
                    "except that a float32 q may read float16 or bfloat16 keys and values, and "
                    f"a float32, float16 or bfloat16 q an {names(quantized_formats())} cache")


def whole_elements(arr: np.ndarray) -> np.ndarray:
    """`arr` as it is when every stride is a whole number of its elements and it is aligned,
    else one contiguous copy: the kernels count strides in elements, and every array they
    read (q, k, v, mask, scales, slopes, sinks, block tables, lengths) passes through here,
    so none is ever read with a truncated stride (a field of a structured array, say)."""
    item = arr.itemsize
    if arr.flags.aligned and all(s % item == 0 for s in arr.strides):
        return arr
    return np.ascontiguousarray(arr)


def kernel_ready(arr: np.ndarray) -> np.ndarray:
    """whole_elements(arr), with a contiguous last axis as well (a copy otherwise). Other
    axes keep their strides (transposed views cost nothing)."""
    if arr.shape[-1] > 1 and arr.strides[-1] != arr.itemsize:
        return np.ascontiguousarray(arr)
    return whole_elements(arr)


def to_4d(arr: np.ndarray) -> np.ndarray:
    """(T, D) -> (1, 1, T, D); (H, T, D) -> (1, H, T, D); views, never copies."""
    return arr.reshape((1,) * (4 - arr.ndim) + arr.shape) if arr.ndim < 4 else arr


def to_3d(arr: np.ndarray) -> np.ndarray:
    """(T,) -> (1, 1, T); (H, T) -> (1, H, T): views, for lse arrays."""
    return arr.reshape((1,) * (3 - arr.ndim) + arr.shape) if arr.ndim < 3 else arr


def _shape_str(a) -> str:
    return "(" + ", ".join(str(s) for s in a.shape) + ")" if a.ndim != 1 else f"({a.shape[0]},)"


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """The precision the kernels compute in for inputs of `dtype`."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)
