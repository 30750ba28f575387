"""Tree verification (speculative decoding with a token tree): ``tree_mask=`` on the cache calls.

The last Tq keys of each sequence are the tree's new tokens; query i sees every key before
them and new token j iff ``tree_mask[i, j]``. Computed as two kernel calls merged exactly by
log-sum-exp: the cached keys, all visible (no mask), and the Tq new keys gathered into a small
(n, Hkv, Tq, D) array with the Tq x Tq mask — never a capacity-wide mask.
"""
from __future__ import annotations

import numpy as np

from ._checks import ScoreOptions
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
        rows, k, v, seqlens = part[:4]
        k_scale, v_scale = part[4:6] if len(part) > 4 else (None, None)
        table = part[6] if len(part) > 6 else None
        seqlens = np.asarray(seqlens, np.int64)
        q_rows = q[rows]
        n = q_rows.shape[0]
        cached = run_part(attn, q_rows, (slice(None), k, v, seqlens - tq) + tuple(part[4:]),
                          seqlen_k=attn.seqlen_k,
                          options=ScoreOptions(opts.softcap, None, opts.sinks))
        tails = [_tail(a, seqlens, tq, table) for a in (k, v, k_scale, v_scale)]
        tree_view = np.broadcast_to(tree[rows][:, None], (n, heads, tq, tq))
        new = run_part(attn, q_rows, (slice(None), tails[0], tails[1],
                                      np.full(n, tq, np.int64), tails[2], tails[3]),
                       seqlen_k=tq, options=ScoreOptions(opts.softcap, None, None, tree_view))
        merge_into(out, lse, rows, [cached, new])
    return finish(out, lse, return_lse)
