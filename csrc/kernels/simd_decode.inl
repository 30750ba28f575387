// Hand-written decode policies for the SIMD tiers (AVX-512: W = 16 lanes; AVX2+FMA: W = 8;
// NEON: W = 4; SSE2, the generic tier on x86-64: W = 4, multiply then add for each FMA),
// written on the SIMD layer (csrc/simd/):
// float32 arithmetic over K/V stored as float32, bfloat16, float16, int8, float8 e4m3fn (one
// float32 scale per row) or int4 blocks, q as float32 or 16 bits. The loop, the online softmax
// and the task contract are decode_attention.inl's (decode_loop, softmax_block); this file gives
// it WidenPath, the arithmetic, and VectorSoftmax, the vector max / exp passes and score
// options (RowScoreOptions) it runs with. Included by every tier's kernels/isa_*.cpp but the
// aarch64 build's generic tier; shapes it does not cover (D or Dv not a multiple of W) and
// that tier run decode_loop with the template policy (TemplatePath).
//
// 16-bit, int8, float8 and int4 K/V are widened to float32 in registers as each vector is
// loaded (simd::vwiden: F16C's vcvtph2ps or NEON's fcvtl, a 16-bit shift for bfloat16,
// vpmovsxbd + vcvtdq2ps or sxtl + scvtf for int8), never copied into a float32 array; row
// scales multiply the scores (K) and the probabilities (V) of a block, in the loop.
//
// What differs from the template policy is the instruction mix:
//   * scores: W dot products at a time (row blocks of 4, 2 or 1 query rows x W / rows
//     keys), each in its own accumulator, then one transpose-reduce tree turns the W
//     accumulators into one vector of W scores, instead of a horizontal sum per (row, key).
//     Each K vector loaded serves every row of the row block.
//   * softmax in whole vectors (exp2_neg, base 2), no scalar exp per key.
//   * P·V with all accumulators in registers.
// Rounding depends only on the shapes (never the thread count).
//
// No std:: templates here (see attention_core.inl).
#pragma once
#if !defined(__SSE2__) && !defined(__aarch64__)
#error "simd_decode.inl needs the SIMD layer of an x86-64 tier or AArch64 NEON"
#endif

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include "../simd/simd.hpp"
#include "decode_attention.inl"

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace simd_decode {

// The SIMD layer's vocabulary (csrc/simd/).
using V = simd::Vec;
using simd::W;
using simd::vfma;
using simd::vloadu;
using simd::vmul;
using simd::vset;
using simd::vstoreu;
using simd::vzero;

// W values d, d + 1, .. (d a multiple of W) of a stored K/V row, widened to float32
// (simd::vwiden): element pointers step values for every storage type but int4, whose rows
// are blocks of 32 (simd/storage.hpp), dequantised in registers.
template <class T> inline V vld_kv(const T* row, int64_t d) { return simd::vwiden(row + d); }
inline V vld_kv(const q4_t* row, int64_t d) {
    return simd::vwiden_q4(&row->byte + (d / kQ4Group) * kQ4BlockBytes, d % kQ4Group);
}
// Vectors one block of a storage type holds: 1, but an int4 block of 32 values spans 32 / W
// vectors, whose header and bytes are then decoded once (vld_kv_block).
// On AVX-512 a float8 e4m3fn row is widened 32 values at a time (simd::vwiden_pair: Zen 5,
// 8/8 heads, L = 16k: 1.38-1.49x, 32/8 1.08-1.11x); not e5m2, whose widening is one shift
// (0.87-0.94x: its V tiles lose the one moved pointer of kPerElement).
template <class T> struct KvBlock { static constexpr int kVecs = 1; };
template <> struct KvBlock<q4_t> { static constexpr int kVecs = 32 / W; };
#if defined(__AVX512F__)
template <> struct KvBlock<f8e4m3_t> { static constexpr int kVecs = 2; };
#endif
// out[0 .. KvBlock<T>::kVecs) = vectors d, d + W, .. of a stored row (d a multiple of
// kVecs * W).
template <class T> inline void vld_kv_block(const T* row, int64_t d, V* out) {
#if defined(__AVX512F__)
    if constexpr (Float8<T>::kIs && KvBlock<T>::kVecs == 2) {
        simd::vwiden_pair(row + d, out);
        return;
    }
#endif
    out[0] = vld_kv(row, d);
}
inline void vld_kv_block(const q4_t* row, int64_t d, V* out) {
    simd::vwiden_q4_block(&row->byte + (d / kQ4Group) * kQ4BlockBytes, out);
}

// Whether one query row scores one key at a time, each key's W partial sums added up by
// lane_sum (transpose_reduce's order: the same bits), rather than W keys in flight and their
// transpose: on AVX-512 with D = 128 unrolled (ND = 8), where with the plain streams of
// decode_loop (kPlainRowStreams) a one-row float32 step ran 1.05-1.23x faster (Zen 4, L = 16k
// / 64k, 1 / 2 threads; HISTORY 37). Not float8, whose widening the W chains hide better
// (0.96-0.97x one key at a time), nor D = 64 (0.97-0.99x).
template <class T, int ND> struct OneKeyScores {
    static constexpr bool value = W == 16 && ND * W == 128 && !Float8<T>::kIs;
};

// s[r * ss + j] = q[r] . k[j] for RB query rows (q rows qs apart, D a multiple of W) and
// the first `keys` (<= W / RB) of W / RB keys (the rows of a StridedRun or ListedRun).
// Missing keys repeat the last one and are not stored (one row: OneKeyScores). With
// ND = D / W > 0 the loops are unrolled for that D and
// walk the keys one after the other (ascending addresses: streamed from memory, 16 rows
// walked side by side measured up to 40% slower, though faster from cache); ND = 0 takes any
// D. When vpf is set, each key's V row (vpf + j * vsb, vrow_bytes long) is prefetched
// before its K row is read (see decode_loop: the V stream then flows alongside K).
template <int RB, int ND, class T, class Run>
inline void score_keys(const float* __restrict q, int64_t qs, Run k, int64_t keys,
                       int64_t D, float* __restrict s, int64_t ss, const char* vpf, int64_t vsb,
                       int64_t vrow_bytes) {
    constexpr int KB = W / RB;
    if constexpr (RB == 1 && OneKeyScores<T, ND>::value && KvBlock<T>::kVecs == 1) {
        for (int64_t j = 0; j < keys; ++j) {
            if (vpf)
                for (int64_t off = 0; off < vrow_bytes; off += 64) __builtin_prefetch(vpf + j * vsb + off, 0, 2);
            const T* krow = k.at(j);
            V acc = vzero();
#pragma GCC unroll 8
            for (int c = 0; c < ND; ++c) acc = vfma(vld_kv(krow, c * W), vloadu(q + c * W), acc);
            s[j] = simd::lane_sum(acc);
        }
        return;
    }
    const T* kp[KB];
    for (int j = 0; j < KB; ++j) kp[j] = k.at(j < keys ? j : keys - 1);
    V acc[W];
    for (int n = 0; n < W; ++n) acc[n] = vzero();
#pragma GCC unroll 16  // keeps the W accumulators in registers (measured: +5-10% at 8/8)
    for (int j = 0; j < KB; ++j) {
        if (vpf && j < keys)
            for (int64_t off = 0; off < vrow_bytes; off += 64) __builtin_prefetch(vpf + j * vsb + off, 0, 2);
        constexpr int BV = KvBlock<T>::kVecs;
        if (ND > 0 && ND % BV == 0) {
            for (int c = 0; c < ND; c += BV) {
                V kv[BV];
                vld_kv_block(kp[j], c * W, kv);
                for (int u = 0; u < BV; ++u)
                    for (int r = 0; r < RB; ++r)
                        acc[r * KB + j] = vfma(kv[u], vloadu(q + r * qs + (c + u) * W), acc[r * KB + j]);
            }
        } else {
            for (int64_t d = 0; d < D; d += W) {
                const V kv = vld_kv(kp[j], d);
                for (int r = 0; r < RB; ++r)
                    acc[r * KB + j] = vfma(kv, vloadu(q + r * qs + d), acc[r * KB + j]);
            }
        }
    }
    const V dots = simd::transpose_reduce(acc);  // lane r * KB + j: row r, key j
    if (keys == KB) {
        for (int r = 0; r < RB; ++r) simd::store_group<KB>(s + r * ss - r * KB, dots, r * KB);
    } else {
        for (int r = 0; r < RB; ++r) simd::store_lanes(s + r * ss - r * KB, dots, r * KB, keys);
    }
}

// acc[r][c] += sum_{j0 <= j < j1} p[r][j] * v[j][col + c] for RB rows and NV vectors of
// columns; accumulators in registers. kPrefetch: key j also starts lines [l0, l1) of kpf's
// row j - j0 towards L2 (see decode_loop; a template parameter, so the tile without it
// compiles as it did before).
template <int RB, int NV, class T, bool kPrefetch = false, class Run = StridedRun<T>>
inline void pv_tile(float* __restrict acc, int64_t acc_stride, const float* __restrict p,
                    int64_t ps, Run v, int64_t col, int64_t j0, int64_t j1,
                    const RowPrefetch& kpf = RowPrefetch{}, int64_t l0 = 0, int64_t l1 = 0) {
    V a[RB][NV];
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < NV; ++c) a[r][c] = vloadu(acc + r * acc_stride + c * W);
    // One value per element (every type but int4): the tile's columns from one moved pointer,
    // so each vector's load has a constant displacement (with `col` added per vector GCC kept
    // one offset register per vector and spilled them to vector registers).
    constexpr bool kPerElement = KvBlock<T>::kVecs == 1;
    const Run vcol = kPerElement ? v.cols(col) : v;
    for (int64_t j = j0; j < j1; ++j) {
        if (kPrefetch && j - j0 < kpf.rows)
            for (int64_t l = l0; l < l1; ++l) __builtin_prefetch(kpf.first + (j - j0) * kpf.stride + l * 64, 0, 2);
        const T* vrow = v.at(j);
        V vv[NV];
        constexpr int BV = KvBlock<T>::kVecs;
        if constexpr (kPerElement) {
            for (int c = 0; c < NV; ++c) vv[c] = vld_kv(vcol.at(j), c * W);
        } else if (NV % BV == 0 && col % (BV * W) == 0) {  // (always, but for int4 in odd tiles)
            for (int c = 0; c < NV; c += BV) vld_kv_block(vrow, col + c * W, vv + c);
        } else {
            for (int c = 0; c < NV; ++c) vv[c] = vld_kv(vrow, col + c * W);
        }
        for (int r = 0; r < RB; ++r) {
            const V pr = vset(p[r * ps + j]);
            for (int c = 0; c < NV; ++c) a[r][c] = vfma(pr, vv[c], a[r][c]);
        }
    }
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < NV; ++c) vstoreu(acc + r * acc_stride + c * W, a[r][c]);
}

// All Dv columns (a multiple of W) for RB rows: RB x NV accumulators a tile (16 with 32
// zmm registers; 8-12 of the 16 ymm registers), then single vectors.
template <int RB, class T, class Run>
inline void pv_rows(float* acc, int64_t Dv, const float* p, int64_t ps, Run v,
                    int64_t j0, int64_t j1, const RowPrefetch& kpf = RowPrefetch{}) {
#if defined(__AVX512F__) || defined(__aarch64__)  // 32 registers
    constexpr int NV = 16 / RB > 8 ? 8 : 16 / RB;
#else
    // RB = 4: 12 accumulators + 3 V vectors + 1 broadcast = 16 registers; measured +3-10%
    // over 8 accumulators at 32/8 heads (Sapphire Rapids held to AVX2).
    constexpr int NV = RB == 4 ? 3 : (RB == 2 ? 4 : 8);
#endif
    // The lines of kpf's rows go out a share per tile, so each V key of a tile also starts
    // a few lines of a K row ahead (all at once when Dv holds no whole tile).
    const int64_t tiles = Dv / (NV * W), lines = (kpf.row_bytes + 63) / 64;
    int64_t e = 0;
    if (kpf.rows > 0 && tiles > 0) {
        for (int64_t t = 0; e + NV * W <= Dv; e += NV * W, ++t)
            pv_tile<RB, NV, T, true>(acc + e, Dv, p, ps, v, e, j0, j1, kpf, lines * t / tiles,
                                     lines * (t + 1) / tiles);
    } else {
        prefetch_rows(kpf);  // (none, or Dv holds no whole tile)
        for (; e + NV * W <= Dv; e += NV * W) pv_tile<RB, NV, T>(acc + e, Dv, p, ps, v, e, j0, j1);
    }
    for (; e < Dv; e += W) pv_tile<RB, 1, T>(acc + e, Dv, p, ps, v, e, j0, j1);
}

// x[c] = 2^(x[c] - m) for b <= c < e and 0 for the other c < n (n rounded up to W may be
// written: the score rows have room); returns the sum over [b, e).
inline float exp_shift_zero(float* x, int64_t n, int64_t b, int64_t e, float m) {
    const V mv = vset(m);
    V sum = vzero();
    for (int64_t c = 0; c < n; c += W) {
        // Lanes outside [b, e) may hold anything (even NaN): zeroed before and after exp.
        const V s = simd::keep_range(vloadu(x + c), c, b, e);
        const V pr = simd::keep_range(simd::exp2_neg(simd::vsub(s, mv)), c, b, e);
        vstoreu(x + c, pr);
        sum = simd::vadd(sum, pr);
    }
    return simd::hsum(sum);
}

// The score options of one query row (RowOptions, attention_core.inl: the same fields, read
// once) applied to its scores srow[b, e) (scaled, base 2; column c is key key0 + c),
// W at a time: the last vector may run past e (score rows have room; exp_shift_zero ignores
// those lanes). softcap with simd_prefill's tanh_vec; the mask read through its strides.
struct RowScoreOptions : RowOptions<float> {
    using RowOptions<float>::RowOptions;

    void apply(float* srow, int64_t b, int64_t e, int64_t key0) const {
        const float log2e = static_cast<float>(kLog2e);  // (an additive mask's units)
        if (softcap != 0) {
            const V c = vset(softcap), ic = vset(inv_softcap);
            for (int64_t x = b; x < e; x += W) vstoreu(srow + x, simd::softcap(vloadu(srow + x), c, ic));
        }
        if (slope != 0) {  // |i' - j| exactly while below 2^24
            alignas(64) float iota[W];
            for (int i = 0; i < W; ++i) iota[i] = static_cast<float>(i);
            const V sl = vset(slope), io = vloadu(iota);
            for (int64_t x = b; x < e; x += W) {
                const V dist = simd::vabs(simd::vsub(vset(static_cast<float>(aligned - (key0 + x))), io));
                vstoreu(srow + x, simd::vfnma(sl, dist, vloadu(srow + x)));
            }
        }
        if (bool_mask) {
            for (int64_t x = b; x < e; ++x)
                if (!bool_mask[(key0 + x) * col_stride]) srow[x] = -__builtin_inff();
        } else if (add_mask_f64) {
            for (int64_t x = b; x < e; ++x) srow[x] += static_cast<float>(add_mask_f64[(key0 + x) * col_stride]) * log2e;
        } else if (add_mask_f32 && col_stride == 1) {
            const float* m = add_mask_f32 + key0;
            const V l2 = vset(log2e);
            int64_t x = b;
            for (; x + W <= e; x += W) vstoreu(srow + x, vfma(vloadu(m + x), l2, vloadu(srow + x)));
            for (; x < e; ++x) srow[x] += m[x] * log2e;
        } else if (add_mask_f32) {
            for (int64_t x = b; x < e; ++x) srow[x] += add_mask_f32[(key0 + x) * col_stride] * log2e;
        }
    }
};

template <int RB, int ND, class T>
struct ScoreBlock {  // scores of RB rows against up to W keys, in groups of W / RB keys
    template <class Run>
    static void run(const float* qs, int64_t qstride, Run k, int64_t keys, int64_t D,
                    float* s, int64_t ss, const char* vpf, int64_t vsb, int64_t vrow_bytes) {
        constexpr int KB = W / RB;
        for (int64_t j = 0; j < keys; j += KB)
            score_keys<RB, ND, T>(qs, qstride, k.from(j), keys - j < KB ? keys - j : KB, D, s + j, ss,
                                  vpf ? vpf + j * vsb : nullptr, vsb, vrow_bytes);
    }
};

// The softmax side of the hand-written policies (decode_loop's Path; see TemplatePath):
// float32 rows, W keys scored per call, the vector max / exp passes and score options above.
struct VectorSoftmax {
    using Acc = float;
    static constexpr int64_t kScoreKeys = W;
    static constexpr bool kTunedStreams = true;
    static constexpr bool kSpreadPrefetch = false;
    static constexpr bool kPairedValues = false;
    static constexpr bool kRowValues = false;  // values() takes runs of V rows (decode_loop)
    static constexpr float kScaleFold = 1.0f;
    static void score_options(const AttentionParams& p, int64_t batch, int64_t head, int64_t pos,
                              int64_t seqlen_k, float* srow, int64_t b, int64_t e, int64_t key0) {
        RowScoreOptions(p, batch, head, pos, seqlen_k).apply(srow, b, e, key0);
    }
    static float range_max(const float* x, int64_t b, int64_t e) { return simd::range_max(x, b, e); }
    static float exp_shift_zero(float* x, int64_t n, int64_t b, int64_t e, float m) {
        return simd_decode::exp_shift_zero(x, n, b, e, m);
    }
};

// decode_loop's arithmetic policy (see TemplatePath, decode_attention.inl): staging a query
// row, scoring W keys for every row, the probabilities of a block being ready, adding V
// rows, finishing the chunk. This one widens every K/V vector to float32 and runs float32
// FMAs (any storage type T, q of type TQ); bf16_decode.inl has a vdpbf16ps one for bfloat16
// q and K/V.
// ND: D / W when the score loops are unrolled for it (0: any multiple of W).
template <int ND, class TQ, class T>
struct WidenPath : VectorSoftmax {
    using Q = TQ;
    using KV = T;
    static constexpr float kScaleFold = simd::kWidenScaleFold<T>;
    static constexpr bool kSpreadPrefetch = true;
    // Workspace floats per staged query row (D rounded up to whole vectors).
    static int64_t query_stride(const AttentionParams& p) { return decode_query_stride(p); }
    static void stage_query(float* qs, const TQ* qrow, int64_t D, float scale) {
        for (int64_t d = 0; d < D; ++d) qs[d] = widen(qrow[d]) * scale;
    }
    // Scores of keys [j, j + nk) (nk <= W) for the n staged rows, k their rows from key j on;
    // the first row block also starts those keys' V rows towards the cache (vj: the first
    // one's bytes, vsb apart). The staged rows already carry the scale.
    template <class Run>
    static void scores_of(int64_t n, const float* qs, int64_t qstride, Run k, int64_t nk,
                          int64_t D, float* sj, int64_t ss, const char* vj, int64_t vsb,
                          int64_t v_row_bytes) {
        int64_t rb = 0;
        for (; rb + kRowBlock <= n; rb += kRowBlock)
            ScoreBlock<kRowBlock, ND, T>::run(qs + rb * qstride, qstride, k, nk, D, sj + rb * ss, ss,
                                              rb == 0 ? vj : nullptr, vsb, v_row_bytes);
        if (n - rb >= 2) {
            ScoreBlock<2, ND, T>::run(qs + rb * qstride, qstride, k, nk, D, sj + rb * ss, ss,
                                      rb == 0 ? vj : nullptr, vsb, v_row_bytes);
            rb += 2;
        }
        if (n - rb == 1)
            ScoreBlock<1, ND, T>::run(qs + rb * qstride, qstride, k, nk, D, sj + rb * ss, ss,
                                      rb == 0 ? vj : nullptr, vsb, v_row_bytes);
    }
    static void scores(int64_t n, const float* qs, int64_t qstride, const T* kj, int64_t ks,
                       int64_t nk, int64_t D, float* sj, int64_t ss, const char* vj,
                       int64_t vsb, int64_t v_row_bytes, float /*scale*/) {
        scores_of(n, qs, qstride, StridedRun<T>{kj, ks}, nk, D, sj, ss, vj, vsb, v_row_bytes);
    }
    static void scores(int64_t n, const float* qs, int64_t qstride, const ListedRun<T>& k, int64_t nk,
                       int64_t D, float* sj, int64_t ss, float /*scale*/) {
        scores_of(n, qs, qstride, k, nk, D, sj, ss, nullptr, 0, 0);
    }
    // A row's probabilities of one block (its key count given) are final in srow.
    static void weights_ready(float*, int64_t) {}
    // acc rows += p rows times `keys` V rows of v, whose weights are columns c0 .. c0 + keys
    // of the block's score rows s_block (ss apart).
    template <class Run>
    static void values_of(int64_t n, float* acc, int64_t Dv, const float* s_block, int64_t ss,
                          int64_t c0, Run v, int64_t keys, const RowPrefetch& kpf) {
        const float* s = s_block + c0;
        int64_t rb = 0;
        for (; rb + kRowBlock <= n; rb += kRowBlock)
            pv_rows<kRowBlock, T>(acc + rb * Dv, Dv, s + rb * ss, ss, v, 0, keys, rb == 0 ? kpf : RowPrefetch{});
        if (n - rb >= 2) {
            pv_rows<2, T>(acc + rb * Dv, Dv, s + rb * ss, ss, v, 0, keys, rb == 0 ? kpf : RowPrefetch{});
            rb += 2;
        }
        if (n - rb == 1) pv_rows<1, T>(acc + rb * Dv, Dv, s + rb * ss, ss, v, 0, keys, rb == 0 ? kpf : RowPrefetch{});
    }
    static void values(int64_t n, float* acc, int64_t Dv, const float* s_block, int64_t ss,
                       int64_t c0, const T* vrun, int64_t vs, int64_t keys,
                       const RowPrefetch& kpf = RowPrefetch{}) {
        values_of(n, acc, Dv, s_block, ss, c0, StridedRun<T>{vrun, vs}, keys, kpf);
    }
    static void values(int64_t n, float* acc, int64_t Dv, const float* s_block, int64_t ss,
                       int64_t c0, const ListedRun<T>& v, int64_t keys) {
        values_of(n, acc, Dv, s_block, ss, c0, v, keys, RowPrefetch{});
    }
    // The chunk's accumulator rows are final (in whatever layout values() kept them).
    static void finish(float*, int64_t, int64_t) {}
};

// Whether this kernel takes the call (else the shared template): every vector of D and Dv
// whole (any score option: RowScoreOptions; sinks only the merge sees).
inline bool covers(const AttentionParams& p) {
    return p.head_dim % W == 0 && p.head_dim_v % W == 0;
}

// decode_loop with WidenPath (its score loops unrolled for D = 128 and 64), for every dtype
// combination of a call this kernel covers (for_storage_types). An indexed task
// (DecodeTask::rows: reads_listed) reads its listed rows in place (ListedRows); only where q
// has the cache's type, as a listed loop for every pair (63 more loops per ISA file) moved
// GCC's inlining of the dense loop and cost 32/8 float32 decode 6-10 % (HISTORY 54).
struct WidenChunk {
    template <class Path>
    static void run_path(const AttentionParams& p, const DecodeTask& task, float* ws, float* acc, float* m,
                         float* l) {
        if constexpr (__is_same(typename Path::Q, typename Path::KV))
            if (task.rows) return decode_loop<Path, ListedRows<typename Path::KV>>(p, task, ws, acc, m, l);
        decode_loop<Path>(p, task, ws, acc, m, l);
    }
    template <class TQ, class T>
    static void run(const AttentionParams& p, const DecodeTask& task, float* ws, float* acc, float* m,
                    float* l) {
        if (p.head_dim == 128) run_path<WidenPath<128 / W, TQ, T>>(p, task, ws, acc, m, l);
        else if (p.head_dim == 64) run_path<WidenPath<64 / W, TQ, T>>(p, task, ws, acc, m, l);
        else run_path<WidenPath<0, TQ, T>>(p, task, ws, acc, m, l);
    }
};
void chunk_any(const AttentionParams& p, const DecodeTask& task, float* ws, float* acc,
               float* m, float* l) {
    for_storage_types<WidenChunk>(p, task, ws, acc, m, l);
}

// Whether an indexed call's tasks read their listed rows in place (ListedRows): over a
// contiguous cache, q of its dtype. Otherwise the driver gathers them (run_chunk).
inline bool reads_listed(const AttentionParams& p) {
    return p.key_index && !p.block_table && p.dtype == p.kv_dtype;
}

// KernelTable::decode_kernel: this kernel where it covers the call, else the template.
DecodeKernel decode_kernel(const AttentionParams& p) {
    if (!covers(p)) return template_decode(p);
    DecodeKernel kernel{KernelId::kSimdDecode, chunk_any};
    kernel.reads_index = reads_listed(p);
    return kernel;
}

}  // namespace simd_decode

// kRowBlock rows per score_keys call, each against W / kRowBlock keys (one vector of
// scores); both products vfma over K/V widened to float32.
template <> struct PolicyOf<KernelId::kSimdDecode> {
    static KernelPolicy of(const AttentionParams&) {
        return {kRowBlock, simd::W / kRowBlock, kVfmaProduct, kVfmaProduct};
    }
};
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
