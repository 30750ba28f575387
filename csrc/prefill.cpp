// attention_forward: checks the params, then sends short queries to the decode driver
// (decode.cpp) and the rest to this file's prefill driver.
//
// Prefill driver: splits the problem into (batch, head, query block) tasks and runs the
// selected kernel tier over them on OpenMP threads.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>
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
    const bool row_scaled = storage_format(kv).row_scaled;
    const bool cache_only = storage_format(kv).cache_only;  // KV storage types, never q's
    const bool same = q == kv && !cache_only;
    const bool f32_q_lowp_kv = q == DType::kF32 && (kv == DType::kF16 || kv == DType::kBF16);
    const bool quantized_kv = cache_only && (q == DType::kF32 || q == DType::kF16 || q == DType::kBF16);
    require(same || f32_q_lowp_kv || quantized_kv, "dtype / kv_dtype combination not supported");
    require(row_scaled == (p.k_scale != nullptr && p.v_scale != nullptr),
            "k_scale and v_scale are required with (and only with) a row-scaled (int8, float8) cache");
    if (p.seqlens_k)
        for (int64_t b = 0; b < p.batch; ++b)
            require(p.seqlens_k[b] >= 0 && p.seqlens_k[b] <= p.seqlen_k,
                    "seqlens_k[b] must be in [0, seqlen_k]");
    if (p.key_index) {
        require(p.key_index_count >= 0, "key_index_count must be >= 0");
        require(!p.alibi_slopes && !p.mask, "key_index does not combine with ALiBi or a mask");
        // Every listed position must be a key of its batch entry (-1: none).
        for (int64_t b = 0; b < p.batch; ++b) {
            const int64_t keys = batch_seqlen_k(p, b);
            for (int64_t g = 0; g < (p.key_index_head_stride ? p.kv_heads : 1); ++g)
                for (int64_t i = 0; i < p.seqlen_q; ++i) {
                    const int32_t* row = p.key_index + b * p.key_index_batch_stride +
                                         g * p.key_index_head_stride + i * p.key_index_row_stride;
                    for (int64_t x = 0; x < p.key_index_count; ++x)
                        require(row[x] >= -1 && row[x] < keys, "key_index: position out of range");
                }
        }
    }
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

// Task `index` of a prefill (index < prefill_tasks). Tasks go out in order of decreasing
// query block: under a causal mask the late blocks see the most keys, so the dynamic
// schedule starts the costliest work first.
BlockTask prefill_task(const AttentionParams& p, const PrefillPlan& plan, int64_t index) {
    const int64_t block_rows = plan.block_rows;
    const int64_t heads_per_task = plan.heads_per_task;
    const int64_t blocks_per_head = (p.seqlen_q + block_rows - 1) / block_rows;
    const int64_t head_groups = p.batch * (p.heads / heads_per_task);
    const int64_t block = blocks_per_head - 1 - index / head_groups;
    const int64_t group = index % head_groups;
    BlockTask task;
    task.batch = group / (p.heads / heads_per_task);
    task.head = group % (p.heads / heads_per_task) * heads_per_task;
    task.head_count = heads_per_task;
    task.row_begin = block * block_rows;
    task.row_end = task.row_begin + block_rows < p.seqlen_q ? task.row_begin + block_rows : p.seqlen_q;
    return task;
}

template <class A>
void run_blocks(const AttentionParams& p,
                void (*attend)(const AttentionParams&, const BlockTask&, A*), const PrefillPlan& plan) {
    const int64_t tasks = prefill_tasks(p, plan);
    if (tasks == 0) return;
    const int threads = p.num_threads < tasks ? p.num_threads : static_cast<int>(tasks);

    const int64_t ws_elems = plan.workspace_elems;
    const ThreadScratch<A> workspace(ws_elems, threads);
    auto task_at = [&](int64_t index) { return prefill_task(p, plan, index); };
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
        attend(p, task_at(index), workspace.at(thread_id));
    });
}

// `p` as the prefill kernels read it. A paged cache is read in place, tile by tile through
// the block table (every kernel walks K and V through attention_core.inl's KeyRows; no
// gathered copy): only seqlen_k changes, from the table's capacity to the longest batch
// entry, the keys the call can read, from which the SIMD kernels size their tiles and task
// plan (as when the pool was gathered into a contiguous copy that long: the same plan, the
// same bits).
AttentionParams prefill_read_params(const AttentionParams& p) {
    if (!p.block_table) return p;
    int64_t keys = 0;
    for (int64_t b = 0; b < p.batch; ++b) keys = batch_seqlen_k(p, b) > keys ? batch_seqlen_k(p, b) : keys;
    AttentionParams read = p;
    read.seqlen_k = keys;
    return read;
}

// The prefill kernel of a call, given the params it reads (prefill_read_params), and its
// plan. attention_forward runs it; plan_prefill describes it.
struct PrefillChoice {
    KernelId id;
    void (*attend_f32)(const AttentionParams&, const BlockTask&, float*);  // or, for float64:
    void (*attend_f64)(const AttentionParams&, const BlockTask&, double*);
    PrefillPlan plan;
};

PrefillChoice choose_prefill(const KernelTable& kernels, const AttentionParams& p) {
    if (p.dtype == DType::kF64)
        return {KernelId::kTemplateF64, nullptr, kernels.attend_block_f64, template_prefill_plan(p)};
    const PrefillKernel kernel = kernels.prefill_kernel(p);
    return {kernel.id, kernel.attend_block, nullptr, kernel.plan(p)};
}

void run_prefill(const AttentionParams& p, const PrefillChoice& choice) {
    if (choice.attend_f64) run_blocks<double>(p, choice.attend_f64, choice.plan);
    else run_blocks<float>(p, choice.attend_f32, choice.plan);
}

// A prefill problem as units of a shared schedule (attention_forward_batch): its tasks, in
// run_blocks' order, in phase 0.
class PrefillWork : public ProblemWork {
public:
    explicit PrefillWork(const AttentionParams& p)
        : read_(prefill_read_params(p)), choice_(choose_prefill(active_kernels(), read_)) {}
    int64_t units(int phase) const override { return phase == 0 ? prefill_tasks(read_, choice_.plan) : 0; }
    int64_t workspace_bytes() const override {
        return choice_.plan.workspace_elems *
               static_cast<int64_t>(choice_.attend_f64 ? sizeof(double) : sizeof(float));
    }
    void run(int, int64_t unit, void* workspace) const override {
        const BlockTask task = prefill_task(read_, choice_.plan, unit);
        if (choice_.attend_f64) choice_.attend_f64(read_, task, static_cast<double*>(workspace));
        else choice_.attend_f32(read_, task, static_cast<float*>(workspace));
    }

private:
    AttentionParams read_;
    PrefillChoice choice_;
};

}  // namespace

std::unique_ptr<ProblemWork> make_prefill_work(const AttentionParams& p) {
    return std::unique_ptr<ProblemWork>(new PrefillWork(p));
}

namespace {

// Checked problems on one schedule. chunk_major: every problem's first task, then every
// problem's second, ... (a sparse prompt's rows: see in_cache_order).
void run_problems(const AttentionParams* problems, int64_t count, bool chunk_major) {
    if (count == 0) return;
    // A prompt over a float8 / int4 cache runs as decode problems of its row blocks.
    std::vector<AttentionParams> expanded;
    for (int64_t i = 0; i < count; ++i) {
        if (runs_as_row_blocks(problems[i])) {
            for (const AttentionParams& block : decode_row_blocks(problems[i])) expanded.push_back(block);
        } else {
            expanded.push_back(problems[i]);
        }
    }
    problems = expanded.data();
    count = static_cast<int64_t>(expanded.size());
    // Prefill tasks first (the longest units), then the decode chunks, which the dynamic
    // schedule spreads over the threads as they free up; then every decode merge.
    std::vector<std::unique_ptr<ProblemWork>> works;
    std::vector<std::pair<int64_t, int64_t>> first, second;  // (problem, unit)
    int64_t ws_bytes = 64;
    for (int pass = 0; pass < 2; ++pass)
        for (int64_t i = 0; i < count; ++i) {
            const bool decode_loop = runs_on_decode_path(problems[i]) || decode_only_format(problems[i].kv_dtype);
            if (decode_loop != (pass == 1)) continue;
            works.push_back(pass == 0 ? make_prefill_work(problems[i]) : make_decode_work(problems[i]));
            const ProblemWork& w = *works.back();
            const int64_t id = static_cast<int64_t>(works.size()) - 1;
            for (int64_t u = 0; u < w.units(0); ++u) first.emplace_back(id, u);
            for (int64_t u = 0; u < w.units(1); ++u) second.emplace_back(id, u);
            if (w.workspace_bytes() > ws_bytes) ws_bytes = w.workspace_bytes();
        }
    if (chunk_major)
        std::stable_sort(first.begin(), first.end(), [](const std::pair<int64_t, int64_t>& a,
                                                         const std::pair<int64_t, int64_t>& b) {
            return a.second < b.second;
        });
    const int64_t most = first.size() > second.size() ? static_cast<int64_t>(first.size())
                                                      : static_cast<int64_t>(second.size());
    if (most == 0) return;
    const int threads = problems[0].num_threads < most ? problems[0].num_threads : static_cast<int>(most);
    const bool interruptible = problems[0].interruptible;
    const ThreadScratch<char> scratch(ws_bytes, threads);
    const std::vector<std::pair<int64_t, int64_t>>* phases[2] = {&first, &second};
    for (int phase = 0; phase < 2; ++phase) {
        const auto& units = *phases[phase];
        parallel::for_each_dynamic(static_cast<int64_t>(units.size()), threads, interruptible,
                                   [&](int64_t index, int thread_id) {
            const auto& unit = units[static_cast<size_t>(index)];
            works[static_cast<size_t>(unit.first)]->run(phase, unit.second, scratch.at(thread_id));
        });
    }
}

}  // namespace

void attention_forward_batch(const AttentionParams* problems, int64_t count) {
    require(count >= 0 && (count == 0 || problems), "attention_forward_batch: no problems");
    for (int64_t i = 0; i < count; ++i) check_params(problems[i]);
    run_problems(problems, count, false);
}

void attention_forward(const AttentionParams& p) {
    check_params(p);
    if (p.key_index && p.seqlen_q > 1) {  // one problem per row, on one schedule, chunk-major
        std::vector<int32_t> lists;
        const std::vector<AttentionParams> rows = decode_row_blocks(in_cache_order(p, lists));
        run_problems(rows.data(), static_cast<int64_t>(rows.size()), true);
        return;
    }
    if (runs_on_decode_path(p)) {
        decode_forward(p);
        return;
    }
    if (decode_only_format(p.kv_dtype)) {
        for (const AttentionParams& block : decode_row_blocks(p)) decode_forward(block);
        return;
    }
    const AttentionParams read = prefill_read_params(p);
    run_prefill(read, choose_prefill(active_kernels(), read));
}

CallPlan plan_prefill(const AttentionParams& p) {
    const KernelTable& kernels = active_kernels();
    const AttentionParams read = prefill_read_params(p);
    const PrefillChoice choice = choose_prefill(kernels, read);
    CallPlan plan{};
    plan.tier = kernels.name;
    plan.decode = false;
    plan.kernel = kernel_name(choice.id);
    set_policy(plan, kernels.kernel_policy(choice.id, read));
    plan.paged = p.block_table != nullptr;
    plan.tasks = prefill_tasks(read, choice.plan);
    plan.threads = parallel::threads_alone(plan.tasks, p.num_threads);
    return plan;
}

CallPlan plan_attention(const AttentionParams& p) {
    check_params(p);
    if (runs_on_decode_path(p) && !p.key_index) return plan_decode(p);
    if (runs_as_row_blocks(p) || p.key_index) {  // its first block of rows: the others split alike
        const std::vector<AttentionParams> blocks = decode_row_blocks(p);
        return plan_decode(blocks.empty() ? p : blocks.front());
    }
    return plan_prefill(p);
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
