"""attnfast: exact attention for CPUs, from NumPy.

Streaming (FlashAttention-style) prefill that never builds the Tq x Tk score matrix, and
bandwidth-bound KV-cache decoding (KVCache, attention_with_kvcache, PagedKVCache), with C++ kernels chosen
at run time for the CPU, OpenMP threads and the GIL released.
"""
__version__ = "0.1.0"

from ._runtime import get_num_threads, set_num_threads, show_config, _check_forced_isa
from ._api import attention, attention_weights, merge_attention_states
from ._backward import attention_backward, attention_varlen_backward
from ._varlen import attention_varlen, explain_varlen
from ._kvcache import KVCache, attention_with_kvcache
from ._paged import PagedKVCache
from ._explain import explain
from ._indexer import index_topk

_check_forced_isa()
del _check_forced_isa

__all__ = [
    "attention",
    "attention_weights",
    "attention_backward",
    "attention_varlen_backward",
    "attention_varlen",
    "merge_attention_states",
    "KVCache",
    "attention_with_kvcache",
    "PagedKVCache",
    "index_topk",
    "explain",
    "explain_varlen",
    "get_num_threads",
    "set_num_threads",
    "show_config",
    "__version__",
]
