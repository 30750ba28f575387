"""Written arguments (issue 45, classes 2, 3 and 10).

Every argument attnfast writes into (out=, k_cache / v_cache and their scales, paged pools,
vLLM pools) is written in place or refused by name (attnfast._written.check_written), never
copied: a torch tensor with the negative or conjugate bit (readable only through a copy), an
array that overlaps itself (a stride of 0 from expand() / as_strided, or overlapping strides)
and a read-only array are refused, with nothing written. Arguments that are only read keep
working (a copy or a stride of 0 is fine there). And a torch input's storage is held while
attnfast reads it: another thread's ``tensor.set_()`` cannot free it mid-call.
Values are checked against float64 NumPy references (tests/reference.py).
"""
import gc
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest

import attnfast as af
from attnfast import _ext
from attnfast._written import overlaps_itself
from reference import reference_attention

torch = pytest.importorskip("torch")

B, H, HKV, D, C = 2, 4, 2, 16, 12
TOL = dict(atol=2e-5, rtol=2e-5)
as_strided = np.lib.stride_tricks.as_strided


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def with_negative_bit(a: np.ndarray):
    """A float tensor equal to `a`, stored as -(-a) with torch's negative bit set."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    neg = torch.conj(torch.complex(torch.zeros_like(t), -t)).imag
    assert neg.is_neg() and torch.equal(neg, t)
    return neg


def decode_reference(q, k_cache, v_cache, lengths):
    """float64 attention of q (B, H, 1, D) over each sequence's first lengths[b] tokens."""
    return np.concatenate([reference_attention(q[b:b + 1], k_cache[b:b + 1, :, :n],
                                               v_cache[b:b + 1, :, :n], causal=True)[0]
                           for b, n in enumerate(lengths)])


@pytest.fixture
def decode(rng):
    """A decode step: q, caches holding 5 and 7 tokens, one new token per sequence."""
    kc, vc = rand(rng, B, HKV, C, D), rand(rng, B, HKV, C, D)
    return dict(q=rand(rng, B, H, 1, D), kc=kc, vc=vc, lengths=np.array([5, 7]),
                kn=rand(rng, B, HKV, 1, D), vn=rand(rng, B, HKV, 1, D))


def expected_step(e):
    kc, vc = e["kc"].copy(), e["vc"].copy()
    for b, n in enumerate(e["lengths"]):
        kc[b, :, n], vc[b, :, n] = e["kn"][b, :, 0], e["vn"][b, :, 0]
    return kc, vc, decode_reference(e["q"], kc, vc, e["lengths"] + 1)


# ------------------------------------------------------------ class 2: never a lost copy

def test_out_with_the_negative_bit_is_refused_and_left_as_it_was(rng):
    q, k, v = rand(rng, B, H, 3, D), rand(rng, B, HKV, 6, D), rand(rng, B, HKV, 6, D)
    ref = reference_attention(q, k, v)[0]
    start = rand(rng, B, H, 3, D)
    tq, tk, tv = map(torch.from_numpy, (q, k, v))
    good = torch.from_numpy(start.copy())
    for _ in range(3):  # the full path, then the fast path (the plan of this layout)
        assert af.attention(tq, tk, tv, out=good) is good
        np.testing.assert_allclose(good.numpy(), ref, **TOL)
    neg = with_negative_bit(start)
    with pytest.raises(ValueError, match=r"^out is a torch tensor with the negative bit"):
        af.attention(tq, tk, tv, out=neg)
    np.testing.assert_array_equal(neg.resolve_neg().numpy(), start)
    with pytest.raises(ValueError, match=r"^out is a torch tensor with the negative bit"):
        af.attention(q, k, v, out=neg)  # NumPy inputs, a torch out


def test_out_with_the_conjugate_bit_is_refused_by_name(rng):
    q, k, v = (torch.from_numpy(rand(rng, 1, 2, 3, D)) for _ in range(3))
    conj = torch.zeros(1, 2, 3, D, dtype=torch.complex64).conj()
    assert conj.is_conj()
    with pytest.raises((TypeError, ValueError), match=r"^out "):
        af.attention(q, k, v, out=conj)
    assert not conj.resolve_conj().abs().any()


@pytest.mark.parametrize("which", ["k_cache", "v_cache"])
def test_a_cache_with_the_negative_bit_is_refused_and_nothing_is_written(decode, which):
    e = decode
    kc_t, vc_t = torch.from_numpy(e["kc"].copy()), torch.from_numpy(e["vc"].copy())
    args = dict(k_cache=kc_t, v_cache=vc_t)
    args[which] = with_negative_bit(e["kc"] if which == "k_cache" else e["vc"])
    other = "v_cache" if which == "k_cache" else "k_cache"
    q, kn, vn, lengths = (torch.from_numpy(e[n]) for n in ("q", "kn", "vn", "lengths"))
    with pytest.raises(ValueError, match=rf"^{which} is a torch tensor with the negative bit"):
        af.attention_with_kvcache(q, args["k_cache"], args["v_cache"], lengths, kn, vn)
    np.testing.assert_array_equal(args[which].resolve_neg().numpy(),
                                  e["kc"] if which == "k_cache" else e["vc"])
    np.testing.assert_array_equal(args[other].numpy(), e["kc"] if other == "k_cache" else e["vc"])
    # the same call with plain tensors writes the token in place and attends over it
    kc_ref, vc_ref, ref = expected_step(e)
    out = af.attention_with_kvcache(q, kc_t, vc_t, lengths, kn, vn)
    np.testing.assert_allclose(out.numpy(), ref, **TOL)
    np.testing.assert_array_equal(kc_t.numpy(), kc_ref)
    np.testing.assert_array_equal(vc_t.numpy(), vc_ref)


def test_a_negative_bit_cache_after_a_plan_is_still_refused(decode):
    e = decode
    q, kn, vn = (torch.from_numpy(e[n]) for n in ("q", "kn", "vn"))
    kc, vc = torch.from_numpy(e["kc"].copy()), torch.from_numpy(e["vc"].copy())
    for n in (2, 3, 4):  # full path, then the fast path of this layout
        af.attention_with_kvcache(q, kc, vc, n, kn, vn)
    neg = with_negative_bit(e["kc"])
    with pytest.raises(ValueError, match=r"^k_cache is a torch tensor with the negative bit"):
        af.attention_with_kvcache(q, neg, vc, 5, kn, vn)
    np.testing.assert_array_equal(neg.resolve_neg().numpy(), e["kc"])


def test_a_negative_bit_argument_that_is_only_read_is_read_exactly(decode):
    e = decode
    q, kc, vc = with_negative_bit(e["q"]), with_negative_bit(e["kc"]), with_negative_bit(e["vc"])
    out = af.attention_with_kvcache(q, kc, vc, torch.from_numpy(e["lengths"]))  # no new tokens
    np.testing.assert_allclose(out.numpy(), decode_reference(e["q"], e["kc"], e["vc"],
                                                             e["lengths"]), **TOL)
    k, v = e["kc"][:, :, :6], e["vc"][:, :, :6]
    out = af.attention(q, with_negative_bit(k), with_negative_bit(v), causal=True)
    np.testing.assert_allclose(out.numpy(), reference_attention(e["q"], k, v, causal=True)[0],
                               **TOL)


def test_int8_scales_with_the_negative_bit_are_refused(decode):
    e = decode
    kc, vc = np.zeros((B, HKV, C, D), np.int8), np.zeros((B, HKV, C, D), np.int8)
    ks, vs = np.ones((B, HKV, C), np.float32), np.ones((B, HKV, C), np.float32)
    with pytest.raises(ValueError, match=r"^k_scale is a torch tensor with the negative bit"):
        af.attention_with_kvcache(e["q"], kc, vc, e["lengths"], e["kn"], e["vn"],
                                  k_scale=with_negative_bit(ks), v_scale=vs)
    assert not kc.any() and not vc.any() and (vs == 1).all()


def test_paged_pools_with_the_negative_bit_are_refused(rng):
    q, kn, vn = rand(rng, B, H, 1, D), rand(rng, B, HKV, 1, D), rand(rng, B, HKV, 1, D)
    kp, vp = rand(rng, 6, HKV, 4, D), rand(rng, 6, HKV, 4, D)
    table, lengths = np.array([[0, 1, 2], [3, 4, 5]]), np.array([5, 2])
    with pytest.raises(ValueError, match=r"^v_cache is a torch tensor with the negative bit"):
        af.attention_with_kvcache(q, torch.from_numpy(kp.copy()), with_negative_bit(vp), lengths,
                                  kn, vn, block_table=table)
    with pytest.raises(ValueError, match=r"^k_cache overlaps itself"):
        af.attention_with_kvcache(q, torch.from_numpy(kp[:1]).expand(6, -1, -1, -1),
                                  torch.from_numpy(vp.copy()), lengths, kn, vn, block_table=table)


def test_the_torch_custom_op_refuses_a_negative_bit_cache(decode):
    aft = pytest.importorskip("attnfast.integrations.torch")
    e = decode
    q, kn, vn, lengths = (torch.from_numpy(e[n]) for n in ("q", "kn", "vn", "lengths"))
    neg = with_negative_bit(e["vc"])
    with pytest.raises(ValueError, match=r"v_cache is a torch tensor with the negative bit"):
        aft.attention_with_kvcache(q, torch.from_numpy(e["kc"].copy()), neg, lengths, kn, vn)
    np.testing.assert_array_equal(neg.resolve_neg().numpy(), e["vc"])
    kc, vc = torch.from_numpy(e["kc"].copy()), torch.from_numpy(e["vc"].copy())
    out = aft.attention_with_kvcache(q, kc, vc, lengths, kn, vn)
    kc_ref, vc_ref, ref = expected_step(e)
    np.testing.assert_allclose(out.numpy(), ref, **TOL)
    np.testing.assert_array_equal(kc.numpy(), kc_ref)


def test_varlen_out_with_the_negative_bit_is_refused(rng):
    q, k, v = rand(rng, 7, H, D), rand(rng, 9, HKV, D), rand(rng, 9, HKV, D)
    cu_q, cu_k = np.array([0, 3, 7], np.int32), np.array([0, 4, 9], np.int32)
    neg = with_negative_bit(np.zeros((7, H, D), np.float32))
    with pytest.raises(ValueError, match=r"^out is a torch tensor with the negative bit"):
        af.attention_varlen(torch.from_numpy(q), k, v, cu_q, cu_k, out=neg)
    assert not neg.any()


def test_vllm_pools_refused_when_not_writable_in_place(rng):
    vllm = pytest.importorskip("attnfast.integrations.vllm")
    cache = rand(rng, 3, HKV, 4, 2 * D)
    kept = cache.copy()
    key, value = rand(rng, 2, HKV, D), rand(rng, 2, HKV, D)
    slots = np.array([1, 6])
    k_pool, v_pool = vllm.split_kv_cache(with_negative_bit(cache))
    with pytest.raises(ValueError, match=r"^k_pool is a torch tensor with the negative bit"):
        vllm.write_kv_cache(key, value, k_pool, v_pool, slots)
    k_pool, v_pool = vllm.split_kv_cache(torch.from_numpy(cache[:1]).expand(3, -1, -1, -1))
    with pytest.raises(ValueError, match=r"^k_pool overlaps itself"):
        vllm.write_kv_cache(key, value, k_pool, v_pool, slots)
    np.testing.assert_array_equal(cache, kept)
    held = torch.from_numpy(cache.copy())
    k_pool, v_pool = vllm.split_kv_cache(held)
    vllm.write_kv_cache(key, value, k_pool, v_pool, slots)
    assert np.shares_memory(k_pool, held.numpy()) and np.shares_memory(v_pool, held.numpy())
    np.testing.assert_array_equal(k_pool[0, :, 1], key[0])    # slot 1: block 0, row 1
    np.testing.assert_array_equal(v_pool[1, :, 2], value[1])  # slot 6: block 1, row 2


# ------------------------------------------------------------ class 3: self-overlap, read-only

@pytest.mark.parametrize("which", ["out", "k_cache", "v_cache"])
def test_an_expanded_tensor_is_refused_as_a_written_argument(decode, which):
    e = decode
    q, kn, vn, lengths = (torch.from_numpy(e[n]) for n in ("q", "kn", "vn", "lengths"))
    kc, vc = torch.from_numpy(e["kc"].copy()), torch.from_numpy(e["vc"].copy())
    out = torch.zeros(B, H, 1, D)
    af.attention_with_kvcache(q, kc.clone(), vc.clone(), lengths, kn, vn,
                              out=torch.zeros(B, H, 1, D))  # a plan for this layout
    row = torch.from_numpy(e["kc"][:1].copy())
    expanded = {"out": torch.zeros(1, H, 1, D).expand(B, -1, -1, -1),
                "k_cache": row.expand(B, -1, -1, -1), "v_cache": row.expand(B, -1, -1, -1)}
    args = dict(out=out, k_cache=kc, v_cache=vc)
    args[which] = expanded[which]
    with pytest.raises(ValueError, match=rf"^{which} overlaps itself"):
        af.attention_with_kvcache(q, args["k_cache"], args["v_cache"], lengths, kn, vn,
                                  out=args["out"])
    np.testing.assert_array_equal(kc.numpy(), e["kc"])
    np.testing.assert_array_equal(vc.numpy(), e["vc"])
    np.testing.assert_array_equal(row.numpy(), e["kc"][:1])
    assert not out.any() and not expanded["out"].any()


def test_attention_refuses_an_expanded_out_after_a_plan(rng):
    q, k, v = rand(rng, B, H, 3, D), rand(rng, B, HKV, 6, D), rand(rng, B, HKV, 6, D)
    for _ in range(2):
        af.attention(q, k, v, out=np.empty((B, H, 3, D), np.float32))
    row = torch.zeros(B, H, 1, D)
    with pytest.raises(ValueError, match=r"^out overlaps itself"):
        af.attention(torch.from_numpy(q), k, v, out=row.expand(-1, -1, 3, -1))
    assert not row.any()


@pytest.mark.parametrize("case", ["out stride 0", "out overlapping strides", "k_cache stride 0",
                                  "v_cache stride 0", "k_scale stride 0"])
def test_numpy_as_strided_written_arrays_are_refused(decode, case):
    e = decode
    name, kind = case.split(" ", 1)
    buf = np.zeros(B * HKV * C * D * 4, np.float32)
    if name == "out":
        shape = (B, H, 1, D)
        strides = ((0, D * 4, D * 4, 4) if kind == "stride 0" else
                   (H * 4 * 4, 4 * 4, 4, 4))  # neighbouring rows share 12 of 16 elements
        bad = as_strided(buf, shape, strides, writeable=True)
        call = dict(k_cache=e["kc"].copy(), v_cache=e["vc"].copy(), out=bad)
        ref = decode_reference(e["q"], e["kc"], e["vc"], e["lengths"])
        args = (e["lengths"],)
        kw = {}
    elif name in ("k_cache", "v_cache"):
        bad = as_strided(buf, (B, HKV, C, D), (0, C * D * 4, D * 4, 4), writeable=True)
        call = dict(k_cache=e["kc"].copy(), v_cache=e["vc"].copy(), out=None)
        call[name] = bad
        args, kw = (e["lengths"], e["kn"], e["vn"]), {}
    else:  # an int8 cache's row scales
        bad = as_strided(buf, (B, HKV, C), (0, C * 4, 4), writeable=True)
        call = dict(k_cache=np.zeros((B, HKV, C, D), np.int8),
                    v_cache=np.zeros((B, HKV, C, D), np.int8), out=None)
        args = (e["lengths"], e["kn"], e["vn"])
        kw = dict(k_scale=bad, v_scale=np.zeros((B, HKV, C), np.float32))
    assert overlaps_itself(bad)
    kept = {n: a.copy() for n, a in call.items() if a is not None}
    with pytest.raises(ValueError, match=rf"^{name} overlaps itself"):
        af.attention_with_kvcache(e["q"], call["k_cache"], call["v_cache"], *args,
                                  out=call["out"], **kw)
    assert not buf.any()
    for n, a in kept.items():
        np.testing.assert_array_equal(call[n], a)
    if name == "out":  # the same call into a plain out
        out = np.empty((B, H, 1, D), np.float32)
        af.attention_with_kvcache(e["q"], call["k_cache"], call["v_cache"], *args, out=out)
        np.testing.assert_allclose(out, ref, **TOL)


@pytest.mark.parametrize("name", ["out", "k_cache", "v_cache", "k_scale", "v_scale"])
def test_read_only_written_arrays_are_refused_by_name(decode, name):
    e = decode
    int8 = name.endswith("scale")
    arrays = dict(out=np.zeros((B, H, 1, D), np.float32),
                  k_cache=np.zeros((B, HKV, C, D), np.int8) if int8 else e["kc"].copy(),
                  v_cache=np.zeros((B, HKV, C, D), np.int8) if int8 else e["vc"].copy())
    if int8:
        arrays.update(k_scale=np.ones((B, HKV, C), np.float32),
                      v_scale=np.ones((B, HKV, C), np.float32))
    arrays[name].flags.writeable = False
    kept = {n: a.copy() for n, a in arrays.items()}
    with pytest.raises(ValueError, match=rf"^{name} is read-only"):
        af.attention_with_kvcache(e["q"], arrays["k_cache"], arrays["v_cache"], e["lengths"],
                                  e["kn"], e["vn"], out=arrays["out"],
                                  k_scale=arrays.get("k_scale"), v_scale=arrays.get("v_scale"))
    for n, a in kept.items():
        np.testing.assert_array_equal(arrays[n], a)


def test_arguments_that_are_only_read_may_overlap_themselves(rng):
    q = rand(rng, B, H, 3, D)
    k1, v1 = rand(rng, 1, HKV, 6, D), rand(rng, 1, HKV, 6, D)
    k, v = torch.from_numpy(k1).expand(B, -1, -1, -1), torch.from_numpy(v1).expand(B, -1, -1, -1)
    out = af.attention(torch.from_numpy(q), k, v, causal=True)
    ref = reference_attention(q, np.broadcast_to(k1, (B, HKV, 6, D)),
                              np.broadcast_to(v1, (B, HKV, 6, D)), causal=True)[0]
    np.testing.assert_allclose(out.numpy(), ref, **TOL)


def test_overlaps_itself_agrees_with_the_addresses(rng):
    """The predicate against a brute-force count of element addresses, over random shapes
    and strides (zero, negative, overlapping, interleaved)."""
    buf = np.zeros(4096, np.float32)
    for _ in range(400):
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(n) for n in rng.integers(0, 5, ndim))
        strides = tuple(4 * int(s) for s in rng.integers(-6, 7, ndim))
        start = 2048
        a = as_strided(buf[start:], shape, strides)
        offsets = sorted({sum(i * s for i, s in zip(idx, strides))
                          for idx in np.ndindex(*shape)})
        overlapping = len(offsets) < a.size or any(
            y - x < 4 for x, y in zip(offsets, offsets[1:]))
        assert overlaps_itself(a) == overlapping, (shape, strides)


# ------------------------------------------------------------ class 10: the storage is held

def test_a_tensor_view_holds_the_storage_not_the_tensor():
    af.attention(*(torch.zeros(1, 1, 1, 4) for _ in range(3)))  # registers torch
    owner = np.arange(64, dtype=np.float32)
    alive = weakref.ref(owner)
    t = torch.from_numpy(owner)
    del owner
    view = _ext.tensor_view(t)
    assert view is not None and view.base is t.untyped_storage()
    t.set_(torch.zeros(3))           # the tensor lets go of its storage
    gc.collect()
    assert alive() is not None       # the view still holds it
    np.testing.assert_array_equal(view, np.arange(64, dtype=np.float32))
    del view, t    # (a tensor converted again keeps its view until it is freed: _view_of)
    gc.collect()
    assert alive() is None


def test_a_kept_view_follows_the_tensor():
    """A tensor converted again keeps its view (attnfast._ext._view_of): each later call
    still reads what the tensor holds then, after set_(), as_strided_(), ``.data =``
    of another dtype, and refuses it once it requires grad."""
    af.attention(*(torch.zeros(1, 1, 1, 4) for _ in range(3)))  # registers torch
    rng = np.random.default_rng(3)
    q, k, v = (torch.from_numpy(rng.standard_normal((1, H, 5, D), dtype=np.float32))
               for _ in range(3))

    def check():
        got = af.attention(q, k, v)
        want = reference_attention(q.numpy(), k.numpy(), v.numpy())[0]
        np.testing.assert_allclose(got.numpy(), want, **TOL)

    for _ in range(3):
        check()
    views = _ext.tensor_views_taken()
    check()
    assert _ext.tensor_views_taken() == views + 3
    k.set_(torch.from_numpy(rng.standard_normal((1, H, 5, D), dtype=np.float32)))
    check()
    v.as_strided_((1, H, 5, D), (H * 5 * D, 5 * D, 1, 5))  # the same memory, other strides
    check()
    q.data = q.data.double()
    with pytest.raises(TypeError, match="q has dtype float64"):
        af.attention(q, k, v)
    q.data = q.data.float()
    check()
    q.requires_grad_(True)
    with pytest.raises(ValueError, match="requires grad"):
        af.attention(q, k, v)
    z = torch.complex(k.clone(), k.clone())
    k = z.imag                      # the same memory, then with the negative bit
    for _ in range(3):
        af.attention(q.detach(), k, v)
    k.data = z.conj().imag
    got = af.attention(q.detach(), k, v)
    want = reference_attention(q.detach().numpy(), -z.imag.numpy(), v.numpy())[0]
    np.testing.assert_allclose(got.numpy(), want, **TOL)


RACE = """
import threading, time, torch, attnfast as af
B, H, T, D = 1, 4, 32768, 72      # 37.7 MB a tensor: above glibc's largest mmap threshold,
q = torch.randn(B, H, 16, D)      # so a freed storage is unmapped at once
k, v = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
done = False
def mutate():
    while not done:
        spare = torch.zeros(B, H, T, D), torch.zeros(B, H, T, D)
        k.set_(spare[0]); v.set_(spare[1])    # frees what k and v held
        del spare
        time.sleep(0.002)
thread = threading.Thread(target=mutate)
thread.start()
calls, start = 0, time.monotonic()
try:
    while time.monotonic() - start < {seconds}:
        af.attention(q, k, v)
        af.attention_with_kvcache(q, k, v, T)
        calls += 1
finally:
    done = True
    thread.join()
print("calls", calls)
"""


def test_set_storage_in_another_thread_while_attnfast_reads_does_not_crash():
    """Another thread swaps (and so frees) the storage of k and v over and over while
    attention and attention_with_kvcache read them: a view that held only the tensor read
    unmapped memory (SIGSEGV); the storage held for the call's duration keeps it valid."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(RACE).format(seconds=2.0)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert int(result.stdout.split()[-1]) >= 1
