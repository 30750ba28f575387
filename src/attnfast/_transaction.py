"""Transactions: a call that changes a cache either returns, or raises and changes nothing.

The rule for every entry point that writes state (KVCache.append / step / truncate / reset,
PagedKVCache.add_sequence / free / fork / truncate / append / step, attention_with_kvcache
with new tokens, and any added later): decorate it with :func:`transaction`, and make every
change through this module, which puts what undoes it in the transaction's log first:
:func:`write_tokens` (the one token writer, for contiguous caches and paged pools of every
format), :func:`assign` (array elements), :func:`logged` (anything else: a callable that
undoes the change and may run twice). The C fast paths log into the same log (attnfast._ext:
write_rows, decode_fast, paged_fast, paged_truncate). Each entry records only what its
change overwrites, so what a call costs never depends on the size of the cache or pool.

If anything at all is raised before the entry point has returned (a KeyboardInterrupt from
Ctrl-C, a MemoryError, a warning turned into an error, an error in bookkeeping after the
kernels ran), the log runs, newest first, and the exception propagates: the call did not
happen. Once the entry point's body returns, the transaction ends in C
(attnfast._ext.transaction): no Python bytecode runs between the commit and the return, so no
signal can be raised there; a Ctrl-C arriving then is raised in the caller's frame, after the
call returned (the tokens are in and ``lengths`` counts them).

A method's transaction takes the object's lock (reentrant) before the body runs and releases
it after the log is dropped, both in C: no other thread sees writes that are then undone, and
no interrupt can leave the lock held (the body does not take it itself: a ``with lock:`` in
Python can be interrupted between the acquire and the block that releases it). Methods that
only read (attend) take the lock the same way. Transactions nest: an entry point called
within another joins the outer log when it returns, so the outer one undoes it too if it
raises later. Outside a transaction (the vLLM cache writer) nothing is logged.
"""
from __future__ import annotations

import functools

import numpy as np

from . import _ext
from ._formats import format_of_storage
from ._interop import conversions
from ._rotation import hadamard_rotate

__all__ = ["transaction", "write_tokens", "assign", "logged"]

open_log = _ext.open_log
write_rows = _ext.write_rows  # (C: logs what it overwrites, then copies the rows)


def transaction(lock: str | None = None, arrays: bool = False):
    """Decorator: the function (or method) runs as one transaction (see the module). `lock`:
    for methods, the name of the instance's reentrant lock, held for the whole call (the
    method's own code must not take it). `arrays`: the function also accepts arrays as
    attnfast._interop.accepts_arrays does (converted, and the result, within the
    transaction). Outermost decorator: nothing may run between the function's return and
    the transaction's end. The signature and docstring are the function's
    (functools.update_wrapper)."""
    def decorate(fn):
        return functools.update_wrapper(_ext.transaction(conversions(fn) if arrays else fn,
                                                         lock), fn)
    return decorate


def logged(undo) -> None:
    """Put `undo` (no arguments; it may run twice) in the open transaction's log, before the
    change it undoes is made."""
    log = open_log()
    if log is not None:
        log.append(undo)


def assign(array: np.ndarray, index, values) -> None:
    """array[index] = values, what it overwrites logged first."""
    old = array[index].copy()
    logged(lambda: array.__setitem__(index, old))
    array[index] = values


def stored_form(k_new, v_new, cache_dtype, key_rotation=None):
    """k_new, v_new as a cache of `cache_dtype` stores them, converted before anything is
    written: (k, v, k row scales, v row scales), the scales None unless the format is
    row-scaled (int8, float8; int4 rows carry their own, attnfast._int4). Values beyond a
    16-bit dtype's range become +-inf, as the cast gives, with no overflow warning
    (docs/user_guide/reliability.md): a warning turned into an error must not stop a write
    half-way."""
    fmt = format_of_storage(cache_dtype)
    if fmt.quantized:  # attnfast._formats
        if key_rotation == "hadamard":  # see attnfast._rotation
            k_new = hadamard_rotate(k_new)
        if fmt.row_scaled:
            (k_new, k_rows), (v_new, v_rows) = fmt.quantize(k_new), fmt.quantize(v_new)
            return k_new, v_new, k_rows, v_rows
        return fmt.quantize(k_new), fmt.quantize(v_new), None, None
    if k_new.dtype != cache_dtype or v_new.dtype != cache_dtype:
        with np.errstate(over="ignore", invalid="ignore"):
            k_new, v_new = k_new.astype(cache_dtype), v_new.astype(cache_dtype)
    return k_new, v_new, None, None


def token_slots(starts, t: int, *, seqs=None, table=None, block_size=None):
    """Where token u of sequence i goes, position starts[i] + u: (blocks, rows), each (n, t):
    in a contiguous cache block seqs[i] (default i: a cache's blocks are its sequences); in
    a paged pool row pos % block_size of block table[i, pos // block_size]."""
    pos = np.asarray(starts, np.int64)[:, None] + np.arange(t)
    if table is None:
        seqs = np.arange(pos.shape[0]) if seqs is None else np.asarray(seqs, np.int64)
        return np.broadcast_to(seqs[:, None], pos.shape), pos
    return np.take_along_axis(table, pos // block_size, axis=1), pos % block_size


def write_tokens(pools, blocks, rows, k_new, v_new, key_rotation=None) -> None:
    """The token writer: token u of sequence i (k_new[i, :, u], v_new[i, :, u]; (n, Hkv, t,
    D | Dv)) into row rows[i, u] of block blocks[i, u] of each pool; pools: (k, v, k_scale,
    v_scale), the scales None but for row-scaled formats. Rounded or quantised to the
    pools' format first (key_rotation: None or "hadamard", keys rotated before they are
    quantised: attnfast._rotation); what each write overwrites is logged."""
    stored = stored_form(k_new, v_new, pools[0].dtype, key_rotation)
    pairs = [(p, x) if p.ndim == 4 else (p[..., None], x[..., None])  # row scales: 1 float32
             for p, x in zip(pools, stored) if p is not None]
    write_rows([p for p, _ in pairs], [x for _, x in pairs], blocks, rows)


def copy_rows(pools, source: int, target: int, count: int) -> None:
    """Rows 0 .. count of block `source` copied into block `target` of each pool (k, v and
    row scales, None skipped): a shared block copied before it is written (copy-on-write)."""
    rows = np.arange(count)[None, :]
    pools = [p if p.ndim == 4 else p[..., None] for p in pools if p is not None]
    write_rows(pools, [p[source:source + 1, :, :count] for p in pools],
               np.full_like(rows, target), rows)
