"""Argument checking for every public entry point: the one place it lives.

Each check raises TypeError or ValueError naming the argument and what it saw, before
anything is written. What passes is handed to the kernels as 4-D (B, H, T, D) views.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from . import _ext
from ._formats import FORMATS, KVFormat, format_named, format_of_storage, names, quantized_formats
from ._formats import FLOAT8_E4M3  # noqa: F401  (the vLLM backend's)
from ._runtime import _clamp, _positive_int, get_num_threads, resolve_threads

FLOAT32 = np.dtype(np.float32)
FLOAT64 = np.dtype(np.float64)
FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
# KV-cache storage formats: attnfast._formats (one entry per format). A packed format's
# arrays (int4's uint8 blocks) do not say their head dims: KVCache / PagedKVCache own such
# arrays and know them; attention_with_kvcache takes q's and v_head_dim.
_KERNEL_DTYPES = (FLOAT32, FLOAT64, FLOAT16, BFLOAT16)
LOWP_DTYPES = (FLOAT16, BFLOAT16)  # 16-bit storage; arithmetic in float32
_DTYPE_NAMES = "float32, float64, float16 or bfloat16"


def _dtype_name(dt: np.dtype) -> str:
    return str(dt)


def cache_format(dtype: np.dtype) -> KVFormat | None:
    """The KV format whose cache arrays have `dtype`, or None (attnfast._formats)."""
    return format_of_storage(dtype)


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
    raise TypeError(f"{name} must be {_DTYPE_NAMES}, got dtype {_dtype_name(dt)}")


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


@dataclass(frozen=True)
class ScoreOptions:
    """Checked score options, in the kernels' terms (see AttentionParams in csrc/attnfast.hpp)."""
    softcap: float = 0.0                # 0 = off
    alibi: np.ndarray | None = None     # float32 (B, H), batch stride 0 for per-head slopes
    sinks: np.ndarray | None = None     # float32 (H,), contiguous
    mask: np.ndarray | None = None      # 4-D (B, H, Tq, Tk) view (zero strides where
                                        # broadcast): bool, or float32 / float64 additive
    key_index: np.ndarray | None = None  # int32 (B, 1 or Hkv, Tq, k): the keys each row
                                         # sees (attnfast._key_index), -1 for none

    @property
    def any(self) -> bool:
        return bool(self.softcap) or self.alibi is not None or self.sinks is not None \
            or self.mask is not None or self.key_index is not None

    def arrays(self) -> list:
        """(name as the caller spells it, array) of the option arrays the kernels read."""
        return [("mask", self.mask), ("alibi_slopes", self.alibi), ("sinks", self.sinks),
                ("key_index", self.key_index)]

    def rows(self, rows) -> "ScoreOptions":
        """The options of the batch entries `rows` (a slice of axis 0)."""
        return ScoreOptions(self.softcap, None if self.alibi is None else self.alibi[rows],
                            self.sinks, None if self.mask is None else self.mask[rows],
                            None if self.key_index is None else self.key_index[rows])


NO_OPTIONS = ScoreOptions()


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


def _float32_vector(x, name: str, shapes: tuple, shape_text: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
        if x.dtype == np.float64:  # a Python list of floats: take it as float32
            x = x.astype(np.float32)
    if x.dtype != FLOAT32:
        raise TypeError(f"{name} must be float32, got dtype {x.dtype}")
    if x.shape not in shapes:
        raise ValueError(f"{name} must have shape {shape_text}, got {_shape_str(x)}")
    return kernel_ready(x)


def check_score_options(softcap, alibi_slopes, sinks, mask, *, batch, heads, seqlen_q,
                        seqlen_k, rank, dtype, mask_supported=True) -> ScoreOptions:
    """softcap, alibi_slopes (H,) or (B, H), sinks (H,), mask broadcastable to
    (B, H, Tq, Tk) (the call's rank) -> ScoreOptions for the kernels."""
    cap = check_softcap(softcap, dtype)
    alibi = sink = view = None
    if alibi_slopes is not None:
        a = _float32_vector(alibi_slopes, "alibi_slopes", ((heads,), (batch, heads)),
                            f"(H,) = ({heads},) or (B, H) = ({batch}, {heads})")
        alibi = np.broadcast_to(a, (batch, heads)) if a.ndim == 1 else a
    if sinks is not None:
        sink = _float32_vector(sinks, "sinks", ((heads,),), f"(H,) = ({heads},)")
    if mask is not None:
        if not mask_supported:
            raise NotImplementedError("mask has no natural shape for packed varlen sequences; "
                                      "call attention() per sequence to mask")
        m = mask if isinstance(mask, np.ndarray) else np.asarray(mask)
        if m.dtype == np.bool_:
            pass
        elif m.dtype in (FLOAT32, FLOAT64) and m.dtype.isnative:
            if m.dtype == FLOAT64 and dtype != FLOAT64:
                m = m.astype(np.float32)  # the compute precision (a copy of the mask as given)
        elif m.dtype in LOWP_DTYPES and m.dtype == dtype:
            m = m.astype(np.float32)
        else:
            raise TypeError(f"mask must be bool (True = keep) or additive float32 (or q's dtype "
                            f"{dtype}), got dtype {m.dtype}")
        m = whole_elements(m)
        full = (batch, heads, seqlen_q, seqlen_k)[4 - rank:]
        try:
            view = np.broadcast_to(m, full)
        except ValueError:
            raise ValueError(f"mask of shape {_shape_str(m)} does not broadcast to {full} "
                             f"(the call's (.., H, Tq, Tk))") from None
        view = view.reshape((1,) * (4 - rank) + full)
    return ScoreOptions(cap, alibi, sink, view)


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
    dtype: np.dtype      # of q and out
    kv_dtype: np.dtype   # of k and v
    scale: float
    causal: bool
    window: tuple[int, int]
    query_offset: int | None  # None: bottom-right; else query row i sits at key i + offset
    num_threads: int
    options: ScoreOptions = NO_OPTIONS

    def out_shape(self) -> tuple[int, ...]:
        full = (self.batch, self.heads, self.seqlen_q, self.head_dim_v)
        return full[4 - self.rank:]

    def lse_shape(self) -> tuple[int, ...]:
        full = (self.batch, self.heads, self.seqlen_q)
        return full[4 - self.rank:]

    @property
    def lse_dtype(self) -> np.dtype:
        return np.dtype(np.float64) if self.dtype == np.float64 else np.dtype(np.float32)


def check_attention(q, k, v, *, causal, scale, window, num_threads, need_v=True,
                    query_offset=None, softcap=None, alibi_slopes=None, sinks=None,
                    mask=None, mask_supported=True) -> AttentionCall:
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
    if need_v and k.dtype != v.dtype:
        raise TypeError(f"k and v must share a dtype; got k {k.dtype}, v {v.dtype}")
    check_query_kv_dtypes(q.dtype, k.dtype, "k, v" if need_v else "k")

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
        head_dim=D, head_dim_v=Dv, dtype=q.dtype, kv_dtype=k.dtype,
        scale=check_scale(scale, D, q.dtype), causal=check_flag(causal, "causal"),
        window=bound_window(check_window(window), Tq, Tk, check_query_offset(query_offset)),
        query_offset=check_query_offset(query_offset),
        options=check_score_options(softcap, alibi_slopes, sinks, mask, batch=B, heads=H,
                                    seqlen_q=Tq, seqlen_k=Tk, rank=rank, dtype=q.dtype,
                                    mask_supported=mask_supported),
        num_threads=resolve_threads(num_threads))


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
# layout and that re-checks its writeable flag need not repeat it. (A stand-in, which only
# carries a shape and flags into the checks for memory attnfast owns elsewhere, is not
# written: its zero strides are not refused.)

class _Noted:
    """The base of an array attnfast made that check_written must know about (_noted): it
    holds the memory's owner and a note saying what the array is."""
    __slots__ = ("__array_interface__", "note", "_owner")


def _noted(array: np.ndarray, note: tuple, **face) -> np.ndarray:
    """An array over `array`'s memory, its __array_interface__ changed by `face`, whose base
    carries `note` (found by _note_of, however the array is viewed after)."""
    holder = _Noted()
    # described as raw bytes, then viewed as its dtype: NumPy cannot read back every
    # ml_dtypes type's typestr (float8_e5m2's '<f1')
    raw = f"|V{array.itemsize}"
    holder.__array_interface__ = {**array.__array_interface__, "typestr": raw,
                                  "descr": [("", raw)], **face}
    holder.note, holder._owner = note, array
    return np.asarray(holder).view(array.dtype)


def _note_of(a: np.ndarray) -> tuple:
    """The note of the _noted array `a` views, or ()."""
    base = a.base
    while isinstance(base, np.ndarray):
        base = base.base
    return base.note if isinstance(base, _Noted) else ()


def read_only_copy(copy: np.ndarray, what: str) -> np.ndarray:
    """`copy` (an array made from a caller's argument, not viewing its memory) as a read-only
    array that check_written refuses, saying `what` the argument was: it may be read, and it
    can never be written in place of the caller's memory."""
    return _noted(copy, ("copy", what), data=(copy.__array_interface__["data"][0], True))


def stand_in(one: np.ndarray, shape: tuple) -> np.ndarray:
    """A writeable array of `shape` with every stride 0 over the one element of `one`: for
    the argument checks, it stands in for an array attnfast holds elsewhere and writes itself
    (a ShardedKVCache's shards, whose own checks guard their memory). check_written reads its
    flags and not its strides (one element cannot hold a cache; it is never written)."""
    return _noted(one, ("stand-in",), shape=tuple(shape), strides=(0,) * len(shape))


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
        note = _note_of(a)
        if note[:1] == ("copy",):
            raise ValueError(f"{name} is {note[1]}: attnfast can read it only through a copy, "
                             f"and {why}, so the writes would go to the copy and be lost; "
                             f"pass a tensor attnfast can write in place (one without the "
                             f"bit, as .clone() gives)")
        raise ValueError(f"{name} is read-only, but {why}")
    if overlaps_itself(a) and _note_of(a) != ("stand-in",):
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


def check_latent_spec(latent, head_dim: int, head_dim_v: int, dtype) -> bool:
    """KVCache(latent=): a bool; a latent cache stores one row per token whose first
    head_dim_v elements are the values, so head_dim_v <= head_dim, and not quantised (int8,
    float8, int4: its K and V rows would need scales of their own)."""
    latent = check_flag(latent, "latent")
    if latent and head_dim_v > head_dim:
        raise ValueError(f"a latent cache's values are a prefix of its rows: v_head_dim must be "
                         f"<= head_dim, got v_head_dim={head_dim_v}, head_dim={head_dim}")
    if latent and is_quantized(dtype):
        kind = _format_label(dtype)
        raise NotImplementedError(f"latent=True with dtype={kind} is not supported (one scale "
                                  "per row cannot serve K and its V prefix); use float32, "
                                  "float16 or bfloat16")
    return latent


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


def check_cu_seqlens(cu, name: str, total: int, max_seqlen) -> np.ndarray:
    """Cumulative sequence offsets: 1-D integers, starting at 0, non-decreasing, ending at
    `total` (the packed length); `max_seqlen`, if given, must be >= the longest sequence."""
    arr = np.asarray(cu)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got {type(cu).__name__} with dtype "
                        f"{arr.dtype}")
    if arr.ndim != 1 or arr.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 1 entries, got shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name} values must be <= {total} (the packed length), got {arr.max()}")
    arr = arr.astype(np.int64)
    if arr[0] != 0 or arr[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at {total} (the packed length), "
                         f"got {arr[0]} ... {arr[-1]}")
    lengths = np.diff(arr)
    if (lengths < 0).any():
        raise ValueError(f"{name} must be non-decreasing, got {arr.tolist()}")
    if max_seqlen is not None:
        arg = "max_seqlen_q" if name.endswith("_q") else "max_seqlen_k"
        limit = _as_int(max_seqlen, arg, "an int")
        longest = int(lengths.max(initial=0))
        if limit < longest:
            raise ValueError(f"{arg} is {limit} but a sequence in {name} has {longest} tokens")
    return arr


def check_varlen_slopes(alibi_slopes, batch: int, heads: int) -> list:
    """attention_varlen's alibi_slopes, (H,) or (batch, H), checked whole (as the caller
    passed it) -> the slopes of each of the `batch` sequences: None, or float32 (H,)."""
    if alibi_slopes is None:
        return [None] * batch
    a = _float32_vector(alibi_slopes, "alibi_slopes", ((heads,), (batch, heads)),
                        f"(H,) = ({heads},) or (batch, H) = ({batch}, {heads}) for {batch} "
                        f"sequence(s) of {heads} query head(s)")
    return [a] * batch if a.ndim == 1 else list(a)


# ---- KV cache: attention_with_kvcache and KVCache (attnfast._kvcache) ----

def _exact_dtype(arr: np.ndarray, name: str) -> np.dtype:
    """The dtype of an array attnfast writes into in place: a KV format's storage dtype,
    native order (a conversion would be a copy, and the writes would be lost)."""
    dt = arr.dtype
    if format_of_storage(dt) is not None and dt.isnative:
        return dt
    quantized = [str(f.storage) for f in quantized_formats() if not f.packed]
    raise TypeError(f"{name} must be a {_DTYPE_NAMES} (or {', '.join(quantized)}) array in native "
                    f"byte order, got dtype {_dtype_name(dt)}")


def check_cache_scales(k_scale, v_scale, cache_dtype: np.dtype, shape: tuple, writes: bool,
                       names=("k_scale", "v_scale")):
    """The float32 (batch, kv_heads, capacity) row scales of a row-scaled cache (int8,
    float8); None for others."""
    if not is_row_scaled(cache_dtype):
        first, rest = _row_scaled_names()
        for name, a in zip(names, (k_scale, v_scale)):
            if a is not None:
                raise ValueError(f"{name} is only for an {first} cache (or a {rest} one); "
                                 f"the cache has dtype {cache_dtype}")
        return None, None
    for name, a in zip(names, (k_scale, v_scale)):
        if a is None:
            raise ValueError(f"an {cache_dtype} cache needs {names[0]} and {names[1]} (float32 arrays of "
                             f"shape {shape}); {name} is None")
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray (it is read and written in place), "
                            f"got {type(a).__name__}")
        if a.dtype != FLOAT32 or not a.dtype.isnative:
            raise TypeError(f"{name} must be float32, got dtype {a.dtype}")
        if a.shape != shape:
            raise ValueError(f"{name} must have shape {shape} (batch, kv_heads, capacity), got "
                             f"{_shape_str(a)}")
        if writes:
            check_written(a, name, "the new tokens' scales must be written into it")
        if whole_elements(a) is not a:  # written in place: a copy would lose the writes
            raise ValueError(f"{name} must be aligned with strides that are whole float32 "
                             f"elements (it is written in place), got strides {a.strides}")
    return k_scale, v_scale


def check_key_rotation(key_rotation, cache_dtype: np.dtype, name: str = "key_rotation"):
    """None or "hadamard" (attnfast._rotation), the latter for quantised caches only."""
    if key_rotation is None:
        return None
    if not isinstance(key_rotation, str) or key_rotation != "hadamard":
        raise ValueError(f"{name} must be None or \"hadamard\", got {key_rotation!r}")
    if not is_quantized(cache_dtype):
        raise ValueError(f"{name}=\"hadamard\" is for {names(quantized_formats(), 'and')} caches (it makes "
                         f"their per-token scales robust to outlier channels); the cache has "
                         f"dtype {cache_dtype}")
    return key_rotation


def default_key_rotation(key_rotation, cache_dtype: np.dtype):
    """A cache's key_rotation argument: "auto" -> "hadamard" for the formats that rotate keys
    by default, int8 and int4 (measured: per-token int8 keys lose 4x accuracy to outlier
    channels without it, int4 blocks 2x; float8 does not gain), else None; otherwise checked
    as check_key_rotation."""
    if isinstance(key_rotation, str) and key_rotation == "auto":
        fmt = format_of_storage(cache_dtype)
        return "hadamard" if fmt is not None and fmt.rotate_keys else None
    return check_key_rotation(key_rotation, cache_dtype)


def check_cache_spec(batch, kv_heads, head_dim, capacity, dtype, v_head_dim):
    """KVCache(...) arguments -> (B, Hkv, D, capacity, dtype, Dv), all checked."""
    B = _positive_int(batch, "batch")
    Hkv = _positive_int(kv_heads, "kv_heads")
    D = _positive_int(head_dim, "head_dim")
    C = _positive_int(capacity, "capacity")
    Dv = D if v_head_dim is None else _positive_int(v_head_dim, "v_head_dim")
    limit = np.iinfo(np.intp).max // 8
    if B * Hkv * C * max(D, Dv) > limit:
        raise ValueError(f"KVCache(batch={B}, kv_heads={kv_heads}, capacity={C}, head_dim={D}, "
                         f"v_head_dim={Dv}) is too large: {B * Hkv * C * max(D, Dv)} elements per "
                         "array")
    return B, Hkv, D, C, check_cache_dtype(dtype).storage, Dv


def check_cache_dtype(dtype) -> KVFormat:
    """A cache's dtype= -> its format (attnfast._formats): a format's name, or a NumPy /
    ml_dtypes dtype that is a format's storage (not uint8: int4 is named)."""
    fmt = format_named(dtype)
    if fmt is not None:
        return fmt
    quoted = [f'"{f.name}"' for f in quantized_formats()]
    wanted = (f"dtype must be {_DTYPE_NAMES}, or a quantised format {', '.join(quoted[:-1])} "
              f"or {quoted[-1]} (float8 also as the ml_dtypes type)")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{wanted}, got {dtype!r}") from None
    packed = format_of_storage(dt)
    hint = (f" (an {packed.name} cache is dtype=\"{packed.name}\"; {dt} is its storage)"
            if packed is not None and packed.packed else "")
    raise TypeError(f"{wanted}, got {dt}{hint}")


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


def check_batch_index(batch_index, batch: int) -> np.ndarray:
    """batch_index (None = every sequence, an int, or a 1-D array of distinct ints in
    [0, batch)) -> int64 array of sequence indices."""
    if batch_index is None:
        return np.arange(batch, dtype=np.int64)
    if isinstance(batch_index, (bool, np.bool_)):
        raise TypeError(f"batch_index must be an int or an array of ints, got bool {batch_index!r}")
    if np.size(batch_index) == 0:
        raise ValueError(f"batch_index must select at least one sequence; got an empty "
                         f"{type(batch_index).__name__} (shape {np.shape(batch_index)})")
    arr = _integer_array(batch_index, "batch_index", "an int or an array of ints")
    if arr.ndim > 1:
        raise ValueError(f"batch_index must be an int or a 1-D array, got shape {arr.shape}")
    arr = arr.reshape(-1)
    if arr.min() < 0 or arr.max() >= batch:  # before the int64 cast: uint64 stays exact
        bad = arr[(arr < 0) | (arr >= batch)][0]
        raise ValueError(f"batch_index values must be in [0, {batch}) (the cache's batch), got {bad}")
    idx = arr.astype(np.int64)
    if np.unique(idx).size != idx.size:
        raise ValueError(f"batch_index must not repeat a sequence, got {arr.tolist()}")
    return idx


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


def check_cache_seqlens(cache_seqlens, batch: int, capacity: int, new_tokens: int) -> np.ndarray:
    """cache_seqlens (an int, or integers of shape (batch,)) -> int64 (batch,), each in
    [0, capacity - new_tokens] so the new tokens fit."""
    arr = _ints_per_sequence(cache_seqlens, "cache_seqlens", (batch,))
    if batch and arr.min() < 0:
        b = int(np.argmax(arr < 0))
        raise ValueError(f"cache_seqlens must be >= 0; cache_seqlens[{b}] = {arr[b]}")
    room = capacity - new_tokens
    if batch and arr.max() > room:
        b = int(np.argmax(arr > room))
        if new_tokens:
            raise ValueError(f"cache full: cache_seqlens[{b}] = {arr[b]} plus {new_tokens} new "
                             f"token(s) exceeds the cache capacity {capacity}")
        raise ValueError(f"cache_seqlens[{b}] = {arr[b]} exceeds the cache capacity {capacity}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _check_array_pair(k_cache, v_cache, names, four_d: str):
    """The part every caller-owned K/V pair shares: both writable-in-place ndarrays, 4-D
    (`four_d` says which 4 axes, for the message), one exact dtype -> that dtype."""
    kn, vn = names
    for name, a in ((kn, k_cache), (vn, v_cache)):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray (it is read and written in place), "
                            f"got {type(a).__name__}")
        if a.ndim != 4:
            raise ValueError(f"{name} must be {four_d}, got shape {_shape_str(a)}")
    kd, vd = _exact_dtype(k_cache, kn), _exact_dtype(v_cache, vn)
    if kd != vd:
        raise TypeError(f"{kn} and {vn} must share a dtype; got {kd} and {vd}")
    return kd


def is_int4_storage(cache) -> bool:
    """Whether a caller's cache array holds a packed format's rows (int4: uint8, the packed
    blocks of attnfast._int4), whose length does not say the head dim."""
    if not isinstance(cache, np.ndarray):
        return False
    fmt = format_of_storage(cache.dtype)
    return fmt is not None and fmt.packed


def int4_head_dims(q, k_cache, v_head_dim, name: str = "v_head_dim"):
    """(D, Dv) of an int4 cache passed as its packed uint8 rows (attention_with_kvcache,
    explain): D is q's head dim, Dv ``v_head_dim`` (default D). None for any other cache, for
    which ``v_head_dim`` must be None (their last axes say the head dims)."""
    if not is_int4_storage(k_cache):
        if v_head_dim is not None:
            raise ValueError(f"{name} is for int4 caches (uint8 arrays of packed rows) only; "
                             f"the caches' last axes give the head dims, got {name}={v_head_dim!r}")
        return None
    shape = getattr(q, "shape", None)
    if not shape:
        return None  # q itself is rejected by the checks that follow
    D = int(shape[-1])
    if v_head_dim is None:
        return D, D
    if isinstance(v_head_dim, (bool, np.bool_)) or not isinstance(v_head_dim, (int, np.integer)) \
            or v_head_dim < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v_head_dim!r}")
    return D, int(v_head_dim)


def _check_head_dims(k_cache, v_cache, names, dtype, head_dims) -> tuple[int, int]:
    """(D, Dv) of a cache pair: their last axes, or for int4 storage (uint8) `head_dims`,
    which the packed rows must fit (attnfast._int4.packed_size)."""
    kn, vn = names
    fmt = format_of_storage(dtype)
    if fmt is not None and fmt.packed:
        if head_dims is None:
            raise TypeError(f"{kn} and {vn} are {dtype}: {fmt.name} caches are used through "
                            f"attnfast.KVCache / PagedKVCache(dtype=\"{fmt.name}\"), which know their "
                            "head dims, or attention_with_kvcache (v_head_dim= gives Dv)")
        D, Dv = head_dims
        for name, a, dim in ((kn, k_cache, D), (vn, v_cache, Dv)):
            if a.shape[3] != fmt.stored_dim(dim):
                raise ValueError(f"{name} {_shape_str(a)} does not hold {fmt.name} rows of {dim} "
                                 f"values ({fmt.row_bytes(dim)} bytes each)")
        return D, Dv
    if k_cache.shape[3] < 1 or v_cache.shape[3] < 1:
        raise ValueError(f"head dims must be >= 1; got {kn} {_shape_str(k_cache)}, "
                         f"{vn} {_shape_str(v_cache)}")
    return k_cache.shape[3], v_cache.shape[3]


def check_cache_pair(k_cache, v_cache, *, names=("k_cache", "v_cache"), head_dims=None):
    """Caller-owned caches (B, Hkv, capacity, D) and (B, Hkv, capacity, Dv) -> ((B, Hkv,
    capacity, D), Dv, dtype). head_dims: (D, Dv) of int4 (uint8) storage."""
    kn, vn = names
    kd = _check_array_pair(k_cache, v_cache, names, "4-D (batch, kv_heads, capacity, head_dim)")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"{vn} must match {kn} on (batch, kv_heads, capacity); got {kn} "
                         f"{_shape_str(k_cache)}, {vn} {_shape_str(v_cache)}")
    D, Dv = _check_head_dims(k_cache, v_cache, names, kd, head_dims)
    return k_cache.shape[:3] + (D,), Dv, kd


def check_cache_room(lengths: np.ndarray, seq_index: np.ndarray, new_tokens: int,
                     capacity: int) -> None:
    """KVCache: the selected sequences must have room for new_tokens more tokens."""
    over = lengths[seq_index] + new_tokens > capacity
    if np.any(over):
        b = int(seq_index[np.argmax(over)])
        raise ValueError(f"cache full: sequence {b} holds {lengths[b]} token(s); {new_tokens} more "
                         f"would exceed the capacity {capacity} (nothing was written)")


def check_new_tokens(k_new, v_new, *, batch, kv_heads, head_dim, head_dim_v, dtype):
    """k_new (batch, kv_heads, t, head_dim) and v_new (batch, kv_heads, t, head_dim_v), both
    or neither -> (k_new, v_new, t) with t >= 1, or (None, None, 0)."""
    if k_new is None and v_new is None:
        return None, None, 0
    if k_new is None or v_new is None:
        given, missing = ("k_new", "v_new") if v_new is None else ("v_new", "k_new")
        raise ValueError(f"k_new and v_new must be given together; got {given} but {missing} is None")
    k_new = as_float_array(k_new, "k_new")
    v_new = as_float_array(v_new, "v_new")
    for name, a in (("k_new", k_new), ("v_new", v_new)):
        if is_quantized(dtype):  # quantised on the way in
            if a.dtype not in (FLOAT32, FLOAT16, BFLOAT16):
                kind = _format_label(dtype)
                raise TypeError(f"{name} for an {kind} cache must be float32, float16 or bfloat16 "
                                f"(quantised on append), got {a.dtype}")
        elif a.dtype != dtype and not (dtype in LOWP_DTYPES and a.dtype == FLOAT32):
            allowed = f"{dtype} or float32 (rounded to {dtype})" if dtype in LOWP_DTYPES else str(dtype)
            raise TypeError(f"{name} must have the cache's dtype {allowed}, got {a.dtype}")
        if a.ndim != 4:
            raise ValueError(f"{name} must be 4-D (batch, kv_heads, new_tokens, dim), got shape "
                             f"{_shape_str(a)}")
    if k_new.dtype != v_new.dtype:
        raise TypeError(f"k_new and v_new must share a dtype; got {k_new.dtype} and {v_new.dtype}")
    t = k_new.shape[2]
    want_k = (batch, kv_heads, t, head_dim)
    want_v = (batch, kv_heads, t, head_dim_v)
    if k_new.shape != want_k or t < 1:
        raise ValueError(f"k_new must have shape (batch={batch}, kv_heads={kv_heads}, "
                         f"new_tokens>=1, head_dim={head_dim}), got {_shape_str(k_new)}")
    if v_new.shape != want_v:
        raise ValueError(f"v_new must have shape {want_v} (k_new has {t} new token(s)), "
                         f"got {_shape_str(v_new)}")
    return k_new, v_new, t


@dataclass
class KVCacheCall:
    """A checked attention over a KV cache: `attn` holds the kernel-ready q and the options
    (its k, v are the caches as given: they are made kernel-ready after the new tokens are
    written); the new tokens go to positions starts[b] .. starts[b] + new_tokens."""
    attn: AttentionCall
    k_cache: np.ndarray
    v_cache: np.ndarray
    starts: np.ndarray
    k_new: np.ndarray | None
    v_new: np.ndarray | None
    new_tokens: int
    k_scale: np.ndarray | None = None  # int8 caches: (batch, kv_heads, capacity) float32
    v_scale: np.ndarray | None = None
    block_table: np.ndarray | None = None  # paged caches: int64 (batch, max_blocks)

    @property
    def seqlens_after(self) -> np.ndarray:
        """Keys each sequence attends over: its cached length plus the new tokens."""
        return self.starts + self.new_tokens


def _kvcache_call(q, k_cache, v_cache, sizes, dtype, cache_names, starts, k_new, v_new, t,
                  k_scale, v_scale, *, causal, scale, window, query_offset, softcap,
                  alibi_slopes, sinks, mask, num_threads, block_table=None,
                  scale_names=None) -> KVCacheCall:
    """The checks check_kvcache_attention and check_paged_kvcache_attention share once their
    caches, tokens and lengths are checked: caches writable (and apart) when tokens are
    written, then the attention options. sizes: (B, H, Hkv, Tq, capacity, D, Dv)."""
    B, H, Hkv, Tq, C, D, Dv = sizes
    kn, vn = cache_names
    if t:
        for name, a in ((kn, k_cache), (vn, v_cache)):
            check_written(a, name, "k_new/v_new must be written into it")
    attn = AttentionCall(
        q=kernel_ready(q), k=k_cache, v=v_cache, rank=4, batch=B, heads=H, kv_heads=Hkv,
        seqlen_q=Tq, seqlen_k=C, head_dim=D, head_dim_v=Dv, dtype=q.dtype, kv_dtype=dtype,
        scale=check_scale(scale, D, q.dtype), causal=check_flag(causal, "causal"),
        window=bound_window(check_window(window), Tq, C, check_query_offset(query_offset)),
        query_offset=check_query_offset(query_offset),
        options=check_score_options(softcap, alibi_slopes, sinks, mask, batch=B, heads=H,
                                    seqlen_q=Tq, seqlen_k=C, rank=4, dtype=q.dtype),
        num_threads=resolve_threads(num_threads))
    if t:  # the new tokens are written into the caches (and scales): all apart, and apart
        sn = ("k_scale", "v_scale") if scale_names is None else scale_names  # from what is read
        # v_cache inside k_cache (a latent cache): k_new writes both. Not for a quantised
        # cache: its keys and values are quantised (and the keys rotated) apart, so the two
        # writes to the shared rows would differ (check_apart refuses the overlap).
        latent = not is_quantized(dtype) and is_latent_view(k_cache, v_cache)
        if latent:
            check_latent_tokens(k_new, v_new, Dv)
        check_apart([(kn, k_cache), (vn, None if latent else v_cache), (sn[0], k_scale),
                     (sn[1], v_scale)],
                    [("q", q), ("k_new", k_new), ("v_new", v_new), ("block_table", block_table)]
                    + attn.options.arrays())
    return KVCacheCall(attn=attn, k_cache=k_cache, v_cache=v_cache, starts=starts,
                       k_new=k_new, v_new=v_new, new_tokens=t, k_scale=k_scale,
                       v_scale=v_scale, block_table=block_table)


def check_kvcache_attention(q, k_cache, v_cache, cache_seqlens, k_new, v_new, *, causal,
                            scale, window, num_threads, k_scale=None, v_scale=None,
                            query_offset=None, softcap=None, alibi_slopes=None, sinks=None,
                            mask=None,
                            cache_names=("k_cache", "v_cache"),
                            scale_names=("k_scale", "v_scale"), head_dims=None,
                            v_head_dim=None) -> KVCacheCall:
    """Everything attention over a KV cache needs, checked before anything is written.
    head_dims: (D, Dv) of int4 (uint8) caches (KVCache knows them); without it, a caller's
    int4 arrays take D from q and Dv from v_head_dim (int4_head_dims)."""
    if head_dims is None:
        head_dims = int4_head_dims(q, k_cache, v_head_dim)
    (B, Hkv, C, D), Dv, dtype = check_cache_pair(k_cache, v_cache, names=cache_names,
                                                 head_dims=head_dims)
    kn, vn = cache_names
    q = as_float_array(q, "q")
    if q.ndim != 4:
        raise ValueError(f"q must be 4-D (batch, heads, query_len, head_dim), got shape {_shape_str(q)}")
    check_query_kv_dtypes(q.dtype, dtype, f"the cache ({kn}, {vn})")
    Bq, H, Tq, Dq = q.shape
    if Bq != B:
        raise ValueError(f"batch size differs: q {_shape_str(q)} has {Bq}, {kn} "
                         f"{_shape_str(k_cache)} has {B}")
    if Dq != D:
        raise ValueError(f"q and {kn} must share the head dim D; got q {_shape_str(q)}, "
                         f"{kn} {_shape_str(k_cache)}")
    if H % Hkv != 0:
        raise ValueError(f"query heads must be a multiple of kv heads (GQA/MQA); got q "
                         f"{_shape_str(q)} with H={H}, {kn} {_shape_str(k_cache)} with Hkv={Hkv}")
    k_new, v_new, t = check_new_tokens(k_new, v_new, batch=B, kv_heads=Hkv, head_dim=D,
                                       head_dim_v=Dv, dtype=dtype)
    k_scale, v_scale = check_cache_scales(k_scale, v_scale, dtype, (B, Hkv, C), writes=t > 0,
                                          names=scale_names)
    starts = check_cache_seqlens(cache_seqlens, B, C, t)
    return _kvcache_call(q, k_cache, v_cache, (B, H, Hkv, Tq, C, D, Dv), dtype, cache_names,
                         starts, k_new, v_new, t, k_scale, v_scale, causal=causal, scale=scale,
                         window=window, query_offset=query_offset, softcap=softcap,
                         alibi_slopes=alibi_slopes, sinks=sinks, mask=mask,
                         num_threads=num_threads, scale_names=scale_names)


def check_truncate(n, lengths: np.ndarray, seq_ids=None) -> np.ndarray:
    """truncate(n): n an int or one int per sequence, 0 <= n <= current length. seq_ids:
    the sequences' ids for the message (default: their indices)."""
    arr = _ints_per_sequence(n, "n", lengths.shape)
    if arr.size and arr.min() < 0:
        raise ValueError(f"n must be >= 0, got {arr.min()}")
    if arr.size and np.any(arr > lengths):
        b = int(np.argmax(arr > lengths))
        raise ValueError(f"cannot truncate sequence {b if seq_ids is None else seq_ids[b]} to "
                         f"{arr[b]}: it holds only {lengths[b]} token(s) (truncate only shortens)")
    return arr.astype(np.int64)


# ---- Fast paths: repeat calls of a layout already accepted ----
#
# A model calls attention once per layer per generated token, with the same shapes every
# time, and the full checks above cost more than a short decode kernel. What they conclude
# from shapes, strides, dtypes and option values is remembered in a plan keyed by exactly
# those, stored only after the full path accepted a call that it could hand to the kernels
# as given (no copy, no reshape, no int8 quantisation). A call whose key finds a plan
# re-checks what can differ between calls of one layout: values (cache lengths), flags
# (writeable, aligned), memory overlap and the options left out of the key. If any of that
# fails, the fast path steps aside and the full path runs, raising its usual error.

_PLAN_LIMIT = 256        # plans per memo; a full memo is emptied (shapes that keep changing)
ATTENTION_PLANS: dict = {}
KVCACHE_PLANS: dict = {}
PAGED_PLANS: dict = {}   # attention_with_kvcache over a paged cache, no new tokens


def remember(memo: dict, key, plan) -> None:
    """Store a plan (None: the layout is not fast-path material)."""
    if plan is None:
        return
    if len(memo) >= _PLAN_LIMIT:
        memo.clear()
    memo[key] = plan


def fast_threads(num_threads) -> int | None:
    """resolve_threads() for the fast paths; None for anything but None or an int >= 1
    (the full path then reports it)."""
    if num_threads is None:
        return get_num_threads()
    if type(num_threads) is int and num_threads >= 1:
        return _clamp(num_threads)
    return None


def fast_query_offset(query_offset) -> bool:
    """Whether check_query_offset() accepts query_offset as it is (None or an int)."""
    return query_offset is None or (type(query_offset) is int
                                    and -_MAX_QUERY_OFFSET <= query_offset <= _MAX_QUERY_OFFSET)


# The plan keys are built in C (attnfast._ext: one bytes object for the arrays' shapes,
# strides and dtypes, the options with their exact types).
attention_key, kvcache_key, seqlens_key = _ext.attention_key, _ext.kvcache_key, _ext.seqlens_key


def attention_plan(call: AttentionCall, q, k, v, out, window, return_lse=False):
    """attention(): what a repeat call needs from the accepted `call` (out shape and dtype,
    scale, Tq, Tk, window as checked, lse dtype or None without return_lse), or None unless
    the kernels took q, k, v (4-D) and out as given."""
    if call.rank != 4 or call.q is not q or call.k is not k or call.v is not v:
        return None
    if out is not None and kernel_ready(out) is not out:
        return None
    return (call.out_shape(), call.dtype, call.scale, call.seqlen_q, call.seqlen_k,
            check_window(window), call.lse_dtype if return_lse else None)


def paged_plan(call, q, k_scale, v_scale, window=None, return_lse=False):
    """What a repeat paged call (attention_with_kvcache(block_table=...), no new tokens) needs
    from a call the full path accepted: (the checked call itself, its q, lengths and table
    replaced per call; the window as checked; the lse dtype or None without return_lse);
    None with new tokens, for int4 pools, and unless the kernels took q and the scales as
    given."""
    if (call.new_tokens or is_int4_storage(call.k_cache) or as_float_array(q, "q") is not q
            or kernel_ready(q) is not q or call.attn.q is not q
            or call.k_scale is not k_scale or call.v_scale is not v_scale):
        return None
    return call, check_window(window), call.attn.lse_dtype if return_lse else None


def kvcache_plan(q, k_cache, v_cache, k_new, out, scale, window, return_lse):
    """What a repeat call needs from a call the full path accepted: (new tokens, out shape,
    dtype, scale, window as checked, Tq, capacity, lse dtype or None without return_lse);
    None for int8 / float8 / int4 caches (quantised on write) and unless the kernels took
    q, the caches and `out` (if given) as given."""
    if (is_quantized(k_cache.dtype) or as_float_array(q, "q") is not q or kernel_ready(q) is not q
            or kernel_ready(k_cache) is not k_cache or kernel_ready(v_cache) is not v_cache
            or (out is not None and kernel_ready(out) is not out)):
        return None
    B, H, Tq, D = q.shape
    return (0 if k_new is None else k_new.shape[2], (B, H, Tq, v_cache.shape[3]), q.dtype,
            check_scale(scale, D, q.dtype), check_window(window), Tq, k_cache.shape[2],
            _compute_dtype(q.dtype) if return_lse else None)

# ---- paged KV cache: attention_with_kvcache(block_table=...) and PagedKVCache ----

def check_block_table(block_table, batch: int, name: str = "block_table") -> np.ndarray:
    """An int32 / int64 (batch, max_blocks) table of block ids -> int64 (batch, max_blocks)
    with a contiguous last axis (a copy only for int32 or a strided last axis; ids are
    checked against the pool by check_paged_kvcache_attention)."""
    if isinstance(block_table, (bool, np.bool_)) or np.isscalar(block_table):
        raise TypeError(f"{name} must be an int32 or int64 array (batch, max_blocks), got "
                        f"{type(block_table).__name__} {block_table!r}"[:200])
    arr = np.asarray(block_table)
    if arr.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise TypeError(f"{name} must have dtype int32 or int64, got {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D (batch, max_blocks), got shape {arr.shape}")
    if arr.shape[0] != batch:
        raise ValueError(f"{name} must have one row per sequence: shape ({batch}, max_blocks), "
                         f"got {arr.shape}")
    if arr.dtype != np.int64 or not arr.dtype.isnative:
        arr = arr.astype(np.int64)
    return kernel_ready(arr)


def check_paged_pools(k_cache, v_cache, *, names=("k_cache", "v_cache"), head_dims=None):
    """Paged pools (num_blocks, Hkv, block_size, D) and (num_blocks, Hkv, block_size, Dv)
    -> ((num_blocks, Hkv, block_size, D), Dv, dtype). head_dims: as check_cache_pair."""
    kn, vn = names
    kd = _check_array_pair(k_cache, v_cache, names,
                           "a 4-D pool (num_blocks, kv_heads, block_size, head_dim) with block_table")
    if v_cache.shape[2] != k_cache.shape[2]:
        raise ValueError(f"block_size differs: {kn} {_shape_str(k_cache)} has block_size "
                         f"{k_cache.shape[2]} (axis 2), {vn} {_shape_str(v_cache)} has {v_cache.shape[2]}")
    if v_cache.shape[:2] != k_cache.shape[:2]:
        raise ValueError(f"{vn} must match {kn} on (num_blocks, kv_heads); got {kn} "
                         f"{_shape_str(k_cache)}, {vn} {_shape_str(v_cache)}")
    if k_cache.shape[2] < 1:
        raise ValueError(f"block_size (axis 2 of {kn}) must be >= 1, got {_shape_str(k_cache)}")
    D, Dv = _check_head_dims(k_cache, v_cache, names, kd, head_dims)
    return k_cache.shape[:3] + (D,), Dv, kd


def check_paged_scales(k_scale, v_scale, cache_dtype, pool_shape: tuple, writes: bool,
                       names=("k_scale", "v_scale")):
    """An int8 pool's float32 (num_blocks, kv_heads, block_size) row scales."""
    if is_row_scaled(cache_dtype):
        for name, a in zip(names, (k_scale, v_scale)):
            if isinstance(a, np.ndarray) and a.ndim == 3 and a.shape[:2] == pool_shape[:2] \
                    and a.shape[2] != pool_shape[2]:
                raise ValueError(f"block_size differs: {name} {_shape_str(a)} has block_size "
                                 f"{a.shape[2]} (axis 2), the pools have {pool_shape[2]}")
    return check_cache_scales(k_scale, v_scale, cache_dtype, pool_shape, writes, names)


def check_paged_blocks(table: np.ndarray, lengths: np.ndarray, block_size: int,
                       num_blocks: int, name: str = "block_table") -> None:
    """Every block a sequence of `lengths[b]` tokens uses (its first ceil(len / block_size)
    table entries) must be an id in [0, num_blocks); later entries are not read."""
    used = -(-lengths // block_size)
    over = used > table.shape[1]
    if np.any(over):
        b = int(np.argmax(over))
        raise ValueError(f"too few blocks: sequence {b} needs {int(used[b])} block(s) of "
                         f"{block_size} for {int(lengths[b])} token(s), but {name} has "
                         f"{table.shape[1]} column(s)")
    in_use = np.arange(table.shape[1])[None, :] < used[:, None]
    bad = in_use & ((table < 0) | (table >= num_blocks))
    if np.any(bad):
        b, i = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"{name}[{b}, {i}] = {int(table[b, i])} is not a block id of the pool "
                         f"(must be in [0, {num_blocks}); sequence {b} uses its first "
                         f"{int(used[b])} entries)")


def check_paged_writes(table: np.ndarray, starts: np.ndarray, new_tokens: int,
                       block_size: int, name: str = "block_table") -> None:
    """The new tokens of different sequences must go to different cache rows."""
    if not new_tokens or table.shape[0] < 2:
        return
    pos = starts[:, None] + np.arange(new_tokens)[None, :]
    rows = np.take_along_axis(table, pos // block_size, axis=1) * block_size + pos % block_size
    flat = rows.reshape(-1)
    if np.unique(flat).size != flat.size:
        raise ValueError(f"{name} maps the new tokens of two sequences to the same block row; "
                         "give each sequence its own blocks for the tokens it appends")


def check_paged_kvcache_attention(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                                  *, causal, scale, window, num_threads, k_scale=None,
                                  v_scale=None, query_offset=None, softcap=None,
                                  alibi_slopes=None, sinks=None, mask=None,
                                  cache_names=("k_cache", "v_cache"),
                                  scale_names=("k_scale", "v_scale"),
                                  table_name="block_table", head_dims=None,
                                  v_head_dim=None) -> KVCacheCall:
    """check_kvcache_attention for a paged cache: pools (num_blocks, Hkv, block_size, D|Dv)
    read through block_table (B, max_blocks); the logical capacity is max_blocks *
    block_size. Everything is checked before anything is written."""
    if head_dims is None:
        head_dims = int4_head_dims(q, k_cache, v_head_dim)
    (NB, Hkv, BS, D), Dv, dtype = check_paged_pools(k_cache, v_cache, names=cache_names,
                                                    head_dims=head_dims)
    kn, vn = cache_names
    q = as_float_array(q, "q")
    if q.ndim != 4:
        raise ValueError(f"q must be 4-D (batch, heads, query_len, head_dim), got shape {_shape_str(q)}")
    check_query_kv_dtypes(q.dtype, dtype, f"the cache ({kn}, {vn})")
    B, H, Tq, Dq = q.shape
    table = check_block_table(block_table, B, table_name)
    C = table.shape[1] * BS
    if Dq != D:
        raise ValueError(f"q and {kn} must share the head dim D; got q {_shape_str(q)}, "
                         f"{kn} {_shape_str(k_cache)}")
    if H % Hkv != 0:
        raise ValueError(f"query heads must be a multiple of kv heads (GQA/MQA); got q "
                         f"{_shape_str(q)} with H={H}, {kn} {_shape_str(k_cache)} with Hkv={Hkv}")
    k_new, v_new, t = check_new_tokens(k_new, v_new, batch=B, kv_heads=Hkv, head_dim=D,
                                       head_dim_v=Dv, dtype=dtype)
    k_scale, v_scale = check_paged_scales(k_scale, v_scale, dtype, (NB, Hkv, BS), writes=t > 0,
                                          names=scale_names)
    lengths = _ints_per_sequence(cache_seqlens, "cache_seqlens", (B,))
    if B and lengths.min() < 0:
        b = int(np.argmax(lengths < 0))
        raise ValueError(f"cache_seqlens must be >= 0; cache_seqlens[{b}] = {lengths[b]}")
    if B and lengths.max() > np.iinfo(np.int64).max // 2:
        raise ValueError(f"cache_seqlens values are too large, got {lengths.max()}")
    starts = np.ascontiguousarray(lengths, dtype=np.int64)
    check_paged_blocks(table, starts + t, BS, NB, table_name)
    check_paged_writes(table, starts, t, BS, table_name)
    return _kvcache_call(q, k_cache, v_cache, (B, H, Hkv, Tq, C, D, Dv), dtype, cache_names,
                         starts, k_new, v_new, t, k_scale, v_scale, causal=causal, scale=scale,
                         window=window, query_offset=query_offset, softcap=softcap,
                         alibi_slopes=alibi_slopes, sinks=sinks, mask=mask,
                         num_threads=num_threads, block_table=table,
                         scale_names=scale_names)


def check_paged_spec(num_blocks, block_size, kv_heads, head_dim, dtype, v_head_dim):
    """PagedKVCache(...) arguments -> (num_blocks, block_size, Hkv, D, dtype, Dv), checked."""
    NB = _positive_int(num_blocks, "num_blocks")
    BS = _positive_int(block_size, "block_size")
    _, Hkv, D, _, dt, Dv = check_cache_spec(1, kv_heads, head_dim, 1, dtype, v_head_dim)
    if NB * Hkv * BS * max(D, Dv) > np.iinfo(np.intp).max // 8:
        raise ValueError(f"PagedKVCache(num_blocks={NB}, block_size={BS}, kv_heads={Hkv}, "
                         f"head_dim={D}, v_head_dim={Dv}) is too large: "
                         f"{NB * Hkv * BS * max(D, Dv)} elements per pool")
    return NB, BS, Hkv, D, dt, Dv


def check_seq_ids(seq_ids, known) -> tuple[list[int], bool]:
    """seq_ids: one id or a non-empty sequence of distinct ids, each in `known` ->
    (list of ids, whether one bare id was given)."""
    single = (not isinstance(seq_ids, (list, tuple, np.ndarray))
              or (isinstance(seq_ids, np.ndarray) and seq_ids.ndim == 0))
    if single:  # an int, a NumPy integer or a 0-d integer array: one id
        ids = [seq_ids[()] if isinstance(seq_ids, np.ndarray) else seq_ids]
    else:
        ids = list(seq_ids.reshape(-1).tolist() if isinstance(seq_ids, np.ndarray) else seq_ids)
    if not ids:
        raise ValueError("seq_ids must name at least one sequence; got an empty sequence")
    out = []
    for s in ids:
        sid = _as_int(s, "seq_ids", "a sequence id (int) or a list of them")
        if sid not in known:
            raise ValueError(f"seq_ids: no sequence {sid} in this cache (live ids: "
                             f"{sorted(known)[:16]}{' ...' if len(known) > 16 else ''})")
        out.append(sid)
    if len(set(out)) != len(out):
        raise ValueError(f"seq_ids must not repeat a sequence, got {out}")
    return out, single


def check_free_blocks(needed: int, free: int, what: str) -> None:
    """Raise (changing nothing) when `needed` new blocks exceed the `free` ones."""
    if needed > free:
        raise ValueError(f"out of blocks: {what} needs {needed} new block(s) but only {free} "
                         f"of the pool are free (nothing was written; free sequences or make "
                         f"a larger pool)")


def check_leading_sequences(seqs, batch, **arrays) -> None:
    """Axis 0 of each 4-D array must be the number of selected sequences (``seqs``, indices
    into a cache of ``batch`` sequences); other ranks are reported by the shape checks."""
    for name, a in arrays.items():
        if a is None or np.ndim(a) != 4:
            continue
        n = np.shape(a)[0]
        if n != seqs.size:
            what = (f"the cache holds {batch}" if seqs.size == batch
                    else f"batch_index selects {seqs.size}")
            raise ValueError(f"{name} has {n} sequence(s) on axis 0 (shape {np.shape(a)}), "
                             f"but {what}")


MAX_TREE_TOKENS = 64  # tree_mask's Tq limit (issue 22): the new-key part stays small


def check_tree_mask(tree_mask, call: "KVCacheCall") -> np.ndarray | None:
    """tree_mask (Tq, Tq) or (B, Tq, Tq) bool, diagonal True (a new token sees itself), for a
    checked cache call -> a (B, Tq, Tq) bool view, or None without a tree mask. The new
    tokens are each sequence's last Tq keys (with k_new: the t = Tq appended ones); the
    options that cannot be composed with it exactly raise NotImplementedError."""
    if tree_mask is None:
        return None
    attn = call.attn
    B, Tq = attn.batch, attn.seqlen_q
    if isinstance(tree_mask, np.ndarray):
        m = tree_mask
    else:  # an array-like (a nested list, a torch tensor, ...): read it as NumPy does
        try:
            m = np.asarray(tree_mask)
        except (TypeError, ValueError, RuntimeError) as e:  # ragged lists, unreadable objects
            raise ValueError(f"tree_mask must be a bool array (True: new token i sees new token "
                             f"j) of shape (Tq, Tq) or (B, Tq, Tq); got a "
                             f"{type(tree_mask).__name__} NumPy cannot read as one ({e})") from None
    if m.dtype != np.bool_:
        raise TypeError(f"tree_mask must be a bool array (True: new token i sees new token j), "
                        f"got dtype {m.dtype}")
    if m.shape not in ((Tq, Tq), (B, Tq, Tq)):
        raise ValueError(f"tree_mask must have shape (Tq, Tq) = ({Tq}, {Tq}) or (B, Tq, Tq) = "
                         f"({B}, {Tq}, {Tq}), got {_shape_str(m)}")
    if not 1 <= Tq <= MAX_TREE_TOKENS:
        raise ValueError(f"tree_mask takes 1 to {MAX_TREE_TOKENS} query tokens (Tq), got {Tq}")
    ndim = m.ndim
    m = np.broadcast_to(m, (B, Tq, Tq))
    diagonal = m[:, np.arange(Tq), np.arange(Tq)]
    if not diagonal.all():
        b, i = (int(x) for x in np.argwhere(~diagonal)[0])
        where = f"tree_mask[{i}, {i}]" if ndim == 2 else f"tree_mask[{b}, {i}, {i}]"
        raise ValueError(f"tree_mask's diagonal must be True (each new token sees itself); "
                         f"{where} is False")
    unsupported = [name for name, used in (
        ("causal=False", not attn.causal), ("window", attn.window != (-1, -1)),
        ("mask", attn.options.mask is not None), ("alibi_slopes", attn.options.alibi is not None),
        ("query_offset", attn.query_offset is not None)) if used]
    if unsupported:
        raise NotImplementedError(f"tree_mask cannot be combined with {', '.join(unsupported)} "
                                  "(tree_mask alone says which keys each query sees)")
    if call.new_tokens and call.new_tokens != Tq:
        raise ValueError(f"with tree_mask the appended tokens are the tree: k_new must hold Tq = "
                         f"{Tq} tokens, got {call.new_tokens}")
    short = call.seqlens_after < Tq
    if np.any(short):
        b = int(np.argmax(short))
        raise ValueError(f"with tree_mask every sequence must hold its Tq = {Tq} new tokens; "
                         f"sequence {b} holds {int(call.seqlens_after[b])}")
    return m
