"""Cost of softcap, ALiBi and a padding mask against plain float32 decode (one query row per
head, L=16384 cached keys, 32/8 heads, D=128), 1 thread, process CPU time, medians of 30
interleaved pairs.

    python bench/bench_decode_options.py
    ATTNFAST_ISA=avx2 python bench/bench_decode_options.py
"""
import time, statistics, numpy as np, attnfast as af
rng = np.random.default_rng(0)
L, H, Hkv, D = 16384, 32, 8, 128
q = rng.standard_normal((1, H, 1, D)).astype(np.float32)
k = rng.standard_normal((1, Hkv, L, D)).astype(np.float32)
v = rng.standard_normal((1, Hkv, L, D)).astype(np.float32)
opts = {"softcap=30": dict(softcap=30.0), "alibi (H,)": dict(alibi_slopes=(2.0 ** -np.arange(1, H + 1)).astype(np.float32) / 64),
        "bool mask (B,1,1,L)": dict(mask=rng.random((1, 1, 1, L)) < 0.9)}
print(f"decode L={L}, H={H}/{Hkv}, D={D}, float32, 1 thread, CPU time; tier {af.show_config()['isa']}")
for name, kw in opts.items():
    a, b = [], []
    for _ in range(30):
        t0 = time.process_time(); af.attention(q, k, v, num_threads=1); a.append(time.process_time() - t0)
        t0 = time.process_time(); af.attention(q, k, v, num_threads=1, **kw); b.append(time.process_time() - t0)
    print(f"{name:22s} plain {statistics.median(a)*1e3:7.2f}ms option {statistics.median(b)*1e3:7.2f}ms ratio {statistics.median(b)/statistics.median(a):5.2f}x")
