"""
A paged KV cache: many sequences, shared prefixes
==================================================

:class:`attnfast.PagedKVCache` keeps one pool of fixed-size blocks for many sequences. A
``fork`` shares every block of a sequence (parallel sampling, beam search); the first append
to a shared, partly filled block copies it (copy-on-write), so no sequence ever changes
another's tokens. This example forks a prompt, decodes both branches in one call, and checks
them against plain attention over each branch's own tokens.
"""
import matplotlib.pyplot as plt
import numpy as np

import attnfast as af

H, Hkv, D, block = 4, 2, 32, 16
rng = np.random.default_rng(0)
cache = af.PagedKVCache(num_blocks=64, block_size=block, kv_heads=Hkv, head_dim=D)


def tokens(t, heads):
    return rng.standard_normal((heads, t, D), dtype=np.float32)


prompt_k, prompt_v = tokens(40, Hkv), tokens(40, Hkv)
a = cache.add_sequence()
cache.step(a, tokens(40, H), prompt_k, prompt_v)      # the prompt: 40 tokens, 3 blocks
print("after the prompt: free blocks", cache.num_free_blocks)
b = cache.fork(a)                                      # shares a's 3 blocks
print("after the fork:   free blocks", cache.num_free_blocks, "(nothing copied)")

# %%
# Decode four tokens on both branches, one kernel call per step.
history = {a: [prompt_k, prompt_v], b: [prompt_k, prompt_v]}
for _ in range(4):
    q = rng.standard_normal((2, H, 1, D), dtype=np.float32)
    k_new = rng.standard_normal((2, Hkv, 1, D), dtype=np.float32)
    v_new = rng.standard_normal((2, Hkv, 1, D), dtype=np.float32)
    out = cache.step([a, b], q, k_new, v_new)
    for i, s in enumerate((a, b)):
        history[s][0] = np.concatenate([history[s][0], k_new[i]], axis=1)
        history[s][1] = np.concatenate([history[s][1], v_new[i]], axis=1)
        expect = af.attention(q[i], history[s][0], history[s][1], causal=True)
        assert np.allclose(out[i], expect, atol=1e-5)
print("both branches equal attention over their own tokens; lengths", cache.lengths)
print("free blocks", cache.num_free_blocks, "(the shared last block was copied once)")

# %%
# Which pool blocks each sequence reads: the first two are shared, the third (partly filled
# at the fork) was copied for one of them.
table = cache.block_table([a, b])
fig, ax = plt.subplots(figsize=(6, 1.8), constrained_layout=True)
ax.imshow(np.where(table >= 0, table, np.nan), cmap="tab20", aspect="auto")
for (i, j), blk in np.ndenumerate(table):
    if blk >= 0:
        ax.text(j, i, str(blk), ha="center", va="center")
ax.set_yticks([0, 1], ["sequence a", "sequence b (fork)"])
ax.set_xticks(range(table.shape[1]))
ax.set_xlabel("table entry (block of 16 tokens)")
ax.set_title("block_table: pool blocks per sequence")
plt.show()
