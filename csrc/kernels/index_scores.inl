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
//
// With AVX512_BF16, a bfloat16 q over bfloat16 or float8 keys runs the products by vdpbf16ps
// (pair_scores_of): the same loop over pairs of dimensions, twice the multiply-adds per
// instruction, every product exact (bfloat16 and float8 values are exact bfloat16), float32
// sums; float8 rows widened to bfloat16 once per key block.
#pragma once
#if defined(__AVX512BF16__)
#include "../simd/simd.hpp"
#endif
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

template <class TQ>
inline const TQ* query_row(const IndexParams& p, int64_t b, int64_t t) {
    return static_cast<const TQ*>(p.q) + b * p.q_batch_stride + t * p.q_row_stride;
}

template <class TQ, class T>
void scores_of(const IndexParams& p, int64_t b, int64_t t, int64_t s0, int64_t s1, float* scores,
               float* ws) {
    const int64_t dims = p.head_dim, hp = index_padded_heads(p), vecs = hp / kLanes;
    float* qt = ws;              // dims x hp
    float* wv = qt + dims * hp;  // hp
    float* kr = wv + hp;         // kKeys x dims
    const TQ* q = query_row<TQ>(p, b, t);
    const float* w = p.weights + b * p.w_batch_stride + t * p.w_row_stride;
    for (int64_t h = 0; h < hp; ++h) {
        wv[h] = h < p.heads ? w[h] : 0.0f;
        for (int64_t d = 0; d < dims; ++d) qt[d * hp + h] = h < p.heads ? widen(q[h * p.q_head_stride + d]) : 0.0f;
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

#if defined(__AVX512BF16__)
// ---- bfloat16 q by vdpbf16ps. A unit is a pair of dimensions (2u, 2u + 1): qt[u][h] holds
// head h's pair, keys are read as pairs where they lie (bfloat16) or from kbuf (float8 rows
// widened to bfloat16, exactly, at 1 / kWidenScaleFold of their value: the score takes it back).
constexpr int kPairKeys = 4;  // KB x NHV = 16 accumulators and NHV query vectors in registers
static_assert(2 * kIndexKeyBlock >= kPairKeys, "kbuf (kPairKeys bfloat16 rows) fits in scores_of's key rows");

template <int NHV>
inline void pair_head_vectors(const uint32_t* qt, int64_t hp, const float* wv, int64_t v0,
                              const uint32_t* const* kr, int64_t units, simd::Vec* total) {
    simd::Vec acc[kPairKeys][NHV];
    for (int j = 0; j < kPairKeys; ++j)
        for (int c = 0; c < NHV; ++c) acc[j][c] = simd::vzero();
    for (int64_t u = 0; u < units; ++u) {
        simd::Pairs qv[NHV];
        for (int c = 0; c < NHV; ++c) qv[c] = simd::pairs_load(qt + u * hp + (v0 + c) * simd::W);
        for (int j = 0; j < kPairKeys; ++j) {
            const simd::Pairs kb = simd::pairs_bcast(kr[j] + u);
            for (int c = 0; c < NHV; ++c) acc[j][c] = simd::vdot_pairs(acc[j][c], qv[c], kb);
        }
    }
    for (int c = 0; c < NHV; ++c) {
        const simd::Vec w = simd::vload(wv + (v0 + c) * simd::W);
        for (int j = 0; j < kPairKeys; ++j)  // relu keeping NaN (vmax returns its second operand for NaN)
            total[j] = simd::vfma(w, simd::vmax(simd::vzero(), acc[j][c]), total[j]);
    }
}

template <class T>
inline const uint32_t* pair_row(const IndexParams& p, int64_t b, int64_t s, int64_t dims, bf16_t* buf) {
    const T* row = key_row<T>(p, b, s);
    if constexpr (std::is_same<T, bf16_t>::value) {
        (void)dims;
        (void)buf;
        return reinterpret_cast<const uint32_t*>(row);
    } else {
        int64_t d = 0;
        for (; d + simd::W <= dims; d += simd::W) simd::vstore_bf16(buf + d, simd::vwiden(row + d));
        for (; d < dims; ++d) buf[d] = narrow_bf16(widen(row[d]) / Float8<T>::kWidenScaleFold);
        return reinterpret_cast<const uint32_t*>(buf);
    }
}

template <class T>
void pair_scores_of(const IndexParams& p, int64_t b, int64_t t, int64_t s0, int64_t s1, float* scores,
                    float* ws) {
    const int64_t dims = p.head_dim, units = dims / 2, hp = index_padded_heads(p), vecs = hp / simd::W;
    // (the workspace of scores_of, which is larger: see index_workspace_floats; qt aligned)
    uint32_t* qt = reinterpret_cast<uint32_t*>(
        (reinterpret_cast<uintptr_t>(ws) + 63) & ~static_cast<uintptr_t>(63));  // units x hp
    float* wv = reinterpret_cast<float*>(qt + units * hp);                       // hp
    bf16_t* kbuf = reinterpret_cast<bf16_t*>(wv + hp);                           // kPairKeys x dims
    const bf16_t* q = query_row<bf16_t>(p, b, t);
    const float* w = p.weights + b * p.w_batch_stride + t * p.w_row_stride;
    for (int64_t h = 0; h < hp; ++h) {
        wv[h] = h < p.heads ? w[h] : 0.0f;
        const bf16_t* qh = q + h * p.q_head_stride;
        for (int64_t u = 0; u < units; ++u)
            qt[u * hp + h] = h < p.heads ? (uint32_t(qh[2 * u].bits) | uint32_t(qh[2 * u + 1].bits) << 16) : 0u;
    }
    constexpr float fold = Float8<T>::kWidenScaleFold;  // (1 for bfloat16 keys)
    for (int64_t j0 = s0; j0 < s1; j0 += kPairKeys) {
        const int64_t nk = s1 - j0 < kPairKeys ? s1 - j0 : kPairKeys;
        const uint32_t* kr[kPairKeys];
        for (int j = 0; j < kPairKeys; ++j)  // (past the run: its last key again, not stored)
            kr[j] = pair_row<T>(p, b, j0 + (j < nk ? j : nk - 1), dims, kbuf + j * dims);
        simd::Vec total[kPairKeys];
        for (int j = 0; j < kPairKeys; ++j) total[j] = simd::vzero();
        int64_t v0 = 0;
        for (; v0 + kHeadVecs <= vecs; v0 += kHeadVecs) pair_head_vectors<kHeadVecs>(qt, hp, wv, v0, kr, units, total);
        for (; v0 < vecs; ++v0) pair_head_vectors<1>(qt, hp, wv, v0, kr, units, total);
        for (int64_t j = 0; j < nk; ++j) scores[j0 - s0 + j] = simd::hsum(total[j]) * fold * key_scale(p, b, j0 + j);
    }
}
#endif

// The products for the call's q and keys: float32 FMA over widened values, or vdpbf16ps.
template <class T>
void scores_for_keys(const IndexParams& p, int64_t b, int64_t t, int64_t s0, int64_t s1, float* scores,
                     float* ws) {
    if (p.q_dtype == DType::kF32) return scores_of<float, T>(p, b, t, s0, s1, scores, ws);
#if defined(__AVX512BF16__)
    if constexpr (!std::is_same<T, float>::value)  // (float32 keys would be rounded)
        if (p.head_dim % 2 == 0) return pair_scores_of<T>(p, b, t, s0, s1, scores, ws);
#endif
    scores_of<bf16_t, T>(p, b, t, s0, s1, scores, ws);
}

}  // namespace indexer

// KernelTable::index_scores (the index keys' storage type named in full: no default).
void index_scores(const IndexParams& p, int64_t b, int64_t t, int64_t s0, int64_t s1, float* scores,
                  float* workspace) {
    switch (p.k_dtype) {
        case DType::kF32: return indexer::scores_for_keys<float>(p, b, t, s0, s1, scores, workspace);
        case DType::kBF16: return indexer::scores_for_keys<bf16_t>(p, b, t, s0, s1, scores, workspace);
        case DType::kF8E4M3: return indexer::scores_for_keys<f8e4m3_t>(p, b, t, s0, s1, scores, workspace);
        case DType::kF64: case DType::kF16: case DType::kI8: case DType::kQ4: case DType::kF8E5M2: break;
    }
    unreachable_dtype("index keys", p.k_dtype);
}

}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
