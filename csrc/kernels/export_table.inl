// The KernelTable of one ISA file: every kernel template it compiled, by entry point.
// Included last by kernels/isa_*.cpp, after block_attention.inl and decode_attention.inl.
#ifndef ATTNFAST_KERNEL_NS
#error "define ATTNFAST_KERNEL_NS and include the kernel .inl files before export_table.inl"
#endif

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {

const KernelTable kTable = {
    ATTNFAST_KERNEL_NAME,
    attend_block_f32, attend_block_f64,
    decode_chunk_f32, decode_chunk_f64,
    decode_merge_f32, decode_merge_f64,
};

}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast
