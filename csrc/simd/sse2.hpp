// The SIMD layer's vocabulary for SSE2 only (the generic tier on x86-64):
// 4 float lanes, 16 xmm registers, no blendv, no round, no FMA.
// Included through simd.hpp (which states the contract), never directly.
#pragma once
#ifndef ATTNFAST_KERNEL_NS
#error "include csrc/simd/simd.hpp from a kernel translation unit (kernels/isa_*.cpp)"
#endif
#include <immintrin.h>

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace simd {

using Vec = __m128;
using Mask = __m128;  // all-ones / all-zeros lanes
constexpr int W = 4;

inline Vec vzero() { return _mm_setzero_ps(); }
inline Vec vset(float x) { return _mm_set1_ps(x); }
inline Vec vload(const float* p) { return _mm_load_ps(p); }
inline void vstore(float* p, Vec x) { _mm_store_ps(p, x); }
inline Vec vbcast(const float* p) { return _mm_load1_ps(p); }  // movss + shufps
// No FMA on this tier: a multiply, then an add (two roundings; the float32 tolerances of the
// tests hold either way). Two-operand SSE needs a copy of one factor per product; register
// moves are free on current x86 cores (eliminated at rename), but it is one more register.
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm_add_ps(_mm_mul_ps(a, b), c); }
inline Vec vadd(Vec a, Vec b) { return _mm_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm_mul_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm_max_ps(a, b); }
inline Vec select(Mask m, Vec yes, Vec no) { return _mm_or_ps(_mm_and_ps(m, yes), _mm_andnot_ps(m, no)); }
inline Mask key_visible(const int32_t* begin, const int32_t* end, int32_t key) {
    const __m128i kv = _mm_set1_epi32(key);
    const __m128i b = _mm_load_si128(reinterpret_cast<const __m128i*>(begin));
    const __m128i e = _mm_load_si128(reinterpret_cast<const __m128i*>(end));
    return _mm_castsi128_ps(_mm_andnot_si128(_mm_cmpgt_epi32(b, kv), _mm_cmpgt_epi32(e, kv)));
}
inline Vec keep_or_neg_inf(Mask keep, Vec x) { return select(keep, x, vset(-__builtin_inff())); }
inline Vec finite_or_zero(Vec m) { return _mm_andnot_ps(_mm_cmpeq_ps(m, vset(-__builtin_inff())), m); }
inline bool all_ones(Vec x) { return _mm_movemask_ps(_mm_cmpneq_ps(x, vset(1.0f))) == 0; }  // NaN: not
inline Vec neg_inf_to_nan(Vec x) {  // -inf | quiet-NaN bits is a NaN; other lanes OR in 0
    return _mm_or_ps(x, _mm_and_ps(_mm_cmpeq_ps(x, vset(-__builtin_inff())), vset(__builtin_nanf(""))));
}
inline Vec vdiv(Vec a, Vec b) { return _mm_div_ps(a, b); }
inline Vec vfnma(Vec a, Vec b, Vec c) { return _mm_sub_ps(c, _mm_mul_ps(a, b)); }
inline Vec vabs(Vec x) { return _mm_andnot_ps(vset(-0.0f), x); }
inline Vec vcopysign(Vec mag, Vec sgn) { return _mm_or_ps(mag, _mm_and_ps(sgn, vset(-0.0f))); }
inline Mask less_than(Vec a, float x) { return _mm_cmplt_ps(a, vset(x)); }
inline bool all_lanes(Mask m) { return _mm_movemask_ps(m) == 0xF; }
inline Vec keep_unless_sign(Vec x, Vec drop) {
    return select(_mm_castsi128_ps(_mm_srai_epi32(_mm_castps_si128(drop), 31)), drop, x);
}

// ---- unaligned access, masked tails, reductions (the decode policies' rows of scores)
inline Vec vloadu(const float* p) { return _mm_loadu_ps(p); }
inline void vstoreu(float* p, Vec x) { _mm_storeu_ps(p, x); }
// out lane n = sum of the lanes of x[n], n < 4: a fixed tree (x[n][0] + x[n][2]) +
// (x[n][1] + x[n][3]), as avx2.hpp's within each 128-bit half.
inline Vec transpose_reduce(const Vec* x) {
    const __m128 t0 = _mm_add_ps(_mm_unpacklo_ps(x[0], x[1]), _mm_unpackhi_ps(x[0], x[1]));
    const __m128 t1 = _mm_add_ps(_mm_unpacklo_ps(x[2], x[3]), _mm_unpackhi_ps(x[2], x[3]));
    return _mm_add_ps(_mm_movelh_ps(t0, t1), _mm_movehl_ps(t1, t0));
}
// s[c] = lane c of x for first <= c < first + n (lanes are < W).
inline void store_lanes(float* s, Vec x, int first, int64_t n) {
    alignas(16) float t[4];
    _mm_store_ps(t, x);
    for (int64_t c = first; c < first + n; ++c) s[c] = t[c];
}
// The same for n == KB lanes starting at first (a multiple of KB).
template <int KB>
inline void store_group(float* s, Vec x, int first) {
    if constexpr (KB == 4) _mm_storeu_ps(s, x);
    else if constexpr (KB == 2) {
        if (first == 0) _mm_storel_pi(reinterpret_cast<__m64*>(s), x);
        else _mm_storeh_pi(reinterpret_cast<__m64*>(s + first), x);
    } else store_lanes(s, x, first, KB);
}
inline float hmax(Vec x) {
    const __m128 m = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 1, 1, 1))));
}
inline float hsum(Vec x) {  // fixed tree: (0 + 2) + (1 + 3)
    const __m128 m = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 1, 1, 1))));
}
// Lanes c (counting from c0) with b <= c0 + c < e: x, others 0 (x may be garbage there).
inline Vec keep_range(Vec x, int64_t c0, int64_t b, int64_t e) {
    const __m128i idx = _mm_add_epi32(_mm_setr_epi32(0, 1, 2, 3), _mm_set1_epi32(static_cast<int32_t>(c0)));
    const __m128i keep = _mm_andnot_si128(_mm_cmpgt_epi32(_mm_set1_epi32(static_cast<int32_t>(b)), idx),
                                          _mm_cmpgt_epi32(_mm_set1_epi32(static_cast<int32_t>(e)), idx));
    return _mm_and_ps(_mm_castsi128_ps(keep), x);
}
// Largest of x[b .. e), or NaN when any of them is NaN (maxps alone may drop a NaN).
inline float range_max(const float* x, int64_t b, int64_t e) {
    __m128 mx = vset(-__builtin_inff());
    __m128 nan = _mm_setzero_ps();
    int64_t c = b;
    for (; c + W <= e; c += W) {
        const __m128 xv = _mm_loadu_ps(x + c);
        nan = _mm_or_ps(nan, _mm_cmpunord_ps(xv, xv));
        mx = _mm_max_ps(mx, xv);
    }
    float m = hmax(mx);
    bool any_nan = _mm_movemask_ps(nan) != 0;
    for (; c < e; ++c) {
        any_nan = any_nan || x[c] != x[c];
        m = x[c] > m ? x[c] : m;
    }
    return any_nan ? __builtin_nanf("") : m;
}

// ---- widening and narrowing: W stored elements (unaligned), float32 lanes; in SSE2 integer
// operations (no pmovzx / pmovsx / F16C); exactly 4 elements read (no over-read)
inline __m128i load4_bytes(const void* p) {
    int32_t w;
    __builtin_memcpy(&w, p, 4);
    return _mm_cvtsi32_si128(w);
}
inline Vec vwiden(const float* x) { return _mm_loadu_ps(x); }
inline Vec vwiden(const bf16_t* x) {  // the 16 bits into the upper half of each lane
    return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(x))));
}
// float16 bits (in the low half of each 32-bit lane) to float32: the exponent rebiased (+112)
// and the mantissa shifted into place; inf / NaN get the float32 exponent 255; zeros and
// subnormals (exponent 0) are m * 2^-24, computed as (2^-14 (1 + m 2^-10)) - 2^-14 so no
// denormal is ever an operand (exact, whatever DAZ says).
inline Vec widen_f16_bits(__m128i h) {
    const __m128i em = _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x7FFF)), 13);
    const __m128i e = _mm_and_si128(h, _mm_set1_epi32(0x7C00));
    const __m128i rebias = _mm_set1_epi32(112 << 23);
    __m128i bits = _mm_add_epi32(em, rebias);
    bits = _mm_add_epi32(bits, _mm_and_si128(_mm_cmpeq_epi32(e, _mm_set1_epi32(0x7C00)), rebias));
    const __m128 two_m14 = _mm_castsi128_ps(_mm_set1_epi32(113 << 23));
    const __m128 small = _mm_sub_ps(_mm_castsi128_ps(_mm_add_epi32(em, _mm_set1_epi32(113 << 23))), two_m14);
    const __m128 is_small = _mm_castsi128_ps(_mm_cmpeq_epi32(e, _mm_setzero_si128()));
    const __m128 mag = _mm_or_ps(_mm_and_ps(is_small, small), _mm_andnot_ps(is_small, _mm_castsi128_ps(bits)));
    return _mm_or_ps(mag, _mm_castsi128_ps(_mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16)));
}
inline Vec vwiden(const f16_t* x) {
    return widen_f16_bits(_mm_unpacklo_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x)), _mm_setzero_si128()));
}
inline __m128i load4_bytes_u32(const void* p) {  // 4 bytes zero-extended to 32-bit lanes
    const __m128i z = _mm_setzero_si128();
    return _mm_unpacklo_epi16(_mm_unpacklo_epi8(load4_bytes(p), z), z);
}
// A float8 format, times 1 / kWidenScaleFold, through float16 bits as ymm.hpp's widen8
// (storage.hpp's Float8 traits); S.1111.111 -> NaN where kNanAtAllOnes.
template <class T, typename std::enable_if<Float8<T>::kIs, int>::type = 0>
inline Vec vwiden(const T* p) {
    static_assert(Float8<T>::kMagShift == 7 || Float8<T>::kMagShift == 8, "a float8 move of 7 or 8 bits");
    const __m128i b = load4_bytes_u32(p);
    const __m128i h = Float8<T>::kMagShift == 8
                          ? _mm_slli_epi32(b, 8)
                          : _mm_slli_epi32(_mm_add_epi32(b, _mm_and_si128(b, _mm_set1_epi32(0x80))), 7);
    if constexpr (Float8<T>::kNanAtAllOnes) {
        const __m128i nan = _mm_cmpeq_epi32(_mm_and_si128(b, _mm_set1_epi32(0x7F)), _mm_set1_epi32(0x7F));
        return _mm_or_ps(widen_f16_bits(h), _mm_castsi128_ps(nan));
    } else {
        return widen_f16_bits(h);
    }
}
inline Vec vwiden(const int8_t* x) {  // each byte into all four of its lane, then >> 24
    __m128i b = load4_bytes(x);
    b = _mm_unpacklo_epi8(b, b);
    b = _mm_unpacklo_epi16(b, b);
    return _mm_cvtepi32_ps(_mm_srai_epi32(b, 24));
}
inline void vnarrow(float* y, Vec x) { _mm_storeu_ps(y, x); }
inline void vnarrow(f16_t* y, Vec x) {  // no F16C: simd/storage.hpp's scalar rounding
    alignas(16) float f[4];
    _mm_store_ps(f, x);
    for (int c = 0; c < 4; ++c) y[c] = narrow_f16(f[c]);
}
inline void vnarrow(bf16_t* y, Vec x) {
    const __m128i u = _mm_castps_si128(x);
    const __m128i hi = _mm_srli_epi32(u, 16);
    const __m128i bias = _mm_add_epi32(_mm_set1_epi32(0x7FFF), _mm_and_si128(hi, _mm_set1_epi32(1)));
    const __m128i rounded = _mm_srli_epi32(_mm_add_epi32(u, bias), 16);
    const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(u, _mm_set1_epi32(0x7FFFFFFF)), _mm_set1_epi32(0x7F800000));
    __m128i r = _mm_or_si128(_mm_and_si128(nan, _mm_or_si128(hi, _mm_set1_epi32(0x40))), _mm_andnot_si128(nan, rounded));
    // r is in [0, 0xFFFF]; packssdw saturates signed, so sign-extend its low half first
    // (no packusdw before SSE4.1): the same 16 bits come out.
    r = _mm_srai_epi32(_mm_slli_epi32(r, 16), 16);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(y), _mm_packs_epi32(r, r));
}

// int4 blocks (storage.hpp's q4_t; see avx2.hpp): the bfloat16 scale and minimum by a shift
// and a mask; nibbles to float32, then multiply and add (no FMA: two roundings).
struct Q4Header {
    Vec scale, minimum;
    explicit Q4Header(const uint8_t* block) {
        int32_t header;
        __builtin_memcpy(&header, block, 4);
        const __m128i h = _mm_set1_epi32(header);
        scale = _mm_castsi128_ps(_mm_slli_epi32(h, 16));
        minimum = _mm_castsi128_ps(_mm_and_si128(h, _mm_set1_epi32(int32_t(0xFFFF0000u))));
    }
};
inline Vec vwiden_q4(const uint8_t* block, int64_t i) {  // values i .. i + 4 (i a multiple of 4)
    const Q4Header hd(block);
    const __m128i bytes = load4_bytes_u32(block + 4 + (i & 15));
    const __m128i n = i < 16 ? _mm_and_si128(bytes, _mm_set1_epi32(15)) : _mm_srli_epi32(bytes, 4);
    return vfma(_mm_cvtepi32_ps(n), hd.scale, hd.minimum);
}
inline void vwiden_q4_block(const uint8_t* block, Vec* out) {  // out[v]: values 4v .. 4v + 4
    const Q4Header hd(block);
    const __m128i z = _mm_setzero_si128();
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
    const __m128i lo8 = _mm_unpacklo_epi8(bytes, z), hi8 = _mm_unpackhi_epi8(bytes, z);
    const __m128i q[4] = {_mm_unpacklo_epi16(lo8, z), _mm_unpackhi_epi16(lo8, z),
                          _mm_unpacklo_epi16(hi8, z), _mm_unpackhi_epi16(hi8, z)};
    for (int v = 0; v < 4; ++v) {
        out[v] = vfma(_mm_cvtepi32_ps(_mm_and_si128(q[v], _mm_set1_epi32(15))), hd.scale, hd.minimum);
        out[v + 4] = vfma(_mm_cvtepi32_ps(_mm_srli_epi32(q[v], 4)), hd.scale, hd.minimum);
    }
}

// ---- chunk extras (simd.hpp; a chunk is one Vec here)
inline Vec widen_chunk(const double* x) { return _mm_movelh_ps(_mm_cvtpd_ps(_mm_loadu_pd(x)), _mm_cvtpd_ps(_mm_loadu_pd(x + 2))); }
inline Vec chunk_zero_to_neg_inf(const uint8_t* m) {  // byte 0: -inf, else +0
    const __m128i z = _mm_setzero_si128();
    return _mm_and_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(load4_bytes_u32(m), z)), vset(-__builtin_inff()));
}
inline void transpose_chunks(Vec* r) { _MM_TRANSPOSE4_PS(r[0], r[1], r[2], r[3]); }
struct ZeroTally {  // whether any lane added was nonzero (NaN counts: unordered) / was zero
    Vec nonzero = _mm_setzero_ps();
    Vec zero = _mm_setzero_ps();
    void add(Vec x) {
        nonzero = _mm_or_ps(nonzero, _mm_cmpneq_ps(x, _mm_setzero_ps()));
        zero = _mm_or_ps(zero, _mm_cmpeq_ps(x, _mm_setzero_ps()));
    }
    void add(float x) { add(vset(x)); }
    bool any_nonzero() const { return _mm_movemask_ps(nonzero) != 0; }
    bool any_zero() const { return _mm_movemask_ps(zero) != 0; }
};

}  // namespace simd
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
