"""``attnfast bench``: prefill, decode and generation timings, judged against this machine.

One run measures, at each requested thread count:

* the machine's limits: memory-read bandwidth (the best of several read-only streams over a
  buffer much larger than the last-level cache, run on as many threads as attnfast gets) and
  float32 GEMM throughput (NumPy's BLAS, limited to the same thread count);
* (a) prefill: causal ``attention`` over T tokens, time and GFLOP/s;
* (b) decode: one ``KVCache.step`` (append one token, attend over L keys), time and GB/s, with a
  least-squares line time = slope * L + intercept and its R^2;
* (c) generation: N tokens after a prompt, with the KV cache against recomputing full causal
  attention over the whole sequence for every token (what a model without a cache does).

It prints tables, writes the raw numbers as JSON and, when matplotlib is installed, a PNG of the
per-token cost against the context length. Only the installed package is needed: no repo files.

Cost model (DESIGN.md): prefill FLOPs = 2 * B * H * (D + Dv) * (visible query-key pairs), which
is Tq * Tk without a mask and T * (T + 1) / 2 causal with Tq == Tk; decode bytes per step =
B * Hkv * L * (D + Dv) * itemsize (every cached K/V byte read once).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import _ext

__all__ = ["main"]

GIB = 1 << 30
MIB = 1 << 20
# Pause after running NumPy's BLAS: its idle worker threads busy-wait for a while and would
# steal cores from the next timing (seen as a 40% slowdown of a 2-thread run right after).
SETTLE_S = 0.3


# ----------------------------------------------------------------------------- cost model

def visible_pairs(tq: int, tk: int, causal: bool) -> int:
    """Query-key pairs that carry work. Causal is bottom-right aligned: row i sees the keys
    j <= i + (tk - tq), so with tq == tk this is tq * (tq + 1) / 2."""
    if not causal:
        return tq * tk
    seen = np.clip(np.arange(tq, dtype=np.int64) + (tk - tq) + 1, 0, tk)
    return int(seen.sum())


def attention_flops(b: int, h: int, tq: int, tk: int, d: int, dv: int, causal: bool) -> int:
    """Useful FLOPs of one attention call: 2 * B * H * (D + Dv) * visible pairs (QK^T and PV)."""
    return 2 * b * h * (d + dv) * visible_pairs(tq, tk, causal)


def decode_bytes(b: int, hkv: int, length: int, d: int, dv: int, itemsize: int) -> int:
    """Bytes a decode step must read: every cached K and V element of the L keys, once."""
    return b * hkv * length * (d + dv) * itemsize


# ----------------------------------------------------------------------------- timing

def time_call(fn, *, budget: float, min_repeats: int = 3, max_repeats: int = 200,
              setup=None, warmup: int = 1) -> list[float]:
    """Wall times (s) of ``fn()``: ``warmup`` untimed calls, then repeats until ``budget`` seconds
    have passed (at least ``min_repeats``, at most ``max_repeats``). ``setup()`` runs untimed
    before each call (e.g. to roll a cache back)."""
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
    return float(statistics.median(xs))


class Progress:
    """A dependency-free progress bar on stderr (one line per step when stderr is not a tty)."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total = max(1, total)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        """Announce the measurement about to run (counts the previous one as done)."""
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        width = 28
        filled = int(width * self.done / self.total)
        bar = "#" * filled + "." * (width - filled)
        line = f"[{bar}] {self.done:3d}/{self.total} {elapsed:6.1f}s  {label}"
        if self.tty:
            self.stream.write("\r" + line[:118].ljust(118))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.done += 1

    def finish(self) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        msg = f"[{'#' * 28}] {self.total:3d}/{self.total} {elapsed:6.1f}s  done"
        self.stream.write(("\r" + msg.ljust(118) + "\n") if self.tty else msg + "\n")
        self.stream.flush()


# ----------------------------------------------------------------------------- machine limits

def _blas_limits(n_threads: int):
    """A context manager limiting NumPy's BLAS to ``n_threads`` (None when threadpoolctl is absent)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    return threadpool_limits(limits=n_threads, user_api="blas")


def blas_description() -> str:
    """Which BLAS NumPy runs (threadpoolctl), and whether OPENBLAS_CORETYPE pins a slower kernel."""
    text = "unknown (install threadpoolctl to see)"
    try:
        from threadpoolctl import threadpool_info
        infos = [i for i in threadpool_info() if i.get("user_api") == "blas"]
        if infos:
            i = infos[0]
            text = f"{i.get('internal_api')} {i.get('version') or ''} kernel={i.get('architecture')}".strip()
        else:
            text = "none found"
    except ImportError:
        pass
    if os.environ.get("OPENBLAS_CORETYPE"):
        text += f" (OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']} is set: may be slower than the CPU allows)"
    return text


def measure_read_bandwidth(n_threads: int, nbytes: int = GIB, repeats: int = 5) -> dict:
    """Memory-read bandwidth (GB/s, 1e9 B/s) of read-only streams over a float32 buffer of
    ``nbytes`` (keep it many times the last-level cache), split over ``n_threads`` Python threads
    (NumPy releases the GIL in both kernels):

    * ``numpy-sum``: ``np.sum`` of each thread's slice;
    * ``blas-dot``: ``np.dot(x, x)`` of each slice, BLAS limited to one thread per slice (needs
      threadpoolctl; a dot product touches each byte once, like decode reads each K/V byte once);
    * ``native-read``: attnfast's own C++ read kernel (csrc/probe.cpp) on ``n_threads`` OpenMP
      threads, each streaming contiguous 4 MiB pieces with independent load chains, so neither
      arithmetic nor Python threads limit it; 32-byte loads where the CPU has AVX2 (the best
      tier's, whatever tier is forced), which read up to 14 % faster than 16-byte ones.

    A single kernel can be limited by its own arithmetic rather than by memory (NumPy's float32
    pairwise sum is, on one core of some CPUs), so the machine's limit is the best kernel: the
    fairest bar for decode, which also reads each byte once. Each kernel's rate is its best of
    ``repeats`` (a limit is the best the machine does; on a shared machine a median can land in a
    slow minute and put results above 100 %).
    """
    x = np.ones(max(nbytes // 4, 1024 * n_threads), dtype=np.float32)
    parts = np.array_split(x, n_threads)
    results = {}
    with ThreadPoolExecutor(max_workers=n_threads) as pool:
        def sum_slices():
            list(pool.map(np.sum, parts))

        def dot_slices():
            list(pool.map(lambda p: np.dot(p, p), parts))

        results["numpy-sum"] = x.nbytes / min(
            time_call(sum_slices, budget=0.0, min_repeats=repeats)) / 1e9
        raw = x.view(np.uint8)
        results["native-read"] = x.nbytes / min(
            time_call(lambda: _ext.read_bytes(raw, n_threads), budget=0.0, min_repeats=repeats)) / 1e9
        one_blas_thread = _blas_limits(1)
        if one_blas_thread is not None:
            with one_blas_thread:
                results["blas-dot"] = x.nbytes / min(
                    time_call(dot_slices, budget=0.0, min_repeats=repeats)) / 1e9
    best = max(results, key=results.get)
    return {"threads": n_threads, "gbps": results[best], "kernel": best, "kernels": results,
            "buffer_mib": x.nbytes / MIB}


def measure_gemm(n_threads: int, n: int = 2048, repeats: int = 3) -> dict | None:
    """float32 GEMM throughput (GFLOP/s, best of ``repeats``) of NumPy's BLAS on (n x n) @ (n x n),
    limited to ``n_threads`` with threadpoolctl; None when threadpoolctl is not installed (the
    thread count could not be matched)."""
    ctx = _blas_limits(n_threads)
    if ctx is None:
        return None
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), np.float32)
    with ctx:
        times = time_call(lambda: np.matmul(a, b, out=c), budget=0.0, min_repeats=repeats)
    return {"threads": n_threads, "gflops": 2 * n ** 3 / min(times) / 1e9, "n": n}


def last_level_cache_bytes() -> int | None:
    """Size of the largest CPU cache (Linux sysfs), to flag working sets that fit in it."""
    best = None
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in os.listdir(base):
            if not entry.startswith("index"):
                continue
            with open(os.path.join(base, entry, "size")) as f:
                raw = f.read().strip()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(raw[-1:].upper(), 1)
            size = int(raw.rstrip("KMGkmg")) * mult
            best = size if best is None else max(best, size)
    except (OSError, ValueError):
        return None
    return best


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_warning(load: float | None, cpus: int) -> str | None:
    """A warning when other processes already keep the CPUs busy: multi-threaded timings then
    stall at every barrier on a thread that was descheduled."""
    if load is None or load < 0.5:
        return None
    return (f"warning: the machine is busy before this run (load average {load:.2f} on {cpus} "
            f"CPUs): timings, above all multi-threaded ones, will be slow and noisy")


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ----------------------------------------------------------------------------- formatting

def format_table(headers, rows, align=None) -> str:
    """Plain fixed-width text table (right-aligned numbers, left-aligned first column)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or ["<"] + [">"] * (len(headers) - 1)
    out = []
    for n, r in enumerate(cells):
        out.append("  ".join(f"{c:{a}{w}}" for c, a, w in zip(r, align, widths)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def format_markdown_table(headers, rows) -> str:
    """The same table as GitHub markdown."""
    lines = ["| " + " | ".join(str(h) for h in headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def fmt_time(seconds: float) -> str:
    """Seconds as a short string in the most readable unit."""
    if seconds >= 1.0:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def fmt_len(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def parse_int_list(text: str, name: str) -> list[int]:
    """'1k,4k,16384' -> [1024, 4096, 16384] (k = 1024)."""
    values = []
    for raw in str(text).split(","):
        item = raw.strip().lower()
        if not item:
            continue
        mult = 1
        if item.endswith("k"):
            mult, item = 1024, item[:-1]
        try:
            value = int(item) * mult
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: {raw!r} is not an integer (1k = 1024)") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name}: values must be >= 1, got {value}")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError(f"{name}: give at least one value")
    return values


def parse_heads(text: str) -> tuple[int, int]:
    """'32/8' -> (32, 8); '8' -> (8, 8)."""
    try:
        if "/" in text:
            h, hkv = (int(p) for p in text.split("/"))
        else:
            h = hkv = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"heads: expected H or H/Hkv like 32/8, got {text!r}") from None
    if h < 1 or hkv < 1 or h % hkv:
        raise argparse.ArgumentTypeError(f"heads: need H % Hkv == 0 and both >= 1, got {text!r}")
    return h, hkv


KV_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8")


def parse_dtypes(text: str) -> list:
    """--dtype: a comma list of float32, float64, float16, bfloat16, int8 (a KV cache dtype:
    the decode cache stores it; prefill runs in that dtype, and not at all for int8)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if part not in KV_DTYPES:
            raise argparse.ArgumentTypeError(f"dtype: unknown {part!r}; choose from "
                                             f"{', '.join(KV_DTYPES)}")
        dt = parse_dtype(part)
        if dt not in out:
            out.append(dt)
    if not out:
        raise argparse.ArgumentTypeError("dtype: empty list")
    return out


def activation_dtype(dt: np.dtype) -> np.dtype:
    """Queries and new tokens for a cache of dtype dt (float32 for an int8 cache)."""
    return np.dtype(np.float32) if dt == np.int8 else dt


def kv_bytes_per_token(kv_heads: int, d: int, dv: int, dt: np.dtype) -> int:
    """Bytes of K and V one cached token holds over all KV heads (int8: plus its 2 scales)."""
    scales = 2 * 4 if dt == np.int8 else 0
    return kv_heads * ((d + dv) * dt.itemsize + scales)


def parse_dtype(text: str) -> np.dtype:
    if text == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise argparse.ArgumentTypeError("dtype bfloat16 needs ml_dtypes (pip install ml_dtypes)") from None
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(text)
    except TypeError:
        raise argparse.ArgumentTypeError(f"dtype: unknown {text!r}") from None


def random_array(rng, shape, dtype) -> np.ndarray:
    """Standard-normal data of ``dtype`` (generated in float32/float64, then cast)."""
    gen_dtype = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    arr = rng.standard_normal(shape, dtype=gen_dtype)
    return arr if arr.dtype == dtype else arr.astype(dtype)


# ----------------------------------------------------------------------------- measurements

class _Threads:
    """Run attnfast with ``n`` threads inside the block; restore the previous setting after."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        from . import _runtime
        self.previous = _runtime._user_threads
        _runtime.set_num_threads(self.n)
        return self

    def __exit__(self, *exc):
        from . import _runtime
        _runtime.set_num_threads(self.previous)


def linear_fit(xs, ys) -> dict:
    """Least-squares ys = slope * xs + intercept, with R^2 (nan when it cannot be computed)."""
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    if len(x) < 2 or np.ptp(x) == 0:
        return {"slope": float("nan"), "intercept": float("nan"), "r2": float("nan")}
    slope, intercept = np.polyfit(x, y, 1)
    pred = slope * x + intercept
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    return {"slope": float(slope), "intercept": float(intercept), "r2": r2}


class DecodeBench:
    """One preallocated ``KVCache`` filled once to the longest context; each decode step at
    context L is measured as ``cache.step`` of one token on a cache holding L - 1 tokens (so it
    attends over L keys), rolled back with ``truncate`` (untimed) between repeats."""

    CHUNK = 4096  # tokens per append while filling: bounded temporaries

    def __init__(self, af, rng, batch, heads, kv_heads, head_dim, dtype, max_len):
        self.af = af
        self.batch, self.heads, self.kv_heads, self.head_dim = batch, heads, kv_heads, head_dim
        self.dtype = dtype
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
        self.set_length(length - 1)
        rollback = lambda: self.cache.truncate(length - 1)  # noqa: E731
        step = lambda: self.cache.step(self.q, self.k_new, self.v_new)  # noqa: E731
        return time_call(step, budget=budget, min_repeats=min_repeats, setup=rollback)

    def context(self, length: int):
        """K and V of the first ``length`` cached tokens, as views (for the recompute baseline)."""
        return self.cache.k[:, :, :length, :], self.cache.v[:, :, :length, :]


def run_generation(af, rng, batch, heads, kv_heads, head_dim, dtype, prompt, tokens):
    """(c): N tokens after a P-token prompt, cached against recomputed. Returns a dict."""
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


# ----------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    cpus = available_cpus()
    default_threads = "1" if cpus == 1 else f"1,{cpus}"
    p = argparse.ArgumentParser(
        prog="attnfast bench",
        description="Time attnfast prefill, KV-cache decode and cached-vs-recompute generation "
                    "on this machine, against its measured memory bandwidth and GEMM throughput.",
        epilog="Lengths accept a k suffix (1k = 1024). Defaults take about 2-4 minutes on 2 cores.")
    p.add_argument("--threads", default=default_threads,
                   help=f"comma list of thread counts (default {default_threads})")
    p.add_argument("--prefill-T", default="256,512,1k,2k,4k,8k",
                   help="prefill lengths T, causal (default 256,512,1k,2k,4k,8k)")
    p.add_argument("--prefill-heads", type=parse_heads, default=(8, 8), metavar="H[/Hkv]",
                   help="heads for the prefill sweep (default 8/8)")
    p.add_argument("--decode-L", default="1k,2k,4k,8k,16k,32k,64k",
                   help="decode context lengths L (default 1k,2k,4k,8k,16k,32k,64k)")
    p.add_argument("--heads", type=parse_heads, default=(32, 8), metavar="H/Hkv",
                   help="query/KV heads for decode and generation (default 32/8, Llama 3 8B)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension D = Dv (default 128)")
    p.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    p.add_argument("--dtype", type=parse_dtypes, default=[np.dtype(np.float32)],
                   help="KV cache dtypes, a comma list of float32 (default), float64, float16, "
                        "bfloat16, int8: decode table and linear fit per dtype (GB/s from the "
                        "bytes read, int8 scales included); prefill, (c) run in the first "
                        "non-int8 one")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated in (c) (default 32)")
    p.add_argument("--prompt", type=int, default=1024,
                   help="prompt length before generating in (c) (default 1024)")
    p.add_argument("--recompute-max-L", default="2k",
                   help="longest context for the recompute-per-token curve (default 2k; it "
                        "costs O(L^2) per point)")
    p.add_argument("--bandwidth-mib", type=int, default=1024,
                   help="buffer for the memory-bandwidth measurement in MiB (default 1024)")
    p.add_argument("--budget", type=float, default=0.5,
                   help="seconds of repeats per measurement (default 0.5; at least 3 repeats)")
    p.add_argument("--out-dir", default=".", help="directory for the PNG and JSON (default .)")
    p.add_argument("--png", default=None,
                   help="plot path (default OUT_DIR/attnfast_bench.png; 'none' to skip)")
    p.add_argument("--json", default=None,
                   help="raw results path (default OUT_DIR/attnfast_bench.json; 'none' to skip)")
    p.add_argument("--quick", action="store_true",
                   help="small shapes for a smoke run (well under a minute); explicit options "
                        "still win")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--seed", type=int, default=0)
    return p


_QUICK = {"prefill_T": "256,512,1k", "decode_L": "1k,4k,16k", "tokens": 8, "prompt": 256,
          "recompute_max_L": "1k", "bandwidth_mib": 256, "budget": 0.2}


def parse_args(argv):
    parser = build_parser()
    # --quick replaces the defaults only: options given explicitly keep their values.
    if "--quick" in argv:
        parser.set_defaults(**_QUICK)
    args = parser.parse_args(argv)
    try:
        args.threads = parse_int_list(args.threads, "--threads")
        args.prefill_T = parse_int_list(args.prefill_T, "--prefill-T")
        args.decode_L = parse_int_list(args.decode_L, "--decode-L")
        args.recompute_max_L = parse_int_list(args.recompute_max_L, "--recompute-max-L")[0]
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    for name in ("head_dim", "batch", "tokens", "prompt", "bandwidth_mib"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv=None) -> int:
    """Entry point of ``attnfast bench``; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)

    import attnfast as af
    from . import _runtime

    dtypes = args.dtype
    # prefill, recompute and generation run in the first dtype that is not a cache-only one
    dtype = next((dt for dt in dtypes if dt != np.int8), np.dtype(np.float32))
    try:  # a dtype the kernels do not take fails here, with attnfast's own message
        for dt in dtypes:
            tiny = af.KVCache(1, 1, args.head_dim, 2, dtype=dt)
            x = np.zeros((1, 1, 1, args.head_dim), activation_dtype(dt))
            tiny.step(x, x, x)
    except (NotImplementedError, TypeError, ValueError) as e:
        print(f"attnfast bench: --dtype {dt.name} --head-dim {args.head_dim}: {e}",
              file=sys.stderr)
        return 2
    d = dv = args.head_dim
    b = args.batch
    h, hkv = args.heads
    ph, phkv = args.prefill_heads
    rng = np.random.default_rng(args.seed)
    llc = last_level_cache_bytes()
    decode_L = sorted(set(args.decode_L))
    recompute_L = [L for L in decode_L if L <= args.recompute_max_L] or [min(decode_L)]
    threads = args.threads

    load_before = load_average()
    warning = busy_warning(load_before, available_cpus())
    if warning:
        print(warning, file=sys.stderr)
    n_steps = len(threads) * (2 + len(args.prefill_T) + len(dtypes) * len(decode_L)
                              + len(recompute_L) + 1) + len(dtypes)
    progress = Progress(n_steps, enabled=not args.no_progress)
    info = _runtime.config()
    results = {
        "command": "attnfast bench " + " ".join(argv),
        "attnfast": info, "numpy": np.__version__, "blas": blas_description(),
        "cpu": cpu_name(), "cpus": available_cpus(), "last_level_cache_bytes": llc,
        "load_average_before": load_before, "busy_warning": warning,
        "dtype": dtype.name, "dtypes": [dt.name for dt in dtypes], "batch": b, "head_dim": d,
        "prefill_heads": [ph, phkv], "heads": [h, hkv],
        "limits": {}, "prefill": [], "decode": [], "decode_fit": {}, "recompute": [],
        "generation": {},
    }

    decodes = {}
    for dt in dtypes:
        progress.step(f"filling a {dt.name} KV cache of {fmt_len(max(decode_L))} tokens")
        decodes[dt.name] = DecodeBench(af, rng, b, h, hkv, d, dt, max(decode_L))
    decode = decodes[dtype.name] if dtype.name in decodes else None

    for n in threads:
        progress.step(f"memory-read bandwidth, {n} thread(s)")
        bw = measure_read_bandwidth(n, args.bandwidth_mib * MIB)
        progress.step(f"GEMM throughput, {n} thread(s)")
        gemm = measure_gemm(n, 1024 if args.quick else 2048)
        results["limits"][n] = {"read_bandwidth": bw, "gemm": gemm}
        time.sleep(SETTLE_S)

        with _Threads(n):
            for T in args.prefill_T:
                progress.step(f"prefill T={fmt_len(T)} H={ph}/{phkv}, {n} thread(s)")
                q = random_array(rng, (b, ph, T, d), dtype)
                k = random_array(rng, (b, phkv, T, d), dtype)
                v = random_array(rng, (b, phkv, T, dv), dtype)
                out = np.empty((b, ph, T, dv), dtype)
                times = time_call(lambda: af.attention(q, k, v, causal=True, out=out),
                                  budget=args.budget)
                flops = attention_flops(b, ph, T, T, d, dv, True)
                results["prefill"].append({"threads": n, "T": T, "times_s": times,
                                           "median_s": median(times), "flops": flops,
                                           "gflops": flops / median(times) / 1e9})

            for dt in dtypes:
                for L in decode_L:
                    progress.step(f"decode step {dt.name} L={fmt_len(L)} H={h}/{hkv}, {n} thread(s)")
                    times = decodes[dt.name].step_at(L, args.budget, 5)
                    nbytes = b * L * kv_bytes_per_token(hkv, d, dv, dt)
                    results["decode"].append({"dtype": dt.name, "threads": n, "L": L,
                                              "times_s": times, "median_s": median(times),
                                              "bytes": nbytes, "gbps": nbytes / median(times) / 1e9,
                                              "fits_in_cache": llc is not None and nbytes <= llc})

            for L in recompute_L:
                progress.step(f"recompute causal attention T={fmt_len(L)} H={h}/{hkv}, {n} thread(s)")
                if decode is None:
                    continue
                kc, vc = decode.context(L)
                q = random_array(rng, (b, h, L, d), dtype)
                times = time_call(lambda: af.attention(q, kc, vc, causal=True),
                                  budget=args.budget)
                results["recompute"].append({"threads": n, "L": L, "times_s": times,
                                             "median_s": median(times)})

            progress.step(f"generate {args.tokens} tokens after {args.prompt}, cached vs "
                          f"recompute, {n} thread(s)")
            results["generation"][n] = run_generation(af, rng, b, h, hkv, d, dtype,
                                                      args.prompt, args.tokens)

        for dt in dtypes:
            rows = [r for r in results["decode"] if r["threads"] == n and r["dtype"] == dt.name]
            results["decode_fit"][f"{dt.name}/{n}"] = dict(
                linear_fit([r["L"] for r in rows], [r["median_s"] for r in rows]),
                dtype=dt.name, threads=n)
    progress.finish()
    del decode, decodes

    report = render_report(results, args)
    print(report)

    png = args.png if args.png is not None else os.path.join(args.out_dir, "attnfast_bench.png")
    js = args.json if args.json is not None else os.path.join(args.out_dir, "attnfast_bench.json")
    if js.lower() != "none":
        os.makedirs(os.path.dirname(os.path.abspath(js)), exist_ok=True)
        with open(js, "w") as f:
            json.dump(results, f, indent=1, default=_json_default)
        print(f"\nraw results: {js}")
    if png.lower() != "none":
        written = write_plot(results, png)
        print(f"plot: {png}" if written else f"plot skipped: {written.reason}")
    return 0


def _json_default(obj):
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    return str(obj)


def render_report(results: dict, args) -> str:
    """The text tables printed at the end of a run."""
    out = []
    info = results["attnfast"]
    out.append(f"attnfast {info['version']}  kernel tier {info['isa']}  OpenMP {info['openmp_runtime']}")
    out.append(f"CPU: {results['cpu']} ({results['cpus']} CPUs available)"
               + (f", last-level cache {results['last_level_cache_bytes'] // MIB} MiB"
                  if results["last_level_cache_bytes"] else ""))
    out.append(f"numpy {results['numpy']}, BLAS: {results['blas']}")
    out.append(f"dtype {results['dtype']}, batch {results['batch']}, D = Dv = {results['head_dim']}; "
               f"times are medians of repeats")
    out.append(f"command: {results['command']}")
    if results.get("busy_warning"):
        out.append(results["busy_warning"])

    out.append("\nMachine limits (same thread counts as attnfast)")
    rows = []
    for n, lim in results["limits"].items():
        bw = lim["read_bandwidth"]
        detail = ", ".join(f"{k} {v:.1f}" for k, v in bw["kernels"].items())
        gemm = lim["gemm"]
        rows.append([n, f"{bw['gbps']:.1f}", f"{bw['kernel']} ({detail})",
                     f"{gemm['gflops']:.1f}" if gemm else "n/a (no threadpoolctl)"])
    out.append(format_table(["threads", "read GB/s", "best read kernel (GB/s each)",
                             "GEMM GFLOP/s"], rows))

    ph, phkv = results["prefill_heads"]
    out.append(f"\n(a) Prefill, causal, H={ph}/{phkv}: GFLOP/s counts useful FLOPs "
               f"2*B*H*(D+Dv)*T*(T+1)/2")
    rows = []
    for r in results["prefill"]:
        gemm = results["limits"][r["threads"]]["gemm"]
        rows.append([fmt_len(r["T"]), r["threads"], fmt_time(r["median_s"]), f"{r['gflops']:.1f}",
                     f"{100 * r['gflops'] / gemm['gflops']:.0f}%" if gemm else "n/a"])
    out.append(format_table(["T", "threads", "time", "GFLOP/s", "% of GEMM"], rows))

    h, hkv = results["heads"]
    out.append(f"\n(b) Decode step (KVCache.step: append 1 token, attend over L keys), H={h}/{hkv}: "
               f"bytes = B*Hkv*L*(D+Dv)*itemsize (+ 8 bytes of scales per token and KV head for int8)")
    rows = []
    first = {}  # (threads, L) -> the first dtype's time, for the speed-up column
    for r in results["decode"]:
        first.setdefault((r["threads"], r["L"]), r["median_s"])
    for r in results["decode"]:
        bw = results["limits"][r["threads"]]["read_bandwidth"]["gbps"]
        flag = " *" if r["fits_in_cache"] else ""
        rows.append([r.get("dtype", results["dtype"]), fmt_len(r["L"]), r["threads"],
                     fmt_time(r["median_s"]), f"{r['gbps']:.1f}", f"{100 * r['gbps'] / bw:.0f}%{flag}",
                     fmt_time(r["median_s"] / max(1, r["L"]) * 1024),
                     f"{first[(r['threads'], r['L'])] / r['median_s']:.2f}x"])
    first_name = results["decode"][0].get("dtype", results["dtype"]) if results["decode"] else ""
    out.append(format_table(["dtype", "L", "threads", "time/step", "GB/s", "% of read BW",
                             "per 1k ctx", f"vs {first_name}"], rows))
    if any(r["fits_in_cache"] for r in results["decode"]):
        out.append("  * K/V bytes fit in the last-level cache: read from cache, not DRAM, so the "
                   "fraction can pass 100%")
    rows = []
    for fit in results["decode_fit"].values():
        dt = parse_dtype(fit["dtype"])
        per_key = results["batch"] * kv_bytes_per_token(hkv, results["head_dim"],
                                                        results["head_dim"], dt)
        slope_gbps = per_key / fit["slope"] / 1e9 if fit["slope"] > 0 else float("nan")
        rows.append([fit["dtype"], fit["threads"], f"{fit['slope'] * 1e9 * 1024 / 1e3:.2f} us/1k keys",
                     fmt_time(fit["intercept"]) if fit["intercept"] >= 0
                     else "-" + fmt_time(-fit["intercept"]),
                     f"{fit['r2']:.5f}", f"{slope_gbps:.1f}"])
    out.append("\nLinear fit of decode time vs L: time = slope * L + intercept")
    out.append(format_table(["dtype", "threads", "slope", "intercept", "R^2", "GB/s from slope"], rows))

    out.append(f"\n(c) Per-token cost without a cache: full causal attention over the context "
               f"(H={h}/{hkv}) against one cached decode step")
    rows = []
    step_at = {(r["threads"], r["L"]): r["median_s"] for r in results["decode"]
               if r.get("dtype", results["dtype"]) == results["dtype"]}
    for r in results["recompute"]:
        cached = step_at.get((r["threads"], r["L"]))
        rows.append([fmt_len(r["L"]), r["threads"], fmt_time(r["median_s"]),
                     fmt_time(cached) if cached else "-",
                     f"{r['median_s'] / cached:.0f}x" if cached else "-"])
    out.append(format_table(["context", "threads", "recompute", "cached step", "ratio"], rows))

    rows = []
    for n, g in results["generation"].items():
        rows.append([n, g["prompt"], g["tokens"], fmt_time(g["prompt_prefill_s"]),
                     fmt_time(g["cached_total_s"]), fmt_time(g["recompute_total_s"]),
                     f"{g['speedup']:.1f}x", f"{g['max_abs_diff']:.1e}"])
    out.append("\n    Generating N tokens after a P-token prompt (totals over the N tokens; "
               "max diff = cached vs recomputed outputs)")
    out.append(format_table(["threads", "P", "N", "prompt prefill", "cached", "recompute",
                             "cached speedup", "max diff"], rows))
    return "\n".join(out)


class _NotWritten:
    def __init__(self, reason):
        self.reason = reason

    def __bool__(self):
        return False


def write_plot(results: dict, path: str):
    """PNG: per-token time against context length, cached decode vs recompute, per thread
    count; and decode GB/s against the measured read bandwidth. Needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _NotWritten("matplotlib is not installed (pip install 'attnfast[bench]')")
    h, hkv = results["heads"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, n in enumerate(results["limits"]):
        c = colors[i % len(colors)]
        names = results.get("dtypes", [results["dtype"]])
        markers = "os^vD"
        for j, name in enumerate(names):  # one line per dtype
            dec = [r for r in results["decode"] if r["threads"] == n and r.get("dtype", name) == name]
            ax.plot([r["L"] for r in dec], [r["median_s"] * 1e3 for r in dec],
                    markers[j % len(markers)] + "-", color=c, alpha=1.0 - 0.15 * j,
                    label=f"KV cache ({name}): one decode step, {n} thr")
            ax2.plot([r["L"] for r in dec], [r["gbps"] for r in dec],
                     markers[j % len(markers)] + "-", color=c, alpha=1.0 - 0.15 * j,
                     label=f"decode {name}, {n} thr")
        dec = [r for r in results["decode"] if r["threads"] == n
               and r.get("dtype", results["dtype"]) == names[0]]
        rec = [r for r in results["recompute"] if r["threads"] == n]
        xs = [r["L"] for r in dec]
        if rec:
            ax.plot([r["L"] for r in rec], [r["median_s"] * 1e3 for r in rec], "s--", color=c,
                    label=f"no cache: recompute causal attention, {n} thr")
            last = rec[-1]
            tail = [L for L in xs if L >= last["L"]]
            if len(tail) > 1:
                ax.plot(tail, [last["median_s"] * 1e3 * (L / last["L"]) ** 2 for L in tail], ":",
                        color=c, alpha=0.7, label=f"recompute extrapolated ~L^2, {n} thr")
        bw = results["limits"][n]["read_bandwidth"]["gbps"]
        ax2.axhline(bw, color=c, ls="--", alpha=0.7, label=f"measured read BW, {n} thr ({bw:.0f})")
    from matplotlib.ticker import FuncFormatter
    tokens = FuncFormatter(lambda x, _: fmt_len(int(round(x))) if x >= 1 else "")
    llc = results.get("last_level_cache_bytes")
    if llc:
        per_token = results["batch"] * kv_bytes_per_token(hkv, results["head_dim"], results["head_dim"],
                                                          parse_dtype(results["dtype"]))
        fits = llc / per_token  # longest context whose K+V fit in the last-level cache
        for a in (ax, ax2):
            a.axvline(fits, color="grey", lw=0.8, ls="-.")
        ax2.text(fits, 0.02, f" K+V = last-level cache ({llc // MIB} MiB)", rotation=90,
                 va="bottom", ha="right", fontsize=7, color="grey",
                 transform=ax2.get_xaxis_transform())
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.xaxis.set_major_formatter(tokens)
    ax.set_yscale("log")
    ax.set_xlabel("context length L (tokens)")
    ax.set_ylabel("time per generated token (ms), attention only")
    ax.set_title(f"Per-token cost, H={h}/{hkv}, D={results['head_dim']}, {results['dtype']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax2.set_xlabel("context length L (tokens)")
    ax2.set_ylabel("decode GB/s (K+V bytes read per step / time)")
    ax2.set_title("Decode bandwidth vs measured memory-read bandwidth")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize=7)
    fig.suptitle(f"attnfast {results['attnfast']['version']} on {results['cpu']}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
