"""attention_backward: the gradients of attention (FlashAttention-2's backward, streamed)."""
from __future__ import annotations

import numpy as np

from . import _ext
from ._interop import accepts_arrays
from ._arrays import kernel_ready, to_3d, to_4d
from ._attention_checks import check_attention, check_packed
from ._key_index import with_key_index

__all__ = ["attention_backward", "attention_varlen_backward"]


def _check_like(name: str, x, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """x as an ndarray of exactly `shape` and `dtype` (what the forward returned)."""
    arr = np.asarray(x)
    if arr.shape != shape:
        raise ValueError(f"{name} must have shape {shape} (the forward's), got {arr.shape}")
    if arr.dtype != dtype:
        raise TypeError(f"{name} must have dtype {np.dtype(dtype)}, got {arr.dtype}")
    return arr


@accepts_arrays
def attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None, window=None,
                       softcap=None, alibi_slopes=None, sinks=None, mask=None,
                       num_threads=None, query_offset=None, key_index=None):
    """Gradients of :func:`attention` with respect to q, k and v (and the sinks).

    FlashAttention-2's backward, streamed: the probabilities are recomputed tile by tile
    from the forward's ``lse``, with ``D = rowsum(dout * out)`` and
    ``dS = P * (dP - D)``; no Tq x Tk array is built (scratch O((Tq + Tk) * D)). With
    ``key_index`` the tiles hold each query row's listed keys only (sparse attention).

    Parameters
    ----------
    dout : array like ``out``
        The gradient of the loss with respect to the forward's output.
    q, k, v : arrays
        The forward's inputs, one dtype (float32, float64, float16 or bfloat16).
    out, lse : arrays
        What ``attention(q, k, v, ..., return_lse=True)`` returned for these options.
    causal, scale, window, softcap, alibi_slopes, sinks, mask, query_offset
        The forward's options, meaning what they mean in :func:`attention`; they must be the
        ones ``out`` and ``lse`` were computed with. ALiBi slopes and masks get no gradient.
    key_index : integer array (.., Tq, k) or (.., Hkv, Tq, k), optional
        The forward's ``key_index`` (sparse attention): the gradients of attention over the
        listed keys, checked as in :func:`attention` (with ``alibi_slopes`` or ``mask``
        NotImplementedError). Only the listed K/V rows are read, with no Tq x Tk array;
        rows of dk, dv that no query sees are 0.
    num_threads : int, optional
        Defaults to :func:`attnfast.get_num_threads`. Results are bit-identical for any value:
        every gradient row is reduced by one task, in a fixed order.

    Returns
    -------
    (dq, dk, dv), shaped and typed like q, k, v (accumulated in float32, float64 for
    float64 inputs; GQA / MQA: dk, dv summed over the query heads of each KV head), or
    (dq, dk, dv, dsinks) when ``sinks`` is given: dsinks float32 (H,),
    ``dsinks[h] = -sum_{b, i} exp(sinks[h] - lse[b, h, i]) * D[b, h, i]``.
    Rows that see no key give zero gradients.
    """
    call = check_attention(q, k, v, causal=causal, scale=scale, window=window,
                           num_threads=num_threads, query_offset=query_offset, softcap=softcap,
                           alibi_slopes=alibi_slopes, sinks=sinks, mask=mask)
    call = with_key_index(call, key_index, call.seqlen_k)
    if call.kv_dtype != call.dtype:
        raise TypeError(f"attention_backward: q, k, v must share a dtype; got q {call.dtype}, "
                        f"k and v {call.kv_dtype}")
    acc = call.lse_dtype
    dout4 = kernel_ready(to_4d(_check_like("dout", dout, call.out_shape(), call.dtype)))
    out4 = to_4d(_check_like("out", out, call.out_shape(), call.dtype))
    lse3 = kernel_ready(to_3d(_check_like("lse", lse, call.lse_shape(), acc)))
    B, H, Hkv = call.batch, call.heads, call.kv_heads
    Tq, Tk, D, Dv = call.seqlen_q, call.seqlen_k, call.head_dim, call.head_dim_v
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite dout / out: NaN rows
        delta = np.einsum("bhtd,bhtd->bht", dout4.astype(acc, copy=False),
                          out4.astype(acc, copy=False))
    delta = np.ascontiguousarray(delta, dtype=acc)
    dq = np.empty((B, H, Tq, _ext.backward_head_dim(D)), acc)  # rows padded for the kernels
    dk = np.empty((B, Hkv, Tk, D), acc)
    dv = np.empty((B, Hkv, Tk, Dv), acc)
    opts = call.options
    _ext.run_attention(call.q, call.k, call.v, dout4, lse3, causal=call.causal,
                       scale=call.scale, window_left=call.window[0],
                       window_right=call.window[1], num_threads=call.num_threads,
                       query_offset=call.query_offset, softcap=opts.softcap, alibi=opts.alibi,
                       sinks=opts.sinks, mask=opts.mask, key_index=opts.key_index,
                       backward=(dout4, delta, dq, dk, dv))
    dq = np.ascontiguousarray(dq[..., :D])
    grads = tuple(g.astype(call.dtype, copy=False).reshape(np.shape(x))
                  for g, x in ((dq, q), (dk, k), (dv, v)))
    if opts.sinks is None:
        return grads
    # a row with lse = -inf saw nothing; a non-finite delta (NaN or inf in dout or out)
    # meets a zero sink probability there: NaN in, NaN out, without a warning
    with np.errstate(invalid="ignore", over="ignore"):
        p_sink = np.where(lse3 == -np.inf, 0, np.exp(opts.sinks.astype(acc)[None, :, None] - lse3))
        dsinks = -(p_sink * delta).sum(axis=(0, 2))
    return grads + (dsinks.astype(np.float32),)


@accepts_arrays
def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *,
                              max_seqlen_q=None, max_seqlen_k=None, causal=False, scale=None,
                              window=None, softcap=None, alibi_slopes=None, sinks=None,
                              num_threads=None):
    """Gradients of :func:`attnfast.attention_varlen` (packed sequences).

    ``dout`` and ``out`` are (total_q, H, Dv), ``lse`` (H, total_q), as
    ``attention_varlen(..., return_lse=True)`` returned them; the other arguments are those
    of that call. Each sequence runs :func:`attention_backward` on its own rows (a sequence
    reads and writes only its own tokens). Returns (dq, dk, dv) like q, k, v, or
    (dq, dk, dv, dsinks) with ``sinks`` (dsinks summed over the sequences).
    """
    q, k, v, cu_q, cu_k = check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k)
    total_q, heads = q.shape[:2]
    dout = _check_like("dout", dout, (total_q, heads, v.shape[2]), q.dtype)
    out = _check_like("out", out, (total_q, heads, v.shape[2]), q.dtype)
    lse = _check_like("lse", lse, (heads, total_q),
                      np.float64 if q.dtype == np.float64 else np.float32)
    batch = cu_q.shape[0] - 1
    slopes = [alibi_slopes] * batch
    if alibi_slopes is not None and np.ndim(alibi_slopes) == 2:
        if np.shape(alibi_slopes)[0] != batch:
            raise ValueError(f"alibi_slopes of shape {np.shape(alibi_slopes)} must be (H,) or "
                             f"(batch, H) with batch = {batch} sequences")
        slopes = list(alibi_slopes)

    def head_major(a, lo, hi):
        return a[lo:hi].transpose(1, 0, 2)

    options = dict(causal=causal, scale=scale, window=window, softcap=softcap, sinks=sinks,
                   num_threads=num_threads)
    # Every sequence is checked (by a call on its empty slice) before anything runs.
    for b in range(batch):
        attention_backward(head_major(dout, 0, 0), head_major(q, 0, 0), head_major(k, 0, 0),
                           head_major(v, 0, 0), head_major(out, 0, 0), lse[:, :0],
                           alibi_slopes=slopes[b], **options)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dsinks = None if sinks is None else np.zeros(heads, np.float32)
    for b in range(batch):
        (q0, q1), (k0, k1) = cu_q[b:b + 2], cu_k[b:b + 2]
        if q1 == q0:
            continue
        grads = attention_backward(
            head_major(dout, q0, q1), head_major(q, q0, q1), head_major(k, k0, k1),
            head_major(v, k0, k1), head_major(out, q0, q1), lse[:, q0:q1],
            alibi_slopes=slopes[b], **options)
        dq[q0:q1] = grads[0].transpose(1, 0, 2)
        dk[k0:k1] = grads[1].transpose(1, 0, 2)
        dv[k0:k1] = grads[2].transpose(1, 0, 2)
        if dsinks is not None:
            dsinks += grads[3]
    return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)
