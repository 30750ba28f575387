// attention_backward (backward.hpp): checks the params, then runs the selected tier's
// backward kernels in two passes over OpenMP threads: dk/dv per (batch, kv head, key
// block), then dq per (batch, head, query block). Each task owns the gradient rows it
// writes, so there are no atomics and the bits never depend on the thread count.
#include <memory>
#include <stdexcept>
#include <string>

#include "backward.hpp"
#include "kernels/kernel_table.hpp"
#include "parallel.hpp"

namespace attnfast {
namespace {

void require(bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("attnfast::attention_backward: ") + what);
}

// The backward kernels of the tier attention_forward uses.
const BackwardKernels& active_backward_kernels() {
    const KernelTable* active = &active_kernels();
#ifdef ATTNFAST_HAVE_AVX512BF16
    if (active == kernel_table_avx512bf16()) return *isa_avx512bf16::backward_kernels();
#endif
#ifdef ATTNFAST_HAVE_AVX512
    if (active == kernel_table_avx512()) return *isa_avx512::backward_kernels();
#endif
#ifdef ATTNFAST_HAVE_AVX2
    if (active == kernel_table_avx2()) return *isa_avx2::backward_kernels();
#endif
#ifdef ATTNFAST_HAVE_NEON
    if (active == kernel_table_neon()) return *isa_neon::backward_kernels();
#endif
    return *isa_generic::backward_kernels();
}

template <class A>
void run_pass(const BackwardParams& bp, int64_t heads, int64_t seqlen, bool costly_last,
              void (*kernel)(const BackwardParams&, const BackwardTask&, A*)) {
    const AttentionParams& p = bp.attn;
    const int64_t blocks = (seqlen + kBackwardTile - 1) / kBackwardTile;
    const int64_t groups = p.batch * heads;
    const int64_t tasks = groups * blocks;
    if (tasks == 0) return;
    const int threads = p.num_threads < tasks ? p.num_threads : static_cast<int>(tasks);
    const int64_t ws_elems = backward_workspace_elems(p);
    std::unique_ptr<A[]> workspace(new A[static_cast<size_t>(ws_elems * threads)]);
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
        kernel(bp, task, workspace.get() + ws_elems * thread_id);
    });
}

}  // namespace

void attention_backward(const BackwardParams& bp) {
    const AttentionParams& p = bp.attn;
    require(p.batch >= 0 && p.heads >= 0 && p.seqlen_q >= 0 && p.seqlen_k >= 0, "negative size");
    require(p.head_dim >= 1 && p.head_dim_v >= 1, "head_dim and head_dim_v must be >= 1");
    require(p.kv_heads >= 1 && p.heads % p.kv_heads == 0, "heads must be a multiple of kv_heads");
    require(p.num_threads >= 1, "num_threads must be >= 1");
    require(p.window_left >= -1 && p.window_right >= -1, "window bounds must be >= -1");
    require(p.softcap >= 0.0, "softcap must be >= 0 (0 = off)");
    require(p.dtype == p.kv_dtype && p.dtype != DType::kI8, "q, k, v must share one float dtype");
    require(!p.block_table && !p.k_scale && !p.v_scale, "no paged or int8 cache in the backward");
    require(p.lse && bp.dout && bp.delta && bp.dq && bp.dk && bp.dv, "missing array");
    if (p.seqlens_k)
        for (int64_t b = 0; b < p.batch; ++b)
            require(p.seqlens_k[b] >= 0 && p.seqlens_k[b] <= p.seqlen_k,
                    "seqlens_k[b] must be in [0, seqlen_k]");
    const BackwardKernels& kernels = active_backward_kernels();
    if (p.dtype == DType::kF64) {
        run_pass<double>(bp, p.kv_heads, p.seqlen_k, false, kernels.key_block_f64);
        run_pass<double>(bp, p.heads, p.seqlen_q, true, kernels.query_block_f64);
    } else {
        run_pass<float>(bp, p.kv_heads, p.seqlen_k, false, kernels.key_block_f32);
        run_pass<float>(bp, p.heads, p.seqlen_q, true, kernels.query_block_f32);
    }
}

}  // namespace attnfast
