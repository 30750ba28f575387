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
//   * the queries are staged transposed by blocks of NV x W rows, so one vector holds W rows'
//     u-th units (a unit: one float32, or a pair of bfloat16 values); the scores of a
//     register block of (NV x W rows) x NK keys are NV x NK accumulators, each step one
//     vector load per row vector and one broadcast per key unit, units in blocks of
//     kUnitBlock over all the tile's keys (the block's queries stay in L1);
//   * the online softmax (simd::online_softmax, the prefill's too) runs W rows at a time
//     (lanes over rows: no horizontal reductions); the probabilities stay in the same
//     [key][row] layout;
//   * P.V is the same shape: accumulators over (NK value columns) x (NV x W rows), kept
//     transposed (acct[dv][r]) across the chunk, each step one vector of probabilities and
//     one broadcast of a V unit -- for a latent cache the K row's prefix, so each latent
//     row is read from memory once for both products.
// The products and the way a 64-key tile's rows reach them are a tile policy (FmaDot with
// WidenedTile: float32 rows in place, 16-bit rows widened; PairDot with PairTile on AVX512_BF16:
// vdpbf16ps over bfloat16 rows in place and V rows interleaved into key pairs).
// Same task and result contract as decode_loop (decode_attention.inl): one chunk of keys of
// one (batch, kv head), all its query rows; the shared merge finishes (sinks, lse, out).
// The score options it takes: scale, causal, window, softcap (ALiBi and masks keep the
// bandwidth-shaped kernels: gemm_decode_kernel declines them). float32 accumulation; K/V
// float32, bfloat16 or float16 (widened exactly), q float32 or 16 bits (widened exactly);
// bfloat16 q over bfloat16 K/V by the pair tile (probabilities rounded to bfloat16).
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

// ---- The two products as a policy over 32-bit units: the value one lane holds per
// multiply-add step. FmaDot: one float32, one FMA. PairDot (AVX512_BF16): two bfloat16 values,
// one vdpbf16ps adding both products (twice the multiply-adds per instruction, and no
// widening pass: bfloat16 K rows are read where they lie).
struct FmaDot {
    using Unit = float;
    using Operand = Vec;
    static Vec load(const float* p) { return simd::vload(p); }
    static Vec bcast(const float* p) { return simd::vbcast(p); }
    static Vec madd(Vec acc, Vec a, Vec b) { return simd::vfma(a, b, acc); }
};
#if defined(__AVX512BF16__)
struct PairDot {
    using Unit = uint32_t;
    using Operand = simd::Pairs;
    static simd::Pairs load(const uint32_t* p) { return simd::pairs_load(p); }
    static simd::Pairs bcast(const uint32_t* p) { return simd::pairs_bcast(p); }
    static Vec madd(Vec acc, simd::Pairs a, simd::Pairs b) { return simd::vdot_pairs(acc, a, b); }
};
#endif

// st[j * rp + r] (+)= sum over units u in [u0, u1) of qb[u * NV * W + r] . krows[j][u] for the
// NV * W rows of the query block qb (its rows' u-th units contiguous) and keys j < nk
// (nk <= NK; missing keys repeat the last row and are not stored); u0 == 0 stores, later
// blocks add. The callers run u in blocks of kUnitBlock over all the tile's keys: the block's
// queries (kUnitBlock x NV * W units, 8 KiB) stay in L1 across the key blocks, and the sum of
// each score grows a rounding error with kUnitBlock + D / kUnitBlock terms rather than with D.
constexpr int64_t kUnitBlock = 64;
// With 32 vector registers score_block and value_block are kept out of line: inlined into
// chunk(), the compiler spilled their operands to the stack (bfloat16 MLA 0.71-0.73x). With 16
// (AVX2) out of line measured 0.57x (HISTORY 46): inlined there.
#if ATTNFAST_SIMD_BYTES >= 64
#define ATTNFAST_BLOCK_LINKAGE __attribute__((noinline))
#else
#define ATTNFAST_BLOCK_LINKAGE inline
#endif
template <class Dot, int NV, int NK>
ATTNFAST_BLOCK_LINKAGE void score_block(const typename Dot::Unit* __restrict qb, int64_t rp,
                        const typename Dot::Unit* const* krows, int64_t nk, int64_t u0, int64_t u1,
                        float* __restrict st) {
    using Unit = typename Dot::Unit;
    const Unit* kp[NK];
    for (int j = 0; j < NK; ++j) kp[j] = krows[j < nk ? j : nk - 1];
    {
        Vec acc[NK][NV];
#pragma GCC unroll 16
        for (int j = 0; j < NK; ++j)
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[j][v] = simd::vzero();
        for (int64_t u = u0; u < u1; ++u) {
            typename Dot::Operand qv[NV];
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) qv[v] = Dot::load(qb + u * (NV * W) + v * W);
#pragma GCC unroll 16
            for (int j = 0; j < NK; ++j) {
                const typename Dot::Operand kb = Dot::bcast(kp[j] + u);
#pragma GCC unroll 4
                for (int v = 0; v < NV; ++v) acc[j][v] = Dot::madd(acc[j][v], qv[v], kb);
            }
        }
        for (int j = 0; j < NK; ++j)
            if (j < nk)
                for (int v = 0; v < NV; ++v) {
                    float* out = st + j * rp + v * W;
                    simd::vstore(out, u0 == 0 ? acc[j][v] : simd::vadd(simd::vload(out), acc[j][v]));
                }
    }
}

// acct[(dv0 + i) * rp + r] = acct[..] * corr[r] + sum_j pt[j * rp + r] . vrows[j][dv0 + i]
// for the NV * W rows at acct / pt / corr, `steps` units of keys j (a key, or a pair of keys)
// and value columns i < nd (nd <= NK).
template <class Dot, int NV, int NK>
ATTNFAST_BLOCK_LINKAGE void value_block(float* __restrict acct, int64_t rp, const typename Dot::Unit* __restrict pt,
                        const float* __restrict corr, const typename Dot::Unit* const* vrows,
                        int64_t steps, int64_t dv0, int64_t nd) {
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
    for (int64_t j = 0; j < steps; ++j) {
        typename Dot::Operand pv[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) pv[v] = Dot::load(pt + j * rp + v * W);
        const typename Dot::Unit* vr = vrows[j];
#pragma GCC unroll 16
        for (int i = 0; i < NK; ++i) {
            const typename Dot::Operand vb = Dot::bcast(vr + col[i]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[i][v] = Dot::madd(acc[i][v], pv[v], vb);
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

// ---- How a tile's rows reach the products, per (q, K/V) storage: the tile policy.
//   Dot            the products (above)
//   kScaledQuery   the staged queries carry scale x log2 e; else the softmax scales the scores
//   query_units    units of a staged query row; stage: unit u of a query row
//   rows           the tile's K rows and V rows as the products read them (krows: one per
//                  key; vrows: one per value step), from the tile buffer `buf` as needed
//   value_steps    value steps of a tile of nt keys
//   weights        the tile's probabilities (st, [key][row] floats) as P.V reads them
// WidenedTile: float32 FMA; float32 rows read in place (measured on Zen 3, one thread: MLA at
// 8k keys 3-9 % faster than with a copy, GQA with 32-64 rows the same within noise), 16-bit
// rows widened to float32 in one sequential pass.
template <class TQ, class T>
struct WidenedTile {
    using Dot = FmaDot;
    static constexpr bool kScaledQuery = true;
    static int64_t query_units(int64_t D) { return D; }
    static float stage(const TQ* qrow, int64_t u, int64_t, float scale) { return widen(qrow[u]) * scale; }
    static int64_t value_steps(int64_t nt) { return nt; }
    static void rows(const AttentionParams& p, const TaskRows<T>& k, const TaskRows<T>& v,
                     int64_t first, int64_t nt, float* buf, const float** krows, const float** vrows) {
        const bool latent = kv_is_latent(p);
        const int64_t kws = widened_stride(p);
        float* vw = latent ? buf : buf + kTileKeys * kws;
        const int64_t vws = latent ? kws : widened_v_stride(p);
        for (int64_t j = 0; j < nt; ++j) {
            if constexpr (sizeof(T) == sizeof(float)) {
                krows[j] = reinterpret_cast<const float*>(k.at(first + j));
                vrows[j] = latent ? krows[j] : reinterpret_cast<const float*>(v.at(first + j));
            } else {
                widen_row(k.at(first + j), p.head_dim, buf + j * kws);
                krows[j] = buf + j * kws;
                if (!latent) widen_row(v.at(first + j), p.head_dim_v, vw + j * vws);
                vrows[j] = vw + j * vws;
            }
        }
    }
    static const float* weights(const float* st, int64_t, int64_t, float*) { return st; }
};

#if defined(__AVX512BF16__)
// PairTile: bfloat16 q over bfloat16 K/V (a model run in bfloat16; even D), vdpbf16ps for
// both products, as bf16_decode.inl does for few rows:
//   * q . k: q staged as it is (exact; the softmax scales each float32 score), K rows read in
//     place as pairs of dimensions;
//   * p . v: the probabilities rounded to bfloat16 (relative error <= 2^-9 per weight; the row
//     sum l stays the float32 sum of the unrounded ones, as in FlashAttention), paired over
//     keys (j, j + 1); the tile's V rows interleaved into the same key pairs once per tile,
//     for every query row (a latent cache's from its K rows).
struct PairTile {
    using Dot = PairDot;
    static constexpr bool kScaledQuery = false;
    static int64_t query_units(int64_t D) { return (D + 1) / 2; }
    static uint32_t stage(const bf16_t* qrow, int64_t u, int64_t D, float) {
        const uint32_t hi = 2 * u + 1 < D ? qrow[2 * u + 1].bits : 0;
        return static_cast<uint32_t>(qrow[2 * u].bits) | hi << 16;
    }
    static int64_t value_steps(int64_t nt) { return (nt + 1) / 2; }
    static void rows(const AttentionParams& p, const TaskRows<bf16_t>& k, const TaskRows<bf16_t>& v,
                     int64_t first, int64_t nt, float* buf, const uint32_t** krows, const uint32_t** vrows) {
        const int64_t Dv = p.head_dim_v, vs = round_up(Dv, W);
        uint32_t* pairs = reinterpret_cast<uint32_t*>(buf);
        for (int64_t j = 0; j < nt; ++j) krows[j] = reinterpret_cast<const uint32_t*>(k.at(first + j));
        for (int64_t j = 0; j < nt; j += 2) {
            const bf16_t* a = v.at(first + j);
            const bf16_t* b = j + 1 < nt ? v.at(first + j + 1) : nullptr;
            uint32_t* out = pairs + j / 2 * vs;
            int64_t c = 0;
            if (b)
                for (; c + W <= Dv; c += W) simd::pairs_interleave(out + c, a + c, b + c);
            for (; c < Dv; ++c) out[c] = static_cast<uint32_t>(a[c].bits) | (b ? static_cast<uint32_t>(b[c].bits) << 16 : 0u);
            vrows[j / 2] = out;
        }
    }
    static const uint32_t* weights(const float* st, int64_t nt, int64_t rp, float* buf) {
        uint32_t* packed = reinterpret_cast<uint32_t*>(buf);
        for (int64_t j = 0; j < nt; j += 2)
            for (int64_t r = 0; r < rp; r += W)
                simd::pairs_store_rounded(packed + j / 2 * rp + r, simd::vload(st + j * rp + r),
                                          j + 1 < nt ? simd::vload(st + (j + 1) * rp + r) : simd::vzero());
        return packed;
    }
};
#endif

// Workspace floats per thread (see chunk() for the layout), plus a vector for alignment: the
// float32 tile's sizes, which bound the pair tile's.
int64_t workspace_elems(const AttentionParams& p) {
    const int64_t rp = padded_rows(p);
    const int64_t merge = p.head_dim_v;
    const int64_t task = rp * (p.head_dim + p.head_dim_v + kTileKeys + kTileKeys / 2 + 5) +
                         kTileKeys * (widened_stride(p) + widened_v_stride(p)) + 2 * W;
    return task > merge ? task : merge;
}

template <class TQ, class T, class Tile>
void chunk(const AttentionParams& p, const DecodeTask& task, float* workspace, float* acc,
           float* m_out, float* l_out) {
    using Dot = typename Tile::Dot;
    using Unit = typename Dot::Unit;
    static_assert(sizeof(Unit) == sizeof(float), "the workspace holds 32-bit units");
    const int64_t D = p.head_dim, Dv = p.head_dim_v, tq = p.seqlen_q;
    const int64_t U = Tile::query_units(D);
    const int64_t group = p.heads / p.kv_heads;
    const int64_t rows = group * tq;
    const int64_t rp = padded_rows(p);
    const int64_t keys = task.key_end - task.key_begin;
    const int64_t kb = task.key_begin;

    // Workspace, each part a whole number of vectors from a vector-aligned start:
    // qt (U x rp units) the staged queries, transposed by blocks of rows (the rows' u-th units
    // contiguous within a block: see query_at); acct (Dv x rp) accumulators, transposed;
    // st (tile x rp) scores, then probabilities; pk (tile / 2 x rp) the probabilities as a
    // pair tile packs them; m, l, corr (rp each) running max, running sum, this tile's
    // rescaling; lo, hi (rp int32 each) each row's chunk-relative visible keys; buf the tile
    // policy's rows (widened or interleaved).
    float* base = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(workspace) + W * sizeof(float) - 1) & ~(uintptr_t)(W * sizeof(float) - 1));
    Unit* qt = reinterpret_cast<Unit*>(base);
    float* acct = base + U * rp;
    float* st = acct + Dv * rp;
    float* pk = st + kTileKeys * rp;
    float* m = pk + kTileKeys / 2 * rp;
    float* l = m + rp;
    float* corr = l + rp;
    int32_t* lo = reinterpret_cast<int32_t*>(corr + rp);
    int32_t* hi = lo + rp;
    float* buf = reinterpret_cast<float*>(hi + rp);
    const Unit* krows[kTileKeys];
    const Unit* vrows[kTileKeys];

    const TaskRows<T> k{key_rows<T>(p, p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride,
                                    task.batch, task.kv_head), task.rows};
    const TaskRows<T> v{key_rows<T>(p, p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride,
                                    task.batch, task.kv_head), task.rows};
    // The chunk's first tile of rows starts towards the cache while the queries are staged
    // (the loop below prefetches each next tile; rows of an indexed task, or of a task that
    // starts cold, would otherwise be waited for).
    const bool latent = kv_is_latent(p);
    const int64_t row_lines = (D * static_cast<int64_t>(sizeof(T)) + 63) / 64;
    const int64_t v_row_lines = latent ? 0 : (Dv * static_cast<int64_t>(sizeof(T)) + 63) / 64;
    for (int64_t j = 0; j < (keys < kTileKeys ? keys : kTileKeys); ++j) {
        const char* kr = reinterpret_cast<const char*>(k.at(kb + j));
        const char* vr = reinterpret_cast<const char*>(v.at(kb + j));
        for (int64_t x = 0; x < row_lines; ++x) __builtin_prefetch(kr + 64 * x, 0, 2);
        for (int64_t x = 0; x < v_row_lines; ++x) __builtin_prefetch(vr + 64 * x, 0, 2);
    }
    const TQ* q = static_cast<const TQ*>(p.q) + task.batch * p.q_batch_stride;
    const float scale = static_cast<float>(p.scale * kLog2e);  // scores in base 2
    // Rows [r, r + NV * W) (or a last block of W) form one query block at qt + r * U, the
    // unit (u, r + x) at u * width + x: the score loops read it sequentially.
    const int64_t full_rows = rp / (kNV * W) * (kNV * W);
    auto query_at = [&](int64_t r, int64_t u) -> Unit& {
        const int64_t width = r < full_rows ? kNV * W : W;
        const int64_t r0 = r < full_rows ? r / (kNV * W) * (kNV * W) : r / W * W;
        return qt[r0 * U + u * width + (r - r0)];
    };
    int64_t used_lo = keys, used_hi = 0;
    for (int64_t r = 0; r < rp; ++r) {
        if (r < rows) {
            const int64_t head = task.kv_head * group + r / tq, pos = r % tq;
            const TQ* qrow = q + head * p.q_head_stride + pos * p.q_row_stride;
            for (int64_t u = 0; u < U; ++u) query_at(r, u) = Tile::stage(qrow, u, D, scale);
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
            for (int64_t u = 0; u < U; ++u) query_at(r, u) = 0;
            lo[r] = hi[r] = 0;
        }
        m[r] = -__builtin_inff();
        l[r] = 0;
    }
    for (int64_t x = 0; x < Dv * rp; ++x) acct[x] = 0;

    const bool capped = p.softcap > 0;
    // softcap in base 2 (RowOptions): c log2(e) tanh(x / (c log2 e))
    const Vec cap = simd::vset(static_cast<float>(p.softcap * kLog2e));
    const Vec inv_cap = simd::vset(capped ? static_cast<float>(1.0 / (p.softcap * kLog2e)) : 0.0f);
    const Vec score_scale = simd::vset(scale);

    // Score-block calls per tile (full tiles).
    const int64_t score_calls = (full_rows / (kNV * W) + (rp - full_rows) / W) *
                                ((U + kUnitBlock - 1) / kUnitBlock) * ((kTileKeys + kNK - 1) / kNK);
    for (int64_t t0 = used_lo; t0 < used_hi; t0 += kTileKeys) {
        const int64_t nt = used_hi - t0 < kTileKeys ? used_hi - t0 : kTileKeys;
        Tile::rows(p, k, v, kb + t0, nt, buf, krows, vrows);
        // The next tile's K and V rows, prefetched into L2 a few lines per score block while
        // this tile computes, so that its reads do not wait for memory (hardware prefetchers
        // stop at page boundaries and do not run ahead by a whole tile).
        const int64_t next_t0 = t0 + kTileKeys;
        const int64_t next_keys = next_t0 < used_hi ? (used_hi - next_t0 < kTileKeys ? used_hi - next_t0 : kTileKeys) : 0;
        const int64_t next_k_lines = next_keys * row_lines;
        const int64_t next_lines = next_k_lines + next_keys * v_row_lines;
        const int64_t lines_per_call = (next_lines + score_calls - 1) / score_calls;
        int64_t next_line = 0;
        // Scores of every row against the tile's keys: per query block, units in blocks of
        // kUnitBlock, each over all the keys.
        for (int64_t r = 0; r < rp; r += r < full_rows ? kNV * W : W)
            for (int64_t u0 = 0; u0 < U; u0 += kUnitBlock) {
                const int64_t u1 = u0 + kUnitBlock < U ? u0 + kUnitBlock : U;
                for (int64_t j0 = 0; j0 < nt; j0 += kNK) {
                    const int64_t nk = nt - j0 < kNK ? nt - j0 : kNK;
                    for (int64_t x = 0; x < lines_per_call && next_line < next_lines; ++x, ++next_line) {
                        const int64_t vl = next_line - next_k_lines;
                        __builtin_prefetch(vl < 0 ? reinterpret_cast<const char*>(k.at(kb + next_t0 + next_line / row_lines)) +
                                                        next_line % row_lines * 64
                                                  : reinterpret_cast<const char*>(v.at(kb + next_t0 + vl / v_row_lines)) +
                                                        vl % v_row_lines * 64, 0, 2);
                    }
                    if (r < full_rows)
                        score_block<Dot, kNV, kNK>(qt + r * U, rp, krows + j0, nk, u0, u1, st + j0 * rp + r);
                    else
                        score_block<Dot, 1, kNK>(qt + r * U, rp, krows + j0, nk, u0, u1, st + j0 * rp + r);
                }
            }
        // Online softmax (base 2), W rows at a time.
        for (int64_t r = 0; r < rp; r += W) {
            Vec bmax = simd::vset(-__builtin_inff());
            // A raw -inf becomes NaN first, as in the prefill (a NaN weight makes l NaN, and
            // decode_merge then the row). Every row of the vector sees every key of the
            // tile (the interior of a chunk): no visibility masks, the same values.
            bool whole = true;
            for (int x = 0; x < W; ++x) whole = whole && lo[r + x] <= t0 && hi[r + x] >= t0 + nt;
            for (int64_t j = 0; j < nt; ++j) {
                Vec s = simd::neg_inf_to_nan(simd::vload(st + j * rp + r));
                if (!Tile::kScaledQuery) s = simd::vmul(s, score_scale);
                if (capped) s = simd::softcap(s, cap, inv_cap);
                if (!whole) s = simd::keep_or_neg_inf(simd::key_visible(lo + r, hi + r, static_cast<int32_t>(t0 + j)), s);
                simd::vstore(st + j * rp + r, s);
                bmax = simd::vmax(bmax, s);
            }
            Vec c;
            simd::online_softmax<1>(st + r, rp, nt, m + r, l + r, &bmax, &c);
            simd::vstore(corr + r, c);
        }
        // P.V: a latent cache's V rows are the K rows' first Dv elements (already in cache).
        const Unit* pt = Tile::weights(st, nt, rp, pk);
        const int64_t steps = Tile::value_steps(nt);
        for (int64_t r = 0; r < full_rows; r += kNV * W)
            for (int64_t d0 = 0; d0 < Dv; d0 += kNK)
                value_block<Dot, kNV, kNK>(acct + r, rp, pt + r, corr + r, vrows, steps, d0,
                                           Dv - d0 < kNK ? Dv - d0 : kNK);
        for (int64_t r = full_rows; r < rp; r += W)
            for (int64_t d0 = 0; d0 < Dv; d0 += kNK)
                value_block<Dot, 1, kNK>(acct + r, rp, pt + r, corr + r, vrows, steps, d0,
                                         Dv - d0 < kNK ? Dv - d0 : kNK);
    }
    // The chunk's partial result in the merge's layout: rows x Dv, max and sum per row; the
    // accumulators transposed in blocks of kChunk x kChunk (a scalar copy with acct's stride
    // measured ~9 % of an MLA task of 256 keys).
    constexpr int64_t C = simd::kChunk;
    for (int64_t r0 = 0; r0 < rows; r0 += C) {
        int64_t d0 = 0;
        for (; d0 + C <= Dv; d0 += C) {
            simd::Chunk block[C];
            for (int64_t i = 0; i < C; ++i) block[i] = simd::chunk_load(acct + (d0 + i) * rp + r0);
            simd::transpose_chunks(block);
            for (int64_t j = 0; j < C && r0 + j < rows; ++j) simd::chunk_storeu(acc + (r0 + j) * Dv + d0, block[j]);
        }
        for (int64_t r = r0; r < r0 + C && r < rows; ++r)
            for (int64_t d = d0; d < Dv; ++d) acc[r * Dv + d] = acct[d * rp + r];
    }
    for (int64_t r = 0; r < rows; ++r) {
        m_out[r] = m[r];
        l_out[r] = l[r];
    }
}

// Whether the pair tile (vdpbf16ps) runs a call: bfloat16 q over a bfloat16 cache, even D.
inline bool takes_pair_tile(const AttentionParams& p) {
#if defined(__AVX512BF16__)
    return p.dtype == DType::kBF16 && p.kv_dtype == DType::kBF16 && p.head_dim % 2 == 0;
#else
    (void)p;
    return false;
#endif
}

void chunk_any(const AttentionParams& p, const DecodeTask& task, float* ws, float* acc,
               float* m, float* l) {
#if defined(__AVX512BF16__)
    if (takes_pair_tile(p)) return chunk<bf16_t, bf16_t, PairTile>(p, task, ws, acc, m, l);
#endif
    with_q_kv_types<true>(p, [&](auto tq, auto tkv) {
        using TQ = typename decltype(tq)::type;
        using T = typename decltype(tkv)::type;
        if constexpr (std::is_same<T, float>::value || std::is_same<T, bf16_t>::value ||
                      std::is_same<T, f16_t>::value)  // (gemm_decode_kernel takes these three)
            chunk<TQ, T, WidenedTile<TQ, T>>(p, task, ws, acc, m, l);
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
    DecodeKernel kernel{latent ? KernelId::kLatentDecode : KernelId::kGemmDecode, chunk_any};
    kernel.chunk_keys = kChunkKeys;
    kernel.workspace_elems = workspace_elems;
    kernel.compute_shaped = true;
    kernel.reads_index = true;
    return kernel;
}

}  // namespace gemm_decode

// The score register block: kNV x W query rows x kNK keys; the tile policy's products.
struct GemmDecodePolicy {
    static KernelPolicy of(const AttentionParams& p) {
        const Product product =
            gemm_decode::takes_pair_tile(p) ? Product::kBf16Pairs : kVfmaProduct;
        return {gemm_decode::kNV * simd::W, gemm_decode::kNK, product, product};
    }
};
template <> struct PolicyOf<KernelId::kGemmDecode> : GemmDecodePolicy {};
template <> struct PolicyOf<KernelId::kLatentDecode> : GemmDecodePolicy {};
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
