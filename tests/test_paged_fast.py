"""The paged fast path: attention_with_kvcache(block_table=...) without new tokens, for a
layout an earlier call had accepted, skips the full checks (attnfast._kvcache._paged_fast,
the per-call values in C: attnfast._ext.paged_table_fast):
the same bits as the full path, and every value that can differ between such calls (lengths,
block ids, out) still checked: a bad one falls back to the full path, which raises."""
import ml_dtypes
import numpy as np
import pytest

import attnfast as af
from attnfast import _kvcache
from attnfast._plans import PAGED_PLANS
from attnfast._formats import quantize_float8
from reference import reference_attention, visible_mask

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _pools(rng, B=3, H=8, Hkv=2, D=64, bs=16, blocks_per_seq=8, dtype=np.float32):
    nb = B * blocks_per_seq + 5
    k = rng.standard_normal((nb, Hkv, bs, D)).astype(np.float32)
    v = rng.standard_normal((nb, Hkv, bs, D)).astype(np.float32)
    scales = {}
    if dtype == FP8:
        (k, ks), (v, vs) = quantize_float8(k), quantize_float8(v)
        scales = dict(k_scale=ks, v_scale=vs)
    else:
        k, v = k.astype(dtype), v.astype(dtype)
    table = rng.permutation(nb)[:B * blocks_per_seq].reshape(B, blocks_per_seq).astype(np.int32)
    q = rng.standard_normal((B, H, 1, D)).astype(np.float32)
    return q, k, v, table, scales


@pytest.fixture
def count_full_checks(monkeypatch):
    calls = []
    inner = _kvcache.check_paged_kvcache_attention

    def counted(*a, **kw):
        calls.append(1)
        return inner(*a, **kw)
    monkeypatch.setattr(_kvcache, "check_paged_kvcache_attention", counted)
    return calls


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, FP8], ids=["f32", "bf16", "fp8"])
def test_repeat_call_takes_the_fast_path_with_the_same_bits(rng, dtype, count_full_checks):
    q, k, v, table, scales = _pools(rng, dtype=np.dtype(dtype))
    lens = np.array([100, 128, 7], np.int32)
    PAGED_PLANS.clear()
    first = af.attention_with_kvcache(q, k, v, lens, block_table=table, **scales)
    assert len(count_full_checks) == 1 and len(PAGED_PLANS) == 1
    for step in range(3):  # new lengths, new q, the same layout: no full checks
        lens = lens + np.array([1, 0, 5], np.int32)
        q = rng.standard_normal(q.shape).astype(np.float32)
        checks = len(count_full_checks)
        out = af.attention_with_kvcache(q, k, v, lens, block_table=table, **scales)
        assert len(count_full_checks) == checks
        PAGED_PLANS.clear()
        full = af.attention_with_kvcache(q, k, v, lens, block_table=table, **scales)
        assert len(count_full_checks) == checks + 1
        np.testing.assert_array_equal(out, full)
    # and against float64 over the keys each sequence reads
    kd, vd = k.astype(np.float64), v.astype(np.float64)
    if scales:
        kd, vd = kd * scales["k_scale"][..., None], vd * scales["v_scale"][..., None]
    for b, n in enumerate(lens):
        rows = np.concatenate([kd[i] for i in table[b]], axis=1)[:, :n]
        vals = np.concatenate([vd[i] for i in table[b]], axis=1)[:, :n]
        ref = reference_attention(q[b:b + 1].astype(np.float64), rows[None], vals[None], causal=True)[0]
        np.testing.assert_allclose(out[b:b + 1], ref, rtol=2e-5, atol=2e-5)
    assert first.shape == out.shape


def test_out_is_written_in_place_and_checked(rng, count_full_checks):
    q, k, v, table, _ = _pools(rng)
    lens = np.array([30, 40, 50])
    out = np.full((3, 8, 1, 64), np.nan, np.float32)
    PAGED_PLANS.clear()
    af.attention_with_kvcache(q, k, v, lens, block_table=table, out=out)
    got = af.attention_with_kvcache(q, k, v, lens + 1, block_table=table, out=out)
    assert got is out and len(count_full_checks) == 1
    np.testing.assert_array_equal(out, af.attention_with_kvcache(q, k, v, lens + 1, block_table=table))
    # out overlapping q (same layout): the full path refuses it, nothing written
    both = np.zeros((2, 3, 8, 1, 64), np.float32)
    both[0] = q
    PAGED_PLANS.clear()
    af.attention_with_kvcache(both[0], k, v, lens, block_table=table, out=both[1])
    before = both.copy()
    with pytest.raises(ValueError, match="overlap|share"):
        af.attention_with_kvcache(both[0], k, v, lens, block_table=table, out=both[0])
    np.testing.assert_array_equal(both, before)


def test_bad_values_on_a_known_layout_raise_as_the_full_path(rng):
    q, k, v, table, _ = _pools(rng)
    lens = np.array([30, 40, 50])
    PAGED_PLANS.clear()
    af.attention_with_kvcache(q, k, v, lens, block_table=table)
    assert len(PAGED_PLANS) == 1
    bad = table.copy()
    bad[1, 0] = k.shape[0]  # not a block of the pool
    with pytest.raises(ValueError, match=r"block_table\[1, 0\]"):
        af.attention_with_kvcache(q, k, v, lens, block_table=bad)
    with pytest.raises(ValueError, match="cache_seqlens|too few blocks"):
        af.attention_with_kvcache(q, k, v, np.array([30, 40, 8 * 16 + 1]), block_table=table)
    with pytest.raises(ValueError, match="cache_seqlens"):
        af.attention_with_kvcache(q, k, v, np.array([30, -1, 5]), block_table=table)


def test_shared_prefix_still_read_once_on_the_fast_path(rng, count_full_checks):
    """Sequences sharing >= 1024 leading keys: the fast path runs the same shared-prefix
    plan (attnfast._shared_prefix) as the full path, with the same bits."""
    from attnfast import _shared_prefix
    B, bs, per = 4, 64, 20
    q, k, v, table, _ = _pools(rng, B=B, bs=bs, blocks_per_seq=per)
    table[1:, :16] = table[0, :16]  # 1024 keys shared by all four
    lens = np.array([1100, 1200, 1250, 1270])
    PAGED_PLANS.clear()
    af.attention_with_kvcache(q, k, v, lens, block_table=table)
    shared = _shared_prefix.stats["shared_calls"]
    fast = af.attention_with_kvcache(q, k, v, lens + 1, block_table=table)
    assert _shared_prefix.stats["shared_calls"] == shared + 1 and len(count_full_checks) == 1
    PAGED_PLANS.clear()
    np.testing.assert_array_equal(fast, af.attention_with_kvcache(q, k, v, lens + 1, block_table=table))


@pytest.mark.parametrize("lengths_kind", ["int", "int32", "int64"])
def test_return_lse_query_offset_and_out_keep_the_fast_path(rng, lengths_kind, count_full_checks):
    """return_lse, query_offset, out= and an int32 table are in the plan key or checked per
    call (attnfast._ext.paged_table_fast): repeat calls take the fast path (counted in
    _ext.fast_calls_taken["paged"]) with the full path's bits and the reference's values."""
    from attnfast import _ext
    q, k, v, table, _ = _pools(rng)
    lens = {"int": 70, "int32": np.array([70, 90, 33], np.int32),
            "int64": np.array([70, 90, 33], np.int64)}[lengths_kind]
    out = np.empty((3, 8, 1, 64), np.float32)
    PAGED_PLANS.clear()
    kw = dict(block_table=table, return_lse=True, out=out, window=(40, 0))
    af.attention_with_kvcache(q, k, v, lens, query_offset=20, **kw)
    for offset in (20, 31, None):
        q = rng.standard_normal(q.shape).astype(np.float32)
        taken = _ext.fast_calls_taken["paged"]
        got, lse = af.attention_with_kvcache(q, k, v, lens, query_offset=offset, **kw)
        assert got is out and _ext.fast_calls_taken["paged"] == taken + 1
        assert len(count_full_checks) == 1
        fast = (out.copy(), lse.copy())
        PAGED_PLANS.clear()
        full = af.attention_with_kvcache(q, k, v, lens, query_offset=offset, **kw)
        np.testing.assert_array_equal(fast[0], full[0])
        np.testing.assert_array_equal(fast[1], full[1])
        count_full_checks.clear()
        count_full_checks.append(1)
        for b in range(3):
            n = lens if lengths_kind == "int" else int(lens[b])
            rows = np.concatenate([k[i] for i in table[b]], axis=1)[:, :n].astype(np.float64)
            vals = np.concatenate([v[i] for i in table[b]], axis=1)[:, :n].astype(np.float64)
            seen = visible_mask(1, n, causal=True, window=(40, 0), query_offset=offset)
            ro, rl, _ = reference_attention(q[b:b + 1].astype(np.float64), rows[None], vals[None],
                                            mask=seen)
            np.testing.assert_allclose(fast[0][b:b + 1], ro, rtol=2e-5, atol=2e-5)
            np.testing.assert_allclose(fast[1][b:b + 1], rl, rtol=2e-5, atol=2e-5)
