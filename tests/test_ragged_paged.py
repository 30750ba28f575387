"""A ragged batch over a paged KV cache in one call: attention_varlen(block_table=, seqused_k=).

Decode rows and prompt chunks of different sequences in one kernel call must match the float64
reference, and be bit-identical to one attention_with_kvcache call per sequence (on every tier).
"""
import ml_dtypes
import numpy as np
import pytest

import attnfast as af
from attnfast._formats import quantize_int8
from reference import reference_attention

BF16 = np.dtype(ml_dtypes.bfloat16)


def ragged_batch(rng, q_lens, k_lens, *, heads=4, kv_heads=2, dim=32, dim_v=None,
                 block_size=16, dtype=np.float32, kv_dtype=None, spare=5):
    """A scattered pool holding each sequence's keys, its table, and the packed queries."""
    kv_dtype = np.dtype(kv_dtype or dtype)
    dim_v = dim_v or dim
    blocks = [-(-n // block_size) for n in k_lens]
    max_blocks = max(max(blocks), 1)
    num_blocks = sum(blocks) + spare
    ids = rng.permutation(num_blocks)
    table = np.full((len(k_lens), max_blocks), -1, np.int32)
    keys, values = [], []
    k_pool = np.zeros((num_blocks, kv_heads, block_size, dim), kv_dtype)
    v_pool = np.zeros((num_blocks, kv_heads, block_size, dim_v), kv_dtype)
    at = 0
    for b, n in enumerate(k_lens):
        kb = rng.standard_normal((kv_heads, n, dim)).astype(kv_dtype)
        vb = rng.standard_normal((kv_heads, n, dim_v)).astype(kv_dtype)
        keys.append(kb)
        values.append(vb)
        for i in range(blocks[b]):
            blk = ids[at]
            at += 1
            table[b, i] = blk
            rows = slice(i * block_size, min((i + 1) * block_size, n))
            k_pool[blk, :, :rows.stop - rows.start] = kb[:, rows]
            v_pool[blk, :, :rows.stop - rows.start] = vb[:, rows]
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]), heads, dim)).astype(dtype)
    return q, k_pool, v_pool, cu_q, np.array(k_lens, np.int32), table, keys, values


def per_sequence(q, k_pool, v_pool, cu_q, used, table, **options):
    """One attention_with_kvcache call per sequence, packed back: (out, lse)."""
    outs, lses = [], []
    for b in range(len(used)):
        q0, q1 = cu_q[b], cu_q[b + 1]
        if q1 == q0:
            continue
        o, l = af.attention_with_kvcache(q[q0:q1].transpose(1, 0, 2)[None], k_pool, v_pool,
                                         used[b:b + 1], block_table=table[b:b + 1],
                                         return_lse=True, **options)
        outs.append(o[0].transpose(1, 0, 2))
        lses.append(l[0])
    return np.concatenate(outs), np.concatenate(lses, axis=1)


MIX = dict(q_lens=[1, 70, 1, 3, 0, 130, 1], k_lens=[300, 70, 45, 200, 17, 400, 0])


@pytest.mark.parametrize("dtype,kv_dtype", [(np.float32, None), (np.float64, None), (BF16, None),
                                            (np.float16, None), (np.float32, BF16)])
def test_mix_matches_reference_and_per_sequence_bits(tier, dtype, kv_dtype):
    rng = np.random.default_rng(1)
    q, kp, vp, cu_q, used, table, keys, values = ragged_batch(rng, **MIX, dtype=dtype,
                                                              kv_dtype=kv_dtype)
    out, lse = af.attention_varlen(q, kp, vp, cu_q, seqused_k=used, block_table=table,
                                   causal=True, return_lse=True, num_threads=2)
    ref_out, ref_lse = per_sequence(q, kp, vp, cu_q, used, table, causal=True, num_threads=1)
    assert out.dtype == ref_out.dtype
    assert np.array_equal(out.view(np.uint8), ref_out.view(np.uint8))
    assert np.array_equal(lse, ref_lse)
    tol = 1e-12 if np.dtype(dtype) == np.float64 else (
        2e-5 if np.dtype(dtype) == np.float32 and kv_dtype is None else 2e-2)
    for b in range(len(used)):
        q0, q1 = cu_q[b], cu_q[b + 1]
        if q1 == q0:
            continue
        want, want_lse, _ = reference_attention(q[q0:q1].transpose(1, 0, 2).astype(np.float64),
                                                keys[b].astype(np.float64),
                                                values[b].astype(np.float64), causal=True)
        np.testing.assert_allclose(out[q0:q1].astype(np.float64), want.transpose(1, 0, 2),
                                   rtol=tol, atol=tol)
        np.testing.assert_allclose(lse[:, q0:q1], want_lse, rtol=tol, atol=tol)


@pytest.mark.parametrize("block_size", [16, 64])
def test_options_gqa_and_thread_counts(block_size):
    rng = np.random.default_rng(2)
    q_lens, k_lens = [1, 40, 2, 90], [500, 90, 33, 90]
    q, kp, vp, cu_q, used, table, keys, values = ragged_batch(
        rng, q_lens, k_lens, heads=6, kv_heads=2, dim=24, dim_v=40, block_size=block_size)
    slopes = rng.uniform(0.01, 0.1, (len(q_lens), 6)).astype(np.float32)
    sinks = rng.standard_normal(6).astype(np.float32)
    options = dict(causal=True, window=(64, 0), softcap=8.0, sinks=sinks, scale=0.3)
    results = [af.attention_varlen(q, kp, vp, cu_q, seqused_k=used, block_table=table,
                                   alibi_slopes=slopes, return_lse=True, num_threads=n, **options)
               for n in (1, 2, 3)]
    for out, lse in results[1:]:
        assert np.array_equal(out, results[0][0]) and np.array_equal(lse, results[0][1])
    out, lse = results[0]
    for b in range(len(q_lens)):
        q0, q1 = cu_q[b], cu_q[b + 1]
        want, want_lse, _ = reference_attention(
            q[q0:q1].transpose(1, 0, 2).astype(np.float64), keys[b].astype(np.float64),
            values[b].astype(np.float64), alibi_slopes=slopes[b], **options)
        np.testing.assert_allclose(out[q0:q1], want.transpose(1, 0, 2), rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(lse[:, q0:q1], want_lse, rtol=2e-5, atol=2e-5)
        o, l = af.attention_with_kvcache(q[q0:q1].transpose(1, 0, 2)[None], kp, vp, used[b:b + 1],
                                         block_table=table[b:b + 1], alibi_slopes=slopes[b],
                                         return_lse=True, **options)
        assert np.array_equal(out[q0:q1], o[0].transpose(1, 0, 2))


def test_int8_pool_bits_equal_per_sequence():
    rng = np.random.default_rng(3)
    q_lens, k_lens = [1, 50, 1], [200, 120, 64]
    q, kp, vp, cu_q, used, table, _, _ = ragged_batch(rng, q_lens, k_lens)
    k8, ks = quantize_int8(kp)
    v8, vs = quantize_int8(vp)
    out = af.attention_varlen(q, k8, v8, cu_q, seqused_k=used, block_table=table, causal=True,
                              k_scale=ks, v_scale=vs)
    ref, _ = per_sequence(q, k8, v8, cu_q, used, table, causal=True, k_scale=ks, v_scale=vs)
    assert np.array_equal(out, ref)
    # and near the float pool it quantises (int8's error: ~1e-2 here)
    full = af.attention_varlen(q, kp, vp, cu_q, seqused_k=used, block_table=table, causal=True)
    np.testing.assert_allclose(out, full, atol=5e-2)


def test_out_and_empty_sequences():
    rng = np.random.default_rng(4)
    q, kp, vp, cu_q, used, table, _, _ = ragged_batch(rng, [2, 0, 20], [2, 5, 0])
    out = np.full((q.shape[0], 4, 32), 7.0, np.float32)
    res, lse = af.attention_varlen(q, kp, vp, cu_q, seqused_k=used, block_table=table, causal=True,
                                   out=out, return_lse=True)
    assert res is out
    assert np.all(out[2:] == 0) and np.all(lse[:, 2:] == -np.inf)  # no keys: zeros, -inf
    assert np.all(np.isfinite(lse[:, :2]))


def test_argument_errors_name_the_argument():
    rng = np.random.default_rng(5)
    q, kp, vp, cu_q, used, table, _, _ = ragged_batch(rng, [1, 3], [20, 30])
    call = dict(seqused_k=used, block_table=table)
    with pytest.raises(ValueError, match="seqused_k"):
        af.attention_varlen(q, kp, vp, cu_q, block_table=table)
    with pytest.raises(ValueError, match="cu_seqlens_k=None"):
        af.attention_varlen(q, kp, vp, cu_q, cu_q, **call)
    with pytest.raises(NotImplementedError, match="block_table"):
        af.attention_varlen(q, kp, vp, cu_q, cu_q, seqused_k=used)
    with pytest.raises(ValueError, match=r"seqused_k must be in \[0, 32\]"):
        af.attention_varlen(q, kp, vp, cu_q, seqused_k=np.array([20, 33]), block_table=table)
    with pytest.raises(ValueError, match="block_table"):
        af.attention_varlen(q, kp, vp, cu_q, seqused_k=used, block_table=table[:1])
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        af.attention_varlen(q, kp, vp, cu_q[:-1], **call)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        af.attention_varlen(q, kp, vp, cu_q, max_seqlen_k=25, **call)
    with pytest.raises(NotImplementedError, match="mask"):
        af.attention_varlen(q, kp, vp, cu_q, mask=np.ones((1, 1), bool), **call)
    bad = table.copy()
    bad[1, 1] = kp.shape[0]
    out = np.full((q.shape[0], 4, 32), 3.0, np.float32)
    with pytest.raises(ValueError, match="block"):
        af.attention_varlen(q, kp, vp, cu_q, seqused_k=used, block_table=bad, out=out)
    assert np.all(out == 3.0)  # a rejected call writes nothing


def test_explain_varlen_reports_the_mix():
    rng = np.random.default_rng(6)
    q, kp, vp, cu_q, used, table, _, _ = ragged_batch(rng, [1, 70, 1, 0, 3], [300, 70, 45, 5, 200])
    plan = af.explain_varlen(q, kp, vp, cu_q, seqused_k=used, block_table=table, causal=True,
                             num_threads=2)
    assert plan["path"] == "ragged" and plan["kv_source"] == "paged"
    assert (plan["sequences"], plan["decode"], plan["prefill"]) == (4, 3, 1)
    assert [p["path"] for p in plan["per_sequence"]] == ["decode", "prefill", "decode", "decode"]
    assert sum(plan["kernels"].values()) == 4
    for b, p in zip([0, 1, 2, 4], plan["per_sequence"]):
        q0, q1 = cu_q[b], cu_q[b + 1]
        own = af.explain(q[q0:q1].transpose(1, 0, 2)[None], kp, vp, cache_seqlens=used[b:b + 1],
                         block_table=table[b:b + 1], causal=True, num_threads=2)
        assert p["kernel"] == own["kernel"] and p["tasks"] == own["tasks"]
    assert plan["tasks"] == sum(p["tasks"] for p in plan["per_sequence"])
    with pytest.raises(NotImplementedError, match="block_table"):
        af.explain_varlen(q, kp, vp, cu_q, cu_q)
    with pytest.raises(ValueError, match="seqused_k"):
        af.explain_varlen(q, kp, vp, cu_q, block_table=table)


def test_runs_of_decode_rows_are_one_problem_with_the_same_bits(monkeypatch):
    """Consecutive one-query sequences (a serving step's decode rows) are checked and run as
    one problem of that many sequences: bit-identical to one call per sequence, lse too,
    a row with no keys included."""
    from attnfast import _varlen
    checks = []
    inner = _varlen.check_paged_kvcache_attention

    def counted(q, *args, **kwargs):
        checks.append(q.shape[0])
        return inner(q, *args, **kwargs)
    monkeypatch.setattr(_varlen, "check_paged_kvcache_attention", counted)
    rng = np.random.default_rng(5)
    q_lens, k_lens = [1, 1, 1, 40, 1, 0, 1, 1], [300, 5, 700, 90, 64, 10, 0, 129]
    q, kp, vp, cu_q, used, table, keys, values = ragged_batch(rng, q_lens, k_lens, heads=8)
    out, lse = af.attention_varlen(q, kp, vp, cu_q, seqused_k=used, block_table=table,
                                   causal=True, return_lse=True, num_threads=2)
    assert checks == [3, 1, 1, 2]  # sequences per problem: a run of 3, the chunk, 1, a run of 2
    ref_out, ref_lse = per_sequence(q, kp, vp, cu_q, used, table, causal=True, num_threads=1)
    assert np.array_equal(out.view(np.uint8), ref_out.view(np.uint8))
    assert np.array_equal(lse, ref_lse)
    assert not out[cu_q[6]].any() and np.isneginf(lse[:, cu_q[6]]).all()  # no keys: zeros, -inf
    for b in (0, 2, 7):
        want, want_lse, _ = reference_attention(q[cu_q[b]:cu_q[b + 1]].transpose(1, 0, 2).astype(np.float64),
                                                keys[b].astype(np.float64),
                                                values[b].astype(np.float64), causal=True)
        np.testing.assert_allclose(out[cu_q[b]:cu_q[b + 1]], want.transpose(1, 0, 2), rtol=2e-5, atol=2e-5)
