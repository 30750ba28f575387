"""Many query rows per KV head on separate K and V (GQA with several query tokens:
speculative trees, multi-token prediction, stacked shared-prefix forks): the GEMM-shaped
decode kernel ("gemm_decode") from 32 rows per KV head, and queries of 17-64 rows kept on
the decode path where a decode kernel takes them, against the float64 reference."""
import ml_dtypes
import numpy as np
import pytest

import attnfast as af
from reference import TOLERANCE, reference_attention

F32 = np.dtype(np.float32)
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)


def rand(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def simd_tier():
    """The GEMM-shaped and hand-written decode kernels exist on the x86 SIMD tiers only."""
    return af._ext.runtime_info()["isa"] in ("avx2", "avx512", "avx512bf16")


def gemm_expected(dtype):
    """gemm_decode on the x86 SIMD tiers, but for bfloat16 q, K, V on avx512bf16 (which keeps
    its vdpbf16ps kernels)."""
    isa = af._ext.runtime_info()["isa"]
    return simd_tier() and not (isa == "avx512bf16" and dtype == BF16)


def tolerance(dtype):
    return dict(rtol=1e-2, atol=1e-2) if dtype in (BF16, F16) else TOLERANCE[F32]


def gqa(rng, dtype, *, B=1, H=32, Hkv=8, tq=8, L=1500, D=64, Dv=None, kv_dtype=None):
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    return (rand(rng, (B, H, tq, D), dtype), rand(rng, (B, Hkv, L, D), kv_dtype),
            rand(rng, (B, Hkv, L, Dv or D), kv_dtype))


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("heads,tq", [((32, 8), 8), ((32, 8), 16), ((8, 8), 32), ((16, 2), 4),
                                      ((6, 2), 13)])
def test_many_rows_per_kv_head_match_reference(dtype, heads, tq):
    rng = np.random.default_rng(tq * 100 + heads[0])
    H, Hkv = heads
    q, k, v = gqa(rng, dtype, H=H, Hkv=Hkv, tq=tq, L=2300, D=72, Dv=40)
    for causal in (False, True):
        out, lse = af.attention(q, k, v, causal=causal, return_lse=True, num_threads=2)
        ref, ref_lse, _ = reference_attention(q, k, v, causal=causal)
        np.testing.assert_allclose(out.astype(np.float64), ref, **tolerance(dtype))
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-4, atol=1e-4)
        plan = af.explain(q, k, v, causal=causal)
        assert plan["latent_kv"] is False
        if gemm_expected(dtype):
            assert plan["kernel"] == "gemm_decode" and plan["regime"] == "compute"
            assert plan["path"] == "decode" and plan["rows_per_kv_read"] == H // Hkv * tq


@pytest.mark.parametrize("kv_dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_gemm_decode_options_paged_and_strided(kv_dtype):
    rng = np.random.default_rng(5)
    H, Hkv, tq, L, D = 16, 4, 9, 1100, 128
    q = rand(rng, (2, H, tq, D))
    k = rand(rng, (2, L, Hkv, D), kv_dtype).transpose(0, 2, 1, 3)  # strided views
    v = rand(rng, (2, L, Hkv, D), kv_dtype).transpose(0, 2, 1, 3)
    q4 = q * 4  # scores large enough for softcap to bite
    sinks = rng.standard_normal(H).astype(np.float32)
    for opts in (dict(softcap=5.0), dict(scale=0.3, causal=True), dict(window=(200, 0), causal=True),
                 dict(sinks=sinks)):
        qo = q4 if "softcap" in opts else q
        out, lse = af.attention(qo, k, v, return_lse=True, **opts)
        ref, ref_lse, _ = reference_attention(qo, k, v, **opts)
        np.testing.assert_allclose(out.astype(np.float64), ref, **tolerance(kv_dtype))
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-4, atol=1e-4)
        if simd_tier():
            assert af.explain(qo, k, v, **opts)["kernel"] == "gemm_decode"
    # The same keys in a paged pool, blocks scattered: the same bits as contiguous.
    bs = 16
    nblk = (L + bs - 1) // bs
    perm = rng.permutation(2 * nblk)[:2 * nblk].reshape(2, nblk)
    kc, vc = np.ascontiguousarray(k), np.ascontiguousarray(v)
    pool_k = np.zeros((2 * nblk, Hkv, bs, D), kc.dtype)
    pool_v = np.zeros_like(pool_k)
    for b in range(2):
        for i in range(nblk):
            n = min(bs, L - i * bs)
            pool_k[perm[b, i], :, :n] = kc[b, :, i * bs:i * bs + n]
            pool_v[perm[b, i], :, :n] = vc[b, :, i * bs:i * bs + n]
    paged = af.attention_with_kvcache(q, pool_k, pool_v, cache_seqlens=np.array([L, L], np.int32),
                                      block_table=perm.astype(np.int32), causal=True)
    assert np.array_equal(paged, af.attention(q, kc, vc, causal=True))


def test_gemm_decode_same_bits_any_thread_count_nan_and_unseen_rows():
    rng = np.random.default_rng(11)
    q, k, v = gqa(rng, F32, H=32, Hkv=4, tq=6, L=5000, D=64)
    one = af.attention(q, k, v, causal=True, num_threads=1)
    assert np.array_equal(one, af.attention(q, k, v, causal=True, num_threads=2))
    # Queries placed before the keys (query_offset -3, window (0, 0)): the first rows see
    # no key: zeros and lse = -inf. The reference gets the same visibility as a bool mask.
    out, lse = af.attention(q, k, v, causal=True, window=(0, 0), query_offset=-3, return_lse=True)
    seen = np.arange(5000)[None, :] == np.arange(6)[:, None] - 3
    ref, ref_lse, _ = reference_attention(q, k, v, mask=seen[None, None])
    np.testing.assert_allclose(out, ref, **TOLERANCE[F32])
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)) and np.isneginf(lse[..., :3]).all()
    assert not np.isnan(out).any() and not out[..., :3, :].any()
    if simd_tier():
        assert af.explain(q, k, v, causal=True, window=(0, 0), query_offset=-3)["kernel"] == "gemm_decode"
    v[0, 1, 77, 3] = np.nan  # NaN in, NaN out: every row of KV head 1 sees key 77's value
    out = af.attention(q, k, v)
    assert np.isnan(out[0, 8:16, :, 3]).all()
    assert np.isnan(out).sum() == out[0, 8:16, :, 3].size


@pytest.mark.parametrize("heads,tq,expected", [
    ((32, 8), 17, "gemm_decode"), ((32, 8), 64, "gemm_decode"), ((8, 8), 33, "gemm_decode"),
    ((8, 8), 17, "simd_decode"), ((8, 8), 20, "simd_decode"), ((8, 8), 21, "simd_prefill"),
    ((8, 8), 28, "simd_prefill"), ((32, 8), 65, "simd_prefill")])
def test_longer_queries_on_the_decode_path(heads, tq, expected):
    """17-64 query rows over many more keys stay on the decode path where a decode kernel
    beats prefill's whole 32-row blocks (kernel_table.hpp: kGemmDecodeMaxQueryRows); from 16
    rows per KV head that kernel is gemm_decode on the AVX-512 tiers (gemm_decode.inl:
    kMinGqaRows), up to 20 rows when fewer than 32."""
    if expected == "simd_decode" and af._ext.runtime_info()["isa"] in ("avx512", "avx512bf16"):
        expected = "gemm_decode"
    rng = np.random.default_rng(tq)
    H, Hkv = heads
    q, k, v = gqa(rng, F32, H=H, Hkv=Hkv, tq=tq, L=2000, D=64)
    out, lse = af.attention(q, k, v, causal=True, return_lse=True)
    ref, ref_lse, _ = reference_attention(q, k, v, causal=True)
    np.testing.assert_allclose(out, ref, **TOLERANCE[F32])
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-4, atol=1e-4)
    plan = af.explain(q, k, v, causal=True)
    if simd_tier():
        assert plan["kernel"] == expected
        assert plan["path"] == ("prefill" if expected == "simd_prefill" else "decode")
    # Few keys per query row: prefill, whatever the tier.
    short = af.explain(q, k[:, :, :7 * tq], v[:, :, :7 * tq], causal=True)
    assert short["path"] == "prefill"


def test_masks_alibi_and_int8_keep_the_bandwidth_kernel():
    rng = np.random.default_rng(2)
    q, k, v = gqa(rng, F32, H=32, Hkv=8, tq=8, L=900, D=64)
    mask = rng.random((1, 1, 8, 900)) > 0.3
    slopes = np.linspace(0.01, 0.1, 32).astype(np.float32)
    for opts in (dict(mask=mask), dict(alibi_slopes=slopes)):
        out = af.attention(q, k, v, **opts)
        ref, _, _ = reference_attention(q, k, v, **opts)
        np.testing.assert_allclose(out, ref, **TOLERANCE[F32])
        assert af.explain(q, k, v, **opts)["kernel"] != "gemm_decode"
