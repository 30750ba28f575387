"""
Decoding with a KV cache: cost linear in the context
=====================================================

Generating a token means attending its query over every cached key. With
:class:`attnfast.KVCache` a step reads each cached key and value once, so its cost grows
linearly with the context length L; recomputing full causal attention over all L tokens at
every step instead costs O(L^2) per step. This example times both on this machine.
"""
import os
import time

import matplotlib.pyplot as plt
import numpy as np

import attnfast as af

# The test suite runs the gallery on small sizes.
SMALL = bool(os.environ.get("ATTNFAST_DOCS_SMALL"))
H, Hkv, D = 8, 2, 64
lengths = [256, 512, 1024] if SMALL else [1024, 2048, 4096, 8192]
rng = np.random.default_rng(0)


def best_of(fn, repeats=5):
    """Best wall time of `repeats` calls (the least disturbed by other work)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


step_ms, recompute_ms = [], []
for L in lengths:
    cache = af.KVCache(1, Hkv, D, capacity=L + 8)
    k = rng.standard_normal((1, Hkv, L, D), dtype=np.float32)
    v = rng.standard_normal((1, Hkv, L, D), dtype=np.float32)
    cache.append(k, v)
    q1 = rng.standard_normal((1, H, 1, D), dtype=np.float32)
    k1 = rng.standard_normal((1, Hkv, 1, D), dtype=np.float32)

    def step():
        cache.step(q1, k1, k1)
        cache.truncate(L)           # keep the length fixed while timing

    q_all = rng.standard_normal((1, H, L, D), dtype=np.float32)
    step_ms.append(1e3 * best_of(step))
    recompute_ms.append(1e3 * best_of(lambda: af.attention(q_all, k, v, causal=True), 3))
    print(f"L = {L:6d}: cached step {step_ms[-1]:8.3f} ms, "
          f"recomputing all of attention {recompute_ms[-1]:9.2f} ms")

# %%
# The cached step's time over L is close to a constant: a straight line through the origin.
slope = np.polyfit(lengths, step_ms, 1)[0]
print(f"cached step: {1e6 * slope:.2f} ns per cached token")

fig, ax = plt.subplots(figsize=(6.5, 4), constrained_layout=True)
ax.loglog(lengths, step_ms, "o-", label="KVCache.step (one new token)")
ax.loglog(lengths, recompute_ms, "s-", label="recompute causal attention over all L")
ax.set_xlabel("context length L (tokens)")
ax.set_ylabel("time per generated token (ms)")
ax.set_title(f"{H} query heads, {Hkv} KV heads, D = {D}, float32")
ax.legend()
plt.show()
