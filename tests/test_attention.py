"""attention() against the independent float64 reference (tests/reference.py)."""
import numpy as np
import pytest

import attnfast as af
from reference import TOLERANCE, reference_attention


def make_qkv(rng, shape_q, shape_k, dv=None, dtype=np.float32, scale=1.0):
    dv = shape_k[-1] if dv is None else dv
    q = (rng.standard_normal(shape_q) * scale).astype(dtype)
    k = (rng.standard_normal(shape_k) * scale).astype(dtype)
    v = rng.standard_normal(shape_k[:-1] + (dv,)).astype(dtype)
    return q, k, v


def check(q, k, v, dtype=None, **options):
    out, lse = af.attention(q, k, v, return_lse=True, **options)
    ref_out, ref_lse, _ = reference_attention(q, k, v, causal=options.get("causal", False),
                                              scale=options.get("scale"),
                                              window=options.get("window"))
    tol = TOLERANCE[np.dtype(q.dtype)]
    assert out.dtype == q.dtype
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    np.testing.assert_allclose(out, ref_out, **tol)
    np.testing.assert_allclose(lse, ref_lse, **tol)
    return out, lse


@pytest.mark.parametrize("D", [1, 3, 59, 64, 111, 128, 256])
@pytest.mark.parametrize("T", [1, 2, 17, 97, 128, 1025])
@pytest.mark.parametrize("causal", [False, True])
def test_sizes_float32(rng, D, T, causal):
    q, k, v = make_qkv(rng, (T, D), (T, D))
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("D,T", [(1, 17), (59, 97), (128, 130), (256, 65)])
@pytest.mark.parametrize("causal", [False, True])
def test_sizes_float64(rng, D, T, causal):
    q, k, v = make_qkv(rng, (2, T, D), (2, T, D), dtype=np.float64)
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("tq,tk", [(1, 300), (5, 64), (64, 65), (100, 257), (130, 70), (7, 3), (3, 0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_causal_unequal_lengths(rng, tq, tk, dtype):
    """Bottom-right aligned causal; with Tq > Tk the first rows see nothing (zeros, -inf)."""
    q, k, v = make_qkv(rng, (2, tq, 24), (2, tk, 24), dv=40, dtype=dtype)
    out, lse = check(q, k, v, causal=True)
    blind = max(tq - tk, 0) if tk > 0 else tq
    assert np.all(out[:, :blind] == 0) and np.all(np.isneginf(lse[:, :blind]))
    assert np.all(np.isfinite(lse[:, blind:]))


@pytest.mark.parametrize("window", [(0, 0), (3, 0), (16, -1), (-1, 5), (70, 2), (1, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tq,tk", [(200, 200), (37, 150)])
def test_window(rng, window, causal, tq, tk):
    q, k, v = make_qkv(rng, (2, tq, 32), (2, tk, 32))
    check(q, k, v, causal=causal, window=window)


@pytest.mark.parametrize("h,hkv", [(32, 8), (8, 1), (6, 3)])
def test_gqa_mqa(rng, h, hkv):
    q, k, v = make_qkv(rng, (2, h, 70, 64), (2, hkv, 90, 64), dv=48)
    check(q, k, v, causal=True)
    check(q, k, v)


def test_dv_differs_and_scale(rng):
    q, k, v = make_qkv(rng, (3, 50, 16), (3, 80, 16), dv=7)
    check(q, k, v, scale=0.37)
    check(q, k, v, scale=2, causal=True)


def test_batched_4d(rng):
    q, k, v = make_qkv(rng, (3, 4, 33, 20), (3, 2, 47, 20))
    check(q, k, v, causal=True)


def test_bthd_layout_as_transposed_view(rng):
    """A (B, T, H, D) array passes as a transposed view, used in place without a copy."""
    B, T, H, D = 2, 77, 4, 32
    x = rng.standard_normal((3, B, T, H, D)).astype(np.float32)
    q, k, v = (x[i].transpose(0, 2, 1, 3) for i in range(3))
    assert not q.flags.c_contiguous
    out = check(q, k, v, causal=True)[0]
    # out= may be a (B, T, H, Dv) buffer seen the same way.
    buf = np.empty((B, T, H, D), np.float32)
    af.attention(q, k, v, causal=True, out=buf.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(buf.transpose(0, 2, 1, 3), out)


def test_every_other_head_and_negative_strides(rng):
    q, k, v = make_qkv(rng, (8, 40, 16), (8, 60, 16))
    check(q[::2], k[::2], v[::2], causal=True)
    check(q[:, ::-1], k[::-1, ::-1], v[::-1, ::-1])
    check(q[::-2, 5:30], k[::-2], v[::-2], causal=True)


def test_non_contiguous_last_axis_is_copied(rng):
    q, k, v = make_qkv(rng, (2, 30, 32), (2, 40, 32))
    check(q[..., ::2], k[..., ::2], v[..., ::2], causal=True)
    out = np.zeros((2, 30, 64), np.float32)
    res = af.attention(q, k, v, out=out[..., ::2])
    np.testing.assert_array_equal(out[..., ::2], af.attention(q, k, v))
    assert np.all(out[..., 1::2] == 0)
    assert res.base is not None and np.shares_memory(res, out)


def test_read_only_inputs(rng):
    q, k, v = make_qkv(rng, (2, 30, 32), (2, 40, 32))
    for a in (q, k, v):
        a.flags.writeable = False
    check(q, k, v, causal=True)


def test_out_is_written_and_returned(rng):
    q, k, v = make_qkv(rng, (2, 30, 32), (2, 40, 32), dv=12)
    out = np.full((2, 30, 12), np.nan, np.float32)
    res = af.attention(q, k, v, out=out)
    assert res is out
    np.testing.assert_array_equal(out, af.attention(q, k, v))


def test_empty_sequences(rng):
    q, k, v = make_qkv(rng, (2, 0, 8), (2, 5, 8))
    out, lse = af.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 0, 8) and lse.shape == (2, 0)
    q, k, v = make_qkv(rng, (2, 4, 8), (2, 0, 8), dv=3)
    out, lse = af.attention(q, k, v, return_lse=True, causal=True)
    assert out.shape == (2, 4, 3) and np.all(out == 0) and np.all(np.isneginf(lse))


def test_large_logits_stay_finite(rng):
    """Scores around 1e4: online softmax must rescale, never overflow."""
    q, k, v = make_qkv(rng, (2, 150, 64), (2, 300, 64), scale=1.0)
    q *= 100.0 / np.sqrt(64) * 8  # |scores| ~ 1e4
    k *= 10
    out, lse = check(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=True)
    assert np.abs(lse).max() > 1e3
    out32, lse32 = af.attention(q, k, v, causal=True, return_lse=True)
    assert np.all(np.isfinite(out32)) and np.all(np.isfinite(lse32))
    ref_out, ref_lse, _ = reference_attention(q, k, v, causal=True)
    # float32 scores of magnitude 1e4 carry ~1e-3 absolute rounding; the softmax amplifies it.
    np.testing.assert_allclose(lse32, ref_lse, rtol=1e-5, atol=0)
    np.testing.assert_allclose(out32, ref_out, atol=0.05)


def test_many_tiles_streaming(rng):
    """Long sequences cross many KV tiles and query blocks: online rescaling is exercised."""
    q, k, v = make_qkv(rng, (1, 1500, 40), (1, 2100, 40), scale=1.5)
    check(q, k, v, causal=True)
    check(q, k, v, window=(300, 10))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_thread_count_gives_identical_bits(rng, dtype):
    q, k, v = make_qkv(rng, (2, 6, 333, 64), (2, 3, 400, 64), dtype=dtype)
    results = [af.attention(q, k, v, causal=True, return_lse=True, num_threads=n) for n in (1, 2, 3)]
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(lse, results[0][1])


def test_attention_weights_match_reference(rng):
    q, k, _ = make_qkv(rng, (2, 4, 19, 8), (2, 2, 23, 8), dtype=np.float64)
    for options in (dict(), dict(causal=True), dict(window=(3, 1)), dict(causal=True, scale=0.3)):
        w = af.attention_weights(q, k, **options)
        ref = reference_attention(q, k, k, **options)[2]
        assert w.shape == ref.shape
        np.testing.assert_allclose(w, ref, rtol=1e-12, atol=1e-14)
    # A row that sees no key has all-zero weights.
    w = af.attention_weights(q[:, :, :5], k[:, :, :2], causal=True)
    assert np.all(w[:, :, :3] == 0) and np.allclose(w[:, :, 3:].sum(-1), 1)


@pytest.mark.parametrize("splits", [[0, 100, 257], [0, 1, 2, 257], [0, 40, 40, 200, 257]])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_merge_attention_states(rng, splits, dtype):
    q, k, v = make_qkv(rng, (3, 30, 16), (3, 257, 16), dtype=dtype)
    full_out, full_lse = af.attention(q, k, v, return_lse=True)
    outs, lses = [], []
    for a, b in zip(splits[:-1], splits[1:]):
        o, s = af.attention(q, k[:, a:b], v[:, a:b], return_lse=True)
        outs.append(o)
        lses.append(s)
    out, lse = af.merge_attention_states(outs, lses)
    assert out.dtype == dtype and lse.dtype == full_lse.dtype
    tol = TOLERANCE[np.dtype(dtype)]
    np.testing.assert_allclose(out, full_out, **tol)
    np.testing.assert_allclose(lse, full_lse, **tol)


def test_merge_attention_states_causal_shards_with_empty_rows(rng):
    """A causal Tq == Tk problem split at key 32. With bottom-right alignment the shard of
    late keys is plain causal (its first 32 rows see nothing: lse -inf), the early shard is
    window (-1, 32); merging them gives the unsplit result exactly."""
    q, k, v = make_qkv(rng, (2, 64, 16), (2, 64, 16), dtype=np.float64)
    full_out, full_lse = af.attention(q, k, v, causal=True, return_lse=True)
    o1, s1 = af.attention(q, k[:, :32], v[:, :32], window=(-1, 32), return_lse=True)
    o2, s2 = af.attention(q, k[:, 32:], v[:, 32:], causal=True, return_lse=True)
    assert np.all(np.isneginf(s2[:, :32])) and np.all(o2[:, :32] == 0)
    out, lse = af.merge_attention_states([o1, o2], [s1, s2])
    np.testing.assert_allclose(out, full_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, full_lse, rtol=1e-12, atol=1e-12)
    # All shards blind for a row: zeros and -inf, never NaN.
    out, lse = af.merge_attention_states([o2[:, :32]], [s2[:, :32]])
    assert np.all(out == 0) and np.all(np.isneginf(lse))
