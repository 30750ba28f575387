"""Decode step over low-bit KV caches (int8, float8_e4m3fn, float8_e5m2, int4) against float32, in one process.

    python bench/bench_lowbit_decode.py                        # L = 16k, 8/8 and 32/8 heads, 1 and 2 threads
    python bench/bench_lowbit_decode.py --lengths 16384,65536 --repeats 11
    python bench/bench_lowbit_decode.py --json bench/results/lowbit/decode-zen4-avx512bf16.json

Each round times, in turns, a decode step (Tq = 1, B = 1, D = 128, KVCache.attend, the user
path) for every cache dtype and the native read kernel (csrc/probe.cpp, as
bench_decode_read.py) over as many bytes as the largest step reads; medians of the rounds.
Columns per (layout, threads, dtype): ms per step, speed-up over the float32 step of the
same rounds, the bytes actually read (values plus row scales) per second, and that as a %
of the read kernel's GB/s. Issue 46's targets: bfloat16 >= 1.8x float32, int8 and float8 >= 3.3x
at 8/8 heads and >= 2.8x at 32/8, int4 >= 5.5x and >= 4x. ``--json F`` stores the run for the
results page (attnfast.bench.lowbit_results).
"""
import argparse
import os
import statistics
import time

import ml_dtypes
import numpy as np

import attnfast as af
from attnfast import _ext

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "int8": "int8",
          "int8-widen": "int8", "fp8": ml_dtypes.float8_e4m3fn, "fp8-e5m2": ml_dtypes.float8_e5m2,
          "int4": "int4"}
# int8-widen: the int8 cache through the exact widening path (ATTNFAST_INT8_DOT=widen) where
# the tier has the vpdpbusd one


def attend(name, cache, q, threads):
    # (the environment switch ATTNFAST_INT8_DOT is read once per process: the mode is forced
    # per call instead, so "int8" and "int8-widen" can take turns)
    if name not in ("int8", "int8-widen"):
        return cache.attend(q, num_threads=threads)
    before = _ext.runtime_info()["int8_dot"]
    _ext.force_int8_dot("widen" if name == "int8-widen" else "auto")
    try:
        return cache.attend(q, num_threads=threads)
    finally:
        _ext.force_int8_dot(before)


def step_bytes(cache) -> int:
    """Bytes a step reads: the stored rows (int4: packed blocks with their scales) and the
    row scales of int8 / float8."""
    n = int(cache.lengths[0])
    per_row = cache.k.itemsize * (cache.k.shape[-1] + cache.v.shape[-1])
    if cache.k_scale is not None:
        per_row += 8
    return cache.kv_heads * n * per_row


def kernel_of(name, cache, q, threads) -> str:
    """The decode kernel a step runs (the C++ planner's answer, as attnfast.explain)."""
    before = _ext.runtime_info()["int8_dot"]
    _ext.force_int8_dot("widen" if name == "int8-widen" else "auto")
    try:
        return _plan(cache, q, threads)
    finally:
        _ext.force_int8_dot(before)


def _plan(cache, q, threads) -> str:
    return _ext.plan_attention(q, cache.k, cache.v, causal=True, scale=q.shape[-1] ** -0.5,
                               window_left=-1, window_right=-1, num_threads=threads,
                               seqlens_k=np.ascontiguousarray(cache.lengths),
                               k_scale=cache.k_scale, v_scale=cache.v_scale,
                               head_dim_v=cache.v_head_dim)["kernel"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="16384")
    p.add_argument("--layouts", default="8/8,32/8")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--dtypes", default="float32,bfloat16,int8,int8-widen,fp8,int4")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--json", default=None,
                   help="store the run here (bench/results/lowbit/decode-<cpu-kind>.json) for the results page")
    args = p.parse_args()
    stored = []
    rng = np.random.default_rng(0)
    d = 128
    names = args.dtypes.split(",")
    print(f"decode Tq=1, B=1, D={d}; tier {_ext.runtime_info()['isa']}; "
          f"load average {os.getloadavg()[0]:.1f} at start")
    for length in [int(x) for x in args.lengths.split(",")]:
        for layout in args.layouts.split(","):
            h, hkv = (int(x) for x in layout.split("/"))
            k = rng.standard_normal((1, hkv, length, d), dtype=np.float32)
            v = rng.standard_normal((1, hkv, length, d), dtype=np.float32)
            q = rng.standard_normal((1, h, 1, d), dtype=np.float32)
            caches = {}
            for name in names:
                c = af.KVCache(1, hkv, d, length, dtype=DTYPES[name])
                c.append(k if name != "bfloat16" else k.astype(ml_dtypes.bfloat16),
                         v if name != "bfloat16" else v.astype(ml_dtypes.bfloat16))
                caches[name] = c
            qs = {n: (q.astype(ml_dtypes.bfloat16) if n == "bfloat16" else q) for n in names}
            buffer = np.ones(max(step_bytes(c) for c in caches.values()), np.uint8)
            for threads in [int(x) for x in args.threads.split(",")]:
                times = {n: [] for n in names}
                reads = []
                for n in names:  # warm
                    attend(n, caches[n], qs[n], threads)
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    _ext.read_bytes(buffer, threads)
                    reads.append(buffer.nbytes / (time.perf_counter() - t0))
                    for n in names:
                        t0 = time.perf_counter()
                        attend(n, caches[n], qs[n], threads)
                        times[n].append(time.perf_counter() - t0)
                limit = statistics.median(reads)
                base = statistics.median(times["float32"]) if "float32" in times else None
                print(f"L={length} {layout} heads, {threads} thread(s): read kernel "
                      f"{limit / 1e9:.1f} GB/s, load {os.getloadavg()[0]:.1f}")
                for n in names:
                    t = statistics.median(times[n])
                    gbs = step_bytes(caches[n]) / t
                    up = f"{base / t:4.2f}x" if base else "  -  "
                    print(f"  {n:9s} {t * 1e3:7.3f} ms  {up} f32  {gbs / 1e9:5.1f} GB/s "
                          f"{100 * gbs / limit:4.0f} % of read")
                kernels = {n: kernel_of(n, caches[n], qs[n], threads) for n in names}
                print("  kernels: " + ", ".join(f"{n} {kernels[n]}" for n in names))
                stored.append(dict(heads=layout, L=length, threads=threads, read_gbs=limit / 1e9,
                                   dtypes={n: dict(ms=1e3 * statistics.median(times[n]),
                                                   of_read=step_bytes(caches[n]) / statistics.median(times[n]) / limit,
                                                   kernel=kernels[n]) for n in names}))
    if args.json:
        from attnfast.bench.sparse_results import store_part
        store_part(args.json, "decode", stored)


if __name__ == "__main__":
    main()
