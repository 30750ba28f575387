// The SIMD layer's vocabulary for AArch64 Advanced SIMD (the neon tier):
// 4 float lanes, 32 registers, FMA.
// Included through simd.hpp (which states the contract), never directly.
#pragma once
#ifndef ATTNFAST_KERNEL_NS
#error "include csrc/simd/simd.hpp from a kernel translation unit (kernels/isa_*.cpp)"
#endif
#include <arm_neon.h>

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace simd {

using Vec = float32x4_t;
using Mask = uint32x4_t;  // all-ones / all-zeros lanes
constexpr int W = 4;

inline Vec vzero() { return vdupq_n_f32(0.0f); }
inline Vec vset(float x) { return vdupq_n_f32(x); }
inline Vec vload(const float* p) { return vld1q_f32(p); }
inline void vstore(float* p, Vec x) { vst1q_f32(p, x); }
inline Vec vbcast(const float* p) { return vld1q_dup_f32(p); }  // ld1r
inline Vec vfma(Vec a, Vec b, Vec c) { return vfmaq_f32(c, a, b); }
inline Vec vadd(Vec a, Vec b) { return vaddq_f32(a, b); }
inline Vec vsub(Vec a, Vec b) { return vsubq_f32(a, b); }
inline Vec vmul(Vec a, Vec b) { return vmulq_f32(a, b); }
// FMAX: NaN in either operand gives NaN (x86's max returns the second operand then); either
// way a NaN score makes every probability of its row NaN.
inline Vec vmax(Vec a, Vec b) { return vmaxq_f32(a, b); }
inline Vec select(Mask m, Vec yes, Vec no) { return vbslq_f32(m, yes, no); }
inline Mask key_visible(const int32_t* begin, const int32_t* end, int32_t key) {
    const int32x4_t kv = vdupq_n_s32(key);
    return vandq_u32(vcleq_s32(vld1q_s32(begin), kv), vcltq_s32(kv, vld1q_s32(end)));
}
inline Vec keep_or_neg_inf(Mask keep, Vec x) { return vbslq_f32(keep, x, vset(-__builtin_inff())); }
inline Vec finite_or_zero(Vec m) { return vbslq_f32(vceqq_f32(m, vset(-__builtin_inff())), vzero(), m); }
inline bool all_ones(Vec x) { return vminvq_u32(vceqq_f32(x, vset(1.0f))) == 0xFFFFFFFFu; }  // NaN: not
inline Vec neg_inf_to_nan(Vec x) {
    return vbslq_f32(vceqq_f32(x, vset(-__builtin_inff())), vset(__builtin_nanf("")), x);
}
inline Vec vdiv(Vec a, Vec b) { return vdivq_f32(a, b); }
inline Vec vfnma(Vec a, Vec b, Vec c) { return vfmsq_f32(c, a, b); }  // c - a * b
inline Vec vabs(Vec x) { return vabsq_f32(x); }
inline Vec vcopysign(Vec mag, Vec sgn) { return vbslq_f32(vdupq_n_u32(0x80000000u), sgn, mag); }
inline Mask less_than(Vec a, float x) { return vcltq_f32(a, vset(x)); }
inline bool all_lanes(Mask m) { return vminvq_u32(m) == 0xFFFFFFFFu; }
inline Vec keep_unless_sign(Vec x, Vec drop) {
    return vbslq_f32(vreinterpretq_u32_s32(vshrq_n_s32(vreinterpretq_s32_f32(drop), 31)), drop, x);
}

}  // namespace simd
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
