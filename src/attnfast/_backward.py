"""attention_backward: the gradients of attention (FlashAttention-2's backward, streamed)."""
from __future__ import annotations

import numpy as np

from . import _ext
from ._interop import accepts_arrays
from ._checks import check_attention, kernel_ready, to_3d, to_4d

__all__ = ["attention_backward"]


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
                       num_threads=None, query_offset=None):
    """Gradients of :func:`attention` with respect to q, k and v (and the sinks).

    FlashAttention-2's backward, streamed: the probabilities are recomputed tile by tile
    from the forward's ``lse``, with ``D = rowsum(dout * out)`` and
    ``dS = P * (dP - D)``; no Tq x Tk array is built (scratch O((Tq + Tk) * D)).

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
    if call.kv_dtype != call.dtype:
        raise TypeError(f"attention_backward: q, k, v must share a dtype; got q {call.dtype}, "
                        f"k and v {call.kv_dtype}")
    acc = call.lse_dtype
    dout4 = kernel_ready(to_4d(_check_like("dout", dout, call.out_shape(), call.dtype)))
    out4 = to_4d(_check_like("out", out, call.out_shape(), call.dtype))
    lse3 = kernel_ready(to_3d(_check_like("lse", lse, call.lse_shape(), acc)))
    B, H, Hkv = call.batch, call.heads, call.kv_heads
    Tq, Tk, D, Dv = call.seqlen_q, call.seqlen_k, call.head_dim, call.head_dim_v
    delta = np.einsum("bhtd,bhtd->bht", dout4.astype(acc, copy=False),
                      out4.astype(acc, copy=False))
    delta = np.ascontiguousarray(delta, dtype=acc)
    dq = np.empty((B, H, Tq, D), acc)
    dk = np.empty((B, Hkv, Tk, D), acc)
    dv = np.empty((B, Hkv, Tk, Dv), acc)
    opts = call.options
    _ext.run_attention(call.q, call.k, call.v, dout4, lse3, causal=call.causal,
                       scale=call.scale, window_left=call.window[0],
                       window_right=call.window[1], num_threads=call.num_threads,
                       query_offset=call.query_offset, softcap=opts.softcap, alibi=opts.alibi,
                       sinks=opts.sinks, mask=opts.mask, backward=(dout4, delta, dq, dk, dv))
    grads = tuple(g.astype(call.dtype, copy=False).reshape(np.shape(x))
                  for g, x in ((dq, q), (dk, k), (dv, v)))
    if opts.sinks is None:
        return grads
    with np.errstate(invalid="ignore", over="ignore"):  # a row with lse = -inf saw nothing
        p_sink = np.where(lse3 == -np.inf, 0, np.exp(opts.sinks.astype(acc)[None, :, None] - lse3))
    dsinks = -(p_sink * delta).sum(axis=(0, 2))
    return grads + (dsinks.astype(np.float32),)
