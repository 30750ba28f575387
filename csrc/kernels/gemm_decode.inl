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
// This kernel runs the two products as small GEMMs with the query rows in the vector lanes:
//   * the scaled queries are staged transposed by blocks of NV x W rows, so one vector holds
//     W rows' d-th elements; each 64-key tile's K rows (and V rows, unless latent) are read
//     where they lie (float32) or widened to float32 in one pass (16-bit); the scores of a
//     register block of (NV x W rows) x NK keys are NV x NK accumulators, each step one
//     vector load per row vector and one broadcast per key element, d in blocks of kDBlock
//     over all the tile's keys (the block's queries stay in L1);
//   * the online softmax runs W rows at a time (lanes over rows: no horizontal reductions),
//     the probabilities stay in the same [key][row] layout;
//   * P.V is the same shape: accumulators over (NK value columns) x (NV x W rows), kept
//     transposed (acct[dv][r]) across the chunk, each step one vector of probabilities and
//     one broadcast of a V element -- for a latent cache the K row's prefix, so each latent
//     row is read from memory once for both products.
// Same task and result contract as decode_loop (decode_attention.inl): one chunk of keys of
// one (batch, kv head), all its query rows; the shared merge finishes (sinks, lse, out).
// The score options it takes: scale, causal, window, softcap (ALiBi and masks keep the
// bandwidth-shaped kernels: gemm_decode_kernel declines them). float32 arithmetic; K/V
// float32, bfloat16 or float16 (widened exactly), q float32 or 16 bits (widened exactly).
// Rounding depends only on the shapes (never the thread count).
#pragma once
#if !defined(__SSE2__) && !defined(__aarch64__)
#error "gemm_decode.inl needs the SIMD layer of an x86-64 tier or AArch64 NEON"
#endif
#include "../simd/simd.hpp"
#include "decode_attention.inl"

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace gemm_decode {

using simd::Vec;
using simd::W;

// Keys per split-KV chunk: a whole number of tiles, large enough that the chunks' partial
// accumulators (rows x Dv floats each) and their merge stay small next to the arithmetic,
// and fixed (never derived from the thread count: the same bits for any count).
constexpr int64_t kChunkKeys = 2048;
// Keys scored, softmaxed and accumulated at a time: a tile's K rows (64 x 576 x 4 bytes)
// stay in L2 between the score pass and the P.V pass.
constexpr int64_t kTileKeys = 64;
// Register blocks: NV row vectors x NK keys (scores) or value columns (P.V); 16
// accumulators with 32 registers (AVX-512, NEON), 12 with 16 (AVX2).
constexpr int kNV = 2;
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int kNK = 8;
#else
constexpr int kNK = 6;
#endif
// Fewest query rows per KV head for which a latent call takes this kernel: one whole vector.
constexpr int64_t kMinRows = W;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Rows padded to whole vectors.
inline int64_t padded_rows(const AttentionParams& p) { return round_up(decode_rows(p), W); }
// Elements of a widened K row in the tile buffer.
inline int64_t widened_stride(const AttentionParams& p) { return round_up(p.head_dim, W); }
// Elements of a widened V row in the tile buffer: none when V is K's prefix (latent).
inline int64_t widened_v_stride(const AttentionParams& p) {
    return kv_is_latent(p) ? 0 : round_up(p.head_dim_v, W);
}

// Workspace floats per thread (see chunk() for the layout), plus a vector for alignment.
int64_t workspace_elems(const AttentionParams& p) {
    const int64_t rp = padded_rows(p);
    const int64_t merge = p.head_dim_v;
    const int64_t task = rp * (p.head_dim + p.head_dim_v + kTileKeys + 5) +
                         kTileKeys * (widened_stride(p) + widened_v_stride(p)) + 2 * W;
    return task > merge ? task : merge;
}

// st[j * rp + r] (+)= sum over d in [d0, d1) of qb[d * NV * W + r] * krows[j][d] for the
// NV * W rows of the query block qb (its rows' d-th elements contiguous) and keys j < nk
// (nk <= NK; missing keys repeat the last row and are not stored); d0 == 0 stores, later
// blocks add. The callers run d in blocks of kDBlock over all the tile's keys: the block's
// queries (kDBlock x NV * W floats, 8 KiB) stay in L1 across the key blocks, and the sum of
// each score grows a rounding error with kDBlock + D / kDBlock terms rather than with D.
constexpr int64_t kDBlock = 64;
template <int NV, int NK>
inline void score_block(const float* __restrict qb, int64_t rp, const float* const* krows,
                        int64_t nk, int64_t d0, int64_t d1, float* __restrict st) {
    const float* kp[NK];
    for (int j = 0; j < NK; ++j) kp[j] = krows[j < nk ? j : nk - 1];
    {
        Vec acc[NK][NV];
#pragma GCC unroll 16
        for (int j = 0; j < NK; ++j)
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[j][v] = simd::vzero();
        for (int64_t d = d0; d < d1; ++d) {
            Vec qv[NV];
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) qv[v] = simd::vload(qb + d * (NV * W) + v * W);
#pragma GCC unroll 16
            for (int j = 0; j < NK; ++j) {
                const Vec kb = simd::vbcast(kp[j] + d);
#pragma GCC unroll 4
                for (int v = 0; v < NV; ++v) acc[j][v] = simd::vfma(qv[v], kb, acc[j][v]);
            }
        }
        for (int j = 0; j < NK; ++j)
            if (j < nk)
                for (int v = 0; v < NV; ++v) {
                    float* out = st + j * rp + v * W;
                    simd::vstore(out, d0 == 0 ? acc[j][v] : simd::vadd(simd::vload(out), acc[j][v]));
                }
    }
}

// acct[(dv0 + i) * rp + r] = acct[..] * corr[r] + sum_j pt[j * rp + r] * vrows[j][dv0 + i]
// for the NV * W rows at acct / pt / corr and value columns i < nd (nd <= NK).
template <int NV, int NK>
inline void value_block(float* __restrict acct, int64_t rp, const float* __restrict pt,
                        const float* __restrict corr, const float* const* vrows,
                        int64_t keys, int64_t dv0, int64_t nd) {
    int64_t col[NK];
    for (int i = 0; i < NK; ++i) col[i] = dv0 + (i < nd ? i : nd - 1);
    // The next call's accumulators (columns dv0 + NK..): acct (Dv x rp floats) outgrows L1
    // and, with the tile's K rows and queries, a 512 KiB L2, and each call's loads of it
    // otherwise stall the call's first multiply-adds (~9 % of a step on Zen 3). A prefetch
    // past the last column reads the workspace that follows: harmless.
    for (int i = 0; i < NK; ++i)
        for (int v = 0; v < NV * W; v += 64 / static_cast<int>(sizeof(float)))
            __builtin_prefetch(acct + (dv0 + NK + i) * rp + v, 1, 3);
    Vec acc[NK][NV];
    Vec cv[NV];
    for (int v = 0; v < NV; ++v) cv[v] = simd::vload(corr + v * W);
#pragma GCC unroll 16
    for (int i = 0; i < NK; ++i)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[i][v] = simd::vmul(simd::vload(acct + col[i] * rp + v * W), cv[v]);
    for (int64_t j = 0; j < keys; ++j) {
        Vec pv[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) pv[v] = simd::vload(pt + j * rp + v * W);
        const float* vr = vrows[j];
#pragma GCC unroll 16
        for (int i = 0; i < NK; ++i) {
            const Vec vb = simd::vbcast(vr + col[i]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[i][v] = simd::vfma(pv[v], vb, acc[i][v]);
        }
    }
    for (int i = 0; i < NK; ++i)
        if (i < nd)
            for (int v = 0; v < NV; ++v) simd::vstore(acct + col[i] * rp + v * W, acc[i][v]);
}

// Widens `n` stored elements to float32 (exactly).
template <class T>
inline void widen_row(const T* __restrict src, int64_t n, float* __restrict dst) {
    int64_t d = 0;
    for (; d + W <= n; d += W) simd::vstore(dst + d, simd::vwiden(src + d));
    for (; d < n; ++d) dst[d] = widen(src[d]);
}

template <class TQ, class T>
void chunk(const AttentionParams& p, const DecodeTask& task, float* workspace, float* acc,
           float* m_out, float* l_out) {
    const int64_t D = p.head_dim, Dv = p.head_dim_v, tq = p.seqlen_q;
    const int64_t group = p.heads / p.kv_heads;
    const int64_t rows = group * tq;
    const int64_t rp = padded_rows(p);
    const int64_t keys = task.key_end - task.key_begin;
    const int64_t kb = task.key_begin;

    // Workspace, each part a whole number of vectors from a vector-aligned start:
    // qt (D x rp) queries times scale log2(e), transposed by blocks of rows (the rows' d-th elements
    // contiguous within a block: see query_block); acct (Dv x rp) accumulators, transposed;
    // st (tile x rp) scores, then probabilities; m, l, corr (rp each) running max, running
    // sum, this tile's rescaling; lo, hi (rp int32 each) each row's chunk-relative visible
    // keys; kw (tile x widened_stride) a 16-bit cache's tile of K rows, widened to float32.
    float* base = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(workspace) + W * sizeof(float) - 1) & ~(uintptr_t)(W * sizeof(float) - 1));
    float* qt = base;
    float* acct = qt + D * rp;
    float* st = acct + Dv * rp;
    float* m = st + kTileKeys * rp;
    float* l = m + rp;
    float* corr = l + rp;
    int32_t* lo = reinterpret_cast<int32_t*>(corr + rp);
    int32_t* hi = lo + rp;
    float* kw = reinterpret_cast<float*>(hi + rp);
    const int64_t kws = widened_stride(p);
    // vw (tile x widened_v_stride) the tile's V rows when V is not K's prefix.
    const bool latent = kv_is_latent(p);
    float* vw = latent ? kw : kw + kTileKeys * kws;
    const int64_t vws = latent ? kws : widened_v_stride(p);
    // The tile's K and V rows as the products read them: float32 rows where they lie in the
    // cache (contiguous or paged: the products read them by broadcasts, at any address), 16-bit
    // rows from their float32 copies in kw / vw.
    const float* krows[kTileKeys];
    const float* vrows[kTileKeys];

    const TQ* q = static_cast<const TQ*>(p.q) + task.batch * p.q_batch_stride;
    const float scale = static_cast<float>(p.scale * kLog2e);  // scores in base 2
    // Rows [r, r + NV * W) (or a last block of W) form one query block at qt + r * D, the
    // element (d, r + x) at d * width + x: the score loops read it sequentially.
    const int64_t full_rows = rp / (kNV * W) * (kNV * W);
    auto query_at = [&](int64_t r, int64_t d) -> float& {
        const int64_t width = r < full_rows ? kNV * W : W;
        const int64_t r0 = r < full_rows ? r / (kNV * W) * (kNV * W) : r / W * W;
        return qt[r0 * D + d * width + (r - r0)];
    };
    int64_t used_lo = keys, used_hi = 0;
    for (int64_t r = 0; r < rp; ++r) {
        if (r < rows) {
            const int64_t head = task.kv_head * group + r / tq, pos = r % tq;
            const TQ* qrow = q + head * p.q_head_stride + pos * p.q_row_stride;
            for (int64_t d = 0; d < D; ++d) query_at(r, d) = widen(qrow[d]) * scale;
            const KeyRange vis = visible_keys(p, pos, task.seqlen_k);
            const int64_t b = vis.begin > task.key_begin ? vis.begin : task.key_begin;
            const int64_t e = vis.end < task.key_end ? vis.end : task.key_end;
            lo[r] = static_cast<int32_t>(b - kb);
            hi[r] = static_cast<int32_t>(e > b ? e - kb : b - kb);
            if (lo[r] < hi[r]) {
                used_lo = lo[r] < used_lo ? lo[r] : used_lo;
                used_hi = hi[r] > used_hi ? hi[r] : used_hi;
            }
        } else {  // padding: sees no key
            for (int64_t d = 0; d < D; ++d) query_at(r, d) = 0;
            lo[r] = hi[r] = 0;
        }
        m[r] = -__builtin_inff();
        l[r] = 0;
    }
    for (int64_t x = 0; x < Dv * rp; ++x) acct[x] = 0;

    const KeyRows<T> k = key_rows<T>(p, p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride,
                                     task.batch, task.kv_head);
    const KeyRows<T> v = key_rows<T>(p, p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride,
                                     task.batch, task.kv_head);
    const bool capped = p.softcap > 0;
    // softcap in base 2 (RowOptions): c log2(e) tanh(x / (c log2 e))
    const Vec cap = simd::vset(static_cast<float>(p.softcap * kLog2e));
    const Vec inv_cap = simd::vset(capped ? static_cast<float>(1.0 / (p.softcap * kLog2e)) : 0.0f);

    // Cache lines of one stored K row, and score-block calls per tile (full tiles).
    const int64_t row_lines = (D * static_cast<int64_t>(sizeof(T)) + 63) / 64;
    const int64_t score_calls = (full_rows / (kNV * W) + (rp - full_rows) / W) *
                                ((D + kDBlock - 1) / kDBlock) * ((kTileKeys + kNK - 1) / kNK);
    for (int64_t t0 = used_lo; t0 < used_hi; t0 += kTileKeys) {
        const int64_t nt = used_hi - t0 < kTileKeys ? used_hi - t0 : kTileKeys;
        // The tile's rows: float32 read in place (measured on Zen 3, one thread: MLA at 8k keys
        // 3-9 % faster than with a copy, GQA with 32-64 rows the same within noise); 16-bit
        // widened to float32 in one sequential pass.
        for (int64_t j = 0; j < nt; ++j) {
            if constexpr (sizeof(T) == sizeof(float)) {
                krows[j] = reinterpret_cast<const float*>(k.at(kb + t0 + j));
                vrows[j] = latent ? krows[j] : reinterpret_cast<const float*>(v.at(kb + t0 + j));
            } else {
                widen_row(k.at(kb + t0 + j), D, kw + j * kws);
                krows[j] = kw + j * kws;
                if (!latent) widen_row(v.at(kb + t0 + j), Dv, vw + j * vws);
                vrows[j] = vw + j * vws;
            }
        }
        // The next tile's K rows, prefetched into L2 a few lines per score block while this
        // tile computes, so that its copy does not wait for memory (hardware prefetchers
        // stop at page boundaries and do not run ahead by a whole tile). (Its V rows too:
        // measured no faster for GQA on Zen 3, not kept.)
        const int64_t next_t0 = t0 + kTileKeys;
        const int64_t next_lines = next_t0 < used_hi ? (used_hi - next_t0 < kTileKeys ? used_hi - next_t0 : kTileKeys) * row_lines : 0;
        const int64_t lines_per_call = (next_lines + score_calls - 1) / score_calls;
        int64_t next_line = 0;
        // Scores of every row against the tile's keys: per query block, d in blocks of
        // kDBlock, each over all the keys.
        for (int64_t r = 0; r < rp; r += r < full_rows ? kNV * W : W)
            for (int64_t d0 = 0; d0 < D; d0 += kDBlock) {
                const int64_t d1 = d0 + kDBlock < D ? d0 + kDBlock : D;
                for (int64_t j0 = 0; j0 < nt; j0 += kNK) {
                    const int64_t nk = nt - j0 < kNK ? nt - j0 : kNK;
                    for (int64_t x = 0; x < lines_per_call && next_line < next_lines; ++x, ++next_line)
                        __builtin_prefetch(reinterpret_cast<const char*>(k.at(kb + next_t0 + next_line / row_lines)) +
                                               next_line % row_lines * 64, 0, 2);
                    if (r < full_rows)
                        score_block<kNV, kNK>(qt + r * D, rp, krows + j0, nk, d0, d1, st + j0 * rp + r);
                    else
                        score_block<1, kNK>(qt + r * D, rp, krows + j0, nk, d0, d1, st + j0 * rp + r);
                }
            }
        // Online softmax (base 2), W rows at a time.
        for (int64_t r = 0; r < rp; r += W) {
            Vec bmax = simd::vset(-__builtin_inff());
            Vec bad = simd::vzero();  // NaN in a lane that met a non-finite visible score
            for (int64_t j = 0; j < nt; ++j) {
                Vec s = simd::vload(st + j * rp + r);
                const simd::Mask keep = simd::key_visible(lo + r, hi + r, static_cast<int32_t>(t0 + j));
                bad = simd::vadd(bad, simd::select(keep, simd::vsub(s, s), simd::vzero()));
                if (capped) s = simd::vmul(cap, simd::tanh_vec(simd::vmul(s, inv_cap)));
                s = simd::keep_or_neg_inf(keep, s);
                simd::vstore(st + j * rp + r, s);
                bmax = simd::vmax(s, bmax);
            }
            const Vec m_old = simd::vload(m + r);
            const Vec m_new = simd::vadd(simd::vmax(bmax, m_old), bad);  // NaN stays NaN
            const Vec shift = simd::finite_or_zero(m_new);
            Vec sum = simd::vzero();
            for (int64_t j = 0; j < nt; ++j) {
                const Vec s = simd::vload(st + j * rp + r);
                const Vec pr = simd::exp2_neg(simd::vsub(s, shift));
                simd::vstore(st + j * rp + r, pr);
                sum = simd::vadd(sum, pr);
            }
            const Vec c = simd::exp2_neg(simd::vsub(m_old, shift));
            simd::vstore(corr + r, c);
            simd::vstore(l + r, simd::vfma(simd::vload(l + r), c, sum));
            simd::vstore(m + r, m_new);
        }
        // P.V: a latent cache's V rows are the K rows' first Dv elements (already in cache).
        for (int64_t r = 0; r < full_rows; r += kNV * W)
            for (int64_t d0 = 0; d0 < Dv; d0 += kNK)
                value_block<kNV, kNK>(acct + r, rp, st + r, corr + r, vrows, nt, d0,
                                      Dv - d0 < kNK ? Dv - d0 : kNK);
        for (int64_t r = full_rows; r < rp; r += W)
            for (int64_t d0 = 0; d0 < Dv; d0 += kNK)
                value_block<1, kNK>(acct + r, rp, st + r, corr + r, vrows, nt, d0,
                                    Dv - d0 < kNK ? Dv - d0 : kNK);
    }
    // The chunk's partial result in the merge's layout: rows x Dv, max and sum per row.
    for (int64_t r = 0; r < rows; ++r) {
        float* acc_row = acc + r * Dv;
        for (int64_t d = 0; d < Dv; ++d) acc_row[d] = acct[d * rp + r];
        m_out[r] = m[r];
        l_out[r] = l[r];
    }
}

void chunk_any(const AttentionParams& p, const DecodeTask& task, float* ws, float* acc,
               float* m, float* l) {
    with_q_kv_types<true>(p, [&](auto tq, auto tkv) {
        using T = typename decltype(tkv)::type;
        if constexpr (std::is_same<T, float>::value || std::is_same<T, bf16_t>::value ||
                      std::is_same<T, f16_t>::value)  // (gemm_decode_kernel takes these three)
            chunk<typename decltype(tq)::type, T>(p, task, ws, acc, m, l);
        else
            unreachable_dtype("K/V (gemm decode)", p.kv_dtype);
    });
}

// KernelTable::gemm_decode_kernel: this kernel for a call it covers, else {nullptr} (the
// tier's decode_kernel runs it). A latent cache from one vector of rows; separate K and V
// from kGemmDecodeMinRows (kernel_table.hpp).
DecodeKernel gemm_decode_kernel(const AttentionParams& p) {
    const bool dtypes = p.dtype != DType::kF64 &&
                        (p.kv_dtype == DType::kF32 || p.kv_dtype == DType::kBF16 ||
                         p.kv_dtype == DType::kF16);
    const bool latent = kv_is_latent(p);
    if (!dtypes || p.alibi_slopes || p.mask || decode_rows(p) < (latent ? kMinRows : kGemmDecodeMinRows))
        return {KernelId::kNone, nullptr};
#if defined(__AVX512BF16__)
    // bfloat16 q, K and V have vdpbf16ps kernels here (bf16_decode.inl, bf16_prefill.inl), at
    // twice the float32 FMA rate; this kernel has not been measured against them: they keep
    // those calls.
    if (!latent && p.dtype == DType::kBF16 && p.kv_dtype == DType::kBF16) return {KernelId::kNone, nullptr};
#endif
    DecodeKernel kernel{latent ? KernelId::kLatentDecode : KernelId::kGemmDecode, chunk_any};
    kernel.chunk_keys = kChunkKeys;
    kernel.workspace_elems = workspace_elems;
    kernel.compute_shaped = true;
    return kernel;
}

}  // namespace gemm_decode
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
