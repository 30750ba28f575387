# In one process: attnfast and OpenVINO SDPA, bfloat16, non-causal, B = 1, H = 8, 2 threads, timed in turns
# (0.3 s pause, 0.25 s of calls each, order swapped every block); argv: T D. Run from anywhere:
#   python bench/results/zen4-2026-12-05/bf16_two_thread_turns.py 1024 128
import os, time, statistics, sys, numpy as np, ml_dtypes
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import attnfast as af
from peers import OpenVINOEngine
dt = np.dtype(ml_dtypes.bfloat16); T, D, H = int(sys.argv[1]), int(sys.argv[2]), 8
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, H, T, D), dtype=np.float32).astype(dt) for _ in range(3))
out = np.empty_like(q)
class C: pass
case = C(); case.kind = "prefill"; case.h = case.hkv = H; case.causal = False; case.tq = T; case.b = 1; case.d = case.dv = D
run, _ = OpenVINOEngine().prepare(case, (q, k, v), 2)
a = lambda: af.attention(q, k, v, out=out, num_threads=2)
a(); run()
for blk in range(12):
    r = {}
    for name, f in (("af", a), ("ov", run)) if blk % 2 == 0 else (("ov", run), ("af", a)):
        time.sleep(0.3); ts = []
        t_end = time.perf_counter() + 0.25
        while time.perf_counter() < t_end or len(ts) < 3:
            t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
        r[name] = statistics.median(ts) * 1e3
    print(f"af {r['af']:.1f} ov {r['ov']:.1f}", end=" | ", flush=True)
print()
