"""Decode A/B/C in one process (bisection, HISTORY 32): the installed attnfast against builds given as DIR:NAME; HEADS=32/8 DT=bf16|f32 L=16384 by default; ATTNFAST_ISA picks the tier."""
import sys, time, statistics, importlib, os
import numpy as np, ml_dtypes
import attnfast as head
builds = {"head": head}
for spec in sys.argv[1:]:
    d, name = spec.split(":")
    sys.path.insert(0, d)
    builds[name] = importlib.import_module(name)
L = int(os.environ.get("L", "16384")); H, HKV = map(int, os.environ.get("HEADS", "32/8").split("/"))
dt = {"bf16": ml_dtypes.bfloat16, "f32": np.float32}[os.environ.get("DT", "bf16")]
rng = np.random.default_rng(0)
k = rng.standard_normal((1, HKV, L, 128), dtype=np.float32).astype(dt)
v = rng.standard_normal((1, HKV, L, 128), dtype=np.float32).astype(dt)
q = rng.standard_normal((1, H, 1, 128), dtype=np.float32).astype(dt)
sl = np.array([L], dtype=np.int32)
def timed(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls): fn()
    return (time.perf_counter() - t0) / calls
for n in (1, 2):
    fns = {nm: (lambda m=m: m.attention_with_kvcache(q, k, v, sl, num_threads=n)) for nm, m in builds.items()}
    for f in fns.values(): f()
    ts = {nm: [] for nm in fns}; names = list(fns)
    for r in range(9):
        for nm in (names if r % 2 == 0 else names[::-1]): ts[nm].append(timed(fns[nm], 10))
    med = {nm: statistics.median(x) for nm, x in ts.items()}
    print(f"threads={n} {H}/{HKV} L={L}: " + "  ".join(f"{nm} {med[nm]*1e3:.2f} ms ({med['head']/med[nm]:.2f}x head)" for nm in names), flush=True)
