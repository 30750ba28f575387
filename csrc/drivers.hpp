// Internal: the drivers attention_forward picks between (not part of the public C++ API).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "attnfast.hpp"

namespace attnfast {

// Throws std::invalid_argument for params the kernels cannot run (prefill.cpp).
void check_params(const AttentionParams& p);

// Whether checked params run on the decode path: short queries (takes_decode_path), and
// longer ones where a decode kernel of the active tier beats prefill on them (see
// kGemmDecodeMaxQueryRows, kernels/kernel_table.hpp). decode.cpp.
bool runs_on_decode_path(const AttentionParams& p);

// Split-KV, GQA-grouped decode (decode.cpp), for params runs_on_decode_path takes.
// `p` has been checked by attention_forward.
void decode_forward(const AttentionParams& p);

// Whether checked params run as several decode problems of blocks of their query rows
// (decode_row_blocks): a prompt (not runs_on_decode_path) over a decode_only_format cache,
// or any query of more than one row with key_index (each row its own key list).
bool runs_as_row_blocks(const AttentionParams& p);

// Such params as the decode problems they run as: blocks of kQuantizedRowBlock query rows
// (one row with key_index; per batch entry when aligned bottom-right), each keeping its
// rows' key positions through an explicit query offset (decode.cpp).
std::vector<AttentionParams> decode_row_blocks(const AttentionParams& p);

// A sparse prompt's params (key_index, more than one query row) over `lists`, a copy of its
// key lists, each stably ordered by the part of the cache its positions lie in (decode.cpp).
AttentionParams in_cache_order(const AttentionParams& p, std::vector<int32_t>& lists);

// plan_attention's answer for checked params, from the code each driver runs by.
CallPlan plan_prefill(const AttentionParams& p);  // prefill.cpp
CallPlan plan_decode(const AttentionParams& p);   // decode.cpp

// Per-thread scratch, each thread's part starting on a 64-byte line: the kernels' vector loads
// of what they stage there (query rows, scores) never straddle two lines. (operator new[] of
// a large array returns 16 bytes past a page; 16 bytes off a line, the avx2 tier's 32/8
// bfloat16 decode measured 7 % slower on Zen 4, HISTORY 32.)
template <class A>
class ThreadScratch {
public:
    ThreadScratch(int64_t elems, int threads)
        : stride_((elems + kLine - 1) / kLine * kLine),
          buf_(new A[static_cast<size_t>(stride_ * (threads > 0 ? threads : 1) + kLine)]),
          base_(reinterpret_cast<A*>((reinterpret_cast<uintptr_t>(buf_.get()) + 63) & ~uintptr_t(63))) {}
    A* at(int thread) const { return base_ + stride_ * thread; }

private:
    static constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(A));  // elements per line
    int64_t stride_;
    std::unique_ptr<A[]> buf_;
    A* base_;  // buf_'s first 64-byte line
};

// One checked problem's work as units a shared schedule runs (attention_forward_batch):
// the units of phase 0 in any order on any thread, then, once phase 0 of every problem is
// done, those of phase 1. Each unit computes what the problem's own attention_forward
// would (its task list and kernels), so the results are the same bits.
class ProblemWork {
public:
    virtual ~ProblemWork() = default;
    virtual int64_t units(int phase) const = 0;
    virtual int64_t workspace_bytes() const = 0;  // one thread's scratch for any unit
    virtual void run(int phase, int64_t unit, void* workspace) const = 0;
};
std::unique_ptr<ProblemWork> make_prefill_work(const AttentionParams& p);  // prefill.cpp
std::unique_ptr<ProblemWork> make_decode_work(const AttentionParams& p);   // decode.cpp

}  // namespace attnfast
