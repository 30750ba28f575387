"""Two builds in ONE process, calls alternated A B A B: a decode step, ms (medians of rounds).

    python inproc_ab.py DIR_B [H/HKV:L:dtype ...]

A is the installed attnfast; B a copy of the package renamed attnfast_b in DIR_B with the other
build's _ext .so (its modules import each other relatively; each .so loads RTLD_LOCAL, so
neither build's symbols reach the other).
"""
import sys
import time

import ml_dtypes
import numpy as np

import attnfast as A

sys.path.insert(0, sys.argv[1])
import attnfast_b as B  # noqa: E402

cells = sys.argv[2:] or ["32/8:512:f32", "32/8:16384:f32", "8/8:16384:f32", "32/8:16384:bf16"]
rng = np.random.default_rng(0)
for cell in cells:
    heads, L, dt = cell.split(":")
    h, hkv = map(int, heads.split("/"))
    L = int(L)
    d = np.float32 if dt == "f32" else ml_dtypes.bfloat16
    q = rng.standard_normal((1, h, 1, 128)).astype(d)
    k = rng.standard_normal((1, hkv, L, 128)).astype(d)
    v = rng.standard_normal((1, hkv, L, 128)).astype(d)
    sl = np.array([L])
    oa = A.attention_with_kvcache(q, k, v, sl, num_threads=1)
    ob = B.attention_with_kvcache(q, k, v, sl, num_threads=1)
    same = np.array_equal(np.asarray(oa).view(np.uint8), np.asarray(ob).view(np.uint8))
    calls = max(3, int(2e6 // (h * L)))
    ta, tb = [], []
    for rnd in range(15):
        for mod, ts in ((A, ta), (B, tb)) if rnd % 2 == 0 else ((B, tb), (A, ta)):
            t0 = time.perf_counter()
            for _ in range(calls):
                mod.attention_with_kvcache(q, k, v, sl, num_threads=1)
            ts.append((time.perf_counter() - t0) / calls)
    ma, mb = np.median(ta) * 1e3, np.median(tb) * 1e3
    print(f"{cell}: A {ma:.3f} ms  B {mb:.3f} ms  B/A {mb / ma:.3f}  same bits: {same}", flush=True)
