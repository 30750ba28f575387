// Kernel tier "generic": the shared kernel templates compiled with this file's flags
// (baseline ISA; the compiler's auto-vectorisation only).
#define ATTNFAST_KERNEL_NS isa_generic
#define ATTNFAST_KERNEL_NAME "generic"
#define ATTNFAST_SIMD_BYTES 16  // vector register width the kernels are tuned for
#include "block_attention.inl"
#include "decode_attention.inl"
#define ATTNFAST_F32_SINKS true  // the templates themselves
#include "export_table.inl"

const attnfast::KernelTable* attnfast::kernel_table_generic() { return &isa_generic::kTable; }
