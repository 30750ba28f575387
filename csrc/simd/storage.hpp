// Storage types of the reduced-precision paths and their conversions to and from the float32
// accumulator: bfloat16, IEEE float16 and int8 (a KV cache with one float32 scale per row).
// Part of the SIMD layer; included by its typed vocabulary (typed.hpp) and the kernel files,
// inside each tier's namespace, so every tier compiles them with its own flags (float16 uses
// F16C's conversions where the tier has them).
//
// Values are only ever widened to float32 for arithmetic; they are narrowed once, when the
// output is stored (round to nearest even; NaN stays NaN).
#pragma once
#include <cstdint>
#include <cstring>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {

struct bf16_t { uint16_t bits; };  // bfloat16: the upper half of a float32
struct f16_t { uint16_t bits; };   // IEEE 754 binary16
// float8 e4m3fn (OCP FP8, ml_dtypes.float8_e4m3fn): sign, 4 exponent bits (bias 7), 3
// mantissa bits; no infinities, S.1111.111 is NaN. A KV-cache storage type only (one float32
// scale per row, as int8).
struct fp8_t { uint8_t bits; };
// int4 (the "int4" cache format): a row of D values is ceil(D / 32) blocks of 32 values, each
// block 20 bytes: a little-endian uint32 holding the bfloat16 scale in its low half and the
// bfloat16 minimum in its high half, then 16 bytes, byte i holding the block's value i in its
// low nibble and value i + 16 in its high nibble (ggml's q4_1 order: a vector of 16
// consecutive values is one 16-byte load); value = scale * n + minimum, n in 0..15 (bfloat16
// so that the header widens with shifts and masks, attnfast/_int4.py). Rows carry their own
// scales (no scale arrays); a row read from non-finite numbers has NaN scales. A KV-cache
// storage type only: element pointers step bytes, never values.
struct q4_t { uint8_t byte; };
constexpr int64_t kQ4Group = 32;       // values per block
constexpr int64_t kQ4BlockBytes = 20;  // bytes per block

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, sizeof f); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, sizeof u); return u; }

// ---- widening (exact for every storage type) ----
inline float widen(float x) { return x; }
inline double widen(double x) { return x; }
inline float widen(bf16_t x) { return bits_to_float(static_cast<uint32_t>(x.bits) << 16); }
inline float widen(int8_t x) { return static_cast<float>(x); }
inline float widen(f16_t x) {
#if defined(__F16C__)
    return _cvtsh_ss(x.bits);
#else
    const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
    const uint32_t exp = (x.bits >> 10) & 0x1Fu, mant = x.bits & 0x3FFu;
    if (exp == 0x1Fu) return bits_to_float(sign | 0x7F800000u | (mant << 13));  // inf, NaN
    if (exp != 0) return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
    // zero or subnormal: mant * 2^-24, exact in float32
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -mag : mag;
#endif
}

// float8 e4m3fn, exactly: (-1)^s 2^(e-7) 1.m, or 2^-6 0.m for e = 0; NaN for S.1111.111.
inline float widen(fp8_t x) {
    const uint32_t sign = static_cast<uint32_t>(x.bits & 0x80u) << 24;
    const uint32_t exp = (x.bits >> 3) & 0xFu, mant = x.bits & 0x7u;
    if ((x.bits & 0x7Fu) == 0x7Fu) return __builtin_nanf("");
    if (exp != 0) return bits_to_float(sign | ((exp + 120u) << 23) | (mant << 20));
    const float mag = static_cast<float>(mant) * 0.001953125f;  // mant * 2^-9, exact
    return sign ? -mag : mag;
}

// Value d of an int4 row, exactly scale * n + minimum in float32 (one rounding).
inline float q4_value(const q4_t* row, int64_t d) {
    const uint8_t* block = &row->byte + (d / kQ4Group) * kQ4BlockBytes;
    uint32_t header;
    std::memcpy(&header, block, 4);
    const int64_t i = d % kQ4Group;
    const uint8_t b = block[4 + (i & 15)];
    const float n = static_cast<float>(i < 16 ? b & 15 : b >> 4);
    return n * bits_to_float(header << 16) + bits_to_float(header & 0xFFFF0000u);
}

// Value `d` of a stored row, widened (float32, or float64 for float64): element pointers
// step values for every type but int4.
template <class T> inline auto kv_value(const T* row, int64_t d) { return widen(row[d]); }
inline float kv_value(const q4_t* row, int64_t d) { return q4_value(row, d); }

// Bytes of a stored row of `n` values.
template <class T> constexpr int64_t kv_row_bytes(int64_t n) { return n * static_cast<int64_t>(sizeof(T)); }
template <> constexpr int64_t kv_row_bytes<q4_t>(int64_t n) {
    return (n + kQ4Group - 1) / kQ4Group * kQ4BlockBytes;
}

// ---- narrowing (round to nearest even) ----
inline bf16_t narrow_bf16(float f) {
    const uint32_t u = float_to_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return {static_cast<uint16_t>((u >> 16) | 0x40u)};  // quiet NaN
    return {static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}
inline f16_t narrow_f16(float f) {
#if defined(__F16C__)
    return {static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT))};
#else
    const uint32_t u = float_to_bits(f);
    const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return {static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu))};  // NaN
    if (a >= 0x477FF000u) return {static_cast<uint16_t>(sign | 0x7C00u)};  // rounds past 65504: inf
    if (a < 0x38800000u) {  // below the smallest normal half: a multiple of 2^-24, rounded
        const float mag = bits_to_float(a) * 16777216.0f;  // exact scaling by 2^24
        // nearbyint to even via the 2^23 trick (mag < 1024 here)
        const float r = (mag + 8388608.0f) - 8388608.0f;
        return {static_cast<uint16_t>(sign | static_cast<uint16_t>(r))};
    }
    // normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even
    const uint32_t rounded = a + 0xFFFu + ((a >> 13) & 1u);
    return {static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13))};
#endif
}

// Storage type -> accumulator type, and back (the output's type).
template <class A, class T> inline A load_acc(T x) { return static_cast<A>(widen(x)); }
template <class T> struct Narrow { template <class A> static T from(A x) { return static_cast<T>(x); } };
template <> struct Narrow<bf16_t> { static bf16_t from(float x) { return narrow_bf16(x); } };
template <> struct Narrow<f16_t> { static f16_t from(float x) { return narrow_f16(x); } };
template <class T, class A> inline T store_from_acc(A x) { return Narrow<T>::from(x); }

// Per-row dequantisation scales of an int8 or float8 cache (1 for every other storage type):
// row j of (batch, kv head) is scale[j * row_stride] times its stored values.
struct RowScales {
    const float* scale = nullptr;  // nullptr: no scales (not an int8 / float8 cache)
    int64_t row_stride = 0;
    // Paged cache (AttentionParams::block_table): this batch entry's block ids, or nullptr;
    // `scale` then points at the pool's kv head, blocks block_stride apart.
    const int64_t* table = nullptr;
    int64_t block_stride = 0;
    int64_t block_size = 1;
    float at(int64_t row) const {
        if (!scale) return 1.0f;
        if (table) return scale[table[row / block_size] * block_stride + row % block_size * row_stride];
        return scale[row * row_stride];
    }
};

}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
