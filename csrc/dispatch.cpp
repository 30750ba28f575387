// Picks the kernel tier once: the best one compiled in that this CPU (and its OS) can run,
// or the one named by ATTNFAST_ISA. Compiled for the baseline ISA like the drivers.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#include "attnfast.hpp"
#include "kernels/kernel_table.hpp"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#define ATTNFAST_X86 1
#endif

namespace attnfast {
namespace {

struct Tier {
    const char* name;
    const KernelTable* (*table)();
    bool (*cpu_runs)();
};

#ifdef ATTNFAST_X86
// XCR0 bits the OS must enable for the register state: SSE|AVX (0x6), plus opmask and
// the upper ZMM halves for AVX-512 (0xE0).
unsigned long long xcr0() {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27))) return 0;  // no OSXSAVE
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (static_cast<unsigned long long>(hi) << 32) | lo;
}
bool cpuid_leaf7(unsigned* ebx) {
    unsigned eax, ecx, edx;
    return __get_cpuid_count(7, 0, &eax, ebx, &ecx, &edx) != 0;
}
bool cpu_runs_avx2() {
    unsigned eax, ebx, ecx, edx, ebx7;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !cpuid_leaf7(&ebx7)) return false;
    const bool fma = ecx & (1u << 12), f16c = ecx & (1u << 29), avx2 = ebx7 & (1u << 5);
    return fma && f16c && avx2 && (xcr0() & 0x6) == 0x6;
}
bool cpu_runs_avx512() {
    unsigned ebx7;
    if (!cpu_runs_avx2() || !cpuid_leaf7(&ebx7)) return false;
    const unsigned need = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);  // F, DQ, BW, VL
    return (ebx7 & need) == need && (xcr0() & 0xE6) == 0xE6;
}
bool cpu_runs_avx512bf16() {
    unsigned eax, ebx, ecx, edx;
    if (!cpu_runs_avx512() || !__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return false;
    return eax & (1u << 5);  // CPUID.(7, 1):EAX[5] AVX512_BF16
}
#endif
bool cpu_runs_always() { return true; }

// Best first.
const Tier kTiers[] = {
#ifdef ATTNFAST_HAVE_NEON
    {"neon", kernel_table_neon, cpu_runs_always},  // Advanced SIMD is part of AArch64
#endif
#ifdef ATTNFAST_HAVE_AVX512BF16
    {"avx512bf16", kernel_table_avx512bf16, cpu_runs_avx512bf16},
#endif
#ifdef ATTNFAST_HAVE_AVX512
    {"avx512", kernel_table_avx512, cpu_runs_avx512},
#endif
#ifdef ATTNFAST_HAVE_AVX2
    {"avx2", kernel_table_avx2, cpu_runs_avx2},
#endif
    {"generic", kernel_table_generic, cpu_runs_always},
};

std::atomic<const KernelTable*> g_active{nullptr};
std::mutex g_mutex;
std::string g_error;
std::string g_available;
std::string g_compiled;

const Tier* find_tier(const char* name) {
    for (const Tier& t : kTiers)
        if (std::strcmp(t.name, name) == 0) return &t;
    return nullptr;
}

// The first (best) tier this CPU runs; generic, last, always does.
const Tier& best_tier() {
    for (const Tier& t : kTiers)
        if (t.cpu_runs()) return t;
    return kTiers[sizeof(kTiers) / sizeof(kTiers[0]) - 1];
}

// Selects by name ("" = best available); on failure keeps the current choice and sets g_error.
bool select_locked(const char* name) {
    if (name == nullptr || *name == '\0') {
        g_active.store(best_tier().table());
        g_error.clear();
        return true;
    }
    const Tier* t = find_tier(name);
    if (t == nullptr) {
        g_error = std::string("unknown kernel tier '") + name + "'; built: " + g_compiled;
        return false;
    }
    if (!t->cpu_runs()) {
        g_error = std::string("kernel tier '") + name + "' cannot run on this CPU; available: " + g_available;
        return false;
    }
    g_active.store(t->table());
    g_error.clear();
    return true;
}

const KernelTable& initialise() {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (const KernelTable* t = g_active.load()) return *t;
    for (const Tier& t : kTiers) {  // fixed for the life of the process
        g_compiled += (g_compiled.empty() ? "" : ",") + std::string(t.name);
        if (t.cpu_runs()) g_available += (g_available.empty() ? "" : ",") + std::string(t.name);
    }
    const char* forced = std::getenv("ATTNFAST_ISA");
    if (!select_locked(forced ? forced : "")) {
        const std::string why = g_error;
        select_locked("");  // fall back to the best tier, but remember why
        g_error = "ATTNFAST_ISA: " + why;
    }
    return *g_active.load();
}

}  // namespace

const KernelTable& active_kernels() {
    if (const KernelTable* t = g_active.load(std::memory_order_acquire)) return *t;
    return initialise();
}

const KernelTable& best_kernels() {
    static const KernelTable* const best = best_tier().table();
    return *best;
}

const char* isa_selected() { return active_kernels().name; }

const char* isa_lowp_instructions() { return active_kernels().lowp_instructions; }

const char* isa_available() {
    active_kernels();
    return g_available.c_str();
}

const char* isa_compiled() {
    active_kernels();
    return g_compiled.c_str();
}

bool isa_force(const char* name) {
    active_kernels();
    std::lock_guard<std::mutex> lock(g_mutex);
    return select_locked(name);
}

namespace {
// bytes clamped to [lo, hi]; `fallback` when bytes <= 0 (unknown).
int64_t clamp_cache_bytes(int64_t bytes, int64_t fallback, int64_t lo, int64_t hi) {
    if (bytes <= 0) return fallback;
    return bytes < lo ? lo : (bytes > hi ? hi : bytes);
}

// sysconf's answer for `name`, clamped to [lo, hi]; `fallback` when the OS does not say
// (some VMs and libcs report 0).
int64_t cache_bytes(int name, int64_t fallback, int64_t lo, int64_t hi) {
    int64_t bytes = 0;
#if defined(__unix__) || defined(__APPLE__)
    if (name >= 0) bytes = static_cast<int64_t>(sysconf(name));
#else
    (void)name;
#endif
    return clamp_cache_bytes(bytes, fallback, lo, hi);
}
}  // namespace

const CacheSizes& cache_sizes() {
    static const CacheSizes sizes = [] {
        CacheSizes c;
#if defined(_SC_LEVEL1_DCACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE)
        c.l1d = cache_bytes(_SC_LEVEL1_DCACHE_SIZE, 32 << 10, 16 << 10, 256 << 10);
        c.l2 = cache_bytes(_SC_LEVEL2_CACHE_SIZE, 1 << 20, 128 << 10, 8 << 20);
#else
        c.l1d = cache_bytes(-1, 32 << 10, 16 << 10, 256 << 10);
        c.l2 = cache_bytes(-1, 1 << 20, 128 << 10, 8 << 20);
#endif
        // ATTNFAST_L2_BYTES (read once) replaces the OS's answer: the tile sizes and decode
        // streams chosen from it can then be tested on any machine.
        if (const char* forced = std::getenv("ATTNFAST_L2_BYTES"))
            c.l2 = clamp_cache_bytes(std::atoll(forced), c.l2, 128 << 10, 8 << 20);
        return c;
    }();
    return sizes;
}

namespace {
std::atomic<int> g_int8_dot_widen{-1};  // -1: not read yet
}  // namespace

bool int8_dot_widen() {
    int widen = g_int8_dot_widen.load(std::memory_order_relaxed);
    if (widen < 0) {
        const char* choice = std::getenv("ATTNFAST_INT8_DOT");
        int expected = -1;
        g_int8_dot_widen.compare_exchange_strong(expected, choice && std::strcmp(choice, "widen") == 0);
        widen = g_int8_dot_widen.load(std::memory_order_relaxed);
    }
    return widen == 1;
}

void int8_dot_widen_force(bool widen) { g_int8_dot_widen.store(widen ? 1 : 0); }

const char* isa_error() {
    active_kernels();
    std::lock_guard<std::mutex> lock(g_mutex);
    return g_error.c_str();
}

}  // namespace attnfast
