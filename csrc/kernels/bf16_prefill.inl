// bfloat16 prefill with AVX512_BF16's vdpbf16ps, for bfloat16 q, k, v (a model run in
// bfloat16). Included by kernels/isa_avx512bf16.cpp after simd_prefill.inl, whose layout it
// keeps (queries in vector lanes, Bq = 32 rows per sub-block; Sᵀ, Oᵀ and the online softmax
// in float32; the task loop simd::run_task, driven with this file's policy Bf16Kernel, and
// the tiling, task plan, softmax update, prefetch and finish (rounding out to bfloat16)
// shared) and whose micro-kernels it replaces by ones that do 32 multiply-adds per
// instruction on bfloat16 pairs:
//   S micro-kernel:  Qᵀ is held as pairs (q[i][2d], q[i][2d+1]), one 32-bit word per query
//                    lane, exactly as stored (the scale multiplies the float32 scores, so q
//                    is not rounded); each K pair (k[t][2d], k[t][2d+1]) is one 32-bit
//                    broadcast from the caller's array: acc[t][v] += qt2[d][v] . kpair.
//   PV micro-kernel: Pᵀ rows j, j+1 become one row of pairs (p[j][i], p[j+1][i]) rounded to
//                    bfloat16 (relative error <= 2^-9 per weight, as FlashAttention; the row
//                    sums l stay float32 sums of the unrounded weights); the tile's V rows
//                    are packed once per tile into pairs (v[j][e], v[j+1][e]):
//                    acc[e][v] += pt2[j/2][v] . vpair[j/2][e].
// An odd D and the score options softcap / ALiBi / mask take the tier's widening kernel
// (simd_prefill.inl: see prefill_kernel); sinks are applied by the shared finish. A paged
// pool is read in place, row by row through the tile's row addresses (simd::find_tile_rows).
#pragma once
#if !defined(__AVX512BF16__)
#error "bf16_prefill.inl needs AVX512_BF16"
#endif
#include "simd_prefill.inl"

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace bf16_prefill {

using simd::Bq;
using simd::kQueryVecs;
using simd::kRows;
using simd::Vec;
using simd::W;

// Words (two bfloat16) of Qᵀ per query lane: D / 2; Qᵀ rows of pairs are Bq words apart.
inline __m512bh as_pairs(__m512i x) { return (__m512bh)x; }
inline __m512bh load_pairs(const uint32_t* p) { return as_pairs(_mm512_load_si512(p)); }
inline __m512bh broadcast_pair(const bf16_t* p) {
    int32_t word;
    __builtin_memcpy(&word, p, sizeof word);  // two adjacent bfloat16 of one row
    return as_pairs(_mm512_set1_epi32(word));
}

// What one task's kernel needs beyond simd::Block: the packed V tile.
struct Scratch {
    uint32_t* v_pairs;  // ceil(Bk / 2) x Dv words: (v[2j][e], v[2j + 1][e])
};

inline int64_t scratch_elems(const AttentionParams& p, const simd::Tiling& t) {
    return (t.Bk + 1) / 2 * p.head_dim_v;
}

PrefillPlan plan(const AttentionParams& p) {
    PrefillPlan plan = simd::plan(p);  // (its Qᵀ of D floats per lane holds our D / 2 words)
    plan.workspace_elems += scratch_elems(p, simd::tiling(p));
    return plan;
}

// Sᵀ rows [j0, j0 + R) of the tile at key `tile` (see simd::scores_rows): R keys x Bq lanes,
// D / 2 pair steps, then scaled into base 2.
template <int R, bool kByAddress, int QV>
__attribute__((always_inline)) inline void scores_rows(const simd::Block& b, int64_t tile, int64_t j0,
                                                       bool partial, float scale2, Vec* tile_max) {
    Vec acc[R][QV];
#pragma GCC unroll 16
    for (int t = 0; t < R; ++t)
#pragma GCC unroll 4
        for (int u = 0; u < QV; ++u) acc[t][u] = simd::vzero();
    const bf16_t* krow[R];
    const bf16_t* k = reinterpret_cast<const bf16_t*>(b.k);
    if constexpr (kByAddress) {
#pragma GCC unroll 16
        for (int t = 0; t < R; ++t) krow[t] = reinterpret_cast<const bf16_t*>(b.k_rows[j0 + t]);
    } else {
#pragma GCC unroll 16
        for (int t = 0; t < R; ++t) krow[t] = k + (tile - b.kv_first + j0 + t) * b.k_stride;
    }
    const uint32_t* q = reinterpret_cast<const uint32_t*>(b.qt);
    for (int64_t d = 0; d < b.D; d += 2, q += Bq) {
        __m512bh qv[QV];
#pragma GCC unroll 4
        for (int u = 0; u < QV; ++u) qv[u] = load_pairs(q + u * W);
#pragma GCC unroll 16
        for (int t = 0; t < R; ++t) {
            const __m512bh kb = broadcast_pair(krow[t] + d);
#pragma GCC unroll 4
            for (int u = 0; u < QV; ++u) acc[t][u] = _mm512_dpbf16_ps(acc[t][u], qv[u], kb);
        }
    }
    const Vec sv = simd::vset(scale2);
    float* s = b.st + j0 * Bq;
#pragma GCC unroll 16
    for (int t = 0; t < R; ++t)
#pragma GCC unroll 4
        for (int u = 0; u < QV; ++u) {
            Vec x = simd::neg_inf_to_nan(simd::vmul(acc[t][u], sv));  // -inf only from an infinite input
            if (partial)
                x = simd::keep_or_neg_inf(simd::key_visible(b.rel_begin + u * W, b.rel_end + u * W,
                                                            static_cast<int32_t>(j0 + t)), x);
            tile_max[u] = simd::vmax(tile_max[u], x);
            simd::vstore(s + t * Bq + u * W, x);
        }
}

// Oᵀ rows [e0, e0 + R) = corr * Oᵀ + Vᵀ Pᵀ over `pairs` key pairs (corr nullptr: all ones).
template <int R, bool kPrefetchByAddress, int QV>
void pv_rows(const simd::Block& b, const Scratch& sc, int64_t pairs, int64_t e0, const Vec* corr,
             simd::PrefetchStream<kPrefetchByAddress>& pf, int pf_steps) {
    Vec acc[R][QV];
    float* o = b.ot + e0 * Bq;
#pragma GCC unroll 16
    for (int t = 0; t < R; ++t)
#pragma GCC unroll 4
        for (int u = 0; u < QV; ++u)
            acc[t][u] = corr ? simd::vmul(simd::vload(o + t * Bq + u * W), corr[u]) : simd::vload(o + t * Bq + u * W);
    const uint32_t* vp = sc.v_pairs + e0;
    const uint32_t* pt = reinterpret_cast<const uint32_t*>(b.st);
    for (int64_t j = 0; j < pairs; ++j, vp += b.Dv, pt += Bq) {
        for (int i = 0; i < pf_steps; ++i) pf.step();
        __m512bh pv[QV];
#pragma GCC unroll 4
        for (int u = 0; u < QV; ++u) pv[u] = load_pairs(pt + u * W);
#pragma GCC unroll 16
        for (int t = 0; t < R; ++t) {
            const __m512bh vb = as_pairs(_mm512_set1_epi32(static_cast<int32_t>(vp[t])));
#pragma GCC unroll 4
            for (int u = 0; u < QV; ++u) acc[t][u] = _mm512_dpbf16_ps(acc[t][u], pv[u], vb);
        }
    }
#pragma GCC unroll 16
    for (int t = 0; t < R; ++t)
#pragma GCC unroll 4
        for (int u = 0; u < QV; ++u) simd::vstore(o + t * Bq + u * W, acc[t][u]);
}

template <int R, bool kByAddress, int QV>
inline void scores_tail(int64_t rows, const simd::Block& b, int64_t tile, int64_t j0, bool partial,
                        float scale2, Vec* tile_max) {
    if (rows == R) scores_rows<R, kByAddress, QV>(b, tile, j0, partial, scale2, tile_max);
    else if constexpr (R > 1) scores_tail<R - 1, kByAddress, QV>(rows, b, tile, j0, partial, scale2, tile_max);
}
template <int R, bool kPrefetchByAddress, int QV>
inline void pv_cols(int64_t cols, const simd::Block& b, const Scratch& sc, int64_t pairs, int64_t e0,
                    const Vec* corr, simd::PrefetchStream<kPrefetchByAddress>& pf, int pf_steps) {
    if (cols == R) pv_rows<R, kPrefetchByAddress, QV>(b, sc, pairs, e0, corr, pf, pf_steps);
    else if constexpr (R > 1) pv_cols<R - 1, kPrefetchByAddress, QV>(cols, b, sc, pairs, e0, corr, pf, pf_steps);
}

// V rows [tile, tile + keys) as pairs of rows, one 32-bit word per column; a missing row
// after an odd count is zeros (never read from the array).
void pack_values(const simd::Block& b, const Scratch& sc, int64_t tile, int64_t keys) {
    const __m512i first = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004,
                                            0x00250005, 0x00260006, 0x00270007, 0x00280008, 0x00290009,
                                            0x002A000A, 0x002B000B, 0x002C000C, 0x002D000D, 0x002E000E,
                                            0x002F000F);  // words i: (x[i], y[i]), i < 16
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));  // i in 16..31
    const bf16_t* v = b.v_rows ? nullptr : reinterpret_cast<const bf16_t*>(b.v) + (tile - b.kv_first) * b.v_stride;
    const int64_t Dv = b.Dv;
    for (int64_t j = 0; j < keys; j += 2) {
        const bf16_t* x = b.v_rows ? reinterpret_cast<const bf16_t*>(b.v_rows[j]) : v + j * b.v_stride;
        const bf16_t* y = j + 1 >= keys ? nullptr
                          : b.v_rows ? reinterpret_cast<const bf16_t*>(b.v_rows[j + 1]) : x + b.v_stride;
        uint32_t* out = sc.v_pairs + (j / 2) * Dv;
        int64_t e = 0;
        for (; e + 32 <= Dv; e += 32) {
            const __m512i xv = _mm512_loadu_si512(x + e);
            const __m512i yv = y ? _mm512_loadu_si512(y + e) : _mm512_setzero_si512();
            _mm512_storeu_si512(out + e, _mm512_permutex2var_epi16(xv, first, yv));
            _mm512_storeu_si512(out + e + 16, _mm512_permutex2var_epi16(xv, second, yv));
        }
        for (; e < Dv; ++e)
            out[e] = static_cast<uint32_t>(x[e].bits) | (y ? static_cast<uint32_t>(y[e].bits) << 16 : 0u);
    }
}

// Pᵀ rows (2j, 2j + 1) -> row j of bfloat16 pairs, in place (row j's words sit over float
// row j, already read); a missing row after an odd count weighs 0.
template <int QV>
inline void pair_weights(const simd::Block& b, int64_t keys) {
    const __m512i interleave = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004,
                                                 0x00150005, 0x00160006, 0x00170007, 0x00180008, 0x00190009,
                                                 0x001A000A, 0x001B000B, 0x001C000C, 0x001D000D, 0x001E000E,
                                                 0x001F000F);  // words i: (lo[i], hi[i])
    for (int64_t j = 0; j < keys; j += 2) {
        const float* even = b.st + j * Bq;
        uint32_t* out = reinterpret_cast<uint32_t*>(b.st) + (j / 2) * Bq;
        for (int u = 0; u < QV; ++u) {
            const Vec lo = simd::vload(even + u * W);
            const Vec hi = j + 1 < keys ? simd::vload(even + Bq + u * W) : simd::vzero();
            // cvtne2ps: bfloat16 of hi in words 16..31, of lo in words 0..15
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
            _mm512_store_si512(out + u * W, _mm512_permutexvar_epi16(interleave, both));
        }
    }
}

// simd::attend_tile_rows with the bfloat16 micro-kernels. Not inlined into simd::run_task,
// so that the compiler's choices inside it (which micro-tiles it inlines) stay as measured.
template <simd::RowSource kSrc, int QV>
__attribute__((noinline)) void attend_tile(const simd::Block& b, const Scratch& sc, int64_t tile, int64_t keys,
                                           int64_t next_keys, bool partial, float scale2) {
    constexpr bool kByAddress = simd::reads_by_address(kSrc);
    constexpr bool kPrefetchByAddress = simd::prefetches_by_address(kSrc);
    Vec tile_max[QV];
    for (int u = 0; u < QV; ++u) tile_max[u] = simd::vset(-__builtin_inff());
    int64_t j0 = 0;
    constexpr int R = kByAddress && simd::tile_rows<QV>() > simd::kAddressRows ? simd::kAddressRows
                                                                               : simd::tile_rows<QV>();
    for (; j0 + R <= keys; j0 += R) scores_rows<R, kByAddress, QV>(b, tile, j0, partial, scale2, tile_max);
    if (j0 < keys) scores_tail<R - 1, kByAddress, QV>(keys - j0, b, tile, j0, partial, scale2, tile_max);
    pack_values(b, sc, tile, keys);  // (its V rows load while the scores finish)

    Vec corr[QV];
    const bool rescale = simd::online_softmax<QV>(b.st, simd::Bq, keys, b.m, b.l, tile_max, corr);
    pair_weights<QV>(b, keys);

    const int64_t pairs = (keys + 1) / 2;
    constexpr int RV = simd::tile_rows<QV>();
    const int64_t passes = (b.Dv + RV - 1) / RV;
    simd::PrefetchStream<kPrefetchByAddress> pf;
    const int pf_steps = simd::prefetch_next_tile(b, tile, next_keys, sizeof(bf16_t), passes * pairs, pf);
    for (int64_t pass = 0, e0 = 0; pass < passes; ++pass) {
        const int64_t cols = b.Dv / passes + (pass < b.Dv % passes ? 1 : 0);
        pv_cols<RV, kPrefetchByAddress, QV>(cols, b, sc, pairs, e0, rescale ? corr : nullptr, pf, pf_steps);
        e0 += cols;
    }
}

// Qᵀ as pairs, lane i from query row q[i] (i < b.rows): word (d / 2, i) = q[i][d], q[i][d + 1]
// (a 32-bit transpose of the rows); lanes past the last row 0.
void stage_queries(simd::Block& b, const bf16_t* const* q) {
    uint32_t* qt = reinterpret_cast<uint32_t*>(b.qt);
    const int64_t words = b.D / 2;
    for (int64_t i = 0; i < Bq; ++i)
        for (int64_t w = 0; w < words; ++w) {
            uint32_t word = 0;
            if (i < b.rows) __builtin_memcpy(&word, q[i] + 2 * w, sizeof word);
            qt[w * Bq + i] = word;
        }
}

// The task loop's policy (see simd::WidenKernel) for bfloat16 q, k, v: K and V read in
// place (bfloat16 rows), Qᵀ as pairs, the tile's packed V rows in the workspace past the
// sub-blocks.
struct Bf16Kernel {
    using Q = bf16_t;
    using KV = bf16_t;
    static constexpr bool kWidened = false;
    static int64_t extra_elems(const AttentionParams& p, const simd::Tiling& t) { return scratch_elems(p, t); }
    Scratch sc;
    float scale2;  // scale * log2(e): the scores in base 2 (Qᵀ is not pre-scaled)
    Bf16Kernel(const AttentionParams& p, float* extra)
        : sc{reinterpret_cast<uint32_t*>(extra)}, scale2(static_cast<float>(p.scale * kLog2e)) {}
    void stage_queries(const AttentionParams&, simd::Block& b, const bf16_t* const* q) const {
        bf16_prefill::stage_queries(b, q);
    }
    void attend(const AttentionParams& p, const simd::Block& b, int64_t /*batch*/, int64_t tile, int64_t keys,
                int64_t next_keys) const {
        const bool partial = simd::tile_ranges(b, tile, keys);
        if (b.k_rows) simd::find_tile_rows(b, tile, keys);
        // (one query vector for at most W rows: see simd::attend_tile)
        simd::with_row_source(b, [&](auto src) {
            if (b.rows <= W) attend_tile<decltype(src)::value, 1>(b, sc, tile, keys, next_keys, partial, scale2);
            else attend_tile<decltype(src)::value, kQueryVecs>(b, sc, tile, keys, next_keys, partial, scale2);
        });
    }
};

inline bool covers(const AttentionParams& p) {
    return p.dtype == DType::kBF16 && p.kv_dtype == DType::kBF16 && p.head_dim % 2 == 0 &&
           p.softcap == 0.0 && !p.alibi_slopes && !p.mask;
}

void attend_block(const AttentionParams& p, const BlockTask& task, float* workspace) {
    simd::run_task<Bf16Kernel>(p, task, workspace);
}

// KernelTable::prefill_kernel of this tier: this kernel where it covers the call, else the
// widening one (simd_prefill.inl).
PrefillKernel prefill_kernel(const AttentionParams& p) {
    if (!covers(p)) return simd::prefill_kernel(p);
    return {KernelId::kBf16Prefill, attend_block, plan};
}

}  // namespace bf16_prefill

// simd_prefill's micro-tile shape (Bq rows x kRows keys), both products by vdpbf16ps.
template <> struct PolicyOf<KernelId::kBf16Prefill> {
    static KernelPolicy of(const AttentionParams&) {
        return {simd::Bq, simd::kRows, Product::kBf16Pairs, Product::kBf16Pairs};
    }
};
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
