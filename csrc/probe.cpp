// A native memory-read kernel: the benchmarks' machine limit for bandwidth-bound decode
// (attnfast._bench.measure_read_bandwidth takes the best of it and NumPy's kernels). The loads
// are the best tier's (kernels/read_fold.inl), whatever tier is forced: a machine limit.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "attnfast.hpp"
#include "kernels/kernel_table.hpp"
#include "parallel.hpp"

namespace attnfast {

uint64_t read_probe(const void* data, int64_t bytes, int num_threads) {
    // Contiguous 4 MiB pieces handed out in address order: each thread streams one at a
    // time, as a decode task streams its chunk of K and V.
    constexpr int64_t kPiece = int64_t(4) << 20;
    const int64_t pieces = (bytes + kPiece - 1) / kPiece;
    std::vector<uint64_t> folded(static_cast<size_t>(pieces > 0 ? pieces : 1), 0);
    uint64_t (*const fold)(const void*, int64_t) = best_kernels().read_fold;
    parallel::for_each_dynamic(pieces, num_threads, false, [&](int64_t piece, int) {
        const int64_t n = bytes - piece * kPiece < kPiece ? bytes - piece * kPiece : kPiece;
        folded[static_cast<size_t>(piece)] = fold(static_cast<const char*>(data) + piece * kPiece, n);
    });
    uint64_t x = 0;
    for (uint64_t f : folded) x ^= f;
    return x;  // returned so the reads cannot be optimised away
}

}  // namespace attnfast
