"""softcap, ALiBi, attention sinks and masks, fused into every path, on every kernel tier,
against the float64 reference (tests/reference.py)."""
import numpy as np
import pytest

import attnfast as af
from reference import TOLERANCE, reference_attention

F32 = TOLERANCE[np.dtype(np.float32)]


def qkv(rng, b, h, hkv, tq, tk, d, dv, dtype=np.float32):
    return (rng.standard_normal((b, h, tq, d)).astype(dtype),
            rng.standard_normal((b, hkv, tk, d)).astype(dtype),
            rng.standard_normal((b, hkv, tk, dv)).astype(dtype))


def check(q, k, v, tol=F32, **opts):
    out, lse = af.attention(q, k, v, return_lse=True, **opts)
    ref_out, ref_lse, ref_w = reference_attention(q, k, v, **opts)
    np.testing.assert_allclose(out, ref_out, **tol)
    np.testing.assert_allclose(lse, ref_lse, **tol)
    w = af.attention_weights(q, k, **{n: o for n, o in opts.items()})
    np.testing.assert_allclose(w, ref_w, **tol)
    return out, lse


SHAPES = [(1, 4, 2, 3, 40, 16, 16), (2, 4, 4, 37, 37, 24, 8), (1, 8, 2, 70, 130, 64, 64)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_each_option_alone(tier, rng, shape, causal):
    b, h, hkv, tq, tk, d, dv = shape
    q, k, v = qkv(rng, b, h, hkv, tq, tk, d, dv)
    q *= 3  # scores big enough that softcap matters
    check(q, k, v, causal=causal, softcap=2.5)
    check(q, k, v, causal=causal, alibi_slopes=rng.uniform(0.01, 0.5, h).astype(np.float32))
    check(q, k, v, causal=causal, alibi_slopes=rng.uniform(0.01, 0.5, (b, h)).astype(np.float32))
    check(q, k, v, causal=causal, sinks=rng.standard_normal(h).astype(np.float32))
    check(q, k, v, causal=causal, mask=rng.random((b, 1, tq, tk)) < 0.7)
    check(q, k, v, causal=causal, mask=(rng.standard_normal((tq, tk)) * 2).astype(np.float32))


@pytest.mark.parametrize("tq", [1, 3, 16, 40])
def test_everything_together_with_gqa_and_window(tier, rng, tq):
    b, h, hkv, tk, d, dv = 2, 8, 2, 300, 32, 48
    q, k, v = qkv(rng, b, h, hkv, tq, tk, d, dv)
    opts = dict(causal=True, window=(120, 0), softcap=5.0,
                alibi_slopes=rng.uniform(0.0, 0.05, h).astype(np.float32),
                sinks=rng.standard_normal(h).astype(np.float32),
                mask=rng.random((b, h, 1, tk)) < 0.8)
    check(q, k, v, **opts)


def test_decode_split_kv_chunk_boundary_with_options(tier, rng):
    """A cache long enough to be split into chunks merged by lse: the sink is added once."""
    b, h, hkv, d = 1, 4, 1, 128
    length = 9000  # several decode chunks
    cache = af.KVCache(b, hkv, d, length + 1)
    k = rng.standard_normal((b, hkv, length, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, length, d)).astype(np.float32)
    cache.append(k, v)
    q = rng.standard_normal((b, h, 1, d)).astype(np.float32) * 2
    sinks = np.full(h, 3.0, np.float32)
    mask = np.ones((1, 1, 1, length + 1), bool)
    mask[..., 4000:4100] = False
    opts = dict(window=(6000, 0), softcap=4.0, sinks=sinks,
                alibi_slopes=np.full(h, 1e-4, np.float32))
    out, lse = cache.attend(q, mask=mask, return_lse=True, **opts)
    ref, ref_lse, _ = reference_attention(q, k, v, causal=True, mask=mask[..., :length], **opts)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-4)
    one = cache.attend(q, mask=mask, num_threads=1, **opts)
    np.testing.assert_array_equal(one, cache.attend(q, mask=mask, num_threads=2, **opts))


def test_kvcache_alibi_uses_each_sequences_length(tier, rng):
    cache = af.KVCache(2, 1, 16, 64)
    cache.append(*qkv(rng, 2, 1, 1, 1, 30, 16, 16)[1:])
    cache.append(*qkv(rng, 1, 1, 1, 1, 10, 16, 16)[1:], batch_index=1)
    q = rng.standard_normal((2, 2, 3, 16)).astype(np.float32)
    slopes = np.array([0.3, 0.1], np.float32)
    out = cache.attend(q, alibi_slopes=slopes)
    for bi, n in enumerate(cache.lengths):
        ref, _, _ = reference_attention(q[bi], cache.k[bi, :, :n], cache.v[bi, :, :n], causal=True,
                                        alibi_slopes=slopes)
        np.testing.assert_allclose(out[bi], ref, **F32)


def test_sinks_row_that_sees_no_key(tier, rng):
    q, k, v = qkv(rng, 1, 2, 2, 20, 10, 8, 8)
    sinks = np.array([0.5, -1.0], np.float32)
    out, lse = af.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert np.all(out[:, :, :10] == 0)
    np.testing.assert_array_equal(lse[0, :, :10], np.broadcast_to(sinks[:, None], (2, 10)))
    _, ref_lse, _ = reference_attention(q, k, v, causal=True, sinks=sinks)
    np.testing.assert_allclose(lse[:, :, 10:], ref_lse[:, :, 10:], **F32)


def test_mask_dropping_every_key_gives_zeros_and_no_warning(tier, rng):
    import warnings
    q, k, v = qkv(rng, 1, 2, 1, 5, 30, 8, 8)
    mask = np.ones((1, 1, 5, 30), bool)
    mask[0, 0, 2] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = af.attention(q, k, v, mask=mask, return_lse=True)
    assert np.all(out[:, :, 2] == 0) and np.all(lse[:, :, 2] == -np.inf)
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_options_on_other_dtypes(tier, rng, dtype):
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v = qkv(rng, 1, 4, 2, 20, 50, 32, 32, dt)
    opts = dict(causal=True, softcap=3.0, alibi_slopes=np.full(4, 0.05, np.float32),
                sinks=np.zeros(4, np.float32), mask=rng.random((20, 50)) < 0.9)
    out = af.attention(q, k, v, **opts)
    ref, _, _ = reference_attention(q, k, v, **opts)
    tol = TOLERANCE[dt] if dt == np.float64 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(out.astype(np.float64), ref, **tol)


def test_varlen_options(rng):
    q = rng.standard_normal((9, 4, 16)).astype(np.float32)
    k = rng.standard_normal((12, 2, 16)).astype(np.float32)
    v = rng.standard_normal((12, 2, 16)).astype(np.float32)
    slopes = rng.uniform(0, 0.3, (2, 4)).astype(np.float32)
    sinks = rng.standard_normal(4).astype(np.float32)
    out = af.attention_varlen(q, k, v, [0, 4, 9], [0, 5, 12], causal=True, softcap=2.0,
                              alibi_slopes=slopes, sinks=sinks)
    for b, ((q0, q1), (k0, k1)) in enumerate((((0, 4), (0, 5)), ((4, 9), (5, 12)))):
        ref, _, _ = reference_attention(q[q0:q1].transpose(1, 0, 2), k[k0:k1].transpose(1, 0, 2),
                                        v[k0:k1].transpose(1, 0, 2), causal=True, softcap=2.0,
                                        alibi_slopes=slopes[b], sinks=sinks)
        np.testing.assert_allclose(out[q0:q1].transpose(1, 0, 2), ref, **F32)
    with pytest.raises(NotImplementedError, match="mask has no natural shape"):
        af.attention_varlen(q, k, v, [0, 4, 9], [0, 5, 12], mask=np.ones((1,), bool))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(softcap=0.0), ValueError, "softcap must be finite and > 0"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap="1"), TypeError, "softcap"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"alibi_slopes must have shape \(H,\)"),
    (dict(alibi_slopes=np.ones(4, np.float64)), TypeError, "alibi_slopes must be float32"),
    (dict(alibi_slopes=np.ones((3, 4), np.float32)), ValueError, "alibi_slopes"),
    (dict(sinks=np.ones(2, np.float32)), ValueError, r"sinks must have shape \(H,\) = \(4,\)"),
    (dict(sinks=np.ones(4, np.int32)), TypeError, "sinks must be float32"),
    (dict(mask=np.ones((3, 7), bool)), ValueError, "mask of shape \\(3, 7\\) does not broadcast"),
    (dict(mask=np.ones((5, 7), np.int32)), TypeError, "mask must be bool"),
])
def test_bad_options_write_nothing(rng, kwargs, error, match):
    q, k, v = qkv(rng, 2, 4, 2, 5, 7, 8, 8)
    out = np.full((2, 4, 5, 8), 3.0, np.float32)
    with pytest.raises(error, match=match):
        af.attention(q, k, v, out=out, **kwargs)
    assert np.all(out == 3.0)
    cache = af.KVCache(2, 2, 8, 12)
    cache.append(k, v)
    before = cache.k.copy(), cache.lengths.copy()
    with pytest.raises(error):
        cache.step(q[:, :, :1], k[:, :, :1], v[:, :, :1],
                   **{n: (x[..., :1] if n == "mask" else x) for n, x in kwargs.items()})
    assert np.array_equal(cache.k, before[0]) and np.array_equal(cache.lengths, before[1])


# ---- the prefill kernels at sizes that reach every part of their tiling: query sub-blocks
# of 32 rows (and a part one), key tiles of ~60 and super-tiles of ~500 keys (D = 128),
# diagonal (partial) tiles, GQA, D a multiple of the vector width and not.

def opts_each(rng, b, h, tq, tk):
    """Each option alone, then all together, as keyword dicts."""
    slopes = rng.uniform(0.001, 0.05, (b, h)).astype(np.float32)
    yield dict(softcap=3.0)
    yield dict(alibi_slopes=slopes)
    yield dict(mask=rng.random((b, 1, tq, tk)) < 0.8)
    yield dict(mask=(rng.standard_normal((b, h, tq, tk)) * 2).astype(np.float32))
    yield dict(softcap=3.0, alibi_slopes=slopes[0], sinks=rng.standard_normal(h).astype(np.float32),
               mask=rng.random((tq, tk)) < 0.9)


@pytest.mark.parametrize("d", [16, 17, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_options_across_tiles(tier, rng, d, causal):
    b, h, hkv, tq, tk = 1, 4, 2, 70, 1100
    q, k, v = qkv(rng, b, h, hkv, tq, tk, d, d)
    q *= 2
    for opts in opts_each(rng, b, h, tq, tk):
        out, lse = af.attention(q, k, v, causal=causal, return_lse=True, **opts)
        ref, ref_lse, _ = reference_attention(q, k, v, causal=causal, **opts)
        np.testing.assert_allclose(out, ref, **F32, err_msg=str(sorted(opts)))
        np.testing.assert_allclose(lse, ref_lse, **F32, err_msg=str(sorted(opts)))


def test_prefill_options_causal_square_with_window(tier, rng):
    """Tq = Tk: every sub-block has diagonal tiles; the window cuts tiles on the left."""
    b, h, hkv, t, d = 2, 2, 1, 200, 40
    q, k, v = qkv(rng, b, h, hkv, t, t, d, 24)
    for opts in opts_each(rng, b, h, t, t):
        check(q, k, v, causal=True, window=(90, 0), **opts)


@pytest.mark.parametrize("layout", ["padding (B,1,1,Tk)", "per row (Tq,1)", "(B,H,Tq,Tk) transposed view",
                                    "float64 additive", "float32 -inf and 0"])
def test_prefill_mask_strides(tier, rng, layout):
    b, h, hkv, tq, tk, d = 2, 4, 4, 45, 300, 32
    q, k, v = qkv(rng, b, h, hkv, tq, tk, d, d)
    if layout.startswith("padding"):
        mask = np.ones((b, 1, 1, tk), bool)
        mask[0, ..., :37] = False   # left padding of sequence 0
        mask[1, ..., 250:] = False  # right padding of sequence 1
    elif layout.startswith("per row"):
        mask = rng.random((tq, 1)) < 0.8   # col stride 0: a row keeps all keys or none
    elif layout.startswith("(B,H"):
        mask = (rng.random((b, h, tk, tq)) < 0.7).transpose(0, 1, 3, 2)  # col stride Tq
    elif layout.startswith("float64"):
        mask = rng.standard_normal((b, 1, tq, tk)) * 3
    else:
        mask = np.where(rng.random((1, h, tq, tk)) < 0.6, 0.0, -np.inf).astype(np.float32)
    out, lse = check(q, k, v, mask=mask)
    if layout.startswith("per row"):
        dropped = ~mask[:, 0]
        assert dropped.any() and np.all(out[:, :, dropped] == 0) and np.all(lse[:, :, dropped] == -np.inf)


def test_prefill_mask_dropping_rows_and_whole_tiles(tier, rng):
    """Rows the mask drops entirely give zeros and lse = -inf beside rows that see keys; tiles
    it drops for every row of a sub-block are skipped; with sinks such a row's lse is the sink."""
    b, h, hkv, tq, tk, d = 1, 2, 1, 70, 700, 64
    q, k, v = qkv(rng, b, h, hkv, tq, tk, d, d)
    mask = rng.random((b, 1, tq, tk)) < 0.9
    mask[..., 100:520] = False           # several whole tiles, every row
    mask[..., [0, 31, 32, 69], :] = False  # whole rows, at sub-block edges
    k[:, :, 300] = np.nan                # a key no row keeps: no NaN anywhere
    out, lse = check(q, k, v, mask=mask)
    assert np.all(out[:, :, [0, 31, 32, 69]] == 0) and np.all(lse[:, :, [0, 31, 32, 69]] == -np.inf)
    assert np.all(np.isfinite(out))
    sinks = np.array([0.5, -2.0], np.float32)
    out, lse = check(q, k, v, mask=mask, sinks=sinks, causal=True)
    np.testing.assert_array_equal(lse[0, :, 0], sinks)


def test_prefill_options_nan_rules(tier, rng):
    b, h, hkv, tq, tk, d = 1, 2, 1, 40, 200, 32
    q, k, v = qkv(rng, b, h, hkv, tq, tk, d, d)
    k[0, 0, 77] = np.nan  # a key every row sees: every row NaN, with any option
    for opts in (dict(softcap=2.0), dict(alibi_slopes=np.full(h, 0.1, np.float32)),
                 dict(mask=np.zeros((tq, tk), np.float32))):
        out, lse = af.attention(q, k, v, return_lse=True, **opts)
        assert np.all(np.isnan(out)) and np.all(np.isnan(lse)), opts
    # a NaN in an additive mask reaches its row only; a bool mask that drops the NaN key
    # for some rows keeps those rows finite
    k[0, 0, 77] = 0
    mask = np.zeros((tq, tk), np.float32)
    mask[5, 9] = np.nan
    out, lse = af.attention(q, k, v, mask=mask, return_lse=True)
    assert np.all(np.isnan(lse[0, :, 5])) and np.isfinite(np.delete(lse, 5, axis=2)).all()
    k[0, 0, 77] = np.nan
    keep = np.ones((tq, tk), bool)
    keep[:20, 77] = False
    out, lse = af.attention(q, k, v, mask=keep, return_lse=True)
    assert np.isfinite(lse[0, :, :20]).all() and np.isnan(lse[0, :, 20:]).all()


def test_prefill_softcap_accuracy_through_lse(tier, rng):
    """With one key, lse is the softcapped score itself: samples the kernel's tanh over
    small, medium and saturated arguments (and NaN / inf scores)."""
    c = 5.0
    x = np.concatenate([np.linspace(-60, 60, 2001), rng.standard_normal(1000) * 3,
                        np.geomspace(1e-6, 4.0, 400), [0.0, -0.0]]).astype(np.float32)
    q = x.reshape(1, 1, -1, 1)
    k = np.ones((1, 1, 1, 1), np.float32)
    _, lse = af.attention(q, k, k, scale=1.0, softcap=c, return_lse=True)
    ref = c * np.tanh(x.astype(np.float64) / c)
    np.testing.assert_allclose(lse[0, 0], ref, rtol=1e-6, atol=1e-6)
    q = np.array([np.nan, np.inf, -np.inf] * 7, np.float32).reshape(1, 1, -1, 1)
    _, lse = af.attention(q, k, k, scale=1.0, softcap=c, return_lse=True)
    assert np.all(np.isnan(lse[0, 0, ::3]))
    np.testing.assert_array_equal(lse[0, 0, 1::3], np.float32(c))  # +inf -> c tanh(inf), as the reference
    assert np.all(np.isnan(lse[0, 0, 2::3]))                       # q . k = -inf: an infinite input


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_prefill_options_thread_count_gives_the_same_bits(tier, rng, dtype):
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    b, h, hkv, tq, tk, d = 1, 8, 2, 300, 900, 64
    q, k, v = qkv(rng, b, h, hkv, tq, tk, d, d, dt)
    opts = dict(causal=True, softcap=4.0, alibi_slopes=np.full(h, 0.01, np.float32),
                sinks=np.ones(h, np.float32), mask=rng.random((b, 1, tq, tk)) < 0.9)
    one = af.attention(q, k, v, num_threads=1, return_lse=True, **opts)
    two = af.attention(q, k, v, num_threads=2, return_lse=True, **opts)
    np.testing.assert_array_equal(one[0], two[0])
    np.testing.assert_array_equal(one[1], two[1])


# ---- the decode kernel (Tq <= 16) with the options: D a multiple of the vector width (the
# hand-written x86 decode) and not (the template), GQA, masks through every stride kind,
# several split-KV chunks, 16-bit caches.

@pytest.mark.parametrize("d", [64, 24])
@pytest.mark.parametrize("tq", [1, 5])
def test_decode_options(tier, rng, d, tq):
    b, h, hkv, tk = 2, 8, 2, 2500
    q, k, v = qkv(rng, b, h, hkv, tq, tk, d, d)
    q *= 2
    masks = [rng.random((b, 1, tq, tk)) < 0.8,
             (rng.random((b, h, tk, tq)) < 0.7).transpose(0, 1, 3, 2),      # col stride != 1
             rng.standard_normal((tq, tk)) * 2,                            # float64 additive
             np.where(rng.random((1, h, 1, tk)) < 0.7, 0, -np.inf).astype(np.float32)]
    for opts in [dict(softcap=2.0), dict(alibi_slopes=rng.uniform(0, 0.01, (b, h)).astype(np.float32))] + \
            [dict(mask=m) for m in masks] + \
            [dict(softcap=3.0, alibi_slopes=np.full(h, 0.002, np.float32), mask=masks[0],
                  sinks=rng.standard_normal(h).astype(np.float32), window=(1500, 0))]:
        for causal in (False, True):
            out, lse = af.attention(q, k, v, causal=causal, return_lse=True, **opts)
            ref, ref_lse, _ = reference_attention(q, k, v, causal=causal, **opts)
            np.testing.assert_allclose(out, ref, **F32, err_msg=str(sorted(opts)))
            np.testing.assert_allclose(lse, ref_lse, **F32, err_msg=str(sorted(opts)))


def test_decode_options_rows_dropped_nan_and_thread_bits(tier, rng):
    b, h, hkv, tq, tk, d = 1, 4, 1, 3, 9000, 128
    q, k, v = qkv(rng, b, h, hkv, tq, tk, d, d)
    mask = rng.random((b, 1, tq, tk)) < 0.9
    mask[..., 1, :] = False               # row 1 sees nothing
    k[0, 0, 100] = np.nan                 # dropped for every row: no NaN
    mask[..., 100] = False
    out, lse = check(q, k, v, mask=mask)
    assert np.all(out[:, :, 1] == 0) and np.all(lse[:, :, 1] == -np.inf) and np.isfinite(out).all()
    opts = dict(mask=mask, softcap=4.0, alibi_slopes=np.full(h, 1e-4, np.float32))
    np.testing.assert_array_equal(af.attention(q, k, v, num_threads=1, **opts),
                                  af.attention(q, k, v, num_threads=2, **opts))
    mask[:, :, [0, 2], 100] = True        # now every row but row 1 sees the NaN key
    _, lse = af.attention(q, k, v, return_lse=True, softcap=4.0, mask=mask)
    assert np.isnan(lse[:, :, [0, 2]]).all() and np.all(lse[:, :, 1] == -np.inf)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8"])
def test_decode_options_16bit_and_int8_cache(tier, rng, dtype, int8_widen):
    import ml_dtypes
    # int8: the format as stored (key_rotation=None) through the exact widening path, so the
    # reference over cache.k is exact (rotation and vpdpbusd: tests/test_lowbit.py)
    cache = af.KVCache(1, 2, 64, 1200, dtype=np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else dtype,
                       key_rotation=None)
    k, v = rng.standard_normal((2, 1, 2, 1100, 64)).astype(np.float32)
    cache.append(k, v)
    kk, vv = (cache.k[:, :, :1100], cache.v[:, :, :1100]) if dtype != "int8" else \
        (cache.k[:, :, :1100] * cache.k_scale[:, :, :1100, None].astype(np.float64),
         cache.v[:, :, :1100] * cache.v_scale[:, :, :1100, None].astype(np.float64))
    q = rng.standard_normal((1, 8, 2, 64)).astype(np.float32)
    mask = rng.random((1, 1, 2, 1200)) < 0.8
    opts = dict(softcap=3.0, alibi_slopes=np.full(8, 0.003, np.float32), sinks=np.ones(8, np.float32))
    out = cache.attend(q, mask=mask, **opts)
    ref, _, _ = reference_attention(q, kk, vv, causal=True, mask=mask[..., :1100], **opts)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
