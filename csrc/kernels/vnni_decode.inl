// int8 decode with AVX512-VNNI's vpdpbusd for Q·Kᵀ over an int8 cache. Included by
// kernels/isa_avx512bf16.cpp after simd_decode.inl; it runs the one decode loop (decode_loop)
// with its own arithmetic policy (VnniPath); P·V and every other call stay on the widening kernels.
//
// Why: widening int8 K costs a vpmovsxbd, a vcvtdq2ps and an FMA per 16 values and query
// row, so an int8 step is compute-bound at a fraction of memory speed. vpdpbusd does 64
// byte products per instruction with exact int32 sums:
//   * each staged query row (scale already applied) is quantised to int8 on the fly with its
//     own scale sq = max|q| / 127 (round to nearest even) — the one rounding this path adds
//     (measured in docs/user_guide/formats.md; ATTNFAST_INT8_DOT=widen selects the exact
//     widening path instead);
//   * vpdpbusd multiplies unsigned by signed bytes, so the keys are made unsigned (k + 128:
//     one vpxord with 0x80 per 64 bytes) and the query bytes stay signed:
//     sum (k + 128) qi = sum k qi + 128 sum qi, the last term one number per query row;
//   * the sums are integers below 2^24 (|sum| <= 255 * 127 * D, D <= 512 here), so they are
//     exact in float32 and the transpose-reduce tree adds them without rounding: a score is
//     sq * (dot - 128 sum qi), one rounding, then the key's row scale (decode_loop).
// NaN / inf in q: the row's scale is NaN, so are its scores (the NaN rule holds).
//
// P·V by vpdpbusd too (widened, it cost three instructions per 16 values and row against
// one for the scores): see ValueQuads below.
#pragma once
#if !defined(__AVX512VNNI__)
#error "vnni_decode.inl needs AVX512-VNNI"
#endif
#include "bf16_decode.inl"

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace vnni_decode {

using simd_decode::W;  // 16 int32 / float32 lanes

// Bytes of int8 query per row and where its scale and correction sit, in floats of a
// staged row: [0, D/4) the bytes, then sq, then 128 * sum qi.
inline int64_t bytes_floats(int64_t D) { return (D / 4 + 15) / 16 * 16; }

// s[r * ss + j] = sq_r * (q_r . k_j) for RB rows and the first `keys` of W / RB keys
// (int8 key rows ks bytes apart), as simd_decode::score_keys (same access order and V
// prefetch), 64 elements of D per vpdpbusd. ND: D / 64 (0: any multiple of 64).
template <int RB, int ND>
inline void score_keys(const float* __restrict q, int64_t qs, const int8_t* __restrict k,
                       int64_t ks, int64_t keys, int64_t D, float* __restrict s, int64_t ss,
                       const char* vpf, int64_t vsb, int64_t vrow_bytes) {
    constexpr int KB = W / RB;
    const int64_t nd = ND > 0 ? ND : D / 64;
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const int64_t tail = bytes_floats(D);
    if constexpr (RB == 1) {  // one key at a time (as simd_decode::OneKeyScores; exact sums)
        const float sq = q[tail], corr = q[tail + 1];
        for (int64_t j = 0; j < keys; ++j) {
            if (vpf)
                for (int64_t off = 0; off < vrow_bytes; off += 64) __builtin_prefetch(vpf + j * vsb + off, 0, 2);
            const int8_t* krow = k + j * ks;
            __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int64_t c = 0; c < nd; ++c)
                acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(_mm512_loadu_si512(krow + c * 64), flip),
                                          _mm512_loadu_si512(reinterpret_cast<const char*>(q) + c * 64));
            s[j] = (simd::lane_sum(_mm512_cvtepi32_ps(acc)) - corr) * sq;
        }
        return;
    }
    const int8_t* kp[KB];
    for (int j = 0; j < KB; ++j) kp[j] = k + (j < keys ? j : keys - 1) * ks;
    __m512i acc[W];
    for (int n = 0; n < W; ++n) acc[n] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int j = 0; j < KB; ++j) {
        if (vpf && j < keys)
            for (int64_t off = 0; off < vrow_bytes; off += 64) __builtin_prefetch(vpf + j * vsb + off, 0, 2);
        for (int64_t c = 0; c < nd; ++c) {
            const __m512i ku = _mm512_xor_si512(_mm512_loadu_si512(kp[j] + c * 64), flip);
            for (int r = 0; r < RB; ++r)
                acc[r * KB + j] = _mm512_dpbusd_epi32(
                    acc[r * KB + j], ku, _mm512_loadu_si512(reinterpret_cast<const char*>(q + r * qs) + c * 64));
        }
    }
    __m512 dots_f[W];
    for (int n = 0; n < W; ++n) dots_f[n] = _mm512_cvtepi32_ps(acc[n]);  // exact (< 2^24)
    const __m512 dots = simd::transpose_reduce(dots_f);            // exact integer sums
    // lane r * KB + j: row r's scale and correction
    alignas(64) float sq[W], corr[W];
    for (int r = 0; r < RB; ++r)
        for (int j = 0; j < KB; ++j) {
            sq[r * KB + j] = q[r * qs + tail];
            corr[r * KB + j] = q[r * qs + tail + 1];
        }
    const __m512 sc = _mm512_mul_ps(_mm512_sub_ps(dots, _mm512_load_ps(corr)), _mm512_load_ps(sq));
    for (int r = 0; r < RB; ++r) simd::store_lanes(s + r * ss - r * KB, sc, r * KB, keys);
}

template <int RB, int ND>
struct ScoreBlock {  // RB rows against up to W keys, in groups of W / RB keys
    static void run(const float* qs, int64_t qstride, const int8_t* k, int64_t ks, int64_t keys,
                    int64_t D, float* s, int64_t ss, const char* vpf, int64_t vsb,
                    int64_t vrow_bytes) {
        constexpr int KB = W / RB;
        for (int64_t j = 0; j < keys; j += KB)
            score_keys<RB, ND>(qs, qstride, k + j * ks, ks, keys - j < KB ? keys - j : KB, D,
                               s + j, ss, vpf ? vpf + j * vsb : nullptr, vsb, vrow_bytes);
    }
};

// P·V over int8 V rows by vpdpwssd. A row's weights of one block (probabilities times the V
// row scales, all >= 0) become 15-bit integers against the block's largest,
// w = round(p / unit) with unit = max p / 32767 (|error| <= max p / 65534 per weight: finer
// than bfloat16's 2^-9 relative wherever a weight is above 1/128 of the block's largest).
// vpdpwssd multiplies two pairs of int16 and adds both products to an int32 lane: two keys'
// weights as one 32-bit word against two V rows, sign-extended to int16 (vpmovsxbw) and
// interleaved so that a lane holds the two keys' values of one column (vpunpck{l,h}wd, as
// bf16_decode's pairs). The int32 sums are exact (below 2^31 for kPairGroupKeys keys) and
// are added to the float32 accumulators once per kPairGroupKeys keys of the block, counted
// from its first key whatever rows a paged cache's blocks cut: the same bits as contiguous.
// (vpdpbusd over byte quads, with the weights as a high and a low byte, measured no faster:
// two sums per column and three shuffles per 64 values against two per 32.)
namespace value_pairs {

constexpr int64_t kPairGroupKeys = 128;  // 64 pairs x 2 x 32767 x 128 < 2^31
constexpr int64_t kMaxValueCols = 512;   // V rows a missing key reads instead (zeros)
alignas(64) constexpr int8_t kZeroRow[kMaxValueCols] = {};

// The packed weights of a row, in place of its float32 scores: unit in float 0, then from
// float 2 on one int16 per key.
inline const int16_t* weights(const float* srow) { return reinterpret_cast<const int16_t*>(srow + 2); }

inline void pack(float* srow, int64_t keys) {
    const float peak = keys > 0 ? simd::range_max(srow, 0, keys) : 0.0f;  // NaN if any is NaN
    const bool usable = peak > 0 && peak < __builtin_inff();
    const float unit = peak / 32767.0f;  // NaN / inf: the weights' sums are 0, times unit NaN
    const __m512 inv = _mm512_set1_ps(usable ? 32767.0f / peak : 0.0f);
    const __m512i top = _mm512_set1_epi32(32767);
    int16_t* out = reinterpret_cast<int16_t*>(srow + 2);
    for (int64_t c = 0; c < keys; c += W) {  // reads floats c.., writes bytes 8 + 2c..: behind
        const __mmask16 live = c + W <= keys ? 0xFFFF : static_cast<__mmask16>((1u << (keys - c)) - 1);
        const __m512 pv = _mm512_maskz_loadu_ps(live, srow + c);
        __m512i w = _mm512_cvtps_epi32(_mm512_mul_ps(pv, inv));  // nearest even
        w = _mm512_max_epi32(_mm512_min_epi32(w, top), _mm512_setzero_si512());
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), _mm512_cvtepi32_epi16(w));
    }
    srow[0] = unit;
}

// acc[r] (RB rows, Dv apart; columns in bf16_decode's pair layout, see finish) += the weights
// of keys [c0, c1) (block-relative, c1 - c0 <= kPairGroupKeys, c0 even) times their V rows
// (row[c - c0]; keys past the block read kZeroRow), over NC groups of 32 columns from col.
template <int RB, int NC>
inline void group_tile(float* __restrict acc, int64_t Dv, const float* s, int64_t ss,
                       const int8_t* const* row, int64_t c0, int64_t c1, int64_t col) {
    __m512i sum[RB][2 * NC];
    for (int r = 0; r < RB; ++r)
        for (int g = 0; g < 2 * NC; ++g) sum[r][g] = _mm512_setzero_si512();
    for (int64_t c = c0; c < c1; c += 2) {
        const int8_t* a = row[c - c0] + col;
        const int8_t* b = row[c - c0 + 1] + col;
        __m512i lo[NC], hi[NC];
        for (int g = 0; g < NC; ++g) {
            const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * g)));
            const __m512i y = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * g)));
            lo[g] = _mm512_unpacklo_epi16(x, y);
            hi[g] = _mm512_unpackhi_epi16(x, y);
        }
        for (int r = 0; r < RB; ++r) {
            int32_t word;
            __builtin_memcpy(&word, weights(s + r * ss) + c, 4);
            const __m512i pair = _mm512_set1_epi32(word);
            for (int g = 0; g < NC; ++g) {
                sum[r][2 * g] = _mm512_dpwssd_epi32(sum[r][2 * g], lo[g], pair);
                sum[r][2 * g + 1] = _mm512_dpwssd_epi32(sum[r][2 * g + 1], hi[g], pair);
            }
        }
    }
    for (int r = 0; r < RB; ++r) {
        const __m512 unit = _mm512_set1_ps(s[r * ss]);
        for (int g = 0; g < 2 * NC; ++g) {
            float* x = acc + r * Dv + col + g * W;
            _mm512_storeu_ps(x, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][g]), unit, _mm512_loadu_ps(x)));
        }
    }
}

// Rows r0.. of the block's group [c0, c1) over every column, RB rows at a time, NC x 32
// columns per tile (at most 16 accumulators), then single groups of 32.
template <int RB, int NC>
inline void rows_tile(int64_t r, float* acc, int64_t Dv, const float* s, int64_t ss,
                      const int8_t* const* row, int64_t c0, int64_t c1) {
    int64_t col = 0;
    for (; col + 32 * NC <= Dv; col += 32 * NC)
        group_tile<RB, NC>(acc + r * Dv, Dv, s + r * ss, ss, row, c0, c1, col);
    for (; col < Dv; col += 32) group_tile<RB, 1>(acc + r * Dv, Dv, s + r * ss, ss, row, c0, c1, col);
}

// decode_loop's kRowValues step: acc rows += the block's packed weights (pack) times its V
// rows, keys [key0, key0 + width) read through `v` (contiguous or paged); each key also
// starts the V row `ahead` on towards L2 (a paged cache's plain streams; 0: none).
inline void block_values(int64_t n, float* acc, int64_t Dv, const float* s, int64_t ss,
                         const KeyRows<int8_t>& v, int64_t key0, int64_t width, int64_t ahead,
                         int64_t end) {
    const int8_t* row[kPairGroupKeys + 2];
    const int64_t lines = (Dv + 63) / 64;
    for (int64_t c0 = 0; c0 < width; c0 += kPairGroupKeys) {
        const int64_t c1 = c0 + kPairGroupKeys < width ? c0 + kPairGroupKeys : width;
        const int64_t c1_pairs = (c1 + 1) / 2 * 2;
        for (int64_t c = c0; c < c1_pairs; ++c) row[c - c0] = c < c1 ? v.at(key0 + c) : kZeroRow;
        if (ahead)
            for (int64_t c = c0; c < c1 && key0 + c + ahead < end; ++c) {
                const char* pf = reinterpret_cast<const char*>(v.at(key0 + c + ahead));
                for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(pf + l * 64, 0, 2);
            }
        int64_t r = 0;
        for (; r + 4 <= n; r += 4) rows_tile<4, 2>(r, acc, Dv, s, ss, row, c0, c1_pairs);
        for (; r + 2 <= n; r += 2) rows_tile<2, 4>(r, acc, Dv, s, ss, row, c0, c1_pairs);
        if (r < n) rows_tile<1, 4>(r, acc, Dv, s, ss, row, c0, c1_pairs);
    }
}

// Columns back in order (bf16_decode's pair layout): per group of 32, 128-bit pieces l0..l3
// (first vector) and h0..h3 (second) become l0 h0 l1 h1 | l2 h2 l3 h3.
inline void finish(float* acc, int64_t rows, int64_t Dv) {
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

}  // namespace value_pairs

// decode_loop's arithmetic policy: int8 query bytes and vpdpbusd for the scores, 15-bit
// weights and vpdpwssd for the values (value_pairs).
template <int ND, class TQ>
struct VnniPath : simd_decode::VectorSoftmax {
    using Q = TQ;
    using KV = int8_t;
    static constexpr bool kRowValues = true;
    static int64_t query_stride(const AttentionParams& p) { return bytes_floats(p.head_dim) + 16; }
    static void stage_query(float* qs, const TQ* qrow, int64_t D, float scale) {
        float peak = 0;
        bool finite = true;
        for (int64_t d = 0; d < D; ++d) {
            const float x = widen(qrow[d]) * scale;
            finite = finite && x - x == 0;  // false for NaN and +-inf
            const float a = x < 0 ? -x : x;
            peak = a > peak ? a : peak;
        }
        const float sq = finite ? peak / 127.0f : __builtin_nanf("");
        const float inv = sq > 0 ? 1.0f / sq : 0.0f;  // (127 / peak would round differently)
        int8_t* bytes = reinterpret_cast<int8_t*>(qs);
        int32_t sum = 0;
        for (int64_t d = 0; d < D; ++d) {
            const float x = finite ? widen(qrow[d]) * scale * inv : 0.0f;
            int32_t v = static_cast<int32_t>(__builtin_nearbyintf(x));  // nearest even
            v = v > 127 ? 127 : (v < -127 ? -127 : v);
            bytes[d] = static_cast<int8_t>(v);
            sum += v;
        }
        const int64_t tail = bytes_floats(D);
        qs[tail] = sq;
        qs[tail + 1] = 128.0f * static_cast<float>(sum);  // exact (|sum| <= 127 * D)
    }
    static void scores(int64_t n, const float* qs, int64_t qstride, const int8_t* kj, int64_t ks,
                       int64_t nk, int64_t D, float* sj, int64_t ss, const char* vj,
                       int64_t vsb, int64_t v_row_bytes, float /*scale*/) {
        int64_t rb = 0;
        for (; rb + kRowBlock <= n; rb += kRowBlock)
            ScoreBlock<kRowBlock, ND>::run(qs + rb * qstride, qstride, kj, ks, nk, D, sj + rb * ss, ss,
                                   rb == 0 ? vj : nullptr, vsb, v_row_bytes);
        if (n - rb >= 2) {
            ScoreBlock<2, ND>::run(qs + rb * qstride, qstride, kj, ks, nk, D, sj + rb * ss, ss,
                                   rb == 0 ? vj : nullptr, vsb, v_row_bytes);
            rb += 2;
        }
        if (n - rb == 1)
            ScoreBlock<1, ND>::run(qs + rb * qstride, qstride, kj, ks, nk, D, sj + rb * ss, ss,
                                   rb == 0 ? vj : nullptr, vsb, v_row_bytes);
    }
    static void weights_ready(float* srow, int64_t keys) { value_pairs::pack(srow, keys); }
    static void block_values(int64_t n, float* acc, int64_t Dv, const float* s, int64_t ss,
                             const KeyRows<int8_t>& v, int64_t key0, int64_t width, int64_t ahead,
                             int64_t end) {
        value_pairs::block_values(n, acc, Dv, s, ss, v, key0, width, ahead, end);
    }
    static void finish(float* acc, int64_t rows, int64_t Dv) { value_pairs::finish(acc, rows, Dv); }
};

// Whether a call takes this path: an int8 cache, D a multiple of 64 up to 512 (the exact
// integer sums), Dv a multiple of 32 up to 512 (value_pairs), a CPU with the instruction,
// and not the exact widening chosen (int8_dot_widen: ATTNFAST_INT8_DOT=widen, read once).
inline bool takes(const AttentionParams& p) {
    if (p.kv_dtype != DType::kI8 || p.head_dim % 64 != 0 || p.head_dim > 512 ||
        p.head_dim_v % 32 != 0 || p.head_dim_v > value_pairs::kMaxValueCols)
        return false;
    static const bool cpu_has = __builtin_cpu_supports("avx512vnni");
    return cpu_has && !int8_dot_widen();
}

template <class TQ>
void chunk_for(const AttentionParams& p, const DecodeTask& task, float* ws, float* acc,
               float* m, float* l) {
    if (p.head_dim == 128) decode_loop<VnniPath<2, TQ>>(p, task, ws, acc, m, l);
    else if (p.head_dim == 64) decode_loop<VnniPath<1, TQ>>(p, task, ws, acc, m, l);
    else decode_loop<VnniPath<0, TQ>>(p, task, ws, acc, m, l);
}

void chunk_any(const AttentionParams& p, const DecodeTask& task, float* ws, float* acc,
               float* m, float* l) {
    with_q_type(p.dtype, [&](auto tq) { chunk_for<typename decltype(tq)::type>(p, task, ws, acc, m, l); });
}

// KernelTable::decode_kernel of this tier: this path where it takes the call, else the
// bfloat16 kernel's choice (vdpbf16ps, or the widening kernel, or the template).
DecodeKernel decode_kernel(const AttentionParams& p) {
    if (takes(p)) return {KernelId::kVnniInt8Decode, chunk_any};
    return bf16_decode::decode_kernel(p);
}

}  // namespace vnni_decode

// kRowBlock rows x W / kRowBlock keys per score_keys call; Q.K by vpdpbusd over q quantised
// per row, P.V by vpdpwssd over 15-bit weights (value_pairs: up to 4 rows x 64 columns x 2 keys).
template <> struct PolicyOf<KernelId::kVnniInt8Decode> {
    static KernelPolicy of(const AttentionParams&) {
        return {kRowBlock, simd::W / kRowBlock, Product::kInt8Quads, Product::kInt16Pairs};
    }
};
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
