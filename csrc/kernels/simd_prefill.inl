// Hand-written float32 prefill kernel for the SIMD tiers: on x86 AVX-512, AVX2+FMA, and SSE2
// (the generic tier on x86-64: 4 lanes, 16 xmm registers, no FMA); on AArch64 Advanced SIMD
// (the neon tier: 4 lanes, 32 vector registers, FMA). Written on the SIMD layer (csrc/simd/:
// Vec, vfma, exp2_neg, ...); one branch per ISA of the micro-tile shape and of the few
// ISA-specific helpers left here (widening / narrowing, transposes, mask tiles); everything
// else is shared.
// Included by kernels/isa_avx512.cpp, isa_avx2.cpp, (x86-64 only) isa_generic.cpp and
// isa_neon.cpp after attention_core.inl, inside their ATTNFAST_KERNEL_NS; the intrinsics
// below compile only under those files' flags (the generic tier's: the x86-64 baseline, SSE2
// and nothing newer; neon's: the AArch64 baseline, which includes Advanced SIMD).
// float64, and the generic tier on other architectures, run the template prefill (the decode
// loop over blocks of query rows, decode_attention.inl).
//
// Layout: query rows live in vector lanes. One block holds Bq = kQueryVecs * W query rows:
//   qt  (D  x Bq)  Qᵀ, pre-multiplied by scale * log2(e) (so the softmax runs in base 2)
//   st  (Bk x Bq)  Sᵀ of the current KV tile, overwritten in place by Pᵀ
//   ot  (Dv x Bq)  Oᵀ, the unnormalised output accumulator
// With queries in lanes the row max, the row sum and the rescaling of the output are plain
// element-wise vector operations, never horizontal reductions. K and V are read straight
// from the caller's arrays (any row stride) as broadcast scalars, so nothing is packed
// per tile and any D, Dv works without padding:
//   S micro-kernel:  kRows keys x kQueryVecs query vectors of accumulators, looping over d:
//                    acc[t][v] += k[key t][d] * qt[d][v-th vector]
//                    (NEON: four d per 4-float K load, through vfmaq_laneq_f32)
//   PV micro-kernel: kRows output columns x kQueryVecs query vectors, looping over keys j:
//                    acc[t][v] += v[j][col t] * pt[j][v-th vector]
// (A sub-block of at most W rows computes one query vector, over wider micro-tiles:
// tile_rows, attend_tile.) The same loop runs the GEMM-shaped decode's chunks
// (gemm_decode.inl), whose sub-blocks mix the heads and positions of one KV head.
// Rounding and summation order depend only on the tile sizes (functions of D, Dv and the
// cache sizes), never on the thread count.
//
// No std:: templates here (see attention_core.inl).
#pragma once

// GCC 12 warns about the deliberately undefined pass-through operand inside
// _mm512_max_ps (_mm512_undefined_ps); a false positive.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include "../simd/simd.hpp"
#include "attention_core.inl"

namespace attnfast {
namespace ATTNFAST_KERNEL_NS {
namespace {
namespace simd {

// ---------------------------------------------------------------- micro-tile shape
// The vector layer (Vec, W, vload, vfma, exp2_neg, ...) is csrc/simd/; per ISA, the query
// vectors per block (Bq = kQueryVecs * W rows) and the keys or output columns per
// micro-tile (kRows):
#if defined(__aarch64__)
// 20 accumulators of 32 registers. S: + the kRows K vectors of four d (vfmaq_laneq_f32 takes
// each key value from a lane: no broadcast) + the Q vectors in flight; PV: + kQueryVecs P
// vectors + one ld1r broadcast of a V value. Not timed (no arm64 hardware here): chosen by
// register count and checked for spills in the cross build (GCC 12, aarch64-linux-gnu-objdump
// of isa_neon.cpp.o, loop bodies): 4 x 5 keeps PV free of spills and has one 16-byte spill
// store + reload per 80 FMLAs in the S loop (its options variant: 5 stack accesses); 4 x 4
// spills nothing but leaves 16 accumulators, at the limit of what a core with 4 FMA pipes of
// latency 4 needs in flight, and makes PV re-read Pᵀ once more per 20 output columns; 4 x 6,
// 5 x 4 spill 12-24 vectors per S iteration (6 x 4 did in the old NEON kernel too). With 4
// query vectors each K / V value loaded feeds 4 FMAs, as on the other tiers.
#ifndef ATTNFAST_NEON_QUERY_VECS  // (overridable only to inspect other shapes)
#define ATTNFAST_NEON_QUERY_VECS 4
#define ATTNFAST_NEON_ROWS 5
#endif
constexpr int kQueryVecs = ATTNFAST_NEON_QUERY_VECS;  // Bq = 16 rows
constexpr int kRows = ATTNFAST_NEON_ROWS;
#elif defined(__AVX512F__)
constexpr int kQueryVecs = 2;   // query vectors per block: Bq = 32 rows
constexpr int kRows = 12;       // keys (S) or output columns (PV) per micro-tile: 24 accumulators
#elif defined(__AVX2__)
// 12 accumulators + 4 query vectors = 16 ymm registers (the key / V value is broadcast
// from memory as an FMA operand). Measured on a Sapphire Rapids core held to AVX2 against
// the AVX-512 tier's shape 2 x 6 (Bq = 16): +10-50% (per-round medians, noisy shared
// machine); 3 x 4 (Bq = 24) in between. Each K/V value loaded from L1 now feeds 4 vector
// FMAs instead of 2. On AMD Zen 3 (2 loads per cycle, so the 4 query vectors re-read as
// FMA operands for every key looked load-bound) 2 x 6 and 3 x 4 were tried against it
// (H = 8, D = 64 / 128, T = 1k / 4k, full and causal, 1 thread, 4-5 interleaved rounds):
// best times within 2 % of each other, rounds spread +-15 % by a noisy host; 4 x 3 stays.
#ifndef ATTNFAST_AVX2_QUERY_VECS  // (overridable only to measure other shapes)
#define ATTNFAST_AVX2_QUERY_VECS 4
#define ATTNFAST_AVX2_ROWS 3
#endif
constexpr int kQueryVecs = ATTNFAST_AVX2_QUERY_VECS;  // Bq = 32 rows
constexpr int kRows = ATTNFAST_AVX2_ROWS;
#else  // SSE2
// 12 accumulators; without FMA each product needs a temporary (two-operand SSE), and the
// broadcast K / V value a register, so of the 4 query vectors GCC keeps 2 in registers and
// reads 2 as memory operands (loads are not the limit: the FP pipes are, with one shuffle
// per broadcast beside each 4 multiplies and 4 adds). Measured on Zen 4 (AMD EPYC, this tier
// forced, T = 4096, H = 8, D = 64 / 128, full and causal, 1 thread, best of 5-9 runs each on
// a shared machine; GFLOP/s): 4x3 32.0-35.4, 6x2 31.6-34.3, 8x1 31.1-32.6, 3x3 30.4-32.1,
// 5x2 29.3-32.2, 4x2 29.4-30.6, 2x6 29.1-31.2, 3x4 24.7-26.4, 6x1 22.3-26.5 (kQueryVecs x
// kRows; above 4 query vectors the `#pragma GCC unroll 4` of the micro-kernels was raised).
#ifndef ATTNFAST_SSE2_QUERY_VECS  // (overridable only to measure other shapes)
#define ATTNFAST_SSE2_QUERY_VECS 4
#define ATTNFAST_SSE2_ROWS 3
#endif
constexpr int kQueryVecs = ATTNFAST_SSE2_QUERY_VECS;  // Bq = 16 rows
constexpr int kRows = ATTNFAST_SSE2_ROWS;
#endif

constexpr int64_t Bq = kQueryVecs * W;

// ---------------------------------------------------------------- block state
// The score options of a task (AttentionParams order), in the kernel's base-2 units: the
// score x = s log2(e) of a scaled score s becomes cap tanh(x / cap) (cap = softcap log2 e),
// then x - slope |i' - j| (slope = ALiBi slope log2 e), then the mask's.
struct ScoreOptions {
    bool softcap = false;
    float cap = 0, inv_cap = 0;
    bool alibi = false;
    float slope = 0;
    bool mask = false;
};
// What one tile applies: the task's options, and the mask as its tile came out.
enum class TileMask : int { kNone, kDrop, kAdd };  // kDrop: 0 / -inf entries; kAdd: added
struct TileOptions {
    bool softcap, alibi;
    TileMask mask;
    bool any() const { return softcap || alibi || mask != TileMask::kNone; }
};

// One sub-block: Bq query rows (lanes) that read one KV head, with its own online-softmax
// state: rows of one head (prefill), or of the heads of a GQA group and their query positions
// (a decode chunk: gemm_decode.inl). The scratch shared by the sub-blocks of a task (Sᵀ,
// masks) is reached from here too.
struct Block {
    int64_t D, Dv, Bk;
    float* qt;            // D x Bq
    float* ot;            // Dv x Bq
    float* m;             // Bq: running max (base-2 scaled scores)
    float* l;             // Bq: running sum
    KeyRange* lanes;      // Bq: each lane's visible keys (padding lanes: the last row's)
    float* st;            // Bk x Bq, shared
    int32_t* rel_begin;   // Bq, shared: visible keys of each lane relative to the tile start
    int32_t* rel_end;
    float* alibi_pos = nullptr;  // Bq, shared: i' - tile start of each lane (ALiBi)
    float* mt = nullptr;         // Bk (rounded up to 8) x Bq, shared: the mask of the tile, transposed
    const float* k;       // key row kv_first of this (batch, kv head): the caller's array, or
    const float* v;       // the task's float32 copy of the current super-tile (bf16_prefill.inl:
                          // the caller's bfloat16 rows, cast; strides count elements)
    int64_t k_stride, v_stride;
    int64_t kv_first = 0;  // key index of row 0 of k and v
    bool v_in_k = false;   // V rows are K rows' prefixes (an MLA latent cache read in place)
    // Rows read in place by address (a paged pool, or an indexed decode task's listed rows;
    // not widened into a copy): the K and V sources (attention_core.inl's TaskRows, strides
    // in bytes), and the current tile's row addresses, key tile + j at k_rows[j] / v_rows[j]
    // (filled once per tile by find_tile_rows: a block table is read once per block, never
    // once per key, and the micro-kernels read each row where it lies). k_rows nullptr: the
    // rows are one strided run from k / v, at k_stride / v_stride (and v_stride also steps
    // inside a run).
    TaskRows<char> k_src{}, v_src{};
    int64_t run_keys = 1;  // keys of every run after a tile's first: the block size, or 1 (listed rows)
    const float** k_rows = nullptr;
    const float** v_rows = nullptr;
    mutable int64_t first_run = 0;  // keys of the tile's first run
    // One tile per super-tile (rows by address, see tiling()): the sub-blocks of a task share
    // the prefetch of the next tile; this one's share starts pf_skip keys into it.
    mutable int64_t pf_skip = 0;
    // Listed rows gathered per tile (Tiling::gathered): k / v point into the copy, read as
    // one strided run; the next tile's rows are prefetched through k_src / v_src.
    bool gathered = false;

    // End of the run of V rows starting at tile-relative key j0 (a run start), at most keys.
    int64_t run_end(int64_t j0, int64_t keys) const {
        const int64_t end = j0 == 0 ? first_run : j0 + run_keys;
        return end < keys ? end : keys;
    }
    // Lanes [0, rows) are rows row_begin.. of the task: a head's query rows (prefill, which
    // also sets head), or a KV head's rows (query head in the group) x Tq + position (decode).
    int64_t head, row_begin, rows;
    int64_t seqlen_k;      // keys valid for this batch entry (batch_seqlen_k)
    KeyRange first, last;  // the lanes' smallest begin and end (first), largest (last)
    ScoreOptions opt;
};

inline int64_t round_down(int64_t x, int64_t to) { return x / to * to; }
inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }
inline int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

// The empty online-softmax state of sub-block b (Qᵀ is the kernel's to stage) and its lanes'
// visible keys: lane i < b.rows is the query row at position pos[i], its keys clipped to
// [lo, hi) (a decode task's chunk).
inline void start_state(const AttentionParams& p, Block& b, const int64_t* pos, int64_t lo, int64_t hi) {
    for (int64_t i = 0; i < Bq; ++i) {
        b.m[i] = -__builtin_inff();
        b.l[i] = 0.0f;
    }
    for (int64_t x = 0; x < b.Dv * Bq; ++x) b.ot[x] = 0.0f;
    for (int64_t i = 0; i < Bq; ++i) {
        KeyRange r = visible_keys(p, pos[i < b.rows ? i : b.rows - 1], b.seqlen_k);
        r.begin = clamp64(r.begin, lo, hi);
        r.end = clamp64(r.end, r.begin, hi);
        b.lanes[i] = r;
        if (i == 0) b.first = b.last = r;
        b.first = {r.begin < b.first.begin ? r.begin : b.first.begin, r.end < b.first.end ? r.end : b.first.end};
        b.last = {r.begin > b.last.begin ? r.begin : b.last.begin, r.end > b.last.end ? r.end : b.last.end};
    }
}

// Whether some lane of sub-block b sees only part of keys [tile, tile + keys); if so, each
// lane's visible keys relative to the tile go to b.rel_begin / rel_end (for key_visible).
inline bool tile_ranges(const Block& b, int64_t tile, int64_t keys) {
    const bool partial = tile < b.last.begin || tile + keys > b.first.end;
    if (partial)
        for (int64_t i = 0; i < Bq; ++i) {
            const int64_t rb = clamp64(b.lanes[i].begin - tile, 0, keys);
            b.rel_begin[i] = static_cast<int32_t>(rb);
            b.rel_end[i] = static_cast<int32_t>(clamp64(b.lanes[i].end - tile, rb, keys));
        }
    return partial;
}

// Rows read by address: the addresses of the K and V rows of keys [tile, tile + keys) into
// b.k_rows / b.v_rows, and b.first_run (one table read per block of the tile).
inline void find_tile_rows(const Block& b, int64_t tile, int64_t keys) {
    b.first_run = b.k_src.run_end(tile, tile + keys + b.run_keys) - tile;
    for (int64_t j0 = 0; j0 < keys;) {
        const int64_t j1 = b.run_end(j0, keys);
        const char* krow = b.k_src.at(tile + j0);
        const char* vrow = b.v_src.at(tile + j0);
        for (int64_t j = j0; j < j1; ++j, krow += b.k_src.rows.row_stride, vrow += b.v_src.rows.row_stride) {
            b.k_rows[j] = reinterpret_cast<const float*>(krow);
            b.v_rows[j] = reinterpret_cast<const float*>(vrow);
        }
        j0 = j1;
    }
}

// Most sub-blocks one task holds: each K/V super-tile is read from L3 once per task and
// reused from L2 by up to this many sub-blocks, whose states (Qᵀ, Oᵀ) also live in L2.
constexpr int64_t kMaxSubBlocks = 4;
// The same when K and V are widened into a float32 copy per task: twice the rows share
// each widening, in super-tiles half the size (L2 / 4). Measured on Zen 4 (1 MiB L2,
// bfloat16 / float16, T = 2048..4096, D = 128): 0.94-0.97x of float32's speed with
// 4 sub-blocks and L2 / 2, 0.98-1.0x with these.
constexpr int64_t kMaxSubBlocksWidened = 8;

// K and V not float32: each super-tile is widened into a float32 copy once per task.
inline bool converts_kv(const AttentionParams& p) { return p.kv_dtype != DType::kF32; }

// Tile sizes of the float32 prefill, from D, Dv and the cache sizes only.
struct Tiling {
    int64_t Bk;          // keys per tile: Sᵀ (Bk x Bq) and the K rows in flight share L1
    int64_t super_keys;  // keys per super-tile: its K and V stay in L2 while every sub-block
                         // of the task walks them (FlashAttention's Bc ~ M / 4d with M = L2)
    bool prefetch;       // one head's K and V do not fit in half of L2
    int64_t sub_elems;   // floats of one sub-block's state
    int64_t shared_elems;
    int64_t row_ptr_elems;  // floats of the tile's K and V row addresses (rows by address), else 0
    int64_t kv_copy_elems;  // floats of the widened super-tile (K and V not float32) or of
                            // the gathered tile (gathered), else 0
    bool gathered;          // listed rows not widened: each tile's rows are copied once per
                            // task into a contiguous run (K, then V unless in K), which every
                            // sub-block then reads as a contiguous cache
};
// Most keys per tile (Bk); 48..96 measured alike on AVX2 (Sapphire Rapids, Bq = 32).
constexpr int64_t kMaxTileKeys = 16 * kRows > 96 ? 16 * kRows : 96;
// widened: the task widens K and V into a float32 copy (see kMaxSubBlocksWidened); listed:
// a decode task that may read listed rows (DecodeTask::rows), which are read by address
// like a paged pool's when not widened.
inline Tiling tiling(const AttentionParams& p, bool widened = false, bool listed = false) {
    const bool by_address = !widened && (p.block_table || listed);
    const CacheSizes& cache = cache_sizes();
    Tiling t;
    const int64_t bk = (cache.l1d / 4) / (Bq * static_cast<int64_t>(sizeof(float)));
    t.Bk = round_down(clamp64(bk, 2 * kRows, kMaxTileKeys), kRows);
    const int64_t row_bytes = (p.head_dim + p.head_dim_v) * static_cast<int64_t>(sizeof(float));
    t.super_keys = round_down(clamp64((cache.l2 / 2) / row_bytes, t.Bk, 1 << 20), t.Bk);
    t.prefetch = p.seqlen_k * row_bytes > cache.l2 / 2;
    t.sub_elems = (p.head_dim + p.head_dim_v + 2 + 4) * Bq;  // qt, ot, m, l, lanes
    t.shared_elems = t.Bk * Bq + 3 * Bq + round_up(t.Bk, 8) * Bq;
    t.row_ptr_elems = by_address
        ? 2 * t.Bk * static_cast<int64_t>(sizeof(const float*) / sizeof(float)) : 0;
    t.shared_elems += t.row_ptr_elems;
    // Whole cache lines, so the sub-block states after it keep the alignment their aligned
    // stores need: with the paged row addresses added it may end mid-vector (seen as a crash
    // of the avx2 tier's paged prefill on AMD Zen 3, whose 32 KiB L1 gives a smaller Bk).
    t.shared_elems = round_up(t.shared_elems, 16);
    if (widened)  // the float32 copy, beside up to kMaxSubBlocksWidened states
        t.super_keys = round_down(clamp64((cache.l2 / 4) / row_bytes, t.Bk, 1 << 20), t.Bk);
    // Rows by address: one tile per super-tile. One head's blocks lie Hkv x
    // block_size rows apart in the pool (64 KiB at Hkv = 8, block 16, D = 128), so they map
    // to a few L2 sets and a super-tile sized for half of L2 evicts itself: paged over
    // contiguous went 1.15x -> 1.10x (H = 8, L = 16k, Tq = 512, one thread, Zen 4; HISTORY 35).
    if (by_address) t.super_keys = t.Bk;
    t.kv_copy_elems = widened ? t.super_keys * (p.head_dim + p.head_dim_v) : 0;
    // Listed float32 rows lie anywhere: read in place, each sub-block's S micro-tile takes a
    // pointer per key (kAddressRows keys, not kRows). One copy per tile, shared by the
    // sub-blocks, costs less: MLA, 128 heads, top-2048 of 32k, 1.08-1.16x (HISTORY 59).
    // (bfloat16 rows, read in place by the pair kernel, measured 0.91-0.99x with the copy.)
    t.gathered = listed && !widened && p.kv_dtype == DType::kF32;
    if (t.gathered) {
        const int64_t row_elems = p.head_dim + (kv_is_latent(p) ? 0 : p.head_dim_v);
        t.kv_copy_elems = round_up(t.Bk * row_elems * dtype_bytes(p.kv_dtype), 64) / 4;
    }
    return t;
}

// How tasks group sub-blocks: heads of one KV head (GQA) and consecutive row blocks.
// Depends on the shape, the dtypes and the cache sizes only. widened: as tiling().
PrefillPlan plan_for(const AttentionParams& p, bool widened) {
    const Tiling t = tiling(p, widened);
    const int64_t group = p.heads / p.kv_heads;
    // Heads per task: the largest divisor of the group up to kMaxSubBlocks.
    int64_t heads = 1;
    for (int64_t h = 1; h <= group && h <= kMaxSubBlocks; ++h)
        if (group % h == 0) heads = h;
    // Row blocks per task: worth it when one head's K and V do not fit in L2, or when each
    // super-tile is widened (once per task, so for more rows). Heads stay at most
    // kMaxSubBlocks (GQA: each head of a task is a sub-block of every row block).
    int64_t row_blocks = widened ? kMaxSubBlocksWidened / heads : (t.prefetch ? kMaxSubBlocks / heads : 1);
    if (row_blocks < 1) row_blocks = 1;
    // Keep enough tasks (64) to balance the thread counts of most machines; a function of
    // the shape only, so the result does not depend on the thread count.
    const int64_t q_blocks = (p.seqlen_q + Bq - 1) / Bq;
    auto tasks = [&](int64_t rb, int64_t hd) {
        return p.batch * (p.heads / hd) * ((q_blocks + rb - 1) / rb);
    };
    while (row_blocks > 1 && tasks(row_blocks, heads) < 64) row_blocks /= 2;
    while (heads > 1 && tasks(row_blocks, heads) < 64) {
        int64_t h = heads - 1;
        while (group % h != 0) --h;
        heads = h;
    }
    PrefillPlan plan;
    plan.block_rows = row_blocks * Bq;
    plan.heads_per_task = heads;
    plan.workspace_elems = heads * row_blocks * t.sub_elems + t.shared_elems + t.kv_copy_elems + 64 / sizeof(float);
    return plan;
}
// The plan of a task that reads float32 K and V in place (at most kMaxSubBlocks sub-blocks).
[[maybe_unused]] PrefillPlan plan(const AttentionParams& p) { return plan_for(p, false); }
// The plan of attend_block for any dtype: K and V not float32 are widened.
PrefillPlan plan_all_dtypes(const AttentionParams& p) { return plan_for(p, converts_kv(p)); }

// ---------------------------------------------------------------- prefetch
// How a sub-block reads a tile's K and V rows and finds the next tile's to prefetch: one
// strided run from b.k / b.v (a contiguous cache or the task's widened copy), the next
// tile's rows after it; by address, each row through b.k_rows / b.v_rows, the next tile's
// through b.k_src / v_src; gathered, a strided run from the task's gathered copy of the
// listed rows, the next tile's through b.k_src / v_src.
enum class RowSource { kStrided, kByAddress, kGathered };
constexpr bool reads_by_address(RowSource s) { return s == RowSource::kByAddress; }
constexpr bool prefetches_by_address(RowSource s) { return s != RowSource::kStrided; }
template <RowSource S> using RowSourceTag = std::integral_constant<RowSource, S>;
// fn(RowSourceTag<sub-block b's source>{}).
template <class Fn>
inline void with_row_source(const Block& b, Fn&& fn) {
    if (b.k_rows) fn(RowSourceTag<RowSource::kByAddress>{});
    else if (b.gathered) fn(RowSourceTag<RowSource::kGathered>{});
    else fn(RowSourceTag<RowSource::kStrided>{});
}

// Brings the K and V rows of the next tile towards L2, a line or two per step, while the
// current tile computes. Needed when one head's K and V do not fit in L2 (they then come
// from L3 and the hardware prefetchers do not follow many strided rows); spread thinly
// because a burst of prefetches stalls the load pipeline. kByAddress (rows read by address:
// a paged pool, listed rows) is a template parameter, as in the micro-kernels below, so the
// contiguous loops compile as they did when measured (run-time tests there cost the avx2
// tier's prefill 10-20 %: GCC moved Pᵀ out of registers, HISTORY 32).
template <bool kByAddress>
struct PrefetchStream {
    const char* k_row = nullptr;
    const char* v_row = nullptr;
    int64_t k_stride = 0, v_stride = 0;  // bytes
    int64_t k_bytes = 0, v_bytes = 0;    // bytes of one row
    int64_t k_lines = 0, lines = 0;      // lines per row: K's, then V's
    int64_t line = 0;                    // next line of the current row
    int64_t rows_left = 0;
    // Rows by address: their sources, the key index of the current row and the end of its
    // run (the next row is then looked up: in a block table, or a task's list); nullptr: one
    // strided run.
    const TaskRows<char>* k_src = nullptr;
    const TaskRows<char>* v_src = nullptr;
    int64_t row = 0, run_end = 0;

    PrefetchStream() = default;
    // elem_bytes: of one K / V element as b.k and b.v hold them (4, or 2 for bfloat16 rows).
    PrefetchStream(const Block& b, int64_t first_row, int64_t rows, int64_t elem_bytes) {
        k_stride = b.k_stride * elem_bytes;
        v_stride = b.v_stride * elem_bytes;
        if constexpr (kByAddress) {
            k_src = &b.k_src;
            v_src = &b.v_src;
            row = first_row;
            run_end = rows > 0 ? b.k_src.run_end(first_row, first_row + rows) : first_row;
            k_row = rows > 0 ? b.k_src.at(first_row) : nullptr;
            v_row = rows > 0 ? b.v_src.at(first_row) : nullptr;
        } else {
            k_row = reinterpret_cast<const char*>(b.k) + (first_row - b.kv_first) * k_stride;
            v_row = reinterpret_cast<const char*>(b.v) + (first_row - b.kv_first) * v_stride;
        }
        k_bytes = b.D * elem_bytes;
        v_bytes = b.v_in_k ? 0 : b.Dv * elem_bytes;
        k_lines = k_bytes / 64 + 1;  // + 1: a row need not start on a line
        lines = k_lines + (v_bytes ? v_bytes / 64 + 1 : 0);
        rows_left = rows;
    }
    int64_t total_lines() const { return rows_left * lines; }
    __attribute__((always_inline)) void step() {  // (inlined into the PV loops, as measured)
        if (rows_left <= 0) return;
        const char* at;
        if (line < k_lines) {
            const int64_t off = line * 64;
            at = k_row + (off < k_bytes ? off : k_bytes - 1);
        } else {
            const int64_t off = (line - k_lines) * 64;
            at = v_row + (off < v_bytes ? off : v_bytes - 1);
        }
        __builtin_prefetch(at, 0, 2);  // to L2: prefetcht1 / PRFM PLDL2KEEP
        if (++line == lines) {
            line = 0;
            --rows_left;
            if (kByAddress && ++row == run_end) {
                if (rows_left > 0) {  // the next run (never looked up past the last row)
                    k_row = k_src->at(row);
                    v_row = v_src->at(row);
                    run_end = k_src->run_end(row, row + rows_left);
                }
            } else {
                k_row += k_stride;
                v_row += v_stride;
            }
        }
    }
};

// pf <- the stream over the `next_keys` K and V rows after the tile at `tile` (none when 0),
// spread evenly over the `visits` iterations of the tile's PV loops: returns the steps per visit.
template <bool kByAddress>
inline int prefetch_next_tile(const Block& b, int64_t tile, int64_t next_keys, int64_t elem_bytes,
                              int64_t visits, PrefetchStream<kByAddress>& pf) {
    if (next_keys <= 0) return 0;
    if constexpr (kByAddress) pf = PrefetchStream<kByAddress>(b, tile + b.Bk + b.pf_skip, next_keys, elem_bytes);
    else pf = PrefetchStream<kByAddress>(b, tile + b.Bk, next_keys, elem_bytes);  // (pf_skip is 0)
    return static_cast<int>((pf.total_lines() + visits - 1) / visits);
}

// ---------------------------------------------------------------- micro-kernels
#if defined(__aarch64__)
// acc[t][u] += qt[d + L][u-th vector] * k[key t][d + L], the key value taken from lane L of
// kq[t] (FMLA by element: one 4-float K load serves four d).
template <int R, int L, int QV>
__attribute__((always_inline)) inline void fma_lane(Vec (&acc)[R][QV], const Vec (&kq)[R], const float* q) {
#pragma GCC unroll 4
    for (int u = 0; u < QV; ++u) {
        const Vec qv = vload(q + u * W);
#pragma GCC unroll 16
        for (int t = 0; t < R; ++t) acc[t][u] = vfmaq_laneq_f32(acc[t][u], qv, kq[t], L);
    }
}
#endif

// Sᵀ rows [j0, j0 + R) of the tile starting at key `tile`: scores of R keys against all Bq
// query lanes; the score options applied (kOptions, as `o` says); masked to -inf outside
// each lane's range when `partial`; folds the row max. kByAddress: the rows from b.k_rows.
// (Always inlined, as scores_tile: the strided and the gathered tiles both call them, and
// as functions called twice GCC left them out of line: float32 prefill and gemm_decode
// 0.83-0.90x.)
template <int R, bool kOptions, bool kByAddress, int QV>
__attribute__((always_inline)) inline void scores_rows(const Block& b, int64_t tile, int64_t j0, bool partial,
                                                       const TileOptions& o, Vec* tile_max) {
    Vec acc[R][QV];
#pragma GCC unroll 16
    for (int t = 0; t < R; ++t)
#pragma GCC unroll 4
        for (int u = 0; u < QV; ++u) acc[t][u] = vzero();
    const float* krow[R];
    if constexpr (kByAddress) {
#pragma GCC unroll 16
        for (int t = 0; t < R; ++t) krow[t] = b.k_rows[j0 + t];
    } else {
#pragma GCC unroll 16
        for (int t = 0; t < R; ++t) krow[t] = b.k + (tile - b.kv_first + j0 + t) * b.k_stride;
    }
    const float* q = b.qt;
    int64_t d = 0;
#if defined(__aarch64__)
    for (; d + 4 <= b.D; d += 4, q += 4 * Bq) {  // four d per K load, the key value from a lane
        Vec kq[R];
#pragma GCC unroll 16
        for (int t = 0; t < R; ++t) kq[t] = vld1q_f32(krow[t] + d);
        fma_lane<R, 0, QV>(acc, kq, q);
        fma_lane<R, 1, QV>(acc, kq, q + Bq);
        fma_lane<R, 2, QV>(acc, kq, q + 2 * Bq);
        fma_lane<R, 3, QV>(acc, kq, q + 3 * Bq);
    }
#endif
    for (; d < b.D; ++d, q += Bq) {
        Vec qv[QV];
#pragma GCC unroll 4
        for (int u = 0; u < QV; ++u) qv[u] = vload(q + u * W);
#pragma GCC unroll 16
        for (int t = 0; t < R; ++t) {
            const Vec kb = vbcast(krow[t] + d);
#pragma GCC unroll 4
            for (int u = 0; u < QV; ++u) acc[t][u] = vfma(kb, qv[u], acc[t][u]);
        }
    }
    float* s = b.st + j0 * Bq;
    // (Read before the stores to s, which the compiler cannot tell apart from b.)
    const Vec cap = vset(b.opt.cap), inv_cap = vset(b.opt.inv_cap), slope = vset(b.opt.slope);
    const float* mt = b.mt + j0 * Bq;
    const float* alibi_pos = b.alibi_pos;
#pragma GCC unroll 16
    for (int t = 0; t < R; ++t)
#pragma GCC unroll 4
        for (int u = 0; u < QV; ++u) {
            Vec x = neg_inf_to_nan(acc[t][u]);  // -inf only from an infinite input
            if constexpr (kOptions) {
                if (o.softcap) x = softcap(x, cap, inv_cap);
                if (o.alibi) {  // |i' - j| exactly (while below 2^24)
                    const Vec dist = vabs(vsub(vload(alibi_pos + u * W), vset(static_cast<float>(j0 + t))));
                    x = vfnma(slope, dist, x);
                }
                if (o.mask == TileMask::kDrop) x = keep_unless_sign(x, vload(mt + t * Bq + u * W));
                else if (o.mask == TileMask::kAdd) x = vadd(x, vload(mt + t * Bq + u * W));
            }
            if (partial)
                x = keep_or_neg_inf(key_visible(b.rel_begin + u * W, b.rel_end + u * W,
                                                static_cast<int32_t>(j0 + t)), x);
            tile_max[u] = vmax(tile_max[u], x);
            vstore(s + t * Bq + u * W, x);
        }
}

// Oᵀ rows [e0, e0 + R) = corr * Oᵀ + Vᵀ[e0:e0+R, tile keys] Pᵀ over `keys` keys (corr
// nullptr: all ones); steps the prefetch stream `pf_steps` times per key.
template <int R, RowSource kSrc, int QV>
void pv_rows(const Block& b, int64_t tile, int64_t keys, int64_t e0, const Vec* corr,
             PrefetchStream<prefetches_by_address(kSrc)>& pf, int pf_steps) {
    Vec acc[R][QV];
    float* o = b.ot + e0 * Bq;
    if (corr) {
#pragma GCC unroll 16
        for (int t = 0; t < R; ++t)
#pragma GCC unroll 4
            for (int u = 0; u < QV; ++u) acc[t][u] = vmul(vload(o + t * Bq + u * W), corr[u]);
    } else {
#pragma GCC unroll 16
        for (int t = 0; t < R; ++t)
#pragma GCC unroll 4
            for (int u = 0; u < QV; ++u) acc[t][u] = vload(o + t * Bq + u * W);
    }
    const float* pt = b.st;
    // One key: acc += V row (R columns from vrow) x Pᵀ row (pt).
    auto key = [&](const float* vrow) __attribute__((always_inline)) {
        for (int i = 0; i < pf_steps; ++i) pf.step();
        Vec pv[QV];
#pragma GCC unroll 4
        for (int u = 0; u < QV; ++u) pv[u] = vload(pt + u * W);
#pragma GCC unroll 16
        for (int t = 0; t < R; ++t) {
            const Vec vb = vbcast(vrow + t);
#pragma GCC unroll 4
            for (int u = 0; u < QV; ++u) acc[t][u] = vfma(vb, pv[u], acc[t][u]);
        }
        pt += Bq;
    };
    if constexpr (reads_by_address(kSrc)) {  // runs of V rows at v_stride steps: the keys of one block
        if (b.run_keys == 1) {  // listed rows: a run per key
            for (int64_t j = 0; j < keys; ++j) key(b.v_rows[j] + e0);
        } else {
            for (int64_t j0 = 0; j0 < keys;) {
                const int64_t j1 = b.run_end(j0, keys);
                const float* vrow = b.v_rows[j0] + e0;
                for (int64_t j = j0; j < j1; ++j, vrow += b.v_stride) key(vrow);
                j0 = j1;
            }
        }
    } else {  // one run: the whole tile (one loop, as the registers were allocated when measured)
        const float* vrow = b.v + (tile - b.kv_first) * b.v_stride + e0;
        for (int64_t j = 0; j < keys; ++j, vrow += b.v_stride) key(vrow);
    }
#pragma GCC unroll 16
    for (int t = 0; t < R; ++t)
#pragma GCC unroll 4
        for (int u = 0; u < QV; ++u) vstore(o + t * Bq + u * W, acc[t][u]);
}

// Remainder micro-tiles (fewer than kRows keys or columns), picked by an if-chain at
// compile time. (No static table: its constructor would run AVX code at library load.)
template <int R, bool kOptions, bool kByAddress, int QV>
inline void scores_tail(int64_t rows, const Block& b, int64_t tile, int64_t j0, bool partial,
                        const TileOptions& o, Vec* tile_max) {
    if (rows == R) scores_rows<R, kOptions, kByAddress, QV>(b, tile, j0, partial, o, tile_max);
    else if constexpr (R > 1) scores_tail<R - 1, kOptions, kByAddress, QV>(rows, b, tile, j0, partial, o, tile_max);
}
template <int R, RowSource kSrc, int QV>
inline void pv_cols(int64_t cols, const Block& b, int64_t tile, int64_t keys, int64_t e0, const Vec* corr,
                    PrefetchStream<prefetches_by_address(kSrc)>& pf, int pf_steps) {
    if (cols == R) pv_rows<R, kSrc, QV>(b, tile, keys, e0, corr, pf, pf_steps);
    else if constexpr (R > 1) pv_cols<R - 1, kSrc, QV>(cols, b, tile, keys, e0, corr, pf, pf_steps);
}

// ---------------------------------------------------------------- one KV tile
// Keys per S micro-tile when the rows are read by address: each key row then takes a pointer
// register of its own, and 12 of them spilled (a stack load per broadcast: sparse MLA over
// listed rows 0.93x of the 8-key kernel before, HISTORY 58).
constexpr int kAddressRows = 8;
// Keys (S) or output columns (PV) per micro-tile of QV query vectors: kRows at full width;
// with fewer vectors, as many accumulators as at full width (each value loaded still feeds
// about as many FMAs), up to 16; NEON's S loop also holds a 4-float K vector per key: kRows.
template <int QV>
constexpr int tile_rows() {
#if defined(__aarch64__)
    return kRows;
#else
    return QV == kQueryVecs ? kRows : (kRows * kQueryVecs / QV < 16 ? kRows * kQueryVecs / QV : 16);
#endif
}
template <bool kOptions, bool kByAddress, int QV>
__attribute__((always_inline)) inline void scores_tile(const Block& b, int64_t tile, int64_t keys, bool partial, const TileOptions& o,
                        Vec* tile_max) {
    constexpr int R = kByAddress && tile_rows<QV>() > kAddressRows ? kAddressRows : tile_rows<QV>();
    int64_t j0 = 0;
    for (; j0 + R <= keys; j0 += R) scores_rows<R, kOptions, kByAddress, QV>(b, tile, j0, partial, o, tile_max);
    if (j0 < keys) scores_tail<R - 1, kOptions, kByAddress, QV>(keys - j0, b, tile, j0, partial, o, tile_max);
}

// Online-softmax update of the block with keys [tile, tile + keys), its rows read as kSrc
// says (attend_tile below picks).
template <RowSource kSrc, int QV>
void attend_tile_rows(const Block& b, int64_t tile, int64_t keys, int64_t next_keys, bool partial,
                      const TileOptions& o) {
    constexpr bool kByAddress = reads_by_address(kSrc);
    // 1. Sᵀ = K_tile Qᵀ (scaled, base 2), options applied, masked on partial tiles, with
    //    the tile's row max.
    Vec tile_max[QV];
    for (int u = 0; u < QV; ++u) tile_max[u] = vset(-__builtin_inff());
    if (o.any()) scores_tile<true, kByAddress, QV>(b, tile, keys, partial, o, tile_max);
    else scores_tile<false, kByAddress, QV>(b, tile, keys, partial, o, tile_max);

    // 2. New max, rescale factor of the old state, Pᵀ = 2^(Sᵀ - m) in place, row sums.
    Vec corr[QV];
    const bool rescale = online_softmax<QV>(b.st, Bq, keys, b.m, b.l, tile_max, corr);

    // 3. Oᵀ = corr * Oᵀ + Vᵀ Pᵀ, in passes of near-equal width (Dv = 64: 11+11+11+11+10+10,
    //    not 12 x 5 + 4), prefetching the next tile on the way.
    constexpr int R = tile_rows<QV>();
    const int64_t passes = (b.Dv + R - 1) / R;
    PrefetchStream<prefetches_by_address(kSrc)> pf;
    const int pf_steps = prefetch_next_tile(b, tile, next_keys, sizeof(float), passes * keys, pf);
    for (int64_t pass = 0, e0 = 0; pass < passes; ++pass) {
        const int64_t cols = b.Dv / passes + (pass < b.Dv % passes ? 1 : 0);
        pv_cols<R, kSrc, QV>(cols, b, tile, keys, e0, rescale ? corr : nullptr, pf, pf_steps);
        e0 += cols;
    }
}
// A sub-block of at most W rows computes one query vector, not kQueryVecs: the same bits
// per lane, for 1 / kQueryVecs of the work (a decode step's 68 rows, 2 sub-blocks and 4 rows).
inline void attend_tile(const Block& b, int64_t tile, int64_t keys, int64_t next_keys, bool partial,
                        const TileOptions& o) {
    with_row_source(b, [&](auto src) {
        if (b.rows <= W) attend_tile_rows<decltype(src)::value, 1>(b, tile, keys, next_keys, partial, o);
        else attend_tile_rows<decltype(src)::value, kQueryVecs>(b, tile, keys, next_keys, partial, o);
    });
}

// ---------------------------------------------------------------- storage types
// Q, the output and mask tiles go through registers kChunk x kChunk elements at a time
// (the SIMD layer's chunks: 8 lanes on both AVX tiers, 4 on NEON and SSE2).
using simd::Chunk;
using simd::kChunk;
using simd::chunk_load;
using simd::chunk_mul;
using simd::chunk_set;
using simd::chunk_store;
using simd::chunk_storeu;
using simd::narrow_chunk;
using simd::transpose_chunks;
using simd::widen_chunk;
inline void narrow1(float* y, float x) { *y = x; }
inline void narrow1(f16_t* y, float x) { *y = narrow_f16(x); }
inline void narrow1(bf16_t* y, float x) { *y = narrow_bf16(x); }

// Keys [first, first + rows) of one (batch, kv head)'s K or V (one strided run, a paged
// pool's blocks, or a decode task's listed rows), widened into dst (rows x dim, contiguous)
// and, for an int8 cache, times each row's scale (one rounding, as the templates do; never
// with listed rows).
template <class T>
void widen_rows(const TaskRows<T>& src, int64_t first, int64_t rows, int64_t dim,
                const RowScales& scale, float* dst) {
    for (int64_t r0 = 0; r0 < rows;) {  // runs of rows within one block (paged)
        const int64_t r1 = src.run_end(first + r0, first + rows) - first;
        const T* x = src.at(first + r0);
        for (int64_t r = r0; r < r1; ++r, x += src.rows.row_stride, dst += dim) {
            const float sc = scale.at(first + r);
            const Chunk scc = chunk_set(sc);
            int64_t d = 0;
            if (scale.scale) {
                for (; d + kChunk <= dim; d += kChunk) chunk_storeu(dst + d, chunk_mul(widen_chunk(x + d), scc));
                for (; d < dim; ++d) dst[d] = widen(x[d]) * sc;
            } else {
                for (; d + kChunk <= dim; d += kChunk) chunk_storeu(dst + d, widen_chunk(x + d));
                for (; d < dim; ++d) dst[d] = widen(x[d]);
            }
        }
        r0 = r1;
    }
}

// ---------------------------------------------------------------- one task
// Qᵀ of one sub-block, lane i from query row q[i] (i < b.rows), widened to float32 and
// scaled into base 2 (exp(x) = 2^(x log2 e)); lanes past the last row 0.
template <class TQ>
void stage_queries(const AttentionParams& p, Block& b, const TQ* const* q) {
    const float qscale = static_cast<float>(p.scale * kLog2e);
    const Chunk scalec = chunk_set(qscale);
    const int64_t D = b.D;
    int64_t i0 = 0;
    for (; i0 + kChunk <= b.rows; i0 += kChunk) {  // kChunk x kChunk blocks through registers
        const TQ* const* q0 = q + i0;
        int64_t d0 = 0;
        for (; d0 + kChunk <= D; d0 += kChunk) {
            Chunk r[kChunk];
            for (int c = 0; c < kChunk; ++c) r[c] = chunk_mul(widen_chunk(q0[c] + d0), scalec);
            transpose_chunks(r);
            for (int c = 0; c < kChunk; ++c) chunk_store(b.qt + (d0 + c) * Bq + i0, r[c]);
        }
        for (; d0 < D; ++d0)
            for (int c = 0; c < kChunk; ++c) b.qt[d0 * Bq + i0 + c] = widen(q0[c][d0]) * qscale;
    }
    for (; i0 < b.rows; ++i0)
        for (int64_t d = 0; d < D; ++d) b.qt[d * Bq + i0] = widen(q[i0][d]) * qscale;
    for (int64_t d = 0; d < D; ++d)
        for (int64_t i = b.rows; i < Bq; ++i) b.qt[d * Bq + i] = 0.0f;
}

// out = Oᵀᵀ / l, rounded to q's type; lse = ln(l) + m ln 2. A row that saw no key (l == 0):
// zeros and -inf; a NaN in a score the row sees makes l NaN, and NaN goes on to out and lse.
template <class TQ = float>
void finish_sub_block(const AttentionParams& p, const Block& b, int64_t batch) {
    TQ* out = static_cast<TQ*>(p.out) + batch * p.out_batch_stride + b.head * p.out_head_stride;
    float* lse = static_cast<float*>(p.lse);
    if (lse) lse += batch * p.lse_batch_stride + b.head * p.lse_head_stride;
    alignas(64) float inv[Bq];
    const int64_t Dv = b.Dv;
    // A row that saw no key may still hold 0 x NaN from a value row other rows of its tiles
    // saw: its out is exactly 0 all the same.
    for (int64_t i = 0; i < b.rows; ++i)
        if (b.l[i] == 0.0f)
            for (int64_t e = 0; e < Dv; ++e) b.ot[e * Bq + i] = 0.0f;
    // Attention sink (gpt-oss): one more term of the denominator, no value; in the base-2
    // units of m and l. A row that saw no key gets m = sink, l = 1 (zeros, lse = sink).
    if (p.sinks) {
        const float sink = static_cast<float>(p.sinks[b.head] * kLog2e);
        for (int64_t i = 0; i < b.rows; ++i) {
            if (b.l[i] == 0.0f) {
                b.m[i] = sink;
                b.l[i] = 1.0f;
                continue;
            }
            const float m_new = b.m[i] > sink ? b.m[i] : sink;  // (a NaN m stays in l)
            const float corr = __builtin_exp2f(b.m[i] - m_new);
            b.l[i] = b.l[i] * corr + __builtin_exp2f(sink - m_new);
            b.m[i] = m_new;
            if (corr != 1.0f)
                for (int64_t e = 0; e < Dv; ++e) b.ot[e * Bq + i] *= corr;
        }
    }
    // l == 0: the row saw no key (zeros, lse -inf); l NaN (a NaN score) stays NaN in both.
    for (int64_t i = 0; i < Bq; ++i) inv[i] = b.l[i] != 0.0f ? 1.0f / b.l[i] : 0.0f;
    int64_t i0 = 0;
    for (; i0 + kChunk <= b.rows; i0 += kChunk) {  // kChunk x kChunk blocks through registers
        TQ* o0 = out + (b.row_begin + i0) * p.out_row_stride;
        const Chunk invc = chunk_load(inv + i0);
        int64_t e0 = 0;
        for (; e0 + kChunk <= Dv; e0 += kChunk) {
            Chunk r[kChunk];
            for (int c = 0; c < kChunk; ++c) r[c] = chunk_mul(chunk_load(b.ot + (e0 + c) * Bq + i0), invc);
            transpose_chunks(r);
            for (int c = 0; c < kChunk; ++c) narrow_chunk(o0 + c * p.out_row_stride + e0, r[c]);
        }
        for (; e0 < Dv; ++e0)
            for (int c = 0; c < kChunk; ++c) narrow1(o0 + c * p.out_row_stride + e0, b.ot[e0 * Bq + i0 + c] * inv[i0 + c]);
    }
    for (; i0 < b.rows; ++i0) {
        TQ* orow = out + (b.row_begin + i0) * p.out_row_stride;
        for (int64_t e = 0; e < Dv; ++e) narrow1(orow + e, b.ot[e * Bq + i0] * inv[i0]);
    }
    if (lse)
        for (int64_t i = 0; i < b.rows; ++i)
            lse[(b.row_begin + i) * p.lse_row_stride] =
                b.l[i] != 0.0f ? b.m[i] * static_cast<float>(kLn2) + __builtin_logf(b.l[i]) : -__builtin_inff();
}

// ---------------------------------------------------------------- masks
// Mask values in the kernel's units: a bool mask's entry as +0 (keep) or -inf (drop), an
// additive mask's times log2(e).
inline float mask_value(const uint8_t* m) { return *m ? 0.0f : -__builtin_inff(); }
inline float mask_value(const float* m) { return *m * static_cast<float>(kLog2e); }
inline float mask_value(const double* m) { return static_cast<float>(*m) * static_cast<float>(kLog2e); }
inline Chunk mask_chunk(const uint8_t* m) { return simd::chunk_zero_to_neg_inf(m); }
inline Chunk mask_chunk(const float* m) { return chunk_mul(widen_chunk(m), chunk_set(static_cast<float>(kLog2e))); }
inline Chunk mask_chunk(const double* m) { return chunk_mul(widen_chunk(m), chunk_set(static_cast<float>(kLog2e))); }
// Whether a mask tile drops or adds anything (lanes nonzero) and keeps anything (zero).
using MaskSummary = simd::ZeroTally;

// b.mt <- the mask of keys [tile, tile + keys) for the sub-block's Bq lanes, transposed
// (key-major, like Sᵀ); padding lanes repeat the last row. Read through the mask's strides
// (0 for a broadcast axis), never beyond key seqlen_k of a row.
template <class M>
void mask_tile(const AttentionParams& p, const Block& b, const M* base, int64_t tile, int64_t keys,
               MaskSummary& sum) {
    const int64_t rs = p.mask_row_stride, cs = p.mask_col_stride;
    auto row = [&](int64_t i) { return base + (b.row_begin + (i < b.rows ? i : b.rows - 1)) * rs + tile * cs; };
    if (rs == 0 || b.rows == 1) {  // every lane the same row: one value per key, broadcast
        const M* m = row(0);
        for (int64_t j = 0; j < keys; ++j) {
            const float x = mask_value(m + j * cs);
            sum.add(x);
            const Vec xv = vset(x);
            for (int u = 0; u < kQueryVecs; ++u) vstore(b.mt + j * Bq + u * W, xv);
        }
        return;
    }
    if (cs == 1) {  // rows of consecutive keys: kChunk x kChunk blocks through registers
        for (int64_t i0 = 0; i0 < Bq; i0 += kChunk) {
            const M* r0[kChunk];
            for (int c = 0; c < kChunk; ++c) r0[c] = row(i0 + c);
            int64_t j0 = 0;
            for (; j0 < keys && tile + j0 + kChunk <= p.seqlen_k; j0 += kChunk) {
                Chunk r[kChunk];
                for (int c = 0; c < kChunk; ++c) r[c] = mask_chunk(r0[c] + j0);
                transpose_chunks(r);
                const int64_t n = keys - j0 < kChunk ? keys - j0 : kChunk;
                for (int64_t c = 0; c < n; ++c) {
                    sum.add(r[c]);
                    chunk_store(b.mt + (j0 + c) * Bq + i0, r[c]);
                }
            }
            for (; j0 < keys; ++j0)  // the last keys of the rows
                for (int c = 0; c < kChunk; ++c) {
                    const float x = mask_value(r0[c] + j0);
                    sum.add(x);
                    b.mt[j0 * Bq + i0 + c] = x;
                }
        }
        return;
    }
    for (int64_t i = 0; i < Bq; ++i) {  // any other strides
        const M* m = row(i);
        for (int64_t j = 0; j < keys; ++j) {
            const float x = mask_value(m + j * cs);
            sum.add(x);
            b.mt[j * Bq + i] = x;
        }
    }
}

// Keys [tile, tile + keys) for sub-block b: masks when some lane's range cuts the tile; the
// score options' per-tile state (ALiBi positions, the mask tile). A tile a bool mask drops
// entirely is skipped (exact: it would add nothing); a mask tile that keeps every key (bool)
// or adds only zeros is not applied.
void attend_sub_tile(const AttentionParams& p, const Block& b, int64_t batch, int64_t tile, int64_t keys,
                     int64_t next_keys) {
    TileOptions o{b.opt.softcap, b.opt.alibi, TileMask::kNone};
    if (b.opt.mask) {
        MaskSummary sum;
        const int64_t at = batch * p.mask_batch_stride + b.head * p.mask_head_stride;
        if (p.mask_kind == MaskKind::kBool) {
            mask_tile(p, b, static_cast<const uint8_t*>(p.mask) + at, tile, keys, sum);
            if (!sum.any_zero()) return;  // every key dropped
            if (sum.any_nonzero()) o.mask = TileMask::kDrop;
        } else {
            if (p.mask_dtype == DType::kF64) mask_tile(p, b, static_cast<const double*>(p.mask) + at, tile, keys, sum);
            else mask_tile(p, b, static_cast<const float*>(p.mask) + at, tile, keys, sum);
            if (sum.any_nonzero()) o.mask = TileMask::kAdd;
        }
    }
    if (b.opt.alibi) {
        const int64_t aligned0 = aligned_row(p, b.row_begin, b.seqlen_k);
        for (int64_t i = 0; i < Bq; ++i) b.alibi_pos[i] = static_cast<float>(aligned0 - tile + i);
    }
    const bool partial = tile_ranges(b, tile, keys);
    if (b.k_rows) find_tile_rows(b, tile, keys);
    attend_tile(b, tile, keys, next_keys, partial, o);
}

template <class T> struct IsFloat { static constexpr bool value = false; };
template <> struct IsFloat<float> { static constexpr bool value = true; };

// The task's score options (see ScoreOptions).
inline ScoreOptions score_options(const AttentionParams& p) {
    ScoreOptions o;
    if (p.softcap > 0) {
        o.softcap = true;
        o.cap = static_cast<float>(p.softcap * kLog2e);
        o.inv_cap = static_cast<float>(1.0 / (p.softcap * kLog2e));
    }
    o.alibi = p.alibi_slopes != nullptr;
    o.mask = p.mask != nullptr;
    return o;
}

// What the task loop leaves to a kernel, as a policy (as decode_loop takes WidenPath): Q and
// KV, the storage types of q / out and of k / v; kWidened, whether each K/V super-tile is
// widened into a float32 copy that b.k and b.v then point into (else they point into the
// caller's arrays, strides in elements); extra_elems, the workspace it needs past the
// sub-blocks and the copy, which its constructor is given; stage_queries, Qᵀ in its layout;
// attend, one KV tile of one sub-block. This kernel widens q, k and v to float32 and applies
// every score option; bf16_prefill.inl has a vdpbf16ps one for bfloat16 q, k, v.
template <class TQ, class TKV>
struct WidenKernel {
    using Q = TQ;
    using KV = TKV;
    static constexpr bool kWidened = !IsFloat<TKV>::value;
    static int64_t extra_elems(const AttentionParams&, const Tiling&) { return 0; }
    WidenKernel(const AttentionParams&, float* /*extra*/) {}
    void stage_queries(const AttentionParams& p, Block& b, const TQ* const* q) const { simd::stage_queries(p, b, q); }
    void attend(const AttentionParams& p, const Block& b, int64_t batch, int64_t tile, int64_t keys,
                int64_t next_keys) const {
        attend_sub_tile(p, b, batch, tile, keys, next_keys);
    }
};

// A task's workspace, from a 64-byte aligned base: the scratch its sub-blocks share (Sᵀ,
// masks, the tile's row addresses), `subs` sub-block states, the widened super-tile, then
// the kernel's extra.
inline float* align_workspace(float* w) {
    return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(w) + 63) & ~uintptr_t(63));
}
inline float* kv_copy_of(float* base, const Tiling& t, int64_t subs) { return base + t.shared_elems + subs * t.sub_elems; }
inline float* kernel_extra_of(float* base, const Tiling& t, int64_t subs) {
    return kv_copy_of(base, t, subs) + t.kv_copy_elems;
}

// A task's rows with strides in bytes: how a sub-block reads rows by address.
template <class T>
TaskRows<char> as_bytes(const TaskRows<T>& r) {
    constexpr int64_t e = sizeof(T);
    return TaskRows<char>{KeyRows<char>{reinterpret_cast<const char*>(r.rows.base), r.rows.row_stride * e,
                                        r.rows.table, r.rows.block_stride * e, r.rows.block_size},
                          r.index};
}

// Rows [first, first + rows) of src (dim elements each) copied one after another to dst.
template <class T>
void gather_rows(const TaskRows<T>& src, int64_t first, int64_t rows, int64_t dim, T* dst) {
    for (int64_t r = 0; r < rows; ++r, dst += dim) __builtin_memcpy(dst, src.at(first + r), dim * sizeof(T));
}

// Sub-block sidx of a task with `subs`, placed in its workspace and reading the K and V rows
// k and v of one (batch, kv head) with seqlen_k valid keys: from the widened super-tile
// (Kernel::kWidened), by address (a block table or a list; listed float32 rows through a
// gathered copy of each tile: Tiling::gathered), or as one strided run. The
// caller sets its rows.
template <class Kernel>
void place_block(const AttentionParams& p, const Tiling& t, float* base, int64_t sidx, int64_t subs,
                 const TaskRows<typename Kernel::KV>& k, const TaskRows<typename Kernel::KV>& v,
                 int64_t seqlen_k, Block& b) {
    using TKV = typename Kernel::KV;
    b = Block{};
    b.D = p.head_dim;
    b.Dv = p.head_dim_v;
    b.Bk = t.Bk;
    b.st = base;
    b.rel_begin = reinterpret_cast<int32_t*>(b.st + t.Bk * Bq);
    b.rel_end = b.rel_begin + Bq;
    b.alibi_pos = reinterpret_cast<float*>(b.rel_end + Bq);
    b.mt = b.alibi_pos + Bq;
    b.qt = base + t.shared_elems + sidx * t.sub_elems;
    b.ot = b.qt + b.D * Bq;
    b.m = b.ot + b.Dv * Bq;
    b.l = b.m + Bq;
    b.lanes = reinterpret_cast<KeyRange*>(b.l + Bq);
    if constexpr (Kernel::kWidened) {
        b.k = kv_copy_of(base, t, subs);
        b.v = b.k + t.super_keys * b.D;
        b.k_stride = b.D;
        b.v_stride = b.Dv;
    } else if (k.rows.table || k.index) {  // rows by address (a block table or a list)
        b.k_src = as_bytes(k);  // (where they are read, or the next tile's prefetched from)
        b.v_src = as_bytes(v);
        b.run_keys = k.index ? 1 : k.rows.block_size;
        if (t.gathered) {  // each tile's listed rows copied by attend_keys, read in order
            const TKV* copy = reinterpret_cast<const TKV*>(kv_copy_of(base, t, subs));
            const bool latent = kv_is_latent(p);
            b.k = reinterpret_cast<const float*>(copy);
            b.v = reinterpret_cast<const float*>(latent ? copy : copy + t.Bk * b.D);
            b.k_stride = b.D;
            b.v_stride = latent ? b.D : b.Dv;
            b.gathered = true;
        } else {
            b.k = b.v = nullptr;  // (rows through k_rows / v_rows)
            b.k_rows = reinterpret_cast<const float**>(b.mt + round_up(t.Bk, 8) * Bq);
            b.v_rows = b.k_rows + t.Bk;
            b.k_stride = k.rows.row_stride;
            b.v_stride = v.rows.row_stride;
        }
    } else {
        b.k = reinterpret_cast<const float*>(k.rows.base);
        b.v = reinterpret_cast<const float*>(v.rows.base);
        b.k_stride = k.rows.row_stride;
        b.v_stride = v.rows.row_stride;
    }
    b.v_in_k = !Kernel::kWidened && kv_is_latent(p);
    b.seqlen_k = seqlen_k;
    b.opt = score_options(p);
}

// Attends the `subs` sub-blocks of one task to the keys their lanes see (their state
// started). The keys are walked in L2-sized super-tiles; every sub-block walks a super-tile
// (in Bk tiles) before the next, so K and V come from L3 once per task instead of once per
// sub-block (and, when Kernel::kWidened, are widened once per task into the float32 copy
// kv_copy). The tile grid starts at the task's first visible key.
template <class Kernel>
void attend_keys(const AttentionParams& p, const Kernel& kernel, const Tiling& t, Block* blocks, int64_t subs,
                 int64_t batch, const TaskRows<typename Kernel::KV>& k, const TaskRows<typename Kernel::KV>& v,
                 const RowScales& k_scale, const RowScales& v_scale, float* kv_copy) {
    constexpr bool kWidened = Kernel::kWidened;
    const bool by_address = blocks[0].k_rows != nullptr;
    int64_t kv_begin = blocks[0].first.begin, kv_end = blocks[0].last.end;
    for (int64_t sidx = 1; sidx < subs; ++sidx) {
        if (blocks[sidx].first.begin < kv_begin) kv_begin = blocks[sidx].first.begin;
        if (blocks[sidx].last.end > kv_end) kv_end = blocks[sidx].last.end;
    }
    // Rows read by address (a paged pool's blocks, listed rows) that no hardware prefetcher
    // finds: the first tile's start towards the cache at once (the later ones are prefetched
    // a tile ahead).
    if ((by_address || t.gathered) && kv_begin < kv_end) {
        PrefetchStream<true> pf(blocks[0], kv_begin, kv_end - kv_begin < t.Bk ? kv_end - kv_begin : t.Bk,
                                sizeof(typename Kernel::KV));
        for (int64_t n = pf.total_lines(); n > 0; --n) pf.step();
    }
    for (int64_t super = kv_begin; super < kv_end; super += t.super_keys) {
        const int64_t super_end = super + t.super_keys < kv_end ? super + t.super_keys : kv_end;
        if constexpr (kWidened) {
            widen_rows(k, super, super_end - super, p.head_dim, k_scale, kv_copy);
            widen_rows(v, super, super_end - super, p.head_dim_v, v_scale, kv_copy + t.super_keys * p.head_dim);
            for (int64_t sidx = 0; sidx < subs; ++sidx) blocks[sidx].kv_first = super;
        } else if (t.gathered) {
            using TKV = typename Kernel::KV;
            TKV* copy = reinterpret_cast<TKV*>(kv_copy);
            gather_rows(k, super, super_end - super, p.head_dim, copy);
            if (!blocks[0].v_in_k) gather_rows(v, super, super_end - super, p.head_dim_v, copy + t.Bk * p.head_dim);
            for (int64_t sidx = 0; sidx < subs; ++sidx) blocks[sidx].kv_first = super;
        }
        int64_t covered = super;  // keys of this super-tile some earlier sub-block has read
        for (int64_t sidx = 0; sidx < subs; ++sidx) {
            const Block& b = blocks[sidx];
            const int64_t lo = b.first.begin, hi = b.last.end < super_end ? b.last.end : super_end;
            int64_t tile = super;
            if (lo > tile) tile += round_down(lo - tile, t.Bk);  // skip tiles before the range
            for (; tile < hi; tile += t.Bk) {
                const int64_t keys = hi - tile < t.Bk ? hi - tile : t.Bk;
                // Prefetch the next tile unless an earlier sub-block already brought it in
                // (or it is in the widened copy, already in L2).
                int64_t next_keys = 0;
                if (!kWidened && t.prefetch && tile + t.Bk >= covered) {
                    const int64_t after = kv_end - (tile + t.Bk);
                    next_keys = after <= 0 ? 0 : (after < t.Bk ? after : t.Bk);
                    // One tile per super-tile (rows by address): every sub-block walks each
                    // tile in turn, so each prefetches its share of the next (1.10x -> 1.08x,
                    // HISTORY 35).
                    if ((by_address || t.gathered) && t.super_keys == t.Bk) {
                        b.pf_skip = next_keys * sidx / subs;
                        next_keys = next_keys * (sidx + 1) / subs - b.pf_skip;
                    }
                }
                kernel.attend(p, b, batch, tile, keys, next_keys);
            }
            if (hi > covered) covered = hi;
        }
    }
}

// One prefill task: heads [head, head + head_count) (all of one KV head) x rows [row_begin,
// row_end), as sub-blocks of Bq rows of one head, with the arithmetic of Kernel (see
// WidenKernel); writes their out and lse rows.
template <class Kernel>
void run_task(const AttentionParams& p, const BlockTask& task, float* workspace) {
    using TQ = typename Kernel::Q;
    using TKV = typename Kernel::KV;
    const Tiling t = tiling(p, Kernel::kWidened);
    const int64_t row_blocks = (task.row_end - task.row_begin + Bq - 1) / Bq;
    const int64_t subs = task.head_count * row_blocks;  // <= kMaxSubBlocks(Widened) (plan_for)
    const int64_t kv_head = task.head / (p.heads / p.kv_heads);
    float* base = align_workspace(workspace);
    const Kernel kernel(p, kernel_extra_of(base, t, subs));

    // The K and V rows (and int8 row scales) of (batch, kv head): one strided run, or a
    // paged pool read in place through the block table (no gathered copy).
    const TaskRows<TKV> k{key_rows<TKV>(p, p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride,
                                        task.batch, kv_head), nullptr};
    const TaskRows<TKV> v{key_rows<TKV>(p, p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride,
                                        task.batch, kv_head), nullptr};
    const RowScales k_scale = row_scales(p, p.k_scale, p.k_scale_batch_stride, p.k_scale_head_stride,
                                         p.k_scale_row_stride, task.batch, kv_head);
    const RowScales v_scale = row_scales(p, p.v_scale, p.v_scale_batch_stride, p.v_scale_head_stride,
                                         p.v_scale_row_stride, task.batch, kv_head);

    Block blocks[kMaxSubBlocksWidened];
    for (int64_t sidx = 0; sidx < subs; ++sidx) {
        Block& b = blocks[sidx];
        place_block<Kernel>(p, t, base, sidx, subs, k, v, batch_seqlen_k(p, task.batch), b);
        b.head = task.head + sidx / row_blocks;
        b.row_begin = task.row_begin + (sidx % row_blocks) * Bq;
        b.rows = task.row_end - b.row_begin < Bq ? task.row_end - b.row_begin : Bq;
        if (b.opt.alibi)
            b.opt.slope = static_cast<float>(p.alibi_slopes[task.batch * p.alibi_batch_stride + b.head] * kLog2e);
        const TQ* q = static_cast<const TQ*>(p.q) + task.batch * p.q_batch_stride + b.head * p.q_head_stride;
        const TQ* qrows[Bq];
        int64_t pos[Bq];
        for (int64_t i = 0; i < Bq; ++i) {
            pos[i] = b.row_begin + i;
            qrows[i] = i < b.rows ? q + pos[i] * p.q_row_stride : nullptr;
        }
        kernel.stage_queries(p, b, qrows);
        start_state(p, b, pos, 0, b.seqlen_k);
    }
    attend_keys(p, kernel, t, blocks, subs, task.batch, k, v, k_scale, v_scale, kv_copy_of(base, t, subs));
    for (int64_t sidx = 0; sidx < subs; ++sidx) finish_sub_block<TQ>(p, blocks[sidx], task.batch);
}

// Every float32-accumulated dtype combination attention_forward accepts over a format the
// prefill reads (with_q_kv_types<false>: not the decode-only ones), with every score option.
void attend_block(const AttentionParams& p, const BlockTask& task, float* workspace) {
    with_q_kv_types<false>(p, [&](auto tq, auto tkv) {
        run_task<WidenKernel<typename decltype(tq)::type, typename decltype(tkv)::type>>(p, task, workspace);
    });
}

// KernelTable::prefill_kernel: this kernel takes every call.
PrefillKernel prefill_kernel(const AttentionParams&) {
    return {KernelId::kSimdPrefill, attend_block, plan_all_dtypes};
}

}  // namespace simd

// The S micro-tile: Bq query rows (in the vector lanes) x kRows keys; both products vfma
// (K and V not float32 widened into a float32 copy first).
template <> struct PolicyOf<KernelId::kSimdPrefill> {
    static KernelPolicy of(const AttentionParams&) {
        return {simd::Bq, simd::kRows, kVfmaProduct, kVfmaProduct};
    }
};
}  // namespace
}  // namespace ATTNFAST_KERNEL_NS
}  // namespace attnfast

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
