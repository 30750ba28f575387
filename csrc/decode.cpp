// Decode driver: a short query (1 to kDecodeMaxQueryRows rows) against a long KV cache.
//
// Work is split into (batch, kv head, chunk of keys) tasks. A chunk's size depends only on
// the head dims and dtype, and chunk boundaries sit at fixed key positions, so the set of
// tasks, and each task's result, are the same for any thread count. Each task serves all
// (H / Hkv) * Tq query rows of its KV head, so every K/V byte is read once per step. A
// second pass merges each (batch, kv head)'s chunks by their (max, sum) in chunk order:
// bit-identical results for any number of threads.
#include <memory>
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

template <class A>
void run_decode(const AttentionParams& p, DecodeChunkFn<A> chunk_fn, DecodeMergeFn<A> merge_fn) {
    const int64_t rows = decode_rows(p);
    const int64_t heads_kv = p.kv_heads;
    if (p.batch == 0 || rows == 0) return;
    const int64_t chunk = decode_chunk_keys(p);

    // Tasks in slot order: batch, then kv head, then chunk. Only chunks holding keys some
    // row may see are listed; a (batch, kv head) with none still gets its merge (zeros).
    std::vector<DecodeTask> tasks;
    std::vector<int64_t> slot_base(static_cast<size_t>(p.batch));
    std::vector<int64_t> chunk_count(static_cast<size_t>(p.batch));
    for (int64_t b = 0; b < p.batch; ++b) {
        const int64_t seqlen_k = batch_seqlen_k(p, b);
        // Visible ranges only move right as rows go down: the union is first.begin..last.end.
        const int64_t begin = visible_keys(p, 0, seqlen_k).begin;
        const int64_t end = visible_keys(p, p.seqlen_q - 1, seqlen_k).end;
        const int64_t c_first = begin / chunk;
        const int64_t c_end = end > begin ? (end + chunk - 1) / chunk : c_first;
        slot_base[b] = static_cast<int64_t>(tasks.size());
        chunk_count[b] = c_end - c_first;
        for (int64_t g = 0; g < heads_kv; ++g)
            for (int64_t c = c_first; c < c_end; ++c) {
                DecodeTask t;
                t.batch = b;
                t.kv_head = g;
                t.key_begin = c * chunk > begin ? c * chunk : begin;
                t.key_end = (c + 1) * chunk < end ? (c + 1) * chunk : end;
                t.seqlen_k = seqlen_k;
                tasks.push_back(t);
            }
    }
    const int64_t slots = static_cast<int64_t>(tasks.size());
    const int64_t merges = p.batch * heads_kv;
    const int64_t most = slots > merges ? slots : merges;
    const int threads = p.num_threads < most ? p.num_threads : static_cast<int>(most);

    // Partial results, one slot per task: unnormalised accumulator (rows x Dv), max, sum.
    const size_t slots_sz = static_cast<size_t>(slots > 0 ? slots : 1);
    std::unique_ptr<A[]> acc(new A[slots_sz * rows * p.head_dim_v]);
    std::unique_ptr<A[]> max_sum(new A[slots_sz * rows * 2]);
    A* row_max = max_sum.get();
    A* row_sum = max_sum.get() + slots_sz * rows;
    const int64_t ws_elems = decode_workspace_elems(p);
    std::unique_ptr<A[]> workspace(new A[static_cast<size_t>(ws_elems * threads)]);

    parallel::for_each_dynamic(slots, threads, p.interruptible, [&](int64_t slot, int thread_id) {
        chunk_fn(p, tasks[slot], workspace.get() + ws_elems * thread_id,
                 acc.get() + slot * rows * p.head_dim_v, row_max + slot * rows,
                 row_sum + slot * rows);
    });
    parallel::for_each_dynamic(merges, threads, p.interruptible, [&](int64_t index, int thread_id) {
        const int64_t b = index / heads_kv, g = index % heads_kv;
        const int64_t base = slot_base[b] + g * chunk_count[b];
        merge_fn(p, b, g, chunk_count[b], acc.get() + base * rows * p.head_dim_v,
                 row_max + base * rows, row_sum + base * rows,
                 workspace.get() + ws_elems * thread_id);
    });
}

}  // namespace

void decode_forward(const AttentionParams& p) {
    const KernelTable& kernels = active_kernels();
    if (p.dtype == DType::kF64) run_decode<double>(p, kernels.decode_chunk_f64, kernels.decode_merge_f64);
    else run_decode<float>(p, kernels.decode_chunk, kernels.decode_merge);
}

}  // namespace attnfast
