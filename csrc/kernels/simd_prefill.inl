// Hand-written float32 prefill kernel for the x86 SIMD tiers (AVX-512 and AVX2+FMA).
// Included by kernels/isa_avx512.cpp and kernels/isa_avx2.cpp after block_attention.inl,
// inside their ATTNFAST_KERNEL_NS; the intrinsics below compile only under those files'
// -m flags. The generic tier and float64 keep the auto-vectorised templates.
//
// Layout: query rows live in vector lanes. One block holds Bq = kQueryVecs * W query rows:
//   qt  (D  x Bq)  Qᵀ, pre-multiplied by scale * log2(e) (so the softmax runs in base 2)
//   st  (Bk x Bq)  Sᵀ of the current KV tile, overwritten in place by Pᵀ
//   ot  (Dv x Bq)  Oᵀ, the unnormalised output accumulator
// With queries in lanes the row max, the row sum and the rescaling of the output are plain
// element-wise vector operations, never horizontal reductions. K and V are read straight
// from the caller's arrays (any row stride) as broadcast scalars, so nothing is packed
// per tile and any D, Dv works without padding:
//   S micro-kernel:  kRows keys x kQueryVecs query vectors of accumulators, looping over d:
//                    acc[t][v] += k[key t][d] * qt[d][v-th vector]
//   PV micro-kernel: kRows output columns x kQueryVecs query vectors, looping over keys j:
//                    acc[t][v] += v[j][col t] * pt[j][v-th vector]
// Rounding and summation order depend only on the tile sizes (functions of D, Dv and the
// cache sizes), never on the thread count.
//
// No std:: templates here (see block_attention.inl).
#include <immintrin.h>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "simd_prefill.inl needs at least -mavx2 -mfma"
#endif

// GCC 12 warns about the deliberately undefined pass-through operand inside
// _mm512_max_ps (_mm512_undefined_ps); a false positive.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace simd {

// ---------------------------------------------------------------- vector layer
#if defined(__AVX512F__)
using Vec = __m512;
using Mask = __mmask16;
constexpr int W = 16;           // float lanes
constexpr int kQueryVecs = 2;   // query vectors per block: Bq = 32 rows
constexpr int kRows = 12;       // keys (S) or output columns (PV) per micro-tile: 24 accumulators

inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset(float x) { return _mm512_set1_ps(x); }
inline Vec vload(const float* p) { return _mm512_load_ps(p); }
inline void vstore(float* p, Vec x) { _mm512_store_ps(p, x); }
inline Vec vbcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
// Lanes whose [begin, end) key range (relative to the tile) contains `key`.
inline Mask key_visible(const int32_t* begin, const int32_t* end, int32_t key) {
    const __m512i kv = _mm512_set1_epi32(key);
    return _mm512_cmp_epi32_mask(_mm512_load_si512(begin), kv, _MM_CMPINT_LE) &
           _mm512_cmp_epi32_mask(kv, _mm512_load_si512(end), _MM_CMPINT_LT);
}
inline Vec keep_or_neg_inf(Mask keep, Vec x) {
    return _mm512_mask_blend_ps(keep, vset(-__builtin_inff()), x);
}
// m == -inf ? 0 : m. The shift for a lane that has seen no key yet, so exp2(-inf - shift) = 0.
inline Vec finite_or_zero(Vec m) {
    const Mask ninf = _mm512_cmp_ps_mask(m, vset(-__builtin_inff()), _CMP_EQ_OQ);
    return _mm512_mask_blend_ps(ninf, m, vzero());
}
inline bool all_ones(Vec x) { return _mm512_cmp_ps_mask(x, vset(1.0f), _CMP_NEQ_UQ) == 0; }
// A raw score of -inf (an infinite input) -> NaN, so the row's out and lse say so.
inline Vec neg_inf_to_nan(Vec x) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, vset(-__builtin_inff()), _CMP_EQ_OQ), x,
                                vset(__builtin_nanf("")));
}
#else  // AVX2 + FMA
using Vec = __m256;
using Mask = __m256;
constexpr int W = 8;
// 12 accumulators + 4 query vectors = 16 ymm registers (the key / V value is broadcast
// from memory as an FMA operand). Measured on a Sapphire Rapids core held to AVX2 against
// the AVX-512 tier's shape 2 x 6 (Bq = 16): +10-50% (per-round medians, noisy shared
// machine); 3 x 4 (Bq = 24) in between. Each K/V value loaded from L1 now feeds 4 vector
// FMAs instead of 2.
constexpr int kQueryVecs = 4;   // Bq = 32 rows
constexpr int kRows = 3;

inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float x) { return _mm256_set1_ps(x); }
inline Vec vload(const float* p) { return _mm256_load_ps(p); }
inline void vstore(float* p, Vec x) { _mm256_store_ps(p, x); }
inline Vec vbcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Mask key_visible(const int32_t* begin, const int32_t* end, int32_t key) {
    const __m256i kv = _mm256_set1_epi32(key);
    const __m256i b = _mm256_load_si256(reinterpret_cast<const __m256i*>(begin));
    const __m256i e = _mm256_load_si256(reinterpret_cast<const __m256i*>(end));
    // begin <= key && key < end  <=>  !(begin > key) && (end > key)
    return _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(b, kv), _mm256_cmpgt_epi32(e, kv)));
}
inline Vec keep_or_neg_inf(Mask keep, Vec x) { return _mm256_blendv_ps(vset(-__builtin_inff()), x, keep); }
inline Vec finite_or_zero(Vec m) {
    return _mm256_andnot_ps(_mm256_cmp_ps(m, vset(-__builtin_inff()), _CMP_EQ_OQ), m);
}
inline bool all_ones(Vec x) { return _mm256_movemask_ps(_mm256_cmp_ps(x, vset(1.0f), _CMP_NEQ_UQ)) == 0; }
inline Vec neg_inf_to_nan(Vec x) {
    return _mm256_blendv_ps(x, vset(__builtin_nanf("")), _mm256_cmp_ps(x, vset(-__builtin_inff()), _CMP_EQ_OQ));
}
#endif

constexpr int64_t Bq = kQueryVecs * W;

// 2^x for x <= 0, as 2^n * p(r), n = round(x), r = x - n in [-1/2, 1/2] (exact), p a degree-6
// minimax polynomial for 2^r (relative error 1.9e-9; <= 0.94 ulp after float32 Horner
// rounding). x < -126 (including -inf) gives exactly 0: underflow is flushed, never denormal.
// NaN stays NaN.
inline Vec exp2_neg(Vec x) {
    constexpr float c1 = 6.931471825e-01f, c2 = 2.402264625e-01f, c3 = 5.550328642e-02f,
                    c4 = 9.618489072e-03f, c5 = 1.339993090e-03f, c6 = 1.534581243e-04f;
#if defined(__AVX512F__)
    const Mask keep = _mm512_cmp_ps_mask(x, vset(-126.0f), _CMP_NLT_UQ);
    const Vec n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const Vec r = vsub(x, n);
#else
    const Vec keep = _mm256_cmp_ps(x, vset(-126.0f), _CMP_NLT_UQ);
    const Vec xc = _mm256_max_ps(vset(-127.0f), x);  // keeps 2^n's exponent field >= 0; NaN passes
    const Vec n = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const Vec r = vsub(xc, n);
#endif
    Vec p = vfma(vset(c6), r, vset(c5));
    p = vfma(p, r, vset(c4));
    p = vfma(p, r, vset(c3));
    p = vfma(p, r, vset(c2));
    p = vfma(p, r, vset(c1));
    p = vfma(p, r, vset(1.0f));
#if defined(__AVX512F__)
    return _mm512_maskz_scalef_ps(keep, p, n);
#else
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
#endif
}

// ---------------------------------------------------------------- block state
// One sub-block: Bq query rows of one head, with its own online-softmax state. The
// scratch shared by the sub-blocks of a task (Sᵀ, masks) is reached from here too.
struct Block {
    int64_t D, Dv, Bk;
    float* qt;            // D x Bq
    float* ot;            // Dv x Bq
    float* m;             // Bq: running max (base-2 scaled scores)
    float* l;             // Bq: running sum
    float* st;            // Bk x Bq, shared
    int32_t* rel_begin;   // Bq, shared: visible keys of each lane relative to the tile start
    int32_t* rel_end;
    const float* k;       // key row 0 of this (batch, kv head)
    const float* v;
    int64_t k_stride, v_stride;
    int64_t head, row_begin, rows;
    int64_t seqlen_k;      // keys valid for this batch entry (batch_seqlen_k)
    KeyRange first, last;  // visible keys of the first and last row
};

inline int64_t round_down(int64_t x, int64_t to) { return x / to * to; }
inline int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Most sub-blocks one task holds: each K/V super-tile is read from L3 once per task and
// reused from L2 by up to this many sub-blocks, whose states (Qᵀ, Oᵀ) also live in L2.
constexpr int64_t kMaxSubBlocks = 4;

// Tile sizes of the float32 prefill, from D, Dv and the cache sizes only.
struct Tiling {
    int64_t Bk;          // keys per tile: Sᵀ (Bk x Bq) and the K rows in flight share L1
    int64_t super_keys;  // keys per super-tile: its K and V stay in L2 while every sub-block
                         // of the task walks them (FlashAttention's Bc ~ M / 4d with M = L2)
    bool prefetch;       // one head's K and V do not fit in half of L2
    int64_t sub_elems;   // floats of one sub-block's state
    int64_t shared_elems;
};
// Most keys per tile (Bk); 48..96 measured alike on AVX2 (Sapphire Rapids, Bq = 32).
constexpr int64_t kMaxTileKeys = 16 * kRows > 96 ? 16 * kRows : 96;
inline Tiling tiling(const AttentionParams& p) {
    const CacheSizes& cache = cache_sizes();
    Tiling t;
    const int64_t bk = (cache.l1d / 4) / (Bq * static_cast<int64_t>(sizeof(float)));
    t.Bk = round_down(clamp64(bk, 2 * kRows, kMaxTileKeys), kRows);
    const int64_t row_bytes = (p.head_dim + p.head_dim_v) * static_cast<int64_t>(sizeof(float));
    t.super_keys = round_down(clamp64((cache.l2 / 2) / row_bytes, t.Bk, 1 << 20), t.Bk);
    t.prefetch = p.seqlen_k * row_bytes > cache.l2 / 2;
    t.sub_elems = (p.head_dim + p.head_dim_v + 2) * Bq;
    t.shared_elems = t.Bk * Bq + 2 * Bq;
    return t;
}

// How tasks group sub-blocks: heads of one KV head (GQA) and consecutive row blocks.
// Depends on the shape and the cache sizes only.
PrefillPlan plan(const AttentionParams& p) {
    const Tiling t = tiling(p);
    const int64_t group = p.heads / p.kv_heads;
    // Heads per task: the largest divisor of the group up to kMaxSubBlocks.
    int64_t heads = 1;
    for (int64_t h = 1; h <= group && h <= kMaxSubBlocks; ++h)
        if (group % h == 0) heads = h;
    // Row blocks per task: only worth it when one head's K and V do not fit in L2.
    int64_t row_blocks = t.prefetch ? kMaxSubBlocks / heads : 1;
    if (row_blocks < 1) row_blocks = 1;
    // Keep enough tasks (64) to balance the thread counts of most machines; a function of
    // the shape only, so the result does not depend on the thread count.
    const int64_t q_blocks = (p.seqlen_q + Bq - 1) / Bq;
    auto tasks = [&](int64_t rb, int64_t hd) {
        return p.batch * (p.heads / hd) * ((q_blocks + rb - 1) / rb);
    };
    while (row_blocks > 1 && tasks(row_blocks, heads) < 64) row_blocks /= 2;
    while (heads > 1 && tasks(row_blocks, heads) < 64) {
        int64_t h = heads - 1;
        while (group % h != 0) --h;
        heads = h;
    }
    PrefillPlan plan;
    plan.block_rows = row_blocks * Bq;
    plan.heads_per_task = heads;
    plan.workspace_elems = heads * row_blocks * t.sub_elems + t.shared_elems + 64 / sizeof(float);
    return plan;
}

// ---------------------------------------------------------------- prefetch
// Brings the K and V rows of the next tile towards L2, a line or two per step, while the
// current tile computes. Needed when one head's K and V do not fit in L2 (they then come
// from L3 and the hardware prefetchers do not follow many strided rows); spread thinly
// because a burst of prefetches stalls the load pipeline.
struct PrefetchStream {
    const char* k_row = nullptr;
    const char* v_row = nullptr;
    int64_t k_stride = 0, v_stride = 0;  // bytes
    int64_t k_bytes = 0, v_bytes = 0;    // bytes of one row
    int64_t k_lines = 0, lines = 0;      // lines per row: K's, then V's
    int64_t line = 0;                    // next line of the current row
    int64_t rows_left = 0;

    PrefetchStream() = default;
    PrefetchStream(const Block& b, int64_t first_row, int64_t rows) {
        k_stride = b.k_stride * 4;
        v_stride = b.v_stride * 4;
        k_row = reinterpret_cast<const char*>(b.k) + first_row * k_stride;
        v_row = reinterpret_cast<const char*>(b.v) + first_row * v_stride;
        k_bytes = b.D * 4;
        v_bytes = b.Dv * 4;
        k_lines = k_bytes / 64 + 1;  // + 1: a row need not start on a line
        lines = k_lines + v_bytes / 64 + 1;
        rows_left = rows;
    }
    int64_t total_lines() const { return rows_left * lines; }
    void step() {
        if (rows_left <= 0) return;
        const char* at;
        if (line < k_lines) {
            const int64_t off = line * 64;
            at = k_row + (off < k_bytes ? off : k_bytes - 1);
        } else {
            const int64_t off = (line - k_lines) * 64;
            at = v_row + (off < v_bytes ? off : v_bytes - 1);
        }
        _mm_prefetch(at, _MM_HINT_T1);
        if (++line == lines) {
            line = 0;
            k_row += k_stride;
            v_row += v_stride;
            --rows_left;
        }
    }
};

// ---------------------------------------------------------------- micro-kernels
// Sᵀ rows [j0, j0 + R) of the tile starting at key `tile`: scores of R keys against all Bq
// query lanes; masked to -inf outside each lane's range when `partial`; folds the row max.
template <int R>
void scores_rows(const Block& b, int64_t tile, int64_t j0, bool partial, Vec* tile_max) {
    Vec acc[R][kQueryVecs];
#pragma GCC unroll 16
    for (int t = 0; t < R; ++t)
#pragma GCC unroll 4
        for (int u = 0; u < kQueryVecs; ++u) acc[t][u] = vzero();
    const float* krow[R];
#pragma GCC unroll 16
    for (int t = 0; t < R; ++t) krow[t] = b.k + (tile + j0 + t) * b.k_stride;
    const float* q = b.qt;
    for (int64_t d = 0; d < b.D; ++d, q += Bq) {
        Vec qv[kQueryVecs];
#pragma GCC unroll 4
        for (int u = 0; u < kQueryVecs; ++u) qv[u] = vload(q + u * W);
#pragma GCC unroll 16
        for (int t = 0; t < R; ++t) {
            const Vec kb = vbcast(krow[t] + d);
#pragma GCC unroll 4
            for (int u = 0; u < kQueryVecs; ++u) acc[t][u] = vfma(kb, qv[u], acc[t][u]);
        }
    }
    float* s = b.st + j0 * Bq;
#pragma GCC unroll 16
    for (int t = 0; t < R; ++t)
#pragma GCC unroll 4
        for (int u = 0; u < kQueryVecs; ++u) {
            Vec x = neg_inf_to_nan(acc[t][u]);  // -inf only from an infinite input
            if (partial)
                x = keep_or_neg_inf(key_visible(b.rel_begin + u * W, b.rel_end + u * W,
                                                static_cast<int32_t>(j0 + t)), x);
            tile_max[u] = vmax(tile_max[u], x);
            vstore(s + t * Bq + u * W, x);
        }
}

// Oᵀ rows [e0, e0 + R) = corr * Oᵀ + Vᵀ[e0:e0+R, tile keys] Pᵀ over `keys` keys (corr
// nullptr: all ones); steps the prefetch stream `pf_steps` times per key.
template <int R>
void pv_rows(const Block& b, int64_t tile, int64_t keys, int64_t e0, const Vec* corr,
             PrefetchStream& pf, int pf_steps) {
    Vec acc[R][kQueryVecs];
    float* o = b.ot + e0 * Bq;
    if (corr) {
#pragma GCC unroll 16
        for (int t = 0; t < R; ++t)
#pragma GCC unroll 4
            for (int u = 0; u < kQueryVecs; ++u) acc[t][u] = vmul(vload(o + t * Bq + u * W), corr[u]);
    } else {
#pragma GCC unroll 16
        for (int t = 0; t < R; ++t)
#pragma GCC unroll 4
            for (int u = 0; u < kQueryVecs; ++u) acc[t][u] = vload(o + t * Bq + u * W);
    }
    const float* vrow = b.v + tile * b.v_stride + e0;
    const float* pt = b.st;
    for (int64_t j = 0; j < keys; ++j, vrow += b.v_stride, pt += Bq) {
        for (int i = 0; i < pf_steps; ++i) pf.step();
        Vec pv[kQueryVecs];
#pragma GCC unroll 4
        for (int u = 0; u < kQueryVecs; ++u) pv[u] = vload(pt + u * W);
#pragma GCC unroll 16
        for (int t = 0; t < R; ++t) {
            const Vec vb = vbcast(vrow + t);
#pragma GCC unroll 4
            for (int u = 0; u < kQueryVecs; ++u) acc[t][u] = vfma(vb, pv[u], acc[t][u]);
        }
    }
#pragma GCC unroll 16
    for (int t = 0; t < R; ++t)
#pragma GCC unroll 4
        for (int u = 0; u < kQueryVecs; ++u) vstore(o + t * Bq + u * W, acc[t][u]);
}

// Remainder micro-tiles (fewer than kRows keys or columns), picked by an if-chain at
// compile time. (No static table: its constructor would run AVX code at library load.)
template <int R>
inline void scores_tail(int64_t rows, const Block& b, int64_t tile, int64_t j0, bool partial, Vec* tile_max) {
    if (rows == R) scores_rows<R>(b, tile, j0, partial, tile_max);
    else if constexpr (R > 1) scores_tail<R - 1>(rows, b, tile, j0, partial, tile_max);
}
template <int R>
inline void pv_cols(int64_t cols, const Block& b, int64_t tile, int64_t keys, int64_t e0, const Vec* corr,
                    PrefetchStream& pf, int pf_steps) {
    if (cols == R) pv_rows<R>(b, tile, keys, e0, corr, pf, pf_steps);
    else if constexpr (R > 1) pv_cols<R - 1>(cols, b, tile, keys, e0, corr, pf, pf_steps);
}

// ---------------------------------------------------------------- one KV tile
// Pᵀ = 2^(Sᵀ - shift) in place over `keys` rows of Sᵀ; adds each row into sum (lane-wise,
// in key order).
inline void exp_pass(const Block& b, int64_t keys, const Vec* shift, Vec* sum) {
    float* s = b.st;
    for (int64_t j = 0; j < keys; ++j, s += Bq)
#pragma GCC unroll 4
        for (int u = 0; u < kQueryVecs; ++u) {
            const Vec pj = exp2_neg(vsub(vload(s + u * W), shift[u]));
            vstore(s + u * W, pj);
            sum[u] = vadd(sum[u], pj);
        }
}

// Online-softmax update of the block with keys [tile, tile + keys).
void attend_tile(const Block& b, int64_t tile, int64_t keys, int64_t next_keys, bool partial) {
    // 1. Sᵀ = K_tile Qᵀ (scaled, base 2), masked on partial tiles, with the tile's row max.
    Vec tile_max[kQueryVecs];
    for (int u = 0; u < kQueryVecs; ++u) tile_max[u] = vset(-__builtin_inff());
    int64_t j0 = 0;
    for (; j0 + kRows <= keys; j0 += kRows) scores_rows<kRows>(b, tile, j0, partial, tile_max);
    if (j0 < keys) scores_tail<kRows - 1>(keys - j0, b, tile, j0, partial, tile_max);

    // 2. New max, rescale factor of the old state, Pᵀ = 2^(Sᵀ - m) in place, row sums.
    Vec shift[kQueryVecs], corr[kQueryVecs], sum[kQueryVecs];
    for (int u = 0; u < kQueryVecs; ++u) {
        const Vec m_old = vload(b.m + u * W);
        const Vec m_new = vmax(m_old, tile_max[u]);
        shift[u] = finite_or_zero(m_new);
        corr[u] = exp2_neg(vsub(m_old, shift[u]));  // 0 while m_old is -inf
        sum[u] = vmul(vload(b.l + u * W), corr[u]);
        vstore(b.m + u * W, m_new);
    }
    exp_pass(b, keys, shift, sum);
    for (int u = 0; u < kQueryVecs; ++u) vstore(b.l + u * W, sum[u]);
    // Once the running max settles, corr is all ones: skip multiplying Oᵀ by it.
    bool rescale = false;
    for (int u = 0; u < kQueryVecs; ++u) rescale = rescale || !all_ones(corr[u]);

    // 3. Oᵀ = corr * Oᵀ + Vᵀ Pᵀ, in passes of near-equal width (Dv = 64: 11+11+11+11+10+10,
    //    not 12 x 5 + 4), prefetching the next tile on the way.
    const int64_t passes = (b.Dv + kRows - 1) / kRows;
    PrefetchStream pf;
    int pf_steps = 0;
    if (next_keys > 0) {
        pf = PrefetchStream(b, tile + b.Bk, next_keys);
        pf_steps = static_cast<int>((pf.total_lines() + passes * keys - 1) / (passes * keys));
    }
    for (int64_t pass = 0, e0 = 0; pass < passes; ++pass) {
        const int64_t cols = b.Dv / passes + (pass < b.Dv % passes ? 1 : 0);
        pv_cols<kRows>(cols, b, tile, keys, e0, rescale ? corr : nullptr, pf, pf_steps);
        e0 += cols;
    }
}

// ---------------------------------------------------------------- one task
// r[c] <- column c of the 8 x 8 block whose rows are r[0..7] (AVX; both tiers have it).
inline void transpose8(__m256* r) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Sets up one sub-block: Qᵀ scaled into base 2 (exp(x) = 2^(x log2 e)), lanes past the
// last row 0; empty state.
void init_sub_block(const AttentionParams& p, Block& b, const float* q) {
    const float qscale = static_cast<float>(p.scale * 1.4426950408889634);
    const __m256 scale8 = _mm256_set1_ps(qscale);
    const int64_t D = b.D;
    int64_t i0 = 0;
    for (; i0 + 8 <= b.rows; i0 += 8) {  // 8 x 8 blocks through registers
        const float* q0 = q + (b.row_begin + i0) * p.q_row_stride;
        int64_t d0 = 0;
        for (; d0 + 8 <= D; d0 += 8) {
            __m256 r[8];
            for (int c = 0; c < 8; ++c) r[c] = _mm256_mul_ps(_mm256_loadu_ps(q0 + c * p.q_row_stride + d0), scale8);
            transpose8(r);
            for (int c = 0; c < 8; ++c) _mm256_store_ps(b.qt + (d0 + c) * Bq + i0, r[c]);
        }
        for (; d0 < D; ++d0)
            for (int c = 0; c < 8; ++c) b.qt[d0 * Bq + i0 + c] = q0[c * p.q_row_stride + d0] * qscale;
    }
    for (; i0 < b.rows; ++i0) {
        const float* qrow = q + (b.row_begin + i0) * p.q_row_stride;
        for (int64_t d = 0; d < D; ++d) b.qt[d * Bq + i0] = qrow[d] * qscale;
    }
    for (int64_t d = 0; d < D; ++d)
        for (int64_t i = b.rows; i < Bq; ++i) b.qt[d * Bq + i] = 0.0f;
    for (int64_t i = 0; i < Bq; ++i) {
        b.m[i] = -__builtin_inff();
        b.l[i] = 0.0f;
    }
    for (int64_t x = 0; x < b.Dv * Bq; ++x) b.ot[x] = 0.0f;
    // Ranges only move right as rows go down.
    b.first = visible_keys(p, b.row_begin, b.seqlen_k);
    b.last = visible_keys(p, b.row_begin + b.rows - 1, b.seqlen_k);
}

// out = Oᵀᵀ / l; lse = ln(l) + m ln 2. A row that saw no key (l == 0): zeros and -inf;
// a NaN in a score the row sees makes l NaN, and NaN goes on to out and lse.
void finish_sub_block(const AttentionParams& p, const Block& b, int64_t batch) {
    float* out = static_cast<float*>(p.out) + batch * p.out_batch_stride + b.head * p.out_head_stride;
    float* lse = static_cast<float*>(p.lse);
    if (lse) lse += batch * p.lse_batch_stride + b.head * p.lse_head_stride;
    alignas(64) float inv[Bq];
    const int64_t Dv = b.Dv;
    // A row that saw no key may still hold 0 x NaN from a value row other rows of its tiles
    // saw: its out is exactly 0 all the same.
    for (int64_t i = 0; i < b.rows; ++i)
        if (b.l[i] == 0.0f)
            for (int64_t e = 0; e < Dv; ++e) b.ot[e * Bq + i] = 0.0f;
    // Attention sink (gpt-oss): one more term of the denominator, no value; in the base-2
    // units of m and l. A row that saw no key gets m = sink, l = 1 (zeros, lse = sink).
    if (p.sinks) {
        const float sink = static_cast<float>(p.sinks[b.head] * 1.4426950408889634);
        for (int64_t i = 0; i < b.rows; ++i) {
            if (b.l[i] == 0.0f) {
                b.m[i] = sink;
                b.l[i] = 1.0f;
                continue;
            }
            const float m_new = b.m[i] > sink ? b.m[i] : sink;  // (a NaN m stays in l)
            const float corr = __builtin_exp2f(b.m[i] - m_new);
            b.l[i] = b.l[i] * corr + __builtin_exp2f(sink - m_new);
            b.m[i] = m_new;
            if (corr != 1.0f)
                for (int64_t e = 0; e < Dv; ++e) b.ot[e * Bq + i] *= corr;
        }
    }
    // l == 0: the row saw no key (zeros, lse -inf); l NaN (a NaN score) stays NaN in both.
    for (int64_t i = 0; i < Bq; ++i) inv[i] = b.l[i] != 0.0f ? 1.0f / b.l[i] : 0.0f;
    int64_t i0 = 0;
    for (; i0 + 8 <= b.rows; i0 += 8) {  // 8 x 8 blocks through registers
        float* o0 = out + (b.row_begin + i0) * p.out_row_stride;
        const __m256 inv8 = _mm256_load_ps(inv + i0);
        int64_t e0 = 0;
        for (; e0 + 8 <= Dv; e0 += 8) {
            __m256 r[8];
            for (int c = 0; c < 8; ++c) r[c] = _mm256_mul_ps(_mm256_load_ps(b.ot + (e0 + c) * Bq + i0), inv8);
            transpose8(r);
            for (int c = 0; c < 8; ++c) _mm256_storeu_ps(o0 + c * p.out_row_stride + e0, r[c]);
        }
        for (; e0 < Dv; ++e0)
            for (int c = 0; c < 8; ++c) o0[c * p.out_row_stride + e0] = b.ot[e0 * Bq + i0 + c] * inv[i0 + c];
    }
    for (; i0 < b.rows; ++i0) {
        float* orow = out + (b.row_begin + i0) * p.out_row_stride;
        for (int64_t e = 0; e < Dv; ++e) orow[e] = b.ot[e * Bq + i0] * inv[i0];
    }
    if (lse)
        for (int64_t i = 0; i < b.rows; ++i)
            lse[(b.row_begin + i) * p.lse_row_stride] =
                b.l[i] != 0.0f ? b.m[i] * 0.6931471805599453f + __builtin_logf(b.l[i]) : -__builtin_inff();
}

// Keys [tile, tile + keys) for sub-block b: masks when some lane's range cuts the tile.
void attend_sub_tile(const AttentionParams& p, const Block& b, int64_t tile, int64_t keys, int64_t next_keys) {
    const bool partial = tile < b.last.begin || tile + keys > b.first.end;
    if (partial) {
        // Padding lanes copy the last row's range so they never make a tile partial.
        for (int64_t i = 0; i < Bq; ++i) {
            const KeyRange r = visible_keys(p, b.row_begin + (i < b.rows ? i : b.rows - 1), b.seqlen_k);
            const int64_t rb = clamp64(r.begin - tile, 0, keys);
            b.rel_begin[i] = static_cast<int32_t>(rb);
            b.rel_end[i] = static_cast<int32_t>(clamp64(r.end - tile, rb, keys));
        }
    }
    attend_tile(b, tile, keys, next_keys, partial);
}

// One task: heads [head, head + head_count) (all of one KV head) x rows [row_begin, row_end),
// as sub-blocks of Bq rows. The keys are walked in L2-sized super-tiles; every sub-block
// walks a super-tile (in Bk tiles) before the next, so K and V come from L3 once per task
// instead of once per sub-block. The tile grid starts at the task's first visible key.
void attend_block(const AttentionParams& p, const BlockTask& task, float* workspace) {
    const Tiling t = tiling(p);
    const int64_t head_count = task.head_count;
    const int64_t row_blocks = (task.row_end - task.row_begin + Bq - 1) / Bq;
    const int64_t subs = head_count * row_blocks;  // <= kMaxSubBlocks (plan)
    const int64_t kv_head = task.head / (p.heads / p.kv_heads);

    float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(workspace) + 63) & ~uintptr_t(63));
    float* st = base;
    int32_t* rel_begin = reinterpret_cast<int32_t*>(st + t.Bk * Bq);
    int32_t* rel_end = rel_begin + Bq;
    float* sub_base = base + t.shared_elems;

    Block blocks[kMaxSubBlocks];
    int64_t kv_begin = 0, kv_end = 0;
    for (int64_t sidx = 0; sidx < subs; ++sidx) {
        Block& b = blocks[sidx];
        b.D = p.head_dim;
        b.Dv = p.head_dim_v;
        b.Bk = t.Bk;
        b.qt = sub_base + sidx * t.sub_elems;
        b.ot = b.qt + b.D * Bq;
        b.m = b.ot + b.Dv * Bq;
        b.l = b.m + Bq;
        b.st = st;
        b.rel_begin = rel_begin;
        b.rel_end = rel_end;
        b.k = static_cast<const float*>(p.k) + task.batch * p.k_batch_stride + kv_head * p.k_head_stride;
        b.v = static_cast<const float*>(p.v) + task.batch * p.v_batch_stride + kv_head * p.v_head_stride;
        b.k_stride = p.k_row_stride;
        b.v_stride = p.v_row_stride;
        b.head = task.head + sidx / row_blocks;
        b.row_begin = task.row_begin + (sidx % row_blocks) * Bq;
        b.rows = task.row_end - b.row_begin < Bq ? task.row_end - b.row_begin : Bq;
        b.seqlen_k = batch_seqlen_k(p, task.batch);
        const float* q = static_cast<const float*>(p.q) + task.batch * p.q_batch_stride + b.head * p.q_head_stride;
        init_sub_block(p, b, q);
        if (sidx == 0 || b.first.begin < kv_begin) kv_begin = b.first.begin;
        if (sidx == 0 || b.last.end > kv_end) kv_end = b.last.end;
    }

    for (int64_t super = kv_begin; super < kv_end; super += t.super_keys) {
        const int64_t super_end = super + t.super_keys < kv_end ? super + t.super_keys : kv_end;
        int64_t covered = super;  // keys of this super-tile some earlier sub-block has read
        for (int64_t sidx = 0; sidx < subs; ++sidx) {
            const Block& b = blocks[sidx];
            const int64_t lo = b.first.begin, hi = b.last.end < super_end ? b.last.end : super_end;
            int64_t tile = super;
            if (lo > tile) tile += round_down(lo - tile, t.Bk);  // skip tiles before the range
            for (; tile < hi; tile += t.Bk) {
                const int64_t keys = hi - tile < t.Bk ? hi - tile : t.Bk;
                // Prefetch the next tile unless an earlier sub-block already brought it in.
                int64_t next_keys = 0;
                if (t.prefetch && tile + t.Bk >= covered) {
                    const int64_t after = kv_end - (tile + t.Bk);
                    next_keys = after <= 0 ? 0 : (after < t.Bk ? after : t.Bk);
                }
                attend_sub_tile(p, b, tile, keys, next_keys);
            }
            if (hi > covered) covered = hi;
        }
    }
    for (int64_t sidx = 0; sidx < subs; ++sidx) finish_sub_block(p, blocks[sidx], task.batch);
}

}  // namespace simd
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
