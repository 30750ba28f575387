"""Tree verification (speculative decoding with a token tree): ``tree_mask=`` on the cache calls.

The last Tq keys of each sequence are the tree's new tokens; query i sees every key before
them and new token j iff ``tree_mask[i, j]``. Computed as two kernel calls merged exactly by
log-sum-exp: the cached keys, all visible (no mask), and the Tq new keys gathered into a small
(n, Hkv, Tq, D) array with the Tq x Tq mask — never a capacity-wide mask.
"""
from __future__ import annotations

import numpy as np

import dataclasses

from ._descriptors import KernelPart, ScoreOptions
from ._compose import compute_queries, finish, merge_into, run_part, start_result

__all__ = ["run_tree_kernels"]


def _tail(pool, lengths, tq, table=None):
    """Rows lengths[i] - tq .. lengths[i] of each sequence i: (n, Hkv, tq, ..) from a cache
    (n, Hkv, capacity, ..) or, with `table`, from a paged pool (num_blocks, Hkv, block_size, ..)."""
    if pool is None:
        return None
    pos = lengths[:, None] - tq + np.arange(tq)[None, :]              # (n, tq)
    if table is None:
        return np.stack([pool[i, :, p[0]:p[0] + tq] for i, p in enumerate(pos)])
    bs = pool.shape[2]
    blocks, rows = np.take_along_axis(table, pos // bs, axis=1), pos % bs
    # advanced indices on axes 0 and 2 put the token axis first: (n, tq, Hkv, ..)
    return np.ascontiguousarray(np.swapaxes(pool[blocks, :, rows], 1, 2))


def run_tree_kernels(attn, user_out, return_lse, parts, tree):
    """run_kernels for a checked cache call with a checked tree mask `tree` (B, Tq, Tq) bool:
    per part, the cached keys (all visible, the sinks) and the new keys (the tree mask)."""
    out, lse = start_result(attn, user_out, return_lse)
    q = compute_queries(attn)
    tq, heads = attn.seqlen_q, attn.heads
    opts = attn.options
    for part in parts:
        seqlens = np.asarray(part.seqlens, np.int64)
        q_rows = q[part.rows]
        n = q_rows.shape[0]
        cached = run_part(attn, q_rows,
                          dataclasses.replace(part, rows=slice(None), seqlens=seqlens - tq),
                          seqlen_k=attn.seqlen_k,
                          options=ScoreOptions(softcap=opts.softcap, sinks=opts.sinks))
        k, v, k_scale, v_scale = (_tail(a, seqlens, tq, part.block_table)
                                  for a in (part.k, part.v, part.k_scale, part.v_scale))
        tree_view = np.broadcast_to(tree[part.rows][:, None], (n, heads, tq, tq))
        new = run_part(attn, q_rows, KernelPart(k=k, v=v, seqlens=np.full(n, tq, np.int64),
                                                k_scale=k_scale, v_scale=v_scale),
                       seqlen_k=tq, options=ScoreOptions(softcap=opts.softcap, mask=tree_view))
        merge_into(out, lse, part.rows, [cached, new])
    return finish(out, lse, return_lse)
