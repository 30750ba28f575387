"""The checks of attention over a KV cache, contiguous or paged: the caches and their scales,
the new tokens, the lengths, block tables and tree masks. Everything is checked before
anything is written."""
from __future__ import annotations

import numpy as np

from ._arrays import (BFLOAT16, FLOAT16, FLOAT32, LOWP_DTYPES, _DTYPE_NAMES, _format_label,
                      _row_scaled_names, _shape_str, as_float_array, check_query_kv_dtypes,
                      is_quantized, is_row_scaled, kernel_ready, whole_elements)
from ._attention_checks import check_score_options
from ._descriptors import AttentionCall, CacheLayout, KVCacheCall
from ._formats import format_of_storage, names, quantized_formats
from ._runtime import resolve_threads
from ._scalars import (_ints_per_sequence, bound_window, check_flag, check_query_offset,
                       check_scale, check_window)
from ._written import check_apart, check_latent_tokens, check_written, is_latent_view


def _exact_dtype(arr: np.ndarray, name: str) -> np.dtype:
    """The dtype of an array attnfast writes into in place: a KV format's storage dtype,
    native order (a conversion would be a copy, and the writes would be lost)."""
    dt = arr.dtype
    if format_of_storage(dt) is not None and dt.isnative:
        return dt
    quantized = [str(f.storage) for f in quantized_formats() if not f.packed]
    raise TypeError(f"{name} must be a {_DTYPE_NAMES} (or {', '.join(quantized)}) array in native "
                    f"byte order, got dtype {dt}")


def check_cache_scales(k_scale, v_scale, cache_dtype: np.dtype, shape: tuple,
                       names=("k_scale", "v_scale")):
    """The float32 (batch, kv_heads, capacity) row scales of a row-scaled cache (int8,
    float8); None for others."""
    if not is_row_scaled(cache_dtype):
        first, rest = _row_scaled_names()
        for name, a in zip(names, (k_scale, v_scale)):
            if a is not None:
                raise ValueError(f"{name} is only for an {first} cache (or a {rest} one); "
                                 f"the cache has dtype {cache_dtype}")
        return None, None
    for name, a in zip(names, (k_scale, v_scale)):
        if a is None:
            raise ValueError(f"an {cache_dtype} cache needs {names[0]} and {names[1]} (float32 arrays of "
                             f"shape {shape}); {name} is None")
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray (it is read and written in place), "
                            f"got {type(a).__name__}")
        if a.dtype != FLOAT32 or not a.dtype.isnative:
            raise TypeError(f"{name} must be float32, got dtype {a.dtype}")
        if a.shape != shape:
            raise ValueError(f"{name} must have shape {shape} (batch, kv_heads, capacity), got "
                             f"{_shape_str(a)}")
        if whole_elements(a) is not a:  # written in place: a copy would lose the writes
            raise ValueError(f"{name} must be aligned with strides that are whole float32 "
                             f"elements (it is written in place), got strides {a.strides}")
    return k_scale, v_scale


def check_key_rotation(key_rotation, cache_dtype: np.dtype, name: str = "key_rotation"):
    """None or "hadamard" (attnfast._rotation), the latter for quantised caches only."""
    if key_rotation is None:
        return None
    if not isinstance(key_rotation, str) or key_rotation != "hadamard":
        raise ValueError(f"{name} must be None or \"hadamard\", got {key_rotation!r}")
    if not is_quantized(cache_dtype):
        raise ValueError(f"{name}=\"hadamard\" is for {names(quantized_formats(), 'and')} caches (it makes "
                         f"their per-token scales robust to outlier channels); the cache has "
                         f"dtype {cache_dtype}")
    return key_rotation


def check_cache_seqlens(cache_seqlens, batch: int, capacity: int | None,
                        new_tokens: int) -> np.ndarray:
    """cache_seqlens (an int, or integers of shape (batch,)) -> int64 (batch,), each in
    [0, capacity - new_tokens] so the new tokens fit (capacity None: a paged call, whose
    block table is checked for room; only values int64 arithmetic cannot hold are refused)."""
    arr = _ints_per_sequence(cache_seqlens, "cache_seqlens", (batch,))
    if batch and arr.min() < 0:
        b = int(np.argmax(arr < 0))
        raise ValueError(f"cache_seqlens must be >= 0; cache_seqlens[{b}] = {arr[b]}")
    if capacity is None:
        if batch and arr.max() > np.iinfo(np.int64).max // 2:
            raise ValueError(f"cache_seqlens values are too large, got {arr.max()}")
        return np.ascontiguousarray(arr, dtype=np.int64)
    room = capacity - new_tokens
    if batch and arr.max() > room:
        b = int(np.argmax(arr > room))
        if new_tokens:
            raise ValueError(f"cache full: cache_seqlens[{b}] = {arr[b]} plus {new_tokens} new "
                             f"token(s) exceeds the cache capacity {capacity}")
        raise ValueError(f"cache_seqlens[{b}] = {arr[b]} exceeds the cache capacity {capacity}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _check_array_pair(k_cache, v_cache, names, four_d: str):
    """The part every caller-owned K/V pair shares: both writable-in-place ndarrays, 4-D
    (`four_d` says which 4 axes, for the message), one exact dtype -> that dtype."""
    kn, vn = names
    for name, a in ((kn, k_cache), (vn, v_cache)):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray (it is read and written in place), "
                            f"got {type(a).__name__}")
        if a.ndim != 4:
            raise ValueError(f"{name} must be {four_d}, got shape {_shape_str(a)}")
    kd, vd = _exact_dtype(k_cache, kn), _exact_dtype(v_cache, vn)
    if kd != vd:
        raise TypeError(f"{kn} and {vn} must share a dtype; got {kd} and {vd}")
    return kd


def is_int4_storage(cache) -> bool:
    """Whether a caller's cache array holds a packed format's rows (int4: uint8, the packed
    blocks of attnfast._int4), whose length does not say the head dim."""
    if not isinstance(cache, np.ndarray):
        return False
    fmt = format_of_storage(cache.dtype)
    return fmt is not None and fmt.packed


def int4_head_dims(q, k_cache, v_head_dim, name: str = "v_head_dim"):
    """(D, Dv) of an int4 cache passed as its packed uint8 rows (attention_with_kvcache,
    explain): D is q's head dim, Dv ``v_head_dim`` (default D). None for any other cache, for
    which ``v_head_dim`` must be None (their last axes say the head dims)."""
    if not is_int4_storage(k_cache):
        if v_head_dim is not None:
            raise ValueError(f"{name} is for int4 caches (uint8 arrays of packed rows) only; "
                             f"the caches' last axes give the head dims, got {name}={v_head_dim!r}")
        return None
    shape = getattr(q, "shape", None)
    if not shape:
        return None  # q itself is rejected by the checks that follow
    D = int(shape[-1])
    if v_head_dim is None:
        return D, D
    if isinstance(v_head_dim, (bool, np.bool_)) or not isinstance(v_head_dim, (int, np.integer)) \
            or v_head_dim < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v_head_dim!r}")
    return D, int(v_head_dim)


def _check_head_dims(k_cache, v_cache, names, dtype, head_dims) -> tuple[int, int]:
    """(D, Dv) of a cache pair: their last axes, or for int4 storage (uint8) `head_dims`,
    which the packed rows must fit (attnfast._int4.packed_size)."""
    kn, vn = names
    fmt = format_of_storage(dtype)
    if fmt is not None and fmt.packed:
        if head_dims is None:
            raise TypeError(f"{kn} and {vn} are {dtype}: {fmt.name} caches are used through "
                            f"attnfast.KVCache / PagedKVCache(dtype=\"{fmt.name}\"), which know their "
                            "head dims, or attention_with_kvcache (v_head_dim= gives Dv)")
        D, Dv = head_dims
        for name, a, dim in ((kn, k_cache, D), (vn, v_cache, Dv)):
            if a.shape[3] != fmt.stored_dim(dim):
                raise ValueError(f"{name} {_shape_str(a)} does not hold {fmt.name} rows of {dim} "
                                 f"values ({fmt.row_bytes(dim)} bytes each)")
        return D, Dv
    if k_cache.shape[3] < 1 or v_cache.shape[3] < 1:
        raise ValueError(f"head dims must be >= 1; got {kn} {_shape_str(k_cache)}, "
                         f"{vn} {_shape_str(v_cache)}")
    return k_cache.shape[3], v_cache.shape[3]


def check_new_tokens(k_new, v_new, *, batch, kv_heads, head_dim, head_dim_v, dtype):
    """k_new (batch, kv_heads, t, head_dim) and v_new (batch, kv_heads, t, head_dim_v), both
    or neither -> (k_new, v_new, t) with t >= 1, or (None, None, 0)."""
    if k_new is None and v_new is None:
        return None, None, 0
    if k_new is None or v_new is None:
        given, missing = ("k_new", "v_new") if v_new is None else ("v_new", "k_new")
        raise ValueError(f"k_new and v_new must be given together; got {given} but {missing} is None")
    k_new = as_float_array(k_new, "k_new")
    v_new = as_float_array(v_new, "v_new")
    for name, a in (("k_new", k_new), ("v_new", v_new)):
        if is_quantized(dtype):  # quantised on the way in
            if a.dtype not in (FLOAT32, FLOAT16, BFLOAT16):
                kind = _format_label(dtype)
                raise TypeError(f"{name} for an {kind} cache must be float32, float16 or bfloat16 "
                                f"(quantised on append), got {a.dtype}")
        elif a.dtype != dtype and not (dtype in LOWP_DTYPES and a.dtype == FLOAT32):
            allowed = f"{dtype} or float32 (rounded to {dtype})" if dtype in LOWP_DTYPES else str(dtype)
            raise TypeError(f"{name} must have the cache's dtype {allowed}, got {a.dtype}")
        if a.ndim != 4:
            raise ValueError(f"{name} must be 4-D (batch, kv_heads, new_tokens, dim), got shape "
                             f"{_shape_str(a)}")
    if k_new.dtype != v_new.dtype:
        raise TypeError(f"k_new and v_new must share a dtype; got {k_new.dtype} and {v_new.dtype}")
    t = k_new.shape[2]
    want_k = (batch, kv_heads, t, head_dim)
    want_v = (batch, kv_heads, t, head_dim_v)
    if k_new.shape != want_k or t < 1:
        raise ValueError(f"k_new must have shape (batch={batch}, kv_heads={kv_heads}, "
                         f"new_tokens>=1, head_dim={head_dim}), got {_shape_str(k_new)}")
    if v_new.shape != want_v:
        raise ValueError(f"v_new must have shape {want_v} (k_new has {t} new token(s)), "
                         f"got {_shape_str(v_new)}")
    return k_new, v_new, t


def caller_caches(k_cache, v_cache, k_scale=None, v_scale=None, *, paged=False,
                  names=("k_cache", "v_cache"), scale_names=("k_scale", "v_scale"), q=None,
                  v_head_dim=None) -> CacheLayout:
    """A caller's caches (B, Hkv, capacity, D|Dv), or with `paged` pools (num_blocks, Hkv,
    block_size, D|Dv), and their row scales (B | num_blocks, Hkv, capacity | block_size)
    -> their CacheLayout. int4 (uint8) rows do not say their head dims: q's and v_head_dim
    (int4_head_dims)."""
    kn, vn = names
    head_dims = int4_head_dims(q, k_cache, v_head_dim)
    dtype = _check_array_pair(k_cache, v_cache, names, (
        "a 4-D pool (num_blocks, kv_heads, block_size, head_dim) with block_table" if paged
        else "4-D (batch, kv_heads, capacity, head_dim)"))
    if paged:
        if v_cache.shape[2] != k_cache.shape[2]:
            raise ValueError(f"block_size differs: {kn} {_shape_str(k_cache)} has block_size "
                             f"{k_cache.shape[2]} (axis 2), {vn} {_shape_str(v_cache)} has "
                             f"{v_cache.shape[2]}")
        if v_cache.shape[:2] != k_cache.shape[:2]:
            raise ValueError(f"{vn} must match {kn} on (num_blocks, kv_heads); got {kn} "
                             f"{_shape_str(k_cache)}, {vn} {_shape_str(v_cache)}")
        if k_cache.shape[2] < 1:
            raise ValueError(f"block_size (axis 2 of {kn}) must be >= 1, got {_shape_str(k_cache)}")
    elif v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"{vn} must match {kn} on (batch, kv_heads, capacity); got {kn} "
                         f"{_shape_str(k_cache)}, {vn} {_shape_str(v_cache)}")
    D, Dv = _check_head_dims(k_cache, v_cache, names, dtype, head_dims)
    sizes = k_cache.shape[:3]
    if paged and is_row_scaled(dtype):
        for name, a in zip(scale_names, (k_scale, v_scale)):
            if isinstance(a, np.ndarray) and a.ndim == 3 and a.shape[:2] == sizes[:2] \
                    and a.shape[2] != sizes[2]:
                raise ValueError(f"block_size differs: {name} {_shape_str(a)} has block_size "
                                 f"{a.shape[2]} (axis 2), the pools have {sizes[2]}")
    k_scale, v_scale = check_cache_scales(k_scale, v_scale, dtype, sizes, scale_names)
    return CacheLayout(sizes=sizes, head_dim=D, head_dim_v=Dv, dtype=dtype, names=names,
                       scale_names=scale_names, k=k_cache, v=v_cache, k_scale=k_scale,
                       v_scale=v_scale)


def _checked_query(q, cache: CacheLayout, batch: int):
    """q (batch, H, Tq, D) for attention over `cache` -> (q as an array, H, Tq)."""
    (kn, vn), (_, Hkv, _), D = cache.names, cache.sizes, cache.head_dim
    q = as_float_array(q, "q")
    if q.ndim != 4:
        raise ValueError(f"q must be 4-D (batch, heads, query_len, head_dim), got shape {_shape_str(q)}")
    check_query_kv_dtypes(q.dtype, cache.dtype, f"the cache ({kn}, {vn})")
    Bq, H, Tq, Dq = q.shape
    sizes = cache.sizes if batch is None else (batch,) + cache.sizes[1:]  # (the call's part)
    k_shape = str(sizes + (format_of_storage(cache.dtype).stored_dim(D),))
    if batch is not None and Bq != batch:
        raise ValueError(f"batch size differs: q {_shape_str(q)} has {Bq}, {kn} {k_shape} has {batch}")
    if Dq != D:
        raise ValueError(f"q and {kn} must share the head dim D; got q {_shape_str(q)}, {kn} {k_shape}")
    if H % Hkv != 0:
        raise ValueError(f"query heads must be a multiple of kv heads (GQA/MQA); got q "
                         f"{_shape_str(q)} with H={H}, {kn} {k_shape} with Hkv={Hkv}")
    return q, H, Tq


def _kvcache_call(q, cache: CacheLayout, heads, seqlen_q, capacity, starts, k_new, v_new, t, *,
                  causal, scale, window, query_offset, softcap, alibi_slopes, sinks, mask,
                  num_threads, block_table=None) -> KVCacheCall:
    """The checks check_kvcache_attention and check_paged_kvcache_attention share once their
    caches, tokens and lengths are checked: the arrays written (the caches, their scales)
    writeable and apart when tokens are written, then the attention options."""
    B, Hkv, C, D, Dv = q.shape[0], cache.sizes[1], capacity, cache.head_dim, cache.head_dim_v
    if t:
        for (name, a), why in zip(cache.arrays(), 2 * ("k_new/v_new must be written into it",)
                                  + 2 * ("the new tokens' scales must be written into it",)):
            if a is not None:
                check_written(a, name, why)
    attn = AttentionCall(
        q=kernel_ready(q), k=cache.k, v=cache.v, rank=4, batch=B, heads=heads, kv_heads=Hkv,
        seqlen_q=seqlen_q, seqlen_k=C, head_dim=D, head_dim_v=Dv, dtype=q.dtype,
        kv_dtype=cache.dtype, scale=check_scale(scale, D, q.dtype),
        causal=check_flag(causal, "causal"),
        window=bound_window(check_window(window), seqlen_q, C, check_query_offset(query_offset)),
        query_offset=check_query_offset(query_offset),
        options=check_score_options(softcap, alibi_slopes, sinks, mask, batch=B, heads=heads,
                                    seqlen_q=seqlen_q, seqlen_k=C, rank=4, dtype=q.dtype),
        num_threads=resolve_threads(num_threads))
    if t and cache.k is not None:  # the new tokens are written into the caches (and
        # scales): all apart, and apart from what is read. v inside k (a latent cache):
        # k_new writes both. Not for a quantised cache: its keys and values are quantised
        # (and the keys rotated) apart, so the two writes to the shared rows would differ
        # (check_apart refuses the overlap).
        latent = not is_quantized(cache.dtype) and is_latent_view(cache.k, cache.v)
        if latent:
            check_latent_tokens(k_new, v_new, Dv)
        written = cache.arrays()
        if latent:
            written[1] = (written[1][0], None)
        check_apart(written, [("q", q), ("k_new", k_new), ("v_new", v_new),
                              ("block_table", block_table)] + attn.options.arrays())
    return KVCacheCall(attn=attn, cache=cache, starts=starts, k_new=k_new, v_new=v_new,
                       new_tokens=t, block_table=block_table)


def check_kvcache_attention(q, cache: CacheLayout, cache_seqlens, k_new, v_new, *, causal,
                            scale, window, num_threads, query_offset=None, softcap=None,
                            alibi_slopes=None, sinks=None, mask=None) -> KVCacheCall:
    """Everything attention over a KV cache (caller_caches, or a cache class's own layout)
    needs, checked before anything is written."""
    B, Hkv, C = cache.sizes
    q, H, Tq = _checked_query(q, cache, B)
    k_new, v_new, t = check_new_tokens(k_new, v_new, batch=B, kv_heads=Hkv,
                                       head_dim=cache.head_dim, head_dim_v=cache.head_dim_v,
                                       dtype=cache.dtype)
    starts = check_cache_seqlens(cache_seqlens, B, C, t)
    return _kvcache_call(q, cache, H, Tq, C, starts, k_new, v_new, t, causal=causal,
                         scale=scale, window=window, query_offset=query_offset,
                         softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, mask=mask,
                         num_threads=num_threads)


def check_block_table(block_table, batch: int, name: str = "block_table") -> np.ndarray:
    """An int32 / int64 (batch, max_blocks) table of block ids -> int64 (batch, max_blocks)
    with a contiguous last axis (a copy only for int32 or a strided last axis; ids are
    checked against the pool by check_paged_kvcache_attention)."""
    if isinstance(block_table, (bool, np.bool_)) or np.isscalar(block_table):
        raise TypeError(f"{name} must be an int32 or int64 array (batch, max_blocks), got "
                        f"{type(block_table).__name__} {block_table!r}"[:200])
    arr = np.asarray(block_table)
    if arr.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise TypeError(f"{name} must have dtype int32 or int64, got {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D (batch, max_blocks), got shape {arr.shape}")
    if arr.shape[0] != batch:
        raise ValueError(f"{name} must have one row per sequence: shape ({batch}, max_blocks), "
                         f"got {arr.shape}")
    if arr.dtype != np.int64 or not arr.dtype.isnative:
        arr = arr.astype(np.int64)
    return kernel_ready(arr)


def check_paged_blocks(table: np.ndarray, lengths: np.ndarray, block_size: int,
                       num_blocks: int, name: str = "block_table") -> None:
    """Every block a sequence of `lengths[b]` tokens uses (its first ceil(len / block_size)
    table entries) must be an id in [0, num_blocks); later entries are not read."""
    used = -(-lengths // block_size)
    over = used > table.shape[1]
    if np.any(over):
        b = int(np.argmax(over))
        raise ValueError(f"too few blocks: sequence {b} needs {int(used[b])} block(s) of "
                         f"{block_size} for {int(lengths[b])} token(s), but {name} has "
                         f"{table.shape[1]} column(s)")
    in_use = np.arange(table.shape[1])[None, :] < used[:, None]
    bad = in_use & ((table < 0) | (table >= num_blocks))
    if np.any(bad):
        b, i = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"{name}[{b}, {i}] = {int(table[b, i])} is not a block id of the pool "
                         f"(must be in [0, {num_blocks}); sequence {b} uses its first "
                         f"{int(used[b])} entries)")


def check_paged_writes(table: np.ndarray, starts: np.ndarray, new_tokens: int,
                       block_size: int, name: str = "block_table") -> None:
    """The new tokens of different sequences must go to different cache rows."""
    if not new_tokens or table.shape[0] < 2:
        return
    pos = starts[:, None] + np.arange(new_tokens)[None, :]
    rows = np.take_along_axis(table, pos // block_size, axis=1) * block_size + pos % block_size
    flat = rows.reshape(-1)
    if np.unique(flat).size != flat.size:
        raise ValueError(f"{name} maps the new tokens of two sequences to the same block row; "
                         "give each sequence its own blocks for the tokens it appends")


def check_paged_kvcache_attention(q, pools: CacheLayout, cache_seqlens, k_new, v_new,
                                  block_table, *, causal, scale, window, num_threads,
                                  query_offset=None, softcap=None, alibi_slopes=None,
                                  sinks=None, mask=None,
                                  table_name="block_table") -> KVCacheCall:
    """check_kvcache_attention for a paged cache: pools (num_blocks, Hkv, block_size, D|Dv)
    read through block_table (B, max_blocks); the logical capacity is max_blocks *
    block_size. Everything is checked before anything is written."""
    NB, Hkv, BS = pools.sizes
    q, H, Tq = _checked_query(q, pools, None)
    B = q.shape[0]
    table = check_block_table(block_table, B, table_name)
    C = table.shape[1] * BS
    k_new, v_new, t = check_new_tokens(k_new, v_new, batch=B, kv_heads=Hkv,
                                       head_dim=pools.head_dim, head_dim_v=pools.head_dim_v,
                                       dtype=pools.dtype)
    starts = check_cache_seqlens(cache_seqlens, B, None, t)
    check_paged_blocks(table, starts + t, BS, NB, table_name)
    check_paged_writes(table, starts, t, BS, table_name)
    return _kvcache_call(q, pools, H, Tq, C, starts, k_new, v_new, t, causal=causal,
                         scale=scale, window=window, query_offset=query_offset,
                         softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, mask=mask,
                         num_threads=num_threads, block_table=table)


MAX_TREE_TOKENS = 64  # tree_mask's Tq limit (issue 22): the new-key part stays small


def check_tree_mask(tree_mask, call: "KVCacheCall") -> np.ndarray | None:
    """tree_mask (Tq, Tq) or (B, Tq, Tq) bool, diagonal True (a new token sees itself), for a
    checked cache call -> a (B, Tq, Tq) bool view, or None without a tree mask. The new
    tokens are each sequence's last Tq keys (with k_new: the t = Tq appended ones); the
    options that cannot be composed with it exactly raise NotImplementedError."""
    if tree_mask is None:
        return None
    attn = call.attn
    B, Tq = attn.batch, attn.seqlen_q
    if isinstance(tree_mask, np.ndarray):
        m = tree_mask
    else:  # an array-like (a nested list, a torch tensor, ...): read it as NumPy does
        try:
            m = np.asarray(tree_mask)
        except (TypeError, ValueError, RuntimeError) as e:  # ragged lists, unreadable objects
            raise ValueError(f"tree_mask must be a bool array (True: new token i sees new token "
                             f"j) of shape (Tq, Tq) or (B, Tq, Tq); got a "
                             f"{type(tree_mask).__name__} NumPy cannot read as one ({e})") from None
    if m.dtype != np.bool_:
        raise TypeError(f"tree_mask must be a bool array (True: new token i sees new token j), "
                        f"got dtype {m.dtype}")
    if m.shape not in ((Tq, Tq), (B, Tq, Tq)):
        raise ValueError(f"tree_mask must have shape (Tq, Tq) = ({Tq}, {Tq}) or (B, Tq, Tq) = "
                         f"({B}, {Tq}, {Tq}), got {_shape_str(m)}")
    if not 1 <= Tq <= MAX_TREE_TOKENS:
        raise ValueError(f"tree_mask takes 1 to {MAX_TREE_TOKENS} query tokens (Tq), got {Tq}")
    ndim = m.ndim
    m = np.broadcast_to(m, (B, Tq, Tq))
    diagonal = m[:, np.arange(Tq), np.arange(Tq)]
    if not diagonal.all():
        b, i = (int(x) for x in np.argwhere(~diagonal)[0])
        where = f"tree_mask[{i}, {i}]" if ndim == 2 else f"tree_mask[{b}, {i}, {i}]"
        raise ValueError(f"tree_mask's diagonal must be True (each new token sees itself); "
                         f"{where} is False")
    unsupported = [name for name, used in (
        ("causal=False", not attn.causal), ("window", attn.window != (-1, -1)),
        ("mask", attn.options.mask is not None), ("alibi_slopes", attn.options.alibi is not None),
        ("query_offset", attn.query_offset is not None)) if used]
    if unsupported:
        raise NotImplementedError(f"tree_mask cannot be combined with {', '.join(unsupported)} "
                                  "(tree_mask alone says which keys each query sees)")
    if call.new_tokens and call.new_tokens != Tq:
        raise ValueError(f"with tree_mask the appended tokens are the tree: k_new must hold Tq = "
                         f"{Tq} tokens, got {call.new_tokens}")
    short = call.seqlens_after < Tq
    if np.any(short):
        b = int(np.argmax(short))
        raise ValueError(f"with tree_mask every sequence must hold its Tq = {Tq} new tokens; "
                         f"sequence {b} holds {int(call.seqlens_after[b])}")
    return m
