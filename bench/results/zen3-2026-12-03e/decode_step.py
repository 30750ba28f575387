"""One decode step (B = 1, Tq = 1, D = 128), medians over N calls: python decode_step.py H HKV L f32|bf16 [N]"""
import numpy as np, attnfast as af, time, sys
h, hkv, L, dt = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
n = int(sys.argv[5]) if len(sys.argv) > 5 else 200
import ml_dtypes
d = np.float32 if dt == "f32" else ml_dtypes.bfloat16
rng = np.random.default_rng(0)
q = rng.standard_normal((1, h, 1, 128)).astype(d)
k = rng.standard_normal((1, hkv, L, 128)).astype(d)
v = rng.standard_normal((1, hkv, L, 128)).astype(d)
sl = np.array([L])
f = lambda: af.attention_with_kvcache(q, k, v, sl, num_threads=1)
f()
ts = []
for _ in range(n):
    t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
print(f"{h}/{hkv} L={L} {dt}: median {np.median(ts)*1e3:.3f} ms, {k.nbytes*2/np.median(ts)/1e9:.1f} GB/s")
