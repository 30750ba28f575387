// The backward kernels (csrc/backward.hpp), compiled by every kernels/isa_*.cpp with its own
// flags. It reuses attention_core.inl's and decode_attention.inl's score options
// (RowOptions, visible_keys) and its exponential base (SoftmaxBase), so the backward sees
// exactly the scores the forward saw, and the typed vector layer (csrc/simd/typed.hpp: Vec<A>, fmadd, splat, loadu, storeu).
//
// FlashAttention-2's backward over tiles of Bt query rows x Bt keys. Per tile pair:
//   S  = q (scale u K)^T  -> P = base^(S' - lse u)   (S' = S after the score options; base 2
//                                                    and u = log2 e in float32, e and 1 in float64)
//   dP = dO V^T          -> dS = P (dP - delta) softcap'(S)
//   dV += P^T dO,  dK += dS^T q,  dQ += dS K     (dK and dQ times scale when written)
// Every product is one register-blocked micro-GEMM (gemm below): C (+)= A B with B's rows
// contiguous and A read by broadcasts at any strides, so P^T and dS^T need no transpose.
// Widths (D, Dv) are padded to whole vectors (kBackwardPad) inside the tiles and in dq.
//
// Two schedules, the same bits (backward.cpp picks one from the number of (batch, kv head)
// groups and threads): a group task walks its key blocks in order and accumulates dK, dV
// and dQ (5 products per tile pair); or a dK/dV pass per key block and a dQ pass per query
// block (7 products: S and dP twice). Each dQ element is the same chain of fused
// multiply-adds over the same key tiles in the same order in both.
#pragma once
#include "../backward.hpp"
#include "attention_core.inl"
#include "decode_attention.inl"
#include "../simd/typed.hpp"

#if defined(__SSE2__) || defined(__aarch64__)
#define ATTNFAST_BWD_SIMD_LAYER 1  // csrc/simd/ has a header for this ISA
#include "../simd/simd.hpp"
#endif
namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace bwd {

constexpr int64_t Bt = kBackwardTile;

// Accumulator block of the micro-GEMM: kMR rows x kNV vectors, within the vector registers
// with the kNV B vectors and a broadcast (16 registers on x86 below AVX-512: 6 x 2; 32 on
// AVX-512 and NEON: 6 x 4).
#if ATTNFAST_SIMD_BYTES == 64 || defined(__aarch64__)
constexpr int kMR = 6, kNV = 4;
#else
constexpr int kMR = 6, kNV = 2;
#endif

// c[m][0, NV lanes) (+)= sum_{k < K} a[m * a_rs + k * a_ks] * b[k * ldb + 0, NV lanes) for
// m < MR: each element one chain of fused multiply-adds in increasing k.
template <class A, int MR, int NV, bool kAccumulate>
void micro(const A* __restrict a, int64_t a_rs, int64_t a_ks, const A* __restrict b, int64_t ldb,
           A* __restrict c, int64_t ldc, int64_t K) {
    constexpr int64_t L = vec_lanes<A>();
    Vec<A> acc[MR][NV];
    for (int m = 0; m < MR; ++m)
        for (int v = 0; v < NV; ++v) acc[m][v] = kAccumulate ? loadu(c + m * ldc + v * L) : Vec<A>{};
#pragma GCC unroll 4  // +8-12 % in a 64 x 64 x 64 harness on Zen 3 (fewer loop branches per FMA)
    for (int64_t k = 0; k < K; ++k) {
        Vec<A> bv[NV];
        for (int v = 0; v < NV; ++v) bv[v] = loadu(b + k * ldb + v * L);
        for (int m = 0; m < MR; ++m) {
            const Vec<A> am = splat(a[m * a_rs + k * a_ks]);
            for (int v = 0; v < NV; ++v) acc[m][v] = fmadd(am, bv[v], acc[m][v]);
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int v = 0; v < NV; ++v) storeu(c + m * ldc + v * L, acc[m][v]);
}

// micro<A, mr, nv>, chosen at run time for 1 <= mr <= MR, 1 <= nv <= NV.
template <class A, bool kAccumulate, int MR, int NV>
inline void micro_nv(int64_t nv, const A* a, int64_t a_rs, int64_t a_ks, const A* b, int64_t ldb,
                     A* c, int64_t ldc, int64_t K) {
    if constexpr (NV > 1)
        if (nv < NV) return micro_nv<A, kAccumulate, MR, NV - 1>(nv, a, a_rs, a_ks, b, ldb, c, ldc, K);
    micro<A, MR, NV, kAccumulate>(a, a_rs, a_ks, b, ldb, c, ldc, K);
}
template <class A, bool kAccumulate, int MR>
inline void micro_any(int64_t mr, int64_t nv, const A* a, int64_t a_rs, int64_t a_ks, const A* b,
                      int64_t ldb, A* c, int64_t ldc, int64_t K) {
    if constexpr (MR > 1)
        if (mr < MR) return micro_any<A, kAccumulate, MR - 1>(mr, nv, a, a_rs, a_ks, b, ldb, c, ldc, K);
    micro_nv<A, kAccumulate, MR, kNV>(nv, a, a_rs, a_ks, b, ldb, c, ldc, K);
}

// c (rows x n, rows ldc apart) (+)= a (rows x K, a(m, k) = a[m * a_rs + k * a_ks]) times
// b (K x n, rows ldb apart); n a multiple of the vector lanes. kAccumulate: add to c (else
// overwrite it).
template <class A, bool kAccumulate>
void gemm(const A* a, int64_t a_rs, int64_t a_ks, const A* b, int64_t ldb, A* c, int64_t ldc,
          int64_t rows, int64_t n, int64_t K) {
    constexpr int64_t L = vec_lanes<A>();
    const int64_t vectors = n / L;
    for (int64_t v0 = 0; v0 < vectors; v0 += kNV) {
        const int64_t nv = vectors - v0 < kNV ? vectors - v0 : kNV;
        for (int64_t m0 = 0; m0 < rows; m0 += kMR) {
            const int64_t mr = rows - m0 < kMR ? rows - m0 : kMR;
            micro_any<A, kAccumulate, kMR>(mr, nv, a + m0 * a_rs, a_rs, a_ks, b + v0 * L, ldb,
                                           c + m0 * ldc + v0 * L, ldc, K);
        }
    }
}

// x * y + z rounded as fmadd rounds each lane: once with FMA, twice without (SSE2).
#if defined(__FMA__) || defined(__aarch64__)
inline float madd(float x, float y, float z) { return __builtin_fmaf(x, y, z); }
inline double madd(double x, double y, double z) { return __builtin_fma(x, y, z); }
#else
template <class A> inline A madd(A x, A y, A z) { return x * y + z; }
#endif

// gemm<A, true> one element at a time, skipping zero coefficients a(m, k). A tile pair runs
// its product this way when the product's B rows hold an inf or a NaN, so that a key or a
// query a row never sees (a zero coefficient: a masked P or dS) does not poison the row
// through 0 x inf = NaN, as the forward's rows are not poisoned by keys they do not see.
// Each element is the same chain in the same order as gemm's, and a skipped term adds
// exactly nothing (the sums start at +0), so every finite element keeps its bits.
template <class A>
void gemm_skipping_zeros(const A* a, int64_t a_rs, int64_t a_ks, const A* b, int64_t ldb, A* c,
                         int64_t ldc, int64_t rows, int64_t n, int64_t K) {
    for (int64_t m = 0; m < rows; ++m)
        for (int64_t k = 0; k < K; ++k) {
            const A x = a[m * a_rs + k * a_ks];
            if (x == A(0)) continue;
            for (int64_t e = 0; e < n; ++e) c[m * ldc + e] = madd(x, b[k * ldb + e], c[m * ldc + e]);
        }
}

// c (+)= a b as above, by gemm_skipping_zeros when b holds a non-finite value.
template <class A>
inline void accumulate_product(bool b_nonfinite, const A* a, int64_t a_rs, int64_t a_ks, const A* b,
                               int64_t ldb, A* c, int64_t ldc, int64_t rows, int64_t n, int64_t K) {
    if (b_nonfinite) gemm_skipping_zeros<A>(a, a_rs, a_ks, b, ldb, c, ldc, rows, n, K);
    else gemm<A, true>(a, a_rs, a_ks, b, ldb, c, ldc, rows, n, K);
}

// Whether rows [0, n) of `dim` values, row_stride apart, hold an inf or a NaN (x - x is
// 0 exactly for every finite x, widened exactly from any storage type, and NaN otherwise:
// summed, NaN when any is). In whole vectors where it can: lane by lane, it cost the sparse
// backward a quarter of its time.
template <class T>
inline bool any_nonfinite(const T* rows, int64_t row_stride, int64_t n, int64_t dim) {
    using W = decltype(widen(rows[0]));
    constexpr int64_t L = vec_lanes<W>();
    Vec<W> lanes = {};
    W tail = 0;
    for (int64_t r = 0; r < n; ++r) {
        const T* row = rows + r * row_stride;
        int64_t e = 0;
        for (; e + L <= dim; e += L) {
            const Vec<W> x = vload(row + e);
            lanes += x - x;
        }
        for (; e < dim; ++e) {
            const W x = widen(row[e]);
            tail += x - x;
        }
    }
    return !(vsum(lanes) + tail == 0);
}

// Row `first` of one (batch, head) of a (B, H, T, dim) tensor with the given strides.
template <class T>
inline const T* rows_at(const void* data, int64_t batch_stride, int64_t head_stride,
                        int64_t row_stride, int64_t batch, int64_t head, int64_t first) {
    return static_cast<const T*>(data) + batch * batch_stride + head * head_stride + first * row_stride;
}
// Rows [0, n) (row_stride apart) as A times `mul`: into x (Bt rows, ld apart; columns
// [dim, ld) and rows [n, Bt) zero), or transposed into xt (dim rows of Bt; columns >= n zero).
template <class T, class A>
void load_tile(const T* rows, int64_t row_stride, int64_t n, int64_t dim, int64_t ld, A mul, A* __restrict x) {
    for (int64_t r = 0; r < n; ++r) {
        const T* row = rows + r * row_stride;
        A* __restrict out = x + r * ld;
        for (int64_t e = 0; e < dim; ++e) out[e] = load_acc<A>(row[e]) * mul;
        for (int64_t e = dim; e < ld; ++e) out[e] = 0;
    }
    for (int64_t e = n * ld; e < Bt * ld; ++e) x[e] = 0;
}
template <class T, class A>
void load_tile_transposed(const T* rows, int64_t row_stride, int64_t n, int64_t dim, A mul,
                          A* __restrict xt) {
    for (int64_t e = 0; e < dim * Bt; ++e) xt[e] = 0;
    for (int64_t r = 0; r < n; ++r) {
        const T* row = rows + r * row_stride;
        for (int64_t e = 0; e < dim; ++e) xt[e * Bt + r] = load_acc<A>(row[e]) * mul;
    }
}

// The visible keys of query rows [first, first + n): a superset of every row's range
// (visible_keys' begin and end both grow with the row).
inline KeyRange rows_key_span(const AttentionParams& p, int64_t first, int64_t n, int64_t seqlen_k) {
    const KeyRange top = visible_keys(p, first, seqlen_k);
    const KeyRange bottom = visible_keys(p, first + n - 1, seqlen_k);
    return {top.begin, bottom.end > top.begin ? bottom.end : top.begin};
}
// Whether rows with that span see any of keys [j0, j0 + nc) (an empty span sees none: its
// rows must not even multiply zeros by the keys, as the dq pass never does).
inline bool span_meets(const KeyRange& span, int64_t j0, int64_t nc) {
    return span.end > span.begin && span.end > j0 && span.begin < j0 + nc;
}

// One key block's tiles: its keys [j0, j_end) (nc of them in the batch entry; <= 0: none).
template <class A>
struct KeyTiles {
    A* kt;  // scale K^T: dp x Bt (rows >= D unused)
    A* vt;  // V^T: dvp x Bt
    A* kr;  // K rows: Bt x dp (the dq product's B)
    A* dk;  // dK accumulators: Bt x dp
    A* dv;  // dV accumulators: Bt x dvp
    int64_t j0, j_end, nc;
    bool k_nonfinite;  // an inf or NaN among its K rows (the dq product's B)
};

// One thread's tiles, in accumulator elements (backward_workspace_elems counts them): the
// key tiles of up to kBackwardKeyBlocks key blocks, swept together over the query blocks
// (backward_key_blocks), and one query block's.
template <class A>
struct Tiles {
    int64_t dp, dvp;  // D and Dv padded to whole vectors
    KeyTiles<A> keys[kBackwardKeyBlocks];
    A* qs;            // q rows of the query block, when copied: Bt x dp
    A* dout;          // dout rows, when copied: Bt x dvp
    A* p;             // P: Bt x Bt
    A* ds;            // dP, then dS: Bt x Bt
    // The products' q and dout rows (load_queries): in place, or the copies above.
    const A* q_rows;
    const A* dout_rows;
    int64_t q_ld, dout_ld;  // elements between their rows
    bool q_nonfinite, dout_nonfinite;  // an inf or NaN among them (the dK, dV products' B)

    Tiles(const AttentionParams& a, A* ws) {
        dp = backward_padded(a.head_dim);
        dvp = backward_padded(a.head_dim_v);
        for (KeyTiles<A>& k : keys) {
            k.kt = ws;
            k.vt = k.kt + dp * Bt;
            k.kr = k.vt + dvp * Bt;
            k.dk = k.kr + Bt * dp;
            k.dv = k.dk + Bt * dp;
            ws = k.dv + Bt * dvp;
        }
        qs = ws;
        dout = qs + Bt * dp;
        p = dout + Bt * dvp;
        ds = p + Bt * Bt;
    }
};

// Keys [kb.j0, kb.j0 + kb.nc) of kv head g into kb's kt, vt (and kr when the dq product runs).
template <class T, class A>
void load_keys(const BackwardParams& bp, int64_t b, int64_t g, bool with_kr, int64_t dp, KeyTiles<A>& kb) {
    const AttentionParams& a = bp.attn;
    const T* k = rows_at<T>(a.k, a.k_batch_stride, a.k_head_stride, a.k_row_stride, b, g, kb.j0);
    const T* v = rows_at<T>(a.v, a.v_batch_stride, a.v_head_stride, a.v_row_stride, b, g, kb.j0);
    load_tile_transposed<T, A>(k, a.k_row_stride, kb.nc, a.head_dim, static_cast<A>(a.scale * SoftmaxBase<A>::kUnit),
                               kb.kt);
    load_tile_transposed<T, A>(v, a.v_row_stride, kb.nc, a.head_dim_v, A(1), kb.vt);
    if (with_kr) load_tile<T, A>(k, a.k_row_stride, kb.nc, a.head_dim, dp, A(1), kb.kr);
    kb.k_nonfinite = any_nonfinite(k, a.k_row_stride, kb.nc, a.head_dim);
}

// nr rows of q and of dout (q_stride, d_stride elements apart) as the products read them.
// Rows of the accumulator type whose width is already whole vectors are read in place (no
// copy per tile pair); others are converted into the tiles qs and dout, padded with zeros.
template <class T, class A>
void load_query_rows(const BackwardParams& bp, const T* q, int64_t q_stride, const T* d, int64_t d_stride,
                     int64_t nr, Tiles<A>& t) {
    const AttentionParams& a = bp.attn;
    if constexpr (sizeof(T) == sizeof(A)) {  // T is A
        if (a.head_dim == t.dp) {
            t.q_rows = reinterpret_cast<const A*>(q), t.q_ld = q_stride;
        } else {
            load_tile<T, A>(q, q_stride, nr, a.head_dim, t.dp, A(1), t.qs);
            t.q_rows = t.qs, t.q_ld = t.dp;
        }
        if (a.head_dim_v == t.dvp) {
            t.dout_rows = reinterpret_cast<const A*>(d), t.dout_ld = d_stride;
        } else {
            load_tile<T, A>(d, d_stride, nr, a.head_dim_v, t.dvp, A(1), t.dout);
            t.dout_rows = t.dout, t.dout_ld = t.dvp;
        }
    } else {
        load_tile<T, A>(q, q_stride, nr, a.head_dim, t.dp, A(1), t.qs);
        load_tile<T, A>(d, d_stride, nr, a.head_dim_v, t.dvp, A(1), t.dout);
        t.q_rows = t.qs, t.q_ld = t.dp, t.dout_rows = t.dout, t.dout_ld = t.dvp;
    }
    t.q_nonfinite = any_nonfinite(q, q_stride, nr, a.head_dim);
    t.dout_nonfinite = any_nonfinite(d, d_stride, nr, a.head_dim_v);
}

// Query rows [i0, i0 + nr) of head h (load_query_rows).
template <class T, class A>
void load_queries(const BackwardParams& bp, int64_t b, int64_t h, int64_t i0, int64_t nr, Tiles<A>& t) {
    const AttentionParams& a = bp.attn;
    const T* q = rows_at<T>(a.q, a.q_batch_stride, a.q_head_stride, a.q_row_stride, b, h, i0);
    const T* d = rows_at<T>(bp.dout, bp.dout_batch_stride, bp.dout_head_stride,
                            bp.dout_row_stride, b, h, i0);
    load_query_rows<T, A>(bp, q, a.q_row_stride, d, bp.dout_row_stride, nr, t);
}

// The last step of one row of a tile pair, s = its scores after the score options and l2
// its lse, both in the softmax's units (SoftmaxBase: base 2 for float32, e for float64),
// g = its dP, columns [lo, end) visible: s = P = base^(s - l2), g = dS = P (g - d) slope (slope: softcap's derivative, or none), other columns (up to width, a multiple of kBackwardPad) 0. float32
// on the SIMD layer (exp2_neg, the forward's exponential; the tiles are vector-aligned),
// float64 lane by lane.
template <class A>
inline void finish_row(A* __restrict s, A* __restrict g, const A* __restrict slope, A l2, A d,
                       int64_t lo, int64_t end, int64_t width = Bt) {
    for (int64_t j = 0; j < width; ++j) {
        const bool seen = j >= lo && j < end;
        const A pj = seen ? SoftmaxBase<A>::exp(s[j] - l2) : A(0);
        g[j] = seen ? pj * (g[j] - d) * (slope ? slope[j] : A(1)) : A(0);
        s[j] = pj;
    }
}
#if ATTNFAST_BWD_SIMD_LAYER
inline void finish_row(float* __restrict s, float* __restrict g, const float* __restrict slope,
                       float l2, float d, int64_t lo, int64_t end, int64_t width = Bt) {
    namespace v = simd;
    const v::Vec lv = v::vset(l2), dv = v::vset(d);
    for (int64_t j = 0; j < width; j += v::W) {
        const v::Vec pj = v::exp2_neg(v::vsub(v::vload(s + j), lv));
        v::Vec gj = v::vmul(pj, v::vsub(v::vload(g + j), dv));
        if (slope) gj = v::vmul(gj, v::vload(slope + j));
        v::vstore(s + j, pj);
        v::vstore(g + j, gj);
    }
    for (int64_t j = 0; j < lo; ++j) s[j] = g[j] = 0;
    for (int64_t j = end; j < width; ++j) s[j] = g[j] = 0;
}
#endif

// Softcap on a row of scores (its first `width` columns, a multiple of kBackwardPad), keeping
// its derivative: s = cap tanh(s / cap), slope = 1 - tanh^2 (float32: the SIMD layer's tanh,
// as the forward's).
template <class A>
inline void softcap_row(A* __restrict s, A* __restrict slope, A cap, A inv_cap, int64_t width = Bt) {
    for (int64_t j = 0; j < width; ++j) {
        const A th = tanh_acc(s[j] * inv_cap);
        s[j] = cap * th;
        slope[j] = 1 - th * th;
    }
}
#if ATTNFAST_BWD_SIMD_LAYER
inline void softcap_row(float* __restrict s, float* __restrict slope, float cap, float inv_cap,
                        int64_t width = Bt) {
    namespace v = simd;
    for (int64_t j = 0; j < width; j += v::W) {
        const v::Vec th = v::tanh_vec(v::vmul(v::vload(s + j), v::vset(inv_cap)));
        v::vstore(s + j, v::vmul(v::vset(cap), th));
        v::vstore(slope + j, v::vfnma(th, th, v::vset(1.0f)));
    }
}
#endif

// For query rows [i0, i0 + nr) of head h and keys [j0, j0 + nc) (tiles loaded): t.p = the
// probabilities exp(s - lse) the forward used, t.ds = dL/ds of the scaled score s = q . k
// scale (before softcap): P * (dP - delta) * softcap'(s). Rows >= nr and columns >= nc are 0; so
// are keys a row does not see, and rows whose lse is -inf (they saw no key and no sink).
template <class A>
void probs_and_dscores(const BackwardParams& bp, int64_t batch, int64_t head, int64_t i0,
                       int64_t nr, const KeyTiles<A>& kb, int64_t seqlen_k, Tiles<A>& t) {
    const AttentionParams& a = bp.attn;
    const int64_t j0 = kb.j0, nc = kb.nc;
    gemm<A, false>(t.q_rows, t.q_ld, 1, kb.kt, Bt, t.p, Bt, nr, Bt, a.head_dim);              // S
    gemm<A, false>(t.dout_rows, t.dout_ld, 1, kb.vt, Bt, t.ds, Bt, nr, Bt, a.head_dim_v);   // dP
    const A* lse = static_cast<const A*>(a.lse) + batch * a.lse_batch_stride + head * a.lse_head_stride;
    const A* delta = static_cast<const A*>(bp.delta) + (batch * a.heads + head) * a.seqlen_q;
    alignas(64) A slope[Bt];
    for (int64_t r = 0; r < Bt; ++r) {
        A* __restrict s = t.p + r * Bt;
        A* __restrict g = t.ds + r * Bt;
        const int64_t i = i0 + r;
        const KeyRange vis = r < nr ? visible_keys(a, i, seqlen_k) : KeyRange{0, 0};
        const A l = r < nr ? lse[i * a.lse_row_stride] : neg_inf<A>();
        if (vis.end <= j0 || vis.begin >= j0 + nc || l == neg_inf<A>()) {
            for (int64_t j = 0; j < Bt; ++j) s[j] = g[j] = 0;
            continue;
        }
        nonfinite_to_nan(s, nc);
        RowOptions<A> options(a, batch, head, i, seqlen_k);
        const A cap = options.softcap;
        if (cap != A(0)) {
            options.softcap = 0;  // applied here, keeping its derivative
            softcap_row(s, slope, cap, options.inv_softcap);
        }
        options.apply(s, j0, nc);
        const int64_t lo = vis.begin - j0, hi = vis.end - j0;  // visible columns [lo, hi)
        finish_row(s, g, cap != A(0) ? slope : nullptr, l * static_cast<A>(SoftmaxBase<A>::kUnit), delta[i],
                   lo < 0 ? 0 : lo, hi < nc ? hi : nc);
    }
}

// dq rows of head h, query rows i0.. of the padded dq (dq_row_stride apart).
template <class A>
inline A* dq_rows(const BackwardParams& bp, int64_t b, int64_t h, int64_t i0) {
    const AttentionParams& a = bp.attn;
    return static_cast<A*>(bp.dq) + ((b * a.heads + h) * a.seqlen_q + i0) * bp.dq_row_stride;
}

// dk, dv rows [j_begin, j_end) of kv head g, in key blocks of Bt (at most
// kBackwardKeyBlocks): every query head of the group, every query block that sees the keys,
// in a fixed order, each query block read once for all the key blocks; with_dq: also dq +=
// dS K into the dq rows of those query blocks, key blocks in increasing order (unscaled:
// finish_dq scales).
template <class T, class A>
void key_blocks(const BackwardParams& bp, int64_t b, int64_t g, int64_t j_begin, int64_t j_end,
                bool with_dq, Tiles<A>& t) {
    const AttentionParams& a = bp.attn;
    const int64_t D = a.head_dim, Dv = a.head_dim_v;
    const int64_t seqlen_k = batch_seqlen_k(a, b);
    const int64_t blocks = (j_end - j_begin + Bt - 1) / Bt;
    for (int64_t s = 0; s < blocks; ++s) {
        KeyTiles<A>& kb = t.keys[s];
        kb.j0 = j_begin + s * Bt;
        kb.j_end = kb.j0 + Bt < j_end ? kb.j0 + Bt : j_end;
        kb.nc = (kb.j_end < seqlen_k ? kb.j_end : seqlen_k) - kb.j0;  // keys past seqlen_k: 0
        for (int64_t e = 0; e < Bt * t.dp; ++e) kb.dk[e] = 0;
        for (int64_t e = 0; e < Bt * t.dvp; ++e) kb.dv[e] = 0;
        if (kb.nc > 0) load_keys<T, A>(bp, b, g, with_dq, t.dp, kb);
    }
    const int64_t group = a.heads / a.kv_heads;
    for (int64_t h = g * group; h < (g + 1) * group; ++h)
        for (int64_t i0 = 0; i0 < a.seqlen_q; i0 += Bt) {
            const int64_t nr = a.seqlen_q - i0 < Bt ? a.seqlen_q - i0 : Bt;
            const KeyRange span = rows_key_span(a, i0, nr, seqlen_k);
            bool loaded = false;
            for (int64_t s = 0; s < blocks; ++s) {
                const KeyTiles<A>& kb = t.keys[s];
                if (kb.nc <= 0 || !span_meets(span, kb.j0, kb.nc)) continue;
                if (!loaded) load_queries<T, A>(bp, b, h, i0, nr, t);
                loaded = true;
                probs_and_dscores<A>(bp, b, h, i0, nr, kb, seqlen_k, t);
                accumulate_product<A>(t.dout_nonfinite, t.p, 1, Bt, t.dout_rows, t.dout_ld, kb.dv,  // dV += P^T dO
                                      t.dvp, kb.nc, t.dvp, nr);
                accumulate_product<A>(t.q_nonfinite, t.ds, 1, Bt, t.q_rows, t.q_ld, kb.dk, t.dp,  // dK += dS^T q
                                      kb.nc, t.dp, nr);
                if (with_dq)                                                                       // dQ += dS K
                    accumulate_product<A>(kb.k_nonfinite, t.ds, Bt, 1, kb.kr, t.dp, dq_rows<A>(bp, b, h, i0),
                                          bp.dq_row_stride, nr, t.dp, kb.nc);
            }
        }
    const A scale = static_cast<A>(a.scale);  // dK = scale dS^T q
    for (int64_t s = 0; s < blocks; ++s) {
        const KeyTiles<A>& kb = t.keys[s];
        A* dk = static_cast<A*>(bp.dk) + ((b * a.kv_heads + g) * a.seqlen_k + kb.j0) * D;
        A* dv = static_cast<A*>(bp.dv) + ((b * a.kv_heads + g) * a.seqlen_k + kb.j0) * Dv;
        for (int64_t j = 0; j < kb.j_end - kb.j0; ++j) {
            for (int64_t e = 0; e < D; ++e) dk[j * D + e] = kb.dk[j * t.dp + e] * scale;
            for (int64_t e = 0; e < Dv; ++e) dv[j * Dv + e] = kb.dv[j * t.dvp + e];
        }
    }
}

// dq rows [i0, i0 + nr) of head h: zeroed before the first key tile, scaled after the last.
template <class A>
void clear_dq(const BackwardParams& bp, int64_t b, int64_t h, int64_t i0, int64_t nr) {
    A* dq = dq_rows<A>(bp, b, h, i0);
    for (int64_t e = 0; e < nr * bp.dq_row_stride; ++e) dq[e] = 0;
}
template <class A>
void finish_dq(const BackwardParams& bp, int64_t b, int64_t h, int64_t i0, int64_t nr) {
    A* dq = dq_rows<A>(bp, b, h, i0);
    const A scale = static_cast<A>(bp.attn.scale);
    for (int64_t e = 0; e < nr * bp.dq_row_stride; ++e) dq[e] *= scale;
}

// The fused schedule: dk, dv and dq of every head of kv head g, key blocks in order.
template <class T, class A>
void group(const BackwardParams& bp, int64_t b, int64_t g, A* ws) {
    const AttentionParams& a = bp.attn;
    Tiles<A> t(a, ws);
    const int64_t group_size = a.heads / a.kv_heads;
    for (int64_t h = g * group_size; h < (g + 1) * group_size; ++h) clear_dq<A>(bp, b, h, 0, a.seqlen_q);
    const int64_t step = Bt * backward_key_blocks(a);
    for (int64_t j0 = 0; j0 < a.seqlen_k; j0 += step)
        key_blocks<T, A>(bp, b, g, j0, j0 + step < a.seqlen_k ? j0 + step : a.seqlen_k, true, t);
    for (int64_t h = g * group_size; h < (g + 1) * group_size; ++h) finish_dq<A>(bp, b, h, 0, a.seqlen_q);
}

// The two-pass schedule's dq pass: dq rows [task.begin, task.end) of query head task.head,
// over the key tiles they see in increasing order.
template <class T, class A>
void query_block(const BackwardParams& bp, const BackwardTask& task, A* ws) {
    const AttentionParams& a = bp.attn;
    Tiles<A> t(a, ws);
    const int64_t b = task.batch, h = task.head, g = h / (a.heads / a.kv_heads);
    const int64_t i0 = task.begin, nr = task.end - task.begin;
    const int64_t seqlen_k = batch_seqlen_k(a, b);
    clear_dq<A>(bp, b, h, i0, nr);
    const KeyRange span = rows_key_span(a, i0, nr, seqlen_k);
    if (span.end > span.begin) {
        load_queries<T, A>(bp, b, h, i0, nr, t);
        KeyTiles<A>& kb = t.keys[0];
        for (kb.j0 = span.begin / Bt * Bt; kb.j0 < span.end; kb.j0 += Bt) {
            kb.nc = seqlen_k - kb.j0 < Bt ? seqlen_k - kb.j0 : Bt;
            load_keys<T, A>(bp, b, g, true, t.dp, kb);
            probs_and_dscores<A>(bp, b, h, i0, nr, kb, seqlen_k, t);
            accumulate_product<A>(kb.k_nonfinite, t.ds, Bt, 1, kb.kr, t.dp, dq_rows<A>(bp, b, h, i0),
                                  bp.dq_row_stride, nr, t.dp, kb.nc);
        }
    }
    finish_dq<A>(bp, b, h, i0, nr);
}

// The two-pass schedule's dk/dv pass: keys [task.begin, task.end) of kv head task.head.
template <class T, class A>
void key_pass_block(const BackwardParams& bp, const BackwardTask& task, A* ws) {
    Tiles<A> t(bp.attn, ws);
    key_blocks<T, A>(bp, task.batch, task.head, task.begin, task.end, false, t);
}

// ---- key_index (sparse attention): each query row's listed keys ----
//
// The same tile products over gathered keys. A tile's rows are the query heads of one kv
// head at one query row i (their q rows a head stride apart, up to Bt of them); its
// columns are up to Bt of the keys row i lists and sees (list order; -1 and keys causal or
// window hide skipped), copied from wherever they are. Only listed K/V rows are read.
// A tile of few rows (kDotHeads query heads per kv head or fewer) keeps its keys as rows
// and takes S and dP as dot products (dot_rows): transposing each gathered key, as the
// products of many rows want it, cost more than the products themselves there.
// Two passes (backward.cpp), each task owning the rows it writes:
//  - dk/dv (listed_key_range): keys [begin, end) of kv head g. For each row i in order,
//    the tile's dK, dV start from the running sums of its keys' rows and are written back
//    (a tile of few rows adds into those rows directly: add_to_rows; a row lists a key at
//    most once), so each dk / dv element is one chain over (query row, query head) in
//    increasing order, whatever the ranges.
//  - dq (listed_query_rows): rows [begin, end) of a block of query heads, each dq element
//    one chain over its row's listed keys in list order.

// Up to Bt positions row i of batch entry b lists for kv head g (list entries `from` on)
// that lie in [range.begin, range.end) (the row's visible keys, narrowed): into pos, in
// list order. Returns how many; `from` moves past the entries read.
inline int64_t gather_listed(const AttentionParams& a, int64_t b, int64_t g, int64_t i,
                             const KeyRange& range, int64_t& from, int64_t* pos) {
    const int32_t* list = a.key_index + b * a.key_index_batch_stride + g * a.key_index_head_stride +
                          i * a.key_index_row_stride;
    int64_t n = 0;
    for (; from < a.key_index_count && n < Bt; ++from) {
        const int64_t j = list[from];
        if (j >= range.begin && j < range.end) pos[n++] = j;  // (-1 too: range.begin >= 0)
    }
    return n;
}

// Query heads per kv head up to which a tile keeps its keys as rows (dot_rows); a fixed
// number, so the layout follows the shape alone.
constexpr int64_t kDotHeads = 16;

// c[m * Bt + r] = mul * (a row m . b row r) for m < rows, r < n (rows of `dim` values, a
// multiple of the vector lanes, zero-padded), c[m * Bt + r] = 0 for r in [n, width): each
// dot product one fixed chain of vector fused multiply-adds, then vsum.
template <class A>
void dot_rows(const A* __restrict a, int64_t a_ld, int64_t rows, const A* __restrict b, int64_t b_ld,
              int64_t n, int64_t width, int64_t dim, A mul, A* __restrict c) {
    constexpr int64_t L = vec_lanes<A>();
    constexpr int kRows = 4;  // rows per sweep of b: each b vector loaded once for them
    for (int64_t m0 = 0; m0 < rows; m0 += kRows) {
        const int mr = rows - m0 < kRows ? static_cast<int>(rows - m0) : kRows;
        for (int64_t r = 0; r < n; ++r) {
            Vec<A> acc[kRows] = {};
            const A* br = b + r * b_ld;
            for (int64_t e = 0; e < dim; e += L) {
                const Vec<A> bv = loadu(br + e);
                for (int m = 0; m < kRows; ++m)
                    if (m < mr) acc[m] = fmadd(loadu(a + (m0 + m) * a_ld + e), bv, acc[m]);
            }
            for (int m = 0; m < mr; ++m) c[(m0 + m) * Bt + r] = vsum(acc[m]) * mul;
        }
        for (int m = 0; m < mr; ++m)
            for (int64_t r = n; r < width; ++r) c[(m0 + m) * Bt + r] = 0;
    }
}

// For r < n: row pos[r] of `base` (rows row_len apart) += sum_{m < K} coef[m * Bt + r] *
// b[m * ldb + (0, dim)]: dK += dS^T q and dV += P^T dO of a tile of few rows, straight into
// the gradient rows (no copy in and out). Each element one chain of fused multiply-adds over
// m in increasing order, from the row's running value, as gemm's; zero coefficients
// skipped when b holds an inf or a NaN (gemm_skipping_zeros' rule).
template <class A>
void add_to_rows(A* base, int64_t row_len, const int64_t* pos, int64_t n, const A* coef, const A* b,
                 int64_t ldb, int64_t K, int64_t dim, bool b_nonfinite) {
    constexpr int64_t L = vec_lanes<A>();
    for (int64_t r = 0; r < n; ++r) {
        A* __restrict row = base + pos[r] * row_len;
        if (b_nonfinite) {
            for (int64_t m = 0; m < K; ++m) {
                const A x = coef[m * Bt + r];
                if (x == A(0)) continue;
                for (int64_t e = 0; e < dim; ++e) row[e] = madd(x, b[m * ldb + e], row[e]);
            }
            continue;
        }
        int64_t e = 0;
        for (; e + L <= dim; e += L) {
            Vec<A> acc = loadu(row + e);
            for (int64_t m = 0; m < K; ++m) acc = fmadd(splat(coef[m * Bt + r]), loadu(b + m * ldb + e), acc);
            storeu(row + e, acc);
        }
        for (; e < dim; ++e) {
            A acc = row[e];
            for (int64_t m = 0; m < K; ++m) acc = madd(coef[m * Bt + r], b[m * ldb + e], acc);
            row[e] = acc;
        }
    }
}

// Keys pos[0, n) of kv head g into kb, as load_keys does for a contiguous block: kt, vt
// (and kr with with_kr); or, as_rows (dot_rows' layout), K rows in kr and V rows in vt's
// memory (Bt x dvp), both zero-padded.
template <class T, class A>
void load_listed_keys(const BackwardParams& bp, int64_t b, int64_t g, const int64_t* pos, int64_t n,
                      bool with_kr, bool as_rows, int64_t dp, int64_t dvp, KeyTiles<A>& kb) {
    const AttentionParams& a = bp.attn;
    const int64_t D = a.head_dim, Dv = a.head_dim_v;
    bool k_nonfinite = false;
    if (as_rows) {
        for (int64_t r = 0; r < n; ++r) {
            const T* k = rows_at<T>(a.k, a.k_batch_stride, a.k_head_stride, a.k_row_stride, b, g, pos[r]);
            const T* v = rows_at<T>(a.v, a.v_batch_stride, a.v_head_stride, a.v_row_stride, b, g, pos[r]);
            for (int64_t e = 0; e < D; ++e) kb.kr[r * dp + e] = load_acc<A>(k[e]);
            for (int64_t e = D; e < dp; ++e) kb.kr[r * dp + e] = 0;
            for (int64_t e = 0; e < Dv; ++e) kb.vt[r * dvp + e] = load_acc<A>(v[e]);
            for (int64_t e = Dv; e < dvp; ++e) kb.vt[r * dvp + e] = 0;
            k_nonfinite |= any_nonfinite(k, 0, 1, D);
        }
        kb.j0 = 0, kb.j_end = kb.nc = n;
        kb.k_nonfinite = k_nonfinite;
        return;
    }
    const A k_mul = static_cast<A>(a.scale * SoftmaxBase<A>::kUnit);
    const int64_t width = backward_padded(n);  // the columns the products read
    for (int64_t e = 0; e < D; ++e)
        for (int64_t r = n; r < width; ++r) kb.kt[e * Bt + r] = 0;
    for (int64_t e = 0; e < Dv; ++e)
        for (int64_t r = n; r < width; ++r) kb.vt[e * Bt + r] = 0;
    for (int64_t r = 0; r < n; ++r) {
        const T* k = rows_at<T>(a.k, a.k_batch_stride, a.k_head_stride, a.k_row_stride, b, g, pos[r]);
        const T* v = rows_at<T>(a.v, a.v_batch_stride, a.v_head_stride, a.v_row_stride, b, g, pos[r]);
        for (int64_t e = 0; e < D; ++e) kb.kt[e * Bt + r] = load_acc<A>(k[e]) * k_mul;
        for (int64_t e = 0; e < Dv; ++e) kb.vt[e * Bt + r] = load_acc<A>(v[e]);
        if (with_kr) {
            for (int64_t e = 0; e < D; ++e) kb.kr[r * dp + e] = load_acc<A>(k[e]);
            for (int64_t e = D; e < dp; ++e) kb.kr[r * dp + e] = 0;
        }
        k_nonfinite |= any_nonfinite(k, 0, 1, D);
    }
    kb.j0 = 0, kb.j_end = kb.nc = n;
    kb.k_nonfinite = k_nonfinite;
}

// Query heads [h0, h0 + nr) at row i: q and dout rows (load_query_rows).
template <class T, class A>
void load_head_rows(const BackwardParams& bp, int64_t b, int64_t h0, int64_t i, int64_t nr, Tiles<A>& t) {
    const AttentionParams& a = bp.attn;
    const T* q = rows_at<T>(a.q, a.q_batch_stride, a.q_head_stride, a.q_row_stride, b, h0, i);
    const T* d = rows_at<T>(bp.dout, bp.dout_batch_stride, bp.dout_head_stride, bp.dout_row_stride, b, h0, i);
    load_query_rows<T, A>(bp, q, a.q_head_stride, d, bp.dout_head_stride, nr, t);
}

// probs_and_dscores for a tile of gathered keys (every one seen by every row; as_rows: in
// dot_rows' layout): t.p = P, t.ds = dS for query heads [h0, h0 + nr) at row i; rows whose
// lse is -inf get 0.
template <class A>
void listed_probs_and_dscores(const BackwardParams& bp, int64_t b, int64_t h0, int64_t i, int64_t nr,
                              const KeyTiles<A>& kb, bool as_rows, Tiles<A>& t) {
    const AttentionParams& a = bp.attn;
    const int64_t nc = kb.nc, width = backward_padded(nc);  // columns [nc, width) are 0
    if (as_rows) {
        dot_rows<A>(t.q_rows, t.q_ld, nr, kb.kr, t.dp, nc, width, t.dp,                             // S
                    static_cast<A>(a.scale * SoftmaxBase<A>::kUnit), t.p);
        dot_rows<A>(t.dout_rows, t.dout_ld, nr, kb.vt, t.dvp, nc, width, t.dvp, A(1), t.ds);    // dP
    } else {
        gemm<A, false>(t.q_rows, t.q_ld, 1, kb.kt, Bt, t.p, Bt, nr, width, a.head_dim);              // S
        gemm<A, false>(t.dout_rows, t.dout_ld, 1, kb.vt, Bt, t.ds, Bt, nr, width, a.head_dim_v);   // dP
    }
    // softcap in the softmax's units, as RowOptions converts it
    const A cap = a.softcap > 0 ? static_cast<A>(a.softcap * SoftmaxBase<A>::kUnit) : A(0);
    const A inv_cap = a.softcap > 0 ? static_cast<A>(1.0 / (a.softcap * SoftmaxBase<A>::kUnit)) : A(0);
    const A* lse = static_cast<const A*>(a.lse) + b * a.lse_batch_stride + i * a.lse_row_stride;
    const A* delta = static_cast<const A*>(bp.delta) + b * a.heads * a.seqlen_q + i;
    alignas(64) A slope[Bt];
    for (int64_t r = 0; r < nr; ++r) {
        A* __restrict s = t.p + r * Bt;
        A* __restrict g = t.ds + r * Bt;
        const int64_t h = h0 + r;
        const A l = lse[h * a.lse_head_stride];
        if (l == neg_inf<A>()) {
            for (int64_t j = 0; j < width; ++j) s[j] = g[j] = 0;
            continue;
        }
        nonfinite_to_nan(s, nc);
        if (cap != A(0)) softcap_row(s, slope, cap, inv_cap, width);
        finish_row(s, g, cap != A(0) ? slope : nullptr, l * static_cast<A>(SoftmaxBase<A>::kUnit),
                   delta[h * a.seqlen_q], 0, nc, width);
    }
}

// The dk/dv pass with key_index: dk, dv rows [task.begin, task.end) of kv head task.head.
template <class T, class A>
void listed_key_range(const BackwardParams& bp, const BackwardTask& task, A* ws) {
    const AttentionParams& a = bp.attn;
    Tiles<A> t(a, ws);
    KeyTiles<A>& kb = t.keys[0];
    const int64_t b = task.batch, g = task.head, D = a.head_dim, Dv = a.head_dim_v;
    const int64_t seqlen_k = batch_seqlen_k(a, b);
    const int64_t group = a.heads / a.kv_heads;
    const bool as_rows = group <= kDotHeads;
    A* dk = static_cast<A*>(bp.dk) + (b * a.kv_heads + g) * a.seqlen_k * D;
    A* dv = static_cast<A*>(bp.dv) + (b * a.kv_heads + g) * a.seqlen_k * Dv;
    for (int64_t e = task.begin * D; e < task.end * D; ++e) dk[e] = 0;
    for (int64_t e = task.begin * Dv; e < task.end * Dv; ++e) dv[e] = 0;
    int64_t pos[Bt];
    for (int64_t i = 0; i < a.seqlen_q; ++i) {
        const KeyRange vis = visible_keys(a, i, seqlen_k);
        const KeyRange range{vis.begin > task.begin ? vis.begin : task.begin,
                             vis.end < task.end ? vis.end : task.end};
        if (range.begin >= range.end) continue;
        bool loaded = false;  // the row's q and dout, when one tile holds every head
        for (int64_t from = 0;;) {
            const int64_t n = gather_listed(a, b, g, i, range, from, pos);
            if (n == 0) break;
            load_listed_keys<T, A>(bp, b, g, pos, n, false, as_rows, t.dp, t.dvp, kb);
            if (as_rows) {  // one head block: the products go straight into the rows
                if (!loaded) load_head_rows<T, A>(bp, b, g * group, i, group, t);
                loaded = true;
                listed_probs_and_dscores<A>(bp, b, g * group, i, group, kb, true, t);
                add_to_rows<A>(dv, Dv, pos, n, t.p, t.dout_rows, t.dout_ld, group, Dv, t.dout_nonfinite);
                add_to_rows<A>(dk, D, pos, n, t.ds, t.q_rows, t.q_ld, group, D, t.q_nonfinite);
                continue;
            }
            for (int64_t r = 0; r < n; ++r) {  // the keys' running sums
                for (int64_t e = 0; e < D; ++e) kb.dk[r * t.dp + e] = dk[pos[r] * D + e];
                for (int64_t e = D; e < t.dp; ++e) kb.dk[r * t.dp + e] = 0;
                for (int64_t e = 0; e < Dv; ++e) kb.dv[r * t.dvp + e] = dv[pos[r] * Dv + e];
                for (int64_t e = Dv; e < t.dvp; ++e) kb.dv[r * t.dvp + e] = 0;
            }
            for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += Bt) {
                const int64_t nr = (g + 1) * group - h0 < Bt ? (g + 1) * group - h0 : Bt;
                if (!loaded) load_head_rows<T, A>(bp, b, h0, i, nr, t);
                loaded = group <= Bt;
                listed_probs_and_dscores<A>(bp, b, h0, i, nr, kb, as_rows, t);
                accumulate_product<A>(t.dout_nonfinite, t.p, 1, Bt, t.dout_rows, t.dout_ld, kb.dv,  // dV += P^T dO
                                      t.dvp, n, t.dvp, nr);
                accumulate_product<A>(t.q_nonfinite, t.ds, 1, Bt, t.q_rows, t.q_ld, kb.dk, t.dp,  // dK += dS^T q
                                      n, t.dp, nr);
            }
            for (int64_t r = 0; r < n; ++r) {
                for (int64_t e = 0; e < D; ++e) dk[pos[r] * D + e] = kb.dk[r * t.dp + e];
                for (int64_t e = 0; e < Dv; ++e) dv[pos[r] * Dv + e] = kb.dv[r * t.dvp + e];
            }
        }
    }
    const A scale = static_cast<A>(a.scale);  // dK = scale dS^T q
    for (int64_t e = task.begin * D; e < task.end * D; ++e) dk[e] *= scale;
}

// The dq pass with key_index: dq rows [task.begin, task.end) of query heads task.head ..
// (up to Bt of them, within one kv head's group).
template <class T, class A>
void listed_query_rows(const BackwardParams& bp, const BackwardTask& task, A* ws) {
    const AttentionParams& a = bp.attn;
    Tiles<A> t(a, ws);
    KeyTiles<A>& kb = t.keys[0];
    const int64_t b = task.batch, h0 = task.head, group = a.heads / a.kv_heads, g = h0 / group;
    const int64_t nr = (g + 1) * group - h0 < Bt ? (g + 1) * group - h0 : Bt;
    const bool as_rows = group <= kDotHeads;
    const int64_t seqlen_k = batch_seqlen_k(a, b);
    const int64_t head_ld = a.seqlen_q * bp.dq_row_stride;  // between the heads' dq rows
    const A scale = static_cast<A>(a.scale);
    int64_t pos[Bt];
    for (int64_t i = task.begin; i < task.end; ++i) {
        A* dq = dq_rows<A>(bp, b, h0, i);
        for (int64_t r = 0; r < nr; ++r)
            for (int64_t e = 0; e < bp.dq_row_stride; ++e) dq[r * head_ld + e] = 0;
        const KeyRange vis = visible_keys(a, i, seqlen_k);
        bool loaded = false;
        for (int64_t from = 0; vis.begin < vis.end;) {
            const int64_t n = gather_listed(a, b, g, i, vis, from, pos);
            if (n == 0) break;
            if (!loaded) load_head_rows<T, A>(bp, b, h0, i, nr, t);
            loaded = true;
            load_listed_keys<T, A>(bp, b, g, pos, n, true, as_rows, t.dp, t.dvp, kb);
            listed_probs_and_dscores<A>(bp, b, h0, i, nr, kb, as_rows, t);
            accumulate_product<A>(kb.k_nonfinite, t.ds, Bt, 1, kb.kr, t.dp, dq, head_ld, nr, t.dp, n);  // dQ += dS K
        }
        for (int64_t r = 0; r < nr; ++r)
            for (int64_t e = 0; e < bp.dq_row_stride; ++e) dq[r * head_ld + e] *= scale;
    }
}

// fn<T, float>(...) with T the call's float32-accumulated dtype (with_q_type: float32,
// bfloat16 or float16; q, k and v share it).
#define ATTNFAST_BWD_BY_DTYPE(fn, ...)                                          \
    with_q_type(bp.attn.dtype, [&](auto stored) { fn<typename decltype(stored)::type, float>(__VA_ARGS__); });
void group_f32(const BackwardParams& bp, int64_t b, int64_t g, float* ws) {
    ATTNFAST_BWD_BY_DTYPE(group, bp, b, g, ws)
}
void key_block_f32(const BackwardParams& bp, const BackwardTask& t, float* ws) {
    ATTNFAST_BWD_BY_DTYPE(key_pass_block, bp, t, ws)
}
void query_block_f32(const BackwardParams& bp, const BackwardTask& t, float* ws) {
    ATTNFAST_BWD_BY_DTYPE(query_block, bp, t, ws)
}
void listed_keys_f32(const BackwardParams& bp, const BackwardTask& t, float* ws) {
    ATTNFAST_BWD_BY_DTYPE(listed_key_range, bp, t, ws)
}
void listed_queries_f32(const BackwardParams& bp, const BackwardTask& t, float* ws) {
    ATTNFAST_BWD_BY_DTYPE(listed_query_rows, bp, t, ws)
}
#undef ATTNFAST_BWD_BY_DTYPE
void group_f64(const BackwardParams& bp, int64_t b, int64_t g, double* ws) {
    group<double, double>(bp, b, g, ws);
}
void key_block_f64(const BackwardParams& bp, const BackwardTask& t, double* ws) {
    key_pass_block<double, double>(bp, t, ws);
}
void query_block_f64(const BackwardParams& bp, const BackwardTask& t, double* ws) {
    query_block<double, double>(bp, t, ws);
}
void listed_keys_f64(const BackwardParams& bp, const BackwardTask& t, double* ws) {
    listed_key_range<double, double>(bp, t, ws);
}
void listed_queries_f64(const BackwardParams& bp, const BackwardTask& t, double* ws) {
    listed_query_rows<double, double>(bp, t, ws);
}

const BackwardKernels kBackward = {group_f32, group_f64, key_block_f32, key_block_f64,
                                   query_block_f32, query_block_f64, listed_keys_f32,
                                   listed_keys_f64, listed_queries_f32, listed_queries_f64};

}  // namespace bwd

const BackwardKernels* backward_kernels() { return &bwd::kBackward; }  // KernelTable::backward_kernels
}  // namespace
#undef ATTNFAST_BWD_SIMD_LAYER

}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
