"""query_offset: where the queries sit among the keys (top-left alignment, shards of keys)."""
import numpy as np
import pytest

import attnfast as af
from attnfast import _ext
from reference import TOLERANCE, reference_attention, visible_mask

TIERS = _ext.runtime_info()["isa_available"]


def offset_reference(q, k, v, offset, causal=True, window=None):
    """float64 reference with query i at key position i + offset."""
    keep = visible_mask(q.shape[-2], k.shape[-2], causal, window, query_offset=offset)
    s = np.einsum("...id,...jd->...ij", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(q.shape[-1])
    s = np.where(keep, s, -np.inf)
    top = s.max(-1, keepdims=True, initial=-np.inf)
    e = np.exp(s - np.where(np.isfinite(top), top, 0))
    tot = e.sum(-1, keepdims=True)
    w = np.where(tot > 0, e / np.where(tot > 0, tot, 1), 0)
    return w @ v.astype(np.float64)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("tq,tk,offset", [(3, 40, 0), (40, 100, 0), (40, 100, 30), (5, 60, -2),
                                          (70, 70, 5), (20, 50, 10**12)])
def test_query_offset_on_every_path(tier, rng, tq, tk, offset):
    _ext.force_isa(tier)
    try:
        q = rng.standard_normal((2, tq, 16)).astype(np.float32)
        k = rng.standard_normal((2, tk, 16)).astype(np.float32)
        v = rng.standard_normal((2, tk, 16)).astype(np.float32)
        for window in (None, (4, 2)):
            out = af.attention(q, k, v, causal=True, window=window, query_offset=offset)
            np.testing.assert_allclose(out, offset_reference(q, k, v, offset, window=window),
                                       **TOLERANCE[np.dtype(np.float32)])
    finally:
        _ext.force_isa("")


def test_default_offset_is_bottom_right(rng):
    q = rng.standard_normal((2, 7, 8)).astype(np.float32)
    k = rng.standard_normal((2, 30, 8)).astype(np.float32)
    assert np.array_equal(af.attention(q, k, k, causal=True),
                          af.attention(q, k, k, causal=True, query_offset=30 - 7))


def test_static_cache_prefill_is_top_left(rng):
    """A prompt written into an empty cache larger than itself: top-left alignment."""
    B, Hkv, C, D, T = 1, 2, 64, 8, 10
    k_cache, v_cache = np.zeros((B, Hkv, C, D), np.float32), np.zeros((B, Hkv, C, D), np.float32)
    k = rng.standard_normal((B, Hkv, T, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, T, D)).astype(np.float32)
    q = rng.standard_normal((B, 4, T, D)).astype(np.float32)
    k_cache[:, :, :T], v_cache[:, :, :T] = k, v
    out = af.attention_with_kvcache(q, k_cache, v_cache, C, query_offset=0)  # all C keys handed over
    ref, _, _ = reference_attention(q, k, v, causal=True)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    w = af.attention_weights(q[0], k_cache[0], causal=True, query_offset=0)
    assert np.all(w[:, :, T:] == 0)


def test_shards_merge_with_global_positions(rng):
    """Keys split in two shards; each shard's call places the queries at their global
    positions, and merging by lse gives causal attention over all keys."""
    q = rng.standard_normal((2, 6, 16)).astype(np.float32)
    k = rng.standard_normal((2, 50, 16)).astype(np.float32)
    v = rng.standard_normal((2, 50, 16)).astype(np.float32)
    first_query = 44  # queries at global positions 44..49
    parts = [af.attention(q, k[:, s0:s1], v[:, s0:s1], causal=True, return_lse=True,
                          query_offset=first_query - s0) for s0, s1 in ((0, 23), (23, 50))]
    out, _ = af.merge_attention_states([p[0] for p in parts], [p[1] for p in parts])
    np.testing.assert_allclose(out, af.attention(q, k, v, causal=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad,error", [(2**62 + 1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_query_offset(rng, bad, error):
    q = rng.standard_normal((3, 8)).astype(np.float32)
    out = np.full((3, 8), 7.0, np.float32)
    with pytest.raises(error, match="query_offset"):
        af.attention(q, q, q, query_offset=bad, out=out)
    assert np.all(out == 7.0)
