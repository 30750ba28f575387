"""attention_backward against torch autograd of a materialised float64 softmax (written here,
sharing no code with attnfast)."""
import numpy as np
import pytest

import attnfast

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")


def reference_grads(q, k, v, dout, *, causal=False, scale=None, window=None, softcap=None,
                    alibi_slopes=None, sinks=None, mask=None, query_offset=None):
    """(out, dq, dk, dv, dsinks or None) in float64 for (B, H, T, D) inputs."""
    t = lambda x: torch.tensor(np.asarray(x, dtype=np.float64), requires_grad=True)
    q64, k64, v64 = t(q), t(k), t(v)
    B, H, Tq, D = q64.shape
    Hkv, Tk = k64.shape[1], k64.shape[2]
    kr = k64.repeat_interleave(H // Hkv, dim=1)
    vr = v64.repeat_interleave(H // Hkv, dim=1)
    s = (D ** -0.5 if scale is None else scale) * q64 @ kr.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(Tq)[:, None] + (Tk - Tq if query_offset is None else query_offset)
    key = torch.arange(Tk)[None, :]
    if alibi_slopes is not None:
        slopes = torch.tensor(np.asarray(alibi_slopes, np.float64)).reshape(-1, H)
        s = s - slopes[:, :, None, None] * (pos - key).abs().double()
    keep = torch.ones(Tq, Tk, dtype=torch.bool).expand(B, H, Tq, Tk)
    if mask is not None:
        m = torch.tensor(np.asarray(mask))
        if m.dtype == torch.bool:
            keep = keep & m
        else:
            s = s + m.double()
    if causal:
        keep = keep & (key <= pos)
    if window is not None:
        if window[0] >= 0:
            keep = keep & (key >= pos - window[0])
        if window[1] >= 0:
            keep = keep & (key <= pos + window[1])
    s = torch.where(keep, s, torch.zeros((), dtype=torch.float64))
    cols = [s]
    sink = None
    if sinks is not None:
        sink = t(sinks)
        cols.append(sink[None, :, None, None].expand(B, H, Tq, 1))
        keep = torch.cat([keep, torch.ones(B, H, Tq, 1, dtype=torch.bool)], -1)
    s = torch.cat(cols, -1)
    m = torch.where(keep, s, torch.full((), -torch.inf, dtype=torch.float64)).amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros(())).detach()
    e = torch.where(keep, torch.exp(s - m), torch.zeros((), dtype=torch.float64))
    total = e.sum(-1, keepdim=True)
    p = e / torch.where(total > 0, total, torch.ones(()))
    out = p[..., :Tk] @ vr
    (out * torch.tensor(np.asarray(dout, np.float64))).sum().backward()
    grads = [x.grad.numpy() for x in (q64, k64, v64)]
    return out.detach().numpy(), *grads, None if sink is None else sink.grad.numpy()


def run(q, k, v, dout, **options):
    out, lse = attnfast.attention(q, k, v, return_lse=True, **options)
    return attnfast.attention_backward(dout, q, k, v, out, lse, **options)


def inputs(rng, B, H, Hkv, Tq, Tk, D, Dv, dtype=np.float64):
    q = rng.standard_normal((B, H, Tq, D))
    k = rng.standard_normal((B, Hkv, Tk, D))
    v = rng.standard_normal((B, Hkv, Tk, Dv))
    dout = rng.standard_normal((B, H, Tq, Dv))
    return [x.astype(dtype) for x in (q, k, v, dout)]


CASES = [
    dict(),
    dict(causal=True),
    dict(window=(9, 4)),
    dict(causal=True, window=(20, -1)),
    dict(softcap=2.5),
    dict(alibi_slopes=np.array([0.3, 0.1, 0.05, 0.02], np.float32)),
    dict(sinks=np.array([0.5, -1.0, 2.0, 0.0], np.float32)),
    dict(sinks=np.array([0.5, -1.0, 2.0, 0.0], np.float32), causal=True, softcap=3.0),
    dict(query_offset=-10, causal=True),
    dict(scale=0.3, causal=True, alibi_slopes=np.array([0.3, 0.1, 0.05, 0.02], np.float32)),
]
SHAPES = [(2, 4, 2, 37, 53, 24, 40), (1, 4, 1, 70, 70, 16, 16), (1, 4, 4, 130, 67, 8, 20)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(o) or "plain")
def test_matches_float64_reference(rng, shape, options):
    q, k, v, dout = inputs(rng, *shape)
    got = run(q, k, v, dout, **options)
    _, *want = reference_grads(q, k, v, dout, **options)
    names = ["dq", "dk", "dv", "dsinks"]
    assert len(got) == (4 if "sinks" in options else 3)
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9 if name != "dsinks" else 1e-5,
                                   err_msg=name)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_masks(rng, kind):
    q, k, v, dout = inputs(rng, 2, 4, 2, 45, 66, 16, 16)
    if kind == "bool":
        mask = rng.random((2, 1, 45, 66)) > 0.3
        mask[0, 0, 3] = False  # a row that sees no key
    else:
        mask = rng.standard_normal((1, 4, 45, 66)).astype(np.float32)
    got = run(q, k, v, dout, mask=mask, causal=True)
    _, *want = reference_grads(q, k, v, dout, mask=mask, causal=True)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9)
    if kind == "bool":
        assert not got[0][0, :, 3].any()


def test_float32(rng):
    q, k, v, dout = inputs(rng, 2, 8, 2, 150, 200, 64, 32, np.float32)
    got = run(q, k, v, dout, causal=True, softcap=5.0)
    _, *want = reference_grads(q, k, v, dout, causal=True, softcap=5.0)
    for g, w in zip(got, want):
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=2e-4 * np.abs(w).max())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit(rng, dtype):
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    q, k, v, dout = (x.astype(dt) for x in inputs(rng, 1, 4, 2, 90, 90, 32, 32, np.float32))
    got = run(q, k, v, dout, causal=True)
    _, *want = reference_grads(q, k, v, dout, causal=True)  # of the same rounded inputs
    tol = 2e-2 if dtype == "bfloat16" else 4e-3  # out and the gradients are rounded to dt
    for g, w in zip(got, want):
        assert g.dtype == dt
        err = np.abs(g.astype(np.float64) - w).max() / np.abs(w).max()
        assert err < tol


def test_rows_that_see_no_key_get_zero_gradients(rng):
    q, k, v, dout = inputs(rng, 1, 2, 2, 40, 10, 8, 8)  # causal, Tq > Tk: rows 0..29 see nothing
    dq, dk, dv = run(q, k, v, dout, causal=True)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    assert not dq[:, :, :30].any()
    _, *want = reference_grads(q, k, v, dout, causal=True)
    for g, w in zip((dq, dk, dv), want):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)


def test_strided_views_and_ranks(rng):
    qb, kb, vb, db = (rng.standard_normal((2, 50, 4, 16)) for _ in range(4))  # (B, T, H, D)
    q, k, v, dout = (x.transpose(0, 2, 1, 3) for x in (qb, kb, vb, db))
    got = run(q, k, v, dout, causal=True)
    _, *want = reference_grads(q, k, v, dout, causal=True)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)
    got3 = run(q[0], k[0], v[0], dout[0], causal=True)  # (H, T, D)
    for g, w in zip(got3, want):
        assert g.shape == w.shape[1:]
        np.testing.assert_allclose(g, w[0], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_bits_do_not_depend_on_threads(rng, dtype):
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v, dout = (x.astype(dt) for x in inputs(rng, 1, 8, 2, 300, 300, 64, 64, np.float32))
    one = run(q, k, v, dout, causal=True, num_threads=1)
    two = run(q, k, v, dout, causal=True, num_threads=2)
    for a, b in zip(one, two):
        assert np.array_equal(a.view(np.uint16 if dt.itemsize == 2 else np.uint32),
                              b.view(np.uint16 if dt.itemsize == 2 else np.uint32))


@pytest.mark.parametrize("dtype", [np.float64, np.float32, "bfloat16"])
def test_both_schedules_give_the_same_bits(rng, dtype):
    """One task per (batch, kv head) accumulating dq too, or a dk/dv pass and a dq pass: the
    thread count picks one, and every gradient element must come out the same."""
    import ml_dtypes
    from attnfast import _ext
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    assert _ext.backward_schedule(2, 1) == "fused"
    assert _ext.backward_schedule(2, 3) == "two-pass"
    q, k, v, dout = (x.astype(dt) for x in inputs(rng, 1, 6, 2, 150, 170, 40, 24, np.float32))
    options = dict(causal=True, window=(90, -1), softcap=4.0)
    fused = run(q, k, v, dout, num_threads=1, **options)
    two_pass = run(q, k, v, dout, num_threads=3, **options)
    for a, b in zip(fused, two_pass):
        assert np.array_equal(a.view(f"u{dt.itemsize}"), b.view(f"u{dt.itemsize}"))
    _, *want = reference_grads(q, k, v, dout, **options)  # and both are right
    for g, w in zip(fused, want):
        err = np.abs(g.astype(np.float64) - w).max() / np.abs(w).max()
        assert err < {8: 1e-12, 4: 1e-5, 2: 2e-2}[dt.itemsize]


_KEY_BLOCKS_CHILD = """
import sys, numpy as np, attnfast
rng = np.random.default_rng(7)
q, k, v, dout = (rng.standard_normal(s).astype(np.float32) for s in
                 [(1, 4, 300, 128), (1, 2, 330, 128), (1, 2, 330, 64), (1, 4, 300, 64)])
out, lse = attnfast.attention(q, k, v, causal=True, softcap=5.0, return_lse=True)
grads = attnfast.attention_backward(dout, q, k, v, out, lse, causal=True, softcap=5.0,
                                    num_threads=int(sys.argv[1]))
sys.stdout.write("".join(g.tobytes().hex() for g in grads))
"""


def test_key_blocks_per_sweep_do_not_change_the_bits():
    """The fused schedule sweeps the query blocks once per group of key blocks, as many as
    the L2 cache size allows (ATTNFAST_L2_BYTES forces it: 128 KiB gives 2 blocks at
    D = 128, 8 MiB the most); every gradient element keeps its order, so its bits."""
    import os
    import subprocess
    import sys
    outputs = []
    for l2, threads in ((131072, 1), (8 << 20, 1), (8 << 20, 2)):
        env = dict(os.environ, ATTNFAST_L2_BYTES=str(l2))
        outputs.append(subprocess.run([sys.executable, "-c", _KEY_BLOCKS_CHILD, str(threads)],
                                      env=env, capture_output=True, text=True, check=True).stdout)
    assert len(outputs[0]) > 1000 and outputs[0] == outputs[1] == outputs[2]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_every_tier(tier, rng, dtype):
    """Each kernel tier's micro-GEMMs and exponentials: padded head dims (72, 20), GQA,
    sinks and a causal window, against the float64 reference."""
    q, k, v, dout = inputs(rng, 1, 4, 2, 90, 75, 72, 20, dtype)
    options = dict(causal=True, window=(40, -1), sinks=np.array([0.3, -1, 0.5, 2], np.float32))
    got = run(q, k, v, dout, **options)
    _, *want = reference_grads(q, k, v, dout, **options)
    for name, g, w in zip(["dq", "dk", "dv", "dsinks"], got, want):
        if dtype == np.float64 or name == "dsinks":
            np.testing.assert_allclose(g, w, rtol=1e-9 if name != "dsinks" else 1e-5,
                                       atol=1e-9 if name != "dsinks" else 1e-5, err_msg=name)
        else:
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-5 * np.abs(w).max(), err_msg=name)


def test_nan_in_nan_out(rng):
    q, k, v, dout = inputs(rng, 1, 2, 2, 20, 20, 8, 8)
    k[0, 0, 5, 0] = np.nan
    dq, dk, dv = run(q, k, v, dout)
    assert np.isnan(dq[0, 0]).all() and np.isfinite(dq[0, 1]).all()
    assert np.isnan(dk[0, 0]).any() and np.isfinite(dk[0, 1]).all()


@pytest.mark.parametrize("where", ["k", "q", "dout"])
def test_a_non_finite_input_reaches_only_what_meets_it(rng, where):
    """A NaN in one key, query or dout row under a causal mask: the gradients of rows and
    keys that never meet it (as the forward's rows never see it) stay finite and right, on
    both schedules with the same bits; those that meet it are NaN."""
    from attnfast import _ext
    q, k, v, dout = inputs(rng, 1, 4, 2, 150, 150, 32, 32)
    bad = {"k": (k, (0, 0, 100, 7)), "q": (q, (0, 1, 60, 3)), "dout": (dout, (0, 1, 60, 3))}
    array, at = bad[where]
    clean = [x.copy() for x in (q, k, v, dout)]
    array[at] = np.nan
    assert _ext.backward_schedule(2, 1) == "fused" and _ext.backward_schedule(2, 3) == "two-pass"
    got = run(q, k, v, dout, causal=True, num_threads=1)
    two_pass = run(q, k, v, dout, causal=True, num_threads=3)
    for a, b in zip(got, two_pass):
        assert np.array_equal(a.view(np.uint64), b.view(np.uint64))
    _, *want = reference_grads(*clean, causal=True)  # what does not meet the NaN: unchanged
    dq, dk, dv = got
    if where == "k":  # rows >= 100 of heads 0, 1 see key 100, and so every key of kv head 0
        nan_dq = np.zeros(dq.shape, bool)
        nan_dq[0, :2, 100:] = True
        nan_kv = np.zeros(dk.shape[:3], bool)
        nan_kv[0, 0] = True
    else:  # row 60 of head 1 meets keys 0..60 of kv head 0
        nan_dq = np.zeros(dq.shape, bool)
        nan_dq[0, 1, 60] = True
        nan_kv = np.zeros(dk.shape[:3], bool)
        nan_kv[0, 0, :61] = True
    assert np.isnan(dq[nan_dq]).all()
    np.testing.assert_allclose(dq[~nan_dq], want[0][~nan_dq], rtol=1e-9, atol=1e-12)
    for g, w in ((dk, want[1]), (dv, want[2])):
        assert np.isnan(g[nan_kv]).any(axis=-1).all()
        np.testing.assert_allclose(g[~nan_kv], w[~nan_kv], rtol=1e-9, atol=1e-12)


def test_errors_name_the_argument(rng):
    q, k, v, dout = inputs(rng, 1, 2, 2, 20, 20, 8, 8)
    out, lse = attnfast.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="dout must have shape"):
        attnfast.attention_backward(dout[:, :, :5], q, k, v, out, lse)
    with pytest.raises(TypeError, match="lse must have dtype float64"):
        attnfast.attention_backward(dout, q, k, v, out, lse.astype(np.float32))
    with pytest.raises(TypeError, match="q, k, v must share a dtype"):
        attnfast.attention_backward(dout.astype(np.float32), q.astype(np.float32),
                                    k.astype(np.float16), v.astype(np.float16),
                                    out.astype(np.float32), lse.astype(np.float32))


def _example():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parents[1] / "examples" / "train_attention.py"
    spec = importlib.util.spec_from_file_location("train_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_one_head_trains_like_sdpa():
    ex = _example()
    a, s = ex.one_head("attnfast", 60), ex.one_head("sdpa", 60)
    assert max(abs(x - y) for x, y in zip(a, s)) < 1e-5
    assert a[-1] < 0.1 * a[0]


@pytest.mark.slow
def test_example_tiny_transformer_trains_like_sdpa():
    ex = _example()
    (la, acc_a), (ls, acc_s) = ex.tiny_transformer("attnfast", 300), ex.tiny_transformer("sdpa", 300)
    assert max(abs(x - y) for x, y in zip(la, ls)) < 1e-3
    assert acc_a > 0.9 and acc_s > 0.9


def test_varlen_matches_per_sequence_reference(rng):
    lens_q, lens_k = [7, 0, 30, 12], [9, 4, 30, 5]
    cu_q, cu_k = np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)
    H, Hkv, D, Dv = 4, 2, 8, 12
    q = rng.standard_normal((cu_q[-1], H, D))
    k = rng.standard_normal((cu_k[-1], Hkv, D))
    v = rng.standard_normal((cu_k[-1], Hkv, Dv))
    dout = rng.standard_normal((cu_q[-1], H, Dv))
    sinks = np.array([0.1, -0.5, 1.0, 0.0], np.float32)
    out, lse = attnfast.attention_varlen(q, k, v, cu_q, cu_k, causal=True, sinks=sinks,
                                         return_lse=True)
    dq, dk, dv, dsinks = attnfast.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                                            causal=True, sinks=sinks)
    want_dsinks = np.zeros(H)
    for b in range(4):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        hm = lambda x: x.transpose(1, 0, 2)[None]
        _, rq, rk, rv, rs = reference_grads(hm(q[sq]), hm(k[sk]), hm(v[sk]), hm(dout[sq]),
                                            causal=True, sinks=sinks)
        np.testing.assert_allclose(dq[sq], rq[0].transpose(1, 0, 2), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(dk[sk], rk[0].transpose(1, 0, 2), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(dv[sk], rv[0].transpose(1, 0, 2), rtol=1e-9, atol=1e-12)
        want_dsinks += 0 if rs is None else rs
    np.testing.assert_allclose(dsinks, want_dsinks, rtol=1e-5, atol=1e-6)
