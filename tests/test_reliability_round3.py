"""Issue 45, classes 5, 7, 8 and 9: the newest paths under hostile input, against float64
NumPy references written here (no attnfast code in the references).

5. No warning from attnfast's own NumPy code on any path (NaN in, NaN out): the block
   Hadamard key rotation for head dims that are not a power of two, merge_attention_states
   beside a NaN part (tree and shared-prefix steps), and a float16 query whose rotation
   leaves float16's range (computed from the float32 rotated query, not rounded back).
7. A tree_mask given as an array-like (nested lists) is checked as an array: errors are
   ValueError / TypeError naming tree_mask.
8. attention_varlen reads the pools PagedKVCache makes in every format: rotated int8 keys
   (key_rotation=) and int4 pools (v_head_dim=), as attention_with_kvcache does.
9. The transformers backend refuses an attention argument it does not implement (the
   sparse top-k ``indices=`` of DeepSeek-V3.2 / GLM-5 where it cannot run it) by name, never drops it.
"""
import os
import sys
import warnings

import numpy as np
import pytest

import attnfast as af
from attnfast import _shared_prefix

# ---------------------------------------------------------------------------------------------
# float64 references, written for these tests


def sylvester(b):
    """The orthonormal b x b Sylvester Hadamard matrix, built with kron."""
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.kron(h, np.array([[1.0, 1.0], [1.0, -1.0]]))
    return h / np.sqrt(b)


def rotation_matrix(d):
    """The block Hadamard matrix along D: blocks of the largest power of two dividing D."""
    b = d & -d
    return np.kron(np.eye(d // b), sylvester(b))


def ref_attention(q, k, v, scale=None, visible=None):
    """float64 softmax attention of q (.., H, Tq, D) over k, v (.., Hkv, Tk, D|Dv), GQA by
    repetition; visible (Tq, Tk) bool or None. NaN anywhere in a row's scores or values
    gives NaN (as attnfast's NaN rule)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    rep = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, rep, axis=-3), np.repeat(v, rep, axis=-3)
    s = np.einsum("...id,...jd->...ij", q, k) * (1 / np.sqrt(q.shape[-1]) if scale is None else scale)
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        p = np.exp(s - m)
        return np.einsum("...ij,...jd->...id", p / p.sum(axis=-1, keepdims=True), v)


def dequant_int8(x, scale):
    """int8 rows times their float32 scales, in float64."""
    return x.astype(np.float64) * scale[..., None].astype(np.float64)


def dequant_int4(packed, dim):
    """attnfast's int4 rows (docs: KV-cache formats) decoded here in float64: blocks of 20
    bytes, a little-endian uint32 header (low half: bfloat16 scale s, high half: bfloat16
    minimum m), then 16 bytes holding value i in the low nibble of byte i and value i + 16 in
    its high nibble; value = s * n + m."""
    blocks = packed.reshape(packed.shape[:-1] + (-1, 20)).astype(np.uint32)
    header = blocks[..., 0] | blocks[..., 1] << 8 | blocks[..., 2] << 16 | blocks[..., 3] << 24

    def bf16(bits):
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    s, m = bf16(header & 0xFFFF), bf16(header >> 16)
    nib = blocks[..., 4:]
    n = np.concatenate([nib & 15, nib >> 4], axis=-1).astype(np.float64)
    values = n * s[..., None] + m[..., None]
    return values.reshape(packed.shape[:-1] + (-1,))[..., :dim]


def pool_rows(pool, table_row, n):
    """The first n token rows of one sequence of a paged pool: (Hkv, n, ...)."""
    bs = pool.shape[2]
    t = np.arange(n)
    return np.swapaxes(pool[table_row[t // bs], :, t % bs], 0, 1)


@pytest.fixture
def no_warnings():
    """Every warning is an error in the test body (as under -W error)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# ---------------------------------------------------------------------------------------------
# 5. Warnings from inside attnfast


@pytest.mark.parametrize("d", [40, 80, 96, 576, 64])
def test_rotation_keeps_finite_blocks_of_a_row_with_an_inf(no_warnings, d):
    """The rotation runs block by block: an inf in one block reaches that block only (never
    the off-block zeros of a D x D matrix: inf * 0 = NaN and a RuntimeWarning)."""
    from attnfast._rotation import hadamard_rotate
    rng = np.random.default_rng(d)
    x = rng.standard_normal((3, d)).astype(np.float32)
    x[1, 0] = np.inf
    x[2, 1] = np.nan
    got = hadamard_rotate(x)
    want = np.where(np.isfinite(x), x, 0).astype(np.float64) @ rotation_matrix(d).T
    b = d & -d
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    for row in (1, 2):
        assert not np.isfinite(got[row, :b]).any()              # the block that holds it
        np.testing.assert_allclose(got[row, b:], want[row, b:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("d", [40, 80, 96, 576])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_rotated_cache_non_finite_key_gives_nan_without_warning(no_warnings, dtype, d, bad):
    """A key row holding inf or NaN in a rotated int8 / int4 cache (head dims that are not a
    power of two) reads back as NaN: NaN for the sequence that sees it, the float64 answer
    for the other, and no RuntimeWarning from the rotation."""
    rng = np.random.default_rng(d)
    B, Hkv, H, n = 2, 1, 2, 6
    k = rng.standard_normal((B, Hkv, n, d)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, n, d)).astype(np.float32)
    k[0, 0, 2, d - 1] = bad
    cache = af.KVCache(B, Hkv, d, 8, dtype=dtype)
    assert cache.key_rotation == "hadamard"
    cache.append(k, v)
    q = rng.standard_normal((B, H, 1, d)).astype(np.float32)
    out = cache.attend(q)
    assert np.isnan(out[0]).all()
    if dtype == "int8":
        kd, vd = dequant_int8(cache.k, cache.k_scale), dequant_int8(cache.v, cache.v_scale)
    else:
        kd, vd = dequant_int4(cache.k, d), dequant_int4(cache.v, d)
    q_rot = q.astype(np.float64) @ rotation_matrix(d).T          # the stored keys are H k
    want = ref_attention(q_rot[1], kd[1, :, :n], vd[1, :, :n])
    np.testing.assert_allclose(out[1], want, rtol=2e-5, atol=2e-5)
    # the paged pools take the same path
    paged = af.PagedKVCache(8, 4, Hkv, d, dtype=dtype)
    ids = [paged.add_sequence() for _ in range(B)]
    paged.append(ids, k, v)
    out_paged = paged.attend(ids, q)
    assert np.isnan(out_paged[0]).all()
    np.testing.assert_allclose(out_paged[1], want, rtol=2e-5, atol=2e-5)


def test_merge_attention_states_beside_a_nan_part(no_warnings):
    """A NaN part (lse NaN) next to a part whose lse is large: NaN out and lse, no overflow
    in exp (the maximum is taken over the parts that are not NaN); the other rows exact."""
    o1 = np.ones((2, 3), np.float32)
    o2 = np.full((2, 3), 2.0, np.float32)
    l1 = np.array([np.nan, 0.5], np.float32)
    l2 = np.array([100.0, 300.0], np.float32)   # exp(100) and exp(300) overflow float32
    out, lse = af.merge_attention_states([o1, o2], [l1, l2])
    assert np.isnan(out[0]).all() and np.isnan(lse[0])
    w = 1 / (1 + np.exp(0.5 - 300.0))
    np.testing.assert_allclose(out[1], (1 - w) * 1.0 + w * 2.0, rtol=1e-6)
    np.testing.assert_allclose(lse[1], 300.0 + np.log1p(np.exp(0.5 - 300.0)), rtol=1e-6)
    # every part NaN, a +inf part, parts that saw nothing: no warning either
    out, lse = af.merge_attention_states([o1, o2], [np.full(2, np.nan, np.float32)] * 2)
    assert np.isnan(out).all() and np.isnan(lse).all()
    out, lse = af.merge_attention_states([o1, o2], [np.full(2, np.inf, np.float32),
                                                    np.full(2, 5.0, np.float32)])
    assert (lse == np.inf).all() and (out == 1.0).all()
    out, lse = af.merge_attention_states([o1, o2], [np.full(2, -np.inf, np.float32)] * 2)
    assert (out == 0).all() and (lse == -np.inf).all()


def test_tree_step_with_a_nan_cached_key_beside_large_scores(no_warnings):
    """A tree step whose cached part holds a NaN key (lse NaN) while its new part's scores
    are large (lse ~ 3600): NaN out, no 'overflow encountered in exp'."""
    rng = np.random.default_rng(5)
    D, tq = 16, 3
    cache = af.KVCache(1, 1, D, 16)
    k = rng.standard_normal((1, 1, 5, D)).astype(np.float32)
    k[0, 0, 2, 3] = np.nan
    cache.append(k, rng.standard_normal((1, 1, 5, D)).astype(np.float32))
    q = np.full((1, 1, tq, D), 30.0, np.float32)
    k_new = np.full((1, 1, tq, D), 30.0, np.float32)
    tree = np.tril(np.ones((tq, tq), bool))
    out = cache.step(q, k_new, k_new.copy(), tree_mask=tree)
    assert np.isnan(out).all()


def test_shared_prefix_step_with_a_nan_prefix_beside_large_scores(no_warnings, monkeypatch):
    """Shared-prefix decoding: forks whose shared prefix holds a NaN key (that part's lse is
    NaN) and whose own keys give lse ~ 3600: NaN out, no warning; a sequence outside the
    group keeps the float64 answer."""
    monkeypatch.setattr(_shared_prefix, "MIN_PREFIX_KEYS", 4)
    rng = np.random.default_rng(6)
    D, BS = 16, 4
    cache = af.PagedKVCache(64, BS, 1, D)
    a = cache.add_sequence()
    k = rng.standard_normal((1, 8, D)).astype(np.float32)
    k[0, 1, 0] = np.nan
    cache.append(a, k, rng.standard_normal((1, 8, D)).astype(np.float32))
    forks = [a, cache.fork(a), cache.fork(a)]
    other = cache.add_sequence()
    k_other = rng.standard_normal((1, 5, D)).astype(np.float32)
    v_other = rng.standard_normal((1, 5, D)).astype(np.float32)
    cache.append(other, k_other, v_other)
    big = np.full((4, 1, 1, D), 30.0, np.float32)
    before = _shared_prefix.stats["shared_calls"]
    out = cache.step(forks + [other], big / 30, big, big.copy())
    assert _shared_prefix.stats["shared_calls"] == before + 1
    assert np.isnan(out[:3]).all()
    k_all = np.concatenate([k_other, big[3]], axis=1)
    v_all = np.concatenate([v_other, big[3]], axis=1)
    np.testing.assert_allclose(out[3], ref_attention(big[3] / 30, k_all, v_all),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("q_dtype", ["float16", "bfloat16"])
def test_16bit_query_rotated_beyond_its_range(no_warnings, dtype, q_dtype):
    """A 16-bit q whose rotation grows an entry past float16's range (60000 * sqrt(64) in
    one entry): the result is the float32 q's (the same values) rounded to q's dtype, and
    the float64 reference's to 16-bit accuracy; never inf / NaN."""
    import ml_dtypes
    qdt = np.dtype(np.float16) if q_dtype == "float16" else np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(7)
    D, Hkv, H, n = 64, 2, 4, 9
    k = rng.standard_normal((1, Hkv, n, D)).astype(np.float32)
    v = rng.standard_normal((1, Hkv, n, D)).astype(np.float32)
    q = np.full((1, H, 1, D), 60000.0, np.float32)
    q[0, 1] *= -1
    q[0, 2, 0, ::2] = 1.0
    q = q.astype(qdt)                          # exact in both 16-bit types
    scale = 1e-6                               # scores of a few units
    for make in ("contiguous", "paged"):
        if make == "contiguous":
            cache = af.KVCache(1, Hkv, D, 16, dtype=dtype)
            cache.append(k, v)
            out16, out32 = cache.attend(q, scale=scale), cache.attend(q.astype(np.float32), scale=scale)
            kp, vp = cache.k[0], cache.v[0]
            ks, vs = (cache.k_scale[0], cache.v_scale[0]) if dtype == "int8" else (None, None)
        else:
            cache = af.PagedKVCache(8, 4, Hkv, D, dtype=dtype)
            s = cache.add_sequence()
            cache.append(s, k[0], v[0])
            out16, out32 = cache.attend(s, q[0], scale=scale), cache.attend(s, q[0].astype(np.float32), scale=scale)
            row = cache.block_table([s])[0]
            kp, vp = pool_rows(cache.k, row, n), pool_rows(cache.v, row, n)
            if dtype == "int8":
                ks, vs = pool_rows(cache.k_scale, row, n), pool_rows(cache.v_scale, row, n)
            out16, out32 = out16[None], out32[None]
        assert out16.dtype == qdt and np.isfinite(out16.astype(np.float32)).all()
        np.testing.assert_array_equal(out16, out32.astype(qdt))
        kd = dequant_int8(kp, ks) if dtype == "int8" else dequant_int4(kp, D)
        vd = dequant_int8(vp, vs) if dtype == "int8" else dequant_int4(vp, D)
        q_rot = q[0].astype(np.float64) @ rotation_matrix(D).T
        want = ref_attention(q_rot, kd[:, :n], vd[:, :n], scale=scale)
        tol = 2e-3 if q_dtype == "float16" else 1.6e-2
        np.testing.assert_allclose(out16[0].astype(np.float64), want, rtol=tol, atol=tol)


def test_16bit_query_over_caller_owned_rotated_cache(no_warnings):
    """attention_with_kvcache(key_rotation="hadamard") with a float16 q beyond range after
    rotation: the float32 answer rounded to float16, written into a float16 out= too."""
    rng = np.random.default_rng(8)
    D, n = 32, 5
    cache = af.KVCache(1, 1, D, 8, dtype="int8")
    cache.append(rng.standard_normal((1, 1, n, D)).astype(np.float32),
                 rng.standard_normal((1, 1, n, D)).astype(np.float32))
    q = np.full((1, 2, 1, D), 50000.0, np.float16)
    out = np.full((1, 2, 1, D), 7.0, np.float16)
    args = (cache.k, cache.v, cache.lengths)
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale, key_rotation="hadamard", scale=1e-6)
    res, lse = af.attention_with_kvcache(q, *args, out=out, return_lse=True, **kw)
    assert res is out
    want, want_lse = af.attention_with_kvcache(q.astype(np.float32), *args, return_lse=True, **kw)
    np.testing.assert_array_equal(out, want.astype(np.float16))
    np.testing.assert_array_equal(lse, want_lse)
    assert np.isfinite(lse).all()


@pytest.mark.parametrize("bad", [np.inf, -np.inf, 3e38])
def test_attention_weights_and_backward_with_non_finite_inputs(no_warnings, bad):
    """attention_weights (NumPy by design) and attention_backward's sink gradient with inf
    or float32-overflowing inputs: no RuntimeWarning; rows that do not see the bad key keep
    the float64 answer, and non-finite inputs give non-finite (never warned) results."""
    rng = np.random.default_rng(14)
    q, k, v = (rng.standard_normal((1, 2, 5, 40)).astype(np.float32) for _ in range(3))
    k[0, :, 4, :3] = [bad, -bad, bad]                  # only the last causal row sees key 4
    w = af.attention_weights(q, k, causal=True)
    visible = np.tril(np.ones((5, 5), bool))
    s = np.einsum("hid,hjd->hij", q[0, :, :4].astype(np.float64), k[0, :, :4].astype(np.float64))
    s = np.where(visible[:4, :4], s / np.sqrt(40), -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(w[0, :, :4, :4], p / p.sum(axis=-1, keepdims=True), rtol=1e-5,
                               atol=1e-6)
    sinks = np.ones(2, np.float32)
    out, lse = af.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    dout = np.ones_like(out)
    dout[0, 0, 1, 0] = bad
    grads = af.attention_backward(dout, q, k, v, out, lse, causal=True, sinks=sinks)
    assert len(grads) == 4 and grads[3].shape == (2,)
    if not np.isfinite(bad):
        assert not np.isfinite(grads[3][0])          # an inf in dout reaches the sink's gradient


# ---------------------------------------------------------------------------------------------
# 7. tree_mask given as array-likes


def _tree_cache(rng, B=2, D=8):
    cache = af.KVCache(B, 1, D, 32)
    k = rng.standard_normal((B, 1, 6, D)).astype(np.float32)
    cache.append(k, k.copy())
    return cache


def test_tree_mask_nested_list_errors_name_tree_mask():
    rng = np.random.default_rng(9)
    cache = _tree_cache(rng)
    q = rng.standard_normal((2, 2, 3, 8)).astype(np.float32)
    k_new = rng.standard_normal((2, 1, 3, 8)).astype(np.float32)
    before = cache.k.copy(), cache.lengths.copy()
    bad_diagonal = [[True, False, False], [True, False, False], [True, True, True]]
    with pytest.raises(ValueError, match=r"tree_mask\[1, 1\] is False"):
        cache.step(q, k_new, k_new, tree_mask=bad_diagonal)
    bad_3d = [np.tril(np.ones((3, 3), bool)).tolist(), bad_diagonal]
    with pytest.raises(ValueError, match=r"tree_mask\[1, 1, 1\] is False"):
        cache.step(q, k_new, k_new, tree_mask=bad_3d)
    ragged = [[True, False], [True, True, False], [True, True, True]]
    with pytest.raises(ValueError, match="tree_mask must be a bool array"):
        cache.step(q, k_new, k_new, tree_mask=ragged)
    with pytest.raises(TypeError, match="tree_mask must be a bool array"):
        cache.step(q, k_new, k_new, tree_mask=[[1, 0, 0], [1, 1, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match="tree_mask must have shape"):
        cache.step(q, k_new, k_new, tree_mask=[[True, False], [True, True]])
    with pytest.raises(ValueError, match=r"tree_mask\[0, 0\] is False"):   # a tuple of tuples
        af.attention_with_kvcache(q, cache.k, cache.v, cache.lengths, k_new, k_new,
                                  tree_mask=((False, False, False), (True, True, False),
                                             (True, True, True)))
    # rejected calls wrote nothing
    np.testing.assert_array_equal(cache.k, before[0])
    np.testing.assert_array_equal(cache.lengths, before[1])


def test_tree_mask_nested_list_equals_the_array_and_the_reference():
    rng = np.random.default_rng(10)
    tree = [[True, False, False], [True, True, False], [True, False, True]]
    q = rng.standard_normal((2, 2, 3, 8)).astype(np.float32)
    k_new = rng.standard_normal((2, 1, 3, 8)).astype(np.float32)
    v_new = rng.standard_normal((2, 1, 3, 8)).astype(np.float32)
    outs = []
    for mask in (tree, np.array(tree)):
        cache = _tree_cache(np.random.default_rng(11))
        outs.append(cache.step(q, k_new, v_new, tree_mask=mask))
    np.testing.assert_array_equal(outs[0], outs[1])
    visible = np.concatenate([np.ones((3, 6), bool), np.array(tree)], axis=1)
    k_all = np.concatenate([cache.k[:, :, :6], k_new], axis=2)
    v_all = np.concatenate([cache.v[:, :, :6], v_new], axis=2)
    np.testing.assert_allclose(outs[0], ref_attention(q, k_all, v_all, visible=visible),
                               rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# 8. attention_varlen over every format a PagedKVCache holds


def _ragged_paged(rng, dtype, D, Dv, q_dtype=np.float32, Hkv=2, H=4, BS=8):
    cache = af.PagedKVCache(32, BS, Hkv, D, dtype=dtype, v_head_dim=Dv)
    lens, tq = [13, 1, 30, 17], [1, 1, 20, 3]   # decode rows and a prompt chunk (> 16)
    ids = [cache.add_sequence() for _ in lens]
    for s, n in zip(ids, lens):
        cache.append(s, rng.standard_normal((Hkv, n, D)).astype(np.float32),
                     rng.standard_normal((Hkv, n, Dv)).astype(np.float32))
    cu = np.concatenate([[0], np.cumsum(tq)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), H, D)).astype(q_dtype)
    return cache, ids, np.array(lens, np.int32), cu, q


def _varlen_reference(cache, ids, lens, cu, q, D, Dv, dtype):
    """Per sequence: q rotated in float64 as the keys were, against the pools dequantised
    here, causal bottom-right."""
    table = cache.block_table(ids)
    rot = rotation_matrix(D)
    outs = []
    for b, n in enumerate(lens):
        kp, vp = pool_rows(cache.k, table[b], n), pool_rows(cache.v, table[b], n)
        if dtype == "int8":
            kd = dequant_int8(kp, pool_rows(cache.k_scale, table[b], n))
            vd = dequant_int8(vp, pool_rows(cache.v_scale, table[b], n))
        else:
            kd, vd = dequant_int4(kp, D), dequant_int4(vp, Dv)
        qb = q[cu[b]:cu[b + 1]].astype(np.float64).transpose(1, 0, 2) @ rot.T
        tq = qb.shape[1]
        visible = np.arange(n)[None, :] <= np.arange(tq)[:, None] + (n - tq)
        outs.append(ref_attention(qb, kd, vd, visible=visible).transpose(1, 0, 2))
    return np.concatenate(outs)


@pytest.mark.parametrize("dtype,D,Dv", [("int8", 64, 48), ("int8", 40, 40), ("int4", 64, 48),
                                        ("int4", 96, 96)])
@pytest.mark.parametrize("q_dtype", ["float32", "float16"])
def test_varlen_reads_rotated_and_int4_pools(no_warnings, int8_widen, dtype, D, Dv, q_dtype):
    # int8_widen: the reference is exact attention over the dequantised pools (the vpdpbusd
    # path rounds q to int8 per row: tests/test_lowbit.py)
    rng = np.random.default_rng(D + Dv)
    cache, ids, lens, cu, q = _ragged_paged(rng, dtype, D, Dv, np.dtype(q_dtype))
    assert cache.key_rotation == "hadamard"
    kw = dict(k_scale=cache.k_scale, v_scale=cache.v_scale) if dtype == "int8" else {}
    if dtype == "int4" and Dv != D:
        kw["v_head_dim"] = Dv
    out, lse = af.attention_varlen(q, cache.k, cache.v, cu, seqused_k=lens,
                                   block_table=cache.block_table(ids), causal=True,
                                   key_rotation=cache.key_rotation, return_lse=True, **kw)
    assert out.dtype == q.dtype and out.shape == (q.shape[0], q.shape[1], Dv)
    want = _varlen_reference(cache, ids, lens, cu, q, D, Dv, dtype)
    tol = 2e-5 if q_dtype == "float32" else 2e-3
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=tol, atol=tol)
    assert np.isfinite(lse).all()
    # the same as the cache's own reading, sequence by sequence
    for b, s in enumerate(ids):
        mine = cache.attend(s, q[cu[b]:cu[b + 1]].transpose(1, 0, 2)).transpose(1, 0, 2)
        np.testing.assert_allclose(out[cu[b]:cu[b + 1]].astype(np.float64),
                                   mine.astype(np.float64), rtol=tol, atol=tol)
    # explain_varlen takes the same arguments
    plan = af.explain_varlen(q, cache.k, cache.v, cu, seqused_k=lens,
                             block_table=cache.block_table(ids), causal=True,
                             key_rotation=cache.key_rotation, **kw)
    assert plan["sequences"] == len(ids)


def test_varlen_out_argument_with_a_rotated_float16_query(no_warnings):
    rng = np.random.default_rng(12)
    cache, ids, lens, cu, q = _ragged_paged(rng, "int8", 32, 32, np.float16)
    out = np.full((q.shape[0], q.shape[1], 32), 3.0, np.float16)
    res = af.attention_varlen(q, cache.k, cache.v, cu, seqused_k=lens,
                              block_table=cache.block_table(ids), causal=True,
                              k_scale=cache.k_scale, v_scale=cache.v_scale,
                              key_rotation="hadamard", out=out)
    assert res is out
    want = _varlen_reference(cache, ids, lens, cu, q, 32, 32, "int8")
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=2e-3, atol=2e-3)


def test_varlen_pool_format_arguments_are_checked():
    rng = np.random.default_rng(13)
    cache, ids, lens, cu, q = _ragged_paged(rng, "int4", 64, 16)
    table = cache.block_table(ids)
    with pytest.raises(ValueError, match="int4 rows of 64 values"):   # Dv = 16: v_head_dim=
        af.attention_varlen(q, cache.k, cache.v, cu, seqused_k=lens, block_table=table)
    f32 = af.PagedKVCache(8, 8, 2, 64)
    s = f32.add_sequence()
    f32.append(s, np.ones((2, 3, 64), np.float32), np.ones((2, 3, 64), np.float32))
    with pytest.raises(ValueError, match="key_rotation"):
        af.attention_varlen(q[:1], f32.k, f32.v, np.array([0, 1]), seqused_k=np.array([3]),
                            block_table=f32.block_table([s]), key_rotation="hadamard")
    with pytest.raises(ValueError, match="v_head_dim"):
        af.attention_varlen(q[:1], f32.k, f32.v, np.array([0, 1]), seqused_k=np.array([3]),
                            block_table=f32.block_table([s]), v_head_dim=64)
    packed = np.ones((4, 2, 64), np.float32)
    for name in ("key_rotation", "v_head_dim"):
        with pytest.raises(NotImplementedError, match=name):
            af.attention_varlen(q[:4], packed, packed, np.array([0, 4]), np.array([0, 4]),
                                **{name: "hadamard" if name == "key_rotation" else 64})


# ---------------------------------------------------------------------------------------------
# 9. The transformers backend refuses what it does not implement


def _backend():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import attnfast.integrations.transformers as aft
    aft.register()
    return torch, aft


def _qkv(torch, seed=0, B=1, H=4, Hkv=2, T=6, D=16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g),
            torch.randn(B, Hkv, T, D, generator=g))


class _Module:
    is_causal = True
    num_key_value_groups = 2
    training = False


def test_backend_runs_sparse_indices_and_refuses_them_where_it_cannot():
    """indices= (DeepSeek-V3.2 / GLM-5's top-k keys per query) runs eagerly: attention over
    the listed keys the mask leaves visible, as sdpa over the dense mask of the top-k, and
    with gradients, sdpa's gradients; block_indices= is refused by name, never dropped."""
    torch, aft = _backend()
    q, k, v = _qkv(torch)
    g = torch.Generator().manual_seed(3)
    indices = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(6)])[None].to(torch.int32)
    mask = torch.ones((1, 1, 6, 6), dtype=torch.bool).tril()
    keep = torch.zeros((1, 1, 6, 6), dtype=torch.bool).scatter(-1, indices.long()[:, None], True) & mask
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), kr.double(), vr.double(),
                                                            attn_mask=keep, scale=0.25)
    got, _ = aft.attention_forward(_Module(), q, k, v, mask, scaling=0.25, indices=indices)
    torch.testing.assert_close(got.transpose(1, 2).double(), want, rtol=2e-5, atol=2e-5)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    got, _ = aft.attention_forward(_Module(), *leaves, mask, scaling=0.25, indices=indices)
    got.transpose(1, 2).sum().backward()
    ref = [x.double().requires_grad_() for x in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(
        ref[0], ref[1].repeat_interleave(2, 1), ref[2].repeat_interleave(2, 1), attn_mask=keep,
        scale=0.25).sum().backward()
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-10)
    with pytest.raises(NotImplementedError, match="block_indices="):
        aft.attention_forward(_Module(), q.detach(), k, v, mask, block_indices=indices)


@pytest.mark.parametrize("topk", [3, 12])
def test_backend_sparse_prompt_as_sdpa_at_any_selected_share(topk):
    """A prompt's indices= selecting few of the keys per query (3 of 64: one gathered problem
    per query) or many (12 of 64: the masked prefill, as sdpa runs it), with -1 entries, a
    padded key and causality from the mask: both sdpa's attention over the dense mask, in
    float64."""
    torch, aft = _backend()
    q, k, v = _qkv(torch, seed=4, T=64)
    q = q[:, :, -8:]
    g = torch.Generator().manual_seed(5)
    indices = torch.stack([torch.randperm(57 + i, generator=g)[:topk] for i in range(8)])[None]
    indices[0, 2, 0] = -1
    mask = torch.ones((1, 1, 8, 64), dtype=torch.bool).tril(56)
    mask[..., 10] = False  # padding
    keep = torch.zeros((1, 1, 8, 65), dtype=torch.bool).scatter(
        -1, torch.where(indices >= 0, indices, 64).long()[:, None], True)[..., :64] & mask
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.repeat_interleave(2, 1).double(), v.repeat_interleave(2, 1).double(),
        attn_mask=keep, scale=0.25)
    got, _ = aft.attention_forward(_Module(), q, k, v, mask, scaling=0.25, indices=indices.to(torch.int32))
    torch.testing.assert_close(got.transpose(1, 2).double(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name,value", [
    ("output_attentions", True), ("cu_seq_lens_q", "tensor"), ("sinks", "tensor"),
    ("position_bias", "tensor"), ("some_future_option", 1)])
def test_backend_refuses_other_unimplemented_arguments(name, value):
    torch, aft = _backend()
    q, k, v = _qkv(torch)
    if value == "tensor":
        value = torch.zeros(2)
    with pytest.raises(NotImplementedError, match=name):
        aft.attention_forward(_Module(), q, k, v, None, **{name: value})


def test_backend_accepts_what_transformers_always_passes():
    """The keyword arguments transformers' models pass to every attention function (found
    by running them: position_ids, use_cache, output_attentions=False, ...) and None for a
    sparse option that is off: the float64 causal answer."""
    torch, aft = _backend()
    q, k, v = _qkv(torch, seed=1)
    out, weights = aft.attention_forward(
        _Module(), q, k, v, None, dropout=0.0, scaling=0.25, sliding_window=None,
        position_ids=torch.arange(6)[None], use_cache=True, output_attentions=False,
        output_router_logits=False, indices=None, position_bias=None, max_length_q=6,
        deterministic=True)
    assert weights is None
    visible = np.tril(np.ones((6, 6), bool))
    want = ref_attention(q.numpy(), k.numpy(), v.numpy(), scale=0.25, visible=visible)
    np.testing.assert_allclose(out.numpy(), want.transpose(0, 2, 1, 3), rtol=2e-5, atol=2e-5)


# (A DeepSeek-V3.2 model on attnfast now runs its sparse attention: test_transformers_backend's
# test_sparse_attention_models_match_sdpa.)


# ---------------------------------------------------------------------------------------------
# CI: the suite runs with warnings as errors


def test_pytest_configuration_turns_warnings_into_errors():
    tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else \
        pytest.importorskip("tomli")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        options = tomllib.load(f)["tool"]["pytest"]["ini_options"]
    assert options["filterwarnings"][0] == "error"
    # every other entry is a narrow ignore: a category and a message or module, never all
    for entry in options["filterwarnings"][1:]:
        action, message, category, *rest = entry.split(":") + ["", ""]
        assert action == "ignore" and category and (message or any(rest)), entry
