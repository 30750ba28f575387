// attention_forward: checks the params, then sends short queries to the decode driver
// (decode.cpp) and the rest to this file's prefill driver.
//
// Prefill driver: splits the problem into (batch, head, query block) tasks and runs the
// selected kernel tier over them on OpenMP threads.
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "attnfast.hpp"
#include "drivers.hpp"
#include "kernels/kernel_table.hpp"
#include "parallel.hpp"

namespace attnfast {

AttentionParams default_params() {
    AttentionParams p{};
    p.dtype = DType::kF32;
    p.kv_dtype = DType::kF32;
    p.scale = 1.0;
    p.window_left = -1;
    p.window_right = -1;
    p.mask_kind = MaskKind::kNone;
    p.num_threads = 1;
    return p;
}

namespace {

void require(bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("attnfast::attention_forward: ") + what);
}

}  // namespace

void check_params(const AttentionParams& p) {
    require(p.batch >= 0 && p.heads >= 0 && p.seqlen_q >= 0 && p.seqlen_k >= 0, "negative size");
    require(p.head_dim >= 1 && p.head_dim_v >= 1, "head_dim and head_dim_v must be >= 1");
    require(p.kv_heads >= 1 && p.heads % p.kv_heads == 0, "heads must be a multiple of kv_heads");
    require(p.num_threads >= 1, "num_threads must be >= 1");
    require(p.window_left >= -1 && p.window_right >= -1, "window bounds must be >= -1");
    require(!p.has_query_offset || (p.query_offset <= (int64_t(1) << 62) &&
                                    p.query_offset >= -(int64_t(1) << 62)),
            "|query_offset| must be <= 2^62");
    require(p.softcap >= 0.0, "softcap must be >= 0 (0 = off)");
    require(!p.mask || p.mask_kind == MaskKind::kBool ||
                (p.mask_kind == MaskKind::kAdditive &&
                 (p.mask_dtype == DType::kF32 || p.mask_dtype == DType::kF64)),
            "mask must be bool, or additive float32 / float64");
    const DType q = p.dtype, kv = p.kv_dtype;
    const bool same = q == kv && q != DType::kI8;
    const bool f32_q_lowp_kv = q == DType::kF32 && (kv == DType::kF16 || kv == DType::kBF16);
    const bool int8_kv = kv == DType::kI8 && (q == DType::kF32 || q == DType::kF16 || q == DType::kBF16);
    require(same || f32_q_lowp_kv || int8_kv, "dtype / kv_dtype combination not supported");
    require((kv == DType::kI8) == (p.k_scale != nullptr && p.v_scale != nullptr),
            "k_scale and v_scale are required with (and only with) an int8 cache");
    if (p.seqlens_k)
        for (int64_t b = 0; b < p.batch; ++b)
            require(p.seqlens_k[b] >= 0 && p.seqlens_k[b] <= p.seqlen_k,
                    "seqlens_k[b] must be in [0, seqlen_k]");
    if (p.block_table) {
        require(p.block_size >= 1 && p.num_blocks >= 0 && p.seqlen_k % p.block_size == 0,
                "paged cache: block_size must be >= 1 and divide seqlen_k");
        // Every block a batch entry reads must exist (the table's other entries are unused).
        for (int64_t b = 0; b < p.batch; ++b) {
            const int64_t used = (batch_seqlen_k(p, b) + p.block_size - 1) / p.block_size;
            for (int64_t i = 0; i < used; ++i) {
                const int64_t id = p.block_table[b * p.block_table_batch_stride + i];
                require(id >= 0 && id < p.num_blocks, "paged cache: block id out of range");
            }
        }
    }
}

namespace {

// The tasks of a prefill: (batch, group of heads_per_task heads, block of block_rows rows).
int64_t prefill_tasks(const AttentionParams& p, const PrefillPlan& plan) {
    const int64_t blocks_per_head = (p.seqlen_q + plan.block_rows - 1) / plan.block_rows;
    return p.batch * (p.heads / plan.heads_per_task) * blocks_per_head;
}

template <class A>
void run_blocks(const AttentionParams& p,
                void (*attend)(const AttentionParams&, const BlockTask&, A*), const PrefillPlan& plan) {
    const int64_t block_rows = plan.block_rows;
    const int64_t heads_per_task = plan.heads_per_task;
    const int64_t blocks_per_head = (p.seqlen_q + block_rows - 1) / block_rows;
    const int64_t head_groups = p.batch * (p.heads / heads_per_task);
    const int64_t tasks = prefill_tasks(p, plan);
    if (tasks == 0) return;
    const int threads = p.num_threads < tasks ? p.num_threads : static_cast<int>(tasks);

    const int64_t ws_elems = plan.workspace_elems;
    std::unique_ptr<A[]> workspace(new A[static_cast<size_t>(ws_elems * threads)]);

    // Tasks go out in order of decreasing query block: under a causal mask the late blocks
    // see the most keys, so the dynamic schedule starts the costliest work first.
    auto task_at = [&](int64_t index) {
        const int64_t block = blocks_per_head - 1 - index / head_groups;
        const int64_t group = index % head_groups;
        BlockTask task;
        task.batch = group / (p.heads / heads_per_task);
        task.head = group % (p.heads / heads_per_task) * heads_per_task;
        task.head_count = heads_per_task;
        task.row_begin = block * block_rows;
        task.row_end = task.row_begin + block_rows < p.seqlen_q ? task.row_begin + block_rows : p.seqlen_q;
        return task;
    };
    // (q's elements are A, or 16 bits under a float32 accumulator)
    const int64_t q_elem = p.dtype == DType::kF16 || p.dtype == DType::kBF16 ? 2 : static_cast<int64_t>(sizeof(A));
    const int64_t q_row_bytes = p.head_dim * q_elem;
    parallel::for_each_dynamic(tasks, threads, p.interruptible, [&](int64_t index, int thread_id) {
        // The dynamic schedule most likely hands this thread index + threads next: start
        // bringing that task's query rows in now, a whole task ahead (a cache hint only).
        if (index + threads < tasks) {
            const BlockTask next = task_at(index + threads);
            for (int64_t h = next.head; h < next.head + next.head_count; ++h)
                for (int64_t r = next.row_begin; r < next.row_end; ++r) {
                    const char* row = static_cast<const char*>(p.q) +
                        (next.batch * p.q_batch_stride + h * p.q_head_stride + r * p.q_row_stride) * q_elem;
                    for (int64_t off = 0; off < q_row_bytes; off += 64) __builtin_prefetch(row + off, 0, 2);
                }
        }
        attend(p, task_at(index), workspace.get() + ws_elems * thread_id);
    });
}

// A paged cache's keys of one call gathered into contiguous (batch, kv head, key) arrays,
// for the hand-written prefill kernels (simd_prefill.inl, bf16_prefill.inl),
// which read one strided run of rows: they then compute exactly the bits of a contiguous cache.
// Costs one copy of the keys the batch reads (O(Tk * D), small next to the O(Tq * Tk * D)
// prefill). Every float32-accumulated prefill reads one (gathers); float64 reads the pool
// through the table.
bool gathers(const AttentionParams& p) { return p.block_table && p.dtype != DType::kF64; }

// `p` over its gathered copy (GatheredCache), without the copy's pointers: as long as its
// longest batch entry, rows packed.
AttentionParams gathered_layout(const AttentionParams& p) {
    int64_t keys = 0;
    for (int64_t b = 0; b < p.batch; ++b) keys = batch_seqlen_k(p, b) > keys ? batch_seqlen_k(p, b) : keys;
    AttentionParams g = p;
    g.block_table = nullptr;
    g.seqlen_k = keys;
    g.k_row_stride = p.head_dim;
    g.k_head_stride = keys * p.head_dim;
    g.k_batch_stride = p.kv_heads * keys * p.head_dim;
    g.v_row_stride = p.head_dim_v;
    g.v_head_stride = keys * p.head_dim_v;
    g.v_batch_stride = p.kv_heads * keys * p.head_dim_v;
    if (p.k_scale) {
        g.k_scale_row_stride = g.v_scale_row_stride = 1;
        g.k_scale_head_stride = g.v_scale_head_stride = keys;
        g.k_scale_batch_stride = g.v_scale_batch_stride = p.kv_heads * keys;
    }
    return g;
}

// The gathered copy itself, and `params` over it.
struct GatheredCache {
    std::unique_ptr<char[]> k, v;
    std::unique_ptr<float[]> k_scale, v_scale;  // int8 caches: their row scales, gathered too
    AttentionParams params;

    explicit GatheredCache(const AttentionParams& p) : params(gathered_layout(p)) {
        const int64_t keys = params.seqlen_k;
        const int64_t elem = kv_element_bytes(p);
        const int64_t rows = p.batch * p.kv_heads * keys;
        k.reset(new char[static_cast<size_t>(rows * p.head_dim * elem > 0 ? rows * p.head_dim * elem : 1)]);
        v.reset(new char[static_cast<size_t>(rows * p.head_dim_v * elem > 0 ? rows * p.head_dim_v * elem : 1)]);
        if (p.k_scale) {
            k_scale.reset(new float[static_cast<size_t>(rows > 0 ? rows : 1)]);
            v_scale.reset(new float[static_cast<size_t>(rows > 0 ? rows : 1)]);
        }
        const int64_t tasks = p.batch * p.kv_heads;
        parallel::for_each_dynamic(tasks, p.num_threads < tasks ? p.num_threads : static_cast<int>(tasks),
                                   false, [&](int64_t index, int) {
            const int64_t b = index / p.kv_heads, g = index % p.kv_heads;
            const int64_t* table = p.block_table + b * p.block_table_batch_stride;
            for (int64_t j = 0; j < batch_seqlen_k(p, b); ++j) {
                const int64_t block = table[j / p.block_size], row = j % p.block_size;
                std::memcpy(k.get() + ((index * keys + j) * p.head_dim) * elem,
                            static_cast<const char*>(p.k) +
                                (block * p.k_batch_stride + g * p.k_head_stride + row * p.k_row_stride) * elem,
                            static_cast<size_t>(p.head_dim * elem));
                std::memcpy(v.get() + ((index * keys + j) * p.head_dim_v) * elem,
                            static_cast<const char*>(p.v) +
                                (block * p.v_batch_stride + g * p.v_head_stride + row * p.v_row_stride) * elem,
                            static_cast<size_t>(p.head_dim_v * elem));
                if (p.k_scale) {
                    k_scale[index * keys + j] = p.k_scale[block * p.k_scale_batch_stride +
                                                          g * p.k_scale_head_stride + row * p.k_scale_row_stride];
                    v_scale[index * keys + j] = p.v_scale[block * p.v_scale_batch_stride +
                                                          g * p.v_scale_head_stride + row * p.v_scale_row_stride];
                }
            }
        });
        params.k = k.get();
        params.v = v.get();
        if (p.k_scale) {
            params.k_scale = k_scale.get();
            params.v_scale = v_scale.get();
        }
    }
};

// The prefill kernel of a call, given the params it reads (gathered, if gathers()), and its
// plan. attention_forward runs it; plan_prefill describes it.
struct PrefillChoice {
    const char* name;
    void (*attend_f32)(const AttentionParams&, const BlockTask&, float*);  // or, for float64:
    void (*attend_f64)(const AttentionParams&, const BlockTask&, double*);
    PrefillPlan plan;
};

PrefillChoice choose_prefill(const KernelTable& kernels, const AttentionParams& p) {
    if (p.dtype == DType::kF64)
        return {"template_f64", nullptr, kernels.attend_block_f64, {kBlockRows, block_workspace_elems(p)}};
    const PrefillKernel kernel = kernels.prefill_kernel(p);
    return {kernel.name, kernel.attend_block, nullptr, kernel.plan(p)};
}

void run_prefill(const AttentionParams& p, const PrefillChoice& choice) {
    if (choice.attend_f64) run_blocks<double>(p, choice.attend_f64, choice.plan);
    else run_blocks<float>(p, choice.attend_f32, choice.plan);
}

}  // namespace

void attention_forward(const AttentionParams& p) {
    check_params(p);
    if (takes_decode_path(p)) {
        decode_forward(p);
        return;
    }
    const KernelTable& kernels = active_kernels();
    if (gathers(p)) {
        const GatheredCache gathered(p);
        run_prefill(gathered.params, choose_prefill(kernels, gathered.params));
    } else {
        run_prefill(p, choose_prefill(kernels, p));
    }
}

CallPlan plan_prefill(const AttentionParams& p) {
    const KernelTable& kernels = active_kernels();
    const AttentionParams read = gathers(p) ? gathered_layout(p) : p;
    const PrefillChoice choice = choose_prefill(kernels, read);
    CallPlan plan{};
    plan.tier = kernels.name;
    plan.decode = false;
    plan.kernel = choice.name;
    plan.paged = p.block_table != nullptr;
    plan.tasks = prefill_tasks(read, choice.plan);
    plan.threads = parallel::threads_alone(plan.tasks, p.num_threads);
    return plan;
}

CallPlan plan_attention(const AttentionParams& p) {
    check_params(p);
    return takes_decode_path(p) ? plan_decode(p) : plan_prefill(p);
}

void request_interrupt() noexcept { parallel::interrupt_flag().store(1); }
bool take_interrupt() noexcept { return parallel::interrupt_flag().exchange(0) != 0; }
int processor_count() noexcept { return parallel::processors(); }

bool openmp_enabled() { return parallel::enabled(); }
int openmp_max_threads() { return parallel::max_threads(); }
const char* openmp_runtime_name() {
#if !defined(_OPENMP)
    return "none (built without OpenMP: single-threaded)";
#elif defined(__clang__)
    return "OpenMP (libomp)";
#elif defined(__GNUC__)
    return "OpenMP (libgomp)";
#else
    return "OpenMP";
#endif
}

}  // namespace attnfast
