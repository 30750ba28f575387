"""Every rejected input: the right exception, naming the argument, and nothing written."""
import numpy as np
import pytest

import attnfast as af


@pytest.fixture
def qkv(rng):
    q = rng.standard_normal((2, 4, 10, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 12, 8)).astype(np.float32)
    v = rng.standard_normal((2, 2, 12, 6)).astype(np.float32)
    return q, k, v


def rejects(exc, match, q, k, v, **kwargs):
    """The call raises `exc` matching `match`, and a provided `out` stays untouched."""
    out = kwargs.get("out")
    before = None if not isinstance(out, np.ndarray) else out.copy()
    with pytest.raises(exc, match=match):
        af.attention(q, k, v, **kwargs)
    if before is not None:
        np.testing.assert_array_equal(out, before)


def sentinel_out(shape=(2, 4, 10, 6), dtype=np.float32):
    return np.full(shape, 7.0, dtype)


def test_rank(qkv):
    q, k, v = qkv
    rejects(ValueError, r"q must be 2-D.*got 1-D", q[0, 0, 0], k, v, out=sentinel_out())
    rejects(ValueError, r"k must be 2-D.*5-D", q, k[None], v, out=sentinel_out())
    rejects(ValueError, r"same number of dimensions.*q \(2, 4, 10, 8\).*k \(2, 12, 8\)",
            q, k[0], v, out=sentinel_out())


def test_batch_mismatch(qkv):
    q, k, v = qkv
    rejects(ValueError, r"batch size differs.*q \(2, 4, 10, 8\) has 2.*k \(1, 2, 12, 8\) has 1",
            q, k[:1], v[:1], out=sentinel_out())


def test_head_dim_mismatch(qkv):
    q, k, v = qkv
    rejects(ValueError, r"share the head dim D.*q \(2, 4, 10, 8\).*k \(2, 2, 12, 7\)",
            q, k[..., :7], v, out=sentinel_out())


def test_zero_head_dim(qkv):
    q, k, v = qkv
    rejects(ValueError, r"head dim D must be >= 1", q[..., :0], k[..., :0], v)
    rejects(ValueError, r"value head dim Dv must be >= 1", q, k, v[..., :0])


def test_gqa_divisibility(qkv):
    q, k, v = qkv
    k3 = np.concatenate([k, k[:, :1]], axis=1)
    v3 = np.concatenate([v, v[:, :1]], axis=1)
    rejects(ValueError, r"multiple of kv heads.*H=4.*Hkv=3", q, k3, v3, out=sentinel_out())


def test_v_shape(qkv):
    q, k, v = qkv
    rejects(ValueError, r"v must match k.*k \(2, 2, 12, 8\).*v \(2, 2, 11, 6\)",
            q, k, v[:, :, :11], out=sentinel_out())
    rejects(ValueError, r"v must match k", q, k, v[:, :1], out=sentinel_out())


def test_dtypes(qkv):
    q, k, v = qkv
    rejects(TypeError, r"k and v must share a dtype; got k float64, v float32", q,
            k.astype(np.float64), v, out=sentinel_out())
    rejects(TypeError, r"q has dtype float32 and k, v float64: they must share a dtype", q,
            k.astype(np.float64), v.astype(np.float64), out=sentinel_out())
    rejects(TypeError, r"q has dtype float16 and k, v float32", q.astype(np.float16), k, v)
    rejects(TypeError, r"v must be float32, float64, float16 or bfloat16, got dtype int64", q, k,
            v.astype(np.int64))
    rejects(TypeError, r"q must be float32, float64, float16 or bfloat16, got dtype complex64",
            q.astype(np.complex64), k, v)


def test_bfloat16_and_float16_mixes(qkv):
    import ml_dtypes
    q, k, v = qkv
    bf = ml_dtypes.bfloat16
    # a float16 q cannot read a bfloat16 cache, nor a float64 q a 16-bit one
    rejects(TypeError, r"q has dtype float16 and k, v bfloat16", q.astype(np.float16),
            k.astype(bf), v.astype(bf))
    rejects(TypeError, r"q has dtype float64 and k, v float16", q.astype(np.float64),
            k.astype(np.float16), v.astype(np.float16))
    rejects(TypeError, r"out must have dtype bfloat16", q.astype(bf), k.astype(bf), v.astype(bf),
            out=np.zeros(af.attention(q, k, v).shape, np.float32))


def test_non_native_byte_order_is_converted(qkv):
    q, k, v = qkv
    out = af.attention(q.astype(">f4"), k, v)
    np.testing.assert_array_equal(out, af.attention(q, k, v))


@pytest.mark.parametrize("scale,exc", [(0.0, ValueError), (-1.0, ValueError), (np.inf, ValueError),
                                       (np.nan, ValueError), ("1", TypeError), (True, TypeError)])
def test_scale(qkv, scale, exc):
    q, k, v = qkv
    rejects(exc, "scale", q, k, v, scale=scale, out=sentinel_out())


@pytest.mark.parametrize("window,exc", [((-2, 0), ValueError), ((1,), TypeError), (3, TypeError),
                                        ((1.5, 2), TypeError)])
def test_window(qkv, window, exc):
    q, k, v = qkv
    rejects(exc, "window", q, k, v, window=window, out=sentinel_out())


@pytest.mark.parametrize("n,exc", [(0, ValueError), (-2, ValueError), (1.5, TypeError),
                                   (True, TypeError), ("2", TypeError)])
def test_num_threads(qkv, n, exc):
    q, k, v = qkv
    rejects(exc, "num_threads", q, k, v, num_threads=n, out=sentinel_out())


def test_out_checks(qkv):
    q, k, v = qkv
    rejects(ValueError, r"out must have shape \(2, 4, 10, 6\), got \(2, 4, 10, 8\)", q, k, v,
            out=sentinel_out((2, 4, 10, 8)))
    rejects(TypeError, r"out must have dtype float32.*got float64", q, k, v,
            out=sentinel_out(dtype=np.float64))
    rejects(TypeError, r"out must be a numpy.ndarray, got list", q, k, v, out=[0.0])
    ro = sentinel_out()
    ro.flags.writeable = False
    rejects(ValueError, r"out is read-only", q, k, v, out=ro)


def test_out_aliasing_inputs(rng):
    q = rng.standard_normal((2, 10, 8)).astype(np.float32)
    k = rng.standard_normal((2, 12, 8)).astype(np.float32)
    v = rng.standard_normal((2, 12, 8)).astype(np.float32)
    q_before = q.copy()
    rejects(ValueError, r"out overlaps the memory of q", q, k, v, out=q)
    np.testing.assert_array_equal(q, q_before)
    rejects(ValueError, r"overlaps the memory of v", q, k, v, out=v[:, :10])


@pytest.mark.parametrize("option", ["softcap", "alibi_slopes", "sinks", "mask"])
def test_unimplemented_options_raise(qkv, option):
    q, k, v = qkv
    rejects(NotImplementedError, option, q, k, v, **{option: 1.0}, out=sentinel_out())
    with pytest.raises(NotImplementedError, match=option):
        af.attention_weights(q, k, **{option: 1.0})


def test_attention_weights_checks(qkv):
    q, k, _ = qkv
    with pytest.raises(ValueError, match="share the head dim"):
        af.attention_weights(q, k[..., :3])
    with pytest.raises(ValueError, match="multiple of kv heads"):
        af.attention_weights(q[:, :3], k)


def test_merge_attention_states_checks(rng):
    o = rng.standard_normal((2, 5, 4)).astype(np.float32)
    s = rng.standard_normal((2, 5)).astype(np.float32)
    with pytest.raises(ValueError, match="non-empty and of equal length"):
        af.merge_attention_states([], [])
    with pytest.raises(ValueError, match="equal length; got 2 outs and 1 lses"):
        af.merge_attention_states([o, o], [s])
    with pytest.raises(ValueError, match=r"outs\[1\] has shape \(2, 4, 4\)"):
        af.merge_attention_states([o, o[:, :4]], [s, s[:, :4]])
    with pytest.raises(ValueError, match=r"lses\[0\] must have shape \(2, 5\)"):
        af.merge_attention_states([o], [s[:, :4]])
    with pytest.raises(TypeError, match=r"outs\[1\] has dtype float64"):
        af.merge_attention_states([o, o.astype(np.float64)], [s, s])
    with pytest.raises(TypeError, match=r"lses\[0\] must have dtype float32"):
        af.merge_attention_states([o], [s.astype(np.float64)])
    with pytest.raises(TypeError, match="sequences of arrays"):
        af.merge_attention_states(o, s)
