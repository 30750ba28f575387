import sys, time, numpy as np, ml_dtypes
import attnfast as A
sys.path.insert(0, sys.argv[1]); import attnfast_b as B
from attnfast._kvcache import quantize_int8
rng = np.random.default_rng(0)
for cell in sys.argv[2:]:
    heads, L, dt, th = cell.split(":"); h, hkv = map(int, heads.split("/")); L = int(L); th = int(th)
    q = rng.standard_normal((1, h, 1, 128)).astype(np.float32)
    kf = rng.standard_normal((1, hkv, L, 128)).astype(np.float32); vf = rng.standard_normal((1, hkv, L, 128)).astype(np.float32)
    kw = {}
    if dt == "int8":
        k, ks = quantize_int8(kf); v, vs = quantize_int8(vf); kw = dict(k_scale=ks, v_scale=vs)
    else:
        d = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}[dt]
        k, v = kf.astype(d), vf.astype(d); q = q.astype(d)
    sl = np.array([L])
    f = lambda m: m.attention_with_kvcache(q, k, v, sl, num_threads=th, **kw)
    same = np.array_equal(np.asarray(f(A)).view(np.uint8), np.asarray(f(B)).view(np.uint8))
    calls = max(3, int(2e6 // (h * L)))
    ta, tb = [], []
    for rnd in range(15):
        for mod, ts in ((A, ta), (B, tb)) if rnd % 2 == 0 else ((B, tb), (A, ta)):
            t0 = time.perf_counter()
            for _ in range(calls): f(mod)
            ts.append((time.perf_counter() - t0) / calls)
    ma, mb = np.median(ta) * 1e3, np.median(tb) * 1e3
    print(f"{cell}: A {ma:.3f} ms  B {mb:.3f} ms  B/A {mb / ma:.3f}  same bits: {same}", flush=True)
