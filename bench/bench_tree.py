"""Tree verification (``tree_mask=``) against the same call with a dense capacity-wide mask
(issue 22, item 3), in one process.

    python bench/bench_tree.py                       # L = 16k, 32/8 heads, D = 128, float32, Tq 2..64
    python bench/bench_tree.py --threads 1 --tq 16,17

A KVCache holding L tokens; the last Tq of them are a random token tree. Each Tq is timed
two ways, in turns (A B A B ..., medians): ``attend(q, tree_mask=tree)`` (cached keys
unmasked + the Tq x Tq tree, merged) and ``attend(q, causal=False, mask=dense)`` with the
equivalent (1, 1, Tq, capacity) bool mask. Results are checked against each other first.
"""
import argparse
import statistics
import time

import numpy as np

import attnfast as af


def random_tree(rng, tq):
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, tq)]
    tree = np.zeros((tq, tq), bool)
    for i in range(tq):
        j = i
        while j >= 0:
            tree[i, j], j = True, parent[j]
    return tree


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--tq", default="2,4,8,16,17,32,64")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    h, hkv = (int(x) for x in args.heads.split("/"))
    L, D = args.length, args.d
    cache = af.KVCache(1, hkv, D, L)
    cache.append(rng.standard_normal((1, hkv, L, D), np.float32),
                 rng.standard_normal((1, hkv, L, D), np.float32))
    print(f"L={L} heads={args.heads} D={D} float32 threads={args.threads or af.get_num_threads()}"
          f" repeats={args.repeats} (medians)")
    print("  Tq  tree ms  dense ms  dense/tree  tree us/row  dense us/row  max|diff|")
    for tq in (int(x) for x in args.tq.split(",")):
        tree = random_tree(rng, tq)
        dense = np.ones((1, 1, tq, L), bool)
        dense[..., L - tq:] = tree
        q = rng.standard_normal((1, h, tq, D), np.float32)
        ways = {"tree": lambda: cache.attend(q, tree_mask=tree, num_threads=args.threads),
                "dense": lambda: cache.attend(q, causal=False, mask=dense,
                                              num_threads=args.threads)}
        err = float(np.abs(ways["tree"]() - ways["dense"]()).max())
        times = {k: [] for k in ways}
        for _ in range(args.repeats):
            for k, fn in ways.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        t = {k: statistics.median(v) for k, v in times.items()}
        print(f"{tq:4d}  {t['tree'] * 1e3:7.2f}  {t['dense'] * 1e3:8.2f}  "
              f"{t['dense'] / t['tree']:9.2f}x  {t['tree'] * 1e6 / tq:11.1f}  "
              f"{t['dense'] * 1e6 / tq:12.1f}  {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
