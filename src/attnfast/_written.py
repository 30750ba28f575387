"""Arguments attnfast writes into (out, caches, their scales): written in place or refused
by name, never replaced by a copy; and the memory-overlap rules between a call's arrays."""
from __future__ import annotations

import numpy as np

# ---- Written arguments: written in place, or refused by name; never a copy ----
#
# One rule for every argument attnfast writes into (out, caches, their scales, pools; present
# and future entry points alike): check_written, before anything is written. What it refuses:
# - a read-only array, and so every copy the conversion layer had to make of what the caller
#   passed (attnfast._interop: a torch tensor with the negative or conjugate bit): such copies
#   are read-only (read_only_copy), so the results can never go to them and be lost;
# - an array that overlaps itself (a stride of 0, from torch's expand() or np.broadcast_to, or
#   overlapping strides from as_strided): two of its elements are one place in memory, so one
#   write would land on another (torch refuses such writes too).
# It depends only on flags, shape and strides, so a fast path whose plan key holds an array's
# layout and that re-checks its writeable flag need not repeat it.


class _ReadOnlyCopy:
    """The base of a read_only_copy: the copy's memory (owner kept alive), read-only, and
    what the caller's argument was (found by _copied_from however the array is viewed)."""
    __slots__ = ("__array_interface__", "what", "_owner")


def read_only_copy(copy: np.ndarray, what: str) -> np.ndarray:
    """`copy` (an array made from a caller's argument, not viewing its memory) as a read-only
    array that check_written refuses, saying `what` the argument was: it may be read, and it
    can never be written in place of the caller's memory."""
    holder = _ReadOnlyCopy()
    # described as raw bytes, then viewed as its dtype: NumPy cannot read back every
    # ml_dtypes type's typestr (float8_e5m2's '<f1')
    raw = f"|V{copy.itemsize}"
    holder.__array_interface__ = {**copy.__array_interface__, "typestr": raw,
                                  "descr": [("", raw)],
                                  "data": (copy.__array_interface__["data"][0], True)}
    holder.what, holder._owner = what, copy
    return np.asarray(holder).view(copy.dtype)


def _copied_from(a: np.ndarray) -> str | None:
    """What the argument a read_only_copy `a` views was, or None."""
    base = a.base
    while isinstance(base, np.ndarray):
        base = base.base
    return base.what if isinstance(base, _ReadOnlyCopy) else None


_EXACT_OVERLAP_LIMIT = 1 << 22  # elements whose addresses overlaps_itself compares one by one


def overlaps_itself(a: np.ndarray) -> bool:
    """Whether two elements of `a` may share memory. O(ndim) for any layout where each axis,
    taken by increasing stride, steps past all the smaller ones (every array NumPy or torch
    makes without as_strided / expand / broadcast_to); other layouts are compared element by
    element, up to _EXACT_OVERLAP_LIMIT elements (beyond that they count as overlapping)."""
    axes = sorted((abs(s), n) for s, n in zip(a.strides, a.shape) if n > 1)
    if not axes or any(n == 0 for n in a.shape):
        return False
    reach = a.itemsize  # bytes spanned by one index of the axes seen so far
    for stride, n in axes:
        if stride < reach:
            break
        reach += stride * (n - 1)
    else:
        return False
    if a.size > _EXACT_OVERLAP_LIMIT:
        return True
    offsets = np.zeros(1, np.int64)
    for stride, n in axes:
        offsets = (offsets[:, None] + stride * np.arange(n, dtype=np.int64)[None, :]).ravel()
    offsets.sort()
    return bool(np.any(np.diff(offsets) < a.itemsize))


def check_written(a: np.ndarray, name: str, why: str = "it is written in place") -> None:
    """The rule for every array attnfast writes into (see above): a ValueError naming `name`
    and what it saw, unless `a` can be written in place as it is. `why` says what the call
    writes there (for the message)."""
    if not a.flags.writeable:
        what = _copied_from(a)
        if what is not None:
            raise ValueError(f"{name} is {what}: attnfast can read it only through a copy, "
                             f"and {why}, so the writes would go to the copy and be lost; "
                             f"pass a tensor attnfast can write in place (one without the "
                             f"bit, as .clone() gives)")
        raise ValueError(f"{name} is read-only, but {why}")
    if overlaps_itself(a):
        raise ValueError(f"{name} overlaps itself: with shape {a.shape} and strides "
                         f"{a.strides} (bytes) two of its elements share memory (a stride of "
                         f"0, as torch's expand() or np.broadcast_to make, or overlapping "
                         f"strides), and {why}: pass an array whose elements are distinct "
                         f"(e.g. {name}.copy() or .clone())")


def check_out(out, shape: tuple, dtype: np.dtype, inputs) -> np.ndarray | None:
    """Check a caller's `out` array (shape, dtype, written in place: check_written, no
    overlap with inputs)."""
    if out is None:
        return None
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy.ndarray, got {type(out).__name__}")
    if out.shape != tuple(shape):
        raise ValueError(f"out must have shape {tuple(shape)}, got {out.shape}")
    if out.dtype != dtype:
        raise TypeError(f"out must have dtype {dtype} (that of q), got {out.dtype}")
    check_written(out, "out", "the results are written into it")
    check_apart([("out", out)], inputs)
    return out


def check_apart(written, read=()) -> None:
    """No two arrays of `written` (name, array) share memory, and none shares memory with
    an array of `read`: checked before a call writes anything, so no write can change what
    the call reads or what another of its writes put there. None entries are skipped."""
    written = [(n, a) for n, a in written if a is not None]
    read = [(n, a) for n, a in read if a is not None]
    for i, (name, a) in enumerate(written):
        for other, b in written[i + 1:]:
            if _overlap(a, b):
                raise ValueError(f"{name} and {other} share memory; both are written by this "
                                 "call: pass separate arrays")
        for other, b in read:
            if _overlap(a, b):
                raise ValueError(f"{name} overlaps the memory of {other}; {name} is written "
                                 f"by this call and {other} read: pass a separate array")


def is_latent_view(k, v) -> bool:
    """Whether v is a prefix view of k's last axis (``v = k[..., :Dv]``, Dv <= D: the same
    memory and strides, an MLA latent cache), which the kernels read once per row for both
    products (kernel_table.hpp: kv_is_latent). With Dv == D that is k itself (a latent cache's
    default, or one array passed as both caches): v's rows are k's, so new tokens are written
    once, through k, and v_new must be k_new (check_latent_tokens), as for any latent cache."""
    return (isinstance(k, np.ndarray) and isinstance(v, np.ndarray) and k.dtype == v.dtype
            and k.ndim == v.ndim and k.shape[:-1] == v.shape[:-1]
            and v.shape[-1] <= k.shape[-1] and k.strides[:-1] == v.strides[:-1]
            and (v.shape[-1] <= 1 or v.strides[-1] == k.strides[-1])
            and k.__array_interface__["data"][0] == v.__array_interface__["data"][0])


def check_latent_tokens(k_new, v_new, head_dim_v: int) -> None:
    """New tokens for a latent cache (v_cache a prefix view of k_cache): v_new must be
    k_new[..., :Dv] (the same latent rows), since writing k_new writes v too."""
    if is_latent_view(k_new, v_new):
        return
    prefix = k_new[..., :head_dim_v]
    same = v_new.dtype == k_new.dtype and np.array_equal(
        np.ascontiguousarray(v_new).view(np.uint8), np.ascontiguousarray(prefix).view(np.uint8))
    if not same and head_dim_v == k_new.shape[-1]:  # v_cache is k_cache: both written here
        raise ValueError("k_cache and v_cache share memory (v_cache is k_cache, as in an MLA "
                         "latent cache), so v_new must equal k_new; got other values: pass "
                         "separate arrays, or v_new = k_new")
    if not same:
        raise ValueError(f"v_cache is a prefix view of k_cache (an MLA latent cache: v = "
                         f"k[..., :{head_dim_v}]), so v_new must equal k_new[..., :{head_dim_v}] "
                         f"(pass that view); got other values")


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    if not np.may_share_memory(a, b):
        return False
    try:
        return bool(np.shares_memory(a, b, max_work=100_000))
    except np.exceptions.TooHardError:  # could not decide cheaply: assume they overlap
        return True
