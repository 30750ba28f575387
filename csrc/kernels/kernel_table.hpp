// The seam between the drivers (prefill.cpp, baseline ISA) and the per-ISA kernel files.
// Each kernels/isa_*.cpp compiles the same kernel templates with its own -m flags and
// exports one KernelTable; dispatch.cpp picks the table once at run time.
#pragma once
#include <cstdint>

#include "../attnfast.hpp"

namespace attnfast {

// Query rows per block and keys per KV tile of the streaming prefill. Fixed numbers (not
// derived from the thread count) so every thread count computes the same bits.
constexpr int64_t kBlockRows = 64;
constexpr int64_t kTileKeys = 64;

// One unit of prefill work: query rows [row_begin, row_end) of one (batch, head), or of
// heads [head, head + head_count) that all read one KV head (GQA; float32 SIMD tiers only).
struct BlockTask {
    int64_t batch;
    int64_t head;
    int64_t row_begin;
    int64_t row_end;
    int64_t head_count = 1;
};

// Scratch one thread needs for one BlockTask, in accumulator elements (float or double).
inline int64_t block_workspace_elems(const AttentionParams& p) {
    return kBlockRows * p.head_dim        // scaled query rows
         + p.head_dim * kTileKeys         // K tile, packed transposed
         + kBlockRows * kTileKeys         // scores / probabilities
         + kBlockRows * p.head_dim_v      // output accumulator
         + 2 * kBlockRows;                // running max, running sum
}

// How a tier splits a float32 prefill: query rows and heads per BlockTask, and scratch
// floats per thread. A function of the problem's shape and the cache sizes, never of the
// thread count (so every thread count computes the same bits).
struct PrefillPlan {
    int64_t block_rows;
    int64_t workspace_elems;
    int64_t heads_per_task = 1;  // divides heads / kv_heads
};

struct KernelTable {
    const char* name;
    // Attend one block of query rows over all the keys it may see; writes its out/lse rows.
    void (*attend_block_f32)(const AttentionParams&, const BlockTask&, float* workspace);
    void (*attend_block_f64)(const AttentionParams&, const BlockTask&, double* workspace);
    // Block rows and workspace for attend_block_f32 (attend_block_f64 always uses
    // kBlockRows and block_workspace_elems).
    PrefillPlan (*plan_f32)(const AttentionParams&);
};

// Per-core data cache sizes in bytes, read once from the OS (with safe defaults when it
// does not say); kernels derive their tile sizes from them.
struct CacheSizes {
    int64_t l1d;
    int64_t l2;
};
const CacheSizes& cache_sizes();

// One per ISA file; each returns nullptr when that tier was not compiled in.
const KernelTable* kernel_table_generic();
const KernelTable* kernel_table_avx2();
const KernelTable* kernel_table_avx512();

// The table in use (chosen once; see dispatch.cpp).
const KernelTable& active_kernels();

// Visible key range [begin, end) of query row `row`, from causal and window.
// Row i is aligned to key i + (Tk - Tq) (bottom-right, as flash-attn >= 2.1).
struct KeyRange {
    int64_t begin;
    int64_t end;
};
inline KeyRange visible_keys(const AttentionParams& p, int64_t row) {
    const int64_t aligned = row + (p.seqlen_k - p.seqlen_q);
    int64_t begin = 0;
    int64_t end = p.seqlen_k;
    if (p.causal && aligned + 1 < end) end = aligned + 1;
    if (p.window_right >= 0 && aligned + p.window_right + 1 < end) end = aligned + p.window_right + 1;
    if (p.window_left >= 0 && aligned - p.window_left > begin) begin = aligned - p.window_left;
    if (end < begin) end = begin;
    if (end < 0) end = begin = 0;
    return {begin, end};
}

}  // namespace attnfast
