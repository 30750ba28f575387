// attnfast C++ core: the entry points and the plain structs that cross from Cython.
// Knows nothing of Python. All strides are in elements (not bytes) and may be negative.
#pragma once
#include <cstdint>

namespace attnfast {

// Element types. Arithmetic accumulates in float32 (float64 for kF64), never in 16 bits.
// kI8, kF8E4M3, kF8E5M2 and kQ4 are KV-cache storage types only: symmetric int8 / float8
// e4m3fn / float8 e5m2 values, each row with one float32 scale (k_scale / v_scale); or kQ4,
// 4-bit values in blocks of 32 that carry their own bfloat16 scale and minimum (value =
// scale * n + minimum; a row of D values is ceil(D / 32) blocks of 20 bytes, strides counted
// in bytes; see simd/storage.hpp for the byte order). storage_format() describes each one.
enum class DType : int32_t {
    kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3, kI8 = 4, kF8E4M3 = 5, kQ4 = 6, kF8E5M2 = 7
};

// What the drivers and checks need to know of a storage type (the kernels' code for it is
// simd/storage.hpp's). Rows are blocks of block_values values in block_bytes bytes.
struct StorageFormat {
    int64_t block_values;  // 1, or int4's 32 (then strides count bytes, not values)
    int64_t block_bytes;   // bytes of one block (one value when block_values is 1)
    bool row_scaled;       // one float32 scale per row (k_scale / v_scale)
    bool cache_only;       // a KV-cache storage type only, never q's (quantised on write)
    bool decode_only;      // only the decode loop reads it (no prefill kernel)
};
// The one switch over storage types outside the kernels (the build has -Werror=switch: a
// new DType does not compile until it is described here).
constexpr StorageFormat storage_format(DType t) {
    switch (t) {
        case DType::kF32: return {1, 4, false, false, false};
        case DType::kF64: return {1, 8, false, false, false};
        case DType::kF16: case DType::kBF16: return {1, 2, false, false, false};
        case DType::kI8: return {1, 1, true, true, false};
        case DType::kF8E4M3: case DType::kF8E5M2: return {1, 1, true, true, true};
        case DType::kQ4: return {32, 20, false, true, true};
    }
    return {1, 0, false, false, false};  // (not a DType)
}
// Bytes of a stored row of n values (a row-scaled row's scale not included).
constexpr int64_t stored_row_bytes(DType t, int64_t n) {
    return (n + storage_format(t).block_values - 1) / storage_format(t).block_values *
           storage_format(t).block_bytes;
}
// Bytes one unit of a stride steps in storage of type t: a value, or a byte of packed blocks.
constexpr int64_t stride_unit_bytes(DType t) {
    return storage_format(t).block_values == 1 ? storage_format(t).block_bytes : 1;
}

// How `mask` is read: bool (one byte, nonzero = keep) or added to the scores.
enum class MaskKind : int32_t { kNone = 0, kBool = 1, kAdditive = 2 };

// One attention problem: out = softmax(q k^T * scale (+ options)) v, per (batch, head).
// Layout is SDPA's (B, H, T, D); the last axis of every tensor is contiguous.
struct AttentionParams {
    const void* q;   // (batch, heads, seqlen_q, head_dim), of `dtype`
    const void* k;   // (batch, kv_heads, seqlen_k, head_dim), of `kv_dtype`
    const void* v;   // (batch, kv_heads, seqlen_k, head_dim_v), of `kv_dtype`
    void* out;       // (batch, heads, seqlen_q, head_dim_v), of `dtype`
    void* lse;       // (batch, heads, seqlen_q) log-sum-exp of the scaled scores, or nullptr;
                     // float32, or float64 when dtype is kF64

    int64_t q_batch_stride, q_head_stride, q_row_stride;
    int64_t k_batch_stride, k_head_stride, k_row_stride;
    int64_t v_batch_stride, v_head_stride, v_row_stride;
    int64_t out_batch_stride, out_head_stride, out_row_stride;
    int64_t lse_batch_stride, lse_head_stride, lse_row_stride;

    int64_t batch;       // B
    int64_t heads;       // H, query heads
    int64_t kv_heads;    // Hkv; heads % kv_heads == 0, query head h reads kv head h / (H / Hkv)
    int64_t seqlen_q;    // Tq
    int64_t seqlen_k;    // Tk: keys k and v hold per (batch, kv head) (a cache's capacity)
    // Keys valid per batch entry, or nullptr = all seqlen_k. With it, batch entry b attends
    // over keys [0, seqlens_k[b]) (0 <= seqlens_k[b] <= seqlen_k) and causal/window align
    // to that length: row i is at key i + (seqlens_k[b] - Tq). (flash-attn's cache_seqlens)
    const int64_t* seqlens_k;
    int64_t head_dim;    // D, of q and k
    int64_t head_dim_v;  // Dv, of v and out

    DType dtype;         // of q and out
    DType kv_dtype;      // of k and v: dtype, or (float32 q) kF16 / kBF16, or (float32 / kF16 /
                         // kBF16 q) a cache-only type (storage_format)
    // A row-scaled kv_dtype only (storage_format): float32 dequantisation scales (batch,
    // kv_heads, seqlen_k), one per cached row: k[b, g, j, :] stands for k_scale[b, g, j] *
    // (its stored values).
    const float* k_scale;
    const float* v_scale;
    int64_t k_scale_batch_stride, k_scale_head_stride, k_scale_row_stride;
    int64_t v_scale_batch_stride, v_scale_head_stride, v_scale_row_stride;
    // Paged KV cache (vLLM's paged attention, flash-attn's block_table), or nullptr =
    // contiguous. With it, k / v (and k_scale / v_scale) are pools of `num_blocks` blocks of
    // `block_size` rows: their "batch" stride is then the stride between blocks, and key j of
    // batch entry b is row j % block_size of block block_table[b * block_table_batch_stride +
    // j / block_size]. seqlen_k is then max_blocks * block_size (the logical capacity; a
    // mask's last axis spans it) and only the blocks holding keys [0, seqlens_k[b]) are read.
    // Results are bit-identical to a contiguous cache holding the same keys.
    const int64_t* block_table;        // (batch, max_blocks) block ids in [0, num_blocks)
    int64_t block_table_batch_stride;  // elements between batch entries' rows of the table
    int64_t block_size;                // rows per block, >= 1 (paged only)
    int64_t num_blocks;                // blocks in each pool (paged only; ids are checked)
    double scale;        // multiplies q . k
    bool causal;         // row i sees key j iff j <= i' (i' below)
    // Where query row i sits among the keys, i': by default i + (Tk - Tq), bottom-right
    // aligned (Tk: seqlens_k[b] when given); with has_query_offset, i + query_offset for
    // every batch entry (e.g. 0: top-left, a prompt written into an empty static cache).
    // causal, window and ALiBi distances are measured from i'. |query_offset| <= 2^62.
    bool has_query_offset;
    int64_t query_offset;
    int64_t window_left;   // row i sees keys j >= i' - window_left; -1 = unbounded
    int64_t window_right;  // row i sees keys j <= i' + window_right; -1 = unbounded
                           // (any value up to INT64_MAX is safe: no overflow)

    // Score options, applied in this order to each scaled score s = scale * q_i . k_j
    // (flash-attn's order), then causal / window:
    double softcap;                 // 0 = off; else s -> softcap * tanh(s / softcap)
    const float* alibi_slopes;      // nullptr = off; s -= slope[b, h] * |i' - j|; slopes of
                                    // (batch, heads) at alibi_batch_stride, heads contiguous
    int64_t alibi_batch_stride;     // 0 when slopes are per head only
    const void* mask;               // nullptr = off; element (b, h, i, j) at the strides below
                                    // (0 for a broadcast axis); j spans seqlen_k
    MaskKind mask_kind;             // kBool: 0 drops the key; kAdditive: s += mask
    DType mask_dtype;               // kAdditive: kF32 or kF64 (bool masks are one byte)
    int64_t mask_batch_stride, mask_head_stride, mask_row_stride, mask_col_stride;  // elements
    const float* sinks;             // nullptr = off; (heads,) one logit per query head that
                                    // joins the softmax denominator (adds no value); lse
                                    // includes it, and a row seeing no key gets lse = sink

    // Selected keys (sparse attention: DeepSeek's DSA top-k), or nullptr = every key. With
    // it, query row i of batch entry b, kv head g, sees only the key positions
    // key_index[b * key_index_batch_stride + g * key_index_head_stride + i * key_index_row_stride
    // + 0 .. key_index_count) (head stride 0: one list for every head), of which -1 means none
    // and the others are distinct and < the entry's key count; a listed key that causal or
    // window hides stays hidden. Neither ALiBi nor a mask (they need each key's position in
    // the kernels). Runs on the decode path, one query row per problem; the listed rows are
    // gathered chunk by chunk and only they are read.
    const int32_t* key_index;
    int64_t key_index_batch_stride, key_index_head_stride, key_index_row_stride;
    int64_t key_index_count;        // k, entries per row (>= 0)

    int num_threads;     // >= 1 (more than the processors are not started); the result
                         // does not depend on it
    bool interruptible;  // stop early (out/lse then unspecified) after request_interrupt()
};

// Returns a params struct with every option off and every pointer null.
AttentionParams default_params();

// Streaming (FlashAttention-style) attention. Never allocates in proportion to Tq * Tk.
// Queries of up to kDecodeMaxQueryRows rows (kernels/kernel_table.hpp), and up to
// kGemmDecodeMaxQueryRows over long caches where a decode kernel beats prefill, take the
// decode path (decode.cpp: GQA-grouped, split-KV); longer ones the prefill tiling, but
// over a float8 or int4 cache (decode_only_format: no prefill kernel reads them) the decode
// loop in blocks of kQuantizedRowBlock query rows, each with its own causal offset.
// Throws std::invalid_argument for a params struct the kernels cannot run
// (the Python layer checks first, so this is a guard, not the user-facing check).
void attention_forward(const AttentionParams& params);

// Several independent problems in one call (the sequences of a ragged serving step, say:
// decode rows and prompt chunks over one paged pool, each its own params): one schedule
// over the tasks of them all, prefill tasks first, then the decode chunks, balanced over
// params[0].num_threads threads (params[0].interruptible applies to all). Each problem's
// out and lse are bit-identical to attention_forward(params[i]). Checks every problem
// before computing any (throws std::invalid_argument).
void attention_forward_batch(const AttentionParams* params, int64_t count);

// What attention_forward would do for a params struct, computing nothing (attnfast.explain).
struct CallPlan {
    const char* tier;     // the kernel tier in use (isa_selected())
    bool decode;          // the decode path (runs_on_decode_path), else prefill
    // The micro-kernel: "simd_prefill", "bf16_prefill", "simd_decode", "bf16_decode",
    // "gemm_decode", "latent_decode" (the hand-written ones), "template_prefill",
    // "template_decode", or "template_f64" (float64): the templates' names start "template".
    const char* kernel;
    bool paged;           // reads a paged KV cache (block_table)
    bool indexed;         // reads the keys key_index selects
    int64_t chunk_keys;   // decode: keys per chunk of the split-KV (0 for prefill)
    int64_t chunks;       // decode: most chunks any (batch entry, kv head) is split into
    int64_t head_groups;  // decode: most groups any kv head's query heads are split into
    int64_t tasks;        // work items the threads share: query blocks, or decode chunks
    int threads;          // threads the call runs on while no other call runs (0: no work)
    // Decode: V is a prefix view of K (an MLA latent cache: kv_is_latent); the query rows
    // one read of a KV row serves ((H / Hkv) * Tq); and the regime the kernel is shaped
    // for, "bandwidth" or "compute" (nullptr for prefill: its query blocks are compute-shaped).
    bool latent_kv;
    int64_t rows_per_kv_read;
    const char* regime;
    // The kernel's micro-kernel policy (KernelTable::kernel_policy): the register block of
    // its Q.K product, query rows (MR) x keys (NR), and how each product multiplies: Q.K
    // and P.V, each "fp32 fma", "fp32 mul+add", "vdpbf16ps", "vpdpbusd" or "fp64".
    int64_t policy_rows;
    int64_t policy_keys;
    const char* policy_qk;
    const char* policy_pv;
};
// Checks `params` as attention_forward does (throws std::invalid_argument) and returns what
// it would run, from the same code: the drivers' own kernel choice and work split.
CallPlan plan_attention(const AttentionParams& params);

// Whether only the decode loop reads this KV storage type (every query length then runs
// through it; see attention_forward).
inline bool decode_only_format(DType kv) { return storage_format(kv).decode_only; }


// ---- the lightning indexer of DeepSeek's sparse attention (DSA) ----
// For query row t of batch entry b and each key s it sees (s < seqlens_k[b]; with causal,
// s <= seqlens_k[b] - seqlen_q + t), the score
//   I[t, s] = k_scale[s] * sum_h weights[t, h] * relu(q[h, t] . k[s])
// (float32 arithmetic), and the `topk` best keys: out_index[b, t, :] their positions by
// descending score, ties to the lower position (a NaN score ranks as -inf), -1 past the keys
// the row sees. No Tq x L array: each row's keys are scored a chunk at a time and a running
// selection keeps the best. The result does not depend on the thread count.
struct IndexParams {
    const void* q;                     // (batch, heads, seqlen_q, head_dim) of q_dtype: kF32, or
    DType q_dtype;                     // kBF16 (exact products by vdpbf16ps where the tier has it
                                       // and the keys are bfloat16 or float8, else widened)
    int64_t q_batch_stride, q_head_stride, q_row_stride;
    const float* weights;              // (batch, seqlen_q, heads), heads contiguous
    int64_t w_batch_stride, w_row_stride;
    const void* k;                     // (batch, seqlen_k, head_dim) of k_dtype (kF32, kBF16 or
                                       // kF8E4M3), or a pool (num_blocks, block_size, head_dim)
    DType k_dtype;
    int64_t k_batch_stride, k_row_stride;  // (paged: the stride between blocks, then rows)
    const float* k_scale;              // (batch, seqlen_k) or (num_blocks, block_size); nullptr = 1
    int64_t k_scale_batch_stride, k_scale_row_stride;
    const int64_t* block_table;        // (batch, max_blocks) or nullptr (as AttentionParams)
    int64_t block_table_batch_stride, block_size, num_blocks;
    const int64_t* seqlens_k;          // (batch,) keys per entry, or nullptr = seqlen_k
    int64_t batch, heads, seqlen_q, seqlen_k, head_dim;
    bool causal;                       // bottom-right aligned, as AttentionParams::causal
    int64_t topk;                      // >= 1
    int32_t* out_index;                // (batch, seqlen_q, topk), contiguous
    float* out_scores;                 // the same shape, or nullptr; -inf where out_index is -1
    int num_threads;
    bool interruptible;
};
// Throws std::invalid_argument for params it cannot run.
void index_topk(const IndexParams& params);

// ---- interrupts (Ctrl-C) ----
// Asks running interruptible calls to stop: they skip the work items not yet started and
// return with out/lse unspecified. Lock-free: may be called from a signal handler.
void request_interrupt() noexcept;
// Whether an interrupt was requested since the last call; clears the request.
bool take_interrupt() noexcept;

// ---- benchmarks ----
// Reads `bytes` bytes at `data` once on up to num_threads threads (a native read kernel for the
// benchmarks' memory-bandwidth limit, with the loads of the best tier this CPU runs, whatever
// tier is forced); returns the XOR of its whole 8-byte words.
uint64_t read_probe(const void* data, int64_t bytes, int num_threads);
// Runs `rounds` rounds of the best tier's widest multiply-adds (bf16: vdpbf16ps where the CPU
// has AVX512_BF16, else float32 FMAs) on num_threads threads at once (the benchmarks' compute
// limit); returns the FLOPs done.
double peak_probe(int64_t rounds, bool bf16, int num_threads);

// x (rows x dim float32, contiguous) times the orthonormal block Hadamard matrix of blocks
// `block` (a power of two dividing dim) along each row, in place: the quantised caches' key
// rotation (attnfast._rotation), by the fast Walsh-Hadamard transform on this thread.
void hadamard_rows(float* x, int64_t rows, int64_t dim, int64_t block);

// ---- runtime facts ----
int processor_count() noexcept;  // processors this process may run on (1 without OpenMP)
bool openmp_enabled();
int openmp_max_threads();        // omp_get_max_threads(), or 1 without OpenMP
const char* openmp_runtime_name();

// Kernel tiers (ISA). The best one the CPU runs is picked on first use; the environment
// variable ATTNFAST_ISA=generic|avx2|avx512|neon forces one.
const char* isa_selected();        // name of the tier in use
const char* isa_available();       // comma-separated names of tiers this CPU can run
const char* isa_compiled();        // comma-separated names of tiers built into this library
// Forces a tier by name ("" = back to auto). Returns false (and changes nothing) when the
// name is unknown or the CPU cannot run it; see isa_error() for why.
bool isa_force(const char* name);
const char* isa_error();
// What the active tier's 16-bit and int8 paths run on (instructions), in words.
const char* isa_lowp_instructions();
// How an int8 cache's Q.K runs where the tier has vpdpbusd (vnni_decode.inl): true, the
// exact widening to float32 instead of q quantised to int8 per row. Set from
// ATTNFAST_INT8_DOT=widen on first use (read once, as ATTNFAST_ISA); int8_dot_widen_force
// changes it for the calls that start after it.
bool int8_dot_widen();
void int8_dot_widen_force(bool widen);

}  // namespace attnfast
