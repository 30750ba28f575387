"""attnfast.index_topk (the lightning indexer + top-k) against a float64 NumPy reference."""
import ml_dtypes
import numpy as np
import pytest

import attnfast

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def reference(q, w, k, topk, *, scale=None, lengths=None, causal=True):
    """float64 scores I[b, t, s] and the top-k positions (descending score, lower position
    first on ties, -1 past the visible keys)."""
    q, w, k = (np.asarray(x, np.float64) for x in (q, w, k))
    B, H, Tq, D = q.shape
    L = k.shape[1]
    lengths = np.full(B, L) if lengths is None else np.asarray(lengths)
    index = np.full((B, Tq, topk), -1, np.int64)
    scores = np.full((B, Tq, topk), -np.inf)
    for b in range(B):
        for t in range(Tq):
            end = min(lengths[b], lengths[b] - Tq + t + 1) if causal else lengths[b]
            end = max(end, 0)
            dots = np.einsum("hd,sd->hs", q[b, :, t], k[b, :end])
            s = (w[b, t][:, None] * np.maximum(dots, 0)).sum(0)
            if scale is not None:
                s = s * np.asarray(scale, np.float64)[b, :end]
            order = np.lexsort((np.arange(end), -s))[:topk]
            index[b, t, :order.size] = order
            scores[b, t, :order.size] = s[order]
    return index, scores


def check(got_index, got_scores, want_index, want_scores, rtol):
    """Same scores to rtol; positions equal except where two scores tie to within rtol
    (float32 rounding may order those either way)."""
    np.testing.assert_allclose(got_scores, want_scores, rtol=rtol, atol=rtol)
    differ = got_index != want_index
    if differ.any():  # only among near-ties: the scores at those ranks agree
        assert np.allclose(got_scores[differ], want_scores[differ], rtol=rtol, atol=rtol)
    np.testing.assert_array_equal(got_index == -1, want_index == -1)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("Tq", [1, 5])
def test_float32_keys(causal, Tq):
    rng = np.random.default_rng(0)
    B, H, D, L, topk = 2, 8, 64, 700, 50
    q = rng.standard_normal((B, H, Tq, D)).astype(np.float32)
    w = rng.standard_normal((B, Tq, H)).astype(np.float32)
    k = rng.standard_normal((B, L, D)).astype(np.float32)
    lengths = np.array([700, 333])
    index, scores = attnfast.index_topk(q, w, k, topk, cache_seqlens=lengths, causal=causal,
                                        return_scores=True)
    assert index.dtype == np.int32 and index.shape == (B, Tq, topk)
    check(index, scores, *reference(q, w, k, topk, lengths=lengths, causal=causal), 1e-4)


def test_float8_keys_with_scales_and_fewer_keys_than_topk():
    """DeepSeek's layout (float8 e4m3 keys, a float32 scale per token); a sequence shorter
    than topk fills the rest with -1 / -inf."""
    rng = np.random.default_rng(1)
    B, H, Tq, D, L, topk = 2, 4, 2, 128, 300, 64
    q = rng.standard_normal((B, H, Tq, D)).astype(np.float32)
    w = rng.standard_normal((B, Tq, H)).astype(np.float32)
    k = rng.standard_normal((B, L, D)).astype(E4M3)
    scale = rng.uniform(0.5, 2, (B, L)).astype(np.float32)
    lengths = np.array([300, 40])
    index, scores = attnfast.index_topk(q, w, k, topk, k_scale=scale, cache_seqlens=lengths,
                                        return_scores=True)
    want = reference(q, w, k.astype(np.float32), topk, scale=scale, lengths=lengths)
    check(index, scores, *want, 1e-4)
    assert np.all(index[1, 0, 39:] == -1) and np.all(index[1, 1, 40:] == -1)


@pytest.mark.parametrize("key_dtype", [np.float32, ml_dtypes.bfloat16, E4M3])
@pytest.mark.parametrize("isa", ["", "avx512", "avx2", "generic"])
def test_bfloat16_queries(key_dtype, isa):
    """A bfloat16 q: exact products (vdpbf16ps where the tier has them, float32 FMA else),
    float32 sums; 70 heads (a partial head vector), float8 keys at D = 136 (a tail past the
    vectors), a NaN key ranking as -inf."""
    if isa and isa not in attnfast._ext.runtime_info()["isa_available"]:
        pytest.skip(f"tier {isa} not on this CPU")
    rng = np.random.default_rng(8)
    B, H, Tq, D, L, topk = 2, 70, 3, 136, 500, 40
    q = rng.standard_normal((B, H, Tq, D)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((B, Tq, H)).astype(np.float32)
    k = rng.standard_normal((B, L, D)).astype(key_dtype)
    k[1, 17, 5] = np.nan
    scale = rng.uniform(0.5, 2, (B, L)).astype(np.float32)
    attnfast._ext.force_isa(isa)
    try:
        index, scores = attnfast.index_topk(q, w, k, topk, k_scale=scale, return_scores=True)
    finally:
        attnfast._ext.force_isa("")
    want = reference(q, w, k, topk, scale=scale)  # (NumPy sorts the NaN score last)
    check(index, scores, *want, 1e-4)
    assert 17 not in index[1]


def test_bfloat16_paged_equals_contiguous():
    rng = np.random.default_rng(2)
    B, H, Tq, D, bs, blocks, topk = 2, 4, 1, 64, 16, 20, 32
    k = rng.standard_normal((B, blocks * bs, D)).astype(ml_dtypes.bfloat16)
    table = rng.permutation(B * blocks).reshape(B, blocks)
    pool = np.empty((B * blocks, bs, D), k.dtype)
    for b in range(B):
        for x in range(blocks):
            pool[table[b, x]] = k[b, x * bs:(x + 1) * bs]
    q = rng.standard_normal((B, H, Tq, D)).astype(np.float32)
    w = rng.standard_normal((B, Tq, H)).astype(np.float32)
    lengths = np.array([250, 301])
    contiguous = attnfast.index_topk(q, w, k, topk, cache_seqlens=lengths)
    paged = attnfast.index_topk(q, w, pool, topk, cache_seqlens=lengths, block_table=table)
    assert np.array_equal(contiguous, paged)


def test_same_result_for_any_thread_count_and_ties_to_the_lower_position():
    """A long decode row is split over tasks when there are threads to spare: the same
    positions as one pass. Equal keys tie: the lower position wins."""
    rng = np.random.default_rng(3)
    B, H, D, L, topk = 1, 4, 32, 30000, 2048
    q = rng.standard_normal((B, H, 1, D)).astype(np.float32)
    w = np.abs(rng.standard_normal((B, 1, H))).astype(np.float32)
    k = rng.standard_normal((B, L, D)).astype(np.float32)
    k[0, 20000:20010] = k[0, 7]  # ten copies of key 7 later on: equal scores
    one = attnfast.index_topk(q, w, k, topk, num_threads=1)
    two = attnfast.index_topk(q, w, k, topk, num_threads=2)
    assert np.array_equal(one, two)
    row = one[0, 0].tolist()
    if 7 in row:  # every copy after 7 ranks right behind it, in position order
        at = row.index(7)
        assert row[at + 1:at + 11] == list(range(20000, 20010))[:len(row[at + 1:at + 11])]
    index, scores = attnfast.index_topk(q, w, k, topk, num_threads=2, return_scores=True)
    check(index, scores, *reference(q, w, k, topk), 1e-4)


def test_feeds_sparse_attention():
    """index_topk's output is attention_with_kvcache's key_index."""
    rng = np.random.default_rng(4)
    B, H, Hi, D, Di, L, topk = 1, 8, 4, 32, 16, 500, 64
    q_index = rng.standard_normal((B, Hi, 1, Di)).astype(np.float32)
    w = rng.standard_normal((B, 1, Hi)).astype(np.float32)
    k_index = rng.standard_normal((B, L, Di)).astype(np.float32)
    selected = attnfast.index_topk(q_index, w, k_index, topk)
    kc = rng.standard_normal((B, 1, L, D)).astype(np.float32)
    q = rng.standard_normal((B, H, 1, D)).astype(np.float32)
    out = attnfast.attention_with_kvcache(q, kc, kc, L, key_index=selected)
    keys = selected[0, 0]
    s = np.einsum("hd,sd->hs", q[0, :, 0].astype(np.float64), kc[0, 0, keys]) / np.sqrt(D)
    p = np.exp(s - s.max(1, keepdims=True))
    want = (p / p.sum(1, keepdims=True)) @ kc[0, 0, keys]
    np.testing.assert_allclose(out[0, :, 0], want, rtol=2e-5, atol=2e-5)


def test_errors_name_the_argument():
    q = np.zeros((1, 2, 1, 8), np.float32)
    w = np.zeros((1, 1, 2), np.float32)
    k = np.zeros((1, 10, 8), np.float32)
    with pytest.raises(ValueError, match="topk must be >= 1"):
        attnfast.index_topk(q, w, k, 0)
    with pytest.raises(ValueError, match="weights must have shape"):
        attnfast.index_topk(q, np.zeros((1, 2), np.float32), k, 3)
    with pytest.raises(ValueError, match="k_index must be 3-D"):
        attnfast.index_topk(q, w, np.zeros((1, 10, 4), np.float32), 3)
    with pytest.raises(TypeError, match="k_index must be float32, bfloat16 or float8_e4m3fn"):
        attnfast.index_topk(q, w, k.astype(np.float16), 3)
    with pytest.raises(ValueError, match="k_scale .* is required"):
        attnfast.index_topk(q, w, k.astype(E4M3), 3)
    with pytest.raises(ValueError, match=r"cache_seqlens must be in \[0, 10\]"):
        attnfast.index_topk(q, w, k, 3, cache_seqlens=11)
    with pytest.raises(ValueError, match="block_table"):
        attnfast.index_topk(q, w, np.zeros((2, 4, 8), np.float32), 3, cache_seqlens=8,
                            block_table=np.array([[0, 5]]))
