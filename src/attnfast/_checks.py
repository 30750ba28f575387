"""Argument checking for every public entry point: the one place it lives.

Each check raises TypeError or ValueError naming the argument and what it saw, before
anything is written. What passes is handed to the kernels as 4-D (B, H, T, D) views.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np

from ._runtime import resolve_threads

_KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_PLANNED_DTYPES = ("float16", "bfloat16")


def _dtype_name(dt: np.dtype) -> str:
    return str(dt)


def as_float_array(x, name: str) -> np.ndarray:
    """`x` as an ndarray of a dtype the kernels take (no copy when it already is one)."""
    arr = np.asarray(x)
    dt = arr.dtype
    if dt.kind == "f" and not dt.isnative:
        arr = arr.astype(dt.newbyteorder("="))
        dt = arr.dtype
    if dt in _KERNEL_DTYPES:
        return arr
    if dt.name in _PLANNED_DTYPES:
        raise NotImplementedError(
            f"{name} has dtype {dt.name}: float16 and bfloat16 are not implemented yet; "
            "pass float32 or float64")
    raise TypeError(f"{name} must be float32 or float64, got dtype {_dtype_name(dt)}")


def kernel_ready(arr: np.ndarray) -> np.ndarray:
    """`arr`, or a copy of it, whose last axis is contiguous and whose strides the kernels
    can express in elements. Other axes keep their strides (transposed views cost nothing)."""
    item = arr.itemsize
    last_ok = arr.shape[-1] <= 1 or arr.strides[-1] == item
    strides_ok = all(s % item == 0 for s in arr.strides)
    if last_ok and strides_ok and arr.flags.aligned:
        return arr
    return np.ascontiguousarray(arr)


def to_4d(arr: np.ndarray) -> np.ndarray:
    """(T, D) -> (1, 1, T, D); (H, T, D) -> (1, H, T, D); views, never copies."""
    return arr.reshape((1,) * (4 - arr.ndim) + arr.shape) if arr.ndim < 4 else arr


def to_3d(arr: np.ndarray) -> np.ndarray:
    """(T,) -> (1, 1, T); (H, T) -> (1, H, T): views, for lse arrays."""
    return arr.reshape((1,) * (3 - arr.ndim) + arr.shape) if arr.ndim < 3 else arr


def _shape_str(a) -> str:
    return "(" + ", ".join(str(s) for s in a.shape) + ")" if a.ndim != 1 else f"({a.shape[0]},)"


def check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__} {scale!r}")
    s = float(scale)
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"scale must be finite and > 0, got {s!r}")
    return s


def check_window(window) -> tuple[int, int]:
    """window=(left, right), each an int >= -1 (-1 = unbounded); None = (-1, -1)."""
    if window is None:
        return -1, -1
    try:
        left, right = window
        left, right = operator.index(left), operator.index(right)
    except (TypeError, ValueError):
        raise TypeError(f"window must be a pair of ints (left, right), got {window!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window values must be >= -1 (-1 = unbounded), got {window!r}")
    return left, right


def reject_unimplemented(**options) -> None:
    for name, value in options.items():
        if value is not None:
            raise NotImplementedError(f"{name} is not implemented yet (got a value for it); "
                                      "leave it as None")


@dataclass
class AttentionCall:
    """A checked call: 4-D views for the kernels and what to hand back to the caller."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray | None
    rank: int
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    dtype: np.dtype
    scale: float
    causal: bool
    window: tuple[int, int]
    num_threads: int

    def out_shape(self) -> tuple[int, ...]:
        full = (self.batch, self.heads, self.seqlen_q, self.head_dim_v)
        return full[4 - self.rank:]

    def lse_shape(self) -> tuple[int, ...]:
        full = (self.batch, self.heads, self.seqlen_q)
        return full[4 - self.rank:]

    @property
    def lse_dtype(self) -> np.dtype:
        return np.dtype(np.float64) if self.dtype == np.float64 else np.dtype(np.float32)


def check_attention(q, k, v, *, causal, scale, window, num_threads, need_v=True) -> AttentionCall:
    """Check q, k (and v) and the common options; returns kernel-ready 4-D views."""
    q = as_float_array(q, "q")
    k = as_float_array(k, "k")
    if need_v:
        v = as_float_array(v, "v")
    named = [("q", q), ("k", k)] + ([("v", v)] if need_v else [])

    for name, a in named:
        if a.ndim not in (2, 3, 4):
            raise ValueError(f"{name} must be 2-D (T, D), 3-D (H, T, D) or 4-D (B, H, T, D); "
                             f"got {a.ndim}-D with shape {_shape_str(a)}")
    ranks = {name: a.ndim for name, a in named}
    if len(set(ranks.values())) != 1:
        raise ValueError("q, k and v must have the same number of dimensions; got "
                         + ", ".join(f"{n} {_shape_str(a)}" for n, a in named))
    dtypes = {a.dtype for _, a in named}
    if len(dtypes) != 1:
        raise TypeError("q, k and v must share a dtype; got "
                        + ", ".join(f"{n} {a.dtype}" for n, a in named))

    rank = q.ndim
    q4, k4 = to_4d(q), to_4d(k)
    B, H, Tq, D = q4.shape
    Bk, Hkv, Tk, Dk = k4.shape
    if Bk != B:
        raise ValueError(f"batch size differs: q {_shape_str(q)} has {B}, k {_shape_str(k)} has {Bk}")
    if D < 1:
        raise ValueError(f"head dim D must be >= 1; got q {_shape_str(q)}")
    if Dk != D:
        raise ValueError(f"q and k must share the head dim D; got q {_shape_str(q)}, k {_shape_str(k)}")
    if Hkv < 1 or H % Hkv != 0:
        raise ValueError(f"query heads must be a multiple of kv heads (GQA/MQA); got q {_shape_str(q)} "
                         f"with H={H}, k {_shape_str(k)} with Hkv={Hkv}")
    Dv = D
    v4 = None
    if need_v:
        v4 = to_4d(v)
        if v4.shape[:3] != (B, Hkv, Tk):
            raise ValueError(f"v must match k on (batch, kv heads, keys); got k {_shape_str(k)}, "
                             f"v {_shape_str(v)}")
        Dv = v4.shape[3]
        if Dv < 1:
            raise ValueError(f"value head dim Dv must be >= 1; got v {_shape_str(v)}")

    return AttentionCall(
        q=kernel_ready(q4), k=kernel_ready(k4), v=None if v4 is None else kernel_ready(v4),
        rank=rank, batch=B, heads=H, kv_heads=Hkv, seqlen_q=Tq, seqlen_k=Tk,
        head_dim=D, head_dim_v=Dv, dtype=q.dtype,
        scale=check_scale(scale, D), causal=bool(causal), window=check_window(window),
        num_threads=resolve_threads(num_threads))


def check_out(out, shape: tuple, dtype: np.dtype, inputs) -> np.ndarray | None:
    """Check a caller's `out` array (shape, dtype, writeable, no overlap with inputs)."""
    if out is None:
        return None
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy.ndarray, got {type(out).__name__}")
    if out.shape != tuple(shape):
        raise ValueError(f"out must have shape {tuple(shape)}, got {out.shape}")
    if out.dtype != dtype:
        raise TypeError(f"out must have dtype {dtype} (that of q), got {out.dtype}")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    for name, a in inputs:
        if a is not None and _overlap(out, a):
            raise ValueError(f"out overlaps the memory of {name}; pass a separate array")
    return out


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    if not np.may_share_memory(a, b):
        return False
    try:
        return bool(np.shares_memory(a, b, max_work=100_000))
    except np.exceptions.TooHardError:  # could not decide cheaply: assume they overlap
        return True


def check_cu_seqlens(cu, name: str, total: int, max_seqlen) -> np.ndarray:
    """Cumulative sequence offsets: 1-D integers, starting at 0, non-decreasing, ending at
    `total` (the packed length); `max_seqlen`, if given, must be >= the longest sequence."""
    arr = np.asarray(cu)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
    if arr.ndim != 1 or arr.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 1 entries, got shape {arr.shape}")
    arr = arr.astype(np.int64)
    if arr[0] != 0 or arr[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at {total} (the packed length), "
                         f"got {arr[0]} ... {arr[-1]}")
    lengths = np.diff(arr)
    if (lengths < 0).any():
        raise ValueError(f"{name} must be non-decreasing, got {arr.tolist()}")
    if max_seqlen is not None:
        longest = int(lengths.max(initial=0))
        if operator.index(max_seqlen) < longest:
            raise ValueError(f"max_seqlen for {name} is {max_seqlen} but a sequence has "
                             f"{longest} tokens")
    return arr
