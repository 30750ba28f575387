// The KernelTable of one ISA file: every kernel template it compiled, by entry point.
// Included last by kernels/isa_*.cpp, after the kernel .inl files. A tier with its own float32
// prefill kernel names it (and its plan) in ATTNFAST_PREFILL_F32 / ATTNFAST_PREFILL_PLAN_F32;
// otherwise the shared template is used; likewise ATTNFAST_PREFILL_ANY / _PLAN_ANY for every
// other float32-accumulated combination. Likewise a float32 decode chunk kernel in
// ATTNFAST_DECODE_CHUNK_F32, and one for every other float32-accumulated dtype combination in
// ATTNFAST_DECODE_CHUNK_ANY. ATTNFAST_F32_SINKS: its float32 kernels take sinks. Every tier
// also gets the benchmarks' read kernel (read_fold.inl).
#ifndef ATTNFAST_KERNEL_NS
#error "define ATTNFAST_KERNEL_NS and include the kernel .inl files before export_table.inl"
#endif
#include "read_fold.inl"  // every tier's read kernel, with its own loads

#ifndef ATTNFAST_PREFILL_F32
#define ATTNFAST_PREFILL_F32 attend_block_f32
#define ATTNFAST_PREFILL_PLAN_F32 plan_templates
#endif
#ifndef ATTNFAST_PREFILL_ANY
#define ATTNFAST_PREFILL_ANY attend_block_any
#define ATTNFAST_PREFILL_PLAN_ANY plan_templates
#endif
#ifndef ATTNFAST_DECODE_CHUNK_F32
#define ATTNFAST_DECODE_CHUNK_F32 decode_chunk_f32
#endif
#ifndef ATTNFAST_DECODE_CHUNK_ANY
#define ATTNFAST_DECODE_CHUNK_ANY decode_chunk_any
#endif

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {

#ifndef ATTNFAST_LOWP_INSTRUCTIONS
#define ATTNFAST_LOWP_INSTRUCTIONS "16-bit and int8 values widened to float32 in plain C++"
#endif
#ifndef ATTNFAST_F32_SINKS
#define ATTNFAST_F32_SINKS false
#endif

const KernelTable kTable = {
    ATTNFAST_KERNEL_NAME,
    ATTNFAST_LOWP_INSTRUCTIONS,
    ATTNFAST_F32_SINKS,
    ATTNFAST_PREFILL_F32, attend_block_f64,
    ATTNFAST_PREFILL_PLAN_F32,
    ATTNFAST_DECODE_CHUNK_F32, decode_chunk_f64,
    decode_merge_f32, decode_merge_f64,
    ATTNFAST_PREFILL_ANY, ATTNFAST_PREFILL_PLAN_ANY, ATTNFAST_DECODE_CHUNK_ANY, decode_merge_any,
    read_fold,
};

}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
