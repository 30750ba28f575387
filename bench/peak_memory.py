"""Peak memory of a long causal prefill beyond its inputs and output.

    python bench/peak_memory.py                 # T=131072, one head, D=128, float32
    python bench/peak_memory.py --tokens 32768 --threads 1

Allocates and touches q, k, v and out first, resets the kernel's high-water mark
(/proc/self/clear_refs), runs attention(causal=True, out=out) and reports how far the
resident set's peak rose above what it was before the call. The naive T x T float32 score
matrix is printed alongside for scale.
"""
import argparse
import time

import numpy as np

import attnfast as af


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    T, D = args.tokens, args.head_dim

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, T, D), dtype=np.float32) for _ in range(3))
    out = np.zeros_like(q)  # zeros touches the pages, so they count before the call
    inputs_mb = 4 * q.nbytes / 2**20

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    rss_before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    af.attention(q, k, v, causal=True, out=out, num_threads=args.threads)
    elapsed = time.perf_counter() - t0
    peak_extra_mb = (_status_kib("VmHWM") - rss_before) / 1024

    flops = 2.0 * T * T * 2 * D / 2
    print(f"T={T} D={D} float32 causal, 1 head, {af.get_num_threads() if args.threads is None else args.threads} thread(s)")
    print(f"  inputs + output:             {inputs_mb:10.1f} MB")
    print(f"  peak beyond inputs + output: {peak_extra_mb:10.2f} MB")
    print(f"  naive T x T score matrix:    {T * T * 4 / 2**20:10.1f} MB (never built)")
    print(f"  time: {elapsed:.2f} s, {flops / elapsed / 1e9:.1f} GFLOP/s")
    print(f"  finite: {bool(np.isfinite(out).all())}")


if __name__ == "__main__":
    main()
