// The KernelTable of one ISA file: every kernel template it compiled, by entry point.
// Included last by kernels/isa_*.cpp, after the kernel .inl files. A tier with its own
// float32-accumulated prefill kernel names it (and its plan) in ATTNFAST_PREFILL /
// ATTNFAST_PREFILL_PLAN, and its decode chunk kernel in ATTNFAST_DECODE_CHUNK; otherwise the
// shared templates are used (float64 always is). Every tier also gets the benchmarks' read
// kernel (read_fold.inl).
#ifndef ATTNFAST_KERNEL_NS
#error "define ATTNFAST_KERNEL_NS and include the kernel .inl files before export_table.inl"
#endif
#include "read_fold.inl"  // every tier's read kernel, with its own loads

#ifndef ATTNFAST_PREFILL
#define ATTNFAST_PREFILL attend_block_any
#define ATTNFAST_PREFILL_PLAN plan_templates
#endif
#ifndef ATTNFAST_DECODE_CHUNK
#define ATTNFAST_DECODE_CHUNK decode_chunk_any
#endif

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {

#ifndef ATTNFAST_LOWP_INSTRUCTIONS
#define ATTNFAST_LOWP_INSTRUCTIONS "16-bit and int8 values widened to float32 in plain C++"
#endif

const KernelTable kTable = {
    ATTNFAST_KERNEL_NAME,
    ATTNFAST_LOWP_INSTRUCTIONS,
    ATTNFAST_PREFILL, ATTNFAST_PREFILL_PLAN, attend_block_f64,
    ATTNFAST_DECODE_CHUNK, decode_chunk_f64,
    decode_merge_any, decode_merge_f64,
    read_fold,
};

}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
