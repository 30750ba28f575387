// Kernel tier "generic": what a CPU gets when no other tier runs on it, compiled with the
// baseline flags of the target (no -m flags).
// x86-64 (baseline: SSE2, 16 xmm registers, no FMA): float32-accumulated prefill (float32,
// 16-bit and int8 inputs, every score option) from the hand-written kernel simd_prefill.inl
// in its SSE2 branch; float64 prefill and all decode from the shared auto-vectorised templates.
// Other architectures (the aarch64 build, where neon is the usual tier): the templates only.
#define ATTNFAST_KERNEL_NS isa_generic
#define ATTNFAST_KERNEL_NAME "generic"
#define ATTNFAST_SIMD_BYTES 16  // vector register width the kernels are tuned for
#include "block_attention.inl"
#include "decode_attention.inl"
#if defined(__SSE2__)
#include "simd_prefill.inl"
#define ATTNFAST_PREFILL_KERNEL simd::prefill_kernel
#define ATTNFAST_LOWP_INSTRUCTIONS \
    "bfloat16 (16-bit shift), float16 (SSE2 integer rebias; no F16C) and int8 (SSE2 unpack) " \
    "widened to float32 into a float32 copy of each K/V super-tile in prefill; in plain C++ in " \
    "decode; float32 multiply then add (no FMA)"
#endif
#include "backward.inl"  // the backward kernels, with this tier's flags
#include "export_table.inl"

const attnfast::KernelTable* attnfast::kernel_table_generic() { return &isa_generic::kTable; }
