"""Packed variable-length sequences (flash-attn's varlen layout)."""
from __future__ import annotations

import numpy as np

from ._api import attention
from ._interop import accepts_arrays
from ._checks import (as_float_array, check_cu_seqlens, check_flag, check_out, check_varlen_slopes,
                      _shape_str)

__all__ = ["attention_varlen"]


@accepts_arrays
def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                     max_seqlen_k=None, causal=False, scale=None, window=None, softcap=None,
                     alibi_slopes=None, sinks=None, mask=None, return_lse=False, out=None,
                     num_threads=None):
    """Attention over a batch of packed sequences of different lengths, with no padding work.

    Sequence b holds query tokens ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of ``q`` and keys
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of ``k``/``v``; it attends only within itself.

    Parameters
    ----------
    q : array (total_q, H, D)
    k : array (total_k, Hkv, D)
    v : array (total_k, Hkv, Dv)
    cu_seqlens_q, cu_seqlens_k : int arrays (batch + 1,)
        Cumulative offsets, starting at 0 and ending at total_q / total_k.
    max_seqlen_q, max_seqlen_k : int, optional
        Accepted for flash-attn compatibility and checked (>= the longest sequence).
    Other options as in :func:`attnfast.attention`; causal is aligned bottom-right within
    each sequence. ``alibi_slopes`` is (H,) or (batch, H); ``mask`` has no natural shape
    here and raises NotImplementedError.

    Returns
    -------
    out (total_q, H, Dv), or (out, lse) with lse of shape (H, total_q) as in flash-attn.
    """
    return_lse = check_flag(return_lse, "return_lse")
    q = as_float_array(q, "q")
    k = as_float_array(k, "k")
    v = as_float_array(v, "v")
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

    # Each sequence as (H, T, D) views: the per-sequence call checks heads, dims, dtypes and
    # options; the first call runs before anything is written, so a bad input writes nothing.
    def head_major(a, lo, hi):
        return a[lo:hi].transpose(1, 0, 2)

    if mask is not None:
        raise NotImplementedError("mask has no natural shape for packed varlen sequences (each "
                                  "has its own Tq x Tk); use causal/window, or attention() per "
                                  "sequence with its own mask")
    batch = cu_q.shape[0] - 1
    slopes = check_varlen_slopes(alibi_slopes, batch, heads)  # (H,) per sequence, or None
    options = dict(causal=causal, scale=scale, window=window, softcap=softcap, sinks=sinks,
                   num_threads=num_threads)
    probe = attention(head_major(q, 0, 0), head_major(k, 0, 0), head_major(v, 0, 0),
                      alibi_slopes=slopes[0] if batch else None, **options)
    total_q, heads, dim_v = q.shape[0], q.shape[1], v.shape[2]
    check_out(out, (total_q, heads, dim_v), probe.dtype, [("q", q), ("k", k), ("v", v)])
    result = out if out is not None else np.empty((total_q, heads, dim_v), probe.dtype)
    lse = np.full((heads, total_q), -np.inf, np.float64 if probe.dtype == np.float64 else np.float32)
    for b in range(cu_q.shape[0] - 1):
        (q0, q1), (k0, k1) = cu_q[b:b + 2], cu_k[b:b + 2]
        if q1 == q0:
            continue
        res = attention(head_major(q, q0, q1), head_major(k, k0, k1), head_major(v, k0, k1),
                        out=head_major(result, q0, q1), return_lse=return_lse,
                        alibi_slopes=slopes[b], **options)
        if return_lse:
            lse[:, q0:q1] = res[1]
    return (result, lse) if return_lse else result
