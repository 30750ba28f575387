// The SIMD layer's typed vocabulary: GCC / Clang vector extensions one register of the
// including tier wide (ATTNFAST_SIMD_BYTES: zmm, ymm or xmm), templated over the accumulator
// type (float, double), for the kernels written once for both (the template decode, the
// backward's micro-GEMM). simd.hpp is the float32 vocabulary of the hand-written kernels;
// this one adds double lanes and the storage types' converting loads (storage.hpp):
//   Vec<A>, vec_lanes<A>()   one register of A
//   vload vstore             unaligned whole vectors; vload of bf16_t / f16_t / int8_t /
//                            float8 widens exactly to float32 lanes; vload_row also reads int4
//   vsum                     the lanes summed in a fixed tree
//   fmadd splat loadu storeu a * b + c with one rounding where the ISA has FMA; broadcast;
//                            one unaligned vector move each
// Included by the kernel files of a tier (kernels/isa_*.cpp and their .inl files), inside
// that tier's namespace, as simd.hpp.
#pragma once
#ifndef ATTNFAST_KERNEL_NS
#error "include csrc/simd/typed.hpp from a kernel translation unit (kernels/isa_*.cpp)"
#endif
#include <cstdint>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "storage.hpp"

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {

#ifndef ATTNFAST_SIMD_BYTES
#define ATTNFAST_SIMD_BYTES 16
#endif
static_assert(ATTNFAST_SIMD_BYTES == 16 || ATTNFAST_SIMD_BYTES == 32 || ATTNFAST_SIMD_BYTES == 64,
              "ATTNFAST_SIMD_BYTES: the vector register width of the including ISA file");

// GCC/Clang vector extensions, one register of the including file's ISA wide (zmm, ymm or
// xmm): plain loops over 2-D accumulator arrays left the accumulators on the stack; these
// keep them in registers while the source stays ISA-neutral. (Wider-than-register vectors
// were tried: GCC lowers them badly.)
#pragma GCC diagnostic push
#if defined(__clang__)
#pragma GCC diagnostic ignored "-Wunknown-warning-option"
#endif
#pragma GCC diagnostic ignored "-Wpsabi"  // all inlined: no vector crosses a call boundary
template <class A> struct VecOf;
template <> struct VecOf<float> { typedef float type __attribute__((vector_size(ATTNFAST_SIMD_BYTES))); };
template <> struct VecOf<double> { typedef double type __attribute__((vector_size(ATTNFAST_SIMD_BYTES))); };
template <class A> using Vec = typename VecOf<A>::type;
template <class A> constexpr int64_t vec_lanes() {
    return ATTNFAST_SIMD_BYTES / static_cast<int64_t>(sizeof(A));
}

// Unaligned loads/stores (memcpy compiles to one vector move). Storage types other than the
// accumulator type would add converting overloads here.
inline Vec<float> vload(const float* p) { Vec<float> v; __builtin_memcpy(&v, p, sizeof v); return v; }
inline Vec<double> vload(const double* p) { Vec<double> v; __builtin_memcpy(&v, p, sizeof v); return v; }
template <class A> inline void vstore(A* p, const Vec<A>& v) { __builtin_memcpy(p, &v, sizeof v); }

// Converting loads of the reduced-precision storage types: one register of float32 lanes
// from that many 16-bit or 8-bit values (widened exactly; never a 16-bit accumulator).
inline Vec<float> vload(const bf16_t* p) {  // bfloat16: the upper half of a float32
    typedef uint16_t Half __attribute__((vector_size(ATTNFAST_SIMD_BYTES / 2)));
    typedef uint32_t Word __attribute__((vector_size(ATTNFAST_SIMD_BYTES)));
    Half h;
    __builtin_memcpy(&h, p, sizeof h);
    const Word w = __builtin_convertvector(h, Word) << 16;
    Vec<float> f;
    __builtin_memcpy(&f, &w, sizeof f);
    return f;
}
inline Vec<float> vload(const f16_t* p) {
    Vec<float> f;
#if defined(__AVX512F__) && ATTNFAST_SIMD_BYTES == 64
    const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    __builtin_memcpy(&f, &x, sizeof f);
#elif defined(__F16C__) && ATTNFAST_SIMD_BYTES == 32
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    __builtin_memcpy(&f, &x, sizeof f);
#else  // no conversion instruction: lane by lane
    for (int64_t i = 0; i < vec_lanes<float>(); ++i) f[i] = widen(p[i]);
#endif
    return f;
}
inline Vec<float> vload(const int8_t* p) {  // an int8 cache's values (scaled by the caller)
    Vec<float> f;
#if defined(__AVX512F__) && ATTNFAST_SIMD_BYTES == 64
    // (GCC turns a one-step int8 -> float __builtin_convertvector into 16 scalar conversions)
    const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    __builtin_memcpy(&f, &x, sizeof f);
#elif defined(__AVX2__) && ATTNFAST_SIMD_BYTES == 32
    const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    __builtin_memcpy(&f, &x, sizeof f);
#else
    typedef int8_t Bytes __attribute__((vector_size(ATTNFAST_SIMD_BYTES / 4)));
    typedef int32_t Words __attribute__((vector_size(ATTNFAST_SIMD_BYTES)));
    Bytes b;
    __builtin_memcpy(&b, p, sizeof b);
    f = __builtin_convertvector(__builtin_convertvector(b, Words), Vec<float>);
#endif
    return f;
}

// A float8 format (a float8 cache's values, scaled by the caller): lane by lane, exactly (the
// hand-written decode widens in registers; see simd_decode.inl).
template <class T, typename std::enable_if<Float8<T>::kIs, int>::type = 0>
inline Vec<float> vload(const T* p) {
    Vec<float> f;
    for (int64_t i = 0; i < vec_lanes<float>(); ++i) f[i] = widen(p[i]);
    return f;
}

// One register of values d, d + 1, .. of a stored K/V row (d a multiple of the lanes).
// Element pointers step values for every storage type but int4, whose rows are blocks
// (storage.hpp): there lane by lane, each value scale * n + minimum.
template <class T> inline auto vload_row(const T* row, int64_t d) { return vload(row + d); }
inline Vec<float> vload_row(const q4_t* row, int64_t d) {
    Vec<float> f = {};  // (every lane written below; the initialiser quiets GCC 12's -Wmaybe-uninitialized)
    for (int64_t i = 0; i < vec_lanes<float>(); ++i) f[i] = q4_value(row, d + i);
    return f;
}

// Sum of the lanes in a fixed tree: add the upper half onto the lower half until 4 float
// (2 double) lanes are left, then (s0 + s2) + (s1 + s3) (s0 + s1). Vector shuffles keep it
// in registers (GCC >= 12, Clang); older compilers do the same arithmetic through memory.
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define ATTNFAST_HALVES(v, n) \
    (__builtin_shufflevector(v, v, ATTNFAST_LO##n) + __builtin_shufflevector(v, v, ATTNFAST_HI##n))
#define ATTNFAST_LO16 0, 1, 2, 3, 4, 5, 6, 7
#define ATTNFAST_HI16 8, 9, 10, 11, 12, 13, 14, 15
#define ATTNFAST_LO8 0, 1, 2, 3
#define ATTNFAST_HI8 4, 5, 6, 7
#define ATTNFAST_LO4 0, 1
#define ATTNFAST_HI4 2, 3
inline float vsum(const Vec<float>& v) {
#if ATTNFAST_SIMD_BYTES == 64
    const auto h = ATTNFAST_HALVES(v, 16);
    const auto s = ATTNFAST_HALVES(h, 8);
#elif ATTNFAST_SIMD_BYTES == 32
    const auto s = ATTNFAST_HALVES(v, 8);
#else
    const auto s = v;
#endif
    return (s[0] + s[2]) + (s[1] + s[3]);
}
inline double vsum(const Vec<double>& v) {
#if ATTNFAST_SIMD_BYTES == 64
    const auto h = ATTNFAST_HALVES(v, 8);
    const auto s = ATTNFAST_HALVES(h, 4);
#elif ATTNFAST_SIMD_BYTES == 32
    const auto s = ATTNFAST_HALVES(v, 4);
#else
    const auto s = v;
#endif
    return s[0] + s[1];
}
#undef ATTNFAST_HALVES
#else
template <class A>
inline A vsum_in_memory(const Vec<A>& v) {
    A x[vec_lanes<A>()];
    __builtin_memcpy(x, &v, sizeof x);
    for (int64_t n = vec_lanes<A>(); n > 16 / static_cast<int64_t>(sizeof(A)); n /= 2)
        for (int64_t u = 0; u < n / 2; ++u) x[u] += x[u + n / 2];
    return sizeof(A) == 4 ? (x[0] + x[2]) + (x[1] + x[3]) : x[0] + x[1];
}
inline float vsum(const Vec<float>& v) { return vsum_in_memory<float>(v); }
inline double vsum(const Vec<double>& v) { return vsum_in_memory<double>(v); }
#endif

// a * b + c, one rounding where the ISA has FMA (GCC's vector types convert to the
// intrinsics' types of the same element type and size). Without FMA (the SSE2 tier):
// multiply, then add, as `a * b + c` compiles under -ffp-contract=off (ISO C++). splat: x in
// every lane (one broadcast; GCC builds it lane by lane from a loop). loadu / storeu: one
// unaligned vector move each (GCC's generic tuning splits a memcpy'd 32-byte store in two).
#if ATTNFAST_SIMD_BYTES == 64 && defined(__AVX512F__)
inline Vec<float> fmadd(Vec<float> a, Vec<float> b, Vec<float> c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec<double> fmadd(Vec<double> a, Vec<double> b, Vec<double> c) { return _mm512_fmadd_pd(a, b, c); }
inline Vec<float> splat(float x) { return _mm512_set1_ps(x); }
inline Vec<double> splat(double x) { return _mm512_set1_pd(x); }
inline Vec<float> loadu(const float* p) { return _mm512_loadu_ps(p); }
inline Vec<double> loadu(const double* p) { return _mm512_loadu_pd(p); }
inline void storeu(float* p, Vec<float> x) { _mm512_storeu_ps(p, x); }
inline void storeu(double* p, Vec<double> x) { _mm512_storeu_pd(p, x); }
#elif ATTNFAST_SIMD_BYTES == 32 && defined(__FMA__)
inline Vec<float> fmadd(Vec<float> a, Vec<float> b, Vec<float> c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec<double> fmadd(Vec<double> a, Vec<double> b, Vec<double> c) { return _mm256_fmadd_pd(a, b, c); }
inline Vec<float> splat(float x) { return _mm256_set1_ps(x); }
inline Vec<double> splat(double x) { return _mm256_set1_pd(x); }
inline Vec<float> loadu(const float* p) { return _mm256_loadu_ps(p); }
inline Vec<double> loadu(const double* p) { return _mm256_loadu_pd(p); }
inline void storeu(float* p, Vec<float> x) { _mm256_storeu_ps(p, x); }
inline void storeu(double* p, Vec<double> x) { _mm256_storeu_pd(p, x); }
#elif ATTNFAST_SIMD_BYTES == 16 && defined(__aarch64__)
inline Vec<float> fmadd(Vec<float> a, Vec<float> b, Vec<float> c) { return vfmaq_f32(c, a, b); }
inline Vec<double> fmadd(Vec<double> a, Vec<double> b, Vec<double> c) { return vfmaq_f64(c, a, b); }
inline Vec<float> splat(float x) { return vdupq_n_f32(x); }
inline Vec<double> splat(double x) { return vdupq_n_f64(x); }
inline Vec<float> loadu(const float* p) { return vld1q_f32(p); }
inline Vec<double> loadu(const double* p) { return vld1q_f64(p); }
inline void storeu(float* p, Vec<float> x) { vst1q_f32(p, x); }
inline void storeu(double* p, Vec<double> x) { vst1q_f64(p, x); }
#elif ATTNFAST_SIMD_BYTES == 16 && defined(__SSE2__)
template <class V> inline V fmadd(V a, V b, V c) { return a * b + c; }
inline Vec<float> splat(float x) { return _mm_set1_ps(x); }
inline Vec<double> splat(double x) { return _mm_set1_pd(x); }
inline Vec<float> loadu(const float* p) { return _mm_loadu_ps(p); }
inline Vec<double> loadu(const double* p) { return _mm_loadu_pd(p); }
inline void storeu(float* p, Vec<float> x) { _mm_storeu_ps(p, x); }
inline void storeu(double* p, Vec<double> x) { _mm_storeu_pd(p, x); }
#else  // another architecture's baseline: GCC's generic vectors
template <class V> inline V fmadd(V a, V b, V c) { return a * b + c; }
template <class A> inline Vec<A> splat(A x) {
    Vec<A> v;
    for (int64_t i = 0; i < vec_lanes<A>(); ++i) v[i] = x;
    return v;
}
template <class A> inline Vec<A> loadu(const A* p) { return vload(p); }
template <class A> inline void storeu(A* p, Vec<A> x) { vstore(p, x); }
#endif

#pragma GCC diagnostic pop

}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
