// Kernel tier "avx512bf16": the avx512 tier's kernels plus the bfloat16 ones that use
// AVX512_BF16's vdpbf16ps (bf16_decode.inl, bf16_prefill.inl), compiled with this file's flags (CMakeLists.txt:
// the avx512 ones and -mavx512bf16). Chosen over "avx512" on CPUs that have the instruction
// (AMD Zen 4, Intel Cooper Lake and Sapphire Rapids on); ATTNFAST_ISA=avx512 forces the tier
// without it.
#define ATTNFAST_KERNEL_NS isa_avx512bf16
#define ATTNFAST_KERNEL_NAME "avx512bf16"
#define ATTNFAST_SIMD_BYTES 64  // vector register width the kernels are tuned for
#include "decode_attention.inl"  // (with attention_core.inl)
#include "simd_prefill.inl"
#include "simd_decode.inl"
#include "bf16_decode.inl"
#include "bf16_prefill.inl"
#include "vnni_decode.inl"  // vpdpbusd for int8 caches (every CPU with AVX512_BF16 has VNNI)
#define ATTNFAST_PREFILL_KERNEL bf16_prefill::prefill_kernel  // vdpbf16ps for bfloat16 q, k, v
#define ATTNFAST_DECODE_KERNEL vnni_decode::decode_kernel     // + vpdpbusd for int8 Q.K
#define ATTNFAST_LOWP_INSTRUCTIONS \
    "bfloat16 q with bfloat16 K/V: vdpbf16ps (prefill and decode); int8 cache decode: Q.K with " \
    "vpdpbusd over q quantised to int8 per row (ATTNFAST_INT8_DOT=widen: widened); other 16-bit, " \
    "int8 and float8 values widened to float32 as in avx512 (F16C vcvtph2ps, vpmovsxbd); float32 FMA"
#include "gemm_decode.inl"
#define ATTNFAST_GEMM_DECODE_KERNEL gemm_decode::gemm_decode_kernel  // many rows per KV head (MLA, GQA)
#include "backward.inl"  // the backward kernels, with this tier's flags
#include "export_table.inl"

const attnfast::KernelTable* attnfast::kernel_table_avx512bf16() { return &isa_avx512bf16::kTable; }
