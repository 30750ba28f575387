"""The fast paths' per-call work in C (attnfast._ext: tensor_view, array_as_tensor,
layout_key, attention_fast, decode_fast): the calls a model makes per layer and token take
them (counted in _ext.fast_calls_taken / tensor_views_taken), give the values of an
independent float64 reference and the bits of the full path, decline whatever they do not
cover (the full checks then run, with their errors), and keep the transaction rules (a call
interrupted by Ctrl-C leaves caches and lengths as they were)."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import attnfast as af
from attnfast import _plans, _ext
from reference import TOLERANCE, reference_attention

B, H, HKV, D, C = 2, 4, 2, 16, 24
F32 = TOLERANCE[np.dtype(np.float32)]


def normal(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


@pytest.fixture(autouse=True)
def _fresh_plans():
    _plans.ATTENTION_PLANS.clear()
    _plans.KVCACHE_PLANS.clear()
    yield
    _plans.ATTENTION_PLANS.clear()
    _plans.KVCACHE_PLANS.clear()


def taken(kind):
    return _ext.fast_calls_taken[kind]


def full_path():
    """The next call of each layout runs the full checks (the plans are dropped)."""
    _plans.ATTENTION_PLANS.clear()
    _plans.KVCACHE_PLANS.clear()


def expected(q, k, v, **options):
    return reference_attention(q.astype(np.float64), k.astype(np.float64),
                               v.astype(np.float64), **options)[0]


# ---------------------------------------------------------------- the C tails are taken

def test_attention_takes_the_c_tail_with_the_references_values(rng):
    q, k, v = normal(rng, B, H, 3, D), normal(rng, B, HKV, 7, D), normal(rng, B, HKV, 7, D)
    given = np.full((B, H, 3, D), np.nan, np.float32)
    first = af.attention(q, k, v, causal=True)          # full checks: store the plans
    af.attention(q, k, v, causal=True, out=given)
    given[:] = np.nan
    before = taken("attention")
    out = af.attention(q, k, v, causal=True)
    assert af.attention(q, k, v, causal=True, out=given) is given
    assert taken("attention") == before + 2
    np.testing.assert_allclose(out, expected(q, k, v, causal=True), **F32)
    np.testing.assert_array_equal(out, first)
    np.testing.assert_array_equal(given, first)
    full_path()
    np.testing.assert_array_equal(af.attention(q, k, v, causal=True), out)
    assert taken("attention") == before + 2, "the full path ran in C"


@pytest.mark.parametrize("lengths", ["int", "int64", "int32"])
def test_attention_with_kvcache_takes_the_c_tail(rng, lengths):
    q, kn, vn = normal(rng, B, H, 1, D), normal(rng, B, HKV, 1, D), normal(rng, B, HKV, 1, D)
    kc, vc = normal(rng, B, HKV, C, D), normal(rng, B, HKV, C, D)
    seqlens = {"int": 5, "int64": np.array([5, 9]), "int32": np.array([5, 9], np.int32)}[lengths]
    starts = [5, 5] if lengths == "int" else [5, 9]
    kc2, vc2 = kc.copy(), vc.copy()
    af.attention_with_kvcache(q, kc, vc, seqlens, kn, vn)   # stores the plan
    before = taken("kvcache")
    kn2, vn2 = normal(rng, B, HKV, 1, D), normal(rng, B, HKV, 1, D)
    out = af.attention_with_kvcache(q, kc, vc, seqlens, kn2, vn2)
    assert taken("kvcache") == before + 1
    for b, s in enumerate(starts):
        kc2[b, :, s], vc2[b, :, s] = kn2[b, :, 0], vn2[b, :, 0]
        np.testing.assert_array_equal(kc[b], kc2[b])        # only the new rows changed
        np.testing.assert_array_equal(vc[b], vc2[b])
        ref = expected(q[b:b + 1], kc2[b:b + 1, :, :s + 1], vc2[b:b + 1, :, :s + 1], causal=True)
        np.testing.assert_allclose(out[b:b + 1], ref, **F32)
    ro = af.attention_with_kvcache(q, kc, vc, np.array(starts) + 1)  # no new tokens: full once
    assert np.array_equal(af.attention_with_kvcache(q, kc, vc, np.array(starts) + 1), ro)
    full_path()
    kc3, vc3 = kc.copy(), vc.copy()
    again = af.attention_with_kvcache(q, kc3, vc3, seqlens, kn2, vn2)
    np.testing.assert_array_equal(again, out)
    np.testing.assert_array_equal(kc3, kc)
    assert taken("kvcache") == before + 2, "only the repeat read-only call was in C"


def test_kvcache_step_and_attend_take_the_c_tail(rng):
    cache = af.KVCache(B, HKV, D, C)
    cache.append(normal(rng, B, HKV, 4, D), normal(rng, B, HKV, 4, D))
    q, kn, vn = normal(rng, B, H, 1, D), normal(rng, B, HKV, 1, D), normal(rng, B, HKV, 1, D)
    cache.step(q, kn, vn)                                   # full checks: the plan
    cache.attend(q)
    before = taken("kvcache")
    outs = [cache.step(q, kn * i, vn * i) for i in range(1, 4)]
    att = cache.attend(q)
    assert taken("kvcache") == before + 4
    assert cache.lengths.tolist() == [8, 8]
    np.testing.assert_array_equal(cache.k[:, :, 7], kn[:, :, 0] * 3)
    ref = expected(q, cache.k[:, :, :8], cache.v[:, :, :8], causal=True)
    np.testing.assert_allclose(outs[-1], ref, **F32)
    np.testing.assert_allclose(att, ref, **F32)
    k, v, lengths = cache.k.copy(), cache.v.copy(), cache.lengths.copy()
    full_path()
    cache.truncate(7)
    np.testing.assert_array_equal(cache.step(q, kn * 3, vn * 3), outs[-1])
    np.testing.assert_array_equal(cache.k, k)
    np.testing.assert_array_equal(cache.v, v)
    np.testing.assert_array_equal(cache.lengths, lengths)


def _listed(rng, lengths, tq, k, heads=None):
    """An int32 key_index (B, Tq, k) -- (B, heads, Tq, k) with heads -- of distinct positions
    below each sequence's length, one -1 per row."""
    rows = []
    for b, n in enumerate(lengths):
        for _ in range((heads or 1) * tq):
            row = rng.choice(n, k, replace=False)
            row[k // 2] = -1
            rows.append(row)
    shape = (len(lengths), tq, k) if heads is None else (len(lengths), heads, tq, k)
    return np.array(rows, np.int32).reshape(shape)


def _listed_reference(q, k, v, index, lengths):
    """float64 causal attention of each query row over its listed keys (per-head lists of KV
    head g serve its query heads); query i of Tq sits at position lengths[b] - Tq + i."""
    B_, H_, Tq, _ = q.shape
    G = k.shape[1]
    out = np.zeros(q.shape[:3] + (v.shape[3],))
    for b in range(B_):
        for h in range(H_):
            g = h // (H_ // G)
            for i in range(Tq):
                rows = index[b, g, i] if index.ndim == 4 else index[b, i]
                rows = rows[(rows >= 0) & (rows <= lengths[b] - Tq + i)]
                s = k[b, g, rows].astype(np.float64) @ q[b, h, i].astype(np.float64) / np.sqrt(q.shape[3])
                p = np.exp(s - s.max())
                out[b, h, i] = p @ v[b, g, rows].astype(np.float64) / p.sum()
    return out


@pytest.mark.parametrize("tq,per_head", [(1, False), (3, False), (2, True)])
def test_key_index_takes_the_c_tail(rng, tq, per_head):
    """Sparse steps (key_index=) of a layout seen before run in C: their values checked there
    (a repeated or out-of-range entry declines: the full path names it, writing nothing)."""
    cache = af.KVCache(B, HKV, D, C)
    cache.append(normal(rng, B, HKV, 9, D), normal(rng, B, HKV, 9, D))
    q, kn, vn = normal(rng, B, H, tq, D), normal(rng, B, HKV, tq, D), normal(rng, B, HKV, tq, D)
    index = _listed(rng, [9 + tq] * B, tq, 5, HKV if per_head else None)
    first = cache.step(q, kn, vn, key_index=index)          # full checks: the plan
    cache.truncate(9)
    before = taken("kvcache")
    again = cache.step(q, kn, vn, key_index=index)
    assert taken("kvcache") == before + 1
    np.testing.assert_array_equal(again, first)
    ref = _listed_reference(q, cache.k, cache.v, index, cache.lengths)
    np.testing.assert_allclose(again, ref, **F32)
    contiguous = af.attention_with_kvcache(q, cache.k, cache.v, cache.lengths, key_index=index)
    before = taken("kvcache")
    np.testing.assert_array_equal(
        af.attention_with_kvcache(q, cache.k, cache.v, cache.lengths, key_index=index), contiguous)
    assert taken("kvcache") == before + 1
    np.testing.assert_allclose(contiguous, ref, **F32)
    k, v, lengths = cache.k.copy(), cache.v.copy(), cache.lengths.copy()
    cache.truncate(9)
    k[:, :, 9:], v[:, :, 9:], lengths[:] = cache.k[:, :, 9:], cache.v[:, :, 9:], 9
    for entry, error in [(index.flat[1], "twice"), (9 + tq, "at or past"), (-2, ">= 0 or -1")]:
        bad = index.copy()
        bad.flat[0] = entry
        with pytest.raises(ValueError, match=error):
            cache.step(q, kn, vn, key_index=bad)
        np.testing.assert_array_equal(cache.k, k)          # nothing written
        np.testing.assert_array_equal(cache.lengths, lengths)
    listed = _listed(rng, [9] * B, tq, 5, HKV if per_head else None)
    cache.attend(q, key_index=listed)                        # the plan of attend
    before = taken("kvcache")
    wide = cache.attend(q, key_index=listed.astype(np.int64))  # another dtype: the full path
    assert taken("kvcache") == before
    np.testing.assert_array_equal(wide, cache.attend(q, key_index=listed))
    assert taken("kvcache") == before + 1


def test_key_index_takes_the_paged_c_tail(rng):
    """PagedKVCache.attend / step with an int32 key_index: the paged C tail, its entries
    checked there; a bad one raises the full path's error and changes nothing."""
    pool = af.PagedKVCache(16, 4, HKV, D)
    seqs = [pool.add_sequence() for _ in range(B)]
    k, v = normal(rng, B, HKV, 10, D), normal(rng, B, HKV, 10, D)
    pool.append(seqs, k[:, :, :9], v[:, :, :9])
    q = normal(rng, B, H, 1, D)
    index = _listed(rng, [10] * B, 1, 6)
    first = pool.step(seqs, q, k[:, :, 9:], v[:, :, 9:], key_index=index)  # full checks
    for s_ in seqs:
        pool.truncate(s_, 9)
    before = taken("paged")
    out = pool.step(seqs, q, k[:, :, 9:], v[:, :, 9:], key_index=index)
    assert taken("paged") == before + 1
    np.testing.assert_array_equal(out, first)
    np.testing.assert_allclose(out, _listed_reference(q, k, v, index, [10] * B), **F32)
    bad = index.copy()
    bad[0, 0, 0] = 11                                            # past the 11 keys after a step
    with pytest.raises(ValueError, match="at or past"):
        pool.step(seqs, q, k[:, :, 9:], v[:, :, 9:], key_index=bad)
    assert [pool.length(s_) for s_ in seqs] == [10] * B          # nothing appended
    pool.attend(seqs, q, key_index=index)                       # the plan of attend
    before = taken("paged")
    np.testing.assert_array_equal(pool.attend(seqs, q, key_index=index), out)
    assert taken("paged") == before + 1


def test_a_latent_cache_steps_in_c(rng):
    cache = af.KVCache(1, 1, D, C, latent=True, v_head_dim=8)
    cache.append(normal(rng, 1, 1, 3, D))
    q, kn = normal(rng, 1, 4, 1, D), normal(rng, 1, 1, 1, D)
    cache.step(q, kn)
    before = taken("kvcache")
    out = cache.step(q, kn * 2)
    assert taken("kvcache") == before + 1
    np.testing.assert_array_equal(cache.k[0, 0, 4], kn[0, 0, 0] * 2)
    ref = expected(q, cache.k[:, :, :5], cache.k[:, :, :5, :8], causal=True)
    np.testing.assert_allclose(out, ref, **F32)


# ---------------------------------------------------------------- what the C tails decline

def test_a_16_bit_cache_fed_float32_tokens_takes_the_c_tail(rng):
    kc = np.zeros((B, HKV, C, D), np.float16)
    vc = np.zeros((B, HKV, C, D), np.float16)
    q, kn, vn = normal(rng, B, H, 1, D), normal(rng, B, HKV, 1, D), normal(rng, B, HKV, 1, D)
    af.attention_with_kvcache(q.astype(np.float16), kc, vc, 0, kn, vn)   # the plan
    before = taken("kvcache")
    out = af.attention_with_kvcache(q.astype(np.float16), kc, vc, 1, kn, vn)
    assert taken("kvcache") == before + 1, "rounded first, then the C tail"
    np.testing.assert_array_equal(kc[:, :, 1], kn[:, :, 0].astype(np.float16))
    ref = expected(q.astype(np.float16), kc[:, :, :2], vc[:, :, :2], causal=True)
    np.testing.assert_allclose(out, ref, rtol=2e-3, atol=2e-3)


def test_overlapping_out_and_read_only_caches_still_raise(rng):
    q, k, v = normal(rng, B, H, 1, D), normal(rng, B, HKV, 6, D), normal(rng, B, HKV, 6, D)
    af.attention(q, k, v, out=np.empty((B, H, 1, D), np.float32))
    with pytest.raises(ValueError, match="out"):
        af.attention(q, k, v, out=q)                       # out overlaps q
    kc, vc = normal(rng, B, HKV, C, D), normal(rng, B, HKV, C, D)
    kn, vn = normal(rng, B, HKV, 1, D), normal(rng, B, HKV, 1, D)
    af.attention_with_kvcache(q, kc, vc, 2, kn, vn)
    kc.flags.writeable = False
    state = kc.tobytes(), vc.tobytes()
    with pytest.raises(ValueError, match="k_cache"):
        af.attention_with_kvcache(q, kc, vc, 2, kn, vn)
    with pytest.raises(ValueError, match="cache_seqlens"):
        af.attention_with_kvcache(q, vc, kc, C, kn, vn)     # no room: nothing written
    assert (kc.tobytes(), vc.tobytes()) == state


def test_layout_key_tells_layouts_apart(rng):
    a = normal(rng, 2, 3, 4, 5)
    assert _ext.layout_key(a, a, a) == _ext.layout_key(a.copy(), a, a)
    assert _ext.layout_key(a, a, a) != _ext.layout_key(a.transpose(0, 2, 1, 3), a, a)
    assert _ext.layout_key(a, a, a) != _ext.layout_key(a.astype(">f4"), a, a)   # byte order
    assert _ext.layout_key(a, a, a) != _ext.layout_key(a.view(np.int32), a, a)
    assert _ext.layout_key(a, a, a) != _ext.layout_key(a, a, a, a)
    assert _ext.layout_key(a, a, a, None, a) != _ext.layout_key(a, a, a, a, None)
    assert _ext.layout_key(a, a, [1.0]) is None
    assert _ext.layout_key(a, a, np.ma.masked_array(a)) is None    # a subclass: full path


# ---------------------------------------------------------------- torch tensors

@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_tensor_view_matches_numpy_and_shares_memory():
    torch = pytest.importorskip("torch")
    import ml_dtypes
    from attnfast import _interop
    _interop.is_torch(torch.zeros(1))                       # registers torch with _ext
    base = torch.randn(2, 5, 3, 4)
    cases = [base, base.transpose(1, 2), base[:, 1:4, :, ::2], torch.randn(1, 4).expand(3, 4),
             base.to(torch.float64), base.to(torch.float16), torch.arange(6), base > 0,
             torch.tensor(2.5), torch.empty(0, 3), base.to(torch.int8)]
    for t in cases:
        before = _ext.tensor_views_taken()
        view = _ext.tensor_view(t)
        assert view is not None and _ext.tensor_views_taken() == before + 1
        ref = t.numpy()
        assert view.dtype == ref.dtype and view.shape == ref.shape
        assert view.strides == ref.strides and view.flags.writeable
        assert view.base is t.untyped_storage()  # what keeps the memory: the storage
        np.testing.assert_array_equal(view, ref)
        if t.numel():
            assert np.shares_memory(view, ref)
    bf = base.to(torch.bfloat16)
    view = _ext.tensor_view(bf)
    assert view.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(view.view(np.int16), bf.view(torch.int16).numpy())
    neg = torch.conj(torch.complex(torch.zeros_like(base), -base)).imag
    refused = [base.clone().requires_grad_(True), neg, base.to_sparse(), torch.nn.Parameter(base),
               torch.empty(2, device="meta"), base.to(torch.complex64), base.to(torch.float8_e4m3fn),
               torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(4, 3)]), base.numpy()]
    for t in refused:
        assert _ext.tensor_view(t) is None


def test_array_as_tensor_shares_memory_and_keeps_the_array_alive():
    torch = pytest.importorskip("torch")
    import gc
    import sys
    import ml_dtypes
    from attnfast import _interop
    _interop.is_torch(torch.zeros(1))                       # registers torch with _ext
    base = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    for a in [base, base[:, ::2, 1:], base.transpose(2, 0, 1), base.astype(np.float64),
              base.astype(np.float16), base.astype(ml_dtypes.bfloat16), base.astype(np.int64),
              base.astype(np.int32), base.astype(np.int8), base > 7, np.full((), 2.5, np.float32),
              np.empty((0, 3), np.float32)]:
        refs = sys.getrefcount(a)
        t = _ext.array_as_tensor(a)
        assert t is not None and tuple(t.shape) == a.shape
        assert tuple(s * a.itemsize for s in t.stride()) == a.strides
        if a.size:
            assert t.data_ptr() == a.ctypes.data
        got = (t.view(torch.int16).numpy().view(a.dtype) if t.dtype == torch.bfloat16
               else t.numpy())
        np.testing.assert_array_equal(got, a)
        assert sys.getrefcount(a) == refs + 1                # the tensor holds the array
        del t, got
        gc.collect()
        assert sys.getrefcount(a) == refs                    # and lets it go
    # the tensor outlives the caller's reference to the array
    t = _ext.array_as_tensor(np.full((4, 4), 3.0, np.float32))
    gc.collect()
    assert float(t.sum()) == 48.0
    # refused: the general path (torch.from_numpy, or a TypeError naming the dtype) decides
    for a in [np.ones(3, ">f4"), np.ones(3, np.complex64), np.ones(3, np.uint8),
              np.frombuffer(b"\0" * 16, np.float32), np.ones(3, np.float32).tolist()]:
        assert _ext.array_as_tensor(a) is None


def test_torch_calls_take_the_c_paths(rng):
    torch = pytest.importorskip("torch")
    q, kn, vn = (torch.from_numpy(normal(rng, B, h, 1, D)) for h in (H, HKV, HKV))
    kc, vc = (torch.from_numpy(normal(rng, B, HKV, C, D)) for _ in range(2))
    lens = torch.tensor([3, 6])
    af.attention_with_kvcache(q, kc, vc, lens, kn, vn)      # full checks: the plan
    views, calls = _ext.tensor_views_taken(), taken("kvcache")
    out = af.attention_with_kvcache(q, kc, vc, lens, kn * 2, vn * 2)
    assert isinstance(out, torch.Tensor)
    assert _ext.tensor_views_taken() == views + 6 and taken("kvcache") == calls + 1
    for b, s in enumerate((3, 6)):
        assert torch.equal(kc[b, :, s], kn[b, :, 0] * 2)
        ref = expected(q[b:b + 1].numpy(), kc[b:b + 1, :, :s + 1].numpy(),
                       vc[b:b + 1, :, :s + 1].numpy(), causal=True)
        np.testing.assert_allclose(out[b:b + 1].numpy(), ref, **F32)
    k, v = (torch.from_numpy(normal(rng, B, HKV, 5, D)) for _ in range(2))
    given = torch.empty(B, 1, H, D).transpose(1, 2)
    af.attention(q, k, v, out=given)
    before = taken("attention")
    assert af.attention(q, k, v, out=given) is given
    assert taken("attention") == before + 1
    np.testing.assert_allclose(given.numpy(), expected(q.numpy(), k.numpy(), v.numpy()),
                               **F32)


def test_the_transformers_backend_decodes_through_the_c_paths(rng):
    torch = pytest.importorskip("torch")
    aft = pytest.importorskip("attnfast.integrations.transformers")

    class Module:
        is_causal = True

    q = torch.from_numpy(normal(rng, 1, H, 1, D))
    k, v = (torch.from_numpy(normal(rng, 1, HKV, 9, D)) for _ in range(2))
    aft.attention_forward(Module(), q, k, v, None, scaling=0.25)
    views, calls = _ext.tensor_views_taken(), taken("attention")
    out, weights = aft.attention_forward(Module(), q, k, v, None, scaling=0.25)
    assert weights is None and out.shape == (1, 1, H, D)
    assert _ext.tensor_views_taken() == views + 3 and taken("attention") == calls + 1
    ref = expected(q.numpy(), k.numpy(), v.numpy(), causal=True, scale=0.25)
    np.testing.assert_allclose(out.transpose(1, 2).numpy(), ref, **F32)
    with pytest.raises(ValueError, match="^query requires grad"):
        with torch.no_grad():
            aft.attention_forward(Module(), q.clone().requires_grad_(True), k, v, None)


# ---------------------------------------------------------------- Ctrl-C in the C tails

_INTERRUPTED_STEP = """
import signal, time, numpy as np, attnfast as af
from attnfast import _ext
signal.signal(signal.SIGINT, signal.default_int_handler)
af.set_num_threads(1)
q = np.random.default_rng(0).random((1, 8, 16384, 64), dtype=np.float32)
q2 = q * 2
{setup}
taken = _ext.fast_calls_taken["kvcache"]
print("READY", flush=True)
try:
    {call}
except KeyboardInterrupt:
    print("INTERRUPTED", {after}, _ext.fast_calls_taken["kvcache"] - taken, flush=True)
    raise
print("FINISHED", flush=True)
"""


def _interrupted(setup, call, after):
    code = _INTERRUPTED_STEP.format(setup=setup, call=call, after=after)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        return out, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# The first call (full checks) stores the plan cheaply: with query_offset = -16385 no query
# sees a key. The second, of the same layout, takes the C tail and attends causally over
# 16384 keys (seconds on one thread): Ctrl-C stops it after its writes.

def test_ctrl_c_in_a_c_kvcache_step_restores_cache_and_lengths(parent_sigint):
    setup = ("cache = af.KVCache(1, 8, 64, 16384)\n"
             "cache.step(q, q, q, query_offset=-16385)\n"
             "cache.truncate(0)\n"
             "k_before, v_before = cache.k.copy(), cache.v.copy()")
    out, err = _interrupted(setup, "cache.step(q2, q2, q2)",
                            "cache.lengths.tolist(), bool(np.array_equal(cache.k, k_before) "
                            "and np.array_equal(cache.v, v_before))")
    assert "FINISHED" not in out, "the step is not long enough for this test"
    line = [ln for ln in out.splitlines() if ln.startswith("INTERRUPTED")]
    assert line, out + err
    assert line[0] == "INTERRUPTED [0] True 1", f"not restored, or not the C tail: {line[0]}"


def test_ctrl_c_in_a_c_attention_with_kvcache_restores_the_caches(parent_sigint):
    setup = ("kc, vc = np.zeros_like(q), np.zeros_like(q)\n"
             "af.attention_with_kvcache(q, kc, vc, 0, q, q, query_offset=-16385)\n"
             "k_before, v_before = kc.copy(), vc.copy()")
    out, err = _interrupted(setup, "af.attention_with_kvcache(q, kc, vc, 0, q2, q2)",
                            "bool(np.array_equal(kc, k_before) and np.array_equal(vc, v_before))")
    assert "FINISHED" not in out, "the call is not long enough for this test"
    line = [ln for ln in out.splitlines() if ln.startswith("INTERRUPTED")]
    assert line, out + err
    assert line[0] == "INTERRUPTED True 1", f"not restored, or not the C tail: {line[0]}"
