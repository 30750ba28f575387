# Type stubs for attnfast's public API. tests/test_stubs.py checks every signature here against
# the runtime one (names, kinds, defaults), so a change to a public signature must come here too.
from typing import Any, Literal, Sequence, overload

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

__version__: str
__all__: list[str]

_Window = tuple[int, int] | Sequence[int] | None
_Out = NDArray[Any]
_OutLse = tuple[NDArray[Any], NDArray[Any]]

@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = ...,
              scale: float | None = ..., window: _Window = ..., softcap: float | None = ...,
              alibi_slopes: ArrayLike | None = ..., sinks: ArrayLike | None = ...,
              mask: ArrayLike | None = ..., return_lse: Literal[False] = ...,
              out: NDArray[Any] | None = ..., num_threads: int | None = ..., query_offset: int | None = ...,
              key_index: ArrayLike | None = ...) -> _Out: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = ...,
              scale: float | None = ..., window: _Window = ..., softcap: float | None = ...,
              alibi_slopes: ArrayLike | None = ..., sinks: ArrayLike | None = ...,
              mask: ArrayLike | None = ..., return_lse: Literal[True],
              out: NDArray[Any] | None = ..., num_threads: int | None = ..., query_offset: int | None = ...,
              key_index: ArrayLike | None = ...) -> _OutLse: ...
@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = False,
              scale: float | None = None, window: _Window = None, softcap: float | None = None,
              alibi_slopes: ArrayLike | None = None, sinks: ArrayLike | None = None,
              mask: ArrayLike | None = None, return_lse: bool = False,
              out: NDArray[Any] | None = None,
              num_threads: int | None = None, query_offset: int | None = None,
              key_index: ArrayLike | None = None) -> _Out | _OutLse: ...

def attention_weights(q: ArrayLike, k: ArrayLike, *, causal: bool = False,
                      scale: float | None = None, window: _Window = None,
                      softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
                      sinks: ArrayLike | None = None, mask: ArrayLike | None = None,
                      num_threads: int | None = None, query_offset: int | None = None) -> NDArray[Any]: ...

def attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                       out: ArrayLike, lse: ArrayLike, *, causal: bool = False,
                       scale: float | None = None, window: _Window = None,
                       softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
                       sinks: ArrayLike | None = None, mask: ArrayLike | None = None,
                       num_threads: int | None = None,
                       query_offset: int | None = None,
                       key_index: ArrayLike | None = None) -> tuple[NDArray[Any], ...]: ...

def attention_varlen_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                              out: ArrayLike, lse: ArrayLike, cu_seqlens_q: ArrayLike,
                              cu_seqlens_k: ArrayLike, *, max_seqlen_q: int | None = None,
                              max_seqlen_k: int | None = None, causal: bool = False,
                              scale: float | None = None, window: _Window = None,
                              softcap: float | None = None,
                              alibi_slopes: ArrayLike | None = None,
                              sinks: ArrayLike | None = None,
                              num_threads: int | None = None) -> tuple[NDArray[Any], ...]: ...

def merge_attention_states(outs: Sequence[ArrayLike],
                           lses: Sequence[ArrayLike]) -> _OutLse: ...

@overload
def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike | None = ..., *, seqused_k: ArrayLike | None = ...,
                     block_table: ArrayLike | None = ..., max_seqlen_q: int | None = ...,
                     max_seqlen_k: int | None = ..., causal: bool = ...,
                     scale: float | None = ..., window: _Window = ...,
                     softcap: float | None = ..., alibi_slopes: ArrayLike | None = ...,
                     sinks: ArrayLike | None = ..., mask: ArrayLike | None = ...,
                     return_lse: Literal[False] = ..., out: NDArray[Any] | None = ...,
                     num_threads: int | None = ...,
                     k_scale: ArrayLike | None = ..., v_scale: ArrayLike | None = ...,
                     key_rotation: str | None = ..., v_head_dim: int | None = ...) -> _Out: ...
@overload
def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike | None = ..., *, seqused_k: ArrayLike | None = ...,
                     block_table: ArrayLike | None = ..., max_seqlen_q: int | None = ...,
                     max_seqlen_k: int | None = ..., causal: bool = ...,
                     scale: float | None = ..., window: _Window = ...,
                     softcap: float | None = ..., alibi_slopes: ArrayLike | None = ...,
                     sinks: ArrayLike | None = ..., mask: ArrayLike | None = ...,
                     return_lse: Literal[True], out: NDArray[Any] | None = ...,
                     num_threads: int | None = ...,
                     k_scale: ArrayLike | None = ..., v_scale: ArrayLike | None = ...,
                     key_rotation: str | None = ..., v_head_dim: int | None = ...) -> _OutLse: ...
@overload
def attention_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                     cu_seqlens_k: ArrayLike | None = None, *, seqused_k: ArrayLike | None = None,
                     block_table: ArrayLike | None = None, max_seqlen_q: int | None = None,
                     max_seqlen_k: int | None = None, causal: bool = False,
                     scale: float | None = None, window: _Window = None,
                     softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
                     sinks: ArrayLike | None = None, mask: ArrayLike | None = None,
                     return_lse: bool = False, out: NDArray[Any] | None = None,
                     num_threads: int | None = None, k_scale: ArrayLike | None = None,
                     v_scale: ArrayLike | None = None, key_rotation: str | None = None,
                     v_head_dim: int | None = None) -> _Out | _OutLse: ...

@overload
def attention_with_kvcache(q: ArrayLike, k_cache: NDArray[Any], v_cache: NDArray[Any],
                           cache_seqlens: int | ArrayLike, k_new: ArrayLike | None = ...,
                           v_new: ArrayLike | None = ..., *, causal: bool = ...,
                           scale: float | None = ..., window: _Window = ...,
                           softcap: float | None = ..., alibi_slopes: ArrayLike | None = ...,
                           sinks: ArrayLike | None = ..., mask: ArrayLike | None = ...,
                           return_lse: Literal[False] = ..., out: NDArray[Any] | None = ...,
                           num_threads: int | None = ..., query_offset: int | None = ..., k_scale: NDArray[np.float32] | None = ...,
                           v_scale: NDArray[np.float32] | None = ...,
                           block_table: ArrayLike | None = ...,
                           tree_mask: ArrayLike | None = ...,
                           key_rotation: str | None = ...,
                           v_head_dim: int | None = ...,
                           key_index: ArrayLike | None = ...) -> _Out: ...
@overload
def attention_with_kvcache(q: ArrayLike, k_cache: NDArray[Any], v_cache: NDArray[Any],
                           cache_seqlens: int | ArrayLike, k_new: ArrayLike | None = ...,
                           v_new: ArrayLike | None = ..., *, causal: bool = ...,
                           scale: float | None = ..., window: _Window = ...,
                           softcap: float | None = ..., alibi_slopes: ArrayLike | None = ...,
                           sinks: ArrayLike | None = ..., mask: ArrayLike | None = ...,
                           return_lse: Literal[True], out: NDArray[Any] | None = ...,
                           num_threads: int | None = ..., query_offset: int | None = ..., k_scale: NDArray[np.float32] | None = ...,
                           v_scale: NDArray[np.float32] | None = ...,
                           block_table: ArrayLike | None = ...,
                           tree_mask: ArrayLike | None = ...,
                           key_rotation: str | None = ...,
                           v_head_dim: int | None = ...,
                           key_index: ArrayLike | None = ...) -> _OutLse: ...
@overload
def attention_with_kvcache(q: ArrayLike, k_cache: NDArray[Any], v_cache: NDArray[Any],
                           cache_seqlens: int | ArrayLike, k_new: ArrayLike | None = None,
                           v_new: ArrayLike | None = None, *, causal: bool = True,
                           scale: float | None = None, window: _Window = None,
                           softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
                           sinks: ArrayLike | None = None, mask: ArrayLike | None = None,
                           return_lse: bool = False, out: NDArray[Any] | None = None,
                           num_threads: int | None = None, query_offset: int | None = None, k_scale: NDArray[np.float32] | None = None,
                           v_scale: NDArray[np.float32] | None = None,
                           block_table: ArrayLike | None = None,
                           tree_mask: ArrayLike | None = None,
                           key_rotation: str | None = None,
                           v_head_dim: int | None = None,
                           key_index: ArrayLike | None = None) -> _Out | _OutLse: ...

class KVCache:
    def __init__(self, batch: int, kv_heads: int, head_dim: int, capacity: int, *,
                 dtype: DTypeLike = np.float32, v_head_dim: int | None = None,
                 latent: bool = False, key_rotation: str | None = "auto") -> None: ...
    @property
    def k(self) -> NDArray[Any]: ...
    @property
    def v(self) -> NDArray[Any]: ...
    @property
    def k_scale(self) -> NDArray[np.float32] | None: ...
    @property
    def v_scale(self) -> NDArray[np.float32] | None: ...
    @property
    def lengths(self) -> NDArray[np.int64]: ...
    @property
    def batch(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def v_head_dim(self) -> int: ...
    @property
    def key_rotation(self) -> str | None: ...
    @property
    def dtype(self) -> np.dtype[Any]: ...
    @property
    def latent(self) -> bool: ...
    def append(self, k_new: ArrayLike, v_new: ArrayLike | None = None, *,
               batch_index: int | ArrayLike | None = None) -> None: ...
    @overload
    def attend(self, q: ArrayLike, *, batch_index: int | ArrayLike | None = ...,
               causal: bool = ..., scale: float | None = ..., window: _Window = ...,
               softcap: float | None = ..., alibi_slopes: ArrayLike | None = ...,
               sinks: ArrayLike | None = ..., mask: ArrayLike | None = ...,
               return_lse: Literal[False] = ..., out: NDArray[Any] | None = ...,
               num_threads: int | None = ..., query_offset: int | None = ...,
               tree_mask: ArrayLike | None = ..., key_index: ArrayLike | None = ...) -> _Out: ...
    @overload
    def attend(self, q: ArrayLike, *, batch_index: int | ArrayLike | None = ...,
               causal: bool = ..., scale: float | None = ..., window: _Window = ...,
               softcap: float | None = ..., alibi_slopes: ArrayLike | None = ...,
               sinks: ArrayLike | None = ..., mask: ArrayLike | None = ...,
               return_lse: Literal[True], out: NDArray[Any] | None = ...,
               num_threads: int | None = ..., query_offset: int | None = ...,
               tree_mask: ArrayLike | None = ..., key_index: ArrayLike | None = ...) -> _OutLse: ...
    @overload
    def attend(self, q: ArrayLike, *, batch_index: int | ArrayLike | None = None,
               causal: bool = True, scale: float | None = None, window: _Window = None,
               softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
               sinks: ArrayLike | None = None, mask: ArrayLike | None = None,
               return_lse: bool = False, out: NDArray[Any] | None = None,
               num_threads: int | None = None, query_offset: int | None = None,
               tree_mask: ArrayLike | None = None, key_index: ArrayLike | None = None) -> _Out | _OutLse: ...
    @overload
    def step(self, q: ArrayLike, k_new: ArrayLike, v_new: ArrayLike | None = ..., *,
             batch_index: int | ArrayLike | None = ..., causal: bool = ...,
             scale: float | None = ..., window: _Window = ..., softcap: float | None = ...,
             alibi_slopes: ArrayLike | None = ..., sinks: ArrayLike | None = ...,
             mask: ArrayLike | None = ..., return_lse: Literal[False] = ...,
             out: NDArray[Any] | None = ..., num_threads: int | None = ..., query_offset: int | None = ...,
             tree_mask: ArrayLike | None = ..., key_index: ArrayLike | None = ...) -> _Out: ...
    @overload
    def step(self, q: ArrayLike, k_new: ArrayLike, v_new: ArrayLike | None = ..., *,
             batch_index: int | ArrayLike | None = ..., causal: bool = ...,
             scale: float | None = ..., window: _Window = ..., softcap: float | None = ...,
             alibi_slopes: ArrayLike | None = ..., sinks: ArrayLike | None = ...,
             mask: ArrayLike | None = ..., return_lse: Literal[True],
             out: NDArray[Any] | None = ..., num_threads: int | None = ..., query_offset: int | None = ...,
             tree_mask: ArrayLike | None = ..., key_index: ArrayLike | None = ...) -> _OutLse: ...
    @overload
    def step(self, q: ArrayLike, k_new: ArrayLike, v_new: ArrayLike | None = None, *,
             batch_index: int | ArrayLike | None = None, causal: bool = True,
             scale: float | None = None, window: _Window = None, softcap: float | None = None,
             alibi_slopes: ArrayLike | None = None, sinks: ArrayLike | None = None,
             mask: ArrayLike | None = None, return_lse: bool = False,
             out: NDArray[Any] | None = None,
             num_threads: int | None = None, query_offset: int | None = None,
             tree_mask: ArrayLike | None = None, key_index: ArrayLike | None = None) -> _Out | _OutLse: ...
    def truncate(self, n: int | ArrayLike) -> None: ...
    def reset(self) -> None: ...

_SeqIds = int | Sequence[int] | NDArray[np.integer[Any]]

class PagedKVCache:
    def __init__(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, *,
                 dtype: DTypeLike = np.float32, v_head_dim: int | None = None,
                 latent: bool = False, key_rotation: str | None = "auto") -> None: ...
    @property
    def latent(self) -> bool: ...
    @property
    def k(self) -> NDArray[Any]: ...
    @property
    def v(self) -> NDArray[Any]: ...
    @property
    def k_scale(self) -> NDArray[np.float32] | None: ...
    @property
    def v_scale(self) -> NDArray[np.float32] | None: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def v_head_dim(self) -> int: ...
    @property
    def key_rotation(self) -> str | None: ...
    @property
    def dtype(self) -> np.dtype[Any]: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def sequences(self) -> tuple[int, ...]: ...
    @property
    def lengths(self) -> dict[int, int]: ...
    def length(self, seq_id: int) -> int: ...
    def blocks(self, seq_id: int) -> tuple[int, ...]: ...
    def block_table(self, seq_ids: _SeqIds) -> NDArray[np.int32]: ...
    def add_sequence(self) -> int: ...
    def free(self, seq_id: int) -> None: ...
    def fork(self, seq_id: int) -> int: ...
    def truncate(self, seq_id: int, n: int) -> None: ...
    def append(self, seq_ids: _SeqIds, k_new: ArrayLike, v_new: ArrayLike | None = None) -> None: ...
    @overload
    def attend(self, seq_ids: _SeqIds, q: ArrayLike, *, causal: bool = ...,
               scale: float | None = ..., window: _Window = ..., softcap: float | None = ...,
               alibi_slopes: ArrayLike | None = ..., sinks: ArrayLike | None = ...,
               mask: ArrayLike | None = ..., return_lse: Literal[False] = ...,
               out: NDArray[Any] | None = ..., num_threads: int | None = ...,
               query_offset: int | None = ...,
               tree_mask: ArrayLike | None = ..., key_index: ArrayLike | None = ...) -> _Out: ...
    @overload
    def attend(self, seq_ids: _SeqIds, q: ArrayLike, *, causal: bool = ...,
               scale: float | None = ..., window: _Window = ..., softcap: float | None = ...,
               alibi_slopes: ArrayLike | None = ..., sinks: ArrayLike | None = ...,
               mask: ArrayLike | None = ..., return_lse: Literal[True],
               out: NDArray[Any] | None = ..., num_threads: int | None = ...,
               query_offset: int | None = ...,
               tree_mask: ArrayLike | None = ..., key_index: ArrayLike | None = ...) -> _OutLse: ...
    @overload
    def attend(self, seq_ids: _SeqIds, q: ArrayLike, *, causal: bool = True,
               scale: float | None = None, window: _Window = None, softcap: float | None = None,
               alibi_slopes: ArrayLike | None = None, sinks: ArrayLike | None = None,
               mask: ArrayLike | None = None, return_lse: bool = False,
               out: NDArray[Any] | None = None, num_threads: int | None = None,
               query_offset: int | None = None,
               tree_mask: ArrayLike | None = None, key_index: ArrayLike | None = None) -> _Out | _OutLse: ...
    @overload
    def step(self, seq_ids: _SeqIds, q: ArrayLike, k_new: ArrayLike,
             v_new: ArrayLike | None = ..., *,
             causal: bool = ..., scale: float | None = ..., window: _Window = ...,
             softcap: float | None = ..., alibi_slopes: ArrayLike | None = ...,
             sinks: ArrayLike | None = ..., mask: ArrayLike | None = ...,
             return_lse: Literal[False] = ..., out: NDArray[Any] | None = ...,
             num_threads: int | None = ..., query_offset: int | None = ...,
             tree_mask: ArrayLike | None = ..., key_index: ArrayLike | None = ...) -> _Out: ...
    @overload
    def step(self, seq_ids: _SeqIds, q: ArrayLike, k_new: ArrayLike,
             v_new: ArrayLike | None = ..., *,
             causal: bool = ..., scale: float | None = ..., window: _Window = ...,
             softcap: float | None = ..., alibi_slopes: ArrayLike | None = ...,
             sinks: ArrayLike | None = ..., mask: ArrayLike | None = ...,
             return_lse: Literal[True], out: NDArray[Any] | None = ...,
             num_threads: int | None = ..., query_offset: int | None = ...,
             tree_mask: ArrayLike | None = ..., key_index: ArrayLike | None = ...) -> _OutLse: ...
    @overload
    def step(self, seq_ids: _SeqIds, q: ArrayLike, k_new: ArrayLike,
             v_new: ArrayLike | None = None, *,
             causal: bool = True, scale: float | None = None, window: _Window = None,
             softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
             sinks: ArrayLike | None = None, mask: ArrayLike | None = None,
             return_lse: bool = False, out: NDArray[Any] | None = None,
             num_threads: int | None = None, query_offset: int | None = None,
             tree_mask: ArrayLike | None = None, key_index: ArrayLike | None = None) -> _Out | _OutLse: ...

def get_num_threads() -> int: ...
def set_num_threads(n: int | None) -> None: ...
def show_config() -> dict[str, Any]: ...

@overload
def index_topk(q: ArrayLike, weights: ArrayLike, k_index: ArrayLike, topk: int, *,
               cache_seqlens: int | ArrayLike | None = ..., k_scale: ArrayLike | None = ...,
               block_table: ArrayLike | None = ..., causal: bool = ...,
               return_scores: Literal[False] = ..., num_threads: int | None = ...) -> NDArray[np.int32]: ...
@overload
def index_topk(q: ArrayLike, weights: ArrayLike, k_index: ArrayLike, topk: int, *,
               cache_seqlens: int | ArrayLike | None = ..., k_scale: ArrayLike | None = ...,
               block_table: ArrayLike | None = ..., causal: bool = ...,
               return_scores: Literal[True], num_threads: int | None = ...) -> tuple[NDArray[np.int32], NDArray[np.float32]]: ...
def index_topk(q: ArrayLike, weights: ArrayLike, k_index: ArrayLike, topk: int, *,
               cache_seqlens: int | ArrayLike | None = None, k_scale: ArrayLike | None = None,
               block_table: ArrayLike | None = None, causal: bool = True,
               return_scores: bool = False, num_threads: int | None = None) -> Any: ...

def explain(q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
            cache_seqlens: int | ArrayLike | None = None, k_new: ArrayLike | None = None,
            v_new: ArrayLike | None = None, k_scale: NDArray[np.float32] | None = None,
            v_scale: NDArray[np.float32] | None = None, block_table: ArrayLike | None = None,
            causal: bool | None = None, scale: float | None = None, window: _Window = None,
            softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
            sinks: ArrayLike | None = None, mask: ArrayLike | None = None,
            return_lse: bool = False, out: NDArray[Any] | None = None,
            num_threads: int | None = None, query_offset: int | None = None,
            v_head_dim: int | None = None, key_index: ArrayLike | None = None) -> dict[str, Any]: ...
def explain_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                   cu_seqlens_k: ArrayLike | None = None, *, seqused_k: ArrayLike | None = None,
                   block_table: ArrayLike | None = None, max_seqlen_q: int | None = None,
                   max_seqlen_k: int | None = None, causal: bool = False,
                   scale: float | None = None, window: _Window = None,
                   softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
                   sinks: ArrayLike | None = None, mask: ArrayLike | None = None,
                   return_lse: bool = False, out: NDArray[Any] | None = None,
                   num_threads: int | None = None, k_scale: ArrayLike | None = None,
                   v_scale: ArrayLike | None = None, key_rotation: str | None = None,
                   v_head_dim: int | None = None) -> dict[str, Any]: ...
