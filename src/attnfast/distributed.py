"""Exact attention over a KV cache whose token axis is sharded across Ray actors.

``ShardedKVCache`` has the interface of :class:`attnfast.KVCache` but keeps its tokens in
``num_shards`` Ray actors (processes, on one machine or on many): shard s holds the global
positions ``[s * capacity_per_shard, (s + 1) * capacity_per_shard)`` of every sequence in a
local ``attnfast.KVCache`` in its own memory. A call sends each shard only what it needs
(the new tokens that land there, and the queries), each shard attends over its own keys with
``return_lse=True`` and ``query_offset`` placing the queries at their global positions (so
causal, window and ALiBi stay exact across shard boundaries), and the caller merges the
shards' ``(out, lse)`` with :func:`attnfast.merge_attention_states`. A decode step moves
O(H * D) bytes per shard, never O(L).

Ray is an optional dependency (``pip install "attnfast[ray]"``), imported only when a
``ShardedKVCache`` is created; ``import attnfast`` never imports it.
"""
from __future__ import annotations

import pickle
import threading

import numpy as np

from ._api import merge_attention_states
from ._formats import format_of_storage
from ._arrays import LOWP_DTYPES
from ._cache_args import (
    check_batch_index,
    check_cache_room,
    check_cache_spec,
    check_leading_sequences,
    check_step_tokens,
    check_truncate,
)
from ._cache_checks import check_kvcache_attention, check_new_tokens
from ._descriptors import CacheLayout
from ._formats import FLOAT64
from ._runtime import _positive_int
from ._scalars import check_flag
from ._written import check_out
from ._interop import accepts_arrays

__all__ = ["ShardedKVCache", "ShardError"]


def _import_ray():
    try:
        import ray
    except ImportError as e:  # pragma: no cover - exercised only without Ray
        raise ImportError("attnfast.distributed.ShardedKVCache needs Ray: install it with "
                          "`pip install \"attnfast[ray]\"` (or `pip install ray`)") from e
    return ray


class ShardError(RuntimeError):
    """A shard of a ShardedKVCache died, could not be reached in time, or failed.

    ``shard`` is its index, ``actor_id`` its Ray actor id (hex). The call that raised it
    returned no result (never a merge of the shards that did answer) and did not change the
    cache's ``lengths``; a dead shard's tokens are lost, so rebuild the cache (``close()``,
    a new ``ShardedKVCache``, and prefill again from the tokens)."""

    def __init__(self, message, shard, actor_id):
        super().__init__(message)
        self.shard = shard
        self.actor_id = actor_id


def _actor_id(actor) -> str:
    try:
        return actor._actor_id.hex()
    except AttributeError:  # pragma: no cover - another Ray version's handle
        return repr(actor)


class _Shard:
    """The actor: one token slice of every layer's cache, in a local attnfast.KVCache each.

    Every call first rolls its caches back to the lengths the caller knows (``sync``), so a
    call that failed half-way elsewhere (another shard died, a timeout) leaves no stray
    tokens behind here once the next call arrives."""

    def __init__(self, batch, kv_heads, head_dim, capacity, dtype, v_head_dim, num_layers):
        import attnfast
        self._caches = [attnfast.KVCache(batch, kv_heads, head_dim, capacity, dtype=dtype,
                                         v_head_dim=v_head_dim) for _ in range(num_layers)]
        # a compiled graph's loop and ordinary calls run on different threads of the actor
        self._lock = threading.Lock()

    def ping(self):
        return None

    def run_packed(self, request):
        """run(), its arguments and result pickled into bytes when small (see _pack);
        None (a compiled graph's call to a shard with nothing to do) returns None."""
        if request is None:
            return None
        with self._lock:
            return _pack(self.run(*_unpack(request)))

    def lengths(self, sync=None):
        with self._lock:
            self.run(sync, [], None)
            return np.stack([c.lengths for c in self._caches])

    def run(self, sync, writes, attend):
        """sync: int64 (num_layers, batch) lengths to roll back to, or None.
        writes: [(layer, seqs, k, v)], appended in order (seqs share the token count).
        attend: None, or (layers, seqs, q (len(layers), n, H, Tq, D), offsets (len(layers), n),
        options, alibi (n, H) | None, mask | None): returns (out, lse) with a leading layer
        axis, out in float32 (float64 for float64 q)."""
        if sync is not None:
            for cache, n in zip(self._caches, sync):
                if np.any(cache.lengths != n):
                    cache.truncate(n)
        for layer, seqs, k, v in writes:
            self._caches[layer].append(k, v, batch_index=seqs)
        if attend is None:
            return None
        layers, seqs, q, offsets, options, alibi, mask = attend
        cache0 = self._caches[layers[0]]
        if q.dtype in LOWP_DTYPES:  # a float32 q reads 16-bit and quantised caches alike:
            q = q.astype(np.float32)  # the shards' results stay float32 until the merge
        nl, n, H, Tq, _ = q.shape
        acc = np.float64 if q.dtype == FLOAT64 else np.float32
        out = np.empty((nl, n, H, Tq, cache0.v_head_dim), acc)
        lse = np.empty((nl, n, H, Tq), acc)
        for li, layer in enumerate(layers):
            cache = self._caches[layer]
            row_offsets = offsets[li]
            groups = ([(row_offsets[0], slice(None))] if np.all(row_offsets == row_offsets[0])
                      else [(off, np.flatnonzero(row_offsets == off))
                            for off in np.unique(row_offsets)])
            for off, rows in groups:
                kw = dict(options)
                if alibi is not None:  # (n, H), or (1, H) for per-head slopes
                    kw["alibi_slopes"] = alibi[rows] if alibi.shape[0] != 1 else alibi[0]
                if mask is not None:
                    kw["mask"] = mask[rows] if mask.shape[0] != 1 else mask
                o, s = cache.attend(q[li, rows], batch_index=seqs[rows], query_offset=int(off),
                                    return_lse=True, **kw)
                out[li, rows] = o
                lse[li, rows] = s
        return out, lse


# Below this many bytes of arrays, a request or result travels as one pickled bytes object:
# Ray handles bytes in ~0.05 ms, but spends ~0.2-0.3 ms on each call carrying numpy arrays
# (measured, bench/bench_distributed.py). Above it, arrays go as they are, through Ray's
# object store without a copy.
_PACK_LIMIT = 256 * 1024


def _array_bytes(obj) -> int:
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, (list, tuple)):
        return sum(_array_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_array_bytes(o) for o in obj.values())
    return 0


def _pack(obj):
    return pickle.dumps(obj, protocol=5) if _array_bytes(obj) < _PACK_LIMIT else obj


def _unpack(obj):
    return pickle.loads(obj) if isinstance(obj, bytes) else obj


_ACTOR_CLASS = None


def _actor_class(ray):
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        _ACTOR_CLASS = ray.remote(_Shard)
    return _ACTOR_CLASS


def _compact(mask: np.ndarray) -> np.ndarray:
    """A broadcast view with its zero-stride axes cut to length 1 (still broadcastable to
    the same shape), so that sending it moves only the distinct values."""
    index = tuple(slice(0, 1) if st == 0 and n > 1 else slice(None)
                  for st, n in zip(mask.strides, mask.shape))
    return np.ascontiguousarray(mask[index])


class ShardedKVCache:
    """A KV cache whose token axis is split over ``num_shards`` Ray actors.

    ``ShardedKVCache(batch, kv_heads, head_dim, capacity_per_shard, num_shards, *,
    dtype=np.float32, v_head_dim=None, num_layers=1, actor_options=None, timeout=None)``

    Shard s (a Ray actor holding a local :class:`attnfast.KVCache`) stores the global
    token positions ``[s * capacity_per_shard, (s + 1) * capacity_per_shard)`` of every
    sequence, so the cache holds ``capacity = num_shards * capacity_per_shard`` tokens per
    sequence. The methods are those of :class:`attnfast.KVCache` (``append``, ``attend``,
    ``step``, ``truncate``, ``reset``, ``lengths``) with the same semantics and results (up
    to float32 rounding of the merge): new tokens go to the shard that holds their
    positions; attention sends the queries to every shard holding keys they may see, each
    shard attends over its keys at the queries' global positions (``query_offset``) and
    returns ``(out, lse)``, and the caller merges them exactly with
    :func:`attnfast.merge_attention_states`. One call is one round trip: all shards'
    requests are issued at once and gathered with one ``ray.get``; a ``step`` appends and
    attends in the same request. A decode step moves the query, out and lse, O(H * D) bytes
    per shard; a ``window`` skips shards wholly before it.

    Parameters
    ----------
    batch, kv_heads, head_dim, dtype, v_head_dim
        As in :class:`attnfast.KVCache` (every storage format of attnfast._formats: int8,
        float8 and int4 included; new K/V rows of a quantised cache are float32, float16 or bfloat16, sent as
        given and quantised by the shard that stores them).
    capacity_per_shard : int
        Tokens per sequence each shard holds.
    num_shards : int
        Number of Ray actors.
    num_layers : int, default 1
        Layers held (one local cache per layer in every actor). With more than one, every
        method takes ``layer=`` (an int: that layer, arrays shaped as for KVCache); with
        ``layer=None`` one call serves all layers at once, the arrays having a leading
        ``num_layers`` axis (the same options for every layer), in one round trip.
    actor_options : dict or list of dicts, optional
        Passed to Ray's ``.options()`` for every actor (or, a list, one per shard): e.g.
        ``{"num_cpus": 16}`` (Ray then sets the actor's OMP_NUM_THREADS, and so attnfast's
        threads, to 16; without ``num_cpus`` Ray gives each actor one thread) or a
        ``scheduling_strategy`` pinning shard s to node s.
    timeout : float, optional
        Seconds to wait for the shards in each call; a shard that has not answered by then
        raises ShardError (None waits forever).
    compiled : bool, default False
        Send the small requests of decoding through a Ray compiled graph (``ray.dag``,
        shared-memory channels set up once) instead of one ordinary actor call per shard:
        every call then reaches every shard (those with nothing to do return at once), and
        the round trip costs about a third (bench/HISTORY.md). Large requests (a long
        prompt's K/V) still take ordinary calls. On a failure the graph is dropped and the
        cache goes on with ordinary calls.

    Ray must be reachable: ``ray.init(address=...)`` first to join a cluster; otherwise Ray
    starts a local instance on first use.

    Failures: a shard that died, timed out or raised makes the call raise
    :class:`ShardError` naming the shard; no partial result is returned and ``lengths`` is
    unchanged (a shard that had already written the call's tokens rolls them back on the
    next call). A dead shard's tokens are gone: rebuild the cache and prefill it again.
    Arguments are checked on the caller's side (as KVCache checks them) before anything is
    sent; a rejected call (e.g. appending past the whole cache's capacity) changes nothing.

    ``mask`` is supported (its key axis spans the whole cache's capacity and is sliced per
    shard), but a mask that varies along the keys moves O(capacity) bytes per call.
    """

    def __init__(self, batch, kv_heads, head_dim, capacity_per_shard, num_shards, *,
                 dtype=np.float32, v_head_dim=None, num_layers=1, actor_options=None,
                 timeout=None, compiled=False):
        S = _positive_int(num_shards, "num_shards")
        B, Hkv, D, C, dt, Dv = check_cache_spec(batch, kv_heads, head_dim, capacity_per_shard,
                                                dtype, v_head_dim)
        check_cache_spec(batch, kv_heads, head_dim, C * S, dtype, v_head_dim)  # total size
        NL = _positive_int(num_layers, "num_layers")
        if actor_options is None:
            per_shard = [{}] * S
        elif isinstance(actor_options, dict):
            per_shard = [actor_options] * S
        else:
            per_shard = list(actor_options)
            if len(per_shard) != S or not all(isinstance(o, dict) for o in per_shard):
                raise ValueError(f"actor_options must be a dict or a list of {S} dicts (one per "
                                 f"shard), got {actor_options!r}"[:300])
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
                raise ValueError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
        ray = _import_ray()
        self._ray = ray
        self._batch, self._kv_heads, self._head_dim, self._v_head_dim = B, Hkv, D, Dv
        self._dtype, self._shard_capacity, self._num_shards, self._num_layers = dt, C, S, NL
        self._timeout = timeout
        self._dag = None
        self._lengths = np.zeros((NL, B), dtype=np.int64)
        self._lock = threading.Lock()
        self._format = format_of_storage(dt)
        # per shard, the local lengths its actor is known to hold (-1: unknown, sync next call)
        self._known = np.zeros((S, NL, B), np.int64)
        cls = _actor_class(ray)
        self._actors = []
        self._closed = False
        try:
            spec = self._format.name  # (KVCache takes every format by name)
            for opts in per_shard:
                self._actors.append(cls.options(**opts).remote(B, Hkv, D, C, spec, Dv, NL))
            self._gather([(s, a.ping.remote()) for s, a in enumerate(self._actors)])
            if check_flag(compiled, "compiled"):
                from ray.dag import InputNode, MultiOutputNode
                with InputNode() as requests:
                    dag = MultiOutputNode([a.run_packed.bind(requests[s])
                                           for s, a in enumerate(self._actors)])
                self._dag = dag.experimental_compile()
        except BaseException:
            self.close()
            raise

    # ---- state ----
    @property
    def lengths(self) -> np.ndarray:
        """Tokens held per sequence, int64 (batch,) (num_layers > 1: (num_layers, batch));
        a read-only view."""
        view = (self._lengths[0] if self._num_layers == 1 else self._lengths).view()
        view.flags.writeable = False
        return view

    batch = property(lambda self: self._batch, doc="Number of sequences.")
    kv_heads = property(lambda self: self._kv_heads, doc="KV heads (Hkv).")
    head_dim = property(lambda self: self._head_dim, doc="Head dim of keys (and queries).")
    v_head_dim = property(lambda self: self._v_head_dim, doc="Head dim of values.")
    dtype = property(lambda self: self._dtype,
                     doc="Storage dtype of the shards' caches (as KVCache.dtype: uint8 for an "
                         "int4 cache, its packed blocks).")
    num_shards = property(lambda self: self._num_shards, doc="Number of Ray actors.")
    num_layers = property(lambda self: self._num_layers, doc="Layers held.")
    capacity_per_shard = property(lambda self: self._shard_capacity,
                                  doc="Tokens per sequence each shard holds.")
    capacity = property(lambda self: self._shard_capacity * self._num_shards,
                        doc="Tokens each sequence can hold (num_shards * capacity_per_shard).")
    actors = property(lambda self: list(self._actors),
                      doc="The shards' Ray actor handles, shard 0 first.")

    def __repr__(self) -> str:
        kind = self._format.label()
        return (f"ShardedKVCache(batch={self.batch}, kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim}, capacity_per_shard={self.capacity_per_shard}, "
                f"num_shards={self.num_shards}, dtype={kind}, v_head_dim={self.v_head_dim}, "
                f"num_layers={self.num_layers}{'; closed' if self._closed else ''})")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Kill the shards' actors (their memory is freed); the cache is unusable after."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._drop_dag()
            for a in self._actors:
                try:
                    self._ray.kill(a)
                except Exception:  # already dead: nothing to free
                    pass

    # ---- methods ----
    @accepts_arrays
    def append(self, k_new, v_new, *, batch_index=None, layer=None) -> None:
        """Append t >= 1 tokens to every sequence (or those of ``batch_index``), each to the
        shard holding its position. Shapes as :meth:`attnfast.KVCache.append` (with a leading
        layer axis when ``layer=None`` and num_layers > 1)."""
        with self._lock:
            self._open()
            layers = self._layers(layer)
            seqs = check_batch_index(batch_index, self._batch)
            ks, vs = self._split_layers(layers, layer, k_new=k_new, v_new=v_new)
            checked = []
            for li, l in enumerate(layers):
                check_leading_sequences(seqs, self._batch, k_new=ks[li], v_new=vs[li])
                k, v, t = check_new_tokens(ks[li], vs[li], batch=seqs.size,
                                           kv_heads=self._kv_heads, head_dim=self._head_dim,
                                           head_dim_v=self._v_head_dim, dtype=self._dtype)
                if t == 0:
                    raise ValueError("append needs both k_new and v_new; both are None")
                check_cache_room(self._lengths[l], seqs, t, self.capacity)
                checked.append((k, v, t))
            self._call(layers, seqs, checked, None)

    @accepts_arrays
    def attend(self, q, *, batch_index=None, causal=True, scale=None, window=None,
               softcap=None, alibi_slopes=None, sinks=None, mask=None, return_lse=False,
               out=None, num_threads=None, query_offset=None, layer=None):
        """Attention of q (n, H, Tq, head_dim) over each sequence's cached tokens, as
        :meth:`attnfast.KVCache.attend` (bottom-right causal by default; ``query_offset``
        in global positions), merged exactly over the shards."""
        return self._run(q, None, None, batch_index=batch_index, causal=causal, scale=scale,
                         window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                         sinks=sinks, mask=mask, return_lse=return_lse, out=out,
                         num_threads=num_threads, query_offset=query_offset, layer=layer)

    @accepts_arrays
    def step(self, q, k_new, v_new, *, batch_index=None, causal=True, scale=None,
             window=None, softcap=None, alibi_slopes=None, sinks=None, mask=None,
             return_lse=False, out=None, num_threads=None, query_offset=None, layer=None):
        """:meth:`append` then :meth:`attend` in one round trip: a prompt (prefill, each
        shard computing the prompt's causal attention over its slice) or a decode step."""
        check_step_tokens(k_new, v_new)
        return self._run(q, k_new, v_new, batch_index=batch_index, causal=causal, scale=scale,
                         window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                         sinks=sinks, mask=mask, return_lse=return_lse, out=out,
                         num_threads=num_threads, query_offset=query_offset, layer=layer)

    @accepts_arrays
    def truncate(self, n, *, layer=None) -> None:
        """Roll every sequence back to n tokens (or sequence b to n[b]); every layer unless
        ``layer`` is given. The shards roll back on their next call."""
        with self._lock:
            self._open()
            layers = self._layers(layer, allow_all=True)
            new = [check_truncate(n, self._lengths[l]) for l in layers]
            self._lengths[layers] = np.stack(new)  # one store: all layers or none

    def reset(self) -> None:
        """Empty every sequence of every layer (the shards roll back on their next call)."""
        with self._lock:
            self._open()
            self._lengths[:] = 0

    def shard_lengths(self) -> np.ndarray:
        """int64 (num_shards, num_layers, batch): the tokens each shard's caches hold, read
        from the actors in one round trip (which first brings each shard in line with
        ``lengths``: a truncate or reset reaches the shards on their next call)."""
        with self._lock:
            self._open()
            C = self._shard_capacity
            starts = np.arange(self._num_shards, dtype=np.int64)[:, None, None] * C
            local = np.clip(self._lengths[None] - starts, 0, C)
            held = np.stack(self._gather([(s, a.lengths.remote(local[s]))
                                          for s, a in enumerate(self._actors)]))
            self._known[:] = held
            return held

    # ---- internals ----
    def _open(self):
        if self._closed:
            raise RuntimeError("this ShardedKVCache is closed")

    def _layers(self, layer, allow_all=True):
        if layer is None:
            return list(range(self._num_layers))
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"layer must be an int or None, got {type(layer).__name__} {layer!r}")
        if not 0 <= layer < self._num_layers:
            raise ValueError(f"layer must be in [0, {self._num_layers}) (num_layers), got {layer}")
        return [int(layer)]

    def _split_layers(self, layers, layer, **arrays):
        """Per-layer views of each array: itself for one layer, else its leading layer axis."""
        if layer is not None or self._num_layers == 1:
            return [[a] for a in arrays.values()]
        result = []
        for name, a in arrays.items():
            if a is None:
                result.append([None] * len(layers))
                continue
            a = np.asarray(a)
            if a.ndim != 5 or a.shape[0] != self._num_layers:
                raise ValueError(f"{name} must be 5-D (num_layers={self._num_layers}, n, ...) when "
                                 f"layer=None serves every layer, got shape {a.shape}")
            result.append(list(a))
        return result

    def _layout(self, n):
        """The selected n sequences of the whole cache as the checks see them: sizes and
        format only (the shards' memory is in their actors, whose own checks guard it)."""
        return CacheLayout(sizes=(n, self._kv_heads, self.capacity), head_dim=self._head_dim,
                           head_dim_v=self._v_head_dim, dtype=self._dtype,
                           names=("cache.k", "cache.v"),
                           scale_names=("cache.k_scale", "cache.v_scale"))

    def _run(self, q, k_new, v_new, *, layer, batch_index, causal, scale, window, softcap,
             alibi_slopes, sinks, mask, return_lse, out, num_threads, query_offset):
        with self._lock:
            self._open()
            return_lse = check_flag(return_lse, "return_lse")
            layers = self._layers(layer)
            seqs = check_batch_index(batch_index, self._batch)
            qs, ks, vs = self._split_layers(layers, layer, q=q, k_new=k_new, v_new=v_new)
            layout = self._layout(seqs.size)
            calls, checked = [], []
            for li, l in enumerate(layers):
                t = np.shape(ks[li])[2] if ks[li] is not None and np.ndim(ks[li]) == 4 else 0
                if li and calls:
                    # the layers of one 5-D array share its shape and dtype: layer 0's checks
                    # cover them, only the room differs
                    if t:
                        check_cache_room(self._lengths[l], seqs, t, self.capacity)
                    c0 = calls[0]
                    checked.append(None if not t else (ks[li].astype(c0.k_new.dtype, copy=False),
                                                       vs[li].astype(c0.v_new.dtype, copy=False), t))
                    continue
                check_leading_sequences(seqs, self._batch, q=qs[li], k_new=ks[li], v_new=vs[li])
                if t:
                    check_cache_room(self._lengths[l], seqs, t, self.capacity)
                call = check_kvcache_attention(
                    qs[li], layout, self._lengths[l][seqs], ks[li], vs[li], causal=causal,
                    scale=scale, window=window, num_threads=num_threads,
                    query_offset=query_offset, softcap=softcap, alibi_slopes=alibi_slopes,
                    sinks=sinks, mask=mask)
                calls.append(call)
                checked.append((call.k_new, call.v_new, call.new_tokens) if call.new_tokens
                               else None)
            a = calls[0].attn
            full_out = (len(layers),) + a.out_shape() if layer is None and self._num_layers > 1 \
                else a.out_shape()
            user_out = check_out(out, full_out, a.dtype, [("q", a.q), ("k_new", calls[0].k_new),
                                                          ("v_new", calls[0].v_new)])
            if any(c is None for c in checked) and not all(c is None for c in checked):
                raise ValueError("k_new/v_new must be given for every layer or for none")
            writes = None if checked[0] is None else checked
            q_all = (a.q[None] if len(layers) == 1 else
                     np.ascontiguousarray(np.asarray(q), dtype=a.q.dtype))
            options = dict(causal=a.causal, scale=a.scale, window=a.window,
                           num_threads=num_threads)
            if a.options.softcap:
                options["softcap"] = a.options.softcap
            attend = (q_all, a.query_offset, options, a.options)
            o, s = self._call(layers, seqs, writes, attend)
            o = o.astype(a.dtype, copy=False)
            if not o.flags.writeable:  # one shard's result, read-only from the object store
                o = o.copy()
            if not s.flags.writeable:
                s = s.copy()
            if layer is not None or self._num_layers == 1:
                o, s = o[0], s[0]
            if user_out is not None:
                user_out[...] = o
                o = user_out
            return (o, s) if return_lse else o

    def _call(self, layers, seqs, writes, attend):
        """One round trip: plan what each shard gets, send it all at once, gather, then
        (only when every shard answered) commit the new lengths and merge."""
        C, S = self._shard_capacity, self._num_shards
        before = self._lengths.copy()
        after = before.copy()
        if writes is not None:
            for l, (_, _, t) in zip(layers, writes):
                after[l, seqs] += t
        starts = np.arange(S, dtype=np.int64)[:, None, None] * C
        local_before = np.clip(before[None] - starts, 0, C)   # (S, NL, B)
        local_after = np.clip(after[None] - starts, 0, C)
        requests = {}
        for s in range(S):
            shard_writes = []
            if writes is not None:
                for l, (k, v, t) in zip(layers, writes):
                    shard_writes += self._pieces(s, l, seqs, before[l, seqs], k, v, t)
            requests[s] = [shard_writes, None]
        merged_parts = []
        if attend is not None:
            q_all, query_offset, options, score = attend
            Tq = q_all.shape[3]
            # global position of each sequence's first query, per layer: (NL_sel, n)
            if query_offset is None:
                first = after[layers][:, seqs] - Tq
            else:
                first = np.full((len(layers), seqs.size), query_offset, dtype=np.int64)
            left, right = options["window"]
            reach = 0 if options["causal"] else (right if right >= 0 else None)
            chosen = []
            for s in range(S):
                have = local_after[s][layers][:, seqs]          # keys this shard holds
                lo_key, hi_key = s * C, s * C + have - 1
                useful = have > 0
                if left >= 0:
                    useful &= hi_key >= first - left
                if reach is not None:
                    useful &= lo_key <= first + Tq - 1 + reach
                if np.any(useful):
                    chosen.append(s)
            if not chosen:
                chosen = [0]  # an empty (or wholly invisible) cache: zeros and lse = -inf / sink
            for i, s in enumerate(chosen):
                shard_options = dict(options)
                if score.sinks is not None and i == 0:  # merge_attention_states adds them once
                    shard_options["sinks"] = score.sinks
                mask = None
                if score.mask is not None:
                    mask = _compact(score.mask[..., s * C:(s + 1) * C]
                                    if score.mask.strides[-1] else score.mask[..., :1])
                requests[s][1] = (layers, seqs, q_all, first - s * C, shard_options,
                                  None if score.alibi is None else _compact(score.alibi), mask)
            merged_parts = chosen
        packed = {}
        for s, (shard_writes, shard_attend) in requests.items():
            if not shard_writes and shard_attend is None:
                continue
            sync = None if np.array_equal(local_before[s], self._known[s]) else local_before[s]
            packed[s] = _pack((sync, shard_writes, shard_attend))
        try:
            if self._dag is not None and all(isinstance(r, bytes) for r in packed.values()):
                answers = self._execute_dag([packed.get(s) for s in range(S)])
                results = {s: _unpack(answers[s]) for s in packed}
            else:
                jobs = [(s, self._actors[s].run_packed.remote(r)) for s, r in packed.items()]
                results = dict(zip(packed, map(_unpack, self._gather(jobs))))
        except BaseException:  # some shards may have written: roll them back next call
            for s in packed:
                self._known[s] = -1
            raise
        for s in packed:  # these shards now hold exactly `local_after`
            self._known[s] = local_after[s]
        self._lengths[:] = after
        if attend is None:
            return None
        outs = [results[s][0] for s in merged_parts]
        lses = [results[s][1] for s in merged_parts]
        if len(outs) == 1:
            return outs[0], lses[0]
        return merge_attention_states(outs, lses)

    def _pieces(self, s, layer, seqs, lengths, k, v, t):
        """The writes of t new tokens (k, v: (n, Hkv, t, .)) that land in shard s: a list of
        (layer, batch_index, k piece, v piece), one per group of sequences whose tokens
        split alike."""
        C = self._shard_capacity
        lo = np.clip(s * C - lengths, 0, t)            # first new token landing in shard s
        hi = np.clip((s + 1) * C - lengths, 0, t)      # one past the last
        if not np.any(hi > lo):
            return []
        if np.all(lo == lo[0]) and np.all(hi == hi[0]):  # every sequence alike (the usual)
            a, b = int(lo[0]), int(hi[0])
            return [(layer, seqs, k[:, :, a:b], v[:, :, a:b])]
        pieces = []
        keys = np.stack([lo, hi], 1)
        for a, b in np.unique(keys, axis=0):
            if b <= a:
                continue
            rows = np.flatnonzero((lo == a) & (hi == b))
            if rows.size == seqs.size:
                pieces.append((layer, seqs, k[:, :, a:b], v[:, :, a:b]))
            else:
                pieces.append((layer, seqs[rows], k[rows, :, a:b], v[rows, :, a:b]))
        return pieces

    def _execute_dag(self, requests):
        """One execution of the compiled graph (every shard called; None: nothing to do).
        On failure the graph is dropped (later calls take ordinary actor calls) and the
        shards are pinged one by one, so that the error names the one that failed."""
        ray = self._ray
        try:
            refs = self._dag.execute(*requests)
            # (a compiled graph's own default is 10 s, which a loaded machine can exceed;
            # -1 is its "no limit", matching ordinary calls with timeout=None)
            return ray.get(refs, timeout=self._timeout if self._timeout is not None else -1)
        except Exception as error:
            self._drop_dag()
            self._gather([(s, a.ping.remote()) for s, a in enumerate(self._actors)],
                         timeout=self._timeout or 30)
            raise ShardError(f"the compiled graph over the {self._num_shards} shards failed: "
                             f"{error}; no result was merged", -1, None) from error

    def _drop_dag(self):
        dag, self._dag = self._dag, None
        if dag is not None:
            try:
                dag.teardown()
            except Exception:  # a shard died: its channels are gone anyway
                pass

    def _gather(self, jobs, timeout=None):
        """ray.get of every (shard, future) at once; a failure names the shard."""
        ray = self._ray
        if not jobs:
            return []
        futures = [f for _, f in jobs]
        timeout = self._timeout if timeout is None else timeout
        try:
            return ray.get(futures, timeout=timeout)
        except Exception as first_error:
            error = first_error
        # find the shard(s) that failed or did not answer
        ready, _ = ray.wait(futures, num_returns=len(futures), timeout=0)
        ready = set(ready)
        for s, f in jobs:
            actor = self._actors[s]
            actor_id = _actor_id(actor)
            where = f"shard {s} of {self._num_shards} (actor {actor_id})"
            if f not in ready:
                if isinstance(error, ray.exceptions.GetTimeoutError):
                    raise ShardError(f"{where} did not answer within {timeout} s; no "
                                     "result was merged", s, actor_id) from error
                continue
            try:
                ray.get(f, timeout=0)
            except ray.exceptions.RayActorError as e:
                what = ("is unreachable" if type(e).__name__ == "ActorUnavailableError"
                        else "died")
                raise ShardError(f"{where} {what}: {e}; no result was merged. Its tokens are "
                                 "lost: rebuild the cache (close(), a new ShardedKVCache) and "
                                 "prefill it again", s, actor_id) from e
            except Exception as e:
                raise ShardError(f"{where} failed: {e}; no result was merged", s,
                                 actor_id) from e
        raise ShardError(f"a shard failed: {error}; no result was merged", -1, None) from error
