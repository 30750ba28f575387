"""Packed variable-length sequences (flash-attn's varlen layout)."""
from __future__ import annotations

import numpy as np

from . import _ext
from ._api import attention, kernel_call, kernels_interruptible
from ._interop import accepts_arrays
from ._arrays import _shape_str, as_float_array, check_query_kv_dtypes
from ._attention_checks import check_cu_seqlens, check_packed, check_varlen_slopes
from ._cache_checks import (
    check_block_table,
    check_key_rotation,
    check_paged_kvcache_attention,
    caller_caches,
)
from ._descriptors import KernelPart
from ._scalars import _as_int, _ints_per_sequence, check_flag
from ._written import check_out
from ._rotation import rotate_queries

__all__ = ["attention_varlen", "explain_varlen"]


@accepts_arrays
def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, seqused_k=None,
                     block_table=None, max_seqlen_q=None, max_seqlen_k=None, causal=False,
                     scale=None, window=None, softcap=None, alibi_slopes=None, sinks=None,
                     mask=None, return_lse=False, out=None, num_threads=None, k_scale=None,
                     v_scale=None, key_rotation=None, v_head_dim=None):
    """Attention over a batch of packed sequences of different lengths, with no padding work.

    Two forms, as flash-attn's ``flash_attn_varlen_func``:

    * packed keys: sequence b holds query tokens ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of
      ``q`` and keys ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of ``k``/``v``; it attends only
      within itself.
    * a ragged batch over a paged KV cache (``block_table``; a continuous-batching step:
      decode rows and prompt chunks together): ``k``/``v`` are pools of blocks, sequence b
      has ``cu_seqlens_q[b+1] - cu_seqlens_q[b]`` new queries and ``seqused_k[b]`` keys
      (its new tokens included, already written to the pool), token t at row
      ``t % block_size`` of block ``block_table[b, t // block_size]``. Every sequence runs
      in ONE kernel call: short rows (up to 16 queries) on the decode kernel, longer chunks
      on the prefill kernel, all their tasks on one schedule over the threads; each
      sequence's result is bit-identical to its own
      ``attention_with_kvcache(q_b, k, v, seqused_k[b], block_table=block_table[b:b+1])``.
      Consecutive one-query sequences (a step's decode rows) are checked and planned
      together, as one batch.

    Parameters
    ----------
    q : array (total_q, H, D)
    k : array (total_k, Hkv, D), or with block_table a pool (num_blocks, Hkv, block_size, D)
    v : array (total_k, Hkv, Dv), or with block_table a pool (num_blocks, Hkv, block_size, Dv)
        Pools as :func:`attnfast.attention_with_kvcache` takes them (any strides on their
        first three axes; flash-attn's (num_blocks, block_size, Hkv, D) pool passes as
        ``.transpose(0, 2, 1, 3)``; :class:`attnfast.PagedKVCache` holds one).
    cu_seqlens_q : int array (batch + 1,)
        Cumulative query offsets, starting at 0 and ending at total_q.
    cu_seqlens_k : int array (batch + 1,), or None with block_table
        Cumulative key offsets (packed keys), ending at total_k.
    seqused_k : int array (batch,), with block_table only (required there)
        Keys of each sequence, in [0, max_blocks * block_size].
    block_table : int32 or int64 array (batch, max_blocks), optional
        The paged cache's block ids (only the first ``ceil(seqused_k[b] / block_size)`` of
        row b are read; they must be in [0, num_blocks)).
    max_seqlen_q, max_seqlen_k : int, optional
        Accepted for flash-attn compatibility and checked (>= the longest sequence).
    k_scale, v_scale : float32 (num_blocks, Hkv, block_size), with an int8 / float8 pool only
        Row scales, paged like the pools (as attention_with_kvcache).
    key_rotation : None or "hadamard", with block_table only, default None
        As in :func:`attnfast.attention_with_kvcache`: "hadamard" says the pool's keys are
        stored rotated by the block Hadamard matrix (what :class:`attnfast.PagedKVCache`
        does by default for int8 and int4: pass ``key_rotation=cache.key_rotation``); q is
        then rotated the same way (in float32) before the kernels read it. None reads the
        keys as given.
    v_head_dim : int, with an int4 pool only
        The values' head dim Dv (int4 pools are uint8 packed rows that do not say it), as in
        :func:`attnfast.attention_with_kvcache`; default q's head dim D.
    Other options as in :func:`attnfast.attention`; causal is aligned bottom-right within
    each sequence. ``alibi_slopes`` is (H,) or (batch, H); ``mask`` has no natural shape
    here and raises NotImplementedError.

    Returns
    -------
    out (total_q, H, Dv), or (out, lse) with lse of shape (H, total_q) as in flash-attn.
    """
    return_lse = check_flag(return_lse, "return_lse")
    if block_table is not None or seqused_k is not None:
        return _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
                             max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
                             scale=scale, window=window, softcap=softcap,
                             alibi_slopes=alibi_slopes, sinks=sinks, mask=mask,
                             return_lse=return_lse, out=out, num_threads=num_threads,
                             k_scale=k_scale, v_scale=v_scale, key_rotation=key_rotation,
                             v_head_dim=v_head_dim)
    if cu_seqlens_k is None:
        raise ValueError("cu_seqlens_k is required for packed keys (it may be None only with "
                         "block_table, a paged cache)")
    if k_scale is not None or v_scale is not None:
        raise NotImplementedError("k_scale / v_scale (an int8 cache) are taken with block_table "
                                  "only; packed varlen keys are float")
    for name, value in (("key_rotation", key_rotation), ("v_head_dim", v_head_dim)):
        if value is not None:
            raise NotImplementedError(f"{name} describes a paged cache's pools and is taken with "
                                      f"block_table only; packed varlen keys are float, read as "
                                      f"given (got {name}={value!r})")
    q, k, v, cu_q, cu_k = check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k)
    heads = q.shape[1]

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


def _ragged_problems(q, k_pool, v_pool, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, *,
                     max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, alibi_slopes,
                     sinks, mask, num_threads, k_scale, v_scale, key_rotation=None,
                     v_head_dim=None, group_decodes=False):
    """attention_varlen's ragged batch over a paged pool, checked: (q, dim_v, table, problems,
    dtype, lse dtype), problems one (q0, q1, call, kernel arguments, grouped) per sequence
    with queries, the arguments its own attention_with_kvcache call would hand the kernels.
    dtype is the result's (q's); with key_rotation the problems read the float32 rotated q
    (as attention_with_kvcache's: attnfast._kvcache.run_cache_kernels), so theirs is
    float32 and the result is rounded to q's dtype once.
    group_decodes: a run of consecutive one-query sequences (a serving step's decode rows)
    is one problem of that many sequences (grouped True; rows q0 .. q1, one per sequence),
    checked once: the decode kernels split keys at fixed positions whatever the batch, so
    each sequence's bits are those of its own call."""
    if block_table is None:
        raise NotImplementedError("seqused_k is taken with block_table (a paged cache) only; for "
                                  "packed keys pass cu_seqlens_k")
    if seqused_k is None:
        raise ValueError("block_table needs seqused_k: the keys of each sequence (its new tokens "
                         "included)")
    if cu_seqlens_k is not None:
        raise ValueError("with block_table the keys of each sequence are seqused_k; pass "
                         "cu_seqlens_k=None")
    if mask is not None:
        raise NotImplementedError("mask has no natural shape for a ragged batch (each sequence has "
                                  "its own Tq x Tk); use causal/window, or attention_with_kvcache "
                                  "per sequence with its own mask")
    q = as_float_array(q, "q")
    if q.ndim != 3:
        raise ValueError(f"q must be 3-D (total_q, heads, head_dim) for varlen, got shape "
                         f"{_shape_str(q)}")
    pools = caller_caches(k_pool, v_pool, k_scale, v_scale, paged=True, names=("k", "v"), q=q,
                          v_head_dim=v_head_dim)
    block_size, dim_v, pool_dtype = pools.sizes[2], pools.head_dim_v, pools.dtype
    rotation = check_key_rotation(key_rotation, pool_dtype)
    out_dtype = q.dtype
    if rotation == "hadamard":  # the keys are stored rotated: q the same way (float32)
        check_query_kv_dtypes(q.dtype, pool_dtype, "the cache (k, v)")
        q = rotate_queries(q)
    cu_q = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q)
    batch = cu_q.shape[0] - 1
    table = check_block_table(block_table, batch)
    capacity = table.shape[1] * block_size
    used = _ints_per_sequence(seqused_k, "seqused_k", (batch,)).astype(np.int64)
    if batch and (used.min() < 0 or used.max() > capacity):
        raise ValueError(f"seqused_k must be in [0, {capacity}] (max_blocks * block_size = "
                         f"{table.shape[1]} * {block_size}), got {used.tolist()}")
    if max_seqlen_k is not None:
        limit = _as_int(max_seqlen_k, "max_seqlen_k", "an int")
        if batch and limit < used.max():
            raise ValueError(f"max_seqlen_k is {limit} but a sequence in seqused_k has "
                             f"{used.max()} keys")
    heads = q.shape[1]
    slopes = check_varlen_slopes(alibi_slopes, batch, heads)
    # Each sequence checked and laid out exactly as its own attention_with_kvcache call
    # would be (the same kernel arguments, so the same bits), before anything is computed.
    problems = []
    b = 0
    while b < batch:
        q0, q1 = int(cu_q[b]), int(cu_q[b + 1])
        end = b + 1
        if group_decodes and q1 - q0 == 1 and alibi_slopes is None:
            while end < batch and cu_q[end + 1] - cu_q[end] == 1:
                end += 1
        if q1 == q0:
            b += 1
            continue
        if end - b > 1:  # one-query sequences b .. end: (end - b, H, 1, D)
            q1 = q0 + (end - b)
            rows = q[q0:q1][:, :, None, :]
        else:
            rows = q[q0:q1].transpose(1, 0, 2)[None]
        call = check_paged_kvcache_attention(
            rows, pools, used[b:end], None, None, table[b:end], causal=causal, scale=scale,
            window=window, num_threads=num_threads, softcap=softcap,
            alibi_slopes=slopes[b] if end - b == 1 else None, sinks=sinks)
        part = KernelPart(k=k_pool, v=v_pool, seqlens=call.seqlens_after, k_scale=call.k_scale,
                          v_scale=call.v_scale, block_table=call.block_table)
        problems.append((q0, q1, call, kernel_call(call.attn, part), end - b > 1))
        b = end
    if problems:
        dtype, lse_dtype = problems[0][2].attn.dtype, problems[0][2].attn.lse_dtype
    else:  # nothing to compute: the dtypes a call would have
        probe = check_paged_kvcache_attention(
            q[:0].transpose(1, 0, 2)[None], pools, used[:1] if batch else 0, None, None,
            table[:1] if batch else np.zeros((1, 1), np.int64), causal=causal, scale=scale,
            window=window, num_threads=num_threads)
        dtype, lse_dtype = probe.attn.dtype, probe.attn.lse_dtype
    if rotation == "hadamard":
        dtype = out_dtype
    return q, dim_v, table, problems, dtype, lse_dtype


def _paged_varlen(q, k_pool, v_pool, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, *,
                  return_lse, out, k_scale, v_scale, key_rotation, v_head_dim, **options):
    """attention_varlen with a block table: one kernel call over every sequence."""
    q_given = q
    q, dim_v, table, problems, dtype, lse_dtype = _ragged_problems(
        q, k_pool, v_pool, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, k_scale=k_scale,
        v_scale=v_scale, key_rotation=key_rotation, v_head_dim=v_head_dim, group_decodes=True,
        **options)
    heads = q.shape[1]
    shape = (q.shape[0], heads, dim_v)
    user_out = check_out(out, shape, dtype, [("q", q_given), ("k", k_pool), ("v", v_pool),
                                             ("block_table", table), ("k_scale", k_scale),
                                             ("v_scale", v_scale)])
    result = user_out if user_out is not None else np.empty(shape, dtype)
    # The kernels write rows with a contiguous last axis, in their q's dtype (float32 for a
    # rotated 16-bit q); otherwise `out` is filled from a copy, rounded once.
    kernel_dtype = problems[0][2].attn.dtype if problems else dtype
    target = result if (kernel_dtype == dtype and (result.strides[-1] == result.itemsize
                                                   or dim_v == 1)) \
        else np.empty(shape, kernel_dtype)
    lse = np.full((heads, q.shape[0]), -np.inf, lse_dtype) if return_lse else None
    calls = []
    for q0, q1, _, ((qb, kb, vb), kw), grouped in problems:
        if grouped:  # rows q0 .. q1 are sequences of one query each: (n, H, 1, ..)
            calls.append((qb, kb, vb, target[q0:q1][:, :, None, :],
                          None if lse is None else lse[:, q0:q1].T[:, :, None], kw))
        else:
            calls.append((qb, kb, vb, target[q0:q1].transpose(1, 0, 2)[None],
                          None if lse is None else lse[:, q0:q1][None], kw))
    _ext.run_attention_batch(calls, interruptible=kernels_interruptible())
    if target is not result:
        with np.errstate(over="ignore"):  # beyond float16's range: +-inf, as a cast gives
            np.copyto(result, target, casting="same_kind")
    return (result, lse) if return_lse else result


def explain_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, seqused_k=None, block_table=None,
                   max_seqlen_q=None, max_seqlen_k=None, causal=False, scale=None, window=None,
                   softcap=None, alibi_slopes=None, sinks=None, mask=None, return_lse=False,
                   out=None, num_threads=None, k_scale=None, v_scale=None, key_rotation=None,
                   v_head_dim=None):
    """What :func:`attnfast.attention_varlen` would run for a ragged batch over a paged cache
    (``block_table``), computing nothing: the mix of decode rows and prefill chunks.

    The arguments are checked exactly as attention_varlen checks them (same errors); each
    sequence's plan comes from the C++ planning code its kernels run by (as
    :func:`attnfast.explain`). The packed-keys form (no ``block_table``) raises
    NotImplementedError: it runs one :func:`attnfast.attention` call per sequence, which
    :func:`attnfast.explain` describes.

    Returns
    -------
    dict with keys ``tier``; ``path`` (``"ragged"``); ``kv_source`` (``"paged"``);
    ``sequences`` (with queries); ``decode`` and ``prefill`` (how many of them take each
    path); ``kernels`` (micro-kernel name -> sequences); ``tasks`` (work items of the one
    schedule's first pass: prefill query blocks and decode chunks of every sequence);
    ``threads`` (threads it runs on alone); ``per_sequence`` (each sequence's
    :func:`attnfast.explain`-style dict, in batch order, sequences without queries left out).
    """
    check_flag(return_lse, "return_lse")
    if block_table is None:
        raise NotImplementedError("explain_varlen describes the ragged batch over a paged cache "
                                  "(block_table=); packed varlen keys run attention() per "
                                  "sequence: use attnfast.explain on one of them")
    _, _, _, problems, _, _ = _ragged_problems(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, causal=causal, scale=scale, window=window, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, mask=mask, num_threads=num_threads,
        k_scale=k_scale, v_scale=v_scale, key_rotation=key_rotation, v_head_dim=v_head_dim)
    plans = [_ext.plan_attention(*args, **kw) for _, _, _, (args, kw), _ in problems]
    kernels = {}
    for plan in plans:
        kernels[plan["kernel"]] = kernels.get(plan["kernel"], 0) + 1
    tasks = sum(p["tasks"] for p in plans)
    # the second pass: one merge per KV head of each decode sequence
    merges = sum(v.shape[1] for p, (_, _, _, ((_, _, v), _), _) in zip(plans, problems) if p["split"])
    most = max(tasks, merges)
    threads = min(problems[0][3][1]["num_threads"], most, _ext.processors()) if most else 0
    return {
        "tier": _ext.runtime_info()["isa"],
        "path": "ragged",
        "kv_source": "paged",
        "sequences": len(plans),
        "decode": sum(p["path"] == "decode" for p in plans),
        "prefill": sum(p["path"] == "prefill" for p in plans),
        "kernels": kernels,
        "tasks": tasks,
        "threads": threads,
        "per_sequence": plans,
    }
