"""The checks of attention() and attention_varlen(): q, k, v and the score options."""
from __future__ import annotations

import numpy as np

from ._arrays import (FLOAT32, FLOAT64, LOWP_DTYPES, _shape_str, as_float_array,
                      check_query_kv_dtypes, kernel_ready, to_4d, whole_elements)
from ._descriptors import AttentionCall, ScoreOptions
from ._runtime import resolve_threads
from ._scalars import (_as_int, bound_window, check_flag, check_query_offset, check_scale,
                       check_softcap, check_window)


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
    return ScoreOptions(softcap=cap, alibi=alibi, sinks=sink, mask=view)


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


def check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Packed varlen sequences (attention_varlen and its backward): q, k, v 3-D (total_tokens,
    heads, dim) float arrays, k and v of the same tokens and kv heads, query heads a multiple
    of the kv heads, q and k of one head dim; the checked cumulative offsets, one per
    sequence boundary alike. Returns (q, k, v, cu_q, cu_k)."""
    q, k, v = (as_float_array(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 3:
            raise ValueError(f"{name} must be 3-D (total_tokens, heads, dim) for varlen, "
                             f"got shape {_shape_str(a)}")
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must hold the same tokens and kv heads; got k {_shape_str(k)}, "
                         f"v {_shape_str(v)}")
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(f"query heads must be a multiple of kv heads (GQA/MQA); got q "
                         f"{_shape_str(q)} with {heads} heads, k {_shape_str(k)} with {kv_heads}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must share the head dim D; got q {_shape_str(q)}, "
                         f"k {_shape_str(k)}")
    cu_q = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q)
    cu_k = check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], max_seqlen_k)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of "
                         f"sequences; got {cu_q.shape[0] - 1} and {cu_k.shape[0] - 1}")
    return q, k, v, cu_q, cu_k
