// Kernel tier "avx2": float32 prefill from the hand-written SIMD kernel (simd_prefill.inl),
// float64 from the shared auto-vectorised templates, both compiled with this file's flags
// (CMakeLists.txt).
#define ATTNFAST_KERNEL_NS isa_avx2
#define ATTNFAST_KERNEL_NAME "avx2"
#include "block_attention.inl"
#include "simd_prefill.inl"

namespace attnfast {
namespace isa_avx2 {
namespace {
const KernelTable kTable = {ATTNFAST_KERNEL_NAME, simd::attend_block, attend_block_f64, simd::plan};
}  // namespace
}  // namespace isa_avx2

const KernelTable* kernel_table_avx2() { return &isa_avx2::kTable; }
}  // namespace attnfast
