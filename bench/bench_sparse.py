"""Sparse attention (key_index=) against the same attention as a dense masked call, for a
prompt chunk whose every query attends its own top-k (issue 48's prefill target).

    python bench/bench_sparse.py --heads 8x2 --prompt 32768 --new 4096 --topk 2048 --threads 1

Each of the `new` queries (the last tokens; causal) lists `topk` random distinct positions it
may see; attnfast.attention(..., key_index=) reads only those rows, the dense call reads every
key under a bool mask of the same selection (built here: Tq x L bytes). One run of each, in
turns, `--repeats` times; medians, and the largest difference of the two outputs.
"""
import argparse
import statistics
import time

import numpy as np

import attnfast
from attnfast.bench.limits import cpu_name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="8x2", help="query x kv heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--new", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    H, Hkv = (int(x) for x in args.heads.split("x"))
    D, P, T, topk = args.head_dim, args.prompt, args.new, args.topk
    rng = np.random.default_rng(0)
    L = P + T
    q = rng.standard_normal((1, H, T, D), dtype=np.float32)
    k = rng.standard_normal((1, Hkv, L, D), dtype=np.float32)
    v = rng.standard_normal((1, Hkv, L, D), dtype=np.float32)
    index = np.full((1, T, topk), -1, np.int32)
    for t in range(T):
        seen = min(P + t + 1, topk)
        index[0, t, :seen] = rng.choice(P + t + 1, size=seen, replace=False)
    mask = np.zeros((1, 1, T, L), bool)
    for t in range(T):
        mask[0, 0, t, index[0, t][index[0, t] >= 0]] = True
    ways = {"sparse": lambda: attnfast.attention(q, k, v, causal=True, key_index=index,
                                                 num_threads=args.threads),
            "dense masked": lambda: attnfast.attention(q, k, v, causal=True, mask=mask,
                                                       num_threads=args.threads)}
    times = {name: [] for name in ways}
    outs = {}
    for _ in range(args.repeats):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - t0)
    s, d = (statistics.median(times[n]) for n in ways)
    print(f"{cpu_name()}, tier {attnfast._ext.runtime_info()['isa']}; "
          f"H={H}/{Hkv} D={D}, {T} new tokens after {P}, top-{topk}, {args.threads} thread(s): "
          f"sparse {s:.2f} s, dense masked {d:.2f} s -> {d / s:.1f}x; max |diff| "
          f"{np.abs(outs['sparse'] - outs['dense masked']).max():.1e}")


if __name__ == "__main__":
    main()
