"""The paged KV cache: attention_with_kvcache(..., block_table=) and PagedKVCache.

Paged results must be bit-identical to a contiguous cache holding the same tokens (on every
kernel tier, decode and prefill, every dtype and option), and match the float64 reference.
"""
import ml_dtypes
import numpy as np
import pytest

import attnfast as af
from reference import TOLERANCE, reference_attention

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)


def rand(rng, shape, dtype=np.float32):
    if np.dtype(dtype) == np.int8:
        return rng.integers(-127, 128, shape).astype(np.int8)
    return rng.standard_normal(shape).astype(dtype)


def to_pool(rng, cache, block_size, spare=3, flash_layout=False, fill=0):
    """The contiguous (B, Hkv, C, X) `cache` (C a multiple of block_size) as a pool of
    blocks under a shuffled table with `spare` unused blocks: (pool, table). With
    flash_layout the pool is stored (num_blocks, block_size, Hkv, X) and returned as the
    transposed view. Scales (B, Hkv, C) work the same (X absent)."""
    B, H, C = cache.shape[:3]
    per = C // block_size
    nb = B * per + spare
    table = rng.permutation(nb)[:B * per].reshape(B, per)
    tail = cache.shape[3:]
    if flash_layout:
        store = np.full((nb, block_size, H) + tail, fill, cache.dtype)
        pool = np.swapaxes(store, 1, 2)
    else:
        pool = np.full((nb, H, block_size) + tail, fill, cache.dtype)
    for b in range(B):
        for i in range(per):
            pool[table[b, i]] = cache[b, :, i * block_size:(i + 1) * block_size]
    return pool, table


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
        np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


def run_both(rng, q, kc, vc, lens, bs, *, ks=None, vs=None, flash_layout=False, **opts):
    """(contiguous (out, lse), paged (out, lse)) for the same tokens."""
    kp, table = to_pool(np.random.default_rng(1), kc, bs, flash_layout=flash_layout)
    vp, _ = to_pool(np.random.default_rng(1), vc, bs, flash_layout=flash_layout)
    ksp = vsp = None
    if ks is not None:
        ksp, _ = to_pool(np.random.default_rng(1), ks, bs)
        vsp, _ = to_pool(np.random.default_rng(1), vs, bs)
    a = af.attention_with_kvcache(q, kc, vc, lens, k_scale=ks, v_scale=vs, return_lse=True, **opts)
    b = af.attention_with_kvcache(q, kp, vp, lens, block_table=table, k_scale=ksp, v_scale=vsp,
                                  return_lse=True, **opts)
    return a, b


def reference_per_sequence(q, kc, vc, lens, **opts):
    outs, lses = [], []
    for b, n in enumerate(lens):
        o, l, _ = reference_attention(q[b], kc[b, :, :n], vc[b, :, :n], **opts)
        outs.append(o)
        lses.append(l)
    return np.stack(outs), np.stack(lses)


@pytest.mark.parametrize("bs", [1, 16, 17])
@pytest.mark.parametrize("tq", [1, 3, 20])
@pytest.mark.parametrize("dims", [(64, 32), (20, 12)], ids=["simd-dims", "odd-dims"])
def test_paged_equals_contiguous_and_reference(tier, rng, bs, tq, dims):
    D, Dv = dims
    B, H, Hkv = 3, 4, 2
    C = bs * -(-90 // bs)
    kc, vc = rand(rng, (B, Hkv, C, D)), rand(rng, (B, Hkv, C, Dv))
    lens = np.array([90, 0, 37]) if tq <= 16 else np.array([90, 25, 37])
    q = rand(rng, (B, H, tq, D))
    (oc, lc), (op, lp) = run_both(rng, q, kc, vc, lens, bs)
    assert same_bits(oc, op) and same_bits(lc, lp)
    ref_o, ref_l = reference_per_sequence(q, kc, vc, lens, causal=True)
    np.testing.assert_allclose(op, ref_o, **TOLERANCE[F32])
    np.testing.assert_allclose(lp, ref_l, **TOLERANCE[F32])


@pytest.mark.parametrize("tq", [1, 20])
def test_float64_and_thread_counts(rng, tq):
    kc, vc = rand(rng, (2, 1, 64, 16), np.float64), rand(rng, (2, 1, 64, 8), np.float64)
    q = rand(rng, (2, 3, tq, 16), np.float64)
    lens = np.array([64, 41])
    kp, table = to_pool(np.random.default_rng(1), kc, 16)
    vp, _ = to_pool(np.random.default_rng(1), vc, 16)  # the same seed: the same table
    outs = [af.attention_with_kvcache(q, kp, vp, lens, block_table=table, num_threads=n)
            for n in (1, 2)]
    assert same_bits(outs[0], outs[1])
    assert same_bits(outs[0], af.attention_with_kvcache(q, kc, vc, lens))
    ref, _ = reference_per_sequence(q, kc, vc, lens, causal=True)
    np.testing.assert_allclose(outs[0], ref, **TOLERANCE[np.dtype(np.float64)])


@pytest.mark.parametrize("bs", [16, 17])
def test_flash_attn_pool_layout_is_read_and_written_in_place(rng, bs):
    """flash-attn's (num_blocks, block_size, Hkv, D) pool passes as a transposed view: the
    new tokens land in it, no copy."""
    B, H, Hkv, D = 2, 4, 2, 32
    C = 4 * bs
    kc, vc = rand(rng, (B, Hkv, C, D)), rand(rng, (B, Hkv, C, D))
    kp, table = to_pool(np.random.default_rng(1), kc, bs, flash_layout=True)
    vp, _ = to_pool(np.random.default_rng(1), vc, bs, flash_layout=True)
    assert not kp.flags.c_contiguous and kp.base is not None
    lens = np.array([bs + 3, 2 * bs - 1])
    q, kn, vn = rand(rng, (B, H, 2, D)), rand(rng, (B, Hkv, 2, D)), rand(rng, (B, Hkv, 2, D))
    out_c = af.attention_with_kvcache(q, kc, vc, lens, kn, vn)
    out_p = af.attention_with_kvcache(q, kp, vp, lens, kn, vn, block_table=table.astype(np.int32))
    assert same_bits(out_c, out_p)
    for b in range(B):
        for t in range(lens[b], lens[b] + 2):
            blk, row = table[b, t // bs], t % bs
            np.testing.assert_array_equal(kp.base[blk, row], kc[b, :, t])  # written in place
            np.testing.assert_array_equal(vp[blk, :, row], vn[b, :, t - lens[b]])


def test_new_tokens_go_through_the_table_and_nothing_else_changes(rng):
    bs, B, Hkv, D = 4, 2, 2, 16
    kc, vc = rand(rng, (B, Hkv, 12, D)), rand(rng, (B, Hkv, 12, D))
    kp, table = to_pool(np.random.default_rng(1), kc, bs, spare=2, fill=7)
    vp, _ = to_pool(np.random.default_rng(1), vc, bs, spare=2, fill=7)
    kp0, vp0 = kp.copy(), vp.copy()
    lens = np.array([3, 6])
    kn, vn = rand(rng, (B, Hkv, 5, D)), rand(rng, (B, Hkv, 5, D))
    q = rand(rng, (B, 4, 5, D))
    out_p = af.attention_with_kvcache(q, kp, vp, lens, kn, vn, block_table=table)
    out_c = af.attention_with_kvcache(q, kc, vc, lens, kn, vn)
    assert same_bits(out_c, out_p)
    written = np.zeros(kp.shape[:1] + kp.shape[2:3], bool)  # (block, row)
    for b in range(B):
        for u in range(5):
            t = lens[b] + u
            written[table[b, t // bs], t % bs] = True
            np.testing.assert_array_equal(kp[table[b, t // bs], :, t % bs], kn[b, :, u])
    keep = ~written
    np.testing.assert_array_equal(kp.transpose(0, 2, 1, 3)[keep], kp0.transpose(0, 2, 1, 3)[keep])
    np.testing.assert_array_equal(vp.transpose(0, 2, 1, 3)[keep], vp0.transpose(0, 2, 1, 3)[keep])


@pytest.mark.parametrize("kv_dtype,q_dtype", [(BF16, BF16), (BF16, F32), (F16, F16), (F16, F32)],
                         ids=str)
@pytest.mark.parametrize("tq", [1, 20])
def test_16bit_pools(tier, rng, kv_dtype, q_dtype, tq):
    bs, B, H, Hkv, D = 16, 2, 4, 2, 64
    kc, vc = rand(rng, (B, Hkv, 96, D), kv_dtype), rand(rng, (B, Hkv, 96, D), kv_dtype)
    q = rand(rng, (B, H, tq, D), q_dtype)
    lens = np.array([96, 50])
    (oc, lc), (op, lp) = run_both(rng, q, kc, vc, lens, bs)
    assert same_bits(oc, op) and same_bits(lc, lp)
    ref, _ = reference_per_sequence(q, kc, vc, lens, causal=True)
    tol = 2e-5 if q_dtype == F32 else 2 * float(ml_dtypes.finfo(q_dtype).eps)
    np.testing.assert_allclose(op.astype(np.float64), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("q_dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("tq", [1, 20])
def test_int8_pools_and_scales(tier, rng, q_dtype, tq):
    bs, B, H, Hkv, D = 17, 2, 4, 2, 32
    C = 5 * bs
    kc, vc = rand(rng, (B, Hkv, C, D), np.int8), rand(rng, (B, Hkv, C, D), np.int8)
    ks = (rng.random((B, Hkv, C)) / 64).astype(np.float32)
    vs = (rng.random((B, Hkv, C)) / 64).astype(np.float32)
    q = rand(rng, (B, H, tq, D), q_dtype)
    lens = np.array([C, 40])
    (oc, lc), (op, lp) = run_both(rng, q, kc, vc, lens, bs, ks=ks, vs=vs)
    assert same_bits(oc, op) and same_bits(lc, lp)
    kd, vd = kc * ks[..., None].astype(np.float64), vc * vs[..., None].astype(np.float64)
    ref, _ = reference_per_sequence(q, kd, vd, lens, causal=True)
    tol = 2e-5 if q_dtype == F32 else 2 * float(ml_dtypes.finfo(q_dtype).eps)
    np.testing.assert_allclose(op.astype(np.float64), ref, rtol=tol, atol=tol)


def test_int8_new_tokens_write_scales_through_the_table(rng):
    bs, Hkv, D = 8, 2, 16
    nb = 6
    kp, vp = np.zeros((nb, Hkv, bs, D), np.int8), np.zeros((nb, Hkv, bs, D), np.int8)
    ksp, vsp = np.zeros((nb, Hkv, bs), np.float32), np.zeros((nb, Hkv, bs), np.float32)
    table = np.array([[4, 1, 0]])
    kn, vn = rand(rng, (1, Hkv, 10, D)), rand(rng, (1, Hkv, 10, D))
    q = rand(rng, (1, 4, 10, D))
    out = af.attention_with_kvcache(q, kp, vp, 0, kn, vn, block_table=table, k_scale=ksp, v_scale=vsp)
    np.testing.assert_allclose(ksp[4, :, :], np.abs(kn[0, :, :8]).max(-1) / 127, rtol=1e-6)
    np.testing.assert_allclose(ksp[1, :, :2], np.abs(kn[0, :, 8:]).max(-1) / 127, rtol=1e-6)
    assert not ksp[[0, 2, 3, 5]].any() and not ksp[1, :, 2:].any()
    ref, _, _ = reference_attention(q, kn, vn, causal=True)
    assert np.abs(out - ref).max() < 0.02  # int8 quantisation error only


@pytest.mark.parametrize("bs", [16, 17])
def test_every_option_across_a_split_kv_chunk_boundary(tier, rng, bs):
    """causal + window + mask + sinks + softcap + ALiBi + GQA, keys on both sides of the
    4096-key decode chunk boundary, decode and prefill."""
    B, H, Hkv, D = 1, 4, 2, 16
    C = bs * -(-4160 // bs)
    kc, vc = rand(rng, (B, Hkv, C, D)), rand(rng, (B, Hkv, C, D))
    lens = np.array([4130])
    for tq in (2, 18):
        q = rand(rng, (B, H, tq, D)) * 2
        mask = rng.random((B, 1, tq, C)) < 0.8
        sinks = rng.standard_normal(H).astype(np.float32)
        slopes = (2.0 ** -np.arange(4, 4 + H)).astype(np.float32)
        opts = dict(causal=True, window=(60, 0), mask=mask, sinks=sinks, softcap=3.0,
                    alibi_slopes=slopes)
        (oc, lc), (op, lp) = run_both(rng, q, kc, vc, lens, bs, **opts)
        assert same_bits(oc, op) and same_bits(lc, lp)
        for n in (1, 2):
            kp, table = to_pool(np.random.default_rng(1), kc, bs)
            vp, _ = to_pool(np.random.default_rng(1), vc, bs)
            o = af.attention_with_kvcache(q, kp, vp, lens, block_table=table, num_threads=n, **opts)
            assert same_bits(o, op)
        L = lens[0]
        ref_o, ref_l, _ = reference_attention(q[0], kc[0, :, :L], vc[0, :, :L], causal=True,
                                              window=(60, 0), mask=mask[0, :, :, :L], sinks=sinks,
                                              softcap=3.0, alibi_slopes=slopes)
        np.testing.assert_allclose(op[0], ref_o, **TOLERANCE[F32])
        np.testing.assert_allclose(lp[0], ref_l, rtol=1e-5, atol=1e-5)


def test_query_offset_and_window_on_a_paged_prompt(rng):
    bs = 8
    kc, vc = rand(rng, (1, 1, 64, 16)), rand(rng, (1, 1, 64, 16))
    q = rand(rng, (1, 2, 20, 16))
    (oc, lc), (op, lp) = run_both(rng, q, kc, vc, np.array([20]), bs, query_offset=0,
                                  window=(5, 2))
    assert same_bits(oc, op) and same_bits(lc, lp)


# ---- bad input: each a clear error naming the argument, nothing written ----

def paged_setup(rng, int8=False):
    dt = np.int8 if int8 else np.float32
    kp, vp = np.zeros((6, 2, 4, 8), dt), np.zeros((6, 2, 4, 8), dt)
    extra = {}
    if int8:
        extra = dict(k_scale=np.zeros((6, 2, 4), np.float32), v_scale=np.zeros((6, 2, 4), np.float32))
    args = dict(q=rand(rng, (2, 2, 1, 8)), k_cache=kp, v_cache=vp, cache_seqlens=np.array([4, 5]),
                k_new=rand(rng, (2, 2, 1, 8)), v_new=rand(rng, (2, 2, 1, 8)),
                block_table=np.array([[0, 1], [2, 3]], np.int32), **extra)
    return args


BAD_TABLES = [
    ("out-of-range id", dict(block_table=np.array([[0, 6], [2, 3]])), ValueError, r"block_table\[0, 1\] = 6"),
    ("negative id", dict(block_table=np.array([[-1, 1], [2, 3]])), ValueError, r"block_table\[0, 0\] = -1"),
    ("too few blocks", dict(cache_seqlens=np.array([3, 8])), ValueError, "too few blocks"),
    ("too few columns", dict(block_table=np.array([[0], [2]])), ValueError, "too few blocks"),
    ("float table", dict(block_table=np.array([[0.0, 1.0], [2.0, 3.0]])), TypeError, "block_table must have dtype int32 or int64"),
    ("int16 table", dict(block_table=np.array([[0, 1], [2, 3]], np.int16)), TypeError, "block_table must have dtype"),
    ("1-D table", dict(block_table=np.array([0, 1, 2, 3])), ValueError, "block_table must be 2-D"),
    ("3-D table", dict(block_table=np.zeros((2, 2, 1), np.int64)), ValueError, "block_table must be 2-D"),
    ("wrong rows", dict(block_table=np.array([[0, 1]])), ValueError, "one row per sequence"),
    ("scalar table", dict(block_table=3), TypeError, "block_table must be an int32 or int64 array"),
    ("block_size differs", dict(v_cache=np.zeros((6, 2, 5, 8), np.float32)), ValueError, "block_size differs"),
    ("pool heads differ", dict(v_cache=np.zeros((6, 1, 4, 8), np.float32)), ValueError, "v_cache must match k_cache"),
    ("3-D pool", dict(k_cache=np.zeros((6, 2, 4), np.float32)), ValueError, "k_cache must be a 4-D pool"),
    ("shared new rows", dict(block_table=np.array([[0, 1], [2, 0]]), cache_seqlens=np.array([3, 7])),
     ValueError, "same block row"),
]


@pytest.mark.parametrize("name,change,error,match", BAD_TABLES, ids=[c[0] for c in BAD_TABLES])
def test_bad_block_tables_raise_and_write_nothing(rng, name, change, error, match):
    args = paged_setup(rng)
    args.update(change)
    before = [a.copy() for a in (args["k_cache"], args["v_cache"])]
    out = np.full((2, 2, 1, 8), 5.0, np.float32)
    with pytest.raises(error, match=match):
        af.attention_with_kvcache(**args, out=out)
    assert same_bits(before[0], args["k_cache"]) and same_bits(before[1], args["v_cache"])
    assert (out == 5.0).all()


@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_scale_pool_block_size_must_match(rng, which):
    args = paged_setup(rng, int8=True)
    args[which] = np.zeros((6, 2, 3), np.float32)
    with pytest.raises(ValueError, match=f"block_size differs: {which}"):
        af.attention_with_kvcache(**args)
    assert not args["k_cache"].any() and not args["v_cache"].any()


def test_contiguous_cache_with_table_needs_the_pool_layout(rng):
    args = paged_setup(rng)
    args["k_cache"] = np.zeros((2, 2, 8), np.float32)
    with pytest.raises(ValueError, match="4-D pool"):
        af.attention_with_kvcache(**args)


def test_unused_table_entries_are_not_read(rng):
    """Entries past what a sequence uses may be anything (e.g. -1 padding)."""
    args = paged_setup(rng)
    args["block_table"] = np.array([[0, 1, -1, 99], [2, 3, -7, -1]])
    af.attention_with_kvcache(**args)


# ---- PagedKVCache ----

def contiguous_of(cache, sid):
    """(Hkv, n, D), (Hkv, n, Dv): the tokens of one sequence, gathered from the pools."""
    n = cache.length(sid)
    blocks = cache.blocks(sid)
    k = np.concatenate([cache.k[b] for b in blocks], axis=1)[:, :n]
    v = np.concatenate([cache.v[b] for b in blocks], axis=1)[:, :n]
    return k, v


def test_paged_cache_prefill_then_batched_decode(rng):
    cache = af.PagedKVCache(64, 16, kv_heads=2, head_dim=32)
    assert cache.num_free_blocks == 64 and cache.sequences == ()
    lens = [40, 5, 16]
    ids = [cache.add_sequence() for _ in lens]
    ks = {s: rand(rng, (2, n, 32)) for s, n in zip(ids, lens)}
    vs = {s: rand(rng, (2, n, 32)) for s, n in zip(ids, lens)}
    for s, n in zip(ids, lens):
        q = rand(rng, (4, n, 32))
        out = cache.step(s, q, ks[s], vs[s])  # one bare id: 3-D arrays
        assert out.shape == (4, n, 32)
        ref, _, _ = reference_attention(q, ks[s], vs[s], causal=True)
        np.testing.assert_allclose(out, ref, **TOLERANCE[F32])
    assert cache.lengths == dict(zip(ids, lens))
    assert cache.num_free_blocks == 64 - (3 + 1 + 1)
    # one batched decode step over all three, in one kernel call
    q, kn, vn = rand(rng, (3, 4, 1, 32)), rand(rng, (3, 2, 1, 32)), rand(rng, (3, 2, 1, 32))
    out, lse = cache.step(ids, q, kn, vn, return_lse=True)
    contiguous = af.KVCache(3, 2, 32, 64)
    for i, s in enumerate(ids):
        k_all = np.concatenate([ks[s], kn[i]], axis=1)
        v_all = np.concatenate([vs[s], vn[i]], axis=1)
        contiguous.append(k_all[None], v_all[None], batch_index=i)
        ref, ref_lse, _ = reference_attention(q[i], k_all, v_all, causal=True)
        np.testing.assert_allclose(out[i], ref, **TOLERANCE[F32])
        np.testing.assert_allclose(lse[i], ref_lse, **TOLERANCE[F32])
    assert same_bits(out, contiguous.attend(q))
    assert cache.lengths == {ids[0]: 41, ids[1]: 6, ids[2]: 17}
    assert cache.num_free_blocks == 64 - (3 + 1 + 2)
    assert same_bits(out, cache.attend(ids, q))
    table = cache.block_table(ids)
    assert table.dtype == np.int32 and table.shape == (3, 3) and table[1, 1] == -1
    assert same_bits(out, af.attention_with_kvcache(q, cache.k, cache.v, [41, 6, 17],
                                                    block_table=table))


def test_fork_shares_blocks_and_copy_on_write_keeps_the_other_sequence(rng):
    cache = af.PagedKVCache(16, 8, kv_heads=1, head_dim=16)
    a = cache.add_sequence()
    cache.append(a, rand(rng, (1, 12, 16)), rand(rng, (1, 12, 16)))  # 1 full + 4 of 8
    q = rand(rng, (1, 2, 1, 16))
    before = cache.attend(a, q[0])
    k_a, v_a = contiguous_of(cache, a)
    free = cache.num_free_blocks
    b = cache.fork(a)
    assert cache.blocks(b) == cache.blocks(a) and cache.num_free_blocks == free
    kn, vn = rand(rng, (1, 3, 16)), rand(rng, (1, 3, 16))
    out_b = cache.step(b, q[0], kn, vn)
    # b's partial block was copied; the full one is still shared
    assert cache.blocks(b)[0] == cache.blocks(a)[0] and cache.blocks(b)[1] != cache.blocks(a)[1]
    assert cache.num_free_blocks == free - 1
    assert same_bits(before, cache.attend(a, q[0]))
    k_a2, v_a2 = contiguous_of(cache, a)
    assert same_bits(k_a, k_a2) and same_bits(v_a, v_a2)
    ref, _, _ = reference_attention(q[0], np.concatenate([k_a, kn], 1), np.concatenate([v_a, vn], 1),
                                    causal=True)
    np.testing.assert_allclose(out_b, ref, **TOLERANCE[F32])
    # a now owns its partial block alone: appending writes in place, no copy
    blocks_a = cache.blocks(a)
    cache.append(a, rand(rng, (1, 2, 16)), rand(rng, (1, 2, 16)))
    assert cache.blocks(a) == blocks_a and cache.num_free_blocks == free - 1
    k_b, _ = contiguous_of(cache, b)
    np.testing.assert_array_equal(k_b[:, :12], k_a)  # b's prefix untouched by a's append
    # freeing returns only unshared blocks
    cache.free(a)
    assert cache.num_free_blocks == free  # a's partial block back; the shared full one stays
    cache.free(b)
    assert cache.num_free_blocks == 16 and cache.sequences == ()


def test_forks_appending_in_one_batched_step(rng):
    cache = af.PagedKVCache(8, 4, kv_heads=1, head_dim=8)
    a = cache.add_sequence()
    ka, va = rand(rng, (1, 6, 8)), rand(rng, (1, 6, 8))
    cache.append(a, ka, va)
    b = cache.fork(a)
    q, kn, vn = rand(rng, (2, 2, 1, 8)), rand(rng, (2, 1, 1, 8)), rand(rng, (2, 1, 1, 8))
    out = cache.step([a, b], q, kn, vn)
    for i in range(2):
        ref, _, _ = reference_attention(q[i], np.concatenate([ka, kn[i]], 1),
                                        np.concatenate([va, vn[i]], 1), causal=True)
        np.testing.assert_allclose(out[i], ref, **TOLERANCE[F32])
    # a copied the shared partial block, b then held the original alone and wrote in place
    assert cache.num_free_blocks == 8 - 3


def snapshot(cache):
    return (cache.k.copy(), cache.v.copy(), cache.lengths,
            {s: cache.blocks(s) for s in cache.sequences}, cache.num_free_blocks)


def assert_unchanged(cache, snap):
    k, v, lengths, blocks, free = snap
    assert same_bits(k, cache.k) and same_bits(v, cache.v)
    assert cache.lengths == lengths and cache.num_free_blocks == free
    assert {s: cache.blocks(s) for s in cache.sequences} == blocks


def test_out_of_blocks_raises_and_changes_nothing(rng):
    cache = af.PagedKVCache(4, 4, kv_heads=1, head_dim=8)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(a, rand(rng, (1, 6, 8)), rand(rng, (1, 6, 8)))   # 2 blocks
    cache.append(b, rand(rng, (1, 3, 8)), rand(rng, (1, 3, 8)))   # 1 block
    c = cache.fork(a)
    snap = snapshot(cache)
    q = rand(rng, (3, 2, 4, 8))
    with pytest.raises(ValueError, match="out of blocks"):  # needs 2 + 1 + 2 (+ a copy), has 1
        cache.step([a, b, c], q, rand(rng, (3, 1, 4, 8)), rand(rng, (3, 1, 4, 8)))
    assert_unchanged(cache, snap)
    with pytest.raises(ValueError, match="out of blocks"):
        cache.append(b, rand(rng, (1, 6, 8)), rand(rng, (1, 6, 8)))
    assert_unchanged(cache, snap)
    cache.append(b, rand(rng, (1, 5, 8)), rand(rng, (1, 5, 8)))  # exactly the last block
    assert cache.num_free_blocks == 0


@pytest.mark.parametrize("call,error,match", [
    (lambda c, rng: c.attend(99, rand(rng, (2, 1, 8))), ValueError, "no sequence 99"),
    (lambda c, rng: c.attend([0, 0], rand(rng, (2, 2, 1, 8))), ValueError, "must not repeat"),
    (lambda c, rng: c.attend([], rand(rng, (2, 1, 8))), ValueError, "at least one"),
    (lambda c, rng: c.attend("a", rand(rng, (2, 1, 8))), TypeError, "seq_ids"),
    (lambda c, rng: c.step(0, rand(rng, (2, 1, 8)), rand(rng, (1, 1, 7)), rand(rng, (1, 1, 8))),
     ValueError, "k_new must have shape"),
    (lambda c, rng: c.step(0, rand(rng, (3, 1, 7)), rand(rng, (1, 1, 8)), rand(rng, (1, 1, 8))),
     ValueError, "share the head dim"),
    (lambda c, rng: c.step([0, 1], rand(rng, (1, 2, 1, 8)), rand(rng, (2, 1, 1, 8)),
                           rand(rng, (2, 1, 1, 8))), ValueError, "one row per sequence"),
    (lambda c, rng: c.step(0, rand(rng, (2, 1, 8)), rand(rng, (1, 1, 8), F16), rand(rng, (1, 1, 8), F16)),
     TypeError, "k_new must have the cache's dtype"),
    (lambda c, rng: c.step(0, rand(rng, (2, 1, 8)), None, rand(rng, (1, 1, 8))), ValueError, "k_new is None"),
    (lambda c, rng: c.free(7), ValueError, "no sequence 7"),
    (lambda c, rng: c.fork(7), ValueError, "no sequence 7"),
])
def test_bad_paged_cache_calls_change_nothing(rng, call, error, match):
    cache = af.PagedKVCache(8, 4, kv_heads=1, head_dim=8)
    for _ in range(2):
        s = cache.add_sequence()
        cache.append(s, rand(rng, (1, 5, 8)), rand(rng, (1, 5, 8)))
    snap = snapshot(cache)
    with pytest.raises(error, match=match):
        call(cache, rng)
    assert_unchanged(cache, snap)


@pytest.mark.parametrize("kwargs,error", [
    (dict(num_blocks=0), ValueError), (dict(block_size=0), ValueError),
    (dict(kv_heads=1.5), TypeError), (dict(dtype=np.int32), TypeError),
    (dict(v_head_dim=0), ValueError),
])
def test_bad_paged_cache_constructor(kwargs, error):
    args = dict(num_blocks=4, block_size=4, kv_heads=1, head_dim=8)
    args.update(kwargs)
    with pytest.raises(error):
        af.PagedKVCache(**args)


@pytest.mark.parametrize("dtype", [BF16, "int8"], ids=str)
def test_paged_cache_low_precision(rng, dtype):
    cache = af.PagedKVCache(16, 16, kv_heads=2, head_dim=32, v_head_dim=16, dtype=dtype)
    flat = af.KVCache(1, 2, 32, 64, dtype=dtype, v_head_dim=16)
    s = cache.add_sequence()
    k, v = rand(rng, (1, 2, 40, 32)), rand(rng, (1, 2, 40, 16))
    q = rand(rng, (1, 4, 40, 32))
    out = cache.step(s, q, k, v)
    assert same_bits(out, flat.step(q, k, v))  # same rounding / quantisation, same bits
    q1, k1, v1 = rand(rng, (1, 4, 1, 32)), rand(rng, (1, 2, 1, 32)), rand(rng, (1, 2, 1, 16))
    assert same_bits(cache.step([s], q1, k1, v1), flat.step(q1, k1, v1))
    if dtype == "int8":
        assert cache.k_scale.shape == (16, 2, 16) and cache.k_scale[cache.blocks(s)[0]].any()
    ref, _, _ = reference_attention(q[0], k[0], v[0], causal=True)
    assert np.abs(out[0] - ref).max() < 0.03


def test_paged_cache_repr_and_members():
    cache = af.PagedKVCache(4, 2, 1, 8)
    assert "num_blocks=4" in repr(cache) and "4 free block(s)" in repr(cache)
    assert (cache.num_blocks, cache.block_size, cache.kv_heads, cache.head_dim, cache.v_head_dim) == (4, 2, 1, 8, 8)
    assert cache.k.shape == (4, 1, 2, 8) and cache.k_scale is None


def test_truncate_returns_unshared_blocks_and_keeps_a_forks_tokens(rng):
    cache = af.PagedKVCache(8, 4, 1, 8)
    a = cache.add_sequence()
    k, v = rand(rng, (1, 10, 8)), rand(rng, (1, 10, 8))
    cache.append(a, k, v)                       # blocks: 4 + 4 + 2 tokens
    b = cache.fork(a)
    cache.truncate(a, 5)                        # a keeps 2 blocks, both shared with b
    assert cache.length(a) == 5 and len(cache.blocks(a)) == 2
    assert cache.num_free_blocks == 5           # b still holds the third block
    k2, v2 = rand(rng, (1, 3, 8)), rand(rng, (1, 3, 8))
    cache.append(a, k2, v2)                     # copy-on-write of the shared second block
    q = rand(rng, (1, 1, 8))
    for sid, (ks, vs) in ((a, (np.concatenate([k[:, :5], k2], 1), np.concatenate([v[:, :5], v2], 1))),
                          (b, (k, v))):
        ref = reference_attention(q, ks, vs)[0]
        np.testing.assert_allclose(cache.attend(sid, q), ref, **TOLERANCE[np.dtype(np.float32)])
    cache.free(b)
    cache.truncate(a, 0)
    assert cache.blocks(a) == () and cache.num_free_blocks == 8
    with pytest.raises(ValueError, match=r"cannot truncate sequence 0 to 1: it holds only 0"):
        cache.truncate(a, 1)


@pytest.mark.parametrize("dtype", [F32, F16, BF16, "int8", np.dtype(ml_dtypes.float8_e4m3fn), "int4"],
                         ids=str)
@pytest.mark.parametrize("heads", [(2, 2), (8, 2)], ids=["1-row", "4-rows"])
def test_window_start_at_every_block_offset(tier, rng, dtype, heads):
    """Issue 45.1: a sliding window whose first visible key falls on any row of a block (odd
    rows included) gives the contiguous cache's bits, for every pool format; the bfloat16
    vdpbf16ps kernel once paired a run's last key with a stale weight (NaN rows) and paired
    keys differently across block ends (last-bit differences)."""
    H, Hkv = heads
    bs, D, L = 16, 64, 16 * 4 + 5
    q_dtype = F32 if isinstance(dtype, str) or dtype.itemsize == 1 else dtype
    contiguous = af.KVCache(1, Hkv, D, L + 1, dtype=dtype)
    paged = af.PagedKVCache(2 * (L // bs + 2), bs, Hkv, D, dtype=dtype)
    seq = paged.add_sequence()
    k = rand(rng, (1, Hkv, L, D), q_dtype)
    v = rand(rng, (1, Hkv, L, D), q_dtype)
    contiguous.append(k, v)
    paged.append(seq, k, v)
    q = rand(rng, (1, H, 1, D), q_dtype)
    for left in range(bs + 2):  # first visible key L - 1 - left: every offset in a block
        want, want_lse = contiguous.attend(q, window=(left, 0), return_lse=True)
        got, got_lse = paged.attend([seq], q, window=(left, 0), return_lse=True)
        assert np.isfinite(np.asarray(got, np.float32)).all(), left
        assert same_bits(want, got) and same_bits(want_lse, got_lse), left
        if dtype in (F32, F16, BF16):  # stored as given: the float64 reference of the window
            ref, ref_lse, _ = reference_attention(q[0], k[0], v[0], causal=True, window=(left, 0))
            tol = 2e-5 if dtype == F32 else 2 * float(ml_dtypes.finfo(dtype).eps)
            np.testing.assert_allclose(np.asarray(got[0], np.float64), ref, rtol=tol, atol=tol)
            np.testing.assert_allclose(got_lse[0], ref_lse, rtol=1e-5, atol=1e-5)
