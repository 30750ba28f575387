"""Shared-prefix decoding: sequences of one paged call that share leading blocks read them once.

When several sequences' block-table rows begin with the same full blocks (as
`PagedKVCache.fork` leaves them), their query rows are stacked as the query positions of one
batch entry and run against the shared blocks in one kernel call (the decode kernel serves
all stacked rows of a KV head per read of a block); each sequence's own blocks are a second,
batched call, and the two are merged exactly by log-sum-exp. `plan_shared_prefix` decides
where this is exact and pays; everything else runs unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._api import run_kernels
from ._descriptors import KernelPart, ScoreOptions
from ._compose import compute_queries, finish, merge_into, plan_part, run_part, start_result

__all__ = ["SharedGroup", "plan_shared_prefix", "run_paged_kernels", "stats"]

# Smallest shared prefix (keys) and group (sequences) worth the extra calls and the merge:
# below them the unshared single call is as fast (bench/bench_shared_prefix.py).
MIN_PREFIX_KEYS = 1024
MIN_GROUP = 2
# Query rows stacked into one prefix call: csrc/kernels/kernel_table.hpp's
# kDecodeMaxQueryRows, so the stacked call stays on the decode path; up to
# kGemmDecodeMaxQueryRows where the planner runs such a call on the GEMM-shaped decode kernel
# (on Zen 3, 64 forks at 8/8 heads: one 64-row call there against four 16-row calls on the
# bandwidth kernel, bench/HISTORY.md 27.3).
MAX_STACKED_ROWS = 16
MAX_GEMM_STACKED_ROWS = 64
GEMM_KERNELS = ("gemm_decode", "latent_decode")

# Counters for tests and benchmarks: calls that took the shared path, and groups served.
stats = {"shared_calls": 0, "groups": 0}


@dataclass(frozen=True)
class SharedGroup:
    """Sequences `rows` (indices into the call's batch) share their first `blocks` blocks."""
    rows: tuple[int, ...]
    blocks: int


def _visible_prefix_blocks(lengths, block_size, seqlen_q, causal, window, query_offset):
    """Per sequence: how many leading full blocks every one of its query rows sees whole."""
    left, right = window
    first = (lengths - seqlen_q) if query_offset is None else np.full_like(lengths, query_offset)
    last = first + seqlen_q - 1                      # positions of the first and last rows
    hi = lengths - 1                                 # the last key each row may see, at least
    if causal:
        hi = np.minimum(hi, first)
    if right >= 0:
        hi = np.minimum(hi, first + right)
    keys = np.maximum(hi + 1, 0)
    if left >= 0:  # a left bound cuts the prefix off unless every row's window starts at 0
        keys = np.where(last - left <= 0, keys, 0)
    return keys // block_size


def _mask_free_over(mask, row, prefix_keys) -> bool:
    """Whether the mask keeps every prefix key for sequence `row`, unchanged (bool True, or
    an additive 0): then the prefix call may run without it."""
    cols = mask[row, ..., :prefix_keys]
    return bool(np.all(cols)) if cols.dtype == np.bool_ else bool(np.all(cols == 0))


def plan_shared_prefix(table, lengths, block_size, seqlen_q, *, causal, window, query_offset,
                       options) -> list[SharedGroup]:
    """The groups of one paged call whose shared leading blocks are read once.

    table: int64 (B, max_blocks); lengths: keys per sequence (after new tokens). A group is
    sequences with the same first block whose rows share a run of identical full blocks that
    every query row of theirs sees whole (causal: the prefix lies before all their queries;
    a window: inside every row's window). Empty when nothing qualifies, or with ALiBi (its
    bias depends on each row's position; not composed) — then the call runs unshared.
    """
    B = table.shape[0]
    if B < MIN_GROUP or seqlen_q < 1 or options.alibi is not None:
        return []
    shareable = _visible_prefix_blocks(np.asarray(lengths, np.int64), block_size, seqlen_q,
                                       causal, window, query_offset)
    by_first: dict[int, list[int]] = {}
    for b in np.flatnonzero(shareable * block_size >= MIN_PREFIX_KEYS).tolist():
        by_first.setdefault(int(table[b, 0]), []).append(b)
    groups = []
    for rows in by_first.values():
        if len(rows) < MIN_GROUP:
            continue
        reach = int(shareable[rows].min())
        same = np.all(table[rows, :reach] == table[rows[0], :reach], axis=0)
        blocks = int(np.argmin(same)) if not same.all() else reach
        if blocks * block_size < MIN_PREFIX_KEYS:
            continue
        if options.mask is not None:  # sequences whose mask changes a prefix key leave
            rows = [r for r in rows if _mask_free_over(options.mask, r, blocks * block_size)]
            if len(rows) < MIN_GROUP:
                continue
        groups.append(SharedGroup(tuple(rows), blocks))
    return groups


def run_paged_kernels(call, user_out, return_lse, k_pool, v_pool, k_scale, v_scale):
    """run_kernels for a checked paged call (attnfast._descriptors.KVCacheCall), reading the
    blocks sequences share once per group when plan_shared_prefix finds groups."""
    attn, table, lengths = call.attn, call.block_table, call.seqlens_after
    block_size = k_pool.shape[2]
    groups = plan_shared_prefix(table, lengths, block_size, attn.seqlen_q, causal=attn.causal,
                                window=attn.window, query_offset=attn.query_offset,
                                options=attn.options)
    if not groups:
        return run_kernels(attn, user_out, return_lse, [KernelPart(
            k=k_pool, v=v_pool, seqlens=lengths, k_scale=k_scale, v_scale=v_scale,
            block_table=table)])
    stats["shared_calls"] += 1
    stats["groups"] += len(groups)
    out, lse = start_result(attn, user_out, return_lse)
    q = compute_queries(attn)
    grouped = np.zeros(attn.batch, bool)
    for group in groups:
        rows = np.array(group.rows)
        grouped[rows] = True
        prefix_keys = group.blocks * block_size
        prefix_out, prefix_lse = _stacked_prefix(attn, q[rows], k_pool, v_pool, k_scale,
                                                 v_scale, table[rows[0], :group.blocks],
                                                 prefix_keys)
        # each sequence's own blocks: the table from block `blocks` on, positions shifted
        own_table = np.ascontiguousarray(table[rows, group.blocks:])
        if own_table.shape[1] == 0:
            own_table = np.zeros((rows.size, 1), np.int64)  # no own keys: never read
        opts = attn.options
        own_options = ScoreOptions(
            softcap=opts.softcap, sinks=opts.sinks,  # the sinks join exactly one part
            mask=None if opts.mask is None else opts.mask[rows][..., prefix_keys:])
        own = run_part(attn, q[rows], KernelPart(k=k_pool, v=v_pool,
                                                 seqlens=lengths[rows] - prefix_keys,
                                                 k_scale=k_scale, v_scale=v_scale,
                                                 block_table=own_table),
                       seqlen_k=own_table.shape[1] * block_size, causal=attn.causal,
                       window=attn.window, options=own_options,
                       query_offset=None if attn.query_offset is None
                       else attn.query_offset - prefix_keys)
        merge_into(out, lse, rows, [(prefix_out, prefix_lse), own])
    rest = np.flatnonzero(~grouped)
    if rest.size:  # sequences of no group: the unshared call, in the caller's precision
        opts = attn.options
        sub_options = ScoreOptions(softcap=opts.softcap, sinks=opts.sinks,
                                   mask=None if opts.mask is None else opts.mask[rest])
        rest_out = run_part(attn, attn.q[rest], KernelPart(k=k_pool, v=v_pool,
                                                           seqlens=lengths[rest],
                                                           k_scale=k_scale, v_scale=v_scale,
                                                           block_table=table[rest]),
                            seqlen_k=attn.seqlen_k, causal=attn.causal, window=attn.window,
                            query_offset=attn.query_offset, options=sub_options)
        merge_into(out, lse, rest, [rest_out])
    return finish(out, lse, return_lse)


def _stacked_prefix(attn, q, k_pool, v_pool, k_scale, v_scale, prefix_blocks, prefix_keys):
    """(out, lse) of the n sequences' queries q (n, H, Tq, D) over the shared prefix blocks,
    every key visible: their rows stacked as one batch entry's query positions, at most
    MAX_STACKED_ROWS to a kernel call (MAX_GEMM_STACKED_ROWS where that call runs on the
    GEMM-shaped decode kernel)."""
    n, H, Tq, _ = q.shape
    table = np.ascontiguousarray(prefix_blocks[None], np.int64)
    per_call = max(1, MAX_STACKED_ROWS // Tq)
    wide = max(1, MAX_GEMM_STACKED_ROWS // Tq)
    part = KernelPart(k=k_pool, v=v_pool, seqlens=np.array([prefix_keys], np.int64),
                      k_scale=k_scale, v_scale=v_scale, block_table=table)
    if n > per_call and wide > per_call:
        probe = np.zeros((1, H, min(n, wide) * Tq, q.shape[3]), q.dtype)
        if plan_part(attn, probe, part, seqlen_k=prefix_keys)["kernel"] in GEMM_KERNELS:
            # Calls of equal size: no short last call falling below the kernel's rows.
            calls = -(-n // wide)
            per_call = -(-n // calls)
    outs, lses = [], []
    for s in range(0, n, per_call):
        chunk = q[s:s + per_call]
        m = chunk.shape[0]
        stacked = np.ascontiguousarray(chunk.transpose(1, 0, 2, 3)).reshape(1, H, m * Tq, -1)
        o, l = run_part(attn, stacked, part, seqlen_k=prefix_keys)
        outs.append(o.reshape(H, m, Tq, -1).transpose(1, 0, 2, 3))
        lses.append(l.reshape(H, m, Tq).transpose(1, 0, 2))
    return np.concatenate(outs), np.concatenate(lses)
