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

// Ctrl-C: a signal handler calls request_interrupt() (a lock-free atomic store, safe in a
// handler); regions started with `interruptible` then skip their remaining work items, and
// the caller learns of it from take_interrupt(). Only the main Python thread's calls are
// interruptible (it alone receives KeyboardInterrupt), so one flag serves the process.
inline std::atomic<int>& interrupt_flag() {
    static std::atomic<int> flag{0};
    return flag;
}
inline bool interrupt_requested() { return interrupt_flag().load(std::memory_order_relaxed) != 0; }

// A share of the machine for one parallel region; returned when it goes out of scope.
// Never more threads than processors: more only slow a compute-bound region down (and
// thousands of them can exhaust the OS's limit).
class ThreadGrant {
public:
    explicit ThreadGrant(int wanted) {
        if (wanted > processors()) wanted = processors();
        if (wanted < 1) wanted = 1;
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

// Threads for_each_dynamic(count, wanted, ...) runs on while no other region runs.
inline int threads_alone(int64_t count, int wanted) {
    if (count <= 0) return 0;
    int threads = wanted < count ? wanted : static_cast<int>(count);
#ifdef _OPENMP
    if (omp_in_parallel()) return 1;
#endif
    if (threads > processors()) threads = processors();
    return threads < 1 ? 1 : threads;
}

// Runs body(index, thread_id) for index in [0, count) on up to `threads` threads, handing
// out indices one at a time in increasing order (so callers put the costliest work first).
// thread_id < min(threads, count). Which thread runs an index never changes a result, so
// running on fewer threads than asked (see ThreadGrant) is always safe. With
// `interruptible`, indices not yet started are skipped once an interrupt is requested.
template <class Body>
void for_each_dynamic(int64_t count, int threads, bool interruptible, Body&& body) {
    if (count <= 0) return;
    if (threads > count) threads = static_cast<int>(count);
#ifdef _OPENMP
    if (threads > 1 && !omp_in_parallel()) {  // nested in someone's region: stay serial
        const ThreadGrant grant(threads);
        threads = grant.threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
        for (int64_t index = 0; index < count; ++index) {
            if (interruptible && interrupt_requested()) continue;
            body(index, omp_get_thread_num());
        }
        return;
    }
#endif
    (void)threads;
    for (int64_t index = 0; index < count; ++index) {
        if (interruptible && interrupt_requested()) return;
        body(index, 0);
    }
}

}  // namespace parallel
}  // namespace attnfast
