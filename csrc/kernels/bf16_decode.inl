// bfloat16 decode with AVX512_BF16's vdpbf16ps, for bfloat16 q over a bfloat16 cache (a
// model run in bfloat16). Included by kernels/isa_avx512bf16.cpp after simd_decode.inl; it runs
// the one decode loop (decode_loop) with its own arithmetic policy (Bf16Path); every other call goes to the
// widening kernel of this tier.
//
// Why: widening costs two instructions per 16 K or V values on top of the float32 FMAs,
// and with 4 query rows per KV head (32/8 heads) a 16-bit cache read at memory speed needs
// more FMAs per second than one core issues. vdpbf16ps takes bfloat16 pairs as they are
// stored and does 32 multiply-adds per instruction, accumulating in float32:
//   * q . k: q is used as given (bfloat16, exact: the scale multiplies the float32 score
//     afterwards), so the scores carry no rounding beyond float32 accumulation.
//   * p . v: the probabilities are rounded to bfloat16 (relative error <= 2^-9 per weight;
//     the row sum l stays the float32 sum of the unrounded ones, as in FlashAttention), in
//     place over their float32 row. V rows j and j+1 are interleaved in registers
//     (vpunpck{l,h}wd) so each 32-bit lane holds (v[j][c], v[j+1][c]) for one column c;
//     the accumulators then hold columns in a fixed permuted order within each group of 32,
//     undone once when the chunk finishes.
#pragma once
#if !defined(__AVX512BF16__)
#error "bf16_decode.inl needs AVX512_BF16"
#endif
#include "simd_decode.inl"

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace bf16_decode {

using simd_decode::W;  // 16 float32 lanes

inline __m512bh load_pairs(const void* p) { return (__m512bh)_mm512_loadu_si512(p); }

// s[r * ss + j] = scale * q[r] . k[j] for RB rows (bfloat16 rows qs elements apart) and the
// first `keys` of W / RB keys; as simd_decode::score_keys (same access order, V prefetch),
// 32 elements of D per instruction. ND: D / 32 (0: any multiple of 32).
template <int RB, int ND>
inline void score_keys(const bf16_t* __restrict q, int64_t qs, const bf16_t* __restrict k,
                       int64_t ks, int64_t keys, int64_t D, float scale, float* __restrict s,
                       int64_t ss, const char* vpf, int64_t vsb, int64_t vrow_bytes) {
    constexpr int KB = W / RB;
    const int64_t nd = ND > 0 ? ND : D / 32;
    if constexpr (RB == 1) {  // one key at a time (as simd_decode::OneKeyScores; same bits):
                              // D = 64 / 128 / 256 1.03-1.10x with the prefetch, HISTORY 37
        for (int64_t j = 0; j < keys; ++j) {
            if (vpf)
                for (int64_t off = 0; off < vrow_bytes; off += 64) __builtin_prefetch(vpf + j * vsb + off, 0, 2);
            const bf16_t* krow = k + j * ks;
            __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 4
            for (int64_t c = 0; c < nd; ++c) acc = _mm512_dpbf16_ps(acc, load_pairs(q + c * 32), load_pairs(krow + c * 32));
            s[j] = simd::lane_sum(acc) * scale;
        }
        return;
    }
    const bf16_t* kp[KB];
    for (int j = 0; j < KB; ++j) kp[j] = k + (j < keys ? j : keys - 1) * ks;
    __m512 acc[W];
    for (int n = 0; n < W; ++n) acc[n] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int j = 0; j < KB; ++j) {
        if (vpf && j < keys)
            for (int64_t off = 0; off < vrow_bytes; off += 64) __builtin_prefetch(vpf + j * vsb + off, 0, 2);
        for (int64_t c = 0; c < nd; ++c) {
            const __m512bh kv = load_pairs(kp[j] + c * 32);
            for (int r = 0; r < RB; ++r)
                acc[r * KB + j] = _mm512_dpbf16_ps(acc[r * KB + j], load_pairs(q + r * qs + c * 32), kv);
        }
    }
    const __m512 dots = _mm512_mul_ps(simd::transpose_reduce(acc), _mm512_set1_ps(scale));
    for (int r = 0; r < RB; ++r) simd::store_lanes(s + r * ss - r * KB, dots, r * KB, keys);
}

// Weights of keys j and j + 1 as one 32-bit word (any alignment: a run of keys may start
// at an odd key of a block).
inline int32_t weight_pair(const bf16_t* p) {
    int32_t word;
    __builtin_memcpy(&word, p, sizeof word);
    return word;
}

// acc[r] += sum_{0 <= j < keys} p[r][j] * v[j] over NG groups of 32 columns, accumulators in
// registers. p rows are bfloat16, ps elements apart; after an odd count the last key is paired
// with `partner` (the V row of key `keys`, where a paged cache's block ends cut a pair) or
// else with a zero V vector (the weight next to it is then 0: weights_ready). acc
// layout per group: 16 lanes of columns {0-3, 8-11, 16-19, 24-27}, then 16 of {4-7, 12-15,
// 20-23, 28-31} (vpunpck{l,h}wd's order).
template <int RB, int NG, bool kPrefetch = false>
inline void pv_tile(float* __restrict acc, int64_t acc_stride, const bf16_t* __restrict p,
                    int64_t ps, const bf16_t* __restrict v, int64_t vs, int64_t keys,
                    const bf16_t* partner, const RowPrefetch& kpf = RowPrefetch{}, int64_t l0 = 0,
                    int64_t l1 = 0) {
    __m512 a[RB][2 * NG];
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < 2 * NG; ++c) a[r][c] = _mm512_loadu_ps(acc + r * acc_stride + c * W);
    for (int64_t j = 0; j < keys; j += 2) {
        if constexpr (kPrefetch)  // lines [l0, l1) of kpf's rows j, j + 1
            for (int64_t x = j; x < j + 2 && x < kpf.rows; ++x)
                for (int64_t l = l0; l < l1; ++l) __builtin_prefetch(kpf.first + x * kpf.stride + l * 64, 0, 2);
        const bf16_t* v0 = v + j * vs;
        const bf16_t* v1 = j + 1 < keys ? v0 + vs : partner;
        __m512bh lo[NG], hi[NG];
        for (int g = 0; g < NG; ++g) {
            const __m512i x = _mm512_loadu_si512(v0 + g * 32);
            const __m512i y = v1 ? _mm512_loadu_si512(v1 + g * 32) : _mm512_setzero_si512();
            lo[g] = (__m512bh)_mm512_unpacklo_epi16(x, y);
            hi[g] = (__m512bh)_mm512_unpackhi_epi16(x, y);
        }
        for (int r = 0; r < RB; ++r) {
            const __m512bh pr = (__m512bh)_mm512_set1_epi32(weight_pair(p + r * ps + j));
            for (int g = 0; g < NG; ++g) {
                a[r][2 * g] = _mm512_dpbf16_ps(a[r][2 * g], lo[g], pr);
                a[r][2 * g + 1] = _mm512_dpbf16_ps(a[r][2 * g + 1], hi[g], pr);
            }
        }
    }
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < 2 * NG; ++c) _mm512_storeu_ps(acc + r * acc_stride + c * W, a[r][c]);
}

// All Dv columns (a multiple of 32) for RB rows: 16 accumulators a tile, then single groups.
// kpf: rows to start towards L2 (the next K rows, or a paged cache's V rows further on), a
// share of each row's lines per tile (simd_decode's pv_rows).
template <int RB>
inline void pv_rows(float* acc, int64_t Dv, const bf16_t* p, int64_t ps, const bf16_t* v,
                    int64_t vs, int64_t keys, const bf16_t* partner, const RowPrefetch& kpf) {
    constexpr int NG = RB == 4 ? 2 : 4;
    const int64_t tiles = Dv / (NG * 32), lines = (kpf.row_bytes + 63) / 64;
    const auto partner_at = [partner](int64_t e) { return partner ? partner + e : nullptr; };
    int64_t e = 0;
    if (kpf.rows > 0 && tiles > 0) {
        for (int64_t t = 0; e + NG * 32 <= Dv; e += NG * 32, ++t)
            pv_tile<RB, NG, true>(acc + e, Dv, p, ps, v + e, vs, keys, partner_at(e), kpf,
                                  lines * t / tiles, lines * (t + 1) / tiles);
    } else {
        prefetch_rows(kpf);  // (none, or Dv holds no whole tile)
        for (; e + NG * 32 <= Dv; e += NG * 32) pv_tile<RB, NG>(acc + e, Dv, p, ps, v + e, vs, keys, partner_at(e));
    }
    for (; e < Dv; e += 32) pv_tile<RB, 1>(acc + e, Dv, p, ps, v + e, vs, keys, partner_at(e));
}

// decode_loop's arithmetic for bfloat16 q and K/V (see the top of this file).
template <int ND>
struct Bf16Path : simd_decode::VectorSoftmax {
    using Q = bf16_t;
    using KV = bf16_t;
    static constexpr bool kSpreadPrefetch = true;
    static constexpr bool kPairedValues = true;
    // A staged row is D bfloat16 values: D / 2 floats of workspace.
    static int64_t query_stride(const AttentionParams& p) { return p.head_dim / 2; }
    static void stage_query(float* qs, const bf16_t* qrow, int64_t D, float) {
        bf16_t* row = reinterpret_cast<bf16_t*>(qs);
        for (int64_t d = 0; d < D; ++d) row[d] = qrow[d];
    }
    // The scale, which stage_query left out, multiplies each float32 score.
    static void scores(int64_t n, const float* qs, int64_t qstride, const bf16_t* kj,
                       int64_t ks, int64_t nk, int64_t D, float* sj, int64_t ss, const char* vj,
                       int64_t vsb, int64_t v_row_bytes, float scale) {
        const bf16_t* q = reinterpret_cast<const bf16_t*>(qs);
        const int64_t qe = 2 * qstride;  // bfloat16 elements between staged rows
        int64_t rb = 0;
        for (; rb + kRowBlock <= n; rb += kRowBlock)
            for (int64_t j = 0; j < nk; j += W / kRowBlock)
                score_keys<kRowBlock, ND>(q + rb * qe, qe, kj + j * ks, ks,
                                          nk - j < W / kRowBlock ? nk - j : W / kRowBlock, D, scale,
                                          sj + rb * ss + j, ss, rb == 0 && vj ? vj + j * vsb : nullptr,
                                          vsb, v_row_bytes);
        if (n - rb >= 2) {
            for (int64_t j = 0; j < nk; j += W / 2)
                score_keys<2, ND>(q + rb * qe, qe, kj + j * ks, ks, nk - j < W / 2 ? nk - j : W / 2, D,
                                  scale, sj + rb * ss + j, ss, rb == 0 && vj ? vj + j * vsb : nullptr,
                                  vsb, v_row_bytes);
            rb += 2;
        }
        if (n - rb == 1)
            score_keys<1, ND>(q + rb * qe, qe, kj, ks, nk, D, scale, sj + rb * ss, ss,
                              rb == 0 ? vj : nullptr, vsb, v_row_bytes);
    }
    // Probabilities to bfloat16 in place (element c over the first half of the row), and a
    // zero after an odd count so the last pair's second weight is 0 (finite: it meets a zero
    // V vector).
    static void weights_ready(float* srow, int64_t keys) {
        bf16_t* out = reinterpret_cast<bf16_t*>(srow);
        for (int64_t c = 0; c < keys; c += W) {  // reads floats c.., writes bytes 2c..: behind
            const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(srow + c));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), (__m256i)h);
        }
        if (keys & 1) out[keys].bits = 0;
    }
    static void values(int64_t n, float* acc, int64_t Dv, const float* s_block, int64_t ss,
                       int64_t c0, const bf16_t* vrun, int64_t vs, int64_t keys,
                       const RowPrefetch& kpf, const bf16_t* partner) {
        // row rr's bfloat16 weights start at s_block + rr * ss (2 * ss elements apart)
        const bf16_t* pb = reinterpret_cast<const bf16_t*>(s_block) + c0;
        const int64_t ps = 2 * ss;
        int64_t rb = 0;
        for (; rb + kRowBlock <= n; rb += kRowBlock)
            pv_rows<kRowBlock>(acc + rb * Dv, Dv, pb + rb * ps, ps, vrun, vs, keys, partner, rb == 0 ? kpf : RowPrefetch{});
        if (n - rb >= 2) {
            pv_rows<2>(acc + rb * Dv, Dv, pb + rb * ps, ps, vrun, vs, keys, partner, rb == 0 ? kpf : RowPrefetch{});
            rb += 2;
        }
        if (n - rb == 1)
            pv_rows<1>(acc + rb * Dv, Dv, pb + rb * ps, ps, vrun, vs, keys, partner, rb == 0 ? kpf : RowPrefetch{});
    }
    // Columns back in order: per group of 32, 128-bit pieces l0..l3 (low half) and h0..h3
    // (high half) become l0 h0 l1 h1 | l2 h2 l3 h3.
    static void finish(float* acc, int64_t rows, int64_t Dv) {
        const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < Dv; c += 32) {
                float* g = acc + r * Dv + c;
                const __m512 lo = _mm512_loadu_ps(g), hi = _mm512_loadu_ps(g + W);
                _mm512_storeu_ps(g, _mm512_permutex2var_ps(lo, first, hi));
                _mm512_storeu_ps(g + W, _mm512_permutex2var_ps(lo, second, hi));
            }
    }
};

inline bool covers(const AttentionParams& p) {
    return p.dtype == DType::kBF16 && p.kv_dtype == DType::kBF16 && p.head_dim % 32 == 0 &&
           p.head_dim_v % 32 == 0 && p.softcap == 0.0 && !p.alibi_slopes && !p.mask;
}

// One chunk, for a call covers() takes.
void chunk(const AttentionParams& p, const DecodeTask& task, float* ws, float* acc, float* m,
           float* l) {
    if (p.head_dim == 128) decode_loop<Bf16Path<4>>(p, task, ws, acc, m, l);
    else if (p.head_dim == 64) decode_loop<Bf16Path<2>>(p, task, ws, acc, m, l);
    else decode_loop<Bf16Path<0>>(p, task, ws, acc, m, l);
}

// KernelTable::decode_kernel of this tier: this kernel where it covers the call, else the
// widening one's choice.
DecodeKernel decode_kernel(const AttentionParams& p) {
    if (!covers(p)) return simd_decode::decode_kernel(p);
    return {KernelId::kBf16Decode, chunk};
}

}  // namespace bf16_decode

// As simd_decode's (kRowBlock rows x W / kRowBlock keys per score_keys call), both products
// by vdpbf16ps on bfloat16 pairs.
template <> struct PolicyOf<KernelId::kBf16Decode> {
    static KernelPolicy of(const AttentionParams&) {
        return {kRowBlock, simd::W / kRowBlock, Product::kBf16Pairs, Product::kBf16Pairs};
    }
};
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
