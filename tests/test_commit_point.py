"""Issue 45, classes 4 and 6.

4. Ctrl-C after the commit. A call that changes a cache either returns, or raises and leaves
   every byte as it was (k, v, scales, lengths; a paged pool's free list, reference counts and
   sequences too): a KeyboardInterrupt raised anywhere in attnfast's Python code before the
   call has returned (releasing the lock, plan bookkeeping, the torch wrapper, ...) puts back
   what it wrote, so a caller that retries appends once (attnfast._transaction).

   Probed as a signal reaches Python code: (a) a sys.settrace tracer raises KeyboardInterrupt
   at the n-th line event inside attnfast's Python code, swept over n for every mutating entry
   point, on the full path (no plans), the fast path in C and the fast path in Python; (b)
   SIGALRM at random times during real decode steps, turned into KeyboardInterrupt when it is
   handled inside attnfast (a Ctrl-C handled after the call returned is the caller's), with a
   twin cache that replays only the calls that returned.

6. KVCache(..., latent=True) with v_head_dim == head_dim (latent's default): v is k itself, and
   step works (it used to blame the caller for the cache's own arrays), against float64.
"""
import os
import signal
import sys
import threading
import time

import ml_dtypes
import numpy as np
import pytest

import attnfast as af
from attnfast import _ext, _kvcache, _plans, _transaction
from reference import TOLERANCE, reference_attention

PKG = os.path.dirname(os.path.abspath(af.__file__)) + os.sep
F32 = np.dtype(np.float32)
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(autouse=True)
def _one_thread():
    """The kernels on one thread: thousands of small calls, each of which could otherwise
    wait for a second thread on a busy machine (which thread runs is not what is tested)."""
    af.set_num_threads(1)
    yield
    af.set_num_threads(None)


def rand(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


# ============================================================ 4. interrupts at every line

class InterruptAt:
    """sys.settrace tracer: KeyboardInterrupt at the n-th line event in attnfast's Python
    code (as a Ctrl-C handled just before that line raises it); n None: never. Counts the
    line events it sees."""

    def __init__(self, n=None):
        self.n, self.count = n, 0

    def __call__(self, frame, event, arg):  # 'call': trace attnfast's frames only
        return self.line if frame.f_code.co_filename.startswith(PKG) else None

    def line(self, frame, event, arg):
        if event == "line":
            self.count += 1
            if self.count == self.n:
                raise KeyboardInterrupt(f"test_commit_point: line event {self.n}")
        return self.line


def traced(call, n=None):
    """("returned", result, events) or ("raised", None, events) of call() interrupted at
    line event n."""
    tracer, previous = InterruptAt(n), sys.gettrace()
    sys.settrace(tracer)
    try:
        result = call()
    except KeyboardInterrupt:
        if tracer.count != n:
            raise
        return "raised", None, tracer.count
    finally:
        sys.settrace(previous)
    return "returned", result, tracer.count


def as_bytes(x):
    """A comparable form of a result or state: arrays by dtype, shape and bytes."""
    if isinstance(x, np.ndarray):
        return (x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, (tuple, list)):
        return tuple(as_bytes(e) for e in x)
    if isinstance(x, dict):
        return tuple(sorted((k, as_bytes(v)) for k, v in x.items()))
    return x


def kvcache_state(c):
    return as_bytes([c.k, c.v, c.k_scale, c.v_scale, c.lengths])


def paged_state(p):
    return as_bytes([p.k, p.v, p.k_scale, p.v_scale, list(p._free), p._refs, p._next_id,
                     {s: (tuple(q.blocks), q.length) for s, q in p._seqs.items()}])


# Each scenario: make(rng) -> (call, state, lock): a fresh object in a fixed state, the
# mutating call to interrupt, a function returning everything the call may change, and the
# object's lock (None for attention_with_kvcache).

def _token_dtype(c):
    """What new tokens and queries of cache c are: float32 over int8 / int4, else its dtype."""
    return np.float32 if c.dtype in (np.int8, np.uint8) else c.dtype


def _filled_cache(rng, dtype=np.float32, latent=False, B=2, Hkv=2, D=16, C=24, held=5):
    c = af.KVCache(B, Hkv, D, C, dtype=dtype, latent=latent)
    k = rand(rng, B, Hkv, held, D, dtype=_token_dtype(c))
    c.append(k, None if latent else k[..., ::-1].copy())
    return c


def _tokens(rng, c, t=1, H=4):
    dt = _token_dtype(c)
    q = rand(rng, c.batch, H, t, c.head_dim, dtype=dt)
    k = rand(rng, c.batch, c.kv_heads, t, c.head_dim, dtype=dt)
    return q, k, (None if c.latent else rand(rng, c.batch, c.kv_heads, t, c.v_head_dim, dtype=dt))


def kv_step(dtype=np.float32, latent=False, **options):
    def make(rng):
        c = _filled_cache(rng, dtype, latent)
        q, k, v = _tokens(rng, c)
        return (lambda: c.step(q, k, v, **options)), (lambda: kvcache_state(c)), c._lock
    return make


def kv_append(dtype=np.float32, t=2):
    def make(rng):
        c = _filled_cache(rng, dtype)
        _, k, v = _tokens(rng, c, t)
        return (lambda: c.append(k, v, batch_index=[1, 0])), (lambda: kvcache_state(c)), c._lock
    return make


def kv_truncate(rng):
    c = _filled_cache(rng)
    return (lambda: c.truncate([3, 4])), (lambda: kvcache_state(c)), c._lock


def kv_reset(rng):
    c = _filled_cache(rng)
    return c.reset, (lambda: kvcache_state(c)), c._lock


def functional(block_table=False, dtype=np.float32, **options):
    """attention_with_kvcache with k_new / v_new over caller-owned arrays (paged: a pool)."""
    def make(rng):
        B, Hkv, D, C = 2, 2, 16, 16
        q = rand(rng, B, 4, 1, D, dtype=dtype)
        k_new, v_new = rand(rng, B, Hkv, 1, D, dtype=dtype), rand(rng, B, Hkv, 1, D, dtype=dtype)
        if block_table:
            kc, vc = rand(rng, 8, Hkv, 4, D, dtype=dtype), rand(rng, 8, Hkv, 4, D, dtype=dtype)
            table = np.array([[5, 2, 7, 0], [1, 6, 3, 4]], np.int32)
            call = lambda: af.attention_with_kvcache(q, kc, vc, np.array([5, 8]), k_new, v_new,
                                                     block_table=table)
        else:
            kc, vc = rand(rng, B, Hkv, C, D, dtype=dtype), rand(rng, B, Hkv, C, D, dtype=dtype)
            call = lambda: af.attention_with_kvcache(q, kc, vc, np.array([5, 9]), k_new, v_new,
                                                     **options)
        return call, (lambda: as_bytes([kc, vc])), None
    return make


def _pool(rng, dtype=np.float32, latent=False):
    """A pool of 12 blocks of 4 with sequence 0 (6 tokens) and its fork 1 (sharing its
    blocks, the last one partly filled)."""
    p = af.PagedKVCache(12, 4, 2, 16, dtype=dtype, latent=latent)
    a = p.add_sequence()
    k = rand(rng, 2, 6, 16)
    p.append(a, k, None if latent else k[..., ::-1].copy())
    p.fork(a)
    return p


def paged(method, dtype=np.float32, latent=False):
    def make(rng):
        p = _pool(rng, dtype, latent)
        k = rand(rng, 2, 2, 3, 16)  # 3 tokens: copy-on-write of the shared block, a new one
        v = None if latent else rand(rng, 2, 2, 3, 16)
        q = rand(rng, 2, 4, 3, 16)
        call = {"step": lambda: p.step([0, 1], q, k, v),
                "append": lambda: p.append([1, 0], k, v),
                "fork": lambda: p.fork(1),
                "free": lambda: p.free(0),
                "truncate": lambda: p.truncate(1, 1),
                "add_sequence": p.add_sequence}[method]
        return call, (lambda: paged_state(p)), p._lock
    return make


# name: (make, whether the call has a fast path of its own)
SCENARIOS = {
    "KVCache.step": kv_step(),
    "KVCache.step int8": kv_step("int8"),
    "KVCache.step int4": kv_step("int4"),
    "KVCache.step bfloat16": kv_step(BF16),
    "KVCache.step latent": kv_step(latent=True),
    "KVCache.step return_lse": kv_step(return_lse=True),
    "KVCache.append": kv_append(),
    "KVCache.append int8": kv_append("int8"),
    "KVCache.truncate": kv_truncate,
    "KVCache.reset": kv_reset,
    "attention_with_kvcache": functional(),
    "attention_with_kvcache float16": functional(dtype=np.float16),
    "attention_with_kvcache paged": functional(block_table=True),
    "PagedKVCache.step": paged("step"),
    "PagedKVCache.step int8": paged("step", "int8"),
    "PagedKVCache.step latent": paged("step", latent=True),
    "PagedKVCache.append": paged("append"),
    "PagedKVCache.fork": paged("fork"),
    "PagedKVCache.free": paged("free"),
    "PagedKVCache.truncate": paged("truncate"),
    "PagedKVCache.add_sequence": paged("add_sequence"),
}

# How a call runs: the full checks (no remembered plans), or a layout seen before (the fast
# path, finished in C).
MODES = ["full", "fast"]
FAST = {"KVCache.step", "KVCache.step bfloat16", "KVCache.step latent", "attention_with_kvcache",
        "attention_with_kvcache float16"}
CASES = [(name, mode) for name in sorted(SCENARIOS) for mode in MODES
         if mode == "full" or name in FAST]


def _prepare(mode, make, seed):
    if mode == "full":
        for memo in (_plans.ATTENTION_PLANS, _plans.KVCACHE_PLANS, _plans.PAGED_PLANS):
            memo.clear()
    return make(np.random.default_rng(seed))


def _sweep_points(events, slow):
    """Every event in the slow run; else about 30 spread over the call, and all of the last
    30 (the commit, the bookkeeping after it and the way out)."""
    if slow:
        return range(1, events + 1)
    every = set(range(1, events + 1, max(1, events // 30)))
    return sorted(every | set(range(max(1, events - 29), events + 1)))


def free_elsewhere(lock) -> bool:
    """Whether another thread can take `lock` (no interrupted call left it held)."""
    taken = []

    def take():
        taken.append(lock.acquire(timeout=1.0))
        if taken[0]:
            lock.release()
    thread = threading.Thread(target=take)
    thread.start()
    thread.join()
    return taken[0]


def sweep(make, mode, slow=False):
    seed = 7
    if mode != "full":  # the layout seen once: its plan is remembered
        make(np.random.default_rng(seed))[0]()
    call, state, _ = _prepare(mode, make, seed)
    status, want_result, events = traced(call)
    want_state = state()
    assert status == "returned" and events > 0
    outcomes = {"returned": 0, "raised": 0}
    for n in _sweep_points(events, slow):
        call, state, lock = _prepare(mode, make, seed)
        before = state()
        status, result, _ = traced(call, n)
        outcomes[status] += 1
        if status == "raised":
            assert state() == before, f"interrupted at line event {n} of {events}: state changed"
            assert lock is None or free_elsewhere(lock), f"line event {n}: the lock left held"
        else:
            assert state() == want_state, f"line event {n} of {events}: returned, state wrong"
            assert as_bytes(result) == as_bytes(want_result)
            continue
        # a caller that retries: the call happens exactly once (and the lock was released)
        status, result, _ = traced(call)
        assert status == "returned" and state() == want_state, f"retry after line event {n}"
        assert as_bytes(result) == as_bytes(want_result)
    return outcomes


@pytest.mark.parametrize("name, mode", CASES)
def test_an_interrupt_at_any_line_changes_nothing_or_the_call_completes(name, mode):
    outcomes = sweep(SCENARIOS[name], mode)
    assert outcomes["raised"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name, mode", CASES)
def test_every_line_event_slow(name, mode):
    sweep(SCENARIOS[name], mode, slow=True)


def test_torch_tensors_too():
    """The torch wrapper (attnfast._interop) runs after the commit: inside the transaction."""
    torch = pytest.importorskip("torch")

    def make(rng):
        c = _filled_cache(rng)
        q, k, v = (torch.from_numpy(a) for a in _tokens(rng, c))
        return (lambda: c.step(q, k, v).numpy()), (lambda: kvcache_state(c)), c._lock
    for mode in ("full", "fast"):
        assert sweep(make, mode)["raised"] > 0


def test_a_second_interrupt_while_putting_back_does_not_stop_it(monkeypatch):
    """Ctrl-C pressed again while a rolled-back call runs its undo log: every change is
    still put back (each log entry may run again), and the first interrupt is the one raised."""
    rng = np.random.default_rng(3)
    c = _filled_cache(rng, "int8")
    q, k, v = _tokens(rng, c)
    before = kvcache_state(c)
    real, calls = _transaction.write_rows, []

    def write_rows(*args):  # the write's undo is followed by one interrupted twice
        real(*args)

        def interrupted():
            calls.append(1)
            if len(calls) <= 2:
                raise KeyboardInterrupt("again")
        _transaction.logged(interrupted)
    monkeypatch.setattr(_transaction, "write_rows", write_rows)

    def bookkeeping(*args):  # after the kernels: the call has written everything
        raise KeyboardInterrupt("first")
    monkeypatch.setattr(_kvcache, "remember", bookkeeping)
    _plans.KVCACHE_PLANS.clear()  # the full path, which remembers the plan after the commit
    with pytest.raises(KeyboardInterrupt, match="first"):
        c.step(q, k, v)
    assert kvcache_state(c) == before and len(calls) == 3


@pytest.mark.parametrize("where", ["KVCache._run_locked", "KVCache fast",
                                   "KVCache fast lse", "PagedKVCache._run_locked",
                                   "attention_with_kvcache", "attention_with_kvcache lse",
                                   "attention_with_kvcache paged"])
def test_an_error_after_the_commit_undoes_the_call(where, monkeypatch):
    """Not only Ctrl-C: any exception before the return (MemoryError here, raised once the
    tokens are written, the lengths advanced and the kernels have run) is a failure and
    leaves nothing behind."""
    make, owner, name = {
        # softcap: an option no plan covers, so the full path runs
        "KVCache._run_locked": (kv_step(softcap=30.0), af.KVCache, "_run_locked"),
        "KVCache fast": (kv_step(), _ext, "decode_fast"),
        "KVCache fast lse": (kv_step(return_lse=True), _ext, "decode_fast"),
        "PagedKVCache._run_locked": (paged("step"), af.PagedKVCache, "_run_locked"),
        "attention_with_kvcache": (functional(), _ext, "decode_fast"),
        "attention_with_kvcache lse": (functional(return_lse=True), _ext, "decode_fast"),
        "attention_with_kvcache paged": (functional(block_table=True), _kvcache,
                                         "run_cache_kernels")}[where]
    make(np.random.default_rng(4))[0]()  # the layout's plan: the fast paths run
    call, state, _ = make(np.random.default_rng(4))
    before = state()
    real = getattr(owner, name)

    def then_fail(*args, **kwargs):
        result = real(*args, **kwargs)
        assert result is not None  # (the path ran)
        raise MemoryError("after the commit")
    monkeypatch.setattr(owner, name, then_fail)
    with pytest.raises(MemoryError):
        call()
    assert state() == before


def test_nested_entry_points_are_undone_with_the_outer_call():
    """An entry point called inside another's transaction joins it: if the outer call then
    raises, the inner call's writes are undone too."""
    rng = np.random.default_rng(5)
    c = _filled_cache(rng)
    q, k, v = _tokens(rng, c)
    before = kvcache_state(c)
    from attnfast._transaction import transaction

    @transaction()
    def outer():
        c.step(q, k, v)
        c.append(k, v)
        raise KeyboardInterrupt("outer")
    with pytest.raises(KeyboardInterrupt):
        outer()
    assert kvcache_state(c) == before
    c.step(q, k, v)  # and the cache works afterwards (its lock released)
    assert c.lengths.tolist() == [6, 6]


def test_the_lock_is_held_until_the_call_has_returned():
    """No other thread sees the cache between the commit and the return (where an undo
    would pull the tokens from under it)."""
    rng = np.random.default_rng(6)
    c = _filled_cache(rng)
    q, k, v = _tokens(rng, c)
    seen = []

    def bookkeeping(memo, key, plan):  # runs after the commit, inside the call
        t = threading.Thread(target=lambda: seen.append(c._lock.acquire(timeout=0.05)))
        t.start()
        t.join()
    real = _kvcache.remember
    _kvcache.remember = bookkeeping
    try:
        _plans.KVCACHE_PLANS.clear()  # the full path, which remembers the plan
        c.step(q, k, v)
    finally:
        _kvcache.remember = real
    assert seen == [False], seen
    assert c._lock.acquire(timeout=1)  # released once the call returned
    c._lock.release()


# ============================================================ 4. real signals, random times

def _alarm_probe(make_call, calls=600, seconds=6.0):
    """Run make_call()'s (call, replay, compare) `calls` times with SIGALRM set to a random
    time within ~1.5 calls' duration; a SIGALRM handled inside attnfast's Python code raises
    KeyboardInterrupt (a Ctrl-C there), one handled in this file's code (the call has not
    started or has returned) is dropped. After every call: if it returned, the twin replays
    it; the cache and the twin must then hold the same bytes. A SIGALRM delivered late (to a
    kernel worker thread the busy machine has not run yet) is dropped once the call is over."""
    armed = [False]

    def handler(signum, frame):
        if not armed[0]:
            return
        f = frame
        while f is not None:
            if f.f_code.co_filename.startswith(PKG):
                raise KeyboardInterrupt("test_commit_point: SIGALRM")
            f = f.f_back

    call, replay, compare, reset = make_call()
    for _ in range(4):  # the first calls of a layout take the full path: not timed
        call()
        replay()
    t0 = time.perf_counter()
    for _ in range(20):
        call()
        replay()
    span = (time.perf_counter() - t0) / 20 * 1.5
    reset()
    previous = signal.signal(signal.SIGALRM, handler)
    rng = np.random.default_rng(0)
    raised = returned = 0
    deadline = time.monotonic() + seconds
    try:
        for i in range(calls):
            if time.monotonic() > deadline and raised >= 5 and returned >= 5:
                break
            armed[0] = True
            signal.setitimer(signal.ITIMER_REAL, float(rng.uniform(1e-6, span)))
            try:
                call()
                ok = True
            except KeyboardInterrupt:
                ok = False
            finally:
                armed[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
            if ok:
                returned += 1
                replay()
            else:
                raised += 1
            compare(i)
            if i % 8 == 7:
                reset()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return raised, returned


def _kvcache_probe(dtype, Hkv=2, D=64, C=40):
    rng = np.random.default_rng(1)
    cache, twin = (af.KVCache(1, Hkv, D, C, dtype=dtype) for _ in range(2))
    dt = np.float32 if dtype == "int8" else dtype
    q, k, v = rand(rng, 1, 8, 1, D, dtype=dt), rand(rng, 1, Hkv, 1, D, dtype=dt), rand(rng, 1, Hkv, 1, D, dtype=dt)

    def compare(i):
        assert kvcache_state(cache) == kvcache_state(twin), f"call {i}: cache != replay"

    def reset():
        cache.truncate(0)
        twin.truncate(0)
    return (lambda: cache.step(q, k, v)), (lambda: twin.step(q, k, v)), compare, reset


def _paged_probe():
    rng = np.random.default_rng(2)
    pools = [af.PagedKVCache(40, 4, 2, 32) for _ in range(2)]
    for p in pools:
        p.add_sequence()
        p.fork(0)
    q, k = rand(rng, 2, 4, 1, 32), rand(rng, 2, 2, 1, 32)

    def compare(i):
        assert paged_state(pools[0]) == paged_state(pools[1]), f"call {i}: pool != replay"

    def reset():
        for p in pools:
            p.truncate(0, 0)
            p.truncate(1, 0)
    return (lambda: pools[0].step([0, 1], q, k, k)), (lambda: pools[1].step([0, 1], q, k, k)), \
        compare, reset


@pytest.mark.parametrize("probe", ["KVCache int8", "KVCache float32", "PagedKVCache"])
def test_random_signals_during_steps_never_leave_a_half_call(probe):
    """The issue's probe: random interrupts of decode steps (KVCache(dtype="int8").step used
    to raise with the token written and lengths advanced for 1-3 % of them)."""
    make = {"KVCache int8": lambda: _kvcache_probe("int8"),
            "KVCache float32": lambda: _kvcache_probe(np.float32),
            "PagedKVCache": _paged_probe}[probe]
    raised, returned = _alarm_probe(make)
    assert raised >= 5 and returned >= 5, (raised, returned)


# ============================================================ 6. latent, v_head_dim == head_dim

def _latent_reference(q, rows, Dv):
    return reference_attention(q, rows, rows[..., :Dv], causal=True)[0]


def _tolerance(dtype):
    """out is rounded once to the cache's dtype (accumulation in float32)."""
    if dtype == BF16:
        return dict(rtol=1e-2, atol=1e-2)
    return dict(rtol=2e-3, atol=2e-3) if dtype == np.float16 else TOLERANCE[F32]


@pytest.mark.parametrize("dtype", [F32, np.dtype(np.float16), BF16],
                         ids=["float32", "float16", "bfloat16"])
def test_latent_kvcache_with_v_head_dim_equal_to_head_dim_steps(dtype):
    """latent=True alone gives v_head_dim == head_dim: v is k itself (a full prefix view), and
    step writes each latent row once and attends with V = K."""
    rng = np.random.default_rng(61)
    B, H, D = 2, 8, 40
    cache = af.KVCache(B, 1, D, 64, dtype=dtype, latent=True)
    assert cache.v_head_dim == D and np.shares_memory(cache.k, cache.v)
    rows = rand(rng, B, 1, 7, D, dtype=dtype)
    out = cache.step(rand(rng, B, H, 7, D, dtype=dtype), rows)  # prefill, causal
    for tq in (1, 1, 3, 1):
        q, new = rand(rng, B, H, tq, D, dtype=dtype), rand(rng, B, 1, tq, D, dtype=dtype)
        out, lse = cache.step(q, new, return_lse=True)
        rows = np.concatenate([rows, new], axis=2)
        np.testing.assert_allclose(out.astype(np.float64), _latent_reference(q, rows, D),
                                   **_tolerance(dtype))
        again = cache.step(q, new)  # the fast path of the same layout
        rows = np.concatenate([rows, new], axis=2)
        np.testing.assert_allclose(again.astype(np.float64), _latent_reference(q, rows, D),
                                   **_tolerance(dtype))
    assert cache.lengths.tolist() == [rows.shape[2]] * B
    assert cache.k[:, :, :rows.shape[2]].tobytes() == rows.tobytes()


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_latent_paged_pool_with_v_head_dim_equal_to_head_dim_steps(dtype):
    rng = np.random.default_rng(62)
    H, D = 8, 24
    pool = af.PagedKVCache(16, 4, 1, D, dtype=dtype, latent=True)
    assert pool.v_head_dim == D
    a = pool.add_sequence()
    prefix = rand(rng, 1, 1, 6, D, dtype=dtype)
    pool.append(a, prefix[0])
    b = pool.fork(a)  # the shared, partly filled last block is copied on write
    rows = [prefix, prefix]
    for tq in (1, 2, 1):
        q, new = rand(rng, 2, H, tq, D, dtype=dtype), rand(rng, 2, 1, tq, D, dtype=dtype)
        out = pool.step([a, b], q, new)
        for i in range(2):
            rows[i] = np.concatenate([rows[i], new[i:i + 1]], axis=2)
            np.testing.assert_allclose(out[i:i + 1].astype(np.float64),
                                       _latent_reference(q[i:i + 1], rows[i], D),
                                       **_tolerance(dtype))
    assert pool.lengths == {a: 10, b: 10}


def test_one_array_as_both_caches_is_a_latent_cache_when_v_new_is_k_new():
    """attention_with_kvcache(q, kc, kc, L, new, new): the same array as both caches with the
    same new rows is a latent cache (V = K); different v_new is refused, writing nothing."""
    rng = np.random.default_rng(63)
    D, L = 16, 9
    kc = rand(rng, 1, 2, 20, D)
    q, new = rand(rng, 1, 4, 1, D), rand(rng, 1, 2, 1, D)
    before = kc.copy()
    with pytest.raises(ValueError, match="share memory"):
        af.attention_with_kvcache(q, kc, kc, L, new, rand(rng, 1, 2, 1, D))
    assert np.array_equal(kc, before)
    out = af.attention_with_kvcache(q, kc, kc, L, new, new)
    rows = np.concatenate([before[:, :, :L], new], axis=2)
    np.testing.assert_allclose(out, _latent_reference(q, rows, D), **TOLERANCE[F32])
    assert np.array_equal(kc[:, :, L], new[:, :, 0])


@pytest.mark.parametrize("dv", [32, 16], ids=["same array", "prefix view"])
def test_a_quantised_cache_never_shares_rows_between_k_and_v(dv):
    """int8 keys and values are quantised apart (the keys rotated): one array cannot hold
    both, so sharing memory stays refused, writing nothing."""
    rng = np.random.default_rng(64)
    kc = np.zeros((1, 1, 16, 32), np.int8)
    k_scale, v_scale = np.zeros((1, 1, 16), np.float32), np.zeros((1, 1, 16), np.float32)
    new = rand(rng, 1, 1, 1, 32)
    with pytest.raises(ValueError, match="k_cache and v_cache share memory"):
        af.attention_with_kvcache(rand(rng, 1, 2, 1, 32), kc, kc[..., :dv], 3, new,
                                  new[..., :dv], k_scale=k_scale, v_scale=v_scale,
                                  key_rotation="hadamard")
    assert not kc.any() and not k_scale.any() and not v_scale.any()
