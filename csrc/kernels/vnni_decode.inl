// int8 decode with AVX512-VNNI's vpdpbusd for Q·Kᵀ over an int8 cache. Included by
// kernels/isa_avx512bf16.cpp after simd_decode.inl; it runs the one decode loop (decode_loop)
// with its own arithmetic policy (VnniPath); P·V and every other call stay on the widening kernels.
//
// Why: widening int8 K costs a vpmovsxbd, a vcvtdq2ps and an FMA per 16 values and query
// row, so an int8 step is compute-bound at a fraction of memory speed. vpdpbusd does 64
// byte products per instruction with exact int32 sums:
//   * each staged query row (scale already applied) is quantised to int8 on the fly with its
//     own scale sq = max|q| / 127 (round to nearest even) — the one rounding this path adds
//     (measured in docs/user_guide/formats.md; ATTNFAST_INT8_DOT=widen selects the exact
//     widening path instead);
//   * vpdpbusd multiplies unsigned by signed bytes, so the keys are made unsigned (k + 128:
//     one vpxord with 0x80 per 64 bytes) and the query bytes stay signed:
//     sum (k + 128) qi = sum k qi + 128 sum qi, the last term one number per query row;
//   * the sums are integers below 2^24 (|sum| <= 255 * 127 * D, D <= 512 here), so they are
//     exact in float32 and the transpose-reduce tree adds them without rounding: a score is
//     sq * (dot - 128 sum qi), one rounding, then the key's row scale (decode_loop).
// NaN / inf in q: the row's scale is NaN, so are its scores (the NaN rule holds).
#pragma once
#if !defined(__AVX512VNNI__)
#error "vnni_decode.inl needs AVX512-VNNI"
#endif
#include "bf16_decode.inl"

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace vnni_decode {

using simd_decode::W;  // 16 int32 / float32 lanes

// Bytes of int8 query per row and where its scale and correction sit, in floats of a
// staged row: [0, D/4) the bytes, then sq, then 128 * sum qi.
inline int64_t bytes_floats(int64_t D) { return (D / 4 + 15) / 16 * 16; }

// s[r * ss + j] = sq_r * (q_r . k_j) for RB rows and the first `keys` of W / RB keys
// (int8 key rows ks bytes apart), as simd_decode::score_keys (same access order and V
// prefetch), 64 elements of D per vpdpbusd. ND: D / 64 (0: any multiple of 64).
template <int RB, int ND>
inline void score_keys(const float* __restrict q, int64_t qs, const int8_t* __restrict k,
                       int64_t ks, int64_t keys, int64_t D, float* __restrict s, int64_t ss,
                       const char* vpf, int64_t vsb, int64_t vrow_bytes) {
    constexpr int KB = W / RB;
    const int64_t nd = ND > 0 ? ND : D / 64;
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const int64_t tail = bytes_floats(D);
    if constexpr (RB == 1) {  // one key at a time (as simd_decode::OneKeyScores; exact sums)
        const float sq = q[tail], corr = q[tail + 1];
        for (int64_t j = 0; j < keys; ++j) {
            if (vpf)
                for (int64_t off = 0; off < vrow_bytes; off += 64) __builtin_prefetch(vpf + j * vsb + off, 0, 2);
            const int8_t* krow = k + j * ks;
            __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int64_t c = 0; c < nd; ++c)
                acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(_mm512_loadu_si512(krow + c * 64), flip),
                                          _mm512_loadu_si512(reinterpret_cast<const char*>(q) + c * 64));
            s[j] = (simd::lane_sum(_mm512_cvtepi32_ps(acc)) - corr) * sq;
        }
        return;
    }
    const int8_t* kp[KB];
    for (int j = 0; j < KB; ++j) kp[j] = k + (j < keys ? j : keys - 1) * ks;
    __m512i acc[W];
    for (int n = 0; n < W; ++n) acc[n] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int j = 0; j < KB; ++j) {
        if (vpf && j < keys)
            for (int64_t off = 0; off < vrow_bytes; off += 64) __builtin_prefetch(vpf + j * vsb + off, 0, 2);
        for (int64_t c = 0; c < nd; ++c) {
            const __m512i ku = _mm512_xor_si512(_mm512_loadu_si512(kp[j] + c * 64), flip);
            for (int r = 0; r < RB; ++r)
                acc[r * KB + j] = _mm512_dpbusd_epi32(
                    acc[r * KB + j], ku, _mm512_loadu_si512(reinterpret_cast<const char*>(q + r * qs) + c * 64));
        }
    }
    __m512 dots_f[W];
    for (int n = 0; n < W; ++n) dots_f[n] = _mm512_cvtepi32_ps(acc[n]);  // exact (< 2^24)
    const __m512 dots = simd::transpose_reduce(dots_f);            // exact integer sums
    // lane r * KB + j: row r's scale and correction
    alignas(64) float sq[W], corr[W];
    for (int r = 0; r < RB; ++r)
        for (int j = 0; j < KB; ++j) {
            sq[r * KB + j] = q[r * qs + tail];
            corr[r * KB + j] = q[r * qs + tail + 1];
        }
    const __m512 sc = _mm512_mul_ps(_mm512_sub_ps(dots, _mm512_load_ps(corr)), _mm512_load_ps(sq));
    for (int r = 0; r < RB; ++r) simd::store_lanes(s + r * ss - r * KB, sc, r * KB, keys);
}

template <int RB, int ND>
struct ScoreBlock {  // RB rows against up to W keys, in groups of W / RB keys
    static void run(const float* qs, int64_t qstride, const int8_t* k, int64_t ks, int64_t keys,
                    int64_t D, float* s, int64_t ss, const char* vpf, int64_t vsb,
                    int64_t vrow_bytes) {
        constexpr int KB = W / RB;
        for (int64_t j = 0; j < keys; j += KB)
            score_keys<RB, ND>(qs, qstride, k + j * ks, ks, keys - j < KB ? keys - j : KB, D,
                               s + j, ss, vpf ? vpf + j * vsb : nullptr, vsb, vrow_bytes);
    }
};

// decode_loop's arithmetic policy: int8 query bytes and vpdpbusd for the scores; the values
// (int8 V rows, weights already times the V row scales) as simd_decode's WidenPath.
template <int ND, class TQ>
struct VnniPath : simd_decode::VectorSoftmax {
    using Q = TQ;
    using KV = int8_t;
    using Widen = simd_decode::WidenPath<(ND * 64) / W, TQ, int8_t>;
    static int64_t query_stride(const AttentionParams& p) { return bytes_floats(p.head_dim) + 16; }
    static void stage_query(float* qs, const TQ* qrow, int64_t D, float scale) {
        float peak = 0;
        bool finite = true;
        for (int64_t d = 0; d < D; ++d) {
            const float x = widen(qrow[d]) * scale;
            finite = finite && x - x == 0;  // false for NaN and +-inf
            const float a = x < 0 ? -x : x;
            peak = a > peak ? a : peak;
        }
        const float sq = finite ? peak / 127.0f : __builtin_nanf("");
        const float inv = sq > 0 ? 1.0f / sq : 0.0f;  // (127 / peak would round differently)
        int8_t* bytes = reinterpret_cast<int8_t*>(qs);
        int32_t sum = 0;
        for (int64_t d = 0; d < D; ++d) {
            const float x = finite ? widen(qrow[d]) * scale * inv : 0.0f;
            int32_t v = static_cast<int32_t>(__builtin_nearbyintf(x));  // nearest even
            v = v > 127 ? 127 : (v < -127 ? -127 : v);
            bytes[d] = static_cast<int8_t>(v);
            sum += v;
        }
        const int64_t tail = bytes_floats(D);
        qs[tail] = sq;
        qs[tail + 1] = 128.0f * static_cast<float>(sum);  // exact (|sum| <= 127 * D)
    }
    static void scores(int64_t n, const float* qs, int64_t qstride, const int8_t* kj, int64_t ks,
                       int64_t nk, int64_t D, float* sj, int64_t ss, const char* vj,
                       int64_t vsb, int64_t v_row_bytes, float /*scale*/) {
        int64_t rb = 0;
        for (; rb + kRowBlock <= n; rb += kRowBlock)
            ScoreBlock<kRowBlock, ND>::run(qs + rb * qstride, qstride, kj, ks, nk, D, sj + rb * ss, ss,
                                   rb == 0 ? vj : nullptr, vsb, v_row_bytes);
        if (n - rb >= 2) {
            ScoreBlock<2, ND>::run(qs + rb * qstride, qstride, kj, ks, nk, D, sj + rb * ss, ss,
                                   rb == 0 ? vj : nullptr, vsb, v_row_bytes);
            rb += 2;
        }
        if (n - rb == 1)
            ScoreBlock<1, ND>::run(qs + rb * qstride, qstride, kj, ks, nk, D, sj + rb * ss, ss,
                                   rb == 0 ? vj : nullptr, vsb, v_row_bytes);
    }
    static void weights_ready(float* srow, int64_t keys) { Widen::weights_ready(srow, keys); }
    static void values(int64_t n, float* acc, int64_t Dv, const float* s_block, int64_t ss,
                       int64_t c0, const int8_t* vrun, int64_t vs, int64_t keys) {
        Widen::values(n, acc, Dv, s_block, ss, c0, vrun, vs, keys);
    }
    static void finish(float* acc, int64_t rows, int64_t Dv) { Widen::finish(acc, rows, Dv); }
};

// Whether a call takes this path: an int8 cache, D a multiple of 64 up to 512 (the exact
// integer sums), Dv a multiple of W, a CPU with the instruction, and not the exact widening
// chosen (int8_dot_widen: ATTNFAST_INT8_DOT=widen, read once).
inline bool takes(const AttentionParams& p) {
    if (p.kv_dtype != DType::kI8 || p.head_dim % 64 != 0 || p.head_dim > 512 ||
        p.head_dim_v % W != 0)
        return false;
    static const bool cpu_has = __builtin_cpu_supports("avx512vnni");
    return cpu_has && !int8_dot_widen();
}

template <class TQ>
void chunk_for(const AttentionParams& p, const DecodeTask& task, float* ws, float* acc,
               float* m, float* l) {
    if (p.head_dim == 128) decode_loop<VnniPath<2, TQ>>(p, task, ws, acc, m, l);
    else if (p.head_dim == 64) decode_loop<VnniPath<1, TQ>>(p, task, ws, acc, m, l);
    else decode_loop<VnniPath<0, TQ>>(p, task, ws, acc, m, l);
}

void chunk_any(const AttentionParams& p, const DecodeTask& task, float* ws, float* acc,
               float* m, float* l) {
    with_q_type(p.dtype, [&](auto tq) { chunk_for<typename decltype(tq)::type>(p, task, ws, acc, m, l); });
}

// KernelTable::decode_kernel of this tier: this path where it takes the call, else the
// bfloat16 kernel's choice (vdpbf16ps, or the widening kernel, or the template).
DecodeKernel decode_kernel(const AttentionParams& p) {
    if (takes(p)) return {KernelId::kVnniInt8Decode, chunk_any};
    return bf16_decode::decode_kernel(p);
}

}  // namespace vnni_decode

// kRowBlock rows x W / kRowBlock keys per score_keys call; Q.K by vpdpbusd over q quantised
// per row, P.V as simd_decode's (the int8 V rows widened, vfma).
template <> struct PolicyOf<KernelId::kVnniInt8Decode> {
    static KernelPolicy of(const AttentionParams&) {
        return {kRowBlock, simd::W / kRowBlock, Product::kInt8Quads, kVfmaProduct};
    }
};
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
