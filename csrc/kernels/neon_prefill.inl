// Hand-written float32 prefill kernel for the "neon" tier (AArch64 Advanced SIMD).
// Included by kernels/isa_neon.cpp after block_attention.inl, inside its ATTNFAST_KERNEL_NS.
// The same scheme as the x86 kernel (simd_prefill.inl), re-blocked for NEON's 32 x 128-bit
// registers; float64 and decode keep the shared templates.
//
// Layout: query rows live in vector lanes. One block holds Bq = kQueryVecs * 4 query rows:
//   qt  (D  x Bq)  Qᵀ, pre-multiplied by scale * log2(e) (so the softmax runs in base 2)
//   st  (Bk x Bq)  Sᵀ of the current KV tile, overwritten in place by Pᵀ
//   ot  (Dv x Bq)  Oᵀ, the unnormalised output accumulator
// With queries in lanes the row max, the row sum and the rescaling of the output are plain
// element-wise vector operations, never horizontal reductions. K and V are read straight
// from the caller's arrays (any row stride), so nothing is packed per tile and any D, Dv
// works without padding:
//   S micro-kernel:  kKeyRows keys x kQueryVecs query vectors of accumulators; four d at a
//                    time, one 4-float load per key row feeds 4 x kQueryVecs FMAs through
//                    vfmaq_laneq_f32 (no broadcast loads):
//                    acc[t][v] += k[key t][d + i] * qt[d + i][v-th vector]
//   PV micro-kernel: up to kColRows output columns x kQueryVecs query vectors, over keys j:
//                    acc[t][v] += v[j][col t] * pt[j][v-th vector]   (v[j][col t] by ld1r)
// Register budget (of 32): S 20 accumulators + 5 K vectors + Q vectors in flight; PV 20
// accumulators + 4 P vectors + broadcasts. (6 x 4 = 24 accumulators made GCC 12 spill
// ~20 vectors per iteration of both loops, per objdump of the cross build; 5 x 4 spills none.)
// Rounding and summation order depend only on the tile sizes (functions of D, Dv and the
// cache sizes), never on the thread count.
//
// Non-finite values: vmaxq_f32 propagates NaN, so a NaN score makes the row max NaN, then
// every probability, the sum and the output of that row NaN; finish_sub_block tells a row
// that saw no key (sum exactly 0) from one whose sum is NaN, so NaN is never turned into
// zeros / -inf.
//
// No std:: templates here (see block_attention.inl).
#include <arm_neon.h>

#if !defined(__aarch64__)
#error "neon_prefill.inl is written for AArch64 (vfmaq_laneq_f32, vrndnq_f32, vminvq_u32)"
#endif

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace neon {

// ---------------------------------------------------------------- vector layer
using Vec = float32x4_t;
using Mask = uint32x4_t;
constexpr int W = 4;            // float lanes
constexpr int kQueryVecs = 4;   // query vectors per block: Bq = 16 rows
constexpr int kKeyRows = 5;     // keys per S micro-tile: 5 x 4 = 20 accumulators
constexpr int kColRows = 5;     // output columns per PV micro-tile: 20 accumulators
constexpr int64_t Bq = kQueryVecs * W;

inline Vec vzero() { return vdupq_n_f32(0.0f); }
inline Vec vset(float x) { return vdupq_n_f32(x); }
inline Vec vload(const float* p) { return vld1q_f32(p); }
inline void vstore(float* p, Vec x) { vst1q_f32(p, x); }
inline Vec vmax(Vec a, Vec b) { return vmaxq_f32(a, b); }  // NaN in either lane gives NaN
// Lanes whose [begin, end) key range (relative to the tile) contains `key`.
inline Mask key_visible(const int32_t* begin, const int32_t* end, int32_t key) {
    const int32x4_t kv = vdupq_n_s32(key);
    return vandq_u32(vcleq_s32(vld1q_s32(begin), kv), vcltq_s32(kv, vld1q_s32(end)));
}
inline Vec keep_or_neg_inf(Mask keep, Vec x) { return vbslq_f32(keep, x, vset(-__builtin_inff())); }
// A raw score of -inf (an infinite input) -> NaN, so the row's out and lse say so.
inline Vec neg_inf_to_nan(Vec x) {
    return vbslq_f32(vceqq_f32(x, vset(-__builtin_inff())), vset(__builtin_nanf("")), x);
}
// m == -inf ? 0 : m. The shift for a lane that has seen no key yet, so 2^(-inf - shift) = 0.
inline Vec finite_or_zero(Vec m) {
    return vbslq_f32(vceqq_f32(m, vset(-__builtin_inff())), vzero(), m);
}
inline bool all_ones(Vec x) { return vminvq_u32(vceqq_f32(x, vset(1.0f))) == 0xffffffffu; }

// 2^x for x <= 0, as 2^n * p(r), n = round(x), r = x - n in [-1/2, 1/2] (exact), p the same
// degree-6 minimax polynomial as the x86 kernel (relative error 1.9e-9 before rounding).
// x < -126 (including -inf) gives exactly 0: underflow is flushed, never denormal. NaN stays
// NaN (the compare is false for NaN, so its lane is kept; FMAX and FMLA propagate it).
inline Vec exp2_neg(Vec x) {
    const float c1 = 6.931471825e-01f, c2 = 2.402264625e-01f, c3 = 5.550328642e-02f,
                c4 = 9.618489072e-03f, c5 = 1.339993090e-03f, c6 = 1.534581243e-04f;
    const Mask flush = vcltq_f32(x, vset(-126.0f));
    const Vec xc = vmaxq_f32(x, vset(-127.0f));  // keeps 2^n's exponent field >= 0
    const Vec n = vrndnq_f32(xc);                 // round to nearest, ties to even
    const Vec r = vsubq_f32(xc, n);
    Vec p = vfmaq_f32(vset(c5), vset(c6), r);
    p = vfmaq_f32(vset(c4), p, r);
    p = vfmaq_f32(vset(c3), p, r);
    p = vfmaq_f32(vset(c2), p, r);
    p = vfmaq_f32(vset(c1), p, r);
    p = vfmaq_f32(vset(1.0f), p, r);
    // n is an exact integer in [-127, 0]: its float->int conversion is exact (NaN gives 0,
    // and p is NaN then anyway).
    const int32x4_t bits = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    const Vec y = vmulq_f32(p, vreinterpretq_f32_s32(bits));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(y), flush));
}

// ---------------------------------------------------------------- block state
// One sub-block: Bq query rows of one head, with its own online-softmax state. The
// scratch shared by the sub-blocks of a task (Sᵀ, masks) is reached from here too.
struct Block {
    int64_t D;             // head_dim
    int64_t Dv;            // head_dim_v
    int64_t Bk;            // keys per tile
    float* qt;             // D x Bq: scaled Qᵀ, lanes past the last row 0
    float* ot;             // Dv x Bq: unnormalised Oᵀ
    float* m;              // Bq: running max (base-2 scaled scores)
    float* l;              // Bq: running sum
    float* st;             // Bk x Bq, shared: Sᵀ, then Pᵀ
    int32_t* rel_begin;    // Bq, shared: first visible key of each lane, relative to the tile
    int32_t* rel_end;      // Bq, shared: end of each lane's visible keys, relative to the tile
    const float* k;        // key row 0 of this (batch, kv head)
    const float* v;        // value row 0 of this (batch, kv head)
    int64_t k_stride;      // elements between key rows
    int64_t v_stride;      // elements between value rows
    int64_t head;          // query head
    int64_t row_begin;     // first query row
    int64_t rows;          // query rows held (<= Bq)
    int64_t seqlen_k;      // keys valid for this batch entry (batch_seqlen_k)
    KeyRange first;        // visible keys of the first row
    KeyRange last;         // visible keys of the last row
};

inline int64_t round_down(int64_t x, int64_t to) { return x / to * to; }
inline int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Most sub-blocks one task holds: each K/V super-tile is read from memory once per task and
// reused from L2 by up to this many sub-blocks.
constexpr int64_t kMaxSubBlocks = 4;

// Tile sizes of the float32 prefill, from D, Dv and the cache sizes only.
struct Tiling {
    int64_t Bk;            // keys per tile: Sᵀ (Bk x Bq) and the K rows in flight share L1
    int64_t super_keys;    // keys per super-tile: its K and V stay in L2 while every
                           // sub-block of the task walks them
    bool prefetch;         // one head's K and V do not fit in half of L2
    int64_t sub_elems;     // floats of one sub-block's state (Qᵀ, Oᵀ, m, l)
    int64_t shared_elems;  // floats shared by a task's sub-blocks (Sᵀ, the two range arrays)
};
inline Tiling tiling(const AttentionParams& p) {
    const CacheSizes& cache = cache_sizes();
    Tiling t;
    const int64_t bk = (cache.l1d / 4) / (Bq * static_cast<int64_t>(sizeof(float)));
    t.Bk = round_down(clamp64(bk, 2 * kKeyRows, 16 * kKeyRows), kKeyRows);
    const int64_t row_bytes = (p.head_dim + p.head_dim_v) * static_cast<int64_t>(sizeof(float));
    t.super_keys = round_down(clamp64((cache.l2 / 2) / row_bytes, t.Bk, 1 << 20), t.Bk);
    t.prefetch = p.seqlen_k * row_bytes > cache.l2 / 2;
    t.sub_elems = (p.head_dim + p.head_dim_v + 2) * Bq;
    t.shared_elems = t.Bk * Bq + 2 * Bq;
    return t;
}

// How tasks group sub-blocks: heads of one KV head (GQA) and consecutive row blocks.
// Depends on the shape and the cache sizes only.
PrefillPlan plan(const AttentionParams& p) {
    const Tiling t = tiling(p);
    const int64_t group = p.heads / p.kv_heads;
    int64_t heads = 1;  // the largest divisor of the group up to kMaxSubBlocks
    for (int64_t h = 1; h <= group && h <= kMaxSubBlocks; ++h)
        if (group % h == 0) heads = h;
    // Several row blocks per task only pay when one head's K and V do not fit in L2.
    int64_t row_blocks = t.prefetch ? kMaxSubBlocks / heads : 1;
    if (row_blocks < 1) row_blocks = 1;
    // Keep enough tasks (64) to balance most machines' thread counts; shape-only.
    const int64_t q_blocks = (p.seqlen_q + Bq - 1) / Bq;
    auto tasks = [&](int64_t rb, int64_t hd) {
        return p.batch * (p.heads / hd) * ((q_blocks + rb - 1) / rb);
    };
    while (row_blocks > 1 && tasks(row_blocks, heads) < 64) row_blocks /= 2;
    while (heads > 1 && tasks(row_blocks, heads) < 64) {
        int64_t h = heads - 1;
        while (group % h != 0) --h;
        heads = h;
    }
    PrefillPlan plan;
    plan.block_rows = row_blocks * Bq;
    plan.heads_per_task = heads;
    plan.workspace_elems = heads * row_blocks * t.sub_elems + t.shared_elems + 64 / sizeof(float);
    return plan;
}

// ---------------------------------------------------------------- prefetch
// Brings the K and V rows of the next tile towards L2, a line or two per step, while the
// current tile computes: needed when one head's K and V do not fit in L2 and many strided
// rows outrun the hardware prefetchers; spread thinly so no burst stalls the loads.
struct PrefetchStream {
    const char* k_row = nullptr;       // current K row
    const char* v_row = nullptr;       // current V row
    int64_t k_stride = 0;              // bytes between K rows
    int64_t v_stride = 0;              // bytes between V rows
    int64_t k_bytes = 0;               // bytes of one K row
    int64_t v_bytes = 0;               // bytes of one V row
    int64_t k_lines = 0;               // lines per row of K
    int64_t lines = 0;                 // lines per row of K and V together
    int64_t line = 0;                  // next line of the current row
    int64_t rows_left = 0;             // rows still to prefetch

    PrefetchStream() = default;
    PrefetchStream(const Block& b, int64_t first_row, int64_t rows) {
        k_stride = b.k_stride * 4;
        v_stride = b.v_stride * 4;
        k_row = reinterpret_cast<const char*>(b.k) + first_row * k_stride;
        v_row = reinterpret_cast<const char*>(b.v) + first_row * v_stride;
        k_bytes = b.D * 4;
        v_bytes = b.Dv * 4;
        k_lines = k_bytes / 64 + 1;  // + 1: a row need not start on a line
        lines = k_lines + v_bytes / 64 + 1;
        rows_left = rows;
    }
    int64_t total_lines() const { return rows_left * lines; }
    void step() {
        if (rows_left <= 0) return;
        const char* at;
        if (line < k_lines) {
            const int64_t off = line * 64;
            at = k_row + (off < k_bytes ? off : k_bytes - 1);
        } else {
            const int64_t off = (line - k_lines) * 64;
            at = v_row + (off < v_bytes ? off : v_bytes - 1);
        }
        __builtin_prefetch(at, 0, 2);  // PRFM PLDL2KEEP
        if (++line == lines) {
            line = 0;
            k_row += k_stride;
            v_row += v_stride;
            --rows_left;
        }
    }
};

// ---------------------------------------------------------------- micro-kernels
// acc[t][u] += qt[d + L][u-th vector] * k[t][d + L], the key value taken from lane L of kq[t].
template <int R, int L>
__attribute__((always_inline)) inline void fma_lane(Vec (&acc)[R][kQueryVecs], const Vec (&kq)[R],
                                                    const float* q) {
#pragma GCC unroll 4
    for (int u = 0; u < kQueryVecs; ++u) {
        const Vec qv = vload(q + u * W);
#pragma GCC unroll 8
        for (int t = 0; t < R; ++t) acc[t][u] = vfmaq_laneq_f32(acc[t][u], qv, kq[t], L);
    }
}

// Sᵀ rows [j0, j0 + R) of the tile starting at key `tile`: scores of R keys against all Bq
// query lanes; masked to -inf outside each lane's range when `partial`; folds the row max.
template <int R>
void scores_rows(const Block& b, int64_t tile, int64_t j0, bool partial, Vec* tile_max) {
    Vec acc[R][kQueryVecs];
#pragma GCC unroll 8
    for (int t = 0; t < R; ++t)
#pragma GCC unroll 4
        for (int u = 0; u < kQueryVecs; ++u) acc[t][u] = vzero();
    const float* krow[R];
#pragma GCC unroll 8
    for (int t = 0; t < R; ++t) krow[t] = b.k + (tile + j0 + t) * b.k_stride;
    const float* q = b.qt;
    int64_t d = 0;
    for (; d + 4 <= b.D; d += 4, q += 4 * Bq) {  // four d per K load
        Vec kq[R];
#pragma GCC unroll 8
        for (int t = 0; t < R; ++t) kq[t] = vld1q_f32(krow[t] + d);
        fma_lane<R, 0>(acc, kq, q);
        fma_lane<R, 1>(acc, kq, q + Bq);
        fma_lane<R, 2>(acc, kq, q + 2 * Bq);
        fma_lane<R, 3>(acc, kq, q + 3 * Bq);
    }
    for (; d < b.D; ++d, q += Bq) {  // the last D % 4
#pragma GCC unroll 4
        for (int u = 0; u < kQueryVecs; ++u) {
            const Vec qv = vload(q + u * W);
#pragma GCC unroll 8
            for (int t = 0; t < R; ++t) acc[t][u] = vfmaq_n_f32(acc[t][u], qv, krow[t][d]);
        }
    }
    float* s = b.st + j0 * Bq;
#pragma GCC unroll 8
    for (int t = 0; t < R; ++t)
#pragma GCC unroll 4
        for (int u = 0; u < kQueryVecs; ++u) {
            Vec x = neg_inf_to_nan(acc[t][u]);  // -inf only from an infinite input
            if (partial)
                x = keep_or_neg_inf(key_visible(b.rel_begin + u * W, b.rel_end + u * W,
                                                static_cast<int32_t>(j0 + t)), x);
            tile_max[u] = vmax(tile_max[u], x);
            vstore(s + t * Bq + u * W, x);
        }
}

// Oᵀ rows [e0, e0 + R) = corr * Oᵀ + Vᵀ[e0:e0+R, tile keys] Pᵀ over `keys` keys (corr
// nullptr: all ones); steps the prefetch stream `pf_steps` times per key.
template <int R>
void pv_rows(const Block& b, int64_t tile, int64_t keys, int64_t e0, const Vec* corr,
             PrefetchStream& pf, int pf_steps) {
    Vec acc[R][kQueryVecs];
    float* o = b.ot + e0 * Bq;
    if (corr) {
#pragma GCC unroll 8
        for (int t = 0; t < R; ++t)
#pragma GCC unroll 4
            for (int u = 0; u < kQueryVecs; ++u) acc[t][u] = vmulq_f32(vload(o + t * Bq + u * W), corr[u]);
    } else {
#pragma GCC unroll 8
        for (int t = 0; t < R; ++t)
#pragma GCC unroll 4
            for (int u = 0; u < kQueryVecs; ++u) acc[t][u] = vload(o + t * Bq + u * W);
    }
    const float* vrow = b.v + tile * b.v_stride + e0;
    const float* pt = b.st;
    for (int64_t j = 0; j < keys; ++j, vrow += b.v_stride, pt += Bq) {
        for (int i = 0; i < pf_steps; ++i) pf.step();
        Vec pv[kQueryVecs];
#pragma GCC unroll 4
        for (int u = 0; u < kQueryVecs; ++u) pv[u] = vload(pt + u * W);
#pragma GCC unroll 8
        for (int t = 0; t < R; ++t) {
            const Vec vb = vld1q_dup_f32(vrow + t);
#pragma GCC unroll 4
            for (int u = 0; u < kQueryVecs; ++u) acc[t][u] = vfmaq_f32(acc[t][u], vb, pv[u]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < R; ++t)
#pragma GCC unroll 4
        for (int u = 0; u < kQueryVecs; ++u) vstore(o + t * Bq + u * W, acc[t][u]);
}

// Remainder micro-tiles (fewer than kKeyRows keys or kColRows columns), picked by an
// if-chain at compile time.
template <int R>
inline void scores_tail(int64_t rows, const Block& b, int64_t tile, int64_t j0, bool partial, Vec* tile_max) {
    if (rows == R) scores_rows<R>(b, tile, j0, partial, tile_max);
    else if constexpr (R > 1) scores_tail<R - 1>(rows, b, tile, j0, partial, tile_max);
}
template <int R>
inline void pv_cols(int64_t cols, const Block& b, int64_t tile, int64_t keys, int64_t e0, const Vec* corr,
                    PrefetchStream& pf, int pf_steps) {
    if (cols == R) pv_rows<R>(b, tile, keys, e0, corr, pf, pf_steps);
    else if constexpr (R > 1) pv_cols<R - 1>(cols, b, tile, keys, e0, corr, pf, pf_steps);
}

// ---------------------------------------------------------------- one KV tile
// Pᵀ = 2^(Sᵀ - shift) in place over `keys` rows of Sᵀ; adds each row into sum (lane-wise,
// in key order).
inline void exp_pass(const Block& b, int64_t keys, const Vec* shift, Vec* sum) {
    float* s = b.st;
    for (int64_t j = 0; j < keys; ++j, s += Bq)
#pragma GCC unroll 4
        for (int u = 0; u < kQueryVecs; ++u) {
            const Vec pj = exp2_neg(vsubq_f32(vload(s + u * W), shift[u]));
            vstore(s + u * W, pj);
            sum[u] = vaddq_f32(sum[u], pj);
        }
}

// Online-softmax update of the block with keys [tile, tile + keys).
void attend_tile(const Block& b, int64_t tile, int64_t keys, int64_t next_keys, bool partial) {
    // 1. Sᵀ = K_tile Qᵀ (scaled, base 2), masked on partial tiles, with the tile's row max.
    Vec tile_max[kQueryVecs];
    for (int u = 0; u < kQueryVecs; ++u) tile_max[u] = vset(-__builtin_inff());
    int64_t j0 = 0;
    for (; j0 + kKeyRows <= keys; j0 += kKeyRows) scores_rows<kKeyRows>(b, tile, j0, partial, tile_max);
    if (j0 < keys) scores_tail<kKeyRows - 1>(keys - j0, b, tile, j0, partial, tile_max);

    // 2. New max, rescale factor of the old state, Pᵀ = 2^(Sᵀ - m) in place, row sums.
    Vec shift[kQueryVecs], corr[kQueryVecs], sum[kQueryVecs];
    for (int u = 0; u < kQueryVecs; ++u) {
        const Vec m_old = vload(b.m + u * W);
        const Vec m_new = vmax(m_old, tile_max[u]);
        shift[u] = finite_or_zero(m_new);
        corr[u] = exp2_neg(vsubq_f32(m_old, shift[u]));  // 0 while m_old is -inf
        sum[u] = vmulq_f32(vload(b.l + u * W), corr[u]);
        vstore(b.m + u * W, m_new);
    }
    exp_pass(b, keys, shift, sum);
    for (int u = 0; u < kQueryVecs; ++u) vstore(b.l + u * W, sum[u]);
    // Once the running max settles, corr is all ones: skip multiplying Oᵀ by it.
    bool rescale = false;
    for (int u = 0; u < kQueryVecs; ++u) rescale = rescale || !all_ones(corr[u]);

    // 3. Oᵀ = corr * Oᵀ + Vᵀ Pᵀ, in passes of near-equal width (Dv = 17: 5 + 4 + 4 + 4,
    //    not 5 + 5 + 5 + 2), prefetching the next tile on the way.
    const int64_t passes = (b.Dv + kColRows - 1) / kColRows;
    PrefetchStream pf;
    int pf_steps = 0;
    if (next_keys > 0) {
        pf = PrefetchStream(b, tile + b.Bk, next_keys);
        pf_steps = static_cast<int>((pf.total_lines() + passes * keys - 1) / (passes * keys));
    }
    for (int64_t pass = 0, e0 = 0; pass < passes; ++pass) {
        const int64_t cols = b.Dv / passes + (pass < b.Dv % passes ? 1 : 0);
        pv_cols<kColRows>(cols, b, tile, keys, e0, rescale ? corr : nullptr, pf, pf_steps);
        e0 += cols;
    }
}

// ---------------------------------------------------------------- one task
// r[c] <- column c of the 4 x 4 block whose rows are r[0..3].
inline void transpose4(Vec* r) {
    const float32x4x2_t a = vtrnq_f32(r[0], r[1]);  // a0 b0 a2 b2 | a1 b1 a3 b3
    const float32x4x2_t c = vtrnq_f32(r[2], r[3]);  // c0 d0 c2 d2 | c1 d1 c3 d3
    r[0] = vcombine_f32(vget_low_f32(a.val[0]), vget_low_f32(c.val[0]));
    r[1] = vcombine_f32(vget_low_f32(a.val[1]), vget_low_f32(c.val[1]));
    r[2] = vcombine_f32(vget_high_f32(a.val[0]), vget_high_f32(c.val[0]));
    r[3] = vcombine_f32(vget_high_f32(a.val[1]), vget_high_f32(c.val[1]));
}

// Sets up one sub-block: Qᵀ scaled into base 2 (exp(x) = 2^(x log2 e)), lanes past the
// last row 0; empty state.
void init_sub_block(const AttentionParams& p, Block& b, const float* q) {
    const float qscale = static_cast<float>(p.scale * 1.4426950408889634);
    const int64_t D = b.D;
    int64_t i0 = 0;
    for (; i0 + 4 <= b.rows; i0 += 4) {  // 4 x 4 blocks through registers
        const float* q0 = q + (b.row_begin + i0) * p.q_row_stride;
        int64_t d0 = 0;
        for (; d0 + 4 <= D; d0 += 4) {
            Vec r[4];
            for (int c = 0; c < 4; ++c) r[c] = vmulq_n_f32(vld1q_f32(q0 + c * p.q_row_stride + d0), qscale);
            transpose4(r);
            for (int c = 0; c < 4; ++c) vstore(b.qt + (d0 + c) * Bq + i0, r[c]);
        }
        for (; d0 < D; ++d0)
            for (int c = 0; c < 4; ++c) b.qt[d0 * Bq + i0 + c] = q0[c * p.q_row_stride + d0] * qscale;
    }
    for (; i0 < b.rows; ++i0) {
        const float* qrow = q + (b.row_begin + i0) * p.q_row_stride;
        for (int64_t d = 0; d < D; ++d) b.qt[d * Bq + i0] = qrow[d] * qscale;
    }
    for (int64_t d = 0; d < D; ++d)
        for (int64_t i = b.rows; i < Bq; ++i) b.qt[d * Bq + i] = 0.0f;
    for (int64_t i = 0; i < Bq; ++i) {
        b.m[i] = -__builtin_inff();
        b.l[i] = 0.0f;
    }
    for (int64_t x = 0; x < b.Dv * Bq; ++x) b.ot[x] = 0.0f;
    // Ranges only move right as rows go down.
    b.first = visible_keys(p, b.row_begin, b.seqlen_k);
    b.last = visible_keys(p, b.row_begin + b.rows - 1, b.seqlen_k);
}

// out = Oᵀᵀ / l; lse = ln(l) + m ln 2. A row that saw no key (l exactly 0): zeros and -inf.
// A NaN sum is not "no key": it gives NaN out and lse.
void finish_sub_block(const AttentionParams& p, const Block& b, int64_t batch) {
    float* out = static_cast<float*>(p.out) + batch * p.out_batch_stride + b.head * p.out_head_stride;
    float* lse = static_cast<float*>(p.lse);
    if (lse) lse += batch * p.lse_batch_stride + b.head * p.lse_head_stride;
    alignas(16) float inv[Bq];  // 1 / l, or 0 for a row that saw no key
    for (int64_t i = 0; i < Bq; ++i) inv[i] = b.l[i] == 0.0f ? 0.0f : 1.0f / b.l[i];
    const int64_t Dv = b.Dv;
    int64_t i0 = 0;
    for (; i0 + 4 <= b.rows; i0 += 4) {  // 4 x 4 blocks through registers
        float* o0 = out + (b.row_begin + i0) * p.out_row_stride;
        const Vec inv4 = vload(inv + i0);
        // Zero, not Oᵀ * 0, for rows that saw no key: a non-finite value in a V row they
        // share a tile with (but do not see) must not leak in.
        const Mask blind = vceqq_f32(inv4, vzero());
        int64_t e0 = 0;
        for (; e0 + 4 <= Dv; e0 += 4) {
            Vec r[4];
            for (int c = 0; c < 4; ++c)
                r[c] = vbslq_f32(blind, vzero(), vmulq_f32(vload(b.ot + (e0 + c) * Bq + i0), inv4));
            transpose4(r);
            for (int c = 0; c < 4; ++c) vst1q_f32(o0 + c * p.out_row_stride + e0, r[c]);
        }
        for (; e0 < Dv; ++e0)
            for (int c = 0; c < 4; ++c)
                o0[c * p.out_row_stride + e0] = inv[i0 + c] == 0.0f ? 0.0f : b.ot[e0 * Bq + i0 + c] * inv[i0 + c];
    }
    for (; i0 < b.rows; ++i0) {
        float* orow = out + (b.row_begin + i0) * p.out_row_stride;
        for (int64_t e = 0; e < Dv; ++e) orow[e] = inv[i0] == 0.0f ? 0.0f : b.ot[e * Bq + i0] * inv[i0];
    }
    if (lse)
        for (int64_t i = 0; i < b.rows; ++i)
            lse[(b.row_begin + i) * p.lse_row_stride] =
                b.l[i] == 0.0f ? -__builtin_inff() : b.m[i] * 0.6931471805599453f + __builtin_logf(b.l[i]);
}

// Keys [tile, tile + keys) for sub-block b: masks when some lane's range cuts the tile.
void attend_sub_tile(const AttentionParams& p, const Block& b, int64_t tile, int64_t keys, int64_t next_keys) {
    const bool partial = tile < b.last.begin || tile + keys > b.first.end;
    if (partial) {
        // Padding lanes copy the last row's range so they never make a tile partial.
        for (int64_t i = 0; i < Bq; ++i) {
            const KeyRange r = visible_keys(p, b.row_begin + (i < b.rows ? i : b.rows - 1), b.seqlen_k);
            const int64_t rb = clamp64(r.begin - tile, 0, keys);
            b.rel_begin[i] = static_cast<int32_t>(rb);
            b.rel_end[i] = static_cast<int32_t>(clamp64(r.end - tile, rb, keys));
        }
    }
    attend_tile(b, tile, keys, next_keys, partial);
}

// One task: heads [head, head + head_count) (all of one KV head) x rows [row_begin, row_end),
// as sub-blocks of Bq rows. The keys are walked in L2-sized super-tiles; every sub-block
// walks a super-tile (in Bk tiles) before the next, so K and V come from memory once per
// task instead of once per sub-block. The tile grid starts at the task's first visible key.
void attend_block(const AttentionParams& p, const BlockTask& task, float* workspace) {
    const Tiling t = tiling(p);
    const int64_t head_count = task.head_count;
    const int64_t row_blocks = (task.row_end - task.row_begin + Bq - 1) / Bq;
    const int64_t subs = head_count * row_blocks;  // <= kMaxSubBlocks (plan)
    const int64_t kv_head = task.head / (p.heads / p.kv_heads);

    float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(workspace) + 63) & ~uintptr_t(63));
    float* st = base;
    int32_t* rel_begin = reinterpret_cast<int32_t*>(st + t.Bk * Bq);
    int32_t* rel_end = rel_begin + Bq;
    float* sub_base = base + t.shared_elems;

    Block blocks[kMaxSubBlocks];
    int64_t kv_begin = 0, kv_end = 0;
    for (int64_t sidx = 0; sidx < subs; ++sidx) {
        Block& b = blocks[sidx];
        b.D = p.head_dim;
        b.Dv = p.head_dim_v;
        b.Bk = t.Bk;
        b.qt = sub_base + sidx * t.sub_elems;
        b.ot = b.qt + b.D * Bq;
        b.m = b.ot + b.Dv * Bq;
        b.l = b.m + Bq;
        b.st = st;
        b.rel_begin = rel_begin;
        b.rel_end = rel_end;
        b.k = static_cast<const float*>(p.k) + task.batch * p.k_batch_stride + kv_head * p.k_head_stride;
        b.v = static_cast<const float*>(p.v) + task.batch * p.v_batch_stride + kv_head * p.v_head_stride;
        b.k_stride = p.k_row_stride;
        b.v_stride = p.v_row_stride;
        b.head = task.head + sidx / row_blocks;
        b.row_begin = task.row_begin + (sidx % row_blocks) * Bq;
        b.rows = task.row_end - b.row_begin < Bq ? task.row_end - b.row_begin : Bq;
        b.seqlen_k = batch_seqlen_k(p, task.batch);
        const float* q = static_cast<const float*>(p.q) + task.batch * p.q_batch_stride + b.head * p.q_head_stride;
        init_sub_block(p, b, q);
        if (sidx == 0 || b.first.begin < kv_begin) kv_begin = b.first.begin;
        if (sidx == 0 || b.last.end > kv_end) kv_end = b.last.end;
    }

    for (int64_t super = kv_begin; super < kv_end; super += t.super_keys) {
        const int64_t super_end = super + t.super_keys < kv_end ? super + t.super_keys : kv_end;
        int64_t covered = super;  // keys of this super-tile some earlier sub-block has read
        for (int64_t sidx = 0; sidx < subs; ++sidx) {
            const Block& b = blocks[sidx];
            const int64_t lo = b.first.begin, hi = b.last.end < super_end ? b.last.end : super_end;
            int64_t tile = super;
            if (lo > tile) tile += round_down(lo - tile, t.Bk);  // skip tiles before the range
            for (; tile < hi; tile += t.Bk) {
                const int64_t keys = hi - tile < t.Bk ? hi - tile : t.Bk;
                // Prefetch the next tile unless an earlier sub-block already brought it in.
                int64_t next_keys = 0;
                if (t.prefetch && tile + t.Bk >= covered) {
                    const int64_t after = kv_end - (tile + t.Bk);
                    next_keys = after <= 0 ? 0 : (after < t.Bk ? after : t.Bk);
                }
                attend_sub_tile(p, b, tile, keys, next_keys);
            }
            if (hi > covered) covered = hi;
        }
    }
    for (int64_t sidx = 0; sidx < subs; ++sidx) finish_sub_block(p, blocks[sidx], task.batch);
}

}  // namespace neon
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
