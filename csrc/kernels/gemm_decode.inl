// GEMM-shaped decode: many query rows per KV head reading each K/V row once. Two kinds of
// call have them:
//   * MLA latent caches (DeepSeek-V2/V3, Kimi K2): V is a prefix view of K's last axis
//     (v = k[..., :Dv], the same memory: kv_is_latent) and 16-128 heads per KV head after
//     weight absorption, times 1-4 query tokens, read each latent row (kernel
//     "latent_decode");
//   * GQA with several query tokens: speculative-tree verification, multi-token prediction,
//     shared-prefix decoding's stacked forks (H / Hkv heads x Tq tokens; kernel
//     "gemm_decode", chosen from kGemmDecodeMinRows rows per KV head).
// There every key costs rows x (D + Dv) multiply-adds for (D + Dv) values read (D for a
// latent row), so the step is bound by arithmetic, not memory, and the bandwidth-shaped
// decode kernel (a dot product per row and key) leaves most of the FMA units idle.
//
// A chunk of keys runs the prefill's tile loop (simd_prefill.inl: simd::attend_keys over
// sub-blocks of Bq query rows in the vector lanes, its micro-kernels and online softmax,
// with its kernel policies: simd::WidenKernel, float32 FMA over float32 rows in place or
// 16-bit rows widened per super-tile; bf16_prefill::Bf16Kernel on AVX512_BF16, vdpbf16ps for
// bfloat16 q over bfloat16 K/V). The lanes of a sub-block are rows r = (query head within
// the group) x Tq + (position) of one (batch, kv head) -- several heads and positions per
// sub-block -- each with its own visible keys within the chunk; the rows of a paged pool or
// of an indexed task are read by address. Same task and result contract as decode_loop
// (decode_attention.inl): one chunk of keys of one (batch, kv head), all its query rows,
// unnormalised; the shared merge finishes (sinks, lse, out). The score options it takes:
// scale, causal, window, softcap (ALiBi and masks keep the bandwidth-shaped kernels:
// gemm_decode_kernel declines them). Rounding depends only on the shapes (never the
// thread count).
#pragma once
#if !defined(__SSE2__) && !defined(__aarch64__)
#error "gemm_decode.inl needs the SIMD layer of an x86-64 tier or AArch64 NEON"
#endif
#include <new>

#include "decode_attention.inl"
#include "simd_prefill.inl"

// The prefill's templates are instantiated here too: the same false positive as there.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace gemm_decode {

using simd::Bq;
using simd::Block;
using simd::Tiling;

// Keys per split-KV chunk: a whole number of tiles, large enough that the chunks' partial
// accumulators (rows x Dv floats each) and their merge stay small next to the arithmetic,
// and fixed (never derived from the thread count: the same bits for any count).
constexpr int64_t kChunkKeys = 2048;
// Fewest query rows per KV head for which a latent call takes this kernel: one whole vector.
constexpr int64_t kMinRows = simd::W;
// Separate K and V: from how many rows per KV head this beats the bandwidth-shaped decode.
// Where one sub-block's vectors are wide (AVX-512) or the bandwidth kernel is itself slow
// (SSE2), from 16 (Zen 5, L = 16k: 8/8 Tq 16 1.16-1.28x, 32/8 Tq 4 1.17-1.32x; HISTORY 59);
// on AVX2 and NEON 16 rows lose (0.70-0.85x), so from kGemmDecodeMinRows.
#if defined(__AVX512F__) || (defined(__SSE2__) && !defined(__AVX2__))
constexpr int64_t kMinGqaRows = 16;
#else
constexpr int64_t kMinGqaRows = kGemmDecodeMinRows;
#endif

inline int64_t sub_blocks(const AttentionParams& p) { return (decode_rows(p) + Bq - 1) / Bq; }
// The chunk's tiling: rows by address when the task is indexed or the cache paged.
template <class Kernel>
Tiling tiling(const AttentionParams& p, bool listed) { return simd::tiling(p, Kernel::kWidened, listed); }

// Workspace floats per thread (see chunk()): the larger of the two tilings, an aligned
// base, and the Block array.
template <class Kernel>
int64_t workspace_elems_of(const AttentionParams& p) {
    const int64_t subs = sub_blocks(p);
    int64_t most = 0;
    for (int listed = 0; listed < 2; ++listed) {
        const Tiling t = tiling<Kernel>(p, listed == 1);
        const int64_t n = t.shared_elems + subs * t.sub_elems + t.kv_copy_elems + Kernel::extra_elems(p, t);
        most = n > most ? n : most;
    }
    const int64_t blocks = (subs * static_cast<int64_t>(sizeof(Block)) + 63) / 64 * 16;
    return most + blocks + 2 * 64 / static_cast<int64_t>(sizeof(float));
}

// One chunk of keys of one (batch, kv head) for all its rows: acc (rows x Dv), m, l.
template <class Kernel>
void chunk(const AttentionParams& p, const DecodeTask& task, float* workspace, float* acc,
           float* m_out, float* l_out) {
    using TQ = typename Kernel::Q;
    using TKV = typename Kernel::KV;
    const int64_t Dv = p.head_dim_v, tq = p.seqlen_q;
    const int64_t group = p.heads / p.kv_heads;
    const int64_t rows = group * tq;
    const int64_t subs = sub_blocks(p);
    const Tiling t = tiling<Kernel>(p, task.rows != nullptr);
    float* base = simd::align_workspace(workspace);
    Block* blocks = reinterpret_cast<Block*>(simd::align_workspace(
        simd::kernel_extra_of(base, t, subs) + Kernel::extra_elems(p, t)));
    const Kernel kernel(p, simd::kernel_extra_of(base, t, subs));

    const TaskRows<TKV> k{key_rows<TKV>(p, p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride,
                                        task.batch, task.kv_head), task.rows};
    const TaskRows<TKV> v{key_rows<TKV>(p, p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride,
                                        task.batch, task.kv_head), task.rows};
    const TQ* q = static_cast<const TQ*>(p.q) + task.batch * p.q_batch_stride;
    for (int64_t sidx = 0; sidx < subs; ++sidx) {
        Block& b = *new (blocks + sidx) Block;
        simd::place_block<Kernel>(p, t, base, sidx, subs, k, v, task.seqlen_k, b);
        b.row_begin = sidx * Bq;
        b.rows = rows - b.row_begin < Bq ? rows - b.row_begin : Bq;
        const TQ* qrows[Bq];
        int64_t pos[Bq];
        for (int64_t i = 0; i < b.rows; ++i) {
            const int64_t r = b.row_begin + i;
            pos[i] = r % tq;
            qrows[i] = q + (task.kv_head * group + r / tq) * p.q_head_stride + pos[i] * p.q_row_stride;
        }
        kernel.stage_queries(p, b, qrows);
        simd::start_state(p, b, pos, task.key_begin, task.key_end);
    }
    simd::attend_keys(p, kernel, t, blocks, subs, task.batch, k, v, RowScales{}, RowScales{},
                      simd::kv_copy_of(base, t, subs));

    // The chunk's partial result in the merge's layout: rows x Dv, max and sum per row; Oᵀ
    // transposed in blocks of kChunk x kChunk (a scalar copy with Oᵀ's stride measured ~9 %
    // of an MLA task of 256 keys).
    constexpr int64_t C = simd::kChunk;
    for (int64_t sidx = 0; sidx < subs; ++sidx) {
        const Block& b = blocks[sidx];
        float* out = acc + b.row_begin * Dv;
        for (int64_t i0 = 0; i0 < b.rows; i0 += C) {
            int64_t d0 = 0;
            for (; d0 + C <= Dv; d0 += C) {
                simd::Chunk block[C];
                for (int64_t c = 0; c < C; ++c) block[c] = simd::chunk_load(b.ot + (d0 + c) * Bq + i0);
                simd::transpose_chunks(block);
                for (int64_t j = 0; j < C && i0 + j < b.rows; ++j)
                    simd::chunk_storeu(out + (i0 + j) * Dv + d0, block[j]);
            }
            for (int64_t i = i0; i < i0 + C && i < b.rows; ++i)
                for (int64_t d = d0; d < Dv; ++d) out[i * Dv + d] = b.ot[d * Bq + i];
        }
        for (int64_t i = 0; i < b.rows; ++i) {
            m_out[b.row_begin + i] = b.m[i];
            l_out[b.row_begin + i] = b.l[i];
        }
    }
}

// Whether the bfloat16 pair kernel (vdpbf16ps) runs a call: bfloat16 q over a bfloat16
// cache, even D, no softcap.
inline bool takes_pair_kernel(const AttentionParams& p) {
#if defined(__AVX512BF16__)
    return bf16_prefill::covers(p);
#else
    (void)p;
    return false;
#endif
}

// Runs fn(Kernel{}) with the call's kernel policy (gemm_decode_kernel takes its dtypes).
template <class Fn>
void with_kernel(const AttentionParams& p, Fn&& fn) {
#if defined(__AVX512BF16__)
    if (takes_pair_kernel(p)) return fn(static_cast<bf16_prefill::Bf16Kernel*>(nullptr));
#endif
    with_q_kv_types<true>(p, [&](auto tq, auto tkv) {
        using TQ = typename decltype(tq)::type;
        using T = typename decltype(tkv)::type;
        if constexpr (std::is_same<T, float>::value || std::is_same<T, bf16_t>::value ||
                      std::is_same<T, f16_t>::value)
            fn(static_cast<simd::WidenKernel<TQ, T>*>(nullptr));
        else
            unreachable_dtype("K/V (gemm decode)", p.kv_dtype);
    });
}

void chunk_any(const AttentionParams& p, const DecodeTask& task, float* ws, float* acc, float* m, float* l) {
    with_kernel(p, [&](auto kernel) { chunk<std::remove_pointer_t<decltype(kernel)>>(p, task, ws, acc, m, l); });
}
int64_t workspace_elems(const AttentionParams& p) {
    int64_t n = 0;
    with_kernel(p, [&](auto kernel) { n = workspace_elems_of<std::remove_pointer_t<decltype(kernel)>>(p); });
    return n;
}

// KernelTable::gemm_decode_kernel: this kernel for a call it covers, else {nullptr} (the
// tier's decode_kernel runs it). A latent cache from one vector of rows; separate K and V
// from kMinGqaRows.
DecodeKernel gemm_decode_kernel(const AttentionParams& p) {
    const bool dtypes = p.dtype != DType::kF64 &&
                        (p.kv_dtype == DType::kF32 || p.kv_dtype == DType::kBF16 ||
                         p.kv_dtype == DType::kF16);
    const bool latent = kv_is_latent(p);
    if (!dtypes || p.alibi_slopes || p.mask || decode_rows(p) < (latent ? kMinRows : kMinGqaRows))
        return {KernelId::kNone, nullptr};
    DecodeKernel kernel{latent ? KernelId::kLatentDecode : KernelId::kGemmDecode, chunk_any};
    kernel.chunk_keys = kChunkKeys;
    kernel.workspace_elems = workspace_elems;
    kernel.compute_shaped = true;
    kernel.reads_index = true;
    return kernel;
}

}  // namespace gemm_decode

// The prefill's micro-tile: Bq query rows x kRows keys; the kernel policy's products.
struct GemmDecodePolicy {
    static KernelPolicy of(const AttentionParams& p) {
        const Product product = gemm_decode::takes_pair_kernel(p) ? Product::kBf16Pairs : kVfmaProduct;
        return {simd::Bq, simd::kRows, product, product};
    }
};
template <> struct PolicyOf<KernelId::kGemmDecode> : GemmDecodePolicy {};
template <> struct PolicyOf<KernelId::kLatentDecode> : GemmDecodePolicy {};
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
