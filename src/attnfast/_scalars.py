"""Scalar arguments and integers per sequence: checked, each error naming its argument."""
from __future__ import annotations

import math
import operator

import numpy as np

from ._arrays import _compute_dtype


def check_scale(scale, head_dim: int, dtype: np.dtype) -> float:
    """scale: a real number > 0 that stays finite and non-zero in the compute precision
    (float32 for float32 inputs), also once multiplied by log2(e) as the kernels do."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__} {scale!r}")
    try:
        s = float(scale)
    except OverflowError:
        s = math.inf
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"scale must be finite and > 0, got {scale!r}")
    info = np.finfo(_compute_dtype(dtype))
    if not float(info.tiny) <= s * math.log2(math.e) <= float(info.max):
        raise ValueError(f"scale={scale!r} is outside the range of {info.dtype} (the compute "
                         f"precision of {np.dtype(dtype)} inputs): it must lie in "
                         f"[{float(info.tiny) / math.log2(math.e):.3g}, {float(info.max) / math.log2(math.e):.3g}]")
    return s


def check_window(window) -> tuple[int, int]:
    """window=(left, right), each an int >= -1 (-1 = unbounded); None = (-1, -1)."""
    if window is None:
        return -1, -1
    try:
        left, right = window
        if isinstance(left, (bool, np.bool_)) or isinstance(right, (bool, np.bool_)):
            raise TypeError
        left, right = operator.index(left), operator.index(right)
    except (TypeError, ValueError):
        raise TypeError(f"window must be a pair of ints (left, right), got {window!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window values must be >= -1 (-1 = unbounded), got {window!r}")
    return left, right


def bound_window(window: tuple[int, int], seqlen_q: int, seqlen_k: int,
                 query_offset: int | None = None) -> tuple[int, int]:
    """A window bound of Tq + Tk (+ |query_offset|) or more excludes no key: it becomes -1
    (unbounded), so any Python int (2**63, 10**30) reaches the kernels as a valid int64."""
    reach = seqlen_q + seqlen_k + (abs(query_offset) if query_offset is not None else 0)
    return tuple(-1 if w >= reach else w for w in window)


_MAX_QUERY_OFFSET = 2**62


def _as_int(value, name: str, expected: str) -> int:
    """`value` as a Python int (any size; bools and floats refused), for argument `name`."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be {expected}, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}") from None


def check_flag(value, name: str) -> bool:
    """A bool option (causal, return_lse): bool, NumPy bool or the ints 0 / 1."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}"[:200])


def check_query_offset(query_offset) -> int | None:
    """query_offset: None (bottom-right alignment) or an int with |value| <= 2**62."""
    if query_offset is None:
        return None
    value = _as_int(query_offset, "query_offset", "an int or None")
    if abs(value) > _MAX_QUERY_OFFSET:
        raise ValueError(f"query_offset must lie in [-2**62, 2**62], got {value}")
    return value


def check_softcap(softcap, dtype: np.dtype) -> float:
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, (int, float, np.integer, np.floating)):
        raise TypeError(f"softcap must be a real number > 0 or None, got {type(softcap).__name__} "
                        f"{softcap!r}")
    try:
        c = float(softcap)
    except OverflowError:  # an int beyond any float: named below like any other
        c = math.inf
    info = np.finfo(_compute_dtype(dtype))
    if not (math.isfinite(c) and float(info.tiny) <= c <= float(info.max)):
        raise ValueError(f"softcap must be finite and > 0 in {info.dtype}, got {softcap!r}")
    return c


def _integer_array(value, name: str, expected: str) -> np.ndarray:
    """`value` (an int or integers) as an integer ndarray, its dtype kept so range checks
    see the values exactly as given. Python ints beyond int64 / uint64 (which NumPy would
    hold as objects) are reported with their value and position."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be {expected}, got bool {value!r}")
    arr = np.asarray(value)
    if arr.dtype == object and arr.size and all(
            isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
            for x in arr.flat):
        pos, big = next((i, int(x)) for i, x in enumerate(arr.flat)
                        if not -2**63 <= int(x) < 2**63)
        where = name if arr.ndim == 0 else f"{name}[{', '.join(map(str, np.unravel_index(pos, arr.shape)))}]"
        raise ValueError(f"{where} = {big} is outside the int64 range [-2**63, 2**63)")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} with dtype "
                        f"{arr.dtype}")
    return arr


def _ints_per_sequence(value, name: str, shape: tuple) -> np.ndarray:
    """An int (the same for every sequence) or integers of `shape` -> an integer array of
    `shape` (dtype kept, so range checks see the values exactly as given)."""
    arr = _integer_array(value, name, "an int or an integer array")
    if arr.ndim == 0:
        arr = np.full(shape, arr, dtype=arr.dtype)
    if arr.shape != shape:
        raise ValueError(f"{name} must be an int or have shape {shape} (one length per "
                         f"sequence), got shape {arr.shape}")
    return arr
