"""pytest-benchmark: the Python-side cost of one decode call per entry point (see
bench/bench_overhead.py, which prints the same rows with the kernel floor subtracted).

    pytest bench/test_bench_overhead.py --benchmark-columns=median,iqr,rounds

Tiny problems (B=1, one query token, L=16 cached keys, D=128, heads 8/2 and 32/8) so that the
C++ kernel takes a few microseconds; the ``kernel`` case is that floor (the Cython entry
called with prepared arrays). One thread, so the numbers are the calling thread's own.
"""
import pytest

from bench_overhead import make_cases

HEADS = [(8, 2), (32, 8)]
NAMES = list(make_cases(8, 2, capacity=64, threads=1))


@pytest.mark.parametrize("heads", HEADS, ids=[f"H{h}x{g}" for h, g in HEADS])
@pytest.mark.parametrize("name", NAMES)
def test_overhead(benchmark, name, heads):
    call, reset = make_cases(*heads, threads=1)[name]
    benchmark.extra_info["entry_point"] = name
    # reset (untimed) before every call: a KVCache.step always appends at L = 16
    benchmark.pedantic(call, setup=reset, rounds=2000, iterations=1, warmup_rounds=20)
