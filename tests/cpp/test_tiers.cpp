// C++ tier test (no Python): for every kernel tier compiled in that this CPU can run, checks
// attnfast::attention_forward against a float64 reference written here (materialised softmax)
// on small odd shapes that cover both paths (decode: Tq <= 16, prefill), causal and windows,
// GQA, Dv != D, strided inputs, per-batch key lengths, paged caches (a block table: the same
// bits as the contiguous cache), float32 and float64, bfloat16 / float16 q, k, v, float32 q
// over a 16-bit or int8 cache and 16-bit q over an int8 cache (the float32-accumulated paths:
// checked against the reference of the stored values, outputs to the rounding of q's dtype),
// the score options (softcap, ALiBi, bool and additive masks, sinks), the NaN contract, and
// that 1 and 3 threads give identical bits; the backward (attention_backward: float32 and
// float64 gradients against a float64 reference, dense and over a key_index, 1 and 3 threads
// bit-identical); and the benchmarks' read kernel (read_probe).
// Built with -DATTNFAST_BUILD_TESTS=ON, run by
// ctest (under qemu-user for cross builds: tools/run_cpp_tests.sh).
//
// Usage: test_tiers [--nan | --random N [seed]]
//   --nan: only the NaN-contract cases; --random: N random shapes instead of the fixed matrix
// Environment: ATTNFAST_TEST_NAN_XFAIL=tier,tier: NaN-contract failures of those tiers are
// reported as XFAIL (known, not counted), a pass there as XPASS. ATTNFAST_TEST_TIERS=tier,..:
// only those tiers (one this CPU lacks fails), so that a slow emulated run can be split
// into one ctest test per tier and run in parallel (CMakeLists.txt, ATTNFAST_TEST_TIERS).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "attnfast.hpp"
#include "backward.hpp"

namespace {

constexpr int64_t kBottomRight = INT64_MIN;  // Case::query_offset: none given

// One attention problem of the test matrix.
struct Case {
    int64_t B;            // batch
    int64_t H;            // query heads
    int64_t Hkv;          // kv heads
    int64_t Tq;           // query rows
    int64_t Tk;           // keys (capacity when seqlens is set)
    int64_t D;            // head_dim
    int64_t Dv;           // head_dim_v
    bool causal;          // bottom-right aligned causal mask
    int64_t wl;           // window_left, -1 = unbounded
    int64_t wr;           // window_right, -1 = unbounded
    bool strided;         // (B, T, H, D)-style interleaved rows with padding, not contiguous
    bool seqlens;         // per-batch key lengths (seqlens_k)
    double amp;           // data amplitude (larger: peakier softmax)
    int nan;              // 0: none; 1: a NaN in one q row; 2: a NaN in one key row
    int64_t query_offset = kBottomRight;  // row i sits at key i + query_offset, or (default)
                                          // bottom-right aligned: i + (keys - Tq)
    int64_t block = 0;    // > 0: also run through a paged copy of the cache (blocks of this
                          // many rows, in reverse order in the pool), which must give the
                          // same bits
    double softcap = 0;  // 0: off
    double alibi = 0;    // 0: off; else head h's ALiBi slope is alibi * (h + 1)
    int mask = 0;        // 0: none; 1: bool (B, 1, Tq, Tk), ~1 key in 5 dropped and row Tq / 2
                         // dropped entirely; 2: additive (Tq, Tk) of the case's dtype,
                         // broadcast over batch and heads, ~1 in 10 entries -inf
    bool sinks = false;  // head h's sink logit 0.5 - 0.3 h
};

// Deterministic data: a 64-bit LCG mapped to [-amp, amp).
struct Rng {
    uint64_t s;  // state
    double next(double amp) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        return ((s >> 11) * (1.0 / 9007199254740992.0) * 2.0 - 1.0) * amp;
    }
};

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

// Storage types of the 16-bit and int8 paths, as attnfast reads them (bit patterns), with
// conversions written here, independently of the kernels' (csrc/simd/storage.hpp).
// Encoding is only for making test data (any nearby value will do: the reference reads the
// stored values back); decoding is exact.
struct Bf16 {  // bfloat16: the upper half of a float32
    uint16_t bits;
    Bf16() = default;
    explicit Bf16(double x) {
        const float f = static_cast<float>(x);
        uint32_t u;
        std::memcpy(&u, &f, 4);
        bits = std::isnan(x) ? uint16_t(0x7FC0) : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
    explicit operator double() const {
        const uint32_t u = static_cast<uint32_t>(bits) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
};
struct F16 {  // IEEE binary16
    uint16_t bits;
    F16() = default;
    explicit F16(double x) {  // nearest (ties away from zero), |x| < 65504
        if (std::isnan(x)) {
            bits = 0x7E00;
            return;
        }
        const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
        x = std::fabs(x);
        if (x < std::ldexp(1.0, -14)) {  // subnormal (1024 x 2^-24 rounds up to the smallest normal)
            bits = static_cast<uint16_t>(sign | std::lround(x * std::ldexp(1.0, 24)));
            return;
        }
        int e;
        long m = std::lround(std::frexp(x, &e) * 2048);  // x = (m / 2048) 2^e, m in [1024, 2048]
        if (m == 2048) m = 1024, ++e;
        bits = static_cast<uint16_t>(sign | ((e + 14) << 10) | (m - 1024));
    }
    explicit operator double() const {
        const int e = (bits >> 10) & 31, m = bits & 1023;
        const double v = e == 0 ? std::ldexp(m, -24) : (e == 31 ? (m ? kNaN : kInf) : std::ldexp(1024 + m, e - 25));
        return bits & 0x8000 ? -v : v;
    }
};
struct I8 {  // an int8 cache value (the row's float32 scale is kept beside it)
    int8_t value;
    I8() = default;
    explicit I8(double x) : value(std::isnan(x) ? 0 : static_cast<int8_t>(std::lround(std::max(-127.0, std::min(127.0, x))))) {}
    explicit operator double() const { return value; }
};
struct F8 {  // a float8 e4m3fn cache value (the row's float32 scale is kept beside it)
    uint8_t bits;
    F8() = default;
    static double decode(uint8_t b) {  // exact: 2^(e-7) 1.m, 2^-6 0.m for e = 0; S.1111.111 NaN
        if ((b & 0x7F) == 0x7F) return kNaN;
        const int e = (b >> 3) & 15, m = b & 7;
        const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
        return b & 0x80 ? -v : v;
    }
    explicit F8(double x) : bits(0x7F) {  // the nearest finite value (NaN stays NaN)
        if (std::isnan(x)) return;
        double best = kInf;
        for (int b = 0; b < 256; ++b) {
            const double d = std::fabs(decode(static_cast<uint8_t>(b)) - x);
            if (d < best) best = d, bits = static_cast<uint8_t>(b);
        }
    }
    explicit operator double() const { return decode(bits); }
};
struct F8E5M2 {  // a float8 e5m2 cache value: float16's top byte (the row's scale beside it)
    uint8_t bits;
    F8E5M2() = default;
    static double decode(uint8_t b) {
        F16 h;
        h.bits = static_cast<uint16_t>(b << 8);
        return static_cast<double>(h);
    }
    explicit F8E5M2(double x) : bits(0x7F) {  // the nearest finite value (NaN stays NaN)
        if (std::isnan(x)) return;
        double best = kInf;
        for (int b = 0; b < 256; ++b) {
            const double d = std::fabs(decode(static_cast<uint8_t>(b)) - x);
            if (d < best) best = d, bits = static_cast<uint8_t>(b);
        }
    }
    explicit operator double() const { return decode(bits); }
};
template <class T> attnfast::DType dtype_of();
template <> attnfast::DType dtype_of<float>() { return attnfast::DType::kF32; }
template <> attnfast::DType dtype_of<double>() { return attnfast::DType::kF64; }
template <> attnfast::DType dtype_of<Bf16>() { return attnfast::DType::kBF16; }
template <> attnfast::DType dtype_of<F16>() { return attnfast::DType::kF16; }
template <> attnfast::DType dtype_of<I8>() { return attnfast::DType::kI8; }
template <> attnfast::DType dtype_of<F8>() { return attnfast::DType::kF8E4M3; }
template <> attnfast::DType dtype_of<F8E5M2>() { return attnfast::DType::kF8E5M2; }
// Relative error the output's rounding to T adds (beyond the float32 arithmetic's).
template <class T> double rounding_of() { return 0; }
template <> double rounding_of<Bf16>() { return 4e-3; }  // half an ulp: 2^-9
template <> double rounding_of<F16>() { return 1e-3; }   // half an ulp: 2^-12

// A (B, heads, T, dim) tensor stored with the case's layout; elements outside the logical
// tensor (padding) are `pad`.
template <class T>
struct Tensor {
    std::vector<T> data;  // storage, padding included
    int64_t batch_stride, head_stride, row_stride;  // in elements
    int64_t B, heads, T_, dim;  // logical shape

    Tensor(int64_t b, int64_t h, int64_t t, int64_t d, bool strided, double pad)
        : B(b), heads(h), T_(t), dim(d) {
        if (strided) {  // (B, T, H, dim + 3): what x.transpose(0, 2, 1, 3) of a padded array gives
            head_stride = d + 3;
            row_stride = h * head_stride;
            batch_stride = t * row_stride;
        } else {
            row_stride = d;
            head_stride = t * d;
            batch_stride = h * head_stride;
        }
        data.assign(static_cast<size_t>(b * batch_stride > 0 ? b * batch_stride : 1), static_cast<T>(pad));
    }
    T& at(int64_t b, int64_t h, int64_t t, int64_t d) {
        return data[static_cast<size_t>(b * batch_stride + h * head_stride + t * row_stride + d)];
    }
};

// Visible keys [begin, end) of query row i for a batch entry with n keys, straight from the
// contract's per-key rule (the set is an interval; empty: begin == end).
void visible(const Case& c, int64_t i, int64_t n, int64_t* begin, int64_t* end) {
    const int64_t a = i + (c.query_offset == kBottomRight ? n - c.Tq : c.query_offset);
    auto sees = [&](int64_t j) {
        return (!c.causal || j <= a) && (c.wr < 0 || j <= a + c.wr) && (c.wl < 0 || j >= a - c.wl);
    };
    int64_t lo = 0;
    while (lo < n && !sees(lo)) ++lo;
    int64_t hi = lo;
    while (hi < n && sees(hi)) ++hi;
    *begin = lo;
    *end = hi;
}

struct Stats {
    long checks = 0;    // problems run and compared (per dtype and thread count)
    long failures = 0;  // problems with any mismatch
    long xfail = 0;     // NaN-contract failures of tiers listed as known
    long xpass = 0;     // NaN-contract passes of tiers listed as known
};

std::string g_xfail_tiers;  // ATTNFAST_TEST_NAN_XFAIL, with commas around

bool nan_known_to_fail(const std::string& tier) {
    return g_xfail_tiers.find("," + tier + ",") != std::string::npos;
}

std::string describe(const Case& c, const char* dtype) {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "%s B=%lld H=%lld Hkv=%lld Tq=%lld Tk=%lld D=%lld Dv=%lld causal=%d window=(%lld,%lld)%s%s%s"
                  " block=%lld softcap=%g alibi=%g mask=%d%s",
                  dtype, (long long)c.B, (long long)c.H, (long long)c.Hkv, (long long)c.Tq,
                  (long long)c.Tk, (long long)c.D, (long long)c.Dv, c.causal ? 1 : 0,
                  (long long)c.wl, (long long)c.wr, c.strided ? " strided" : "",
                  c.seqlens ? " seqlens_k" : "",
                  c.nan == 1 ? " NaN-in-q" : (c.nan == 2 ? " NaN-in-k" : ""), (long long)c.block,
                  c.softcap, c.alibi, c.mask, c.sinks ? " sinks" : "");
    return buf;
}

// Runs one case with q and out of type T and k, v of type TKV on the active tier with 1 and
// 3 threads; compares with the reference and the two runs with each other. Returns false on
// any mismatch (printed). Arithmetic, lse and additive masks are float64 for float64, else
// float32 (A); an int8 K/V row stands for its float32 scale times its values.
// The active tier rounds P to bfloat16 for P·V with bfloat16 q, k, v (avx512bf16's vdpbf16ps
// kernels; README): each weight's relative error up to 2^-9 adds up to 2^-9 max|v| to out;
// and bfloat16 subnormals count as zero there (vdpbf16ps's inputs).
bool g_bf16_rounds_p = false;

template <class T, class TKV = T>
bool run_case(const Case& c, uint64_t seed, const char* dtype) {
    using A = typename std::conditional<std::is_same<T, double>::value, double, float>::type;
    // int8 or float8: K/V rows with float32 scales, stored values spanning +-kStoredMax
    constexpr bool kInt8 = std::is_same<TKV, I8>::value || std::is_same<TKV, F8>::value ||
                           std::is_same<TKV, F8E5M2>::value;
    const double kStoredMax = std::is_same<TKV, F8>::value ? 448.0 : std::is_same<TKV, F8E5M2>::value ? 57344.0 : 127.0;
    const double tol = sizeof(A) == 4 ? 2e-5 : 1e-12;
    const double out_rel = tol + rounding_of<T>();  // relative tolerance of out
    const double out_abs = tol + (std::is_same<T, Bf16>::value && std::is_same<TKV, Bf16>::value && g_bf16_rounds_p
                                      ? std::ldexp(1.0, -9) : 0.0);  // (|v| <= 1)
    Rng rng{seed};
    Tensor<T> q(c.B, c.H, c.Tq, c.D, c.strided, kNaN);
    Tensor<TKV> k(c.B, c.Hkv, c.Tk, c.D, c.strided, kNaN);
    Tensor<TKV> v(c.B, c.Hkv, c.Tk, c.Dv, c.strided, kNaN);
    // int8: per-row scales (batch, kv head, key), NaN past each batch entry's keys; the
    // values span [-127, 127] so that scale x value spans the case's amplitude.
    std::vector<float> ks(kInt8 ? static_cast<size_t>(c.B * c.Hkv * c.Tk) : 0, static_cast<float>(kNaN));
    std::vector<float> vs(ks.size(), static_cast<float>(kNaN));
    auto k_scale = [&](int64_t b, int64_t g, int64_t j) { return kInt8 ? static_cast<double>(ks[(b * c.Hkv + g) * c.Tk + j]) : 1.0; };
    auto v_scale = [&](int64_t b, int64_t g, int64_t j) { return kInt8 ? static_cast<double>(vs[(b * c.Hkv + g) * c.Tk + j]) : 1.0; };
    const double k_amp = kInt8 ? kStoredMax : c.amp, v_amp = kInt8 ? kStoredMax : 1.0;
    std::vector<int64_t> lens(static_cast<size_t>(c.B), c.Tk);
    if (c.seqlens)  // lengths down to 0 (a batch entry that sees nothing)
        for (int64_t b = 0; b < c.B; ++b) lens[b] = b == 0 ? c.Tk : (b == 1 ? c.Tk / 2 + 1 : (b == 2 ? 0 : std::max<int64_t>(0, c.Tk - b)));
    // Keys past a batch entry's length stay NaN: a kernel reading them shows.
    for (int64_t b = 0; b < c.B; ++b)
        for (int64_t h = 0; h < c.H; ++h)
            for (int64_t t = 0; t < c.Tq; ++t)
                for (int64_t d = 0; d < c.D; ++d) q.at(b, h, t, d) = static_cast<T>(rng.next(c.amp));
    for (int64_t b = 0; b < c.B; ++b)
        for (int64_t h = 0; h < c.Hkv; ++h)
            for (int64_t t = 0; t < lens[b]; ++t) {
                for (int64_t d = 0; d < c.D; ++d) k.at(b, h, t, d) = static_cast<TKV>(rng.next(k_amp));
                for (int64_t d = 0; d < c.Dv; ++d) v.at(b, h, t, d) = static_cast<TKV>(rng.next(v_amp));
                if (kInt8) {
                    ks[(b * c.Hkv + h) * c.Tk + t] = static_cast<float>(c.amp / kStoredMax * (0.75 + 0.25 * rng.next(1.0)));
                    vs[(b * c.Hkv + h) * c.Tk + t] = static_cast<float>(1.0 / kStoredMax * (0.75 + 0.25 * rng.next(1.0)));
                }
            }
    // NaN cases: one q row (batch 0, head H-1, a late row) or one key (batch 0, kv head 0,
    // a key early enough that causal rows after it see it).
    const int64_t nan_row = c.Tq - 1 - c.Tq / 3, nan_key = c.Tk / 3;
    if (c.nan == 1) q.at(0, c.H - 1, nan_row, c.D / 2) = static_cast<T>(kNaN);
    if (c.nan == 2) {  // (int8: the key's scale)
        if (kInt8) ks[nan_key] = static_cast<float>(kNaN);
        else k.at(0, 0, nan_key, c.D - 1) = static_cast<TKV>(kNaN);
    }

    // Score options.
    std::vector<float> slopes(static_cast<size_t>(c.H)), sinks(static_cast<size_t>(c.H));
    for (int64_t h = 0; h < c.H; ++h) {
        slopes[h] = static_cast<float>(c.alibi * static_cast<double>(h + 1));
        sinks[h] = static_cast<float>(0.5 - 0.3 * static_cast<double>(h));
    }
    std::vector<uint8_t> keep(c.mask == 1 ? static_cast<size_t>(c.B * c.Tq * c.Tk) : 0);
    for (int64_t b = 0; b < (c.mask == 1 ? c.B : 0); ++b)
        for (int64_t i = 0; i < c.Tq; ++i)
            for (int64_t j = 0; j < c.Tk; ++j)
                keep[(b * c.Tq + i) * c.Tk + j] = i != c.Tq / 2 && rng.next(1.0) > -0.6;
    std::vector<A> add(c.mask == 2 ? static_cast<size_t>(c.Tq * c.Tk) : 0);
    for (size_t x = 0; x < add.size(); ++x) {
        const double r = rng.next(1.0);
        add[x] = static_cast<A>(r < -0.8 ? -kInf : 2.0 * r);
    }
    auto mask_drops = [&](int64_t b, int64_t i, int64_t j) {
        return c.mask == 1 && !keep[(b * c.Tq + i) * c.Tk + j];
    };
    auto mask_adds = [&](int64_t i, int64_t j) {
        return c.mask == 2 ? static_cast<double>(add[i * c.Tk + j]) : 0.0;
    };

    // Outputs: out in the case's layout, padding a sentinel that must survive; lse (B, Tq, H)
    // when strided (SDPA-transposed), else (B, H, Tq); both start as NaN-free garbage-free
    // sentinels so an unwritten element shows.
    const double sentinel = 1234.5;
    Tensor<T> out1(c.B, c.H, c.Tq, c.Dv, c.strided, sentinel), out3 = out1;
    std::vector<A> lse1(static_cast<size_t>(c.B * c.H * c.Tq + 1), static_cast<A>(sentinel)), lse3 = lse1;
    const int64_t lse_b = c.H * c.Tq, lse_h = c.strided ? 1 : c.Tq, lse_r = c.strided ? c.H : 1;

    attnfast::AttentionParams p = attnfast::default_params();
    p.dtype = dtype_of<T>();
    p.kv_dtype = dtype_of<TKV>();
    if (kInt8) {
        p.k_scale = ks.data(), p.v_scale = vs.data();
        p.k_scale_batch_stride = p.v_scale_batch_stride = c.Hkv * c.Tk;
        p.k_scale_head_stride = p.v_scale_head_stride = c.Tk;
        p.k_scale_row_stride = p.v_scale_row_stride = 1;
    }
    p.q = q.data.data();
    p.k = k.data.data();
    p.v = v.data.data();
    p.q_batch_stride = q.batch_stride, p.q_head_stride = q.head_stride, p.q_row_stride = q.row_stride;
    p.k_batch_stride = k.batch_stride, p.k_head_stride = k.head_stride, p.k_row_stride = k.row_stride;
    p.v_batch_stride = v.batch_stride, p.v_head_stride = v.head_stride, p.v_row_stride = v.row_stride;
    p.out_batch_stride = out1.batch_stride, p.out_head_stride = out1.head_stride;
    p.out_row_stride = out1.row_stride;
    p.lse_batch_stride = lse_b, p.lse_head_stride = lse_h, p.lse_row_stride = lse_r;
    p.batch = c.B, p.heads = c.H, p.kv_heads = c.Hkv, p.seqlen_q = c.Tq, p.seqlen_k = c.Tk;
    p.seqlens_k = c.seqlens ? lens.data() : nullptr;
    p.head_dim = c.D, p.head_dim_v = c.Dv;
    p.scale = 1.0 / std::sqrt(static_cast<double>(c.D));
    p.causal = c.causal, p.window_left = c.wl, p.window_right = c.wr;
    p.has_query_offset = c.query_offset != kBottomRight;
    p.query_offset = p.has_query_offset ? c.query_offset : 0;
    p.softcap = c.softcap;
    if (c.alibi != 0) p.alibi_slopes = slopes.data(), p.alibi_batch_stride = 0;
    if (c.sinks) p.sinks = sinks.data();
    if (c.mask == 1) {
        p.mask = keep.data(), p.mask_kind = attnfast::MaskKind::kBool;
        p.mask_batch_stride = c.Tq * c.Tk, p.mask_head_stride = 0, p.mask_row_stride = c.Tk, p.mask_col_stride = 1;
    } else if (c.mask == 2) {
        p.mask = add.data(), p.mask_kind = attnfast::MaskKind::kAdditive, p.mask_dtype = dtype_of<A>();
        p.mask_batch_stride = 0, p.mask_head_stride = 0, p.mask_row_stride = c.Tk, p.mask_col_stride = 1;
    }

    const std::string what = describe(c, dtype);
    try {
        p.out = out1.data.data(), p.lse = lse1.data(), p.num_threads = 1;
        attnfast::attention_forward(p);  // (float8: the decode loop in row blocks)
        p.out = out3.data.data(), p.lse = lse3.data(), p.num_threads = 3;
        attnfast::attention_forward(p);
    } catch (const std::exception& e) {
        std::printf("  FAIL %s: attention_forward threw: %s\n", what.c_str(), e.what());
        return false;
    }
    int reported = 0;
    auto fail = [&](const char* msg, int64_t b, int64_t h, int64_t i, int64_t e, double got, double want) {
        if (reported++ < 3)
            std::printf("  FAIL %s: %s at b=%lld h=%lld row=%lld col=%lld: got %.9g, want %.9g\n",
                        what.c_str(), msg, (long long)b, (long long)h, (long long)i, (long long)e, got, want);
    };

    // Thread counts: identical bits, padding included.
    if (std::memcmp(out1.data.data(), out3.data.data(), out1.data.size() * sizeof(T)) != 0 ||
        std::memcmp(lse1.data(), lse3.data(), lse1.size() * sizeof(A)) != 0)
        fail("1 and 3 threads differ", -1, -1, -1, -1, 0, 0);

    // Paged: the same keys in a pool of blocks (reverse order, rows past the keys NaN), read
    // through a block table; the same bits as the contiguous call.
    if (c.block > 0) {
        const int64_t bs = c.block, per = (c.Tk + bs - 1) / bs, nb = c.B * per + 2;
        std::vector<TKV> kp(static_cast<size_t>(nb * c.Hkv * bs * c.D), static_cast<TKV>(kNaN));
        std::vector<TKV> vp(static_cast<size_t>(nb * c.Hkv * bs * c.Dv), static_cast<TKV>(kNaN));
        std::vector<float> ksp(kInt8 ? static_cast<size_t>(nb * c.Hkv * bs) : 0, static_cast<float>(kNaN));
        std::vector<float> vsp(ksp.size(), static_cast<float>(kNaN));
        std::vector<int64_t> table(static_cast<size_t>(c.B * per));
        for (int64_t b = 0; b < c.B; ++b)
            for (int64_t i = 0; i < per; ++i) {
                const int64_t id = nb - 1 - (b * per + i);
                table[b * per + i] = id;
                for (int64_t g = 0; g < c.Hkv; ++g)
                    for (int64_t r = 0; r < bs && i * bs + r < lens[b]; ++r) {
                        for (int64_t d = 0; d < c.D; ++d)
                            kp[((id * c.Hkv + g) * bs + r) * c.D + d] = k.at(b, g, i * bs + r, d);
                        for (int64_t d = 0; d < c.Dv; ++d)
                            vp[((id * c.Hkv + g) * bs + r) * c.Dv + d] = v.at(b, g, i * bs + r, d);
                        if (kInt8) {
                            ksp[(id * c.Hkv + g) * bs + r] = ks[(b * c.Hkv + g) * c.Tk + i * bs + r];
                            vsp[(id * c.Hkv + g) * bs + r] = vs[(b * c.Hkv + g) * c.Tk + i * bs + r];
                        }
                    }
            }
        attnfast::AttentionParams pp = p;
        pp.k = kp.data(), pp.v = vp.data();
        pp.k_batch_stride = c.Hkv * bs * c.D, pp.k_head_stride = bs * c.D, pp.k_row_stride = c.D;
        pp.v_batch_stride = c.Hkv * bs * c.Dv, pp.v_head_stride = bs * c.Dv, pp.v_row_stride = c.Dv;
        if (kInt8) {
            pp.k_scale = ksp.data(), pp.v_scale = vsp.data();
            pp.k_scale_batch_stride = pp.v_scale_batch_stride = c.Hkv * bs;
            pp.k_scale_head_stride = pp.v_scale_head_stride = bs;
        }
        pp.block_table = table.data(), pp.block_table_batch_stride = per;
        pp.block_size = bs, pp.num_blocks = nb, pp.seqlen_k = per * bs;
        pp.seqlens_k = lens.data();  // the keys of the contiguous call (not the pool's capacity)
        Tensor<T> outp(c.B, c.H, c.Tq, c.Dv, c.strided, sentinel);
        std::vector<A> lsep(lse1.size(), static_cast<A>(sentinel));
        pp.out = outp.data.data(), pp.lse = lsep.data(), pp.num_threads = 3;
        try {
            attnfast::attention_forward(pp);
        } catch (const std::exception& e) {
            std::printf("  FAIL %s: paged attention_forward threw: %s\n", what.c_str(), e.what());
            return false;
        }
        if (std::memcmp(out1.data.data(), outp.data.data(), out1.data.size() * sizeof(T)) != 0 ||
            std::memcmp(lse1.data(), lsep.data(), lse1.size() * sizeof(A)) != 0)
            fail("paged (block table) differs from contiguous", -1, -1, -1, -1, 0, 0);
    }

    // Reference, row by row, in float64 from the stored values.
    const int64_t group = c.H / c.Hkv;
    std::vector<double> s(static_cast<size_t>(c.Tk)), o(static_cast<size_t>(c.Dv));
    for (int64_t b = 0; b < c.B; ++b)
        for (int64_t h = 0; h < c.H; ++h)
            for (int64_t i = 0; i < c.Tq; ++i) {
                int64_t lo, hi;
                visible(c, i, lens[b], &lo, &hi);
                const int64_t g = h / group;
                const int64_t aligned = i + (c.query_offset == kBottomRight ? lens[b] - c.Tq : c.query_offset);
                double m = -kInf;
                bool has_nan = false;
                for (int64_t j = lo; j < hi; ++j) {
                    double dot = 0;
                    for (int64_t d = 0; d < c.D; ++d)
                        dot += static_cast<double>(q.at(b, h, i, d)) * static_cast<double>(k.at(b, g, j, d));
                    s[j] = dot * k_scale(b, g, j) * p.scale;
                    // the options in AttentionParams' order; a dropped key is -inf (skipped)
                    if (c.softcap != 0) s[j] = c.softcap * std::tanh(s[j] / c.softcap);
                    if (c.alibi != 0) s[j] -= static_cast<double>(slopes[h]) * static_cast<double>(std::llabs(aligned - j));
                    s[j] = mask_drops(b, i, j) ? -kInf : s[j] + mask_adds(i, j);
                    if (std::isnan(s[j])) has_nan = true;
                    else m = std::max(m, s[j]);
                }
                const bool blind = m == -kInf;  // (no key seen, or every one dropped)
                if (c.sinks && !has_nan) m = std::max(m, static_cast<double>(sinks[h]));
                double sum = c.sinks && !has_nan ? std::exp(static_cast<double>(sinks[h]) - m) : 0;
                for (int64_t e = 0; e < c.Dv; ++e) o[e] = 0;
                for (int64_t j = lo; j < hi && !has_nan && !blind; ++j) {
                    if (s[j] == -kInf) continue;
                    const double w = std::exp(s[j] - m);
                    sum += w;
                    const double wv = w * v_scale(b, g, j);
                    for (int64_t e = 0; e < c.Dv; ++e) o[e] += wv * static_cast<double>(v.at(b, g, j, e));
                }
                const double got_lse = static_cast<double>(lse1[b * lse_b + h * lse_h + i * lse_r]);
                if (has_nan) {  // NaN in, NaN out: every element of out and lse
                    if (!std::isnan(got_lse)) fail("lse not NaN (NaN input)", b, h, i, -1, got_lse, kNaN);
                    for (int64_t e = 0; e < c.Dv; ++e)
                        if (!std::isnan(static_cast<double>(out1.at(b, h, i, e)))) {
                            fail("out not NaN (NaN input)", b, h, i, e, static_cast<double>(out1.at(b, h, i, e)), kNaN);
                            break;
                        }
                    continue;
                }
                if (hi == lo || blind) {  // sees no key: exact zeros and -inf (the sink with sinks)
                    const double want_lse = c.sinks ? static_cast<double>(sinks[h]) : -kInf;
                    if (!(got_lse == want_lse || std::fabs(got_lse - want_lse) <= tol))
                        fail("lse of a blind row", b, h, i, -1, got_lse, want_lse);
                    for (int64_t e = 0; e < c.Dv; ++e)
                        if (static_cast<double>(out1.at(b, h, i, e)) != 0.0) {
                            fail("out of a blind row", b, h, i, e, static_cast<double>(out1.at(b, h, i, e)), 0);
                            break;
                        }
                    continue;
                }
                const double want_lse = m + std::log(sum);
                if (!(std::fabs(got_lse - want_lse) <= tol + tol * std::fabs(want_lse)))
                    fail("lse", b, h, i, -1, got_lse, want_lse);
                for (int64_t e = 0; e < c.Dv; ++e) {
                    const double want = o[e] / sum, got = static_cast<double>(out1.at(b, h, i, e));
                    if (!(std::fabs(got - want) <= out_abs + out_rel * std::fabs(want))) {
                        fail("out", b, h, i, e, got, want);
                        break;
                    }
                }
            }
    // Padding of out untouched (strided layout).
    if (c.strided)
        for (int64_t b = 0; b < c.B; ++b)
            for (int64_t t = 0; t < c.Tq; ++t)
                for (int64_t h = 0; h < c.H; ++h)
                    for (int64_t e = c.Dv; e < out1.head_stride; ++e)
                        if (static_cast<double>(out1.at(b, h, t, e)) != static_cast<double>(static_cast<T>(sentinel)))
                            fail("out padding written", b, h, t, e, static_cast<double>(out1.at(b, h, t, e)), sentinel);
    if (reported > 3) std::printf("  ... %d more mismatches in that case\n", reported - 3);
    return reported == 0;
}

// The test matrix. Tq <= 16 takes the decode path, longer queries the prefill path.
std::vector<Case> accuracy_cases() {
    //      B  H Hkv  Tq    Tk    D    Dv  causal  wl   wr  strided seqlens amp nan
    return {
        // decode path
        {1, 1, 1, 1, 1, 1, 1, false, -1, -1, false, false, 1.0, 0},
        {2, 4, 2, 1, 100, 17, 3, true, -1, -1, false, true, 1.0, 0},
        {1, 4, 1, 5, 63, 64, 64, true, -1, -1, false, false, 1.0, 0},
        {1, 4, 4, 16, 257, 80, 130, false, -1, -1, true, false, 1.0, 0},
        {3, 4, 2, 5, 17, 3, 17, true, 8, 0, false, true, 1.0, 0},
        {1, 2, 2, 16, 5, 130, 64, true, -1, -1, false, false, 1.0, 0},
        {1, 4, 1, 1, 257, 130, 80, false, 50, -1, true, false, 2.0, 0},
        {1, 4, 2, 3, 1100, 130, 130, true, -1, -1, false, false, 1.0, 0},  // several decode chunks
        {2, 4, 1, 16, 300, 1, 17, true, 40, 2, true, true, 3.0, 0},
        // prefill path
        {1, 1, 1, 17, 17, 1, 1, true, -1, -1, false, false, 1.0, 0},
        {1, 2, 2, 63, 100, 3, 17, false, -1, -1, true, false, 1.0, 0},
        {3, 2, 1, 100, 63, 64, 64, true, -1, -1, false, true, 1.0, 0},
        {1, 2, 1, 257, 257, 80, 80, true, -1, -1, false, false, 1.0, 0},
        {1, 8, 1, 257, 257, 3, 17, true, -1, -1, false, false, 1.0, 0},  // 2 heads per task (GQA)
        {1, 2, 2, 100, 257, 17, 130, false, 20, 5, false, false, 1.0, 0},
        {1, 2, 1, 257, 100, 130, 3, true, 30, -1, true, false, 2.0, 0},
        {2, 4, 2, 17, 257, 64, 80, false, -1, -1, true, true, 1.0, 0},
        {1, 1, 1, 63, 63, 130, 130, true, 10, 10, false, false, 1.0, 0},
        {1, 4, 2, 100, 100, 1, 64, false, -1, -1, false, false, 3.0, 0},
        {1, 2, 2, 257, 5, 17, 17, true, -1, -1, false, false, 1.0, 0},
        {1, 4, 4, 33, 100, 80, 1, false, 0, 0, true, false, 1.0, 0},
        {1, 1, 1, 24, 1100, 130, 130, true, -1, -1, false, false, 1.0, 0},  // L2 super-tiles, prefetch
        {2, 4, 1, 65, 129, 3, 80, true, -1, 7, false, true, 2.0, 0},
        // query_offset: top-left prefill (a prompt in an empty static cache), shifted, past the keys
        {1, 2, 1, 100, 257, 64, 64, true, -1, -1, false, false, 1.0, 0, 0},
        {2, 4, 2, 40, 130, 17, 3, true, 20, -1, true, true, 1.0, 0, 60},
        {1, 2, 2, 5, 100, 80, 80, true, -1, -1, false, false, 1.0, 0, 10},
        {1, 2, 2, 30, 20, 3, 3, true, -1, -1, false, false, 1.0, 0, 15},
        // paged caches (block table): decode and prefill, block sizes 1, 7, 16, 64
        {2, 4, 2, 1, 100, 17, 3, true, -1, -1, false, true, 1.0, 0, kBottomRight, 7},
        {1, 4, 1, 5, 257, 64, 64, true, -1, -1, true, false, 1.0, 0, kBottomRight, 16},
        {1, 4, 2, 3, 1100, 130, 130, true, 50, -1, false, false, 1.0, 0, kBottomRight, 64},
        {2, 2, 1, 9, 40, 3, 17, false, -1, -1, false, true, 1.0, 0, kBottomRight, 1},
        {3, 2, 1, 100, 63, 64, 64, true, -1, -1, false, true, 1.0, 0, kBottomRight, 16},
        {1, 2, 2, 100, 257, 17, 130, false, 20, 5, true, false, 1.0, 0, kBottomRight, 7},
        {2, 4, 2, 40, 130, 17, 3, true, 20, -1, true, true, 1.0, 0, 60, 16},
        // score options: softcap, ALiBi, masks, sinks, alone and together (decode and prefill;
        // Tq = 100, Tk = 1100, D = 128 crosses prefill sub-blocks, tiles and super-tiles)
        {1, 4, 2, 70, 300, 17, 17, true, -1, -1, false, false, 3.0, 0, kBottomRight, 0, 3.0},
        {1, 4, 2, 70, 300, 64, 48, false, -1, -1, true, false, 1.0, 0, kBottomRight, 0, 0, 0.05},
        {2, 2, 1, 45, 700, 32, 48, true, -1, -1, false, true, 1.0, 0, kBottomRight, 0, 0, 0, 1},
        {1, 2, 2, 100, 100, 80, 80, true, 30, -1, false, false, 1.0, 0, kBottomRight, 0, 0, 0, 2, true},
        {2, 4, 1, 3, 300, 64, 64, true, -1, -1, false, true, 2.0, 0, kBottomRight, 0, 4.0, 0.02, 1, true},
        {1, 4, 2, 9, 200, 16, 16, false, -1, -1, false, false, 1.0, 0, kBottomRight, 0, 0, 0, 2},
        {1, 4, 2, 100, 1100, 128, 128, true, -1, -1, false, false, 2.0, 0, kBottomRight, 0, 5.0, 0.01, 1, true},
        {1, 2, 1, 40, 130, 17, 3, true, 20, -1, true, true, 1.0, 0, 60, 0, 2.0, 0.1, 2, true},
    };
}

// `n` random problems (a longer, optional soak: test_tiers --random N [seed]), each at most
// ~2e6 multiply-adds.
std::vector<Case> random_cases(int n, uint64_t seed) {
    Rng rng{seed};
    auto pick = [&](int64_t lo, int64_t hi) {  // uniform in [lo, hi]
        return lo + static_cast<int64_t>((rng.next(1.0) + 1.0) * 0.5 * static_cast<double>(hi - lo + 1)) % (hi - lo + 1);
    };
    std::vector<Case> cases;
    for (int i = 0; i < n; ++i) {
        Case c{};
        c.B = pick(1, 3);
        c.Hkv = pick(1, 2);
        c.H = c.Hkv * (int64_t(1) << pick(0, 2));
        c.Tq = pick(0, 1) ? pick(1, 16) : pick(17, 400);
        c.Tk = pick(0, 3) ? pick(1, 400) : pick(401, 1500);
        c.D = pick(0, 4) ? pick(1, 160) : pick(161, 300);
        c.Dv = pick(0, 2) ? c.D : pick(1, 300);
        c.causal = pick(0, 1) == 1;
        c.wl = pick(0, 2) ? -1 : pick(0, 60);
        c.wr = pick(0, 2) ? -1 : pick(0, 60);
        c.strided = pick(0, 1) == 1;
        c.seqlens = pick(0, 2) == 0;
        c.amp = static_cast<double>(pick(1, 3));
        while (c.Tq > 17 && c.B * c.H * c.Tq * c.Tk * (c.D + c.Dv) > 2000000) c.Tq = c.Tq / 2 > 17 ? c.Tq / 2 : 17;
        while (c.B * c.H * c.Tq * c.Tk * (c.D + c.Dv) > 2000000 && c.Tk > 1) c.Tk /= 2;
        cases.push_back(c);
    }
    return cases;
}

std::vector<Case> g_cases;  // the accuracy cases of this run (fixed matrix or random)

std::vector<Case> nan_cases() {
    //      B  H Hkv  Tq    Tk    D    Dv  causal  wl   wr  strided seqlens amp nan
    return {
        {1, 2, 1, 5, 63, 17, 17, true, -1, -1, false, false, 1.0, 1},     // decode, q
        {1, 2, 1, 5, 63, 17, 17, true, -1, -1, false, false, 1.0, 2},     // decode, k
        {1, 2, 2, 100, 100, 64, 64, true, -1, -1, false, false, 1.0, 1},  // prefill, q
        {1, 2, 2, 100, 100, 64, 64, true, -1, -1, false, false, 1.0, 2},  // prefill, k
        {1, 4, 2, 63, 63, 3, 17, false, 5, 5, true, false, 1.0, 2},       // prefill, k, window
    };
}

// One case in every dtype combination attention_forward takes (q's / k and v's); returns
// the failures, counts the problems run in `checks`.
long run_dtypes(const Case& c, uint64_t& seed, long& checks) {
    long failed = 0;
    auto run = [&](bool ok) { ++checks, failed += ok ? 0 : 1; };
    run(run_case<float>(c, seed++, "f32"));
    run(run_case<double>(c, seed++, "f64"));
    run(run_case<Bf16>(c, seed++, "bf16"));
    run(run_case<F16>(c, seed++, "f16"));
    run(run_case<float, Bf16>(c, seed++, "f32/bf16"));
    run(run_case<float, F16>(c, seed++, "f32/f16"));
    run(run_case<float, I8>(c, seed++, "f32/i8"));
    run(run_case<Bf16, I8>(c, seed++, "bf16/i8"));
    run(run_case<F16, I8>(c, seed++, "f16/i8"));
    run(run_case<float, F8>(c, seed++, "f32/f8"));
    run(run_case<Bf16, F8>(c, seed++, "bf16/f8"));
    run(run_case<F16, F8>(c, seed++, "f16/f8"));
    run(run_case<float, F8E5M2>(c, seed++, "f32/f8e5m2"));
    run(run_case<Bf16, F8E5M2>(c, seed++, "bf16/f8e5m2"));
    return failed;
}

// Every finite value of a 16-bit type T (subnormals and the largest included) through the
// prefill and back: V holds them all, window (0, 0) lets each row see only its own key (q and
// k ones, weight exactly 1), so out must be V bit for bit (a -0 may come back +0). Checks the
// tier's widening of K/V and its rounding of out. flushes_subnormals: subnormal values may come
// back as zeros (vdpbf16ps treats its subnormal inputs as zero). Returns whether it held.
template <class T>
bool round_trip_16bit(const char* dtype, bool flushes_subnormals = false) {
    std::vector<T> v;
    for (uint32_t b = 0; b < 65536; ++b) {
        T x;
        x.bits = static_cast<uint16_t>(b);
        if (std::isfinite(static_cast<double>(x))) v.push_back(x);
    }
    const int64_t H = 8, D = 64, T_ = static_cast<int64_t>(v.size()) / (H * D);  // f16: 124; bf16: 127 (+ rest)
    v.resize(static_cast<size_t>(H * T_ * D));
    std::vector<T> ones(v.size(), T(1.0)), out(v.size(), T(kNaN));
    attnfast::AttentionParams p = attnfast::default_params();
    p.dtype = p.kv_dtype = dtype_of<T>();
    p.q = ones.data(), p.k = ones.data(), p.v = v.data(), p.out = out.data();
    p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.out_batch_stride = H * T_ * D;
    p.q_head_stride = p.k_head_stride = p.v_head_stride = p.out_head_stride = T_ * D;
    p.q_row_stride = p.k_row_stride = p.v_row_stride = p.out_row_stride = D;
    p.batch = 1, p.heads = p.kv_heads = H, p.seqlen_q = p.seqlen_k = T_, p.head_dim = p.head_dim_v = D;
    p.scale = 1.0, p.window_left = 0, p.window_right = 0, p.num_threads = 3;
    try {
        attnfast::attention_forward(p);
    } catch (const std::exception& e) {
        std::printf("  FAIL %s round trip: attention_forward threw: %s\n", dtype, e.what());
        return false;
    }
    const uint16_t exponent = std::is_same<T, F16>::value ? 0x7C00 : 0x7F80;
    for (size_t x = 0; x < v.size(); ++x)
        if (out[x].bits != v[x].bits && !(v[x].bits == 0x8000 && out[x].bits == 0) &&
            !(flushes_subnormals && (v[x].bits & exponent) == 0 && (out[x].bits & 0x7FFF) == 0)) {
            std::printf("  FAIL %s round trip: value bits 0x%04x came back as 0x%04x\n", dtype, v[x].bits, out[x].bits);
            return false;
        }
    return true;
}

// int4 cache (DType::kQ4): rows of 20-byte blocks (bfloat16 scale, bfloat16 minimum, 16 bytes
// of nibbles: value i low, value i + 16 high), decoded here from that layout. Decode (Tq 1, 3)
// and a prompt chunk (Tq 40: the decode loop in row blocks), GQA, D and Dv that are and are
// not whole vectors, contiguous and paged; float32 q; 1 and 3 threads the same bits.
bool run_int4_case(int64_t H, int64_t Hkv, int64_t Tq, int64_t Tk, int64_t D, int64_t Dv, uint64_t seed) {
    const int64_t gk = (D + 31) / 32, gv = (Dv + 31) / 32, rk = 20 * gk, rv = 20 * gv;
    Rng rng{seed};
    std::vector<uint8_t> k(static_cast<size_t>(Hkv * Tk * rk)), v(static_cast<size_t>(Hkv * Tk * rv));
    auto fill = [&](std::vector<uint8_t>& rows, int64_t row_bytes) {
        for (int64_t r = 0; r < static_cast<int64_t>(rows.size()) / row_bytes; ++r)
            for (int64_t g = 0; g < row_bytes / 20; ++g) {
                uint8_t* blk = rows.data() + r * row_bytes + g * 20;
                const Bf16 scale(0.02 + 0.01 * rng.next(1.0)), minimum(-0.15 + 0.05 * rng.next(1.0));
                std::memcpy(blk, &scale.bits, 2);
                std::memcpy(blk + 2, &minimum.bits, 2);
                for (int i = 0; i < 16; ++i) blk[4 + i] = static_cast<uint8_t>(std::lround(127.5 + 127.5 * rng.next(1.0)));
            }
    };
    fill(k, rk);
    fill(v, rv);
    auto value = [](const std::vector<uint8_t>& rows, int64_t row_bytes, int64_t r, int64_t d) {
        const uint8_t* blk = rows.data() + r * row_bytes + (d / 32) * 20;
        Bf16 scale, minimum;
        std::memcpy(&scale.bits, blk, 2);
        std::memcpy(&minimum.bits, blk + 2, 2);
        const int i = static_cast<int>(d % 32);
        const int n = i < 16 ? blk[4 + i] & 15 : blk[4 + i - 16] >> 4;
        return n * static_cast<double>(scale) + static_cast<double>(minimum);
    };
    std::vector<float> q(static_cast<size_t>(H * Tq * D)), out1(static_cast<size_t>(H * Tq * Dv)), out3 = out1;
    for (float& x : q) x = static_cast<float>(rng.next(1.0));
    attnfast::AttentionParams p = attnfast::default_params();
    p.dtype = attnfast::DType::kF32, p.kv_dtype = attnfast::DType::kQ4;
    p.q = q.data(), p.k = k.data(), p.v = v.data();
    p.q_batch_stride = H * Tq * D, p.q_head_stride = Tq * D, p.q_row_stride = D;
    p.k_batch_stride = Hkv * Tk * rk, p.k_head_stride = Tk * rk, p.k_row_stride = rk;  // bytes
    p.v_batch_stride = Hkv * Tk * rv, p.v_head_stride = Tk * rv, p.v_row_stride = rv;
    p.out_batch_stride = H * Tq * Dv, p.out_head_stride = Tq * Dv, p.out_row_stride = Dv;
    p.batch = 1, p.heads = H, p.kv_heads = Hkv, p.seqlen_q = Tq, p.seqlen_k = Tk;
    p.head_dim = D, p.head_dim_v = Dv, p.scale = 1.0 / std::sqrt(static_cast<double>(D)), p.causal = true;
    char what[128];
    std::snprintf(what, sizeof what, "int4 H=%lld Hkv=%lld Tq=%lld Tk=%lld D=%lld Dv=%lld", (long long)H,
                  (long long)Hkv, (long long)Tq, (long long)Tk, (long long)D, (long long)Dv);
    try {
        p.out = out1.data(), p.num_threads = 1;
        attnfast::attention_forward(p);
        p.out = out3.data(), p.num_threads = 3;
        attnfast::attention_forward(p);
    } catch (const std::exception& e) {
        std::printf("  FAIL %s: attention_forward threw: %s\n", what, e.what());
        return false;
    }
    if (std::memcmp(out1.data(), out3.data(), out1.size() * sizeof(float)) != 0) {
        std::printf("  FAIL %s: 1 and 3 threads differ\n", what);
        return false;
    }
    // paged: the same rows in blocks of 16 taken in reverse order
    const int64_t bs = 16, per = (Tk + bs - 1) / bs;
    std::vector<uint8_t> kp(static_cast<size_t>(per * Hkv * bs * rk)), vp(static_cast<size_t>(per * Hkv * bs * rv));
    std::vector<int64_t> table(static_cast<size_t>(per));
    for (int64_t i = 0; i < per; ++i) {
        const int64_t id = per - 1 - i;
        table[i] = id;
        for (int64_t g = 0; g < Hkv; ++g)
            for (int64_t r = 0; r < bs && i * bs + r < Tk; ++r) {
                std::memcpy(&kp[((id * Hkv + g) * bs + r) * rk], &k[(g * Tk + i * bs + r) * rk], rk);
                std::memcpy(&vp[((id * Hkv + g) * bs + r) * rv], &v[(g * Tk + i * bs + r) * rv], rv);
            }
    }
    std::vector<float> outp(out1.size());
    std::vector<int64_t> lens{Tk};
    attnfast::AttentionParams pp = p;
    pp.k = kp.data(), pp.v = vp.data();
    pp.k_batch_stride = Hkv * bs * rk, pp.k_head_stride = bs * rk;
    pp.v_batch_stride = Hkv * bs * rv, pp.v_head_stride = bs * rv;
    pp.block_table = table.data(), pp.block_table_batch_stride = per, pp.block_size = bs;
    pp.num_blocks = per, pp.seqlen_k = per * bs, pp.seqlens_k = lens.data(), pp.out = outp.data();
    try {
        attnfast::attention_forward(pp);
    } catch (const std::exception& e) {
        std::printf("  FAIL %s: paged attention_forward threw: %s\n", what, e.what());
        return false;
    }
    if (std::memcmp(out1.data(), outp.data(), out1.size() * sizeof(float)) != 0) {
        std::printf("  FAIL %s: paged differs from contiguous\n", what);
        return false;
    }
    const int64_t group = H / Hkv;
    std::vector<double> s(static_cast<size_t>(Tk));
    for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < Tq; ++i) {
            const int64_t last = i + Tk - Tq, g = h / group;  // causal, bottom-right
            double m = -kInf, sum = 0;
            for (int64_t j = 0; j <= last; ++j) {
                double dot = 0;
                for (int64_t d = 0; d < D; ++d) dot += q[(h * Tq + i) * D + d] * value(k, rk, g * Tk + j, d);
                s[j] = dot * p.scale;
                m = std::max(m, s[j]);
            }
            for (int64_t j = 0; j <= last; ++j) sum += std::exp(s[j] - m);
            for (int64_t e = 0; e < Dv; ++e) {
                double o = 0;
                for (int64_t j = 0; j <= last; ++j) o += std::exp(s[j] - m) * value(v, rv, g * Tk + j, e);
                const double want = o / sum, got = out1[(h * Tq + i) * Dv + e];
                if (!(std::fabs(got - want) <= 2e-5 + 2e-5 * std::fabs(want))) {
                    std::printf("  FAIL %s: out at h=%lld row=%lld col=%lld: got %.9g, want %.9g\n", what,
                                (long long)h, (long long)i, (long long)e, got, want);
                    return false;
                }
            }
        }
    return true;
}

long run_int4_cases(long& checks) {
    long failures = 0;
    uint64_t seed = 77;
    const int64_t cases[][6] = {{8, 8, 1, 300, 128, 128}, {8, 2, 3, 150, 64, 80}, {4, 4, 1, 100, 80, 64},
                                {4, 1, 40, 130, 128, 128}, {2, 2, 1, 50, 33, 20}};
    for (const auto& c : cases) {
        ++checks;
        failures += run_int4_case(c[0], c[1], c[2], c[3], c[4], c[5], seed++) ? 0 : 1;
    }
    return failures;
}

// attention_backward on the active tier, accumulator type A (float32 or float64 inputs):
// B = 2, H = 4, Hkv = 2 (GQA), Tq = 70, Tk = 90 (bottom-right causal, window_left 50),
// softcap 4, D = 40 and Dv = 20 (padded to whole vectors inside), against the float64
// gradients of a materialised softmax written here. Threads 1 and 3 run the two schedules
// (fused / two-pass: 4 groups), which must give the same bits. With `sparse`, a key_index
// (one list per query shared by the heads, in descending positions, -1 for about a fifth of
// the keys: the others listed) and its own two passes. Returns the failures.
template <class A>
long run_backward_case(uint64_t seed, long& checks, bool sparse = false) {
    const int64_t B = 2, H = 4, Hkv = 2, Tq = 70, Tk = 90, D = 40, Dv = 20, wl = 50;
    const double cap = 4.0, scale = 1.0 / std::sqrt(static_cast<double>(D));
    const double tol = sizeof(A) == 4 ? 1e-4 : 1e-10;  // of the largest |gradient|
    Rng rng{seed};
    auto fill = [&](std::vector<A>& x, int64_t n, double amp) {
        x.resize(static_cast<size_t>(n));
        for (A& e : x) e = static_cast<A>(rng.next(amp));
    };
    std::vector<A> q, k, v, dout;
    fill(q, B * H * Tq * D, 2.0), fill(k, B * Hkv * Tk * D, 2.0), fill(v, B * Hkv * Tk * Dv, 1.0);
    fill(dout, B * H * Tq * Dv, 1.0);
    std::vector<A> out(static_cast<size_t>(B * H * Tq * Dv)), lse(static_cast<size_t>(B * H * Tq));
    attnfast::AttentionParams p = attnfast::default_params();
    p.dtype = p.kv_dtype = dtype_of<A>();
    p.q = q.data(), p.k = k.data(), p.v = v.data(), p.out = out.data(), p.lse = lse.data();
    p.q_batch_stride = H * Tq * D, p.q_head_stride = Tq * D, p.q_row_stride = D;
    p.k_batch_stride = Hkv * Tk * D, p.k_head_stride = Tk * D, p.k_row_stride = D;
    p.v_batch_stride = Hkv * Tk * Dv, p.v_head_stride = Tk * Dv, p.v_row_stride = Dv;
    p.out_batch_stride = H * Tq * Dv, p.out_head_stride = Tq * Dv, p.out_row_stride = Dv;
    p.lse_batch_stride = H * Tq, p.lse_head_stride = Tq, p.lse_row_stride = 1;
    p.batch = B, p.heads = H, p.kv_heads = Hkv, p.seqlen_q = Tq, p.seqlen_k = Tk;
    p.head_dim = D, p.head_dim_v = Dv, p.scale = scale, p.causal = true, p.window_left = wl;
    p.softcap = cap, p.num_threads = 1;
    auto listed = [&](int64_t i, int64_t j) { return !sparse || (j * 7 + i * 3) % 5 != 0; };
    std::vector<int32_t> key_index;
    if (sparse) {
        key_index.resize(static_cast<size_t>(B * Tq * Tk));
        for (int64_t b = 0; b < B; ++b)
            for (int64_t i = 0; i < Tq; ++i)
                for (int64_t x = 0; x < Tk; ++x) {
                    const int64_t j = Tk - 1 - x;
                    key_index[static_cast<size_t>((b * Tq + i) * Tk + x)] = listed(i, j) ? static_cast<int32_t>(j) : -1;
                }
        p.key_index = key_index.data();
        p.key_index_batch_stride = Tq * Tk, p.key_index_head_stride = 0, p.key_index_row_stride = Tk;
        p.key_index_count = Tk;
    }
    std::vector<A> delta(static_cast<size_t>(B * H * Tq));
    const int64_t Dp = attnfast::backward_padded(D);
    std::vector<A> dq[2], dk[2], dv[2];
    try {
        attnfast::attention_forward(p);
        for (int64_t r = 0; r < B * H * Tq; ++r) {
            double sum = 0;
            for (int64_t e = 0; e < Dv; ++e) sum += static_cast<double>(dout[r * Dv + e]) * out[r * Dv + e];
            delta[r] = static_cast<A>(sum);
        }
        for (int run = 0; run < 2; ++run) {
            dq[run].assign(static_cast<size_t>(B * H * Tq * Dp), A(0));
            dk[run].assign(static_cast<size_t>(B * Hkv * Tk * D), A(0));
            dv[run].assign(static_cast<size_t>(B * Hkv * Tk * Dv), A(0));
            attnfast::BackwardParams bp;
            bp.attn = p;
            bp.attn.num_threads = run == 0 ? 1 : 3;
            bp.dout = dout.data();
            bp.dout_batch_stride = H * Tq * Dv, bp.dout_head_stride = Tq * Dv, bp.dout_row_stride = Dv;
            bp.delta = delta.data();
            bp.dq = dq[run].data(), bp.dq_row_stride = Dp, bp.dk = dk[run].data(), bp.dv = dv[run].data();
            attnfast::attention_backward(bp);
        }
    } catch (const std::exception& e) {
        std::printf("  FAIL backward%s (%s): threw: %s\n", sparse ? " key_index" : "", sizeof(A) == 4 ? "f32" : "f64",
                    e.what());
        return 1;
    }
    // The reference: s = scale q.k, softcapped, P over the visible keys, dS = P (dP - rowsum(P dP)) (1 - tanh^2).
    std::vector<double> rq(static_cast<size_t>(B * H * Tq * D)), rk(dk[0].size()), rv(dv[0].size());
    std::vector<double> pr(static_cast<size_t>(Tk)), th(pr.size()), dp(pr.size());
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
            for (int64_t i = 0; i < Tq; ++i) {
                const int64_t g = h / (H / Hkv), a = i + Tk - Tq;
                const A* qi = &q[((b * H + h) * Tq + i) * D];
                const A* di = &dout[((b * H + h) * Tq + i) * Dv];
                double m = -kInf, l = 0;
                for (int64_t j = 0; j < Tk; ++j) {
                    const A* kj = &k[((b * Hkv + g) * Tk + j) * D];
                    double dot = 0;
                    for (int64_t e = 0; e < D; ++e) dot += static_cast<double>(qi[e]) * kj[e];
                    th[j] = std::tanh(scale * dot / cap);
                    pr[j] = j <= a && j >= a - wl && listed(i, j) ? cap * th[j] : -kInf;
                    m = std::max(m, pr[j]);
                }
                for (int64_t j = 0; j < Tk; ++j) l += pr[j] == -kInf ? 0 : std::exp(pr[j] - m);
                double dsum = 0;
                for (int64_t j = 0; j < Tk; ++j) {
                    pr[j] = pr[j] == -kInf ? 0 : std::exp(pr[j] - m) / l;
                    const A* vj = &v[((b * Hkv + g) * Tk + j) * Dv];
                    dp[j] = 0;
                    for (int64_t e = 0; e < Dv; ++e) dp[j] += static_cast<double>(di[e]) * vj[e];
                    dsum += pr[j] * dp[j];
                }
                for (int64_t j = 0; j < Tk; ++j) {
                    if (pr[j] == 0) continue;
                    const double ds = pr[j] * (dp[j] - dsum) * (1 - th[j] * th[j]) * scale;
                    const int64_t kr = (b * Hkv + g) * Tk + j;
                    for (int64_t e = 0; e < D; ++e) {
                        rq[((b * H + h) * Tq + i) * D + e] += ds * k[kr * D + e];
                        rk[kr * D + e] += ds * qi[e];
                    }
                    for (int64_t e = 0; e < Dv; ++e) rv[kr * Dv + e] += pr[j] * di[e];
                }
            }
    long failures = 0;
    auto compare = [&](const char* name, const std::vector<A>& got, const std::vector<A>& got3,
                       const std::vector<double>& want, int64_t width, int64_t stride) {
        ++checks;
        double big = 0, err = 0;
        bool same_bits = true;
        for (size_t r = 0; r < want.size() / width; ++r)
            for (int64_t e = 0; e < width; ++e) {
                const A x = got[r * stride + e], x3 = got3[r * stride + e];
                big = std::max(big, std::fabs(want[r * width + e]));
                err = std::max(err, std::isnan(x) ? kInf : std::fabs(x - want[r * width + e]));
                same_bits = same_bits && std::memcmp(&x, &x3, sizeof x) == 0;
            }
        if (err > tol * big || !same_bits) {
            std::printf("  FAIL backward%s %s (%s): max error %.3g of max |%s| %.3g; 1 and 3 threads %s\n",
                        sparse ? " key_index" : "", name, sizeof(A) == 4 ? "f32" : "f64", err, name, big,
                        same_bits ? "agree" : "DIFFER");
            ++failures;
        }
    };
    compare("dq", dq[0], dq[1], rq, D, Dp);
    compare("dk", dk[0], dk[1], rk, D, D);
    compare("dv", dv[0], dv[1], rv, Dv, Dv);
    return failures;
}

// All cases on the active tier, in every dtype combination.
void run_tier(const std::string& tier, bool nan_only, Stats& total) {
    Stats st;
    long nan_failed = 0, nan_checked = 0;
    uint64_t seed = 1;
    g_bf16_rounds_p = tier == "avx512bf16";
    if (!nan_only)
        for (const Case& c : g_cases) st.failures += run_dtypes(c, seed, st.checks);
    for (const Case& c : nan_cases()) nan_failed += run_dtypes(c, seed, nan_checked);
    if (!nan_only) {
        st.checks += 2;
        st.failures += round_trip_16bit<F16>("f16") ? 0 : 1;
        st.failures += round_trip_16bit<Bf16>("bf16", g_bf16_rounds_p) ? 0 : 1;
        st.failures += run_int4_cases(st.checks);
        st.failures += run_backward_case<float>(91, st.checks);
        st.failures += run_backward_case<double>(92, st.checks);
        st.failures += run_backward_case<float>(93, st.checks, true);
        st.failures += run_backward_case<double>(94, st.checks, true);
    }
    st.checks += nan_checked;
    const bool known = nan_known_to_fail(tier);
    if (known) {
        st.xfail += nan_failed;
        if (nan_failed == 0) st.xpass += 1;
    } else {
        st.failures += nan_failed;
    }
    std::printf("tier %-8s %4ld problems (14 dtype combinations, threads 1 and 3): %ld failed%s\n", tier.c_str(),
                st.checks, st.failures,
                known ? (nan_failed ? "  [NaN-contract failures XFAIL]" : "  [XPASS: NaN contract now holds]") : "");
    std::fflush(stdout);
    total.checks += st.checks;
    total.failures += st.failures;
    total.xfail += st.xfail;
    total.xpass += st.xpass;
}

std::vector<std::string> split(const std::string& s) {
    std::vector<std::string> parts;
    size_t at = 0;
    while (at <= s.size()) {
        const size_t comma = s.find(',', at);
        const std::string part = s.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
        if (!part.empty()) parts.push_back(part);
        if (comma == std::string::npos) break;
        at = comma + 1;
    }
    return parts;
}

// The benchmarks' read kernel (read_probe, the best tier's loads): the XOR of the whole 8-byte
// words of odd-sized, unaligned buffers of several 4 MiB pieces, for 1 and 3 threads, against
// a plain loop. Returns the failures.
long check_read_probe() {
    std::vector<unsigned char> buffer((size_t(9) << 20) + 77);
    uint64_t state = 88172645463325252ull;
    for (unsigned char& b : buffer) {
        state ^= state << 13, state ^= state >> 7, state ^= state << 17;
        b = static_cast<unsigned char>(state >> 56);
    }
    long failures = 0;
    for (size_t offset : {size_t(0), size_t(1), size_t(13)})
        for (size_t bytes : {size_t(0), size_t(7), size_t(8), size_t(300), size_t(4) << 20, buffer.size() - offset}) {
            uint64_t expected = 0;
            for (size_t w = 0; w + 8 <= bytes; w += 8) {
                uint64_t word;
                std::memcpy(&word, buffer.data() + offset + w, 8);
                expected ^= word;
            }
            for (int threads : {1, 3})
                if (attnfast::read_probe(buffer.data() + offset, static_cast<int64_t>(bytes), threads) != expected) {
                    std::printf("FAIL: read_probe, %zu bytes at offset %zu, %d threads\n", bytes, offset, threads);
                    ++failures;
                }
        }
    return failures;
}

}  // namespace

int main(int argc, char** argv) {
    const bool nan_only = argc > 1 && std::strcmp(argv[1], "--nan") == 0;
    // int8 caches through the exact widening path: this test's tolerance is float32 rounding
    // (the avx512bf16 tier's vpdpbusd path rounds q to int8: tests/test_lowbit.py checks it)
    setenv("ATTNFAST_INT8_DOT", "widen", 1);
    g_cases = accuracy_cases();
    if (argc > 2 && std::strcmp(argv[1], "--random") == 0)
        g_cases = random_cases(std::atoi(argv[2]), argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 12345);
    if (const char* x = std::getenv("ATTNFAST_TEST_NAN_XFAIL")) g_xfail_tiers = "," + std::string(x) + ",";
    const std::string compiled = attnfast::isa_compiled(), available = attnfast::isa_available();
    const std::string automatic = attnfast::isa_selected();
    std::printf("attnfast tiers compiled: %s; this CPU runs: %s; automatic choice: %s; OpenMP: %s\n",
                compiled.c_str(), available.c_str(), automatic.c_str(), attnfast::openmp_runtime_name());
    long setup_failures = 0;
#if defined(__aarch64__)
    // NEON is part of AArch64: the tier must be built, runnable and the automatic choice.
    if (available.find("neon") == std::string::npos ||
        (!std::getenv("ATTNFAST_ISA") && automatic != "neon")) {
        std::printf("FAIL: on aarch64 'neon' must be available and chosen by default\n");
        ++setup_failures;
    }
#endif
    if (attnfast::isa_force("no-such-tier")) {
        std::printf("FAIL: isa_force accepted an unknown tier\n");
        ++setup_failures;
    }
    Stats total;
    std::vector<std::string> tiers = split(available);
    if (const char* only = std::getenv("ATTNFAST_TEST_TIERS")) tiers = split(only);  // (forcing fails below
                                                                                     // on a tier it lacks)
    for (const std::string& tier : tiers) {
        if (!attnfast::isa_force(tier.c_str()) || tier != attnfast::isa_selected()) {
            std::printf("FAIL: could not force tier %s: %s\n", tier.c_str(), attnfast::isa_error());
            ++setup_failures;
            continue;
        }
        run_tier(tier, nan_only, total);
    }
    attnfast::isa_force("");
    setup_failures += check_read_probe();
    total.failures += setup_failures;
    std::printf("SUMMARY: %zu tiers x %zu cases (%s): %ld problems checked, %ld failed", tiers.size(),
                (nan_only ? 0 : g_cases.size()) + nan_cases().size(),
                nan_only ? "NaN contract only" : "accuracy + NaN contract", total.checks, total.failures);
    if (total.xfail || total.xpass) std::printf(", %ld known NaN-contract failures (XFAIL), %ld XPASS", total.xfail, total.xpass);
    std::printf("\n%s\n", total.failures == 0 ? "PASS" : "FAIL");
    return total.failures == 0 ? 0 : 1;
}
