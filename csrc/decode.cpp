// Decode driver: a short query (runs_on_decode_path: up to kDecodeMaxQueryRows rows, or up to
// kGemmDecodeMaxQueryRows where a decode kernel beats prefill) against a long KV cache.
//
// Work is split into (batch, kv head, chunk of keys) tasks, and where a compute-shaped kernel
// has too few of those for its threads, each KV head's query heads into groups (split_decode).
// A chunk's size depends only on the head dims and dtype, its boundaries sit at fixed key
// positions, and a row's result does not depend on the group it is computed in, so every
// thread count gives the same bits. A task serves all its (heads x Tq) query rows, so each
// K/V byte is read once per step and group. A second pass merges each (batch entry,
// heads)'s chunks by their (max, sum) in chunk order.
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "drivers.hpp"
#include "kernels/kernel_table.hpp"
#include "parallel.hpp"

namespace attnfast {
namespace {

template <class A>
using DecodeChunkFn = void (*)(const AttentionParams&, const DecodeTask&, A*, A*, A*, A*);
template <class A>
using DecodeMergeFn = void (*)(const AttentionParams&, int64_t, int64_t, int64_t, const A*,
                               const A*, const A*, A*);

// The tasks of a decode call: each (batch entry, kv head) cut into chunks of keys and, where
// a compute-shaped kernel needs more tasks than that gives, its query heads into groups
// (`heads` of them from `head0`; the whole group otherwise). A task's partial result (rows =
// its heads x Tq) starts `row_at` rows into the partial arrays; the chunks of one merge lie
// there consecutively. Only chunks holding keys some row may see are listed; a (batch
// entry, heads) with none still gets its merge (zeros).
struct SplitTask {
    DecodeTask keys;
    int64_t head0, heads, row_at;
};
struct SplitMerge {
    int64_t batch, kv_head, head0, heads, row_at, chunks;
};
struct DecodeSplit {
    std::vector<SplitTask> tasks;
    std::vector<SplitMerge> merges;
    int64_t rows = 0;         // partial-result rows over all tasks
    int64_t chunks = 0;       // (explain) most chunks any (batch entry, kv head) is cut into
    int64_t head_groups = 1;  // (explain) most groups any kv head's query heads are cut into
};

// Keys per chunk of a call run by `kernel`: its own number, or decode_chunk_keys.
int64_t chunk_keys_of(const AttentionParams& p, const DecodeKernel& kernel) {
    return kernel.chunk_keys > 0 ? kernel.chunk_keys : decode_chunk_keys(p);
}

// Servers run these models on 32-128 cores, and a B = 1 step has only Hkv x chunks tasks:
// 8 for an MLA latent cache at 16k keys. A compute-shaped kernel (rows in vector lanes: a
// row's bits do not depend on the rows beside it) therefore cuts each KV head's query heads
// into groups while the call has at most half as many tasks as threads, in groups of at
// least kDecodeMinTaskRows rows (a register block). Each group reads its chunk again and
// stages it again (two groups ~1.15x one's work), so a cut that leaves more tasks than
// threads would lengthen the step. The bits stay those of one group, so the thread count
// may size this; one thread never splits. Shorter chunks would give every kernel more
// tasks, but they move the merge (the bits) and cost a one-thread step 3-7 % at 512 KiB
// (bench/HISTORY.md 51): the chunks stay as sized.
constexpr int64_t kDecodeMinTaskRows = 32;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// With key_index (one query row: decode_row_blocks), the chunks split the row's list, entries
// [0, key_index_count), at the same fixed points: a task's keys [key_begin, key_end) are then
// list entries, which run_chunk gathers.
DecodeSplit split_decode(const AttentionParams& p, int64_t chunk, bool compute_shaped) {
    DecodeSplit split;
    const int64_t group = p.heads / p.kv_heads, tq = p.seqlen_q;
    // Each batch entry's key range: visible ranges only move right as rows go down, so the
    // union is the first row's begin to the last row's end.
    std::vector<KeyRange> ranges(static_cast<size_t>(p.batch));
    int64_t chunk_tasks = 0;
    for (int64_t b = 0; b < p.batch; ++b) {
        const int64_t seqlen_k = batch_seqlen_k(p, b);
        KeyRange& r = ranges[static_cast<size_t>(b)];
        r.begin = p.key_index ? 0 : visible_keys(p, 0, seqlen_k).begin;
        r.end = p.key_index ? p.key_index_count : visible_keys(p, p.seqlen_q - 1, seqlen_k).end;
        if (r.end > r.begin) chunk_tasks += p.kv_heads * ((r.end + chunk - 1) / chunk - r.begin / chunk);
    }
    int64_t heads = group;
    if (compute_shaped)
        while (chunk_tasks > 0 && 2 * chunk_tasks * ceil_div(group, heads) <= p.num_threads &&
               heads / 2 * tq >= kDecodeMinTaskRows)
            heads = ceil_div(heads, 2);
    split.head_groups = ceil_div(group, heads);
    for (int64_t b = 0; b < p.batch; ++b) {
        const int64_t seqlen_k = batch_seqlen_k(p, b);
        const int64_t begin = ranges[static_cast<size_t>(b)].begin, end = ranges[static_cast<size_t>(b)].end;
        const int64_t c_first = begin / chunk;
        const int64_t c_end = end > begin ? (end + chunk - 1) / chunk : c_first;
        if (c_end - c_first > split.chunks) split.chunks = c_end - c_first;
        for (int64_t g = 0; g < p.kv_heads; ++g) {
            // The merges of the KV head's groups, each over its chunks' partial results,
            // consecutive; the tasks chunk by chunk, a chunk's groups one after another (a
            // thread that runs them in turn finds the chunk's keys in its cache).
            const size_t first_merge = split.merges.size();
            for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += heads) {
                const int64_t n = (g + 1) * group - h0 < heads ? (g + 1) * group - h0 : heads;
                split.merges.push_back({b, g, h0, n, split.rows, c_end - c_first});
                split.rows += (c_end - c_first) * n * tq;
            }
            for (int64_t c = c_first; c < c_end; ++c)
                for (size_t i = first_merge; i < split.merges.size(); ++i) {
                    const SplitMerge& m = split.merges[i];
                    DecodeTask t;
                    t.batch = b;
                    t.kv_head = g;
                    t.key_begin = c * chunk > begin ? c * chunk : begin;
                    t.key_end = (c + 1) * chunk < end ? (c + 1) * chunk : end;
                    t.seqlen_k = seqlen_k;
                    split.tasks.push_back({t, m.head0, m.heads, m.row_at + (c - c_first) * m.heads * tq});
                }
        }
    }
    return split;
}

inline int64_t line_up(int64_t bytes) { return (bytes + 63) / 64 * 64; }

// Bytes run_chunk stages a chunk's listed rows in: for a kernel that reads an indexed source
// their positions (int32); else their K and V row scales (float32), then the K rows, then
// the V rows (none for a latent cache), each part from a 64-byte line.
int64_t staging_bytes(const AttentionParams& p, int64_t chunk_keys, bool reads_index) {
    if (!p.key_index) return 0;
    if (reads_index) return line_up(chunk_keys * int64_t(sizeof(int32_t)));
    const int64_t v_bytes = kv_is_latent(p) ? 0 : stored_row_bytes(p.kv_dtype, p.head_dim_v);
    return line_up(2 * chunk_keys * int64_t(sizeof(float))) +
           line_up(chunk_keys * stored_row_bytes(p.kv_dtype, p.head_dim)) + line_up(chunk_keys * v_bytes);
}

// The scratch one thread of `kernel` needs for a chunk, in elements of its accumulator type.
int64_t workspace_elems_of(const AttentionParams& p, const DecodeKernel& kernel) {
    return kernel.workspace_elems ? kernel.workspace_elems(p) : decode_workspace_elems(p);
}

// A thread's whole scratch: the kernel's own (`own` elements of A), then, from a 64-byte
// line on, run_chunk's staging (key_index).
template <class A>
int64_t thread_scratch_elems(const AttentionParams& p, int64_t own, int64_t chunk_keys, bool reads_index) {
    const int64_t line = 64 / static_cast<int64_t>(sizeof(A));
    return (own + line - 1) / line * line +
           (staging_bytes(p, chunk_keys, reads_index) + int64_t(sizeof(A)) - 1) / int64_t(sizeof(A));
}

// Address of key `pos`'s row of (batch, kv head) in one of the cache's arrays (elements of
// elem_bytes; its batch stride is the pool's block stride when paged).
const char* row_at(const AttentionParams& p, const void* data, int64_t elem_bytes, int64_t batch_stride,
                   int64_t head_stride, int64_t row_stride, int64_t batch, int64_t kv_head, int64_t pos) {
    int64_t at = kv_head * head_stride;
    if (p.block_table)
        at += p.block_table[batch * p.block_table_batch_stride + pos / p.block_size] * batch_stride +
              pos % p.block_size * row_stride;
    else
        at += batch * batch_stride + pos * row_stride;
    return static_cast<const char*>(data) + at * elem_bytes;
}

// One decode task through chunk_fn. With key_index, the task's list entries name the rows
// it reads: those the query row sees (causal / window; -1 skipped), in list order, kept in
// the staging after the kernel's scratch (`own` elements). A kernel that reads an indexed
// source (reads_index) gets their positions (DecodeTask::rows); any other, the rows copied
// there as a contiguous cache (decode_loop, reading a listed source one key per run, measured
// 0.37-0.59x the copy: HISTORY 47). Either sees them as keys 0 .. n, every one visible. The
// chunk points are fixed, so the bits do not depend on the thread count.
template <class A>
void run_chunk(const AttentionParams& p, const DecodeTask& task, DecodeChunkFn<A> chunk_fn, bool reads_index,
               A* ws, int64_t own, A* acc, A* m, A* l) {
    if (!p.key_index) return chunk_fn(p, task, ws, acc, m, l);
    const int64_t line = 64 / static_cast<int64_t>(sizeof(A));
    char* stage = reinterpret_cast<char*>(ws + (own + line - 1) / line * line);
    const int32_t* list = p.key_index + task.batch * p.key_index_batch_stride +
                          task.kv_head * p.key_index_head_stride;
    const KeyRange vis = visible_keys(p, 0, task.seqlen_k);
    AttentionParams staged = p;  // keys 0 .. n, all visible
    staged.seqlens_k = nullptr;
    staged.causal = false;
    staged.window_left = staged.window_right = -1;
    staged.has_query_offset = false;
    staged.key_index = nullptr;
    if (reads_index) {
        int32_t* rows = reinterpret_cast<int32_t*>(stage);
        int64_t n = 0;
        for (int64_t x = task.key_begin; x < task.key_end; ++x)
            if (list[x] >= vis.begin && list[x] < vis.end) rows[n++] = list[x];  // (-1 too: vis.begin >= 0)
        staged.seqlen_k = n;
        DecodeTask listed{task.batch, task.kv_head, 0, n, n};
        listed.rows = rows;
        return chunk_fn(staged, listed, ws, acc, m, l);
    }
    const int64_t keys = task.key_end - task.key_begin;
    const bool latent = kv_is_latent(p);
    const int64_t eb = dtype_bytes(p.kv_dtype);
    const int64_t k_bytes = stored_row_bytes(p.kv_dtype, p.head_dim), v_bytes = stored_row_bytes(p.kv_dtype, p.head_dim_v);
    float* k_scales = reinterpret_cast<float*>(stage);  // (the layout of staging_bytes)
    float* v_scales = k_scales + keys;
    char* k_rows = stage + line_up(2 * keys * int64_t(sizeof(float)));
    char* v_rows = latent ? k_rows : k_rows + line_up(keys * k_bytes);
    int64_t n = 0;
    // The rows kGatherAhead entries on start towards the cache while these are copied: the
    // listed rows lie anywhere, so no hardware prefetcher finds them.
    constexpr int64_t kGatherAhead = 8;
    for (int64_t x = task.key_begin; x < task.key_end; ++x) {
        const int64_t ahead = x + kGatherAhead < task.key_end ? list[x + kGatherAhead] : -1;
        if (ahead >= 0) {
            const char* kr = row_at(p, p.k, eb, p.k_batch_stride, p.k_head_stride, p.k_row_stride, task.batch,
                                    task.kv_head, ahead);
            const char* vr = row_at(p, p.v, eb, p.v_batch_stride, p.v_head_stride, p.v_row_stride, task.batch,
                                    task.kv_head, ahead);
            for (int64_t off = 0; off < k_bytes; off += 64) __builtin_prefetch(kr + off, 0, 0);
            for (int64_t off = 0; off < (latent ? 0 : v_bytes); off += 64) __builtin_prefetch(vr + off, 0, 0);
            if (p.k_scale) {
                __builtin_prefetch(row_at(p, p.k_scale, 4, p.k_scale_batch_stride, p.k_scale_head_stride,
                                          p.k_scale_row_stride, task.batch, task.kv_head, ahead), 0, 0);
                __builtin_prefetch(row_at(p, p.v_scale, 4, p.v_scale_batch_stride, p.v_scale_head_stride,
                                          p.v_scale_row_stride, task.batch, task.kv_head, ahead), 0, 0);
            }
        }
        const int64_t pos = list[x];
        if (pos < vis.begin || pos >= vis.end) continue;  // (-1 too: vis.begin >= 0)
        std::memcpy(k_rows + n * k_bytes, row_at(p, p.k, eb, p.k_batch_stride, p.k_head_stride, p.k_row_stride,
                                                 task.batch, task.kv_head, pos), static_cast<size_t>(k_bytes));
        if (!latent)
            std::memcpy(v_rows + n * v_bytes, row_at(p, p.v, eb, p.v_batch_stride, p.v_head_stride, p.v_row_stride,
                                                     task.batch, task.kv_head, pos), static_cast<size_t>(v_bytes));
        if (p.k_scale) {
            k_scales[n] = *reinterpret_cast<const float*>(row_at(p, p.k_scale, 4, p.k_scale_batch_stride,
                p.k_scale_head_stride, p.k_scale_row_stride, task.batch, task.kv_head, pos));
            v_scales[n] = *reinterpret_cast<const float*>(row_at(p, p.v_scale, 4, p.v_scale_batch_stride,
                p.v_scale_head_stride, p.v_scale_row_stride, task.batch, task.kv_head, pos));
        }
        ++n;
    }
    staged.k = k_rows;  // the gathered rows: one contiguous run
    staged.v = v_rows;
    staged.k_batch_stride = staged.k_head_stride = staged.v_batch_stride = staged.v_head_stride = 0;
    staged.k_row_stride = k_bytes / eb;
    staged.v_row_stride = latent ? staged.k_row_stride : v_bytes / eb;
    if (p.k_scale) {
        staged.k_scale = k_scales;
        staged.v_scale = v_scales;
        staged.k_scale_batch_stride = staged.k_scale_head_stride = 0;
        staged.v_scale_batch_stride = staged.v_scale_head_stride = 0;
        staged.k_scale_row_stride = staged.v_scale_row_stride = 1;
    }
    staged.block_table = nullptr;
    staged.seqlen_k = n;
    chunk_fn(staged, DecodeTask{task.batch, task.kv_head, 0, n, n}, ws, acc, m, l);
}

// The decode chunk kernel of a call: float64 the template's; many query rows per KV head
// the tier's GEMM-shaped kernel, where it has one that takes the call; else the tier's
// (bandwidth-shaped) choice.
DecodeKernel choose_decode(const KernelTable& kernels, const AttentionParams& p) {
    if (p.dtype == DType::kF64) return {KernelId::kTemplateF64, nullptr};
    const DecodeKernel gemm = kernels.gemm_decode_kernel(p);
    if (gemm.chunk) return gemm;
    return kernels.decode_kernel(p);
}

// A decode problem's work, run alone (decode_forward) or as units of a shared schedule
// (attention_forward_batch): phase 0 its tasks, phase 1 its merges, over the partial
// results it owns. A task or merge of a group of heads sees the call through head_group
// (its heads over their KV head's rows, kv_heads = 1).
template <class A>
class DecodeWork : public ProblemWork {
public:
    DecodeWork(const AttentionParams& p, const DecodeKernel& kernel, DecodeChunkFn<A> chunk_fn,
               DecodeMergeFn<A> merge_fn)
        : p_(p), chunk_fn_(chunk_fn), merge_fn_(merge_fn), reads_index_(kernel.reads_index),
          own_elems_(workspace_elems_of(p, kernel)) {
        const int64_t chunk_keys = chunk_keys_of(p, kernel);
        ws_elems_ = thread_scratch_elems<A>(p, own_elems_, chunk_keys, reads_index_);
        if (p.batch == 0 || decode_rows(p) == 0) return;
        split_ = split_decode(p, chunk_keys, kernel.compute_shaped);
        // Partial results of every task: unnormalised accumulator (rows x Dv), max, sum.
        const int64_t rows = split_.rows > 0 ? split_.rows : 1;
        acc_.reset(new A[static_cast<size_t>(rows * p.head_dim_v)]);
        max_sum_.reset(new A[static_cast<size_t>(rows * 2)]);
        row_sum_ = max_sum_.get() + rows;
    }
    int64_t units(int phase) const override {
        return static_cast<int64_t>(phase == 0 ? split_.tasks.size() : split_.merges.size());
    }
    int64_t workspace_bytes() const override {
        return ws_elems_ * static_cast<int64_t>(sizeof(A));
    }
    void run(int phase, int64_t unit, void* workspace) const override {
        A* ws = static_cast<A*>(workspace);
        const int64_t group = p_.heads / p_.kv_heads;
        if (phase == 0) {
            const SplitTask& t = split_.tasks[static_cast<size_t>(unit)];
            A* acc = acc_.get() + t.row_at * p_.head_dim_v;
            A* m = max_sum_.get() + t.row_at;
            A* l = row_sum_ + t.row_at;
            if (t.heads == group) return run_chunk(p_, t.keys, chunk_fn_, reads_index_, ws, own_elems_, acc, m, l);
            DecodeTask keys = t.keys;  // (the group's view holds one KV head)
            keys.kv_head = 0;
            return run_chunk(head_group(p_, t.head0, t.heads), keys, chunk_fn_, reads_index_, ws, own_elems_,
                             acc, m, l);
        }
        const SplitMerge& g = split_.merges[static_cast<size_t>(unit)];
        const A* acc = acc_.get() + g.row_at * p_.head_dim_v;
        const A* m = max_sum_.get() + g.row_at;
        const A* l = row_sum_ + g.row_at;
        if (g.heads == group) return merge_fn_(p_, g.batch, g.kv_head, g.chunks, acc, m, l, ws);
        merge_fn_(head_group(p_, g.head0, g.heads), g.batch, 0, g.chunks, acc, m, l, ws);
    }

private:
    AttentionParams p_;
    DecodeChunkFn<A> chunk_fn_;
    DecodeMergeFn<A> merge_fn_;
    bool reads_index_;
    int64_t own_elems_;     // the chunk kernel's scratch, in elements of A
    int64_t ws_elems_ = 0;  // a thread's: that and run_chunk's staging
    DecodeSplit split_;
    std::unique_ptr<A[]> acc_, max_sum_;
    A* row_sum_ = nullptr;
};

// Work items of the larger pass: tasks, or merges.
int64_t most_units(const ProblemWork& work) {
    return work.units(0) > work.units(1) ? work.units(0) : work.units(1);
}

}  // namespace

std::unique_ptr<ProblemWork> make_decode_work(const AttentionParams& p) {
    const KernelTable& kernels = active_kernels();
    const DecodeKernel kernel = choose_decode(kernels, p);
    if (kernel.chunk)
        return std::unique_ptr<ProblemWork>(new DecodeWork<float>(p, kernel, kernel.chunk, kernels.decode_merge));
    return std::unique_ptr<ProblemWork>(
        new DecodeWork<double>(p, kernel, kernels.decode_chunk_f64, kernels.decode_merge_f64));
}

bool runs_as_row_blocks(const AttentionParams& p) {
    if (p.key_index) return p.seqlen_q > 1;
    return decode_only_format(p.kv_dtype) && !runs_on_decode_path(p);
}

std::vector<AttentionParams> decode_row_blocks(const AttentionParams& p) {
    std::vector<AttentionParams> blocks;
    const int64_t T = p.seqlen_q;
    const int64_t block = p.key_index ? 1 : kQuantizedRowBlock;  // (key_index: a list per row)
    auto add_rows = [&](const AttentionParams& one, int64_t offset) {
        for (int64_t r0 = 0; r0 < T; r0 += block)
            blocks.push_back(query_rows(one, r0, T - r0 < block ? T - r0 : block, offset));
    };
    if (p.has_query_offset) {
        add_rows(p, p.query_offset);
    } else {
        for (int64_t b = 0; b < p.batch; ++b)  // bottom-right: each entry's own offset
            add_rows(batch_entry(p, b), batch_seqlen_k(p, b) - T);
    }
    return blocks;
}

// Parts of the cache a sparse prompt's lists are ordered by. Each row's list is split into
// chunks at fixed entries (split_decode); listed in cache order, a row's first chunk reads
// the first part of the cache, its second the next, and so on, and attention_forward runs
// every row's first chunk, then every row's second, ...: the rows' reads of one chunk fall in
// one stretch of the cache, which stays in L3 between rows instead of coming from memory.
// (A stable order by part, not a sort: linear, and the order within a part is the caller's.)
constexpr int64_t kCacheOrderParts = 64;

AttentionParams in_cache_order(const AttentionParams& p, std::vector<int32_t>& lists) {
    const int64_t k = p.key_index_count, T = p.seqlen_q;
    const int64_t heads = p.key_index_head_stride ? p.kv_heads : 1;
    lists.resize(static_cast<size_t>(p.batch * heads * T * k));
    int64_t counts[kCacheOrderParts + 2];
    for (int64_t b = 0; b < p.batch; ++b) {
        const int64_t seqlen_k = batch_seqlen_k(p, b);
        // an entry's part; -1 (none) after every position
        auto part = [&](int32_t pos) {
            return pos < 0 || pos >= seqlen_k ? kCacheOrderParts : pos * kCacheOrderParts / seqlen_k;
        };
        for (int64_t h = 0; h < heads; ++h)
            for (int64_t t = 0; t < T; ++t) {
                const int32_t* src = p.key_index + b * p.key_index_batch_stride + h * p.key_index_head_stride +
                                     t * p.key_index_row_stride;
                int32_t* dst = lists.data() + ((b * heads + h) * T + t) * k;
                for (int64_t x = 0; x < kCacheOrderParts + 2; ++x) counts[x] = 0;
                for (int64_t x = 0; x < k; ++x) ++counts[part(src[x]) + 1];
                for (int64_t x = 1; x < kCacheOrderParts + 2; ++x) counts[x] += counts[x - 1];
                for (int64_t x = 0; x < k; ++x) dst[counts[part(src[x])]++] = src[x];
            }
    }
    AttentionParams ordered = p;
    ordered.key_index = lists.data();
    ordered.key_index_row_stride = k;
    ordered.key_index_head_stride = p.key_index_head_stride ? T * k : 0;
    ordered.key_index_batch_stride = heads * T * k;
    return ordered;
}

bool runs_on_decode_path(const AttentionParams& p) {
    if (takes_decode_path(p)) return true;
    if (p.dtype == DType::kF64 || p.seqlen_k < kDecodeMinKeysPerQuery * p.seqlen_q) return false;
    const KernelTable& kernels = active_kernels();
    // (below kGemmDecodeMinRows rows per KV head, past kFewRowsDecodeMaxQueryRows positions
    // the prefill is ahead of gemm_decode too: 8/8 heads, Tq = 24-28, 0.87-0.90x on Zen 5)
    const bool gemm_rows = decode_rows(p) >= kGemmDecodeMinRows || p.seqlen_q <= kFewRowsDecodeMaxQueryRows;
    if (p.seqlen_q <= kGemmDecodeMaxQueryRows && gemm_rows && kernels.gemm_decode_kernel(p).chunk) return true;
    // (the templates' decode is no match for the prefill kernels)
    return p.seqlen_q <= kFewRowsDecodeMaxQueryRows && decode_rows(p) < kGemmDecodeMinRows &&
           !is_template(kernels.decode_kernel(p).id);
}

void decode_forward(const AttentionParams& p) {
    const std::unique_ptr<ProblemWork> work = make_decode_work(p);
    const int64_t most = most_units(*work);
    if (most == 0) return;
    const int threads = p.num_threads < most ? p.num_threads : static_cast<int>(most);
    const ThreadScratch<char> scratch(work->workspace_bytes(), threads);
    for (int phase = 0; phase < 2; ++phase)
        parallel::for_each_dynamic(work->units(phase), threads, p.interruptible, [&](int64_t unit, int thread_id) {
            work->run(phase, unit, scratch.at(thread_id));
        });
}

CallPlan plan_decode(const AttentionParams& p) {
    const KernelTable& kernels = active_kernels();
    CallPlan plan{};
    plan.tier = kernels.name;
    plan.decode = true;
    const DecodeKernel kernel = choose_decode(kernels, p);
    plan.kernel = kernel_name(kernel.id);
    set_policy(plan, kernels.kernel_policy(kernel.id, p));
    plan.paged = p.block_table != nullptr;
    plan.indexed = p.key_index != nullptr;
    plan.chunk_keys = chunk_keys_of(p, kernel);
    plan.head_groups = 1;
    plan.latent_kv = kv_is_latent(p);
    plan.rows_per_kv_read = decode_rows(p);
    // Compute-shaped when the kernel blocks the rows as a GEMM (a latent cache's many rows);
    // the other decode kernels stream K/V once per step, shaped by memory bandwidth.
    plan.regime = kernel.compute_shaped ? "compute" : "bandwidth";
    if (p.batch == 0 || decode_rows(p) == 0) return plan;  // (no tasks: the work has no units)
    const DecodeSplit split = split_decode(p, plan.chunk_keys, kernel.compute_shaped);
    plan.chunks = split.chunks;
    plan.head_groups = split.head_groups;
    plan.tasks = static_cast<int64_t>(split.tasks.size());
    const int64_t merges = static_cast<int64_t>(split.merges.size());
    plan.threads = parallel::threads_alone(plan.tasks > merges ? plan.tasks : merges, p.num_threads);
    return plan;
}

}  // namespace attnfast
