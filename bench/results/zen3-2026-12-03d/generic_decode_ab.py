import time, sys, numpy as np, ml_dtypes, attnfast as af
assert af._ext.runtime_info()["isa"] == "generic"
rng = np.random.default_rng(0)
res = []
for name, dt in (("f32", np.float32), ("bf16", ml_dtypes.bfloat16), ("int8", None)):
    for (h, hkv) in ((32, 8), (8, 8)):
        L = 16384
        q = rng.standard_normal((1, h, 1, 128)).astype(np.float32 if dt is None else dt)
        kf = rng.standard_normal((1, hkv, L, 128)).astype(np.float32)
        vf = rng.standard_normal((1, hkv, L, 128)).astype(np.float32)
        kw = {}
        if dt is None:
            from attnfast._kvcache import quantize_int8
            k, ks = quantize_int8(kf); v, vs = quantize_int8(vf); kw = dict(k_scale=ks, v_scale=vs)
        else:
            k, v = kf.astype(dt), vf.astype(dt)
        f = lambda: af.attention_with_kvcache(q, k, v, np.array([L]), num_threads=1, **kw)
        f()
        ts = []
        for _ in range(15):
            t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
        res.append(f"{name} {h}/{hkv} {np.median(ts)*1e3:.2f}")
print(af.explain(q, k, v, cache_seqlens=np.array([L]), **kw)["kernel"], " | ".join(res))
