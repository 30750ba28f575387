// The parts of the attention algorithm every kernel shares, written once and compiled by
// every ISA file with its own flags: the accumulator-type math (exp2, log, tanh, the
// NaN-propagating max), the KV sources (KeyRows, RowScales: contiguous rows, or a paged
// cache's blocks read in place through the block table, and an int8 / float8 cache's row
// scales), the score transforms (RowOptions: softcap, ALiBi, mask; nonfinite_to_nan, the NaN
// rule for infinite inputs) and the online-softmax step (softmax_block). Visibility (causal,
// window) is kernel_table.hpp's visible_keys.
//
// Units: every float32 kernel scores in base 2. A scaled score s = scale q . k is carried as
// x = s log2(e) (the staged query rows carry scale log2(e)), so that each softmax weight is
// one exp2(x - m) with no multiply; the score options convert their constants once
// (RowOptions), and only the lse leaves in natural units: lse = ln(2) (m + log2 l). float64
// keeps base e (SoftmaxBase). Included by kernels/isa_*.cpp and the .inl files
// that use it, after ATTNFAST_KERNEL_NS is defined (a namespace unique to that file, so the
// per-ISA copies never merge at link time).
//
// No std:: templates here: an inline std function instantiated in an AVX-512 file could be
// picked by the linker for the baseline build too.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernel_table.hpp"

#ifndef ATTNFAST_KERNEL_NS
#error "define ATTNFAST_KERNEL_NS before including attention_core.inl"
#endif

#include "../simd/storage.hpp"

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {

template <class A> inline A neg_inf() { return -static_cast<A>(__builtin_inf()); }
// max that propagates NaN from either side (a NaN score must reach the row's out and lse,
// never be dropped by a comparison).
template <class A> inline A max_of(A a, A b) { return (a > b || a != a) ? a : b; }

constexpr double kLog2e = 1.4426950408889634074;  // log2(e): natural-log units -> base 2
constexpr double kLn2 = 0.6931471805599453094;    // ln(2): base 2 -> natural-log units
// 2^x for float: simd::exp2_neg's steps on one lane (n = round(x), r = x - n exact, the same
// degree-6 polynomial for 2^r, times 2^n). The softmax only takes x <= 0 (a score minus the
// running max); below -126 (and -inf) exactly 0, never denormal; NaN stays NaN.
inline float exp2_acc(float x) {
    if (!(x >= -126.0f)) return x == x ? 0.0f : x;
    const float xc = x > 127.0f ? 127.0f : x;
    const float round_magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    const float n = (xc + round_magic) - round_magic;
    const float r = xc - n;
    float poly = 1.534581243e-04f;
    poly = poly * r + 1.339993090e-03f;
    poly = poly * r + 9.618489072e-03f;
    poly = poly * r + 5.550328642e-02f;
    poly = poly * r + 2.402264625e-01f;
    poly = poly * r + 6.931471825e-01f;
    poly = poly * r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    return poly * two_n;
}
inline double exp2_acc(double x) { return __builtin_exp2(x); }

// The online softmax's exponent base for an accumulator type. float32 (every hand-written
// kernel and the float32 templates): base 2, the scores carrying log2 e in their scale, each
// weight one exp2. float64, the reference precision: base e, as the float64 results were
// before (a power-of-two scale leaves its scores exact; log2 e would round every one, and
// the lse's round trip through base 2 cost the float64 backward up to 7x its naive error).
template <class A> struct SoftmaxBase;
template <> struct SoftmaxBase<float> {
    static constexpr double kUnit = kLog2e;  // a natural-log score times this is the kernels'
    static float exp(float x) { return exp2_acc(x); }
    static float to_natural(float m) { return m * static_cast<float>(kLn2); }
};
template <> struct SoftmaxBase<double> {
    static constexpr double kUnit = 1.0;
    static double exp(double x) { return __builtin_exp(x); }
    static double to_natural(double m) { return m; }
};

// ---- (q, K/V) storage-type dispatch, through storage.hpp's one switch (with_storage_type)
template <class T> struct As { using type = T; };

// fn(As<TQ>{}) with the q (and out) storage type of a float32-accumulated call: float32,
// bfloat16 or float16.
template <class Fn>
inline void with_q_type(DType q, Fn&& fn) {
    with_storage_type(q, [&](auto tq) {
        using T = typename decltype(tq)::type;
        if constexpr (decltype(tq)::kFormat.cache_only || std::is_same<T, double>::value)
            unreachable_dtype("q", q);
        else
            fn(As<T>{});
    });
}

// fn(As<TQ>{}, As<TKV>{}) for the call's q and K/V storage types: every float32-accumulated
// combination (float32; 16-bit q with its own K/V type; float32 q over a 16-bit cache;
// float32 or 16-bit q over a cache-only format). kDecode: the decode loop's entry, which
// reads every format; else a prefill kernel's, which reads no decode-only format.
template <bool kDecode, class Fn>
inline void with_q_kv_types(const AttentionParams& p, Fn&& fn) {
    const DType q = p.dtype;
    with_storage_type(p.kv_dtype, [&](auto tkv) {
        using T = typename decltype(tkv)::type;
        constexpr StorageFormat format = decltype(tkv)::kFormat;
        if constexpr (std::is_same<T, double>::value || (!kDecode && format.decode_only)) {
            unreachable_dtype("K/V (float64 kernels, or decode only)", p.kv_dtype);
        } else if constexpr (format.cache_only) {  // any float32-accumulated q
            with_q_type(q, [&](auto tq) { fn(tq, As<T>{}); });
        } else if constexpr (std::is_same<T, float>::value) {
            if (q != DType::kF32) unreachable_dtype("q (over a float32 cache)", q);
            fn(As<float>{}, As<float>{});
        } else {  // a 16-bit cache: q of its type or float32
            if (q == p.kv_dtype) fn(As<T>{}, As<T>{});
            else if (q == DType::kF32) fn(As<float>{}, As<T>{});
            else unreachable_dtype("q (over a 16-bit cache of another type)", q);
        }
    });
}

inline float log_acc(float x) { return __builtin_logf(x); }
inline double log_acc(double x) { return __builtin_log(x); }
inline float tanh_acc(float x) { return __builtin_tanhf(x); }
inline double tanh_acc(double x) { return __builtin_tanh(x); }


// Row scales of an int8 K (or V) cache for one (batch, kv head); none for other types.
inline RowScales row_scales(const float* scale, int64_t batch_stride, int64_t head_stride,
                            int64_t row_stride, int64_t batch, int64_t kv_head) {
    RowScales r;
    if (scale) {
        r.scale = scale + batch * batch_stride + kv_head * head_stride;
        r.row_stride = row_stride;
    }
    return r;
}

// The same through a paged cache's block table (row j of the batch entry in block
// table[j / block_size]); row_scales() when the cache is contiguous.
inline RowScales row_scales(const AttentionParams& p, const float* scale, int64_t batch_stride,
                            int64_t head_stride, int64_t row_stride, int64_t batch,
                            int64_t kv_head) {
    if (!p.block_table) return row_scales(scale, batch_stride, head_stride, row_stride, batch, kv_head);
    RowScales r;
    if (scale) {
        r.scale = scale + kv_head * head_stride;
        r.row_stride = row_stride;
        r.table = p.block_table + batch * p.block_table_batch_stride;
        r.block_stride = batch_stride;
        r.block_size = p.block_size;
    }
    return r;
}

// Where the key (or value) rows of one (batch, kv head) live: one strided run, or, in a
// paged cache (AttentionParams::block_table), one run per block, found through the table.
// Kernels ask for a row's address once per run (run_end) and step by row_stride inside it,
// so the table is read once per block, not once per key.
template <class T>
struct KeyRows {
    const T* base;               // contiguous: row 0; paged: the pool at this kv head
    int64_t row_stride;          // elements between rows of one run
    const int64_t* table;        // paged: the batch entry's block ids; nullptr: contiguous
    int64_t block_stride;        // paged: elements between blocks of the pool
    int64_t block_size;          // paged: rows per block

    const T* at(int64_t j) const {
        if (!table) return base + j * row_stride;
        return base + table[j / block_size] * block_stride + j % block_size * row_stride;
    }
    // End of the run of rows that starts at j (rows j, j + 1, .. at row_stride steps), at
    // most `end`: the end of j's block when paged.
    int64_t run_end(int64_t j, int64_t end) const {
        if (!table) return end;
        const int64_t block_end = (j / block_size + 1) * block_size;
        return block_end < end ? block_end : end;
    }
    int64_t position(int64_t j) const { return j; }  // (the key's position: its row scales)
};

// A run of K or V rows as the decode Paths read them, row j at at(j): a strided run (of a
// contiguous cache, or one block of a paged one), or rows listed by position over a
// contiguous cache (key_index: anywhere). from(j): the run from its row j on; cols(c): the
// same rows from column c on.
template <class T>
struct StridedRun {
    const T* first;
    int64_t stride;
    const T* at(int64_t j) const { return first + j * stride; }
    StridedRun from(int64_t j) const { return {at(j), stride}; }
    StridedRun cols(int64_t c) const { return {first + c, stride}; }
};
template <class T>
struct ListedRun {
    const T* base;        // position 0
    int64_t stride;
    const int32_t* pos;   // row j is position pos[j]
    const T* at(int64_t j) const { return base + static_cast<int64_t>(pos[j]) * stride; }
    ListedRun from(int64_t j) const { return {base, stride, pos + j}; }
    ListedRun cols(int64_t c) const { return {base + c, stride, pos}; }
};

// decode_loop's source for an indexed task over a contiguous cache (DecodeTask::rows): key j
// is position rows[j]; the whole list is one run, so the Paths score and add listed rows in
// their usual blocks, in place (no gathered copy).
template <class T>
struct ListedRows {
    ListedRun<T> rows;
    const T* at(int64_t j) const { return rows.at(j); }
    int64_t run_end(int64_t, int64_t end) const { return end; }
    ListedRun<T> run(int64_t j) const { return rows.from(j); }
    int64_t position(int64_t j) const { return rows.pos[j]; }
};

// A task's source of type Src: its KeyRows, or its ListedRows.
template <class Src, class T>
inline const Src& source_of(const KeyRows<T>& rows, const ListedRows<T>& listed) {
    if constexpr (__is_same(Src, KeyRows<T>)) return rows;
    else return listed;
}

// The K (or V) rows of (batch, kv head): data with the tensor's batch (paged: block), head
// and row strides.
template <class T>
inline KeyRows<T> key_rows(const AttentionParams& p, const void* data, int64_t batch_stride,
                           int64_t head_stride, int64_t row_stride, int64_t batch,
                           int64_t kv_head) {
    const T* at_head = static_cast<const T*>(data) + kv_head * head_stride;
    if (!p.block_table) return KeyRows<T>{at_head + batch * batch_stride, row_stride, nullptr, 0, 1};
    return KeyRows<T>{at_head, row_stride, p.block_table + batch * p.block_table_batch_stride,
                      batch_stride, p.block_size};
}

// A task's rows one by one, for kernels that read them so (DecodeKernel::reads_index): key j
// is position j, or position index[j] of an indexed task (DecodeTask::rows) -- contiguous,
// paged and indexed sources alike, with no copy.
template <class T>
struct TaskRows {
    KeyRows<T> rows;
    const int32_t* index;  // DecodeTask::rows, or nullptr
    const T* at(int64_t j) const { return rows.at(index ? index[j] : j); }
    // End of the run of rows at row_stride steps that starts at key j, at most `end`: one
    // key of an indexed task.
    int64_t run_end(int64_t j, int64_t end) const { return index ? j + 1 : rows.run_end(j, end); }
};

// A raw score q . k of -inf comes only from an infinite (or overflowing) input: it becomes
// NaN, so the row's out and lse say so instead of dropping the key as if masked. (+inf
// already turns into NaN in the softmax.)
template <class A>
inline void nonfinite_to_nan(A* __restrict s, int64_t n) {
    for (int64_t j = 0; j < n; ++j) s[j] = s[j] == neg_inf<A>() ? __builtin_nan("") : s[j];
}

// The score options of one query row (softcap, ALiBi, mask; see AttentionParams) in base-2
// units, applied to s[0, n) holding the scores (times log2 e) of keys first_key ..
// first_key + n: softcap c becomes c log2(e) (c tanh(s / c) times log2 e is
// c log2(e) tanh(x / (c log2 e))), an ALiBi slope and an additive mask are multiplied by log2 e.
template <class A>
struct RowOptions {
    A softcap = 0;                   // softcap log2(e); 0: off
    A inv_softcap = 0;               // its inverse
    A slope = 0;                     // ALiBi slope of the row's head times log2(e) (0: off)
    int64_t aligned = 0;             // i', the row's key position
    MaskKind mask_kind = MaskKind::kNone;
    const uint8_t* bool_mask = nullptr;  // the row's mask entries, col_stride apart
    const float* add_mask_f32 = nullptr;  // (natural-log units, as the caller gave them)
    const double* add_mask_f64 = nullptr;
    int64_t col_stride = 0;

    RowOptions(const AttentionParams& p, int64_t batch, int64_t head, int64_t row,
               int64_t seqlen_k) {
        if (p.softcap > 0) {
            softcap = static_cast<A>(p.softcap * SoftmaxBase<A>::kUnit);
            inv_softcap = static_cast<A>(1.0 / (p.softcap * SoftmaxBase<A>::kUnit));
        }
        if (p.alibi_slopes) slope = static_cast<A>(p.alibi_slopes[batch * p.alibi_batch_stride + head] * SoftmaxBase<A>::kUnit);
        aligned = aligned_row(p, row, seqlen_k);
        if (p.mask) {
            mask_kind = p.mask_kind;
            const int64_t at = batch * p.mask_batch_stride + head * p.mask_head_stride + row * p.mask_row_stride;
            if (p.mask_kind == MaskKind::kBool) bool_mask = static_cast<const uint8_t*>(p.mask) + at;
            else if (p.mask_dtype == DType::kF64) add_mask_f64 = static_cast<const double*>(p.mask) + at;
            else add_mask_f32 = static_cast<const float*>(p.mask) + at;
            col_stride = p.mask_col_stride;
        }
    }
    void apply(A* __restrict s, int64_t first_key, int64_t n) const {
        if (softcap != A(0))
            for (int64_t j = 0; j < n; ++j) s[j] = softcap * tanh_acc(s[j] * inv_softcap);
        if (slope != A(0))
            for (int64_t j = 0; j < n; ++j) {
                const int64_t dist = aligned - (first_key + j);
                s[j] -= slope * static_cast<A>(dist < 0 ? -dist : dist);
            }
        const A log2e = static_cast<A>(SoftmaxBase<A>::kUnit);
        if (bool_mask) {
            for (int64_t j = 0; j < n; ++j)
                if (!bool_mask[(first_key + j) * col_stride]) s[j] = neg_inf<A>();
        } else if (add_mask_f32) {
            for (int64_t j = 0; j < n; ++j) s[j] += static_cast<A>(add_mask_f32[(first_key + j) * col_stride]) * log2e;
        } else if (add_mask_f64) {
            for (int64_t j = 0; j < n; ++j) s[j] += static_cast<A>(add_mask_f64[(first_key + j) * col_stride]) * log2e;
        }
    }
};

// The online softmax of one query row over one block of its scores (base 2), srow[0, width),
// of which it sees [b, e): folds the block into the row's running max m, sum l and
// accumulator acc_row (Dv, rescaled when m grows) and leaves in srow the block's weights
// exp2(x - m), 0 outside [b, e). Returns false (weights all 0, state untouched) when the row
// sees nothing in the block. A NaN score makes m, l and with them the row's out NaN.
// Written once for every policy of the decode loop (decode_attention.inl, which runs the
// template prefill too); Path gives the two passes over the scores, range_max and
// exp_shift_zero (see TemplatePath). Always inlined: called as a
// function, the template decode spent 12 % more cycles at 8/8 heads (tier generic, Zen 3;
// HISTORY.md 28).
template <class Path, class A>
__attribute__((always_inline)) inline bool softmax_block(A* srow, int64_t width, int64_t b,
                                                         int64_t e, A& m, A& l, A* acc_row,
                                                         int64_t Dv) {
    const A block_max = b < e ? Path::range_max(srow, b, e) : neg_inf<A>();
    if (block_max == neg_inf<A>()) {
        for (int64_t c = 0; c < width; ++c) srow[c] = 0;
        return false;
    }
    const A m_new = m > block_max ? m : block_max;
    if (m != m_new && m != neg_inf<A>()) {  // (exp2(-inf) = 0 needs no pass over acc_row)
        const A correction = SoftmaxBase<A>::exp(m - m_new);
        l *= correction;
        for (int64_t c = 0; c < Dv; ++c) acc_row[c] *= correction;
    }
    m = m_new;
    l += Path::exp_shift_zero(srow, width, b, e, m_new);
    return true;
}

}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
