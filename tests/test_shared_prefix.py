"""Shared-prefix decoding (issue 22, item 1): sequences of one paged call that share leading
full blocks read them once, merged by log-sum-exp. Checked against the float64 reference
over the tokens the pool holds, and against the unshared path."""
import ml_dtypes
import numpy as np
import pytest

import attnfast as af
from attnfast import _shared_prefix
from reference import TOLERANCE, reference_attention

F32 = np.dtype(np.float32)
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
BS = 16


@pytest.fixture
def small_prefix(monkeypatch):
    """Share prefixes from one block on, so small caches exercise the shared path."""
    monkeypatch.setattr(_shared_prefix, "MIN_PREFIX_KEYS", BS)


def rand(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def stored_kv(cache, seq):
    """float64 (Hkv, length, D) keys and values of one sequence as the pool holds them."""
    n = cache.length(seq)
    blocks = list(cache.blocks(seq))
    def gather(pool, scale):
        rows = np.concatenate([pool[b] for b in blocks], axis=1)[:, :n].astype(np.float64)
        if scale is not None:
            rows *= np.concatenate([scale[b] for b in blocks], axis=1)[:, :n, None]
        return rows
    return gather(cache.k, cache.k_scale), gather(cache.v, cache.v_scale)


def forked(rng, *, prompt, own, n=4, Hkv=2, D=16, dtype=np.float32, num_blocks=400):
    """A prompt of `prompt` tokens, n - 1 forks of it, then `own[i]` tokens of each."""
    cache = af.PagedKVCache(num_blocks, BS, Hkv, D, dtype=dtype, key_rotation=None)  # stored as given
    a = cache.add_sequence()
    quantised = isinstance(dtype, str) or np.dtype(dtype) in (np.dtype(np.int8),
                                                              np.dtype(ml_dtypes.float8_e4m3fn))
    new_dtype = np.float32 if quantised else dtype  # quantised caches take float32 tokens
    cache.append(a, rand(rng, (Hkv, prompt, D), new_dtype), rand(rng, (Hkv, prompt, D), new_dtype))
    ids = [a] + [cache.fork(a) for _ in range(n - 1)]
    for s, t in zip(ids, own):
        if t:
            cache.append(s, rand(rng, (Hkv, t, D), new_dtype), rand(rng, (Hkv, t, D), new_dtype))
    return cache, ids


def check_against_reference(cache, ids, q, out, lse=None, tol=TOLERANCE[F32], **options):
    for i, s in enumerate(ids):
        k, v = stored_kv(cache, s)
        ref, ref_lse, _ = reference_attention(q[i].astype(np.float64), k, v, causal=True, **options)
        np.testing.assert_allclose(out[i].astype(np.float64), ref, **tol)
        if lse is not None:
            np.testing.assert_allclose(lse[i], ref_lse, **tol)


def shared_calls():
    return _shared_prefix.stats["shared_calls"]


@pytest.mark.parametrize("prompt, own, shares", [
    (64, [0, 0, 0, 0], True),       # every block shared, no own keys
    (64, [3, 17, 1, 40], True),     # some shared, own blocks after
    (70, [0, 0, 0, 0], True),       # a shared partly filled last block: not part of the prefix
    (10, [0, 0, 0, 0], False),      # only a partly filled block shared: nothing to share
])
def test_forks_match_reference(rng, small_prefix, prompt, own, shares):
    cache, ids = forked(rng, prompt=prompt, own=own)
    q = rand(rng, (4, 4, 1, 16))
    before = shared_calls()
    out, lse = cache.attend(ids, q, return_lse=True)
    assert shared_calls() - before == int(shares)
    check_against_reference(cache, ids, q, out, lse)


def test_plan_stops_at_the_first_differing_block_and_partial_blocks(rng, small_prefix):
    cache, ids = forked(rng, prompt=70, own=[0, 5, 30, 0])  # 4 full blocks + 6 tokens shared
    table = cache.block_table(ids).astype(np.int64)
    lengths = np.array([cache.length(s) for s in ids])
    opts = af._descriptors.NO_OPTIONS
    groups = _shared_prefix.plan_shared_prefix(table, lengths, BS, 1, causal=True,
                                               window=(-1, -1), query_offset=None, options=opts)
    assert groups == [_shared_prefix.SharedGroup((0, 1, 2, 3), 4)]
    independent = np.arange(8, dtype=np.int64).reshape(4, 2)
    assert _shared_prefix.plan_shared_prefix(independent, np.full(4, 32), BS, 1, causal=True,
                                             window=(-1, -1), query_offset=None,
                                             options=opts) == []


def test_unshared_sequences_in_the_call_keep_their_bits(rng, small_prefix):
    cache, ids = forked(rng, prompt=48, own=[2, 3, 4], n=3)
    other = cache.add_sequence()
    cache.append(other, rand(rng, (2, 40, 16)), rand(rng, (2, 40, 16)))
    q = rand(rng, (4, 4, 1, 16))
    before = shared_calls()
    out = cache.attend(ids + [other], q)
    assert shared_calls() == before + 1
    alone = cache.attend([other], q[3:])
    np.testing.assert_array_equal(out[3], alone[0])
    check_against_reference(cache, ids + [other], q, out)


@pytest.mark.parametrize("dtype, q_dtype", [(F32, F32), (BF16, BF16), (F16, F16),
                                            (BF16, F32), (np.int8, F32), (np.int8, BF16)])
def test_dtypes_and_gqa(rng, small_prefix, dtype, q_dtype):
    cache, ids = forked(rng, prompt=80, own=[1, 20, 7, 33], Hkv=2, dtype=dtype)
    q = rand(rng, (4, 8, 1, 16), q_dtype)  # GQA 8/2
    before = shared_calls()
    out, lse = cache.attend(ids, q, return_lse=True)
    assert shared_calls() == before + 1 and out.dtype == q_dtype
    tol = TOLERANCE[F32] if np.dtype(q_dtype) == F32 else dict(
        rtol=2 * float(ml_dtypes.finfo(q_dtype).eps), atol=2 * float(ml_dtypes.finfo(q_dtype).eps))
    check_against_reference(cache, ids, q.astype(np.float32), out, tol=tol)
    np.testing.assert_allclose(lse, [reference_attention(
        q[i].astype(np.float64), *stored_kv(cache, s), causal=True)[1]
        for i, s in enumerate(ids)], rtol=1e-4, atol=1e-4)


def test_float64(rng, small_prefix):
    cache, ids = forked(rng, prompt=48, own=[1, 2, 3, 4], dtype=np.float64)
    q = rng.standard_normal((4, 4, 1, 16))
    before = shared_calls()
    out, lse = cache.attend(ids, q, return_lse=True)
    assert shared_calls() == before + 1
    check_against_reference(cache, ids, q, out, lse, tol=TOLERANCE[np.dtype(np.float64)])


@pytest.mark.parametrize("name, options, shares", [
    ("softcap", dict(softcap=5.0), True),
    ("sinks", dict(sinks=np.array([0.5, -1.0, 2.0, 0.0], np.float32)), True),
    ("window inside", dict(window=(200, 0)), True),
    ("window cutting the prefix", dict(window=(30, 0)), False),
    ("alibi", dict(alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4], np.float32)), False),
])
def test_options(rng, small_prefix, name, options, shares):
    cache, ids = forked(rng, prompt=64, own=[5, 9, 20, 2])
    q = rand(rng, (4, 4, 1, 16))
    before = shared_calls()
    out, lse = cache.attend(ids, q, return_lse=True, **options)
    assert shared_calls() - before == int(shares), name
    for i, s in enumerate(ids):
        k, v = stored_kv(cache, s)
        window = options.get("window")
        ref, ref_lse, _ = reference_attention(
            q[i].astype(np.float64), k, v, causal=True, window=window,
            softcap=options.get("softcap"), sinks=options.get("sinks"),
            alibi_slopes=options.get("alibi_slopes"))
        np.testing.assert_allclose(out[i], ref, **TOLERANCE[F32])
        np.testing.assert_allclose(lse[i], ref_lse, **TOLERANCE[F32])


@pytest.mark.parametrize("keeps_prefix", [True, False])
def test_mask(rng, small_prefix, keeps_prefix):
    cache, ids = forked(rng, prompt=64, own=[5, 9, 20, 2])
    width = cache.block_table(ids).shape[1] * BS
    mask = rng.random((4, 1, 1, width)) < 0.7
    mask[..., :64] = True
    if not keeps_prefix:
        mask[2, ..., 3] = False
    q = rand(rng, (4, 4, 1, 16))
    before = shared_calls()
    out = cache.attend(ids, q, mask=mask)
    # sequence 2 masks a prefix key: its group shrinks to the other three, still shared
    assert shared_calls() - before == 1
    for i, s in enumerate(ids):
        k, v = stored_kv(cache, s)
        ref, _, _ = reference_attention(q[i].astype(np.float64), k, v, causal=True,
                                        mask=mask[i][..., :k.shape[1]])
        np.testing.assert_allclose(out[i], ref, **TOLERANCE[F32])


def test_mask_on_every_sequence_falls_back(rng, small_prefix):
    cache, ids = forked(rng, prompt=64, own=[5, 9])
    ids = ids[:2]
    width = cache.block_table(ids).shape[1] * BS
    mask = np.ones((1, 1, 1, width), bool)
    mask[..., 0] = False
    before = shared_calls()
    cache.attend(ids, rand(rng, (2, 4, 1, 16)), mask=mask)
    assert shared_calls() == before


@pytest.mark.parametrize("tq, query_offset", [(3, None), (4, 70), (16, None)])
def test_several_queries_and_query_offset(rng, small_prefix, tq, query_offset):
    cache, ids = forked(rng, prompt=64, own=[20, 30, 16, 25])
    q = rand(rng, (4, 4, tq, 16))
    before = shared_calls()
    out = cache.attend(ids, q, query_offset=query_offset)
    assert shared_calls() == before + 1
    for i, s in enumerate(ids):
        k, v = stored_kv(cache, s)
        L = k.shape[1]
        rows = np.arange(tq)[:, None] + (L - tq if query_offset is None else query_offset)
        keep = np.arange(L)[None, :] <= rows
        ref, _, _ = reference_attention(q[i].astype(np.float64), k, v, mask=keep)
        np.testing.assert_allclose(out[i], ref, **TOLERANCE[F32])


def test_step_after_fork_copy_on_write_and_threads(rng, small_prefix):
    cache, ids = forked(rng, prompt=70, own=[0, 0, 0, 0])  # the partial block 4 is shared
    q = rand(rng, (4, 4, 1, 16))
    k_tok, v_tok = rand(rng, (4, 2, 1, 16)), rand(rng, (4, 2, 1, 16))
    before = shared_calls()
    out1 = cache.step(ids, q, k_tok, v_tok, num_threads=1)
    assert shared_calls() == before + 1
    assert len({cache.blocks(s)[4] for s in ids}) == 4  # copied on write, one each
    check_against_reference(cache, ids, q, out1)
    out2 = cache.attend(ids, q, num_threads=2)
    np.testing.assert_array_equal(out1, out2)


def test_functional_block_table(rng, small_prefix):
    Hkv, D, nb = 2, 16, 12
    kp, vp = rand(rng, (nb, Hkv, BS, D)), rand(rng, (nb, Hkv, BS, D))
    table = np.array([[0, 1, 2, 5], [0, 1, 2, 6], [0, 1, 3, 7]], np.int32)
    seqlens = np.array([60, 55, 63])
    k_new, v_new = rand(rng, (3, Hkv, 1, D)), rand(rng, (3, Hkv, 1, D))
    q = rand(rng, (3, 4, 1, D))
    before = shared_calls()
    out = af.attention_with_kvcache(q, kp, vp, seqlens, k_new, v_new, block_table=table)
    assert shared_calls() == before + 1
    for b in range(3):
        n = seqlens[b] + 1
        k = np.concatenate([kp[i] for i in table[b]], axis=1)[:, :n]
        v = np.concatenate([vp[i] for i in table[b]], axis=1)[:, :n]
        ref, _, _ = reference_attention(q[b], k, v, causal=True)
        np.testing.assert_allclose(out[b], ref, **TOLERANCE[F32])


def test_default_threshold_and_many_forks(rng):
    """At the shipped threshold a 1024-key prompt is shared; 20 forks take two stacked calls."""
    cache, ids = forked(rng, prompt=1024, own=[i % 5 for i in range(20)], n=20, Hkv=1, D=8,
                        num_blocks=200)
    q = rand(rng, (20, 2, 1, 8))
    before = shared_calls()
    out = cache.attend(ids, q)
    assert shared_calls() == before + 1
    check_against_reference(cache, ids, q, out)
    short, short_ids = forked(rng, prompt=512, own=[1, 2], n=2, Hkv=1, D=8, num_blocks=100)
    before = shared_calls()
    short.attend(short_ids, rand(rng, (2, 2, 1, 8)))
    assert shared_calls() == before  # below MIN_PREFIX_KEYS: unshared


def test_out_argument_and_additive_mask(rng, small_prefix):
    cache, ids = forked(rng, prompt=64, own=[5, 9, 20, 2])
    width = cache.block_table(ids).shape[1] * BS
    mask = np.zeros((1, 1, 1, width), np.float32)
    mask[..., 64:] = rng.standard_normal(width - 64)  # additive, 0 over the prefix
    q = rand(rng, (4, 4, 1, 16))
    buf = np.full((4, 1, 4, 16), np.nan, np.float32)
    out = buf.transpose(0, 2, 1, 3)  # a strided out, filled in place
    before = shared_calls()
    result, lse = cache.attend(ids, q, mask=mask, out=out, return_lse=True)
    assert shared_calls() == before + 1 and result is out
    for i, s in enumerate(ids):
        k, v = stored_kv(cache, s)
        ref, ref_lse, _ = reference_attention(q[i].astype(np.float64), k, v, causal=True,
                                              mask=mask[0][..., :k.shape[1]])
        np.testing.assert_allclose(out[i], ref, **TOLERANCE[F32])
        np.testing.assert_allclose(lse[i], ref_lse, **TOLERANCE[F32])


def test_many_forks_stack_into_one_gemm_shaped_call(rng, monkeypatch):
    """48 forks at one query head per KV head: 48 stacked rows per KV head, one prefix call
    where the planner runs it on the GEMM-shaped decode kernel (x86 SIMD tiers), else calls
    of 16 rows; the result is the reference's either way."""
    cache, ids = forked(rng, prompt=1024, own=[i % 3 for i in range(48)], n=48, Hkv=2, D=16,
                        num_blocks=400)
    q = rand(rng, (48, 2, 1, 16))
    prefix_rows = []
    run_part = _shared_prefix.run_part

    def counting(attn, q_part, part, **kw):
        if kw.get("seqlen_k") == 1024 and q_part.shape[0] == 1:
            prefix_rows.append(q_part.shape[2])
        return run_part(attn, q_part, part, **kw)

    monkeypatch.setattr(_shared_prefix, "run_part", counting)
    out, lse = cache.attend(ids, q, return_lse=True)
    check_against_reference(cache, ids, q, out, lse)
    gemm = af._ext.runtime_info()["isa"] in ("avx2", "avx512", "avx512bf16")
    assert prefix_rows == ([48] if gemm else [16, 16, 16])
    # 70 forks: two equal calls of 35 rows (no short last call), or 16-row calls.
    cache, ids = forked(rng, prompt=1024, own=[1] * 70, n=70, Hkv=2, D=16, num_blocks=400)
    q = rand(rng, (70, 2, 1, 16))
    prefix_rows.clear()
    out = cache.attend(ids, q)
    check_against_reference(cache, ids, q, out)
    assert prefix_rows == ([35, 35] if gemm else [16, 16, 16, 16, 6])


def test_explain_reports_the_shared_groups_and_the_call_uses_them(rng, small_prefix):
    cache, ids = forked(rng, prompt=70, own=[0, 5, 30, 0])  # 4 full blocks + 6 tokens shared
    other = cache.add_sequence()
    cache.append(other, rand(rng, (2, 40, 16)), rand(rng, (2, 40, 16)))
    ids = ids + [other]
    q = rand(rng, (5, 4, 1, 16))
    table = cache.block_table(ids)
    lengths = np.array([cache.length(s) for s in ids], np.int32)
    plan = af.explain(q, cache.k, cache.v, cache_seqlens=lengths, block_table=table)
    assert plan["kv_source"] == "paged"
    assert plan["shared_prefix"] == [{"sequences": [0, 1, 2, 3], "blocks": 4, "keys": 4 * BS}]
    before = shared_calls()
    out = af.attention_with_kvcache(q, cache.k, cache.v, lengths, block_table=table)
    assert shared_calls() == before + 1
    check_against_reference(cache, ids, q, out)
    # nothing shared: unrelated sequences, ALiBi, no block table
    assert af.explain(q[4:], cache.k, cache.v, cache_seqlens=lengths[4:],
                      block_table=table[4:])["shared_prefix"] is None
    slopes = np.full(4, 0.1, np.float32)
    assert af.explain(q, cache.k, cache.v, cache_seqlens=lengths, block_table=table,
                      alibi_slopes=slopes)["shared_prefix"] is None
    assert af.explain(q[:1], cache.k[:1], cache.v[:1])["shared_prefix"] is None


@pytest.mark.parametrize("dtype", [ml_dtypes.float8_e4m3fn, "int4"])
def test_low_bit_pools_share_and_match_the_unshared_call(rng, small_prefix, monkeypatch, dtype):
    """float8 and int4 pools take the shared path too: equal to the same call with nothing
    shared, to float32 rounding (float8 also against the float64 reference of its stored
    values)."""
    cache, ids = forked(rng, prompt=80, own=[1, 20, 7, 33], Hkv=2, dtype=dtype)
    q = rand(rng, (4, 8, 1, 16))
    before = shared_calls()
    out, lse = cache.attend(ids, q, return_lse=True)
    assert shared_calls() == before + 1
    monkeypatch.setattr(_shared_prefix, "MIN_PREFIX_KEYS", 1 << 30)  # nothing shared
    alone, alone_lse = cache.attend(ids, q, return_lse=True)
    assert shared_calls() == before + 1
    np.testing.assert_allclose(out, alone, **TOLERANCE[F32])
    np.testing.assert_allclose(lse, alone_lse, rtol=1e-5, atol=1e-5)
    if dtype != "int4":
        check_against_reference(cache, ids, q, out, lse)
