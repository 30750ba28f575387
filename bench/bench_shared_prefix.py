"""Shared-prefix decoding against the unshared paged call, in one process (issue 22, item 1).

    python bench/bench_shared_prefix.py                    # 8 forks, L = 16k + 256 own, 32/8 and 8/8, f32 + bf16
    python bench/bench_shared_prefix.py --forks 64 --heads 8/8 --dtypes float32
    python bench/bench_shared_prefix.py --sweep            # prefix lengths 256..4096: where sharing pays

A prompt of --prompt tokens in a PagedKVCache (block_size 16), --forks forks of it, each with
--own tokens of its own; one decode step (Tq = 1, attend over all forks) timed three ways, in
turns (A B C A B C ..., medians): the shared call (the default), the same call unshared
(attnfast._shared_prefix.MIN_PREFIX_KEYS raised past the prompt: one batched kernel call that
reads the prompt once per fork) and one call per fork. Outputs are checked against each other
first (float32 rounding).
"""
import argparse
import statistics
import time

import ml_dtypes
import numpy as np

import attnfast as af
from attnfast import _shared_prefix

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def build(prompt, own, forks, hkv, d, dtype, rng):
    blocks = -(-prompt // 16) + forks * (-(-own // 16) + 1) + 1
    cache = af.PagedKVCache(blocks, 16, hkv, d, dtype=dtype)
    a = cache.add_sequence()
    for s in range(0, prompt, 4096):  # in pieces: the float32 temporaries stay small
        n = min(4096, prompt - s)
        cache.append(a, rng.standard_normal((hkv, n, d), np.float32).astype(dtype),
                     rng.standard_normal((hkv, n, d), np.float32).astype(dtype))
    ids = [a] + [cache.fork(a) for _ in range(forks - 1)]
    if own:
        cache.append(ids, rng.standard_normal((forks, hkv, own, d), np.float32).astype(dtype),
                     rng.standard_normal((forks, hkv, own, d), np.float32).astype(dtype))
    return cache, ids


def unshared(fn):
    saved = _shared_prefix.MIN_PREFIX_KEYS
    _shared_prefix.MIN_PREFIX_KEYS = 1 << 62
    try:
        return fn()
    finally:
        _shared_prefix.MIN_PREFIX_KEYS = saved


def measure(cache, ids, q, threads, repeats):
    ways = {
        "shared": lambda: cache.attend(ids, q, num_threads=threads),
        "unshared": lambda: unshared(lambda: cache.attend(ids, q, num_threads=threads)),
        "per fork": lambda: [cache.attend(s, q[i], num_threads=threads)
                             for i, s in enumerate(ids)],
    }
    before = _shared_prefix.stats["shared_calls"]
    a, b = ways["shared"](), ways["unshared"]()
    assert _shared_prefix.stats["shared_calls"] == before + 1, "the shared path did not run"
    err = float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())
    times = {k: [] for k in ways}
    for _ in range(repeats):
        for k, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}, err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=16384)
    ap.add_argument("--own", type=int, default=256)
    ap.add_argument("--forks", type=int, default=8)
    ap.add_argument("--heads", default="32/8,8/8")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sweep", action="store_true",
                    help="prefix lengths 256..4096 at 8 forks, 8/8, float32 (MIN_PREFIX_KEYS)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    if args.sweep:
        _shared_prefix.MIN_PREFIX_KEYS = 16
        print("prompt  shared ms  unshared ms  unshared/shared")
        for prompt in (256, 512, 1024, 2048, 4096):
            cache, ids = build(prompt, args.own, 8, 8, args.d, np.float32, rng)
            q = rng.standard_normal((8, 8, 1, args.d), np.float32)
            t, _ = measure(cache, ids, q, args.threads, args.repeats)
            print(f"{prompt:6d}  {t['shared'] * 1e3:9.2f}  {t['unshared'] * 1e3:11.2f}  "
                  f"{t['unshared'] / t['shared']:6.2f}x")
        return
    print(f"forks={args.forks} prompt={args.prompt} own={args.own} D={args.d} "
          f"threads={args.threads or af.get_num_threads()} repeats={args.repeats} (medians)")
    print("heads  dtype     shared ms  unshared ms  per-fork ms  unshared/shared  "
          "per-fork/shared  max|diff|")
    for heads in args.heads.split(","):
        h, hkv = (int(x) for x in heads.split("/"))
        for name in args.dtypes.split(","):
            dtype = DTYPES[name]
            cache, ids = build(args.prompt, args.own, args.forks, hkv, args.d, dtype, rng)
            q = rng.standard_normal((args.forks, h, 1, args.d), np.float32).astype(dtype)
            t, err = measure(cache, ids, q, args.threads, args.repeats)
            print(f"{heads:5s}  {name:8s}  {t['shared'] * 1e3:9.2f}  {t['unshared'] * 1e3:11.2f}"
                  f"  {t['per fork'] * 1e3:11.2f}  {t['unshared'] / t['shared']:14.2f}x"
                  f"  {t['per fork'] / t['shared']:14.2f}x  {err:.1e}", flush=True)
            del cache


if __name__ == "__main__":
    main()
