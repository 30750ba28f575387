// index_topk (attnfast.hpp): the lightning indexer's scores (the tier's index_scores) and a
// running top-k per query row.
//
// Keys are scored kIndexChunkKeys at a time into a per-thread buffer; after each chunk the
// row's candidates (the best so far plus the chunk's) are cut back to the best topk by
// nth_element over the order (score descending, position ascending; NaN as -inf), so no
// Tq x L array exists. The selection under that total order is exact, so splitting a row's
// keys over tasks (decode: few rows, many keys) and merging their candidates gives the
// same positions as one pass: the result never depends on the thread count.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "attnfast.hpp"
#include "drivers.hpp"
#include "kernels/kernel_table.hpp"
#include "parallel.hpp"

namespace attnfast {
namespace {

constexpr int64_t kIndexChunkKeys = 4096;

void require(bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("attnfast::index_topk: ") + what);
}

struct Candidate {
    float score;  // NaN replaced by -inf
    int32_t pos;
};
inline bool better(const Candidate& a, const Candidate& b) {
    return a.score > b.score || (a.score == b.score && a.pos < b.pos);
}

// Keeps the best `topk` of cand (any order).
void cut(std::vector<Candidate>& cand, int64_t topk) {
    if (static_cast<int64_t>(cand.size()) <= topk) return;
    std::nth_element(cand.begin(), cand.begin() + topk, cand.end(), better);
    cand.resize(static_cast<size_t>(topk));
}

int64_t keys_of(const IndexParams& p, int64_t b) { return p.seqlens_k ? p.seqlens_k[b] : p.seqlen_k; }

// Keys [0, end) query row t of entry b sees.
int64_t visible_end(const IndexParams& p, int64_t b, int64_t t) {
    const int64_t keys = keys_of(p, b);
    if (!p.causal) return keys;
    const int64_t last = keys - p.seqlen_q + t;  // the row's own position
    return last + 1 < 0 ? 0 : (last + 1 < keys ? last + 1 : keys);
}

// Scores keys [s0, s1) of row (b, t) chunk by chunk into cand, keeping the best topk. After
// a cut to topk, a key enters only with a score above the worst kept one (its position is
// larger than every kept one's, so a tie ranks it below; later cuts only raise that floor):
// the same selection, with few candidates once the scores have settled, and a cut only when
// a chunk's worth has gathered.
void select_range(const IndexParams& p, const KernelTable& kt, int64_t b, int64_t t, int64_t s0,
                  int64_t s1, float* chunk, float* ws, std::vector<Candidate>& cand) {
    float floor = -INFINITY;
    bool have_floor = false;  // topk kept at the last cut: floor is the worst of them
    for (int64_t c0 = s0; c0 < s1; c0 += kIndexChunkKeys) {
        const int64_t c1 = c0 + kIndexChunkKeys < s1 ? c0 + kIndexChunkKeys : s1;
        kt.index_scores(p, b, t, c0, c1, chunk, ws);
        for (int64_t s = c0; s < c1; ++s) {
            const float x = chunk[s - c0] == chunk[s - c0] ? chunk[s - c0] : -INFINITY;
            if (!have_floor || x > floor) cand.push_back({x, static_cast<int32_t>(s)});
        }
        if (static_cast<int64_t>(cand.size()) < p.topk + kIndexChunkKeys && c1 < s1) continue;
        cut(cand, p.topk);
        have_floor = static_cast<int64_t>(cand.size()) == p.topk;
        if (have_floor) {
            floor = cand[0].score;
            for (const Candidate& c : cand) floor = c.score < floor ? c.score : floor;
        }
    }
}

// Writes row (b, t)'s result from its candidates (sorted best first, -1 / -inf after).
void write_row(const IndexParams& p, int64_t b, int64_t t, std::vector<Candidate>& cand) {
    cut(cand, p.topk);
    std::sort(cand.begin(), cand.end(), better);
    int32_t* index = p.out_index + (b * p.seqlen_q + t) * p.topk;
    float* scores = p.out_scores ? p.out_scores + (b * p.seqlen_q + t) * p.topk : nullptr;
    for (int64_t x = 0; x < p.topk; ++x) {
        const bool have = x < static_cast<int64_t>(cand.size());
        index[x] = have ? cand[static_cast<size_t>(x)].pos : -1;
        if (scores) scores[x] = have ? cand[static_cast<size_t>(x)].score : -INFINITY;
    }
}

}  // namespace

void index_topk(const IndexParams& p) {
    require(p.batch >= 0 && p.heads >= 1 && p.seqlen_q >= 0 && p.seqlen_k >= 0, "bad sizes");
    require(p.head_dim >= 1, "head_dim must be >= 1");
    require(p.topk >= 1 && p.topk <= INT32_MAX, "topk must be >= 1");
    require(p.seqlen_k <= INT32_MAX, "too many keys for int32 positions");
    require(p.num_threads >= 1, "num_threads must be >= 1");
    require(p.q_dtype == DType::kF32 || p.q_dtype == DType::kBF16, "q must be float32 or bfloat16");
    require(p.k_dtype == DType::kF32 || p.k_dtype == DType::kBF16 || p.k_dtype == DType::kF8E4M3,
            "index keys must be float32, bfloat16 or float8_e4m3fn");
    for (int64_t b = 0; b < p.batch; ++b) {
        const int64_t keys = keys_of(p, b);
        require(keys >= 0 && keys <= p.seqlen_k, "seqlens_k[b] must be in [0, seqlen_k]");
        if (p.block_table)
            for (int64_t x = 0; x < (keys + p.block_size - 1) / p.block_size; ++x) {
                const int64_t id = p.block_table[b * p.block_table_batch_stride + x];
                require(id >= 0 && id < p.num_blocks, "paged index keys: block id out of range");
            }
    }
    const KernelTable& kt = active_kernels();
    const int64_t rows = p.batch * p.seqlen_q;
    if (rows == 0) return;
    // Rows are tasks when there are enough of them; otherwise each row's keys are split at
    // fixed points into parts (decode), whose candidates a second pass merges.
    int64_t parts = 1;
    if (rows < 2 * static_cast<int64_t>(p.num_threads)) {
        int64_t most = 0;
        for (int64_t b = 0; b < p.batch; ++b) most = keys_of(p, b) > most ? keys_of(p, b) : most;
        parts = (most + kIndexChunkKeys - 1) / kIndexChunkKeys;
        parts = parts < 1 ? 1 : (parts > 64 ? 64 : parts);
    }
    const int64_t tasks = rows * parts;
    const int threads = parallel::threads_alone(tasks, p.num_threads);
    const int64_t scratch = kIndexChunkKeys + index_workspace_floats(p);
    const ThreadScratch<float> buffers(scratch, threads > 0 ? threads : 1);
    std::vector<std::vector<Candidate>> found(static_cast<size_t>(tasks));
    parallel::for_each_dynamic(tasks, threads, p.interruptible, [&](int64_t task, int thread_id) {
        const int64_t row = task / parts, part = task % parts;
        const int64_t b = row / p.seqlen_q, t = row % p.seqlen_q;
        const int64_t end = visible_end(p, b, t);
        // Part boundaries in whole chunks: fixed by the shape, not by the threads.
        const int64_t per = (end + parts * kIndexChunkKeys - 1) / (parts * kIndexChunkKeys) * kIndexChunkKeys;
        const int64_t s0 = part * per < end ? part * per : end;
        const int64_t s1 = s0 + per < end ? s0 + per : end;
        std::vector<Candidate>& cand = found[static_cast<size_t>(task)];
        cand.reserve(static_cast<size_t>(p.topk + 2 * kIndexChunkKeys));
        float* buf = buffers.at(thread_id);
        select_range(p, kt, b, t, s0, s1, buf, buf + kIndexChunkKeys, cand);
        if (parts == 1) {
            write_row(p, b, t, cand);
            std::vector<Candidate>().swap(cand);
        }
    });
    if (parts == 1) return;
    parallel::for_each_dynamic(rows, threads, p.interruptible, [&](int64_t row, int) {
        std::vector<Candidate> all;
        for (int64_t part = 0; part < parts; ++part) {
            const std::vector<Candidate>& c = found[static_cast<size_t>(row * parts + part)];
            all.insert(all.end(), c.begin(), c.end());
        }
        write_row(p, row / p.seqlen_q, row % p.seqlen_q, all);
    });
}

}  // namespace attnfast
