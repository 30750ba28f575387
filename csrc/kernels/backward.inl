// The backward kernels (csrc/backward.hpp), compiled by every kernels/isa_*.cpp with its own
// flags; included after block_attention.inl and decode_attention.inl, whose score options
// (RowOptions, visible_keys), exp and vector types it reuses, so the backward sees exactly
// the scores the forward saw.
//
// Every product of FlashAttention-2's backward is one shape of micro-GEMM here:
// c[r][0, 64) (+)= sum_k a[r][k] b[k][0, 64), with the tile transposed where needed:
//   S = qs kt, dP = dout vt              (query rows x keys)
//   dv^T += dout^T P, dk^T += qs^T dS    (Dv or D x keys)
//   dq^T += kt dS^T                      (D x query rows)
#include "../backward.hpp"

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace bwd {

constexpr int64_t Bt = kBackwardTile;

// R rows of c at once: R * (vectors per row) accumulators, sized to stay in registers.
template <class A, int R, bool kAccumulate>
inline void gemm_rows(const A* __restrict a, int64_t lda, const A* __restrict b, A* __restrict c,
                      int64_t dim) {
    constexpr int lanes = static_cast<int>(vec_lanes<A>());
    constexpr int nv = static_cast<int>(Bt) / lanes;
    Vec<A> acc[R][nv];
    for (int u = 0; u < R; ++u)
        for (int v = 0; v < nv; ++v) {
            if (kAccumulate) acc[u][v] = vload(c + u * Bt + v * lanes);
            else acc[u][v] = Vec<A>{};
        }
    for (int64_t k = 0; k < dim; ++k) {
        const A* brow = b + k * Bt;
        for (int v = 0; v < nv; ++v) {
            const Vec<A> bv = vload(brow + v * lanes);
            for (int u = 0; u < R; ++u) acc[u][v] += a[u * lda + k] * bv;
        }
    }
    for (int u = 0; u < R; ++u)
        for (int v = 0; v < nv; ++v) vstore(c + u * Bt + v * lanes, acc[u][v]);
}

// c (rows x Bt) (+)= a (rows x dim, rows lda apart) times b (dim x Bt).
template <class A, bool kAccumulate>
inline void gemm(const A* a, int64_t lda, const A* b, A* c, int64_t rows, int64_t dim) {
    constexpr int nv = static_cast<int>(Bt * sizeof(A) / sizeof(Vec<A>));
    constexpr int R = nv >= 16 ? 1 : (16 / nv > 4 ? 4 : 16 / nv);
    int64_t r = 0;
    for (; r + R <= rows; r += R) gemm_rows<A, R, kAccumulate>(a + r * lda, lda, b, c + r * Bt, dim);
    for (; r < rows; ++r) gemm_rows<A, 1, kAccumulate>(a + r * lda, lda, b, c + r * Bt, dim);
}

// dst[j][i] = src[i][j] for a Bt x Bt tile.
template <class A>
inline void transpose_tile(const A* __restrict src, A* __restrict dst) {
    for (int64_t i = 0; i < Bt; ++i)
        for (int64_t j = 0; j < Bt; ++j) dst[j * Bt + i] = src[i * Bt + j];
}

// Rows [first, first + n) of one (batch, head) of a (B, H, T, dim) tensor with the given
// strides, as A: into x (n x dim) scaled by `mul`, and/or xt (dim x Bt, columns >= n zero).
template <class T, class A>
inline void load_rows(const void* data, int64_t batch_stride, int64_t head_stride, int64_t row_stride,
                      int64_t batch, int64_t head, int64_t first, int64_t n, int64_t dim, A mul,
                      A* __restrict x, A* __restrict xt) {
    const T* base = static_cast<const T*>(data) + batch * batch_stride + head * head_stride;
    if (xt)
        for (int64_t e = 0; e < dim * Bt; ++e) xt[e] = 0;
    for (int64_t r = 0; r < n; ++r) {
        const T* row = base + (first + r) * row_stride;
        for (int64_t e = 0; e < dim; ++e) {
            const A value = load_acc<A>(row[e]) * mul;
            if (x) x[r * dim + e] = value;
            if (xt) xt[e * Bt + r] = value;
        }
    }
}

// The visible keys of query rows [first, first + n): a superset of every row's range
// (visible_keys' begin and end both grow with the row).
inline KeyRange rows_key_span(const AttentionParams& p, int64_t first, int64_t n, int64_t seqlen_k) {
    const KeyRange top = visible_keys(p, first, seqlen_k);
    const KeyRange bottom = visible_keys(p, first + n - 1, seqlen_k);
    return {top.begin, bottom.end > top.begin ? bottom.end : top.begin};
}

// For query rows [i0, i0 + nr) of head h and keys [j0, j0 + nc): p = the probabilities
// exp(s - lse) the forward used, ds = dL/ds of the scaled score s = qs . k (before softcap):
// P * (dP - delta) * softcap'(s). Rows >= nr and columns >= nc are 0; so are keys a row
// does not see, and rows whose lse is -inf (they saw no key and no sink).
template <class A>
void probs_and_dscores(const BackwardParams& bp, int64_t batch, int64_t head, int64_t i0,
                       int64_t nr, int64_t j0, int64_t nc, int64_t seqlen_k, const A* qs,
                       const A* dout, const A* kt, const A* vt, A* __restrict p, A* __restrict ds) {
    const AttentionParams& a = bp.attn;
    gemm<A, false>(qs, a.head_dim, kt, p, nr, a.head_dim);        // scores
    gemm<A, false>(dout, a.head_dim_v, vt, ds, nr, a.head_dim_v);  // dP = dout v^T
    const A* lse = static_cast<const A*>(a.lse) + batch * a.lse_batch_stride + head * a.lse_head_stride;
    const A* delta = static_cast<const A*>(bp.delta) + (batch * a.heads + head) * a.seqlen_q;
    for (int64_t r = 0; r < Bt; ++r) {
        A* __restrict s = p + r * Bt;
        A* __restrict g = ds + r * Bt;
        const int64_t i = i0 + r;
        const KeyRange vis = r < nr ? visible_keys(a, i, seqlen_k) : KeyRange{0, 0};
        const A l = r < nr ? lse[i * a.lse_row_stride] : neg_inf<A>();
        if (vis.end <= j0 || vis.begin >= j0 + nc || l == neg_inf<A>()) {
            for (int64_t j = 0; j < Bt; ++j) s[j] = g[j] = 0;
            continue;
        }
        nonfinite_to_nan(s, nc);
        RowOptions<A> options(a, batch, head, i, seqlen_k);
        const A cap = options.softcap, inv_cap = options.inv_softcap;
        options.softcap = 0;  // applied here, keeping its derivative 1 - tanh^2
        A slope[Bt];
        for (int64_t j = 0; j < Bt; ++j) slope[j] = 1;
        if (cap != A(0))
            for (int64_t j = 0; j < nc; ++j) {
                const A t = tanh_acc(s[j] * inv_cap);
                s[j] = cap * t;
                slope[j] = 1 - t * t;
            }
        options.apply(s, j0, nc);
        const A d = delta[i];
        const int64_t lo = vis.begin - j0, hi = vis.end - j0;  // visible columns [lo, hi)
        for (int64_t j = 0; j < Bt; ++j) {
            const bool seen = j >= lo && j < hi && j < nc;
            const A pj = seen ? exp_acc(s[j] - l) : A(0);
            g[j] = seen ? pj * (g[j] - d) * slope[j] : A(0);
            s[j] = pj;
        }
    }
}

// dk, dv rows [task.begin, task.end) of kv head task.head: every query head of the group,
// every query block that sees the keys, in a fixed order.
template <class T, class A>
void key_block(const BackwardParams& bp, const BackwardTask& task, A* ws) {
    const AttentionParams& a = bp.attn;
    const int64_t D = a.head_dim, Dv = a.head_dim_v, b = task.batch, g = task.head;
    A* kt = ws;
    A* vt = kt + D * Bt;
    A* dkt = vt + Dv * Bt;
    A* dvt = dkt + D * Bt;
    A* qs = dvt + Dv * Bt;
    A* qst = qs + Bt * D;
    A* dout = qst + D * Bt;
    A* doutt = dout + Bt * Dv;
    A* p = doutt + Dv * Bt;
    A* ds = p + Bt * Bt;
    for (int64_t e = 0; e < (D + Dv) * Bt; ++e) dkt[e] = 0;  // dkt, dvt
    const int64_t seqlen_k = batch_seqlen_k(a, b);
    const int64_t j0 = task.begin;
    const int64_t nc = task.end < seqlen_k ? task.end - j0 : seqlen_k - j0;  // keys past seqlen_k: 0
    if (nc > 0) {
        load_rows<T, A>(a.k, a.k_batch_stride, a.k_head_stride, a.k_row_stride, b, g, j0, nc, D,
                        A(1), nullptr, kt);
        load_rows<T, A>(a.v, a.v_batch_stride, a.v_head_stride, a.v_row_stride, b, g, j0, nc, Dv,
                        A(1), nullptr, vt);
        const int64_t group = a.heads / a.kv_heads;
        for (int64_t h = g * group; h < (g + 1) * group; ++h)
            for (int64_t i0 = 0; i0 < a.seqlen_q; i0 += Bt) {
                const int64_t nr = a.seqlen_q - i0 < Bt ? a.seqlen_q - i0 : Bt;
                const KeyRange span = rows_key_span(a, i0, nr, seqlen_k);
                if (span.end <= j0 || span.begin >= j0 + nc) continue;
                load_rows<T, A>(a.q, a.q_batch_stride, a.q_head_stride, a.q_row_stride, b, h, i0,
                                nr, D, static_cast<A>(a.scale), qs, qst);
                load_rows<T, A>(bp.dout, bp.dout_batch_stride, bp.dout_head_stride,
                                bp.dout_row_stride, b, h, i0, nr, Dv, A(1), dout, doutt);
                probs_and_dscores<A>(bp, b, h, i0, nr, j0, nc, seqlen_k, qs, dout, kt, vt, p, ds);
                gemm<A, true>(doutt, Bt, p, dvt, Dv, nr);
                gemm<A, true>(qst, Bt, ds, dkt, D, nr);
            }
    }
    A* dk = static_cast<A*>(bp.dk) + ((b * a.kv_heads + g) * a.seqlen_k + j0) * D;
    A* dv = static_cast<A*>(bp.dv) + ((b * a.kv_heads + g) * a.seqlen_k + j0) * Dv;
    for (int64_t j = 0; j < task.end - j0; ++j) {
        for (int64_t e = 0; e < D; ++e) dk[j * D + e] = dkt[e * Bt + j];
        for (int64_t e = 0; e < Dv; ++e) dv[j * Dv + e] = dvt[e * Bt + j];
    }
}

// dq rows [task.begin, task.end) of query head task.head, over the key tiles they see in
// increasing order.
template <class T, class A>
void query_block(const BackwardParams& bp, const BackwardTask& task, A* ws) {
    const AttentionParams& a = bp.attn;
    const int64_t D = a.head_dim, Dv = a.head_dim_v, b = task.batch, h = task.head;
    const int64_t g = h / (a.heads / a.kv_heads);
    A* qs = ws;
    A* dout = qs + Bt * D;
    A* kt = dout + Bt * Dv;
    A* vt = kt + D * Bt;
    A* dqt = vt + Dv * Bt;
    A* p = dqt + D * Bt;
    A* ds = p + Bt * Bt;
    A* dst = ds + Bt * Bt;
    for (int64_t e = 0; e < D * Bt; ++e) dqt[e] = 0;
    const int64_t i0 = task.begin, nr = task.end - task.begin;
    const int64_t seqlen_k = batch_seqlen_k(a, b);
    const KeyRange span = rows_key_span(a, i0, nr, seqlen_k);
    if (span.end > span.begin) {
        load_rows<T, A>(a.q, a.q_batch_stride, a.q_head_stride, a.q_row_stride, b, h, i0, nr, D,
                        static_cast<A>(a.scale), qs, nullptr);
        load_rows<T, A>(bp.dout, bp.dout_batch_stride, bp.dout_head_stride, bp.dout_row_stride,
                        b, h, i0, nr, Dv, A(1), dout, nullptr);
        for (int64_t j0 = span.begin / Bt * Bt; j0 < span.end; j0 += Bt) {
            const int64_t nc = seqlen_k - j0 < Bt ? seqlen_k - j0 : Bt;
            load_rows<T, A>(a.k, a.k_batch_stride, a.k_head_stride, a.k_row_stride, b, g, j0, nc,
                            D, A(1), nullptr, kt);
            load_rows<T, A>(a.v, a.v_batch_stride, a.v_head_stride, a.v_row_stride, b, g, j0, nc,
                            Dv, A(1), nullptr, vt);
            probs_and_dscores<A>(bp, b, h, i0, nr, j0, nc, seqlen_k, qs, dout, kt, vt, p, ds);
            transpose_tile(ds, dst);
            gemm<A, true>(kt, Bt, dst, dqt, D, nc);
        }
    }
    A* dq = static_cast<A*>(bp.dq) + ((b * a.heads + h) * a.seqlen_q + i0) * D;
    const A scale = static_cast<A>(a.scale);
    for (int64_t r = 0; r < nr; ++r)
        for (int64_t e = 0; e < D; ++e) dq[r * D + e] = dqt[e * Bt + r] * scale;
}

void key_block_f32(const BackwardParams& bp, const BackwardTask& t, float* ws) {
    switch (bp.attn.dtype) {
        case DType::kBF16: key_block<bf16_t, float>(bp, t, ws); break;
        case DType::kF16: key_block<f16_t, float>(bp, t, ws); break;
        default: key_block<float, float>(bp, t, ws); break;
    }
}
void query_block_f32(const BackwardParams& bp, const BackwardTask& t, float* ws) {
    switch (bp.attn.dtype) {
        case DType::kBF16: query_block<bf16_t, float>(bp, t, ws); break;
        case DType::kF16: query_block<f16_t, float>(bp, t, ws); break;
        default: query_block<float, float>(bp, t, ws); break;
    }
}
void key_block_f64(const BackwardParams& bp, const BackwardTask& t, double* ws) {
    key_block<double, double>(bp, t, ws);
}
void query_block_f64(const BackwardParams& bp, const BackwardTask& t, double* ws) {
    query_block<double, double>(bp, t, ws);
}

const BackwardKernels kBackward = {key_block_f32, key_block_f64, query_block_f32, query_block_f64};

}  // namespace bwd
}  // namespace

const BackwardKernels* backward_kernels() { return &bwd::kBackward; }

}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
