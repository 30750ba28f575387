// Picks the kernel tier once: the best one compiled in that this CPU (and its OS) can run,
// or the one named by ATTNFAST_ISA. Compiled for the baseline ISA like the drivers.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

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
#endif
bool cpu_runs_always() { return true; }

// Best first.
const Tier kTiers[] = {
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

// Selects by name ("" = best available); on failure keeps the current choice and sets g_error.
bool select_locked(const char* name) {
    if (name == nullptr || *name == '\0') {
        for (const Tier& t : kTiers)
            if (t.cpu_runs()) {
                g_active.store(t.table());
                g_error.clear();
                return true;
            }
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

const char* isa_selected() { return active_kernels().name; }

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

const char* isa_error() {
    active_kernels();
    std::lock_guard<std::mutex> lock(g_mutex);
    return g_error.c_str();
}

}  // namespace attnfast
