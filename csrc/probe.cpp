// A native memory-read kernel: the benchmarks' machine limit for bandwidth-bound decode
// (attnfast._bench.measure_read_bandwidth takes the best of it and NumPy's kernels). Baseline
// ISA on purpose: 16-byte loads already ask far more of one core than DRAM delivers.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "attnfast.hpp"
#include "parallel.hpp"

namespace attnfast {

uint64_t read_probe(const void* data, int64_t bytes, int num_threads) {
    // Contiguous 4 MiB pieces handed out in address order: each thread streams one at a
    // time, as a decode task streams its chunk of K and V.
    constexpr int64_t kPiece = int64_t(4) << 20;
    const int64_t pieces = (bytes + kPiece - 1) / kPiece;
    std::vector<uint64_t> folded(static_cast<size_t>(pieces > 0 ? pieces : 1), 0);
    parallel::for_each_dynamic(pieces, num_threads, false, [&](int64_t piece, int) {
        const char* begin = static_cast<const char*>(data) + piece * kPiece;
        const int64_t n = (bytes - piece * kPiece < kPiece ? bytes - piece * kPiece : kPiece) / 8;
        uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // independent chains: loads, not adds, limit
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int u = 0; u < 8; ++u) {
                uint64_t word;
                __builtin_memcpy(&word, begin + (i + u) * 8, 8);
                acc[u] ^= word;
            }
        for (; i < n; ++i) {
            uint64_t word;
            __builtin_memcpy(&word, begin + i * 8, 8);
            acc[0] ^= word;
        }
        uint64_t x = 0;
        for (int u = 0; u < 8; ++u) x ^= acc[u];
        folded[static_cast<size_t>(piece)] = x;
    });
    uint64_t x = 0;
    for (uint64_t f : folded) x ^= f;
    return x;  // returned so the reads cannot be optimised away
}

}  // namespace attnfast
