# Included by _ext.pyx: the per-call work of attnfast's fast paths (attnfast._plans, "Fast
# paths"), in C. A model calls attention once per layer per token with the same layout; once
# the full checks accepted a layout, what is left per call (plan key, flags, memory overlap,
# the new tokens' writes, the output, the kernel call) costs a few microseconds in Python and
# a fraction of one here. Every function declines (returns None, having changed nothing)
# whenever anything differs from the common case; the full checks then run (and raise the
# usual errors). There is no second, Python copy of this work: tests see which path ran
# through fast_calls_taken and fail the kernels through fast_call_hooks. Their arguments
# are positional (keyword parsing would cost a tenth of what is left); the callers name them.

from libc.stdlib cimport calloc, malloc, free
from libc.string cimport memcmp, memcpy

cdef extern from *:
    """
    /* np.empty(shape, dtype): steals the reference to descr (NumPy's rule). */
    static PyObject* attnfast_empty(int nd, npy_intp* dims, PyObject* descr) {
        return PyArray_Empty(nd, dims, (PyArray_Descr*) descr, 0);
    }
    static int attnfast_equiv_dtypes(PyArrayObject* a, PyArrayObject* b) {
        return PyArray_EquivTypes(PyArray_DESCR(a), PyArray_DESCR(b));
    }
    static int attnfast_byteorder(PyArrayObject* a) { return PyArray_DESCR(a)->byteorder; }
    """
    object attnfast_empty(int nd, cnp.npy_intp* dims, PyObject* descr)
    bint attnfast_equiv_dtypes(cnp.ndarray a, cnp.ndarray b)
    int attnfast_byteorder(cnp.ndarray a)

cdef enum:
    _KEY_WORDS_PER_ARRAY = 36   # ndim, 16 dims, 16 strides, type number, byte order, item size

# Calls each C tail took (counted before the kernels run): tests see which path ran.
fast_calls_taken = {"attention": 0, "kvcache": 0, "paged": 0}

# For tests: a callable set here runs right before each C tail calls the kernels (with the
# keyword interruptible=, what the kernels are given), and may raise there what a kernel
# stopped by Ctrl-C raises (KeyboardInterrupt), or MemoryError, to show that such a call
# changes nothing. None in production.
fast_call_hooks = {"before_kernels": None}


cdef class Layout:
    """layout_key's result: the words it read, compared whole, hashed once as they are read
    (FNV-1a over the words: a plan's lookup then costs no SipHash over a few hundred bytes)."""
    cdef bytes words
    cdef Py_hash_t hash

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        cdef bytes a = self.words, b
        if type(other) is not Layout:
            return False
        b = (<Layout> other).words
        return len(a) == len(b) and memcmp(<char*> a, <char*> b, len(a)) == 0


def layout_key(a0, a1, a2, a3=None, a4=None, a5=None, bint any_keys=False):
    """The layout of up to six arrays as one Layout (shape, strides, dtype of each; None
    stays distinct from every array), or None unless each is None or exactly a
    numpy.ndarray of at most 16 dimensions: the array part of a fast-path plan key.
    any_keys: a1 and a2 (k and v) are C-contiguous 4-D arrays whose key count (axis 2), and
    with it their outer strides, the key leaves out (a marker instead): a cache that grows
    by a token a step (transformers' DynamicCache) keeps its plan."""
    cdef int64_t words[6 * _KEY_WORDS_PER_ARRAY]
    cdef int n = 0, i, j, slot = -1
    cdef uint64_t h = 14695981039346656037ULL
    cdef cnp.ndarray a
    cdef Layout key
    for obj in (a0, a1, a2, a3, a4, a5):
        slot += 1
        if obj is None:
            words[n] = -1
            n += 1
            continue
        if type(obj) is not _ndarray:
            return None
        a = <cnp.ndarray> obj
        if cnp.PyArray_NDIM(a) > 16:
            return None
        words[n] = cnp.PyArray_NDIM(a)
        n += 1
        for j in range(cnp.PyArray_NDIM(a)):
            words[n] = cnp.PyArray_DIMS(a)[j]
            words[n + 1] = cnp.PyArray_STRIDES(a)[j]
            if any_keys and (slot == 1 or slot == 2) and j <= 2:
                words[n + (0 if j == 2 else 1)] = -2  # (axis 2's count; axes 0, 1's strides)
            n += 2
        words[n] = cnp.PyArray_TYPE(a)
        words[n + 1] = attnfast_byteorder(a)
        words[n + 2] = cnp.PyArray_ITEMSIZE(a)
        n += 3
    for i in range(n):
        h = (h ^ <uint64_t> words[i]) * 1099511628211ULL
    key = Layout.__new__(Layout)
    key.words = (<char*> words)[:n * sizeof(int64_t)]
    key.hash = <Py_hash_t> (h >> 1)   # (never -1)
    return key


cdef bint _extent(cnp.ndarray a, char** lo, char** hi):
    """[lo, hi): the bytes `a` spans, as np.may_share_memory bounds them; False if empty."""
    cdef char* start = <char*> cnp.PyArray_DATA(a)
    cdef char* end = start + cnp.PyArray_ITEMSIZE(a)
    cdef cnp.npy_intp n, s
    cdef int i
    for i in range(cnp.PyArray_NDIM(a)):
        n = cnp.PyArray_DIMS(a)[i]
        if n == 0:
            return False
        s = cnp.PyArray_STRIDES(a)[i]
        if s < 0:
            start += (n - 1) * s
        else:
            end += (n - 1) * s
    lo[0] = start
    hi[0] = end
    return True


cdef int _apart(cnp.ndarray a, cnp.ndarray b):
    """1 when np.may_share_memory(a, b) is False, 0 when it is True, -1 when either is empty
    (the fast paths then decline: NumPy's answer for empty arrays is not reproduced here)."""
    cdef char *alo, *ahi, *blo, *bhi
    if not _extent(a, &alo, &ahi) or not _extent(b, &blo, &bhi):
        return -1
    return 1 if (alo >= bhi or blo >= ahi) else 0


cdef inline bint _aligned(cnp.ndarray a):
    return (cnp.PyArray_FLAGS(a) & cnp.NPY_ARRAY_ALIGNED) != 0


cdef inline bint _writeable(cnp.ndarray a):
    return (cnp.PyArray_FLAGS(a) & cnp.NPY_ARRAY_WRITEABLE) != 0


cdef object _usable_out(out, cnp.ndarray a, cnp.ndarray b, cnp.ndarray c, d=None, e=None):
    """The per-call checks of a caller's `out` that a plan key cannot hold (its layout is in
    the key, so check_out's shape, dtype and self-overlap rules held when the plan was made):
    `out` as an ndarray when it is exactly one, writeable (not a read-only copy of a torch
    tensor with the negative bit: attnfast._written.check_written), aligned, and apart from
    each of the arrays the call reads or writes (a .. e; d, e may be None); else None (the
    fast path declines and the full path raises its usual error, naming out)."""
    cdef cnp.ndarray target
    if type(out) is not _ndarray:
        return None
    target = <cnp.ndarray> out
    if not (_writeable(target) and _aligned(target) and _apart(target, a) == 1
            and _apart(target, b) == 1 and _apart(target, c) == 1):
        return None
    if d is not None and _apart(target, <cnp.ndarray> d) != 1:
        return None
    if e is not None and _apart(target, <cnp.ndarray> e) != 1:
        return None
    return target


cdef object _empty(tuple shape, dtype):
    """np.empty(shape, dtype) for a shape of at most 4 axes."""
    cdef cnp.npy_intp dims[4]
    cdef int i
    for i in range(len(shape)):
        dims[i] = shape[i]
    Py_INCREF(dtype)
    return attnfast_empty(len(shape), dims, <PyObject*> dtype)


# Below this much work (B * H * Tq * Tk * (D + Dv), ~1 ms on one core) a C tail leaves
# Python's SIGINT handler in place while the kernels run: a Ctrl-C then raises as they return,
# inside the entry point's transaction, which undoes the call; stopping them early would save
# less than the two sigaction calls cost (~1 us, a decode step's kernel time).
cdef double _INTERRUPTIBLE_WORK = 4e6

import _signal
import threading
cdef object _default_int_handler = _signal.default_int_handler
cdef object _getsignal = _signal.getsignal  # (the handler as stored: no enum conversion)


def kernels_interruptible():
    """Whether Ctrl-C may stop the kernels of this call: only in the main thread, which alone
    receives it, and only under Python's default SIGINT handler (an ignored SIGINT, e.g. a
    background job, or a handler of the caller's own must not cut a computation short)."""
    return (threading.get_ident() == threading.main_thread().ident
            and _getsignal(SIGINT) is _default_int_handler)


cdef int _run_one(AttentionParams* p) except -1:
    hook = fast_call_hooks["before_kernels"]
    if hook is not None:
        hook(interruptible=kernels_interruptible())
    if ((<double> p.batch * p.heads * p.seqlen_q * p.seqlen_k * (p.head_dim + p.head_dim_v))
            >= _INTERRUPTIBLE_WORK and kernels_interruptible()):
        _run_interruptible(p)
    else:
        with nogil:
            attention_forward(p[0])
    return 0


# ---- what every C tail resolves per call: threads, query_offset, window ----

cdef int _processors = max(1, processor_count())
cdef int _default_threads = 0   # set_num_threads or ATTNFAST_NUM_THREADS; 0: OpenMP's limit


def set_default_threads(n):
    """attnfast._runtime: the thread count of calls without num_threads (None: OpenMP's)."""
    global _default_threads
    _default_threads = 0 if n is None else n


def call_threads(num_threads):
    """The threads of a call (attnfast._runtime.resolve_threads) for num_threads None or an
    int >= 1, clamped to the processors; None for anything else (the full path raises)."""
    cdef int overflow = 0
    cdef long long n
    if num_threads is None:
        return _default_threads if _default_threads > 0 else min(
            max(1, openmp_max_threads()), _processors)
    if type(num_threads) is not int:
        return None
    n = PyLong_AsLongLongAndOverflow(num_threads, &overflow)
    if overflow > 0 or n >= _processors:
        return _processors
    return n if n >= 1 else None


cdef bint _offset_ok(query_offset) except -1:
    """check_query_offset accepts query_offset as it is: None, or an int within +-2**62."""
    cdef int overflow = 0
    cdef long long n
    if query_offset is None:
        return True
    if type(query_offset) is not int:
        return False
    n = PyLong_AsLongLongAndOverflow(query_offset, &overflow)
    return overflow == 0 and -(1LL << 62) <= n <= (1LL << 62)


cdef int _bound_window(tuple window, int64_t reach, query_offset, int64_t* side) except -1:
    """attnfast._scalars.bound_window over `reach` keys + query rows (+ |query_offset|): a
    checked window's sides (ints >= -1, any size), -1 where they exclude no key."""
    cdef int overflow = 0, i
    cdef long long w
    if query_offset is not None:
        w = query_offset
        reach += w if w >= 0 else -w
    for i in range(2):
        w = PyLong_AsLongLongAndOverflow(window[i], &overflow)
        side[i] = -1 if (overflow or w >= reach) else w
    return 0


cdef object _threads(num_threads, query_offset, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v):
    """A C tail's threads (call_threads), or None (it declines) unless query_offset is as the
    full path takes it unchanged and q, k, v are aligned."""
    threads = call_threads(num_threads)
    if (threads is None or not _offset_ok(query_offset)
            or not (_aligned(q) and _aligned(k) and _aligned(v))):
        return None
    return threads


cdef class Plan:
    """What the full checks concluded about an accepted call's layout (attnfast._plans), as
    the C tails read it: the output's shape and dtype, scale, the window as checked, Tq, the
    keys the window is bounded by (attention: Tk; a contiguous cache: its capacity), the new
    tokens per sequence, the lse dtype (None without return_lse); a paged call's checked
    call (for the shared-prefix composition)."""
    cdef readonly tuple out_shape, window
    cdef readonly object dtype, lse_dtype, call
    cdef readonly double scale
    cdef readonly int64_t new_tokens, seqlen_q, seqlen_k

    def __init__(self, *, out_shape, dtype, scale, window, seqlen_k, lse_dtype,
                 new_tokens=0, call=None):
        self.out_shape, self.dtype, self.scale = tuple(out_shape), dtype, scale
        self.window, self.seqlen_q, self.seqlen_k = tuple(window), out_shape[2], seqlen_k
        self.lse_dtype, self.new_tokens, self.call = lse_dtype, new_tokens, call


def attention_fast(Plan plan, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, out, bint causal,
                   num_threads, query_offset):
    """The rest of attnfast.attention's fast path in one call: q, k, v 4-D of a layout the
    full path accepted (`plan`); out None (allocated) or an array to fill; with the plan's
    lse dtype (return_lse) the tuple (out, lse), lse a new (B, H, Tq) array. None, having
    done nothing, unless num_threads and query_offset are as the full path takes them
    unchanged, q, k, v are aligned and out (if given) is a writeable aligned ndarray apart
    from q, k and v."""
    threads = _threads(num_threads, query_offset, q, k, v)
    if threads is None:
        return None
    if out is not None:
        out = _usable_out(out, q, k, v)
        if out is None:
            return None
    # (the key count from the call: the plan's key holds it, or, without it (any_keys), held
    # k's and v's counts equal and >= 1 when attention_key built it for this call)
    return _run_plan(plan, "attention", q, k, v, out, causal, threads, None, None, None,
                     query_offset, None, cnp.PyArray_DIMS(k)[2])


def decode_fast(Plan plan, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, lengths, k_new,
                v_new, out, bint causal, num_threads, query_offset, bint advance,
                key_index=None):
    """The rest of the KV-cache fast paths (attention_with_kvcache, KVCache.attend / step) in
    one call, for a layout the full path accepted (`plan`): write the t new tokens (t = 0:
    none; rounded to a 16-bit cache's dtype first, as the full path stores them) at each
    sequence's length, attend over the lengths plus t, return out: the caller's `out`
    (written in place) or, when it is None, a new array; with the plan's lse dtype
    (return_lse) the tuple (out, lse), lse a new (B, H, Tq) array.
    A caller's out is used only if _usable_out accepts it (writeable, aligned, apart from
    q, the caches and the new tokens); its layout is in the plan key.

    lengths: the tokens cached per sequence: a Python int (every sequence) or an int32 /
    int64 array (B,); with ``advance`` (KVCache) an int64 C-contiguous array that is
    advanced by t in place. None, having changed nothing, unless every length leaves room
    for t tokens, the arrays are aligned, the caches writeable (in a transaction, whose
    log takes what the writes overwrite and the lengths: attnfast._transaction), the new
    tokens of the caches' dtype, and nothing that is written overlaps what is read (the full
    path decides the rest; the caches may overlap each other only with advance, a latent
    KVCache's v being a view of its k). key_index: the call's, of the layout in the plan key
    (kvcache_key), its values checked here (_listed_keys_ok; the full path names a bad one).
    """
    cdef cnp.npy_intp B = cnp.PyArray_DIMS(q)[0], b, i
    cdef cnp.ndarray lens = None
    cdef int64_t* starts = NULL
    cdef int64_t* after      # the lengths after the call: the cache's own, or in `starts`
    cdef int64_t t = plan.new_tokens, capacity = plan.seqlen_k
    cdef bint latent = advance and _apart(k, v) != 1  # (a latent KVCache: v is k's prefix)
    threads = _threads(num_threads, query_offset, q, k, v)
    if threads is None or B < 1:
        return None
    if advance:  # the cache's own lengths, advanced in place
        lens = <cnp.ndarray?> lengths
        if (cnp.PyArray_TYPE(lens) != cnp.NPY_INT64 or not cnp.PyArray_IS_C_CONTIGUOUS(lens)
                or not _writeable(lens)):
            return None
    rows = _new_rows(k_new, v_new, q, k, v, latent) if t else ()
    if rows is None:
        return None
    if out is not None:
        out = _usable_out(out, q, k, v, k_new, v_new)
        if out is None:
            return None      # the full path raises its error, naming out
    starts = <int64_t*> malloc((2 * B + 2 * B * t) * sizeof(int64_t))  # + slots, lengths
    if starts == NULL:
        raise MemoryError()
    after = <int64_t*> cnp.PyArray_DATA(lens) if advance else starts + B + 2 * B * t
    try:
        if not _read_lengths(lengths, B, capacity - t, starts):
            return None
        if key_index is not None:  # its entries against the lengths after the call
            for b in range(B):
                starts[B + 2 * B * t + b] = starts[b] + t
            key_index = _listed_keys_ok(<cnp.ndarray> key_index, B, cnp.PyArray_DIMS(q)[2],
                                        starts + B + 2 * B * t, capacity)
            if key_index is None:
                return None
        if t:  # sequence b's token u: row starts[b] + u of the cache's "block" b
            for b in range(B):
                for i in range(t):
                    starts[B + 2 * (b * t + i)] = b
                    starts[B + 2 * (b * t + i) + 1] = starts[b] + i
            # (joins the transaction's log; a latent cache's v rows are its k rows)
            _write_rows([k] if latent else [k, v], [rows[0]] if latent else list(rows),
                        starts + B, B, t)
            if advance:
                _keep_int64s(lens)
        for b in range(B):
            after[b] = starts[b] + t
        # (raising: the transaction puts back what was written)
        return _run_plan(plan, "kvcache", q, k, v, out, causal, threads, None, None, None,
                         query_offset, None, capacity, NULL, after, key_index)
    finally:
        free(starts)


cdef object _listed_keys_ok(cnp.ndarray index, cnp.npy_intp B, cnp.npy_intp Tq,
                            const int64_t* lengths, int64_t capacity):
    """key_index (B, Tq, k) or (B, Hkv, Tq, k), int32, as the kernels read it, (B, 1 or Hkv,
    Tq, k): or None (decline) unless every entry is -1 or a position below its sequence's
    length and no row lists a position twice (the full path's rules: attnfast._key_index)."""
    cdef int nd = cnp.PyArray_NDIM(index)
    cdef cnp.npy_intp G = cnp.PyArray_DIMS(index)[1] if nd == 4 else 1
    cdef cnp.npy_intp K = cnp.PyArray_DIMS(index)[nd - 1], b, g, i, x
    cdef char* base = <char*> cnp.PyArray_DATA(index)
    cdef cnp.npy_intp sb = cnp.PyArray_STRIDES(index)[0]
    cdef cnp.npy_intp sg = cnp.PyArray_STRIDES(index)[1] if nd == 4 else 0
    cdef cnp.npy_intp st = cnp.PyArray_STRIDES(index)[nd - 2]
    cdef const int32_t* row
    cdef int32_t pos
    cdef uint64_t* seen = <uint64_t*> calloc(<size_t> (capacity // 64 + 1), sizeof(uint64_t))
    cdef bint ok = True
    if seen == NULL:
        raise MemoryError()
    try:
        for b in range(B):
            for g in range(G):
                for i in range(Tq):
                    row = <const int32_t*> (base + b * sb + g * sg + i * st)
                    for x in range(K):
                        pos = row[x]
                        if pos < -1 or pos >= lengths[b]:
                            ok = False
                        elif pos >= 0:
                            if seen[pos >> 6] & (1ULL << (pos & 63)):
                                ok = False
                            seen[pos >> 6] |= 1ULL << (pos & 63)
                    for x in range(K):  # (cleared for the next row)
                        pos = row[x]
                        if 0 <= pos < lengths[b]:
                            seen[pos >> 6] = 0
                    if not ok:
                        return None
    finally:
        free(seen)
    return index if nd == 4 else index.reshape(B, 1, Tq, K)


_INT64 = np.dtype(np.int64)


cdef tuple _new_rows(k_new, v_new, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, bint latent):
    """(k_new, v_new) as a C tail writes them into caches k, v: in their dtype (float32 rows
    rounded to a 16-bit cache's, as the full path stores them; a latent cache's values the
    prefix view of its rows), or None (decline) unless both are ndarrays, the caches are
    writeable, a transaction is open (it undoes the writes) and nothing written overlaps
    what is read (a latent cache's v is a view of its k, v_new one of k_new)."""
    cdef cnp.ndarray kn, vn
    if type(k_new) is not _ndarray or type(v_new) is not _ndarray:
        return None
    if not (_writeable(k) and _writeable(v) and _open_log() is not None):
        return None
    kn, vn = <cnp.ndarray> k_new, <cnp.ndarray> v_new
    if not (attnfast_equiv_dtypes(kn, k) and attnfast_equiv_dtypes(vn, v)):
        from attnfast._transaction import stored_form
        kn, vn = stored_form(kn, vn, k.dtype)[:2]
        if latent:
            vn = kn[..., :cnp.PyArray_DIMS(v)[3]]
        if not (attnfast_equiv_dtypes(kn, k) and attnfast_equiv_dtypes(vn, v)):
            return None
    if latent:  # v_new must be k_new's prefix view (latent_values): written with k
        if (cnp.PyArray_DATA(vn) != cnp.PyArray_DATA(kn)
                or cnp.PyArray_STRIDES(vn)[0] != cnp.PyArray_STRIDES(kn)[0]
                or cnp.PyArray_STRIDES(vn)[1] != cnp.PyArray_STRIDES(kn)[1]
                or cnp.PyArray_STRIDES(vn)[2] != cnp.PyArray_STRIDES(kn)[2]):
            return None
    elif _apart(k, v) != 1:
        return None
    if not (_apart(q, k) == 1 and _apart(q, v) == 1 and _apart(kn, k) == 1
            and _apart(kn, v) == 1 and _apart(vn, k) == 1 and _apart(vn, v) == 1):
        return None      # the full path decides (and raises) exactly
    return kn, vn


cdef bint _read_lengths(lengths, cnp.npy_intp B, int64_t most, int64_t* into) except -1:
    """A call's cache lengths, a Python int (every sequence) or an aligned native int32 /
    int64 array (B,), into `into`: False (decline) for anything else or a value outside
    [0, most]."""
    cdef int overflow = 0
    cdef long long n
    cdef cnp.ndarray given
    cdef cnp.npy_intp b
    if type(lengths) is int:
        n = PyLong_AsLongLongAndOverflow(lengths, &overflow)
        for b in range(B):
            into[b] = n
    elif type(lengths) is _ndarray:
        given = <cnp.ndarray> lengths
        if (cnp.PyArray_NDIM(given) != 1 or cnp.PyArray_DIMS(given)[0] != B
                or not _aligned(given) or not cnp.PyArray_ISNOTSWAPPED(given)):
            return False
        for b in range(B):
            if cnp.PyArray_TYPE(given) == cnp.NPY_INT64:
                into[b] = (<int64_t*> cnp.PyArray_GETPTR1(given, b))[0]
            elif cnp.PyArray_TYPE(given) == cnp.NPY_INT32:
                into[b] = (<int32_t*> cnp.PyArray_GETPTR1(given, b))[0]
            else:
                return False
    else:
        return False
    for b in range(B):
        if overflow or into[b] < 0 or into[b] > most:
            return False
    return True


cdef object _run_plan(Plan plan, str path, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, out,
                      bint causal, threads, seqlens, k_scale, v_scale, query_offset, table,
                      int64_t keys, const int64_t* pool_table=NULL, const int64_t* lens=NULL,
                      key_index=None):
    """The end of every C tail: out (the caller's, checked, or a new array) and lse (with
    return_lse), the window bounded over `keys` (bound_window), the kernel call; returns
    out or (out, lse). `lens`: the lengths (B,) in a C tail's own memory (seqlens None);
    `pool_table`: paged_fast's block table (B, keys / block size), likewise (table None);
    key_index: (B, 1 or Hkv, Tq, k) int32, checked (_listed_keys_ok)."""
    cdef AttentionParams p = default_params()
    cdef int64_t side[2]
    target = _empty(plan.out_shape, plan.dtype) if out is None else out
    lse = None if plan.lse_dtype is None else _empty(plan.out_shape[:3], plan.lse_dtype)
    _bound_window(plan.window, plan.seqlen_q + keys, query_offset, side)
    _fill_params(&p, q, k, v, target, lse, causal, plan.scale, side[0], side[1], threads,
                 seqlens, k_scale, v_scale, query_offset, 0.0, None, None, None, table, -1,
                 key_index)
    if lens != NULL:
        p.seqlens_k = lens
    if pool_table != NULL:
        p.block_table = pool_table
        p.block_size, p.num_blocks = cnp.PyArray_DIMS(k)[2], cnp.PyArray_DIMS(k)[0]
        p.block_table_batch_stride, p.seqlen_k = keys // p.block_size, keys
    fast_calls_taken[path] += 1
    _run_one(&p)
    return target if lse is None else (target, lse)


# ---- plan keys (attnfast._plans): what a plan is stored and found under ----

cdef frozenset _KEY_SCALE_TYPES = frozenset((float, int, np.float64, np.float32, np.float16))


def attention_key(q, k, v, out, causal, scale, window, return_lse=False, tuple unplanned=()):
    """attention(): the plan key of a call (kvcache_key's, without lengths or new tokens), or
    None when no plan can serve it: where attention()'s fast-path eligibility is decided.
    C-contiguous 4-D k and v with the same key count >= 1 are keyed without it (any_keys)."""
    return kvcache_key(q, k, v, "attention", None, None, out, causal, scale, window,
                       return_lse, unplanned, any_keys=_any_keys(k, v))


cdef bint _any_keys(k, v):
    """Whether k and v are C-contiguous 4-D ndarrays with the same key count, at least 1:
    their layout is then the same for any count (see layout_key), and attention_fast takes
    the count from the call."""
    cdef cnp.ndarray a, b
    if type(k) is not _ndarray or type(v) is not _ndarray:
        return False
    a, b = <cnp.ndarray> k, <cnp.ndarray> v
    return (cnp.PyArray_NDIM(a) == 4 and cnp.PyArray_NDIM(b) == 4
            and cnp.PyArray_IS_C_CONTIGUOUS(a) and cnp.PyArray_IS_C_CONTIGUOUS(b)
            and cnp.PyArray_DIMS(a)[2] >= 1 and cnp.PyArray_DIMS(a)[2] == cnp.PyArray_DIMS(b)[2])


def seqlens_key(cache_seqlens):
    """cache_seqlens in a kvcache_key: a Python int, or a 1-D integer array (its shape and
    dtype); None (the full path) for anything else."""
    if type(cache_seqlens) is int:
        return int
    if type(cache_seqlens) is _ndarray and cnp.PyArray_NDIM(<cnp.ndarray> cache_seqlens) == 1:
        return cache_seqlens.shape, cache_seqlens.dtype
    return None


cpdef object kvcache_key(q, k_cache, v_cache, lengths_key, k_new, v_new, out, causal, scale,
                        window, return_lse, tuple unplanned=(), block_table=None, k_scale=None,
                        v_scale=None, bint any_keys=False, key_index=None):
    """attention_with_kvcache() and KVCache.attend/step: the plan key of a call, or None when
    no plan can serve it: where the KV-cache fast path's eligibility is decided. The key
    holds the layouts of q, the caches, the new tokens and `out` (so out's shape, dtype and
    strides were checked once, by the call that stored the plan), the lengths' type
    (`lengths_key`; their values are checked per call), causal, scale, window and
    return_lse with their exact types. `unplanned`: the call's other options, which only
    the full path takes; the key is None unless each of them is None. A paged call's
    block_table and scales add their layouts (the table's width fixes the capacity);
    key_index (with a 4-D q, no block table or scales) its layout: an aligned int32 ndarray,
    3-D or 4-D, its last axis contiguous (decode_fast and paged_fast check its values)."""
    cdef Py_ssize_t i
    if lengths_key is None or q is None or k_cache is None or v_cache is None:
        return None
    if (k_new is None) != (v_new is None):
        return None
    if return_lse is not False and return_lse is not True:
        return None
    for i in range(len(unplanned)):
        if unplanned[i] is not None:
            return None
    layout = layout_key(q, k_cache, v_cache, k_new, v_new, out, any_keys)  # (None unless ndarrays)
    if layout is None:
        return None
    # The options with exact types: values that compare equal (True == 1 == 1.0) must be
    # checked alike, and bools are refused where ints are taken.
    if causal is not True and causal is not False:
        return None
    if scale is not None and type(scale) not in _KEY_SCALE_TYPES:
        return None
    if window is not None and not (type(window) is tuple and len(window) == 2
                                   and type(window[0]) is int and type(window[1]) is int):
        return None
    if key_index is not None:  # (for a 4-D q: (B, Tq, k) or (B, Hkv, Tq, k))
        listed = _listed_keys_layout(key_index)
        if (listed is None or cnp.PyArray_NDIM(<cnp.ndarray> q) != 4 or block_table is not None
                or k_scale is not None or v_scale is not None):
            return None
        return layout, lengths_key, causal, scale, window, return_lse, listed
    if block_table is None and k_scale is None and v_scale is None:
        return layout, lengths_key, causal, scale, window, return_lse
    paged = layout_key(block_table, k_scale, v_scale)
    return None if paged is None else (layout, lengths_key, causal, scale, window, return_lse,
                                       paged)


cdef object _listed_keys_layout(key_index):
    """key_index's part of a kvcache_key: its layout, or None (the full path) unless it is
    an aligned native int32 ndarray of 3 or 4 dimensions whose last axis is contiguous."""
    cdef cnp.ndarray a
    if type(key_index) is not _ndarray:
        return None
    a = <cnp.ndarray> key_index
    if (cnp.PyArray_TYPE(a) != cnp.NPY_INT32 or not (cnp.PyArray_NDIM(a) == 3 or cnp.PyArray_NDIM(a) == 4)
            or not _aligned(a) or not cnp.PyArray_ISNOTSWAPPED(a)
            or (cnp.PyArray_DIMS(a)[cnp.PyArray_NDIM(a) - 1] > 1
                and cnp.PyArray_STRIDES(a)[cnp.PyArray_NDIM(a) - 1] != 4)):
        return None
    return "key_index", layout_key(a, None, None)


# ---- PagedKVCache.attend / step (attnfast._paged): the per-call bookkeeping, in C ----
#
# What a repeat call of an accepted layout still has to check and do, in one pass over the
# sequences it serves: their ids, whether the pool has the blocks an append takes, the block
# table and lengths the kernels read, that nothing written overlaps what is read, the token
# writes with the rows they overwrite kept, the blocks taken, the lengths advanced, the
# kernel call. Anything unusual (an id that is not an int or not live, a shared partly filled
# last block to copy first, too few free blocks, sequences sharing a long prefix, other
# dtypes or overlaps) declines, having changed nothing: the full path then runs and raises
# or composes as always.

cdef class _PagedStepWritten:
    """What one paged_fast call changed in the bookkeeping: the blocks it took off the free
    list (the first `popped`), the sequences' lengths and block lists (the pool rows it
    wrote are _RowsWritten entries of their own). Calling it puts it back; it may run again
    (and then changes nothing)."""
    cdef list seqs, free
    cdef cnp.ndarray refs
    cdef bytes info, table     # int64 per sequence: (length, blocks held, blocks taken); table
    cdef int64_t popped, width
    cdef bint restored

    def __call__(self):
        cdef const int64_t* info = <const int64_t*> (<char*> self.info)
        cdef const int64_t* tab = <const int64_t*> (<char*> self.table)
        cdef int64_t* refs = <int64_t*> cnp.PyArray_DATA(self.refs)
        cdef int64_t width = self.width, blk
        cdef Py_ssize_t B = len(self.seqs), b, g, i
        cdef list taken = []
        if self.restored:
            return
        for b in range(B):
            seq = self.seqs[b]
            del seq.blocks[info[3 * b + 1]:]
            seq.length = info[3 * b]
            for g in range(info[3 * b + 2]):
                taken.append(tab[b * width + info[3 * b + 1] + g])
        for i in range(self.popped - 1, -1, -1):  # back on the stack in the order they left
            blk = taken[i]
            refs[blk] = 0
            self.free.append(blk)
        self.restored = True


cdef bint _has_shape(cnp.ndarray a, tuple shape):
    """a's shape is `shape` (a tuple of ints)."""
    cdef int i
    if cnp.PyArray_NDIM(a) != len(shape):
        return False
    for i in range(cnp.PyArray_NDIM(a)):
        if cnp.PyArray_DIMS(a)[i] != <cnp.npy_intp> shape[i]:
            return False
    return True


cdef dict _paged_plans = None       # attnfast._plans.KVCACHE_PLANS (use_paged_plans)
cdef object _shared_prefix = None    # attnfast._shared_prefix (its MIN_PREFIX_KEYS, per call)


def use_paged_plans(dict plans, shared_prefix):
    """attnfast._paged, once: where paged_call finds plans and the shared-prefix threshold."""
    global _paged_plans, _shared_prefix
    _paged_plans, _shared_prefix = plans, shared_prefix


def paged_call(cache, seq_ids, q, k_new, v_new, causal, scale, window, softcap, alibi_slopes,
               sinks, mask, return_lse, out, num_threads, query_offset, tree_mask, key_index):
    """PagedKVCache.attend / step by the plan an earlier call of this layout left under the
    call's kvcache_key, if there is one: with one bare id, 3-D arrays gain the sequence axis
    (the results lose it again; a caller's out comes back as itself), then paged_fast. Else
    (no plan, or paged_fast declines, having changed nothing) the full path,
    ``cache._call(the same arguments)``."""
    k, v = cache._k, cache._v
    key = kvcache_key(q, k, v, "PagedKVCache.lengths", k_new, v_new, out, causal,
                      scale, window, return_lse, (softcap, alibi_slopes, sinks, mask, tree_mask),
                      key_index=key_index)
    plan = None if key is None else _paged_plans.get(key)
    result = None if plan is None else _paged_planned(
        plan, cache, k, v, seq_ids, q, k_new, v_new, out, causal, num_threads, query_offset,
        key_index)
    if result is None:
        return cache._call(seq_ids, q, k_new, v_new, causal, scale, window, softcap,
                           alibi_slopes, sinks, mask, return_lse, out, num_threads,
                           query_offset, tree_mask, key_index)
    return result


cdef object _paged_planned(Plan plan, cache, cnp.ndarray k, cnp.ndarray v, seq_ids, q, k_new,
                           v_new, out, bint causal, num_threads, query_offset, key_index):
    """paged_call's fast path (None: declined)."""
    lq, lk, lv, lout = q, k_new, v_new, out
    if type(seq_ids) is int:  # one bare id: 3-D arrays gain the sequence axis
        lq, lk, lv, lout = [a[None] if a is not None and a.ndim == 3 else a
                            for a in (q, k_new, v_new, out)]
    elif cnp.PyArray_NDIM(<cnp.ndarray> q) == 3:
        return None
    result = paged_fast(plan, cache, k, v, seq_ids, lq, lk, lv, lout, causal, num_threads,
                        query_offset, _shared_prefix.MIN_PREFIX_KEYS, key_index)
    if result is None or (lq is q and out is None):
        return result
    return paged_result(result, plan.lse_dtype is not None, lq is not q, out)


def paged_result(result, bint return_lse, bint squeeze, out):
    """PagedKVCache.attend / step's result: 3-D (squeeze: one bare id, 3-D q) or as computed;
    a caller's `out` comes back as itself (not as the 4-D view the kernels filled)."""
    first, lse = result if return_lse else (result, None)
    if squeeze:
        first, lse = first[0], (None if lse is None else lse[0])
    if out is not None:
        first = out
    return (first, lse) if return_lse else first


cdef paged_fast(Plan plan, cache, cnp.ndarray k, cnp.ndarray v, seq_ids, cnp.ndarray q, k_new,
                v_new, out, bint causal,
                num_threads, query_offset, int64_t shared_keys, key_index=None):
    """The rest of PagedKVCache.attend / step's fast path (paged_call) in
    one call, for a layout the full path accepted (`plan`: t new tokens, the output, scale,
    window as checked): append k_new, v_new (t > 0) to each sequence of
    `seq_ids` (an int, or a list / tuple of ints, one per row of q), taking blocks from the
    free list as PagedKVCache._append does, then attend over every sequence's tokens.
    Returns out (the caller's `out`, written in place, or a new array), or (out, lse) with
    the plan's lse dtype. None, having changed nothing, unless the ids are distinct live sequences,
    no sequence's partly filled last block is shared (copy-on-write: the full path), the pool
    has the blocks needed, no two sequences with `shared_keys` or more keys begin with the
    same block (shared-prefix decoding: the full path), the new tokens fit (_new_rows)
    and nothing written overlaps what the call reads, and key_index (its layout in the plan
    key) lists distinct positions below the lengths after the call (_listed_keys_ok). What
    it changes (bytes, blocks, lengths) goes to the open transaction's log first
    (attnfast._transaction)."""
    cdef cnp.ndarray refs = None     # (the blocks' counts and the free list: read to append)
    cdef list free_list = None
    cdef dict live = <dict?> cache._seqs
    cdef cnp.ndarray kn = None, vn = None
    cdef Py_ssize_t B, b, c, i, g, nb, nfree
    cdef int64_t NB = cnp.PyArray_DIMS(k)[0], Hkv = cnp.PyArray_DIMS(k)[1]
    cdef int64_t BS = cnp.PyArray_DIMS(k)[2]
    cdef int64_t n, grow, needed = 0, width = 1, blk
    cdef int64_t t = plan.new_tokens
    cdef tuple out_shape = plan.out_shape
    cdef int64_t* info
    cdef int64_t* tab = NULL
    cdef int64_t* lens
    cdef int64_t* refp = NULL
    cdef int64_t* slots
    cdef list seqs
    cdef _PagedStepWritten w
    threads = _threads(num_threads, query_offset, q, k, v)
    if threads is None:
        return None
    if type(seq_ids) is int:
        ids = (seq_ids,)
    elif type(seq_ids) is list or type(seq_ids) is tuple:
        ids = seq_ids
    else:
        return None
    B = len(ids)
    if B < 1 or B != cnp.PyArray_DIMS(q)[0] or B != out_shape[0]:
        return None
    if t:
        refs, free_list = <cnp.ndarray?> cache._refs, <list?> cache._free
        if (cnp.PyArray_TYPE(refs) != cnp.NPY_INT64 or cnp.PyArray_NDIM(refs) != 1
                or cnp.PyArray_DIMS(refs)[0] != NB or not cnp.PyArray_IS_C_CONTIGUOUS(refs)):
            return None
        refp = <int64_t*> cnp.PyArray_DATA(refs)
        rows = _new_rows(k_new, v_new, q, k, v, cache._latent)
        if rows is None:
            return None
        kn, vn = rows
        if (cnp.PyArray_NDIM(kn) != 4 or cnp.PyArray_NDIM(vn) != 4
                or cnp.PyArray_DIMS(kn)[0] != B or cnp.PyArray_DIMS(kn)[1] != Hkv
                or cnp.PyArray_DIMS(kn)[2] != t or cnp.PyArray_DIMS(vn)[0] != B
                or cnp.PyArray_DIMS(vn)[1] != Hkv or cnp.PyArray_DIMS(vn)[2] != t
                or cnp.PyArray_DIMS(kn)[3] != cnp.PyArray_DIMS(k)[3]
                or cnp.PyArray_DIMS(vn)[3] != cnp.PyArray_DIMS(v)[3]):
            return None
    if out is not None:
        out = _usable_out(out, q, k, v, k_new, v_new)
        if out is None or not _has_shape(<cnp.ndarray> out, out_shape):
            return None      # the full path raises its error, naming out
    seqs = [None] * B
    for b in range(B):
        sid = ids[b]
        if type(sid) is not int:
            return None
        seq = live.get(sid)
        if seq is None:
            return None      # the full path names the id
        seqs[b] = seq
    if B > 1:
        if B <= 16:
            for b in range(1, B):
                for c in range(b):
                    if seqs[b] is seqs[c]:
                        return None
        elif len(set(ids)) != B:
            return None
    info = <int64_t*> malloc((3 * B + 2 * B * t) * sizeof(int64_t))  # + the token slots
    if info == NULL:
        raise MemoryError()
    try:
        # The plan: per sequence its length, blocks held, blocks to take; checked first.
        for b in range(B):
            seq = seqs[b]
            blocks = seq.blocks
            length = seq.length
            if type(blocks) is not list or type(length) is not int:
                return None
            n = length
            nb = len(<list> blocks)
            grow = 0
            if t:
                if n % BS and n // BS < nb:
                    blk = (<list> blocks)[n // BS]
                    if blk < 0 or blk >= NB or refp[blk] > 1:
                        return None  # a shared partly filled block: copied first (full path)
                grow = (n + t + BS - 1) // BS - nb
                if grow < 0:
                    grow = 0
            info[3 * b], info[3 * b + 1], info[3 * b + 2] = n, nb, grow
            needed += grow
            if nb + grow > width:
                width = nb + grow
        nfree = len(free_list) if t else 0
        if needed > nfree:
            return None          # out of blocks: the full path raises, naming them
        if B >= 2 and shared_keys > 0:  # forks sharing a long prefix read it once (full path)
            for b in range(1, B):
                if info[3 * b + 1] == 0 or info[3 * b] + t < shared_keys:
                    continue
                for c in range(b):
                    if (info[3 * c + 1] and info[3 * c] + t >= shared_keys
                            and (<list> seqs[c].blocks)[0] == (<list> seqs[b].blocks)[0]):
                        return None
        # The table (unused entries 0: a valid id, never read) with the blocks to be taken,
        # then the lengths after the call
        tab = <int64_t*> malloc((B * width + B) * sizeof(int64_t))
        if tab == NULL:
            raise MemoryError()
        memset(tab, 0, B * width * sizeof(int64_t))
        g = nfree - 1
        for b in range(B):
            blocks = seqs[b].blocks
            for i in range(info[3 * b + 1]):
                blk = (<list> blocks)[i]
                if blk < 0 or blk >= NB:
                    return None
                tab[b * width + i] = blk
            for i in range(info[3 * b + 2]):  # popped off the free stack's top, in order
                blk = free_list[g]
                g -= 1
                if blk < 0 or blk >= NB or refp[blk] != 0:
                    return None
                tab[b * width + info[3 * b + 1] + i] = blk
        lens = tab + B * width
        for b in range(B):
            lens[b] = info[3 * b] + t
        if key_index is not None:
            key_index = _listed_keys_ok(<cnp.ndarray> key_index, B, cnp.PyArray_DIMS(q)[2], lens,
                                        width * BS)
            if key_index is None:
                return None
        if t:  # what changes goes to the open transaction's log first (it undoes a raise)
            w = _PagedStepWritten.__new__(_PagedStepWritten)
            w.seqs, w.free, w.refs, w.width = seqs, free_list, refs, width
            w.table = (<char*> tab)[:B * width * sizeof(int64_t)]
            w.info = (<char*> info)[:3 * B * sizeof(int64_t)]
            slots = info + 3 * B  # sequence b's token u: (block, row) of position info[3b] + u
            for b in range(B):
                for i in range(t):
                    n = info[3 * b] + i
                    slots[2 * (b * t + i)] = tab[b * width + n // BS]
                    slots[2 * (b * t + i) + 1] = n % BS
            # (a latent pool's v rows are its k rows)
            _write_rows([k] if cache._latent else [k, v], [kn] if cache._latent else [kn, vn],
                        slots, B, t)
            (<list> _open_log()).append(w)
            for b in range(B):
                seq = seqs[b]
                for i in range(info[3 * b + 2]):
                    blk = free_list.pop()
                    w.popped += 1
                    refp[blk] = 1
                    seq.blocks.append(blk)
                seq.length = lens[b]
        # (the window as bound_window leaves it over this call's width * block_size keys)
        return _run_plan(plan, "paged", q, k, v, out, causal, threads, None, None, None,
                         query_offset, None, width * BS, tab, lens, key_index)
    finally:
        free(info)
        free(tab)


# ---- attention_with_kvcache(block_table=...) without new tokens: the per-call values ----

cdef class SharedPrefix:
    """paged_table_fast's answer for a call whose sequences share a long prefix: the checked
    int64 block table, key lengths and threads; the caller runs the shared-prefix
    composition (attnfast._shared_prefix) over them."""
    cdef readonly object table, lengths, threads


def paged_table_fast(Plan plan, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cache_seqlens,
                     block_table, k_scale, v_scale, out, bint causal, num_threads, query_offset,
                     int64_t shared_keys):
    """The rest of attention_with_kvcache(block_table=...)'s fast path (_kvcache._paged_fast)
    for a layout the full path accepted (`plan`), no new tokens: the lengths (a Python int, or an
    int32 / int64 array (B,)) each in [0, max_blocks * block_size], the ids of the blocks in
    use (a sequence of n keys reads its first ceil(n / block_size) entries) in
    [0, num_blocks), `out` (if given) writeable, aligned and apart from every array the call
    reads; then the kernel call. Returns out, or (out, lse) (return_lse); a SharedPrefix
    when two sequences of `shared_keys` or more keys begin with the same block (the caller
    composes); None, having done nothing, when anything is unusual (the full path raises)."""
    cdef cnp.ndarray tab_in
    cdef int64_t NB = cnp.PyArray_DIMS(k)[0], BS = cnp.PyArray_DIMS(k)[2]
    cdef cnp.npy_intp B = cnp.PyArray_DIMS(q)[0], W, b, c, i, s0, s1
    cdef int64_t used
    cdef int64_t* tab
    cdef int64_t* buf
    cdef int64_t* L
    cdef bint copied
    cdef char* src
    threads = _threads(num_threads, query_offset, q, k, v)
    if threads is None or B < 1 or type(block_table) is not _ndarray:
        return None
    tab_in = <cnp.ndarray> block_table
    if (cnp.PyArray_NDIM(tab_in) != 2 or cnp.PyArray_DIMS(tab_in)[0] != B
            or not _aligned(tab_in) or not cnp.PyArray_ISNOTSWAPPED(tab_in)
            or cnp.PyArray_TYPE(tab_in) not in (cnp.NPY_INT64, cnp.NPY_INT32)):
        return None
    W = cnp.PyArray_DIMS(tab_in)[1]
    if W < 1:
        return None
    for a in (k_scale, v_scale):
        if a is not None and (type(a) is not _ndarray or not _aligned(<cnp.ndarray> a)):
            return None
    if out is not None:
        out = _usable_out(out, q, k, v, block_table, k_scale)
        if (out is None or not _has_shape(<cnp.ndarray> out, plan.out_shape)
                or (v_scale is not None and _apart(<cnp.ndarray> out, <cnp.ndarray> v_scale) != 1)):
            return None      # the full path raises its error, naming out
    # The table as the kernels take it: int64, rows contiguous (a copy unless it is so),
    # `rows` bytes apart; then the lengths, in memory of this call's own.
    buf = <int64_t*> malloc((B * W + B) * sizeof(int64_t))
    if buf == NULL:
        raise MemoryError()
    try:
        src, s0, s1 = <char*> cnp.PyArray_DATA(tab_in), cnp.PyArray_STRIDES(tab_in)[0], 0
        copied = not (cnp.PyArray_TYPE(tab_in) == cnp.NPY_INT64
                      and (W == 1 or cnp.PyArray_STRIDES(tab_in)[1] == 8))
        if copied:
            s1 = cnp.PyArray_STRIDES(tab_in)[1]
            for b in range(B):
                for i in range(W):
                    if cnp.PyArray_TYPE(tab_in) == cnp.NPY_INT64:
                        buf[b * W + i] = (<int64_t*> (src + b * s0 + i * s1))[0]
                    else:
                        buf[b * W + i] = (<int32_t*> (src + b * s0 + i * s1))[0]
            src, s0 = <char*> buf, W * sizeof(int64_t)
        L = buf + B * W
        if not _read_lengths(cache_seqlens, B, W * BS, L):
            return None              # the full path names the length
        for b in range(B):
            used = (L[b] + BS - 1) // BS
            tab = <int64_t*> (src + b * s0)
            for i in range(used):
                if tab[i] < 0 or tab[i] >= NB:
                    return None      # the full path names the entry
        if B >= 2 and shared_keys > 0:  # sequences sharing a long prefix read it once
            for b in range(1, B):
                if L[b] < shared_keys:
                    continue
                for c in range(b):
                    if (L[c] >= shared_keys and (<int64_t*> (src + b * s0))[0]
                            == (<int64_t*> (src + c * s0))[0]):
                        shared = SharedPrefix.__new__(SharedPrefix)
                        (<SharedPrefix> shared).table = tab_in if not copied else np.frombuffer(
                            (<char*> buf)[:B * W * sizeof(int64_t)], np.int64).reshape(B, W).copy()
                        (<SharedPrefix> shared).lengths = np.frombuffer(
                            (<char*> L)[:B * sizeof(int64_t)], np.int64).copy()
                        (<SharedPrefix> shared).threads = threads
                        return shared
        table = None if copied else tab_in
        if copied and k_scale is not None:  # (the scales' checks need the table's array)
            table = _empty((B, W), _INT64)
            memcpy(cnp.PyArray_DATA(table), buf, B * W * sizeof(int64_t))
        return _run_plan(plan, "paged", q, k, v, out, causal, threads, None, k_scale, v_scale,
                         query_offset, table, W * BS, buf if table is None else NULL, L)
    finally:
        free(buf)


# ---- PagedKVCache.truncate (attnfast._paged): what it changes, recorded as it goes ----

cdef class _PagedTruncated:
    """A sequence's block list and length before paged_truncate changed them (the blocks it
    released log themselves: PagedKVCache._release). Calling it puts them back; it may run
    again."""
    cdef object seq, length
    cdef list blocks, dropped
    cdef Py_ssize_t used

    def __call__(self):
        del self.blocks[self.used:]
        self.blocks.extend(self.dropped)
        self.seq.length = self.length


def paged_truncate(cache, seq_id, n):
    """PagedKVCache.truncate(seq_id, n) for a live sequence id and 0 <= n <= its length, both
    Python ints, in a transaction: the blocks past ceil(n / block_size) released
    (cache._release: back on the free list unless another sequence holds them), the length
    set, each change in the open transaction's log first. True when done; None, having
    changed nothing, for anything else (the caller checks and raises)."""
    cdef int64_t BS = cnp.PyArray_DIMS(<cnp.ndarray?> cache._k)[2]
    cdef int64_t NB = cnp.PyArray_DIMS(<cnp.ndarray?> cache._k)[0]
    cdef _PagedTruncated w
    log = _open_log()
    if type(seq_id) is not int or type(n) is not int or log is None:
        return None
    seq = (<dict?> cache._seqs).get(seq_id)
    if seq is None:
        return None
    length, blocks = seq.length, seq.blocks
    if type(length) is not int or type(blocks) is not list or not 0 <= n <= length:
        return None
    w = _PagedTruncated.__new__(_PagedTruncated)
    w.seq, w.blocks, w.length = seq, blocks, length
    w.used = (<int64_t> n + BS - 1) // BS
    w.dropped = (<list> blocks)[w.used:]
    for blk in w.dropped:
        if type(blk) is not int or not 0 <= blk < NB:
            return None
    (<list> log).append(w)
    for blk in w.dropped:
        cache._release(blk)
    del (<list> blocks)[w.used:]
    seq.length = n
    return True
