# Included by _ext.pyx: transactions (attnfast._transaction). A call that changes a cache
# either returns, or raises having changed nothing: its writes are logged (Undo objects and
# decode_fast's _TokensWritten join the log of the transaction open in their thread) and put
# back when anything is raised before the call has returned, KeyboardInterrupt included.
#
# The part that needs C is the end. CPython hands a pending signal to Python code only
# between bytecodes of a Python frame (after each call returns, at backward jumps, ...), so
# a transaction cannot end in Python: whatever bytecode runs after the commit and before the
# return may raise. Here, after the entry point returns, only C runs (no bytecode, so no
# signal handler and no trace function): the log is dropped, the lock released, the result
# returned. A Ctrl-C that arrived meanwhile is raised in the caller's frame, after the call
# returned, as any signal arriving after a call is.

from cpython.ref cimport PyObject

cdef extern from *:
    """
    /* The undo log (a list) of the transaction open in this thread, or NULL; a borrowed
       reference: the _transact call that set it holds the list until it resets this. */
    static thread_local PyObject* attnfast_open_log = nullptr;
    """
    PyObject* attnfast_open_log


cdef inline object _open_log():
    """The undo log (a list) of the transaction open in this thread, or None."""
    return None if attnfast_open_log == NULL else <object> attnfast_open_log


def open_log():
    """The undo log (a list) of the transaction open in this thread, or None: what a write
    joins so that the call it belongs to can be undone until it returns (attnfast._transaction)."""
    return _open_log()


cdef int _roll_back(list log) except -1:
    """Put back, newest first, what each entry of `log` saved (entry.restore()). Another
    KeyboardInterrupt meanwhile (Ctrl-C pressed again) does not stop it: an entry that was
    interrupted is restored again (every restore may run twice). Other errors of a restore
    are retried a few times, then that entry is given up (the first exception is the one the
    caller sees)."""
    cdef int failures
    while log:
        entry = log[len(log) - 1]  # (_ext is compiled with wraparound=False: no log[-1])
        failures = 0
        while True:
            try:
                entry.restore()
                break
            except KeyboardInterrupt:
                continue
            except BaseException:
                failures += 1
                if failures > 3:
                    break
        log.pop()
    return 0


cdef object _transact(fn, lock_attr, tuple args, dict kwargs):
    global attnfast_open_log
    cdef PyObject* outer
    cdef list log = []
    lock = None
    if lock_attr is not None:
        lock = getattr(args[0], lock_attr)
        lock.acquire()  # (may raise KeyboardInterrupt while it waits: nothing changed yet)
    outer = attnfast_open_log
    attnfast_open_log = <PyObject*> log
    try:
        result = fn(*args, **kwargs)
    except BaseException:
        attnfast_open_log = outer
        _roll_back(log)   # under the lock: no other thread saw these writes
        if lock is not None:
            lock.release()
        raise
    # Committed: from here to the return, C only (nothing can raise).
    attnfast_open_log = outer
    if outer != NULL:  # a transaction within one (a nested entry point): the outer one
        (<list> outer).extend(log)   # undoes this call too if it raises later
    if lock is not None:
        lock.release()
    return result


def transaction(fn, lock_attr=None):
    """`fn` (an entry point that changes state) run as one transaction: it returns, or it
    raises having changed nothing (attnfast._transaction). With `lock_attr`, fn is a method
    and ``getattr(self, lock_attr)`` (a reentrant lock) is held from before fn runs until
    after its log is dropped, so that no other thread sees writes that are then undone."""
    def transactional(*args, **kwargs):
        return _transact(fn, lock_attr, args, kwargs)
    return transactional
