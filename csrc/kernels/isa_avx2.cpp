// Kernel tier "avx2": the shared kernel templates compiled with this file's flags (CMakeLists.txt).
#define ATTNFAST_KERNEL_NS isa_avx2
#define ATTNFAST_KERNEL_NAME "avx2"
#define ATTNFAST_SIMD_BYTES 32  // vector register width the kernels are tuned for
#include "block_attention.inl"
#include "decode_attention.inl"
#include "export_table.inl"

const attnfast::KernelTable* attnfast::kernel_table_avx2() { return &isa_avx2::kTable; }
