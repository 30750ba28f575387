"""key_index=: attention over selected keys (sparse attention), against a float64 reference
that attends over exactly the listed keys a row may see."""
import ml_dtypes
import numpy as np
import pytest

import attnfast
from attnfast import attention, attention_with_kvcache

BF16 = np.dtype(ml_dtypes.bfloat16)


def reference(q, k, v, index, *, scale=None, causal=False, window=None, softcap=None,
              sinks=None, seqlens=None):
    """float64 out, lse of q (B, H, Tq, D) over k, v (B, Hkv, Tk, D|Dv), query i of sequence
    b seeing only the positions index[b, g or 0, i] lists (-1: none) that causal / window
    (aligned bottom-right to seqlens[b]) leave visible."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    lengths = np.full(B, Tk) if seqlens is None else np.asarray(seqlens)
    out = np.zeros((B, H, Tq, v.shape[3]))
    lse = np.full((B, H, Tq), -np.inf)
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)
            for i in range(Tq):
                pos = lengths[b] - Tq + i
                listed = index[b, g if index.shape[1] > 1 else 0, i]
                keys = [int(j) for j in listed if j >= 0 and (not causal or j <= pos)
                        and (window is None or (window[0] < 0 or j >= pos - window[0]))
                        and (window is None or (window[1] < 0 or j <= pos + window[1]))]
                s = np.array([q[b, h, i] @ k[b, g, j] * scale for j in keys])
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                logits = np.concatenate([s, [float(sinks[h])]]) if sinks is not None else s
                if logits.size == 0:
                    continue
                top = logits.max()
                w = np.exp(s - top)
                total = np.exp(logits - top).sum()
                if keys:
                    out[b, h, i] = w @ v[b, g, keys] / total
                lse[b, h, i] = top + np.log(total)
    return out, lse


def random_index(rng, B, groups, Tq, k, Tk, none=0.2):
    """Distinct positions < Tk per row, about `none` of the entries -1."""
    index = np.empty((B, groups, Tq, k), np.int32)
    for b in range(B):
        for g in range(groups):
            for i in range(Tq):
                index[b, g, i] = rng.choice(Tk, size=k, replace=False)
    index[rng.random(index.shape) < none] = -1
    return index


def _close(got, want, tol):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,tol", [(np.float32, 2e-5), (np.float64, 1e-12), (BF16, 2e-2)])
def test_attention_over_listed_keys(dtype, tol, causal, per_head):
    rng = np.random.default_rng(1)
    B, H, Hkv, Tq, Tk, D, k = 2, 4, 2, 5, 300, 64, 40
    q = rng.standard_normal((B, H, Tq, D)).astype(dtype)
    kk = rng.standard_normal((B, Hkv, Tk, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Tk, D)).astype(dtype)
    index = random_index(rng, B, Hkv if per_head else 1, Tq, k, Tk)
    given = index if per_head else index[:, 0]
    out, lse = attention(q, kk, v, causal=causal, key_index=given, return_lse=True)
    ref_out, ref_lse = reference(q, kk, v, index, causal=causal)
    _close(out, ref_out, tol)
    _close(lse, ref_lse, tol)


def test_rows_that_see_nothing_and_options():
    """softcap and sinks; a row whose every entry is -1 (or hidden) gets zeros and -inf (the
    sink's logit with sinks)."""
    rng = np.random.default_rng(2)
    B, H, Hkv, Tq, Tk, D = 1, 4, 1, 3, 64, 32
    q, kk, v = (rng.standard_normal(s).astype(np.float32)
                for s in ((B, H, Tq, D), (B, Hkv, Tk, D), (B, Hkv, Tk, D)))
    index = random_index(rng, B, 1, Tq, 10, Tk, none=0.0)
    index[0, 0, 1] = -1
    sinks = rng.standard_normal(H).astype(np.float32)
    for options in ({}, {"softcap": 2.0}, {"sinks": sinks}, {"softcap": 1.5, "sinks": sinks}):
        out, lse = attention(q, kk, v, key_index=index[:, 0], return_lse=True, **options)
        ref_out, ref_lse = reference(q, kk, v, index, **options)
        _close(out, ref_out, 2e-5)
        _close(lse, ref_lse, 2e-5)
        assert np.all(out[0, :, 1] == 0)


def test_reads_only_listed_keys_and_same_bits_for_any_thread_count():
    """Unlisted K/V rows hold NaN: nothing of them reaches out. A list longer than a decode
    chunk (split and merged) gives the same bits on one thread and on two."""
    rng = np.random.default_rng(3)
    B, H, Hkv, Tk, D, k = 1, 8, 2, 20000, 64, 6000
    q = rng.standard_normal((B, H, 1, D)).astype(np.float32)
    kk = np.full((B, Hkv, Tk, D), np.nan, np.float32)
    v = np.full((B, Hkv, Tk, D), np.nan, np.float32)
    index = random_index(rng, B, 1, 1, k, Tk, none=0.1)
    listed = np.unique(index[index >= 0])
    kk[:, :, listed] = rng.standard_normal((B, Hkv, listed.size, D))
    v[:, :, listed] = rng.standard_normal((B, Hkv, listed.size, D))
    one = attention(q, kk, v, key_index=index[:, 0], num_threads=1)
    two = attention(q, kk, v, key_index=index[:, 0], num_threads=2)
    assert np.array_equal(one, two)
    ref_out, _ = reference(q, np.nan_to_num(kk), np.nan_to_num(v), index)
    _close(one, ref_out, 2e-5)


@pytest.mark.parametrize("cache_dtype,tol", [(np.float32, 2e-5), (BF16, 2e-2), (np.float16, 5e-3)])
def test_kvcache_decode_and_new_tokens(cache_dtype, tol):
    """attention_with_kvcache: a decode step and a 3-token chunk written first (causal), GQA;
    the listed positions may include the new tokens."""
    rng = np.random.default_rng(4)
    B, H, Hkv, C, D, k = 2, 8, 2, 512, 64, 50
    kc = rng.standard_normal((B, Hkv, C, D)).astype(cache_dtype)
    vc = rng.standard_normal((B, Hkv, C, D)).astype(cache_dtype)
    lengths = np.array([300, 450])
    for t in (0, 3):
        Tq = max(t, 1)
        q = rng.standard_normal((B, H, Tq, D)).astype(np.float32)
        k_new = rng.standard_normal((B, Hkv, t, D)).astype(np.float32) if t else None
        v_new = rng.standard_normal((B, Hkv, t, D)).astype(np.float32) if t else None
        index = np.stack([random_index(rng, 1, 1, Tq, k, int(n) + t)[0] for n in lengths])
        out, lse = attention_with_kvcache(q, kc, vc, lengths, k_new, v_new, key_index=index[:, 0],
                                          return_lse=True)
        ref_out, ref_lse = reference(q, kc.astype(np.float64), vc.astype(np.float64), index,
                                     causal=True, seqlens=lengths + t)
        _close(out, ref_out, tol)
        _close(lse, ref_lse, tol)


def test_paged_equals_contiguous():
    """A paged pool gives the bits of a contiguous cache holding the same tokens."""
    rng = np.random.default_rng(5)
    B, H, Hkv, C, D, bs, k = 2, 4, 2, 256, 32, 16, 30
    kc = rng.standard_normal((B, Hkv, C, D)).astype(np.float32)
    vc = rng.standard_normal((B, Hkv, C, D)).astype(np.float32)
    blocks = C // bs
    perm = rng.permutation(B * blocks)
    table = perm.reshape(B, blocks).astype(np.int32)
    k_pool = np.empty((B * blocks, Hkv, bs, D), np.float32)
    v_pool = np.empty_like(k_pool)
    for b in range(B):
        for x in range(blocks):
            k_pool[table[b, x]] = kc[b, :, x * bs:(x + 1) * bs]
            v_pool[table[b, x]] = vc[b, :, x * bs:(x + 1) * bs]
    lengths = np.array([200, 131])
    q = rng.standard_normal((B, H, 1, D)).astype(np.float32)
    index = np.stack([random_index(rng, 1, Hkv, 1, k, int(n))[0] for n in lengths])
    contiguous = attention_with_kvcache(q, kc, vc, lengths, key_index=index)
    paged = attention_with_kvcache(q, k_pool, v_pool, lengths, block_table=table, key_index=index)
    assert np.array_equal(contiguous, paged)
    _close(paged, reference(q, kc, vc, index, causal=True, seqlens=lengths)[0], 2e-5)


@pytest.mark.parametrize("Tq", [1, 4])
@pytest.mark.parametrize("cache_dtype,tol", [(np.float32, 2e-5), (np.float16, 5e-3), (BF16, 2e-2)])
def test_listed_rows_read_in_place(tier, cache_dtype, tol, Tq):
    """A contiguous cache's listed rows are read where they lie (the widening decode, q of the
    cache's dtype; a paged pool's rows are gathered first): the same bits, on every tier, for
    a list longer than a decode chunk (split and merged) with -1 entries and unlisted rows
    NaN, for one query row and a prompt of four (each row its own list), on one thread and
    two."""
    rng = np.random.default_rng(11)
    B, H, Hkv, C, D, k, bs = 1, 4, 2, 2600, 128, 2200, 64
    lengths = np.array([2500])
    index = random_index(rng, B, Hkv, Tq, k, int(lengths[0]), none=0.05)
    kc = np.full((B, Hkv, C, D), np.nan, np.float32)
    vc = np.full((B, Hkv, C, D), np.nan, np.float32)
    for g in range(Hkv):
        listed = np.unique(index[0, g][index[0, g] >= 0])
        kc[0, g, listed] = rng.standard_normal((listed.size, D))
        vc[0, g, listed] = rng.standard_normal((listed.size, D))
    kc, vc = kc.astype(cache_dtype), vc.astype(cache_dtype)
    table = rng.permutation(C // bs).astype(np.int32)[None]
    k_pool = np.empty((C // bs, Hkv, bs, D), cache_dtype)
    v_pool = np.empty_like(k_pool)
    for x in range(C // bs):
        k_pool[table[0, x]] = kc[0, :, x * bs:(x + 1) * bs]
        v_pool[table[0, x]] = vc[0, :, x * bs:(x + 1) * bs]
    q = rng.standard_normal((B, H, Tq, D)).astype(cache_dtype)  # (in place: q's dtype the cache's)
    contiguous = attention_with_kvcache(q, kc, vc, lengths, key_index=index)
    paged = attention_with_kvcache(q, k_pool, v_pool, lengths, block_table=table, key_index=index)
    assert np.array_equal(contiguous, paged)
    two = attention_with_kvcache(q, kc, vc, lengths, key_index=index, num_threads=2)
    assert np.array_equal(contiguous, two)  # (a prompt's rows run chunk-major on any thread count)
    finite = (np.nan_to_num(kc.astype(np.float64)), np.nan_to_num(vc.astype(np.float64)))
    _close(contiguous, reference(q, *finite, index, causal=True, seqlens=lengths)[0], tol)


def test_latent_cache_many_heads():
    """An MLA latent cache (v a prefix view of k) with 32 query heads on one latent row."""
    rng = np.random.default_rng(6)
    B, H, C, D, Dv, k = 1, 32, 1024, 96, 64, 200
    latent = rng.standard_normal((B, 1, C, D)).astype(np.float32)
    q = rng.standard_normal((B, H, 1, D)).astype(np.float32)
    index = random_index(rng, B, 1, 1, k, 900)
    out = attention_with_kvcache(q, latent, latent[..., :Dv], 900, key_index=index[:, 0])
    assert attnfast.explain(q, latent, latent[..., :Dv])["latent_kv"]
    _close(out, reference(q, latent, latent[..., :Dv], index, causal=True,
                          seqlens=np.array([900]))[0], 2e-5)


@pytest.mark.parametrize("dtype,tol", [(np.float32, 2e-5), (BF16, 2e-2)])
def test_latent_rows_read_where_they_lie(dtype, tol):
    """The GEMM-shaped kernel reads an indexed source's rows in place (contiguous and paged):
    unlisted rows hold NaN, a list longer than a chunk (2,048 keys) with -1 entries is split
    and merged, the same bits on one thread and two and paged as contiguous."""
    rng = np.random.default_rng(16)
    B, H, C, D, Dv, k, bs = 1, 32, 6144, 64, 32, 4500, 64
    index = random_index(rng, B, 1, 1, k, C, none=0.1)
    listed = np.unique(index[index >= 0])
    latent = np.full((B, 1, C, D), np.nan, np.float32)
    latent[:, :, listed] = rng.standard_normal((B, 1, listed.size, D))
    latent = latent.astype(dtype)
    q = rng.standard_normal((B, H, 1, D)).astype(dtype)
    table = rng.permutation(C // bs).astype(np.int32)[None]
    pool = np.empty((C // bs, 1, bs, D), dtype)
    for x in range(C // bs):
        pool[table[0, x]] = latent[0, :, x * bs:(x + 1) * bs]
    plan = attnfast.explain(q, latent, latent[..., :Dv], cache_seqlens=C, key_index=index[:, 0])
    assert plan["kernel"] == "latent_decode" and "indexed" in plan["kv_source"]
    one = attention_with_kvcache(q, latent, latent[..., :Dv], C, key_index=index[:, 0], num_threads=1)
    two = attention_with_kvcache(q, latent, latent[..., :Dv], C, key_index=index[:, 0], num_threads=2)
    paged = attention_with_kvcache(q, pool, pool[..., :Dv], C, block_table=table, key_index=index[:, 0])
    assert np.array_equal(one.view(np.uint8), two.view(np.uint8))
    assert np.array_equal(one.view(np.uint8), paged.view(np.uint8))
    clean = np.nan_to_num(latent.astype(np.float64))
    _close(one, reference(q, clean, clean[..., :Dv], index, causal=True)[0], tol)


def test_rejected_calls_name_key_index_and_write_nothing():
    rng = np.random.default_rng(7)
    B, H, Hkv, C, D = 1, 2, 1, 64, 16
    kc = rng.standard_normal((B, Hkv, C, D)).astype(np.float32)
    vc = rng.standard_normal((B, Hkv, C, D)).astype(np.float32)
    q = rng.standard_normal((B, H, 1, D)).astype(np.float32)
    k_new = rng.standard_normal((B, Hkv, 1, D)).astype(np.float32)
    before = kc.copy(), vc.copy()
    bad = [
        (np.array([[[3, 3, 5]]]), ValueError, "twice"),
        (np.array([[[3, 11]]]), ValueError, "past sequence 0's length 11"),
        (np.array([[[-2, 1]]]), ValueError, ">= 0 or -1"),
        (np.array([[3, 4]]), ValueError, "shape"),
        (np.array([[[1.0, 2.0]]]), TypeError, "integer"),
    ]
    for index, error, words in bad:
        with pytest.raises(error, match=words):
            attention_with_kvcache(q, kc, vc, 10, k_new, k_new, key_index=index)
        assert np.array_equal(kc, before[0]) and np.array_equal(vc, before[1])
    with pytest.raises(NotImplementedError, match="key_index"):
        attention_with_kvcache(q, kc, vc, 10, key_index=np.array([[[1]]]),
                               alibi_slopes=np.ones(H, np.float32))
    with pytest.raises(NotImplementedError, match="key_index"):
        attention_with_kvcache(q, kc, vc, 10, key_index=np.array([[[1]]]),
                               tree_mask=np.ones((1, 1), bool))
    # -1 may repeat; a duplicate of a real position may not
    out = attention_with_kvcache(q, kc, vc, 10, key_index=np.array([[[-1, 4, -1]]]))
    _close(out, reference(q, kc, vc, np.array([[[[-1, 4, -1]]]]), causal=True,
                          seqlens=np.array([10]))[0], 2e-5)


@pytest.mark.parametrize("fmt,tol", [("int8", 0.05), (ml_dtypes.float8_e4m3fn, 0.15),
                                     (ml_dtypes.float8_e5m2, 0.3), ("int4", 0.3)])
def test_kvcache_formats(fmt, tol):
    """KVCache.step / attend over quantised caches: the listed keys only. Against the cache's
    own dense attention with a bool mask keeping the same keys (the same stored values: float32
    rounding apart), and against the float64 reference over the unquantised tokens (the
    format's error)."""
    rng = np.random.default_rng(8)
    B, H, Hkv, D, T, k = 2, 8, 2, 64, 200, 32
    cache = attnfast.KVCache(B, Hkv, D, 256, dtype=fmt)
    kk = rng.standard_normal((B, Hkv, T, D)).astype(np.float32)
    vv = rng.standard_normal((B, Hkv, T, D)).astype(np.float32)
    cache.append(kk[:, :, :T - 1], vv[:, :, :T - 1])
    q = rng.standard_normal((B, H, 1, D)).astype(np.float32)
    index = random_index(rng, B, 1, 1, k, T)
    sparse = cache.step(q, kk[:, :, T - 1:], vv[:, :, T - 1:], key_index=index[:, 0])
    keep = np.zeros((B, 1, 1, 256), bool)
    for b in range(B):
        keep[b, 0, 0, index[b, 0, 0][index[b, 0, 0] >= 0]] = True
    dense = cache.attend(q, mask=keep)
    _close(sparse, dense.astype(np.float64), 1e-5)
    _close(sparse, reference(q, kk, vv, index, causal=True)[0], tol)
    # attend reads the same keys as the step did
    assert np.array_equal(cache.attend(q, key_index=index[:, 0]), sparse)


def test_paged_cache_class_step_and_attend():
    """PagedKVCache.step / attend with key_index: the bits of KVCache holding the same tokens
    (one bare id as well: its 3-D q takes a (Tq, k) list)."""
    rng = np.random.default_rng(9)
    H, Hkv, D, T, k = 4, 2, 32, 100, 20
    paged = attnfast.PagedKVCache(num_blocks=32, block_size=16, kv_heads=Hkv, head_dim=D)
    plain = attnfast.KVCache(2, Hkv, D, 128)
    seqs = [paged.add_sequence(), paged.add_sequence()]
    kk = rng.standard_normal((2, Hkv, T, D)).astype(np.float32)
    vv = rng.standard_normal((2, Hkv, T, D)).astype(np.float32)
    q0 = rng.standard_normal((2, H, T - 1, D)).astype(np.float32)
    paged.step(seqs, q0, kk[:, :, :T - 1], vv[:, :, :T - 1])
    plain.step(q0, kk[:, :, :T - 1], vv[:, :, :T - 1])
    q = rng.standard_normal((2, H, 1, D)).astype(np.float32)
    index = random_index(rng, 2, 1, 1, k, T)[:, 0]
    a = paged.step(seqs, q, kk[:, :, T - 1:], vv[:, :, T - 1:], key_index=index)
    b = plain.step(q, kk[:, :, T - 1:], vv[:, :, T - 1:], key_index=index)
    assert np.array_equal(a, b)
    _close(a, reference(q, kk, vv, index[:, None], causal=True)[0], 2e-5)
    one = paged.attend(seqs[1], q[1], key_index=index[1])
    assert np.array_equal(one, plain.attend(q, key_index=index)[1])


@pytest.mark.parametrize("D", [37, 64])
def test_int8_caller_arrays_any_head_dim(int8_widen, D):
    """A caller's int8 cache with its row scales (odd D too: the staged rows' scales stay
    aligned), over the dequantised values."""
    from attnfast._formats import quantize_int8
    rng = np.random.default_rng(10)
    B, H, C, n = 2, 4, 96, 80
    k = rng.standard_normal((B, 1, C, D)).astype(np.float32)
    v = rng.standard_normal((B, 1, C, D)).astype(np.float32)
    (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
    q = rng.standard_normal((B, H, 1, D)).astype(np.float32)
    index = random_index(rng, B, 1, 1, 25, n)
    out = attention_with_kvcache(q, kq, vq, n, k_scale=ks, v_scale=vs, key_index=index[:, 0])
    kd = kq.astype(np.float64) * ks[..., None]
    vd = vq.astype(np.float64) * vs[..., None]
    _close(out, reference(q, kd, vd, index, causal=True, seqlens=np.array([n, n]))[0], 2e-5)
