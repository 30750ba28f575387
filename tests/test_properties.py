"""Property tests (hypothesis) of every public computation against tests/reference.py.

Profiles (ATTNFAST_HYPOTHESIS_PROFILE):
- "ci" (default): derandomized, so every run draws the same examples; the whole file takes
  about a minute on 2 cores.
- "long": >= 10^5 examples in total, random (new examples each run; failures are kept in
  build/hypothesis-db and replayed first). Its tests are marked slow, so they run
  only when asked for:
      ATTNFAST_HYPOTHESIS_PROFILE=long python -m pytest -m slow tests/test_properties.py
  (ATTNFAST_HYPOTHESIS_MAX_EXAMPLES=n sets the examples per test for a shorter soak;
  ATTNFAST_HYPOTHESIS_COUNT_FILE=path makes the state machines append their running count
  of finished examples to path every 100, for a soak that is stopped before it ends.)
"""
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

import ml_dtypes

import attnfast as af
from attnfast import _ext, _paged, _plans, _transaction
from reference import (TOLERANCE, float32_score_rounding, nan_leak_allowed, reference_attention,
                       reference_nonfinite_rows)

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much])
settings.register_profile("ci", derandomize=True, database=None, **_COMMON)
# The long profile keeps its failures under build/ (git-ignored) and replays them first.
_DB = DirectoryBasedExampleDatabase(os.path.join(os.path.dirname(__file__), os.pardir, "build",
                                                 "hypothesis-db"))
settings.register_profile("long", derandomize=False, database=_DB, **_COMMON)
PROFILE = os.environ.get("ATTNFAST_HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)
LONG = PROFILE == "long"
if LONG:
    # Never part of the default run (pyproject deselects -m slow).
    pytestmark = pytest.mark.slow


# ATTNFAST_HYPOTHESIS_MAX_EXAMPLES overrides the long profile's count per test (e.g. for a
# shorter soak run); the default gives 6 x 15k + 2 x 10k + 2 x 15k state-machine runs >= 10^5.
LONG_EXAMPLES = int(os.environ.get("ATTNFAST_HYPOTHESIS_MAX_EXAMPLES", "0")) or None


def examples(ci, long=15_000):
    """max_examples for one test under the active profile."""
    return settings(max_examples=(LONG_EXAMPLES or long) if LONG else ci)


DTYPES = [np.dtype(np.float32), np.dtype(np.float64)]
ISAS = _ext.runtime_info()["isa_available"]
LAYOUTS = ["contiguous", "transposed", "sliced", "reversed", "last_axis_strided"]


def laid_out(arr, layout):
    """A view with the values of the 4-D `arr` but the strides of `layout` (no copy is made
    from the view: attnfast must read the strides itself)."""
    if layout == "contiguous":
        return np.ascontiguousarray(arr)
    if layout == "transposed":    # (B, T, H, D) storage seen as (B, H, T, D)
        return np.ascontiguousarray(arr.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    if layout == "sliced":        # every other row and head of a larger buffer
        B, H, T, D = arr.shape
        buf = np.full((B, 2 * H, 2 * T, D + 3), 99.0, arr.dtype)
        buf[:, ::2, ::2, 1:D + 1] = arr
        return buf[:, ::2, ::2, 1:D + 1]
    if layout == "reversed":      # negative strides on T and H
        return np.ascontiguousarray(arr[:, ::-1, ::-1])[:, ::-1, ::-1]
    if layout == "last_axis_strided":
        B, H, T, D = arr.shape
        buf = np.full((B, H, T, 2 * D), 99.0, arr.dtype)
        buf[..., ::2] = arr
        return buf[..., ::2]
    raise AssertionError(layout)


def assert_close(actual, expected, dtype, what, rounding=0.0):
    """Within the dtype's tolerance of the float64 reference; for float32 also within
    `rounding` (an absolute tolerance per element, reference.float32_score_rounding), the
    error float32 scores may make, which outgrows the fixed one where scores are large."""
    tol = TOLERANCE[np.dtype(dtype)]
    atol = tol["atol"] + (np.asarray(rounding) if np.dtype(dtype) == np.float32 else 0.0)
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = np.abs(actual - expected)
    bad = ~(err <= atol + tol["rtol"] * np.abs(expected)) & ~(np.isnan(actual) & np.isnan(expected))
    if bad.any():
        worst = np.unravel_index(np.argmax(np.where(bad, err, -1.0)), err.shape)
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} elements out of tolerance; "
                             f"worst at {worst}: {actual[worst]!r} vs {expected[worst]!r} "
                             f"(atol there {np.broadcast_to(atol, err.shape)[worst]:.3g}, "
                             f"rtol {tol['rtol']:.3g})")


class forced_isa:
    """Run a block with kernel tier `name` forced, restoring automatic choice after."""
    def __init__(self, name):
        self.name = name

    def __enter__(self):
        _ext.force_isa(self.name)

    def __exit__(self, *exc):
        _ext.force_isa("")


@st.composite
def attention_problem(draw, max_t=40, finite=True):
    dtype = draw(st.sampled_from(DTYPES))
    rank = draw(st.sampled_from([2, 3, 4]))
    B = draw(st.integers(0, 2)) if rank == 4 else 1
    Hkv = draw(st.integers(1, 3)) if rank >= 3 else 1
    group = draw(st.one_of(st.integers(1, 3), st.just(0))) if rank >= 3 else 1  # 0: no heads
    H = Hkv * group
    # Tq <= 16 takes the decode path, longer the prefill tiling: draw both often.
    Tq = draw(st.one_of(st.integers(0, 16), st.integers(17, max_t)))
    Tk = draw(st.one_of(st.integers(0, 3), st.integers(0, max_t)))
    D = draw(st.one_of(st.integers(1, 9), st.integers(10, 40)))
    Dv = draw(st.one_of(st.just(D), st.integers(1, 24)))
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.tuples(st.integers(-1, Tk + 2), st.integers(-1, Tk + 2))))
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    seed = draw(st.integers(0, 2**32 - 1))
    layouts = [draw(st.sampled_from(LAYOUTS)) for _ in range(3)]
    rng = np.random.default_rng(seed)
    mag = draw(st.sampled_from([0.1, 1.0, 3.0]))
    q = (rng.standard_normal((B, H, Tq, D)) * mag).astype(dtype)
    k = (rng.standard_normal((B, Hkv, Tk, D)) * mag).astype(dtype)
    v = rng.standard_normal((B, Hkv, Tk, Dv)).astype(dtype)
    q, k, v = (laid_out(a, lay) for a, lay in zip((q, k, v), layouts))
    if rank < 4:  # drop leading axes (views keep the strides)
        q, k, v = (a[(0,) * (4 - rank)] for a in (q, k, v))
    return dict(q=q, k=k, v=v, causal=causal, window=window, scale=scale, dtype=dtype)


# ------------------------------------------------------------------ attention

@examples(ci=300)
@given(p=attention_problem(), isa=st.sampled_from(ISAS), threads=st.sampled_from([1, 2, 3]))
def test_attention_matches_reference_on_every_tier_and_thread_count(p, isa, threads):
    q, k, v, dtype = p["q"], p["k"], p["v"], p["dtype"]
    opts = dict(causal=p["causal"], window=p["window"], scale=p["scale"])
    before = [a.copy() for a in (q, k, v)]
    with forced_isa(isa):
        out, lse = af.attention(q, k, v, return_lse=True, num_threads=threads, **opts)
        results = {threads: (out, lse)}
        for n in {1, 2, 3} - {threads}:
            results[n] = af.attention(q, k, v, return_lse=True, num_threads=n, **opts)
    ref_out, ref_lse, ref_w = reference_attention(q, k, v, **opts)
    out_tol, lse_tol = float32_score_rounding(q, k, v, ref_w, ref_out, p["scale"])
    assert out.shape == ref_out.shape and out.dtype == dtype
    assert lse.shape == ref_lse.shape
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert_close(out, ref_out, dtype, "out", out_tol)
    # lse: -inf exactly where the row sees no key, close elsewhere.
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert_close(lse[fin], ref_lse[fin], dtype, "lse", lse_tol[fin])
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    for n, (o, s) in results.items():  # bit-identical for any thread count
        assert o.tobytes() == out.tobytes(), f"out differs between {threads} and {n} threads"
        assert s.tobytes() == lse.tobytes(), f"lse differs between {threads} and {n} threads"
    for a, b in zip((q, k, v), before):  # inputs untouched
        assert a.tobytes() == b.tobytes()


@examples(ci=100, long=10_000)
@given(p=attention_problem(max_t=24), out_layout=st.sampled_from(LAYOUTS))
def test_attention_out_argument_is_filled_and_returned(p, out_layout):
    q, k, v = p["q"], p["k"], p["v"]
    opts = dict(causal=p["causal"], window=p["window"], scale=p["scale"])
    expected = af.attention(q, k, v, **opts)
    shape4 = (1,) * (4 - expected.ndim) + expected.shape
    out = laid_out(np.full(shape4, 7.0, p["dtype"]), out_layout)[(0,) * (4 - expected.ndim)]
    got = af.attention(q, k, v, out=out, **opts)
    assert got is out
    assert np.array_equal(out, expected)


@examples(ci=100, long=10_000)
@given(p=attention_problem(max_t=20))
def test_attention_weights_match_reference(p):
    q, k = p["q"], p["k"]
    opts = dict(causal=p["causal"], window=p["window"], scale=p["scale"])
    w = af.attention_weights(q, k, **opts)
    _, _, ref_w = reference_attention(q, k, p["v"], **opts)
    assert w.shape == ref_w.shape and w.dtype == p["dtype"]
    assert_close(w, ref_w, p["dtype"], "weights")


# ------------------------------------------------------------------ non-finite rule

@examples(ci=250)
@given(p=attention_problem(max_t=40), isa=st.sampled_from(ISAS),
       threads=st.sampled_from([1, 2]), data=st.data())
def test_nonfinite_in_gives_nan_out_on_the_rows_that_see_it(p, isa, threads, data):
    q, k, v, dtype = p["q"], p["k"], p["v"], p["dtype"]  # views of fresh buffers
    assume(q.size + k.size + v.size > 0)
    for name, arr in (("q", q), ("k", k), ("v", v)):
        if arr.size == 0:
            continue
        for _ in range(data.draw(st.integers(0, 3), label=f"{name} poison count")):
            idx = tuple(data.draw(st.integers(0, s - 1)) for s in arr.shape)
            values = [np.nan] if name == "v" else [np.nan, np.inf, -np.inf]
            arr[idx] = data.draw(st.sampled_from(values), label=f"{name}{idx}")
    opts = dict(causal=p["causal"], window=p["window"], scale=p["scale"])
    with forced_isa(isa):
        out, lse = af.attention(q, k, v, return_lse=True, num_threads=threads, **opts)
    out_nan, lse_nan, sees_none = reference_nonfinite_rows(q, k, v, **opts)
    assert np.array_equal(np.isnan(lse), lse_nan), "lse NaN pattern"
    got = np.isnan(out)
    leak = nan_leak_allowed(out.shape, v, sees_none)
    assert np.all(got[out_nan]), "out NaN pattern"
    assert not np.any(got & ~out_nan & ~leak), "out NaN only where the rule (or its limit) says"
    assert np.all(np.isneginf(lse[sees_none])) and np.all(out[sees_none] == 0)
    # Rows untouched by the poison keep their exact values.
    clean_rows = ~out_nan.any(axis=-1) & ~sees_none & ~(leak & got).any(axis=-1)
    if clean_rows.any():
        finite = [np.nan_to_num(a) for a in (q, k, v)]
        with np.errstate(all="ignore"):   # poisoned rows (inf -> 1.8e308) are not compared
            ref_out, ref_lse, ref_w = reference_attention(*finite, **opts)
            out_tol, lse_tol = float32_score_rounding(*finite, ref_w, ref_out, p["scale"])
        ok = clean_rows & ~lse_nan
        assert_close(out[ok], ref_out[ok], dtype, "out of clean rows", out_tol[ok])
        assert_close(lse[ok], ref_lse[ok], dtype, "lse of clean rows", lse_tol[ok])


# ------------------------------------------------------------------ varlen

@examples(ci=120)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), Hkv=st.integers(1, 2),
       group=st.integers(1, 3), D=st.integers(1, 20), Dv=st.integers(1, 20),
       causal=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_varlen_matches_per_sequence_reference(data, dtype, Hkv, group, D, Dv, causal, seed):
    n = data.draw(st.integers(0, 4), label="sequences")
    lq = data.draw(st.lists(st.one_of(st.integers(0, 16), st.integers(17, 30)), min_size=n, max_size=n))
    lk = data.draw(st.lists(st.integers(0, 30), min_size=n, max_size=n))
    window = data.draw(st.one_of(st.none(), st.tuples(st.integers(-1, 8), st.integers(-1, 8))))
    threads = data.draw(st.sampled_from([1, 2, 3]))
    H = Hkv * group
    rng = np.random.default_rng(seed)
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int64)
    q = rng.standard_normal((cu_q[-1], H, D)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], Hkv, D)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], Hkv, Dv)).astype(dtype)
    out, lse = af.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window=window,
                                   return_lse=True, num_threads=threads)
    assert out.shape == (cu_q[-1], H, Dv) and lse.shape == (H, cu_q[-1])
    for b in range(n):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ro, rl, _ = reference_attention(q[sq].transpose(1, 0, 2), k[sk].transpose(1, 0, 2),
                                        v[sk].transpose(1, 0, 2), causal=causal, window=window)
        assert_close(out[sq].transpose(1, 0, 2), ro, dtype, f"out of sequence {b}")
        assert np.array_equal(np.isneginf(lse[:, sq]), np.isneginf(rl))
        fin = np.isfinite(rl)
        assert_close(lse[:, sq][fin], rl[fin], dtype, f"lse of sequence {b}")
    if threads != 1:
        o1, l1 = af.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window=window,
                                     return_lse=True, num_threads=1)
        assert o1.tobytes() == out.tobytes() and l1.tobytes() == lse.tobytes()


# ------------------------------------------------------------------ merge_attention_states

@examples(ci=150)
@given(p=attention_problem(max_t=40), data=st.data())
def test_merging_key_shards_equals_attention_over_all_keys(p, data):
    q, k, v, dtype = p["q"], p["k"], p["v"], p["dtype"]
    Tk = k.shape[-2]
    cuts = sorted(data.draw(st.lists(st.integers(0, Tk), max_size=4), label="cuts"))
    bounds = [0] + cuts + [Tk]
    scale = p["scale"]
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        o, s = af.attention(q, k[..., lo:hi, :], v[..., lo:hi, :], scale=scale, return_lse=True)
        outs.append(o), lses.append(s)
    out, lse = af.merge_attention_states(outs, lses)
    ref_out, ref_lse, _ = reference_attention(q, k, v, scale=scale)
    assert out.dtype == dtype and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    # Merging rounds once more than one pass: allow 4x the dtype's tolerance.
    tol = {key: 4 * val for key, val in TOLERANCE[np.dtype(dtype)].items()}
    np.testing.assert_allclose(out, ref_out, **tol)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], **tol)


# ------------------------------------------------------------------ attention_with_kvcache

@examples(ci=120)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), B=st.integers(1, 3), Hkv=st.integers(1, 2),
       group=st.integers(1, 3), D=st.integers(1, 16), Dv=st.integers(1, 16),
       capacity=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_attention_with_kvcache_matches_reference(data, dtype, B, Hkv, group, D, Dv, capacity, seed):
    H = Hkv * group
    t = data.draw(st.integers(0, min(capacity, 20)), label="new tokens")
    Tq = data.draw(st.one_of(st.integers(1, 16), st.integers(17, 24)), label="Tq")
    seqlens = np.array(data.draw(st.lists(st.integers(0, capacity - t), min_size=B, max_size=B)))
    causal = data.draw(st.booleans())
    window = data.draw(st.one_of(st.none(), st.tuples(st.integers(-1, 6), st.integers(-1, 6))))
    transposed = data.draw(st.booleans(), label="(B, capacity, Hkv, D) cache storage")
    rng = np.random.default_rng(seed)
    k_cache = rng.standard_normal((B, Hkv, capacity, D)).astype(dtype)
    v_cache = rng.standard_normal((B, Hkv, capacity, Dv)).astype(dtype)
    if transposed:
        k_cache, v_cache = (laid_out(a, "transposed") for a in (k_cache, v_cache))
    q = rng.standard_normal((B, H, Tq, D)).astype(dtype)
    k_new = rng.standard_normal((B, Hkv, t, D)).astype(dtype) if t else None
    v_new = rng.standard_normal((B, Hkv, t, Dv)).astype(dtype) if t else None
    k_before, v_before = k_cache.copy(), v_cache.copy()
    out, lse = af.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new,
                                         causal=causal, window=window, return_lse=True)
    for b in range(B):
        L = seqlens[b] + t
        kb, vb = k_before[b].copy(), v_before[b].copy()
        if t:
            kb[:, seqlens[b]:L], vb[:, seqlens[b]:L] = k_new[b], v_new[b]
        # Written exactly where flash-attn writes, nothing else touched.
        assert np.array_equal(k_cache[b], kb) and np.array_equal(v_cache[b], vb)
        ro, rl, _ = reference_attention(q[b], kb[:, :L], vb[:, :L], causal=causal, window=window)
        assert_close(out[b], ro, dtype, f"out of sequence {b}")
        assert np.array_equal(np.isneginf(lse[b]), np.isneginf(rl))
        fin = np.isfinite(rl)
        assert_close(lse[b][fin], rl[fin], dtype, f"lse of sequence {b}")


# ------------------------------------------------------------------ caches as state machines

CACHE_DTYPES = DTYPES + [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.int8)]


def stored(x, cache_dtype):
    """float64 values of what a cache of `cache_dtype` holds for x (the last axis a row):
    rounded to a 16-bit dtype, or int8 as documented (scale = max|x| / 127 per row in
    float32, values round(x / scale))."""
    if cache_dtype != np.int8:
        return x.astype(cache_dtype).astype(np.float64)
    x = x.astype(np.float32)
    scale = (np.max(np.abs(x), axis=-1) / np.float32(127)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    values = np.clip(np.rint(x / safe[..., None]), -127, 127)
    return values.astype(np.float64) * scale[..., None].astype(np.float64)


def held(values, scales):
    """float64 values of cache rows (with their int8 scales, or None)."""
    out = values.astype(np.float64)
    return out if scales is None else out * scales[..., None].astype(np.float64)


def cache_tolerance(out_dtype, q_dtype, cache_dtype):
    """(out tolerance, lse tolerance) against the float64 reference over the values the
    cache holds: outputs are rounded to out's dtype; all arithmetic is float32 or better
    (bfloat16 q, k, v may round P to bfloat16 on the avx512bf16 tier)."""
    if out_dtype == np.float64:
        return TOLERANCE[out_dtype], TOLERANCE[out_dtype]
    lse_tol = dict(rtol=1e-4, atol=1e-4)
    if out_dtype == np.float16:
        return dict(rtol=4e-3, atol=4e-3), lse_tol
    if out_dtype == ml_dtypes.bfloat16:
        return dict(rtol=3e-2, atol=3e-2), lse_tol
    if cache_dtype != np.float32:  # float32 q over a 16-bit or int8 cache
        return dict(rtol=1e-4, atol=1e-4), lse_tol
    return TOLERANCE[out_dtype], lse_tol


class _Raises:
    """Stands in for a function and raises `error` on its `after`-th call (1 = the first;
    having run it, with `after_real`): a KeyboardInterrupt or MemoryError in the middle of a
    call."""

    def __init__(self, real, error, after=1, after_real=False):
        self.real, self.error, self.after, self.after_real = real, error, after, after_real
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls < self.after:
            return self.real(*args, **kwargs)
        if self.after_real:
            self.real(*args, **kwargs)
        raise self.error("attnfast property test")


class _patched:
    """Replace obj.name by a _Raises for the block (hypothesis rules cannot use monkeypatch)."""

    def __init__(self, obj, name, error, after=1, after_real=False):
        self.obj, self.name = obj, name
        self.fake = _Raises(getattr(obj, name), error, after, after_real)

    def __enter__(self):
        fake = self.fake

        def stand_in(*args, **kwargs):  # a function: bound like the method it replaces
            return fake(*args, **kwargs)
        setattr(self.obj, self.name, stand_in)
        return fake

    def __exit__(self, *exc):
        setattr(self.obj, self.name, self.fake.real)


# Where a mutating call can be cut short: in the kernels (Ctrl-C), or at its first write into
# the cache, once written (every row write of the full path goes through
# attnfast._transaction.write_rows: a copy-on-write copy, or the new tokens).
INTERRUPTS = st.tuples(st.sampled_from(["kernels", "write"]),
                       st.sampled_from([KeyboardInterrupt, MemoryError]), st.integers(1, 6))


class _interrupt:
    """Cut the call made in the block short. "kernels": where the kernels run, on every path
    (the full path's _ext.run_attention, and the C tails' hook, _ext.fast_call_hooks). "write":
    once the full path's first write_rows has written; the C tails write in C, where nothing
    can raise, so the plans are dropped first and the full path runs."""

    def __init__(self, where, error):
        self.where = where
        if where == "kernels":
            self.patch = _patched(_ext, "run_attention", error)
        else:
            self.patch = _patched(_transaction, "write_rows", error, after_real=True)

    def __enter__(self):
        fake = self.patch.__enter__()
        if self.where == "kernels":
            _ext.fast_call_hooks["before_kernels"] = fake
        else:
            for memo in (_plans.ATTENTION_PLANS, _plans.KVCACHE_PLANS, _plans.PAGED_PLANS):
                memo.clear()
        return fake

    def __exit__(self, *exc):
        _ext.fast_call_hooks["before_kernels"] = None
        return self.patch.__exit__(*exc)


_COUNT_FILE = os.environ.get("ATTNFAST_HYPOTHESIS_COUNT_FILE")
_FINISHED = {}


class _CacheMachine(RuleBasedStateMachine):
    """What the KVCache and PagedKVCache machines share: dtypes of the arrays they draw and
    the reference check of an attention result."""

    def teardown(self):
        if _COUNT_FILE:
            name = type(self).__name__
            _FINISHED[name] = _FINISHED.get(name, 0) + 1
            if _FINISHED[name] % 100 == 0:
                with open(_COUNT_FILE, "a") as f:
                    f.write(f"{name} {_FINISHED[name]} runs (incl. shrinking)\n")

    def _draw_dtypes(self, data, dtype):
        self.dtype = dtype
        if dtype == np.int8:
            self.in_dtype = self.q_dtype = np.dtype(np.float32)
        elif dtype in (np.float16, ml_dtypes.bfloat16):
            self.in_dtype = data.draw(st.sampled_from([dtype, np.dtype(np.float32)]), label="k_new dtype")
            self.q_dtype = data.draw(st.sampled_from([dtype, np.dtype(np.float32)]), label="q dtype")
        else:
            self.in_dtype = self.q_dtype = dtype

    def _normal(self, *shape, dtype=None):
        return self.rng.standard_normal(shape).astype(dtype or self.in_dtype)

    def _q(self, *shape):
        return self._normal(*shape, dtype=self.q_dtype)

    def _check_one(self, q, out, lse, k, v, causal, window, what):
        tol, lse_tol = cache_tolerance(out.dtype, self.q_dtype, self.dtype)
        ro, rl, _ = reference_attention(q.astype(np.float64), k, v, causal=causal, window=window)
        np.testing.assert_allclose(out.astype(np.float64), ro, err_msg=f"out of {what}", **tol)
        assert np.array_equal(np.isneginf(lse), np.isneginf(rl))
        fin = np.isfinite(rl)
        np.testing.assert_allclose(lse[fin], rl[fin], err_msg=f"lse of {what}", **lse_tol)


class KVCacheMachine(_CacheMachine):
    """Random sequences of append / step / attend / truncate / reset (with batch_index
    subsets, over-capacity attempts, rejected arguments and calls interrupted in the kernels
    or at any write) against a list-of-arrays model + the reference, for every cache dtype."""

    @initialize(data=st.data(), dtype=st.sampled_from(CACHE_DTYPES), B=st.integers(1, 3),
                Hkv=st.integers(1, 2), group=st.integers(1, 3), D=st.integers(1, 12),
                Dv=st.integers(1, 12), capacity=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
    def setup(self, data, dtype, B, Hkv, group, D, Dv, capacity, seed):
        self._draw_dtypes(data, dtype)
        self.B, self.Hkv, self.H = B, Hkv, Hkv * group
        self.D, self.Dv, self.C = D, Dv, capacity
        self.rng = np.random.default_rng(seed)
        self.cache = af.KVCache(B, Hkv, D, capacity, dtype=dtype, v_head_dim=Dv, key_rotation=None)
        self.model_k = [np.zeros((Hkv, 0, D)) for _ in range(B)]   # float64, as stored
        self.model_v = [np.zeros((Hkv, 0, Dv)) for _ in range(B)]

    def _seqs(self, data):
        kind = data.draw(st.sampled_from(["all", "int", "subset"]), label="batch_index kind")
        if kind == "all":
            return None, list(range(self.B))
        if kind == "int":
            b = data.draw(st.integers(0, self.B - 1), label="batch_index")
            return b, [b]
        seqs = data.draw(st.lists(st.integers(0, self.B - 1), min_size=1, unique=True),
                         label="batch_index")
        return np.array(seqs), seqs

    def _snapshot(self):
        c = self.cache
        return [a.tobytes() for a in (c.k, c.v, c.lengths, c.k_scale, c.v_scale) if a is not None]

    def _fits(self, seqs, t):
        return all(self.model_k[b].shape[1] + t <= self.C for b in seqs)

    def _append_model(self, seqs, k_new, v_new):
        for i, b in enumerate(seqs):
            self.model_k[b] = np.concatenate([self.model_k[b], stored(k_new[i], self.dtype)], axis=1)
            self.model_v[b] = np.concatenate([self.model_v[b], stored(v_new[i], self.dtype)], axis=1)

    def _check_attention(self, seqs, q, out, lse, causal, window):
        for i, b in enumerate(seqs):
            self._check_one(q[i], out[i], lse[i], self.model_k[b], self.model_v[b], causal,
                            window, f"sequence {b}")

    def _tokens(self, n, t):
        return self._normal(n, self.Hkv, t, self.D), self._normal(n, self.Hkv, t, self.Dv)

    @rule(data=st.data(), t=st.integers(1, 6))
    def append(self, data, t):
        index, seqs = self._seqs(data)
        k_new, v_new = self._tokens(len(seqs), t)
        if not self._fits(seqs, t):
            snap = self._snapshot()
            with pytest.raises(ValueError, match="capacity"):
                self.cache.append(k_new, v_new, batch_index=index)
            assert self._snapshot() == snap
            return
        self.cache.append(k_new, v_new, batch_index=index)
        self._append_model(seqs, k_new, v_new)

    @rule(data=st.data(), t=st.one_of(st.integers(1, 3), st.integers(17, 20)),
          causal=st.booleans(), threads=st.integers(1, 3))
    def step(self, data, t, causal, threads):
        index, seqs = self._seqs(data)
        window = data.draw(st.one_of(st.none(), st.tuples(st.integers(-1, 5), st.integers(-1, 5))))
        q = self._q(len(seqs), self.H, t, self.D)
        k_new, v_new = self._tokens(len(seqs), t)
        if not self._fits(seqs, t):
            snap = self._snapshot()
            with pytest.raises(ValueError, match="capacity"):
                self.cache.step(q, k_new, v_new, batch_index=index)
            assert self._snapshot() == snap
            return
        out, lse = self.cache.step(q, k_new, v_new, batch_index=index, causal=causal,
                                   window=window, return_lse=True, num_threads=threads)
        self._append_model(seqs, k_new, v_new)
        self._check_attention(seqs, q, out, lse, causal, window)

    @rule(data=st.data(), t=st.integers(1, 3), how=INTERRUPTS, kind=st.sampled_from(
        ["step", "fast step", "append"]))
    def interrupted(self, data, t, how, kind):
        """A call cut short (Ctrl-C or MemoryError, in the kernels or at a write) changes
        nothing; "fast step" takes the fast path's plan (a good call of the layout first)."""
        index, seqs = self._seqs(data)
        if kind == "fast step":
            index, seqs = None, list(range(self.B))
        if not self._fits(seqs, 2 * t):
            return
        q = self._q(len(seqs), self.H, t, self.D)
        k_new, v_new = self._tokens(len(seqs), t)
        if kind == "fast step":
            self.cache.step(q, k_new, v_new)
            self._append_model(seqs, k_new, v_new)
        where, error, _ = how
        where = "write" if kind == "append" else where  # append runs no kernel
        snap = self._snapshot()
        with _interrupt(where, error), pytest.raises(error):
            if kind == "append":
                self.cache.append(k_new, v_new, batch_index=index)
            else:
                self.cache.step(q, k_new, v_new, batch_index=index)
        assert self._snapshot() == snap

    @rule(data=st.data(), case=st.sampled_from(["v_new head dim", "q dtype", "q head dim"]))
    def rejected(self, data, case):
        """A call with a bad argument raises and changes nothing."""
        index, seqs = self._seqs(data)
        q = self._q(len(seqs), self.H, 1, self.D)
        k_new, v_new = self._tokens(len(seqs), 1)
        if case == "v_new head dim":
            v_new = self._normal(len(seqs), self.Hkv, 1, self.Dv + 1)
        elif case == "q dtype":
            q = q.astype(np.int32)
        else:
            q = self._q(len(seqs), self.H, 1, self.D + 1)
        snap = self._snapshot()
        with pytest.raises((ValueError, TypeError)):
            self.cache.step(q, k_new, v_new, batch_index=index)
        assert self._snapshot() == snap

    @rule(data=st.data(), tq=st.one_of(st.integers(1, 16), st.integers(17, 24)),
          causal=st.booleans())
    def attend(self, data, tq, causal):
        index, seqs = self._seqs(data)
        q = self._q(len(seqs), self.H, tq, self.D)
        snap = self._snapshot()
        out, lse = self.cache.attend(q, batch_index=index, causal=causal, return_lse=True)
        assert self._snapshot() == snap
        self._check_attention(seqs, q, out, lse, causal, None)

    @rule(data=st.data())
    def truncate(self, data):
        lengths = [m.shape[1] for m in self.model_k]
        if data.draw(st.booleans(), label="one n for all"):
            n = data.draw(st.integers(0, min(lengths)))
            ns = [n] * self.B
        else:
            ns = [data.draw(st.integers(0, L)) for L in lengths]
            n = np.array(ns)
        self.cache.truncate(n)
        for b, nb in enumerate(ns):
            self.model_k[b] = self.model_k[b][:, :nb]
            self.model_v[b] = self.model_v[b][:, :nb]

    @precondition(lambda self: max(m.shape[1] for m in self.model_k) > 0)
    @rule()
    def truncate_too_far_is_rejected(self):
        lengths = [m.shape[1] for m in self.model_k]
        snap = self._snapshot()
        with pytest.raises(ValueError):
            self.cache.truncate(max(lengths) + 1)
        assert self._snapshot() == snap

    @rule()
    def reset(self):
        self.cache.reset()
        self.model_k = [m[:, :0] for m in self.model_k]
        self.model_v = [m[:, :0] for m in self.model_v]

    @invariant()
    def cache_holds_the_model(self):
        c = self.cache
        assert c.lengths.tolist() == [m.shape[1] for m in self.model_k]
        for b in range(self.B):
            L = self.model_k[b].shape[1]
            ks = None if c.k_scale is None else c.k_scale[b, :, :L]
            vs = None if c.v_scale is None else c.v_scale[b, :, :L]
            assert np.array_equal(held(c.k[b, :, :L], ks), self.model_k[b])
            assert np.array_equal(held(c.v[b, :, :L], vs), self.model_v[b])


KVCacheMachine.TestCase.settings = settings(
    max_examples=(LONG_EXAMPLES or 15_000) if LONG else 60, stateful_step_count=25 if LONG else 15)
test_kvcache_state_machine = KVCacheMachine.TestCase


class PagedKVCacheMachine(_CacheMachine):
    """Random programs of add / fork / free / append / step / attend / truncate on a
    PagedKVCache (small pools: running out of blocks is common; forks share blocks, so
    copy-on-write is exercised), with raised and interrupted calls, checked token by token
    against a list-of-arrays model (every sequence's tokens read back through its blocks),
    the block accounting, and the reference."""

    @initialize(data=st.data(), dtype=st.sampled_from(CACHE_DTYPES), blocks=st.integers(1, 16),
                block_size=st.integers(1, 5), Hkv=st.integers(1, 2), group=st.integers(1, 2),
                D=st.integers(1, 8), Dv=st.integers(1, 8), seed=st.integers(0, 2**32 - 1))
    def setup(self, data, dtype, blocks, block_size, Hkv, group, D, Dv, seed):
        self._draw_dtypes(data, dtype)
        self.Hkv, self.H, self.D, self.Dv, self.bs = Hkv, Hkv * group, D, Dv, block_size
        self.rng = np.random.default_rng(seed)
        # (key_rotation=None: the model holds the keys as stored; rotation: test_lowbit.py)
        self.cache = af.PagedKVCache(blocks, block_size, Hkv, D, dtype=dtype, v_head_dim=Dv,
                                     key_rotation=None)
        self.model = {}  # seq id -> (k (Hkv, L, D), v (Hkv, L, Dv)), float64 as stored
        self.add()  # every rule is enabled from the start

    def _snapshot(self):
        c = self.cache
        pools = [a.tobytes() for a in (c.k, c.v, c.k_scale, c.v_scale) if a is not None]
        return (pools, list(c._free), c._refs.tobytes(), c._next_id,
                [(s, c.blocks(s), c.length(s)) for s in c.sequences])

    def _ids(self, data, single_ok=True):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True),
                        label="seq_ids")
        if single_ok and len(ids) == 1 and data.draw(st.booleans(), label="bare id"):
            return ids[0], ids
        return ids, ids

    def _needed(self, ids, t):
        """New blocks appending t tokens to `ids` takes, from the block lists and counts."""
        c, refs, need = self.cache, {}, 0
        for s in ids:
            length, blocks = c.length(s), c.blocks(s)
            if length % self.bs:
                last = blocks[length // self.bs]
                left = refs.get(last, int(c._refs[last]))
                if left > 1:
                    need += 1
                    refs[last] = left - 1
            need += -(-(length + t) // self.bs) - len(blocks)
        return need

    def _tokens(self, n, t):
        return self._normal(n, self.Hkv, t, self.D), self._normal(n, self.Hkv, t, self.Dv)

    def _lifted(self, seq_arg, *arrays):
        return [a[0] if not isinstance(seq_arg, list) else a for a in arrays]

    @rule()
    def add(self):
        sid = self.cache.add_sequence()
        assert sid not in self.model
        self.model[sid] = (np.zeros((self.Hkv, 0, self.D)), np.zeros((self.Hkv, 0, self.Dv)))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        new = self.cache.fork(sid)
        self.model[new] = self.model[sid]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.free(sid)
        del self.model[sid]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def truncate(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        k, v = self.model[sid]
        n = data.draw(st.integers(0, k.shape[1] + 1), label="n")
        if n > k.shape[1]:
            snap = self._snapshot()
            with pytest.raises(ValueError, match="truncate only shortens"):
                self.cache.truncate(sid, n)
            assert self._snapshot() == snap
            return
        self.cache.truncate(sid, n)
        self.model[sid] = (k[:, :n], v[:, :n])

    def _append_model(self, ids, k_new, v_new):
        for i, s in enumerate(ids):
            k, v = self.model[s]
            self.model[s] = (np.concatenate([k, stored(k_new[i], self.dtype)], axis=1),
                             np.concatenate([v, stored(v_new[i], self.dtype)], axis=1))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), t=st.integers(1, 6), with_attention=st.booleans(), causal=st.booleans(),
          calls=st.integers(1, 3))
    def append_or_step(self, data, t, with_attention, causal, calls):
        """`calls` calls of one layout: the first plans it, the others take the fast path."""
        arg, ids = self._ids(data)
        for _ in range(calls):
            k_new, v_new = self._tokens(len(ids), t)
            q = self._q(len(ids), self.H, t, self.D)
            call = ((lambda: self.cache.step(arg, *self._lifted(arg, q, k_new, v_new),
                                             causal=causal, return_lse=True))
                    if with_attention
                    else (lambda: self.cache.append(arg, *self._lifted(arg, k_new, v_new))))
            if self._needed(ids, t) > self.cache.num_free_blocks:
                snap = self._snapshot()
                with pytest.raises(ValueError, match="out of blocks"):
                    call()
                assert self._snapshot() == snap
                return
            result = call()
            self._append_model(ids, k_new, v_new)
            if with_attention:
                out, lse = result if isinstance(arg, list) else (result[0][None], result[1][None])
                for i, s in enumerate(ids):
                    self._check_one(q[i], out[i], lse[i], *self.model[s], causal, None,
                                    f"sequence {s}")

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tq=st.integers(1, 6), causal=st.booleans())
    def attend(self, data, tq, causal):
        arg, ids = self._ids(data)
        q = self._q(len(ids), self.H, tq, self.D)
        snap = self._snapshot()
        out, lse = self.cache.attend(arg, *self._lifted(arg, q), causal=causal, return_lse=True)
        assert self._snapshot() == snap
        if not isinstance(arg, list):
            out, lse = out[None], lse[None]
        for i, s in enumerate(ids):
            self._check_one(q[i], out[i], lse[i], *self.model[s], causal, None, f"sequence {s}")

    @precondition(lambda self: self.model)
    @rule(data=st.data(), t=st.integers(1, 6), how=INTERRUPTS,
          kind=st.sampled_from(["step", "fast step", "append", "fork", "free", "truncate"]))
    def interrupted(self, data, t, how, kind):
        """A call cut short (in the kernels or at any write), or raising at its reference
        counting, changes nothing: blocks, counts, free list, lengths and pool bytes. "fast
        step" takes the fast path's plan (a good call of the layout first)."""
        arg, ids = self._ids(data, single_ok=False)
        snap = self._snapshot()
        where, error, after = how  # (after: the block release that fails)
        if kind in ("fork", "free", "truncate"):
            # no kernels, no token writes: fail in the block accounting instead, after the
            # reference counts changed (fork: at the new sequence's record; free, truncate:
            # at the after-th block released)
            blocks = len(self.cache.blocks(ids[0]))
            if kind == "fork":
                target = _patched(_paged, "_Sequence", error)
            elif blocks == 0:
                return
            else:
                target = _patched(self.cache, "_release", error, min(after, blocks))
            with target, pytest.raises(error):
                if kind == "fork":
                    self.cache.fork(ids[0])
                elif kind == "free":
                    self.cache.free(ids[0])
                else:
                    self.cache.truncate(ids[0], 0)
            self.cache.__dict__.pop("_release", None)
            assert self._snapshot() == snap
            return
        if self._needed(ids, 2 * t if kind == "fast step" else t) > self.cache.num_free_blocks:
            return
        k_new, v_new = self._tokens(len(ids), t)
        q = self._q(len(ids), self.H, t, self.D)
        if kind == "fast step":  # a good call of the layout first: its plan serves the next
            self.cache.step(ids, q, k_new, v_new)
            self._append_model(ids, k_new, v_new)
            snap = self._snapshot()
        where = "write" if kind == "append" else where  # append runs no kernel
        with _interrupt(where, error), pytest.raises(error):
            if kind == "append":
                self.cache.append(ids, k_new, v_new)
            else:
                self.cache.step(ids, q, k_new, v_new)
        assert self._snapshot() == snap

    @precondition(lambda self: self.model)
    @rule(data=st.data(), case=st.sampled_from(["v_new head dim", "q head dim", "unknown id"]))
    def rejected(self, data, case):
        arg, ids = self._ids(data, single_ok=False)
        q = self._q(len(ids), self.H, 1, self.D)
        k_new, v_new = self._tokens(len(ids), 1)
        if case == "v_new head dim":
            v_new = self._normal(len(ids), self.Hkv, 1, self.Dv + 1)
        elif case == "q head dim":
            q = self._q(len(ids), self.H, 1, self.D + 1)
        else:
            ids = ids + [max(self.model) + 100]
        snap = self._snapshot()
        with pytest.raises((ValueError, TypeError)):
            self.cache.step(ids, q, k_new, v_new)
        assert self._snapshot() == snap

    @invariant()
    def pool_holds_the_model(self):
        c = self.cache
        if not hasattr(self, "model"):
            return
        assert sorted(c.sequences) == sorted(self.model)
        holders = np.zeros(c.num_blocks, np.int64)
        for s, (k, v) in self.model.items():
            L, blocks = k.shape[1], c.blocks(s)
            assert c.length(s) == L and len(blocks) == -(-L // self.bs)
            holders[list(blocks)] += 1
            pos = np.arange(L)
            rows = (np.array(blocks, np.int64)[pos // self.bs], slice(None), pos % self.bs)
            ks = None if c.k_scale is None else c.k_scale[rows].T
            vs = None if c.v_scale is None else c.v_scale[rows].T
            # token by token: (L, Hkv, D) read through the blocks, as (Hkv, L, D)
            assert np.array_equal(held(np.swapaxes(c.k[rows], 0, 1), ks), k), f"keys of {s}"
            assert np.array_equal(held(np.swapaxes(c.v[rows], 0, 1), vs), v), f"values of {s}"
        assert np.array_equal(c._refs, holders), "reference counts"
        assert sorted(c._free) == np.flatnonzero(holders == 0).tolist(), "free list"


PagedKVCacheMachine.TestCase.settings = settings(
    max_examples=(LONG_EXAMPLES or 15_000) if LONG else 40, stateful_step_count=25 if LONG else 15)
test_paged_kvcache_state_machine = PagedKVCacheMachine.TestCase


def test_score_rounding_tolerance_is_small_for_unit_scores_and_grows_with_them():
    """The float32 tolerance term of assert_close stays below the fixed one for O(1) scores
    (it does not loosen ordinary checks) and grows with the score magnitude."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 3, 17, 28)) for _ in range(3))
    for mag, scale, lo, hi in ((1.0, None, 0.0, 2e-5), (3.0, 1.875, 1e-4, 1e-2)):
        out, _, w = reference_attention(q * mag, k * mag, v, scale=scale)
        out_tol, lse_tol = float32_score_rounding(q * mag, k * mag, v, w, out, scale)
        assert lo <= out_tol.max() < hi and lo <= lse_tol.max() < 10 * hi
