// The lightning indexer's scores (IndexParams, attnfast.hpp), compiled by every tier with its
// own flags on the typed vector layer (simd/typed.hpp): for one query row and a run of keys,
// scores[s] = k_scale[s] * sum_h w[h] * relu(q[h] . k[s]).
//
// The products are a small GEMM (heads x head_dim times head_dim x keys): each block of
// 2 vectors of keys is widened to float32 and transposed once (kt[d][j]: keys in the vector
// lanes), then every block of NH heads runs d by d with one broadcast of q[h][d] per head and
// one load of kt[d] per key vector, NH x NK accumulators in registers; the heads' relu-ed dot
// products are weighted and summed lane by lane (no horizontal sums). Included by
// export_table.inl inside the tier's namespace.
#pragma once
#include "../simd/typed.hpp"
#include "kernel_table.hpp"

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace indexer {

constexpr int64_t kLanes = vec_lanes<float>();
constexpr int kKeyVecs = 2;                       // key vectors per register block
constexpr int64_t kBlockKeys = kKeyVecs * kLanes;  // keys per register block
static_assert(kBlockKeys <= kIndexBlockKeys, "the workspace holds one transposed block");

#pragma GCC diagnostic push
#if defined(__clang__)
#pragma GCC diagnostic ignored "-Wunknown-warning-option"
#endif
#pragma GCC diagnostic ignored "-Wpsabi"  // all inlined: no vector crosses a call boundary

// total[c] += sum over heads [h0, h0 + NH) of w[h] relu(q[h] . k[j]) for the kBlockKeys keys
// of kt (d-major, kBlockKeys floats per d): NH x kKeyVecs accumulators.
template <int NH>
inline void head_block(const IndexParams& p, const float* q, const float* w, int64_t h0,
                       const float* kt, Vec<float>* total) {
    Vec<float> acc[NH][kKeyVecs];
    for (int h = 0; h < NH; ++h)
        for (int c = 0; c < kKeyVecs; ++c) acc[h][c] = Vec<float>{};
    const float* qh[NH];
    for (int h = 0; h < NH; ++h) qh[h] = q + (h0 + h) * p.q_head_stride;
    for (int64_t d = 0; d < p.head_dim; ++d) {
        Vec<float> kv[kKeyVecs];
        for (int c = 0; c < kKeyVecs; ++c) kv[c] = vload(kt + d * kBlockKeys + c * kLanes);
        for (int h = 0; h < NH; ++h) {
            const Vec<float> qb = splat(qh[h][d]);
            for (int c = 0; c < kKeyVecs; ++c) acc[h][c] = fmadd(qb, kv[c], acc[h][c]);
        }
    }
    const Vec<float> zero = Vec<float>{};
    for (int h = 0; h < NH; ++h) {
        const Vec<float> wh = splat(w[h0 + h]);
        for (int c = 0; c < kKeyVecs; ++c)  // relu keeping NaN (NaN < 0 is false)
            total[c] = fmadd(wh, acc[h][c] < zero ? zero : acc[h][c], total[c]);
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
void scores_of(const IndexParams& p, int64_t b, int64_t t, int64_t s0, int64_t s1, float* scores,
               float* kt) {
    const float* q = p.q + b * p.q_batch_stride + t * p.q_row_stride;
    const float* w = p.weights + b * p.w_batch_stride + t * p.w_row_stride;
    for (int64_t j0 = s0; j0 < s1; j0 += kBlockKeys) {
        const int64_t nk = s1 - j0 < kBlockKeys ? s1 - j0 : kBlockKeys;
        for (int64_t j = 0; j < kBlockKeys; ++j) {  // the block's keys, transposed (0 past nk)
            if (j < nk) {
                const T* row = key_row<T>(p, b, j0 + j);
                for (int64_t d = 0; d < p.head_dim; ++d) kt[d * kBlockKeys + j] = widen(row[d]);
            } else {
                for (int64_t d = 0; d < p.head_dim; ++d) kt[d * kBlockKeys + j] = 0.0f;
            }
        }
        Vec<float> total[kKeyVecs];
        for (int c = 0; c < kKeyVecs; ++c) total[c] = Vec<float>{};
        int64_t h0 = 0;
        for (; h0 + 4 <= p.heads; h0 += 4) head_block<4>(p, q, w, h0, kt, total);
        for (; h0 < p.heads; ++h0) head_block<1>(p, q, w, h0, kt, total);
        alignas(64) float lanes[kBlockKeys];
        for (int c = 0; c < kKeyVecs; ++c) vstore(lanes + c * kLanes, total[c]);
        for (int64_t j = 0; j < nk; ++j) scores[j0 - s0 + j] = lanes[j] * key_scale(p, b, j0 + j);
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
        case DType::kF8E4M3: return indexer::scores_of<fp8_t>(p, b, t, s0, s1, scores, workspace);
        case DType::kF64: case DType::kF16: case DType::kI8: case DType::kQ4: break;
    }
    unreachable_dtype("index keys", p.k_dtype);
}

}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
