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

}  // namespace simd
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
