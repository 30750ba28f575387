// The SIMD layer: one vocabulary of float32 vector operations, with one header per ISA
// (neon.hpp, avx512.hpp, avx2.hpp, sse2.hpp) chosen by the flags this translation unit is
// compiled with, and the math built on it (math.hpp). Included only by the kernel files of a
// tier (kernels/isa_*.cpp and the .inl files they include): everything lives in that tier's
// namespace (ATTNFAST_KERNEL_NS, anonymous), so no function compiled with one tier's flags
// can be linked into another's, or into the baseline drivers.
//
// The contract, the same on every ISA:
//   Vec, Mask, W         a vector of W float32 lanes; a per-lane predicate
//   vzero vset vbcast    constants and broadcasts
//   vload vstore         whole vectors at W-float-aligned addresses
//   vadd vsub vmul vdiv  one rounding each
//   vfma vfnma           a * b + c, c - a * b: one rounding (sse2: two, multiply then add)
//   vmax                 max; with a NaN operand: NaN on neon (FMAX), the second operand on
//                        x86 (maxps), so the operand order is part of each caller's contract
//   vabs vcopysign select less_than all_lanes all_ones
//   key_visible keep_or_neg_inf finite_or_zero neg_inf_to_nan keep_unless_sign
//                        the predicates and blends of the online softmax
//   exp2_neg tanh_vec    (math.hpp)
// and, for rows of scores and stored K/V rows (at any alignment):
//   vloadu vstoreu       unaligned whole vectors
//   store_lanes store_group  lanes [first, first + n) of a vector (masked tails)
//   keep_range           lanes outside a range zeroed
//   hsum transpose_reduce  fixed-order sums of one vector's lanes / of W vectors' lanes
//   lane_sum             one vector's lanes summed in transpose_reduce's order (the same
//                        bits as that vector's lane of a transpose_reduce)
//   hmax range_max       max of lanes / of a range, NaN if any element is NaN
//   vwiden vwiden_q4 vwiden_q4_block  W stored float32 / bfloat16 / float16 / int8 / float8
//                        (times 1 / kWidenScaleFold) / int4 values to float32 lanes,
//                        exactly, in registers
//   vnarrow              float32 lanes to W stored float32 / float16 / bfloat16 values (round
//                        to nearest even, NaN kept)
// and chunks, the unit the prefill transposes its Q, O and mask tiles in: Chunk, kChunk
// consecutive float32 values of a row in one register (8 in a ymm on both AVX tiers: ymm.hpp;
// one Vec on NEON and SSE2):
//   chunk_set chunk_mul chunk_load chunk_store (aligned) chunk_storeu
//   widen_chunk narrow_chunk  stored values (float32 / 16-bit / int8 / float8; and float64
//                        rounded to float32) to a chunk and back, as vwiden / vnarrow
//   chunk_zero_to_neg_inf  kChunk bytes: 0 -> -inf, other -> +0
//   transpose_chunks     kChunk chunks, rows to columns
//   ZeroTally            whether any lane added so far was nonzero (NaN counts) / zero
// Every operation rounds as its instruction does: results depend on the ISA (the header),
// never on the thread count. Beside it: typed.hpp (vectors of float or double lanes for the
// kernels templated over the accumulator type) and storage.hpp (the storage types).
#pragma once
#ifndef ATTNFAST_KERNEL_NS
#error "include csrc/simd/simd.hpp from a kernel translation unit (kernels/isa_*.cpp)"
#endif

#include <cstdint>

#include "storage.hpp"  // the storage types vwiden reads

#if defined(__aarch64__)
#include "neon.hpp"
#elif defined(__AVX512F__)
#include "avx512.hpp"
#elif defined(__AVX2__)
#include "avx2.hpp"
#elif defined(__SSE2__)
#include "sse2.hpp"
#else
#error "the SIMD layer needs SSE2 (x86-64) or AArch64 NEON"
#endif
#include "math.hpp"

#if !defined(__AVX2__)  // NEON, SSE2: a chunk is one vector (the AVX tiers': ymm.hpp)
namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace simd {
using Chunk = Vec;
constexpr int kChunk = W;
inline Chunk chunk_set(float x) { return vset(x); }
inline Chunk chunk_mul(Chunk a, Chunk b) { return vmul(a, b); }
inline Chunk chunk_load(const float* p) { return vload(p); }  // aligned
inline void chunk_store(float* p, Chunk x) { vstore(p, x); }   // aligned
inline void chunk_storeu(float* p, Chunk x) { vstoreu(p, x); }
template <class T> inline Chunk widen_chunk(const T* x) { return vwiden(x); }
template <class T> inline void narrow_chunk(T* y, Chunk x) { vnarrow(y, x); }
}  // namespace simd
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
#endif

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace simd {
#if !defined(__AVX512F__)  // (avx512.hpp: four shuffles)
inline float lane_sum(Vec x) {
    Vec rows[W];
    rows[0] = x;
    for (int i = 1; i < W; ++i) rows[i] = vzero();
    alignas(64) float sums[W];
    vstore(sums, transpose_reduce(rows));
    return sums[0];
}
#endif
// What vwiden leaves in a row's scale: the stored value is kWidenScaleFold<T> * vwiden's lane.
template <class T> constexpr float kWidenScaleFold = Float8<T>::kWidenScaleFold;
}  // namespace simd
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
