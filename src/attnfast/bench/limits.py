"""The machine a benchmark runs on, and its limits at a thread count.

* what it is: CPU model and flags, CPUs available, last-level cache, NumPy's BLAS, load;
* memory-read bandwidth: the best of several read-only streams over a buffer much larger than
  the last-level cache (the bar for decode, which reads each K/V byte once);
* GEMM throughput: NumPy's BLAS float32 GEMM at the same thread count and, where torch is
  installed, ``torch.mm`` (also in 16-bit dtypes): the bar for prefill.

Each limit is the best of its repeats, not their median: a limit is the best the machine does,
and on a shared machine a median can land in a slow minute and put results above 100 %.
"""
from __future__ import annotations

import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .timing import time_call

__all__ = ["GIB", "MIB", "SETTLE_S", "blas_threads", "blas_description",
           "measure_read_bandwidth", "measure_gemm", "measure_peak", "measure_limits", "limits_from",
           "best_limits", "gemm_limit", "cpu_name", "cpu_flags", "last_level_cache_bytes",
           "available_cpus", "load_average", "busy_warning"]

GIB = 1 << 30
MIB = 1 << 20
# Pause after running NumPy's BLAS: its idle worker threads busy-wait for a while and would
# steal cores from the next timing (seen as a 40% slowdown of a 2-thread run right after).
SETTLE_S = 0.3


# ----------------------------------------------------------------------------- the machine

def _cpuinfo_field(name: str) -> str | None:
    """The first ``name : value`` of /proc/cpuinfo (what lscpu shows as Model name / Flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name (lscpu's "Model name"), else what the platform module reports."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The CPU's feature flags as the kernel reports them (lscpu's "Flags"; empty off Linux)."""
    return (_cpuinfo_field("flags") or _cpuinfo_field("features") or "").split()


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


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


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


def blas_threads(n_threads: int):
    """A context manager limiting NumPy's BLAS to ``n_threads``, or None without threadpoolctl."""
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
            text = (f"{i.get('internal_api')} {i.get('version') or ''} "
                    f"kernel={i.get('architecture')}").strip()
        else:
            text = "none found"
    except ImportError:
        pass
    if os.environ.get("OPENBLAS_CORETYPE"):
        text += (f" (OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']} is set: may be slower "
                 f"than the CPU allows)")
    return text


# ----------------------------------------------------------------------------- measurements

def measure_read_bandwidth(n_threads: int, nbytes: int = GIB, repeats: int = 5) -> dict:
    """Memory-read bandwidth of the best of three read-only kernels.

    Each kernel streams a float32 buffer of ``nbytes`` (keep it many times the last-level
    cache) split over ``n_threads``:

    * ``numpy-sum``: ``np.sum`` of each slice on a Python thread (NumPy releases the GIL);
    * ``blas-dot``: ``np.dot(x, x)`` of each slice, BLAS held to one thread per slice (needs
      threadpoolctl; a dot product touches each byte once, like decode);
    * ``native-read``: attnfast's C++ read kernel (csrc/probe.cpp) on ``n_threads`` OpenMP
      threads, contiguous 4 MiB pieces with independent load chains, 32-byte loads where the
      CPU has AVX2 (they read up to 14 % faster than 16-byte ones).

    One kernel alone can be limited by its own arithmetic (NumPy's pairwise float32 sum is, on
    one core of some CPUs), so the machine's limit is the best kernel.

    Parameters
    ----------
    n_threads : int
        Threads (Python threads for the NumPy kernels, OpenMP threads for the native one).
    nbytes : int
        Size of the buffer read.
    repeats : int
        Each kernel's rate is its best of this many reads.

    Returns
    -------
    dict
        ``threads``, ``gbps`` (1e9 B/s) and ``kernel`` of the best kernel, ``kernels`` (GB/s of
        each) and ``buffer_mib``.
    """
    from .. import _ext

    x = np.ones(max(nbytes // 4, 1024 * n_threads), dtype=np.float32)
    parts = np.array_split(x, n_threads)
    rates = {}
    with ThreadPoolExecutor(max_workers=n_threads) as pool:
        def best_rate(fn):
            return x.nbytes / min(time_call(fn, budget=0.0, min_repeats=repeats)) / 1e9

        rates["numpy-sum"] = best_rate(lambda: list(pool.map(np.sum, parts)))
        raw = x.view(np.uint8)
        rates["native-read"] = best_rate(lambda: _ext.read_bytes(raw, n_threads))
        one_blas_thread = blas_threads(1)
        if one_blas_thread is not None:
            with one_blas_thread:
                rates["blas-dot"] = best_rate(lambda: list(pool.map(lambda p: np.dot(p, p), parts)))
    best = max(rates, key=rates.get)
    return {"threads": n_threads, "gbps": rates[best], "kernel": best, "kernels": rates,
            "buffer_mib": x.nbytes / MIB}


def measure_peak(n_threads: int, bf16: bool = False, seconds: float = 0.05, repeats: int = 3) -> float:
    """The machine's multiply-add peak in GFLOP/s: attnfast's native probe (csrc/probe.cpp),
    the widest multiply-adds of the best tier on independent chains, on ``n_threads`` threads
    at once; ``bf16``: vdpbf16ps where the CPU has AVX512_BF16, else float32 FMAs.

    No GEMM of the dtype can pass it, so it bounds a compute-bound kernel where the BLAS at
    hand runs below the machine (OpenBLAS and torch's float32 GEMM on AMD Zen 5: ~110 GFLOP/s,
    about half of it).

    Parameters
    ----------
    n_threads : int
        Threads running the probe at once.
    bf16 : bool
        The bfloat16 pair dot product's peak instead of float32's.
    seconds : float
        Length of one run (calibrated first).
    repeats : int
        The rate is the best of this many runs.

    Returns
    -------
    float
        GFLOP/s (a multiply-add counts two FLOPs; a vdpbf16ps lane four).
    """
    from .. import _ext

    rounds = 1 << 14
    while True:  # calibrate: rounds for about `seconds`
        start = time.perf_counter()
        _ext.peak_flops(rounds, bf16, n_threads)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds / 4 or rounds >= 1 << 30:
            break
        rounds *= 4
    rounds = max(1, int(rounds * seconds / max(elapsed, 1e-9)))
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        flops = _ext.peak_flops(rounds, bf16, n_threads)
        best = max(best, flops / (time.perf_counter() - start) / 1e9)
    return best


def measure_gemm(n_threads: int, n: int = 2048, repeats: int = 3) -> dict | None:
    """float32 GEMM throughput of NumPy's BLAS on (n x n) @ (n x n).

    Parameters
    ----------
    n_threads : int
        BLAS threads (set with threadpoolctl).
    n : int
        Matrix size.
    repeats : int
        The rate is the best of this many products.

    Returns
    -------
    dict or None
        ``threads``, ``gflops``, ``n``; None without threadpoolctl (the thread count could not
        be matched).
    """
    ctx = blas_threads(n_threads)
    if ctx is None:
        return None
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), np.float32)
    with ctx:
        times = time_call(lambda: np.matmul(a, b, out=c), budget=0.0, min_repeats=repeats)
    return {"threads": n_threads, "gflops": 2 * n ** 3 / min(times) / 1e9, "n": n}


def _torch_gemm(n: int, dtype_name: str = "float32") -> float:
    """GFLOP/s of ``torch.mm`` on (n x n) tensors of a dtype (best of 3; threads already set)."""
    import torch
    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    c = torch.empty(n, n, dtype=dtype)
    times = time_call(lambda: torch.mm(a, b, out=c), budget=0.0, min_repeats=3)
    return 2 * n ** 3 / min(times) / 1e9


def measure_limits(threads: int, bandwidth_bytes: int, gemm_n: int, use_torch: bool,
                   settle: float, dtypes=("float32",)) -> dict:
    """One thread count's limits, as :func:`limits_from` assembles them.

    Parameters
    ----------
    threads : int
        Thread count of every source.
    bandwidth_bytes : int
        Buffer of :func:`measure_read_bandwidth`.
    gemm_n : int
        Matrix size of the GEMMs.
    use_torch : bool
        Also time ``torch.mm`` (float32 and each 16-bit dtype of ``dtypes``).
    settle : float
        Seconds of pause between sources, so the previous one's thread pool goes idle.
    dtypes : sequence of str
        float32, bfloat16, float16: a 16-bit dtype's GEMM limit is the best of torch.mm in that
        dtype and the float32 GEMM (a kernel can always widen tiles to float32, so no 16-bit row
        gets a lower bar).

    Returns
    -------
    dict
        See :func:`limits_from`.
    """
    bw = measure_read_bandwidth(threads, bandwidth_bytes)
    gemm = {}
    numpy_gemm = measure_gemm(threads, gemm_n)
    if numpy_gemm is not None:
        gemm["numpy"] = numpy_gemm["gflops"]
    time.sleep(settle)
    if use_torch:
        import torch
        torch.set_num_threads(threads)
        gemm["torch"] = _torch_gemm(gemm_n)
    best = max(gemm, key=gemm.get) if gemm else None
    extra = {}
    for name in dtypes:
        if name == "float32":
            continue
        cands = {}
        if use_torch:
            time.sleep(settle)
            # A probe first: torch's float16 mm on a CPU without FP16 arithmetic is a slow
            # fallback (~1 GFLOP/s on Zen 4), which at gemm_n = 2048 would take minutes.
            for size in dict.fromkeys((min(256, gemm_n), gemm_n)):
                rate = _torch_gemm(size, name)
                if size == gemm_n:
                    cands[f"torch {name}"] = rate
                elif best and rate < 0.25 * gemm[best]:
                    cands[f"torch {name} (n={size})"] = rate  # far below float32: stop here
                    break
        if best:
            cands[f"float32 {best}"] = gemm[best]
        extra[name] = cands
    return limits_from(bw["kernels"], gemm, extra)


def limits_from(read_kernels: dict, gemm: dict, dtype_gemm: dict) -> dict:
    """One thread count's limits from each source's reading: each limit is its best source.

    Parameters
    ----------
    read_kernels : dict
        GB/s by read kernel.
    gemm : dict
        float32 GFLOP/s by GEMM source.
    dtype_gemm : dict
        Per 16-bit dtype, GFLOP/s by GEMM candidate.

    Returns
    -------
    dict
        ``read_kernels``, ``gemm``, ``read_gbps``, ``read_kernel``, ``gemm_gflops``,
        ``gemm_source`` and, with ``dtype_gemm``, ``dtype_gemm[name]`` = ``gemm_gflops``,
        ``gemm_source``, ``gemm``.
    """
    def top(rates: dict):
        name = max(rates, key=rates.get) if rates else None
        return (rates[name] if name else None), name

    limits = {"read_kernels": read_kernels, "gemm": gemm}
    limits["read_gbps"], limits["read_kernel"] = top(read_kernels)
    limits["gemm_gflops"], limits["gemm_source"] = top(gemm)
    if dtype_gemm:
        limits["dtype_gemm"] = {}
        for name, cands in dtype_gemm.items():
            rate, source = top(cands)
            limits["dtype_gemm"][name] = {"gemm_gflops": rate, "gemm_source": source, "gemm": cands}
    return limits


def best_limits(first: dict, second: dict) -> dict:
    """The limits of two measurements of one thread count, each source at its better reading.

    A limit is the best the machine does, and one measurement can land in a slow minute of a
    shared machine (then results read above 100 %). The result has ``measured`` = 2.
    """
    def best(a: dict, b: dict) -> dict:
        return {k: max(x for x in (a.get(k), b.get(k)) if x is not None) for k in {**a, **b}}

    second_dtypes = second.get("dtype_gemm", {})
    out = limits_from(best(first["read_kernels"], second["read_kernels"]),
                      best(first["gemm"], second["gemm"]),
                      {name: best(lim["gemm"], second_dtypes.get(name, {}).get("gemm", {}))
                       for name, lim in first.get("dtype_gemm", {}).items()})
    out["measured"] = 2
    return out


def gemm_limit(lim: dict, dtype: str):
    """The GEMM GFLOP/s a prefill row of ``dtype`` is measured against (None: not measured)."""
    if dtype == "float32":
        return lim["gemm_gflops"]
    return lim.get("dtype_gemm", {}).get(dtype, {}).get("gemm_gflops")
