// Every OpenMP call of the library lives here, each with a fallback for builds without it.
#pragma once
#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace attnfast {
namespace parallel {

inline bool enabled() {
#ifdef _OPENMP
    return true;
#else
    return false;
#endif
}

inline int max_threads() {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

// Runs body(index, thread_id) for index in [0, count) on up to `threads` threads, handing
// out indices one at a time in increasing order (so callers put the costliest work first).
// thread_id < min(threads, count). Which thread runs an index never changes a result.
template <class Body>
void for_each_dynamic(int64_t count, int threads, Body&& body) {
    if (count <= 0) return;
    if (threads > count) threads = static_cast<int>(count);
#ifdef _OPENMP
    if (threads > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (int64_t index = 0; index < count; ++index) body(index, omp_get_thread_num());
        return;
    }
#endif
    (void)threads;
    for (int64_t index = 0; index < count; ++index) body(index, 0);
}

}  // namespace parallel
}  // namespace attnfast
