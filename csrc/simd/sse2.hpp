// The SIMD layer's vocabulary for SSE2 only (the generic tier on x86-64):
// 4 float lanes, 16 xmm registers, no blendv, no round, no FMA.
// Included through simd.hpp (which states the contract), never directly.
#pragma once
#ifndef ATTNFAST_KERNEL_NS
#error "include csrc/simd/simd.hpp from a kernel translation unit (kernels/isa_*.cpp)"
#endif
#include <immintrin.h>

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace simd {

using Vec = __m128;
using Mask = __m128;  // all-ones / all-zeros lanes
constexpr int W = 4;

inline Vec vzero() { return _mm_setzero_ps(); }
inline Vec vset(float x) { return _mm_set1_ps(x); }
inline Vec vload(const float* p) { return _mm_load_ps(p); }
inline void vstore(float* p, Vec x) { _mm_store_ps(p, x); }
inline Vec vbcast(const float* p) { return _mm_load1_ps(p); }  // movss + shufps
// No FMA on this tier: a multiply, then an add (two roundings; the float32 tolerances of the
// tests hold either way). Two-operand SSE needs a copy of one factor per product; register
// moves are free on current x86 cores (eliminated at rename), but it is one more register.
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm_add_ps(_mm_mul_ps(a, b), c); }
inline Vec vadd(Vec a, Vec b) { return _mm_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm_mul_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm_max_ps(a, b); }
inline Vec select(Mask m, Vec yes, Vec no) { return _mm_or_ps(_mm_and_ps(m, yes), _mm_andnot_ps(m, no)); }
inline Mask key_visible(const int32_t* begin, const int32_t* end, int32_t key) {
    const __m128i kv = _mm_set1_epi32(key);
    const __m128i b = _mm_load_si128(reinterpret_cast<const __m128i*>(begin));
    const __m128i e = _mm_load_si128(reinterpret_cast<const __m128i*>(end));
    return _mm_castsi128_ps(_mm_andnot_si128(_mm_cmpgt_epi32(b, kv), _mm_cmpgt_epi32(e, kv)));
}
inline Vec keep_or_neg_inf(Mask keep, Vec x) { return select(keep, x, vset(-__builtin_inff())); }
inline Vec finite_or_zero(Vec m) { return _mm_andnot_ps(_mm_cmpeq_ps(m, vset(-__builtin_inff())), m); }
inline bool all_ones(Vec x) { return _mm_movemask_ps(_mm_cmpneq_ps(x, vset(1.0f))) == 0; }  // NaN: not
inline Vec neg_inf_to_nan(Vec x) {  // -inf | quiet-NaN bits is a NaN; other lanes OR in 0
    return _mm_or_ps(x, _mm_and_ps(_mm_cmpeq_ps(x, vset(-__builtin_inff())), vset(__builtin_nanf(""))));
}
inline Vec vdiv(Vec a, Vec b) { return _mm_div_ps(a, b); }
inline Vec vfnma(Vec a, Vec b, Vec c) { return _mm_sub_ps(c, _mm_mul_ps(a, b)); }
inline Vec vabs(Vec x) { return _mm_andnot_ps(vset(-0.0f), x); }
inline Vec vcopysign(Vec mag, Vec sgn) { return _mm_or_ps(mag, _mm_and_ps(sgn, vset(-0.0f))); }
inline Mask less_than(Vec a, float x) { return _mm_cmplt_ps(a, vset(x)); }
inline bool all_lanes(Mask m) { return _mm_movemask_ps(m) == 0xF; }
inline Vec keep_unless_sign(Vec x, Vec drop) {
    return select(_mm_castsi128_ps(_mm_srai_epi32(_mm_castps_si128(drop), 31)), drop, x);
}

}  // namespace simd
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
