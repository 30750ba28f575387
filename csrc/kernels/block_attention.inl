// Streaming attention over one block of query rows: the kernel templates every ISA file
// compiles with its own flags. Included by kernels/isa_*.cpp after defining
// ATTNFAST_KERNEL_NS (a namespace unique to that file, so the per-ISA copies never merge
// at link time) and ATTNFAST_KERNEL_NAME.
//
// No std:: templates here: an inline std function instantiated in an AVX-512 file could be
// picked by the linker for the baseline build too.
//
// Loops are written with compile-time trip counts and lane-wise partial sums so the
// compiler vectorises them for the ISA of the including file.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernel_table.hpp"

#ifndef ATTNFAST_KERNEL_NS
#error "define ATTNFAST_KERNEL_NS before including block_attention.inl"
#endif

#include "../simd/storage.hpp"

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {

constexpr int64_t Bq = kBlockRows;
constexpr int64_t Bk = kTileKeys;
constexpr int kLanes = 16;  // partial sums kept per reduction, so reductions vectorise
static_assert(Bk % kLanes == 0, "tile must be a multiple of the reduction lanes");

template <class A> inline A neg_inf() { return -static_cast<A>(__builtin_inf()); }
// max that propagates NaN from either side (a NaN score must reach the row's out and lse,
// never be dropped by a comparison).
template <class A> inline A max_of(A a, A b) { return (a > b || a != a) ? a : b; }

// exp for float: Cody-Waite range reduction and a degree-6 polynomial (Cephes' expf
// coefficients), ~1 ulp on the range softmax uses; flushes to 0 below -87.3 (and for -inf).
inline float exp_acc(float x) {
    float xc = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
    xc = xc == xc ? xc : 0.0f;  // NaN: computed on 0 (no undefined int conversion), returned as is
    const float round_magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    const float n = (xc * 1.44269504088896341f + round_magic) - round_magic;
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float poly = 1.9875691500e-4f;
    poly = poly * r + 1.3981999507e-3f;
    poly = poly * r + 8.3334519073e-3f;
    poly = poly * r + 4.1665795894e-2f;
    poly = poly * r + 1.6666665459e-1f;
    poly = poly * r + 5.0000001201e-1f;
    const float er = poly * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    return x < -87.3f ? 0.0f : (x == x ? er * two_n : x);
}
inline double exp_acc(double x) { return __builtin_exp(x); }

inline float log_acc(float x) { return __builtin_logf(x); }
inline double log_acc(double x) { return __builtin_log(x); }
inline float tanh_acc(float x) { return __builtin_tanhf(x); }
inline double tanh_acc(double x) { return __builtin_tanh(x); }


// s[i][j] = sum_d qs[i][d] * kt[d][j] for i < rows, all Bk columns (kt packed D x Bk).
template <class A>
inline void scores_tile(const A* __restrict qs, const A* __restrict kt, A* __restrict s,
                        int64_t rows, int64_t dim) {
    for (int64_t i = 0; i < rows; ++i) {
        A acc[Bk];
        for (int64_t j = 0; j < Bk; ++j) acc[j] = 0;
        const A* qrow = qs + i * dim;
        for (int64_t d = 0; d < dim; ++d) {
            const A qd = qrow[d];
            const A* krow = kt + d * Bk;
            for (int64_t j = 0; j < Bk; ++j) acc[j] += qd * krow[j];
        }
        A* srow = s + i * Bk;
        for (int64_t j = 0; j < Bk; ++j) srow[j] = acc[j];
    }
}

template <class A>
inline A row_max(const A* __restrict x) {
    A part[kLanes];
    for (int u = 0; u < kLanes; ++u) part[u] = x[u];
    for (int64_t j = kLanes; j < Bk; j += kLanes)
        for (int u = 0; u < kLanes; ++u) part[u] = max_of(part[u], x[j + u]);
    A m = part[0];
    for (int u = 1; u < kLanes; ++u) m = max_of(m, part[u]);
    return m;
}

// x[j] = exp(x[j] - m); returns the sum (lane-wise partial sums in a fixed order).
template <class A>
inline A exp_shift_sum(A* __restrict x, A m) {
    A part[kLanes];
    for (int u = 0; u < kLanes; ++u) part[u] = 0;
    for (int64_t j = 0; j < Bk; j += kLanes)
        for (int u = 0; u < kLanes; ++u) {
            const A p = exp_acc(x[j + u] - m);
            x[j + u] = p;
            part[u] += p;
        }
    A sum = 0;
    for (int u = 0; u < kLanes; ++u) sum += part[u];
    return sum;
}

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
};

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

// acc[e] += sum_j p[j] * v_scale[j] * v[j][e] over the first `keys` rows of v (v_scale:
// an int8 cache's row scales, else all 1).
template <class A, class T>
inline void accumulate_pv(A* __restrict acc, const A* __restrict p, const KeyRows<T>& v,
                          int64_t keys, int64_t dim_v, const RowScales& v_scale,
                          int64_t first_row) {
    for (int64_t j0 = 0; j0 < keys;) {  // runs of rows within one block
        const int64_t j1 = v.run_end(first_row + j0, first_row + keys) - first_row;
        const T* vrow = v.at(first_row + j0);
        for (int64_t j = j0; j < j1; ++j, vrow += v.row_stride) {
            if (p[j] == A(0)) continue;  // masked or underflowed: nothing to add
            const A pj = p[j] * static_cast<A>(v_scale.at(first_row + j));
            for (int64_t e = 0; e < dim_v; ++e) acc[e] += pj * load_acc<A>(vrow[e]);
        }
        j0 = j1;
    }
}

// A raw score q . k of -inf comes only from an infinite (or overflowing) input: it becomes
// NaN, so the row's out and lse say so instead of dropping the key as if masked. (+inf
// already turns into NaN in the softmax.)
template <class A>
inline void nonfinite_to_nan(A* __restrict s, int64_t n) {
    for (int64_t j = 0; j < n; ++j) s[j] = s[j] == neg_inf<A>() ? __builtin_nan("") : s[j];
}

// The score options of one query row (softcap, ALiBi, mask; see AttentionParams), applied to
// s[0, n) holding the scaled scores of keys first_key .. first_key + n.
template <class A>
struct RowOptions {
    A softcap = 0;                   // 0: off
    A inv_softcap = 0;
    A slope = 0;                     // ALiBi slope of the row's head (0: off)
    int64_t aligned = 0;             // i', the row's key position
    MaskKind mask_kind = MaskKind::kNone;
    const uint8_t* bool_mask = nullptr;  // the row's mask entries, col_stride apart
    const float* add_mask_f32 = nullptr;
    const double* add_mask_f64 = nullptr;
    int64_t col_stride = 0;

    RowOptions(const AttentionParams& p, int64_t batch, int64_t head, int64_t row,
               int64_t seqlen_k) {
        if (p.softcap > 0) {
            softcap = static_cast<A>(p.softcap);
            inv_softcap = static_cast<A>(1.0 / p.softcap);
        }
        if (p.alibi_slopes) slope = static_cast<A>(p.alibi_slopes[batch * p.alibi_batch_stride + head]);
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
        if (bool_mask) {
            for (int64_t j = 0; j < n; ++j)
                if (!bool_mask[(first_key + j) * col_stride]) s[j] = neg_inf<A>();
        } else if (add_mask_f32) {
            for (int64_t j = 0; j < n; ++j) s[j] += static_cast<A>(add_mask_f32[(first_key + j) * col_stride]);
        } else if (add_mask_f64) {
            for (int64_t j = 0; j < n; ++j) s[j] += static_cast<A>(add_mask_f64[(first_key + j) * col_stride]);
        }
    }
};

// Folds the sink logit of a row (gpt-oss) into its online-softmax state: one more term of
// the denominator, no value. A row that saw no key gets m = sink, l = 1, acc = 0.
template <class A>
inline void add_sink(A sink, A& m, A& l, A* acc, int64_t dim_v) {
    if (m == neg_inf<A>()) {
        m = sink;
        l = 1;
        return;
    }
    const A m_new = max_of(m, sink);
    const A correction = exp_acc(m - m_new);
    l = l * correction + exp_acc(sink - m_new);
    if (correction != A(1))
        for (int64_t e = 0; e < dim_v; ++e) acc[e] *= correction;
    m = m_new;
}

// The online softmax of one query row over one block of its scores, srow[0, width), of
// which it sees [b, e): folds the block into the row's running max m, sum l and
// accumulator acc_row (Dv, rescaled when m grows) and leaves in srow the block's weights
// exp(s - m), 0 outside [b, e). Returns false (weights all 0, state untouched) when the row
// sees nothing in the block. A NaN score makes m, l and with them the row's out NaN.
// Written once for the template prefill (attend_block: whole tiles, unseen keys at -inf) and
// every policy of the decode loop; Path gives the two passes over the scores, range_max and
// exp_shift_zero (see TemplatePath, decode_attention.inl). Always inlined: called as a
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
    if (m != m_new && m != neg_inf<A>()) {  // (exp(-inf) = 0 needs no pass over acc_row)
        const A correction = exp_acc(m - m_new);
        l *= correction;
        for (int64_t c = 0; c < Dv; ++c) acc_row[c] *= correction;
    }
    m = m_new;
    l += Path::exp_shift_zero(srow, width, b, e, m_new);
    return true;
}

// attend_block's passes for softmax_block: whole tiles of Bk scores (keys a row does not see
// already -inf), maxima and sums in row_max's and exp_shift_sum's fixed orders.
template <class A>
struct TileSoftmax {
    static A range_max(const A* x, int64_t, int64_t) { return row_max(x); }
    static A exp_shift_zero(A* x, int64_t, int64_t, int64_t, A m) { return exp_shift_sum(x, m); }
};

// TQ: type of q and out; TKV: type of k and v (TQ, or a 16-bit / int8 cache under float32
// queries); A: the accumulator (float, or double for float64).
template <class TQ, class TKV, class A>
void attend_block(const AttentionParams& p, const BlockTask& task, A* workspace) {
    const int64_t D = p.head_dim, Dv = p.head_dim_v;
    const int64_t rows = task.row_end - task.row_begin;
    const int64_t kv_head = task.head / (p.heads / p.kv_heads);

    A* qs = workspace;           // rows x D, pre-multiplied by scale
    A* kt = qs + Bq * D;         // D x Bk
    A* s = kt + D * Bk;          // rows x Bk
    A* acc = s + Bq * Bk;        // rows x Dv
    A* m = acc + Bq * Dv;        // rows
    A* l = m + Bq;               // rows

    const TQ* q = static_cast<const TQ*>(p.q) + task.batch * p.q_batch_stride + task.head * p.q_head_stride;
    const KeyRows<TKV> k = key_rows<TKV>(p, p.k, p.k_batch_stride, p.k_head_stride,
                                         p.k_row_stride, task.batch, kv_head);
    const KeyRows<TKV> v = key_rows<TKV>(p, p.v, p.v_batch_stride, p.v_head_stride,
                                         p.v_row_stride, task.batch, kv_head);
    const RowScales k_scale = row_scales(p, p.k_scale, p.k_scale_batch_stride, p.k_scale_head_stride,
                                         p.k_scale_row_stride, task.batch, kv_head);
    const RowScales v_scale = row_scales(p, p.v_scale, p.v_scale_batch_stride, p.v_scale_head_stride,
                                         p.v_scale_row_stride, task.batch, kv_head);

    const A scale = static_cast<A>(p.scale);
    for (int64_t i = 0; i < rows; ++i) {
        const TQ* qrow = q + (task.row_begin + i) * p.q_row_stride;
        for (int64_t d = 0; d < D; ++d) qs[i * D + d] = load_acc<A>(qrow[d]) * scale;
        m[i] = neg_inf<A>();
        l[i] = 0;
        for (int64_t e = 0; e < Dv; ++e) acc[i * Dv + e] = 0;
    }

    // Keys any row of the block may see; ranges only move right as rows go down.
    const int64_t seqlen_k = batch_seqlen_k(p, task.batch);
    const KeyRange first = visible_keys(p, task.row_begin, seqlen_k);
    const KeyRange last = visible_keys(p, task.row_end - 1, seqlen_k);
    const int64_t kv_begin = first.begin;
    const int64_t kv_end = last.end;
    const bool options = p.softcap > 0 || p.alibi_slopes || p.mask;

    for (int64_t tile = kv_begin; tile < kv_end; tile += Bk) {
        const int64_t keys = (kv_end - tile < Bk) ? kv_end - tile : Bk;

        // Pack the K tile transposed (zero-padded), converting to the accumulator type.
        for (int64_t j0 = 0; j0 < keys;) {  // runs of rows within one block (paged)
            const int64_t j1 = k.run_end(tile + j0, tile + keys) - tile;
            const TKV* krow = k.at(tile + j0);
            for (int64_t j = j0; j < j1; ++j, krow += k.row_stride) {
                const A ks = static_cast<A>(k_scale.at(tile + j));
                for (int64_t d = 0; d < D; ++d) kt[d * Bk + j] = load_acc<A>(krow[d]) * ks;
            }
            j0 = j1;
        }
        for (int64_t d = 0; d < D; ++d)
            for (int64_t j = keys; j < Bk; ++j) kt[d * Bk + j] = 0;

        scores_tile(qs, kt, s, rows, D);

        // Only tiles crossing some row's range boundary need the per-element mask.
        const bool partial = keys < Bk || tile < last.begin || tile + keys > first.end;
        for (int64_t i = 0; i < rows; ++i) {
            A* srow = s + i * Bk;
            nonfinite_to_nan(srow, keys);
            if (options)
                RowOptions<A>(p, task.batch, task.head, task.row_begin + i, seqlen_k).apply(srow, tile, keys);
            if (partial) {
                const KeyRange r = visible_keys(p, task.row_begin + i, seqlen_k);
                for (int64_t j = 0; j < Bk; ++j) {
                    const int64_t key = tile + j;
                    if (j >= keys || key < r.begin || key >= r.end) srow[j] = neg_inf<A>();
                }
            }
            A* acc_row = acc + i * Dv;
            if (!softmax_block<TileSoftmax<A>>(srow, Bk, 0, Bk, m[i], l[i], acc_row, Dv))
                continue;  // row sees nothing here
            accumulate_pv(acc_row, srow, v, keys, Dv, v_scale, tile);
        }
    }

    TQ* out = static_cast<TQ*>(p.out) + task.batch * p.out_batch_stride + task.head * p.out_head_stride;
    A* lse = static_cast<A*>(p.lse);
    if (lse) lse += task.batch * p.lse_batch_stride + task.head * p.lse_head_stride;
    for (int64_t i = 0; i < rows; ++i) {
        TQ* orow = out + (task.row_begin + i) * p.out_row_stride;
        A* acc_row = acc + i * Dv;
        if (p.sinks) add_sink(static_cast<A>(p.sinks[task.head]), m[i], l[i], acc_row, Dv);
        if (l[i] != A(0)) {  // saw keys; NaN here (a NaN score) gives NaN out and lse
            const A inv = A(1) / l[i];
            for (int64_t e = 0; e < Dv; ++e) orow[e] = store_from_acc<TQ>(acc_row[e] * inv);
            if (lse) lse[(task.row_begin + i) * p.lse_row_stride] = m[i] + log_acc(l[i]);
        } else {  // the row sees no key: zeros and -inf, never NaN
            for (int64_t e = 0; e < Dv; ++e) orow[e] = store_from_acc<TQ>(A(0));
            if (lse) lse[(task.row_begin + i) * p.lse_row_stride] = neg_inf<A>();
        }
    }
}

void attend_block_f64(const AttentionParams& p, const BlockTask& t, double* ws) {
    attend_block<double, double, double>(p, t, ws);
}
// Every float32-accumulated combination (checked by attention_forward): float32, 16-bit
// q/k/v, float32 q over a 16-bit cache, float32 / 16-bit q over an int8 cache.
[[maybe_unused]] void attend_block_any(const AttentionParams& p, const BlockTask& t, float* ws) {
    const DType q = p.dtype, kv = p.kv_dtype;
    if (kv == DType::kBF16) {
        if (q == DType::kBF16) attend_block<bf16_t, bf16_t, float>(p, t, ws);
        else attend_block<float, bf16_t, float>(p, t, ws);
    } else if (kv == DType::kF16) {
        if (q == DType::kF16) attend_block<f16_t, f16_t, float>(p, t, ws);
        else attend_block<float, f16_t, float>(p, t, ws);
    } else if (kv == DType::kF32) {
        attend_block<float, float, float>(p, t, ws);
    } else {  // kI8
        if (q == DType::kBF16) attend_block<bf16_t, int8_t, float>(p, t, ws);
        else if (q == DType::kF16) attend_block<f16_t, int8_t, float>(p, t, ws);
        else attend_block<float, int8_t, float>(p, t, ws);
    }
}

// attend_block_any's plan (the prefill of tiers without a hand-written one).
[[maybe_unused]] PrefillPlan plan_templates(const AttentionParams& p) {
    PrefillPlan plan;
    plan.block_rows = kBlockRows;
    plan.workspace_elems = block_workspace_elems(p);
    return plan;
}

// The prefill of tiers without a hand-written one (KernelTable::prefill_kernel).
[[maybe_unused]] PrefillKernel template_prefill(const AttentionParams&) {
    return {"template_prefill", attend_block_any, plan_templates};
}

}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
