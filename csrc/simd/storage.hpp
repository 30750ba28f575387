// Storage types of the reduced-precision paths and their conversions to and from the float32
// accumulator: bfloat16, IEEE float16, and the KV-cache formats (int8, float8, int4); and the
// one switch from a DType to its storage type (with_storage_type).
// Part of the SIMD layer; included by its typed vocabulary (typed.hpp) and the kernel files,
// inside each tier's namespace, so every tier compiles them with its own flags (float16 uses
// F16C's conversions where the tier has them).
//
// Values are only ever widened to float32 for arithmetic; they are narrowed once, when the
// output is stored (round to nearest even; NaN stays NaN).
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include "../attnfast.hpp"
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
struct f8e4m3_t { uint8_t bits; };
// float8 e5m2 (OCP FP8, ml_dtypes.float8_e5m2): sign, 5 exponent bits (bias 15), 2 mantissa
// bits: the top byte of an IEEE float16, infinities and NaNs included. A KV-cache storage
// type only (one float32 scale per row, as int8).
struct f8e5m2_t { uint8_t bits; };
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

// ---- one-byte floats: float16 with the low mantissa bits dropped
// A float8 byte b moved into a float16's bits, ((b & 0x7F) << kMagShift) | ((b & 0x80) << 8),
// is its value times 1 / kWidenScaleFold, every subnormal exact (both formats' subnormals are
// 0.m times their smallest normal): widening is that move and a float16 conversion (F16C
// where the tier has it). kNanAtAllOnes: S.1111.111 is NaN but moves to a finite float16,
// so widening sets it apart. The ISA widenings (simd/*.hpp) read only these traits.
template <class T> struct Float8 {
    static constexpr bool kIs = false;
    static constexpr float kWidenScaleFold = 1.0f;
};
template <> struct Float8<f8e4m3_t> {  // exponent bias 7 against float16's 15: 2^-8
    static constexpr bool kIs = true;
    static constexpr int kMagShift = 7;
    static constexpr bool kNanAtAllOnes = true;
    static constexpr float kAllOnesWidened = 1.875f;  // |S.1111.111| through float16, over 2^8
    static constexpr float kWidenScaleFold = 256.0f;
};
template <> struct Float8<f8e5m2_t> {  // float16's top byte: byte << 8, exactly its value
    static constexpr bool kIs = true;
    static constexpr int kMagShift = 8;
    static constexpr bool kNanAtAllOnes = false;
    static constexpr float kWidenScaleFold = 1.0f;
};

// A float8 value, exactly (its float16 bits widened, times kWidenScaleFold).
template <class T, typename std::enable_if<Float8<T>::kIs, int>::type = 0>
inline float widen(T x) {
    if (Float8<T>::kNanAtAllOnes && (x.bits & 0x7Fu) == 0x7Fu) return __builtin_nanf("");
    const uint16_t h =
        static_cast<uint16_t>(((x.bits & 0x7Fu) << Float8<T>::kMagShift) | ((x.bits & 0x80u) << 8));
    return widen(f16_t{h}) * Float8<T>::kWidenScaleFold;
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

// Per-row dequantisation scales of a row-scaled cache (1 for every other storage type):
// row j of (batch, kv head) is scale[j * row_stride] times its stored values.
struct RowScales {
    const float* scale = nullptr;  // nullptr: no scales (not a row-scaled cache)
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

// ---- storage-type dispatch
// A DType's storage type T and the DType itself, for fn(Stored<...>{}) (the format's
// description: storage_format(kDType), constexpr).
template <DType D, class T> struct Stored {
    using type = T;
    static constexpr DType kDType = D;
    static constexpr StorageFormat kFormat = storage_format(D);
};

// A dtype reached a kernel that has no code for it. The checks before the kernels let none
// through, so this is a bug: stop, rather than read memory as some other format.
[[noreturn]] inline void unreachable_dtype(const char* what, DType d) {
    std::fprintf(stderr, "attnfast: internal error: %s dtype %d reached a kernel without code for it\n",
                 what, static_cast<int>(d));
    std::abort();
}

// fn(Stored<t, T>{}) with T the storage type of dtype t: the kernels' one switch over storage
// types, every DType named, no default branch (-Werror=switch: a new format does not compile
// until it is named here; callers choose among types by the traits, never by a list).
template <class Fn>
inline void with_storage_type(DType t, Fn&& fn) {
    switch (t) {
        case DType::kF32: return fn(Stored<DType::kF32, float>{});
        case DType::kF64: return fn(Stored<DType::kF64, double>{});
        case DType::kF16: return fn(Stored<DType::kF16, f16_t>{});
        case DType::kBF16: return fn(Stored<DType::kBF16, bf16_t>{});
        case DType::kI8: return fn(Stored<DType::kI8, int8_t>{});
        case DType::kF8E4M3: return fn(Stored<DType::kF8E4M3, f8e4m3_t>{});
        case DType::kF8E5M2: return fn(Stored<DType::kF8E5M2, f8e5m2_t>{});
        case DType::kQ4: return fn(Stored<DType::kQ4, q4_t>{});
    }
    unreachable_dtype("storage", t);
}

}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
