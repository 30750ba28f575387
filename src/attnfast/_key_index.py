"""key_index=: attention over selected keys (DeepSeek's sparse attention, DSA), checked.

A query row lists the key positions it attends over (int32, -1 for none): one list per
(sequence, query) shared by every head, (B, Tq, k), or one per KV head, (B, Hkv, Tq, k).
The kernels gather the listed rows a chunk at a time and read no other key
(csrc/decode.cpp, run_chunk).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ._arrays import _shape_str


def check_key_index(key_index, *, rank: int, batch: int, kv_heads: int, seqlen_q: int,
                    seqlens, options) -> np.ndarray | None:
    """key_index as the kernels read it: int32 (B, 1 or Hkv, Tq, k), last axis contiguous;
    None when not given.

    rank: q's rank (the shapes accepted follow it: 4-D q takes (B, Tq, k) or
    (B, Hkv, Tq, k); 3-D q (Tq, k) or (Hkv, Tq, k); 2-D q (Tq, k)). seqlens: the keys each
    sequence holds (an int for all, or one per sequence): every listed position must be
    below it. options: the call's ScoreOptions (ALiBi and masks do not combine with it).
    """
    if key_index is None:
        return None
    if options.alibi is not None or options.mask is not None:
        raise NotImplementedError("key_index does not combine with alibi_slopes or mask (not "
                                  "implemented); softcap and sinks do")
    arr = np.asarray(key_index)
    if arr.dtype == np.bool_ or arr.dtype.kind not in "iu":
        raise TypeError(f"key_index must be an integer array (int32 positions), got dtype {arr.dtype}")
    shared = {4: (batch, seqlen_q), 3: (seqlen_q,), 2: (seqlen_q,)}[rank]
    per_head = {4: (batch, kv_heads, seqlen_q), 3: (kv_heads, seqlen_q), 2: None}[rank]
    if arr.ndim >= 1 and arr.shape[:-1] == shared:
        view = arr.reshape((batch, 1, seqlen_q, arr.shape[-1]))
    elif per_head is not None and arr.ndim >= 1 and arr.shape[:-1] == per_head:
        view = arr.reshape((batch, kv_heads, seqlen_q, arr.shape[-1]))
    else:
        wanted = " or ".join(f"({', '.join(map(str, s + ('k',)))})" for s in (shared, per_head) if s)
        raise ValueError(f"key_index must have shape {wanted} (query positions, then the k listed "
                         f"keys), got {_shape_str(arr)}")
    if view.size == 0:
        return np.ascontiguousarray(view, dtype=np.int32)
    low = int(view.min())
    if low < -1:
        raise ValueError(f"key_index entries must be key positions >= 0 or -1 (none), got {low}")
    lengths = np.broadcast_to(np.asarray(seqlens, dtype=np.int64), (batch,))
    past = view >= lengths[:, None, None, None]
    if past.any():
        b, g, i, x = (int(n) for n in np.argwhere(past)[0])
        raise ValueError(f"key_index[{b}, {'' if view.shape[1] == 1 else f'{g}, '}{i}, {x}] = "
                         f"{int(view[b, g, i, x])} is at or past sequence {b}'s length "
                         f"{int(lengths[b])}")
    ordered = np.sort(view, axis=-1)
    repeated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if repeated.any():
        b, g, i, _ = (int(n) for n in np.argwhere(repeated)[0])
        values, counts = np.unique(view[b, g, i][view[b, g, i] >= 0], return_counts=True)
        raise ValueError(f"key_index lists key {int(values[counts > 1][0])} twice for query "
                         f"{i} of sequence {b}: positions must be distinct (-1 may repeat)")
    return np.ascontiguousarray(view, dtype=np.int32)


def with_key_index(call, key_index, seqlens):
    """A checked AttentionCall with key_index checked (check_key_index) against `seqlens`,
    the keys each sequence holds, and carried in its options; the call itself without one."""
    if key_index is None:
        return call
    index = check_key_index(key_index, rank=call.rank, batch=call.batch, kv_heads=call.kv_heads,
                            seqlen_q=call.seqlen_q, seqlens=seqlens, options=call.options)
    return dataclasses.replace(call, options=dataclasses.replace(call.options, key_index=index))
