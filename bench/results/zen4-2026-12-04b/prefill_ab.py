"""Prefill A/B/C in one process (bisection, HISTORY 32): the installed attnfast against builds given as DIR:NAME (a build's package renamed NAME in DIR). ATTNFAST_ISA picks the tier."""
import sys, time, statistics, importlib
import numpy as np
import attnfast as head
builds = {"head": head}
for spec in sys.argv[1:]:
    d, name = spec.split(":")
    sys.path.insert(0, d)
    builds[name] = importlib.import_module(name)
print({k: m._ext.runtime_info()["isa"] for k, m in builds.items()})
rng = np.random.default_rng(0)
def timed(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls): fn()
    return (time.perf_counter() - t0) / calls
for t, d in ((1024, 128), (1024, 64)):
    q, k, v = (rng.standard_normal((1, 8, t, d), dtype=np.float32) for _ in range(3))
    for causal in (False, True):
        fns = {n: (lambda m=m: m.attention(q, k, v, causal=causal, num_threads=1)) for n, m in builds.items()}
        for f in fns.values(): f()
        calls = max(1, int(0.15 / timed(fns["head"], 1)))
        ts = {n: [] for n in fns}
        names = list(fns)
        for r in range(7):
            for n in (names if r % 2 == 0 else names[::-1]):
                ts[n].append(timed(fns[n], calls))
        med = {n: statistics.median(x) for n, x in ts.items()}
        print(f"T={t} D={d} causal={causal}: " + "  ".join(f"{n} {med[n]*1e3:.2f} ms ({med['head']/med[n]:.2f}x head)" for n in names), flush=True)
