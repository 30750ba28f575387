// The KernelTable of one ISA file: every kernel template it compiled, by entry point.
// Included last by kernels/isa_*.cpp, after the kernel .inl files. A tier with kernels of its
// own names the functions that pick one for a call (KernelTable::prefill_kernel,
// decode_kernel) in ATTNFAST_PREFILL_KERNEL / ATTNFAST_DECODE_KERNEL; otherwise the shared
// templates run (float64 always does). Every tier also gets the benchmarks' probes
// (probes.inl).
#pragma once
#ifndef ATTNFAST_KERNEL_NS
#error "define ATTNFAST_KERNEL_NS and include the kernel .inl files before export_table.inl"
#endif
#include "probes.inl"  // every tier's read and peak kernels, with its own instructions
#include "index_scores.inl"  // every tier's lightning-indexer scores

#ifndef ATTNFAST_PREFILL_KERNEL
#define ATTNFAST_PREFILL_KERNEL template_prefill
#endif
#ifndef ATTNFAST_DECODE_KERNEL
#define ATTNFAST_DECODE_KERNEL template_decode
#endif
#ifndef ATTNFAST_GEMM_DECODE_KERNEL
#define ATTNFAST_GEMM_DECODE_KERNEL no_gemm_decode
#endif

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {

#ifndef ATTNFAST_LOWP_INSTRUCTIONS
#define ATTNFAST_LOWP_INSTRUCTIONS "16-bit and int8 values widened to float32 in plain C++"
#endif

// A tier without a GEMM-shaped decode kernel: its decode kernels run those calls too.
[[maybe_unused]] DecodeKernel no_gemm_decode(const AttentionParams&) { return {KernelId::kNone, nullptr}; }

// KernelTable::kernel_policy: every kernel id named (no default: -Wswitch), each policy
// specialised next to its kernel (PolicyOf).
KernelPolicy kernel_policy(KernelId id, const AttentionParams& p) {
    switch (id) {
        case KernelId::kNone: return {};
        case KernelId::kSimdPrefill: return PolicyOf<KernelId::kSimdPrefill>::of(p);
        case KernelId::kBf16Prefill: return PolicyOf<KernelId::kBf16Prefill>::of(p);
        case KernelId::kSimdDecode: return PolicyOf<KernelId::kSimdDecode>::of(p);
        case KernelId::kBf16Decode: return PolicyOf<KernelId::kBf16Decode>::of(p);
        case KernelId::kVnniInt8Decode: return PolicyOf<KernelId::kVnniInt8Decode>::of(p);
        case KernelId::kGemmDecode: return PolicyOf<KernelId::kGemmDecode>::of(p);
        case KernelId::kLatentDecode: return PolicyOf<KernelId::kLatentDecode>::of(p);
        case KernelId::kTemplatePrefill: return PolicyOf<KernelId::kTemplatePrefill>::of(p);
        case KernelId::kTemplateDecode: return PolicyOf<KernelId::kTemplateDecode>::of(p);
        case KernelId::kTemplateF64: return PolicyOf<KernelId::kTemplateF64>::of(p);
    }
    return {};
}

const KernelTable kTable = {
    ATTNFAST_KERNEL_NAME,
    ATTNFAST_LOWP_INSTRUCTIONS,
    ATTNFAST_PREFILL_KERNEL, attend_block_f64,
    ATTNFAST_DECODE_KERNEL, decode_chunk_f64,
    decode_merge_any, decode_merge_f64,
    read_fold,
    peak_spin,
    ATTNFAST_GEMM_DECODE_KERNEL,
    backward_kernels,
    kernel_policy,
    index_scores,
};

}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
