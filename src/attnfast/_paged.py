"""A paged KV cache for many sequences: one pool of fixed-size blocks (vLLM's paged attention).

`PagedKVCache` owns the pools and, per sequence, the list of its blocks; each call builds the
block table of the sequences it serves and runs `attention_with_kvcache(..., block_table=)`'s
kernels over all of them at once. Blocks are reference-counted, so `fork` shares a prefix
without copying it; a shared, partly filled last block is copied before it is appended to
(copy-on-write). Every method checks everything (attnfast._cache_checks, _cache_args)
before it changes anything: running out of blocks raises and leaves the cache as it was.
"""
from __future__ import annotations

import numpy as np

from . import _ext, _shared_prefix
from ._formats import format_of_storage
from ._cache_args import (check_free_blocks, check_paged_spec, check_seq_ids, check_step_tokens,
                          check_truncate)
from ._cache_checks import check_new_tokens, check_paged_kvcache_attention, check_tree_mask
from ._plans import kvcache_key, kvcache_plan, KVCACHE_PLANS, remember
from ._scalars import check_flag
from ._written import check_out
from ._descriptors import CacheLayout, KernelPart
from ._kvcache import (_read_and_written, allocate_storage, latent_values, run_cache_kernels,
                       storage_properties, with_key_index)
from ._transaction import assign, copy_rows, logged, token_slots, transaction, write_tokens

__all__ = ["PagedKVCache"]

_LENGTHS = "PagedKVCache.lengths"  # a PagedKVCache's lengths in its plan keys (kvcache_key)
_ext.use_paged_plans(KVCACHE_PLANS, _shared_prefix)


class _Sequence:
    """One sequence of the pool: its blocks in token order and how many tokens it holds."""
    __slots__ = ("blocks", "length")

    def __init__(self, blocks=None, length=0):
        self.blocks: list[int] = list(blocks or [])
        self.length: int = length


class PagedKVCache:
    """A pool of KV-cache blocks shared by many sequences of different lengths.

    ``PagedKVCache(num_blocks, block_size, kv_heads, head_dim, *, dtype=np.float32,
    v_head_dim=None)`` holds ``k`` (num_blocks, kv_heads, block_size, head_dim) and ``v``
    (num_blocks, kv_heads, block_size, v_head_dim) pools (views of KV-head-major storage; and,
    for ``dtype="int8"``, float32 ``k_scale`` / ``v_scale`` (num_blocks, kv_heads,
    block_size); ``dtype="int4"`` packs each row into uint8 blocks as
    :class:`attnfast.KVCache` does). Free blocks are handed out lowest id first. A sequence's token t is row
    ``t % block_size`` of its ``t // block_size``-th block; blocks are taken from the pool as
    sequences grow and return to it when they are freed::

        cache = attnfast.PagedKVCache(num_blocks=1024, block_size=16, kv_heads=8, head_dim=128)
        a = cache.add_sequence()
        cache.step(a, q_prompt, k_prompt, v_prompt)         # (1, H, T, D) ...: causal prefill
        b = cache.fork(a)                                   # shares a's blocks, copies nothing
        out = cache.step([a, b], q, k_tok, v_tok)           # both decode in one kernel call
        cache.free(a)                                       # its unshared blocks go back

    Methods that take ``seq_ids`` accept one id or a list of distinct ids; the arrays passed
    then hold those sequences, in that order, on axis 0 (with one bare id, 3-D arrays
    without that axis are taken too, and the result is 3-D).

    Forks share blocks, counted by reference: a block returns to the pool when no sequence
    holds it. Appending to a sequence whose partly filled last block is shared first copies
    that block (copy-on-write), so the other sequences' tokens never change.

    Every method checks all its arguments, and that the pool has the blocks it needs,
    before it changes anything: a rejected call (ValueError "out of blocks ..." included)
    leaves the pools, the sequences and ``num_free_blocks`` exactly as they were. So does a
    call that raises once it has started changing them (Ctrl-C in the kernels or anywhere
    before the call has returned, MemoryError): the blocks it took, the bytes it wrote and the
    lengths all go back (attnfast._transaction). A call either returns or changes nothing.

    Thread safety: each method holds the cache's lock for its whole call (as KVCache).
    """

    def __init__(self, num_blocks, block_size, kv_heads, head_dim, *, dtype=np.float32,
                 v_head_dim=None, latent=False, key_rotation="auto"):
        NB, BS, Hkv, D, dt, Dv = check_paged_spec(num_blocks, block_size, kv_heads, head_dim,
                                                  dtype, v_head_dim)
        # Stored KV-head-major, (Hkv, num_blocks, block_size, D), and exposed as the
        # (num_blocks, Hkv, block_size, D) view the kernels take: a KV head's rows of blocks
        # with consecutive ids are then adjacent in memory, so a sequence whose blocks were
        # taken in order streams like a contiguous cache (scattered short blocks cost more:
        # see docs/user_guide/paged.md).
        allocate_storage(self, (NB, Hkv, BS), dt, (D, Dv), latent, key_rotation, head_major=True)
        # the pools as the checks see them (attnfast._cache_checks)
        self._layout = CacheLayout(sizes=(NB, Hkv, BS), head_dim=D, head_dim_v=Dv, dtype=dt,
                                   names=("cache.k", "cache.v"),
                                   scale_names=("cache.k_scale", "cache.v_scale"), k=self._k,
                                   v=self._v, k_scale=self._k_scale, v_scale=self._v_scale)
        self._refs = np.zeros(NB, dtype=np.int64)     # sequences holding each block
        self._free = list(range(NB - 1, -1, -1))      # a stack: the lowest id is taken first
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0

    # ---- state ----
    (k, v, k_scale, v_scale, key_rotation, latent, kv_heads, head_dim, v_head_dim,
     dtype) = storage_properties("pool")
    num_blocks = property(lambda self: self._k.shape[0], doc="Blocks in the pool.")
    block_size = property(lambda self: self._k.shape[2], doc="Tokens per block.")

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, available to appends."""
        return len(self._free)

    @property
    def sequences(self) -> tuple[int, ...]:
        """Ids of the live sequences, in the order they were added."""
        return tuple(self._seqs)

    @property
    def lengths(self) -> dict[int, int]:
        """Tokens held per live sequence, {seq_id: length} (a copy)."""
        return {sid: s.length for sid, s in self._seqs.items()}

    def length(self, seq_id) -> int:
        """Tokens held by one sequence."""
        (sid,), _ = check_seq_ids([seq_id], self._seqs)
        return self._seqs[sid].length

    def blocks(self, seq_id) -> tuple[int, ...]:
        """The pool blocks of one sequence, in token order."""
        (sid,), _ = check_seq_ids([seq_id], self._seqs)
        return tuple(self._seqs[sid].blocks)

    def block_table(self, seq_ids) -> np.ndarray:
        """int32 (n, max_blocks) table of the sequences (unused entries -1), as
        :func:`attnfast.attention_with_kvcache` takes it with this cache's ``k`` and ``v``."""
        ids, _ = check_seq_ids(seq_ids, self._seqs)
        return self._table([self._seqs[s].blocks for s in ids], fill=-1).astype(np.int32)

    def __repr__(self) -> str:
        kind = format_of_storage(self.dtype).label()
        return (f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, dtype={kind}, "
                f"v_head_dim={self.v_head_dim}{', latent=True' if self._latent else ''}; "
                f"{len(self._seqs)} sequence(s), "
                f"{self.num_free_blocks} free block(s))")

    # ---- sequences ----
    @transaction(lock="_lock")
    def add_sequence(self) -> int:
        """A new, empty sequence (it takes no block until tokens are appended); its id."""
        return self._new_sequence(_Sequence())

    @transaction(lock="_lock")
    def free(self, seq_id) -> None:
        """Forget a sequence; the blocks no other sequence holds return to the pool."""
        (sid,), _ = check_seq_ids([seq_id], self._seqs)
        seq, order = self._seqs[sid], list(self._seqs)

        def undo():  # the sequence back in its place (ids in the order they were added)
            if sid not in self._seqs:
                self._seqs = {s: seq if s == sid else self._seqs[s] for s in order}
        logged(undo)
        del self._seqs[sid]
        for blk in seq.blocks:
            self._release(blk)

    @transaction(lock="_lock")
    def fork(self, seq_id) -> int:
        """A new sequence holding the same tokens as `seq_id`, sharing its blocks (nothing is
        copied now; a shared partly filled block is copied when either one appends to it).
        Returns the new id."""
        (sid,), _ = check_seq_ids([seq_id], self._seqs)
        src = self._seqs[sid]
        held = np.array(src.blocks, np.int64)
        assign(self._refs, held, self._refs[held] + 1)
        return self._new_sequence(_Sequence(src.blocks, src.length))

    @transaction(lock="_lock")
    def truncate(self, seq_id, n) -> None:
        """Roll one sequence back to its first n tokens (0 <= n <= its length), e.g. to drop
        rejected speculative tokens; the blocks it no longer needs return to the pool unless
        another sequence holds them."""
        if _ext.paged_truncate(self, seq_id, n):  # releases, sets, logs what it changed
            return
        (sid,), _ = check_seq_ids([seq_id], self._seqs)   # raises, naming the argument
        (kept,) = check_truncate(n, np.array([self._seqs[sid].length]), [sid]).tolist()
        if not _ext.paged_truncate(self, sid, kept):  # checked: Python ints now
            raise RuntimeError(f"PagedKVCache: the blocks of sequence {sid} are inconsistent")

    # ---- tokens and attention ----
    @transaction(lock="_lock", arrays=True)
    def append(self, seq_ids, k_new, v_new=None) -> None:
        """Append t >= 1 tokens to each sequence of `seq_ids`: k_new (n, kv_heads, t,
        head_dim), v_new (n, kv_heads, t, v_head_dim) in the cache's dtype (float32 is also
        taken by a 16-bit or int8 cache; a latent pool takes k_new only, v_new None). Takes
        blocks from the pool as needed; raises ValueError, changing nothing, when it has too
        few."""
        v_new = latent_values(self, k_new, v_new, ndims=(3, 4))
        ids, single = check_seq_ids(seq_ids, self._seqs)
        k_new, v_new = _lift(single, k_new), _lift(single, v_new)
        k_new, v_new, t = check_new_tokens(
            k_new, v_new, batch=len(ids), kv_heads=self.kv_heads, head_dim=self.head_dim,
            head_dim_v=self.v_head_dim, dtype=self.dtype)
        if t == 0:
            raise ValueError("append needs both k_new and v_new; both are None")
        plan = self._plan(ids, t)
        starts = np.array([self._seqs[s].length for s in ids], dtype=np.int64)
        self._append(ids, plan, self._table(self._tentative(ids, plan)), starts, k_new, v_new)

    @transaction(lock="_lock", arrays=True)
    def attend(self, seq_ids, q, *, causal=True, scale=None, window=None, softcap=None,
               alibi_slopes=None, sinks=None, mask=None, return_lse=False, out=None,
               num_threads=None, query_offset=None, tree_mask=None, key_index=None):
        """Attention of q (n, H, Tq, head_dim) over each sequence's tokens, all sequences in
        one kernel call. Causal by default, bottom-right aligned per sequence; options as in
        :func:`attnfast.attention_with_kvcache` (``key_index`` (n, Tq, k) or (n, kv_heads, Tq,
        k): sparse attention over the listed positions of each sequence). A mask's last axis spans the call's key
        positions: ``max_blocks * block_size``, max_blocks being the most blocks any of the
        sequences holds. Sequences sharing leading full blocks (forks) read them once
        (docs/user_guide/paged.md, shared-prefix decoding). ``tree_mask`` (Tq x Tq bool): the
        last Tq tokens of each sequence are a token tree, as in :func:`attnfast.attention_with_kvcache`.
        Returns out (n, H, Tq, v_head_dim), or (out, lse)."""
        return _ext.paged_call(self, seq_ids, q, None, None, causal, scale, window, softcap,
                               alibi_slopes, sinks, mask, return_lse, out, num_threads,
                               query_offset, tree_mask, key_index)

    @transaction(lock="_lock", arrays=True)
    def step(self, seq_ids, q, k_new, v_new=None, *, causal=True, scale=None, window=None,
             softcap=None, alibi_slopes=None, sinks=None, mask=None, return_lse=False,
             out=None, num_threads=None, query_offset=None, tree_mask=None, key_index=None):
        """The decode step: :meth:`append` k_new, v_new, then :meth:`attend` q, in one call
        (one kernel call for all the sequences). Everything, the free blocks included, is
        checked before anything is written. A latent pool takes k_new only (v_new None).
        ``key_index`` as in :meth:`attend`, its positions counting the new tokens."""
        v_new = latent_values(self, k_new, v_new, ndims=(3, 4))
        check_step_tokens(k_new, v_new)
        return _ext.paged_call(self, seq_ids, q, k_new, v_new, causal, scale, window, softcap,
                               alibi_slopes, sinks, mask, return_lse, out, num_threads,
                               query_offset, tree_mask, key_index)

    # ---- internals ----
    # Every change below is logged first (attnfast._transaction): a call that raises puts
    # back the blocks, counts, lengths and bytes it changed, and only those.
    def _new_sequence(self, seq: _Sequence) -> int:
        sid = self._next_id

        def undo():
            self._seqs.pop(sid, None)
            self._next_id = sid
        logged(undo)
        self._next_id = sid + 1
        self._seqs[sid] = seq
        return sid

    def _take(self) -> int:
        """The free block on top of the stack (the lowest id when none was freed), now held."""
        free, n = self._free, len(self._free) - 1
        blk = free[n]

        def undo():
            free[n:] = [blk]
            self._refs[blk] = 0
        logged(undo)
        free.pop()
        self._refs[blk] = 1
        return blk

    def _release(self, blk: int) -> None:
        """One holder fewer for `blk`; back on the free list when it has none."""
        free, n, count = self._free, len(self._free), int(self._refs[blk])

        def undo():
            del free[n:]
            self._refs[blk] = count
        logged(undo)
        self._refs[blk] = count - 1
        if count == 1:
            free.append(blk)

    @staticmethod
    def _update(seq: _Sequence, blocks: list, length: int) -> None:
        old = seq.blocks, seq.length  # (block lists are replaced, never changed in place)

        def undo():
            seq.blocks, seq.length = old
        logged(undo)
        seq.blocks, seq.length = blocks, length

    def _plan(self, ids, t):
        """For appending t tokens to each of `ids`: per sequence (copy its shared partial last
        block?, new blocks to take), checked against the free blocks. Changes nothing."""
        bs = self.block_size
        refs = {}  # references as the earlier sequences of this call leave them
        plan, needed = [], 0
        for sid in ids:
            seq = self._seqs[sid]
            copy = False
            if t and seq.length % bs and seq.length // bs < len(seq.blocks):
                last = seq.blocks[seq.length // bs]
                left = refs.get(last, int(self._refs[last]))
                if left > 1:  # shared: this sequence writes into a copy of its own
                    copy = True
                    refs[last] = left - 1
            grow = max(0, -(-(seq.length + t) // bs) - len(seq.blocks))
            plan.append((copy, grow))
            needed += copy + grow
        what = (f"appending {t} token(s) to sequence(s) {ids}" if len(ids) <= 8
                else f"appending {t} token(s) to {len(ids)} sequences")
        check_free_blocks(needed, len(self._free), what)
        return plan

    def _tentative(self, ids, plan):
        """The block lists `ids` would have after _append(ids, plan, ..), taking no block."""
        taken = sum(copy + grow for copy, grow in plan)
        upcoming = self._free[len(self._free) - taken:][::-1] if taken else []  # _take order
        lists, n = [], 0
        for sid, (copy, grow) in zip(ids, plan):
            seq = self._seqs[sid]
            blocks = list(seq.blocks)
            if copy:
                blocks[seq.length // self.block_size] = upcoming[n]
                n += 1
            blocks += upcoming[n:n + grow]
            n += grow
            lists.append(blocks)
        return lists

    def _append(self, ids, plan, table, starts, k_new, v_new) -> None:
        """Take the blocks of `plan` (copying shared partly filled ones first: copy-on-write),
        which give `table` (_tentative's), and write k_new, v_new (None: no tokens) at
        `starts`."""
        bs, pools = self.block_size, (self._k, self._v, self._k_scale, self._v_scale)
        t = 0 if k_new is None else k_new.shape[2]
        for sid, (copy, grow) in zip(ids, plan):
            seq = self._seqs[sid]
            if not (copy or grow or t):
                continue
            blocks = list(seq.blocks)
            if copy:
                i, new = seq.length // bs, self._take()
                copy_rows(pools, blocks[i], new, seq.length % bs)
                self._release(blocks[i])
                blocks[i] = new
            blocks += [self._take() for _ in range(grow)]
            self._update(seq, blocks, seq.length + t)
        if t:
            write_tokens(pools, *token_slots(starts, t, table=table, block_size=bs), k_new,
                         v_new, self._key_rotation)

    @staticmethod
    def _table(block_lists, fill=0) -> np.ndarray:
        """int64 (n, max(1, most blocks)) table; `fill` (a valid id: never read) elsewhere."""
        width = max(1, max(len(b) for b in block_lists))
        table = np.full((len(block_lists), width), fill, dtype=np.int64)
        for i, b in enumerate(block_lists):
            table[i, :len(b)] = b
        return table

    def _call(self, seq_ids, q, k_new, v_new, causal, scale, window, softcap, alibi_slopes, sinks,
              mask, return_lse, out, num_threads, query_offset, tree_mask, key_index):
        """attend / step by the full path (when _ext.paged_call found no plan or its fast path
        declined), which leaves a plan for the call's key (_ext.kvcache_key)."""
        result = self._run_locked(seq_ids, q, k_new, v_new, causal, scale, window, softcap,
                                  alibi_slopes, sinks, mask, return_lse, out, num_threads,
                                  query_offset, tree_mask, key_index)
        key = kvcache_key(q, self._k, self._v, _LENGTHS, k_new, v_new, out, causal, scale,
                          window, return_lse, (softcap, alibi_slopes, sinks, mask, tree_mask),
                          key_index=key_index)
        if key is not None:  # accepted: later calls of this layout take the fast path
            if type(seq_ids) is int:  # (the plan of the arrays the kernels took: 4-D)
                q, k_new, v_new, out = (_lift(True, a) for a in (q, k_new, v_new, out))
            if q.ndim == 4:
                remember(KVCACHE_PLANS, key,
                         kvcache_plan(q, self._k, self._v, k_new, out, scale, window,
                                      return_lse))
        return result

    def _run_locked(self, seq_ids, q, k_new, v_new, causal, scale, window, softcap, alibi_slopes,
                    sinks, mask, return_lse, out, num_threads, query_offset, tree_mask, key_index):
        return_lse = check_flag(return_lse, "return_lse")
        ids, single = check_seq_ids(seq_ids, self._seqs)
        squeeze = single and np.ndim(q) == 3  # one bare id, 3-D q: 3-D results
        q, k_new, v_new = _lift(single, q), _lift(single, k_new), _lift(single, v_new)
        t = np.shape(k_new)[2] if k_new is not None and np.ndim(k_new) == 4 else 0
        plan = self._plan(ids, t) if t else [(False, 0)] * len(ids)
        lengths = np.array([self._seqs[s].length for s in ids], dtype=np.int64)
        table = self._table(self._tentative(ids, plan))
        call = check_paged_kvcache_attention(
            q, self._layout, lengths, k_new, v_new, table, causal=causal, scale=scale,
            window=window, num_threads=num_threads, query_offset=query_offset, softcap=softcap,
            alibi_slopes=alibi_slopes, sinks=sinks, mask=mask)
        if key_index is not None and squeeze:  # one bare id: its list gains the sequence axis
            key_index = np.asarray(key_index)[None]
        call = with_key_index(call, key_index, tree_mask)
        user_out = check_out(_lift(single, out) if out is not None and np.ndim(out) == 3 else out,
                             call.attn.out_shape(), call.attn.dtype, _read_and_written(call))
        tree = check_tree_mask(tree_mask, call)
        # (raising from here on, the transaction puts back every change: blocks, rows, lengths)
        self._append(ids, plan, call.block_table, call.starts, call.k_new, call.v_new)
        parts = [KernelPart(k=self._k, v=self._v, seqlens=call.seqlens_after,
                            k_scale=self._k_scale, v_scale=self._v_scale,
                            block_table=call.block_table)]
        result = run_cache_kernels(call, user_out, return_lse, parts, tree, self._key_rotation)
        return _ext.paged_result(result, return_lse, squeeze, out)


def _lift(single: bool, x):
    """With one bare sequence id, a 3-D array gains the sequence axis (a view)."""
    if single and x is not None and np.ndim(x) == 3:
        return np.asarray(x)[None]
    return x
