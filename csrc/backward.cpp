// attention_backward (backward.hpp): checks the params, then runs the selected tier's
// backward kernels over OpenMP threads, in one of two schedules (backward_fused): one task
// per (batch, kv head), or two passes, dk/dv per (batch, kv head, key block), then dq per
// (batch, head, query block). Each task owns the gradient rows it writes, so there are no
// atomics, and both schedules reduce every element in the same order: the bits never
// depend on the thread count. With key_index (sparse attention) two passes over the listed
// keys only (run_listed).
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "backward.hpp"
#include "kernels/kernel_table.hpp"
#include "parallel.hpp"

namespace attnfast {
namespace {

void require(bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("attnfast::attention_backward: ") + what);
}

// The backward kernels of the tier attention_forward uses.
const BackwardKernels& active_backward_kernels() { return *active_kernels().backward_kernels(); }

// One workspace per thread, each 64-byte aligned (whole vectors of every tier: the kernels'
// tiles are multiples of 64 bytes, and the SIMD layer's loads are aligned).
template <class A>
struct Workspaces {
    static constexpr int64_t kAlign = 64 / sizeof(A);
    int64_t elems;
    std::unique_ptr<A[]> memory;
    A* first;
    Workspaces(const AttentionParams& p, int threads)
        : elems((backward_workspace_elems(p) + kAlign - 1) / kAlign * kAlign),
          memory(new A[static_cast<size_t>(elems * threads + kAlign)]) {
        const uintptr_t at = reinterpret_cast<uintptr_t>(memory.get());
        first = memory.get() + ((64 - at % 64) % 64) / sizeof(A);
    }
    A* of(int thread_id) const { return first + elems * thread_id; }
};

template <class A>
void run_pass(const BackwardParams& bp, int64_t heads, int64_t seqlen, bool costly_last,
              void (*kernel)(const BackwardParams&, const BackwardTask&, A*)) {
    const AttentionParams& p = bp.attn;
    const int64_t blocks = (seqlen + kBackwardTile - 1) / kBackwardTile;
    const int64_t groups = p.batch * heads;
    const int64_t tasks = groups * blocks;
    if (tasks == 0) return;
    const int threads = p.num_threads < tasks ? p.num_threads : static_cast<int>(tasks);
    const Workspaces<A> workspaces(p, threads);
    // Under a causal mask late query blocks and early key blocks do the most work: they go
    // out first, for the dynamic schedule.
    parallel::for_each_dynamic(tasks, threads, false, [&](int64_t index, int thread_id) {
        const int64_t block = costly_last ? blocks - 1 - index / groups : index / groups;
        const int64_t group = index % groups;
        BackwardTask task;
        task.batch = group / heads;
        task.head = group % heads;
        task.begin = block * kBackwardTile;
        task.end = task.begin + kBackwardTile < seqlen ? task.begin + kBackwardTile : seqlen;
        kernel(bp, task, workspaces.of(thread_id));
    });
}

// The fused schedule: one task per (batch, kv head), the costly causal ones no different.
template <class A>
void run_groups(const BackwardParams& bp,
                void (*kernel)(const BackwardParams&, int64_t, int64_t, A*)) {
    const AttentionParams& p = bp.attn;
    const int64_t tasks = p.batch * p.kv_heads;
    if (tasks == 0) return;
    const int threads = p.num_threads < tasks ? p.num_threads : static_cast<int>(tasks);
    const Workspaces<A> workspaces(p, threads);
    parallel::for_each_dynamic(tasks, threads, false, [&](int64_t index, int thread_id) {
        kernel(bp, index / p.kv_heads, index % p.kv_heads, workspaces.of(thread_id));
    });
}

template <class A>
void run_schedule(const BackwardParams& bp,
                  void (*group)(const BackwardParams&, int64_t, int64_t, A*),
                  void (*key_block)(const BackwardParams&, const BackwardTask&, A*),
                  void (*query_block)(const BackwardParams&, const BackwardTask&, A*)) {
    const AttentionParams& p = bp.attn;
    if (backward_fused(p.batch * p.kv_heads, p.num_threads)) {
        run_groups<A>(bp, group);
    } else {
        run_pass<A>(bp, p.kv_heads, p.seqlen_k, false, key_block);
        run_pass<A>(bp, p.heads, p.seqlen_q, true, query_block);
    }
}

// With key_index: the dk/dv pass over (batch, kv head, key range), then the dq pass over
// (batch, block of query heads, block of query rows).
template <class A>
void run_listed(const BackwardParams& bp, void (*keys)(const BackwardParams&, const BackwardTask&, A*),
                void (*queries)(const BackwardParams&, const BackwardTask&, A*)) {
    const AttentionParams& p = bp.attn;
    const int64_t group = p.heads / p.kv_heads;
    std::vector<BackwardTask> key_tasks, query_tasks;
    const int64_t range = sparse_key_range(p.seqlen_k);
    for (int64_t b = 0; b < p.batch; ++b)
        for (int64_t g = 0; g < p.kv_heads; ++g) {
            for (int64_t j0 = 0; j0 < p.seqlen_k; j0 += range)
                key_tasks.push_back({b, g, j0, j0 + range < p.seqlen_k ? j0 + range : p.seqlen_k});
            for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += kBackwardTile)
                for (int64_t i0 = 0; i0 < p.seqlen_q; i0 += kSparseQueryRows)
                    query_tasks.push_back({b, h0, i0, i0 + kSparseQueryRows < p.seqlen_q ? i0 + kSparseQueryRows
                                                                                       : p.seqlen_q});
        }
    for (const auto* pass : {&key_tasks, &query_tasks}) {
        const std::vector<BackwardTask>& tasks = *pass;
        const int64_t count = static_cast<int64_t>(tasks.size());
        if (count == 0) continue;
        const int threads = p.num_threads < count ? p.num_threads : static_cast<int>(count);
        const Workspaces<A> workspaces(p, threads);
        auto kernel = pass == &key_tasks ? keys : queries;
        parallel::for_each_dynamic(count, threads, false, [&](int64_t index, int thread_id) {
            kernel(bp, tasks[static_cast<size_t>(index)], workspaces.of(thread_id));
        });
    }
}

}  // namespace

int64_t backward_key_blocks(const AttentionParams& p) {
    const int64_t accumulator = p.dtype == DType::kF64 ? 8 : 4;
    const int64_t per_block = kBackwardTile * (3 * backward_padded(p.head_dim) +
                                               2 * backward_padded(p.head_dim_v)) * accumulator;
    // The key tiles may spill from L2: on Zen 3 (512 KiB L2), T = 4096, D = 128, float32,
    // 8 blocks (1.25 MiB of key tiles) ran 4-10 % faster than 4, 4 10 % faster than 2, 2 up
    // to 9 % faster than 1 (bench/HISTORY.md 25): the query side's traffic costs more.
    const int64_t fit = cache_sizes().l2 * 3 / per_block;
    return fit < 1 ? 1 : (fit > kBackwardKeyBlocks ? kBackwardKeyBlocks : fit);
}

void attention_backward(const BackwardParams& bp) {
    const AttentionParams& p = bp.attn;
    require(p.batch >= 0 && p.heads >= 0 && p.seqlen_q >= 0 && p.seqlen_k >= 0, "negative size");
    require(p.head_dim >= 1 && p.head_dim_v >= 1, "head_dim and head_dim_v must be >= 1");
    require(p.kv_heads >= 1 && p.heads % p.kv_heads == 0, "heads must be a multiple of kv_heads");
    require(p.num_threads >= 1, "num_threads must be >= 1");
    require(p.window_left >= -1 && p.window_right >= -1, "window bounds must be >= -1");
    require(p.softcap >= 0.0, "softcap must be >= 0 (0 = off)");
    require(p.dtype == p.kv_dtype && !storage_format(p.dtype).cache_only, "q, k, v must share one float dtype");
    require(!p.block_table && !p.k_scale && !p.v_scale, "no paged or int8 cache in the backward");
    require(p.lse && bp.dout && bp.delta && bp.dq && bp.dk && bp.dv, "missing array");
    require(bp.dq_row_stride == backward_padded(p.head_dim),
            "dq_row_stride must be head_dim padded to a multiple of kBackwardPad");
    if (p.seqlens_k)
        for (int64_t b = 0; b < p.batch; ++b)
            require(p.seqlens_k[b] >= 0 && p.seqlens_k[b] <= p.seqlen_k,
                    "seqlens_k[b] must be in [0, seqlen_k]");
    if (p.key_index) {
        require(p.key_index_count >= 0, "key_index_count must be >= 0");
        require(!p.alibi_slopes && !p.mask, "key_index does not combine with ALiBi or a mask");
        for (int64_t b = 0; b < p.batch; ++b)  // every listed position a key of its entry
            for (int64_t g = 0; g < (p.key_index_head_stride ? p.kv_heads : 1); ++g)
                for (int64_t i = 0; i < p.seqlen_q; ++i) {
                    const int32_t* row = p.key_index + b * p.key_index_batch_stride +
                                         g * p.key_index_head_stride + i * p.key_index_row_stride;
                    for (int64_t x = 0; x < p.key_index_count; ++x)
                        require(row[x] >= -1 && row[x] < batch_seqlen_k(p, b), "key_index: position out of range");
                }
    }
    const BackwardKernels& kernels = active_backward_kernels();
    if (p.key_index) {
        if (p.dtype == DType::kF64) run_listed<double>(bp, kernels.listed_keys_f64, kernels.listed_queries_f64);
        else run_listed<float>(bp, kernels.listed_keys_f32, kernels.listed_queries_f32);
        return;
    }
    if (p.dtype == DType::kF64)
        run_schedule<double>(bp, kernels.group_f64, kernels.key_block_f64, kernels.query_block_f64);
    else
        run_schedule<float>(bp, kernels.group_f32, kernels.key_block_f32, kernels.query_block_f32);
}

}  // namespace attnfast
