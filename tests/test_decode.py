"""The decode kernel (short queries over a KV cache) against the float64 reference.

Queries of up to 16 tokens take the split-KV decode path; these tests go through
attention_with_kvcache (per-sequence lengths) and attention(), on every kernel tier this
CPU runs.
"""
import numpy as np
import pytest

import attnfast as af
from reference import TOLERANCE, reference_attention



def random_cache(batch, kv_heads, capacity, head_dim, head_dim_v, dtype):
    """Caches whose every slot holds NaN: a kernel reading past a sequence's length shows."""
    k = np.full((batch, kv_heads, capacity, head_dim), np.nan, dtype=dtype)
    v = np.full((batch, kv_heads, capacity, head_dim_v), np.nan, dtype=dtype)
    return k, v


def fill(rng, k, v, lengths):
    for b, n in enumerate(lengths):
        k[b, :, :n] = rng.standard_normal(k[b, :, :n].shape)
        v[b, :, :n] = rng.standard_normal(v[b, :, :n].shape)


def assert_matches_reference(out, lse, q, k, v, lengths, *, causal, window=None, scale=None):
    """Each sequence b against the reference over its first lengths[b] keys."""
    tol = TOLERANCE[np.dtype(q.dtype)]
    for b, n in enumerate(lengths):
        ref_out, ref_lse, _ = reference_attention(q[b], k[b, :, :n], v[b, :, :n], causal=causal,
                                                  window=window, scale=scale)
        np.testing.assert_allclose(out[b], ref_out, **tol, err_msg=f"sequence {b} (length {n})")
        assert np.array_equal(np.isneginf(lse[b]), np.isneginf(ref_lse)), f"sequence {b}"
        seen = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[b][seen], ref_lse[seen], **tol)
        assert np.all(out[b][~seen] == 0), "a query that sees no key must give zeros"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (8, 1)], ids=["gqa32/8", "mqa8/1"])
@pytest.mark.parametrize("query_len", [1, 4])
@pytest.mark.parametrize("length", [1, 2, 17, 1000, 5000])
def test_decode_matches_reference(tier, rng, dtype, heads, kv_heads, query_len, length):
    # Two sequences of different lengths (the second one shorter, possibly empty).
    lengths = [length, max(length - 7, 0)]
    D = 64
    k, v = random_cache(2, kv_heads, length + 9, D, D, dtype)
    fill(rng, k, v, lengths)
    q = rng.standard_normal((2, heads, query_len, D)).astype(dtype)
    out, lse = af.attention_with_kvcache(q, k, v, np.array(lengths), return_lse=True)
    assert out.dtype == dtype and lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert_matches_reference(out, lse, q, k, v, lengths, causal=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("head_dim,head_dim_v", [(7, 5), (80, 48), (128, 128), (200, 136)])
def test_decode_head_dims(tier, rng, dtype, head_dim, head_dim_v):
    """Head dims that are not multiples of the vector width, and Dv != D."""
    lengths = [1500, 333]
    k, v = random_cache(2, 2, 1600, head_dim, head_dim_v, dtype)
    fill(rng, k, v, lengths)
    q = rng.standard_normal((2, 6, 3, head_dim)).astype(dtype)
    out, lse = af.attention_with_kvcache(q, k, v, np.array(lengths), return_lse=True)
    assert_matches_reference(out, lse, q, k, v, lengths, causal=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (5, 0), (600, 2), (0, 0), (-1, 3)])
@pytest.mark.parametrize("query_len", [1, 4, 16])
def test_decode_causal_and_window(tier, rng, causal, window, query_len):
    """Bottom-right alignment per sequence length, windows, rows that see no key."""
    lengths = [1300, 3, 0, 700]
    D = 32
    k, v = random_cache(4, 2, 1400, D, D, np.float32)
    fill(rng, k, v, lengths)
    q = rng.standard_normal((4, 4, query_len, D)).astype(np.float32)
    out, lse = af.attention_with_kvcache(q, k, v, np.array(lengths), causal=causal,
                                         window=window, scale=0.3, return_lse=True)
    assert_matches_reference(out, lse, q, k, v, lengths, causal=causal, window=window, scale=0.3)


@pytest.mark.parametrize("causal,window", [(True, None), (True, (7, 3)), (False, (20, 2))])
@pytest.mark.parametrize("query_len", [16, 17, 40])
def test_prefill_and_decode_paths_honour_lengths(tier, rng, query_len, causal, window):
    """16 query rows take the decode path, 17 and more the prefill tiling: both use the
    per-sequence lengths and align causal and window to them."""
    lengths = [300, 41, 5]
    k, v = random_cache(3, 2, 320, 24, 24, np.float64)
    fill(rng, k, v, lengths)
    q = rng.standard_normal((3, 4, query_len, 24))
    out, lse = af.attention_with_kvcache(q, k, v, np.array(lengths), causal=causal,
                                         window=window, return_lse=True)
    assert_matches_reference(out, lse, q, k, v, lengths, causal=causal, window=window)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_thread_count_does_not_change_bits(tier, rng, dtype):
    """Split points depend on L only, chunks merge in a fixed order: any thread count gives
    the same bits. L = 20000 spans many chunks; B * Hkv = 2 is below the split count."""
    lengths = [20000, 5000]
    k, v = random_cache(2, 1, 20000, 128, 128, dtype)
    fill(rng, k, v, lengths)
    q = rng.standard_normal((2, 8, 4, 128)).astype(dtype)
    results = [af.attention_with_kvcache(q, k, v, np.array(lengths), return_lse=True,
                                         num_threads=n) for n in (1, 2, 3)]
    for out, lse in results[1:]:
        assert np.array_equal(out, results[0][0])
        assert np.array_equal(lse, results[0][1])
    assert_matches_reference(*results[0], q, k, v, lengths, causal=True)


def test_attention_short_query_uses_whole_keys(tier, rng):
    """attention() with a short query (the decode path) against the reference, GQA,
    non-causal and causal, strided (transposed) inputs."""
    kv = rng.standard_normal((2, 3000, 4, 64)).astype(np.float32)  # (B, T, Hkv, D)
    k = kv.transpose(0, 2, 1, 3)
    v = (kv * 0.5).transpose(0, 2, 1, 3)
    q = rng.standard_normal((2, 1, 16, 64)).astype(np.float32).transpose(0, 2, 1, 3)  # (B, 16, 1, D)
    for causal in (False, True):
        out, lse = af.attention(q, k, v, causal=causal, return_lse=True)
        ref_out, ref_lse, _ = reference_attention(q, k, v, causal=causal)
        np.testing.assert_allclose(out, ref_out, **TOLERANCE[np.dtype(np.float32)])
        np.testing.assert_allclose(lse, ref_lse, **TOLERANCE[np.dtype(np.float32)])


def test_decode_large_scores_are_stable(tier, rng):
    """Scores of order 1e3 spread over chunks: the (max, sum) merge must not overflow."""
    lengths = [4000]
    k, v = random_cache(1, 1, 4000, 16, 16, np.float32)
    fill(rng, k, v, lengths)
    k[0, 0, 3500] *= 40.0  # one dominant key, in a late chunk
    q = (rng.standard_normal((1, 2, 1, 16)) * 10).astype(np.float32)
    out, lse = af.attention_with_kvcache(q, k, v, 4000, return_lse=True)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    assert_matches_reference(out, lse, q, k, v, lengths, causal=True)


@pytest.mark.parametrize("heads,kv_heads,query_len", [(8, 1, 5), (64, 1, 16)])
def test_more_rows_per_kv_head_than_one_pass_serves(tier, rng, heads, kv_heads, query_len):
    """(H / Hkv) * Tq above the rows one pass over a chunk serves (32): several passes."""
    lengths = [2100, 900]
    k, v = random_cache(2, kv_heads, 2100, 40, 24, np.float32)
    fill(rng, k, v, lengths)
    q = rng.standard_normal((2, heads, query_len, 40)).astype(np.float32)
    out, lse = af.attention_with_kvcache(q, k, v, np.array(lengths), return_lse=True)
    assert_matches_reference(out, lse, q, k, v, lengths, causal=True)
