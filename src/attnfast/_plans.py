"""Plans: what the full checks concluded about a call's layout, memoised, so that repeat
calls of that layout take the fast path (attnfast._ext's C tails)."""
from __future__ import annotations

from . import _ext
from ._arrays import _compute_dtype, as_float_array, is_quantized, kernel_ready
from ._cache_checks import is_int4_storage
from ._descriptors import AttentionCall
from ._scalars import check_scale, check_window

# A model calls attention once per layer per generated token, with the same shapes every
# time, and the full checks cost more than a short decode kernel. What they conclude
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


# The plan keys are built in C (attnfast._ext: one bytes object for the arrays' shapes,
# strides and dtypes, the options with their exact types).
attention_key, kvcache_key, seqlens_key = _ext.attention_key, _ext.kvcache_key, _ext.seqlens_key
Plan = _ext.Plan


def attention_plan(call: AttentionCall, q, k, v, out, window, return_lse=False):
    """attention(): what a repeat call needs from the accepted `call` (a Plan), or None unless
    the kernels took q, k, v (4-D) and out as given."""
    if call.rank != 4 or call.q is not q or call.k is not k or call.v is not v:
        return None
    if out is not None and kernel_ready(out) is not out:
        return None
    return Plan(out_shape=call.out_shape(), dtype=call.dtype, scale=call.scale,
                window=check_window(window), seqlen_k=call.seqlen_k,
                lse_dtype=call.lse_dtype if return_lse else None)


def paged_plan(call, q, k_scale, v_scale, window=None, return_lse=False):
    """What a repeat paged call (attention_with_kvcache(block_table=...), no new tokens) needs
    from a call the full path accepted: a Plan holding the checked call itself (its q,
    lengths and table replaced per call, for the shared-prefix composition); None with new
    tokens, for int4 pools, and unless the kernels took q and the scales as given."""
    if (call.new_tokens or is_int4_storage(call.k_cache) or as_float_array(q, "q") is not q
            or kernel_ready(q) is not q or call.attn.q is not q
            or call.k_scale is not k_scale or call.v_scale is not v_scale):
        return None
    attn = call.attn
    return Plan(out_shape=attn.out_shape(), dtype=attn.dtype, scale=attn.scale,
                window=check_window(window), seqlen_k=attn.seqlen_k,
                lse_dtype=attn.lse_dtype if return_lse else None, call=call)


def kvcache_plan(q, k_cache, v_cache, k_new, out, scale, window, return_lse):
    """What a repeat call needs from a call the full path accepted (a Plan: new tokens, the
    output, scale, window as checked, the capacity the window is bounded by); None for
    int8 / float8 / int4 caches (quantised on write) and unless the kernels took q, the
    caches and `out` (if given) as given."""
    if (is_quantized(k_cache.dtype) or as_float_array(q, "q") is not q or kernel_ready(q) is not q
            or kernel_ready(k_cache) is not k_cache or kernel_ready(v_cache) is not v_cache
            or (out is not None and kernel_ready(out) is not out)):
        return None
    B, H, Tq, D = q.shape
    return Plan(out_shape=(B, H, Tq, v_cache.shape[3]), dtype=q.dtype,
                scale=check_scale(scale, D, q.dtype), window=check_window(window),
                seqlen_k=k_cache.shape[2], lse_dtype=_compute_dtype(q.dtype) if return_lse else None,
                new_tokens=0 if k_new is None else k_new.shape[2])
