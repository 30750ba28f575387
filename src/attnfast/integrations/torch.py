"""attnfast as ``torch.library`` custom operators, so that ``torch.compile`` sees them (optional).

    import attnfast.integrations.torch as aft
    out = aft.attention(q, k, v, causal=True)             # torch.ops.attnfast.attention
    out = aft.attention_with_kvcache(q, kc, vc, lens, k_new, v_new)

Tensor arguments may be passed by keyword or in the order of the signature (torch's custom
ops take no keyword-only tensors); options are keyword-only. Each function here *is* a custom op (``torch.library.custom_op``) with a fake (meta)
implementation giving the result's shape, dtype and strides, so ``torch.compile(...,
fullgraph=True)`` traces a call as one node instead of breaking the graph at the NumPy code
inside. Called eagerly, the op runs :func:`attnfast.attention` (and friends) on the tensors'
memory; arguments are checked exactly as there (TypeError / ValueError naming the argument,
nothing written on error). The plain functions :func:`attnfast.attention` etc. also take torch
tensors and cost less per call (no dispatcher); use these ops where a graph is traced.

:func:`attention` is differentiable (q, k, v and sinks; masks, ALiBi slopes and key_index
get no gradient; with key_index the backward reads only the listed keys): when gradients
are being recorded it runs the op ``attnfast::attention_lse``, whose forward also returns
the lse and whose backward (``torch.library.register_autograd``) is
:func:`attnfast.attention_backward` as the op ``attnfast::attention_backward``; so it
works under ``torch.autograd``, ``torch.autograd.gradcheck`` (float64) and ``torch.compile``.
Otherwise it runs the forward-only op ``attnfast::attention``.
:func:`attention_with_kvcache` is forward only (an inference step): gradients through it
raise a RuntimeError (torch's "no autograd formula was registered").

Importing this module imports torch (importing attnfast does not).
"""
from typing import Optional

import torch

import attnfast as _af

__all__ = ["attention", "attention_with_kvcache"]  # the ops: attention_forward, attention_lse, attention_backward

Tensor = torch.Tensor


def plain(t):
    """t, detached when it requires grad (the op itself records no gradient: its autograd
    entry is torch's; below it the kernels only read the memory). None stays None."""
    return t.detach() if t is not None and t.requires_grad else t


def _window(window):
    return None if window is None else tuple(window)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None,
              sinks: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
              key_index: Optional[Tensor] = None, *,
              causal: bool = False, scale: Optional[float] = None,
              window: Optional[list[int]] = None, query_offset: Optional[int] = None,
              softcap: Optional[float] = None, num_threads: Optional[int] = None) -> Tensor:
    """:func:`attnfast.attention` as a custom op, differentiable.

    Parameters
    ----------
    q, k, v : Tensor (Tq, D), (H, Tq, D) or (B, H, Tq, D); k, v with Hkv heads, H % Hkv == 0
    causal, scale, window, query_offset, softcap, alibi_slopes, sinks, mask, num_threads
        As in :func:`attnfast.attention` (``window`` a pair [left, right]; ``mask`` a bool
        or additive float tensor broadcastable to (.., H, Tq, Tk), read through its strides).
    key_index : integer Tensor (.., Tq, k) or (.., Hkv, Tq, k), optional
        Sparse attention over the listed keys, as in :func:`attnfast.attention`; it gets no
        gradient (the backward reads only the listed keys).

    Returns
    -------
    Tensor (.., H, Tq, Dv), dtype of q (a new tensor). When gradients are recorded for q, k,
    v or sinks, ``backward()`` computes them with :func:`attnfast.attention_backward`
    (deterministic: the same bits for any thread count).
    """
    options = dict(causal=causal, scale=scale, window=window, query_offset=query_offset,
                   softcap=softcap, num_threads=num_threads)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks)):
        return attention_lse(q, k, v, mask, sinks, alibi_slopes, key_index, **options)[0]
    return attention_forward(q, k, v, mask, sinks, alibi_slopes, key_index, **options)


@torch.library.custom_op("attnfast::attention", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None,
                      sinks: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
                      key_index: Optional[Tensor] = None, *,
                      causal: bool = False, scale: Optional[float] = None,
                      window: Optional[list[int]] = None, query_offset: Optional[int] = None,
                      softcap: Optional[float] = None, num_threads: Optional[int] = None) -> Tensor:
    """The custom op ``attnfast::attention``: :func:`attention` with no gradient."""
    return _af.attention(plain(q), plain(k), plain(v), causal=causal, scale=scale,
                         window=_window(window), query_offset=query_offset, softcap=softcap,
                         alibi_slopes=plain(alibi_slopes), sinks=plain(sinks), mask=plain(mask),
                         key_index=key_index, num_threads=num_threads)


@attention_forward.register_fake
def _attention_fake(q, k, v, mask=None, sinks=None, alibi_slopes=None, key_index=None, **options):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


@torch.library.custom_op("attnfast::attention_lse", mutates_args=())
def attention_lse(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None,
                  sinks: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
                  key_index: Optional[Tensor] = None, *,
                  causal: bool = False, scale: Optional[float] = None,
                  window: Optional[list[int]] = None, query_offset: Optional[int] = None,
                  softcap: Optional[float] = None,
                  num_threads: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """The custom op ``attnfast::attention_lse``: (out, lse) of :func:`attnfast.attention`
    (lse float32, float64 for float64 inputs), differentiable in q, k, v and sinks."""
    return _af.attention(plain(q), plain(k), plain(v), causal=causal, scale=scale,
                         window=_window(window), query_offset=query_offset, softcap=softcap,
                         alibi_slopes=plain(alibi_slopes), sinks=plain(sinks), mask=plain(mask),
                         key_index=key_index, num_threads=num_threads, return_lse=True)


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@attention_lse.register_fake
def _attention_lse_fake(q, k, v, mask=None, sinks=None, alibi_slopes=None, key_index=None,
                        **options):
    return (q.new_empty(q.shape[:-1] + v.shape[-1:]),
            q.new_empty(q.shape[:-1], dtype=_lse_dtype(q)))


@torch.library.custom_op("attnfast::attention_backward", mutates_args=())
def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       mask: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                       alibi_slopes: Optional[Tensor] = None,
                       key_index: Optional[Tensor] = None, *, causal: bool = False,
                       scale: Optional[float] = None, window: Optional[list[int]] = None,
                       query_offset: Optional[int] = None, softcap: Optional[float] = None,
                       num_threads: Optional[int] = None
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The custom op ``attnfast::attention_backward``: :func:`attnfast.attention_backward`,
    returning (dq, dk, dv, dsinks); dsinks is empty (0,) without sinks."""
    grads = _af.attention_backward(
        plain(dout).contiguous(), plain(q), plain(k), plain(v), plain(out), plain(lse),
        causal=causal, scale=scale, window=_window(window), query_offset=query_offset,
        softcap=softcap, alibi_slopes=plain(alibi_slopes), sinks=plain(sinks),
        mask=plain(mask), key_index=key_index, num_threads=num_threads)
    dsinks = grads[3] if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    return grads[0], grads[1], grads[2], dsinks


@attention_backward.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, mask=None, sinks=None, alibi_slopes=None,
                             key_index=None, **options):
    dsinks = q.new_empty(sinks.shape if sinks is not None else (0,), dtype=torch.float32)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks)


_OPTIONS = ("causal", "scale", "window", "query_offset", "softcap", "num_threads")


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, mask, sinks, alibi_slopes, key_index = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], mask, sinks, alibi_slopes, key_index)
    ctx.options = {name: keyword_only_inputs.get(name) for name in _OPTIONS}
    ctx.options["causal"] = bool(ctx.options["causal"])
    ctx.mark_non_differentiable(output[1])  # lse: no gradient flows back through it


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, mask, sinks, alibi_slopes, key_index = ctx.saved_tensors
    dq, dk, dv, dsinks = attention_backward(dout, q, k, v, out, lse, mask, sinks, alibi_slopes,
                                            key_index, **ctx.options)
    return dq, dk, dv, None, dsinks if sinks is not None else None, None, None


attention_lse.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("attnfast::attention_with_kvcache",
                         mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"))
def attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                           k_new: Optional[Tensor] = None, v_new: Optional[Tensor] = None,
                           k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None,
                           block_table: Optional[Tensor] = None, mask: Optional[Tensor] = None,
                           sinks: Optional[Tensor] = None,
                           alibi_slopes: Optional[Tensor] = None, *, causal: bool = True,
                           scale: Optional[float] = None, window: Optional[list[int]] = None,
                           softcap: Optional[float] = None, num_threads: Optional[int] = None,
                           query_offset: Optional[int] = None) -> Tensor:
    """:func:`attnfast.attention_with_kvcache` (the KV-cache decode step: write the new
    tokens, attend over the cache) as the custom op ``attnfast::attention_with_kvcache``.

    Parameters
    ----------
    q : Tensor (B, H, Tq, D)
    k_cache, v_cache : Tensor (B, Hkv, capacity, D|Dv), or paged pools with ``block_table``;
        written in place when k_new / v_new are given (declared mutated to the compiler)
    cache_seqlens : integer Tensor (B,), tokens already cached per sequence (not modified)
    k_new, v_new, causal, scale, window, softcap, alibi_slopes, sinks, mask, num_threads,
    query_offset, k_scale, v_scale, block_table
        As in :func:`attnfast.attention_with_kvcache`.

    Returns
    -------
    Tensor (B, H, Tq, Dv), dtype of q (a new tensor).
    """
    return _kvcache_kernel(q, k_cache, v_cache, cache_seqlens, k_new, v_new, k_scale, v_scale,
                           block_table, mask, sinks, alibi_slopes, causal=causal, scale=scale,
                           window=window, softcap=softcap, num_threads=num_threads,
                           query_offset=query_offset)


def _kvcache_kernel(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, k_scale=None,
                    v_scale=None, block_table=None, mask=None, sinks=None, alibi_slopes=None, *,
                    causal=True, scale=None, window=None, softcap=None, num_threads=None,
                    query_offset=None):
    """The kernel of ``attnfast::attention_with_kvcache`` (its arguments as the dispatcher
    passes them)."""
    return _af.attention_with_kvcache(
        plain(q), k_cache, v_cache, cache_seqlens, plain(k_new), plain(v_new), causal=causal,
        scale=scale, window=_window(window), softcap=softcap,
        alibi_slopes=plain(alibi_slopes), sinks=plain(sinks), mask=plain(mask),
        num_threads=num_threads, query_offset=query_offset, k_scale=k_scale, v_scale=v_scale,
        block_table=block_table)


# A tensor with the negative or conjugate bit would otherwise meet torch's fallback for them,
# which hands the op a resolved clone of each such mutated argument (k_cache, ...) and copies
# it back only for ops that return it (this one fails an internal assert instead, its writes
# left in the clone). The op's own kernel takes such calls: attnfast reads a read argument
# with the bit through a copy and refuses a written one by name (attnfast._written.
# check_written), as the plain attnfast.attention_with_kvcache does (issue 45.2).
_MATH_BITS = torch.library.Library("attnfast", "IMPL")
for _key in ("Negative", "Conjugate"):
    _MATH_BITS.impl("attention_with_kvcache", _kvcache_kernel, _key)


@attention_with_kvcache.register_fake
def _attention_with_kvcache_fake(q, k_cache, v_cache, cache_seqlens, *tensors, **options):
    return q.new_empty(q.shape[:-1] + v_cache.shape[-1:])
