// attention_backward: the gradients of attention_forward (FlashAttention-2's backward,
// streamed: P is recomputed per tile from the forward's lse, never stored whole).
// Knows nothing of Python.
#pragma once
#include <cstdint>

#include "attnfast.hpp"

namespace attnfast {

// The forward problem (q, k, v, lse and every score option in `attn`; attn.out is unused)
// plus the incoming gradient and the gradient buffers. kv_dtype must equal dtype (no int8,
// no paged cache). Accumulator type A: double for kF64, else float.
struct BackwardParams {
    AttentionParams attn;  // attn.lse is required: the forward's lse (of type A)
    const void* dout;      // (batch, heads, seqlen_q, head_dim_v), of attn.dtype
    int64_t dout_batch_stride, dout_head_stride, dout_row_stride;
    const void* delta;     // (batch, heads, seqlen_q) contiguous, of A: rowsum(dout * out)
    // Gradients, contiguous, of A: dq (B, H, Tq, D), dk (B, Hkv, Tk, D), dv (B, Hkv, Tk, Dv).
    // Every element is written (rows no query sees get 0).
    void* dq;
    void* dk;
    void* dv;
};

// Deterministic: each gradient row is reduced by one task in a fixed order, so the result
// bits do not depend on num_threads. Throws std::invalid_argument on bad params.
void attention_backward(const BackwardParams& params);

// Keys per key block of the dk/dv pass and query rows per block of the dq pass: fixed
// numbers (never the thread count), and equal, so one 64-column micro-GEMM serves every
// product of the backward.
constexpr int64_t kBackwardTile = 64;

// One unit of backward work: for the dk/dv pass, keys [begin, end) of kv head `head`;
// for the dq pass, query rows [begin, end) of query head `head`.
struct BackwardTask {
    int64_t batch;
    int64_t head;
    int64_t begin;
    int64_t end;
};

// Scratch one thread needs for either pass, in accumulator elements.
static inline int64_t backward_workspace_elems(const AttentionParams& p) {
    const int64_t t = kBackwardTile;
    return t * (4 * p.head_dim + 4 * p.head_dim_v) + 6 * t * t + 4 * t;
}

// One per kernel tier (csrc/kernels/backward.inl compiled by each isa_*.cpp).
struct BackwardKernels {
    // dk/dv rows of one key block (all query heads of its kv head): float32 accumulation
    // for float32 / float16 / bfloat16 inputs, and float64.
    void (*key_block_f32)(const BackwardParams&, const BackwardTask&, float* workspace);
    void (*key_block_f64)(const BackwardParams&, const BackwardTask&, double* workspace);
    // dq rows of one query block of one query head.
    void (*query_block_f32)(const BackwardParams&, const BackwardTask&, float* workspace);
    void (*query_block_f64)(const BackwardParams&, const BackwardTask&, double* workspace);
};

namespace isa_generic { const BackwardKernels* backward_kernels(); }
namespace isa_avx2 { const BackwardKernels* backward_kernels(); }
namespace isa_avx512 { const BackwardKernels* backward_kernels(); }
namespace isa_avx512bf16 { const BackwardKernels* backward_kernels(); }
namespace isa_neon { const BackwardKernels* backward_kernels(); }

}  // namespace attnfast
