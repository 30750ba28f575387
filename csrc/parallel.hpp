// Every OpenMP call of the library lives here, each with a fallback for builds without it.
#pragma once
#include <atomic>
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

// Threads held by parallel regions running right now, across all callers. Several Python
// threads may call in at once (the GIL is released); each region takes only what the cores
// leave free (at least one thread), so concurrent calls do not oversubscribe the machine.
// A region that starts while no other runs gets all it asks for.
inline std::atomic<int>& busy_threads() {
    static std::atomic<int> busy{0};
    return busy;
}

inline int processors() {
#ifdef _OPENMP
    return omp_get_num_procs();
#else
    return 1;
#endif
}

// A share of the machine for one parallel region; returned when it goes out of scope.
class ThreadGrant {
public:
    explicit ThreadGrant(int wanted) {
        int busy = busy_threads().load();
        do {
            const int free_now = busy == 0 ? wanted : processors() - busy;
            granted_ = wanted < free_now ? wanted : (free_now > 1 ? free_now : 1);
        } while (!busy_threads().compare_exchange_weak(busy, busy + granted_));
    }
    ~ThreadGrant() { busy_threads().fetch_sub(granted_); }
    ThreadGrant(const ThreadGrant&) = delete;
    ThreadGrant& operator=(const ThreadGrant&) = delete;
    int threads() const { return granted_; }

private:
    int granted_ = 1;
};

// Runs body(index, thread_id) for index in [0, count) on up to `threads` threads, handing
// out indices one at a time in increasing order (so callers put the costliest work first).
// thread_id < min(threads, count). Which thread runs an index never changes a result, so
// running on fewer threads than asked (see ThreadGrant) is always safe.
template <class Body>
void for_each_dynamic(int64_t count, int threads, Body&& body) {
    if (count <= 0) return;
    if (threads > count) threads = static_cast<int>(count);
#ifdef _OPENMP
    if (threads > 1 && !omp_in_parallel()) {  // nested in someone's region: stay serial
        const ThreadGrant grant(threads);
        threads = grant.threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
        for (int64_t index = 0; index < count; ++index) body(index, omp_get_thread_num());
        return;
    }
#endif
    (void)threads;
    for (int64_t index = 0; index < count; ++index) body(index, 0);
}

}  // namespace parallel
}  // namespace attnfast
