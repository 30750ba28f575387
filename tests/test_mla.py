"""MLA latent caches (issue 22, item 2): V a prefix view of K's last axis (v = k[..., :Dv]),
read once per row by the compute-shaped latent decode kernel, against the float64 reference
(which is given V as a separate array)."""
import ml_dtypes
import numpy as np
import pytest

import attnfast as af
from reference import TOLERANCE, reference_attention

F32 = np.dtype(np.float32)
BF16 = np.dtype(ml_dtypes.bfloat16)


def rand(rng, shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def latent_kernel_expected():
    """The latent kernel exists on the SIMD tiers with FMA (generic: the decode kernels)."""
    return af._ext.runtime_info()["isa"] in ("avx2", "avx512", "avx512bf16", "neon")


def tolerance(dtype):
    # bfloat16 inputs are widened exactly and accumulated in float32; out is rounded to
    # bfloat16 (8 bits of mantissa) once.
    return dict(rtol=1e-2, atol=1e-2) if dtype == BF16 else TOLERANCE[F32]


def mla_arrays(rng, dtype, *, B=1, H=16, tq=1, L=300, D=72, Dv=64):
    q = rand(rng, (B, H, tq, D), dtype)
    latent = rand(rng, (B, 1, L, D), dtype)
    return q, latent, latent[..., :Dv]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("tq", [1, 2, 3, 4])
def test_attention_latent_view_matches_reference(dtype, heads, tq):
    rng = np.random.default_rng(heads * 10 + tq)
    q, k, v = mla_arrays(rng, dtype, H=heads, tq=tq, L=2600, D=80, Dv=64)
    assert np.shares_memory(k, v)
    out, lse = af.attention(q, k, v, causal=True, return_lse=True, num_threads=2)
    ref, ref_lse, _ = reference_attention(q, k, np.array(v), causal=True)
    np.testing.assert_allclose(out.astype(np.float64), ref, **tolerance(dtype))
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-4, atol=1e-4)
    plan = af.explain(q, k, v, causal=True)
    assert plan["latent_kv"] is True and plan["rows_per_kv_read"] == heads * tq
    if latent_kernel_expected():
        assert plan["kernel"] == "latent_decode" and plan["regime"] == "compute"


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_latent_options_softcap_scale_window_sinks(dtype):
    rng = np.random.default_rng(7)
    q, k, v = mla_arrays(rng, dtype, B=2, H=32, tq=3, L=700, D=576, Dv=512)
    q4 = (q.astype(np.float32) * 4).astype(dtype)  # scores large enough for softcap to bite
    sinks = rng.standard_normal(32).astype(np.float32)
    for opts in (dict(softcap=5.0), dict(scale=0.1), dict(window=(100, 0), causal=True),
                 dict(sinks=sinks, causal=True)):
        qo = q4 if "softcap" in opts else q
        out, lse = af.attention(qo, k, v, return_lse=True, **opts)
        ref, ref_lse, _ = reference_attention(qo, k, np.array(v), **opts)
        np.testing.assert_allclose(out.astype(np.float64), ref, **tolerance(dtype))
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-4, atol=1e-4)
        if latent_kernel_expected():
            assert af.explain(qo, k, v, **opts)["kernel"] == "latent_decode"


def test_latent_same_bits_any_thread_count_and_nan():
    rng = np.random.default_rng(3)
    q, k, v = mla_arrays(rng, F32, H=64, tq=2, L=5000, D=96, Dv=64)
    one = af.attention(q, k, v, causal=True, num_threads=1)
    two = af.attention(q, k, v, causal=True, num_threads=2)
    assert np.array_equal(one, two)
    k[0, 0, 1234, 5] = np.nan  # NaN in, NaN out (every row sees key 1234)
    out = af.attention(q, k, v, causal=True)
    assert np.isnan(out).all()


def test_latent_rows_seeing_no_key_and_declined_options():
    rng = np.random.default_rng(4)
    q, k, v = mla_arrays(rng, F32, H=16, tq=4, L=2, D=40, Dv=32)
    out, lse = af.attention(q, k, v, causal=True, return_lse=True)  # rows 0, 1 see no key
    assert np.all(out[:, :, :2] == 0) and np.all(lse[:, :, :2] == -np.inf)
    ref, _, _ = reference_attention(q, k, np.array(v), causal=True)
    np.testing.assert_allclose(out[:, :, 2:], ref[:, :, 2:], **TOLERANCE[F32])
    # ALiBi and masks keep the bandwidth-shaped kernels, still correct
    q, k, v = mla_arrays(rng, F32, H=16, tq=1, L=300, D=40, Dv=32)
    slopes = np.linspace(0.01, 0.1, 16).astype(np.float32)
    assert af.explain(q, k, v, alibi_slopes=slopes)["kernel"] != "latent_decode"
    out = af.attention(q, k, v, alibi_slopes=slopes)
    ref, _, _ = reference_attention(q, k, np.array(v), alibi_slopes=slopes)
    np.testing.assert_allclose(out, ref, **TOLERANCE[F32])
    # a copy of the prefix (not a view) is a separate V: not the latent kernel (16 rows per
    # KV head: gemm_decode on the AVX-512 tiers, the bandwidth-shaped decode on the others)
    plan = af.explain(q, k, np.array(v))
    assert plan["latent_kv"] is False and plan["kernel"] != "latent_decode"


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_kvcache_latent_append_step_truncate(dtype):
    rng = np.random.default_rng(11)
    H, D, Dv = 128, 576, 512
    cache = af.KVCache(2, 1, D, 3000, dtype=dtype, v_head_dim=Dv, latent=True)
    assert cache.latent and np.shares_memory(cache.k, cache.v)
    assert cache.v.shape == (2, 1, 3000, Dv)
    rows = rand(rng, (2, 1, 2100, D), dtype)
    cache.append(rows)
    assert np.array_equal(cache.lengths, [2100, 2100])
    for tq in (1, 4):
        q = rand(rng, (2, H, tq, D), dtype)
        new = rand(rng, (2, 1, tq, D), dtype)
        out, lse = cache.step(q, new, return_lse=True)
        rows = np.concatenate([rows, new], axis=2)
        ref, ref_lse, _ = reference_attention(q, rows, rows[..., :Dv], causal=True)
        np.testing.assert_allclose(out.astype(np.float64), ref, **tolerance(dtype))
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-4, atol=1e-4)
    again = cache.attend(q)  # the fast path of a layout seen before
    np.testing.assert_allclose(again.astype(np.float64), ref, **tolerance(dtype))
    cache.truncate(2050)
    rows = rows[:, :, :2050]
    q = rand(rng, (2, H, 1, D), dtype)
    out = cache.attend(q)
    ref, _, _ = reference_attention(q, rows, rows[..., :Dv], causal=True)
    np.testing.assert_allclose(out.astype(np.float64), ref, **tolerance(dtype))
    if latent_kernel_expected():
        plan = af.explain(q, cache.k, cache.v, cache_seqlens=cache.lengths)
        assert plan["kernel"] == "latent_decode" and plan["regime"] == "compute"


def test_kvcache_latent_refuses_values_and_bad_specs():
    cache = af.KVCache(1, 1, 48, 16, v_head_dim=32, latent=True)
    k_new = np.ones((1, 1, 2, 48), np.float32)
    with pytest.raises(ValueError, match="latent"):
        cache.append(k_new, k_new[..., :32].copy())
    assert cache.lengths[0] == 0
    with pytest.raises(ValueError, match="v_head_dim must be <= head_dim"):
        af.KVCache(1, 1, 32, 16, v_head_dim=48, latent=True)
    with pytest.raises(NotImplementedError, match="int8"):
        af.KVCache(1, 1, 48, 16, v_head_dim=32, latent=True, dtype="int8")
    assert "latent=True" in repr(cache)


def test_attention_with_kvcache_latent_new_tokens():
    """The functional form over a caller-owned latent cache (and paged pool): v_new must be
    k_new's prefix (a differing v_new is refused, writing nothing)."""
    rng = np.random.default_rng(5)
    H, D, Dv, L = 32, 80, 64, 1500
    kc = np.zeros((1, 1, 2000, D), np.float32)
    kc[:, :, :L] = rand(rng, (1, 1, L, D))
    vc = kc[..., :Dv]
    q = rand(rng, (1, H, 2, D))
    new = rand(rng, (1, 1, 2, D))
    before = kc.copy()
    with pytest.raises(ValueError, match="v_new must equal"):
        af.attention_with_kvcache(q, kc, vc, L, new, rand(rng, (1, 1, 2, Dv)))
    assert np.array_equal(kc, before)
    out = af.attention_with_kvcache(q, kc, vc, L, new, new[..., :Dv])
    rows = np.concatenate([before[:, :, :L], new], axis=2)
    ref, _, _ = reference_attention(q, rows, rows[..., :Dv], causal=True)
    np.testing.assert_allclose(out, ref, **TOLERANCE[F32])
    # paged: a pool whose values are the rows' prefix
    bs = 64
    blocks = (L + 2 + bs - 1) // bs
    pool = np.zeros((blocks + 3, 1, bs, D), np.float32)
    order = rng.permutation(blocks + 3)[:blocks]
    for i, b in enumerate(order):
        chunk = rows[0, 0, i * bs:(i + 1) * bs]
        pool[b, 0, :len(chunk)] = chunk
    table = order[None, :].astype(np.int32)
    out = af.attention_with_kvcache(q, pool, pool[..., :Dv], L + 2, block_table=table)
    np.testing.assert_allclose(out, ref, **TOLERANCE[F32])
    if latent_kernel_expected():
        plan = af.explain(q, pool, pool[..., :Dv], cache_seqlens=L + 2, block_table=table)
        assert plan["kernel"] == "latent_decode" and plan["kv_source"] == "paged"


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_paged_latent_pool_equals_the_contiguous_latent_cache(dtype):
    """PagedKVCache(latent=True): one latent row per token in the pool, v a prefix view of k;
    its steps give the contiguous latent cache's bits (forks too), through the latent kernel."""
    rng = np.random.default_rng(12)
    H, D, Dv, n = 64, 576, 512, 700
    pool = af.PagedKVCache(64, 32, 1, D, dtype=dtype, v_head_dim=Dv, latent=True)
    assert pool.latent and np.shares_memory(pool.k, pool.v) and pool.v.shape[-1] == Dv
    cache = af.KVCache(2, 1, D, 1024, dtype=dtype, v_head_dim=Dv, latent=True)
    rows = rand(rng, (1, 1, n, D), dtype)
    a = pool.add_sequence()
    pool.append(a, rows[0])
    b = pool.fork(a)  # shares the blocks; the partly filled last one is copied on write
    cache.append(np.concatenate([rows, rows]))
    for tq in (1, 2):
        q = rand(rng, (2, H, tq, D), dtype)
        new = rand(rng, (2, 1, tq, D), dtype)
        got = pool.step([a, b], q, new)
        want = cache.step(q, new)
        assert got.tobytes() == want.tobytes()
        ref, _, _ = reference_attention(q[:1], np.concatenate([rows, new[:1]], axis=2)[..., :],
                                        np.concatenate([rows, new[:1]], axis=2)[..., :Dv],
                                        causal=True)
        np.testing.assert_allclose(got[:1].astype(np.float64), ref, **tolerance(dtype))
        rows = np.concatenate([rows, new[:1]], axis=2)
    if latent_kernel_expected():
        plan = af.explain(q, pool.k, pool.v, cache_seqlens=[n + 3, n + 3],
                          block_table=np.arange(2 * 23).reshape(2, 23) % 64)
        assert plan["kernel"] == "latent_decode" and plan["latent_kv"] and plan["kv_source"] == "paged"
    with pytest.raises(ValueError, match="latent"):
        pool.append(a, new[0], new[0][..., :Dv].copy())
    with pytest.raises(NotImplementedError, match="int4"):
        af.PagedKVCache(4, 16, 1, 64, dtype="int4", v_head_dim=32, latent=True)
