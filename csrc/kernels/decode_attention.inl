// Decode: a short query (decode.cpp: runs_on_decode_path) against a long KV cache, compiled
// by every ISA file with its own flags, inside its per-ISA namespace; and the template
// prefill, the same loop over one block of query rows at a time. Uses attention_core.inl's
// parts (exp2_acc, log_acc, neg_inf, max_of, RowOptions, KeyRows, RowScales, softmax_block),
// storage.hpp's conversions and the typed vector layer (csrc/simd/typed.hpp).
//
// Decoding is bandwidth-bound: each cached K/V byte is used by only (H / Hkv) * Tq query
// rows. So one task takes one chunk of keys of one (batch, kv head) and serves all the query
// rows of that KV head with one pass over K (scores into a small per-chunk buffer), a
// softmax per row, and one pass over V; decode_merge (or the driver's shared-prefix merge)
// then combines the chunks. The loop is written once (decode_loop, with its online-softmax
// step softmax_block) over an arithmetic policy: TemplatePath here (plain C++, every tier,
// float64), the hand-written ones in simd_decode.inl, bf16_decode.inl and vnni_decode.inl.
//
// No std:: templates here (see attention_core.inl).
#pragma once
#include "attention_core.inl"
#include "../simd/typed.hpp"

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {

constexpr int kLanes = 16;  // partial sums kept per reduction, so reductions vectorise

// Sums the kLanes partial sums pairwise in a fixed tree (vectorises, fixed order).
// (Spelled out level by level: constant trip counts let the compiler keep it in registers.)
static_assert(kLanes == 16, "the reduction trees below are written for 16 lanes");
template <class A>
inline A reduce_sum_lanes(A* __restrict part) {
    for (int u = 0; u < 8; ++u) part[u] += part[u + 8];
    for (int u = 0; u < 4; ++u) part[u] += part[u + 4];
    for (int u = 0; u < 2; ++u) part[u] += part[u + 2];
    return part[0] + part[1];
}

template <class A>
inline A reduce_max_lanes(A* __restrict part) {
    for (int u = 0; u < 8; ++u) part[u] = max_of(part[u], part[u + 8]);
    for (int u = 0; u < 4; ++u) part[u] = max_of(part[u], part[u + 4]);
    for (int u = 0; u < 2; ++u) part[u] = max_of(part[u], part[u + 2]);
    return max_of(part[0], part[1]);
}

static_assert(kDecodeVectorBytes % ATTNFAST_SIMD_BYTES == 0, "query rows are padded to whole vectors");

#pragma GCC diagnostic push
#if defined(__clang__)
#pragma GCC diagnostic ignored "-Wunknown-warning-option"
#endif
#pragma GCC diagnostic ignored "-Wpsabi"  // all inlined: no vector crosses a call boundary

// Query rows one micro-kernel call serves, each with its own accumulators in registers.
constexpr int kRowBlock = 4;
// Vectors of output columns per row the V micro-kernel keeps in registers: kRowBlock x 4
// with AVX-512's 32 registers, kRowBlock x 2 with 16.
constexpr int kValueVecs = ATTNFAST_SIMD_BYTES >= 64 ? 4 : 2;
// Keys per V sub-block: small enough (32 x Dv) to stay in L1 while every row block and
// column tile walks it.
constexpr int64_t kValueSubKeys = 32;

// s[r * s_stride] = q[r] . k for NR query rows (q rows q_stride apart, zero-padded from D to
// q_stride, a multiple of the vector lanes): each K vector is loaded once for all NR rows;
// each row sums in one vector of lanes, reduced in a fixed tree.
template <int NR, class A, class T>
inline void dot_rows(const A* __restrict q, int64_t q_stride, const T* __restrict k, int64_t D,
                     A* __restrict s, int64_t s_stride) {
    constexpr int64_t L = vec_lanes<A>();
    Vec<A> part[NR];
    for (int r = 0; r < NR; ++r) part[r] = Vec<A>{};
    int64_t d = 0;
    for (; d + L <= D; d += L) {
        const Vec<A> kv = vload_row(k, d);
        for (int r = 0; r < NR; ++r) part[r] += vload(q + r * q_stride + d) * kv;
    }
    if (d < D) {  // the last D % L elements: a zero-filled vector (never reads past the row)
        A tail[L] = {};
        for (int64_t e = d; e < D; ++e) tail[e - d] = static_cast<A>(kv_value(k, e));
        const Vec<A> kv = vload(tail);
        for (int r = 0; r < NR; ++r) part[r] += vload(q + r * q_stride + d) * kv;
    }
    for (int r = 0; r < NR; ++r) s[r * s_stride] = vsum(part[r]);
}

// acc[r][c*L ..] += sum_{j0 <= j < j1} p[r][j] * v[j][col + c*L ..] for NR rows and NV
// vectors of columns (acc rows acc_stride apart, p rows p_stride apart); accumulators in
// registers.
template <int NR, int NV, class A, class T>
inline void pv_tile(A* __restrict acc, int64_t acc_stride, const A* __restrict p,
                    int64_t p_stride, const T* __restrict v, int64_t col, int64_t v_stride,
                    int64_t j0, int64_t j1) {
    constexpr int64_t L = vec_lanes<A>();
    Vec<A> a[NR][NV];
    for (int r = 0; r < NR; ++r)
        for (int c = 0; c < NV; ++c) a[r][c] = vload(acc + r * acc_stride + c * L);
    for (int64_t j = j0; j < j1; ++j) {
        const T* vrow = v + j * v_stride;
        Vec<A> vv[NV];
        for (int c = 0; c < NV; ++c) vv[c] = vload_row(vrow, col + c * L);
        for (int r = 0; r < NR; ++r) {
            const A pr = p[r * p_stride + j];
            for (int c = 0; c < NV; ++c) a[r][c] += pr * vv[c];
        }
    }
    for (int r = 0; r < NR; ++r)
        for (int c = 0; c < NV; ++c) vstore(acc + r * acc_stride + c * L, a[r][c]);
}

// The same for all Dv columns: wide tiles, single vectors, then the last columns one by one.
template <int NR, class A, class T>
inline void pv_rows(A* __restrict acc, int64_t Dv, const A* __restrict p, int64_t p_stride,
                    const T* __restrict v, int64_t v_stride, int64_t j0, int64_t j1) {
    constexpr int64_t L = vec_lanes<A>();
    int64_t e0 = 0;
    for (; e0 + kValueVecs * L <= Dv; e0 += kValueVecs * L)
        pv_tile<NR, kValueVecs>(acc + e0, Dv, p, p_stride, v, e0, v_stride, j0, j1);
    for (; e0 + L <= Dv; e0 += L) pv_tile<NR, 1>(acc + e0, Dv, p, p_stride, v, e0, v_stride, j0, j1);
    if (e0 == Dv) return;
    for (int r = 0; r < NR; ++r)
        for (int64_t j = j0; j < j1; ++j) {
            const A pr = p[r * p_stride + j];
            const T* vrow = v + j * v_stride;
            for (int64_t e = e0; e < Dv; ++e) acc[r * Dv + e] += pr * static_cast<A>(kv_value(vrow, e));
        }
}
#pragma GCC diagnostic pop

template <class A>
inline A range_max(const A* __restrict x, int64_t n) {
    A part[kLanes];
    for (int u = 0; u < kLanes; ++u) part[u] = neg_inf<A>();
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes)
        for (int u = 0; u < kLanes; ++u) part[u] = max_of(part[u], x[j + u]);
    for (int u = 0; j + u < n; ++u) part[u] = max_of(part[u], x[j + u]);
    return reduce_max_lanes(part);
}

// x[j] = 2^(x[j] - m) for j < n; returns the sum.
template <class A>
inline A range_exp_sum(A* __restrict x, int64_t n, A m) {
    A part[kLanes];
    for (int u = 0; u < kLanes; ++u) part[u] = 0;
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes)
        for (int u = 0; u < kLanes; ++u) {
            const A e = SoftmaxBase<A>::exp(x[j + u] - m);
            x[j + u] = e;
            part[u] += e;
        }
    for (int u = 0; j + u < n; ++u) {
        const A e = SoftmaxBase<A>::exp(x[j + u] - m);
        x[j + u] = e;
        part[u] += e;
    }
    return reduce_sum_lanes(part);
}

// acc[e] += w * v[e].
template <class A, class T>
inline void axpy(A* __restrict acc, A w, const T* __restrict v, int64_t n) {
    for (int64_t e = 0; e < n; ++e) acc[e] += w * load_acc<A>(v[e]);
}

// Runs fn<NR>(row_begin) over n rows in blocks of kRowBlock, then one block of n % kRowBlock.
template <class Fn>
inline void for_row_blocks(int64_t n, Fn&& fn) {
    int64_t rb = 0;
    for (; rb + kRowBlock <= n; rb += kRowBlock) fn.template run<kRowBlock>(rb);
    switch (n - rb) {
        case 3: fn.template run<3>(rb); break;
        case 2: fn.template run<2>(rb); break;
        case 1: fn.template run<1>(rb); break;
        default: break;
    }
}

template <class T, class A>
struct ScoreRows {  // scores of n query rows against one key row
    const A* qs; int64_t qs_stride; const T* krow; int64_t D; A* s; int64_t ss;
    template <int NR> void run(int64_t rb) const {
        dot_rows<NR>(qs + rb * qs_stride, qs_stride, krow, D, s + rb * ss, ss);
    }
};

template <class T, class A>
struct AddValueRows {  // acc rows += probabilities x value rows, for one block of keys
    A* acc; int64_t Dv; const A* s; int64_t ss; const T* v; int64_t v_stride; int64_t j0, j1;
    template <int NR> void run(int64_t rb) const {
        pv_rows<NR>(acc + rb * Dv, Dv, s + rb * ss, ss, v, v_stride, j0, j1);
    }
};

// How decode_loop does its arithmetic, as a policy (simd_decode.inl's WidenPath, Bf16Path
// and VnniPath are the hand-written ones). This one, the shared template, runs on every tier
// and for float64: plain C++ over the typed vectors (simd/typed.hpp), any D and Dv, each
// key's row dotted with every query row (dot_rows), the softmax in scalar exp.
//   Acc            the accumulator type (float, or double for float64)
//   Q, KV          the types of q and of the stored K/V rows
//   kScoreKeys     keys per scores() call
//   kTunedStreams  whether the loop's pipelined / small-L2 streams apply (see decode_loop)
//   kSpreadPrefetch  whether values() takes the rows to prefetch (a RowPrefetch) and
//                  spreads them over its V keys; else decode_loop issues them before it
//   kPairedValues  whether values() adds keys two at a time (vdpbf16ps), pairs counted from
//                  the block's first key; it then also takes a `partner`: the V row of the
//                  key after the run where a run ends mid-pair (see decode_loop)
//   kRowValues     whether the Path reads a whole block's V rows itself by row pointer
//                  (block_values) instead of values() over runs of rows
//   kScaleFold     what the widened K/V lanes leave in the row scales (stored = fold x lanes)
//   query_stride   workspace elements per staged query row; stage_query stages one
//   scores         scores of keys [j, j + nk) for the n staged rows (with vj set, one row
//                  per key prefetched first: vj + j * vsb, v_row_bytes each; decode_loop
//                  passes the keys' V rows, or a paged cache's K rows further on)
//   score_options  softcap, ALiBi and mask on one row's scores [b, e)
//   range_max, exp_shift_zero   the softmax's two passes over a row's block of scores
//   weights_ready  a row's probabilities of one block are final (a layout change may follow)
//   values         acc rows += probabilities x `keys` V rows (+ kpf, with kSpreadPrefetch);
//                  finish: the chunk is done
template <class TQ, class T, class A>
struct TemplatePath {
    using Acc = A;
    using Q = TQ;
    using KV = T;
    static constexpr int64_t kScoreKeys = kDecodeKeyBlock;  // one call per run of keys
    static constexpr bool kTunedStreams = false;
    static constexpr bool kSpreadPrefetch = false;
    static constexpr bool kPairedValues = false;
    static constexpr bool kRowValues = false;
    static constexpr float kScaleFold = 1.0f;
    static int64_t query_stride(const AttentionParams& p) { return decode_query_stride(p); }
    static void stage_query(A* qs, const TQ* qrow, int64_t D, A scale) {
        constexpr int64_t lanes = kDecodeVectorBytes / static_cast<int64_t>(sizeof(A));
        for (int64_t d = 0; d < D; ++d) qs[d] = load_acc<A>(qrow[d]) * scale;
        for (int64_t d = D; d < (D + lanes - 1) / lanes * lanes; ++d) qs[d] = 0;  // dot_rows reads it
    }
    static void scores(int64_t n, const A* qs, int64_t qstride, const T* kj, int64_t ks,
                       int64_t nk, int64_t D, A* sj, int64_t ss, const char* vj, int64_t vsb,
                       int64_t v_row_bytes, A /*scale: in the staged rows*/) {
        for (int64_t j = 0; j < nk; ++j) {
            if (vj)
                for (int64_t off = 0; off < v_row_bytes; off += 64) __builtin_prefetch(vj + j * vsb + off, 0, 2);
            for_row_blocks(n, ScoreRows<T, A>{qs, qstride, kj + j * ks, D, sj + j, ss});
        }
    }
    static void score_options(const AttentionParams& p, int64_t batch, int64_t head, int64_t pos,
                              int64_t seqlen_k, A* srow, int64_t b, int64_t e, int64_t key0) {
        RowOptions<A>(p, batch, head, pos, seqlen_k).apply(srow + b, key0 + b, e - b);
    }
    static A range_max(const A* x, int64_t b, int64_t e) { return attnfast::ATTNFAST_KERNEL_NS::range_max(x + b, e - b); }
    static A exp_shift_zero(A* x, int64_t n, int64_t b, int64_t e, A m) {
        for (int64_t c = 0; c < b; ++c) x[c] = 0;
        for (int64_t c = e; c < n; ++c) x[c] = 0;
        return range_exp_sum(x + b, e - b, m);
    }
    static void weights_ready(A*, int64_t) {}
    static void values(int64_t n, A* acc, int64_t Dv, const A* s_block, int64_t ss, int64_t c0,
                       const T* vrun, int64_t vs, int64_t keys) {
        for_row_blocks(n, AddValueRows<T, A>{acc, Dv, s_block + c0, ss, vrun, vs, 0, keys});
    }
    static void finish(A*, int64_t, int64_t) {}
};

// Keys per call of the V pass when one row block holds every row (see decode_loop). With
// 16-byte vectors 32: the SSE2 (generic) tier on Zen 4, float32 8/8 heads, L = 16k / 64k,
// ran 1.3x / 1.3x faster on one thread and 1.1x / 1.1x on two than with 128 (HISTORY 32);
// NEON follows the width, not measured (qemu only).
constexpr int64_t kValueRunKeys = ATTNFAST_SIMD_BYTES >= 32 ? 128 : 32;
// With two or more query rows per KV head (see decode_loop): keys per block, and keys per
// call of the V pass, each call preceded by the prefetch of as many of the next block's K rows.
constexpr int64_t kPipelinedKeyBlock = 128;
constexpr int64_t kPipelinedValueRun = 16;
// float32 K/V on a core whose L2 is below kSmallL2Bytes (AMD Zen 3: 512 KiB), where the
// streams above measured slower (bench/HISTORY.md 24, tier avx2): one row reads each block's
// K and then its V as two plain streams (no V prefetch during the K pass, V runs of
// kSmallL2ValueRun keys), and two or more rows pipeline blocks of kSmallL2PipelinedBlock keys
// with one V run per block. 16-bit K/V read by one row take the plain streams too (Zen 3,
// bfloat16, 8/8 heads, medians: 61.5-63 -> 63.5-66.5 % of the read kernel on one thread,
// 62.5-63 -> 70-73 % on two; HISTORY.md 28.1); with more rows they keep the pipelined blocks (measured slower with
// the small ones). The 1-2 MiB L2 of Zen 4 and Emerald Rapids keep the passes above, measured
// faster there (RESULTS 13.4, 14.1).
constexpr int64_t kSmallL2Bytes = 1 << 20;
constexpr int64_t kSmallL2ValueRun = 16;
constexpr int64_t kSmallL2PipelinedBlock = 32;
// One row over a contiguous cache on an AVX-512 tier, Dv = kPlainRowValueCols: the plain
// streams too, at any L2 size and for every storage type. The hardware prefetcher streams K,
// then V, at up to the read limit, and one key scored at a time (simd_decode::OneKeyScores)
// keeps up with it: AMD Zen 4, 8/8 heads, D = 128, L = 16k / 64k, one thread, against the V
// prefetch: float32 1.07-1.23x, bfloat16 / float16 1.31-1.46x, int8 1.18-1.51x (HISTORY 36-37). Only
// there: the one-row V tile of these Paths is 128 columns, and a V row read in several
// passes (D = 64: four of one vector; D = 256: two tiles) from memory rather than from L2
// measured 0.67-0.93x. A paged pool: see kPagedAheadBytes.
constexpr bool kPlainRowStreams = ATTNFAST_SIMD_BYTES >= 64;
constexpr int64_t kPlainRowValueCols = 128;
// A paged cache on those streams: each block of a KV head is a run the hardware prefetcher
// follows, but it cannot guess the next block. Where a KV head's block holds at most
// kPagedAheadMaxBlockBytes, each scored key (K pass) and each added key (V pass) starts the
// row kPagedAheadBytes further on (rounded up to whole blocks: the same row of a later block)
// towards L2. AMD Zen 4, 8/8 heads, D = 128, L = 16k, scattered blocks, one thread: block 16
// float32 / bfloat16 (8 / 4 KiB) 0.35-0.37 -> 0.54-0.59 of the read kernel, block 32 / 64 1.1-1.7x;
// two threads 1.2-1.6x. A native probe reading scattered 8 KiB blocks in a random order peaks
// at 0.63 of the read kernel with any prefetch distance (0.37 without), so block 16 is near
// what the machine does. Larger blocks stream well without it (block 128 float32 = 64 KiB:
// 0.91x with it; block 256: 0.80x) and take the plain streams alone: 1.1-1.3x the V prefetch
// beside K they had before (HISTORY 38).
constexpr int64_t kPagedAheadMaxBlockBytes = 32 * 1024;
constexpr int64_t kPagedAheadBytes = 16 * 1024;

// Rows first, first + stride, .. (`rows` of them, row_bytes each) to start towards L2 (see
// decode_loop: a Path with kSpreadPrefetch spreads them over its V pass).
struct RowPrefetch {
    const char* first = nullptr;
    int64_t stride = 0;
    int64_t rows = 0;
    int64_t row_bytes = 0;
};

inline void prefetch_rows(const RowPrefetch& rows) {  // all of them now
    for (int64_t x = 0; x < rows.rows; ++x)
        for (int64_t off = 0; off < rows.row_bytes; off += 64) __builtin_prefetch(rows.first + x * rows.stride + off, 0, 2);
}

// Rows [first, last) of `rows` (a KeyRows or ListedRows) started towards L2, each row_bytes long.
template <class Rows>
inline void prefetch_rows(const Rows& rows, int64_t first, int64_t last, int64_t row_bytes) {
    for (int64_t x = first; x < last; ++x) {
        const char* row = reinterpret_cast<const char*>(rows.at(x));
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(row + off, 0, 2);
    }
}

// The decode loop: one chunk of keys, [task.key_begin, task.key_end), of one (batch, kv head)
// for all its (H / Hkv) x Tq query rows, with the arithmetic of Path (above). Writes the
// chunk's unnormalised acc (rows x Dv), row max m (base 2) and row sum l (decode_merge
// finishes them). Src: where the task's K and V rows lie: KeyRows (contiguous or paged), or
// ListedRows (an indexed task's rows, read in place; for a Path whose scores() and values()
// take a ListedRun: simd_decode's WidenPath).
// Rows go in groups of kDecodeGroupRows; for each group, blocks of keys: one pass over the
// block's K rows writes every row's scores, then per row the key scales, the NaN rule, the
// score options and the online softmax, then one pass over the block's V rows.
template <class Path, class Src = KeyRows<typename Path::KV>>
void decode_loop(const AttentionParams& p, const DecodeTask& task, typename Path::Acc* workspace,
                 typename Path::Acc* acc, typename Path::Acc* m, typename Path::Acc* l) {
    using A = typename Path::Acc;
    using TQ = typename Path::Q;
    using T = typename Path::KV;
    constexpr bool kListed = !__is_same(Src, KeyRows<T>);
    const int64_t D = p.head_dim, Dv = p.head_dim_v, tq = p.seqlen_q;
    const int64_t group = p.heads / p.kv_heads;
    const int64_t rows = group * tq;
    const int64_t keys = task.key_end - task.key_begin;
    const int64_t ss = kDecodeScoreStride;
    static_assert(kDecodeScoreStride >= kDecodeKeyBlock + 16, "score rows hold a block plus one vector");

    const int64_t qstride = Path::query_stride(p);
    A* qs = workspace;
    A* s = qs + kDecodeGroupRows * qstride;
    // int8 / float8 cache: one block's K and V row scales, contiguous (see decode_workspace_elems)
    A* k_scale_block = s + kDecodeGroupRows * ss;
    A* v_scale_block = k_scale_block + kDecodeKeyBlock;
    int64_t lo[kDecodeGroupRows], hi[kDecodeGroupRows];  // each row's visible keys, chunk-relative

    const TQ* q = static_cast<const TQ*>(p.q) + task.batch * p.q_batch_stride;
    // K/V rows and row scales by key position (kb + chunk-relative key): one run, or one per
    // block of a paged cache; each group of keys below stays within one run.
    const KeyRows<T> k_rows = key_rows<T>(p, p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride,
                                          task.batch, task.kv_head);
    const KeyRows<T> v_rows = key_rows<T>(p, p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride,
                                          task.batch, task.kv_head);
    const ListedRows<T> k_listed{{k_rows.base, k_rows.row_stride, task.rows}};  // (listed: a contiguous cache)
    const ListedRows<T> v_listed{{v_rows.base, v_rows.row_stride, task.rows}};
    const Src& k = source_of<Src>(k_rows, k_listed);
    const Src& v = source_of<Src>(v_rows, v_listed);
    const RowScales k_scale = row_scales(p, p.k_scale, p.k_scale_batch_stride, p.k_scale_head_stride,
                                         p.k_scale_row_stride, task.batch, task.kv_head);
    const RowScales v_scale = row_scales(p, p.v_scale, p.v_scale_batch_stride, p.v_scale_head_stride,
                                         p.v_scale_row_stride, task.batch, task.kv_head);
    const int64_t kb = task.key_begin;
    const A scale = static_cast<A>(p.scale * SoftmaxBase<A>::kUnit);  // (the softmax's base)
    const int64_t v_row_bytes = kv_row_bytes<T>(Dv);
    const bool options = p.softcap > 0 || p.alibi_slopes || p.mask;

    for (int64_t r0 = 0; r0 < rows; r0 += kDecodeGroupRows) {
        const int64_t n = rows - r0 < kDecodeGroupRows ? rows - r0 : kDecodeGroupRows;
        // Each key's V row is started towards L2 just before its K row is read, so the V
        // stream is fetched alongside K instead of after it (measured on one core of an AMD
        // EPYC: +30 % GB/s; the hardware prefetcher alone stalls at each switch of streams).
        // One query row (8/8 heads): blocks of kDecodeKeyBlock keys. The K pass, with the V
        // rows prefetched beside it, streams at the memory rate and the V pass reads V from L2
        // in runs of kValueRunKeys (longer runs measured faster than 32: Zen 4, tier avx2,
        // +5-15 % GB/s; RESULTS 13.4). A contiguous cache on AVX-512 reads K, then V,
        // without it (kPlainRowStreams).
        // Two or more rows (GQA: 32/8 heads): each key costs rows x (D + Dv) FMAs, on one core
        // more than half the memory time, and DRAM would sit idle during the V pass. So the
        // passes are pipelined: short blocks, and each V run first prefetches as many of the
        // next block's K rows (the task's keys first, then the head's next keys, which a
        // following task of this thread reads), so memory streams while the FMAs run; the
        // next K pass then finds its rows in L2. The hand-written Paths (kSpreadPrefetch) issue
        // those K lines inside the V pass, a few per V key, instead of as one burst before it:
        // with the burst the one-core speed depended on where the build placed the loops (Zen 4,
        // float32 32/8: 55 % or 67 % of the read limit from the same source); spread, each x86
        // tier moves by 1-5 % between the two layouts tried (the burst: 1.3x), at 1.1-1.5x the
        // burst's slow placements and 0.9x its fast one (HISTORY 34). The pipelining itself, measured
        // on Zen 4 (RESULTS 14.1), at 32/8 heads: one core +18-43 % (float32, both x86
        // tiers), +48 % (bfloat16); two cores +4-23 %; at 16/8 and 64/8 +5-28 % on one core,
        // within noise on two. At one row within noise, and with an int8 cache (a quarter of the bytes per key, so the
        // widening arithmetic, not memory, bounds it) 8-21 % slower: neither is pipelined.
        // (Run lengths change no addition, so no bits; the block length changes the online
        // softmax's rescaling points, the same for any thread count.)
        // (The small-L2 choice, a property of the machine, is the same for any thread count.)
        // (Path::kTunedStreams: these streams were tuned on the hand-written policies; the
        // template's per-key dot products keep one long block with V prefetched beside K and
        // the V pass in L1-sized runs of kValueSubKeys.)
        const bool pipelined = Path::kTunedStreams && n >= 2 && sizeof(T) >= 2;
        const bool small_l2 = Path::kTunedStreams && (sizeof(T) == 4 || (sizeof(T) == 2 && n == 1)) &&
                              cache_sizes().l2 < kSmallL2Bytes;
        // (Listed rows lie anywhere: no hardware prefetcher follows them.)
        const bool plain_row = !kListed && Path::kTunedStreams && kPlainRowStreams && n == 1 && Dv == kPlainRowValueCols;
        const bool prefetch_v = (pipelined || !small_l2) && !plain_row;
        const int64_t key_block = !pipelined ? kDecodeKeyBlock : (small_l2 ? kSmallL2PipelinedBlock : kPipelinedKeyBlock);
        const int64_t value_keys = !Path::kTunedStreams ? kValueSubKeys
                                 : pipelined ? (small_l2 ? kSmallL2PipelinedBlock : kPipelinedValueRun)
                                             : (small_l2 ? kSmallL2ValueRun : (n <= 4 ? kValueRunKeys : kValueSubKeys));
        const int64_t prefetch_end = task.seqlen_k - kb;  // chunk-relative end of the head's keys
        const int64_t k_row_bytes = kv_row_bytes<T>(D);
        // Rows ahead (whole blocks) that a paged cache's plain streams prefetch, or 0.
        int64_t ahead = 0;
        if (plain_row && p.block_table && p.block_size * k_row_bytes <= kPagedAheadMaxBlockBytes &&
            p.block_size * v_row_bytes <= kPagedAheadMaxBlockBytes) {
            const int64_t rows_ahead = (kPagedAheadBytes + k_row_bytes - 1) / k_row_bytes;
            ahead = (rows_ahead + p.block_size - 1) / p.block_size * p.block_size;
        }
        int64_t used_lo = keys, used_hi = 0;
        for (int64_t rr = 0; rr < n; ++rr) {
            const int64_t r = r0 + rr;
            const int64_t head = task.kv_head * group + r / tq, pos = r % tq;
            const TQ* qrow = q + head * p.q_head_stride + pos * p.q_row_stride;
            Path::stage_query(qs + rr * qstride, qrow, D, scale);
            const KeyRange vis = visible_keys(p, pos, task.seqlen_k);
            const int64_t b = vis.begin > task.key_begin ? vis.begin : task.key_begin;
            const int64_t e = vis.end < task.key_end ? vis.end : task.key_end;
            lo[rr] = b - task.key_begin;
            hi[rr] = e > b ? e - task.key_begin : lo[rr];
            if (lo[rr] < hi[rr]) {
                used_lo = lo[rr] < used_lo ? lo[rr] : used_lo;
                used_hi = hi[rr] > used_hi ? hi[rr] : used_hi;
            }
            A* acc_row = acc + r * Dv;
            for (int64_t e2 = 0; e2 < Dv; ++e2) acc_row[e2] = 0;
            m[r] = neg_inf<A>();
            l[r] = 0;
        }

        for (int64_t j0 = used_lo; j0 < used_hi; j0 += key_block) {
            const int64_t j1 = j0 + key_block < used_hi ? j0 + key_block : used_hi;
            // Scores, kScoreKeys keys at a time for every row. One row per scored key starts
            // towards the cache: that key's V row (prefetch_v), or the K row `ahead` on (its
            // block's run ends with the scored keys' run: same offset, whole blocks on).
            const int64_t k_stride_bytes = k_rows.row_stride * static_cast<int64_t>(sizeof(T));
            const int64_t v_stride_bytes = v_rows.row_stride * static_cast<int64_t>(sizeof(T));
            for (int64_t j = j0, nk = 0; j < j1; j += nk) {
                nk = k.run_end(kb + j, kb + (j1 - j < Path::kScoreKeys ? j1 : j + Path::kScoreKeys)) - kb - j;
                if constexpr (kListed) {  // the keys' V rows, then their scores
                    prefetch_rows(v, kb + j, kb + j + nk, v_row_bytes);
                    Path::scores(n, qs, qstride, k.run(kb + j), nk, D, s + (j - j0), ss, scale);
                } else {
                    RowPrefetch pf;  // none, or one row per scored key: V beside K, or K `ahead` on
                    if (prefetch_v)
                        pf = RowPrefetch{reinterpret_cast<const char*>(v.at(kb + j)), v_stride_bytes, nk, v_row_bytes};
                    else if (ahead && j + ahead + nk <= prefetch_end)
                        pf = RowPrefetch{reinterpret_cast<const char*>(k.at(kb + j + ahead)), k_stride_bytes, nk,
                                         k_row_bytes};
                    Path::scores(n, qs, qstride, k.at(kb + j), k.row_stride, nk, D, s + (j - j0), ss, pf.first,
                                 pf.stride, pf.row_bytes, scale);
                }
            }
            if (k_scale.scale)  // one block's scales, gathered once for all rows
                for (int64_t c = 0; c < j1 - j0; ++c) {  // (kScaleFold: a power of two, exact)
                    k_scale_block[c] = k_scale.at(k.position(kb + j0 + c)) * Path::kScaleFold;
                    v_scale_block[c] = v_scale.at(k.position(kb + j0 + c)) * Path::kScaleFold;
                }

            for (int64_t rr = 0; rr < n; ++rr) {
                const int64_t r = r0 + rr;
                A* srow = s + rr * ss;  // column c is key j0 + c
                const int64_t b = (lo[rr] > j0 ? lo[rr] : j0) - j0;
                const int64_t e = (hi[rr] < j1 ? hi[rr] : j1) - j0;
                if (k_scale.scale)  // int8 K: the score of key j is k_scale[j] * (q . k_int8[j])
                    for (int64_t c = b; c < e; ++c) srow[c] *= k_scale_block[c];
                nonfinite_to_nan(srow + b, e - b);  // -inf from an infinite input: NaN
                if (options && b < e) {
                    const int64_t head = task.kv_head * group + r / tq, pos = r % tq;
                    Path::score_options(p, task.batch, head, pos, task.seqlen_k, srow, b, e, task.key_begin + j0);
                }
                if (!softmax_block<Path>(srow, j1 - j0, b, e, m[r], l[r], acc + r * Dv, Dv)) {
                    Path::weights_ready(srow, j1 - j0);  // sees nothing in this block: weight 0
                    continue;
                }
                if (v_scale.scale)  // int8 V: the weight of v_int8[j] is p[j] * v_scale[j]
                    for (int64_t c = b; c < e; ++c) srow[c] *= v_scale_block[c];
                Path::weights_ready(srow, j1 - j0);
            }

            if constexpr (kListed) {
                // The block's listed V rows in runs of value_keys, each run first starting as
                // many of the next block's K rows (pipelined) towards L2.
                for (int64_t v0 = j0; v0 < j1; v0 += value_keys) {
                    const int64_t v1 = v0 + value_keys < j1 ? v0 + value_keys : j1;
                    if (pipelined) {
                        const int64_t x0 = j1 + (v0 - j0), x1 = j1 + (v1 - j0);
                        prefetch_rows(k, kb + x0, kb + (x1 < prefetch_end ? x1 : prefetch_end), k_row_bytes);
                    }
                    Path::values(n, acc + r0 * Dv, Dv, s, ss, v0 - j0, v.run(kb + v0), v1 - v0);
                }
            } else if constexpr (Path::kRowValues) {
                // The Path reads the block's V rows itself, each by its row pointer (and starts
                // the rows `ahead` on towards L2, as below).
                Path::block_values(n, acc + r0 * Dv, Dv, s, ss, v, kb + j0, j1 - j0, ahead, kb + prefetch_end);
            } else {
                // (A paged cache's block ends cut the sub-blocks further: same keys, same order.)
                for (int64_t v0 = j0, v1 = j0; v0 < j1; v0 = v1) {
                    v1 = v.run_end(kb + v0, kb + (v0 + value_keys < j1 ? v0 + value_keys : j1)) - kb;
                    // A paired Path adds keys (j0, j0 + 1), (j0 + 2, j0 + 3), .. as over one
                    // contiguous run, whatever the block ends: a run that ends mid-pair lends its
                    // last key the next key's V row (the partner), and the next run starts after it.
                    // Same pairs, same bits as a contiguous cache; no weight outside the block is read.
                    const T* partner = nullptr;
                    if constexpr (Path::kPairedValues)
                        if (((v1 - j0) & 1) && v1 < j1) partner = v.at(kb + v1);
                    RowPrefetch kpf;  // rows to start towards L2 during this V run
                    if (ahead && v1 + ahead <= prefetch_end)  // the V rows `ahead` on (one run: whole blocks on)
                        kpf = RowPrefetch{reinterpret_cast<const char*>(v.at(kb + v0 + ahead)), v_stride_bytes,
                                          v1 - v0, v_row_bytes};
                    if (pipelined) {
                        const int64_t x0 = j1 + (v0 - j0), x1 = j1 + (v1 - j0);
                        const int64_t xe = x1 < prefetch_end ? x1 : prefetch_end;
                        if constexpr (Path::kSpreadPrefetch) {
                            if (x0 < xe && k.run_end(kb + x0, kb + xe) == kb + xe)
                                kpf = RowPrefetch{reinterpret_cast<const char*>(k.at(kb + x0)),
                                                  k.row_stride * static_cast<int64_t>(sizeof(T)), xe - x0, k_row_bytes};
                            else
                                prefetch_rows(k, kb + x0, kb + xe, k_row_bytes);
                        } else {
                            prefetch_rows(k, kb + x0, kb + xe, k_row_bytes);
                        }
                    }
                    if constexpr (Path::kPairedValues) {
                        Path::values(n, acc + r0 * Dv, Dv, s, ss, v0 - j0, v.at(kb + v0), v.row_stride, v1 - v0, kpf,
                                     partner);
                        if (partner) ++v1;  // its key is done
                    } else if constexpr (Path::kSpreadPrefetch) {
                        Path::values(n, acc + r0 * Dv, Dv, s, ss, v0 - j0, v.at(kb + v0), v.row_stride, v1 - v0, kpf);
                    } else {
                        prefetch_rows(kpf);
                        Path::values(n, acc + r0 * Dv, Dv, s, ss, v0 - j0, v.at(kb + v0), v.row_stride, v1 - v0);
                    }
                }
            }
        }
    }
    Path::finish(acc, rows, Dv);
}

// Finishes the rows of one (batch, kv head) from its chunks' (acc, m, l), m in base 2: out,
// and lse in natural-log units. T: type of out (that of q).
template <class T, class A>
void decode_merge(const AttentionParams& p, int64_t batch, int64_t kv_head, int64_t chunks,
                  const A* acc, const A* m, const A* l, A* workspace) {
    const int64_t Dv = p.head_dim_v, tq = p.seqlen_q;
    const int64_t group = p.heads / p.kv_heads;
    const int64_t rows = group * tq;
    T* out = static_cast<T*>(p.out) + batch * p.out_batch_stride;
    A* lse = static_cast<A*>(p.lse);
    if (lse) lse += batch * p.lse_batch_stride;
    A* sum = workspace;  // Dv

    for (int64_t r = 0; r < rows; ++r) {
        const int64_t head = kv_head * group + r / tq, pos = r % tq;
        T* orow = out + head * p.out_head_stride + pos * p.out_row_stride;
        A* lse_at = lse ? lse + head * p.lse_head_stride + pos * p.lse_row_stride : nullptr;
        // A chunk whose l is 0 saw no key (a NaN l, from a NaN score, counts: it makes the
        // row NaN, whatever its m); the prefill's finish tests the same.
        A top = neg_inf<A>();
        bool seen = false;
        for (int64_t c = 0; c < chunks; ++c)
            if (l[c * rows + r] != A(0)) {
                top = max_of(top, m[c * rows + r]);
                seen = true;
            }
        if (!seen) {  // the row sees no key: zeros and -inf (the sink's logit with sinks),
                      // never NaN
            for (int64_t e = 0; e < Dv; ++e) orow[e] = store_from_acc<T>(A(0));
            if (lse_at) *lse_at = p.sinks ? static_cast<A>(p.sinks[head]) : neg_inf<A>();
            continue;
        }
        // The sink (once per row, after the chunks): one more term of the denominator.
        A total = 0;
        if (p.sinks) {
            const A sink = static_cast<A>(p.sinks[head] * SoftmaxBase<A>::kUnit);
            top = max_of(top, sink);
            total = SoftmaxBase<A>::exp(sink - top);
        }
        // Chunks in their fixed order, so the bits never depend on who computed them.
        for (int64_t e = 0; e < Dv; ++e) sum[e] = 0;
        for (int64_t c = 0; c < chunks; ++c) {
            if (l[c * rows + r] == A(0)) continue;
            const A w = SoftmaxBase<A>::exp(m[c * rows + r] - top);
            total += w * l[c * rows + r];
            axpy(sum, w, acc + (c * rows + r) * Dv, Dv);
        }
        const A inv = A(1) / total;
        for (int64_t e = 0; e < Dv; ++e) orow[e] = store_from_acc<T>(sum[e] * inv);
        if (lse_at) *lse_at = SoftmaxBase<A>::to_natural(top) + log_acc(total);  // natural units
    }
}

void decode_chunk_f64(const AttentionParams& p, const DecodeTask& t, double* ws, double* acc,
                      double* m, double* l) {
    decode_loop<TemplatePath<double, double, double>>(p, t, ws, acc, m, l);
}
// Runs Fn::run<TQ, TKV>(p, args...) for the call's q and K/V storage types
// (with_q_kv_types: every float32-accumulated combination, every format). Every decode
// kernel's entry point goes through it (and the template prefill's), so each one
// instantiates the same combinations.
template <class Fn, class... Args>
inline void for_storage_types(const AttentionParams& p, const Args&... args) {
    with_q_kv_types<true>(p, [&](auto tq, auto tkv) {
        Fn::template run<typename decltype(tq)::type, typename decltype(tkv)::type>(p, args...);
    });
}

struct TemplateChunk {  // decode_loop with the template policy
    template <class TQ, class T>
    static void run(const AttentionParams& p, const DecodeTask& t, float* ws, float* acc, float* m, float* l) {
        decode_loop<TemplatePath<TQ, T, float>>(p, t, ws, acc, m, l);
    }
};
void decode_chunk_any(const AttentionParams& p, const DecodeTask& t, float* ws, float* acc,
                       float* m, float* l) {
    for_storage_types<TemplateChunk>(p, t, ws, acc, m, l);
}
// The decode of tiers without a hand-written one, and of the calls theirs does not cover
// (KernelTable::decode_kernel).
[[maybe_unused]] DecodeKernel template_decode(const AttentionParams&) {
    return {KernelId::kTemplateDecode, decode_chunk_any};
}
void decode_merge_any(const AttentionParams& p, int64_t b, int64_t g, int64_t chunks,
                       const float* acc, const float* m, const float* l, float* ws) {
    with_q_type(p.dtype, [&](auto tq) { decode_merge<typename decltype(tq)::type, float>(p, b, g, chunks, acc, m, l, ws); });
}
void decode_merge_f64(const AttentionParams& p, int64_t b, int64_t g, int64_t chunks,
                      const double* acc, const double* m, const double* l, double* ws) {
    decode_merge<double, double>(p, b, g, chunks, acc, m, l, ws);
}

// ---- the template prefill: the decode loop over one block of query rows
// The prefill of float64, and of the tiers without a hand-written one (the aarch64 build's
// generic tier): a BlockTask (query rows [row_begin, row_end) of one head, kDecodeGroupRows
// of them: template_prefill_plan) runs as a decode problem of that one head over every key
// its rows may see, in one chunk, finished at once by decode_merge: the same streaming online
// softmax over blocks of keys, in O(rows x Dv) memory, the loop written once.
template <class TQ, class TKV, class A>
void template_prefill_block(const AttentionParams& p, const BlockTask& task, A* workspace) {
    const int64_t rows = task.row_end - task.row_begin, seqlen_k = batch_seqlen_k(p, task.batch);
    const AttentionParams one = query_rows(one_head(p, task.head), task.row_begin, rows,
                                           aligned_row(p, 0, seqlen_k));
    const KeyRange first = visible_keys(one, 0, seqlen_k), last = visible_keys(one, rows - 1, seqlen_k);
    A* acc = workspace + decode_workspace_elems(one);  // rows x Dv, then m and l (rows each)
    A* m = acc + rows * p.head_dim_v;
    A* l = m + rows;
    decode_loop<TemplatePath<TQ, TKV, A>>(one, DecodeTask{task.batch, 0, first.begin, last.end, seqlen_k},
                                          workspace, acc, m, l);
    decode_merge<TQ, A>(one, task.batch, 0, 1, acc, m, l, workspace);
}

void attend_block_f64(const AttentionParams& p, const BlockTask& t, double* ws) {
    template_prefill_block<double, double, double>(p, t, ws);
}
struct TemplatePrefillBlock {  // template_prefill_block for for_storage_types
    template <class TQ, class T>
    static void run(const AttentionParams& p, const BlockTask& t, float* ws) {
        template_prefill_block<TQ, T, float>(p, t, ws);
    }
};
[[maybe_unused]] void attend_block_any(const AttentionParams& p, const BlockTask& t, float* ws) {
    for_storage_types<TemplatePrefillBlock>(p, t, ws);
}
// The prefill of tiers without a hand-written one (KernelTable::prefill_kernel).
[[maybe_unused]] PrefillKernel template_prefill(const AttentionParams&) {
    return {KernelId::kTemplatePrefill, attend_block_any, template_prefill_plan};
}

// ---- micro-kernel policies (KernelTable::kernel_policy, attnfast.explain's "policy")
// The policy of kernel Id on this tier, specialised next to each kernel from the constants it
// runs by; a kernel the tier does not compile keeps this empty one (never chosen there).
template <KernelId Id>
struct PolicyOf {
    static KernelPolicy of(const AttentionParams&) { return {}; }
};
// The SIMD layer's vfma: fused where the tier has FMA, else a multiply and an add (SSE2).
#if defined(__FMA__) || defined(__aarch64__)
constexpr Product kVfmaProduct = Product::kF32Fma;
#else
constexpr Product kVfmaProduct = Product::kF32MulAdd;
#endif
// The templates: kRowBlock rows against one key per dot_rows call, `a * b + c` in the
// accumulator type (ISO C++: -ffp-contract=off, so a multiply and an add).
template <Product kProduct>
struct TemplatePolicy {
    static KernelPolicy of(const AttentionParams&) { return {kRowBlock, 1, kProduct, kProduct}; }
};
template <> struct PolicyOf<KernelId::kTemplatePrefill> : TemplatePolicy<Product::kF32MulAdd> {};
template <> struct PolicyOf<KernelId::kTemplateDecode> : TemplatePolicy<Product::kF32MulAdd> {};
template <> struct PolicyOf<KernelId::kTemplateF64> : TemplatePolicy<Product::kF64> {};

}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
