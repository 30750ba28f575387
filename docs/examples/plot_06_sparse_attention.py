"""
Sparse attention: which keys a query selects
=============================================

DeepSeek-V3.2 and GLM-5 let a small "lightning indexer" score every earlier token for each
query and attend over the ``topk`` best only. :func:`attnfast.index_topk` is that indexer with
its top-k; ``key_index=`` runs attention over the selected keys and reads no other K/V row.
This example selects 16 of up to 96 keys per query, draws the selection, and checks the
sparse attention against a float64 reference over exactly those keys.
"""
import matplotlib.pyplot as plt
import numpy as np

import attnfast as af

rng = np.random.default_rng(0)
T, topk = 96, 16                    # a 96-token prompt; each query keeps 16 keys
Hi, Di = 4, 32                      # the indexer's heads and head dim
H, D = 4, 32                        # the attention's (one KV head: MQA / an MLA latent row)

q_index = rng.standard_normal((1, Hi, T, Di), dtype=np.float32)
weights = np.abs(rng.standard_normal((1, T, Hi), dtype=np.float32))
k_index = rng.standard_normal((1, T, Di), dtype=np.float32)

# Causal: query t sees keys 0..t; a query with fewer than 16 keys gets -1 for the rest.
selected = af.index_topk(q_index, weights, k_index, topk)        # int32 (1, T, 16)
print("query 5 selects", selected[0, 5].tolist())
print("query 95 selects", sorted(selected[0, 95].tolist()))

# %%
# Attention over the selected keys only (a prefill of the whole prompt: every query row
# with its own list).
q = rng.standard_normal((1, H, T, D), dtype=np.float32)
k = rng.standard_normal((1, 1, T, D), dtype=np.float32)
v = rng.standard_normal((1, 1, T, D), dtype=np.float32)
out = af.attention(q, k, v, causal=True, key_index=selected)

worst = 0.0
for t in range(T):
    keys = [int(j) for j in selected[0, t] if j >= 0]
    s = q[0, :, t].astype(np.float64) @ k[0, 0, keys].T.astype(np.float64) / np.sqrt(D)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    want = (p / p.sum(axis=1, keepdims=True)) @ v[0, 0, keys]
    worst = max(worst, float(np.abs(out[0, :, t] - want).max()))
print(f"max |sparse attention - float64 reference over the selected keys| = {worst:.1e}")

# %%
# The selection: row t is query t, a dark cell a key it attends over. The first 16 queries
# see fewer than 16 keys and take them all (the filled corner); later ones pick 16 of the
# t + 1 keys the causal triangle leaves them.
picture = np.zeros((T, T))
for t in range(T):
    picture[t, selected[0, t][selected[0, t] >= 0]] = 1
fig, ax = plt.subplots(figsize=(5, 5))
ax.imshow(picture, cmap="Greys", interpolation="nearest")
ax.set_xlabel("key position")
ax.set_ylabel("query position")
ax.set_title(f"keys selected by the indexer (top-{topk})")
fig.tight_layout()
plt.show()
