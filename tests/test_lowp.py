"""float16 / bfloat16 attention and caches, and the int8 KV cache, on every kernel tier.

Accuracy follows FlashAttention's rule: attnfast's max error against the float64 reference
is at most twice the error of a materialised attention computed from the same 16-bit inputs
in float32 (softmax included) and rounded to the output dtype, plus a small absolute slack.
"""
import platform

import ml_dtypes
import numpy as np
import pytest

import attnfast as af
from reference import reference_attention

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
LOWP = [F16, BF16]
SLACK = 1e-4
X86_64 = platform.machine().lower() in ("x86_64", "amd64")


def runs_simd_prefill(tier):
    """The tiers whose prefill is csrc/kernels/simd_prefill.inl: the avx ones, neon (its NEON
    branch) and generic on x86-64 (its SSE2 branch); elsewhere generic runs the templates."""
    return tier.startswith("avx") or tier == "neon" or (tier == "generic" and X86_64)


def materialised_float32(q, k, v, out_dtype, causal=False, window=None):
    """The same attention materialised in float32 from the (16-bit) inputs, rounded to
    out_dtype: the error budget a 16-bit attention is held to."""
    from reference import visible_mask
    q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
    h, hkv = q32.shape[-3], k32.shape[-3]
    k32 = np.repeat(k32, h // hkv, axis=-3)
    v32 = np.repeat(v32, h // hkv, axis=-3)
    s = np.einsum("...id,...jd->...ij", q32, k32) * np.float32(1 / np.sqrt(q.shape[-1]))
    keep = visible_mask(s.shape[-2], s.shape[-1], causal, window)
    s = np.where(keep, s, np.float32(-np.inf))
    top = np.max(s, axis=-1, keepdims=True, initial=np.float32(-np.inf))
    e = np.exp(s - np.where(np.isfinite(top), top, 0)).astype(np.float32)
    total = e.sum(-1, keepdims=True)
    w = np.where(total > 0, e / np.where(total > 0, total, 1), 0).astype(np.float32)
    return np.einsum("...ij,...jd->...id", w, v32).astype(out_dtype)


def assert_flash_rule(out, q, k, v, causal=False, window=None):
    ref, _, _ = reference_attention(q, k, v, causal=causal, window=window)
    budget = np.abs(materialised_float32(q, k, v, out.dtype, causal, window).astype(np.float64) - ref).max()
    err = np.abs(out.astype(np.float64) - ref).max()
    assert err <= 2 * budget + SLACK, f"max error {err:.3g} > 2 x {budget:.3g} + {SLACK}"


def rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("d", [1, 3, 80, 96, 256])
@pytest.mark.parametrize("tq,tk", [(1, 77), (5, 300), (37, 37), (130, 141)])
def test_16bit_matches_the_flash_rule(tier, rng, dtype, d, tq, tk):
    q, k, v = rand(rng, (1, 4, tq, d), dtype), rand(rng, (1, 2, tk, d), dtype), rand(rng, (1, 2, tk, d), dtype)
    for causal in (False, True):
        out, lse = af.attention(q, k, v, causal=causal, return_lse=True)
        assert out.dtype == dtype and lse.dtype == np.float32
        assert_flash_rule(out, q, k, v, causal)
        _, ref_lse, _ = reference_attention(q, k, v, causal=causal)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("tq", [1, 3, 100])
def test_float32_query_over_a_16bit_cache(tier, rng, dtype, tq):
    """A float32 q reads 16-bit K and V without a converted copy; out is float32."""
    q = rand(rng, (2, 8, tq, 64), np.float32)
    k, v = rand(rng, (2, 2, 200, 64), dtype), rand(rng, (2, 2, 200, 48), dtype)
    out = af.attention(q, k, v, causal=True)
    assert out.dtype == np.float32
    ref, _, _ = reference_attention(q, k, v, causal=True)  # exact from the stored values
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_strided_views_and_window(tier, rng, dtype):
    base_q = rand(rng, (1, 90, 4, 32), dtype)      # (B, T, H, D) as models hold it
    base_kv = rand(rng, (1, 90, 2, 64), dtype)
    q = base_q.transpose(0, 2, 1, 3)
    k = base_kv[..., :32].transpose(0, 2, 1, 3)    # a sliced, strided view
    v = base_kv[..., 32:].transpose(0, 2, 1, 3)
    out = af.attention(q, k, v, window=(10, 0))
    assert_flash_rule(out, q, k, v, window=(10, 0))


@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_rows_that_see_no_key(tier, rng, dtype):
    q, k, v = rand(rng, (2, 40, 16), dtype), rand(rng, (2, 30, 16), dtype), rand(rng, (2, 30, 16), dtype)
    out, lse = af.attention(q, k, v, causal=True, return_lse=True)  # rows 0..9 see nothing
    assert np.all(out[:, :10].astype(np.float32) == 0)
    assert np.all(lse[:, :10] == -np.inf)
    assert np.all(np.isfinite(out[:, 10:].astype(np.float32)))


@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("tq", [2, 70])
def test_nan_in_nan_out(tier, rng, dtype, tq):
    q, k, v = rand(rng, (2, tq, 16), dtype), rand(rng, (2, 50, 16), dtype), rand(rng, (2, 50, 16), dtype)
    k[0, 3, 0] = np.nan
    out, lse = af.attention(q, k, v, return_lse=True)
    assert np.all(np.isnan(out[0].astype(np.float32))) and np.all(np.isnan(lse[0]))
    assert np.all(np.isfinite(out[1].astype(np.float32))) and np.all(np.isfinite(lse[1]))


@pytest.mark.parametrize("dtype", LOWP + [np.dtype("int8")], ids=str)
@pytest.mark.parametrize("tq", [1, 40])
def test_thread_count_gives_the_same_bits(tier, rng, dtype, tq):
    cache = af.KVCache(1, 2, 64, 3000, dtype=dtype)
    cache.append(rand(rng, (1, 2, 2500, 64), np.float32), rand(rng, (1, 2, 2500, 64), np.float32))
    q = rand(rng, (1, 8, tq, 64), np.float32)
    one = cache.attend(q, num_threads=1)
    np.testing.assert_array_equal(cache.attend(q, num_threads=2), one)


@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_kvcache_16bit(tier, rng, dtype):
    cache = af.KVCache(2, 2, 32, 64, dtype=dtype, v_head_dim=24)
    k, v = rand(rng, (2, 2, 20, 32), dtype), rand(rng, (2, 2, 20, 24), dtype)
    q = rand(rng, (2, 4, 20, 32), dtype)
    out = cache.step(q, k, v)                      # prompt: causal prefill
    assert out.dtype == dtype
    assert_flash_rule(out, q, k, v, causal=True)
    k1, v1 = rand(rng, (2, 2, 1, 32), np.float32), rand(rng, (2, 2, 1, 24), np.float32)
    q1 = rand(rng, (2, 4, 1, 32), np.float32)      # float32 activations, 16-bit cache
    out1 = cache.step(q1, k1, v1)
    kk = np.concatenate([k, k1.astype(dtype)], axis=2)
    vv = np.concatenate([v, v1.astype(dtype)], axis=2)
    ref, _, _ = reference_attention(q1, kk, vv, causal=True)
    np.testing.assert_allclose(out1, ref, rtol=2e-5, atol=2e-5)


def int8_reference(x):
    """Independent symmetric per-row int8 round trip: what the cache holds."""
    x = x.astype(np.float64)
    scale = np.abs(x).max(-1, keepdims=True) / 127
    return np.clip(np.rint(x / np.where(scale > 0, scale, 1)), -127, 127) * scale


@pytest.mark.parametrize("qdtype", [np.dtype(np.float32), F16, BF16], ids=str)
@pytest.mark.parametrize("tq", [1, 4, 33])
def test_int8_cache(tier, rng, qdtype, tq, int8_widen):
    # The format as stored (key_rotation=None) through the exact widening path: the kernels
    # equal attention over the dequantised values (rotation and the vpdpbusd path:
    # tests/test_lowbit.py).
    cache = af.KVCache(2, 2, 64, 700, dtype="int8", key_rotation=None)
    k, v = rand(rng, (2, 2, 600, 64), np.float32), rand(rng, (2, 2, 600, 64), np.float32)
    cache.append(k, v)
    assert cache.k.dtype == np.int8 and cache.k_scale.shape == (2, 2, 700)
    q = rand(rng, (2, 8, tq, 64), qdtype)
    out = cache.attend(q)
    assert out.dtype == qdtype
    # exact against the dequantised values the cache stands for ...
    ref_q, _, _ = reference_attention(q, int8_reference(k), int8_reference(v), causal=True)
    tol = 2e-5 if qdtype == np.float32 else 2 * float(ml_dtypes.finfo(qdtype).eps)
    np.testing.assert_allclose(out.astype(np.float64), ref_q, rtol=tol, atol=tol)
    # ... and the quantisation error against the float32 data stays small
    ref, _, _ = reference_attention(q, k, v, causal=True)
    assert np.abs(out.astype(np.float64) - ref).max() < 0.02


def test_attention_with_int8_cache_writes_scales(rng):
    B, Hkv, C, D = 2, 2, 16, 8
    k_cache, v_cache = np.zeros((B, Hkv, C, D), np.int8), np.zeros((B, Hkv, C, D), np.int8)
    k_scale, v_scale = np.zeros((B, Hkv, C), np.float32), np.zeros((B, Hkv, C), np.float32)
    k_new, v_new = rand(rng, (B, Hkv, 3, D), np.float32), rand(rng, (B, Hkv, 3, D), np.float32)
    q = rand(rng, (B, 4, 3, D), np.float32)
    out = af.attention_with_kvcache(q, k_cache, v_cache, np.array([0, 5]), k_new, v_new,
                                    k_scale=k_scale, v_scale=v_scale)
    np.testing.assert_allclose(k_scale[1, :, 5:8], np.abs(k_new[1]).max(-1) / 127, rtol=1e-6)
    np.testing.assert_allclose(k_cache[0, :, :3] * k_scale[0, :, :3, None], k_new[0], atol=0.02)
    assert np.all(k_scale[0, :, 3:] == 0)
    ref, _, _ = reference_attention(q[:1], int8_reference(k_new[:1]), int8_reference(v_new[:1]), causal=True)
    np.testing.assert_allclose(out[:1], ref, rtol=2e-5, atol=2e-5)


def test_bad_16bit_and_int8_input_writes_nothing(rng):
    cache = af.KVCache(1, 2, 8, 4, dtype="int8")
    k = rand(rng, (1, 2, 1, 8), np.float32)
    cache.append(k, k)
    before = (cache.k.copy(), cache.k_scale.copy(), cache.lengths.copy())
    q = rand(rng, (1, 2, 1, 8), np.float64)
    with pytest.raises(TypeError, match="q has dtype float64 and the cache"):
        cache.step(q, k, k)
    with pytest.raises(TypeError, match="k_new for an int8 cache must be float32, float16 or bfloat16"):
        cache.step(q.astype(np.float32), k.astype(np.float64), k)
    assert all(np.array_equal(a, b) for a, b in zip(before, (cache.k, cache.k_scale, cache.lengths)))
    kc = np.zeros((1, 2, 4, 8), np.int8)
    with pytest.raises(TypeError, match="k_scale must be float32"):
        af.attention_with_kvcache(q.astype(np.float32), kc, kc.copy(), 0,
                                  k_scale=np.zeros((1, 2, 4)), v_scale=np.zeros((1, 2, 4), np.float32))
    with pytest.raises(ValueError, match=r"v_scale must have shape \(1, 2, 4\)"):
        af.attention_with_kvcache(q.astype(np.float32), kc, kc.copy(), 0,
                                  k_scale=np.zeros((1, 2, 4), np.float32), v_scale=np.zeros((1, 2, 5), np.float32))


@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_varlen_and_weights_16bit(rng, dtype):
    q, k, v = rand(rng, (9, 4, 16), dtype), rand(rng, (12, 2, 16), dtype), rand(rng, (12, 2, 16), dtype)
    out = af.attention_varlen(q, k, v, [0, 4, 9], [0, 5, 12], causal=True)
    assert out.dtype == dtype
    for (q0, q1), (k0, k1) in (((0, 4), (0, 5)), ((4, 9), (5, 12))):
        qs, ks, vs = (a.transpose(1, 0, 2) for a in (q[q0:q1], k[k0:k1], v[k0:k1]))
        assert_flash_rule(out[q0:q1].transpose(1, 0, 2), qs, ks, vs, causal=True)
    w = af.attention_weights(q.transpose(1, 0, 2), k.transpose(1, 0, 2), causal=True)
    _, _, ref_w = reference_attention(q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2), causal=True)
    assert w.dtype == dtype
    np.testing.assert_allclose(w.astype(np.float64), ref_w, atol=2 * float(ml_dtypes.finfo(dtype).eps))


# ---- the prefill kernels' converting path: each K/V super-tile widened once per task, q as
# Qᵀ is formed, the output rounded on store. Sizes that cross sub-blocks (32 rows), tiles
# and super-tiles (~1000 keys at D = 64), with GQA.

@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("d", [64, 80])
def test_16bit_prefill_across_super_tiles(tier, rng, dtype, d):
    q, k, v = rand(rng, (1, 4, 100, d), dtype), rand(rng, (1, 2, 1300, d), dtype), rand(rng, (1, 2, 1300, d), dtype)
    for causal in (False, True):
        out, lse = af.attention(q, k, v, causal=causal, return_lse=True)
        assert_flash_rule(out, q, k, v, causal)
        _, ref_lse, _ = reference_attention(q, k, v, causal=causal)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-4)


def float32_of_int8(x, scale):
    """What an int8 cache row stands for, as the kernel forms it: float32(x) * scale, one
    float32 rounding."""
    return x.astype(np.float32) * scale[..., None]


def int8_cache(rng, shape):
    x = rng.standard_normal(shape)
    scale = (np.abs(x).max(-1) / 127).astype(np.float32)
    return np.rint(x / scale[..., None]).astype(np.int8), scale


@pytest.mark.parametrize("case", ["float16", "float32 q, bfloat16 kv", "float32 q, float16 kv",
                                  "bfloat16 q, int8 kv", "float16 q, int8 kv", "float32 q, int8 kv"])
@pytest.mark.parametrize("options", [False, True])
def test_16bit_prefill_is_float32_prefill_of_the_widened_values(tier, rng, case, options):
    """Widening is exact and accumulation float32: the converting path gives the bits of the
    float32 path on the widened inputs (the same kernel and plan), rounded to the output
    dtype (round to nearest even: numpy's astype) -- options and sinks included."""
    b, h, hkv, tq, tk, d = 1, 4, 2, 200, 1500, 64  # < 64 tasks: the same plan for both
    qname, _, kvname = case.partition(" q, ")
    qdt = BF16 if qname.startswith("bfloat16") else np.dtype(qname.split()[0])
    kv = kvname.split()[0] if kvname else qname
    q = rand(rng, (b, h, tq, d), qdt)
    opts = {}
    if options:
        opts = dict(softcap=4.0, alibi_slopes=np.full(h, 0.02, np.float32), sinks=np.ones(h, np.float32),
                    mask=rng.random((b, 1, tq, tk)) < 0.8)
    if kv == "int8":
        if not runs_simd_prefill(tier):
            pytest.skip("the templates multiply an int8 V row's scale into the weight, not the value")
        (k8, ks), (v8, vs) = int8_cache(rng, (b, hkv, tk, d)), int8_cache(rng, (b, hkv, tk, d))
        out, lse = af.attention_with_kvcache(q, k8, v8, tk, k_scale=ks, v_scale=vs, return_lse=True, **opts)
        k32, v32 = float32_of_int8(k8, ks), float32_of_int8(v8, vs)
    else:
        kvdt = BF16 if kv == "bfloat16" else np.dtype(kv)
        k, v = rand(rng, (b, hkv, tk, d), kvdt), rand(rng, (b, hkv, tk, d), kvdt)
        out, lse = af.attention(q, k, v, causal=True, return_lse=True, **opts)
        k32, v32 = k.astype(np.float32), v.astype(np.float32)
    out32, lse32 = af.attention(q.astype(np.float32), k32, v32, causal=True, return_lse=True, **opts)
    assert out.dtype == qdt
    np.testing.assert_array_equal(out, out32.astype(qdt))
    np.testing.assert_array_equal(lse, lse32)


@pytest.mark.parametrize("qdtype", [np.dtype(np.float32), F16, BF16], ids=str)
def test_int8_prefill_across_super_tiles(tier, rng, qdtype):
    (k8, ks), (v8, vs) = int8_cache(rng, (1, 2, 2300, 64)), int8_cache(rng, (1, 2, 2300, 48))
    q = rand(rng, (1, 8, 40, 64), qdtype)
    out = af.attention_with_kvcache(q, k8, v8, 2300, k_scale=ks, v_scale=vs)
    ref, _, _ = reference_attention(q, float32_of_int8(k8, ks), float32_of_int8(v8, vs), causal=True)
    tol = 2e-5 if qdtype == np.float32 else 2 * float(ml_dtypes.finfo(qdtype).eps)
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_16bit_prefill_rounds_nan_and_extremes(tier, rng, dtype):
    """NaN stays NaN on store; large outputs (float16: near its largest value) round to
    themselves, never to inf. (bfloat16's range is float32's: the float32 accumulator of
    50 such values would overflow, so a smaller one.)"""
    big = min(float(ml_dtypes.finfo(dtype).max) / 2, 1e30)
    q, k = rand(rng, (1, 2, 50, 16), dtype), rand(rng, (1, 2, 50, 16), dtype)
    v = np.full((1, 2, 50, 16), big, np.float32).astype(dtype)
    v[0, 1, :, 3] = np.nan
    out = af.attention(q, k, v)
    assert np.all(np.isnan(out[0, 1, :, 3].astype(np.float32)))
    np.testing.assert_array_equal(np.delete(out[0, 1], 3, axis=-1), np.asarray(big, dtype))
    np.testing.assert_array_equal(out[0, 0], np.asarray(big, dtype))


@pytest.mark.parametrize("d,dv", [(32, 32), (64, 128), (128, 64), (128, 128), (160, 96)])
@pytest.mark.parametrize("h,hkv,tq", [(8, 2, 1), (32, 8, 1), (12, 2, 3), (5, 5, 2)])
def test_bf16_decode_shapes_of_the_dot_product_kernel(tier, rng, d, dv, h, hkv, tq):
    """bfloat16 q over a bfloat16 cache in the decode path: D and Dv multiples of 32 (the
    shapes the vdpbf16ps kernel of the avx512bf16 tier takes), row groups of 1 to 18 rows
    (row blocks of 4, 2 and 1), odd key counts (the last key pair half empty), and a cache
    longer than one decode chunk and key block."""
    for tk in (1, 33, 1031) + ((5001,) if d == 128 else ()):
        q, k, v = rand(rng, (1, h, tq, d), BF16), rand(rng, (1, hkv, tk, d), BF16), rand(rng, (1, hkv, tk, dv), BF16)
        out, lse = af.attention(q, k, v, causal=True, return_lse=True)
        assert out.dtype == BF16
        assert_flash_rule(out, q, k, v, causal=True)
        _, ref_lse, _ = reference_attention(q, k, v, causal=True)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-4)


def test_bf16_decode_nan_and_rows_without_keys(tier, rng):
    """The vdpbf16ps decode keeps the NaN rule and gives zeros / -inf to rows that see no
    key (a window past the cache end), like every other path."""
    q, k, v = rand(rng, (1, 8, 1, 64), BF16), rand(rng, (1, 2, 300, 64), BF16), rand(rng, (1, 2, 300, 64), BF16)
    k[0, 1, 7, 3] = np.nan
    out, lse = af.attention(q, k, v, return_lse=True)
    assert np.isnan(out[0, 4:].astype(np.float32)).all() and np.isnan(lse[0, 4:]).all()
    assert np.isfinite(out[0, :4].astype(np.float32)).all()
    out, lse = af.attention(q, k, v, window=(0, 0), query_offset=400, return_lse=True)
    assert (out.astype(np.float32) == 0).all() and (lse == -np.inf).all()


def test_every_float16_value_widens_and_narrows_exactly(tier):
    """V holds every finite float16 (subnormals, +-0, 65504 included); with window=(0, 0) each
    row sees only its own key, so out is that key's V row, bit for bit (only -0 may come
    back as +0). Covers each tier's widening of K/V and rounding of out (the SSE2 generic
    tier does both without F16C)."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    finite = bits.view(np.float16)[np.isfinite(bits.view(np.float16))]  # 63488 = 8 * 124 * 64
    v = finite.reshape(1, 8, 124, 64)
    q = np.ones_like(v)
    out = af.attention(q, np.zeros_like(v), v, window=(0, 0))
    np.testing.assert_array_equal(out, v)


def test_float16_subnormal_keys_are_not_flushed(tier, rng):
    """Keys made only of float16 subnormals against a large q: scores of a few units, which a
    widening that flushed subnormals to zero would make all 0 (and lse = log(Tk))."""
    sub = (np.arange(1, 1024, dtype=np.uint16)).view(np.float16)  # every positive subnormal
    k = rng.choice(sub, size=(1, 2, 40, 64)) * rng.choice(np.array([-1, 1], np.float16), size=(1, 2, 40, 64))
    q = np.full((1, 2, 40, 64), 2048.0, np.float16)
    v = rand(rng, (1, 2, 40, 64), F16)
    out, lse = af.attention(q, k, v, causal=True, return_lse=True)
    ref, ref_lse, _ = reference_attention(q, k, v, causal=True)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-4)
    assert_flash_rule(out, q, k, v, causal=True)
