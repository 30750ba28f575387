"""Transactions: a call that changes a cache either returns, or raises and changes nothing.

The rule for every entry point that writes state (KVCache.append / step / truncate / reset,
PagedKVCache.add_sequence / free / fork / truncate / append / step, attention_with_kvcache
with new tokens, and any added later): decorate it with :func:`transaction`, and make every
change through an :class:`Undo` (``undo.write(array, index, values)`` for bytes,
``undo.call(restore)`` for anything else), created while the call runs.

Each Undo joins the undo log of the transaction open in its thread; the C fast paths
(attnfast._ext.decode_fast) add what they wrote to the same log. If anything at all is raised
before the entry point has returned (a KeyboardInterrupt from Ctrl-C, a MemoryError, an error
in bookkeeping after the kernels ran), the whole log is put back, newest first, and the
exception propagates: the call did not happen. Once the entry point's body returns, the
transaction ends in C (attnfast._ext.transaction): no Python bytecode runs between the commit
and the return, so no signal can be raised there; a Ctrl-C arriving then is raised in the
caller's frame, after the call returned (the tokens are in and ``lengths`` counts them).

A method's transaction takes the object's lock (reentrant) before the body runs and releases
it after the log is dropped, both in C: no other thread sees writes that are then undone, and
no interrupt can leave the lock held (the body does not take it itself: a ``with lock:`` in
Python can be interrupted between the acquire and the block that releases it). Methods that
only read (attend) take the lock the same way. Transactions nest: an entry point called
within another joins the outer log when it returns, so the outer one undoes it too if it
raises later.
"""
from __future__ import annotations

import functools

from . import _ext

__all__ = ["Undo", "transaction"]

open_log = _ext.open_log


def transaction(lock: str | None = None):
    """Decorator: the function (or method) runs as one transaction (see the module). `lock`:
    for methods, the name of the instance's reentrant lock, held for the whole call (the
    method's own code must not take it). Outermost decorator: nothing may run between the
    function's return and the transaction's end. The signature and docstring are the
    function's (functools.update_wrapper)."""
    def decorate(fn):
        return functools.update_wrapper(_ext.transaction(fn, lock), fn)
    return decorate


class Undo:
    """The bytes a mutating call is about to overwrite, saved before each write, so that a
    call which then raises anything (KeyboardInterrupt, MemoryError, ...) puts them back and
    leaves every cache and scale array byte-identical: the call did not happen. Created in a
    transaction, it joins that transaction's log, which restores it if the call raises
    before it returns (after the body's own ``except`` has passed)."""
    __slots__ = ("_saved",)

    def __init__(self):
        self._saved = []
        log = open_log()
        if log is not None:
            log.append(self)

    def write(self, array, index, values) -> None:
        """array[index] = values, keeping what was there."""
        self._saved.append((array, index, array[index].copy()))
        array[index] = values

    def call(self, restore) -> None:
        """Have restore() (no arguments, safe to run twice) run when the call is undone, in
        order with the writes (newest first)."""
        self._saved.append((None, restore, None))

    def restore(self) -> None:
        """Put everything back, newest first. Each entry is dropped only once it is put back,
        so a restore that is itself interrupted can simply run again."""
        saved = self._saved
        while saved:
            array, index, old = saved[-1]
            if array is None:
                index()
            else:
                array[index] = old
            del saved[-1]
