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

Forward only: no backward is registered yet. Gradients through an op raise a RuntimeError
when ``backward()`` reaches it (torch's "no autograd formula was registered"), never zero or
wrong gradients.

Importing this module imports torch (importing attnfast does not).
"""
from typing import Optional

import torch

import attnfast as _af

__all__ = ["attention", "attention_with_kvcache"]

Tensor = torch.Tensor


def plain(t):
    """t, detached when it requires grad (the op itself records no gradient: its autograd
    entry is torch's; below it the kernels only read the memory). None stays None."""
    return t.detach() if t is not None and t.requires_grad else t


def _window(window):
    return None if window is None else tuple(window)


@torch.library.custom_op("attnfast::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None,
              sinks: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None, *,
              causal: bool = False, scale: Optional[float] = None,
              window: Optional[list[int]] = None, query_offset: Optional[int] = None,
              softcap: Optional[float] = None, num_threads: Optional[int] = None) -> Tensor:
    """:func:`attnfast.attention` as the custom op ``attnfast::attention``.

    Parameters
    ----------
    q, k, v : Tensor (Tq, D), (H, Tq, D) or (B, H, Tq, D); k, v with Hkv heads, H % Hkv == 0
    causal, scale, window, query_offset, softcap, alibi_slopes, sinks, mask, num_threads
        As in :func:`attnfast.attention` (``window`` a pair [left, right]; ``mask`` a bool
        or additive float tensor broadcastable to (.., H, Tq, Tk), read through its strides).

    Returns
    -------
    Tensor (.., H, Tq, Dv), dtype of q (a new tensor).
    """
    return _af.attention(plain(q), plain(k), plain(v), causal=causal, scale=scale,
                         window=_window(window), query_offset=query_offset, softcap=softcap,
                         alibi_slopes=plain(alibi_slopes), sinks=plain(sinks), mask=plain(mask),
                         num_threads=num_threads)


@attention.register_fake
def _attention_fake(q, k, v, mask=None, sinks=None, alibi_slopes=None, **options):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


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
    return _af.attention_with_kvcache(
        plain(q), k_cache, v_cache, cache_seqlens, plain(k_new), plain(v_new), causal=causal,
        scale=scale, window=_window(window), softcap=softcap,
        alibi_slopes=plain(alibi_slopes), sinks=plain(sinks), mask=plain(mask),
        num_threads=num_threads, query_offset=query_offset, k_scale=k_scale, v_scale=v_scale,
        block_table=block_table)


@attention_with_kvcache.register_fake
def _attention_with_kvcache_fake(q, k_cache, v_cache, cache_seqlens, *tensors, **options):
    return q.new_empty(q.shape[:-1] + v_cache.shape[-1:])
