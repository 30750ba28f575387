"""Reliability at the edges (issue 19), one section per class of failure:

1. strides that are not a whole number of elements (fields of structured arrays);
2. state changed by a call that then raises (Ctrl-C, an overflow warning made an error);
3. two arrays a call writes (or one it writes and one it reads) that share memory;
4. error messages that must name the caller's argument and values;
5. the non-finite rule of an int8 cache (one scale per row);
6. (in tests/test_reliability.py and tests/test_fast_paths.py: the Ctrl-C tests set the
   SIGINT disposition they test, whatever the parent's).

Every numerical check is against tests/reference.py (float64 NumPy).
"""
import warnings

import ml_dtypes
import numpy as np
import pytest

import attnfast as af
from attnfast import _ext, _transaction
from reference import TOLERANCE, reference_attention


def normal(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def field(values, pad_dtype):
    """`values` as field "x" of a structured array whose records also hold a `pad_dtype`
    field: a view whose strides are not a whole number of `values`' elements."""
    rec = np.zeros(values.shape, dtype=[("x", values.dtype), ("pad", pad_dtype)])
    rec["x"] = values
    view = rec["x"]
    assert any(s % values.itemsize for s in view.strides)
    return view


def assert_close(actual, expected, dtype=np.float32):
    np.testing.assert_allclose(actual, expected, **TOLERANCE[np.dtype(dtype)])


def cache_state(cache):
    """Every byte and number of a KVCache's state."""
    arrays = [cache.k, cache.v, cache.lengths] + [a for a in (cache.k_scale, cache.v_scale)
                                                  if a is not None]
    return [a.tobytes() for a in arrays]


def paged_state(cache):
    """Every byte and number of a PagedKVCache's state: pools, scales, free list, reference
    counts, sequences with their blocks and lengths."""
    arrays = [cache.k, cache.v] + [a for a in (cache.k_scale, cache.v_scale) if a is not None]
    return ([a.tobytes() for a in arrays], list(cache._free), cache._refs.tobytes(),
            cache._next_id, [(s, cache.blocks(s), cache.length(s)) for s in cache.sequences])


class Interrupt:
    """Stands in for attnfast._ext.run_attention and raises KeyboardInterrupt, as the real
    one does when Ctrl-C stops the kernels."""

    def __call__(self, *args, **kwargs):
        raise KeyboardInterrupt("attnfast: interrupted")


def kernels_raise(monkeypatch, fake):
    """`fake` (a callable that raises) runs where the kernels would, on every path: for
    attnfast._ext.run_attention (the full path) and as the C tails' hook."""
    monkeypatch.setattr(_ext, "run_attention", fake)
    monkeypatch.setitem(_ext.fast_call_hooks, "before_kernels", fake)


# ============================================================ 1. whole-element strides

@pytest.mark.parametrize("dtype,pad", [(np.float32, np.int16), (np.float64, np.int32)],
                         ids=["float32 stride 6", "float64 stride 12"])
def test_a_mask_with_a_fractional_stride_is_read_by_value(rng, dtype, pad):
    q, k, v = (normal(rng, 2, 3, n, 8, dtype=dtype) for n in (5, 7, 7))
    mask = normal(rng, 2, 3, 5, 7, dtype=dtype)
    out = af.attention(q, k, v, mask=field(mask, pad))
    assert_close(out, reference_attention(q, k, v, mask=mask)[0], dtype)


@pytest.mark.parametrize("dtype,pad", [(np.float32, np.int16), (np.float64, np.int32)])
def test_kvcache_attend_reads_a_fractional_stride_mask_by_value(rng, dtype, pad):
    cache = af.KVCache(1, 2, 8, 12, dtype=dtype)
    k, v = normal(rng, 1, 2, 9, 8, dtype=dtype), normal(rng, 1, 2, 9, 8, dtype=dtype)
    cache.append(k, v)
    q = normal(rng, 1, 4, 3, 8, dtype=dtype)
    mask = normal(rng, 1, 1, 3, 12, dtype=dtype)
    out = cache.attend(q, mask=field(mask, pad), causal=False)
    assert_close(out, reference_attention(q, k, v, mask=mask[..., :9])[0], dtype)


def test_every_other_array_with_a_fractional_stride_is_read_by_value(rng):
    """slopes, sinks, lengths and block tables as fields of structured arrays."""
    pools = normal(rng, 6, 2, 4, 8), normal(rng, 6, 2, 4, 8)
    table = np.array([[5, 1, 3], [0, 2, 4]], np.int64)
    lengths = np.array([10, 7], np.int64)
    q = normal(rng, 2, 4, 1, 8)
    slopes = np.abs(normal(rng, 4)) / 4
    sinks = normal(rng, 4)
    want = af.attention_with_kvcache(q, *pools, lengths, block_table=table,
                                     alibi_slopes=slopes, sinks=sinks)
    got = af.attention_with_kvcache(q, *pools, field(lengths, np.int32),
                                    block_table=field(table, np.int32),
                                    alibi_slopes=field(slopes, np.int16),
                                    sinks=field(sinks, np.int16))
    assert np.array_equal(got, want)
    for b in range(2):  # and against the reference over the gathered tokens
        blocks = table[b, :3]
        kb = pools[0][blocks].transpose(1, 0, 2, 3).reshape(2, 12, 8)[:, :lengths[b]]
        vb = pools[1][blocks].transpose(1, 0, 2, 3).reshape(2, 12, 8)[:, :lengths[b]]
        ref = reference_attention(q[b], kb, vb, causal=True, alibi_slopes=slopes, sinks=sinks)[0]
        assert_close(got[b], ref)


def test_the_bridge_refuses_a_stride_that_is_not_whole_elements(rng):
    """The last line of defence: attnfast._ext never truncates a stride."""
    q = normal(rng, 1, 1, 2, 4)
    out = np.empty_like(q)
    mask = field(normal(rng, 1, 1, 2, 2), np.int16)
    with pytest.raises(TypeError, match="not a whole number"):
        _ext.run_attention(q, q, q, out, None, causal=False, scale=0.5, window_left=-1,
                           window_right=-1, num_threads=1, mask=mask)


def test_scales_with_a_fractional_stride_are_rejected_not_copied(rng):
    """Scales are written in place: a copy would lose the writes, so they are refused."""
    kc, vc = np.zeros((1, 1, 4, 8), np.int8), np.zeros((1, 1, 4, 8), np.int8)
    ks, vs = field(np.zeros((1, 1, 4), np.float32), np.int16), np.zeros((1, 1, 4), np.float32)
    with pytest.raises(ValueError, match="k_scale must be aligned with strides that are whole"):
        af.attention_with_kvcache(normal(rng, 1, 1, 1, 8), kc, vc, 0, normal(rng, 1, 1, 1, 8),
                                  normal(rng, 1, 1, 1, 8), k_scale=ks, v_scale=vs)


# ============================================================ 2. transactions

def _pool_with_a_sequence(rng, num_blocks=64, block_size=4, length=10):
    cache = af.PagedKVCache(num_blocks, block_size, 2, 8)
    a = cache.add_sequence()
    cache.append(a, normal(rng, 2, length, 8), normal(rng, 2, length, 8))
    return cache, a


def test_interrupted_paged_step_gives_back_every_block(rng, monkeypatch):
    cache, a = _pool_with_a_sequence(rng)
    before = paged_state(cache)
    kernels_raise(monkeypatch, Interrupt())
    with pytest.raises(KeyboardInterrupt):  # 30 tokens: 8 blocks more than it holds
        cache.step(a, normal(rng, 4, 30, 8), normal(rng, 2, 30, 8), normal(rng, 2, 30, 8))
    assert paged_state(cache) == before


def test_interrupted_paged_step_then_fork_keeps_the_other_sequence(rng, monkeypatch):
    """The issue's corruption: blocks kept by an interrupted step were shared by a fork
    without copy-on-write, so appending to one sequence overwrote the other's token."""
    cache, a = _pool_with_a_sequence(rng, length=8)  # two full blocks
    kernels_raise(monkeypatch, Interrupt())
    with pytest.raises(KeyboardInterrupt):
        cache.step(a, normal(rng, 4, 6, 8), normal(rng, 2, 6, 8), normal(rng, 2, 6, 8))
    monkeypatch.undo()
    b = cache.fork(a)
    kb, vb = normal(rng, 2, 1, 8), normal(rng, 2, 1, 8)
    cache.append(b, kb, vb)
    ka = normal(rng, 2, 1, 8)
    cache.append(a, ka, normal(rng, 2, 1, 8))
    table = cache.block_table([b])
    k_of_b = cache.k[table[0, 2], :, 0]  # b's token 8
    assert np.array_equal(k_of_b, kb[:, 0]), "appending to a overwrote b's token"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["KVCache.append", "KVCache.step", "PagedKVCache.append",
                                  "PagedKVCache.step", "attention_with_kvcache"])
def test_overflow_to_16_bits_is_inf_without_a_warning(rng, dtype, kind):
    """float32 values beyond a 16-bit cache's range are stored as +-inf, as the cast gives;
    attnfast raises no warning, so a warnings filter of "error" cannot stop a write half-way."""
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    big = np.float32(1e6) if dt == np.float16 else np.finfo(np.float32).max
    k_new, v_new = normal(rng, 1, 2, 3, 8), normal(rng, 1, 2, 3, 8)
    k_new[0, 1, 2, 5], v_new[0, 0, 0, 0] = big, -big
    q = normal(rng, 1, 2, 3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if kind.startswith("KVCache"):
            cache = af.KVCache(1, 2, 8, 6, dtype=dt)
            (cache.append(k_new, v_new) if kind.endswith("append")
             else cache.step(q, k_new, v_new))
            k, v = cache.k[:, :, :3], cache.v[:, :, :3]
        elif kind.startswith("Paged"):
            cache = af.PagedKVCache(4, 2, 2, 8, dtype=dt)
            s = cache.add_sequence()
            (cache.append(s, k_new[0], v_new[0]) if kind.endswith("append")
             else cache.step(s, q[0], k_new[0], v_new[0]))
            blocks = cache.block_table([s])[0, :2]
            k = cache.k[blocks].transpose(1, 0, 2, 3).reshape(1, 2, 4, 8)[:, :, :3]
            v = cache.v[blocks].transpose(1, 0, 2, 3).reshape(1, 2, 4, 8)[:, :, :3]
        else:
            kc, vc = np.zeros((1, 2, 6, 8), dt), np.zeros((1, 2, 6, 8), dt)
            af.attention_with_kvcache(q, kc, vc, 0, k_new, v_new)
            k, v = kc[:, :, :3], vc[:, :, :3]
    with np.errstate(over="ignore"):
        want_k, want_v = k_new.astype(dt), v_new.astype(dt)
    assert np.isposinf(k[0, 1, 2, 5].astype(np.float32)) and np.isneginf(v[0, 0, 0, 0].astype(np.float32))
    assert k.tobytes() == want_k.tobytes() and v.tobytes() == want_v.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8])
@pytest.mark.parametrize("error", [KeyboardInterrupt, MemoryError])
def test_a_raising_kvcache_step_leaves_every_byte(rng, monkeypatch, dtype, error):
    cache = af.KVCache(2, 2, 8, 16, dtype=dtype)
    cache.append(normal(rng, 2, 2, 5, 8), normal(rng, 2, 2, 5, 8))
    stored = np.float32 if dtype == np.int8 else dtype  # an int8 cache takes float32
    q, kn, vn = (normal(rng, 2, 2, 1, 8, dtype=stored) for _ in range(3))
    cache.step(q, kn, vn)  # a good step: the next one of this layout takes the fast path
    before = cache_state(cache)

    def fail(*args, **kwargs):
        raise error("attnfast test")
    kernels_raise(monkeypatch, fail)
    for index, return_lse in ((None, False), (None, True), ([1], False)):  # fast, full paths
        rows = slice(None) if index is None else slice(1, 2)
        with pytest.raises(error):
            cache.step(q[rows], kn[rows], vn[rows], batch_index=index, return_lse=return_lse)
        assert cache_state(cache) == before
    real = _transaction.write_rows

    def fails_once_written(*args):  # the rows are in, the lengths not yet advanced
        real(*args)
        raise error("attnfast test")
    with pytest.raises(error):  # append has no kernel: fail it in the middle of its writes
        monkeypatch.setattr(_transaction, "write_rows", fails_once_written)
        cache.append(kn, vn)
    monkeypatch.undo()
    assert cache_state(cache) == before


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.int8])
def test_a_raising_functional_call_restores_the_callers_caches(rng, monkeypatch, paged, dtype):
    q, kn, vn = normal(rng, 2, 2, 2, 8), normal(rng, 2, 1, 2, 8), normal(rng, 2, 1, 2, 8)
    int8 = dtype == np.int8
    if paged:
        kc, vc = (rng.integers(-9, 9, (6, 1, 4, 8)).astype(dtype) for _ in range(2))
        extra = dict(block_table=np.array([[0, 1], [2, 3]]))
        sshape = (6, 1, 4)
    else:
        kc, vc = (rng.integers(-9, 9, (2, 1, 8, 8)).astype(dtype) for _ in range(2))
        extra = {}
        sshape = (2, 1, 8)
    if int8:
        extra.update(k_scale=np.ones(sshape, np.float32), v_scale=np.ones(sshape, np.float32))
    arrays = [kc, vc] + ([extra["k_scale"], extra["v_scale"]] if int8 else [])
    lengths = np.array([3, 5])
    af.attention_with_kvcache(q, kc, vc, lengths, kn, vn, **extra)  # a plan for the fast path
    before = [a.tobytes() for a in arrays]
    kernels_raise(monkeypatch, Interrupt())
    with pytest.raises(KeyboardInterrupt):
        af.attention_with_kvcache(q, kc, vc, lengths + 1, kn, vn, **extra)
    assert [a.tobytes() for a in arrays] == before


def test_a_raising_paged_append_fork_and_free_change_nothing(rng, monkeypatch):
    """An exception anywhere inside a mutating call (here from the pool writes, the
    reference counting and the block release) puts everything back."""
    cache, a = _pool_with_a_sequence(rng, length=6)
    b = cache.fork(a)
    before = paged_state(cache)
    import attnfast._paged as paged

    def boom(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(paged, "write_tokens", boom)
    with pytest.raises(KeyboardInterrupt):  # after copy-on-write of the shared last block
        cache.append(b, normal(rng, 2, 5, 8), normal(rng, 2, 5, 8))
    assert paged_state(cache) == before
    monkeypatch.undo()
    monkeypatch.setattr(cache, "_release", boom)
    with pytest.raises(KeyboardInterrupt):
        cache.free(a)
    assert paged_state(cache) == before
    monkeypatch.undo()
    monkeypatch.setattr(cache, "_new_sequence", boom)  # after the counts went up
    with pytest.raises(KeyboardInterrupt):
        cache.fork(a)
    monkeypatch.undo()
    assert paged_state(cache) == before


# ============================================================ 3. aliasing of written arrays

@pytest.mark.parametrize("paged", [False, True])
def test_one_array_for_both_scales_is_rejected_with_new_tokens(rng, paged):
    shape = (4, 1, 4) if paged else (1, 1, 8)
    s = np.ones(shape, np.float32)
    kc, vc = np.zeros(shape + (8,), np.int8), np.zeros(shape + (8,), np.int8)
    extra = dict(block_table=np.array([[0, 1]])) if paged else {}
    before = s.tobytes(), kc.tobytes(), vc.tobytes()
    with pytest.raises(ValueError, match="k_scale and v_scale share memory"):
        af.attention_with_kvcache(normal(rng, 1, 1, 1, 8), kc, vc, 2, normal(rng, 1, 1, 1, 8),
                                  normal(rng, 1, 1, 1, 8), k_scale=s, v_scale=s, **extra)
    assert (s.tobytes(), kc.tobytes(), vc.tobytes()) == before
    # without new tokens nothing is written: one array may serve as both
    out = af.attention_with_kvcache(normal(rng, 1, 1, 1, 8), kc, vc, 2, k_scale=s, v_scale=s,
                                    **extra)
    assert np.array_equal(out, np.zeros_like(out))


@pytest.mark.parametrize("case", ["scale in cache", "q in cache", "k_new in v_cache",
                                  "mask in k_scale", "out in k_scale"])
def test_every_written_array_is_apart_from_the_others_and_from_what_is_read(rng, case):
    buf = np.zeros(4096, np.float32)
    kc = buf[:64].view(np.int8).reshape(1, 1, 32, 8)
    vc = np.zeros((1, 1, 32, 8), np.int8)
    ks, vs = np.ones((1, 1, 32), np.float32), np.ones((1, 1, 32), np.float32)
    q, kn, vn = normal(rng, 1, 1, 1, 8), normal(rng, 1, 1, 1, 8), normal(rng, 1, 1, 1, 8)
    opts = {}
    if case == "scale in cache":
        ks = buf[:32].reshape(1, 1, 32)
        want = "k_cache and k_scale share memory"
    elif case == "q in cache":
        q = buf[:8].reshape(1, 1, 1, 8)
        want = "k_cache overlaps the memory of q"
    elif case == "k_new in v_cache":  # every entry of k_new reads one float32 of v_cache
        kn = np.lib.stride_tricks.as_strided(vc.view(np.float32), (1, 1, 1, 8), (0, 0, 0, 0))
        want = "v_cache overlaps the memory of k_new"
    elif case == "mask in k_scale":
        opts["mask"] = ks[:, :, None, :]
        want = "k_scale overlaps the memory of mask"
    else:
        opts["out"] = np.lib.stride_tricks.as_strided(ks, (1, 1, 1, 8), (4, 4, 4, 4))
        want = "out overlaps the memory of k_scale"
    state = [a.tobytes() for a in (kc, vc, ks, vs)]
    with pytest.raises(ValueError, match=want):
        af.attention_with_kvcache(q, kc, vc, 3, kn, vn, k_scale=ks, v_scale=vs, **opts)
    assert [a.tobytes() for a in (kc, vc, ks, vs)] == state


@pytest.mark.parametrize("option", ["mask", "alibi_slopes", "sinks"])
def test_out_apart_from_the_option_arrays_attention_reads(rng, option):
    q, k, v = normal(rng, 1, 2, 4, 8), normal(rng, 1, 2, 4, 8), normal(rng, 1, 2, 4, 8)
    out = np.zeros((1, 2, 4, 8), np.float32)
    arrays = dict(mask=out[0, 0, :, :4], alibi_slopes=out[0, 0, 0, :2], sinks=out[0, 0, 0, :2])
    before = out.tobytes()
    with pytest.raises(ValueError, match=f"out overlaps the memory of {option}"):
        af.attention(q, k, v, out=out, **{option: arrays[option]})
    assert out.tobytes() == before


# ============================================================ 4. messages

def test_a_huge_softcap_is_a_value_error_naming_it(rng):
    q = normal(rng, 4, 8)
    with pytest.raises(ValueError, match=r"softcap must be finite and > 0 in float32, got 1000"):
        af.attention(q, q, q, softcap=10**400)


@pytest.mark.parametrize("where", ["cache_seqlens int", "cache_seqlens list", "batch_index",
                                   "truncate", "truncate list"])
def test_ints_beyond_int64_are_named_with_their_value(rng, where):
    big = 10**30
    cache = af.KVCache(2, 1, 8, 8)
    q = normal(rng, 2, 1, 1, 8)
    if where == "cache_seqlens int":
        call, want = (lambda: af.attention_with_kvcache(q, cache.k, cache.v, big),
                      rf"cache_seqlens = {big} is outside the int64 range")
    elif where == "cache_seqlens list":
        call, want = (lambda: af.attention_with_kvcache(q, cache.k, cache.v, [1, big]),
                      rf"cache_seqlens\[1\] = {big} is outside the int64 range")
    elif where == "batch_index":
        call, want = (lambda: cache.attend(q[:1], batch_index=big),
                      rf"batch_index = {big} is outside the int64 range")
    elif where == "truncate":
        call, want = lambda: cache.truncate(big), rf"n = {big} is outside the int64 range"
    else:
        call, want = lambda: cache.truncate([0, -big]), rf"n\[1\] = -{big} is outside the int64"
    with pytest.raises(ValueError, match=want):
        call()


def test_a_0d_integer_array_is_one_sequence_id(rng):
    cache = af.PagedKVCache(8, 4, 1, 8)
    s = cache.add_sequence()
    k, v, q = normal(rng, 1, 3, 8), normal(rng, 1, 3, 8), normal(rng, 2, 3, 8)
    out = cache.step(np.array(s), q, k, v)  # 3-D q, as for a bare id
    assert out.shape == (2, 3, 8)
    assert_close(out, reference_attention(q, k, v, causal=True)[0])
    assert cache.length(np.array(s)) == 3
    with pytest.raises(ValueError, match=r"seq_ids: no sequence 7 in this cache"):
        cache.attend(np.array(7), q)


def test_varlen_slopes_of_the_wrong_shape_are_reported_as_passed(rng):
    q, k, v = normal(rng, 6, 2, 8), normal(rng, 6, 2, 8), normal(rng, 6, 2, 8)
    cu = np.array([0, 2, 6])
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(H,\) = \(2,\) or "
                       r"\(batch, H\) = \(2, 2\) .*got \(2, 3\)"):
        af.attention_varlen(q, k, v, cu, cu, alibi_slopes=np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"got \(3, 2\)"):
        af.attention_varlen(q, k, v, cu, cu, alibi_slopes=np.ones((3, 2), np.float32))


# ============================================================ 5. int8: one scale per row

@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("which", ["value", "key"])
def test_int8_a_nonfinite_entry_poisons_its_whole_row(rng, bad, which):
    """An int8 row has one scale: a NaN or inf anywhere in a key or value row gives the row a
    NaN scale, so every column of out (and lse, for a key) is NaN for the queries that see
    it (README, reliability rules and int8 section); the other queries are unaffected."""
    cache = af.KVCache(1, 1, 8, 16, dtype=np.int8)
    k, v = normal(rng, 1, 1, 12, 8), normal(rng, 1, 1, 12, 8)
    (v if which == "value" else k)[0, 0, 6, 3] = bad
    cache.append(k, v)
    assert np.isnan(cache.v_scale[0, 0, 6] if which == "value" else cache.k_scale[0, 0, 6])
    q = normal(rng, 1, 2, 12, 8)
    out, lse = cache.attend(q, return_lse=True)  # causal: query i sees keys 0..i
    sees = np.arange(12) >= 6
    assert np.isnan(out[0][:, sees]).all()
    assert np.isfinite(out[0][:, ~sees]).all()
    if which == "key":
        assert np.isnan(lse[0][:, sees]).all()
    else:
        assert np.isfinite(lse[0]).all()
    ref = reference_attention(q[0][:, ~sees], k[0, :, :6], v[0, :, :6], causal=True)[0]
    np.testing.assert_allclose(out[0][:, ~sees], ref, atol=0.05, rtol=0.05)
