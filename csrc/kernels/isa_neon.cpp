// Kernel tier "neon" (AArch64 Advanced SIMD, part of every AArch64 CPU): the hand-written
// kernels on the SIMD layer's NEON header (csrc/simd/neon.hpp): float32-accumulated prefill
// (float32, 16-bit and int8 inputs, every score option, sinks) from simd_prefill.inl in its
// NEON branch; decode from simd_decode.inl's WidenPath through the one decode loop (K/V of
// every storage type widened in registers), and from gemm_decode.inl where many query rows
// share a KV head (MLA, GQA); float64 from the template policy. Compiled only for aarch64
// targets (CMakeLists.txt), with the baseline flags: NEON needs no -m flag there.
// Not timed (no arm64 hardware here): checked against the float64 reference under qemu
// (tools/run_cpp_tests.sh).
#define ATTNFAST_KERNEL_NS isa_neon
#define ATTNFAST_KERNEL_NAME "neon"
#define ATTNFAST_SIMD_BYTES 16  // vector register width the kernels are tuned for
#include "decode_attention.inl"  // (with attention_core.inl)
#include "simd_prefill.inl"
#include "simd_decode.inl"
#define ATTNFAST_PREFILL_KERNEL simd::prefill_kernel
#define ATTNFAST_DECODE_KERNEL simd_decode::decode_kernel
#define ATTNFAST_LOWP_INSTRUCTIONS \
    "bfloat16 (16-bit shift), float16 (NEON fcvtl) and int8 (NEON sxtl) widened to float32: in " \
    "registers as decode loads them, into a float32 copy of each K/V super-tile in prefill; float32 FMA"
#include "gemm_decode.inl"
#define ATTNFAST_GEMM_DECODE_KERNEL gemm_decode::gemm_decode_kernel  // many rows per KV head (MLA, GQA)
#include "backward.inl"  // the backward kernels, with this tier's flags
#include "export_table.inl"

const attnfast::KernelTable* attnfast::kernel_table_neon() { return &isa_neon::kTable; }
