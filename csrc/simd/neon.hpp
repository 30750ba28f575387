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

// ---- unaligned access, masked tails, reductions (the decode policies' rows of scores)
inline Vec vloadu(const float* p) { return vld1q_f32(p); }  // (ld1 takes any alignment)
inline void vstoreu(float* p, Vec x) { vst1q_f32(p, x); }
// out lane n = sum of the lanes of x[n], n < 4: pairwise adds (FADDP), a fixed tree
// (x[n][0] + x[n][1]) + (x[n][2] + x[n][3]).
inline Vec transpose_reduce(const Vec* x) {
    return vpaddq_f32(vpaddq_f32(x[0], x[1]), vpaddq_f32(x[2], x[3]));
}
// s[c] = lane c of x for first <= c < first + n (lanes are < W).
inline void store_lanes(float* s, Vec x, int first, int64_t n) {
    alignas(16) float t[4];
    vst1q_f32(t, x);
    for (int64_t c = first; c < first + n; ++c) s[c] = t[c];
}
// The same for n == KB lanes starting at first (a multiple of KB).
template <int KB>
inline void store_group(float* s, Vec x, int first) {
    if constexpr (KB == 4) vst1q_f32(s, x);
    else if constexpr (KB == 2) vst1_f32(s + first, first == 0 ? vget_low_f32(x) : vget_high_f32(x));
    else store_lanes(s, x, first, KB);
}
inline float hmax(Vec x) { return vmaxvq_f32(x); }  // FMAXV: NaN if any lane is
inline float hsum(Vec x) { return vaddvq_f32(x); }  // (0 + 1) + (2 + 3)
// Lanes c (counting from c0) with b <= c0 + c < e: x, others 0 (x may be garbage there).
inline Vec keep_range(Vec x, int64_t c0, int64_t b, int64_t e) {
    const int32_t iota[4] = {0, 1, 2, 3};
    const int32x4_t idx = vaddq_s32(vld1q_s32(iota), vdupq_n_s32(static_cast<int32_t>(c0)));
    const uint32x4_t keep = vandq_u32(vcleq_s32(vdupq_n_s32(static_cast<int32_t>(b)), idx),
                                      vcltq_s32(idx, vdupq_n_s32(static_cast<int32_t>(e))));
    return vreinterpretq_f32_u32(vandq_u32(keep, vreinterpretq_u32_f32(x)));
}
// Largest of x[b .. e), or NaN when any of them is NaN (FMAX keeps a NaN; the scalar tail
// checks its own).
inline float range_max(const float* x, int64_t b, int64_t e) {
    Vec mx = vset(-__builtin_inff());
    int64_t c = b;
    for (; c + W <= e; c += W) mx = vmaxq_f32(mx, vld1q_f32(x + c));
    float m = hmax(mx);
    bool any_nan = m != m;
    for (; c < e; ++c) {
        any_nan = any_nan || x[c] != x[c];
        m = x[c] > m ? x[c] : m;
    }
    return any_nan ? __builtin_nanf("") : m;
}

// ---- widening: W stored elements (unaligned) to float32 lanes, exact; 4 elements read
inline uint16x4_t load4_halves(const void* p) { return vld1_u16(static_cast<const uint16_t*>(p)); }
inline uint16x4_t load4_bytes_u16(const void* p) {  // 4 bytes zero-extended (no over-read)
    uint32_t w;
    __builtin_memcpy(&w, p, 4);
    return vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(w))));
}
inline Vec vwiden(const float* p) { return vld1q_f32(p); }
inline Vec vwiden(const bf16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(load4_halves(p), 16)); }
// fcvtl: exact, subnormals included (FPCR.FZ16 is clear in the Linux and macOS defaults).
inline Vec vwiden(const f16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(load4_halves(p))); }
inline Vec vwiden(const int8_t* p) {
    int32_t w;
    __builtin_memcpy(&w, p, 4);
    const int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(w)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
}
// A float8 format, times 1 / kWidenScaleFold, by float16 bits as ymm.hpp's widen8
// (storage.hpp's Float8 traits); S.1111.111 -> NaN where kNanAtAllOnes.
template <class T, typename std::enable_if<Float8<T>::kIs, int>::type = 0>
inline Vec vwiden(const T* p) {
    const uint16x4_t b = load4_bytes_u16(p);
    const uint16x4_t mag = vand_u16(b, vdup_n_u16(0x7F));
    const uint16x4_t h = vorr_u16(vshl_n_u16(mag, Float8<T>::kMagShift), vshl_n_u16(vand_u16(b, vdup_n_u16(0x80)), 8));
    const Vec x = vcvt_f32_f16(vreinterpret_f16_u16(h));
    if constexpr (Float8<T>::kNanAtAllOnes) {
        const uint32x4_t nan = vreinterpretq_u32_s32(vmovl_s16(vreinterpret_s16_u16(vceq_u16(mag, vdup_n_u16(0x7F)))));
        return vbslq_f32(nan, vset(__builtin_nanf("")), x);
    } else {
        return x;
    }
}
// ---- narrowing: float32 lanes to W stored elements
inline void vnarrow(float* y, Vec x) { vst1q_f32(y, x); }
// fcvtn rounds to nearest even (the FPCR default) and quiets a NaN keeping its upper payload
// bits, as simd/storage.hpp's narrow_f16.
inline void vnarrow(f16_t* y, Vec x) { vst1_u16(reinterpret_cast<uint16_t*>(y), vreinterpret_u16_f16(vcvt_f16_f32(x))); }
inline void vnarrow(bf16_t* y, Vec x) {  // simd/storage.hpp's narrow_bf16, 4 lanes
    const uint32x4_t u = vreinterpretq_u32_f32(x);
    const uint32x4_t hi = vshrq_n_u32(u, 16);
    const uint32x4_t bias = vaddq_u32(vdupq_n_u32(0x7FFF), vandq_u32(hi, vdupq_n_u32(1)));
    const uint32x4_t rounded = vshrq_n_u32(vaddq_u32(u, bias), 16);
    const uint32x4_t nan = vcgtq_u32(vandq_u32(u, vdupq_n_u32(0x7FFFFFFF)), vdupq_n_u32(0x7F800000));
    const uint32x4_t r = vbslq_u32(nan, vorrq_u32(hi, vdupq_n_u32(0x40)), rounded);
    vst1_u16(reinterpret_cast<uint16_t*>(y), vmovn_u32(r));
}
// int4 blocks (storage.hpp's q4_t; see avx2.hpp): the bfloat16 scale and minimum by a shift and a mask.
struct Q4Header {
    Vec scale, minimum;
    explicit Q4Header(const uint8_t* block) {
        uint32_t header;
        __builtin_memcpy(&header, block, 4);
        const uint32x4_t h = vdupq_n_u32(header);
        scale = vreinterpretq_f32_u32(vshlq_n_u32(h, 16));
        minimum = vreinterpretq_f32_u32(vandq_u32(h, vdupq_n_u32(0xFFFF0000u)));
    }
};
inline Vec vwiden_q4(const uint8_t* block, int64_t i) {  // values i .. i + 4 (i a multiple of 4)
    const Q4Header hd(block);
    const uint32x4_t bytes = vmovl_u16(load4_bytes_u16(block + 4 + (i & 15)));
    const uint32x4_t n = i < 16 ? vandq_u32(bytes, vdupq_n_u32(15)) : vshrq_n_u32(bytes, 4);
    return vfma(vcvtq_f32_u32(n), hd.scale, hd.minimum);
}
inline void vwiden_q4_block(const uint8_t* block, Vec* out) {  // out[v]: values 4v .. 4v + 4
    const Q4Header hd(block);
    const uint8x16_t bytes = vld1q_u8(block + 4);
    const uint16x8_t lo8 = vmovl_u8(vget_low_u8(bytes)), hi8 = vmovl_u8(vget_high_u8(bytes));
    const uint32x4_t q[4] = {vmovl_u16(vget_low_u16(lo8)), vmovl_u16(vget_high_u16(lo8)),
                             vmovl_u16(vget_low_u16(hi8)), vmovl_u16(vget_high_u16(hi8))};
    for (int v = 0; v < 4; ++v) {
        out[v] = vfma(vcvtq_f32_u32(vandq_u32(q[v], vdupq_n_u32(15))), hd.scale, hd.minimum);
        out[v + 4] = vfma(vcvtq_f32_u32(vshrq_n_u32(q[v], 4)), hd.scale, hd.minimum);
    }
}

// ---- chunk extras (simd.hpp; a chunk is one Vec here)
inline Vec widen_chunk(const double* x) { return vcombine_f32(vcvt_f32_f64(vld1q_f64(x)), vcvt_f32_f64(vld1q_f64(x + 2))); }
inline Vec chunk_zero_to_neg_inf(const uint8_t* m) {  // byte 0: -inf, else +0
    const uint32x4_t x = vmovl_u16(load4_bytes_u16(m));
    return vreinterpretq_f32_u32(vandq_u32(vceqzq_u32(x), vreinterpretq_u32_f32(vdupq_n_f32(-__builtin_inff()))));
}
inline void transpose_chunks(Vec* r) {  // r[c] <- column c of the 4 x 4 block of rows r
    const float32x4x2_t a = vtrnq_f32(r[0], r[1]);  // a0 b0 a2 b2 | a1 b1 a3 b3
    const float32x4x2_t c = vtrnq_f32(r[2], r[3]);  // c0 d0 c2 d2 | c1 d1 c3 d3
    r[0] = vcombine_f32(vget_low_f32(a.val[0]), vget_low_f32(c.val[0]));
    r[1] = vcombine_f32(vget_low_f32(a.val[1]), vget_low_f32(c.val[1]));
    r[2] = vcombine_f32(vget_high_f32(a.val[0]), vget_high_f32(c.val[0]));
    r[3] = vcombine_f32(vget_high_f32(a.val[1]), vget_high_f32(c.val[1]));
}
struct ZeroTally {  // whether any lane added was nonzero (NaN counts: not equal) / was zero
    uint32x4_t nonzero = vdupq_n_u32(0);
    uint32x4_t zero = vdupq_n_u32(0);
    void add(Vec x) {
        const uint32x4_t z = vceqzq_f32(x);
        nonzero = vorrq_u32(nonzero, vmvnq_u32(z));
        zero = vorrq_u32(zero, z);
    }
    void add(float x) { add(vdupq_n_f32(x)); }
    bool any_nonzero() const { return vmaxvq_u32(nonzero) != 0; }
    bool any_zero() const { return vmaxvq_u32(zero) != 0; }
};

}  // namespace simd
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
