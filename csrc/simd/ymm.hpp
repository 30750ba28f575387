// 8-lane float32 on x86 (AVX2 + F16C), for the avx2 tier's vectors (avx2.hpp's vwiden /
// vnarrow) and the chunks both AVX tiers' prefill stages rows in (simd.hpp's chunk contract):
// stored elements widened to float32 exactly; float32 narrowed to the output type with round
// to nearest even, NaN kept (as storage.hpp's scalars); 8 x 8 transposes; zero tallies.
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
// A float8 format (storage.hpp's Float8 traits), times 1 / kWidenScaleFold (the row scale
// carries the rest): each byte moved into a float16's bits, then vcvtph2ps. e4m3fn's move,
// s.eeee.mmm -> s.0eeee.mmm0000000, is (byte + (byte & 0x80)) << 7; a byte whose sign is
// already in place (kMagShift 8, e5m2) is byte << 8. kNanAtAllOnes: S.1111.111 comes out as
// +-kAllOnesWidened, a magnitude no finite value widens to: those lanes are set to all ones,
// a NaN (a compare in the float domain: no lane-crossing widening of a 16-bit mask).
template <class T, typename std::enable_if<Float8<T>::kIs, int>::type = 0>
inline __m256 widen8(const T* p) {
    static_assert(Float8<T>::kMagShift == 7 || Float8<T>::kMagShift == 8, "a float8 move of 7 or 8 bits");
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h = Float8<T>::kMagShift == 8
                          ? _mm_slli_epi16(b, 8)
                          : _mm_slli_epi16(_mm_add_epi16(b, _mm_and_si128(b, _mm_set1_epi16(0x80))), 7);
    const __m256 x = _mm256_cvtph_ps(h);
    if constexpr (Float8<T>::kNanAtAllOnes) {
        const __m256 nan = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x),
                                         _mm256_set1_ps(Float8<T>::kAllOnesWidened), _CMP_EQ_OQ);
        return _mm256_or_ps(x, nan);
    } else {
        return x;
    }
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

// ---- chunks (simd.hpp): 8 float32 lanes in a ymm, on the AVX-512 tier too
using Chunk = __m256;
constexpr int kChunk = 8;
inline Chunk chunk_set(float x) { return _mm256_set1_ps(x); }
inline Chunk chunk_mul(Chunk a, Chunk b) { return _mm256_mul_ps(a, b); }
inline Chunk chunk_load(const float* p) { return _mm256_load_ps(p); }  // aligned
inline void chunk_store(float* p, Chunk x) { _mm256_store_ps(p, x); }   // aligned
inline void chunk_storeu(float* p, Chunk x) { _mm256_storeu_ps(p, x); }
template <class T> inline Chunk widen_chunk(const T* x) { return widen8(x); }
inline Chunk widen_chunk(const double* x) {
    return _mm256_set_m128(_mm256_cvtpd_ps(_mm256_loadu_pd(x + 4)), _mm256_cvtpd_ps(_mm256_loadu_pd(x)));
}
template <class T> inline void narrow_chunk(T* y, Chunk x) { narrow8(y, x); }
inline Chunk chunk_zero_to_neg_inf(const uint8_t* m) {  // byte 0: -inf, else +0
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m)));
    const __m256i zero = _mm256_cmpeq_epi32(x, _mm256_setzero_si256());
    return _mm256_and_ps(_mm256_castsi256_ps(zero), _mm256_set1_ps(-__builtin_inff()));
}
inline void transpose_chunks(Chunk* r) {  // r[c] <- column c of the 8 x 8 block of rows r
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}
struct ZeroTally {  // whether any lane added was nonzero (NaN counts) / was zero
    __m256 nonzero = _mm256_setzero_ps();
    __m256 zero = _mm256_setzero_ps();
    void add(Chunk x) {
        nonzero = _mm256_or_ps(nonzero, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_NEQ_UQ));
        zero = _mm256_or_ps(zero, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_EQ_OQ));
    }
    void add(float x) { add(_mm256_set1_ps(x)); }
    bool any_nonzero() const { return _mm256_movemask_ps(nonzero) != 0; }
    bool any_zero() const { return _mm256_movemask_ps(zero) != 0; }
};

}  // namespace simd
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
