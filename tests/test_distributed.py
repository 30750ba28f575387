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


def _wait_dead(ray, actor, seconds=30):
    """ray.kill is asynchronous: wait until the actor's calls fail as a dead actor's."""
    import time
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=seconds)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    pytest.fail(f"actor {actor} still answers {seconds} s after it was killed")


def _rand(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def _max_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    both_inf = np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b))
    return float(np.max(np.where(both_inf, 0.0, np.abs(a - b)), initial=0.0))


# Two cache specs shared by most tests (each new cache starts its actors: ~1 s each).
SPEC_2 = dict(batch=2, kv_heads=2, head_dim=16, capacity_per_shard=96, num_shards=2)
SPEC_4 = dict(batch=3, kv_heads=1, head_dim=8, capacity_per_shard=48, num_shards=4,
              v_head_dim=24)  # MQA, Dv != D

CASES = {
    # name: (spec, H, prompt, options)
    "gqa-2shards": (SPEC_2, 8, 100, {}),
    "softcap-alibi-sinks-2shards": (SPEC_2, 8, 100, dict(softcap=4.0, sinks="h",
                                                         alibi_slopes="h")),
    "mqa-dv-4shards": (SPEC_4, 4, 100, {}),
    "window-4shards": (SPEC_4, 6, 100, dict(window=(37, -1))),
    "window-both-sides-sinks-4shards": (SPEC_4, 4, 70, dict(window=(20, 3), sinks="h")),
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
    spec, H, T, options = CASES[case]
    rng = np.random.default_rng(len(case))
    options = _options(options, H, rng)
    B, Hkv, D, C, S = (spec[n] for n in ("batch", "kv_heads", "head_dim", "capacity_per_shard",
                                         "num_shards"))
    Dv = spec.get("v_head_dim", D)
    steps = 50
    sharded = caches(**spec)
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
    B, H, Hkv, D, Dv, C, S = 3, 4, 1, 8, 24, 48, 4
    sharded = caches(**SPEC_4)
    local = af.KVCache(B, Hkv, D, C * S, v_head_dim=Dv)
    for c in (sharded, local):
        c.append(np.zeros((B, Hkv, 5, D), np.float32) + 0.5, np.ones((B, Hkv, 5, Dv), np.float32))
    for seqs, t in (([0], 40), ([1, 2], 27), ([2], 31), ([0, 2], 3)):
        k = _rand(rng, (len(seqs), Hkv, t, D))
        v = _rand(rng, (len(seqs), Hkv, t, Dv))
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
    v = _rand(rng, (B, Hkv, 2, Dv))
    q = _rand(rng, (B, H, 2, D))
    a, la = local.step(q, k, v, return_lse=True)
    b, lb = sharded.step(q, k, v, return_lse=True)
    assert _max_err(a, b) <= EXACT and _max_err(la, lb) <= EXACT
    assert sharded.shard_lengths()[:, 0].tolist() == [[35, 9, 48], [0, 0, 18], [0, 0, 0],
                                                     [0, 0, 0]]
    # an empty cache: zeros and lse = -inf, as KVCache
    sharded.reset()
    o, lse = sharded.attend(q, return_lse=True)
    assert np.all(o == 0) and np.all(lse == -np.inf)


@needs_ray
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, "int8", np.float64])
def test_storage_dtypes(caches, dtype):
    rng = np.random.default_rng(3)
    B, H, Hkv, D, C, S, T = 1, 4, 2, 16, 40, 2, 60  # keys in both shards
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


# Quantised storage: the shards quantise the float rows that land in them. head_dim 16 and
# v_head_dim 24 are not the length of an int4 row (20 bytes: one packed block), so the
# caller's checks must use the head dims, not the stored rows' length.
QUANTISED = {"int4": "int4", "float8": ml_dtypes.float8_e4m3fn, "float8_e5m2": "float8_e5m2"}
QUANT_SPEC = dict(batch=2, kv_heads=2, head_dim=16, v_head_dim=24, capacity_per_shard=32,
                  num_shards=2)


def _quantised_pair(caches, name):
    """The sharded cache of QUANT_SPEC with this storage, and an empty one-process KVCache
    of the same dtype and whole capacity."""
    spec = dict(QUANT_SPEC, dtype=QUANTISED[name])
    sharded = caches(**spec)
    local = af.KVCache(spec["batch"], spec["kv_heads"], spec["head_dim"],
                       spec["capacity_per_shard"] * spec["num_shards"], dtype=QUANTISED[name],
                       v_head_dim=spec["v_head_dim"])
    return sharded, local


@needs_ray
@pytest.mark.parametrize("name", sorted(QUANTISED))
def test_quantised_storage_matches_one_process(caches, name):
    """int4 / float8_e4m3fn shards: append (a prompt crossing the shard boundary), step
    (float32, float16 and bfloat16 new rows) and attend equal a one-process KVCache of the
    same dtype holding the same tokens, to float32 rounding of the merge."""
    rng = np.random.default_rng(17)
    sharded, local = _quantised_pair(caches, name)
    B, Hkv, D, Dv, H, T = 2, 2, 16, 24, 4, 45  # keys in both shards (32 per shard)
    assert sharded.dtype == local.dtype
    assert (f"dtype='{name}'" if name == "int4" else "float8") in repr(sharded)
    k, v = _rand(rng, (B, Hkv, T, D)), _rand(rng, (B, Hkv, T, Dv))
    for c in (sharded, local):
        c.append(k, v)
    q = _rand(rng, (B, H, 5, D))
    a, la = local.attend(q, return_lse=True)
    b, lb = sharded.attend(q, return_lse=True)
    assert b.shape == (B, H, 5, Dv) and b.dtype == np.float32
    assert _max_err(a, b) <= EXACT and _max_err(la, lb) <= EXACT
    # the shards really store the quantised format: not the float32 attention
    exact = af.KVCache(B, Hkv, D, 64, v_head_dim=Dv)
    exact.append(k, v)
    assert _max_err(b, exact.attend(q)) > 1e-3
    for new_dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        kt, vt = _rand(rng, (B, Hkv, 1, D), new_dtype), _rand(rng, (B, Hkv, 1, Dv), new_dtype)
        qt = _rand(rng, (B, H, 1, D))
        a, la = local.step(qt, kt, vt, return_lse=True)
        b, lb = sharded.step(qt, kt, vt, return_lse=True)
        assert _max_err(a, b) <= EXACT and _max_err(la, lb) <= EXACT
    # one sequence only (batch_index), a chunk of 3 with a window, then attend
    kt, vt = _rand(rng, (1, Hkv, 3, D)), _rand(rng, (1, Hkv, 3, Dv))
    qt = _rand(rng, (1, H, 3, D))
    a = local.step(qt, kt, vt, batch_index=1, window=(20, -1))
    b = sharded.step(qt, kt, vt, batch_index=1, window=(20, -1))
    assert _max_err(a, b) <= EXACT
    assert sharded.lengths.tolist() == local.lengths.tolist() == [T + 3, T + 6]
    assert sharded.shard_lengths()[:, 0].tolist() == [[32, 32], [T + 3 - 32, T + 6 - 32]]
    q = _rand(rng, (B, H, 2, D))
    assert _max_err(local.attend(q), sharded.attend(q)) <= EXACT
    # a 16-bit q: widened on the shards, one rounding at the end (as the bfloat16 cache test)
    qb = q[:, :, -1:].astype(ml_dtypes.bfloat16)
    a, b = local.attend(qb), sharded.attend(qb)
    assert b.dtype == a.dtype == ml_dtypes.bfloat16
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.abs(a - b) <= 2 ** -7 * np.maximum(1.0, np.abs(a)))


@needs_ray
def test_int4_bad_input_writes_nothing(caches):
    """An int4 sharded cache rejects what KVCache(dtype="int4") rejects, with its error,
    before anything is sent: no shard is called and nothing is written."""
    from attnfast import _int4
    rng = np.random.default_rng(19)
    sharded, local = _quantised_pair(caches, "int4")
    B, Hkv, D, Dv, H, T = 2, 2, 16, 24, 4, 60
    k, v = _rand(rng, (B, Hkv, T, D)), _rand(rng, (B, Hkv, T, Dv))
    for c in (sharded, local):
        c.append(k, v)
    q = _rand(rng, (B, H, 1, D))
    before = sharded.attend(q)
    assert _max_err(before, local.attend(q)) <= EXACT
    held = sharded.shard_lengths().tolist()
    k1, v1 = k[:, :, :1], v[:, :, :1]
    bad = [
        (TypeError, "int4 cache must be float32, float16 or bfloat16",
         lambda c: c.append(k1.astype(np.float64), v1.astype(np.float64))),
        (TypeError, "int4 cache must be float32, float16 or bfloat16",
         lambda c: c.step(q, k1.astype(np.float64), v1.astype(np.float64))),
        (TypeError, "k_new must be", lambda c: c.append(_int4.quantize(k1), _int4.quantize(v1))),
        (TypeError, "k_new must be", lambda c: c.append(k1.astype(np.int8), v1)),
        (TypeError, "share a dtype", lambda c: c.append(k1, v1.astype(ml_dtypes.bfloat16))),
        (ValueError, "k_new must have shape", lambda c: c.append(k1[..., :8], v1)),
        (ValueError, "k_new must have shape", lambda c: c.step(q, k1[:, :, :, :8], v1)),
        (ValueError, "v_new must have shape", lambda c: c.step(q, k1, v1[..., :16])),
        (ValueError, "cache full", lambda c: c.append(k[:, :, :5], v[:, :, :5])),
        (ValueError, "cache full", lambda c: c.step(q, k[:, :, :5], v[:, :, :5])),
        (TypeError, "dtype", lambda c: c.attend(q.astype(np.float64))),
        (ValueError, "head dim", lambda c: c.attend(q[..., :8])),
    ]
    sent = []
    original = sharded._gather
    sharded._gather = lambda jobs: sent.append(jobs) or original(jobs)
    try:
        for error, match, call in bad:
            for c in (sharded, local):  # the same error from both
                with pytest.raises(error, match=match):
                    call(c)
    finally:
        del sharded._gather
    assert sent == []
    assert sharded.lengths.tolist() == local.lengths.tolist() == [T, T]
    assert sharded.shard_lengths().tolist() == held
    after = sharded.attend(q)
    assert np.array_equal(after, before) and _max_err(after, local.attend(q)) <= EXACT


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
    B, H, Hkv, D, C, S, T = 2, 4, 2, 16, 96, 2, 150
    sharded = caches(**SPEC_2)
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
        _wait_dead(ray_runtime, cache.actors[1])
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
    sharded = caches(**SPEC_2)
    local = af.KVCache(2, 2, 16, 192)
    k = _rand(rng, (2, 2, 94, 16))
    for c in (sharded, local):
        c.append(k, k)
    original = sharded._gather

    def failing(jobs):
        original(jobs)  # every shard wrote ...
        raise distributed.ShardError("simulated", 1, None)  # ... but the call failed
    sharded._gather = failing
    try:
        with pytest.raises(distributed.ShardError, match="simulated"):
            sharded.append(_rand(rng, (2, 2, 4, 16)), _rand(rng, (2, 2, 4, 16)))
    finally:
        del sharded._gather
    assert sharded.lengths.tolist() == [94, 94]
    q = _rand(rng, (2, 4, 1, 16))
    assert _max_err(sharded.attend(q), local.attend(q)) <= EXACT
    assert sharded.shard_lengths()[:, 0].tolist() == [[94, 94], [0, 0]]


@needs_ray
def test_bad_input_is_rejected_before_anything_is_sent(caches):
    rng = np.random.default_rng(4)
    B, H, Hkv, D = 2, 4, 2, 16
    sharded = caches(**SPEC_2)
    k = _rand(rng, (B, Hkv, 190, D))
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
        (ValueError, "mask", lambda: sharded.attend(q, mask=np.ones((1, 1, 1, 191), bool))),
        (ValueError, "out", lambda: sharded.attend(q, out=np.zeros((1, 1), np.float32))),
        (ValueError, "truncate", lambda: sharded.truncate(191)),
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
    assert sharded.lengths.tolist() == [190, 190]
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
    for a in actors:
        _wait_dead(ray_runtime, a)


@needs_ray
def test_compiled_graph_matches_and_names_a_dead_shard(ray_runtime):
    """compiled=True: decode through a Ray compiled graph, prefill through ordinary calls;
    the same results, and a killed actor still gives the error naming its shard."""
    from attnfast.distributed import ShardError, ShardedKVCache
    rng = np.random.default_rng(9)
    B, H, Hkv, D, C, S, T = 1, 4, 2, 16, 2048, 2, 2100  # the prompt's K/V: a large request
    local = af.KVCache(B, Hkv, D, C * S)
    cache = ShardedKVCache(B, Hkv, D, C, S, compiled=True)
    try:
        k = _rand(rng, (B, Hkv, T, D))
        q = _rand(rng, (B, H, 8, D))
        assert _max_err(cache.step(q, k, k), local.step(q, k, k)) <= EXACT
        assert cache._dag is not None
        for _ in range(10):
            kt, qt = _rand(rng, (B, Hkv, 1, D)), _rand(rng, (B, H, 1, D))
            assert _max_err(cache.step(qt, kt, kt, window=(100, -1)),
                            local.step(qt, kt, kt, window=(100, -1))) <= EXACT
        ray_runtime.kill(cache.actors[0])
        _wait_dead(ray_runtime, cache.actors[0])
        with pytest.raises(ShardError, match=r"shard 0 of 2 \(actor [0-9a-f]+\) died"):
            cache.step(qt, kt, kt)
        assert cache.lengths.tolist() == [T + 10]
    finally:
        cache.close()
