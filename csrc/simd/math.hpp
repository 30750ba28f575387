// The SIMD layer's math on its vocabulary (simd.hpp): 2^x and tanh, with each ISA's rounding
// and exponent steps; softcap, and the online-softmax step over query rows in lanes.
// Included through simd.hpp, never directly.
#pragma once
#ifndef ATTNFAST_KERNEL_NS
#error "include csrc/simd/simd.hpp from a kernel translation unit (kernels/isa_*.cpp)"
#endif

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace simd {

// 2^x for x <= 0, as 2^n * p(r), n = round(x), r = x - n in [-1/2, 1/2] (exact), p a degree-6
// minimax polynomial for 2^r (relative error 1.9e-9; <= 0.94 ulp after float32 Horner
// rounding). x < -126 (including -inf) gives exactly 0: underflow is flushed, never denormal.
// NaN stays NaN.
inline Vec exp2_neg(Vec x) {
    constexpr float c1 = 6.931471825e-01f, c2 = 2.402264625e-01f, c3 = 5.550328642e-02f,
                    c4 = 9.618489072e-03f, c5 = 1.339993090e-03f, c6 = 1.534581243e-04f;
#if defined(__AVX512F__)
    const Mask keep = _mm512_cmp_ps_mask(x, vset(-126.0f), _CMP_NLT_UQ);
    const Vec n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const Vec r = vsub(x, n);
#elif defined(__AVX2__)
    const Vec keep = _mm256_cmp_ps(x, vset(-126.0f), _CMP_NLT_UQ);
    const Vec xc = _mm256_max_ps(vset(-127.0f), x);  // keeps 2^n's exponent field >= 0; NaN passes
    const Vec n = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const Vec r = vsub(xc, n);
#elif defined(__aarch64__)
    const Mask keep = vmvnq_u32(vcltq_f32(x, vset(-126.0f)));  // (NaN: not less, so kept)
    const Vec xc = vmaxq_f32(vset(-127.0f), x);  // FMAX: NaN stays NaN
    // Round to nearest even into an integer: exact for xc in [-127, 0]; NaN gives 0 (and p,
    // hence the result, is NaN then anyway).
    const int32x4_t ni = vcvtnq_s32_f32(xc);
    const Vec r = vsub(xc, vcvtq_f32_s32(ni));
#else
    const Vec keep = _mm_cmpnlt_ps(x, vset(-126.0f));  // (unordered: true, so NaN is kept)
    const Vec xc = _mm_max_ps(vset(-127.0f), x);         // maxps returns x when x is NaN
    // cvtps2dq rounds to nearest even in the default MXCSR mode (no roundps before SSE4.1);
    // xc is in [-127, 0] here, so it never overflows; NaN gives INT_MIN and r stays NaN.
    const __m128i ni = _mm_cvtps_epi32(xc);
    const Vec r = vsub(xc, _mm_cvtepi32_ps(ni));
#endif
    Vec p = vfma(vset(c6), r, vset(c5));
    p = vfma(p, r, vset(c4));
    p = vfma(p, r, vset(c3));
    p = vfma(p, r, vset(c2));
    p = vfma(p, r, vset(c1));
    p = vfma(p, r, vset(1.0f));
#if defined(__AVX512F__)
    return _mm512_maskz_scalef_ps(keep, p, n);
#elif defined(__AVX2__)
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
#elif defined(__aarch64__)
    const int32x4_t bits = vshlq_n_s32(vaddq_s32(ni, vdupq_n_s32(127)), 23);
    return vreinterpretq_f32_u32(vandq_u32(keep, vreinterpretq_u32_f32(vmulq_f32(p, vreinterpretq_f32_s32(bits)))));
#else
    const __m128i bits = _mm_slli_epi32(_mm_add_epi32(ni, _mm_set1_epi32(127)), 23);
    return _mm_and_ps(keep, _mm_mul_ps(p, _mm_castsi128_ps(bits)));
#endif
}

// tanh, <= 1.58 ulp against the float64 tanh over every float32 input (checked
// exhaustively on both tiers when written; tests/test_options.py samples it through lse).
// |x| < 0.875: x + x^3 P(x^2), P a degree-5 minimax fit of the relative error (1.1e-8);
// otherwise 1 - 2e / (1 + e) with e = exp(-2|x|) from exp2_neg (no cancellation: the
// quotient is < 0.28 there). Past |x| = 9 the result rounds to exactly +-1; NaN stays NaN. Only a vector with some lane past 0.875 pays for the exponential and the
// division (softcapped scores are mostly well inside it).
inline Vec tanh_vec(Vec x) {
    constexpr float t1 = -3.333324194e-01f, t2 = 1.333097517e-01f, t3 = -5.376160145e-02f,
                    t4 = 2.101710252e-02f, t5 = -7.003248669e-03f, t6 = 1.370988553e-03f;
    const Vec a = vabs(x);
    const Vec u = vmul(a, a);
    Vec p = vfma(vset(t6), u, vset(t5));
    p = vfma(p, u, vset(t4));
    p = vfma(p, u, vset(t3));
    p = vfma(p, u, vset(t2));
    p = vfma(p, u, vset(t1));
    Vec r = vfma(vmul(a, u), p, a);
    const Mask small = less_than(a, 0.875f);
    if (!all_lanes(small)) {
        const Vec e = exp2_neg(vmul(a, vset(-2.0f * 1.4426950408889634f)));
        const Vec big = vsub(vset(1.0f), vdiv(vadd(e, e), vadd(vset(1.0f), e)));
        r = select(small, r, big);
    }
    return vcopysign(r, x);
}

// Softcap on scores in base 2, x = s log2(e): cap tanh(x / cap) with cap = softcap log2(e)
// (attention_core.inl's RowOptions converts it once). Every vector kernel's softcap.
inline Vec softcap(Vec x, Vec cap, Vec inv_cap) { return vmul(cap, tanh_vec(vmul(x, inv_cap))); }

// The online-softmax step of the tile loop that holds query rows in vector lanes
// (simd_prefill.inl; bf16_prefill's and gemm_decode's calls too), for NV vectors of rows over
// one tile of `keys` scores in base 2, key j's at st + j * stride: the running max m becomes
// max(m, tile_max) (the tile's NaN rule is the caller's: a NaN score gives a NaN weight, so l
// turns NaN), corr = 2^(m_old - m)
// rescales the old state (0 while m_old is -inf), the scores become the weights 2^(s - m)
// (exactly 0 below -126), and l = l corr + the tile's weights, summed in key order first (so
// that l takes one rounding per tile, not one per key: over T keys, its error grows with
// T / tile rather than with T). Returns whether some lane of corr is not 1, i.e. whether the
// caller's accumulators need rescaling (once the running max settles they do not). Always
// inlined: out of line, shift and sum went through memory on every key, and an out-of-line
// copy measured up to 4 % slower bfloat16 prefill on Zen 4.
template <int NV>
__attribute__((always_inline)) inline bool online_softmax(float* st, int64_t stride, int64_t keys, float* m,
                                                          float* l, const Vec* tile_max, Vec* corr) {
    Vec shift[NV], sum[NV];
    for (int u = 0; u < NV; ++u) {
        const Vec m_old = vload(m + u * W);
        const Vec m_new = vmax(m_old, tile_max[u]);
        shift[u] = finite_or_zero(m_new);
        corr[u] = exp2_neg(vsub(m_old, shift[u]));
        sum[u] = vzero();
        vstore(m + u * W, m_new);
    }
    for (int64_t j = 0; j < keys; ++j, st += stride)
#pragma GCC unroll 4
        for (int u = 0; u < NV; ++u) {
            const Vec pj = exp2_neg(vsub(vload(st + u * W), shift[u]));
            vstore(st + u * W, pj);
            sum[u] = vadd(sum[u], pj);
        }
    bool rescale = false;
    for (int u = 0; u < NV; ++u) {
        vstore(l + u * W, vfma(vload(l + u * W), corr[u], sum[u]));
        rescale = rescale || !all_ones(corr[u]);
    }
    return rescale;
}

}  // namespace simd
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
