"""The arguments of the cache classes' constructors and bookkeeping methods (KVCache,
PagedKVCache, ShardedKVCache): sizes and formats, batch_index, sequence ids, truncation,
room and free blocks."""
from __future__ import annotations

import numpy as np

from ._arrays import _DTYPE_NAMES, _format_label, is_quantized
from ._cache_checks import check_key_rotation
from ._formats import KVFormat, format_named, format_of_storage, quantized_formats
from ._runtime import _positive_int
from ._scalars import _as_int, _integer_array, _ints_per_sequence, check_flag


def check_latent_spec(latent, head_dim: int, head_dim_v: int, dtype) -> bool:
    """KVCache(latent=): a bool; a latent cache stores one row per token whose first
    head_dim_v elements are the values, so head_dim_v <= head_dim, and not quantised (int8,
    float8, int4: its K and V rows would need scales of their own)."""
    latent = check_flag(latent, "latent")
    if latent and head_dim_v > head_dim:
        raise ValueError(f"a latent cache's values are a prefix of its rows: v_head_dim must be "
                         f"<= head_dim, got v_head_dim={head_dim_v}, head_dim={head_dim}")
    if latent and is_quantized(dtype):
        kind = _format_label(dtype)
        raise NotImplementedError(f"latent=True with dtype={kind} is not supported (one scale "
                                  "per row cannot serve K and its V prefix); use float32, "
                                  "float16 or bfloat16")
    return latent


def default_key_rotation(key_rotation, cache_dtype: np.dtype):
    """A cache's key_rotation argument: "auto" -> "hadamard" for the formats that rotate keys
    by default, int8 and int4 (measured: per-token int8 keys lose 4x accuracy to outlier
    channels without it, int4 blocks 2x; float8 does not gain), else None; otherwise checked
    as check_key_rotation."""
    if isinstance(key_rotation, str) and key_rotation == "auto":
        fmt = format_of_storage(cache_dtype)
        return "hadamard" if fmt is not None and fmt.rotate_keys else None
    return check_key_rotation(key_rotation, cache_dtype)


def check_cache_spec(batch, kv_heads, head_dim, capacity, dtype, v_head_dim):
    """KVCache(...) arguments -> (B, Hkv, D, capacity, dtype, Dv), all checked."""
    B = _positive_int(batch, "batch")
    Hkv = _positive_int(kv_heads, "kv_heads")
    D = _positive_int(head_dim, "head_dim")
    C = _positive_int(capacity, "capacity")
    Dv = D if v_head_dim is None else _positive_int(v_head_dim, "v_head_dim")
    limit = np.iinfo(np.intp).max // 8
    if B * Hkv * C * max(D, Dv) > limit:
        raise ValueError(f"KVCache(batch={B}, kv_heads={kv_heads}, capacity={C}, head_dim={D}, "
                         f"v_head_dim={Dv}) is too large: {B * Hkv * C * max(D, Dv)} elements per "
                         "array")
    return B, Hkv, D, C, check_cache_dtype(dtype).storage, Dv


def check_cache_dtype(dtype) -> KVFormat:
    """A cache's dtype= -> its format (attnfast._formats): a format's name, or a NumPy /
    ml_dtypes dtype that is a format's storage (not uint8: int4 is named)."""
    fmt = format_named(dtype)
    if fmt is not None:
        return fmt
    quoted = [f'"{f.name}"' for f in quantized_formats()]
    wanted = (f"dtype must be {_DTYPE_NAMES}, or a quantised format {', '.join(quoted[:-1])} "
              f"or {quoted[-1]} (float8 also as the ml_dtypes type)")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{wanted}, got {dtype!r}") from None
    packed = format_of_storage(dt)
    hint = (f" (an {packed.name} cache is dtype=\"{packed.name}\"; {dt} is its storage)"
            if packed is not None and packed.packed else "")
    raise TypeError(f"{wanted}, got {dt}{hint}")


def check_batch_index(batch_index, batch: int) -> np.ndarray:
    """batch_index (None = every sequence, an int, or a 1-D array of distinct ints in
    [0, batch)) -> int64 array of sequence indices."""
    if batch_index is None:
        return np.arange(batch, dtype=np.int64)
    if isinstance(batch_index, (bool, np.bool_)):
        raise TypeError(f"batch_index must be an int or an array of ints, got bool {batch_index!r}")
    if np.size(batch_index) == 0:
        raise ValueError(f"batch_index must select at least one sequence; got an empty "
                         f"{type(batch_index).__name__} (shape {np.shape(batch_index)})")
    arr = _integer_array(batch_index, "batch_index", "an int or an array of ints")
    if arr.ndim > 1:
        raise ValueError(f"batch_index must be an int or a 1-D array, got shape {arr.shape}")
    arr = arr.reshape(-1)
    if arr.min() < 0 or arr.max() >= batch:  # before the int64 cast: uint64 stays exact
        bad = arr[(arr < 0) | (arr >= batch)][0]
        raise ValueError(f"batch_index values must be in [0, {batch}) (the cache's batch), got {bad}")
    idx = arr.astype(np.int64)
    if np.unique(idx).size != idx.size:
        raise ValueError(f"batch_index must not repeat a sequence, got {arr.tolist()}")
    return idx


def check_cache_room(lengths: np.ndarray, seq_index: np.ndarray, new_tokens: int,
                     capacity: int) -> None:
    """KVCache: the selected sequences must have room for new_tokens more tokens."""
    over = lengths[seq_index] + new_tokens > capacity
    if np.any(over):
        b = int(seq_index[np.argmax(over)])
        raise ValueError(f"cache full: sequence {b} holds {lengths[b]} token(s); {new_tokens} more "
                         f"would exceed the capacity {capacity} (nothing was written)")


def check_truncate(n, lengths: np.ndarray, seq_ids=None) -> np.ndarray:
    """truncate(n): n an int or one int per sequence, 0 <= n <= current length. seq_ids:
    the sequences' ids for the message (default: their indices)."""
    arr = _ints_per_sequence(n, "n", lengths.shape)
    if arr.size and arr.min() < 0:
        raise ValueError(f"n must be >= 0, got {arr.min()}")
    if arr.size and np.any(arr > lengths):
        b = int(np.argmax(arr > lengths))
        raise ValueError(f"cannot truncate sequence {b if seq_ids is None else seq_ids[b]} to "
                         f"{arr[b]}: it holds only {lengths[b]} token(s) (truncate only shortens)")
    return arr.astype(np.int64)


def check_paged_spec(num_blocks, block_size, kv_heads, head_dim, dtype, v_head_dim):
    """PagedKVCache(...) arguments -> (num_blocks, block_size, Hkv, D, dtype, Dv), checked."""
    NB = _positive_int(num_blocks, "num_blocks")
    BS = _positive_int(block_size, "block_size")
    _, Hkv, D, _, dt, Dv = check_cache_spec(1, kv_heads, head_dim, 1, dtype, v_head_dim)
    if NB * Hkv * BS * max(D, Dv) > np.iinfo(np.intp).max // 8:
        raise ValueError(f"PagedKVCache(num_blocks={NB}, block_size={BS}, kv_heads={Hkv}, "
                         f"head_dim={D}, v_head_dim={Dv}) is too large: "
                         f"{NB * Hkv * BS * max(D, Dv)} elements per pool")
    return NB, BS, Hkv, D, dt, Dv


def check_seq_ids(seq_ids, known) -> tuple[list[int], bool]:
    """seq_ids: one id or a non-empty sequence of distinct ids, each in `known` ->
    (list of ids, whether one bare id was given)."""
    single = (not isinstance(seq_ids, (list, tuple, np.ndarray))
              or (isinstance(seq_ids, np.ndarray) and seq_ids.ndim == 0))
    if single:  # an int, a NumPy integer or a 0-d integer array: one id
        ids = [seq_ids[()] if isinstance(seq_ids, np.ndarray) else seq_ids]
    else:
        ids = list(seq_ids.reshape(-1).tolist() if isinstance(seq_ids, np.ndarray) else seq_ids)
    if not ids:
        raise ValueError("seq_ids must name at least one sequence; got an empty sequence")
    out = []
    for s in ids:
        sid = _as_int(s, "seq_ids", "a sequence id (int) or a list of them")
        if sid not in known:
            raise ValueError(f"seq_ids: no sequence {sid} in this cache (live ids: "
                             f"{sorted(known)[:16]}{' ...' if len(known) > 16 else ''})")
        out.append(sid)
    if len(set(out)) != len(out):
        raise ValueError(f"seq_ids must not repeat a sequence, got {out}")
    return out, single


def check_free_blocks(needed: int, free: int, what: str) -> None:
    """Raise (changing nothing) when `needed` new blocks exceed the `free` ones."""
    if needed > free:
        raise ValueError(f"out of blocks: {what} needs {needed} new block(s) but only {free} "
                         f"of the pool are free (nothing was written; free sequences or make "
                         f"a larger pool)")


def check_leading_sequences(seqs, batch, **arrays) -> None:
    """Axis 0 of each 4-D array must be the number of selected sequences (``seqs``, indices
    into a cache of ``batch`` sequences); other ranks are reported by the shape checks."""
    for name, a in arrays.items():
        if a is None or np.ndim(a) != 4:
            continue
        n = np.shape(a)[0]
        if n != seqs.size:
            what = (f"the cache holds {batch}" if seqs.size == batch
                    else f"batch_index selects {seqs.size}")
            raise ValueError(f"{name} has {n} sequence(s) on axis 0 (shape {np.shape(a)}), "
                             f"but {what}")


def check_step_tokens(k_new, v_new) -> None:
    """A step's new tokens: k_new and v_new both given (attend() attends without appending)."""
    if k_new is None or v_new is None:
        missing = " and ".join(n for n, a in (("k_new", k_new), ("v_new", v_new)) if a is None)
        raise ValueError(f"step needs both k_new and v_new; {missing} is None (use attend() "
                         "to attend without appending)")
