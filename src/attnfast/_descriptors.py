"""Call descriptors: what the checks hand to the kernels, frozen and built by keyword."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np

# Keyword-only where Python has it (3.10+); 3.9 builds them by keyword all the same.
descriptor = (dataclass(frozen=True, kw_only=True) if sys.version_info >= (3, 10)
              else dataclass(frozen=True))


@descriptor
class ScoreOptions:
    """Checked score options, in the kernels' terms (see AttentionParams in csrc/attnfast.hpp)."""
    softcap: float = 0.0                # 0 = off
    alibi: np.ndarray | None = None     # float32 (B, H), batch stride 0 for per-head slopes
    sinks: np.ndarray | None = None     # float32 (H,), contiguous
    mask: np.ndarray | None = None      # 4-D (B, H, Tq, Tk) view (zero strides where
                                        # broadcast): bool, or float32 / float64 additive
    key_index: np.ndarray | None = None  # int32 (B, 1 or Hkv, Tq, k): the keys each row
                                         # sees (attnfast._key_index), -1 for none

    @property
    def any(self) -> bool:
        return bool(self.softcap) or self.alibi is not None or self.sinks is not None \
            or self.mask is not None or self.key_index is not None

    def arrays(self) -> list:
        """(name as the caller spells it, array) of the option arrays the kernels read."""
        return [("mask", self.mask), ("alibi_slopes", self.alibi), ("sinks", self.sinks),
                ("key_index", self.key_index)]

    def rows(self, rows) -> "ScoreOptions":
        """The options of the batch entries `rows` (a slice of axis 0)."""
        return ScoreOptions(softcap=self.softcap,
                            alibi=None if self.alibi is None else self.alibi[rows],
                            sinks=self.sinks, mask=None if self.mask is None else self.mask[rows],
                            key_index=None if self.key_index is None else self.key_index[rows])


NO_OPTIONS = ScoreOptions()


@descriptor
class AttentionCall:
    """A checked call: 4-D views for the kernels and what to hand back to the caller."""
    q: np.ndarray
    k: np.ndarray | None  # (None over a cache: its parts say what the kernels read)
    v: np.ndarray | None
    rank: int
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    dtype: np.dtype      # of q and out
    kv_dtype: np.dtype   # of k and v
    scale: float
    causal: bool
    window: tuple[int, int]
    query_offset: int | None  # None: bottom-right; else query row i sits at key i + offset
    num_threads: int
    options: ScoreOptions = NO_OPTIONS

    def out_shape(self) -> tuple[int, ...]:
        full = (self.batch, self.heads, self.seqlen_q, self.head_dim_v)
        return full[4 - self.rank:]

    def lse_shape(self) -> tuple[int, ...]:
        full = (self.batch, self.heads, self.seqlen_q)
        return full[4 - self.rank:]

    @property
    def lse_dtype(self) -> np.dtype:
        return np.dtype(np.float64) if self.dtype == np.float64 else np.dtype(np.float32)


@descriptor
class CacheLayout:
    """A KV cache as the checks see it: its sizes and storage, the names errors give its
    arrays, and the arrays themselves where the checks guard them (writeable, apart from
    what the call reads); None where attnfast guards that memory elsewhere (a
    ShardedKVCache's shards, in their actors)."""
    sizes: tuple[int, int, int]  # (batch, kv_heads, capacity); a pool's (num_blocks,
                                 # kv_heads, block_size)
    head_dim: int
    head_dim_v: int
    dtype: np.dtype              # storage (int4: uint8, its packed rows)
    names: tuple[str, str] = ("k_cache", "v_cache")
    scale_names: tuple[str, str] = ("k_scale", "v_scale")
    k: np.ndarray | None = None
    v: np.ndarray | None = None
    k_scale: np.ndarray | None = None  # row-scaled formats (int8, float8): float32 (*sizes)
    v_scale: np.ndarray | None = None

    def arrays(self) -> list:
        """(name, array) of the arrays the checks guard (None entries included)."""
        return [(self.names[0], self.k), (self.names[1], self.v),
                (self.scale_names[0], self.k_scale), (self.scale_names[1], self.v_scale)]


@descriptor
class KVCacheCall:
    """A checked attention over a KV cache: `attn` holds the kernel-ready q and the options;
    the new tokens go to positions starts[b] .. starts[b] + new_tokens."""
    attn: AttentionCall
    cache: CacheLayout
    starts: np.ndarray
    k_new: np.ndarray | None
    v_new: np.ndarray | None
    new_tokens: int
    block_table: np.ndarray | None = None  # paged caches: int64 (batch, max_blocks)

    k_cache = property(lambda self: self.cache.k)
    v_cache = property(lambda self: self.cache.v)
    k_scale = property(lambda self: self.cache.k_scale)
    v_scale = property(lambda self: self.cache.v_scale)

    @property
    def seqlens_after(self) -> np.ndarray:
        """Keys each sequence attends over: its cached length plus the new tokens."""
        return self.starts + self.new_tokens


@descriptor
class KernelPart:
    """One kernel call of a checked call: rows `rows` (a slice of axis 0) of q, out and lse
    over the caches k, v (of those rows), with per row key lengths and the format's scales
    and block table where the call has them."""
    k: np.ndarray
    v: np.ndarray
    rows: slice = field(default_factory=lambda: slice(None))
    seqlens: np.ndarray | None = None     # keys per row; None: all of k's
    k_scale: np.ndarray | None = None     # row-scaled formats
    v_scale: np.ndarray | None = None
    block_table: np.ndarray | None = None  # paged pools: int64 (rows, max_blocks)
