# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Thin typed bridge from Python to the C++ core (csrc/attnfast.hpp).

Arguments arrive already checked and shaped (attnfast._attention_checks, _cache_checks): q,
k, v, out are 4-D (B, H, T, D) arrays whose last axis is contiguous, lse is 3-D (B, H, Tq) or
None. This module only fills the params struct, releases the GIL and calls the kernels.
"""
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.string cimport memset
from libcpp cimport bool as cbool
from libcpp.vector cimport vector
from posix.signal cimport sigaction, sigaction_t, sigemptyset
cimport numpy as cnp

cnp.import_array()

cdef extern from "attnfast.hpp" namespace "attnfast":
    cdef enum class MaskKind(int):
        kNone
        kBool
        kAdditive

    cdef enum class DType(int):
        kF32
        kF64
        kF16
        kBF16
        kI8
        kF8E4M3
        kQ4

    cdef struct AttentionParams:
        const void* q
        const void* k
        const void* v
        void* out
        void* lse
        int64_t q_batch_stride, q_head_stride, q_row_stride
        int64_t k_batch_stride, k_head_stride, k_row_stride
        int64_t v_batch_stride, v_head_stride, v_row_stride
        int64_t out_batch_stride, out_head_stride, out_row_stride
        int64_t lse_batch_stride, lse_head_stride, lse_row_stride
        int64_t batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, head_dim_v
        const int64_t* seqlens_k
        DType dtype
        DType kv_dtype
        const float* k_scale
        const float* v_scale
        int64_t k_scale_batch_stride, k_scale_head_stride, k_scale_row_stride
        int64_t v_scale_batch_stride, v_scale_head_stride, v_scale_row_stride
        const int64_t* block_table
        int64_t block_table_batch_stride, block_size, num_blocks
        double scale
        cbool causal
        cbool has_query_offset
        int64_t query_offset
        int64_t window_left, window_right
        double softcap
        const float* alibi_slopes
        int64_t alibi_batch_stride
        const void* mask
        MaskKind mask_kind
        DType mask_dtype
        int64_t mask_batch_stride, mask_head_stride, mask_row_stride, mask_col_stride
        const float* sinks
        const int32_t* key_index
        int64_t key_index_batch_stride, key_index_head_stride, key_index_row_stride
        int64_t key_index_count
        int num_threads
        cbool interruptible

    AttentionParams default_params() noexcept nogil
    void request_interrupt() noexcept nogil
    cbool take_interrupt() noexcept nogil
    int processor_count() noexcept nogil
    void attention_forward(const AttentionParams&) except + nogil
    void attention_forward_batch(const AttentionParams* params, int64_t count) except + nogil
    cdef struct CallPlan:
        const char* tier
        cbool decode
        const char* kernel
        cbool paged
        cbool indexed
        int64_t chunk_keys
        int64_t chunks
        int64_t head_groups
        int64_t tasks
        int threads
        cbool latent_kv
        int64_t rows_per_kv_read
        const char* regime
        int64_t policy_rows
        int64_t policy_keys
        const char* policy_qk
        const char* policy_pv
    CallPlan plan_attention_core "attnfast::plan_attention"(const AttentionParams&) except + nogil
    cdef struct IndexParams:
        const void* q
        DType q_dtype
        int64_t q_batch_stride, q_head_stride, q_row_stride
        const float* weights
        int64_t w_batch_stride, w_row_stride
        const void* k
        DType k_dtype
        int64_t k_batch_stride, k_row_stride
        const float* k_scale
        int64_t k_scale_batch_stride, k_scale_row_stride
        const int64_t* block_table
        int64_t block_table_batch_stride, block_size, num_blocks
        const int64_t* seqlens_k
        int64_t batch, heads, seqlen_q, seqlen_k, head_dim
        cbool causal
        int64_t topk
        int32_t* out_index
        float* out_scores
        int num_threads
        cbool interruptible
    void index_topk_core "attnfast::index_topk"(const IndexParams&) except + nogil
    cbool openmp_enabled() noexcept nogil
    int openmp_max_threads() noexcept nogil
    const char* openmp_runtime_name() noexcept nogil
    const char* isa_selected() noexcept nogil
    const char* isa_available() noexcept nogil
    const char* isa_compiled() noexcept nogil
    cbool isa_force(const char* name) noexcept nogil
    const char* isa_error() noexcept nogil
    const char* isa_lowp_instructions() noexcept nogil
    cbool int8_dot_widen() noexcept nogil
    void int8_dot_widen_force(cbool widen) noexcept nogil
    uint64_t read_probe(const void* data, int64_t nbytes, int num_threads) noexcept nogil
    double peak_probe(int64_t rounds, bint bf16, int num_threads) noexcept nogil
    void hadamard_rows(float* x, int64_t rows, int64_t dim, int64_t block) noexcept nogil


cdef extern from "backward.hpp" namespace "attnfast":
    cdef struct BackwardParams:
        AttentionParams attn
        const void* dout
        int64_t dout_batch_stride, dout_head_stride, dout_row_stride
        const void* delta
        void* dq
        int64_t dq_row_stride
        void* dk
        void* dv

    void attention_backward(const BackwardParams&) except + nogil
    int64_t backward_padded(int64_t n) noexcept nogil
    bint backward_fused(int64_t groups, int64_t threads) noexcept nogil


cdef extern from "<signal.h>":
    enum: SIGINT

cdef extern from "Python.h":
    void PyErr_SetInterrupt()
    int PyErr_CheckSignals() except -1
    long long PyLong_AsLongLongAndOverflow(object, int*) except? -1


cdef void _on_sigint(int signum) noexcept nogil:
    request_interrupt()


cdef void _run_interruptible(AttentionParams* p, int64_t count=-1) except *:
    """attention_forward(p[0]) (count < 0), or attention_forward_batch(p, count), with Ctrl-C
    turned into a stop request for the kernels.

    While the kernels run (GIL released) SIGINT only sets the core's interrupt flag; the
    previous handler is then restored and, if SIGINT came, handed the signal (Python's
    default handler raises KeyboardInterrupt). Only for the main thread, which alone
    receives Python's signals.
    """
    cdef sigaction_t ours, previous
    cdef int64_t i
    memset(&ours, 0, sizeof(ours))
    ours.sa_handler = _on_sigint
    sigemptyset(&ours.sa_mask)
    take_interrupt()  # drop a request left over from an earlier call
    cdef bint installed = sigaction(SIGINT, &ours, &previous) == 0
    for i in range(count if count > 0 else 1):  # cannot install: run uninterruptible
        p[i].interruptible = installed
    try:
        with nogil:
            if count < 0:
                attention_forward(p[0])
            else:
                attention_forward_batch(p, count)
    finally:
        if installed:
            sigaction(SIGINT, &previous, NULL)
    if installed and take_interrupt():
        PyErr_SetInterrupt()
        PyErr_CheckSignals()
        # The kernels stopped early: never return their partial output as a result.
        raise KeyboardInterrupt("attnfast: interrupted")


cdef inline int64_t _stride(cnp.ndarray a, int axis) except? -1:
    """Stride of `axis` in elements. The checks hand over whole-element strides only
    (attnfast._arrays.whole_elements); anything else is refused here rather than truncated."""
    cdef int64_t byte_stride = cnp.PyArray_STRIDES(a)[axis]
    cdef int64_t item = cnp.PyArray_ITEMSIZE(a)
    if byte_stride % item:
        raise TypeError(f"attnfast._ext: a stride of {byte_stride} bytes is not a whole number "
                        f"of {item}-byte elements")
    return byte_stride // item


import numpy as np

from attnfast._formats import BFLOAT16 as _BFLOAT16, FORMATS, c_codes_by_type_num

# C DType codes of the storage formats (attnfast._formats) by NumPy type number: NumPy's own
# types in a table, ml_dtypes' (numbers of 256 and up, given at import) in a dict.
cdef enum:
    _BUILTIN_TYPES = 64
cdef int _BUILTIN_CODES[_BUILTIN_TYPES]
for _num in range(_BUILTIN_TYPES):
    _BUILTIN_CODES[_num] = -1
cdef dict _OTHER_CODES = {}
for _num, _code in c_codes_by_type_num().items():
    if 0 <= _num < _BUILTIN_TYPES:
        _BUILTIN_CODES[_num] = _code
    else:
        _OTHER_CODES[_num] = _code
# packed formats (int4) by type number: their rows' length is not the head dim
cdef dict _PACKED_FORMATS = {f.storage.num: f for f in FORMATS.values() if f.packed}


cdef DType _dtype_code(cnp.ndarray a) except *:
    cdef int num = cnp.PyArray_TYPE(a)
    cdef int code = -1
    if 0 <= num < _BUILTIN_TYPES:
        code = _BUILTIN_CODES[num]
    else:
        code = _OTHER_CODES.get(num, -1)
    if code < 0:
        raise TypeError(f"attnfast._ext: unsupported dtype {a.dtype}")
    return <DType>code


cdef int _fill_params(AttentionParams* p, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, out, lse,
                      bint causal, double scale, int64_t window_left, int64_t window_right,
                      int num_threads, seqlens_k, k_scale, v_scale, query_offset,
                      double softcap, alibi, sinks, mask, block_table,
                      int64_t head_dim_v=-1, key_index=None) except -1:
    """Fills `p` from run_attention's arguments (out may be None: plan_attention)."""
    cdef cnp.ndarray out_arr, lse_arr, index_arr
    cdef cnp.ndarray seqlens_arr
    cdef cnp.ndarray ks_arr, vs_arr
    cdef cnp.ndarray alibi_arr, sinks_arr, mask_arr, table_arr
    cdef int64_t scale_blocks
    p.q = cnp.PyArray_DATA(q)
    p.k = cnp.PyArray_DATA(k)
    p.v = cnp.PyArray_DATA(v)
    p.q_batch_stride, p.q_head_stride, p.q_row_stride = _stride(q, 0), _stride(q, 1), _stride(q, 2)
    p.k_batch_stride, p.k_head_stride, p.k_row_stride = _stride(k, 0), _stride(k, 1), _stride(k, 2)
    p.v_batch_stride, p.v_head_stride, p.v_row_stride = _stride(v, 0), _stride(v, 1), _stride(v, 2)
    if out is not None:
        out_arr = out
        p.out = cnp.PyArray_DATA(out_arr)
        p.out_batch_stride, p.out_head_stride, p.out_row_stride = (
            _stride(out_arr, 0), _stride(out_arr, 1), _stride(out_arr, 2))
    if lse is not None:
        lse_arr = lse
        p.lse = cnp.PyArray_DATA(lse_arr)
        p.lse_batch_stride, p.lse_head_stride, p.lse_row_stride = (
            _stride(lse_arr, 0), _stride(lse_arr, 1), _stride(lse_arr, 2))
    p.batch, p.heads, p.seqlen_q, p.head_dim = q.shape[0], q.shape[1], q.shape[2], q.shape[3]
    p.kv_heads, p.seqlen_k, p.head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    fmt = _PACKED_FORMATS.get(cnp.PyArray_TYPE(k)) if _PACKED_FORMATS else None
    if fmt is not None:  # int4: rows of 20-byte blocks of 32 values
        if (head_dim_v < 1 or k.shape[3] != fmt.stored_dim(p.head_dim)
                or v.shape[3] != fmt.stored_dim(head_dim_v)):
            raise TypeError(f"attnfast._ext: a {fmt.name} ({k.dtype}) k / v needs head_dim_v, "
                            "and rows of its packed blocks for head_dim and head_dim_v")
        p.head_dim_v = head_dim_v
    scale_blocks = p.batch
    if block_table is not None:
        table_arr = block_table
        if (cnp.PyArray_TYPE(table_arr) != cnp.NPY_INT64 or table_arr.ndim != 2
                or table_arr.shape[0] != p.batch
                or (table_arr.shape[1] > 1 and _stride(table_arr, 1) != 1)
                or v.shape[0] != k.shape[0] or v.shape[2] != k.shape[2]):
            raise TypeError("attnfast._ext: block_table must be int64 (B, max_blocks), last "
                            "axis contiguous, over k, v pools of one block size")
        p.block_table = <const int64_t*> cnp.PyArray_DATA(table_arr)
        p.block_table_batch_stride = _stride(table_arr, 0)
        p.block_size = k.shape[2]
        p.num_blocks = k.shape[0]
        p.seqlen_k = table_arr.shape[1] * p.block_size
        scale_blocks = p.num_blocks
    p.dtype = _dtype_code(q)
    p.kv_dtype = _dtype_code(k)
    if _dtype_code(v) != p.kv_dtype:
        raise TypeError("attnfast._ext: k and v dtypes differ")
    if k_scale is not None or v_scale is not None:
        ks_arr, vs_arr = k_scale, v_scale
        for arr in (ks_arr, vs_arr):
            if (cnp.PyArray_TYPE(arr) != cnp.NPY_FLOAT32 or arr.ndim != 3
                    or arr.shape[0] != scale_blocks or arr.shape[1] != p.kv_heads
                    or arr.shape[2] != k.shape[2]):
                raise TypeError("attnfast._ext: scales must be float32 (B, Hkv, Tk), or "
                                "(num_blocks, Hkv, block_size) when paged")
        p.k_scale = <const float*> cnp.PyArray_DATA(ks_arr)
        p.v_scale = <const float*> cnp.PyArray_DATA(vs_arr)
        p.k_scale_batch_stride, p.k_scale_head_stride, p.k_scale_row_stride = (
            _stride(ks_arr, 0), _stride(ks_arr, 1), _stride(ks_arr, 2))
        p.v_scale_batch_stride, p.v_scale_head_stride, p.v_scale_row_stride = (
            _stride(vs_arr, 0), _stride(vs_arr, 1), _stride(vs_arr, 2))
    p.scale = scale
    p.causal = causal
    p.softcap = softcap
    if alibi is not None:
        alibi_arr = alibi
        if (cnp.PyArray_TYPE(alibi_arr) != cnp.NPY_FLOAT32 or alibi_arr.ndim != 2
                or alibi_arr.shape[0] != p.batch or alibi_arr.shape[1] != p.heads
                or (p.heads > 1 and _stride(alibi_arr, 1) != 1)):
            raise TypeError("attnfast._ext: alibi must be float32 (B, H), heads contiguous")
        p.alibi_slopes = <const float*> cnp.PyArray_DATA(alibi_arr)
        p.alibi_batch_stride = _stride(alibi_arr, 0)
    if sinks is not None:
        sinks_arr = sinks
        if (cnp.PyArray_TYPE(sinks_arr) != cnp.NPY_FLOAT32 or sinks_arr.ndim != 1
                or sinks_arr.shape[0] != p.heads or not sinks_arr.flags.c_contiguous):
            raise TypeError("attnfast._ext: sinks must be contiguous float32 (H,)")
        p.sinks = <const float*> cnp.PyArray_DATA(sinks_arr)
    if mask is not None:
        mask_arr = mask
        if (mask_arr.ndim != 4 or mask_arr.shape[0] != p.batch or mask_arr.shape[1] != p.heads
                or mask_arr.shape[2] != p.seqlen_q or mask_arr.shape[3] != p.seqlen_k):
            raise TypeError("attnfast._ext: mask must be 4-D (B, H, Tq, Tk)")
        if cnp.PyArray_TYPE(mask_arr) == cnp.NPY_BOOL:
            p.mask_kind = MaskKind.kBool
        elif cnp.PyArray_TYPE(mask_arr) == cnp.NPY_FLOAT32:
            p.mask_kind, p.mask_dtype = MaskKind.kAdditive, DType.kF32
        elif cnp.PyArray_TYPE(mask_arr) == cnp.NPY_FLOAT64:
            p.mask_kind, p.mask_dtype = MaskKind.kAdditive, DType.kF64
        else:
            raise TypeError("attnfast._ext: mask must be bool, float32 or float64")
        p.mask = cnp.PyArray_DATA(mask_arr)
        p.mask_batch_stride, p.mask_head_stride = _stride(mask_arr, 0), _stride(mask_arr, 1)
        p.mask_row_stride, p.mask_col_stride = _stride(mask_arr, 2), _stride(mask_arr, 3)
    if key_index is not None:
        index_arr = key_index
        if (cnp.PyArray_TYPE(index_arr) != cnp.NPY_INT32 or index_arr.ndim != 4
                or index_arr.shape[0] != p.batch
                or (index_arr.shape[1] != 1 and index_arr.shape[1] != p.kv_heads)
                or index_arr.shape[2] != p.seqlen_q
                or (index_arr.shape[3] > 1 and _stride(index_arr, 3) != 1)):
            raise TypeError("attnfast._ext: key_index must be int32 (B, 1 or Hkv, Tq, k), last "
                            "axis contiguous")
        p.key_index = <const int32_t*> cnp.PyArray_DATA(index_arr)
        p.key_index_batch_stride = _stride(index_arr, 0)
        p.key_index_head_stride = _stride(index_arr, 1) if index_arr.shape[1] > 1 else 0
        p.key_index_row_stride = _stride(index_arr, 2)
        p.key_index_count = index_arr.shape[3]
    if query_offset is not None:
        p.has_query_offset = True
        p.query_offset = query_offset
    p.window_left = window_left
    p.window_right = window_right
    p.num_threads = num_threads
    if seqlens_k is not None:
        seqlens_arr = seqlens_k
        if (cnp.PyArray_TYPE(seqlens_arr) != cnp.NPY_INT64 or seqlens_arr.ndim != 1
                or seqlens_arr.shape[0] != p.batch or not seqlens_arr.flags.c_contiguous):
            raise TypeError("attnfast._ext: seqlens_k must be a contiguous int64 array (B,)")
        p.seqlens_k = <const int64_t*> cnp.PyArray_DATA(seqlens_arr)
    return 0


def run_attention(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out,
                      lse, *, bint causal, double scale, int64_t window_left,
                      int64_t window_right, int num_threads, seqlens_k=None,
                      bint interruptible=False, k_scale=None, v_scale=None,
                      query_offset=None, double softcap=0.0, alibi=None, sinks=None,
                      mask=None, block_table=None, backward=None, int64_t head_dim_v=-1,
                      key_index=None):
    """Run the streaming attention kernel; q, k, v, out are 4-D, lse 3-D or None.

    An int4 cache is a uint8 k / v of packed rows (attnfast._int4): head_dim_v then gives
    the values' width (the rows' last axis holds ceil(head_dim_v / 32) blocks of 20 bytes).

    softcap (0 = off), alibi (float32 (B, H), heads contiguous), sinks (float32 (H,),
    contiguous), mask (4-D (B, H, Tq, Tk) bool / float32 / float64 view, any strides):
    the score options, checked into attnfast._descriptors.ScoreOptions.
    k_scale, v_scale: with an int8 or float8_e4m3fn k/v, float32 (B, Hkv, Tk) row scales (strides in whole
    elements; checked by attnfast._attention_checks).
    interruptible: call from the main thread only, under Python's default SIGINT handler;
    Ctrl-C then stops the kernels early (out and lse unspecified) and raises
    KeyboardInterrupt.

    seqlens_k: None, or a C-contiguous int64 array (B,) of keys valid per batch entry, each
    in [0, k.shape[2]] (checked by attnfast._cache_checks; the core re-checks as a guard).

    block_table: None, or an int64 (B, max_blocks) array with a contiguous last axis: a paged
    cache. k, v are then pools (num_blocks, Hkv, block_size, D|Dv), k_scale / v_scale
    (num_blocks, Hkv, block_size), and the keys span max_blocks * block_size positions
    (seqlens_k[b] of them valid; checked by attnfast._cache_checks, the core re-checks the ids).

    key_index: None, or an int32 (B, 1 or Hkv, Tq, k) view, last axis contiguous: the keys
    each query row sees (-1: none; checked by attnfast._key_index, the core re-checks ranges).

    backward: None, or (dout, delta, dq, dk, dv): run the backward instead (_run_backward).
    """
    cdef AttentionParams p = default_params()
    _fill_params(&p, q, k, v, out, lse, causal, scale, window_left, window_right, num_threads,
                 seqlens_k, k_scale, v_scale, query_offset, softcap, alibi, sinks, mask,
                 block_table, head_dim_v, key_index)
    if backward is not None:
        _run_backward(&p, backward[0], backward[1], backward[2], backward[3], backward[4])
    elif interruptible:
        _run_interruptible(&p)
    else:
        with nogil:
            attention_forward(p)


def run_attention_batch(list calls, *, bint interruptible=False):
    """Run several problems in one kernel call (attnfast.attention_varlen's ragged batch over
    a paged pool: one problem per sequence), on one schedule over all their tasks.

    calls: a list of (q, k, v, out, lse, keywords), each as one run_attention call (keywords:
    run_attention's, less interruptible and backward; every problem takes the first one's
    num_threads). Each problem's out / lse are bit-identical to its own run_attention call.
    The arrays must stay alive for the call (the list holds them). interruptible: as for
    run_attention (main thread only, under Python's default SIGINT handler).
    """
    cdef vector[AttentionParams] params
    cdef Py_ssize_t i
    params.resize(len(calls))
    for i in range(len(calls)):
        q, k, v, out, lse, kw = calls[i]
        params[i] = default_params()
        _fill_params(&params[i], q, k, v, out, lse, kw["causal"], kw["scale"], kw["window_left"],
                     kw["window_right"], kw["num_threads"], kw.get("seqlens_k"), kw.get("k_scale"),
                     kw.get("v_scale"), kw.get("query_offset"), kw.get("softcap", 0.0),
                     kw.get("alibi"), kw.get("sinks"), kw.get("mask"), kw.get("block_table"),
                     kw.get("head_dim_v", -1), kw.get("key_index"))
    if params.size() == 0:
        return
    if interruptible:
        _run_interruptible(params.data(), <int64_t> params.size())
    else:
        with nogil:
            attention_forward_batch(params.data(), <int64_t> params.size())


def run_index_topk(cnp.ndarray q, cnp.ndarray weights, cnp.ndarray k, k_scale, block_table,
                   seqlens_k, bint causal, int64_t topk, cnp.ndarray out_index, out_scores,
                   int num_threads):
    """The lightning indexer (attnfast.index_topk), arguments checked by attnfast._indexer:
    q float32 or bfloat16 (B, H, Tq, D), weights float32 (B, Tq, H) heads contiguous, k (B, L, D) or a
    pool (num_blocks, block_size, D) float32 / bfloat16 / float8_e4m3fn, last axes
    contiguous; k_scale float32 (B, L) / (num_blocks, block_size) or None; block_table int64
    (B, max_blocks) or None; seqlens_k contiguous int64 (B,) or None; out_index contiguous
    int32 (B, Tq, topk); out_scores the same in float32, or None."""
    cdef IndexParams p
    cdef cnp.ndarray ks_arr, table_arr, lens_arr, scores_arr
    memset(&p, 0, sizeof(p))
    p.q = cnp.PyArray_DATA(q)
    p.q_dtype = _dtype_code(q)
    p.q_batch_stride, p.q_head_stride, p.q_row_stride = _stride(q, 0), _stride(q, 1), _stride(q, 2)
    p.weights = <const float*> cnp.PyArray_DATA(weights)
    p.w_batch_stride, p.w_row_stride = _stride(weights, 0), _stride(weights, 1)
    p.k = cnp.PyArray_DATA(k)
    p.k_dtype = _dtype_code(k)
    p.k_batch_stride, p.k_row_stride = _stride(k, 0), _stride(k, 1)
    p.batch, p.heads, p.seqlen_q, p.head_dim = q.shape[0], q.shape[1], q.shape[2], q.shape[3]
    p.seqlen_k = k.shape[1]
    if k_scale is not None:
        ks_arr = k_scale
        p.k_scale = <const float*> cnp.PyArray_DATA(ks_arr)
        p.k_scale_batch_stride, p.k_scale_row_stride = _stride(ks_arr, 0), _stride(ks_arr, 1)
    if block_table is not None:
        table_arr = block_table
        p.block_table = <const int64_t*> cnp.PyArray_DATA(table_arr)
        p.block_table_batch_stride = _stride(table_arr, 0)
        p.block_size = k.shape[1]
        p.num_blocks = k.shape[0]
        p.seqlen_k = table_arr.shape[1] * p.block_size
    if seqlens_k is not None:
        lens_arr = seqlens_k
        p.seqlens_k = <const int64_t*> cnp.PyArray_DATA(lens_arr)
    p.causal = causal
    p.topk = topk
    p.out_index = <int32_t*> cnp.PyArray_DATA(out_index)
    if out_scores is not None:
        scores_arr = out_scores
        p.out_scores = <float*> cnp.PyArray_DATA(scores_arr)
    p.num_threads = num_threads
    p.interruptible = False
    with nogil:
        index_topk_core(p)


def plan_attention(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, *, bint causal, double scale,
                   int64_t window_left, int64_t window_right, int num_threads, seqlens_k=None,
                   k_scale=None, v_scale=None, query_offset=None, double softcap=0.0,
                   alibi=None, sinks=None, mask=None, block_table=None, int64_t head_dim_v=-1,
                   key_index=None):
    """What run_attention would run for these arguments (its own, less out, lse and
    interruptible), as a dict (attnfast.explain), from the core's plan_attention."""
    cdef AttentionParams p = default_params()
    cdef CallPlan plan
    _fill_params(&p, q, k, v, None, None, causal, scale, window_left, window_right, num_threads,
                 seqlens_k, k_scale, v_scale, query_offset, softcap, alibi, sinks, mask,
                 block_table, head_dim_v, key_index)
    plan = plan_attention_core(p)
    split = None
    if plan.decode:
        split = {"chunk_keys": plan.chunk_keys, "chunks": plan.chunks,
                 "head_groups": plan.head_groups, "tasks": plan.tasks}
    return {
        "tier": plan.tier.decode(),
        "path": "decode" if plan.decode else "prefill",
        "kernel": plan.kernel.decode(),
        "kv_source": ("paged" if plan.paged else "contiguous") + (", indexed" if plan.indexed else ""),
        "split": split,
        "tasks": plan.tasks,
        "threads": plan.threads,
        "regime": plan.regime.decode() if plan.regime != NULL else "compute",
        "latent_kv": bool(plan.latent_kv),
        "rows_per_kv_read": plan.rows_per_kv_read if plan.decode else None,
        "policy": {"rows": plan.policy_rows, "keys": plan.policy_keys,
                   "qk": plan.policy_qk.decode(), "pv": plan.policy_pv.decode()},
    }


cdef _run_backward(AttentionParams* p, cnp.ndarray dout, cnp.ndarray delta, cnp.ndarray dq,
                   cnp.ndarray dk, cnp.ndarray dv):
    """attention_backward over the forward problem p (whose lse is set): dout 4-D like out,
    last axis contiguous, of q's dtype; delta (B, H, Tq), dq, dk, dv contiguous, of the
    accumulator type (float64 for float64 inputs, else float32), written in place; dq's
    last axis padded to backward_head_dim(D) (its extra columns are scratch)."""
    cdef BackwardParams bp
    if p.lse == NULL:
        raise TypeError("attnfast._ext: the backward needs the forward's lse")
    for arr in (delta, dq, dk, dv):
        if not arr.flags.c_contiguous:
            raise TypeError("attnfast._ext: delta, dq, dk, dv must be C-contiguous")
    bp.attn = p[0]
    bp.dout = cnp.PyArray_DATA(dout)
    bp.dout_batch_stride, bp.dout_head_stride, bp.dout_row_stride = (
        _stride(dout, 0), _stride(dout, 1), _stride(dout, 2))
    bp.delta = cnp.PyArray_DATA(delta)
    bp.dq = cnp.PyArray_DATA(dq)
    bp.dq_row_stride = dq.shape[dq.ndim - 1]
    bp.dk = cnp.PyArray_DATA(dk)
    bp.dv = cnp.PyArray_DATA(dv)
    with nogil:
        attention_backward(bp)


def backward_head_dim(int64_t head_dim):
    """The row length of the backward's dq buffer: head_dim padded to whole vectors."""
    return backward_padded(head_dim)


def backward_schedule(int64_t groups, int64_t threads):
    """Which schedule attention_backward runs for batch * kv_heads = groups on `threads`
    threads: "fused" (dk, dv, dq in one task per group) or "two-pass" (same bits)."""
    return "fused" if backward_fused(groups, threads) else "two-pass"


def runtime_info():
    """Facts about the compiled core: OpenMP and kernel tiers."""
    return {
        "openmp": bool(openmp_enabled()),
        "openmp_runtime": openmp_runtime_name().decode(),
        "openmp_max_threads": openmp_max_threads(),
        "isa": isa_selected().decode(),
        "isa_available": [s for s in isa_available().decode().split(",") if s],
        "isa_compiled": [s for s in isa_compiled().decode().split(",") if s],
        "isa_error": isa_error().decode(),
        "lowp_instructions": isa_lowp_instructions().decode(),
        "int8_dot": "widen" if int8_dot_widen() else "auto",
    }


def force_int8_dot(str mode):
    """How an int8 cache's Q.K runs on tiers with vpdpbusd, for the calls that start after
    this: "widen" (exact widening to float32) or "auto" (q quantised to int8 per row).
    ATTNFAST_INT8_DOT=widen sets "widen" at first use; this overrides it."""
    if mode not in ("widen", "auto"):
        raise ValueError(f"int8 dot mode must be 'widen' or 'auto', got {mode!r}")
    int8_dot_widen_force(mode == "widen")


def force_isa(str name):
    """Switch kernel tier by name ('' = best available); raises ValueError if impossible."""
    if not isa_force(name.encode()):
        raise ValueError(isa_error().decode())


def processors():
    """Processors this process may run on (1 without OpenMP): the most threads a call starts."""
    return processor_count()


def read_bytes(const unsigned char[::1] buffer, int num_threads):
    """Reads every byte of a contiguous buffer once on up to num_threads threads, GIL
    released (the benchmarks' native memory-read kernel); returns an XOR of its words."""
    cdef uint64_t folded
    with nogil:
        folded = read_probe(&buffer[0] if buffer.shape[0] else NULL, buffer.shape[0], num_threads)
    return folded


def hadamard_rotate_rows(float[:, ::1] x, int64_t block):
    """x (rows x D, float32, C-contiguous) times the orthonormal block Hadamard matrix of
    blocks `block` (a power of two dividing D) along each row, in place, GIL released
    (attnfast._rotation.hadamard_rotate)."""
    if block < 1 or x.shape[1] % block or block & (block - 1):
        raise ValueError(f"block must be a power of two dividing {x.shape[1]}, got {block}")
    with nogil:
        hadamard_rows(&x[0, 0] if x.shape[0] and x.shape[1] else NULL, x.shape[0], x.shape[1], block)


def peak_flops(int64_t rounds, bint bf16, int num_threads):
    """Runs `rounds` rounds of the best tier's widest multiply-adds on num_threads threads at
    once, GIL released (the benchmarks' compute limit: bf16 takes vdpbf16ps where the CPU has
    AVX512_BF16, else float32 FMAs); returns the FLOPs done."""
    cdef double flops
    with nogil:
        flops = peak_probe(rounds, bf16, num_threads)
    return flops


include "_torch_views.pxi"
include "_transactions.pxi"
include "_fast_calls.pxi"
