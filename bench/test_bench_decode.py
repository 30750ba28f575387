"""pytest-benchmark: one decode step against a KV cache of L tokens, L = 1k ... 128k, heads 8/8
and 32/8, D = 128, float32.

    pytest bench/test_bench_decode.py                  # L <= 32k
    pytest bench/test_bench_decode.py -m ""            # also 64k and 128k (1 GiB caches)

Two forms: ``KVCache.step`` (append one token to a cache holding L - 1, attend over L; rolled
back with ``truncate`` between rounds, untimed) and ``attention_with_kvcache`` over
caller-owned arrays (attend over L, nothing appended). extra_info records the bytes a step must
read (B * Hkv * L * (D + Dv) * 4) and the GB/s of the median. Outputs are checked against an
independent float64 reference.
"""
import numpy as np
import pytest

import attnfast as af
from attnfast.bench.costs import decode_bytes
from attnfast.bench.timing import Threads
from bench_common import bench_threads, max_abs_error

D = 128
LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
HEADS = [(8, 8), (32, 8)]
BIG_L = 65536  # from here the caches take 0.5-1 GiB: marked slow
ROUNDS = 30

def _cases():
    for h, hkv in HEADS:
        for L in LENGTHS:
            yield pytest.param(L, h, hkv, id=f"L{L}-H{h}x{hkv}",
                               marks=[pytest.mark.slow] if L >= BIG_L else [])


_filled = {}  # one filled cache at a time, reused across thread counts (threads vary fastest)


def filled_cache(L, hkv):
    """A KVCache of capacity L holding L - 1 random tokens, and the token to append."""
    key = (L, hkv)
    if key not in _filled:
        _filled.clear()
        rng = np.random.default_rng(L + hkv)
        cache = af.KVCache(1, hkv, D, L, dtype=np.float32)
        chunk = 8192
        for start in range(0, L - 1, chunk):
            t = min(chunk, L - 1 - start)
            cache.append(rng.standard_normal((1, hkv, t, D), dtype=np.float32),
                         rng.standard_normal((1, hkv, t, D), dtype=np.float32))
        k_new = rng.standard_normal((1, hkv, 1, D), dtype=np.float32)
        v_new = rng.standard_normal((1, hkv, 1, D), dtype=np.float32)
        _filled[key] = (cache, k_new, v_new)
    return _filled[key]


def _record(benchmark, form, L, h, hkv, threads):
    nbytes = decode_bytes(1, hkv, L, D, D, 4)
    benchmark.extra_info.update(
        kind="decode", form=form, L=L, heads=h, kv_heads=hkv, head_dim=D, threads=threads,
        dtype="float32", bytes=nbytes, flops=4 * h * L * D,
        gb_per_s=nbytes / benchmark.stats.stats.median / 1e9)


@pytest.mark.parametrize("threads", bench_threads(), ids=lambda n: f"thr{n}")
@pytest.mark.parametrize("L,h,hkv", list(_cases()))
def test_decode_step(benchmark, L, h, hkv, threads):
    cache, k_new, v_new = filled_cache(L, hkv)
    q = np.random.default_rng(1).standard_normal((1, h, 1, D), dtype=np.float32)

    def rollback():
        cache.truncate(L - 1)

    benchmark.group = f"decode KVCache.step H={h}/{hkv} D={D} float32"
    with Threads(threads):
        benchmark.pedantic(cache.step, args=(q, k_new, v_new), setup=rollback,
                           rounds=ROUNDS, warmup_rounds=2)
        rollback()
        out = cache.step(q, k_new, v_new)
    _record(benchmark, "KVCache.step", L, h, hkv, threads)
    assert int(cache.lengths[0]) == L
    assert max_abs_error(out, q, cache.k[:, :, :L], cache.v[:, :, :L]) < 1e-4


@pytest.mark.parametrize("threads", bench_threads(), ids=lambda n: f"thr{n}")
@pytest.mark.parametrize("L,h,hkv", list(_cases()))
def test_decode_attention_with_kvcache(benchmark, L, h, hkv, threads):
    cache, k_new, v_new = filled_cache(L, hkv)
    cache.truncate(L - 1)
    cache.append(k_new, v_new)  # L tokens, attended without appending
    q = np.random.default_rng(2).standard_normal((1, h, 1, D), dtype=np.float32)
    seqlens = np.array([L], dtype=np.int64)

    benchmark.group = f"decode attention_with_kvcache H={h}/{hkv} D={D} float32"
    with Threads(threads):
        out = benchmark.pedantic(af.attention_with_kvcache, args=(q, cache.k, cache.v, seqlens),
                                 rounds=ROUNDS, warmup_rounds=2)
    _record(benchmark, "attention_with_kvcache", L, h, hkv, threads)
    assert max_abs_error(out, q, cache.k[:, :, :L], cache.v[:, :, :L]) < 1e-4
