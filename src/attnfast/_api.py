"""Public attention functions: check (attnfast._attention_checks), then run the C++ kernels."""
from __future__ import annotations

import numpy as np

from . import _ext
from ._interop import accepts_arrays
from ._key_index import with_key_index
from ._arrays import kernel_ready, to_3d, to_4d
from ._attention_checks import check_attention
from ._descriptors import KernelPart
from ._formats import BFLOAT16, FLOAT16, FLOAT32, FLOAT64
from ._plans import attention_key, attention_plan, ATTENTION_PLANS, remember
from ._scalars import check_flag
from ._written import check_out

kernels_interruptible = _ext.kernels_interruptible  # whether Ctrl-C may stop a call's kernels

__all__ = ["attention", "attention_weights", "merge_attention_states"]

_MASK_DRAWING = """
    Masks (Tq=3 query rows, Tk=5 keys; x = may attend). causal is aligned bottom-right, so
    the last query sees every key (flash-attn >= 2.1; what decoding with a KV cache needs):

        causal=True               window=(1, 0)             window=(1, 1), causal=False
        k: 0 1 2 3 4              k: 0 1 2 3 4              k: 0 1 2 3 4
        q0 x x x . .              q0 . x x . .              q0 . x x x .
        q1 x x x x .              q1 . . x x .              q1 . . x x x
        q2 x x x x x              q2 . . . x x              q2 . . . x x

    Query i is aligned to key i' = i + (Tk - Tq); with Tq > Tk the first rows see no key
    and give zeros (lse = -inf).
"""


@accepts_arrays
def attention(q, k, v, *, causal=False, scale=None, window=None, softcap=None,
              alibi_slopes=None, sinks=None, mask=None, return_lse=False, out=None,
              num_threads=None, query_offset=None, key_index=None):
    """Exact scaled dot-product attention, streamed: the Tq x Tk matrix is never built.

    ``out[.., h, i, :] = sum_j softmax_j(scale * q[.., h, i, :] . k[.., g, j, :]) v[.., g, j, :]``
    with ``g = h // (H // Hkv)`` (GQA/MQA).

    Parameters
    ----------
    q : array (Tq, D), (H, Tq, D) or (B, H, Tq, D)
    k : array (.., Hkv, Tk, D), same rank and dtype as q; H % Hkv == 0
    v : array (.., Hkv, Tk, Dv)
        float32, float64, float16 or bfloat16 (a float32 q may read float16 / bfloat16 k, v).
        Any strides on the non-last axes are used without a copy, so a
        (B, T, H, D) array passes as ``x.transpose(0, 2, 1, 3)`` at no cost.
    causal : bool
        Query i sees key j iff j <= i + (Tk - Tq) (bottom-right aligned).
    scale : float, default 1/sqrt(D)
    window : (left, right) or None
        Query i sees keys in [i' - left, i' + right], i' = i + (Tk - Tq); -1 = unbounded.
    query_offset : int, optional
        Where the queries sit among the keys: query i is at key position
        ``i' = i + query_offset`` (causal and window are measured from there). The default,
        ``Tk - Tq``, aligns the last query with the last key (bottom-right); 0 aligns the
        first query with the first key (top-left: a prompt written into an empty, larger
        cache). Any int with abs(value) <= 2**62.
    softcap : float > 0, optional
        Scores s become softcap * tanh(s / softcap) (Gemma 2), before ALiBi and the mask.
    alibi_slopes : float32 array (H,) or (B, H), optional
        Adds -slope * abs(i' - j) to the score of query i and key j (i' as for causal).
    sinks : float32 array (H,), optional
        One logit per query head that joins the softmax denominator and adds no value
        (gpt-oss); lse includes it, and a row seeing no key gets lse = sink.
    mask : array broadcastable to (B, H, Tq, Tk), optional
        bool (True keeps the key) or additive float (float32 or q's dtype), read through its
        broadcast strides (never expanded); combined with causal and window. On the KV-cache
        paths its last axis spans the cache's capacity.
    return_lse : bool
        Also return the natural-log log-sum-exp of each row's scaled scores, shape
        (.., H, Tq), float32 (float64 for float64 inputs); -inf for a row that sees no key.
    key_index : integer array (.., Tq, k) or (.., Hkv, Tq, k), optional
        Sparse attention (DeepSeek-V3.2's and GLM-5's DSA): each query attends only over the
        key positions its row lists (int32; -1 = none; distinct, each below Tk), one list
        per query shared by every head (q's leading axes, then Tq, k) or one per KV head.
        A listed key that causal or window hides stays hidden; only the listed K/V rows are
        read. Takes softcap and sinks; with alibi_slopes or mask NotImplementedError.
        docs/user_guide/sparse.md.
    out : array (.., H, Tq, Dv), optional
        Written in place and returned; must not overlap q, k or v.
    num_threads : int, optional
        Defaults to :func:`attnfast.get_num_threads`. Results are bit-identical for any value.

    Returns
    -------
    out, or (out, lse) when return_lse.
    """
    # The fast path: a plan for this call's layout and options (the key decides whether one
    # can serve it at all: attnfast._ext.attention_key), then the per-call checks, in C.
    key = attention_key(q, k, v, out, causal, scale, window, return_lse,
                        (softcap, alibi_slopes, sinks, mask, key_index))
    plan = ATTENTION_PLANS.get(key) if key is not None else None
    if plan is not None:
        result = _ext.attention_fast(plan, q, k, v, out, causal, num_threads, query_offset)
        if result is not None:
            return result
    return_lse = check_flag(return_lse, "return_lse")
    call = check_attention(q, k, v, causal=causal, scale=scale, window=window,
                           num_threads=num_threads, query_offset=query_offset, softcap=softcap,
                           alibi_slopes=alibi_slopes, sinks=sinks, mask=mask)
    call = with_key_index(call, key_index, call.seqlen_k)
    user_out = check_out(out, call.out_shape(), call.dtype,
                         [("q", call.q), ("k", call.k), ("v", call.v)] + call.options.arrays())
    result = run_kernels(call, user_out, return_lse)
    if key is not None:  # accepted: later calls of this layout take the fast path
        remember(ATTENTION_PLANS, key, attention_plan(call, q, k, v, out, window, return_lse))
    return result


attention.__doc__ += _MASK_DRAWING


def run_kernels(call, user_out, return_lse, parts=None):
    """Run the C++ kernels for a checked call and return out (and lse).

    ``parts`` lists the kernel calls (KernelPart); by default one call over everything
    with ``call.k`` and ``call.v``.
    """
    target = user_out if user_out is not None else np.empty(call.out_shape(), call.dtype)
    target4 = to_4d(target)
    # The kernels need a contiguous last axis; a strided `out` is filled from a temporary.
    result4 = target4 if kernel_ready(target4) is target4 else np.empty(target4.shape, call.dtype)
    lse = np.empty(call.lse_shape(), call.lse_dtype) if return_lse else None
    lse3 = None if lse is None else to_3d(lse)
    # Ctrl-C stops the kernels early only in the main thread, which alone receives it, and
    # only under Python's default SIGINT handler: an ignored SIGINT (e.g. a background job)
    # or a handler of the caller's own must not cut a computation short.
    interruptible = kernels_interruptible()
    for part in parts or [KernelPart(k=call.k, v=call.v)]:
        args, kwargs = kernel_call(call, part)
        rows = part.rows
        _ext.run_attention(*args, result4[rows], None if lse3 is None else lse3[rows],
                           interruptible=interruptible, **kwargs)
    if result4 is not target4:
        np.copyto(target4, result4)
    return (target, lse) if return_lse else target


def kernel_call(call, part):
    """The arguments of _ext.run_attention (and of _ext.plan_attention) for one part of a
    checked call (see run_kernels), but out, lse and interruptible: ((q, k, v), keywords)."""
    seqlens, options = part.seqlens, call.options.rows(part.rows)
    return (call.q[part.rows], kernel_ready(part.k), kernel_ready(part.v)), dict(
        causal=call.causal, scale=call.scale, window_left=call.window[0],
        window_right=call.window[1], num_threads=call.num_threads,
        seqlens_k=None if seqlens is None else np.ascontiguousarray(seqlens, dtype=np.int64),
        k_scale=part.k_scale, v_scale=part.v_scale, query_offset=call.query_offset,
        softcap=options.softcap, alibi=options.alibi, sinks=options.sinks, mask=options.mask,
        block_table=part.block_table, head_dim_v=call.head_dim_v,  # (read for int4 caches only)
        key_index=options.key_index)


def _visible(call) -> np.ndarray:
    """(Tq, Tk) boolean: which keys each query row may see (causal, window)."""
    shift = call.seqlen_k - call.seqlen_q if call.query_offset is None else call.query_offset
    rows = np.arange(call.seqlen_q)[:, None] + shift
    keys = np.arange(call.seqlen_k)[None, :]
    left, right = call.window
    keep = np.ones((call.seqlen_q, call.seqlen_k), dtype=bool)
    if call.causal:
        keep &= keys <= rows
    if right >= 0:
        keep &= keys <= rows + right
    if left >= 0:
        keep &= keys >= rows - left
    return keep


@accepts_arrays
def attention_weights(q, k, *, causal=False, scale=None, window=None, softcap=None,
                      alibi_slopes=None, sinks=None, mask=None, num_threads=None,
                      query_offset=None):
    """The explicit attention probabilities, shape (.., H, Tq, Tk), dtype of q.

    For inspection and teaching on small inputs: unlike :func:`attention` this materialises
    the full Tq x Tk matrix per head, by design. Options mean what they mean in
    :func:`attention` (with ``sinks`` a row's weights sum to less than 1: the sink takes the
    rest); rows that see no key are all zeros. ``num_threads`` is accepted for symmetry and
    checked, but this NumPy computation does not use it.
    """
    call = check_attention(q, k, None, causal=causal, scale=scale, window=window,
                           num_threads=num_threads, need_v=False, query_offset=query_offset,
                           softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, mask=mask)
    shape = call.out_shape()[:-1] + (call.seqlen_k,)
    if call.heads == 0 or call.seqlen_q == 0 or call.batch == 0:
        return np.zeros(shape, call.dtype)
    group = call.heads // call.kv_heads
    k_per_head = np.repeat(call.k, group, axis=1) if group > 1 else call.k
    compute = np.float64 if call.dtype == np.float64 else np.float32  # never in 16 bits
    opts = call.options
    shift = call.seqlen_k - call.seqlen_q if call.query_offset is None else call.query_offset
    # Non-finite or huge inputs give non-finite scores here (inf * 0, inf - inf, a product
    # past the compute dtype's range): expected, and carried to NaN / zero weights below as
    # the kernels carry them (NaN in, NaN out), not conditions to warn about.
    with np.errstate(invalid="ignore", over="ignore"):
        scores = np.matmul(call.q.astype(compute, copy=False),
                           np.swapaxes(k_per_head.astype(compute, copy=False), -1, -2))
        scores = scores * compute(call.scale)
        if opts.softcap:
            scores = compute(opts.softcap) * np.tanh(scores / compute(opts.softcap))
        if opts.alibi is not None:
            dist = np.abs(np.arange(call.seqlen_q)[:, None] + shift
                          - np.arange(call.seqlen_k)[None, :])
            scores = scores - opts.alibi.astype(compute)[:, :, None, None] * dist.astype(compute)
        if opts.mask is not None:
            if opts.mask.dtype == np.bool_:
                scores = np.where(opts.mask, scores, -np.inf)
            else:
                scores = scores + opts.mask.astype(compute, copy=False)
    keep = _visible(call)
    scores = np.where(keep, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True, initial=-np.inf)
    if opts.sinks is not None:
        sink = opts.sinks.astype(compute)[None, :, None, None]
        row_max = np.maximum(row_max, sink)
    safe_max = np.where(np.isfinite(row_max), row_max, 0)
    with np.errstate(invalid="ignore", over="ignore"):
        weights = np.exp(scores - safe_max)
        total = weights.sum(axis=-1, keepdims=True)
        if opts.sinks is not None:
            total = total + np.exp(sink - safe_max)
        weights = np.divide(weights, total, out=np.zeros_like(weights), where=total != 0)
    return weights.astype(call.dtype, copy=False).reshape(call.out_shape()[:-1] + (call.seqlen_k,))


@accepts_arrays
def merge_attention_states(outs, lses):
    """Combine attention computed over disjoint KV shards into attention over their union.

    ``outs[i]`` has shape (.., H, Tq, Dv) and ``lses[i]`` shape (.., H, Tq), as returned by
    ``attention(..., return_lse=True)`` over shard i of the keys. Returns ``(out, lse)``
    equal to one ``attention`` over all shards (split-KV decoding, prefix sharing,
    sequence-parallel attention). Shards whose row saw no key (lse = -inf) contribute nothing.
    """
    for name, seq in (("outs", outs), ("lses", lses)):
        if isinstance(seq, (str, bytes)) or not hasattr(seq, "__iter__"):
            raise TypeError(f"{name} must be a sequence of arrays (one per shard), got "
                            f"{type(seq).__name__}")
    if isinstance(outs, np.ndarray) or isinstance(lses, np.ndarray):
        raise TypeError("outs and lses must be sequences of arrays (one per shard), "
                        "not single arrays")
    outs, lses = list(outs), list(lses)
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"outs and lses must be non-empty and of equal length; got "
                         f"{len(outs)} outs and {len(lses)} lses")
    outs = [np.asarray(o) for o in outs]
    lses = [np.asarray(s) for s in lses]
    dtype = outs[0].dtype
    if dtype not in (FLOAT32, FLOAT64, FLOAT16, BFLOAT16):
        raise TypeError(f"outs must be float32, float64, float16 or bfloat16, got {dtype}")
    lse_dtype = np.float64 if dtype == np.float64 else np.float32
    for i, (o, s) in enumerate(zip(outs, lses)):
        if o.dtype != dtype:
            raise TypeError(f"outs[{i}] has dtype {o.dtype}, outs[0] has {dtype}")
        if s.dtype != lse_dtype:
            raise TypeError(f"lses[{i}] must have dtype {np.dtype(lse_dtype)} for {dtype} outs, got {s.dtype}")
        if o.shape != outs[0].shape:
            raise ValueError(f"outs[{i}] has shape {o.shape}, outs[0] has {outs[0].shape}")
        if o.ndim < 1 or s.shape != o.shape[:-1]:
            raise ValueError(f"lses[{i}] must have shape {o.shape[:-1]} (outs[{i}] without its "
                             f"last axis), got {s.shape}")
    lse_stack = np.stack(lses)                       # (S, .., Tq)
    # The largest lse that is not NaN (fmax skips NaN; NaN only where every shard's is): a
    # NaN shard must not hide the others' maximum, or exp(lse - 0) of a large finite lse
    # would overflow beside it. A NaN shard's weight stays NaN (NaN in, NaN out).
    top = np.fmax.reduce(lse_stack, axis=0)
    infinite_top = top == np.inf
    safe_top = np.where(np.isfinite(top), top, 0)
    shifted = lse_stack - safe_top                   # <= 0 where not NaN, for a finite top
    if infinite_top.any():  # a +inf lse takes all the weight: 1 for +inf shards, 0 for others
        plus_inf = np.isinf(lse_stack) & (lse_stack > 0)
        shifted = np.where(infinite_top, np.where(plus_inf, 0.0, -np.inf), shifted)
        shifted = np.where(np.isnan(lse_stack), np.nan, shifted)
    w = np.exp(shifted)                              # 0 for shards that saw nothing
    total = w.sum(axis=0)
    # total == 0: no shard saw a key (zeros, -inf); NaN (a NaN lse) stays NaN in out and lse
    seen = total != 0
    merged_lse = np.where(seen, safe_top + np.log(np.where(seen, total, 1)), -np.inf)
    merged_lse = np.where(infinite_top & ~np.isnan(total), np.inf, merged_lse)
    acc = np.zeros(outs[0].shape, dtype=lse_dtype)
    # Non-finite outs are expected here (NaN or inf in v gives them): 0 * inf and inf - inf
    # are NaN, the answer the rule wants (NaN in, NaN out), not a condition to warn about.
    with np.errstate(invalid="ignore", over="ignore"):
        for wi, o in zip(w, outs):
            acc += wi[..., None] * o.astype(lse_dtype, copy=False)
        out = np.divide(acc, total[..., None], out=np.zeros_like(acc), where=seen[..., None])
    return out.astype(dtype, copy=False), merged_lse.astype(lse_dtype, copy=False)
