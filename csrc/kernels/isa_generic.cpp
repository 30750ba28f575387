// Kernel tier "generic": the shared kernel templates compiled with this file's flags (CMakeLists.txt).
#define ATTNFAST_KERNEL_NS isa_generic
#define ATTNFAST_KERNEL_NAME "generic"
#include "block_attention.inl"

const attnfast::KernelTable* attnfast::kernel_table_generic() { return &isa_generic::kTable; }
