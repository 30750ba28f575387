"""KVCache and attention_with_kvcache: semantics, and every bad input rejected with
nothing written."""
import numpy as np
import pytest

import attnfast as af
from reference import TOLERANCE, reference_attention


def tokens(rng, batch, heads, t, dim, dtype=np.float32):
    return rng.standard_normal((batch, heads, t, dim)).astype(dtype)


def snapshot(cache):
    return cache.k.copy(), cache.v.copy(), cache.lengths.copy()


def assert_unchanged(cache, snap):
    k, v, lengths = snap
    assert np.array_equal(cache.k, k, equal_nan=True)
    assert np.array_equal(cache.v, v, equal_nan=True)
    assert np.array_equal(cache.lengths, lengths)


# ---------------------------------------------------------------- KVCache semantics

def test_new_cache_is_empty_and_shaped():
    cache = af.KVCache(3, 2, 16, 50, dtype=np.float64, v_head_dim=8)
    assert cache.k.shape == (3, 2, 50, 16) and cache.v.shape == (3, 2, 50, 8)
    assert cache.k.dtype == np.float64 and cache.dtype == np.float64
    assert cache.lengths.dtype == np.int64 and np.array_equal(cache.lengths, [0, 0, 0])
    assert (cache.batch, cache.kv_heads, cache.head_dim, cache.v_head_dim, cache.capacity) == (3, 2, 16, 8, 50)
    with pytest.raises(ValueError):
        cache.lengths[0] = 5  # read-only view: lengths change only through the methods


def test_append_writes_at_each_sequence_end(rng):
    cache = af.KVCache(2, 2, 4, 10)
    k1, v1 = tokens(rng, 2, 2, 3, 4), tokens(rng, 2, 2, 3, 4)
    cache.append(k1, v1)
    k2, v2 = tokens(rng, 1, 2, 2, 4), tokens(rng, 1, 2, 2, 4)
    cache.append(k2, v2, batch_index=1)
    assert np.array_equal(cache.lengths, [3, 5])
    assert np.array_equal(cache.k[:, :, :3], k1) and np.array_equal(cache.v[:, :, :3], v1)
    assert np.array_equal(cache.k[1, :, 3:5], k2[0]) and np.array_equal(cache.v[1, :, 3:5], v2[0])
    assert np.all(cache.k[0, :, 3:] == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 1), (3, 3)])
def test_prompt_then_token_by_token_equals_one_causal_attention(rng, dtype, heads, kv_heads):
    B, T, P, D, Dv = 2, 60, 23, 32, 24
    q = tokens(rng, B, heads, T, D, dtype)
    k = tokens(rng, B, kv_heads, T, D, dtype)
    v = tokens(rng, B, kv_heads, T, Dv, dtype)
    whole, whole_lse = af.attention(q, k, v, causal=True, return_lse=True)

    cache = af.KVCache(B, kv_heads, D, 64, dtype=dtype, v_head_dim=Dv)
    outs, lses = [], []
    out, lse = cache.step(q[:, :, :P], k[:, :, :P], v[:, :, :P], return_lse=True)  # prefill
    outs.append(out), lses.append(lse)
    for t in range(P, T):  # decode
        out, lse = cache.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], return_lse=True)
        outs.append(out), lses.append(lse)
    tol = TOLERANCE[np.dtype(dtype)]
    np.testing.assert_allclose(np.concatenate(outs, axis=2), whole, **tol)
    np.testing.assert_allclose(np.concatenate(lses, axis=2), whole_lse, **tol)
    ref_out, _, _ = reference_attention(q, k, v, causal=True)
    np.testing.assert_allclose(np.concatenate(outs, axis=2), ref_out, **tol)
    assert np.array_equal(cache.lengths, [T, T])


def test_step_with_several_tokens_is_causal_over_the_cache(rng):
    cache = af.KVCache(1, 2, 16, 40)
    k, v, q = tokens(rng, 1, 2, 30, 16), tokens(rng, 1, 2, 30, 16), tokens(rng, 1, 4, 30, 16)
    cache.append(k[:, :, :26], v[:, :, :26])
    out = cache.step(q[:, :, 26:], k[:, :, 26:], v[:, :, 26:])  # 4 new tokens
    ref_out, _, _ = reference_attention(q, k, v, causal=True)
    np.testing.assert_allclose(out, ref_out[:, :, 26:], **TOLERANCE[np.dtype(np.float32)])
    non_causal = cache.attend(q[:, :, 26:], causal=False)
    ref_nc, _, _ = reference_attention(q[:, :, 26:], k, v, causal=False)
    np.testing.assert_allclose(non_causal, ref_nc, **TOLERANCE[np.dtype(np.float32)])


def test_different_lengths_per_sequence(rng):
    cache = af.KVCache(3, 2, 8, 100, dtype=np.float64)
    lengths = [70, 0, 13]
    keys = {}
    for b, n in enumerate(lengths):
        if n:
            keys[b] = (tokens(rng, 1, 2, n, 8, np.float64), tokens(rng, 1, 2, n, 8, np.float64))
            cache.append(*keys[b], batch_index=b)
    assert np.array_equal(cache.lengths, lengths)
    q = tokens(rng, 3, 4, 2, 8, np.float64)
    out, lse = cache.attend(q, return_lse=True)
    for b, n in enumerate(lengths):
        if n == 0:  # an empty sequence: zeros and lse = -inf, never NaN
            assert np.all(out[b] == 0) and np.all(np.isneginf(lse[b]))
            continue
        ref_out, ref_lse, _ = reference_attention(q[b], keys[b][0][0], keys[b][1][0], causal=True)
        np.testing.assert_allclose(out[b], ref_out, **TOLERANCE[np.dtype(np.float64)])
        np.testing.assert_allclose(lse[b], ref_lse, **TOLERANCE[np.dtype(np.float64)])


@pytest.mark.parametrize("batch_index", [1, [3], [0, 2], [1, 2, 3], [3, 0], [2, 0, 3]],
                         ids=["int", "one", "stride2", "range", "reversed", "scattered"])
def test_batch_index_selects_sequences(rng, batch_index):
    B, D = 4, 8
    cache = af.KVCache(B, 1, D, 30)
    cache.append(tokens(rng, B, 1, 5, D), tokens(rng, B, 1, 5, D))
    seqs = np.atleast_1d(batch_index)
    n = seqs.size
    before = snapshot(cache)
    k_new, v_new, q = tokens(rng, n, 1, 2, D), tokens(rng, n, 1, 2, D), tokens(rng, n, 2, 2, D)
    out = cache.step(q, k_new, v_new, batch_index=batch_index)
    for i, b in enumerate(seqs):
        assert cache.lengths[b] == 7
        np.testing.assert_array_equal(cache.k[b, :, 5:7], k_new[i])
        ref_out, _, _ = reference_attention(q[i], cache.k[b, :, :7], cache.v[b, :, :7], causal=True)
        np.testing.assert_allclose(out[i], ref_out, **TOLERANCE[np.dtype(np.float32)])
    others = np.setdiff1d(np.arange(B), seqs)
    assert np.array_equal(cache.lengths[others], before[2][others])
    assert np.array_equal(cache.k[others], before[0][others])


def test_truncate_rolls_back(rng):
    cache = af.KVCache(2, 1, 8, 20)
    k, v, q = tokens(rng, 2, 1, 12, 8), tokens(rng, 2, 1, 12, 8), tokens(rng, 2, 2, 1, 8)
    cache.append(k[:, :, :10], v[:, :, :10])
    expected = cache.attend(q)
    cache.append(k[:, :, 10:], v[:, :, 10:])  # speculative tokens, then rejected
    cache.truncate(10)
    assert np.array_equal(cache.lengths, [10, 10])
    assert np.array_equal(cache.attend(q), expected)
    cache.truncate([10, 4])  # one length per sequence
    assert np.array_equal(cache.lengths, [10, 4])
    snap = snapshot(cache)
    with pytest.raises(ValueError, match="only shortens"):
        cache.truncate(5)  # sequence 1 holds only 4
    with pytest.raises(ValueError, match=">= 0"):
        cache.truncate(-1)
    with pytest.raises(TypeError):
        cache.truncate(2.5)
    with pytest.raises(ValueError, match="shape"):
        cache.truncate([1, 2, 3])
    assert_unchanged(cache, snap)


def test_reset_empties_every_sequence(rng):
    cache = af.KVCache(2, 1, 4, 6)
    cache.append(tokens(rng, 2, 1, 6, 4), tokens(rng, 2, 1, 6, 4))
    cache.reset()
    assert np.array_equal(cache.lengths, [0, 0])
    k, v = tokens(rng, 2, 1, 6, 4), tokens(rng, 2, 1, 6, 4)
    cache.append(k, v)  # the whole capacity is free again
    assert np.array_equal(cache.k, k)


def test_overflow_raises_and_leaves_cache_bit_identical(rng):
    cache = af.KVCache(2, 2, 4, 8)
    cache.append(tokens(rng, 2, 2, 6, 4), tokens(rng, 2, 2, 6, 4))
    cache.append(tokens(rng, 1, 2, 1, 4), tokens(rng, 1, 2, 1, 4), batch_index=0)  # 7 and 6
    snap = snapshot(cache)
    with pytest.raises(ValueError, match="capacity"):
        cache.append(tokens(rng, 2, 2, 2, 4), tokens(rng, 2, 2, 2, 4))  # sequence 0 has 1 slot
    with pytest.raises(ValueError, match="capacity"):
        cache.step(tokens(rng, 2, 2, 3, 4), tokens(rng, 2, 2, 3, 4), tokens(rng, 2, 2, 3, 4))
    with pytest.raises(ValueError, match="capacity"):
        cache.append(tokens(rng, 1, 2, 3, 4), tokens(rng, 1, 2, 3, 4), batch_index=1)
    assert_unchanged(cache, snap)
    cache.append(tokens(rng, 1, 2, 2, 4), tokens(rng, 1, 2, 2, 4), batch_index=1)  # exactly fits
    assert np.array_equal(cache.lengths, [7, 8])


# ---------------------------------------------------------------- KVCache bad inputs

@pytest.mark.parametrize("kwargs,error", [
    (dict(batch=0), ValueError), (dict(kv_heads=-1), ValueError), (dict(head_dim=2.0), TypeError),
    (dict(capacity=0), ValueError), (dict(dtype=np.int32), TypeError),
    (dict(dtype=np.uint8), TypeError), (dict(v_head_dim=0), ValueError),
])
def test_bad_constructor_arguments(kwargs, error):
    args = dict(batch=2, kv_heads=2, head_dim=8, capacity=16)
    args.update(kwargs)
    with pytest.raises(error):
        af.KVCache(args.pop("batch"), args.pop("kv_heads"), args.pop("head_dim"),
                   args.pop("capacity"), **args)


def bad_step_calls(rng):
    """(description, call(cache), expected error, message pattern): each must leave the
    cache unchanged."""
    B, Hkv, D = 2, 2, 8
    q, k, v = tokens(rng, B, 4, 1, D), tokens(rng, B, Hkv, 1, D), tokens(rng, B, Hkv, 1, D)
    return [
        ("heads not a multiple of kv heads", lambda c: c.step(tokens(rng, B, 3, 1, D), k, v), ValueError, 'multiple of kv heads'),
        ("q of another dtype", lambda c: c.step(q.astype(np.float64), k, v), TypeError, 'q has dtype float64 and the cache'),
        ("k_new of another dtype", lambda c: c.step(q, k.astype(np.float64), v), TypeError, 'k_new must have'),
        ("q with another head dim", lambda c: c.step(tokens(rng, B, 4, 1, D + 1), k, v), ValueError, 'head dim'),
        ("k_new with another head dim", lambda c: c.step(q, tokens(rng, B, Hkv, 1, D + 1), v), ValueError, 'k_new must have shape'),
        ("k_new with other kv heads", lambda c: c.step(q, tokens(rng, B, 1, 1, D), v), ValueError, 'k_new must have shape'),
        ("v_new with other token count", lambda c: c.step(q, k, tokens(rng, B, Hkv, 2, D)), ValueError, 'v_new must have shape'),
        ("k_new without v_new", lambda c: c.step(q, k, None), ValueError, 'v_new is None'),
        ("append k_new without v_new", lambda c: c.append(k, None), ValueError, 'v_new is None'),
        ("zero new tokens", lambda c: c.append(k[:, :, :0], v[:, :, :0]), ValueError, 'new_tokens>=1'),
        ("q of other batch", lambda c: c.step(q[:1], k, v), ValueError, 'q has 1 sequence'),
        ("k_new of other batch", lambda c: c.append(k[:1], v[:1]), ValueError, 'k_new has 1 sequence'),
        ("batch_index out of range", lambda c: c.step(q[:1], k[:1], v[:1], batch_index=2), ValueError, 'batch_index'),
        ("negative batch_index", lambda c: c.append(k[:1], v[:1], batch_index=-1), ValueError, 'batch_index'),
        ("repeated batch_index", lambda c: c.append(k, v, batch_index=[1, 1]), ValueError, 'repeat'),
        ("float batch_index", lambda c: c.append(k[:1], v[:1], batch_index=0.0), TypeError, 'batch_index'),
        ("2-D batch_index", lambda c: c.append(k, v, batch_index=[[0, 1]]), ValueError, 'batch_index'),
        ("batch_index size differs", lambda c: c.step(q, k, v, batch_index=[0]), ValueError, 'batch_index selects 1'),
        ("3-D q", lambda c: c.step(q[0], k, v), ValueError, 'q must be 4-D'),
        ("bad out shape", lambda c: c.step(q, k, v, out=np.empty((B, 4, 2, D), np.float32)), ValueError, 'out must have shape'),
        ("bad out dtype", lambda c: c.step(q, k, v, out=np.empty((B, 4, 1, D))), TypeError, 'out must have dtype'),
        ("bad window", lambda c: c.step(q, k, v, window=(-2, 0)), ValueError, 'window'),
        ("bad scale", lambda c: c.step(q, k, v, scale=-1.0), ValueError, 'scale'),
        ("bad num_threads", lambda c: c.step(q, k, v, num_threads=0), ValueError, 'num_threads'),
        ("softcap", lambda c: c.step(q, k, v, softcap=30.0), NotImplementedError, 'softcap'),
        ("alibi_slopes", lambda c: c.step(q, k, v, alibi_slopes=np.ones(4)), NotImplementedError, 'alibi_slopes'),
        ("sinks", lambda c: c.step(q, k, v, sinks=np.zeros(4)), NotImplementedError, 'sinks'),
        ("mask", lambda c: c.step(q, k, v, mask=np.ones((1, 1), bool)), NotImplementedError, 'mask'),
    ]


@pytest.mark.parametrize("case", range(len(bad_step_calls(np.random.default_rng(0)))))
def test_bad_cache_calls_raise_and_write_nothing(rng, case):
    what, call, error, match = bad_step_calls(rng)[case]
    cache = af.KVCache(2, 2, 8, 4)
    cache.append(tokens(rng, 2, 2, 2, 8), tokens(rng, 2, 2, 2, 8))
    snap = snapshot(cache)
    with pytest.raises(error, match=match):
        call(cache)
    assert_unchanged(cache, snap)


def test_out_receives_the_result(rng):
    cache = af.KVCache(1, 1, 8, 10, v_head_dim=4)
    q, k, v = tokens(rng, 1, 2, 1, 8), tokens(rng, 1, 1, 1, 8), tokens(rng, 1, 1, 1, 4)
    out = np.full((1, 2, 1, 4), np.nan, np.float32)
    got = cache.step(q, k, v, out=out)
    assert got is out
    np.testing.assert_allclose(out, np.broadcast_to(v, (1, 2, 1, 4)), rtol=1e-6)  # one key
    with pytest.raises(ValueError, match="overlaps"):
        cache.attend(q, out=cache.v[:, :, :2].reshape(1, 2, 1, 4))


# ---------------------------------------------------------------- attention_with_kvcache

def make_caches(rng, B=2, Hkv=2, C=12, D=8, Dv=8, dtype=np.float32):
    return (rng.standard_normal((B, Hkv, C, D)).astype(dtype),
            rng.standard_normal((B, Hkv, C, Dv)).astype(dtype))


def test_functional_writes_new_tokens_and_attends(rng):
    k_cache, v_cache = make_caches(rng)
    seqlens = np.array([3, 9], dtype=np.int32)
    k_new, v_new = tokens(rng, 2, 2, 2, 8), tokens(rng, 2, 2, 2, 8)
    q = tokens(rng, 2, 4, 2, 8)
    before_k = k_cache.copy()
    out, lse = af.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new, return_lse=True)
    assert np.array_equal(seqlens, [3, 9]), "cache_seqlens is not updated (as in flash-attn)"
    assert np.array_equal(k_cache[0, :, 3:5], k_new[0]) and np.array_equal(k_cache[1, :, 9:11], k_new[1])
    assert np.array_equal(v_cache[1, :, 9:11], v_new[1])
    assert np.array_equal(k_cache[0, :, 5:], before_k[0, :, 5:]) and np.array_equal(k_cache[0, :, :3], before_k[0, :, :3])
    for b, n in enumerate([5, 11]):
        ref_out, ref_lse, _ = reference_attention(q[b], k_cache[b, :, :n], v_cache[b, :, :n], causal=True)
        np.testing.assert_allclose(out[b], ref_out, **TOLERANCE[np.dtype(np.float32)])
        np.testing.assert_allclose(lse[b], ref_lse, **TOLERANCE[np.dtype(np.float32)])


def test_functional_strided_caches_are_written_in_place(rng):
    """A (B, capacity, Hkv, D) buffer passed transposed: written in place, no copy lost."""
    buf_k = np.zeros((2, 10, 2, 8), np.float64)
    buf_v = np.zeros((2, 10, 2, 8), np.float64)
    k_new, v_new = tokens(rng, 2, 2, 1, 8, np.float64), tokens(rng, 2, 2, 1, 8, np.float64)
    q = tokens(rng, 2, 2, 1, 8, np.float64)
    out = af.attention_with_kvcache(q, buf_k.transpose(0, 2, 1, 3), buf_v.transpose(0, 2, 1, 3),
                                    4, k_new, v_new)
    assert np.array_equal(buf_k[:, 4], k_new[:, :, 0]) and np.array_equal(buf_v[:, 4], v_new[:, :, 0])
    ref_out, _, _ = reference_attention(q, buf_k.transpose(0, 2, 1, 3)[:, :, :5],
                                        buf_v.transpose(0, 2, 1, 3)[:, :, :5], causal=True)
    np.testing.assert_allclose(out, ref_out, **TOLERANCE[np.dtype(np.float64)])


def test_functional_default_is_causal(rng):
    k_cache, v_cache = make_caches(rng)
    q = tokens(rng, 2, 2, 3, 8)
    default = af.attention_with_kvcache(q, k_cache, v_cache, 7)
    causal = af.attention_with_kvcache(q, k_cache, v_cache, 7, causal=True)
    full = af.attention_with_kvcache(q, k_cache, v_cache, 7, causal=False)
    assert np.array_equal(default, causal)
    assert not np.allclose(default[:, :, 0], full[:, :, 0])
    np.testing.assert_array_equal(default[:, :, -1], full[:, :, -1])  # last row sees all


def bad_functional_calls(rng):
    """(description, kwargs overriding a valid call, expected error, message pattern)."""
    B, Hkv, C, D = 2, 2, 12, 8
    k_new, v_new = tokens(rng, B, Hkv, 2, D), tokens(rng, B, Hkv, 2, D)
    ro_k = np.zeros((B, Hkv, C, D), np.float32)
    ro_k.flags.writeable = False
    return [
        ("wrong head count", dict(q=tokens(rng, B, 3, 1, D)), ValueError, 'multiple of kv heads'),
        ("q dtype", dict(q=tokens(rng, B, 4, 1, D, np.float64)), TypeError, 'q has dtype float64 and the cache'),
        ("k_new dtype", dict(k_new=k_new.astype(np.float64)), TypeError, 'k_new must have'),
        ("q head dim", dict(q=tokens(rng, B, 4, 1, D - 1)), ValueError, 'head dim'),
        ("k_new head dim", dict(k_new=tokens(rng, B, Hkv, 2, D - 1)), ValueError, 'k_new must have shape'),
        ("k_new kv heads", dict(k_new=tokens(rng, B, 1, 2, D)), ValueError, 'k_new must have shape'),
        ("k_new batch", dict(k_new=k_new[:1]), ValueError, 'k_new must have shape'),
        ("v_new token count", dict(v_new=v_new[:, :, :1]), ValueError, 'v_new must have shape'),
        ("more tokens than room", dict(cache_seqlens=np.array([3, 11])), ValueError, 'cache_seqlens\\[1\\] = 11 plus 2'),
        ("oversized cache_seqlens", dict(cache_seqlens=np.array([13, 0]), k_new=None, v_new=None), ValueError, 'cache_seqlens\\[0\\] = 13'),
        ("negative cache_seqlens", dict(cache_seqlens=np.array([-1, 2])), ValueError, 'cache_seqlens\\[0\\] = -1'),
        ("cache_seqlens shape", dict(cache_seqlens=np.array([1, 2, 3])), ValueError, 'cache_seqlens'),
        ("cache_seqlens float", dict(cache_seqlens=np.array([1.0, 2.0])), TypeError, 'cache_seqlens'),
        ("cache_seqlens bool", dict(cache_seqlens=True), TypeError, 'cache_seqlens'),
        ("k_new without v_new", dict(v_new=None), ValueError, 'v_new is None'),
        ("v_new without k_new", dict(k_new=None), ValueError, 'k_new is None'),
        ("zero new tokens", dict(k_new=k_new[:, :, :0], v_new=v_new[:, :, :0]), ValueError, 'new_tokens>=1'),
        ("cache dtypes differ", dict(v_cache=np.zeros((B, Hkv, C, D))), TypeError, 'share a dtype'),
        ("cache shapes differ", dict(v_cache=np.zeros((B, Hkv, C + 1, D), np.float32)), ValueError, 'v_cache must match'),
        ("cache not an array", dict(k_cache=np.zeros((B, Hkv, C, D), np.float32).tolist()), TypeError, 'k_cache must be a numpy.ndarray'),
        ("3-D cache", dict(k_cache=np.zeros((Hkv, C, D), np.float32)), ValueError, 'k_cache must be 4-D'),
        ("read-only cache", dict(k_cache=ro_k), ValueError, 'read-only'),
        ("cache as both k and v", dict(v_cache="same"), ValueError, 'share memory'),
        ("float16 cache, float32 new tokens, float64 q", dict(
            k_cache=np.zeros((B, Hkv, C, D), np.float16), v_cache=np.zeros((B, Hkv, C, D), np.float16),
            q=tokens(rng, B, 4, 1, D, np.float64)), TypeError, "q has dtype float64 and the cache"),
        ("int8 cache without scales", dict(k_cache=np.zeros((B, Hkv, C, D), np.int8),
                                           v_cache=np.zeros((B, Hkv, C, D), np.int8)),
         ValueError, "an int8 cache needs k_scale and v_scale"),
        ("scales for a float cache", dict(k_scale=np.zeros((B, Hkv, C), np.float32),
                                          v_scale=np.zeros((B, Hkv, C), np.float32)),
         ValueError, "k_scale is only for an int8 cache"),
        ("bad out", dict(out=np.empty((B, 4, 2, D), np.float32)), ValueError, 'out must have shape'),
        ("softcap", dict(softcap=1.0), NotImplementedError, 'softcap'),
        ("mask", dict(mask=np.ones((1,), bool)), NotImplementedError, 'mask'),
    ]


@pytest.mark.parametrize("case", range(len(bad_functional_calls(np.random.default_rng(0)))))
def test_bad_functional_calls_raise_and_write_nothing(rng, case):
    what, override, error, match = bad_functional_calls(rng)[case]
    k_cache, v_cache = make_caches(rng)
    args = dict(q=tokens(rng, 2, 4, 1, 8), k_cache=k_cache, v_cache=v_cache,
                cache_seqlens=np.array([3, 9]), k_new=tokens(rng, 2, 2, 2, 8),
                v_new=tokens(rng, 2, 2, 2, 8), out=np.full((2, 4, 1, 8), 7.0, np.float32))
    args.update(override)
    if isinstance(args["v_cache"], str):  # "same": one array passed as both caches
        args["v_cache"] = args["k_cache"]
    written = {n: args[n] for n in ("k_cache", "v_cache", "out") if isinstance(args[n], np.ndarray)}
    before = {n: a.copy() for n, a in written.items()}
    with pytest.raises(error, match=match):
        af.attention_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"),
                                  args.pop("cache_seqlens"), args.pop("k_new"), args.pop("v_new"),
                                  **args)
    for name, array in written.items():
        assert np.array_equal(array, before[name]), f"{name} was written by a rejected call ({what})"
