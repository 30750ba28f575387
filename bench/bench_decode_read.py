"""One-core and two-core decode against the machine's read limit, in one process.

    python bench/bench_decode_read.py                          # L = 16k and 64k, 8/8 and 32/8 heads
    python bench/bench_decode_read.py --lengths 65536 --threads 1 --repeats 15

A decode step (Tq = 1, B = 1, D = 128, float32 K/V) streams every K and V byte once, so its
bound is the rate at which the cores can read memory. The bar here is attnfast's native read
kernel (csrc/probe.cpp, the kernel `attnfast bench` and compare_peers take the read limit
from) over a buffer of the same size as the 8-KV-head cache, timed in turns with the decode
calls (medians of interleaved repeats), so a drift of the shared machine hits both alike and
the percentage compares numbers of the same minutes. Both the cache and the buffer are NumPy
allocations (transparent huge pages where the kernel offers them).

Columns: the read kernel's median GB/s, then per head layout the decode median (ms), its K+V
GB/s and that as a % of the read kernel's.
"""
import argparse
import os
import statistics
import time

import numpy as np

import attnfast as af
from attnfast import _ext


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="16384,65536", help="cache lengths L")
    p.add_argument("--layouts", default="8/8,32/8", help="query heads / KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=11, help="interleaved rounds (median)")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    d = args.head_dim
    layouts = [tuple(int(x) for x in s.split("/")) for s in args.layouts.split(",")]
    print(f"decode Tq=1, B=1, D={d}, float32; kernel tier {_ext.runtime_info()['isa']}; "
          f"load average {os.getloadavg()[0]:.1f}")
    for length in [int(x) for x in args.lengths.split(",")]:
        cases = {}
        for h, hkv in layouts:
            cache = af.KVCache(1, hkv, d, length, dtype=np.float32)
            kv = rng.standard_normal((1, hkv, length, d), dtype=np.float32)
            cache.append(kv, kv)
            q = rng.standard_normal((1, h, 1, d), dtype=np.float32)
            cases[f"{h}/{hkv}"] = (cache, q, hkv * length * d * 4 * 2)
        read_bytes = max(b for _, _, b in cases.values())
        buffer = np.ones(read_bytes, dtype=np.uint8)
        for n in [int(x) for x in args.threads.split(",")]:
            times = {name: [] for name in ["read", *cases]}
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                _ext.read_bytes(buffer, n)
                times["read"].append(time.perf_counter() - t0)
                for name, (cache, q, _) in cases.items():
                    t0 = time.perf_counter()
                    cache.attend(q, num_threads=n)
                    times[name].append(time.perf_counter() - t0)
            read = read_bytes / statistics.median(times["read"]) / 1e9
            line = f"L={length:6d} threads={n}  read {read:5.1f} GB/s"
            for name, (_, _, nbytes) in cases.items():
                med = statistics.median(times[name])
                gbps = nbytes / med / 1e9
                line += f" | {name} {med * 1e3:7.2f} ms {gbps:5.1f} GB/s {100 * gbps / read:3.0f}%"
            print(line, flush=True)


if __name__ == "__main__":
    main()
