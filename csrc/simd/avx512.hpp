// The SIMD layer's vocabulary for AVX-512 F/DQ/BW/VL (the avx512 and
// avx512bf16 tiers): 16 float lanes, mask registers.
// Included through simd.hpp (which states the contract), never directly.
#pragma once
#ifndef ATTNFAST_KERNEL_NS
#error "include csrc/simd/simd.hpp from a kernel translation unit (kernels/isa_*.cpp)"
#endif
#include <immintrin.h>
#include "ymm.hpp"  // (8-lane conversions: the prefill's row chunks)

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace simd {

using Vec = __m512;
using Mask = __mmask16;
constexpr int W = 16;           // float lanes

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
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec vfnma(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline Vec vabs(Vec x) { return _mm512_abs_ps(x); }
inline Vec vcopysign(Vec mag, Vec sgn) {  // mag >= 0 (or NaN) with the sign bit of sgn
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(mag), _mm512_castps_si512(sgn),
                                                         _mm512_set1_epi32(INT32_MIN), 0xF8));  // a | (b & c)
}
inline Mask less_than(Vec a, float x) { return _mm512_cmp_ps_mask(a, vset(x), _CMP_LT_OQ); }
inline bool all_lanes(Mask m) { return m == Mask(0xFFFF); }
inline Vec select(Mask m, Vec yes, Vec no) { return _mm512_mask_blend_ps(m, no, yes); }
// x where the sign bit of `drop` is clear, else drop (a mask tile's 0 / -inf entries).
inline Vec keep_unless_sign(Vec x, Vec drop) {
    return _mm512_mask_blend_ps(_mm512_movepi32_mask(_mm512_castps_si512(drop)), x, drop);
}

// ---- unaligned access, masked tails, reductions (the decode policies' rows of scores)
inline Vec vloadu(const float* p) { return _mm512_loadu_ps(p); }
inline void vstoreu(float* p, Vec x) { _mm512_storeu_ps(p, x); }
// out lane n = sum of the lanes of x[n], n < 16, in a fixed tree: pairs interleaved within
// 128-bit lanes, then 64-bit pairs, then 128-bit lanes across registers.
inline Vec transpose_reduce(const Vec* x) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; ++i)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]),
                             _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; ++i)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                         _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}
// s[c] = lane c of x for first <= c < first + n (lanes are < W).
inline void store_lanes(float* s, Vec x, int first, int64_t n) {
    _mm512_mask_storeu_ps(s, static_cast<__mmask16>(((1u << n) - 1u) << first), x);
}
// The same for n == KB lanes starting at first: a masked store is one uop here.
template <int KB>
inline void store_group(float* s, Vec x, int first) { store_lanes(s, x, first, KB); }
inline float hmax(Vec x) { return _mm512_reduce_max_ps(x); }
inline float hsum(Vec x) { return _mm512_reduce_add_ps(x); }
// The sum of x's lanes in transpose_reduce's order (its lane j when x is its input j): within
// each 128-bit block (e0 + e2) + (e1 + e3), then the blocks (b0 + b2) + (b1 + b3).
inline float lane_sum(Vec x) {
    const Vec y = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E));
    const Vec z = _mm512_add_ps(y, _mm512_permute_ps(y, 0xB1));
    const Vec w = _mm512_add_ps(z, _mm512_shuffle_f32x4(z, z, 0x4E));
    return _mm512_cvtss_f32(_mm512_add_ps(w, _mm512_shuffle_f32x4(w, w, 0xB1)));
}
// Lanes c (counting from c0) with b <= c0 + c < e: x, others 0 (x may be garbage there).
inline Vec keep_range(Vec x, int64_t c0, int64_t b, int64_t e) {
    const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int32_t>(c0)));
    const __mmask16 keep = _mm512_cmp_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(b)), idx, _MM_CMPINT_LE) &
                           _mm512_cmp_epi32_mask(idx, _mm512_set1_epi32(static_cast<int32_t>(e)), _MM_CMPINT_LT);
    return _mm512_maskz_mov_ps(keep, x);
}
// Largest of x[b .. e), or NaN when any of them is NaN (max_ps alone may drop a NaN).
inline float range_max(const float* x, int64_t b, int64_t e) {
    __m512 mx = _mm512_set1_ps(-__builtin_inff());
    __mmask16 nan = 0;
    int64_t c = b;
    for (; c + W <= e; c += W) {
        const __m512 xv = _mm512_loadu_ps(x + c);
        nan |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, xv);
    }
    if (c < e) {
        const __mmask16 tail = static_cast<__mmask16>((1u << (e - c)) - 1u);
        const __m512 xv = _mm512_mask_loadu_ps(_mm512_set1_ps(-__builtin_inff()), tail, x + c);
        nan |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, xv);
    }
    return nan ? __builtin_nanf("") : hmax(mx);
}

// ---- widening: W stored elements (unaligned) to float32 lanes, exact (see ymm.hpp)
inline Vec vwiden(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vwiden(const bf16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline Vec vwiden(const f16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Vec vwiden(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// A float8 format, times 1 / kWidenScaleFold, as ymm.hpp's widen8 (storage.hpp's Float8).
template <class T, typename std::enable_if<Float8<T>::kIs, int>::type = 0>
inline Vec vwiden(const T* p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    if constexpr (Float8<T>::kMagShift == 8 && !Float8<T>::kNanAtAllOnes) {  // the sign in place
        return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
    } else {
        const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi16(0x7F));
        const __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, Float8<T>::kMagShift),
                                          _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
        if constexpr (Float8<T>::kNanAtAllOnes) {
            const __mmask16 nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7F));
            return _mm512_mask_mov_ps(_mm512_cvtph_ps(h), nan, _mm512_set1_ps(__builtin_nanf("")));
        } else {
            return _mm512_cvtph_ps(h);
        }
    }
}
// 2W float8 values at once into out[0], out[1] (the same values as two vwiden calls): the
// byte-to-float16 move on 32 16-bit lanes of one zmm, half the integer work per value.
template <class T, typename std::enable_if<Float8<T>::kIs, int>::type = 0>
inline void vwiden_pair(const T* p, Vec* out) {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    static_assert(Float8<T>::kMagShift == 7 || Float8<T>::kMagShift == 8, "a float8 move of 7 or 8 bits");
    const __m512i h = Float8<T>::kMagShift == 8
                          ? _mm512_slli_epi16(b, 8)
                          : _mm512_slli_epi16(_mm512_add_epi16(b, _mm512_and_si512(b, _mm512_set1_epi16(0x80))), 7);
    out[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    out[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    if constexpr (Float8<T>::kNanAtAllOnes) {
        const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(b, _mm512_set1_epi16(0x7F)),
                                                      _mm512_set1_epi16(0x7F));
        out[0] = _mm512_mask_mov_ps(out[0], static_cast<__mmask16>(nan), _mm512_set1_ps(__builtin_nanf("")));
        out[1] = _mm512_mask_mov_ps(out[1], static_cast<__mmask16>(nan >> 16), _mm512_set1_ps(__builtin_nanf("")));
    }
}
struct Q4Header {  // as avx2.hpp's
    Vec scale, minimum;
    explicit Q4Header(const uint8_t* block) {
        int32_t header;
        __builtin_memcpy(&header, block, 4);
        const __m512i h = _mm512_set1_epi32(header);
        scale = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
        minimum = _mm512_castsi512_ps(_mm512_and_si512(h, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
    }
};
inline Vec vwiden_q4(const uint8_t* block, int64_t i) {  // values i .. i + W (i: 0 or 16)
    const Q4Header hd(block);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4)));
    const __m512i n = i < 16 ? _mm512_and_si512(bytes, _mm512_set1_epi32(15)) : _mm512_srli_epi32(bytes, 4);
    return vfma(_mm512_cvtepi32_ps(n), hd.scale, hd.minimum);
}
inline void vwiden_q4_block(const uint8_t* block, Vec* out) {
    const Q4Header hd(block);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4)));
    out[0] = vfma(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15))), hd.scale, hd.minimum);
    out[1] = vfma(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), hd.scale, hd.minimum);
}

#if defined(__AVX512BF16__)
// ---- bfloat16 pair dot products (vdpbf16ps): a Pairs vector holds W 32-bit lanes of two
// bfloat16 values each, the lower-addressed one in the low half; vdot_pairs adds both products
// of each lane pair to the float32 lane, exactly as float32 arithmetic would round a
// two-term dot product (products exact, one float32 accumulation).
using Pairs = __m512bh;
inline Pairs pairs_load(const uint32_t* p) { return (__m512bh)_mm512_load_si512(p); }
inline Pairs pairs_bcast(const uint32_t* p) {  // p: any 2-byte alignment (a stored bfloat16 row)
    int32_t word;
    __builtin_memcpy(&word, p, sizeof word);
    return (__m512bh)_mm512_set1_epi32(word);
}
inline Vec vdot_pairs(Vec acc, Pairs a, Pairs b) { return _mm512_dpbf16_ps(acc, a, b); }
// lanes (lo[x], hi[x]) of two float32 vectors rounded to bfloat16 (nearest even), stored aligned.
inline void pairs_store_rounded(uint32_t* p, Vec lo, Vec hi) {
    const __m512i l = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
    const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi));
    _mm512_store_si512(p, _mm512_or_si512(l, _mm512_slli_epi32(h, 16)));
}
// W float32 lanes rounded to bfloat16 (nearest even), stored unaligned as W values.
inline void vstore_bf16(bf16_t* p, Vec x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
}
// W stored bfloat16 values of two rows (unaligned) as W pairs (a[x], b[x]), stored aligned.
inline void pairs_interleave(uint32_t* p, const bf16_t* a, const bf16_t* b) {
    const __m512i l = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    _mm512_store_si512(p, _mm512_or_si512(l, _mm512_slli_epi32(h, 16)));
}
#endif

}  // namespace simd
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
