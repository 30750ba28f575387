// 8-lane float32 conversions on x86 (AVX2 + F16C), for the avx2 tier's vectors (avx2.hpp's
// vwiden / vnarrow) and the 8-lane chunks the AVX-512 tier's prefill stages rows in
// (simd_prefill.inl): stored elements widened to float32 exactly; float32 narrowed to the
// output type with round to nearest even, NaN kept (as storage.hpp's scalars).
// Included through simd.hpp (avx2.hpp, avx512.hpp), never directly.
#pragma once
#ifndef ATTNFAST_KERNEL_NS
#error "include csrc/simd/simd.hpp from a kernel translation unit (kernels/isa_*.cpp)"
#endif
#include <immintrin.h>

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace simd {

// ---- 8 stored elements (unaligned) to float32
inline __m256 widen8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 widen8(const f16_t* x) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))); }
inline __m256 widen8(const bf16_t* x) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
inline __m256 widen8(const int8_t* x) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x))));
}
// float8 e4m3fn, times 2^-8 (kWidenScaleFold: the row scale carries the 2^8): each byte moved
// into a float16's bits, s.eeee.mmm -> s.0eeee.mmm0000000 = (byte + (byte & 0x80)) << 7, which
// is the e4m3 value over 2^8 with every subnormal exact (both formats' subnormals are 0.m times
// their smallest normal), then vcvtph2ps. S.1111.111 (NaN in e4m3fn) comes out as +-1.875, a
// magnitude no finite e4m3 value over 2^8 has (the largest is 1.75): those lanes are set to
// all ones, a NaN (a compare in the float domain: no lane-crossing widening of a 16-bit mask).
inline __m256 widen8(const fp8_t* p) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h = _mm_slli_epi16(_mm_add_epi16(b, _mm_and_si128(b, _mm_set1_epi16(0x80))), 7);
    const __m256 x = _mm256_cvtph_ps(h);
    const __m256 nan = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), _mm256_set1_ps(1.875f),
                                     _CMP_EQ_OQ);
    return _mm256_or_ps(x, nan);
}

// ---- float32 to 8 stored elements
inline void narrow8(float* y, __m256 x) { _mm256_storeu_ps(y, x); }
inline void narrow8(f16_t* y, __m256 x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void narrow8(bf16_t* y, __m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(hi, _mm256_set1_epi32(1)));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                           _mm256_set1_epi32(0x7F800000));
    const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

}  // namespace simd
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
