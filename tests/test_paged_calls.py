"""PagedKVCache.attend / step on the fast path (issue 47.1): a repeat call of an accepted
layout finds its plan (attnfast._ext.kvcache_key) and does the per-call work in C
(attnfast._ext.paged_fast): ids, blocks taken, table, lengths, overlap, token writes, kernel.
Counted in attnfast._ext.fast_calls_taken["paged"]. The values are checked against a float64
reference over what each sequence holds; what the C path declines (copy-on-write, out of
blocks, unknown or repeated ids, long shared prefixes, a 16-bit pool fed float32 tokens)
runs the full path, with its errors and nothing changed."""
import ml_dtypes
import numpy as np
import pytest

import attnfast as af
from attnfast import _plans, _ext
from reference import reference_attention

H, HKV, D, DV, BS = 4, 2, 8, 6, 4


@pytest.fixture(autouse=True)
def _fresh_plans():
    _plans.KVCACHE_PLANS.clear()
    yield
    _plans.KVCACHE_PLANS.clear()
    _ext.fast_call_hooks["before_kernels"] = None


def fast_calls():
    return _ext.fast_calls_taken["paged"]


def state(cache):
    """Every byte and number of the pool's state."""
    return ([a.tobytes() for a in (cache.k, cache.v)], list(cache._free), cache._refs.tobytes(),
            [(s, cache.blocks(s), cache.length(s)) for s in cache.sequences])


class Model:
    """float64 tokens per sequence, as the pool should hold them."""

    def __init__(self, cache):
        self.cache, self.k, self.v = cache, {}, {}

    def add(self):
        s = self.cache.add_sequence()
        self.k[s], self.v[s] = np.zeros((HKV, 0, D)), np.zeros((HKV, 0, DV))
        return s

    def append(self, ids, k_new, v_new):
        for i, s in enumerate(ids):
            self.k[s] = np.concatenate([self.k[s], k_new[i].astype(np.float64)], axis=1)
            self.v[s] = np.concatenate([self.v[s], v_new[i].astype(np.float64)], axis=1)

    def check(self, ids, q, out, lse=None):
        for i, s in enumerate(ids):
            ro, rl, _ = reference_attention(q[i:i + 1].astype(np.float64), self.k[s][None],
                                            self.v[s][None], causal=True)
            np.testing.assert_allclose(out[i:i + 1], ro, rtol=2e-5, atol=2e-5)
            if lse is not None:
                np.testing.assert_allclose(lse[i:i + 1], rl, rtol=2e-5, atol=2e-5)
        # and the pool holds the model's tokens, read back through the blocks
        for s in ids:
            table, n = self.cache.block_table([s])[0], self.cache.length(s)
            k = np.concatenate([self.cache.k[b] for b in table if b >= 0], axis=1)[:, :n]
            v = np.concatenate([self.cache.v[b] for b in table if b >= 0], axis=1)[:, :n]
            assert np.array_equal(k, self.k[s]) and np.array_equal(v, self.v[s])


def tokens(rng, n, t=1, tq=None):
    q = rng.standard_normal((n, H, tq or t, D)).astype(np.float32)
    return (q, rng.standard_normal((n, HKV, t, D)).astype(np.float32),
            rng.standard_normal((n, HKV, t, DV)).astype(np.float32))


def test_decode_steps_take_the_fast_path_across_blocks(rng):
    """Steps of one token over several block boundaries (blocks taken from the free list in
    C), then attends: every repeat call is a fast call, with the reference's values."""
    cache = af.PagedKVCache(16, BS, HKV, D, v_head_dim=DV)
    model = Model(cache)
    ids = [model.add(), model.add()]
    q, k, v = tokens(rng, 2, 3)
    cache.append(ids, k, v)
    model.append(ids, k, v)
    for step in range(7):
        q, k, v = tokens(rng, 2)
        before = fast_calls()
        out, lse = cache.step(ids, q, k, v, return_lse=True)
        model.append(ids, k, v)
        assert fast_calls() == before + (step > 0), step
        model.check(ids, q, out, lse)
    assert cache.num_free_blocks == 16 - 2 * 3  # 10 tokens each: 3 blocks of 4
    q = tokens(rng, 2)[0]
    cache.attend(ids, q)
    before = fast_calls()
    model.check(ids, q, cache.attend(ids, q))
    assert fast_calls() == before + 1


def test_fast_and_full_paths_give_the_same_bits(rng):
    pools = [af.PagedKVCache(32, BS, HKV, D, v_head_dim=DV) for _ in range(2)]
    for p in pools:
        p.add_sequence()
        p.add_sequence()
    for step in range(6):
        q, k, v = tokens(rng, 2, t=2)
        fast = pools[0].step([1, 0], q, k, v)     # plans once, then fast
        _plans.KVCACHE_PLANS.clear()
        before = fast_calls()
        full = pools[1].step([1, 0], q, k, v)     # always the full path
        assert fast_calls() == before
        assert fast.tobytes() == full.tobytes() and state(pools[0]) == state(pools[1])
        pools[0].step([1, 0], q, k, v)            # (leaves the plan for the next round)
        pools[1].step([1, 0], q, k, v)


def test_one_bare_id_out_and_lse(rng):
    """A bare id with 3-D arrays; out= written in place and returned; return_lse."""
    cache = af.PagedKVCache(8, BS, HKV, D, v_head_dim=DV)
    model = Model(cache)
    s = model.add()
    out = np.full((H, 1, DV), np.nan, np.float32)
    for step in range(3):
        q, k, v = tokens(rng, 1)
        before = fast_calls()
        got, lse = cache.step(s, q[0], k[0], v[0], out=out, return_lse=True)
        model.append([s], k, v)
        assert got is out and lse.shape == (H, 1) and fast_calls() == before + (step > 0)
        model.check([s], q, out[None], lse[None])


def test_copy_on_write_out_of_blocks_and_bad_ids_take_the_full_path(rng):
    cache = af.PagedKVCache(4, BS, HKV, D, v_head_dim=DV)
    model = Model(cache)
    a = model.add()
    q, k, v = tokens(rng, 1, t=2)
    cache.step([a], q, k, v)  # the plan of (1 sequence, 2 tokens)
    model.append([a], k, v)
    b = cache.fork(a)        # shares a's partly filled block
    model.k[b], model.v[b] = model.k[a], model.v[a]
    q, k, v = tokens(rng, 1, t=2)
    before = fast_calls()
    out = cache.step([b], q, k, v)  # copy-on-write: the full path copies the block first
    model.append([b], k, v)
    assert fast_calls() == before
    model.check([b], q, out)
    qa = tokens(rng, 1)[0]
    model.check([a], qa, cache.attend([a], qa))  # a's tokens as they were
    q, k, v = tokens(rng, 1, t=9)
    cache.step([a], q[:, :, :2], k[:, :, :2], v[:, :, :2])  # a plan for 1 x 2 tokens
    model.append([a], k[:, :, :2], v[:, :, :2])
    snap = state(cache)
    for ids, error in (([a + b + 7], "no sequence"), ([a, a], "must not repeat")):
        q2, k2, v2 = tokens(rng, len(ids), t=2)
        with pytest.raises(ValueError, match=error):
            cache.step(ids, q2, k2, v2)
        assert state(cache) == snap
    q2, k2, v2 = tokens(rng, 1, t=2)
    for _ in range(6):  # until the pool runs out: ValueError "out of blocks", nothing changed
        try:
            cache.step([a], q2, k2, v2)
        except ValueError as e:
            assert "out of blocks" in str(e)
            assert state(cache) == snap
            break
        model.append([a], k2, v2)
        snap = state(cache)
    else:
        pytest.fail("the pool never ran out of blocks")
    model.check([a], q2, cache.attend([a], q2))


@pytest.mark.parametrize("latent", [False, True])
def test_float32_tokens_into_a_16_bit_pool_are_rounded_as_the_full_path_rounds(rng, latent):
    """Rounded to bfloat16 before the C path copies them (values beyond the range: inf)."""
    bf16 = ml_dtypes.bfloat16
    dv = D if latent else DV
    cache = af.PagedKVCache(8, BS, HKV, D, v_head_dim=dv, dtype=bf16, latent=latent)
    s = cache.add_sequence()
    for step in range(3):
        q, k, v = tokens(rng, 1)
        if step == 2:
            k[0, 0, 0, 1] = np.finfo(np.float32).max
        before = fast_calls()
        cache.step([s], q, k, None if latent else v[..., :dv])
        assert fast_calls() == before + (step > 0)
    table = cache.block_table([s])[0]
    with np.errstate(over="ignore"):
        assert cache.k[table[0], :, 2].tobytes() == k[0, :, 0].astype(bf16).tobytes()
    assert np.isposinf(cache.k[table[0], 0, 2, 1].astype(np.float32))


@pytest.mark.parametrize("error", [KeyboardInterrupt, MemoryError])
def test_a_fast_step_failing_in_the_kernels_changes_nothing(rng, error):
    """Raised where the kernels run (Ctrl-C there raises KeyboardInterrupt): the rows
    written, the blocks taken and the lengths all go back."""
    cache = af.PagedKVCache(12, BS, HKV, D, v_head_dim=DV)
    ids = [cache.add_sequence(), cache.add_sequence()]
    q, k, v = tokens(rng, 2, t=3)
    cache.step(ids, q, k, v)
    cache.step(ids, q, k, v)  # 6 tokens each: a step of 3 takes a block per sequence
    snap = state(cache)

    def fail(**kwargs):
        raise error("in the kernels")
    _ext.fast_call_hooks["before_kernels"] = fail
    before = fast_calls()
    with pytest.raises(error):
        cache.step(ids, q, k, v)
    assert fast_calls() == before + 1 and state(cache) == snap
    _ext.fast_call_hooks["before_kernels"] = None
    cache.step(ids, q, k, v)
    assert [cache.length(s) for s in ids] == [9, 9]


def test_an_error_after_a_fast_step_undoes_it(rng):
    """The C path's changes join the transaction's log: an exception before the entry point
    returns (here raised by an outer transaction) puts them back."""
    from attnfast._transaction import transaction
    cache = af.PagedKVCache(12, BS, HKV, D, v_head_dim=DV)
    ids = [cache.add_sequence()]
    q, k, v = tokens(rng, 1, t=3)
    cache.step(ids, q, k, v)
    snap = state(cache)

    @transaction()
    def outer():
        cache.step(ids, q, k, v)
        cache.truncate(ids[0], 1)
        raise MemoryError("later")
    before = fast_calls()
    with pytest.raises(MemoryError):
        outer()
    assert fast_calls() == before + 1 and state(cache) == snap


def test_truncate_gives_blocks_back_and_is_undone_as_a_whole(rng):
    cache = af.PagedKVCache(8, BS, HKV, D, v_head_dim=DV)
    a = cache.add_sequence()
    q, k, v = tokens(rng, 1, t=9)
    cache.append(a, k[0], v[0])
    b = cache.fork(a)
    assert cache.num_free_blocks == 5
    cache.truncate(a, 5)  # its third block is still b's
    assert cache.blocks(a) == cache.blocks(b)[:2] and cache.num_free_blocks == 5
    cache.truncate(b, 0)  # b's third block has no holder left
    assert cache.blocks(b) == () and cache.num_free_blocks == 6
    with pytest.raises(ValueError, match="truncate only shortens"):
        cache.truncate(a, 6)
    with pytest.raises(ValueError, match="no sequence"):
        cache.truncate(99, 0)


def test_prompt_sized_steps_on_the_fast_path(rng):
    """Steps of 600 tokens (rows copied with the GIL released), then one that fails in the
    kernels: values as the reference, state as before the failed one."""
    cache = af.PagedKVCache(1000, BS, HKV, D, v_head_dim=DV)
    model = Model(cache)
    ids = [model.add(), model.add()]
    for step in range(2):
        q, k, v = tokens(rng, 2, t=600, tq=2)
        before = fast_calls()
        out = cache.step(ids, q, k, v)
        model.append(ids, k, v)
        assert fast_calls() == before + (step > 0)
        model.check(ids, q, out)
    snap = state(cache)

    def fail(**kwargs):
        raise KeyboardInterrupt("in the kernels")
    _ext.fast_call_hooks["before_kernels"] = fail
    with pytest.raises(KeyboardInterrupt):
        cache.step(ids, q, k, v)
    assert state(cache) == snap


@pytest.mark.parametrize("out_ndim", [3, 4])
def test_a_bare_id_with_4d_queries_and_out_of_either_rank(rng, out_ndim):
    """A bare id lifts only the 3-D arrays (as the full path does): a 3-D out with 4-D q
    (Tq = 3) is filled, on the fast path too, with the reference's values."""
    cache = af.PagedKVCache(8, BS, HKV, D, v_head_dim=DV)
    model = Model(cache)
    s = model.add()
    q, k, v = tokens(rng, 1, t=5)
    cache.append(s, k[0], v[0])
    model.append([s], k, v)
    out = np.zeros((1, H, 3, DV)[4 - out_ndim:], np.float32)
    for call in range(2):
        q = tokens(rng, 1, tq=3)[0]
        before = fast_calls()
        got = cache.attend(s, q, out=out)
        assert got is out and fast_calls() == before + call
        model.check([s], q, out.reshape(1, H, 3, DV))
