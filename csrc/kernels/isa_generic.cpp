// Kernel tier "generic": what a CPU gets when no other tier runs on it, compiled with the
// baseline flags of the target (no -m flags).
// x86-64 (baseline: SSE2, 16 xmm registers, no FMA): the hand-written kernels on the SIMD
// layer's SSE2 header (csrc/simd/sse2.hpp; multiply then add where the other tiers fuse):
// float32-accumulated prefill (float32, 16-bit and int8 inputs, every score option) from
// simd_prefill.inl; decode from simd_decode.inl's WidenPath through the one decode loop
// (K/V of every storage type widened in registers) and from gemm_decode.inl where many query
// rows share a KV head (MLA, GQA); float64 from the template policy of the decode loop.
// Other architectures (the aarch64 build, where neon is the usual tier): the template policy only,
// so that the portable template policies keep a tier of their own.
#define ATTNFAST_KERNEL_NS isa_generic
#define ATTNFAST_KERNEL_NAME "generic"
#define ATTNFAST_SIMD_BYTES 16  // vector register width the kernels are tuned for
#include "decode_attention.inl"  // (with attention_core.inl)
#if defined(__SSE2__)
#include "simd_prefill.inl"
#include "simd_decode.inl"
#include "gemm_decode.inl"
#define ATTNFAST_PREFILL_KERNEL simd::prefill_kernel
#define ATTNFAST_DECODE_KERNEL simd_decode::decode_kernel
#define ATTNFAST_GEMM_DECODE_KERNEL gemm_decode::gemm_decode_kernel  // many rows per KV head (MLA, GQA)
#define ATTNFAST_LOWP_INSTRUCTIONS \
    "bfloat16 (16-bit shift), float16 (SSE2 integer rebias; no F16C) and int8 (SSE2 unpack) " \
    "widened to float32: in registers as decode loads them, into a float32 copy of each K/V " \
    "super-tile in prefill; float32 multiply then add (no FMA)"
#endif
#include "backward.inl"  // the backward kernels, with this tier's flags
#include "export_table.inl"

const attnfast::KernelTable* attnfast::kernel_table_generic() { return &isa_generic::kTable; }
