// The lightning indexer's scores (IndexParams, attnfast.hpp), compiled by every tier with its
// own flags on the typed vector layer (simd/typed.hpp): for one query row and a run of keys,
// scores[s] = k_scale[s] * sum_h w[h] * relu(q[h] . k[s]).
//
// The row's queries are fixed for all its keys, so they are staged once per call transposed,
// heads in the vector lanes (qt[d][h], heads padded to whole vectors with zeros). Keys go in
// blocks of kIndexKeyBlock, each row converted to float32 once; for each group of NHV head
// vectors, d by d, one load per head vector and one broadcast per key feed KB x NHV
// accumulators in registers (16 FMAs for 8 loads with AVX-512's four head vectors). A key's
// relu-ed head dots are weighted in the lanes and summed once (vsum: a fixed tree), so every
// key's score is the same operations wherever it sits in a block: the bits do not depend on
// the chunking or the thread count. Included by export_table.inl inside the tier's namespace.
#pragma once
#include "../simd/typed.hpp"
#include "kernel_table.hpp"

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace indexer {

constexpr int64_t kLanes = vec_lanes<float>();
constexpr int kKeys = static_cast<int>(kIndexKeyBlock);
// Head vectors per pass: KB x NHV accumulators plus NHV query vectors in the registers
// (32 with AVX-512 and NEON, 16 otherwise).
constexpr int kHeadVecs = ATTNFAST_SIMD_BYTES >= 64 ? 4 : 2;

#pragma GCC diagnostic push
#if defined(__clang__)
#pragma GCC diagnostic ignored "-Wunknown-warning-option"
#endif
#pragma GCC diagnostic ignored "-Wpsabi"  // all inlined: no vector crosses a call boundary

// total[j] += w[h] relu(q[h] . k[j]) in the lanes of head vectors [v0, v0 + NHV) for the
// block's kKeys keys (rows kr, head_dim apart).
template <int NHV>
inline void head_vectors(const float* qt, int64_t hp, const float* wv, int64_t v0, const float* kr,
                         int64_t dims, Vec<float>* total) {
    Vec<float> acc[kKeys][NHV];
    for (int j = 0; j < kKeys; ++j)
        for (int c = 0; c < NHV; ++c) acc[j][c] = Vec<float>{};
    for (int64_t d = 0; d < dims; ++d) {
        Vec<float> qv[NHV];
        for (int c = 0; c < NHV; ++c) qv[c] = vload(qt + d * hp + (v0 + c) * kLanes);
        for (int j = 0; j < kKeys; ++j) {
            const Vec<float> kb = splat(kr[j * dims + d]);
            for (int c = 0; c < NHV; ++c) acc[j][c] = fmadd(kb, qv[c], acc[j][c]);
        }
    }
    const Vec<float> zero = Vec<float>{};
    for (int c = 0; c < NHV; ++c) {
        const Vec<float> w = vload(wv + (v0 + c) * kLanes);
        for (int j = 0; j < kKeys; ++j)  // relu keeping NaN (NaN < 0 is false)
            total[j] = fmadd(w, acc[j][c] < zero ? zero : acc[j][c], total[j]);
    }
}

template <class T>
inline const T* key_row(const IndexParams& p, int64_t b, int64_t s) {
    const T* k = static_cast<const T*>(p.k);
    if (!p.block_table) return k + b * p.k_batch_stride + s * p.k_row_stride;
    return k + p.block_table[b * p.block_table_batch_stride + s / p.block_size] * p.k_batch_stride +
           s % p.block_size * p.k_row_stride;
}

inline float key_scale(const IndexParams& p, int64_t b, int64_t s) {
    if (!p.k_scale) return 1.0f;
    if (!p.block_table) return p.k_scale[b * p.k_scale_batch_stride + s * p.k_scale_row_stride];
    return p.k_scale[p.block_table[b * p.block_table_batch_stride + s / p.block_size] * p.k_scale_batch_stride +
                     s % p.block_size * p.k_scale_row_stride];
}

template <class T>
inline void widen_row(const T* row, int64_t dims, float* out) {
    int64_t d = 0;
    for (; d + kLanes <= dims; d += kLanes) vstore(out + d, vload(row + d));
    for (; d < dims; ++d) out[d] = widen(row[d]);
}

// float8 e4m3 through a table of its 256 values (widen() per element, the typed layer's
// lane-by-lane load, measured 4x slower than the products at 64 heads).
struct E4m3Table {
    float value[256];
    E4m3Table() {
        for (int i = 0; i < 256; ++i) value[i] = widen(f8e4m3_t{static_cast<uint8_t>(i)});
    }
};
inline void widen_row(const f8e4m3_t* row, int64_t dims, float* out) {
    static const E4m3Table table;
    for (int64_t d = 0; d < dims; ++d) out[d] = table.value[row[d].bits];
}

template <class T>
void scores_of(const IndexParams& p, int64_t b, int64_t t, int64_t s0, int64_t s1, float* scores,
               float* ws) {
    const int64_t dims = p.head_dim, hp = index_padded_heads(p), vecs = hp / kLanes;
    float* qt = ws;              // dims x hp
    float* wv = qt + dims * hp;  // hp
    float* kr = wv + hp;         // kKeys x dims
    const float* q = p.q + b * p.q_batch_stride + t * p.q_row_stride;
    const float* w = p.weights + b * p.w_batch_stride + t * p.w_row_stride;
    for (int64_t h = 0; h < hp; ++h) {
        wv[h] = h < p.heads ? w[h] : 0.0f;
        for (int64_t d = 0; d < dims; ++d) qt[d * hp + h] = h < p.heads ? q[h * p.q_head_stride + d] : 0.0f;
    }
    for (int64_t j0 = s0; j0 < s1; j0 += kKeys) {
        const int64_t nk = s1 - j0 < kKeys ? s1 - j0 : kKeys;
        for (int j = 0; j < kKeys; ++j)  // (past the run: its last key again, not stored)
            widen_row(key_row<T>(p, b, j0 + (j < nk ? j : nk - 1)), dims, kr + j * dims);
        Vec<float> total[kKeys];
        for (int j = 0; j < kKeys; ++j) total[j] = Vec<float>{};
        int64_t v0 = 0;
        for (; v0 + kHeadVecs <= vecs; v0 += kHeadVecs) head_vectors<kHeadVecs>(qt, hp, wv, v0, kr, dims, total);
        for (; v0 < vecs; ++v0) head_vectors<1>(qt, hp, wv, v0, kr, dims, total);
        for (int64_t j = 0; j < nk; ++j) scores[j0 - s0 + j] = vsum(total[j]) * key_scale(p, b, j0 + j);
    }
}
#pragma GCC diagnostic pop

}  // namespace indexer

// KernelTable::index_scores (the index keys' storage type named in full: no default).
void index_scores(const IndexParams& p, int64_t b, int64_t t, int64_t s0, int64_t s1, float* scores,
                  float* workspace) {
    switch (p.k_dtype) {
        case DType::kF32: return indexer::scores_of<float>(p, b, t, s0, s1, scores, workspace);
        case DType::kBF16: return indexer::scores_of<bf16_t>(p, b, t, s0, s1, scores, workspace);
        case DType::kF8E4M3: return indexer::scores_of<f8e4m3_t>(p, b, t, s0, s1, scores, workspace);
        case DType::kF64: case DType::kF16: case DType::kI8: case DType::kQ4: case DType::kF8E5M2: break;
    }
    unreachable_dtype("index keys", p.k_dtype);
}

}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
