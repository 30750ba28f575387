"""Tree verification (issue 22, item 3): ``tree_mask=`` on the cache calls, against the float64
reference with the equivalent dense mask (cached keys all visible, new token i sees new token
j iff tree_mask[i, j])."""
import ml_dtypes
import numpy as np
import pytest

import attnfast as af
from reference import TOLERANCE, reference_attention

F32 = np.dtype(np.float32)
BF16 = np.dtype(ml_dtypes.bfloat16)


def rand(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def random_tree(rng, tq):
    """A token tree: each node's parent is an earlier node; a node sees its ancestors."""
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, tq)]
    tree = np.zeros((tq, tq), bool)
    for i in range(tq):
        j = i
        while j >= 0:
            tree[i, j] = True
            j = parent[j]
    return tree


def star(tq):
    """A root and tq - 1 children that each see only the root and themselves."""
    tree = np.eye(tq, dtype=bool)
    tree[:, 0] = True
    return tree


def reference(q, k, v, lengths, tree, **options):
    """float64 (out, lse) per sequence: k, v (B, Hkv, >= L, D) hold each sequence's keys."""
    tq = q.shape[2]
    outs, lses = [], []
    for b, L in enumerate(lengths):
        mask = np.ones((tq, L), bool)
        mask[:, L - tq:] = tree if tree.ndim == 2 else tree[b]
        o, l, _ = reference_attention(q[b].astype(np.float64), k[b][:, :L].astype(np.float64),
                                      v[b][:, :L].astype(np.float64), mask=mask, **options)
        outs.append(o)
        lses.append(l)
    return np.stack(outs), np.stack(lses)


def tol_for(dtype):
    if np.dtype(dtype) == F32:
        return TOLERANCE[F32]
    eps = 2 * float(ml_dtypes.finfo(dtype).eps)
    return dict(rtol=eps, atol=eps)


@pytest.mark.parametrize("tq", [1, 2, 7, 17, 64])
def test_kvcache_step_random_tree(rng, tq):
    B, Hkv, H, D = 2, 2, 4, 16
    cache = af.KVCache(B, Hkv, D, 200)
    cache.append(rand(rng, (B, Hkv, 50, D)), rand(rng, (B, Hkv, 50, D)))
    cache.truncate(np.array([50, 33]))
    tree = random_tree(rng, tq)
    q, kn, vn = rand(rng, (B, H, tq, D)), rand(rng, (B, Hkv, tq, D)), rand(rng, (B, Hkv, tq, D))
    out, lse = cache.step(q, kn, vn, tree_mask=tree, return_lse=True)
    ref, ref_lse = reference(q, cache.k, cache.v, cache.lengths, tree)
    np.testing.assert_allclose(out, ref, **TOLERANCE[F32])
    np.testing.assert_allclose(lse, ref_lse, **TOLERANCE[F32])


@pytest.mark.parametrize("dtype, q_dtype", [(F32, F32), (BF16, BF16), (np.float16, np.float16),
                                            (np.int8, F32)])
def test_paged_dtypes_per_sequence_trees(rng, dtype, q_dtype):
    Hkv, H, D, tq = 2, 8, 16, 6
    cache = af.PagedKVCache(40, 16, Hkv, D, dtype=dtype, key_rotation=None)  # reference reads it as stored
    ids = [cache.add_sequence() for _ in range(3)]
    new = np.float32 if np.dtype(dtype) == np.int8 else dtype
    for s, n in zip(ids, (20, 45, 6)):
        cache.append(s, rand(rng, (Hkv, n, D), new), rand(rng, (Hkv, n, D), new))
    trees = np.stack([random_tree(rng, tq), star(tq), np.tril(np.ones((tq, tq), bool))])
    q = rand(rng, (3, H, tq, D), q_dtype)
    out = cache.attend(ids, q, tree_mask=trees)
    assert out.dtype == q_dtype
    # the reference reads the pool as stored (int8: times its row scales)
    table = cache.block_table(ids)
    def flat(pool, scale):
        x = pool[table].astype(np.float64)                          # (B, nb, Hkv, bs, D)
        if scale is not None:
            x *= scale[table][..., None]
        return x.transpose(0, 2, 1, 3, 4).reshape(3, Hkv, -1, D)
    ref, _ = reference(q.astype(np.float32), flat(cache.k, cache.k_scale),
                       flat(cache.v, cache.v_scale), [20, 45, 6], trees)
    np.testing.assert_allclose(out.astype(np.float64), ref, **tol_for(q_dtype))


def test_chain_equals_causal_and_star(rng):
    B, Hkv, H, D, tq = 2, 1, 2, 8, 9
    cache = af.KVCache(B, Hkv, D, 64)
    cache.append(rand(rng, (B, Hkv, 30, D)), rand(rng, (B, Hkv, 30, D)))
    q = rand(rng, (B, H, tq, D))
    chain = cache.attend(q, tree_mask=np.tril(np.ones((tq, tq), bool)))
    np.testing.assert_allclose(chain, cache.attend(q), rtol=1e-6, atol=1e-6)
    out, lse = cache.attend(q, tree_mask=star(tq), return_lse=True)
    ref, ref_lse = reference(q, cache.k, cache.v, cache.lengths, star(tq))
    np.testing.assert_allclose(out, ref, **TOLERANCE[F32])
    np.testing.assert_allclose(lse, ref_lse, **TOLERANCE[F32])


@pytest.mark.parametrize("paged", [False, True])
def test_functional_softcap_sinks_threads(rng, paged):
    B, Hkv, H, D, tq = 2, 2, 4, 16, 5
    tree = random_tree(rng, tq)
    q, kn, vn = rand(rng, (B, H, tq, D)), rand(rng, (B, Hkv, tq, D)), rand(rng, (B, Hkv, tq, D))
    sinks = np.array([0.3, -0.2, 1.0, 0.0], np.float32)
    seqlens = np.array([20, 11])
    if paged:
        kc, vc = rand(rng, (8, Hkv, 16, D)), rand(rng, (8, Hkv, 16, D))
        extra = dict(block_table=np.array([[3, 1], [0, 6]]))
    else:
        kc, vc = rand(rng, (B, Hkv, 40, D)), rand(rng, (B, Hkv, 40, D))
        extra = {}
    results = []
    for threads in (1, 2):
        kc2, vc2 = kc.copy(), vc.copy()
        results.append(af.attention_with_kvcache(
            q, kc2, vc2, seqlens, kn, vn, tree_mask=tree, softcap=4.0, sinks=sinks,
            return_lse=True, num_threads=threads, **extra))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
    if paged:
        table = extra["block_table"]
        k = kc2[table].transpose(0, 2, 1, 3, 4).reshape(B, Hkv, -1, D)
        v = vc2[table].transpose(0, 2, 1, 3, 4).reshape(B, Hkv, -1, D)
    else:
        k, v = kc2, vc2
    ref, ref_lse = reference(q, k, v, seqlens + tq, tree, softcap=4.0, sinks=sinks)
    np.testing.assert_allclose(results[0][0], ref, **TOLERANCE[F32])
    np.testing.assert_allclose(results[0][1], ref_lse, **TOLERANCE[F32])


def test_batch_index_selection(rng):
    cache = af.KVCache(4, 1, 8, 40)
    cache.append(rand(rng, (4, 1, 12, 8)), rand(rng, (4, 1, 12, 8)))
    tree = random_tree(rng, 4)
    q = rand(rng, (2, 2, 4, 8))
    out = cache.attend(q, batch_index=[3, 0], tree_mask=tree)
    ref, _ = reference(q, cache.k[[3, 0]], cache.v[[3, 0]], [12, 12], tree)
    np.testing.assert_allclose(out, ref, **TOLERANCE[F32])


@pytest.mark.parametrize("tree_mask, error, text", [
    (np.ones((3, 3), np.int8), TypeError, "tree_mask must be a bool array"),
    (np.ones((3, 4), bool), ValueError, r"tree_mask must have shape \(Tq, Tq\) = \(3, 3\)"),
    (np.ones((5, 3, 3), bool), ValueError, r"\(B, Tq, Tq\) = \(2, 3, 3\), got \(5, 3, 3\)"),
    (np.diag([True, False, True]), ValueError,
     r"diagonal must be True.*tree_mask\[1, 1\] is False"),
])
def test_bad_tree_mask_leaves_the_cache_unchanged(rng, tree_mask, error, text):
    cache = af.KVCache(2, 1, 8, 20)
    cache.append(rand(rng, (2, 1, 5, 8)), rand(rng, (2, 1, 5, 8)))
    k0, v0, l0 = cache.k.copy(), cache.v.copy(), cache.lengths.copy()
    with pytest.raises(error, match=text):
        cache.step(rand(rng, (2, 2, 3, 8)), rand(rng, (2, 1, 3, 8)), rand(rng, (2, 1, 3, 8)),
                   tree_mask=tree_mask)
    assert cache.k.tobytes() == k0.tobytes() and cache.v.tobytes() == v0.tobytes()
    np.testing.assert_array_equal(cache.lengths, l0)


@pytest.mark.parametrize("options, names", [
    (dict(window=(4, 0)), "window"), (dict(causal=False), "causal=False"),
    (dict(query_offset=2), "query_offset"),
    (dict(alibi_slopes=np.ones(2, np.float32)), "alibi_slopes"),
    (dict(mask=np.ones((1, 1, 1, 8), bool)), "mask"),
])
def test_unsupported_combinations_raise_before_writing(rng, options, names):
    cache = af.PagedKVCache(8, 4, 1, 8)
    s = cache.add_sequence()
    cache.append(s, rand(rng, (1, 5, 8)), rand(rng, (1, 5, 8)))
    k0, free = cache.k.copy(), cache.num_free_blocks
    with pytest.raises(NotImplementedError, match=f"tree_mask cannot be combined with {names}"):
        cache.step(s, rand(rng, (2, 3, 8)), rand(rng, (1, 3, 8)), rand(rng, (1, 3, 8)),
                   tree_mask=np.eye(3, dtype=bool), **options)
    assert cache.k.tobytes() == k0.tobytes() and cache.length(s) == 5
    assert cache.num_free_blocks == free


def test_token_counts(rng):
    cache = af.KVCache(1, 1, 8, 200)
    cache.append(rand(rng, (1, 1, 2, 8)), rand(rng, (1, 1, 2, 8)))
    with pytest.raises(ValueError, match="sequence 0 holds 2"):
        cache.attend(rand(rng, (1, 1, 3, 8)), tree_mask=np.eye(3, dtype=bool))
    with pytest.raises(ValueError, match="k_new must hold Tq = 3 tokens, got 2"):
        cache.step(rand(rng, (1, 1, 3, 8)), rand(rng, (1, 1, 2, 8)), rand(rng, (1, 1, 2, 8)),
                   tree_mask=np.eye(3, dtype=bool))
    with pytest.raises(ValueError, match="1 to 64 query tokens"):
        cache.append(rand(rng, (1, 1, 80, 8)), rand(rng, (1, 1, 80, 8)))
        cache.attend(rand(rng, (1, 1, 65, 8)), tree_mask=np.eye(65, dtype=bool))
    assert cache.lengths[0] == 82
