"""Property tests (hypothesis) of every public computation against tests/reference.py.

Profiles (ATTNFAST_HYPOTHESIS_PROFILE):
- "ci" (default): derandomized, so every run draws the same examples; the whole file takes
  about a minute on 2 cores.
- "long": >= 10^5 examples in total, random (new examples each run; failures are kept in
  build/hypothesis-db and replayed first). Its tests are marked slow, so they run
  only when asked for:
      ATTNFAST_HYPOTHESIS_PROFILE=long python -m pytest -m slow tests/test_properties.py
  (ATTNFAST_HYPOTHESIS_MAX_EXAMPLES=n sets the examples per test for a shorter soak.)
"""
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

import attnfast as af
from attnfast import _ext
from reference import (TOLERANCE, nan_leak_allowed, reference_attention, reference_nonfinite_rows,
                       visible_mask)

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
# shorter soak run); the default gives 6 x 15k + 2 x 10k + 15k state-machine runs >= 10^5.
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


def assert_close(actual, expected, dtype, what):
    tol = TOLERANCE[np.dtype(dtype)]
    np.testing.assert_allclose(actual, expected, err_msg=what, **tol)


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
    ref_out, ref_lse, _ = reference_attention(q, k, v, **opts)
    assert out.shape == ref_out.shape and out.dtype == dtype
    assert lse.shape == ref_lse.shape
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert_close(out, ref_out, dtype, "out")
    # lse: -inf exactly where the row sees no key, close elsewhere.
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert_close(lse[fin], ref_lse[fin], dtype, "lse")
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
        ref_out, ref_lse, _ = reference_attention(np.nan_to_num(q), np.nan_to_num(k),
                                                  np.nan_to_num(v), **opts)
        ok = clean_rows & ~lse_nan
        assert_close(out[ok], ref_out[ok], dtype, "out of clean rows")
        assert_close(lse[ok], ref_lse[ok], dtype, "lse of clean rows")


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


# ------------------------------------------------------------------ KVCache as a state machine

class KVCacheMachine(RuleBasedStateMachine):
    """Random sequences of append / step / attend / truncate / reset (with batch_index
    subsets and over-capacity attempts) against a pure-NumPy model cache + the reference."""

    @initialize(dtype=st.sampled_from(DTYPES), B=st.integers(1, 3), Hkv=st.integers(1, 2),
                group=st.integers(1, 3), D=st.integers(1, 12), Dv=st.integers(1, 12),
                capacity=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
    def setup(self, dtype, B, Hkv, group, D, Dv, capacity, seed):
        self.dtype, self.B, self.Hkv, self.H = dtype, B, Hkv, Hkv * group
        self.D, self.Dv, self.C = D, Dv, capacity
        self.rng = np.random.default_rng(seed)
        self.cache = af.KVCache(B, Hkv, D, capacity, dtype=dtype, v_head_dim=Dv)
        self.model_k = [np.zeros((Hkv, 0, D)) for _ in range(B)]   # float64 copies
        self.model_v = [np.zeros((Hkv, 0, Dv)) for _ in range(B)]

    def _normal(self, *shape):
        return self.rng.standard_normal(shape).astype(self.dtype)

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
        return c.k.tobytes(), c.v.tobytes(), c.lengths.tobytes()

    def _fits(self, seqs, t):
        return all(self.model_k[b].shape[1] + t <= self.C for b in seqs)

    def _append_model(self, seqs, k_new, v_new):
        for i, b in enumerate(seqs):
            self.model_k[b] = np.concatenate([self.model_k[b], k_new[i].astype(np.float64)], axis=1)
            self.model_v[b] = np.concatenate([self.model_v[b], v_new[i].astype(np.float64)], axis=1)

    def _check_attention(self, seqs, q, out, lse, causal, window):
        for i, b in enumerate(seqs):
            ro, rl, _ = reference_attention(q[i], self.model_k[b], self.model_v[b],
                                            causal=causal, window=window)
            assert_close(out[i], ro, self.dtype, f"out of sequence {b}")
            assert np.array_equal(np.isneginf(lse[i]), np.isneginf(rl))
            fin = np.isfinite(rl)
            assert_close(lse[i][fin], rl[fin], self.dtype, f"lse of sequence {b}")

    @rule(data=st.data(), t=st.integers(1, 6))
    def append(self, data, t):
        index, seqs = self._seqs(data)
        k_new, v_new = self._normal(len(seqs), self.Hkv, t, self.D), self._normal(len(seqs), self.Hkv, t, self.Dv)
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
        q = self._normal(len(seqs), self.H, t, self.D)
        k_new, v_new = self._normal(len(seqs), self.Hkv, t, self.D), self._normal(len(seqs), self.Hkv, t, self.Dv)
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

    @rule(data=st.data(), tq=st.one_of(st.integers(1, 16), st.integers(17, 24)),
          causal=st.booleans())
    def attend(self, data, tq, causal):
        index, seqs = self._seqs(data)
        q = self._normal(len(seqs), self.H, tq, self.D)
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
            assert np.array_equal(c.k[b, :, :L], self.model_k[b].astype(self.dtype))
            assert np.array_equal(c.v[b, :, :L], self.model_v[b].astype(self.dtype))


KVCacheMachine.TestCase.settings = settings(
    max_examples=(LONG_EXAMPLES or 15_000) if LONG else 60, stateful_step_count=25 if LONG else 15)
test_kvcache_state_machine = KVCacheMachine.TestCase
