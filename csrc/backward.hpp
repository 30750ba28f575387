// attention_backward: the gradients of attention_forward (FlashAttention-2's backward,
// streamed: P is recomputed per tile from the forward's lse, never stored whole).
// Knows nothing of Python.
#pragma once
#include <cstdint>

#include "attnfast.hpp"

namespace attnfast {

// The forward problem (q, k, v, lse and every score option in `attn`; attn.out is unused)
// plus the incoming gradient and the gradient buffers. kv_dtype must equal dtype (no int8,
// no paged cache). With attn.key_index (no ALiBi, no mask), the gradients of attention over
// the listed keys (sparse_key_range), only those K/V rows read. Accumulator type A: double
// for kF64, else float.
struct BackwardParams {
    AttentionParams attn;  // attn.lse is required: the forward's lse (of type A)
    const void* dout;      // (batch, heads, seqlen_q, head_dim_v), of attn.dtype
    int64_t dout_batch_stride, dout_head_stride, dout_row_stride;
    const void* delta;     // (batch, heads, seqlen_q) contiguous, of A: rowsum(dout * out)
    // Gradients, of A: dq (B, H, Tq, dq_row_stride) with its rows padded to
    // backward_padded(head_dim) (the micro-GEMMs write whole vectors: columns >= head_dim
    // are scratch), dk (B, Hkv, Tk, D) and dv (B, Hkv, Tk, Dv) contiguous. Every element is
    // written (rows no query sees get 0).
    void* dq;
    int64_t dq_row_stride;  // must equal backward_padded(attn.head_dim)
    void* dk;
    void* dv;
};

// Deterministic: each gradient row is reduced by one task in a fixed order, so the result
// bits do not depend on num_threads. Throws std::invalid_argument on bad params.
void attention_backward(const BackwardParams& params);

// Keys per key block and query rows per query block: a fixed number (never the thread
// count), the same for both, so every tile pair is Bt x Bt.
constexpr int64_t kBackwardTile = 64;

// Widths (head_dim, head_dim_v) inside the tiles and dq's rows are padded to a multiple of
// this: whole vectors on every tier (16 float32 lanes of AVX-512).
constexpr int64_t kBackwardPad = 16;
static inline int64_t backward_padded(int64_t n) {
    return (n + kBackwardPad - 1) / kBackwardPad * kBackwardPad;
}

// The schedule: true for one task per (batch, kv head) that accumulates dk, dv and dq over
// its key blocks in order (5 tile products per tile pair); false for a dk/dv pass and a dq
// pass (7: the scores and dP are recomputed in the second). The fused one has fewer tasks,
// so it is chosen when they keep every thread busy: at most 1.4x the ideal time (the
// other's extra work). Both give the same bits (backward.inl), so the choice may depend on
// the thread count.
static inline bool backward_fused(int64_t groups, int64_t threads) {
    if (groups <= 0 || threads <= 0) return true;
    const int64_t rounds = (groups + threads - 1) / threads;
    return 5 * rounds * threads <= 7 * groups;
}

// With key_index (sparse attention) the backward reads only the listed keys, in two passes:
// dk/dv tasks of sparse_key_range(seqlen_k) keys per (batch, kv head), each scanning every
// query row's list for its keys (so at most 64 ranges: the scans stay a small share), and dq
// tasks of kSparseQueryRows query rows per (batch, block of query heads). Both sizes follow
// from the shape alone, and each task owns the rows it writes: the bits do not depend on
// the thread count.
static inline int64_t sparse_key_range(int64_t seqlen_k) {
    const int64_t per_range = (seqlen_k + 63) / 64;
    return per_range < 256 ? 256 : per_range;
}
constexpr int64_t kSparseQueryRows = 16;

// One unit of backward work: for the dk/dv pass, keys [begin, end) of kv head `head`;
// for the dq pass, query rows [begin, end) of query head `head`.
struct BackwardTask {
    int64_t batch;
    int64_t head;
    int64_t begin;
    int64_t end;
};

// The fused schedule sweeps the query blocks once for up to this many key blocks at a time
// (fewer reads of q, dout and dq per product), as many as 3x the L2 cache holds with
// their tiles (backward_key_blocks, from the cache size: never the thread count; the bits
// do not depend on it either, as each gradient element keeps its order).
constexpr int64_t kBackwardKeyBlocks = 8;
int64_t backward_key_blocks(const AttentionParams& p);

// Scratch one thread needs for any task, in accumulator elements: per key block the tiles
// of K^T, V^T, K, dK, dV, then one query block's q, dout (copies, widths padded) and P, dS
// (bwd::Tiles).
static inline int64_t backward_workspace_elems(const AttentionParams& p) {
    const int64_t t = kBackwardTile, dp = backward_padded(p.head_dim), dvp = backward_padded(p.head_dim_v);
    return kBackwardKeyBlocks * t * (3 * dp + 2 * dvp) + t * (dp + dvp) + 2 * t * t;
}

// One per kernel tier (csrc/kernels/backward.inl compiled by each isa_*.cpp).
struct BackwardKernels {
    // The fused schedule: dk, dv and dq of every head of one (batch, kv head).
    void (*group_f32)(const BackwardParams&, int64_t batch, int64_t kv_head, float* workspace);
    void (*group_f64)(const BackwardParams&, int64_t batch, int64_t kv_head, double* workspace);
    // The two-pass schedule: dk/dv rows of one key block (all query heads of its kv head): float32 accumulation
    // for float32 / float16 / bfloat16 inputs, and float64.
    void (*key_block_f32)(const BackwardParams&, const BackwardTask&, float* workspace);
    void (*key_block_f64)(const BackwardParams&, const BackwardTask&, double* workspace);
    // dq rows of one query block of one query head.
    void (*query_block_f32)(const BackwardParams&, const BackwardTask&, float* workspace);
    void (*query_block_f64)(const BackwardParams&, const BackwardTask&, double* workspace);
    // With key_index: dk/dv rows [begin, end) of kv head `head` (every query row's listed
    // keys in that range), and dq rows [begin, end) of the query heads `head` .. (up to
    // kBackwardTile of them, within one kv head's group).
    void (*listed_keys_f32)(const BackwardParams&, const BackwardTask&, float* workspace);
    void (*listed_keys_f64)(const BackwardParams&, const BackwardTask&, double* workspace);
    void (*listed_queries_f32)(const BackwardParams&, const BackwardTask&, float* workspace);
    void (*listed_queries_f64)(const BackwardParams&, const BackwardTask&, double* workspace);
};


}  // namespace attnfast
