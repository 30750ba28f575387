// Kernel tier "generic": the shared kernel templates compiled with this file's flags (CMakeLists.txt).
#define ATTNFAST_KERNEL_NS isa_generic
#define ATTNFAST_KERNEL_NAME "generic"
#include "block_attention.inl"

namespace attnfast {
namespace isa_generic {
namespace {
const KernelTable kTable = {ATTNFAST_KERNEL_NAME, attend_block_f32, attend_block_f64, plan_f32_generic};
}  // namespace
}  // namespace isa_generic

const KernelTable* kernel_table_generic() { return &isa_generic::kTable; }
}  // namespace attnfast
