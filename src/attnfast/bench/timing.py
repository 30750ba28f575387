"""Timing: repeats of a call, thread settings, a progress bar, and the runners of ``attnfast
bench`` (a decode step at context L, generating tokens cached against recomputed)."""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np

__all__ = ["time_call", "median", "linear_fit", "Threads", "Progress", "random_array",
           "activation_dtype", "DecodeBench", "run_generation"]


def time_call(fn, *, budget: float, min_repeats: int = 3, max_repeats: int = 200,
              setup=None, warmup: int = 1) -> list[float]:
    """Wall times of repeated calls.

    Parameters
    ----------
    fn : callable
        Called without arguments; what is timed.
    budget : float
        Seconds of repeats: calls go on until this much time has passed.
    min_repeats, max_repeats : int
        Bounds on the number of timed calls, whatever the budget.
    setup : callable, optional
        Runs untimed before each call (e.g. to roll a cache back).
    warmup : int
        Untimed calls first.

    Returns
    -------
    list of float
        Seconds of each timed call.
    """
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_repeats or (
            len(times) < max_repeats and time.perf_counter() - start < budget):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def median(xs) -> float:
    """The median of ``xs`` as a float."""
    return float(statistics.median(xs))


def linear_fit(xs, ys) -> dict:
    """Least-squares ``ys = slope * xs + intercept``.

    Returns
    -------
    dict
        ``slope``, ``intercept`` and ``r2`` (all nan when there are fewer than two distinct xs).
    """
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    if len(x) < 2 or np.ptp(x) == 0:
        return {"slope": float("nan"), "intercept": float("nan"), "r2": float("nan")}
    slope, intercept = np.polyfit(x, y, 1)
    pred = slope * x + intercept
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    return {"slope": float(slope), "intercept": float(intercept), "r2": r2}


class Threads:
    """Run attnfast with ``n`` threads inside the block; restore the previous setting after."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        from .. import _runtime
        self.previous = _runtime._user_threads
        _runtime.set_num_threads(self.n)
        return self

    def __exit__(self, *exc):
        from .. import _runtime
        _runtime.set_num_threads(self.previous)


class Progress:
    """Progress over ``total`` steps on stderr: a tqdm bar, or one line per step without tqdm.

    Parameters
    ----------
    total : int
        Steps announced with :meth:`step`.
    enabled : bool
        False: print nothing.
    """

    def __init__(self, total: int, enabled: bool = True):
        self.total = max(1, total)
        self.started = False
        self.bar = self.stream = None
        self.start = time.perf_counter()
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            self.stream = sys.stderr
            return
        self.bar = tqdm(total=self.total, file=sys.stderr, dynamic_ncols=True,
                        bar_format="{n_fmt}/{total_fmt} {bar} {elapsed} {desc}")

    def step(self, label: str) -> None:
        """Announce the measurement about to run (counts the previous one as done)."""
        if self.bar is not None:
            if self.started:
                self.bar.update(1)
            self.bar.set_description_str(label)
        elif self.stream is not None:
            self.stream.write(f"{time.perf_counter() - self.start:7.1f}s  {label}\n")
            self.stream.flush()
        self.started = True

    def finish(self) -> None:
        """Count every step as done and say so."""
        if self.bar is not None:
            self.bar.set_description_str("done", refresh=False)
            self.bar.update(self.total - self.bar.n)
            self.bar.close()
        elif self.stream is not None:
            self.stream.write(f"{time.perf_counter() - self.start:7.1f}s  done\n")
            self.stream.flush()


def activation_dtype(dt: np.dtype) -> np.dtype:
    """Queries and new tokens for a cache of dtype dt (float32 for an int8 / float8 / int4
    cache: a quantised format of attnfast._formats)."""
    from .._formats import FORMATS
    fmt = FORMATS.get(dt.name)
    return np.dtype(np.float32) if fmt is not None and fmt.quantized else dt


def random_array(rng, shape, dtype) -> np.ndarray:
    """Standard-normal data of ``dtype`` (generated in float32/float64, then cast)."""
    gen_dtype = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    arr = rng.standard_normal(shape, dtype=gen_dtype)
    return arr if arr.dtype == dtype else arr.astype(dtype)


class DecodeBench:
    """Decode steps at chosen context lengths on one ``KVCache``.

    The cache is preallocated and filled once to the longest context; a step at context L is
    ``cache.step`` of one token on a cache holding L - 1 tokens (so it attends over L keys),
    rolled back with ``truncate`` (untimed) between repeats.
    """

    CHUNK = 4096  # tokens per append while filling: bounded temporaries

    def __init__(self, af, rng, batch, heads, kv_heads, head_dim, dtype, max_len):
        act = activation_dtype(dtype)  # queries and new tokens (float32 for an int8 cache)
        self.cache = af.KVCache(batch, kv_heads, head_dim, max_len, dtype=dtype)
        filled = 0
        while filled < max_len - 1:
            t = min(self.CHUNK, max_len - 1 - filled)
            self.cache.append(random_array(rng, (batch, kv_heads, t, head_dim), act),
                              random_array(rng, (batch, kv_heads, t, head_dim), act))
            filled += t
        self.filled = filled
        self.q = random_array(rng, (batch, heads, 1, head_dim), act)
        self.k_new = random_array(rng, (batch, kv_heads, 1, head_dim), act)
        self.v_new = random_array(rng, (batch, kv_heads, 1, head_dim), act)

    def set_length(self, n: int) -> None:
        """Make the cache hold ``n`` tokens (n <= the tokens filled in). ``truncate`` only
        shortens and keeps the stored tokens, so growing back just moves the length: the
        bench owns this cache, and every token below ``filled`` holds its data."""
        cache = self.cache
        if n <= int(cache.lengths[0]):
            cache.truncate(n)
            return
        assert n <= self.filled
        with cache._lock:
            cache._lengths[:] = n

    def step_at(self, length: int, budget: float, min_repeats: int) -> list[float]:
        """Times (s) of a decode step attending over ``length`` keys (see :func:`time_call`)."""
        self.set_length(length - 1)
        rollback = lambda: self.cache.truncate(length - 1)  # noqa: E731
        step = lambda: self.cache.step(self.q, self.k_new, self.v_new)  # noqa: E731
        return time_call(step, budget=budget, min_repeats=min_repeats, setup=rollback)

    def context(self, length: int):
        """K and V of the first ``length`` cached tokens, as views (for the recompute baseline)."""
        return self.cache.k[:, :, :length, :], self.cache.v[:, :, :length, :]


def run_generation(af, rng, batch, heads, kv_heads, head_dim, dtype, prompt, tokens) -> dict:
    """Generate ``tokens`` tokens after a ``prompt``-token prompt, cached against recomputed.

    Returns
    -------
    dict
        ``prompt``, ``tokens``, ``prompt_prefill_s``, ``cached_total_s``, ``recompute_total_s``,
        per-token ``cached_step_s`` and ``recompute_step_s``, ``speedup`` (recompute / cached)
        and ``max_abs_diff`` between the two paths' outputs.
    """
    total = prompt + tokens
    q = random_array(rng, (batch, heads, total, head_dim), dtype)
    k = random_array(rng, (batch, kv_heads, total, head_dim), dtype)
    v = random_array(rng, (batch, kv_heads, total, head_dim), dtype)

    # Warm both paths up on a throwaway cache / a short call (first-touch page faults, thread pool).
    warm = af.KVCache(batch, kv_heads, head_dim, 2, dtype=dtype)
    warm.step(q[:, :, :1], k[:, :, :1], v[:, :, :1])
    af.attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], causal=True)

    cache = af.KVCache(batch, kv_heads, head_dim, total, dtype=dtype)
    t0 = time.perf_counter()
    cache.step(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt])
    prompt_time = time.perf_counter() - t0
    cached_times, cached_rows = [], []
    for t in range(prompt, total):
        t0 = time.perf_counter()
        out = cache.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
        cached_times.append(time.perf_counter() - t0)
        cached_rows.append(np.array(out[:, :, -1], dtype=np.float64))

    recompute_times, max_diff = [], 0.0
    for n, t in enumerate(range(prompt, total)):
        t0 = time.perf_counter()
        out = af.attention(q[:, :, :t + 1], k[:, :, :t + 1], v[:, :, :t + 1], causal=True)
        recompute_times.append(time.perf_counter() - t0)
        diff = np.abs(np.asarray(out[:, :, -1], dtype=np.float64) - cached_rows[n]).max()
        max_diff = max(max_diff, float(diff))
    return {
        "prompt": prompt, "tokens": tokens, "prompt_prefill_s": prompt_time,
        "cached_total_s": sum(cached_times), "recompute_total_s": sum(recompute_times),
        "cached_step_s": cached_times, "recompute_step_s": recompute_times,
        "speedup": sum(recompute_times) / sum(cached_times),
        "max_abs_diff": max_diff,
    }
