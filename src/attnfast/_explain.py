"""attnfast.explain: which kernel a call would run, and how its work would be split."""
from __future__ import annotations

from . import _ext
from ._api import kernel_call
from ._key_index import with_key_index as attach_key_index
from ._kvcache import with_key_index
from ._attention_checks import check_attention
from ._cache_checks import caller_caches, check_kvcache_attention, check_paged_kvcache_attention
from ._descriptors import KernelPart
from ._shared_prefix import plan_shared_prefix

__all__ = ["explain"]


def explain(q, k, v, *, cache_seqlens=None, k_new=None, v_new=None, k_scale=None,
            v_scale=None, block_table=None, causal=None, scale=None, window=None,
            softcap=None, alibi_slopes=None, sinks=None, mask=None, return_lse=False,
            out=None, num_threads=None, query_offset=None, v_head_dim=None, key_index=None):
    """What the kernels would do for a call, computing nothing.

    ``explain(q, k, v, **options)`` describes ``attention(q, k, v, **options)``; with
    ``cache_seqlens`` it describes ``attention_with_kvcache(q, k, v, cache_seqlens, ...)``
    instead (``k``, ``v`` are then the caches, or with ``block_table`` the paged pools).
    The arguments are checked exactly as those functions check them (and raise the same
    errors); nothing is computed and nothing is written (``k_new`` / ``v_new`` only count as
    new tokens). The answer comes from the C++ planning code the drivers themselves use to
    pick a kernel, on the tier in use now (``ATTNFAST_ISA`` forces one).

    Parameters
    ----------
    q, k, v
        As in :func:`attnfast.attention`, or, with ``cache_seqlens``, the caches of
        :func:`attnfast.attention_with_kvcache`.
    cache_seqlens, k_new, v_new, k_scale, v_scale, block_table, v_head_dim : optional
        As in :func:`attnfast.attention_with_kvcache`; ``cache_seqlens`` selects it (the
        others need it).
    causal : bool, optional
        Defaults to the described function's default: False for ``attention``, True over a
        KV cache.
    scale, window, softcap, alibi_slopes, sinks, mask, return_lse, out, num_threads, query_offset
        As in the described function (``return_lse`` and ``out`` do not change the plan).
    key_index : optional
        As in the described function: the call then runs on the decode path, one problem
        per query row (the plan is that of the first), over the listed keys.

    Returns
    -------
    dict with keys

    ``tier`` : str
        The kernel tier (``attnfast.show_config()``'s ISA), e.g. ``"avx512"``.
    ``path`` : str
        ``"prefill"`` (more than 16 query rows) or ``"decode"``.
    ``kernel`` : str
        The micro-kernel: ``"simd_prefill"``, ``"bf16_prefill"``, ``"simd_decode"``,
        ``"bf16_decode"`` (the hand-written ones), ``"template_prefill"``,
        ``"template_decode"`` (the portable templates) or ``"template_f64"`` (float64).
    ``kv_source`` : str
        ``"contiguous"`` or ``"paged"``, followed by ``", indexed"`` with ``key_index`` (the
        listed rows gathered chunk by chunk).
    ``split`` : dict or None
        Decode only: ``chunk_keys`` (keys per chunk; fixed by the shapes and the L2 size,
        never by the thread count), ``chunks`` (most chunks any (batch entry, KV head) is
        split into), ``head_groups`` (most groups any KV head's query heads are split into:
        a compute-shaped kernel splits them, at least 32 rows a group, while the call has at
        most half as many tasks as threads; a row's bits do not depend on its group) and
        ``tasks`` (chunks x groups over all of them); None for prefill.
    ``tasks`` : int
        Work items the threads share (prefill: query blocks; decode: chunks, or merges
        when there are more of those).
    ``threads`` : int
        Threads the call would run on when no other call is running.
    ``regime`` : str
        ``"bandwidth"``: a decode kernel that streams K/V once per step with a dot product per
        query row (bound by memory); ``"compute"``: the prefill kernels, and the GEMM-shaped
        decode kernels the planner picks for many query rows per KV head (bound by
        arithmetic: the rows blocked as a small GEMM): ``"latent_decode"`` for an MLA latent
        cache, ``"gemm_decode"`` for separate K and V from 16 rows on the AVX-512 tiers, 32
        on AVX2 and NEON (GQA with several query tokens: trees, multi-token prediction,
        stacked shared-prefix forks).
    ``latent_kv`` : bool
        ``v`` is a prefix view of ``k``'s last axis (``v = k[..., :Dv]``, the same memory):
        each latent row is read once for both products.
    ``rows_per_kv_read`` : int or None
        Decode only: the query rows ((H / Hkv) x Tq) one read of a KV row serves, from which
        the regime is chosen; None for prefill.
    ``shared_prefix`` : list of dict or None
        Paged calls (``block_table``) only: the groups of sequences whose block-table rows
        begin with the same full blocks (as :meth:`PagedKVCache.fork` leaves them) and which
        every query row of theirs sees whole. Each group's shared blocks are read once for
        all its sequences (their query rows stacked in one call), its sequences' own blocks in
        a second call, merged exactly by log-sum-exp. Each dict: ``sequences`` (indices into
        the batch), ``blocks`` and ``keys`` (the shared prefix). The other keys describe the
        call as if nothing were shared. None when no group qualifies (fewer than two
        sequences share 1024 keys or more, ALiBi, a window that cuts the prefix) or without
        a block table.
    ``policy`` : dict
        The micro-kernel policy that runs: the kernel's own constants on this tier. ``rows``
        (MR) and ``keys`` (NR): the register block of the Q.K micro-kernel, query rows x keys
        (per register block, not per tile: e.g. ``{"rows": 32, "keys": 12}`` for
        ``"simd_prefill"`` and ``"gemm_decode"`` on AVX-512 (the decode kernel runs the
        prefill's tile loop), ``{"rows": 4, "keys": 4}`` for the hand-written decode
        loop; a call with fewer rows per KV head fills part of it); ``qk`` and ``pv``: how the
        Q.K and P.V products multiply, ``"fp32 fma"``, ``"fp32 mul+add"`` (no FMA: the SSE2
        generic tier and the portable templates), ``"vdpbf16ps"`` (bfloat16 pairs),
        ``"vpdpbusd"`` (int8: ``"vnni_int8_decode"``'s Q.K over q quantised per row),
        ``"vpdpwssd"`` (int8: that kernel's P.V over weights rounded to 15 bits per block) or
        ``"fp64"``.

    Examples
    --------
    >>> import numpy as np, attnfast
    >>> q = np.zeros((1, 8, 1, 128), np.float32)
    >>> k = v = np.zeros((1, 2, 4096, 128), np.float32)
    >>> plan = attnfast.explain(q, k, v, num_threads=1)
    >>> plan["path"], plan["split"]["chunk_keys"] > 0
    ('decode', True)
    """
    if cache_seqlens is None:
        for name, value in (("k_new", k_new), ("v_new", v_new), ("k_scale", k_scale),
                            ("v_scale", v_scale), ("block_table", block_table),
                            ("v_head_dim", v_head_dim)):
            if value is not None:
                raise TypeError(f"{name} describes a KV-cache call: pass cache_seqlens too")
        call = check_attention(q, k, v, causal=False if causal is None else causal,
                               scale=scale, window=window, num_threads=num_threads,
                               query_offset=query_offset, softcap=softcap,
                               alibi_slopes=alibi_slopes, sinks=sinks, mask=mask)
        call = attach_key_index(call, key_index, call.seqlen_k)
        part = KernelPart(k=call.k, v=call.v)
    else:
        options = dict(causal=True if causal is None else causal, scale=scale, window=window,
                       num_threads=num_threads, query_offset=query_offset, softcap=softcap,
                       alibi_slopes=alibi_slopes, sinks=sinks, mask=mask)
        caches = caller_caches(k, v, k_scale, v_scale, paged=block_table is not None, q=q,
                               v_head_dim=v_head_dim)
        if block_table is None:
            cache = check_kvcache_attention(q, caches, cache_seqlens, k_new, v_new, **options)
        else:
            cache = check_paged_kvcache_attention(q, caches, cache_seqlens, k_new, v_new,
                                                  block_table, **options)
        cache = with_key_index(cache, key_index)
        call = cache.attn
        part = KernelPart(k=k, v=v, seqlens=cache.seqlens_after, k_scale=cache.k_scale,
                          v_scale=cache.v_scale, block_table=cache.block_table)
    args, kwargs = kernel_call(call, part)
    plan = _ext.plan_attention(*args, **kwargs)
    plan["shared_prefix"] = None
    if cache_seqlens is not None and block_table is not None and key_index is None:
        block_size = k.shape[2]
        groups = plan_shared_prefix(cache.block_table, cache.seqlens_after, block_size,
                                    call.seqlen_q, causal=call.causal, window=call.window,
                                    query_offset=call.query_offset, options=call.options)
        plan["shared_prefix"] = [{"sequences": list(g.rows), "blocks": g.blocks,
                                  "keys": g.blocks * block_size} for g in groups] or None
    return plan
