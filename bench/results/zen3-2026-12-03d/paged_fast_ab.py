import time, numpy as np, attnfast as af, statistics
from attnfast._checks import PAGED_PLANS
import attnfast.integrations.vllm as afv
rng = np.random.default_rng(0)
for (H, HKV, B) in ((32, 8, 1), (32, 8, 8)):
    D, BS, L = 128, 16, 64
    nb = B * -(-L // BS)
    kp = rng.standard_normal((2 * nb, HKV, BS, D)).astype(np.float32); vp = kp.copy()
    table = rng.permutation(2 * nb)[:nb].astype(np.int32).reshape(B, -1)
    q = rng.standard_normal((B, H, 1, D), dtype=np.float32)
    sl = np.full(B, L, np.int32)
    fast = lambda: af.attention_with_kvcache(q, kp, vp, sl, block_table=table, num_threads=1)
    def full():
        PAGED_PLANS.clear()
        return af.attention_with_kvcache(q, kp, vp, sl, block_table=table, num_threads=1)
    assert np.array_equal(fast(), full())
    fast(); fast()
    res = {"fast": [], "full": []}
    for _ in range(30):
        for name, f in (("fast", fast), ("full", full)):
            t0 = time.perf_counter()
            for _ in range(50): f()
            res[name].append((time.perf_counter() - t0) / 50 * 1e6)
    print(f"B={B} H={H}/{HKV} L={L}: fast {statistics.median(res['fast']):.1f} us, full checks {statistics.median(res['full']):.1f} us")
