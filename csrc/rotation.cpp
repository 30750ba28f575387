// The quantised caches' key rotation (attnfast._rotation): rows times the orthonormal block
// Hadamard matrix, by the fast Walsh-Hadamard transform. Here rather than a BLAS product: a
// decode step rotates its query rows (and appends rotate their keys) on every call, and a
// threaded BLAS woken for a 32 x 128 product then spins on the other cores while attention
// runs there (OpenBLAS, Zen 5, 32/8 heads, int8 cache, two threads: 8.0 ms a step instead of
// 1.1). Baseline-compiled: a few adds a value, far below the step's cost.
#include <cmath>
#include <cstdint>

#include "attnfast.hpp"

namespace attnfast {

void hadamard_rows(float* x, int64_t rows, int64_t dim, int64_t block) {
    if (block <= 1 || rows <= 0) return;
    // One butterfly stage at a time over every block of the rows: pairs (i, i + h) within
    // each run of 2h become (sum, difference); then the float32 1 / sqrt(block) of an
    // orthonormal matrix (tests/test_lowbit.py writes the same butterflies in NumPy).
    const int64_t n = rows * dim;
    for (int64_t h = 1; h < block; h *= 2)
        for (int64_t run = 0; run < n; run += 2 * h)
            for (int64_t i = run; i < run + h; ++i) {
                const float lo = x[i], hi = x[i + h];
                x[i] = lo + hi;
                x[i + h] = lo - hi;
            }
    const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)));
    for (int64_t i = 0; i < n; ++i) x[i] *= norm;
}

}  // namespace attnfast
