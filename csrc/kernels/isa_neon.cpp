// Kernel tier "neon" (AArch64 Advanced SIMD, part of every AArch64 CPU): float32-accumulated
// prefill (float32, 16-bit and int8 inputs, every score option, sinks) from the hand-written
// kernel simd_prefill.inl in its NEON branch; float64 prefill and all decode from the shared
// templates, whose 16-byte GCC vector extensions compile to NEON here. Compiled only for
// aarch64 targets (CMakeLists.txt), with the baseline flags: NEON needs no -m flag there.
//
// Decode keeps the shared template: it is bandwidth-bound, and its inner dot loop already
// compiles (GCC 12, objdump) to 1 K load + 4 Q loads + 4 FMLA.4s per 4 elements for 4 rows,
// no spills, ~6 bytes of K per cycle at 2 loads/cycle: about one core's DRAM bandwidth. A
// hand-written one could not be shown better without arm64 hardware to time it on.
#define ATTNFAST_KERNEL_NS isa_neon
#define ATTNFAST_KERNEL_NAME "neon"
#define ATTNFAST_SIMD_BYTES 16  // vector register width the kernels are tuned for
#include "block_attention.inl"
#include "decode_attention.inl"
#include "simd_prefill.inl"
#define ATTNFAST_PREFILL_KERNEL simd::prefill_kernel
#define ATTNFAST_LOWP_INSTRUCTIONS \
    "bfloat16 (16-bit shift), float16 (NEON fcvtl) and int8 (NEON sxtl) widened to float32 into a " \
    "float32 copy of each K/V super-tile in prefill; in plain C++ in decode; float32 FMA"
#include "backward.inl"  // the backward kernels, with this tier's flags
#include "export_table.inl"

const attnfast::KernelTable* attnfast::kernel_table_neon() { return &isa_neon::kTable; }
