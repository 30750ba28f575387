"""Attention composed from several kernel calls over disjoint sets of keys, merged exactly.

Shared-prefix decoding (attnfast._shared_prefix) and tree verification (attnfast._tree) both
split one checked call's keys into parts, run the existing kernels once per part with
``return_lse`` and combine the parts by log-sum-exp (:func:`attnfast.merge_attention_states`).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import _ext
from ._api import kernel_call, merge_attention_states, run_kernels
from ._descriptors import ScoreOptions
from ._formats import FLOAT64


def compute_queries(attn) -> np.ndarray:
    """The call's q in the precision parts are computed and merged in: float64 stays, every
    other dtype becomes float32 (exact: a 16-bit query widens without rounding), so the
    composed result is rounded to q's dtype once, at the end, as a single call's is."""
    return attn.q if attn.q.dtype == FLOAT64 else attn.q.astype(np.float32)


def _part_call(attn, q, *, seqlen_k, causal, window, query_offset, options):
    if options is None:
        options = ScoreOptions(softcap=attn.options.softcap)
    return dataclasses.replace(attn, q=q, batch=q.shape[0], seqlen_q=q.shape[2],
                               seqlen_k=seqlen_k, dtype=q.dtype, causal=causal, window=window,
                               query_offset=query_offset, options=options)


def run_part(attn, q, part, *, seqlen_k, causal=False, window=(-1, -1), query_offset=None,
             options=None):
    """(out, lse) of one kernel call: `attn`'s scale and thread count with q (n, H, Tq, D),
    one `part` as run_kernels takes it (slice(None) rows), the given key count, alignment
    and options (default: every key of the part visible, softcap only)."""
    sub = _part_call(attn, q, seqlen_k=seqlen_k, causal=causal, window=window,
                     query_offset=query_offset, options=options)
    return run_kernels(sub, None, True, [part])


def plan_part(attn, q, part, *, seqlen_k, causal=False, window=(-1, -1), query_offset=None,
              options=None) -> dict:
    """What run_part with these arguments would run (attnfast.explain's dict), computing
    nothing."""
    sub = _part_call(attn, q, seqlen_k=seqlen_k, causal=causal, window=window,
                     query_offset=query_offset, options=options)
    args, kwargs = kernel_call(sub, part)
    return _ext.plan_attention(*args, **kwargs)


def start_result(attn, user_out, return_lse):
    """The arrays a composed call fills: out (the caller's, or a new one) and lse (or None)."""
    out = user_out if user_out is not None else np.empty(attn.out_shape(), attn.dtype)
    lse = np.empty(attn.lse_shape(), attn.lse_dtype) if return_lse else None
    return out, lse


def merge_into(out, lse, rows, states) -> None:
    """Merge the (out, lse) `states` of rows `rows` and write them to out[rows] (rounded to
    out's dtype once) and lse[rows]."""
    if len(states) == 1:
        merged_out, merged_lse = states[0]
    else:
        merged_out, merged_lse = merge_attention_states([s[0] for s in states],
                                                        [s[1] for s in states])
    out[rows] = merged_out
    if lse is not None:
        lse[rows] = merged_lse


def finish(out, lse, return_lse):
    return (out, lse) if return_lse else out
