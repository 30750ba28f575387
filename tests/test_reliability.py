"""Issue 10: one test (or a few) per defect a hostile user found, each stating the rule.

1. integers beyond the C side  2. thread counts beyond the machine  3. non-finite values
4. a KVCache shared between Python threads  5. Ctrl-C  6. error messages and a bad
ATTNFAST_NUM_THREADS. Plus: resources (RSS flat over many calls) and other defects found
while writing these.
"""
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import attnfast as af
from attnfast import _ext
from reference import TOLERANCE, nan_leak_allowed, reference_attention, reference_nonfinite_rows

CORES = os.cpu_count()
ISAS = _ext.runtime_info()["isa_available"]
HUGE = [2**31, 2**32 + 1, 2**62, 2**63 - 1, 2**63, 2**64, 10**30]


def normal(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def filled_cache(rng, B=2, Hkv=2, D=8, C=32, held=5, dtype=np.float32):
    cache = af.KVCache(B, Hkv, D, C, dtype=dtype)
    cache.append(normal(rng, B, Hkv, held, D, dtype=dtype), normal(rng, B, Hkv, held, D, dtype=dtype))
    return cache


def cache_bytes(cache):
    return cache.k.tobytes(), cache.v.tobytes(), cache.lengths.tobytes()


def run_python(code, env=None, timeout=60):
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full_env, timeout=timeout)


@pytest.fixture(autouse=True)
def _restore_runtime():
    yield
    af.set_num_threads(None)
    _ext.force_isa("")


# ============================================================ 1. integers beyond the C side

@pytest.mark.parametrize("n", [2**31, 2**63, 10**30])
@pytest.mark.parametrize("method", ["step", "attend", "attend_batch_index"])
def test_huge_num_threads_in_a_cache_call_is_validated_before_anything_is_written(rng, n, method):
    """Rejected with TypeError/ValueError and the cache bit-identical, or accepted (clamped
    to the cores) with the result of num_threads=1."""
    cache, twin = filled_cache(rng), None
    q, k_new, v_new = normal(rng, 2, 4, 1, 8), normal(rng, 2, 2, 1, 8), normal(rng, 2, 2, 1, 8)
    before = cache_bytes(cache)
    twin = af.KVCache(2, 2, 8, 32)
    twin.append(cache.k[:, :, :5].copy(), cache.v[:, :, :5].copy())
    call = {"step": lambda c, t: c.step(q, k_new, v_new, num_threads=t),
            "attend": lambda c, t: c.attend(q, num_threads=t),
            "attend_batch_index": lambda c, t: c.attend(q, num_threads=t, batch_index=[0, 1])}[method]
    try:
        got = call(cache, n)
    except (TypeError, ValueError) as exc:
        assert "num_threads" in str(exc)
        assert cache_bytes(cache) == before, "a rejected call changed the cache"
        return
    expected = call(twin, 1)
    assert np.array_equal(got, expected)
    assert cache_bytes(cache) == cache_bytes(twin)


@pytest.mark.parametrize("n", [2**31, 2**40, 2**63, 10**30])
def test_set_num_threads_huge_raises_or_clamps_and_later_calls_work(rng, n):
    try:
        af.set_num_threads(n)
    except (TypeError, ValueError) as exc:
        assert re.search(r"\bn\b|num_threads", str(exc)), str(exc)
    else:
        assert 1 <= af.get_num_threads() <= CORES
    q = normal(rng, 2, 40, 8)
    out = af.attention(q, q, q, causal=True)       # later calls work
    cache = filled_cache(rng)
    cache.step(normal(rng, 2, 4, 1, 8), normal(rng, 2, 2, 1, 8), normal(rng, 2, 2, 1, 8))
    ref, _, _ = reference_attention(q, q, q, causal=True)
    np.testing.assert_allclose(out, ref, **TOLERANCE[np.dtype(np.float32)])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("tq,tk", [(1, 37), (7, 7), (16, 40), (40, 40), (70, 90)])
@pytest.mark.parametrize("causal", [False, True])
def test_window_bounds_beyond_any_distance_are_unbounded(rng, dtype, tq, tk, causal):
    """A bound >= Tq + Tk (up to 2**63, 10**30) means the same as -1, on every tier."""
    q, k, v = normal(rng, 2, tq, 16, dtype=dtype), normal(rng, 1, tk, 16, dtype=dtype), normal(rng, 1, tk, 8, dtype=dtype)
    ref, ref_lse, _ = reference_attention(q, k, v, causal=causal)
    tol = TOLERANCE[np.dtype(dtype)]
    for isa in ISAS:
        _ext.force_isa(isa)
        unbounded, unbounded_lse = af.attention(q, k, v, causal=causal, return_lse=True)
        np.testing.assert_allclose(unbounded, ref, **tol)
        for big in [tq + tk] + HUGE:
            for window in [(big, big), (-1, big), (big, -1)]:
                out, lse = af.attention(q, k, v, causal=causal, window=window, return_lse=True)
                assert np.array_equal(out, unbounded) and np.array_equal(lse, unbounded_lse), (
                    f"window={window} differs from unbounded on {isa} (tq={tq}, tk={tk})")


@pytest.mark.parametrize("big", [2**62, 2**63 - 1, 2**63, 10**30])
def test_huge_window_in_cache_and_varlen_paths_is_unbounded(rng, big):
    cache = filled_cache(rng, held=9)
    q = normal(rng, 2, 4, 3, 8)
    np.testing.assert_array_equal(cache.attend(q, window=(big, big)), cache.attend(q))
    kc, vc = cache.k.copy(), cache.v.copy()
    np.testing.assert_array_equal(af.attention_with_kvcache(q, kc, vc, 9, window=(big, 0)),
                                  af.attention_with_kvcache(q, kc, vc, 9, window=(-1, 0)))
    qp, kp = normal(rng, 30, 2, 8), normal(rng, 25, 1, 8)
    cu_q, cu_k = np.array([0, 20, 30]), np.array([0, 5, 25])
    np.testing.assert_array_equal(
        af.attention_varlen(qp, kp, kp, cu_q, cu_k, causal=True, window=(big, big)),
        af.attention_varlen(qp, kp, kp, cu_q, cu_k, causal=True))


# ============================================================ 2. thread counts beyond the machine

_THREADS_PROBE = """
import re, numpy as np, attnfast as af
def threads():
    return int(re.search(r"Threads:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
q = np.ones((1, 512, 64, 4), np.float32)   # hundreds of (head, query block) tasks
kd = np.ones((1, 512, 300, 4), np.float32)
base = threads()                                            # before any OpenMP team exists
af.attention(q, q, q, num_threads={n})                      # prefill
af.attention(q[:, :, :2], kd, kd, num_threads={n})          # decode (split-KV)
print("THREADS", threads() - base, "GET", af.get_num_threads())
"""


def _probe(n="None", env=None):
    """Threads a fresh process gained through two attnfast calls, and get_num_threads()."""
    env = {"OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
    res = run_python(_THREADS_PROBE.format(n=n), env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("THREADS")][-1].split()
    return int(line[1]), int(line[3])


@pytest.mark.parametrize("n", [10**9, 2**31 - 1])
def test_huge_num_threads_argument_starts_no_more_threads_than_cores(n):
    added, _ = _probe(n=str(n))
    # at most CORES - 1 OpenMP workers join the calling thread
    assert added <= CORES - 1, f"num_threads={n}: {added} threads started on {CORES} cores"


@pytest.mark.parametrize("var", ["OMP_NUM_THREADS", "ATTNFAST_NUM_THREADS"])
def test_huge_thread_environment_is_clamped_to_the_cores(var):
    added, got = _probe(env={var: "100000"})
    assert got <= CORES, f"{var}=100000: get_num_threads() = {got} on {CORES} cores"
    assert added <= CORES - 1, f"{var}=100000: {added} threads started on {CORES} cores"


def test_set_num_threads_beyond_the_cores_is_clamped_or_rejected():
    try:
        af.set_num_threads(CORES + 5)
    except ValueError:
        return
    assert af.get_num_threads() <= CORES


# ============================================================ 3. non-finite values

def _poisoned(rng, dtype, B, H, Hkv, tq, tk, D, Dv):
    q, k, v = (normal(rng, B, H, tq, D, dtype=dtype), normal(rng, B, Hkv, tk, D, dtype=dtype),
               normal(rng, B, Hkv, tk, Dv, dtype=dtype))
    q[0, 0, tq - 1, 0] = np.nan                 # the last row (sees keys under causal)
    k[0, Hkv - 1, tk // 2, D - 1] = np.inf     # a key in the middle
    k[B - 1, 0, 0, 0] = np.nan                 # the first key (only early rows with a window)
    v[B - 1, Hkv - 1, tk - 1, Dv // 2] = np.nan  # the last value: rows that see the last key
    if tq > 1:
        q[B - 1, H - 1, 0, 1 % D] = -np.inf
    return q, k, v


def _check_nonfinite(out, lse, q, k, v, **opts):
    out_nan, lse_nan, sees_none = reference_nonfinite_rows(q, k, v, **opts)
    assert np.array_equal(np.isnan(lse), lse_nan), "lse: NaN exactly on the rows that see a non-finite q or key"
    got = np.isnan(out)
    assert np.all(got[out_nan]), "out: NaN wherever the rule says"
    assert not np.any(got & ~out_nan & ~nan_leak_allowed(out.shape, v, sees_none)), \
        "out: NaN only where the rule (or its documented limit) says"
    assert np.all(out[sees_none] == 0) and np.all(np.isneginf(lse[sees_none]))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("tq,tk", [(1, 50), (4, 33), (16, 16), (17, 40), (64, 64), (100, 130)])
@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(causal=True, window=(8, 0))],
                         ids=["full", "causal", "window"])
def test_nan_in_nan_out_on_every_tier(rng, isa, dtype, tq, tk, opts):
    q, k, v = _poisoned(rng, dtype, 2, 4, 2, tq, tk, 16, 8)
    _ext.force_isa(isa)
    for threads in (1, 2):
        out, lse = af.attention(q, k, v, return_lse=True, num_threads=threads, **opts)
        _check_nonfinite(out, lse, q, k, v, **opts)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window", [None, (100, 0)])
def test_nan_rule_across_decode_chunks(rng, isa, window):
    # Many query rows per KV head over a cache split into several chunks (the GEMM-shaped
    # decode where the tier has one): a non-finite key poisons exactly the rows that see it,
    # also when it is the only key a row sees in its chunk or its tile.
    _ext.force_isa(isa)
    tq, tk = 4, 5000
    q, k, v = _poisoned(rng, np.float32, 1, 8, 1, tq, tk, 16, 16)
    k[0, 0, 4096, 3] = np.nan  # the first key of a chunk (2048-key chunks)
    k[0, 0, 4999, 3] = -np.inf  # the last key: only the last row sees it
    for threads in (1, 2):
        out, lse = af.attention(q, k, v, causal=True, window=window, return_lse=True,
                                num_threads=threads)
        _check_nonfinite(out, lse, q, k, v, causal=True, window=window)
        assert np.isnan(lse[0, :, -1]).all()
        finite = ~np.isnan(lse)
        ref_out, ref_lse, _ = reference_attention(np.nan_to_num(q), np.nan_to_num(k), np.nan_to_num(v),
                                                  causal=True, window=window)
        if window is not None:  # rows 0..2 of most heads see no poisoned key: their values
            assert finite.sum() >= 20
            np.testing.assert_allclose(lse[finite], ref_lse[finite], **TOLERANCE[np.dtype(np.float32)])
            out_nan, _, sees_none = reference_nonfinite_rows(q, k, v, causal=True, window=window)
            clean = ~out_nan & ~nan_leak_allowed(out.shape, v, sees_none)
            np.testing.assert_allclose(out[clean], ref_out[clean], **TOLERANCE[np.dtype(np.float32)])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_rule_on_the_cache_and_varlen_paths(rng, isa, dtype):
    _ext.force_isa(isa)
    # KVCache decode: a NaN key in sequence 1 poisons only sequence 1
    cache = af.KVCache(2, 1, 8, 64, dtype=dtype)
    k0, v0 = normal(rng, 2, 1, 40, 8, dtype=dtype), normal(rng, 2, 1, 40, 8, dtype=dtype)
    k0[1, 0, 13, 3] = np.nan
    cache.append(k0, v0)
    q = normal(rng, 2, 2, 1, 8, dtype=dtype)
    out, lse = cache.step(q, normal(rng, 2, 1, 1, 8, dtype=dtype), normal(rng, 2, 1, 1, 8, dtype=dtype),
                          return_lse=True)
    assert not np.isnan(out[0]).any() and not np.isnan(lse[0]).any()
    assert np.isnan(out[1]).all() and np.isnan(lse[1]).all()
    # varlen: sequence 0 holds a NaN value, sequence 1 an inf query
    qp, kp, vp = normal(rng, 30, 2, 8, dtype=dtype), normal(rng, 40, 2, 8, dtype=dtype), normal(rng, 40, 2, 8, dtype=dtype)
    vp[3, 1, 2] = np.nan
    qp[25, 0, 0] = np.inf
    cu_q, cu_k = np.array([0, 20, 30]), np.array([0, 10, 40])
    out, lse = af.attention_varlen(qp, kp, vp, cu_q, cu_k, return_lse=True)
    for b, (sq, sk) in enumerate([(slice(0, 20), slice(0, 10)), (slice(20, 30), slice(10, 40))]):
        tq_ = lambda a: a.transpose(1, 0, 2)  # noqa: E731
        _check_nonfinite(tq_(out[sq]), lse[:, sq], tq_(qp[sq]), tq_(kp[sk]), tq_(vp[sk]))


@pytest.mark.parametrize("scale", [1e39, 3.5e38, -1e39, float("inf")])
def test_float32_scale_that_is_not_finite_in_float32_is_rejected(rng, scale):
    q = normal(rng, 2, 20, 8)
    out = np.full((2, 20, 8), 7.0, np.float32)
    with pytest.raises(ValueError, match="scale"):
        af.attention(q, q, q, scale=scale, out=out)
    assert np.all(out == 7.0)


def test_rows_that_see_no_key_stay_zero_even_with_nan_inputs(rng):
    q = normal(rng, 2, 30, 8)
    q[:, :10] = np.nan                          # rows 0..9 see no key (Tk = 20 < Tq, causal)
    k = normal(rng, 2, 20, 8)
    out, lse = af.attention(q, k, k, causal=True, return_lse=True)
    assert np.all(out[:, :10] == 0) and np.all(np.isneginf(lse[:, :10]))


# ============================================================ 4. a KVCache shared between threads

@pytest.mark.parametrize("op", ["step", "append"])
def test_two_python_threads_sharing_a_cache_keep_every_token(op):
    per_thread, n_threads = 1500, 2
    cache = af.KVCache(1, 1, 2, per_thread * n_threads)
    q = np.zeros((1, 1, 1, 2), np.float32)
    barrier = threading.Barrier(n_threads)
    errors = []

    def worker(tid):
        try:
            barrier.wait()
            for i in range(per_thread):
                tok = np.full((1, 1, 1, 2), tid * 100_000 + i, np.float32)
                if op == "step":
                    cache.step(q, tok, tok)
                else:
                    cache.append(tok, tok)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    total = per_thread * n_threads
    assert cache.lengths.tolist() == [total]
    stored = cache.k[0, 0, :, 0]
    expected = {tid * 100_000 + i for tid in range(n_threads) for i in range(per_thread)}
    assert set(stored.tolist()) == expected, f"{total - len(set(stored.tolist()))} tokens lost"
    assert np.array_equal(cache.k, cache.v)       # each k row stored with its own v row
    for tid in range(n_threads):                  # each thread's tokens in its own order
        mine = stored[(stored >= tid * 100_000) & (stored < (tid + 1) * 100_000)]
        assert np.all(np.diff(mine) > 0)


def test_concurrent_truncate_reset_and_step_keep_the_cache_consistent(rng):
    cache = af.KVCache(1, 1, 4, 4000)
    q = np.zeros((1, 1, 1, 4), np.float32)
    stop = threading.Event()
    errors = []

    def stepper():
        try:
            for i in range(1500):
                tok = np.full((1, 1, 1, 4), float(i), np.float32)
                cache.step(q, tok, tok)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            stop.set()

    def shrinker():
        while not stop.is_set():
            n = int(cache.lengths[0])
            try:
                cache.truncate(n // 2)
            except ValueError:  # the length moved between the read and the call: fine
                pass

    ts = [threading.Thread(target=stepper), threading.Thread(target=shrinker)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errors, errors
    n = int(cache.lengths[0])
    assert 0 <= n <= 4000
    assert np.array_equal(cache.k[0, 0, :n], cache.v[0, 0, :n])  # k and v rows paired


# ============================================================ 5. Ctrl-C

_LONG_CALL = """
import signal, sys, time, numpy as np, attnfast as af
# Python's default handler, whatever the parent left (an ignored SIGINT is inherited)
signal.signal(signal.SIGINT, signal.default_int_handler)
q = np.random.default_rng(0).random((1, 8, 16384, 64), dtype=np.float32)
{setup}
print("READY", flush=True)
t0 = time.time()
try:
    {call}
except KeyboardInterrupt:
    print("INTERRUPTED", time.time(), {after}, flush=True)
    raise
print("FINISHED", time.time() - t0, flush=True)
"""


def _interrupt(setup, call, after="None", budget=2.5):
    """Start the long call in a subprocess, SIGINT it ~1 s in; returns (seconds from the
    signal to exit, returncode, stdout, stderr). The child is killed at the budget."""
    code = _LONG_CALL.format(setup=setup, call=call, after=after)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
        time.sleep(1.0)
        sent = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=budget)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            return None, proc.returncode, out, err
        return time.monotonic() - sent, proc.returncode, out, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_c_stops_a_long_prefill_within_two_seconds(parent_sigint):
    elapsed, rc, out, err = _interrupt("", "af.attention(q, q, q)")
    assert "FINISHED" not in out, "the prefill is not long enough for this test"
    assert elapsed is not None, "still computing 2.5 s after SIGINT (the signal waits for the call)"
    assert "KeyboardInterrupt" in err and rc != 0


def test_ctrl_c_during_kvcache_step_restores_the_lengths(parent_sigint):
    setup = ("cache = af.KVCache(1, 8, 64, 16384 + 8)\n"
             "cache.append(q[:, :, :8], q[:, :, :8])\n"
             "before = cache.lengths.tolist()")
    elapsed, rc, out, err = _interrupt(setup, "cache.step(q[:, :, 8:], q[:, :, 8:], q[:, :, 8:], causal=False)",
                                       after="*(before, cache.lengths.tolist())")
    assert elapsed is not None, "still computing 2.5 s after SIGINT"
    line = [ln for ln in out.splitlines() if ln.startswith("INTERRUPTED")]
    assert line, out + err
    assert line[0].endswith("[8] [8]"), f"lengths not restored: {line[0]}"


def test_ctrl_c_stops_a_ragged_paged_batch_within_two_seconds(parent_sigint):
    """attention_varlen(block_table=) runs every sequence in one kernel call: Ctrl-C stops it
    as it stops one attention call."""
    setup = ("pool = q[0].reshape(8, 1024, 16, 64).transpose(1, 0, 2, 3).copy()  # 1024 blocks of 16\n"
             "table = np.arange(1024, dtype=np.int32).reshape(1, 1024)\n"
             "qp = np.ascontiguousarray(q[0].transpose(1, 0, 2))  # (16384, 8, 64): one long chunk\n"
             "cu = np.array([0, 16384], np.int32); used = np.array([16384], np.int32)")
    elapsed, rc, out, err = _interrupt(setup, "af.attention_varlen(qp, pool, pool, cu, seqused_k=used, "
                                              "block_table=table)")
    assert "FINISHED" not in out, "the batch is not long enough for this test"
    assert elapsed is not None, "still computing 2.5 s after SIGINT (the signal waits for the call)"
    assert "KeyboardInterrupt" in err and rc != 0


def test_an_ignored_or_custom_sigint_never_cuts_a_call_short():
    """With SIGINT ignored (a background job) or a handler of the caller's own, a signal
    during a call leaves the result whole: the kernels are only interruptible under Python's
    default handler."""
    code = (
        "import signal, threading, os, numpy as np, attnfast as af\n"
        "q = np.random.default_rng(0).standard_normal((8, 8192, 64)).astype(np.float32)\n"
        "ref = af.attention(q, q, q, causal=True)\n"
        "seen = []\n"
        "for handler in (signal.SIG_IGN, lambda *a: seen.append(1)):\n"
        "    signal.signal(signal.SIGINT, handler)\n"
        "    threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
        "    out = af.attention(q, q, q, causal=True)\n"
        "    assert np.array_equal(out, ref), 'result cut short'\n"
        "print('OK', len(seen))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK 1", proc.stdout + proc.stderr


# ============================================================ 6. error messages

def test_float_max_seqlen_is_a_type_error_naming_it(rng):
    q = normal(rng, 6, 2, 8)
    cu = np.array([0, 2, 6])
    for name in ("max_seqlen_q", "max_seqlen_k"):
        with pytest.raises(TypeError, match=name):
            af.attention_varlen(q, q, q, cu, cu, **{name: 4.0})
        with pytest.raises(ValueError, match=name):
            af.attention_varlen(q, q, q, cu, cu, **{name: 1})
        for big in (2**63, 10**30):  # a true upper bound: accepted
            np.testing.assert_array_equal(af.attention_varlen(q, q, q, cu, cu, **{name: big}),
                                          af.attention_varlen(q, q, q, cu, cu))


def test_varlen_head_mismatch_reports_the_callers_shapes(rng):
    q, k = normal(rng, 6, 3, 8), normal(rng, 5, 2, 8)
    with pytest.raises(ValueError) as info:
        af.attention_varlen(q, k, k, np.array([0, 2, 6]), np.array([0, 1, 5]))
    msg = str(info.value)
    assert "(6, 3, 8)" in msg and "(5, 2, 8)" in msg, msg


def test_append_with_an_empty_batch_index_does_not_blame_a_dtype(rng):
    cache = filled_cache(rng)
    before = cache_bytes(cache)
    with pytest.raises(ValueError, match="batch_index") as info:
        cache.append(normal(rng, 0, 2, 1, 8), normal(rng, 0, 2, 1, 8), batch_index=[])
    assert "float64" not in str(info.value)
    assert cache_bytes(cache) == before


@pytest.mark.parametrize("value", ["abc", "-3", "0", "2.5", "1e3"])
def test_invalid_attnfast_num_threads_warns_and_is_ignored(value):
    code = """
    import warnings, io, contextlib
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        import attnfast as af
    print("WARNINGS", [str(x.message) for x in w])
    print("GET", af.get_num_threads())
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        af.show_config()
    print("CONFIG", buf.getvalue().replace("\\n", " | "))
    import numpy as np
    q = np.ones((2, 5, 4), np.float32)
    print("SUM", float(af.attention(q, q, q).sum()))
    """
    res = run_python(code, env={"ATTNFAST_NUM_THREADS": value})
    assert res.returncode == 0, res.stderr
    lines = dict(ln.split(" ", 1) for ln in res.stdout.splitlines() if " " in ln)
    assert "ATTNFAST_NUM_THREADS" in lines["WARNINGS"], res.stdout
    assert 1 <= int(lines["GET"]) <= CORES
    assert "ATTNFAST_NUM_THREADS" in lines["CONFIG"], "show_config() does not say why it was ignored"
    assert float(lines["SUM"]) == pytest.approx(40.0)


# ============================================================ resources

def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _entry_points(rng):
    q, k, v = normal(rng, 2, 5, 8), normal(rng, 2, 7, 8), normal(rng, 2, 7, 8)
    qd = normal(rng, 1, 2, 1, 8)
    qp, cu = normal(rng, 6, 2, 8), np.array([0, 2, 6])
    o1, l1 = af.attention(q, k[:, :3], v[:, :3], return_lse=True)
    o2, l2 = af.attention(q, k[:, 3:], v[:, 3:], return_lse=True)
    cache = af.KVCache(1, 2, 8, 8)
    kc, vc = np.zeros((1, 2, 8, 8), np.float32), np.zeros((1, 2, 8, 8), np.float32)
    tok = normal(rng, 1, 2, 1, 8)

    def kv_cycle():
        if cache.lengths[0] >= 8:
            cache.reset()
        cache.step(qd, tok, tok)

    def bad_call():
        try:
            af.attention(q, k, v, window=(-5, 0))
        except ValueError:
            pass

    return {
        "attention": lambda: af.attention(q, k, v, causal=True, return_lse=True),
        "attention_weights": lambda: af.attention_weights(q, k),
        "attention_varlen": lambda: af.attention_varlen(qp, qp, qp, cu, cu, return_lse=True),
        "merge_attention_states": lambda: af.merge_attention_states([o1, o2], [l1, l2]),
        "KVCache.step/reset": kv_cycle,
        "KVCache.attend": lambda: cache.attend(qd),
        "attention_with_kvcache": lambda: af.attention_with_kvcache(qd, kc, vc, 3, tok, tok),
        "rejected call": bad_call,
    }


@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="ASan's quarantine holds freed memory: RSS is not a leak signal there")
@pytest.mark.parametrize("name", list(_entry_points(np.random.default_rng(0))))
def test_ten_thousand_calls_leave_rss_flat(rng, name):
    # One thread: on a loaded 2-core machine each OpenMP fork/join of a tiny call can wait a
    # scheduler tick, which would make 10^4 calls take a minute. Leaks are per call anyway.
    af.set_num_threads(1)
    fn = _entry_points(rng)[name]
    for _ in range(2000):   # warm-up: allocator pools, OpenMP threads, caches
        fn()
    start = _rss()
    for _ in range(10_000):
        fn()
    grown = _rss() - start
    assert grown < 1 << 20, f"{name}: RSS grew by {grown / 1024:.0f} KiB over 10^4 calls"


# ============================================================ other defects found

@pytest.mark.parametrize("method", ["append", "step"])
def test_read_only_cache_values_are_rejected_before_the_keys_are_written(rng, method):
    """A user can make KVCache.v read-only (it is the cache's own array): append and step
    must then fail before anything is written, not after writing the keys."""
    cache = filled_cache(rng)
    cache.v.flags.writeable = False
    before = cache_bytes(cache)
    k_new, v_new = normal(rng, 2, 2, 1, 8), normal(rng, 2, 2, 1, 8)
    with pytest.raises(ValueError, match=r"cache\.v|read-only"):
        if method == "append":
            cache.append(k_new, v_new)
        else:
            cache.step(normal(rng, 2, 4, 1, 8), k_new, v_new)
    assert cache_bytes(cache) == before


def test_attention_weights_with_no_query_heads_matches_attention(rng):
    """Found by the long hypothesis profile: H = 0 query heads over Hkv = 2 KV heads is
    accepted by attention() but attention_weights() fails inside NumPy."""
    q, k = normal(rng, 0, 3, 4), normal(rng, 2, 5, 4)
    assert af.attention(q, k, k).shape == (0, 3, 4)
    assert af.attention_weights(q, k).shape == (0, 3, 5)
