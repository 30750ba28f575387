import numpy as np, attnfast as af, time, sys, ml_dtypes
rng=np.random.default_rng(0)
L=16384
res=[]
for dt in (np.float32, ml_dtypes.bfloat16):
    k=rng.standard_normal((1,8,L,128),dtype=np.float32).astype(dt); v=rng.standard_normal((1,8,L,128),dtype=np.float32).astype(dt)
    for H,tq in ((32,8),(32,16),(8,32)):
        q=rng.standard_normal((1,H,tq,128),dtype=np.float32).astype(dt)
        f=lambda: af.attention_with_kvcache(q,k,v,L,causal=True,num_threads=1)
        f(); ts=[]
        for _ in range(5):
            t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
        p=af.explain(q,k,v,cache_seqlens=L,num_threads=1)
        res.append(f"{np.dtype(dt).name} {H}/8 Tq={tq} {p['kernel']} {np.median(ts)*1e3:.1f}")
# MLA
kl=rng.standard_normal((1,1,8192,576),dtype=np.float32)
q=rng.standard_normal((1,128,1,576),dtype=np.float32)
f=lambda: af.attention_with_kvcache(q,kl,kl[...,:512],8192,num_threads=1)
f(); ts=[]
for _ in range(5):
    t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
res.append(f"mla f32 8k {np.median(ts)*1e3:.1f}")
print(sys.argv[1], " | ".join(res))
