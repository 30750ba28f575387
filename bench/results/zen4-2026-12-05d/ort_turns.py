# attnfast vs ONNX Runtime GroupQueryAttention, one decode step, 8/8 and 32/8 heads, D = 128, float32,
# in one process on the same buffers, engines in turns (A B A B), medians of the turns' medians.
import os, sys, time
import numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # bench/
from peers import AttnfastEngine, OnnxRuntimeEngine, Case
rng = np.random.default_rng(0)
for threads in (1, 2):
    for L in (16384, 65536):
        for h in (8, 32):
            case = Case("decode", 1, h, 8, 1, L, 128, 128, False)
            q = rng.standard_normal((1, h, 1, 128), dtype=np.float32)
            k = rng.standard_normal((1, 8, L, 128), dtype=np.float32)
            v = rng.standard_normal((1, 8, L, 128), dtype=np.float32)
            runs = {e.name: e.prepare(case, (q, k, v), threads)[0] for e in (AttnfastEngine(), OnnxRuntimeEngine())}
            med = {n: [] for n in runs}
            for r in range(11):
                for n, run in runs.items():
                    time.sleep(0.1); run(); ts = []
                    for _ in range(25 if L == 16384 else 8):
                        t0 = time.perf_counter(); run(); ts.append(time.perf_counter() - t0)
                    med[n].append(np.median(ts))
            a, o = np.median(med["attnfast"]), np.median(med["onnxruntime"])
            gb = 2 * k.nbytes / 1e9
            print(f"{threads}T L={L//1024}k {h}/8: attnfast {a*1e3:.2f} ms ({gb/a:.1f} GB/s)  ort {o*1e3:.2f} ms ({gb/o:.1f} GB/s)  attnfast/ort speed {o/a:.2f}x", flush=True)
