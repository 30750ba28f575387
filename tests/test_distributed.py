"""attnfast.distributed.ShardedKVCache on a local Ray runtime: the same results as a
one-process KVCache (and the float64 reference), the clear error of a dead shard, bad input
rejected on the caller's side with nothing changed."""
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import attnfast as af
from reference import reference_attention

# The import-hygiene tests below run without Ray too; everything else needs it.
try:
    import ray
except ImportError:  # pragma: no cover
    ray = None

needs_ray = pytest.mark.skipif(ray is None, reason="Ray is not installed (pip install "
                               "'attnfast[ray]'): the sharded-cache tests need a local Ray runtime")

EXACT = 1e-5  # max |sharded - one-process| for float32


def test_import_attnfast_does_not_import_ray():
    code = ("import sys, attnfast, attnfast.distributed; "
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_missing_ray_names_the_extra(monkeypatch):
    from attnfast import distributed
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"attnfast\[ray\]"):
        distributed.ShardedKVCache(1, 1, 8, 16, 2)


@pytest.fixture(scope="module")
def ray_runtime():
    if ray is None:
        pytest.skip("Ray is not installed (pip install 'attnfast[ray]')")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20,
                 log_to_driver=False, configure_logging=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def caches(ray_runtime):
    """ShardedKVCache objects shared by the tests of this module (actors take a second to
    start): caches(**spec) hands out the one of that spec, reset to empty."""
    from attnfast.distributed import ShardedKVCache
    pool = {}

    def get(**spec):
        key = tuple(sorted((k, str(v)) for k, v in spec.items()))
        if key not in pool:
            spec = dict(spec)
            args = [spec.pop(n) for n in ("batch", "kv_heads", "head_dim",
                                          "capacity_per_shard", "num_shards")]
            pool[key] = ShardedKVCache(*args, **spec)
        pool[key].reset()
        return pool[key]

    yield get
    for c in pool.values():
        c.close()


def _rand(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def _max_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    both_inf = np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b))
    return float(np.max(np.where(both_inf, 0.0, np.abs(a - b)), initial=0.0))


CASES = {
    # name: (num_shards, capacity_per_shard, H, Hkv, D, Dv, prompt, options)
    "gqa-2shards": (2, 96, 8, 2, 16, 16, 100, {}),
    "dv-4shards": (4, 48, 4, 4, 16, 24, 100, {}),
    "mqa-window-4shards": (4, 48, 6, 1, 8, 8, 100, dict(window=(37, -1))),
    "softcap-alibi-sinks": (2, 96, 8, 2, 16, 12, 100, dict(softcap=4.0, sinks="h",
                                                           alibi_slopes="h")),
    "window-both-sides-sinks-4shards": (4, 48, 4, 2, 8, 8, 70, dict(window=(20, 3),
                                                                     sinks="h")),
}


def _options(options, H, rng):
    out = {}
    for k, v in options.items():
        if v == "h":
            v = (rng.uniform(0.02, 0.3, H) if k == "alibi_slopes"
                 else rng.standard_normal(H)).astype(np.float32)
        out[k] = v
    return out


@needs_ray
@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_and_50_decode_steps_match_one_process(caches, case):
    S, C, H, Hkv, D, Dv, T, options = CASES[case]
    rng = np.random.default_rng(len(case))
    options = _options(options, H, rng)
    B, steps = 2, 50
    sharded = caches(batch=B, kv_heads=Hkv, head_dim=D, capacity_per_shard=C, num_shards=S,
                     v_head_dim=Dv)
    local = af.KVCache(B, Hkv, D, C * S, v_head_dim=Dv)
    k_all = _rand(rng, (B, Hkv, T + steps, D))
    v_all = _rand(rng, (B, Hkv, T + steps, Dv))
    q = _rand(rng, (B, H, T, D))
    o_ref, l_ref = local.step(q, k_all[:, :, :T], v_all[:, :, :T], return_lse=True, **options)
    o, lse = sharded.step(q, k_all[:, :, :T], v_all[:, :, :T], return_lse=True, **options)
    assert o.shape == (B, H, T, Dv) and o.dtype == np.float32 and lse.shape == (B, H, T)
    assert _max_err(o, o_ref) <= EXACT and _max_err(lse, l_ref) <= EXACT
    ref64, _, _ = reference_attention(q, k_all[:, :, :T], v_all[:, :, :T], causal=True,
                                      **options)
    np.testing.assert_allclose(o, ref64, rtol=2e-5, atol=2e-5)
    worst = 0.0
    for i in range(steps):
        sl = slice(T + i, T + i + 1)
        qt = _rand(rng, (B, H, 1, D))
        o_ref, l_ref = local.step(qt, k_all[:, :, sl], v_all[:, :, sl], return_lse=True,
                                  **options)
        o, lse = sharded.step(qt, k_all[:, :, sl], v_all[:, :, sl], return_lse=True, **options)
        worst = max(worst, _max_err(o, o_ref), _max_err(lse, l_ref))
    assert worst <= EXACT, f"max error over {steps} decode steps: {worst}"
    assert sharded.lengths.tolist() == [T + steps] * B
    ref64, lse64, _ = reference_attention(qt, k_all, v_all, causal=True, **options)
    np.testing.assert_allclose(o, ref64, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, lse64, rtol=2e-5, atol=2e-5)
    # each shard holds exactly its slice of positions
    held = sharded.shard_lengths()[:, 0, :]
    assert held.tolist() == [[min(max(T + steps - s * C, 0), C)] * B for s in range(S)]


@needs_ray
def test_ragged_lengths_truncate_and_query_offset(caches):
    """Sequences of different lengths (batch_index), a chunked prompt, truncation and an
    explicit global query_offset: same as the one-process cache."""
    rng = np.random.default_rng(7)
    B, H, Hkv, D, C, S = 3, 4, 2, 8, 32, 4
    sharded = caches(batch=B, kv_heads=Hkv, head_dim=D, capacity_per_shard=C, num_shards=S)
    local = af.KVCache(B, Hkv, D, C * S)
    for c in (sharded, local):
        c.append(np.zeros((B, Hkv, 5, D), np.float32) + 0.5, np.ones((B, Hkv, 5, D), np.float32))
    for seqs, t in (([0], 40), ([1, 2], 27), ([2], 31), ([0, 2], 3)):
        k = _rand(rng, (len(seqs), Hkv, t, D))
        v = _rand(rng, (len(seqs), Hkv, t, D))
        q = _rand(rng, (len(seqs), H, t, D))
        a = local.step(q, k, v, batch_index=seqs)
        b = sharded.step(q, k, v, batch_index=seqs)
        assert _max_err(a, b) <= EXACT
    assert sharded.lengths.tolist() == local.lengths.tolist() == [48, 32, 66]
    q = _rand(rng, (B, H, 3, D))
    assert _max_err(sharded.attend(q), local.attend(q)) <= EXACT
    for off in (0, 20, 40, 45):
        a = local.attend(q, query_offset=off, window=(9, 2))
        b = sharded.attend(q, query_offset=off, window=(9, 2))
        assert _max_err(a, b) <= EXACT
    for c in (sharded, local):
        c.truncate([33, 7, 64])
    assert sharded.lengths.tolist() == [33, 7, 64]
    k = _rand(rng, (B, Hkv, 2, D))
    q = _rand(rng, (B, H, 2, D))
    a, la = local.step(q, k, k, return_lse=True)
    b, lb = sharded.step(q, k, k, return_lse=True)
    assert _max_err(a, b) <= EXACT and _max_err(la, lb) <= EXACT
    assert sharded.shard_lengths()[:, 0].tolist() == [[32, 9, 32], [3, 0, 32], [0, 0, 2],
                                                     [0, 0, 0]]
    # an empty cache: zeros and lse = -inf, as KVCache
    sharded.reset()
    o, lse = sharded.attend(q, return_lse=True)
    assert np.all(o == 0) and np.all(lse == -np.inf)


@needs_ray
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, "int8", np.float64])
def test_storage_dtypes(caches, dtype):
    rng = np.random.default_rng(3)
    B, H, Hkv, D, C, S, T = 1, 4, 2, 16, 40, 2, 60
    sharded = caches(batch=B, kv_heads=Hkv, head_dim=D, capacity_per_shard=C, num_shards=S,
                     dtype=dtype)
    local = af.KVCache(B, Hkv, D, C * S, dtype=dtype)
    q_dtype = np.float64 if dtype is np.float64 else np.float32
    new_dtype = q_dtype if dtype != ml_dtypes.bfloat16 else ml_dtypes.bfloat16
    k = _rand(rng, (B, Hkv, T, D), new_dtype)
    v = _rand(rng, (B, Hkv, T, D), new_dtype)
    q = _rand(rng, (B, H, T, D), q_dtype)
    a = local.step(q, k, v)
    b = sharded.step(q, k, v)
    assert b.dtype == a.dtype
    assert _max_err(a, b) <= (1e-12 if dtype is np.float64 else EXACT)
    if dtype == ml_dtypes.bfloat16:  # a 16-bit q over the 16-bit cache: one rounding at the end
        qb = q[:, :, -1:].astype(ml_dtypes.bfloat16)
        a, b = local.attend(qb), sharded.attend(qb)
        assert b.dtype == ml_dtypes.bfloat16
        assert _max_err(a, b) <= 2 ** -7  # within one bfloat16 rounding of each other


@needs_ray
def test_multi_layer_one_round_trip(caches):
    """num_layers=3: one call with a leading layer axis serves every layer; layer=i one."""
    rng = np.random.default_rng(11)
    NL, B, H, Hkv, D, C, S, T = 3, 2, 4, 2, 8, 32, 2, 40
    sharded = caches(batch=B, kv_heads=Hkv, head_dim=D, capacity_per_shard=C, num_shards=S,
                     num_layers=NL)
    locals_ = [af.KVCache(B, Hkv, D, C * S) for _ in range(NL)]
    for t in (T, 1, 1, 1):
        q = _rand(rng, (NL, B, H, t, D))
        k = _rand(rng, (NL, B, Hkv, t, D))
        v = _rand(rng, (NL, B, Hkv, t, D))
        o = sharded.step(q, k, v, window=(30, -1))
        assert o.shape == (NL, B, H, t, D)
        for li in range(NL):
            assert _max_err(o[li], locals_[li].step(q[li], k[li], v[li], window=(30, -1))) <= EXACT
    assert sharded.lengths.tolist() == [[T + 3] * B] * NL
    k = _rand(rng, (B, Hkv, 1, D))
    q = _rand(rng, (B, H, 1, D))
    o = sharded.step(q, k, k, layer=1)
    assert _max_err(o, locals_[1].step(q, k, k)) <= EXACT
    assert sharded.lengths[:, 0].tolist() == [T + 3, T + 4, T + 3]
    with pytest.raises(ValueError, match="layer must be in"):
        sharded.attend(q, layer=3)
    with pytest.raises(ValueError, match="5-D"):
        sharded.attend(q)


@needs_ray
def test_mask_sliced_per_shard(caches):
    rng = np.random.default_rng(5)
    B, H, Hkv, D, C, S, T = 2, 4, 2, 8, 24, 3, 60
    sharded = caches(batch=B, kv_heads=Hkv, head_dim=D, capacity_per_shard=C, num_shards=S)
    local = af.KVCache(B, Hkv, D, C * S)
    k = _rand(rng, (B, Hkv, T, D))
    q = _rand(rng, (B, H, 1, D))
    for c in (sharded, local):
        c.append(k, k)
    keep = rng.random((B, 1, 1, C * S)) > 0.3
    additive = rng.standard_normal((1, H, 1, C * S)).astype(np.float32)
    for mask in (keep, additive):
        a, la = local.attend(q, mask=mask, return_lse=True)
        b, lb = sharded.attend(q, mask=mask, return_lse=True)
        assert _max_err(a, b) <= EXACT and _max_err(la, lb) <= EXACT


@needs_ray
def test_dead_shard_gives_a_clear_error(ray_runtime):
    from attnfast.distributed import ShardError, ShardedKVCache
    rng = np.random.default_rng(1)
    cache = ShardedKVCache(1, 2, 8, 16, 2)
    try:
        k = _rand(rng, (1, 2, 20, 8))
        q = _rand(rng, (1, 2, 1, 8))
        cache.append(k, k)
        before = cache.attend(q)
        ray_runtime.kill(cache.actors[1])
        with pytest.raises(ShardError, match=r"shard 1 of 2 \(actor [0-9a-f]+\) died") as info:
            cache.step(q, k[:, :, :1], k[:, :, :1])
        assert info.value.shard == 1 and isinstance(info.value, RuntimeError)
        assert cache.lengths.tolist() == [20]  # the failed step did not count
        with pytest.raises(ShardError, match="shard 1 of 2"):
            cache.attend(q)
        # a window reaching only shard 0 still works: shard 1 is not asked
        assert before.shape == cache.attend(q[:, :, :, :], window=(0, 0),
                                            query_offset=3).shape
    finally:
        cache.close()
    with pytest.raises(RuntimeError, match="closed"):
        cache.attend(q)


@needs_ray
def test_failed_call_rolls_back_the_shards_that_wrote(caches):
    """A shard that wrote a call's tokens while another failed holds them no longer once
    the next call arrives (simulated: the merge of the first call raises)."""
    from attnfast import distributed
    rng = np.random.default_rng(2)
    sharded = caches(batch=1, kv_heads=1, head_dim=8, capacity_per_shard=16, num_shards=2)
    local = af.KVCache(1, 1, 8, 32)
    k = _rand(rng, (1, 1, 14, 8))
    for c in (sharded, local):
        c.append(k, k)
    original = sharded._gather

    def failing(jobs):
        original(jobs)  # every shard wrote ...
        raise distributed.ShardError("simulated", 1, None)  # ... but the call failed
    sharded._gather = failing
    try:
        with pytest.raises(distributed.ShardError, match="simulated"):
            sharded.append(_rand(rng, (1, 1, 4, 8)), _rand(rng, (1, 1, 4, 8)))
    finally:
        del sharded._gather
    assert sharded.lengths.tolist() == [14]
    q = _rand(rng, (1, 1, 1, 8))
    assert _max_err(sharded.attend(q), local.attend(q)) <= EXACT
    assert sharded.shard_lengths()[:, 0, 0].tolist() == [14, 0]


@needs_ray
def test_bad_input_is_rejected_before_anything_is_sent(caches):
    rng = np.random.default_rng(4)
    B, H, Hkv, D, C, S = 2, 4, 2, 8, 16, 2
    sharded = caches(batch=B, kv_heads=Hkv, head_dim=D, capacity_per_shard=C, num_shards=S)
    k = _rand(rng, (B, Hkv, 30, D))
    sharded.append(k, k)
    held = sharded.shard_lengths().tolist()
    sent = []
    original = sharded._gather
    sharded._gather = lambda jobs: sent.append(jobs) or original(jobs)
    q = _rand(rng, (B, H, 1, D))
    bad = [
        (ValueError, "cache full", lambda: sharded.append(k[:, :, :3], k[:, :, :3])),
        (ValueError, "cache full", lambda: sharded.step(q, k[:, :, :3], k[:, :, :3])),
        (ValueError, "k_new", lambda: sharded.step(q, k[:, :1, :1], k[:, :1, :1])),
        (ValueError, "head dim", lambda: sharded.attend(q[..., :4])),
        (TypeError, "dtype", lambda: sharded.attend(q.astype(np.float16))),
        (ValueError, "axis 0", lambda: sharded.attend(q[:1])),
        (ValueError, "batch_index", lambda: sharded.attend(q, batch_index=[0, 5])),
        (ValueError, "window", lambda: sharded.attend(q, window=(-3, 0))),
        (ValueError, "sinks", lambda: sharded.attend(q, sinks=np.zeros(3, np.float32))),
        (ValueError, "mask", lambda: sharded.attend(q, mask=np.ones((1, 1, 1, 31), bool))),
        (ValueError, "out", lambda: sharded.attend(q, out=np.zeros((1, 1), np.float32))),
        (ValueError, "truncate", lambda: sharded.truncate(31)),
        (ValueError, "layer", lambda: sharded.attend(q, layer=1)),
        (TypeError, "layer", lambda: sharded.attend(q, layer=0.0)),
    ]
    try:
        for error, match, call in bad:
            with pytest.raises(error, match=match):
                call()
    finally:
        del sharded._gather
    assert sent == []
    assert sharded.lengths.tolist() == [30, 30]
    assert sharded.shard_lengths().tolist() == held


@needs_ray
def test_constructor_checks_and_context_manager(ray_runtime):
    from attnfast.distributed import ShardedKVCache
    for args, kwargs, error in [((1, 1, 8, 16, 0), {}, ValueError),
                                ((1, 1, 8, 16, 1.5), {}, TypeError),
                                ((1, 1, 8, 0, 2), {}, ValueError),
                                ((1, 1, 8, 16, 2), {"dtype": np.int32}, TypeError),
                                ((1, 1, 8, 16, 2), {"actor_options": [{}]}, ValueError),
                                ((1, 1, 8, 16, 2), {"timeout": 0}, ValueError),
                                ((1, 1, 8, 16, 2), {"num_layers": 0}, ValueError)]:
        with pytest.raises(error):
            ShardedKVCache(*args, **kwargs)
    with ShardedKVCache(1, 1, 8, 16, 2, actor_options={"num_cpus": 0}) as cache:
        actors = cache.actors
        assert cache.capacity == 32 and "num_shards=2" in repr(cache)
        ray_runtime.get([a.ping.remote() for a in actors])
    with pytest.raises(ray_runtime.exceptions.RayActorError):
        ray_runtime.get(actors[0].ping.remote(), timeout=30)
