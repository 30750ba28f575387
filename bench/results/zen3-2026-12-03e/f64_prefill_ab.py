"""float64 prefill (the template prefill) per call, ms: run once per build, alternating.

    for i in 1 2 3; do for b in old new; do PYTHONPATH=/tmp/ab/$b python f64_prefill_ab.py $b; done; done
"""
import sys
import time

import numpy as np

import attnfast as af

rng = np.random.default_rng(0)
cells = []
for T, D in ((1024, 64), (1024, 128), (4096, 64)):
    for causal in (False, True):
        q = rng.standard_normal((1, 8, T, D))
        k = rng.standard_normal((1, 8, T, D))
        v = rng.standard_normal((1, 8, T, D))
        f = lambda: af.attention(q, k, v, causal=causal, num_threads=1)
        f()
        ts = []
        for _ in range(3 if T > 2048 else 5):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        cells.append(f"T{T} D{D} {'causal' if causal else 'full'} {np.median(ts) * 1e3:.0f}")
print(sys.argv[1] if len(sys.argv) > 1 else "", af.explain(q, k, v)["kernel"], " | ".join(cells))
