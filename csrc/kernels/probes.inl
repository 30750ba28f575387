// The benchmarks' native probes, the machine limits a kernel is judged against, with each
// tier's instructions (probe.cpp runs the best tier's). Included by every kernels/isa_*.cpp
// inside its ATTNFAST_KERNEL_NS.
//
// read_fold: one piece of the memory-read kernel, the XOR of the whole 8-byte words at data
// (any alignment), so the loads cannot be optimised away. The load width matters: on AMD Zen
// 4, 32-byte loads read up to 10 % faster on one core and 14 % on two than the 16-byte loads
// the baseline build makes of the plain loop, and 64-byte ones are no faster than 32-byte ones
// (up to 19 % slower; RESULTS 15.1). So 32-byte loads wherever AVX2 is there, four
// independent chains so the loads, not the XORs, limit it.
#pragma once
#include <cstdint>
#if defined(__AVX2__) || defined(__SSE2__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {

uint64_t read_fold(const void* data, int64_t bytes) {
    const char* p = static_cast<const char*>(data);
    const int64_t words = bytes / 8;
    int64_t i = 0;  // words done
    uint64_t x = 0;
#if defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 16 <= words; i += 16) {
        const char* q = p + i * 8;
        a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
        a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 96)));
    }
    const __m256i a = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a);
    x = lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
#else
    // Eight independent chains; the compiler turns them into the target's 16-byte loads.
    uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (; i + 8 <= words; i += 8)
        for (int u = 0; u < 8; ++u) {
            uint64_t word;
            __builtin_memcpy(&word, p + (i + u) * 8, 8);
            acc[u] ^= word;
        }
    for (int u = 0; u < 8; ++u) x ^= acc[u];
#endif
    for (; i < words; ++i) {
        uint64_t word;
        __builtin_memcpy(&word, p + i * 8, 8);
        x ^= word;
    }
    return x;
}

// peak_spin: `rounds` rounds of the tier's widest float32 multiply-adds on independent
// accumulators (AVX512_BF16 with bf16 set: vdpbf16ps, two products a lane), enough chains to
// cover the latency of every pipe. Its rate is the compute limit no GEMM of that dtype can
// pass: where the BLAS at hand runs below the machine (OpenBLAS and torch's float32 GEMM on
// AMD Zen 5: ~110 GFLOP/s of ~230), attnfast's prefill read 148-176 % of "GEMM". Returns the
// FLOPs done; *sink gets a fold of the accumulators, so the work is not optimised away.
double peak_spin(int64_t rounds, bool bf16, float* sink) {
    constexpr int kChains = 12;  // >= 2 pipes x latency 4-6; with the 2 constants, 14 registers
#if defined(__AVX512BF16__)
    if (bf16) {
        __m512 acc[kChains];
        for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
        const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3F803F80);  // (1, 1)
        const __m512bh y = (__m512bh)_mm512_set1_epi32(0x33803380);  // (2^-24, 2^-24)
        for (int64_t r = 0; r < rounds; ++r)
#pragma GCC unroll 12
            for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], x, y);
        __m512 t = acc[0];
        for (int c = 1; c < kChains; ++c) t = _mm512_add_ps(t, acc[c]);
        *sink = _mm512_reduce_add_ps(t);
        return 4.0 * 16 * kChains * static_cast<double>(rounds);
    }
#endif
    (void)bf16;
#if defined(__AVX512F__)
    using V = __m512;
    constexpr int kLanes = 16;
    auto set = [](float x) { return _mm512_set1_ps(x); };
    auto madd = [](V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); };
    auto add = [](V a, V b) { return _mm512_add_ps(a, b); };
    auto first = [](V a) { return _mm512_cvtss_f32(a); };
#elif defined(__AVX2__) && defined(__FMA__)
    using V = __m256;
    constexpr int kLanes = 8;
    auto set = [](float x) { return _mm256_set1_ps(x); };
    auto madd = [](V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); };
    auto add = [](V a, V b) { return _mm256_add_ps(a, b); };
    auto first = [](V a) { return _mm256_cvtss_f32(a); };
#elif defined(__aarch64__)
    using V = float32x4_t;
    constexpr int kLanes = 4;
    auto set = [](float x) { return vdupq_n_f32(x); };
    auto madd = [](V a, V b, V c) { return vfmaq_f32(c, a, b); };
    auto add = [](V a, V b) { return vaddq_f32(a, b); };
    auto first = [](V a) { return vgetq_lane_f32(a, 0); };
#elif defined(__SSE2__)  // no FMA: a multiply and an add, the generic tier's multiply-add
    using V = __m128;
    constexpr int kLanes = 4;
    auto set = [](float x) { return _mm_set1_ps(x); };
    auto madd = [](V a, V b, V c) { return _mm_add_ps(_mm_mul_ps(a, b), c); };
    auto add = [](V a, V b) { return _mm_add_ps(a, b); };
    auto first = [](V a) { return _mm_cvtss_f32(a); };
#else
    using V = float;
    constexpr int kLanes = 1;
    auto set = [](float x) { return x; };
    auto madd = [](V a, V b, V c) { return a * b + c; };
    auto add = [](V a, V b) { return a + b; };
    auto first = [](V a) { return a; };
#endif
    V acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = set(static_cast<float>(c));
    const V a = set(0.999999f), b = set(1e-7f);
    for (int64_t r = 0; r < rounds; ++r)
#pragma GCC unroll 12
        for (int c = 0; c < kChains; ++c) acc[c] = madd(acc[c], a, b);
    V t = acc[0];
    for (int c = 1; c < kChains; ++c) t = add(t, acc[c]);
    *sink = first(t);
    return 2.0 * kLanes * kChains * static_cast<double>(rounds);
}

}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
