# Included by _ext.pyx: transactions (attnfast._transaction). A call that changes a cache
# either returns, or raises having changed nothing: before each change it makes, it puts a
# callable that undoes that change (and may run twice) in the log of the transaction open in
# its thread: Python's (_transaction.assign, logged) and C's (write_rows, the fast paths)
# alike. When anything is raised before the call has returned, KeyboardInterrupt included,
# the log runs newest first.
#
# The part that needs C is the end. CPython hands a pending signal to Python code only
# between bytecodes of a Python frame (after each call returns, at backward jumps, ...), so
# a transaction cannot end in Python: whatever bytecode runs after the commit and before the
# return may raise. Here, after the entry point returns, only C runs (no bytecode, so no
# signal handler and no trace function): the log is dropped, the lock released, the result
# returned. A Ctrl-C that arrived meanwhile is raised in the caller's frame, after the call
# returned, as any signal arriving after a call is.

from cpython.ref cimport PyObject
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

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
    """The undo log (a list of callables) of the transaction open in this thread, or None."""
    return _open_log()


cdef int _roll_back(list log) except -1:
    """Run each entry of `log` (a callable undoing one change), newest first. Another
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
                entry()
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
        if type(fn) is Converting:  # (accepts_arrays' conversions, within the transaction)
            result = (<Converting> fn).call(args, kwargs)
        else:
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
    after its log is dropped, so that no other thread sees writes that are then undone.
    `fn` may be a Converting (the arguments converted, and the result, in the transaction)."""
    def transactional(*args, **kwargs):
        return _transact(fn, lock_attr, args, kwargs)
    return transactional


# ---- the token writer: every write of new tokens into a cache, Python's and C's ----

cdef void _copy_row(char* dst, cnp.npy_intp dst_step, const char* src, cnp.npy_intp src_step,
                    cnp.npy_intp n, cnp.npy_intp item) noexcept nogil:
    cdef cnp.npy_intp j
    if dst_step == item and src_step == item:
        memcpy(dst, src, n * item)
    else:
        for j in range(n):
            memcpy(dst + j * dst_step, src + j * src_step, item)


cdef void _move_rows(cnp.ndarray pool, cnp.ndarray new, const int64_t* slots, cnp.npy_intp n,
                     cnp.npy_intp t, char* saved, bint restore) noexcept nogil:
    """Token u of sequence i, every head h: pool[block, h, row] = new[i, h, u], (block, row)
    = slots[2 (i t + u) : +2]; the row it overwrites first kept in `saved`, in order
    (restore: `saved` put back; new unused)."""
    cdef cnp.npy_intp H = cnp.PyArray_DIMS(pool)[1], R = cnp.PyArray_DIMS(pool)[3]
    cdef cnp.npy_intp item = cnp.PyArray_ITEMSIZE(pool), row = R * item
    cdef cnp.npy_intp* ps = cnp.PyArray_STRIDES(pool)
    cdef char* p0 = <char*> cnp.PyArray_DATA(pool)
    cdef cnp.npy_intp* ns
    cdef char* dst
    cdef cnp.npy_intp i, u, h, k
    for i in range(n):
        for u in range(t):
            k = 2 * (i * t + u)
            for h in range(H):
                dst = p0 + slots[k] * ps[0] + h * ps[1] + slots[k + 1] * ps[2]
                if restore:
                    _copy_row(dst, ps[3], saved, item, R, item)
                else:
                    ns = cnp.PyArray_STRIDES(new)
                    _copy_row(saved, item, dst, ps[3], R, item)
                    _copy_row(dst, ps[3], <char*> cnp.PyArray_DATA(new) + i * ns[0] + h * ns[1]
                              + u * ns[2], ns[3], R, item)
                saved += row


cdef cnp.npy_intp _rows_bytes(cnp.ndarray pool, cnp.npy_intp tokens):
    return tokens * cnp.PyArray_DIMS(pool)[1] * cnp.PyArray_DIMS(pool)[3] * cnp.PyArray_ITEMSIZE(pool)


cdef class _RowsWritten:
    """What one write of token rows into `pools` (in order) overwrote; calling it puts the
    rows back, the last pool's first (again if need be)."""
    cdef list pools
    cdef char* buffer          # the slots (2 n t int64), then the rows overwritten
    cdef cnp.npy_intp n, t

    def __dealloc__(self):
        free(self.buffer)

    def __call__(self):
        cdef cnp.npy_intp total = 2 * self.n * self.t * sizeof(int64_t), i
        for pool in self.pools:
            total += _rows_bytes(<cnp.ndarray> pool, self.n * self.t)
        for i in range(len(self.pools) - 1, -1, -1):
            total -= _rows_bytes(<cnp.ndarray> self.pools[i], self.n * self.t)
            _move_rows(<cnp.ndarray> self.pools[i], None, <int64_t*> self.buffer, self.n,
                       self.t, self.buffer + total, True)


cdef _RowsWritten _write_rows(list pools, list news, const int64_t* slots, cnp.npy_intp n,
                              cnp.npy_intp t):
    """_move_rows of news[j] into pools[j], in order, the rows overwritten kept in the entry
    returned, which joins the open transaction's log before anything is written."""
    cdef _RowsWritten w = _RowsWritten.__new__(_RowsWritten)
    cdef cnp.npy_intp total = 2 * n * t * sizeof(int64_t), j
    for pool in pools:
        total += _rows_bytes(<cnp.ndarray> pool, n * t)
    w.buffer = <char*> malloc(total + 1)
    if w.buffer == NULL:
        raise MemoryError()
    w.pools, w.n, w.t = pools, n, t
    memcpy(w.buffer, slots, 2 * n * t * sizeof(int64_t))
    log = _open_log()
    if log is not None:
        (<list> log).append(w)
    total = 2 * n * t * sizeof(int64_t)
    for j in range(len(pools)):
        _move_rows(<cnp.ndarray> pools[j], <cnp.ndarray> news[j], slots, n, t, w.buffer + total,
                   False)
        total += _rows_bytes(<cnp.ndarray> pools[j], n * t)
    return w


def write_rows(list pools, list news, cnp.ndarray blocks, cnp.ndarray rows):
    """The token writer (attnfast._transaction.write_tokens): token u of sequence i,
    news[j][i, :, u] (news[j]: (n, H, t, R), the dtype of pools[j]), to row rows[i, u] of
    block blocks[i, u] of pools[j] (X, H, S, R) (a contiguous cache's blocks are its
    sequences), every head, for each j in order; what it overwrites joins the open
    transaction's log first. Any strides."""
    cdef cnp.ndarray pool, new, slots
    cdef cnp.npy_intp n = cnp.PyArray_DIMS(<cnp.ndarray?> news[0])[0], i
    cdef cnp.npy_intp t = cnp.PyArray_DIMS(<cnp.ndarray?> news[0])[2]
    cdef int64_t* s
    slots = np.stack([blocks, rows], axis=-1).astype(np.int64).reshape(-1)
    s = <int64_t*> cnp.PyArray_DATA(slots)
    for pool, new in zip(pools, news):
        if (cnp.PyArray_NDIM(pool) != 4 or cnp.PyArray_NDIM(new) != 4
                or not attnfast_equiv_dtypes(pool, new) or not _writeable(pool)
                or cnp.PyArray_DIMS(new)[0] != n or cnp.PyArray_DIMS(new)[2] != t
                or cnp.PyArray_DIMS(new)[1] != cnp.PyArray_DIMS(pool)[1]
                or cnp.PyArray_DIMS(new)[3] != cnp.PyArray_DIMS(pool)[3]
                or (<object> blocks).shape != (n, t) or (<object> rows).shape != (n, t)):
            raise ValueError("write_rows: pools, news, blocks and rows do not fit")
        for i in range(n * t):  # (the callers checked them: a guard against writing elsewhere)
            if not (0 <= s[2 * i] < cnp.PyArray_DIMS(pool)[0]
                    and 0 <= s[2 * i + 1] < cnp.PyArray_DIMS(pool)[2]):
                raise IndexError(f"write_rows: slot {i} is outside the pool")
    _write_rows(pools, news, s, n, t)


cdef class _Int64sKept:
    """A C-contiguous int64 array's values before a call changed them (a KVCache's lengths)."""
    cdef cnp.ndarray array
    cdef int64_t* kept

    def __dealloc__(self):
        free(self.kept)

    def __call__(self):
        memcpy(cnp.PyArray_DATA(self.array), self.kept, cnp.PyArray_NBYTES(self.array))


cdef int _keep_int64s(cnp.ndarray array) except -1:
    """Log `array` (int64, C-contiguous) as it is now, in the open transaction."""
    cdef _Int64sKept w = _Int64sKept.__new__(_Int64sKept)
    w.kept = <int64_t*> malloc(cnp.PyArray_NBYTES(array) + 1)
    if w.kept == NULL:
        raise MemoryError()
    w.array = array
    memcpy(w.kept, cnp.PyArray_DATA(array), cnp.PyArray_NBYTES(array))
    log = _open_log()
    if log is not None:
        (<list> log).append(w)
    return 0


def truncate_lengths(cnp.ndarray lengths, n):
    """KVCache.truncate(n) for a Python int n, 0 <= n <= every length (`lengths`: int64,
    C-contiguous), in a transaction: the lengths set to n, logged first. True when done;
    None, having changed nothing, for anything else (the caller checks and raises)."""
    cdef int overflow = 0
    cdef long long value
    cdef cnp.npy_intp i, count = cnp.PyArray_SIZE(lengths)
    cdef int64_t* data = <int64_t*> cnp.PyArray_DATA(lengths)
    if (type(n) is not int or _open_log() is None or cnp.PyArray_TYPE(lengths) != cnp.NPY_INT64
            or not cnp.PyArray_IS_C_CONTIGUOUS(lengths)
            or not (cnp.PyArray_FLAGS(lengths) & cnp.NPY_ARRAY_WRITEABLE)):
        return None
    value = PyLong_AsLongLongAndOverflow(n, &overflow)
    if overflow or value < 0:
        return None
    for i in range(count):
        if data[i] < value:
            return None
    _keep_int64s(lengths)
    for i in range(count):
        data[i] = value
    return True
