// The benchmarks' native machine limits, with the best tier's instructions (kernels/probes.inl),
// whatever tier is forced: a memory-read kernel for bandwidth-bound decode
// (attnfast.bench.limits.measure_read_bandwidth takes the best of it and NumPy's kernels) and
// the compute peak for compute-bound calls (measure_peak: no GEMM of a dtype can pass it).
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

double peak_probe(int64_t rounds, bool bf16, int num_threads) {
    const int threads = num_threads > 0 ? num_threads : 1;
    std::vector<double> flops(static_cast<size_t>(threads), 0.0);
    std::vector<float> sink(static_cast<size_t>(threads), 0.0f);
    double (*const spin)(int64_t, bool, float*) = best_kernels().peak_spin;
    parallel::for_each_dynamic(threads, threads, false, [&](int64_t t, int) {
        flops[static_cast<size_t>(t)] = spin(rounds, bf16, &sink[static_cast<size_t>(t)]);
    });
    double total = 0;
    for (double f : flops) total += f;
    return total;
}

}  // namespace attnfast
