// The SIMD layer's vocabulary for AVX2 + FMA (the avx2 tier): 8 float
// lanes, masks as all-ones / all-zeros lanes.
// Included through simd.hpp (which states the contract), never directly.
#pragma once
#ifndef ATTNFAST_KERNEL_NS
#error "include csrc/simd/simd.hpp from a kernel translation unit (kernels/isa_*.cpp)"
#endif
#if !defined(__FMA__)
#error "the avx2 SIMD layer needs -mfma too"
#endif
#include <immintrin.h>
#include "ymm.hpp"

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace simd {

using Vec = __m256;
using Mask = __m256;
constexpr int W = 8;

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
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec vfnma(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline Vec vabs(Vec x) { return _mm256_andnot_ps(vset(-0.0f), x); }
inline Vec vcopysign(Vec mag, Vec sgn) { return _mm256_or_ps(mag, _mm256_and_ps(sgn, vset(-0.0f))); }
inline Mask less_than(Vec a, float x) { return _mm256_cmp_ps(a, vset(x), _CMP_LT_OQ); }
inline bool all_lanes(Mask m) { return _mm256_movemask_ps(m) == 0xFF; }
inline Vec select(Mask m, Vec yes, Vec no) { return _mm256_blendv_ps(no, yes, m); }
inline Vec keep_unless_sign(Vec x, Vec drop) { return _mm256_blendv_ps(x, drop, drop); }

// ---- unaligned access, masked tails, reductions (the decode policies' rows of scores)
inline Vec vloadu(const float* p) { return _mm256_loadu_ps(p); }
inline void vstoreu(float* p, Vec x) { _mm256_storeu_ps(p, x); }
// out lane n = sum of the lanes of x[n], n < W: pairs interleaved within 128-bit lanes,
// then 64-bit pairs, then the two 128-bit halves (a fixed tree).
inline Vec transpose_reduce(const Vec* x) {
    __m256 t[4], u[2];
    for (int i = 0; i < 4; ++i)
        t[i] = _mm256_add_ps(_mm256_unpacklo_ps(x[2 * i], x[2 * i + 1]),
                             _mm256_unpackhi_ps(x[2 * i], x[2 * i + 1]));
    for (int i = 0; i < 2; ++i) {
        const __m256d a = _mm256_castps_pd(t[2 * i]), b = _mm256_castps_pd(t[2 * i + 1]);
        u[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20),
                         _mm256_permute2f128_ps(u[0], u[1], 0x31));
}
inline __m256i lanes_in(int64_t c0, int64_t b, int64_t e) {  // b <= c0 + lane < e
    const __m256i idx = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                         _mm256_set1_epi32(static_cast<int32_t>(c0)));
    return _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(b)), idx),
                               _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(e)), idx));
}
// s[c] = lane c of x for first <= c < first + n (lanes are < W).
inline void store_lanes(float* s, Vec x, int first, int64_t n) {
    _mm256_maskstore_ps(s, lanes_in(0, first, first + n), x);
}
// The same for n == KB lanes starting at first (a multiple of KB): plain stores (a masked
// store costs several uops on Intel and is microcoded on AMD Zen).
template <int KB>
inline void store_group(float* s, Vec x, int first) {
    if constexpr (KB == 8) {
        _mm256_storeu_ps(s, x);
    } else {
        const __m128 half = first < 4 ? _mm256_castps256_ps128(x) : _mm256_extractf128_ps(x, 1);
        if constexpr (KB == 4) {
            _mm_storeu_ps(s + first, half);
        } else {
            static_assert(KB == 2, "W / RB keys per group");
            if ((first & 3) == 0) _mm_storel_pi(reinterpret_cast<__m64*>(s + first), half);
            else _mm_storeh_pi(reinterpret_cast<__m64*>(s + first), half);
        }
    }
}
inline float hmax(Vec x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
inline float hsum(Vec x) {  // fixed tree: halves, then (0 + 2) + (1 + 3)
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
// Lanes c (counting from c0) with b <= c0 + c < e: x, others 0 (x may be garbage there).
inline Vec keep_range(Vec x, int64_t c0, int64_t b, int64_t e) {
    return _mm256_and_ps(_mm256_castsi256_ps(lanes_in(c0, b, e)), x);
}
// Largest of x[b .. e), or NaN when any of them is NaN (max_ps alone may drop a NaN).
inline float range_max(const float* x, int64_t b, int64_t e) {
    __m256 mx = _mm256_set1_ps(-__builtin_inff());
    __m256 nan = _mm256_setzero_ps();
    int64_t c = b;
    for (; c + W <= e; c += W) {
        const __m256 xv = _mm256_loadu_ps(x + c);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
        mx = _mm256_max_ps(mx, xv);
    }
    float m = hmax(mx);
    bool any_nan = _mm256_movemask_ps(nan) != 0;
    for (; c < e; ++c) {
        any_nan = any_nan || x[c] != x[c];
        m = x[c] > m ? x[c] : m;
    }
    return any_nan ? __builtin_nanf("") : m;
}

// ---- widening and narrowing: W stored elements (unaligned), float32 lanes (ymm.hpp)
template <class T> inline Vec vwiden(const T* p) { return widen8(p); }
template <class T> inline void vnarrow(T* p, Vec x) { narrow8(p, x); }
// int4 (storage.hpp's q4_t blocks), dequantised in registers: the block's header broadcast,
// its bfloat16 scale and minimum made float32 by a shift and a mask (no shuffles); the bytes
// zero-extended to 32-bit lanes, masked to the low nibbles or shifted down to the high ones,
// vcvtdq2ps, one FMA. (Measured: float16 headers cost more than the nibbles, their
// vcvtph2ps and broadcasts all on the shuffle port.)
struct Q4Header {
    Vec scale, minimum;
    explicit Q4Header(const uint8_t* block) {
        int32_t header;
        __builtin_memcpy(&header, block, 4);
        const __m256i h = _mm256_set1_epi32(header);
        scale = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
        minimum = _mm256_castsi256_ps(_mm256_and_si256(h, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
    }
};
// Values i .. i + W of the block (i a multiple of W).
inline Vec vwiden_q4(const uint8_t* block, int64_t i) {
    const Q4Header hd(block);
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 4 + (i & 15))));
    const __m256i n = i < 16 ? _mm256_and_si256(bytes, _mm256_set1_epi32(15)) : _mm256_srli_epi32(bytes, 4);
    return vfma(_mm256_cvtepi32_ps(n), hd.scale, hd.minimum);
}
// All 32 values of the block: out[v] = values v W .. v W + W.
inline void vwiden_q4_block(const uint8_t* block, Vec* out) {
    const Q4Header hd(block);
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 4)));
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 12)));
    const __m256i low = _mm256_set1_epi32(15);
    out[0] = vfma(_mm256_cvtepi32_ps(_mm256_and_si256(lo, low)), hd.scale, hd.minimum);
    out[1] = vfma(_mm256_cvtepi32_ps(_mm256_and_si256(hi, low)), hd.scale, hd.minimum);
    out[2] = vfma(_mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), hd.scale, hd.minimum);
    out[3] = vfma(_mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)), hd.scale, hd.minimum);
}

}  // namespace simd
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
