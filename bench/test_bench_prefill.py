"""pytest-benchmark: causal prefill, T = 1k ... 128k, heads 8/8 and 32/8, D = 128, float32.

    pytest bench/test_bench_prefill.py                 # the shapes that take ~1 s or less a call
    pytest bench/test_bench_prefill.py -m ""           # every shape (hours at T = 128k)
    ATTNFAST_BENCH_THREADS=1 pytest bench/...          # one thread count only

Not collected by the default test run (testpaths = ["tests"]). extra_info records the useful
FLOPs (2 * B * H * (D + Dv) * T * (T + 1) / 2), the compulsory bytes (q, k, v read once, out
written once) and the GFLOP/s of the median. Each output is checked on sampled rows against an
independent float64 reference.
"""
import numpy as np
import pytest

import attnfast as af
from attnfast.bench.costs import attention_flops
from bench_common import bench_threads, max_abs_error

D = 128
LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
HEADS = [(8, 8), (32, 8)]
# Shapes above this many FLOPs take seconds a call on one core: marked slow, so that a plain
# `pytest bench` stays within a few minutes (the project's addopts deselect slow).
BIG_FLOPS = 40e9
TARGET_SECONDS = 3.0  # rounds are chosen so a shape takes about this long


def _cases():
    for h, hkv in HEADS:
        for T in LENGTHS:
            big = attention_flops(1, h, T, T, D, D, True) > BIG_FLOPS
            yield pytest.param(T, h, hkv, id=f"T{T}-H{h}x{hkv}",
                               marks=[pytest.mark.slow] if big else [])


@pytest.mark.parametrize("threads", bench_threads(), ids=lambda n: f"thr{n}")
@pytest.mark.parametrize("T,h,hkv", list(_cases()))
def test_prefill_causal(benchmark, T, h, hkv, threads):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, h, T, D), dtype=np.float32)
    k = rng.standard_normal((1, hkv, T, D), dtype=np.float32)
    v = rng.standard_normal((1, hkv, T, D), dtype=np.float32)
    out = np.empty_like(q)
    flops = attention_flops(1, h, T, T, D, D, True)
    rounds = int(max(3, min(30, TARGET_SECONDS * 30e9 / flops)))  # ~30 GFLOP/s assumed

    benchmark.group = f"prefill causal H={h}/{hkv} D={D} float32"
    benchmark.pedantic(af.attention, args=(q, k, v),
                       kwargs=dict(causal=True, out=out, num_threads=threads),
                       rounds=rounds, warmup_rounds=1)
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        kind="prefill", causal=True, T=T, heads=h, kv_heads=hkv, head_dim=D, threads=threads,
        dtype="float32", flops=flops, bytes=(q.nbytes + k.nbytes + v.nbytes + out.nbytes),
        gflops_per_s=flops / median / 1e9)
    assert max_abs_error(out, q, k, v, causal=True) < 1e-4
