"""attnfast.index_topk: the lightning indexer of DeepSeek's sparse attention, fused with its
top-k (csrc/indexer.cpp, csrc/kernels/index_scores.inl)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from . import _ext
from ._arrays import _shape_str
from ._scalars import check_flag
from ._interop import accepts_arrays
from ._runtime import _positive_int, resolve_threads

__all__ = ["index_topk"]

_KEY_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn))
_MAX_HEAD_DIM = 1024


def _float32(x, name: str, shape: tuple, text: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind != "f" and arr.dtype not in _KEY_DTYPES[1:]:
        raise TypeError(f"{name} must be a float array, got dtype {arr.dtype}")
    if arr.shape != shape:
        raise ValueError(f"{name} must have shape {text}, got {_shape_str(arr)}")
    return np.ascontiguousarray(arr, dtype=np.float32)


@accepts_arrays
def index_topk(q, weights, k_index, topk, *, cache_seqlens=None, k_scale=None, block_table=None,
               causal=True, return_scores=False, num_threads=None):
    """The lightning indexer of DeepSeek-V3.2 / GLM-5 with its top-k, in one call.

    For query t of sequence b and every key position s it sees, the index score

    ``I[b, t, s] = k_scale[b, s] * sum_h weights[b, t, h] * relu(q[b, h, t] . k_index[b, s])``

    (float32 sums), and the ``topk`` best positions: what :func:`attention_with_kvcache`
    takes as ``key_index=``. Keys are scored a chunk at a time and a running selection keeps
    the best, so no Tq x L array is built, for a decode step (Tq = 1) as for a prefill.

    Parameters
    ----------
    q : array (B, Hi, Tq, Di)
        The indexer's queries, Di <= 1024: float32; bfloat16, whose products with bfloat16
        or float8 keys are exact, run by the CPU's bfloat16 dot products (AVX512_BF16) where
        it has them (about twice the float32 rate; the sums stay float32, in another order);
        float16 is widened to float32.
    weights : array (B, Tq, Hi)
        Per query and indexer head, float (used as float32).
    k_index : array (B, L, Di), or a pool (num_blocks, block_size, Di) with block_table
        The index-key cache: float32, bfloat16 or float8_e4m3fn (DeepSeek's layout: float8
        keys with one float32 scale per token, 132 bytes at Di = 128).
    topk : int >= 1
    cache_seqlens : int or integer array (B,), optional
        Keys each sequence holds (default: all L, or max_blocks x block_size when paged).
    k_scale : float32 array (B, L) or (num_blocks, block_size), optional
        One scale per key (required for float8 keys; default 1 otherwise).
    block_table : integer array (B, max_blocks), optional
        A paged index-key pool, as in :func:`attention_with_kvcache`.
    causal : bool, default True
        Query t sees the keys ``s <= cache_seqlens[b] - Tq + t`` (bottom-right aligned, the
        queries being the last Tq tokens); False: every key of its sequence.
    return_scores : bool
        Also return the selected keys' scores, float32 (B, Tq, topk).
    num_threads : int, optional
        The result is the same for any value.

    Returns
    -------
    int32 (B, Tq, topk): positions by descending score, ties to the lower position (a NaN
    score ranks as -inf), -1 where the query sees fewer than topk keys; with return_scores
    also (B, Tq, topk) float32 scores (-inf where the position is -1).
    """
    q = np.asarray(q)
    if q.dtype.kind != "f" and q.dtype not in _KEY_DTYPES[1:]:
        raise TypeError(f"q must be a float array, got dtype {q.dtype}")
    if q.ndim != 4:
        raise ValueError(f"q must be 4-D (B, Hi, Tq, Di), got shape {_shape_str(q)}")
    B, Hi, Tq, Di = q.shape
    if not 1 <= Di <= _MAX_HEAD_DIM or Hi < 1:
        raise ValueError(f"q {_shape_str(q)}: need Hi >= 1 and 1 <= Di <= {_MAX_HEAD_DIM}")
    # bfloat16 stays bfloat16 (exact products by vdpbf16ps where the CPU has them); any other
    # float type is widened to float32.
    q32 = np.ascontiguousarray(q, dtype=q.dtype if q.dtype == _KEY_DTYPES[1] else np.float32)
    w32 = _float32(weights, "weights", (B, Tq, Hi), f"(B, Tq, Hi) = ({B}, {Tq}, {Hi})")
    k_top = _positive_int(topk, "topk")
    causal = check_flag(causal, "causal")
    return_scores = check_flag(return_scores, "return_scores")

    keys = np.asarray(k_index)
    if keys.dtype not in _KEY_DTYPES:
        raise TypeError(f"k_index must be float32, bfloat16 or float8_e4m3fn, got dtype {keys.dtype}")
    if keys.ndim != 3 or keys.shape[2] != Di:
        raise ValueError(f"k_index must be 3-D (B, L, Di) (or a pool (num_blocks, block_size, Di)) "
                         f"with Di = {Di} as q, got {_shape_str(keys)}")
    keys = keys if keys.strides[2] == keys.itemsize or Di == 1 else np.ascontiguousarray(keys)
    table = None
    if block_table is None:
        if keys.shape[0] != B:
            raise ValueError(f"k_index {_shape_str(keys)} holds {keys.shape[0]} sequences, q {B}")
        capacity = keys.shape[1]
        scale_shape = (B, capacity)
    else:
        table = np.asarray(block_table)
        if table.dtype.kind not in "iu" or table.ndim != 2 or table.shape[0] != B:
            raise ValueError(f"block_table must be an integer array (B, max_blocks) with B = {B}, "
                             f"got {table.dtype} {_shape_str(table)}")
        table = np.ascontiguousarray(table, dtype=np.int64)
        capacity = table.shape[1] * keys.shape[1]
        scale_shape = keys.shape[:2]
    if cache_seqlens is None:
        lengths = np.full(B, capacity, np.int64)
    else:
        given = np.asarray(cache_seqlens)
        if given.dtype.kind not in "iu" or given.shape not in ((), (B,)):
            raise TypeError(f"cache_seqlens must be an int or integers (B,) = ({B},), got "
                            f"{given.dtype} {_shape_str(given)}")
        lengths = np.ascontiguousarray(np.broadcast_to(given, (B,)), dtype=np.int64)
        if lengths.size and (lengths.min() < 0 or lengths.max() > capacity):
            raise ValueError(f"cache_seqlens must be in [0, {capacity}], got {lengths.tolist()}")
    if table is not None:
        blocks = keys.shape[0]
        for b in range(B):
            used = table[b, :(int(lengths[b]) + keys.shape[1] - 1) // keys.shape[1]]
            if used.size and (used.min() < 0 or used.max() >= blocks):
                raise ValueError(f"block_table[{b}] names a block outside [0, {blocks}) among the "
                                 f"blocks sequence {b} uses: {used.tolist()}")
    scales = None
    if k_scale is not None:
        scales = np.asarray(k_scale)
        if scales.dtype != np.float32 or scales.shape != scale_shape:
            raise TypeError(f"k_scale must be float32 {scale_shape}, got {scales.dtype} {_shape_str(scales)}")
        scales = scales if scales.ndim and scales.strides[-1] == 4 else np.ascontiguousarray(scales)
    elif keys.dtype == _KEY_DTYPES[2]:
        raise ValueError("k_index is float8_e4m3fn: k_scale (one float32 scale per key) is required")
    index = np.empty((B, Tq, k_top), np.int32)
    scores = np.empty((B, Tq, k_top), np.float32) if return_scores else None
    _ext.run_index_topk(q32, w32, keys, scales, table, lengths, causal, k_top, index, scores,
                        resolve_threads(num_threads))
    return (index, scores) if return_scores else index
