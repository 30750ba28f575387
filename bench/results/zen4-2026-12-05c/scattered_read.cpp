// Native probe (HISTORY 38): one thread reads 128 MiB as blocks of B bytes taken in a random
// order from a pool of twice that (huge pages), four zmm loads per 256 bytes, with the block
// `ahead` places on prefetched (prefetcht1) as each block is read; best of 5. The limit a paged
// cache's decode can reach with blocks scattered at random.
//   g++ -O2 -mavx512f -std=c++17 scattered_read.cpp -o /tmp/scattered_read && /tmp/scattered_read
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include <sys/mman.h>
__attribute__((noinline)) float run(const char* pool, const std::vector<int>& ids, size_t bs, int ahead) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < ids.size(); ++i) {
        const char* b = pool + (size_t)ids[i] * bs;
        const char* pf = ahead && i + ahead < ids.size() ? pool + (size_t)ids[i + ahead] * bs : nullptr;
        for (size_t o = 0; o < bs; o += 256) {
            if (pf) { _mm_prefetch(pf + o, _MM_HINT_T1); _mm_prefetch(pf + o + 64, _MM_HINT_T1); _mm_prefetch(pf + o + 128, _MM_HINT_T1); _mm_prefetch(pf + o + 192, _MM_HINT_T1); }
            a0 = _mm512_add_ps(a0, _mm512_loadu_ps((const float*)(b + o)));
            a1 = _mm512_add_ps(a1, _mm512_loadu_ps((const float*)(b + o + 64)));
            a2 = _mm512_add_ps(a2, _mm512_loadu_ps((const float*)(b + o + 128)));
            a3 = _mm512_add_ps(a3, _mm512_loadu_ps((const float*)(b + o + 192)));
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
int main() {
    size_t total = (size_t)128 << 20;  // bytes read
    char* pool = (char*)aligned_alloc(1 << 21, 2 * total);
    madvise(pool, 2 * total, MADV_HUGEPAGE);
    memset(pool, 1, 2 * total);
    for (size_t bs : {size_t(4096), size_t(8192), size_t(16384), size_t(65536), size_t(131072), total}) {
        size_t nb = total / bs;
        std::vector<int> ids(2 * nb); for (size_t i = 0; i < ids.size(); ++i) ids[i] = i;
        std::mt19937 g(0); std::shuffle(ids.begin(), ids.end(), g); ids.resize(nb);
        if (bs == total) ids[0] = 0;
        for (int ahead : {0, 1, 2, 4}) {
            double best = 1e9; float s = 0;
            for (int r = 0; r < 5; ++r) {
                auto t0 = std::chrono::steady_clock::now();
                s += run(pool, ids, bs, ahead);
                double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                best = std::min(best, t);
            }
            printf("block %7zu B ahead %d: %.1f GB/s %g\n", bs, ahead, total / best / 1e9, s);
        }
    }
}
