// Kernel tier "avx512": float32 prefill and decode from the hand-written SIMD kernels
// (simd_prefill.inl, simd_decode.inl); float64 (prefill and decode) from the decode loop's
// template policy (decode_attention.inl); all compiled with this file's flags (CMakeLists.txt).
#define ATTNFAST_KERNEL_NS isa_avx512
#define ATTNFAST_KERNEL_NAME "avx512"
#define ATTNFAST_SIMD_BYTES 64  // vector register width the kernels are tuned for
#include "decode_attention.inl"  // (with attention_core.inl)
#include "simd_prefill.inl"
#include "simd_decode.inl"
#define ATTNFAST_PREFILL_KERNEL simd::prefill_kernel
#define ATTNFAST_DECODE_KERNEL simd_decode::decode_kernel
#define ATTNFAST_LOWP_INSTRUCTIONS \
    "bfloat16 (16-bit shift), float16 (F16C vcvtph2ps) and int8 (vpmovsxbd) widened to float32: in " \
    "registers as decode loads them, into a float32 copy of each K/V super-tile in prefill; float32 FMA"
#include "gemm_decode.inl"
#define ATTNFAST_GEMM_DECODE_KERNEL gemm_decode::gemm_decode_kernel  // many rows per KV head (MLA, GQA)
#include "backward.inl"  // the backward kernels, with this tier's flags
#include "export_table.inl"

const attnfast::KernelTable* attnfast::kernel_table_avx512() { return &isa_avx512::kTable; }
