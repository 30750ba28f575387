"""Torch tensors (and other array objects) through every public function: zero-copy inputs,
torch outputs sharing attnfast's memory, out= and KV caches written in place, clear errors.
References are attnfast's own NumPy results (checked against independent references in the
other test files) and torch's scaled_dot_product_attention."""
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import attnfast as af

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

BF16 = np.dtype(ml_dtypes.bfloat16)


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_import_attnfast_does_not_import_torch():
    code = "import sys, attnfast; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_attention_torch_in_torch_out_matches_sdpa():
    q, k, v = _rand(2, 4, 7, 16, seed=1), _rand(2, 2, 9, 16, seed=2), _rand(2, 2, 9, 8, seed=3)
    tq, tk, tv = map(torch.from_numpy, (q, k, v))
    out, lse = af.attention(tq, tk, tv, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert out.dtype == torch.float32 and out.shape == (2, 4, 7, 8) and lse.shape == (2, 4, 7)
    ref = torch.nn.functional.scaled_dot_product_attention(
        tq, tk.repeat_interleave(2, 1), tv.repeat_interleave(2, 1),
        attn_mask=torch.ones(7, 9, dtype=torch.bool).tril(9 - 7))
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    np.testing.assert_array_equal(out.numpy(), af.attention(q, k, v, causal=True))


def test_inputs_are_not_copied_and_strided_views_work():
    base = torch.from_numpy(_rand(1, 9, 4, 16, seed=4))   # (B, T, H, D)
    q = base.transpose(1, 2)                               # (B, H, T, D) view, strided
    out = af.attention(q, q, q)
    ref = af.attention(base.numpy().transpose(0, 2, 1, 3), base.numpy().transpose(0, 2, 1, 3),
                       base.numpy().transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(out.numpy(), ref)
    from attnfast._interop import to_numpy
    view = to_numpy(q, "q")
    assert np.shares_memory(view, base.numpy())


def test_output_shares_memory_with_attnfast_result():
    q = torch.from_numpy(_rand(3, 5, 8))
    out = af.attention(q, q, q)
    arr = out.numpy()
    arr[0, 0, 0] = 123.0                   # same buffer: visible through the tensor
    assert out[0, 0, 0].item() == 123.0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_low_and_high_precision_dtypes(dtype):
    q, k, v = _rand(2, 6, 32, seed=5), _rand(1, 10, 32, seed=6), _rand(1, 10, 32, seed=7)
    np_dtype = {"bfloat16": BF16, "float16": np.float16, "float64": np.float64}[dtype]
    tdt = getattr(torch, dtype)
    tq, tk, tv = (torch.from_numpy(a).to(tdt) for a in (q, k, v))
    out = af.attention(tq, tk, tv, causal=True)
    assert out.dtype == tdt
    ref = af.attention(*(a.astype(np_dtype) for a in (q, k, v)), causal=True)
    got = out.view(torch.int16).numpy().view(BF16) if dtype == "bfloat16" else out.numpy()
    np.testing.assert_array_equal(got, ref)   # the same kernels on the same bits


def test_bfloat16_input_is_zero_copy():
    t = torch.randn(2, 3, 8).to(torch.bfloat16)
    from attnfast._interop import to_numpy
    a = to_numpy(t, "q")
    assert a.dtype == BF16 and a.ctypes.data == t.data_ptr()
    np.testing.assert_array_equal(a.astype(np.float32), t.float().numpy())


def test_out_tensor_written_in_place_and_returned():
    q = torch.from_numpy(_rand(2, 5, 8, seed=8))
    out = torch.full((2, 5, 8), 7.0)
    res = af.attention(q, q, q, out=out)
    assert res is out
    np.testing.assert_array_equal(out.numpy(), af.attention(q.numpy(), q.numpy(), q.numpy()))
    ob = torch.zeros(2, 5, 8, dtype=torch.bfloat16)
    res, lse = af.attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), out=ob, return_lse=True)
    assert res is ob and isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    assert torch.count_nonzero(ob) > 0


def test_numpy_out_with_torch_inputs_stays_numpy():
    q = torch.from_numpy(_rand(2, 5, 8, seed=9))
    out = np.zeros((2, 5, 8), np.float32)
    assert af.attention(q, q, q, out=out) is out


def test_attention_with_kvcache_writes_torch_caches_in_place():
    B, H, Hkv, D, C = 2, 4, 2, 16, 12
    kc, vc = torch.zeros(B, Hkv, C, D), torch.zeros(B, Hkv, C, D)
    kn, vn = torch.from_numpy(_rand(B, Hkv, 3, D, seed=10)), torch.from_numpy(_rand(B, Hkv, 3, D, seed=11))
    q = torch.from_numpy(_rand(B, H, 3, D, seed=12))
    seqlens = torch.tensor([0, 4], dtype=torch.int32)
    kc[1, :, :4] = torch.from_numpy(_rand(Hkv, 4, D, seed=13))
    vc[1, :, :4] = torch.from_numpy(_rand(Hkv, 4, D, seed=14))
    kc_np, vc_np = kc.numpy().copy(), vc.numpy().copy()
    out = af.attention_with_kvcache(q, kc, vc, seqlens, kn, vn)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(kc[0, :, :3], kn[0], rtol=0, atol=0)
    torch.testing.assert_close(vc[1, :, 4:7], vn[1], rtol=0, atol=0)
    ref = af.attention_with_kvcache(q.numpy(), kc_np, vc_np, seqlens.numpy(), kn.numpy(), vn.numpy())
    np.testing.assert_array_equal(out.numpy(), ref)
    np.testing.assert_array_equal(kc.numpy(), kc_np)


def test_kvcache_methods_and_int8_cache():
    cache = af.KVCache(1, 2, 8, 16, dtype="int8")
    k, v = torch.from_numpy(_rand(1, 2, 5, 8, seed=15)), torch.from_numpy(_rand(1, 2, 5, 8, seed=16))
    q = torch.from_numpy(_rand(1, 4, 5, 8, seed=17))
    out = cache.step(q, k, v)
    assert isinstance(out, torch.Tensor)
    ref_cache = af.KVCache(1, 2, 8, 16, dtype="int8")
    np.testing.assert_array_equal(out.numpy(), ref_cache.step(q.numpy(), k.numpy(), v.numpy()))
    cache.truncate(torch.tensor(2))
    assert cache.lengths.tolist() == [2]
    assert isinstance(cache.attend(q[:, :, :1]), torch.Tensor)


def test_attention_weights_varlen_and_merge():
    q, k = torch.from_numpy(_rand(2, 4, 8, seed=18)), torch.from_numpy(_rand(2, 6, 8, seed=19))
    w = af.attention_weights(q, k, causal=True)
    assert isinstance(w, torch.Tensor)
    np.testing.assert_array_equal(w.numpy(), af.attention_weights(q.numpy(), k.numpy(), causal=True))
    o1, l1 = af.attention(q, k[:, :3], k[:, :3], return_lse=True)
    o2, l2 = af.attention(q, k[:, 3:], k[:, 3:], return_lse=True)
    o, l = af.merge_attention_states([o1, o2], [l1, l2])
    assert isinstance(o, torch.Tensor)
    torch.testing.assert_close(o, af.attention(q, k, k), atol=1e-6, rtol=1e-5)
    qp = torch.from_numpy(_rand(7, 2, 8, seed=20))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out = af.attention_varlen(qp, qp, qp, cu, cu, causal=True)
    assert isinstance(out, torch.Tensor)
    np.testing.assert_array_equal(out.numpy(), af.attention_varlen(qp.numpy(), qp.numpy(), qp.numpy(),
                                                                   cu.numpy(), cu.numpy(), causal=True))


def test_requires_grad_is_an_error_naming_the_argument():
    q = torch.randn(2, 3, 8)
    k = torch.randn(2, 3, 8, requires_grad=True)
    with pytest.raises(ValueError, match=r"^k requires grad"):
        af.attention(q, k, q)
    with pytest.raises(ValueError, match=r"k_new requires grad"):
        af.attention_with_kvcache(q[None], torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), 0,
                                  k_new=k[None, :, :1], v_new=q[None, :, :1])
    with torch.no_grad():   # under no_grad a leaf still requires grad: still an error
        with pytest.raises(ValueError, match="requires grad"):
            af.attention(k, q, q)
    af.attention(q, k.detach(), q)


def test_non_cpu_tensor_is_an_error_naming_the_argument():
    v = torch.randn(2, 3, 8, device="meta")
    with pytest.raises(ValueError, match=r"^v is a torch tensor on device meta"):
        af.attention(torch.randn(2, 3, 8), torch.randn(2, 3, 8), v)


def test_errors_still_come_from_the_checks():
    with pytest.raises(TypeError, match="q"):
        af.attention(torch.zeros(2, 3, 8, dtype=torch.int32), torch.zeros(2, 3, 8), torch.zeros(2, 3, 8))
    with pytest.raises(ValueError, match="out"):
        af.attention(torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), torch.zeros(2, 3, 8),
                     out=torch.zeros(2, 3, 9))


def test_array_protocol_objects():
    class Wrapped:
        def __init__(self, a):
            self.a = a

        def __array__(self, dtype=None, copy=None):
            return self.a

    q = _rand(2, 4, 8, seed=21)
    out = af.attention(Wrapped(q), Wrapped(q), Wrapped(q))
    assert type(out) is np.ndarray
    np.testing.assert_array_equal(out, af.attention(q, q, q))

    class DL:   # a DLPack-only producer (no __array__)
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    out = af.attention(DL(q), DL(q), DL(q))
    assert type(out) is np.ndarray
    np.testing.assert_array_equal(out, af.attention(q, q, q))
