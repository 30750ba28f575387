"""attention_with_kvcache (and KVCache.attend / step) with ``out=`` and ``return_lse``: the
fast path serves them as it serves calls without (issue 47.1). out's layout is part of the
plan key; what a key cannot hold (out writeable, aligned, apart from what the call reads and
writes) is checked per call in C, and a refused out makes the fast path decline, so the full
path raises its usual error naming out, having written nothing. Which path ran is counted in
attnfast._ext.fast_calls_taken["kvcache"]."""
import numpy as np
import pytest

import attnfast as af
from attnfast import _plans, _ext

B, H, HKV, TQ, D, C = 2, 4, 2, 1, 8, 16
LENS = (9, 14)


@pytest.fixture(autouse=True)
def _fresh_plans():
    _plans.KVCACHE_PLANS.clear()
    yield
    _plans.KVCACHE_PLANS.clear()


def fast_calls():
    return _ext.fast_calls_taken["kvcache"]


def reference(q, k_cache, v_cache, lengths):
    """float64 causal (bottom-right) attention of q (B, H, Tq, D) over the first lengths[b]
    keys of each sequence: (out, lse)."""
    q, kc, vc = (np.asarray(a, np.float64) for a in (q, k_cache, v_cache))
    b_, h_, tq, d = q.shape
    group = h_ // kc.shape[1]
    out = np.zeros(q.shape[:3] + (vc.shape[3],))
    lse = np.full(q.shape[:3], -np.inf)
    for b in range(b_):
        n = lengths[b]
        for h in range(h_):
            k, v = kc[b, h // group, :n], vc[b, h // group, :n]
            s = q[b, h] @ k.T / np.sqrt(d)
            visible = np.arange(n)[None, :] <= np.arange(tq)[:, None] + (n - tq)
            s = np.where(visible, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            out[b, h] = p @ v / p.sum(axis=1, keepdims=True)
            lse[b, h] = (m + np.log(p.sum(axis=1, keepdims=True)))[:, 0]
    return out, lse


def inputs(rng, dtype=np.float32):
    q = rng.standard_normal((B, H, TQ, D)).astype(dtype)
    kc = rng.standard_normal((B, HKV, C, D)).astype(dtype)
    vc = rng.standard_normal((B, HKV, C, D)).astype(dtype)
    kn = rng.standard_normal((B, HKV, 1, D)).astype(dtype)
    vn = rng.standard_normal((B, HKV, 1, D)).astype(dtype)
    return q, kc, vc, kn, vn


def lengths_as(kind):
    return {"int": LENS[0], "int32": np.array(LENS, np.int32),
            "int64": np.array(LENS, np.int64)}[kind]


# ------------------------------------------------------------ results and the path taken

@pytest.mark.parametrize("lengths", ["int", "int32", "int64"])
@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_out_takes_the_fast_path_with_the_bits_of_a_call_without(rng, lengths, return_lse,
                                                                 dtype):
    q, kc, vc, _, _ = inputs(rng, dtype)
    sl = lengths_as(lengths)
    n = [sl] * B if lengths == "int" else list(LENS)
    want_out, want_lse = reference(q, kc, vc, n)
    plain = af.attention_with_kvcache(q, kc, vc, sl)           # no out, no lse: its own plan
    _, lse_plain = af.attention_with_kvcache(q, kc, vc, sl, return_lse=True)  # (the full path)
    o = np.full((B, H, TQ, D), np.nan, dtype)
    for call in range(3):  # the full path (stores the plan), then the fast path twice
        o[...] = np.nan
        before = fast_calls()
        got = af.attention_with_kvcache(q, kc, vc, sl, out=o, return_lse=return_lse)
        assert fast_calls() == before + (call > 0), f"call {call}: the path"
        out, lse = got if return_lse else (got, None)
        assert out is o
        np.testing.assert_array_equal(o, plain)              # bit for bit
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(o, want_out, **tol)
        if return_lse:
            assert lse.shape == (B, H, TQ) and lse.dtype == np.dtype(dtype)
            np.testing.assert_allclose(lse, want_lse, **tol)
            np.testing.assert_array_equal(lse, lse_plain)


def test_out_with_new_tokens_writes_them_once_and_attends(rng):
    q, kc, vc, kn, vn = inputs(rng)
    sl = np.array([3, 7], np.int64)
    o = np.empty((B, H, TQ, D), np.float32)
    twin_k, twin_v = kc.copy(), vc.copy()
    af.attention_with_kvcache(q, twin_k, twin_v, sl, kn, vn)   # plan without out
    plain = af.attention_with_kvcache(q, twin_k.copy(), twin_v.copy(), sl, kn, vn)
    af.attention_with_kvcache(q, kc.copy(), vc.copy(), sl, kn, vn, out=o,
                              return_lse=True)                 # the plan with out and lse
    before = fast_calls()
    out, lse = af.attention_with_kvcache(q, kc, vc, sl, kn, vn, out=o, return_lse=True)
    assert out is o and fast_calls() == before + 1
    np.testing.assert_array_equal(kc, twin_k)
    np.testing.assert_array_equal(vc, twin_v)
    np.testing.assert_array_equal(o, plain)
    want_out, want_lse = reference(q, kc, vc, [4, 8])
    np.testing.assert_allclose(o, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_torch_out_takes_the_fast_path_and_comes_back_as_itself(rng):
    torch = pytest.importorskip("torch")
    q, kc, vc, _, _ = (torch.from_numpy(a) for a in inputs(rng))
    for sl in (LENS[0], torch.tensor(LENS, dtype=torch.int32)):
        n = [LENS[0]] * B if isinstance(sl, int) else list(LENS)
        plain = af.attention_with_kvcache(q, kc, vc, sl)
        o = torch.full((B, H, TQ, D), float("nan"))
        af.attention_with_kvcache(q, kc, vc, sl, out=o, return_lse=True)
        before = fast_calls()
        out, lse = af.attention_with_kvcache(q, kc, vc, sl, out=o, return_lse=True)
        assert out is o and isinstance(lse, torch.Tensor) and fast_calls() == before + 1
        assert torch.equal(o, plain)
        want_out, want_lse = reference(q.numpy(), kc.numpy(), vc.numpy(), n)
        np.testing.assert_allclose(o.numpy(), want_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-5, atol=1e-5)


def test_kvcache_step_and_attend_with_out_and_lse_take_the_fast_path(rng):
    q, _, _, kn, vn = inputs(rng)
    cache, twin = af.KVCache(B, HKV, D, C), af.KVCache(B, HKV, D, C)
    o = np.empty((B, H, TQ, D), np.float32)
    for step in range(4):
        before = fast_calls()
        out, lse = cache.step(q, kn + step, vn - step, out=o, return_lse=True)
        plain = twin.step(q, kn + step, vn - step)
        assert out is o and fast_calls() == before + (step > 0) + (step > 0)
        np.testing.assert_array_equal(o, plain)
        n = cache.lengths.tolist()
        want_out, want_lse = reference(q, cache.k, cache.v, n)
        np.testing.assert_allclose(o, want_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    before = fast_calls()
    cache.attend(q, out=o)
    assert cache.attend(q, out=o) is o and fast_calls() == before + 1
    np.testing.assert_array_equal(o, twin.attend(q))


# ------------------------------------------------------------ refused outs: named, nothing written

def _overlapping_k_cache(kc):
    """An out of the good layout (C-contiguous (B, H, TQ, D) float32) over k_cache's memory."""
    return kc.reshape(-1)[:B * H * TQ * D].reshape(B, H, TQ, D)


def _read_only():
    o = np.empty((B, H, TQ, D), np.float32)
    o.flags.writeable = False
    return o


BAD_OUTS = {
    "wrong shape": (lambda kc: np.empty((B, H, TQ, D + 1), np.float32), ValueError, "out must have shape"),
    "wrong dtype": (lambda kc: np.empty((B, H, TQ, D), np.float64), TypeError, "out must have dtype"),
    "read-only": (lambda kc: _read_only(), ValueError, "out is read-only"),
    "overlaps k_cache": (_overlapping_k_cache, ValueError, "out overlaps the memory of k_cache"),
}


@pytest.mark.parametrize("kind", list(BAD_OUTS) + ["torch stride 0", "torch negative bit"])
def test_a_refused_out_is_named_and_nothing_is_written(rng, kind):
    q, kc, vc, kn, vn = inputs(rng)
    sl = np.array([3, 7], np.int64)
    if kind.startswith("torch"):
        torch = pytest.importorskip("torch")
        q, kc, vc, kn, vn = (torch.from_numpy(a) for a in (q, kc, vc, kn, vn))
        if kind == "torch stride 0":
            make = lambda kc: torch.zeros(1, H, TQ, D).expand(B, H, TQ, D)
            error, text = ValueError, "out overlaps itself"
        else:
            make = lambda kc: torch.zeros(B, H, TQ, D, dtype=torch.complex64).conj().imag
            error, text = ValueError, "out is a torch tensor with the negative bit"
        as_bytes = lambda a: a.numpy().tobytes()
        good = torch.empty(B, H, TQ, D)
    else:
        make, error, text = BAD_OUTS[kind]
        as_bytes = lambda a: a.tobytes()
        good = np.empty((B, H, TQ, D), np.float32)
    for attempt in ("first call", "after a plan was memoised"):
        state = (as_bytes(kc), as_bytes(vc))
        before = fast_calls()
        with pytest.raises(error, match=text):
            af.attention_with_kvcache(q, kc, vc, sl, kn, vn, out=make(kc))
        assert (as_bytes(kc), as_bytes(vc)) == state, attempt
        assert fast_calls() == before, attempt
        # a good out of the same layout: accepted; it stores the plan the next attempt finds
        af.attention_with_kvcache(q, kc, vc, sl, kn, vn, out=good)
        assert _plans.KVCACHE_PLANS


def test_a_refused_out_after_a_plan_with_return_lse_and_a_kvcache(rng):
    q, _, _, kn, vn = inputs(rng)
    cache = af.KVCache(B, HKV, D, C)
    o = np.empty((B, H, TQ, D), np.float32)
    cache.step(q, kn, vn, out=o, return_lse=True)
    cache.step(q, kn, vn, out=o, return_lse=True)        # the fast path
    state = (cache.k.tobytes(), cache.v.tobytes(), cache.lengths.tolist())
    before = fast_calls()
    for bad, text in ((_read_only(), "out is read-only"),
                      (cache.k.reshape(-1)[:o.size].reshape(o.shape), "out overlaps the memory of")):
        with pytest.raises(ValueError, match=text):
            cache.step(q, kn, vn, out=bad, return_lse=True)
        assert (cache.k.tobytes(), cache.v.tobytes(), cache.lengths.tolist()) == state
    assert fast_calls() == before
