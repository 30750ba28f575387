// Kernel tier "avx512": float32 prefill from the hand-written SIMD kernel (simd_prefill.inl),
// float64 from the shared auto-vectorised templates, both compiled with this file's flags
// (CMakeLists.txt).
#define ATTNFAST_KERNEL_NS isa_avx512
#define ATTNFAST_KERNEL_NAME "avx512"
#include "block_attention.inl"
#include "simd_prefill.inl"

namespace attnfast {
namespace isa_avx512 {
namespace {
const KernelTable kTable = {ATTNFAST_KERNEL_NAME, simd::attend_block, attend_block_f64, simd::plan};
}  // namespace
}  // namespace isa_avx512

const KernelTable* kernel_table_avx512() { return &isa_avx512::kTable; }
}  // namespace attnfast
