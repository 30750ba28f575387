// The SIMD layer's vocabulary for AVX-512 F/DQ/BW/VL (the avx512 and
// avx512bf16 tiers): 16 float lanes, mask registers.
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

}  // namespace simd
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
