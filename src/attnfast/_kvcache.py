"""Attention over a KV cache: the decode half of attnfast.

`KVCache` owns preallocated K/V arrays and a length per sequence; `attention_with_kvcache`
is the functional form over caller-owned arrays (flash-attn's ``flash_attn_with_kvcache``,
in PyTorch SDPA's (batch, heads, tokens, dim) layout). Both check everything first
(attnfast._cache_checks), write new tokens only then, and run the C++ kernels, which pick the
bandwidth-bound decode path for queries of up to 16 tokens.
"""
from __future__ import annotations

import dataclasses
import threading

import numpy as np

from . import _ext
from ._formats import format_of_storage
from ._api import run_kernels
from ._key_index import with_key_index as attach_key_index
from ._cache_args import (
    check_batch_index,
    check_cache_room,
    check_cache_spec,
    check_latent_spec,
    check_leading_sequences,
    check_step_tokens,
    check_truncate,
    default_key_rotation,
)
from ._cache_checks import (
    caller_caches,
    check_key_rotation,
    check_kvcache_attention,
    check_new_tokens,
    check_paged_kvcache_attention,
    check_tree_mask,
)
from ._descriptors import CacheLayout, KernelPart
from ._plans import (
    kvcache_key,
    kvcache_plan,
    KVCACHE_PLANS,
    paged_plan,
    PAGED_PLANS,
    remember,
    seqlens_key,
)
from ._scalars import bound_window, check_flag
from ._written import check_out
from ._rotation import rotate_queries
from . import _shared_prefix
from ._shared_prefix import run_paged_kernels
from ._transaction import assign, token_slots, transaction, write_tokens
from ._tree import run_tree_kernels

__all__ = ["KVCache", "attention_with_kvcache"]

_LENGTHS = "KVCache.lengths"  # a KVCache's lengths in its plan keys (attnfast._ext.kvcache_key)


@transaction(arrays=True)
def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, *,
                           causal=True, scale=None, window=None, softcap=None,
                           alibi_slopes=None, sinks=None, mask=None, return_lse=False,
                           out=None, num_threads=None, query_offset=None, k_scale=None,
                           v_scale=None, block_table=None, tree_mask=None, key_rotation=None,
                           v_head_dim=None, key_index=None):
    """Attention of new queries over a KV cache held in caller-owned arrays.

    flash-attn's ``flash_attn_with_kvcache`` in PyTorch SDPA's layout. For each sequence b,
    when ``k_new``/``v_new`` are given they are first written in place into
    ``k_cache[b, :, cache_seqlens[b] : cache_seqlens[b] + t]`` (and ``v_cache``); then
    ``q[b]`` attends over the first ``cache_seqlens[b] + t`` keys of the cache (t = 0
    without new tokens). Queries of up to 16 tokens take the bandwidth-bound decode kernel
    (all query heads of a KV head share one pass over it; long caches are split across
    threads and merged exactly).

    Parameters
    ----------
    q : array (B, H, Tq, D)
    k_cache : ndarray (B, Hkv, capacity, D), written in place when k_new is given
    v_cache : ndarray (B, Hkv, capacity, Dv)
        float32, float64, float16, bfloat16 or int8; H % Hkv == 0 (GQA/MQA). q has the
        caches' dtype, or float32 over a float16 / bfloat16 cache, or float32 / float16 /
        bfloat16 over an int8 cache. Any strides on the first three axes (a (B, capacity,
        Hkv, D) buffer passes as ``.transpose(0, 2, 1, 3)``).
    cache_seqlens : int or integer array (B,)
        Tokens already in each sequence's cache. Not modified: add t yourself after the call
        (as flash-attn). Each value must leave room for the new tokens:
        ``0 <= cache_seqlens[b] <= capacity - t``.
    k_new, v_new : arrays (B, Hkv, t, D) and (B, Hkv, t, Dv), t >= 1, or None (both or neither)
        In the caches' dtype (float32 is also taken by a 16-bit cache, rounded on write);
        for an int8 cache float32, float16 or bfloat16, quantised on write.
    k_scale, v_scale : float32 arrays (B, Hkv, capacity), int8 caches only (required there)
        Row j of sequence b, head g stands for ``k_scale[b, g, j] * k_cache[b, g, j]``
        (symmetric: scale = max|x| / 127). The new tokens' scales are written in place.
        With block_table: (num_blocks, Hkv, block_size), paged like the caches. A
        float8_e4m3fn or float8_e5m2 cache (``ml_dtypes.float8_e4m3fn`` / ``float8_e5m2``)
        has the same scales (scale = max|x| / 448, or / 57344).
        An int4 cache is uint8 arrays of packed rows, ``(B, Hkv, capacity,
        packed_size(D))``, as :class:`attnfast.KVCache` (dtype="int4") holds them: blocks of
        32 values, each with its own bfloat16 scale and minimum in the row (no scale arrays;
        docs: KV-cache formats); new tokens (float32 or 16-bit) are quantised on write.
    v_head_dim : int, optional
        int4 caches only (their packed rows do not say it): the values' head dim Dv;
        default q's head dim D.
    key_rotation : None or "hadamard", default None
        int8 / float8 caches: "hadamard" says the cached keys are stored rotated by the
        orthonormal block Hadamard matrix along D (docs: KV-cache formats): new keys are
        rotated before they are quantised and q is rotated the same way before the kernel
        reads it (q . k is unchanged). :class:`attnfast.KVCache` (dtype="int8") stores its
        keys so and passes it; None (the default here) reads the keys as given.
    block_table : int32 or int64 array (B, max_blocks), optional
        A paged cache (vLLM's paged attention, flash-attn's ``block_table``): ``k_cache`` is
        then a pool (num_blocks, Hkv, block_size, D) and ``v_cache`` (num_blocks, Hkv,
        block_size, Dv), any strides on their first three axes (flash-attn's (num_blocks,
        block_size, Hkv, D) pool passes as ``.transpose(0, 2, 1, 3)``). Token t of sequence b
        is row ``t % block_size`` of block ``block_table[b, t // block_size]``; new tokens
        are written there. The capacity is ``max_blocks * block_size`` (a mask's last axis
        spans it); a sequence of n tokens (after the new ones) reads its first
        ``ceil(n / block_size)`` entries, which must be ids in [0, num_blocks) (later entries
        are ignored, e.g. -1 padding). Sequences may share blocks they only read (a common
        prefix); results are bit-identical to a contiguous cache holding the same tokens.
        :class:`attnfast.PagedKVCache` manages such a pool. Sequences whose rows begin with
        the same full blocks (at least 1024 keys, every key visible to all their query rows)
        read those blocks once for all of them, merged by log-sum-exp: equal to float32
        rounding, same bits for any thread count (docs/user_guide/paged.md).
    tree_mask : bool array (Tq, Tq) or (B, Tq, Tq), optional, Tq <= 64
        Token-tree verification: the last Tq keys of each sequence (with k_new, the t = Tq
        new ones) are the tree; query i sees every earlier key and new token j iff
        ``tree_mask[i, j]`` (the diagonal must be True). Replaces causal; with window, mask,
        alibi_slopes, query_offset or causal=False it raises NotImplementedError. Computed as
        the cached keys (unmasked) and the Tq new keys (with the Tq x Tq mask), merged exactly.
    causal : bool, default True
        Bottom-right aligned: query i of sequence b sees key j iff
        ``j <= i + (cache_seqlens[b] + t - Tq)``. Unlike flash-attn (whose default is False)
        this defaults to True, as :meth:`KVCache.attend` does: with one query token both are
        the same, and with several new tokens (a prompt chunk, speculative verification)
        causal is what decoding means; pass ``causal=False`` to let every query see every
        cached key.
    scale, window, return_lse, num_threads
        As in :func:`attnfast.attention` (window is aligned like causal).
    out : array (B, H, Tq, Dv) of q's dtype, optional
        Written in place and returned (a torch tensor comes back as itself). It must be
        writeable, must not overlap itself (a stride of 0, as torch's ``expand()`` gives) or
        any other argument (q, the caches, their scales, k_new, v_new): otherwise a
        ValueError (TypeError for a wrong dtype) names it before anything is written; it is
        never replaced by a copy (a torch tensor with the negative or conjugate bit is
        refused). Neither ``out`` nor ``return_lse`` costs a repeat call its fast path:
        decode steps that reuse one buffer cost what calls without it cost.
    query_offset : int, optional
        Query i sits at cache position ``i + query_offset`` in every sequence (causal and
        window measured from there) instead of bottom-right; e.g. 0 for a prompt written
        into an empty static cache whose capacity exceeds the prompt.
    softcap, alibi_slopes, sinks, mask
        As in :func:`attnfast.attention` (ALiBi distances from each sequence's i'); the mask
        broadcasts to (B, H, Tq, capacity): its last axis spans the cache's capacity.
    key_index : integer array (B, Tq, k) or (B, Hkv, Tq, k), optional
        Sparse attention (DeepSeek's DSA): query i of sequence b attends only over the cache
        positions its row lists (-1 = none; distinct; each below the sequence's length after
        the new tokens), one list shared by every head or one per KV head; causal and window
        still apply. Only the listed rows are read (contiguous or paged, every cache format).
        Not with tree_mask, alibi_slopes or mask (NotImplementedError).

    Returns
    -------
    out (B, H, Tq, Dv), or (out, lse) when return_lse; lse (B, H, Tq) is float32 (float64
    for float64). A query that sees no key (e.g. an empty cache) gives zeros and lse = -inf.

    Every argument is checked before anything is written: a rejected call leaves the caches
    and ``out`` untouched, and a call that raises after writing (Ctrl-C in the kernels, or
    at any point before it has returned) puts back every byte of the caches and scales it
    overwrote (attnfast._transaction). float32 values beyond a
    16-bit cache's range are stored as +-inf, without a warning.
    """
    # The fast path: a plan for this call's layout and options (the key decides whether
    # one can serve it at all: attnfast._ext.kvcache_key), then the per-call checks, in C.
    key = kvcache_key(q, k_cache, v_cache, seqlens_key(cache_seqlens), k_new, v_new, out,
                      causal, scale, window, return_lse,
                      (softcap, alibi_slopes, sinks, mask, tree_mask, key_rotation, v_head_dim),
                      block_table, k_scale, v_scale, key_index=key_index)
    if key is not None:
        if block_table is None:
            plan = KVCACHE_PLANS.get(key)
            if plan is not None:
                result = _ext.decode_fast(plan, q, k_cache, v_cache, cache_seqlens, k_new,
                                          v_new, out, causal, num_threads, query_offset, False,
                                          key_index)
                if result is not None:
                    return result
        else:  # a paged decode step (a serving engine's every layer)
            plan = PAGED_PLANS.get(key)
            if plan is not None:
                result = _paged_fast(plan, q, k_cache, v_cache, cache_seqlens, block_table,
                                     k_scale, v_scale, out, causal, num_threads, query_offset)
                if result is not None:
                    return result
    return_lse = check_flag(return_lse, "return_lse")
    paged = block_table is not None
    caches = caller_caches(k_cache, v_cache, k_scale, v_scale, paged=paged, q=q,
                           v_head_dim=v_head_dim)
    options = dict(causal=causal, scale=scale, window=window, num_threads=num_threads,
                   query_offset=query_offset, softcap=softcap, alibi_slopes=alibi_slopes,
                   sinks=sinks, mask=mask)
    call = (check_paged_kvcache_attention(q, caches, cache_seqlens, k_new, v_new, block_table,
                                          **options) if paged
            else check_kvcache_attention(q, caches, cache_seqlens, k_new, v_new, **options))
    call = with_key_index(call, key_index, tree_mask)
    rotation = check_key_rotation(key_rotation, k_cache.dtype)
    user_out = check_out(out, call.attn.out_shape(), call.attn.dtype, _read_and_written(call))
    tree = check_tree_mask(tree_mask, call)
    if call.new_tokens:  # (undone by the transaction if the call raises)
        write_tokens((k_cache, v_cache, call.k_scale, call.v_scale),
                     *token_slots(call.starts, call.new_tokens, table=call.block_table,
                                  block_size=k_cache.shape[2]),
                     call.k_new, call.v_new, rotation)
    parts = [KernelPart(k=k_cache, v=v_cache, seqlens=call.seqlens_after, k_scale=call.k_scale,
                        v_scale=call.v_scale, block_table=call.block_table)]
    result = run_cache_kernels(call, user_out, return_lse, parts, tree, rotation)
    if key is not None and paged:  # accepted: later calls of this layout take the fast path
        remember(PAGED_PLANS, key, paged_plan(call, q, k_scale, v_scale, window, return_lse))
    elif key is not None:
        remember(KVCACHE_PLANS, key, kvcache_plan(q, k_cache, v_cache, call.k_new, out, scale,
                                                  window, return_lse))
    return result


def with_key_index(call, key_index, tree_mask=None):
    """A checked KV-cache call (KVCacheCall) with its key_index checked (attnfast._key_index)
    against each sequence's length after the new tokens; the call itself without one."""
    if key_index is None:
        return call
    if tree_mask is not None:
        raise NotImplementedError("key_index with tree_mask is not implemented")
    return _with_fields(call, attn=attach_key_index(call.attn, key_index, call.seqlens_after))


def _read_and_written(call) -> list:
    """Every array of a checked KV-cache call other than `out` (the caches and scales it
    reads or writes, and what it reads): `out` must overlap none of them."""
    return ([("q", call.attn.q)] + call.cache.arrays() + [
        ("k_new", call.k_new), ("v_new", call.v_new), ("block_table", call.block_table)]
        + call.attn.options.arrays())


def run_cache_kernels(call, user_out, return_lse, parts, tree=None, key_rotation=None):
    """run_kernels for a checked cache call (KVCacheCall): composed from several calls for
    a tree mask (attnfast._tree) or, over a paged pool, for sequences sharing leading blocks
    (attnfast._shared_prefix); one call otherwise. With key_rotation ("hadamard": the
    cached keys are rotated) q is rotated the same way first, into float32 (a 16-bit q
    rounded back could overflow: attnfast._rotation.rotate_queries); a 16-bit q's result is
    computed from that float32 q and rounded to q's dtype once, as the kernels round it."""
    if key_rotation == "hadamard":
        q_dtype = call.attn.dtype
        rotated = rotate_queries(call.attn.q)
        call = _with_fields(call, attn=dataclasses.replace(call.attn, q=rotated,
                                                           dtype=rotated.dtype))
        if q_dtype != rotated.dtype:
            result = _run_cache_parts(call, None, return_lse, parts, tree)
            out32, lse = result if return_lse else (result, None)
            out = user_out if user_out is not None else np.empty(out32.shape, q_dtype)
            with np.errstate(over="ignore"):  # beyond float16's range: +-inf, as a cast gives
                np.copyto(out, out32, casting="same_kind")
            return (out, lse) if return_lse else out
    return _run_cache_parts(call, user_out, return_lse, parts, tree)


def _run_cache_parts(call, user_out, return_lse, parts, tree):
    """run_cache_kernels after the query rotation: the composed or the single call."""
    if tree is not None:
        return run_tree_kernels(call.attn, user_out, return_lse, parts, tree)
    if call.block_table is not None and len(parts) == 1 and call.attn.options.key_index is None:
        part = parts[0]  # (shared prefixes: every key)
        return run_paged_kernels(call, user_out, return_lse, part.k, part.v, part.k_scale,
                                 part.v_scale)
    return run_kernels(call.attn, user_out, return_lse, parts)


def _paged_fast(plan, q, k_pool, v_pool, cache_seqlens, block_table, k_scale, v_scale, out,
                causal, num_threads, query_offset):
    """attention_with_kvcache(block_table=...) without new tokens, for a call whose plan key
    found the plan an earlier call left (PAGED_PLANS): the lengths, block ids in use, `out`
    and the kernel call in C (_ext.paged_table_fast); sequences sharing a long prefix run
    the same composition as the full path (run_paged_kernels). None, having done nothing,
    when anything is unusual: the full path then runs (and raises as always). Nothing is
    written but `out`."""
    result = _ext.paged_table_fast(plan, q, k_pool, v_pool, cache_seqlens, block_table, k_scale,
                                   v_scale, out, causal, num_threads, query_offset,
                                   _shared_prefix.MIN_PREFIX_KEYS)
    if type(result) is not _ext.SharedPrefix:
        return result
    call = plan.call
    attn = call.attn
    bounded = bound_window(plan.window, attn.seqlen_q, attn.seqlen_k, query_offset)
    fresh = _with_fields(
        call, attn=_with_fields(attn, q=q, k=k_pool, v=v_pool, num_threads=result.threads,
                                window=bounded, query_offset=query_offset),
        cache=_with_fields(call.cache, k=k_pool, v=v_pool, k_scale=k_scale, v_scale=v_scale),
        starts=result.lengths, block_table=result.table)
    return run_paged_kernels(fresh, out, plan.lse_dtype is not None, k_pool, v_pool, k_scale,
                             v_scale)


def _with_fields(checked, **fields):
    """A copy of a checked call (dataclass) with some fields replaced: dataclasses.replace
    without re-running __init__ (every field is already checked; ~10x cheaper per call)."""
    copy = object.__new__(type(checked))
    copy.__dict__.update(checked.__dict__)
    copy.__dict__.update(fields)
    return copy


def latent_values(cache, k_new, v_new, ndims):
    """The v_new of a KVCache / PagedKVCache call: as given; for a latent cache None becomes
    k_new's prefix view (the same rows: written once), and anything else is refused. ndims:
    the k_new ranks the cache takes (others are left to the usual checks, which name them)."""
    if not cache.latent:
        return v_new
    if v_new is not None:
        raise ValueError(f"this {type(cache).__name__} is latent (v is a prefix view of k): "
                         "pass the latent rows as k_new only, v_new=None")
    if k_new is None or np.ndim(k_new) not in ndims:
        return None
    return np.asarray(k_new)[..., :cache.v_head_dim]


def allocate_storage(cache, shape, dtype, head_dims, latent, key_rotation, head_major=False):
    """The K/V arrays of a KVCache or PagedKVCache, (X, Hkv, rows, D | Dv) for `shape` = (X,
    Hkv, rows) (a sequence or a block per X), of the storage format `dtype` (int4: rows of
    packed blocks, their length not the head dim), and the float32 row scales (X, Hkv, rows)
    of a row-scaled format (int8, float8); a latent (MLA) cache's v the first Dv elements of
    its k rows (a view). head_major: stored (Hkv, X, ..) and seen as the (X, Hkv, ..) view.
    Also the cache's lock, held by every method for its whole call: taken and released in
    C, around the method's Python code, by its transaction (attnfast._transaction), so no
    interrupt can leave it held; reentrant (a method called within another takes it again)."""
    D, Dv = cache._head_dims = head_dims
    cache._latent = check_latent_spec(latent, D, Dv, dtype)
    cache._key_rotation = default_key_rotation(key_rotation, dtype)
    fmt, (X, H, R) = format_of_storage(dtype), shape

    def zeros(dt, *row):
        a = np.zeros(((H, X) if head_major else (X, H)) + (R,) + row, dt)
        return a.swapaxes(0, 1) if head_major else a
    cache._k = zeros(dtype, fmt.stored_dim(D))
    cache._v = cache._k[..., :Dv] if cache._latent else zeros(dtype, fmt.stored_dim(Dv))
    scaled = fmt.row_scaled
    cache._k_scale, cache._v_scale = (zeros(np.float32), zeros(np.float32)) if scaled else (None,) * 2
    cache._lock = threading.RLock()


def storage_properties(what: str):
    """The properties KVCache and PagedKVCache share, `what` naming the cache in their docs:
    k, v, k_scale, v_scale, key_rotation, latent, kv_heads, head_dim, v_head_dim, dtype."""
    return (
        property(lambda self: self._k, doc=f"Keys of the {what} (in use: each sequence's first "
                 "lengths tokens). An int4 cache's are uint8 rows of packed blocks, 20 * "
                 "ceil(head_dim / 32) bytes (layout in the user guide, \"Low-bit KV caches\")."),
        property(lambda self: self._v, doc=f"Values of the {what} (int4: packed, as k)."),
        property(lambda self: self._k_scale, doc=f"int8 / float8 {what}s: float32 row scales "
                 "(the key row j of a KV head stands for ``k_scale[.., j] * k[.., j]``); None "
                 "for other dtypes."),
        property(lambda self: self._v_scale, doc="The value rows' scales, as k_scale."),
        property(lambda self: self._key_rotation, doc="How the keys are stored: \"hadamard\" "
                 "(rotated by the orthonormal block Hadamard matrix along head_dim before "
                 "quantisation; the default for int8 and int4) or None (as given). Queries are "
                 "rotated the same way, so results do not change."),
        property(lambda self: self._latent, doc=f"Whether v is a prefix view of k (an MLA "
                 f"latent {what}: one row per token)."),
        property(lambda self: self._k.shape[1], doc="KV heads (Hkv)."),
        property(lambda self: self._head_dims[0], doc="Head dim of keys (and queries)."),
        property(lambda self: self._head_dims[1], doc="Head dim of values."),
        property(lambda self: self._k.dtype, doc=f"Storage dtype of k and v (queries: this "
                 f"dtype, or float32 over a 16-bit {what}, or float32 / float16 / bfloat16 over "
                 "an int8, float8 or int4 one); uint8 for int4 (its packed blocks)."))


class KVCache:
    """A preallocated KV cache for batched incremental decoding.

    ``KVCache(batch, kv_heads, head_dim, capacity, *, dtype=np.float32, v_head_dim=None)``
    holds ``k`` (batch, kv_heads, capacity, head_dim) and ``v`` (batch, kv_heads, capacity,
    v_head_dim) arrays and, per sequence, ``lengths[b]``: how many tokens it holds (keys
    ``[0, lengths[b])`` are valid). Sequences may hold different numbers of tokens.

    Typical decode loop::

        cache = attnfast.KVCache(1, 8, 128, capacity=4096)
        out = cache.step(q_prompt, k_prompt, v_prompt)      # prefill: causal over the prompt
        for _ in range(n_tokens):
            out = cache.step(q_tok, k_tok, v_tok)           # one token: O(length) work

    ``dtype``: float32, float64, float16 or bfloat16 (stored as given), or a quantised
    format new tokens are quantised into on append (queries float32, float16 or bfloat16):
    ``"int8"`` (a float32 scale per token row in ``k_scale`` / ``v_scale``; keys rotated,
    see ``key_rotation``), ``ml_dtypes.float8_e4m3fn`` or ``float8_e5m2`` (scales the same;
    also by name, ``"float8_e5m2"``) or ``"int4"``
    (groups of 32 values with their own bfloat16 scale and minimum, packed into uint8 ``k`` /
    ``v`` rows of 20 * ceil(head_dim / 32) bytes; keys rotated). Formats and their errors:
    the user guide's "KV-cache formats" page.

    Every method checks all its arguments before changing anything: a rejected call (for
    instance appending past ``capacity``, which raises ValueError) leaves ``k``, ``v`` and
    ``lengths`` exactly as they were.

    ``batch_index`` (an int, or an array of distinct ints) selects the sequences a call
    works on; the arrays passed then hold those sequences, in that order, on axis 0.

    Thread safety: one cache may be shared by Python threads. Each method holds the cache's
    lock for its whole call, so concurrent ``append``/``step``/``attend``/``truncate``/
    ``reset`` calls run one after the other, each seeing the others' tokens complete (the
    kernels still use every core for each call). Writing to ``k``/``v`` directly bypasses it.

    Ctrl-C: every method either returns or raises and leaves the cache as it was before the
    call: ``lengths`` and every byte of ``k``, ``v`` and the scales. A ``step`` interrupted
    while attending raises KeyboardInterrupt so; a Ctrl-C that comes once the tokens are
    written but before the call has returned puts them back too (so does any call that
    raises, whatever it raises), and one that comes later is raised after the call returned,
    with the tokens in (attnfast._transaction). Retrying a call that raised never appends twice.
    """

    def __init__(self, batch, kv_heads, head_dim, capacity, *, dtype=np.float32,
                 v_head_dim=None, latent=False, key_rotation="auto"):
        B, Hkv, D, C, dt, Dv = check_cache_spec(batch, kv_heads, head_dim, capacity, dtype,
                                                v_head_dim)
        allocate_storage(self, (B, Hkv, C), dt, (D, Dv), latent, key_rotation)
        self._lengths = np.zeros(B, dtype=np.int64)

    # ---- state ----
    (k, v, k_scale, v_scale, key_rotation, latent, kv_heads, head_dim, v_head_dim,
     dtype) = storage_properties("cache")

    @property
    def lengths(self) -> np.ndarray:
        """Tokens held per sequence, int64 (batch,) (a read-only view)."""
        view = self._lengths.view()
        view.flags.writeable = False
        return view

    batch = property(lambda self: self._k.shape[0], doc="Number of sequences.")
    capacity = property(lambda self: self._k.shape[2], doc="Tokens each sequence can hold.")

    def __repr__(self) -> str:
        kind = format_of_storage(self.dtype).label()
        return (f"KVCache(batch={self.batch}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
                f"capacity={self.capacity}, dtype={kind}, v_head_dim={self.v_head_dim}"
                f"{', latent=True' if self._latent else ''}; "
                f"lengths={self._lengths.tolist() if self.batch <= 8 else '...'})")

    # ---- methods ----
    @transaction(lock="_lock", arrays=True)
    def append(self, k_new, v_new=None, *, batch_index=None) -> None:
        """Append t >= 1 tokens to every sequence (or to those of ``batch_index``).

        k_new: (n, kv_heads, t, head_dim), v_new: (n, kv_heads, t, v_head_dim), in the cache's
        dtype, n = batch (or the number of sequences batch_index selects). A latent cache
        takes the latent rows k_new only (v_new None: the values are their prefix). Raises
        ValueError, changing nothing, when a sequence has fewer than t free slots.
        """
        v_new = latent_values(self, k_new, v_new, ndims=(4,))
        self._append(k_new, v_new, batch_index)

    def _append(self, k_new, v_new, batch_index) -> None:
        seqs = check_batch_index(batch_index, self.batch)
        check_leading_sequences(seqs, self.batch, k_new=k_new, v_new=v_new)
        k_new, v_new, t = check_new_tokens(
            k_new, v_new, batch=seqs.size, kv_heads=self.kv_heads, head_dim=self.head_dim,
            head_dim_v=self.v_head_dim, dtype=self.dtype)
        if t == 0:
            raise ValueError("append needs both k_new and v_new; both are None")
        check_cache_room(self._lengths, seqs, t, self.capacity)
        for name, a in (("cache.k", self._k), ("cache.v", self._v)):
            if not a.flags.writeable:
                raise ValueError(f"{name} is read-only, but k_new/v_new must be written into it")
        self._write(seqs, self._lengths[seqs], k_new, v_new)

    @transaction(lock="_lock", arrays=True)
    def attend(self, q, *, batch_index=None, causal=True, scale=None, window=None,
               softcap=None, alibi_slopes=None, sinks=None, mask=None, return_lse=False,
               out=None, num_threads=None, query_offset=None, tree_mask=None, key_index=None):
        """Attention of q (n, H, Tq, head_dim) over each sequence's cached tokens.

        Causal by default, bottom-right aligned: query i of sequence b sees the keys
        ``j <= i + (lengths[b] - Tq)``, so the last query sees the whole sequence. Other
        options as in :func:`attnfast.attention`; ``tree_mask`` (Tq x Tq bool) and
        ``key_index`` (n, Tq, k) or (n, kv_heads, Tq, k) (sparse attention over the listed
        positions) as in :func:`attnfast.attention_with_kvcache` (the last Tq cached tokens
        are the tree). Returns out (n, H, Tq, v_head_dim), or (out, lse) when return_lse.
        """
        return self._call(q, None, None, batch_index, causal, scale, window, softcap, alibi_slopes,
                          sinks, mask, return_lse, out, num_threads, query_offset, tree_mask,
                          key_index)

    @transaction(lock="_lock", arrays=True)
    def step(self, q, k_new, v_new=None, *, batch_index=None, causal=True, scale=None,
             window=None, softcap=None, alibi_slopes=None, sinks=None, mask=None,
             return_lse=False, out=None, num_threads=None, query_offset=None, tree_mask=None,
             key_index=None):
        """The decode step: :meth:`append` k_new, v_new, then :meth:`attend` q, in one call.

        With a prompt (t = Tq tokens) this is causal prefill; with one token, one decode
        step. With ``tree_mask`` the t = Tq new tokens are a token tree (speculative
        verification; see :func:`attnfast.attention_with_kvcache`). ``key_index`` as in
        :meth:`attend`, its positions counting the new tokens. Everything is checked before
        the tokens are written. A latent cache takes k_new only (v_new None).
        """
        v_new = latent_values(self, k_new, v_new, ndims=(4,))
        check_step_tokens(k_new, v_new)
        return self._call(q, k_new, v_new, batch_index, causal, scale, window, softcap,
                          alibi_slopes, sinks, mask, return_lse, out, num_threads, query_offset,
                          tree_mask, key_index)

    @transaction(lock="_lock", arrays=True)
    def truncate(self, n) -> None:
        """Roll every sequence back to n tokens (or sequence b to n[b]), e.g. to drop rejected
        speculative tokens. n may not exceed a sequence's current length (ValueError)."""
        if not _ext.truncate_lengths(self._lengths, n):  # (an int that fits: in C, logged)
            assign(self._lengths, slice(None), check_truncate(n, self._lengths))

    @transaction(lock="_lock")
    def reset(self) -> None:
        """Empty every sequence (lengths = 0; the arrays are kept, not cleared)."""
        assign(self._lengths, slice(None), 0)

    # ---- internals ----
    def _write(self, seqs, starts, k_new, v_new) -> None:
        """The t new tokens of the sequences `seqs` written at `starts`, their lengths
        advanced (each change logged: attnfast._transaction)."""
        t = k_new.shape[2]
        write_tokens((self._k, self._v, self._k_scale, self._v_scale),
                     *token_slots(starts, t, seqs=seqs), k_new, v_new, self._key_rotation)
        assign(self._lengths, seqs, starts + t)

    def _layout(self, n: int) -> CacheLayout:
        """The cache as the checks see a call on n of its sequences (its whole arrays are the
        ones guarded: written in place, apart from what the call reads)."""
        return CacheLayout(sizes=(n, self.kv_heads, self.capacity), head_dim=self.head_dim,
                           head_dim_v=self.v_head_dim, dtype=self.dtype,
                           names=("cache.k", "cache.v"),
                           scale_names=("cache.k_scale", "cache.v_scale"), k=self._k, v=self._v,
                           k_scale=self._k_scale, v_scale=self._v_scale)

    def _views(self, seqs):
        """(rows of the selection, batch slice of the cache) for each kernel call: one call
        when the indices are evenly spaced (a strided view, no copy), else one per sequence."""
        if seqs.size == 1:
            b = int(seqs[0])
            return [(slice(0, 1), slice(b, b + 1))]
        steps = np.diff(seqs)
        if steps[0] > 0 and np.all(steps == steps[0]):
            return [(slice(None), slice(int(seqs[0]), int(seqs[-1]) + 1, int(steps[0])))]
        return [(slice(i, i + 1), slice(b, b + 1)) for i, b in enumerate(seqs.tolist())]

    def _call(self, q, k_new, v_new, batch_index, causal, scale, window, softcap, alibi_slopes,
              sinks, mask, return_lse, out, num_threads, query_offset, tree_mask, key_index):
        """attend / step: by the plan an earlier call of this layout left (the C tail
        _ext.decode_fast, the lengths advanced in place), else by the full path, which
        leaves one for the call's plan key (attnfast._ext.kvcache_key)."""
        key = kvcache_key(q, self._k, self._v, _LENGTHS, k_new, v_new, out, causal, scale,
                          window, return_lse,
                          (batch_index, softcap, alibi_slopes, sinks, mask, tree_mask),
                          key_index=key_index)
        plan = None if key is None else KVCACHE_PLANS.get(key)
        if plan is not None:
            result = _ext.decode_fast(plan, q, self._k, self._v, self._lengths, k_new, v_new,
                                      out, causal, num_threads, query_offset, True,  # (advance)
                                      key_index)
            if result is not None:
                return result
        result = self._run_locked(q, k_new, v_new, batch_index, causal, scale, window, softcap,
                                  alibi_slopes, sinks, mask, return_lse, out, num_threads,
                                  query_offset, tree_mask, key_index)
        if key is not None:  # accepted: later calls of this layout take the fast path
            remember(KVCACHE_PLANS, key,
                     kvcache_plan(q, self._k, self._v, k_new, out, scale, window, return_lse))
        return result

    def _run_locked(self, q, k_new, v_new, batch_index, causal, scale, window, softcap,
                    alibi_slopes, sinks, mask, return_lse, out, num_threads, query_offset,
                    tree_mask, key_index):
        return_lse = check_flag(return_lse, "return_lse")
        seqs = check_batch_index(batch_index, self.batch)
        check_leading_sequences(seqs, self.batch, q=q, k_new=k_new, v_new=v_new)
        t = np.shape(k_new)[2] if k_new is not None and np.ndim(k_new) == 4 else 0
        if t:
            check_cache_room(self._lengths, seqs, t, self.capacity)
        call = check_kvcache_attention(q, self._layout(seqs.size), self._lengths[seqs], k_new,
                                       v_new, causal=causal, scale=scale, window=window,
                                       num_threads=num_threads, query_offset=query_offset,
                                       softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                       mask=mask)
        call = with_key_index(call, key_index, tree_mask)
        user_out = check_out(out, call.attn.out_shape(), call.attn.dtype, _read_and_written(call))
        tree = check_tree_mask(tree_mask, call)
        if call.new_tokens:  # (undone by the transaction if the call raises)
            self._write(seqs, call.starts, call.k_new, call.v_new)
        scaled = self._k_scale is not None
        parts = [KernelPart(rows=rows, k=self._k[cache_rows], v=self._v[cache_rows],
                            seqlens=self._lengths[cache_rows],
                            k_scale=self._k_scale[cache_rows] if scaled else None,
                            v_scale=self._v_scale[cache_rows] if scaled else None)
                 for rows, cache_rows in self._views(seqs)]
        return run_cache_kernels(call, user_out, return_lse, parts, tree, self._key_rotation)
