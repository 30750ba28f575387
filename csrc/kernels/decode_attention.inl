// Decode kernels: a short query (decode.cpp: runs_on_decode_path) against a long KV cache, the
// templates every ISA file compiles with its own flags, inside its per-ISA namespace. Uses
// block_attention.inl's helpers (exp_acc, log_acc, load_acc, store_from_acc, neg_inf, max_of,
// kLanes) and the typed vector layer (csrc/simd/typed.hpp).
//
// Decoding is bandwidth-bound: each cached K/V byte is used by only (H / Hkv) * Tq query
// rows. So one task takes one chunk of keys of one (batch, kv head) and serves all the query
// rows of that KV head with one pass over K (scores into a small per-chunk buffer), a
// softmax per row, and one pass over V. The driver (decode.cpp) merges the chunks.
//
// No std:: templates here (see block_attention.inl).
#pragma once
#include "block_attention.inl"
#include "../simd/typed.hpp"

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {

constexpr int64_t kGroupRows = kDecodeGroupRows;

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

// x[j] = exp(x[j] - m) for j < n; returns the sum.
template <class A>
inline A range_exp_sum(A* __restrict x, int64_t n, A m) {
    A part[kLanes];
    for (int u = 0; u < kLanes; ++u) part[u] = 0;
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes)
        for (int u = 0; u < kLanes; ++u) {
            const A e = exp_acc(x[j + u] - m);
            x[j + u] = e;
            part[u] += e;
        }
    for (int u = 0; j + u < n; ++u) {
        const A e = exp_acc(x[j + u] - m);
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

// TQ: type of q; TKV: type of k and v (see attend_block); A: the accumulator.
template <class TQ, class TKV, class A>
void decode_chunk(const AttentionParams& p, const DecodeTask& task, A* workspace, A* acc,
                  A* m, A* l) {
    using T = TKV;
    const int64_t D = p.head_dim, Dv = p.head_dim_v, tq = p.seqlen_q;
    const int64_t group = p.heads / p.kv_heads;
    const int64_t rows = group * tq;
    const int64_t keys = task.key_end - task.key_begin;  // <= decode_chunk_keys(p)
    const int64_t ss = kDecodeScoreStride;

    const int64_t qs_stride = decode_query_stride(p);  // D rounded up to the vector lanes
    A* qs = workspace;               // kGroupRows rows qs_stride apart, times scale, 0-padded
    A* s = qs + kGroupRows * qs_stride;  // kGroupRows rows ss apart: one key block's scores
    int64_t lo[kGroupRows], hi[kGroupRows];  // each row's visible keys, chunk-relative

    const TQ* q = static_cast<const TQ*>(p.q) + task.batch * p.q_batch_stride;
    // int8 / float8 cache: row scales by key position (else all 1)
    const RowScales k_scale = row_scales(p, p.k_scale, p.k_scale_batch_stride, p.k_scale_head_stride,
                                         p.k_scale_row_stride, task.batch, task.kv_head);
    const RowScales v_scale = row_scales(p, p.v_scale, p.v_scale_batch_stride, p.v_scale_head_stride,
                                         p.v_scale_row_stride, task.batch, task.kv_head);
    // Key rows by key position (contiguous, or through a paged cache's block table)
    const KeyRows<T> k = key_rows<T>(p, p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride,
                                     task.batch, task.kv_head);
    const KeyRows<T> v = key_rows<T>(p, p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride,
                                     task.batch, task.kv_head);
    const int64_t kb = task.key_begin;  // chunk-relative key c is key kb + c
    const A scale = static_cast<A>(p.scale);
    const int64_t v_row_bytes = kv_row_bytes<T>(Dv);
    const bool options = p.softcap > 0 || p.alibi_slopes || p.mask;

    for (int64_t r0 = 0; r0 < rows; r0 += kGroupRows) {
        const int64_t n = rows - r0 < kGroupRows ? rows - r0 : kGroupRows;
        int64_t used_lo = keys, used_hi = 0;  // keys some row of the group sees
        for (int64_t rr = 0; rr < n; ++rr) {
            const int64_t r = r0 + rr;
            const int64_t head = task.kv_head * group + r / tq, pos = r % tq;
            const TQ* qrow = q + head * p.q_head_stride + pos * p.q_row_stride;
            for (int64_t d = 0; d < D; ++d) qs[rr * qs_stride + d] = load_acc<A>(qrow[d]) * scale;
            for (int64_t d = D; d < qs_stride; ++d) qs[rr * qs_stride + d] = 0;
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

        // Blocks of kDecodeKeyBlock keys, each: scores (one pass over its K rows), an online
        // softmax update per row, then a pass over its V rows.
        for (int64_t j0 = used_lo; j0 < used_hi; j0 += kDecodeKeyBlock) {
            const int64_t j1 = j0 + kDecodeKeyBlock < used_hi ? j0 + kDecodeKeyBlock : used_hi;
            for (int64_t ja = j0; ja < j1;) {  // runs of keys within one block (paged)
                const int64_t jb = k.run_end(kb + ja, kb + j1) - kb;
                const T* krow = k.at(kb + ja);
                const T* vrow = v.at(kb + ja);
                for (int64_t j = ja; j < jb; ++j, krow += k.row_stride, vrow += v.row_stride) {
                    // Start this key's V row towards L2 now, so the V stream is fetched
                    // alongside the K stream instead of after it (a block's V, at most half
                    // of the chunk's bytes, stays in L2 until its pass). Measured on one core
                    // of an AMD EPYC: +30% GB/s; the hardware prefetcher alone stalls at each
                    // switch. (Interleaving K and V in smaller blocks, or prefetching the next
                    // chunk's K during the V pass, measured slower.)
                    const char* vbytes = reinterpret_cast<const char*>(vrow);
                    for (int64_t off = 0; off < v_row_bytes; off += 64) __builtin_prefetch(vbytes + off, 0, 2);
                    // Each key row is loaded once and dotted with all n query rows.
                    for_row_blocks(n, ScoreRows<T, A>{qs, qs_stride, krow, D, s + (j - j0), ss});
                }
                ja = jb;
            }

            for (int64_t rr = 0; rr < n; ++rr) {
                const int64_t r = r0 + rr;
                A* srow = s + rr * ss;  // column c is key j0 + c
                const int64_t b = (lo[rr] > j0 ? lo[rr] : j0) - j0;
                const int64_t e = (hi[rr] < j1 ? hi[rr] : j1) - j0;
                nonfinite_to_nan(srow + b, e - b);
                if (k_scale.scale)  // int8 K: the score of key j is k_scale[j] * (q . k_int8[j])
                    for (int64_t c = b; c < e; ++c) srow[c] *= static_cast<A>(k_scale.at(kb + j0 + c));
                if (options && b < e) {
                    const int64_t head = task.kv_head * group + r / tq, pos = r % tq;
                    RowOptions<A>(p, task.batch, head, pos, task.seqlen_k)
                        .apply(srow + b, task.key_begin + j0 + b, e - b);
                }
                A block_max = neg_inf<A>();
                if (b < e) block_max = range_max(srow + b, e - b);
                if (block_max == neg_inf<A>()) {  // sees nothing in this block: weight 0
                    for (int64_t c = 0; c < j1 - j0; ++c) srow[c] = 0;
                    continue;
                }
                const A m_new = max_of(m[r], block_max);
                const A correction = exp_acc(m[r] - m_new);  // 0 while m[r] is -inf
                if (correction != A(1)) {
                    l[r] *= correction;
                    A* acc_row = acc + r * Dv;
                    for (int64_t c = 0; c < Dv; ++c) acc_row[c] *= correction;
                }
                m[r] = m_new;
                l[r] += range_exp_sum(srow + b, e - b, m_new);
                // Keys this row does not see weigh exactly 0 in the pass over V (which walks
                // the keys any row sees; only a non-finite value there could leak in).
                for (int64_t c = 0; c < b; ++c) srow[c] = 0;
                for (int64_t c = e; c < j1 - j0; ++c) srow[c] = 0;
                if (v_scale.scale)  // int8 V: the weight of v_int8[j] is p[j] * v_scale[j]
                    for (int64_t c = b; c < e; ++c) srow[c] *= static_cast<A>(v_scale.at(kb + j0 + c));
            }

            // Value rows in sub-blocks that stay in L1 while every row block walks them; each
            // is loaded once per row block and added to that block's accumulators. A paged
            // cache's block boundaries cut the sub-blocks further: the sums run over the same
            // keys in the same order, so the bits are those of a contiguous cache.
            for (int64_t v0 = j0; v0 < j1;) {
                int64_t v1 = v0 + kValueSubKeys < j1 ? v0 + kValueSubKeys : j1;
                v1 = v.run_end(kb + v0, kb + v1) - kb;
                for_row_blocks(n, AddValueRows<T, A>{acc + r0 * Dv, Dv, s + (v0 - j0), ss,
                                                     v.at(kb + v0), v.row_stride, 0, v1 - v0});
                v0 = v1;
            }
        }
    }
}

// T: type of out (that of q).
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
        A top = neg_inf<A>();
        for (int64_t c = 0; c < chunks; ++c) top = max_of(top, m[c * rows + r]);
        if (top == neg_inf<A>()) {  // the row sees no key: zeros and -inf (the sink's
                                    // logit with sinks), never NaN
            for (int64_t e = 0; e < Dv; ++e) orow[e] = store_from_acc<T>(A(0));
            if (lse_at) *lse_at = p.sinks ? static_cast<A>(p.sinks[head]) : neg_inf<A>();
            continue;
        }
        // The sink (once per row, after the chunks): one more term of the denominator.
        A total = 0;
        if (p.sinks) {
            const A sink = static_cast<A>(p.sinks[head]);
            top = max_of(top, sink);
            total = exp_acc(sink - top);
        }
        // Chunks in their fixed order, so the bits never depend on who computed them.
        for (int64_t e = 0; e < Dv; ++e) sum[e] = 0;
        for (int64_t c = 0; c < chunks; ++c) {
            const A mc = m[c * rows + r];
            if (mc == neg_inf<A>()) continue;
            const A w = exp_acc(mc - top);
            total += w * l[c * rows + r];
            axpy(sum, w, acc + (c * rows + r) * Dv, Dv);
        }
        const A inv = A(1) / total;
        for (int64_t e = 0; e < Dv; ++e) orow[e] = store_from_acc<T>(sum[e] * inv);
        if (lse_at) *lse_at = top + log_acc(total);
    }
}

void decode_chunk_f64(const AttentionParams& p, const DecodeTask& t, double* ws, double* acc,
                      double* m, double* l) {
    decode_chunk<double, double, double>(p, t, ws, acc, m, l);
}
// Every float32-accumulated combination, as attend_block_any.
void decode_chunk_any(const AttentionParams& p, const DecodeTask& t, float* ws, float* acc,
                       float* m, float* l) {
    const DType q = p.dtype, kv = p.kv_dtype;
    if (kv == DType::kBF16) {
        if (q == DType::kBF16) decode_chunk<bf16_t, bf16_t, float>(p, t, ws, acc, m, l);
        else decode_chunk<float, bf16_t, float>(p, t, ws, acc, m, l);
    } else if (kv == DType::kF16) {
        if (q == DType::kF16) decode_chunk<f16_t, f16_t, float>(p, t, ws, acc, m, l);
        else decode_chunk<float, f16_t, float>(p, t, ws, acc, m, l);
    } else if (kv == DType::kF32) {
        decode_chunk<float, float, float>(p, t, ws, acc, m, l);
    } else if (kv == DType::kF8E4M3) {
        if (q == DType::kBF16) decode_chunk<bf16_t, fp8_t, float>(p, t, ws, acc, m, l);
        else if (q == DType::kF16) decode_chunk<f16_t, fp8_t, float>(p, t, ws, acc, m, l);
        else decode_chunk<float, fp8_t, float>(p, t, ws, acc, m, l);
    } else if (kv == DType::kQ4) {
        if (q == DType::kBF16) decode_chunk<bf16_t, q4_t, float>(p, t, ws, acc, m, l);
        else if (q == DType::kF16) decode_chunk<f16_t, q4_t, float>(p, t, ws, acc, m, l);
        else decode_chunk<float, q4_t, float>(p, t, ws, acc, m, l);
    } else {  // kI8
        if (q == DType::kBF16) decode_chunk<bf16_t, int8_t, float>(p, t, ws, acc, m, l);
        else if (q == DType::kF16) decode_chunk<f16_t, int8_t, float>(p, t, ws, acc, m, l);
        else decode_chunk<float, int8_t, float>(p, t, ws, acc, m, l);
    }
}
// The decode of tiers without a hand-written one, and of the calls theirs does not cover
// (KernelTable::decode_kernel).
[[maybe_unused]] DecodeKernel template_decode(const AttentionParams&) {
    return {"template_decode", decode_chunk_any};
}
void decode_merge_any(const AttentionParams& p, int64_t b, int64_t g, int64_t chunks,
                       const float* acc, const float* m, const float* l, float* ws) {
    if (p.dtype == DType::kBF16) decode_merge<bf16_t, float>(p, b, g, chunks, acc, m, l, ws);
    else if (p.dtype == DType::kF16) decode_merge<f16_t, float>(p, b, g, chunks, acc, m, l, ws);
    else decode_merge<float, float>(p, b, g, chunks, acc, m, l, ws);
}
void decode_merge_f64(const AttentionParams& p, int64_t b, int64_t g, int64_t chunks,
                      const double* acc, const double* m, const double* l, double* ws) {
    decode_merge<double, double>(p, b, g, chunks, acc, m, l, ws);
}

}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
