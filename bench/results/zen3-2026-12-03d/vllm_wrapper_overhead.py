"""paged_attention (vLLM backend wrapper, torch tensors in) against attnfast.attention_with_kvcache
(NumPy in) on the same paged pool, L = 64, 32/8 heads, D = 128, one thread, alternated: the
wrapper's own per-call cost."""
import time, statistics, numpy as np, attnfast as af, torch
import attnfast.integrations.vllm as afv
rng = np.random.default_rng(0)
H, HKV, D, BS, L, B = 32, 8, 128, 128, 64, 1
cache = torch.zeros(4, HKV, BS, 2 * D)
kp, vp = afv.split_kv_cache(cache)
table = torch.tensor([[2]], dtype=torch.int32)
q = torch.randn(B, H, D); out = torch.empty_like(q)
qsl = torch.tensor([0, 1], dtype=torch.int32); sl = torch.tensor([L], dtype=torch.int32)
f = lambda: afv.paged_attention(q, kp, vp, out, qsl, sl, table, scale=0.088, num_threads=1)
qn, tn, sn = q.numpy()[:, :, None], table.numpy(), sl.numpy()
g = lambda: af.attention_with_kvcache(qn, kp, vp, sn, block_table=tn, num_threads=1, scale=0.088)
f(); g()
res = {"paged_attention (torch in)": [], "attention_with_kvcache (numpy)": []}
for _ in range(30):
    for name, fn in zip(res, (f, g)):
        t0 = time.perf_counter()
        for _ in range(100): fn()
        res[name].append((time.perf_counter() - t0) / 100 * 1e6)
for k, v in res.items(): print(k, round(statistics.median(v), 1), "us")
