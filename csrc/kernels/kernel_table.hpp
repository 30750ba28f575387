// The seam between the drivers (prefill.cpp, baseline ISA) and the per-ISA kernel files.
// Each kernels/isa_*.cpp compiles the same kernel templates with its own -m flags and
// exports one KernelTable; dispatch.cpp picks the table once at run time.
#pragma once
#include <cstdint>

#include "../attnfast.hpp"

// The helpers below are `static inline`: every translation unit keeps its own copy, so the
// linker can never hand the baseline drivers a copy compiled with AVX-512 flags.

namespace attnfast {

// One unit of prefill work: query rows [row_begin, row_end) of one (batch, head), or of
// heads [head, head + head_count) that all read one KV head (GQA; float32 SIMD tiers only).
// Row blocks are fixed by the plan (PrefillPlan), never by the thread count, so every thread
// count computes the same bits.
struct BlockTask {
    int64_t batch;
    int64_t head;
    int64_t row_begin;
    int64_t row_end;
    int64_t head_count = 1;
};

// Per-core data cache sizes in bytes, read once from the OS (with safe defaults when it
// does not say); kernels derive their tile sizes from them.
struct CacheSizes {
    int64_t l1d;
    int64_t l2;
};
const CacheSizes& cache_sizes();

// ---- decode (short queries against a long KV cache; csrc/decode.cpp) ----
// Queries of at most this many rows take the decode path: bandwidth-bound, all H/Hkv query
// heads of one KV head together, KV split into fixed chunks merged by (out, lse).
constexpr int64_t kDecodeMaxQueryRows = 16;
static inline bool takes_decode_path(const AttentionParams& p) {
    return p.seqlen_q <= kDecodeMaxQueryRows;
}
// Longer queries take the decode path too where it is faster (runs_on_decode_path,
// decode.cpp), over at least kDecodeMinKeysPerQuery keys per query row: up to
// kGemmDecodeMaxQueryRows rows when the tier's GEMM-shaped decode takes them (from
// kGemmDecodeMinRows rows per KV head, 16 on some tiers: gemm_decode.inl kMinGqaRows; from
// there it beats the bandwidth-shaped decode, which serves kDecodeGroupRows rows per pass),
// and up to kFewRowsDecodeMaxQueryRows rows with fewer rows per KV head than
// kGemmDecodeMinRows, on either decode kernel. The prefill kernel
// computes whole blocks of 32 query rows per head, so 17 rows cost it as much as 32: the
// decode path removes that step. Measured on Zen 3 (avx2; bench/HISTORY.md 27): 32/8 heads,
// L = 16k, Tq = 17, float32: 11 ms per row on prefill, 5.4-6.2 on gemm_decode; 8/8, Tq = 17:
// 2.6 on prefill, 2.2-2.3 on simd_decode; 8/8 at Tq = 24: prefill ahead again (1.8-2.0
// against 2.0-2.4). bfloat16 on AVX512_BF16 (gemm_decode's pair tile against bf16_decode,
// Zen 4, one thread, 32/8, L = 16k): Tq = 8 1.29x, Tq = 16 1.49x (HISTORY 46).
constexpr int64_t kGemmDecodeMinRows = 32;
constexpr int64_t kGemmDecodeMaxQueryRows = 64;
constexpr int64_t kFewRowsDecodeMaxQueryRows = 20;
constexpr int64_t kDecodeMinKeysPerQuery = 8;
// Query rows per decode call when a longer query reads a float8 or int4 cache, which has no
// prefill kernel (decode_only_format): each block re-reads the cache once.
constexpr int64_t kQuantizedRowBlock = 64;
// Query rows (heads x positions) one pass over a block of keys serves; more rows re-read
// the block from cache (L2), not from memory.
constexpr int64_t kDecodeGroupRows = 32;
// Bytes of K plus V one chunk spans: the L2 size, within these bounds (a block's V rows,
// prefetched during the pass over its K rows, must still be in L2 for the pass over V).
// 1 MiB measured ~5-10% faster than 512 KiB on one Zen 4 core (1 MiB L2); 2 MiB no better.
constexpr int64_t kDecodeMinChunkBytes = 256 * 1024;
constexpr int64_t kDecodeMaxChunkBytes = 1024 * 1024;
// Bounds on a chunk's key count.
constexpr int64_t kDecodeMinChunkKeys = 64;
constexpr int64_t kDecodeMaxChunkKeys = 4096;

// Bytes of one key's K row plus V row as stored (a row-scaled row's 4-byte scale ignored).
static inline int64_t kv_pair_bytes(const AttentionParams& p) {
    return stored_row_bytes(p.kv_dtype, p.head_dim) + stored_row_bytes(p.kv_dtype, p.head_dim_v);
}

// Keys per decode chunk: a function of the sizes and the cache size only (never of the
// thread count), so the split points, and with them the result bits, are the same for any
// thread count.
static inline int64_t decode_chunk_keys(const AttentionParams& p) {
    const int64_t pair = kv_pair_bytes(p);
    int64_t bytes = cache_sizes().l2;
    if (bytes < kDecodeMinChunkBytes) bytes = kDecodeMinChunkBytes;
    if (bytes > kDecodeMaxChunkBytes) bytes = kDecodeMaxChunkBytes;
    int64_t keys = kDecodeMaxChunkKeys;
    while (keys > kDecodeMinChunkKeys && keys * pair > bytes)
        keys /= 2;
    return keys;
}

// Rows of a decode problem handled together for one KV head: (H / Hkv) * Tq, row
// r = (query head within the group) * Tq + (query position).
static inline int64_t decode_rows(const AttentionParams& p) {
    return (p.heads / p.kv_heads) * p.seqlen_q;
}

// One unit of decode work: keys [key_begin, key_end) (one chunk, clipped to the keys any
// row may see) of one (batch, kv head), for all its decode_rows() query rows.
struct DecodeTask {
    int64_t batch;
    int64_t kv_head;
    int64_t key_begin;
    int64_t key_end;
    int64_t seqlen_k;  // keys valid for this batch entry (seqlens_k[batch] or seqlen_k)
    // An indexed source (key_index, for a kernel with DecodeKernel::reads_index): key j of
    // the task is the cache's position rows[j], every one visible; nullptr: key j is position j.
    const int32_t* rows = nullptr;
};

// The decode kernel pads query rows to whole vectors of this many bytes (the widest
// vector register of any tier: 16 floats, 8 doubles).
constexpr int64_t kDecodeVectorBytes = 64;

// Elements between the decode kernel's scaled query rows: D rounded up to whole vectors.
static inline int64_t decode_query_stride(const AttentionParams& p) {
    const int64_t lanes = kDecodeVectorBytes / (p.dtype == DType::kF64 ? 8 : 4);
    return (p.head_dim + lanes - 1) / lanes * lanes;
}

// Keys the decode kernel scores, softmaxes and accumulates at a time (online softmax across
// blocks, when a chunk holds more): small enough that a block's V stays in L2 between the
// pass over its K (which prefetches it) and the pass over its V; long runs of each stream
// measured faster than finer interleaving.
constexpr int64_t kDecodeKeyBlock = 1024;
// Elements between score rows in the decode workspace: a key block plus a cache line or
// two, so the rows do not all fall into the same few L1 sets (a power-of-two stride would).
constexpr int64_t kDecodeScoreStride = kDecodeKeyBlock + 16;

// Scratch one thread needs for one DecodeTask (and for a merge), in accumulator elements.
static inline int64_t decode_workspace_elems(const AttentionParams& p) {
    const int64_t merge = p.head_dim_v;
    // + one key block's K and V row scales (int8 caches, hand-written SIMD decode)
    const int64_t task = kDecodeGroupRows * (decode_query_stride(p) + kDecodeScoreStride) +
                         2 * kDecodeKeyBlock;
    return task > merge ? task : merge;
}

// How a tier splits a float32-accumulated prefill (PrefillKernel::plan): query rows and heads
// per BlockTask, and scratch floats per thread. A function of the problem's shape and the
// cache sizes, never of the thread count (so every thread count computes the same bits).
struct PrefillPlan {
    int64_t block_rows;
    int64_t workspace_elems;
    int64_t heads_per_task = 1;  // divides heads / kv_heads
};

// The template prefill's plan (decode_attention.inl: the decode loop over one group of
// kDecodeGroupRows query rows of one head per task): the decode loop's scratch, then the
// group's accumulator rows, running max and running sum.
static inline PrefillPlan template_prefill_plan(const AttentionParams& p) {
    return {kDecodeGroupRows, decode_workspace_elems(p) + kDecodeGroupRows * (p.head_dim_v + 2)};
}

// Which kernel runs a call: the drivers branch on it, attnfast.explain names it
// (kernel_name). The hand-written kernels first, then the shared templates.
enum class KernelId : uint8_t {
    kNone,  // no kernel (a tier's gemm_decode_kernel that does not take the call)
    kSimdPrefill, kBf16Prefill, kSimdDecode, kBf16Decode, kVnniInt8Decode, kGemmDecode,
    kLatentDecode,
    kTemplatePrefill, kTemplateDecode, kTemplateF64,
};
// Every id named (no default: a new id that is not named here does not compile, -Wswitch).
constexpr const char* kernel_name(KernelId id) {
    switch (id) {
        case KernelId::kNone: return "none";
        case KernelId::kSimdPrefill: return "simd_prefill";
        case KernelId::kBf16Prefill: return "bf16_prefill";
        case KernelId::kSimdDecode: return "simd_decode";
        case KernelId::kBf16Decode: return "bf16_decode";
        case KernelId::kVnniInt8Decode: return "vnni_int8_decode";
        case KernelId::kGemmDecode: return "gemm_decode";
        case KernelId::kLatentDecode: return "latent_decode";
        case KernelId::kTemplatePrefill: return "template_prefill";
        case KernelId::kTemplateDecode: return "template_decode";
        case KernelId::kTemplateF64: return "template_f64";
    }
    return "none";
}
// The shared templates (plain C++ over typed vectors), not a hand-written kernel.
constexpr bool is_template(KernelId id) {
    return id == KernelId::kTemplatePrefill || id == KernelId::kTemplateDecode || id == KernelId::kTemplateF64;
}

// The arithmetic of one product of a micro-kernel (attnfast.explain's policy "qk", "pv").
enum class Product : uint8_t {
    kNone,
    kF32Fma,     // float32 fused multiply-add (16-bit and int8 values widened first)
    kF32MulAdd,  // float32 multiply, then add (SSE2 has no FMA; the templates are not contracted)
    kBf16Pairs,  // vdpbf16ps: two bfloat16 products per float32 lane
    kInt8Quads,  // vpdpbusd: four int8 products per int32 lane
    kInt16Pairs, // vpdpwssd: two int16 products per int32 lane
    kF64,        // float64 (the template, for float64 calls)
};
// Every product named (no default, -Wswitch).
constexpr const char* product_name(Product product) {
    switch (product) {
        case Product::kNone: return "none";
        case Product::kF32Fma: return "fp32 fma";
        case Product::kF32MulAdd: return "fp32 mul+add";
        case Product::kBf16Pairs: return "vdpbf16ps";
        case Product::kInt8Quads: return "vpdpbusd";
        case Product::kInt16Pairs: return "vpdpwssd";
        case Product::kF64: return "fp64";
    }
    return "none";
}
// A kernel's micro-kernel policy (KernelTable::kernel_policy; attnfast.explain's "policy"):
// the register block of its Q.K micro-kernel, query rows (MR) x keys (NR), and the
// arithmetic of its two products.
struct KernelPolicy {
    int64_t rows = 0;
    int64_t keys = 0;
    Product qk = Product::kNone;
    Product pv = Product::kNone;
};
// plan_attention's policy fields from a kernel's policy.
static inline void set_policy(CallPlan& plan, const KernelPolicy& policy) {
    plan.policy_rows = policy.rows;
    plan.policy_keys = policy.keys;
    plan.policy_qk = product_name(policy.qk);
    plan.policy_pv = product_name(policy.pv);
}

// The float32-accumulated prefill kernel that runs a call, as KernelTable::prefill_kernel
// picks it: its id (attnfast.explain names it), its task entry point and its plan.
struct PrefillKernel {
    KernelId id;  // kSimdPrefill, kBf16Prefill or kTemplatePrefill
    // Attend one block of query rows over all the keys it may see; writes its out/lse rows.
    void (*attend_block)(const AttentionParams&, const BlockTask&, float* workspace);
    PrefillPlan (*plan)(const AttentionParams&);  // its block rows and workspace
};

// Likewise the float32-accumulated decode chunk kernel (KernelTable::decode_kernel).
struct DecodeKernel {
    KernelId id;  // a decode id (kNone with chunk == nullptr: no kernel)
    // Decode, step 1: one chunk for all rows of a (batch, kv head). Writes the chunk's
    // unnormalised accumulator acc (rows x Dv), row max m and row sum l (rows each);
    // a row that sees no key of the chunk gets m = -inf, l = 0, acc = 0.
    void (*chunk)(const AttentionParams&, const DecodeTask&, float* workspace, float* acc,
                  float* m, float* l);
    // Keys per chunk, when the kernel fixes its own (0: decode_chunk_keys), and scratch
    // floats per thread, when it needs its own (nullptr: decode_workspace_elems).
    int64_t chunk_keys = 0;
    int64_t (*workspace_elems)(const AttentionParams&) = nullptr;
    // Blocks the query rows as a small GEMM (bound by arithmetic), rather than streaming
    // K/V once per step with a dot product per row (bound by memory): explain's "regime".
    bool compute_shaped = false;
    // Reads an indexed task's rows where they lie (DecodeTask::rows, through TaskRows): with
    // key_index the driver lists a chunk's positions instead of copying its rows.
    bool reads_index = false;
};

// An MLA latent cache: V is a prefix view of K's last axis (v = k[..., :Dv], the same
// memory, the same strides), so one read of each latent row serves both products.
static inline bool kv_is_latent(const AttentionParams& p) {
    return p.v == p.k && p.head_dim_v <= p.head_dim &&
           !storage_format(p.kv_dtype).cache_only &&
           p.v_batch_stride == p.k_batch_stride && p.v_head_stride == p.k_head_stride &&
           p.v_row_stride == p.k_row_stride;
}

struct BackwardKernels;  // backward.hpp

struct KernelTable {
    const char* name;
    // What the 16-bit and int8 paths of this tier run on, for show_config().
    const char* lowp_instructions;
    // The prefill kernel for a call accumulating in float32: every dtype combination but
    // float64 (float32; float16 / bfloat16 q, k, v; float32 q over a 16-bit or int8 cache;
    // 16-bit q over an int8 cache) and every score option (softcap, ALiBi, mask, sinks). The
    // tier's hand-written kernel where it covers the call (widening as it loads; vdpbf16ps on
    // avx512bf16), else the converting templates. The drivers call it once per call, and
    // plan_attention (attnfast.explain) calls the same function, so the two cannot disagree.
    PrefillKernel (*prefill_kernel)(const AttentionParams&);
    // float64 prefill (the template prefill; template_prefill_plan).
    void (*attend_block_f64)(const AttentionParams&, const BlockTask&, double* workspace);
    // The decode chunk kernel for a call accumulating in float32, chosen as prefill_kernel.
    DecodeKernel (*decode_kernel)(const AttentionParams&);
    void (*decode_chunk_f64)(const AttentionParams&, const DecodeTask&, double* workspace,
                             double* acc, double* m, double* l);
    // Decode, step 2: merge the `chunks` partial results of a (batch, kv head), laid out one
    // after the other as written by step 1, in chunk order; applies sinks; writes its out
    // and lse rows.
    void (*decode_merge)(const AttentionParams&, int64_t batch, int64_t kv_head,
                         int64_t chunks, const float* acc, const float* m,
                         const float* l, float* workspace);
    void (*decode_merge_f64)(const AttentionParams&, int64_t batch, int64_t kv_head,
                             int64_t chunks, const double* acc, const double* m,
                             const double* l, double* workspace);
    // The benchmarks' probes (probes.inl): the read kernel, XOR of the whole 8-byte words of
    // data[0, bytes) with this tier's loads; the compute peak, `rounds` rounds of its widest
    // multiply-adds (bf16: vdpbf16ps where the tier has it), returning the FLOPs done.
    uint64_t (*read_fold)(const void* data, int64_t bytes);
    double (*peak_spin)(int64_t rounds, bool bf16, float* sink);
    // The compute-shaped decode kernel for many query rows per KV head (gemm_decode.inl: a
    // latent cache, or GQA with several query tokens), or {nullptr} when it does not take
    // the call (or the tier has none): decode.cpp then runs decode_kernel's choice.
    DecodeKernel (*gemm_decode_kernel)(const AttentionParams&);
    // The tier's attention_backward kernels (backward.inl), compiled with its flags.
    const BackwardKernels* (*backward_kernels)();
    // The policy of the decode or prefill kernel `id` as this tier runs it for a call that
    // the kernel takes (export_table.inl: from the constants the kernels run by).
    KernelPolicy (*kernel_policy)(KernelId id, const AttentionParams&);
    // The indexer's scores (index_scores.inl) of query row `row` of batch entry `batch` for
    // keys [s0, s1): scores[s - s0]; workspace: index_workspace_floats(p) floats.
    void (*index_scores)(const IndexParams&, int64_t batch, int64_t row, int64_t s0, int64_t s1,
                         float* scores, float* workspace);
};
// Keys index_scores scores at a time (each row converted to float32 once for every head).
constexpr int64_t kIndexKeyBlock = 4;
// Heads padded to whole vectors of the widest tier (16 floats).
static inline int64_t index_padded_heads(const IndexParams& p) { return (p.heads + 15) / 16 * 16; }
// Scratch floats index_scores needs: the row's queries transposed (head_dim x padded heads),
// its weights, and one key block's rows in float32.
static inline int64_t index_workspace_floats(const IndexParams& p) {
    return p.head_dim * index_padded_heads(p) + index_padded_heads(p) + kIndexKeyBlock * p.head_dim + 16;
}

// One per ISA file; each returns nullptr when that tier was not compiled in.
const KernelTable* kernel_table_generic();
const KernelTable* kernel_table_avx2();
const KernelTable* kernel_table_avx512();
const KernelTable* kernel_table_avx512bf16();
const KernelTable* kernel_table_neon();

// The table in use (chosen once; see dispatch.cpp).
const KernelTable& active_kernels();
// The best tier this CPU runs, whatever ATTNFAST_ISA or isa_force chose: a machine limit
// (read_probe) must not depend on the tier under test.
const KernelTable& best_kernels();

// Key position of query row `row`, i' (see AttentionParams::has_query_offset).
static inline int64_t aligned_row(const AttentionParams& p, int64_t row, int64_t seqlen_k) {
    return row + (p.has_query_offset ? p.query_offset : seqlen_k - p.seqlen_q);
}

// Keys valid for batch entry `batch`: seqlens_k[batch], or seqlen_k when that is null.
static inline int64_t batch_seqlen_k(const AttentionParams& p, int64_t batch) {
    return p.seqlens_k ? p.seqlens_k[batch] : p.seqlen_k;
}

// Visible key range [begin, end) of query row `row`, from causal and window, for a batch
// entry with `seqlen_k` valid keys (see batch_seqlen_k).
// Row i is aligned to key i + (Tk - Tq) (bottom-right, as flash-attn >= 2.1), or to
// i + query_offset when the caller gives one.
struct KeyRange {
    int64_t begin;
    int64_t end;
};
// Window bounds may be as large as INT64_MAX (any bound >= Tq + Tk means unbounded): each
// one is compared with a distance between positions before it is added, never overflowing.
static inline KeyRange visible_keys(const AttentionParams& p, int64_t row, int64_t seqlen_k) {
    const int64_t aligned = aligned_row(p, row, seqlen_k);
    int64_t begin = 0;
    int64_t end = seqlen_k;
    if (p.causal && aligned + 1 < end) end = aligned + 1;
    if (p.window_right >= 0 && p.window_right < end - aligned - 1) end = aligned + p.window_right + 1;
    if (p.window_left >= 0 && p.window_left < aligned - begin) begin = aligned - p.window_left;
    if (begin > seqlen_k) begin = seqlen_k;  // (a query_offset past the keys)
    if (end < begin) end = begin;
    if (end < 0) end = begin = 0;
    return {begin, end};
}


// ---- views of a call: the same arrays, a part of the problem ----

static inline int64_t dtype_bytes(DType t) { return stride_unit_bytes(t); }
static inline const void* at_bytes(const void* base, int64_t elements, int64_t elem_bytes) {
    return base ? static_cast<const char*>(base) + elements * elem_bytes : nullptr;
}
static inline void* at_bytes(void* base, int64_t elements, int64_t elem_bytes) {
    return base ? static_cast<char*>(base) + elements * elem_bytes : nullptr;
}

// The query side of s (q, out, lse, mask) moved `steps` elements along one axis, whose
// strides in p are the *_step arguments: a block of rows, or a batch entry.
static inline void move_query_side(AttentionParams& s, const AttentionParams& p, int64_t steps,
                                   int64_t q_step, int64_t out_step, int64_t lse_step,
                                   int64_t mask_step) {
    const int64_t qb = dtype_bytes(p.dtype);
    s.q = at_bytes(p.q, steps * q_step, qb);
    s.out = at_bytes(p.out, steps * out_step, qb);
    s.lse = at_bytes(p.lse, steps * lse_step, p.dtype == DType::kF64 ? 8 : 4);
    if (p.mask) {
        const int64_t mb = p.mask_kind == MaskKind::kBool ? 1 : dtype_bytes(p.mask_dtype);
        s.mask = at_bytes(p.mask, steps * mask_step, mb);
    }
}

// p restricted to query rows [r0, r0 + n): q, out, lse and mask rows moved, seqlen_q = n,
// and the rows keep their key positions through an explicit query offset.
static inline AttentionParams query_rows(const AttentionParams& p, int64_t r0, int64_t n,
                                         int64_t offset) {
    AttentionParams s = p;
    move_query_side(s, p, r0, p.q_row_stride, p.out_row_stride, p.lse_row_stride, p.mask_row_stride);
    s.seqlen_q = n;
    s.has_query_offset = true;
    s.query_offset = offset + r0;
    if (p.key_index) s.key_index = p.key_index + r0 * p.key_index_row_stride;
    return s;
}

// p restricted to batch entry b (batch = 1).
static inline AttentionParams batch_entry(const AttentionParams& p, int64_t b) {
    AttentionParams s = p;
    const int64_t kvb = dtype_bytes(p.kv_dtype);
    s.batch = 1;
    move_query_side(s, p, b, p.q_batch_stride, p.out_batch_stride, p.lse_batch_stride,
                    p.mask_batch_stride);
    if (p.alibi_slopes) s.alibi_slopes = p.alibi_slopes + b * p.alibi_batch_stride;
    if (p.seqlens_k) s.seqlens_k = p.seqlens_k + b;
    if (p.key_index) s.key_index = p.key_index + b * p.key_index_batch_stride;
    if (p.block_table) {
        s.block_table = p.block_table + b * p.block_table_batch_stride;
    } else {  // contiguous: the entry's rows (a pool's blocks stay where they are)
        s.k = at_bytes(p.k, b * p.k_batch_stride, kvb);
        s.v = at_bytes(p.v, b * p.v_batch_stride, kvb);
        if (p.k_scale) s.k_scale = p.k_scale + b * p.k_scale_batch_stride;
        if (p.v_scale) s.v_scale = p.v_scale + b * p.v_scale_batch_stride;
    }
    return s;
}

// p restricted to query head `head` (heads = kv_heads = 1): that head's q, out, lse and
// mask, ALiBi slopes and sink, and its KV head's K, V and row scales.
static inline AttentionParams one_head(const AttentionParams& p, int64_t head) {
    AttentionParams s = p;
    const int64_t kv_head = head / (p.heads / p.kv_heads), kvb = dtype_bytes(p.kv_dtype);
    s.heads = s.kv_heads = 1;
    move_query_side(s, p, head, p.q_head_stride, p.out_head_stride, p.lse_head_stride,
                    p.mask_head_stride);
    if (p.alibi_slopes) s.alibi_slopes = p.alibi_slopes + head;
    if (p.sinks) s.sinks = p.sinks + head;
    if (p.key_index) s.key_index = p.key_index + kv_head * p.key_index_head_stride;
    s.k = at_bytes(p.k, kv_head * p.k_head_stride, kvb);
    s.v = at_bytes(p.v, kv_head * p.v_head_stride, kvb);
    if (p.k_scale) s.k_scale = p.k_scale + kv_head * p.k_scale_head_stride;
    if (p.v_scale) s.v_scale = p.v_scale + kv_head * p.v_scale_head_stride;
    return s;
}

// p restricted to the n query heads [head, head + n) of one KV head's group (heads = n,
// kv_heads = 1): one_head's view, for several heads.
static inline AttentionParams head_group(const AttentionParams& p, int64_t head, int64_t n) {
    AttentionParams s = one_head(p, head);
    s.heads = n;
    return s;
}

}  // namespace attnfast
