"""attention_backward(key_index=): the gradients of attention over selected keys, against a
float64 reference written out here (a dense softmax over each row's listed, visible keys and
the closed-form gradients, no autograd)."""
import ml_dtypes
import numpy as np
import pytest

from attnfast import attention, attention_backward

BF16 = np.dtype(ml_dtypes.bfloat16)


def listed_keys(index, b, g, i, pos, causal, window):
    """The positions query row i (at key position pos) lists and sees."""
    row = index[b, g if index.shape[1] > 1 else 0, i]
    return [int(j) for j in row if j >= 0 and (not causal or j <= pos)
            and (window is None or window[0] < 0 or j >= pos - window[0])
            and (window is None or window[1] < 0 or j <= pos + window[1])]


def reference_grads(q, k, v, dout, index, *, scale=None, causal=False, window=None,
                    softcap=None, sinks=None):
    """float64 (dq, dk, dv, dsinks) of out = softmax(scores of the listed keys (+ sink)) v,
    index (B, 1 or Hkv, Tq, k), causal / window aligned bottom-right. With softcap the score
    is c tanh(s / c), whose derivative is 1 - tanh^2."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dsinks = np.zeros(H)
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)
            for i in range(Tq):
                keys = listed_keys(index, b, g, i, Tk - Tq + i, causal, window)
                s = scale * k[b, g, keys] @ q[b, h, i]
                slope = np.ones_like(s)
                if softcap:
                    t = np.tanh(s / softcap)
                    s, slope = softcap * t, 1 - t * t
                logits = np.append(s, float(sinks[h])) if sinks is not None else s
                if logits.size == 0:
                    continue
                p_all = np.exp(logits - logits.max())
                p_all /= p_all.sum()
                p = p_all[:len(keys)]
                out = p @ v[b, g, keys]
                dp = v[b, g, keys] @ dout[b, h, i]
                delta = dout[b, h, i] @ out
                ds = p * (dp - delta) * slope
                dq[b, h, i] = scale * ds @ k[b, g, keys]
                dk[b, g, keys] += scale * np.outer(ds, q[b, h, i])
                dv[b, g, keys] += np.outer(p, dout[b, h, i])
                if sinks is not None:
                    dsinks[h] -= p_all[-1] * delta
    return dq, dk, dv, dsinks


def random_index(rng, B, groups, Tq, k, Tk, none=0.2):
    """Distinct positions < Tk per row, about `none` of the entries -1."""
    index = np.stack([[[rng.choice(Tk, size=k, replace=False) for _ in range(Tq)]
                       for _ in range(groups)] for _ in range(B)]).astype(np.int32)
    index[rng.random(index.shape) < none] = -1
    return index


def problem(rng, dtype, B, H, Hkv, Tq, Tk, D, Dv):
    shapes = ((B, H, Tq, D), (B, Hkv, Tk, D), (B, Hkv, Tk, Dv), (B, H, Tq, Dv))
    return tuple(rng.standard_normal(s).astype(dtype) for s in shapes)


def grads_of(q, k, v, dout, index, **options):
    """attnfast's forward, then its backward, over key_index."""
    out, lse = attention(q, k, v, key_index=index, return_lse=True, **options)
    return attention_backward(dout, q, k, v, out, lse, key_index=index, **options)


def assert_close(got, want, tol):
    """Within tol of the largest reference magnitude (and elementwise relative tol)."""
    got = np.asarray(got, np.float64)
    bound = tol * max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=tol, atol=bound)


TOLERANCES = [(np.float32, 2e-5), (np.float64, 1e-12), (np.float16, 1e-2), (BF16, 5e-2)]


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,tol", TOLERANCES)
def test_gradients_over_listed_keys(dtype, tol, causal, per_head):
    """GQA (2 query heads per KV head), -1 padding, D and Dv not whole vectors; a list shared
    by the heads or one per KV head. The reference reads the same rounded inputs."""
    rng = np.random.default_rng(1)
    B, H, Hkv, Tq, Tk, D, Dv, k = 2, 4, 2, 5, 70, 24, 20, 12
    q, kk, v, dout = problem(rng, dtype, B, H, Hkv, Tq, Tk, D, Dv)
    index = random_index(rng, B, Hkv if per_head else 1, Tq, k, Tk)
    given = index if per_head else index[:, 0]
    dq, dk, dv = grads_of(q, kk, v, dout, given, causal=causal)
    assert dq.dtype == dk.dtype == dv.dtype == q.dtype
    want = reference_grads(q, kk, v, dout, index, causal=causal)
    for got, ref in zip((dq, dk, dv), want):
        assert_close(got, ref, tol)
    # keys no row lists get exactly zero
    unlisted = np.setdiff1d(np.arange(Tk), index[index >= 0])
    assert np.all(dk[:, :, unlisted] == 0) and np.all(dv[:, :, unlisted] == 0)


def test_hidden_keys_and_rows_that_see_nothing():
    """A window hides some listed keys (ignored, as the forward ignores them); a row of -1
    only and a row whose listed keys are all hidden get zero dq; float32 and float64."""
    rng = np.random.default_rng(2)
    B, H, Hkv, Tq, Tk, D = 1, 2, 1, 6, 40, 16
    for dtype, tol in ((np.float32, 2e-5), (np.float64, 1e-12)):
        q, kk, v, dout = problem(rng, dtype, B, H, Hkv, Tq, Tk, D, D)
        index = random_index(rng, B, 1, Tq, 10, Tk, none=0.1)
        index[0, 0, 1] = -1
        index[0, 0, 3] = [0, 1, 2, 3, -1, -1, 4, 5, 6, 7]  # all left of row 3's window
        options = dict(causal=True, window=(8, 0))
        dq, dk, dv = grads_of(q, kk, v, dout, index[:, 0], **options)
        want = reference_grads(q, kk, v, dout, index, **options)
        for got, ref in zip((dq, dk, dv), want):
            assert_close(got, ref, tol)
        assert np.all(dq[0, :, 1] == 0) and np.all(dq[0, :, 3] == 0)


@pytest.mark.parametrize("options", [{"softcap": 1.5}, {"sinks": True},
                                     {"softcap": 2.0, "sinks": True, "scale": 0.3}])
@pytest.mark.parametrize("dtype,tol", [(np.float32, 2e-5), (np.float64, 1e-12)])
def test_softcap_sinks_and_scale(dtype, tol, options):
    """Sinks join the denominator (a row seeing no key keeps its sink: dsinks from it too)."""
    rng = np.random.default_rng(3)
    B, H, Hkv, Tq, Tk, D = 2, 4, 1, 4, 50, 32
    q, kk, v, dout = problem(rng, dtype, B, H, Hkv, Tq, Tk, D, D)
    index = random_index(rng, B, 1, Tq, 9, Tk)
    index[1, 0, 2] = -1
    options = dict(options)
    if options.pop("sinks", False):
        options["sinks"] = rng.standard_normal(H).astype(np.float32)
    grads = grads_of(q, kk, v, dout, index[:, 0], **options)
    want = reference_grads(q, kk, v, dout, index, **options)
    for got, ref in zip(grads[:3], want[:3]):
        assert_close(got, ref, tol)
    if "sinks" in options:
        assert_close(grads[3], want[3], max(tol, 1e-6))  # dsinks is float32


def test_many_heads_long_lists_same_bits_for_any_thread_count():
    """72 query heads on one KV head (two head blocks of a tile), 40 query rows (three dq
    tasks), 700 keys (three dk/dv ranges), lists longer than a tile: one thread and two
    give the same bits, and both match the reference. Unlisted K/V rows hold NaN: the
    backward reads only listed keys."""
    rng = np.random.default_rng(4)
    B, H, Hkv, Tq, Tk, D, k = 1, 72, 1, 40, 700, 16, 150
    q, kk, v, dout = problem(rng, np.float32, B, H, Hkv, Tq, Tk, D, D)
    allowed = np.flatnonzero(np.arange(Tk) % 5)  # every fifth key never listed
    picks = random_index(rng, B, 1, Tq, k, allowed.size, none=0.1)
    index = np.where(picks >= 0, allowed[picks], -1).astype(np.int32)
    unlisted = np.setdiff1d(np.arange(Tk), index[index >= 0])
    kk[:, :, unlisted] = np.nan
    v[:, :, unlisted] = np.nan
    out, lse = attention(q, kk, v, key_index=index[:, 0], causal=True, return_lse=True)
    one = attention_backward(dout, q, kk, v, out, lse, key_index=index[:, 0], causal=True,
                             num_threads=1)
    two = attention_backward(dout, q, kk, v, out, lse, key_index=index[:, 0], causal=True,
                             num_threads=2)
    for a, b in zip(one, two):
        assert np.array_equal(a, b)
    want = reference_grads(q, np.nan_to_num(kk), np.nan_to_num(v), dout, index, causal=True)
    assert_close(one[0], want[0], 2e-5)
    listed = np.setdiff1d(np.arange(Tk), unlisted)
    for got, ref in zip(one[1:], want[1:]):
        assert_close(got[:, :, listed], ref[:, :, listed], 2e-5)
        assert np.all(got[:, :, unlisted] == 0)


@pytest.mark.parametrize("heads", [(6, 2), (20, 1)])
def test_every_tier(tier, heads):
    """Each kernel tier: a tile of 3 query heads (keys kept as rows, dot products) and of 20
    (keys transposed, micro-GEMMs), padded head dims, softcap; float32 and bfloat16, two
    threads' bits equal to one's."""
    rng = np.random.default_rng(7)
    (H, Hkv), Tq, Tk, D, Dv = heads, 3, 90, 20, 36
    for dtype, tol in ((np.float32, 2e-5), (BF16, 5e-2)):
        q, kk, v, dout = problem(rng, dtype, 1, H, Hkv, Tq, Tk, D, Dv)
        index = random_index(rng, 1, Hkv, Tq, 70, Tk)
        out, lse = attention(q, kk, v, key_index=index, softcap=3.0, return_lse=True)
        one, two = (attention_backward(dout, q, kk, v, out, lse, key_index=index, softcap=3.0,
                                       num_threads=n) for n in (1, 2))
        want = reference_grads(q, kk, v, dout, index, softcap=3.0)
        for a, b, ref in zip(one, two, want):
            assert np.array_equal(a, b)
            assert_close(a, ref, tol)


def test_rejected_calls_name_key_index():
    rng = np.random.default_rng(5)
    q, kk, v, dout = problem(rng, np.float32, 1, 2, 1, 3, 10, 8, 8)
    out, lse = attention(q, kk, v, return_lse=True)
    bad = [
        (np.array([[[3, 3], [1, 2], [0, 1]]]), ValueError, "key_index lists key 3 twice"),
        (np.array([[[3, 10], [1, 2], [0, 1]]]), ValueError, r"key_index\[0, 0, 1\] = 10"),
        (np.array([[[-2, 1], [1, 2], [0, 1]]]), ValueError, "key_index.*>= 0 or -1"),
        (np.array([[3, 4]]), ValueError, "key_index must have shape"),
        (np.array([[[1.0, 2.0]] * 3]), TypeError, "key_index must be an integer"),
    ]
    for index, error, words in bad:
        with pytest.raises(error, match=words):
            attention_backward(dout, q, kk, v, out, lse, key_index=index)
    good = np.array([[[1], [2], [3]]], np.int32)
    with pytest.raises(NotImplementedError, match="key_index"):
        attention_backward(dout, q, kk, v, out, lse, key_index=good,
                           alibi_slopes=np.ones(2, np.float32))
    with pytest.raises(NotImplementedError, match="key_index"):
        attention_backward(dout, q, kk, v, out, lse, key_index=good,
                           mask=np.ones((3, 10), bool))


def test_torch_op_gradients_through_key_index():
    """attnfast.integrations.torch.attention(key_index=) under autograd: float64 gradcheck,
    and float32 gradients (q, k, v, sinks) against the reference."""
    torch = pytest.importorskip("torch")
    import attnfast.integrations.torch as aft
    rng = np.random.default_rng(6)
    B, H, Hkv, Tq, Tk, D, k = 1, 2, 1, 3, 12, 8, 5
    index = random_index(rng, B, 1, Tq, k, Tk)
    key_index = torch.from_numpy(index[:, 0])
    arrays = problem(rng, np.float64, B, H, Hkv, Tq, Tk, D, D)
    q, kk, v = (torch.from_numpy(a).requires_grad_() for a in arrays[:3])
    sinks = torch.from_numpy(rng.standard_normal(H).astype(np.float32))
    # (one thread: the ~500 tiny calls of gradcheck pay no thread wake-ups)
    assert torch.autograd.gradcheck(
        lambda q, k, v: aft.attention(q, k, v, key_index=key_index, causal=True, softcap=2.0,
                                      num_threads=1),
        (q, kk, v))
    q32, k32, v32 = (torch.from_numpy(a.astype(np.float32)).requires_grad_() for a in arrays[:3])
    sinks.requires_grad_()
    out = aft.attention(q32, k32, v32, sinks=sinks, key_index=key_index)
    dout = arrays[3].astype(np.float32)
    out.backward(torch.from_numpy(dout))
    want = reference_grads(*(a.astype(np.float32) for a in arrays[:3]), dout, index,
                           sinks=sinks.detach().numpy())
    for got, ref in zip((q32.grad, k32.grad, v32.grad, sinks.grad), want):
        assert_close(got.numpy(), ref, 2e-5)
    # the fake (meta) implementation gives the shapes without running anything
    meta = aft.attention_lse(*(t.detach().to("meta") for t in (q32, k32, v32)),
                             key_index=key_index.to("meta"))
    assert meta[0].shape == q32.shape and meta[1].shape == q32.shape[:-1]
