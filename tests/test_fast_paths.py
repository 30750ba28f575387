"""The per-layout fast paths (attnfast._plans): a call shaped like one already
accepted skips the full checks. Each test here first makes the fast path ready (a good call
of the same layout), then checks that what must not take it still gets exactly the error of
the full path (same type, same message) and writes nothing, and that what takes it gives the
full path's result bit for bit and keeps the Ctrl-C rule (lengths restored).
"""
import signal
import threading

import numpy as np
import pytest

import attnfast as af
from attnfast import _api, _kvcache, _plans
from reference import TOLERANCE, reference_attention

B, H, HKV, D, C = 2, 4, 2, 16, 24


def normal(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def clear_plans():
    _plans.ATTENTION_PLANS.clear()
    _plans.KVCACHE_PLANS.clear()


@pytest.fixture(autouse=True)
def _fresh_plans():
    clear_plans()
    yield
    clear_plans()
    af.set_num_threads(None)


def full_path_error(call):
    """The exception the full path raises for `call` (no plan in the memos)."""
    clear_plans()
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    return type(info.value), str(info.value)


def assert_same_error(warm, bad, state=None):
    """`bad` raises the full path's error (type and message) after `warm` made its layout's
    plan, and changes nothing that `state()` sees."""
    expected = full_path_error(bad)
    warm()
    assert _plans.ATTENTION_PLANS or _plans.KVCACHE_PLANS, "the good call stored no plan"
    before = state() if state is not None else None
    with pytest.raises(expected[0]) as info:
        bad()
    assert str(info.value) == expected[1]
    if state is not None:
        assert state() == before, "a rejected call changed the cache"


def forbid_full_checks(monkeypatch):
    """From here on, a call that runs the full checks fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the full checks ran: the fast path was not taken")
    for module, name in ((_api, "check_attention"), (_kvcache, "caller_caches"),
                         (_kvcache, "check_kvcache_attention"),
                         (_kvcache, "check_paged_kvcache_attention")):
        monkeypatch.setattr(module, name, refuse)


def cache_with(rng, held=5, dtype=np.float32):
    cache = af.KVCache(B, HKV, D, C, dtype=dtype)
    cache.append(normal(rng, B, HKV, held, D, dtype=dtype), normal(rng, B, HKV, held, D, dtype=dtype))
    return cache


def cache_state(cache):
    return cache.k.tobytes(), cache.v.tobytes(), cache.lengths.tolist()


# ---------------------------------------------------------------- the fast path is taken

def test_repeat_calls_take_a_plan_and_give_the_full_paths_bits(rng):
    q = normal(rng, B, H, 1, D)
    k, v = normal(rng, B, HKV, 9, D), normal(rng, B, HKV, 9, D)
    first = af.attention(q, k, v, causal=True)  # full path; stores the plan
    assert len(_plans.ATTENTION_PLANS) == 1
    calls = []
    real = _api.check_attention
    try:
        _api.check_attention = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        again = af.attention(q, k, v, causal=True)
    finally:
        _api.check_attention = real
    assert calls == [], "the repeat call ran the full checks"
    np.testing.assert_array_equal(first, again)
    ref = reference_attention(q, k, v, causal=True)[0]
    np.testing.assert_allclose(again, ref, **TOLERANCE[np.dtype(np.float32)])


def test_a_cache_growing_by_a_token_keeps_its_plan(rng, monkeypatch):
    """transformers' DynamicCache hands attention() new C-contiguous k and v one key longer
    each decode step: one plan serves every length (its key leaves the key count out), and
    each step gives the full path's bits and float64's answer, the window bounded by that
    step's keys."""
    q = normal(rng, B, H, 1, D)
    keys, values = normal(rng, B, HKV, 20, D), normal(rng, B, HKV, 20, D)
    steps = [(np.ascontiguousarray(keys[:, :, :n]), np.ascontiguousarray(values[:, :, :n]))
             for n in range(6, 20)]
    opts = dict(causal=True, window=(4, 0))
    full = []
    for k, v in steps:
        clear_plans()
        full.append(af.attention(q, k, v, **opts))
    clear_plans()
    out = np.zeros((B, H, 1, D), np.float32)
    af.attention(q, *steps[0], out=out, **opts)  # stores the plan
    forbid_full_checks(monkeypatch)
    for (k, v), want in zip(steps, full):
        got = af.attention(q, k, v, out=out, **opts)
        assert got is out
        np.testing.assert_array_equal(got, want)
        ref = reference_attention(q, k, v, **opts)[0]
        np.testing.assert_allclose(got, ref, **TOLERANCE[np.dtype(np.float32)])
    assert len(_plans.ATTENTION_PLANS) == 1


def test_fast_kvcache_step_equals_the_full_path(rng, monkeypatch):
    a, b = cache_with(rng), cache_with(rng)
    b.k[...], b.v[...] = a.k, a.v
    toks = [(normal(rng, B, H, 1, D), normal(rng, B, HKV, 1, D), normal(rng, B, HKV, 1, D))
            for _ in range(4)]
    for q, kn, vn in toks:       # a: plans cleared before every call (always the full path)
        clear_plans()
        out_full = a.step(q, kn, vn)
    clear_plans()
    b.step(*toks[0])             # b: the first call stores the plan, the rest use it
    b.truncate(b.lengths - 1)
    forbid_full_checks(monkeypatch)
    for q, kn, vn in toks:
        out_fast = b.step(q, kn, vn)
    assert _plans.KVCACHE_PLANS
    np.testing.assert_array_equal(out_full, out_fast)
    assert cache_state(a) == cache_state(b)
    monkeypatch.undo()
    full = a.attend(toks[0][0])
    b.attend(toks[0][0])
    forbid_full_checks(monkeypatch)
    np.testing.assert_array_equal(full, b.attend(toks[0][0]))


def test_fast_attention_with_kvcache_equals_the_full_path(rng, monkeypatch):
    kc, vc = normal(rng, B, HKV, C, D), normal(rng, B, HKV, C, D)
    kc2, vc2 = kc.copy(), vc.copy()
    for seqlens in (np.array([3, 7]), 4):
        for step in range(3):
            q, kn, vn = normal(rng, B, H, 1, D), normal(rng, B, HKV, 1, D), normal(rng, B, HKV, 1, D)
            monkeypatch.undo()
            clear_plans()
            full = af.attention_with_kvcache(q, kc, vc, seqlens + step, kn, vn)
            if step == 0:
                af.attention_with_kvcache(q, kc2, vc2, seqlens + step, kn, vn)  # stores the plan
                assert _plans.KVCACHE_PLANS
            forbid_full_checks(monkeypatch)
            fast = af.attention_with_kvcache(q, kc2, vc2, seqlens + step, kn, vn)
            np.testing.assert_array_equal(full, fast)
            np.testing.assert_array_equal(kc, kc2)
            np.testing.assert_array_equal(vc, vc2)


def test_plans_are_bounded():
    rng = np.random.default_rng(0)
    k = normal(rng, 1, 1, 3, 4)
    for t in range(_plans._PLAN_LIMIT + 5):
        af.attention(normal(rng, 1, 1, t + 1, 4), k, k)
    assert 0 < len(_plans.ATTENTION_PLANS) <= _plans._PLAN_LIMIT


# ---------------------------------------------------------------- ... and must not be taken

@pytest.mark.parametrize("case", [
    "q dtype", "q head dim", "q batch", "k_new tokens", "v_new dtype", "num_threads 0",
    "num_threads bool", "num_threads float", "scale bool", "scale negative", "causal 2",
    "window bool", "window negative", "query_offset huge", "query_offset float"])
def test_kvcache_step_after_a_good_call_still_rejects(rng, case):
    cache = cache_with(rng)
    q, kn, vn = normal(rng, B, H, 1, D), normal(rng, B, HKV, 1, D), normal(rng, B, HKV, 1, D)
    good = dict(scale=0.25, num_threads=1, window=(3, 0), query_offset=None)
    bad_args, bad_opts = (q, kn, vn), dict(good)
    if case == "q dtype":
        bad_args = (q.astype(np.float64), kn, vn)
    elif case == "q head dim":
        bad_args = (normal(rng, B, H, 1, D + 1), kn, vn)
    elif case == "q batch":
        bad_args = (normal(rng, B + 1, H, 1, D), kn, vn)
    elif case == "k_new tokens":
        bad_args = (q, normal(rng, B, HKV, 2, D), vn)
    elif case == "v_new dtype":
        bad_args = (q, kn, vn.astype(np.float64))
    else:
        name, value = {
            "num_threads 0": ("num_threads", 0), "num_threads bool": ("num_threads", True),
            "num_threads float": ("num_threads", 1.0), "scale bool": ("scale", True),
            "scale negative": ("scale", -0.25), "causal 2": ("causal", 2),
            "window bool": ("window", (True, 0)), "window negative": ("window", (3, -2)),
            "query_offset huge": ("query_offset", 2**63),
            "query_offset float": ("query_offset", 1.0)}[case]
        bad_opts[name] = value
    if case == "scale bool":
        good["scale"] = 1    # True == 1 and hashes alike: it must not find 1's plan
    if case == "window bool":
        good["window"] = (1, 0)
    assert_same_error(lambda: cache.step(q, kn, vn, **good),
                      lambda: cache.step(*bad_args, **bad_opts), lambda: cache_state(cache))


def test_kvcache_step_into_a_full_cache_after_good_steps(rng):
    cache = cache_with(rng, held=C - 2)
    q, kn, vn = normal(rng, B, H, 1, D), normal(rng, B, HKV, 1, D), normal(rng, B, HKV, 1, D)
    cache.step(q, kn, vn)
    cache.step(q, kn, vn)  # fast path; the cache is now full
    assert _plans.KVCACHE_PLANS
    before = cache_state(cache)
    with pytest.raises(ValueError, match="cache full"):
        cache.step(q, kn, vn)
    assert cache_state(cache) == before


def test_kvcache_step_into_a_read_only_cache_after_a_good_step(rng):
    cache = cache_with(rng)
    q, kn, vn = normal(rng, B, H, 1, D), normal(rng, B, HKV, 1, D), normal(rng, B, HKV, 1, D)
    cache.step(q, kn, vn)
    for name in ("k", "v"):
        getattr(cache, name).flags.writeable = False
        before = cache_state(cache)
        with pytest.raises(ValueError, match=rf"cache\.{name} is read-only"):
            cache.step(q, kn, vn)
        assert cache_state(cache) == before
        getattr(cache, name).flags.writeable = True
    cache.attend(q)  # attending reads only: fine on a read-only cache (as the full path)


def test_kvcache_attend_after_a_good_call_still_rejects(rng):
    cache = cache_with(rng)
    q = normal(rng, B, H, 1, D)
    assert_same_error(lambda: cache.attend(q), lambda: cache.attend(q.astype(np.float16)),
                      lambda: cache_state(cache))
    assert_same_error(lambda: cache.attend(q), lambda: cache.attend(q[:, :3]),
                      lambda: cache_state(cache))


def test_the_plan_of_one_cache_layout_does_not_serve_another(rng):
    """Same inputs, a cache of another dtype or capacity: its own checks decide."""
    q, kn, vn = normal(rng, B, H, 1, D), normal(rng, B, HKV, 1, D), normal(rng, B, HKV, 1, D)
    for other in (af.KVCache(B, HKV, D, C, dtype=np.float64), af.KVCache(B, HKV, D, 1)):
        other.append(np.zeros((B, HKV, 1, D), other.dtype), np.zeros((B, HKV, 1, D), other.dtype))
        assert_same_error(lambda: cache_with(rng).step(q, kn, vn),
                          lambda: other.step(q, kn, vn), lambda: cache_state(other))


@pytest.mark.parametrize("case", ["seqlens negative", "seqlens full", "seqlens shape",
                                  "seqlens float", "read-only k_cache", "read-only v_cache",
                                  "shared caches", "k_new without v_new", "q dtype",
                                  "num_threads 0"])
def test_attention_with_kvcache_after_a_good_call_still_rejects(rng, case):
    kc, vc = normal(rng, B, HKV, C, D), normal(rng, B, HKV, C, D)
    q, kn, vn = normal(rng, B, H, 1, D), normal(rng, B, HKV, 1, D), normal(rng, B, HKV, 1, D)
    seqlens = np.array([3, 5])
    args, opts = [q, kc, vc, seqlens, kn, vn], {}
    if case == "seqlens negative":
        args[3] = np.array([3, -1])
    elif case == "seqlens full":
        args[3] = np.array([3, C])
    elif case == "seqlens shape":
        args[3] = np.array([3, 5, 6])
    elif case == "seqlens float":
        args[3] = np.array([3.0, 5.0])
    elif case == "read-only k_cache":
        args[1] = kc.copy()
        args[1].flags.writeable = False
    elif case == "read-only v_cache":
        args[2] = vc.copy()
        args[2].flags.writeable = False
    elif case == "shared caches":
        args[2] = kc
    elif case == "k_new without v_new":
        args[5] = None
    elif case == "q dtype":
        args[0] = q.astype(np.float64)
    elif case == "num_threads 0":
        opts["num_threads"] = 0
    state = lambda: (kc.tobytes(), vc.tobytes())  # noqa: E731
    assert_same_error(lambda: af.attention_with_kvcache(q, kc, vc, seqlens, kn, vn),
                      lambda: af.attention_with_kvcache(*args, **opts), state)


@pytest.mark.parametrize("case", ["q dtype", "k shape", "v head dim", "out shape",
                                  "out dtype", "out read-only", "out overlaps q",
                                  "out overlaps k", "causal 2", "scale bool", "window bool",
                                  "query_offset huge", "num_threads -1"])
def test_attention_after_a_good_call_still_rejects(rng, case):
    q, k, v = normal(rng, B, H, 1, D), normal(rng, B, HKV, 6, D), normal(rng, B, HKV, 6, D)
    out = np.zeros((B, H, 1, D), np.float32)
    good = dict(causal=True, scale=1, window=(1, 0), out=out)
    args, opts = [q, k, v], dict(good)
    if case == "q dtype":
        args[0] = q.astype(np.float64)
    elif case == "k shape":
        args[1] = normal(rng, B, HKV, 5, D)
    elif case == "v head dim":
        args[2] = normal(rng, B, HKV, 6, D + 1)
    elif case == "out shape":
        opts["out"] = np.zeros((B, H, 2, D), np.float32)
    elif case == "out dtype":
        opts["out"] = np.zeros((B, H, 1, D), np.float64)
    elif case == "out read-only":
        opts["out"] = np.zeros((B, H, 1, D), np.float32)
        opts["out"].flags.writeable = False
    elif case == "out overlaps q":
        opts["out"] = args[0] = np.zeros((B, H, 1, D), np.float32)
    elif case == "out overlaps k":  # the layout of a fresh out, in k's memory
        opts["out"] = k.reshape(-1)[:out.size].reshape(out.shape)
    elif case == "causal 2":
        opts["causal"] = 2
    elif case == "scale bool":
        opts["scale"] = True
    elif case == "window bool":
        opts["window"] = (True, 0)
    elif case == "query_offset huge":
        opts["query_offset"] = -(2**62) - 1
    elif case == "num_threads -1":
        opts["num_threads"] = -1
    assert_same_error(lambda: af.attention(q, k, v, **good), lambda: af.attention(*args, **opts))


# ---------------------------------------------------------------- Ctrl-C on the fast paths

class _Interrupted:
    """Where the kernels run, on every path: stands in for attnfast._ext.run_attention (the
    full path) and is the C tails' hook (_ext.fast_call_hooks): records `interruptible`,
    then raises KeyboardInterrupt as the kernels do when Ctrl-C stops them."""

    def __init__(self, monkeypatch):
        self.real, self.seen, self.armed = af._ext.run_attention, [], False
        monkeypatch.setattr(af._ext, "run_attention", self)
        monkeypatch.setitem(af._ext.fast_call_hooks, "before_kernels", self.hook)

    def hook(self, *, interruptible):
        self.seen.append(interruptible)
        if self.armed:
            raise KeyboardInterrupt("attnfast: interrupted")

    def __call__(self, *args, **kwargs):
        self.hook(interruptible=kwargs.get("interruptible"))
        return self.real(*args, **kwargs)


def test_ctrl_c_in_a_fast_step_restores_the_lengths(rng, monkeypatch, parent_sigint):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the disposition tested here
    cache = cache_with(rng)
    q, kn, vn = normal(rng, B, H, 1, D), normal(rng, B, HKV, 1, D), normal(rng, B, HKV, 1, D)
    cache.step(q, kn, vn)                   # stores the plan
    fake = _Interrupted(monkeypatch)
    fake.armed = True
    lengths = cache.lengths.tolist()
    with pytest.raises(KeyboardInterrupt):
        cache.step(q, kn, vn)
    assert cache.lengths.tolist() == lengths
    assert fake.seen == [True], "the fast path did not run, or not interruptibly"
    fake.armed = False
    cache.step(q, kn, vn)                   # and the cache goes on from there
    assert cache.lengths.tolist() == [n + 1 for n in lengths]


def test_fast_paths_are_interruptible_only_under_the_default_handler(rng, monkeypatch,
                                                                   parent_sigint):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the disposition tested first
    cache = cache_with(rng)
    q, kn, vn = normal(rng, B, H, 1, D), normal(rng, B, HKV, 1, D), normal(rng, B, HKV, 1, D)
    kc, vc = normal(rng, B, HKV, C, D), normal(rng, B, HKV, C, D)
    calls = [lambda: cache.attend(q), lambda: af.attention(q, kc, vc),
             lambda: af.attention_with_kvcache(q, kc, vc, 3, kn, vn)]
    for call in calls:
        call()                              # store the plans
    fake = _Interrupted(monkeypatch)
    for call in calls:
        call()
    assert fake.seen == [True] * 3
    fake.seen.clear()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for call in calls:
            call()
    finally:
        signal.signal(signal.SIGINT, previous)
    thread = threading.Thread(target=lambda: [call() for call in calls])
    thread.start()
    thread.join()
    assert fake.seen == [False] * 6


# ---------------------------------------------------------------- torch tensors

def test_torch_tensors_after_a_good_call_keep_every_check(rng):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(normal(rng, B, h, t, D)) for h, t in ((H, 1), (HKV, 6), (HKV, 6)))
    af.attention(q, k, v)                  # converts x.numpy() directly; stores the plan
    with pytest.raises(ValueError, match=r"^k requires grad"):
        af.attention(q, k.clone().requires_grad_(True), v)
    with torch.no_grad():                  # x.numpy() would succeed here: attnfast must not
        with pytest.raises(ValueError, match=r"^k requires grad"):
            af.attention(q, k.clone().requires_grad_(True), v)
    with pytest.raises(TypeError, match=r"^v is a torch tensor with layout torch.sparse_coo"):
        af.attention(q, k, v.to_sparse())
    with pytest.raises(TypeError, match=r"^q must be float32, .* got dtype complex64"):
        af.attention(q.to(torch.complex64), k, v)
    with pytest.raises(TypeError, match=r"^q has torch dtype torch.float8_e4m3fn, which"):
        af.attention(q.to(torch.float8_e4m3fn), k, v)  # a dtype NumPy lacks
    # a tensor with the negative bit (x.numpy() refuses it) is resolved, as before
    z = torch.complex(torch.zeros_like(v), -v)
    neg = torch.conj(z).imag               # == v, stored as -(-v) with the negative bit set
    assert neg.is_neg()
    np.testing.assert_array_equal(af.attention(q, k, neg).numpy(), af.attention(q, k, v).numpy())
    bf = [t.to(torch.bfloat16) for t in (q, k, v)]
    out = af.attention(*bf)
    assert out.dtype == torch.bfloat16 and af.attention(*bf).equal(out)


# ---------------------------------------------------------------- which options skip the checks

# Options a repeat call may take on the fast path; every other parameter, when given, must send
# the call through the full checks. A new parameter fails test_every_parameter_is_classified
# until it is added to one side (and, if full-path only, to the fast path's condition).
FAST = {"attention": {"q", "k", "v", "causal", "scale", "window", "out", "num_threads",
                      "query_offset"},
        "attention_with_kvcache": {"q", "k_cache", "v_cache", "cache_seqlens", "k_new", "v_new",
                                   "causal", "scale", "window", "num_threads", "query_offset"},
        "step": {"self", "q", "k_new", "v_new", "causal", "scale", "window", "num_threads",
                 "query_offset"},
        "attend": {"self", "q", "causal", "scale", "window", "num_threads", "query_offset"}}
SCORE = {"softcap": 30.0, "alibi_slopes": np.full(H, 0.5, np.float32),
         "sinks": np.zeros(H, np.float32), "return_lse": True}
INDEX = np.zeros((B, 1, 1), np.int32)  # key_index: every query sees key 0 only
FULL = {"attention": dict(SCORE, mask=np.ones((1, 6), bool), key_index=INDEX),
        "attention_with_kvcache": dict(SCORE, mask=np.ones((1, C), bool), return_lse=True,
                                       block_table=np.arange(B, dtype=np.int32)[:, None],
                                       out=np.zeros((B, H, 1, D), np.float32),
                                       k_scale=np.zeros((B, HKV, C), np.float32),
                                       v_scale=np.zeros((B, HKV, C), np.float32),
                                       tree_mask=np.ones((1, 1), bool),
                                       key_rotation="hadamard", v_head_dim=D, key_index=INDEX),
        "step": dict(SCORE, mask=np.ones((1, C), bool), batch_index=[0, 1],
                     out=np.zeros((B, H, 1, D), np.float32), tree_mask=np.ones((1, 1), bool),
                     key_index=INDEX),
        "attend": dict(SCORE, mask=np.ones((1, C), bool), batch_index=[0, 1],
                       out=np.zeros((B, H, 1, D), np.float32), tree_mask=np.ones((1, 1), bool),
                       key_index=INDEX)}


def _entry_points(rng):
    cache = cache_with(rng)
    q, kn, vn = normal(rng, B, H, 1, D), normal(rng, B, HKV, 1, D), normal(rng, B, HKV, 1, D)
    k, v = normal(rng, B, HKV, 6, D), normal(rng, B, HKV, 6, D)
    kc, vc = normal(rng, B, HKV, C, D), normal(rng, B, HKV, C, D)
    return {"attention": (af.attention, lambda **o: af.attention(q, k, v, **o)),
            "attention_with_kvcache": (af.attention_with_kvcache, lambda **o:
                                       af.attention_with_kvcache(q, kc, vc, 3, kn, vn, **o)),
            "step": (af.KVCache.step, lambda **o: cache.step(q, kn, vn, **o)),
            "attend": (af.KVCache.attend, lambda **o: cache.attend(q, **o))}


def test_every_parameter_is_classified(rng):
    import inspect
    for name, (fn, _) in _entry_points(rng).items():
        params = set(inspect.signature(fn).parameters)
        assert params == FAST[name] | set(FULL[name]), (
            f"{name}: classify {params ^ (FAST[name] | set(FULL[name]))} in FAST or FULL")


@pytest.mark.parametrize("entry", sorted(FULL))
def test_options_outside_the_fast_path_run_the_full_checks(rng, monkeypatch, entry):
    call = _entry_points(rng)[entry][1]
    call()                                  # the plan of the plain call
    assert _plans.ATTENTION_PLANS or _plans.KVCACHE_PLANS
    ran = []
    for module, name in ((_api, "check_attention"), (_kvcache, "caller_caches"),
                         (_kvcache, "check_kvcache_attention"),
                         (_kvcache, "check_paged_kvcache_attention")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _real=real, **kw: ran.append(1) or _real(*a, **kw))
    for option, value in FULL[entry].items():
        ran.clear()
        try:
            call(**{option: value})
        except (TypeError, ValueError, NotImplementedError):
            pass                            # e.g. k_scale for a float32 cache: rejected
        assert ran, f"{entry}({option}=...) skipped the full checks"
