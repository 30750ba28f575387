"""Decode over a KV cache sharded across local Ray actors (attnfast.distributed).

    python bench/bench_distributed.py [--lengths 4096 16384 65536] [--shards 1 2 4]
                                      [--steps 30] [--json out.json]

Measures, on one machine with a local Ray runtime:
- the Ray round trip: an empty actor call to 1, 2, 4 actors at once (ray.get of a list);
- a ShardedKVCache decode step at a tiny length (8 tokens in the last shard, 128 in the
  others): the whole stack's overhead, through ordinary actor calls and through a Ray
  compiled graph (compiled=True);
- one call serving 32 layers at once (num_layers=32, layer=None) at the tiny length;
- decode step time against the number of shards and L, with the one-process KVCache
  alongside (1 thread, as each Ray actor runs one OpenMP thread unless given num_cpus);
- the bytes handed to Ray per step and shard (request and result payloads, as pickled);
- the per-shard KV read bandwidth implied by (step - tiny step).

Shapes: Llama 3 8B attention, 32 query heads, 8 KV heads, D = 128, batch 1, one layer;
bfloat16 cache read by float32 queries. Each number is the median over --steps steps.
Local shards share the machine's cores: with more shards than cores they oversubscribe.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import ml_dtypes
import numpy as np

import attnfast as af
from attnfast import distributed

H, HKV, D = 32, 8, 128
CACHE_DTYPE = ml_dtypes.bfloat16
TINY_CAPACITY, TINY_STEPS = 128, 100  # the overhead runs: 128 tokens per shard at most


def _median_us(fn, repeats, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


class Traffic:
    """Counts the payloads ShardedKVCache hands to Ray (requests) and gets back (results)."""

    def __init__(self):
        self.sent, self.received = [], []
        self._pack, self._unpack = distributed._pack, distributed._unpack

    def __enter__(self):
        def pack(obj):
            out = self._pack(obj)
            self.sent.append(len(out) if isinstance(out, bytes) else distributed._array_bytes(out))
            return out

        def unpack(obj):
            self.received.append(len(obj) if isinstance(obj, bytes)
                                 else distributed._array_bytes(obj))
            return self._unpack(obj)
        distributed._pack, distributed._unpack = pack, unpack
        return self

    def __exit__(self, *exc):
        distributed._pack, distributed._unpack = self._pack, self._unpack


def _fill(cache, length, rng, chunk=8192):
    """Append `length` tokens in chunks (each chunk travels through Ray's object store)."""
    done = 0
    while done < length:
        t = min(chunk, length - done)
        k = rng.standard_normal((1, HKV, t, D), dtype=np.float32).astype(CACHE_DTYPE)
        cache.append(k, k)
        done += t


class _NoRay:
    """Stands in for the ray module: actors are plain objects of this process and calls run
    at once, so ShardedKVCache's own code (checks, plan, pickling, shard work, merge) is timed
    without Ray."""

    class _Done:
        def __init__(self, value):
            self.value = value

    class _Method:
        def __init__(self, fn):
            self.remote = lambda *a: _NoRay._Done(fn(*a))

    class _Handle:
        def __init__(self, obj):
            for name in ("ping", "run_packed", "lengths"):
                setattr(self, name, _NoRay._Method(getattr(obj, name)))

    class _Class:
        def __init__(self, cls):
            self.cls = cls

        def options(self, **_):
            return self

        def remote(self, *args):
            return _NoRay._Handle(self.cls(*args))

    remote = _Class

    @staticmethod
    def get(futures, timeout=None):
        return [f.value for f in futures]

    @staticmethod
    def kill(actor):
        pass


def in_process_step(S, tiny_len, rng, steps):
    """The tiny decode step of ShardedKVCache with its shards in this process (no Ray)."""
    saved = distributed._import_ray, distributed._ACTOR_CLASS
    distributed._import_ray, distributed._ACTOR_CLASS = (lambda: _NoRay), None
    try:
        with distributed.ShardedKVCache(1, HKV, D, TINY_CAPACITY, S, dtype=CACHE_DTYPE) as cache:
            _fill(cache, tiny_len, rng)
            q = rng.standard_normal((1, H, 1, D), dtype=np.float32)
            k = rng.standard_normal((1, HKV, 1, D), dtype=np.float32).astype(CACHE_DTYPE)
            return _median_us(lambda: (cache.step(q, k, k), cache.truncate(tiny_len)), steps)
    finally:
        distributed._import_ray, distributed._ACTOR_CLASS = saved


def ray_round_trips(ray, shard_counts, repeats):
    @ray.remote
    class Empty:
        def ping(self):
            return None
    actors = [Empty.remote() for _ in range(max(shard_counts))]
    ray.get([a.ping.remote() for a in actors])
    result = {n: _median_us(lambda: ray.get([a.ping.remote() for a in actors[:n]]), repeats)
              for n in shard_counts}
    for a in actors:
        ray.kill(a)
    return result


def sharded_step(cache, rng, steps):
    """Median decode step, µs, through the compiled graph (the cache is made with
    compiled=True), then, the graph torn down, through ordinary actor calls. Not interleaved:
    a compiled graph's actors busy-poll their channels, which would slow the other mode
    down. Each step is undone (truncate, applied by the shard on its next call) so that L
    stays as filled."""
    length = int(cache.lengths[0])
    q = rng.standard_normal((1, H, 1, D), dtype=np.float32)
    k = rng.standard_normal((1, HKV, 1, D), dtype=np.float32).astype(CACHE_DTYPE)
    result = {}
    for mode in ("compiled", "calls"):
        if mode == "calls":
            cache._drop_dag()
        times = []
        for i in range(steps + 3):
            t = time.perf_counter()
            cache.step(q, k, k)
            cache.truncate(length)
            if i >= 3:
                times.append(time.perf_counter() - t)
        result[mode] = statistics.median(times) * 1e6
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--json", default=None)
    p.add_argument("--overhead-only", action="store_true",
                   help="only the overhead table (no decode against L)")
    args = p.parse_args(argv)
    import ray
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=300 * 2**20,
             log_to_driver=False, configure_logging=False)
    rng = np.random.default_rng(0)
    report = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "ray": ray.__version__, "attnfast": af.__version__,
              "load_average": os.getloadavg()[0]}
    print(f"attnfast {af.__version__}, ray {ray.__version__}, {os.cpu_count()} CPUs, "
          f"load average {report['load_average']:.2f}; H={H}, Hkv={HKV}, D={D}, bfloat16 cache, "
          f"float32 q, batch 1, one layer; medians of {args.steps} steps")

    # ---- overheads ----
    empty = ray_round_trips(ray, args.shards, repeats=max(100, args.steps))
    report["empty_call_us"] = empty
    tiny, tiny_traffic, layers32, no_ray = {}, {}, {}, {}
    threads_before = af.get_num_threads()
    af.set_num_threads(1)  # as in the actors
    for S in args.shards:
        no_ray[S] = in_process_step(S, TINY_CAPACITY * (S - 1) + 8, rng, TINY_STEPS)
    af.set_num_threads(threads_before)
    for S in args.shards:
        tiny_len = TINY_CAPACITY * (S - 1) + 8  # every shard holds keys, the last one 8
        with distributed.ShardedKVCache(1, HKV, D, TINY_CAPACITY, S, dtype=CACHE_DTYPE,
                                        compiled=True) as cache:
            _fill(cache, tiny_len, rng)
            with Traffic() as tr:
                tiny[S] = sharded_step(cache, rng, TINY_STEPS)
            tiny_traffic[S] = (statistics.median(tr.sent), statistics.median(tr.received))
        with distributed.ShardedKVCache(1, HKV, D, TINY_CAPACITY, S, dtype=CACHE_DTYPE,
                                        num_layers=32) as cache:
            q = rng.standard_normal((32, 1, H, 1, D), dtype=np.float32)
            k = rng.standard_normal((32, 1, HKV, tiny_len, D), dtype=np.float32).astype(CACHE_DTYPE)
            cache.append(k, k)
            # 32 layers' q and results (512 KB each) exceed the packed limit: ordinary calls
            layers32[S] = {"calls": _median_us(lambda: cache.attend(q), max(30, args.steps // 2))}
    report["tiny_step_us"], report["tiny_bytes"], report["attend_32_layers_us"] = \
        tiny, tiny_traffic, layers32
    report["tiny_step_without_ray_us"] = no_ray
    print("\nRay overhead per call (local actors):")
    print(f"| shards | empty actor call, µs | decode step at L = {TINY_CAPACITY}·(S−1)+8, µs: "
          "actor calls / compiled graph / shards in-process without Ray | bytes sent / "
          "received per shard | attend of 32 layers in one call, µs (per layer) |")
    print("|---:|---:|---:|---:|---:|")
    for S in args.shards:
        l32 = layers32[S]["calls"]
        print(f"| {S} | {empty[S]:.0f} | {tiny[S]['calls']:.0f} / {tiny[S]['compiled']:.0f} / "
              f"{no_ray[S]:.0f} | "
              f"{tiny_traffic[S][0]:.0f} / {tiny_traffic[S][1]:.0f} | {l32:.0f} ({l32 / 32:.0f}) |")
    print(f"target per shard and step: 2·H·(Dv+1)·4 = {2 * H * (D + 1) * 4} bytes")

    if args.overhead_only:
        ray.shutdown()
        return
    # ---- decode against L and shards ----
    rows = []
    q = rng.standard_normal((1, H, 1, D), dtype=np.float32)
    for L in args.lengths:
        local = af.KVCache(1, HKV, D, L + args.steps + 8, dtype=CACHE_DTYPE)
        k = rng.standard_normal((1, HKV, L, D), dtype=np.float32).astype(CACHE_DTYPE)
        local.append(k, k)
        del k
        one = {}
        threads_before = af.get_num_threads()
        for threads in (1, 2):
            af.set_num_threads(threads)
            one[threads] = _median_us(lambda: local.attend(q), args.steps)
        af.set_num_threads(threads_before)
        del local
        kv_bytes = HKV * L * 2 * D * 2
        row = {"L": L, "kv_mib": kv_bytes / 2**20, "one_process_us": one, "sharded_us": {},
               "bytes": {}}
        for S in args.shards:
            cap = -(-(L + args.steps + 8) // S)
            with distributed.ShardedKVCache(1, HKV, D, cap, S, dtype=CACHE_DTYPE,
                                            compiled=True) as cache:
                _fill(cache, L, rng)
                with Traffic() as tr:
                    row["sharded_us"][S] = sharded_step(cache, rng, args.steps)
                row["bytes"][S] = (statistics.median(tr.sent), statistics.median(tr.received))
        rows.append(row)
        print(f"  L={L} done", flush=True)
    report["decode"] = rows
    print("\nDecode step (append 1 token + attend), µs, actor calls / compiled graph; "
          "one-process KVCache.attend alongside:")
    head = " | ".join(f"{S} shard{'s' if S > 1 else ''}" for S in args.shards)
    print(f"| L | K+V MiB | one process, 1 thread | one process, 2 threads | {head} |")
    print("|---:|---:|---:|---:|" + "---:|" * len(args.shards))
    for r in rows:
        cells = " | ".join(f"{r['sharded_us'][S]['calls']:.0f} / {r['sharded_us'][S]['compiled']:.0f}"
                           for S in args.shards)
        print(f"| {r['L']} | {r['kv_mib']:.0f} | {r['one_process_us'][1]:.0f} | "
              f"{r['one_process_us'][2]:.0f} | {cells} |")
    print("\nPer-shard KV read bandwidth implied by (step at L - step at tiny L), actor calls, "
          "GB/s:")
    print("| L | " + " | ".join(f"{S} shard{'s' if S > 1 else ''}" for S in args.shards)
          + " | one process, 1 thread |")
    print("|---:|" + "---:|" * (len(args.shards) + 1))
    for r in rows:
        kv = HKV * r["L"] * 2 * D * 2
        cells = []
        for S in args.shards:
            work = r["sharded_us"][S]["calls"] - tiny[S]["calls"]
            cells.append(f"{kv / S / work / 1e3:.1f}" if work > 0 else "-")
        print(f"| {r['L']} | " + " | ".join(cells) +
              f" | {kv / r['one_process_us'][1] / 1e3:.1f} |")
    print("\nbytes handed to Ray per step and shard, sent / received (median):")
    for r in rows:
        print(f"  L={r['L']}: " + ", ".join(f"{S} shards {r['bytes'][S][0]:.0f} / "
                                            f"{r['bytes'][S][1]:.0f}" for S in args.shards))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    ray.shutdown()


if __name__ == "__main__":
    main()
