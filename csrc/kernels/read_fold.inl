// The benchmarks' native memory-read kernel, one piece of it: the XOR of the whole 8-byte
// words at data (any alignment), so the loads cannot be optimised away. Included by every
// kernels/isa_*.cpp inside its ATTNFAST_KERNEL_NS (probe.cpp calls the best tier's). The load
// width matters: on AMD Zen 4, 32-byte loads read up to 10 % faster on one core and 14 % on
// two than the 16-byte loads the baseline build makes of the plain loop, and 64-byte ones are
// no faster than 32-byte ones (up to 19 % slower; RESULTS 15.1). So 32-byte loads wherever AVX2
// is there, four independent chains so the loads, not the XORs, limit it.
#pragma once
#include <cstdint>
#if defined(__AVX2__)
#include <immintrin.h>
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

}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
