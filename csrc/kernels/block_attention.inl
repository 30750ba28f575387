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
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernel_table.hpp"

#ifndef ATTNFAST_KERNEL_NS
#error "define ATTNFAST_KERNEL_NS before including block_attention.inl"
#endif

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {

constexpr int64_t Bq = kBlockRows;
constexpr int64_t Bk = kTileKeys;
constexpr int kLanes = 16;  // partial sums kept per reduction, so reductions vectorise
static_assert(Bk % kLanes == 0, "tile must be a multiple of the reduction lanes");

template <class A> inline A neg_inf() { return -static_cast<A>(__builtin_inf()); }
// NaN-sticky: once either argument is NaN the result is NaN, so a NaN score reaches the row
// max and from there every probability of its row (NaN in, NaN out).
template <class A> inline A max_of(A a, A b) { return (a > b || a != a) ? a : b; }

// exp for float: Cody-Waite range reduction and a degree-6 polynomial (Cephes' expf
// coefficients), ~1 ulp on the range softmax uses; flushes to 0 below -87.3 (and for -inf).
inline float exp_acc(float x) {
    const float xc = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
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
    return x < -87.3f ? 0.0f : er * two_n;
}
inline double exp_acc(double x) { return __builtin_exp(x); }

inline float log_acc(float x) { return __builtin_logf(x); }
inline double log_acc(double x) { return __builtin_log(x); }

// Storage type -> accumulator type. (16-bit storage types plug in here.)
template <class A, class T> inline A load_acc(T x) { return static_cast<A>(x); }
template <class T, class A> inline T store_from_acc(A x) { return static_cast<T>(x); }

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

// acc[e] += sum_j p[j] * v[j][e] over the first `keys` rows of v.
template <class A, class T>
inline void accumulate_pv(A* __restrict acc, const A* __restrict p, const T* __restrict v,
                          int64_t v_row_stride, int64_t keys, int64_t dim_v) {
    for (int64_t j = 0; j < keys; ++j) {
        const A pj = p[j];
        if (pj == A(0)) continue;  // masked or underflowed: nothing to add
        const T* vrow = v + j * v_row_stride;
        for (int64_t e = 0; e < dim_v; ++e) acc[e] += pj * load_acc<A>(vrow[e]);
    }
}

template <class T, class A>
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

    const T* q = static_cast<const T*>(p.q) + task.batch * p.q_batch_stride + task.head * p.q_head_stride;
    const T* k = static_cast<const T*>(p.k) + task.batch * p.k_batch_stride + kv_head * p.k_head_stride;
    const T* v = static_cast<const T*>(p.v) + task.batch * p.v_batch_stride + kv_head * p.v_head_stride;

    const A scale = static_cast<A>(p.scale);
    for (int64_t i = 0; i < rows; ++i) {
        const T* qrow = q + (task.row_begin + i) * p.q_row_stride;
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

    for (int64_t tile = kv_begin; tile < kv_end; tile += Bk) {
        const int64_t keys = (kv_end - tile < Bk) ? kv_end - tile : Bk;

        // Pack the K tile transposed (zero-padded), converting to the accumulator type.
        for (int64_t j = 0; j < keys; ++j) {
            const T* krow = k + (tile + j) * p.k_row_stride;
            for (int64_t d = 0; d < D; ++d) kt[d * Bk + j] = load_acc<A>(krow[d]);
        }
        for (int64_t d = 0; d < D; ++d)
            for (int64_t j = keys; j < Bk; ++j) kt[d * Bk + j] = 0;

        scores_tile(qs, kt, s, rows, D);

        // Only tiles crossing some row's range boundary need the per-element mask.
        const bool partial = keys < Bk || tile < last.begin || tile + keys > first.end;
        for (int64_t i = 0; i < rows; ++i) {
            A* srow = s + i * Bk;
            if (partial) {
                const KeyRange r = visible_keys(p, task.row_begin + i, seqlen_k);
                for (int64_t j = 0; j < Bk; ++j) {
                    const int64_t key = tile + j;
                    if (j >= keys || key < r.begin || key >= r.end) srow[j] = neg_inf<A>();
                }
            }
            const A tile_max = row_max(srow);
            if (tile_max == neg_inf<A>()) continue;  // row sees nothing here
            const A m_new = max_of(m[i], tile_max);
            const A correction = exp_acc(m[i] - m_new);  // 0 while m[i] is -inf
            const A tile_sum = exp_shift_sum(srow, m_new);
            l[i] = l[i] * correction + tile_sum;
            m[i] = m_new;
            A* acc_row = acc + i * Dv;
            if (correction != A(1))
                for (int64_t e = 0; e < Dv; ++e) acc_row[e] *= correction;
            accumulate_pv(acc_row, srow, v + tile * p.v_row_stride, p.v_row_stride, keys, Dv);
        }
    }

    T* out = static_cast<T*>(p.out) + task.batch * p.out_batch_stride + task.head * p.out_head_stride;
    A* lse = static_cast<A*>(p.lse);
    if (lse) lse += task.batch * p.lse_batch_stride + task.head * p.lse_head_stride;
    for (int64_t i = 0; i < rows; ++i) {
        T* orow = out + (task.row_begin + i) * p.out_row_stride;
        const A* acc_row = acc + i * Dv;
        if (l[i] != A(0)) {  // saw keys; a NaN sum (NaN input) gives NaN out and lse
            const A inv = A(1) / l[i];
            for (int64_t e = 0; e < Dv; ++e) orow[e] = store_from_acc<T>(acc_row[e] * inv);
            if (lse) lse[(task.row_begin + i) * p.lse_row_stride] = m[i] + log_acc(l[i]);
        } else {  // the row sees no key: zeros and -inf, never NaN
            for (int64_t e = 0; e < Dv; ++e) orow[e] = store_from_acc<T>(A(0));
            if (lse) lse[(task.row_begin + i) * p.lse_row_stride] = neg_inf<A>();
        }
    }
}

[[maybe_unused]] void attend_block_f32(const AttentionParams& p, const BlockTask& t, float* ws) {
    attend_block<float, float>(p, t, ws);
}
void attend_block_f64(const AttentionParams& p, const BlockTask& t, double* ws) {
    attend_block<double, double>(p, t, ws);
}

// The float32 plan of this kernel (the SIMD tiers use their own kernel and plan for float32).
[[maybe_unused]] PrefillPlan plan_f32_generic(const AttentionParams& p) {
    PrefillPlan plan;
    plan.block_rows = kBlockRows;
    plan.workspace_elems = block_workspace_elems(p);
    return plan;
}

}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
