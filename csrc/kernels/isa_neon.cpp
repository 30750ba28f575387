// Kernel tier "neon" (AArch64 Advanced SIMD, part of every AArch64 CPU): float32 prefill from
// the hand-written NEON kernel (neon_prefill.inl); float64 prefill and all decode from the
// shared templates, whose 16-byte GCC vector extensions compile to NEON here. Compiled only
// for aarch64 targets (CMakeLists.txt), with the baseline flags: NEON needs no -m flag there.
#define ATTNFAST_KERNEL_NS isa_neon
#define ATTNFAST_KERNEL_NAME "neon"
#define ATTNFAST_SIMD_BYTES 16  // vector register width the kernels are tuned for
#include "block_attention.inl"
#include "decode_attention.inl"
#include "neon_prefill.inl"
#define ATTNFAST_PREFILL_F32 neon::attend_block
#define ATTNFAST_PREFILL_PLAN_F32 neon::plan
#include "export_table.inl"

const attnfast::KernelTable* attnfast::kernel_table_neon() { return &isa_neon::kTable; }
