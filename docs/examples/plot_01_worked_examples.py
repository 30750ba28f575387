"""
The worked examples: "The cat sat ... it" and "the cat sat"
============================================================

Two hand-computed attention examples from the chapters attnfast grew out of, reproduced to
their printed digits with :func:`attnfast.attention_weights` (which builds the small Tq x Tk
matrix on purpose) and :func:`attnfast.attention` (which never does).
"""
import matplotlib.pyplot as plt
import numpy as np

import attnfast as af

# %%
# "The cat sat ... it": one head, causal, scaled
# ----------------------------------------------
# Four tokens embedded in C = 3 dimensions, projected to d = 2 by W_Q, W_K, W_V.
X = np.array([[1.0, 0.0, 0.0],   # The
              [0.0, 1.0, 0.0],   # cat
              [0.0, 0.0, 1.0],   # sat
              [0.2, 0.3, 0.0]])  # it
W_Q = np.array([[0, 1], [2, 0], [0, 1]], dtype=float)
W_K = np.array([[0.5, 0], [4, 0], [0, 2]], dtype=float)
W_V = np.array([[1, 0], [0, 1], [0.5, 0.5]], dtype=float)
Q, K, V = X @ W_Q, X @ W_K, X @ W_V
tokens = ["The", "cat", "sat", "it"]

print("scores of 'it', unscaled:", np.round(Q[3] @ K.T, 2))
print("scores of 'it', scaled:  ", np.round(Q[3] @ K.T / np.sqrt(2), 2))

causal = af.attention_weights(Q, K, causal=True)
full = af.attention_weights(Q, K)
print("causal weights:\n", np.round(causal, 4))
print("output:\n", np.round(af.attention(Q, K, V, causal=True), 4))

# %%
# "it" puts 0.56 of its attention on "cat". Without the causal mask every token also sees the
# ones after it:


def heatmap(ax, weights, title, rows, cols):
    im = ax.imshow(weights, vmin=0, vmax=1, cmap="viridis")
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title(title)
    for i in range(weights.shape[0]):
        for j in range(weights.shape[1]):
            ax.text(j, i, f"{weights[i, j]:.2f}", ha="center", va="center",
                    color="white" if weights[i, j] < 0.6 else "black", fontsize=9)
    return im


fig, axes = plt.subplots(1, 2, figsize=(9, 4), constrained_layout=True)
heatmap(axes[0], causal, "causal (a token sees only the past)", tokens, tokens)
im = heatmap(axes[1], full, "no mask", tokens, tokens)
fig.colorbar(im, ax=axes, shrink=0.8, label="attention weight")

# %%
# "the cat sat": three tokens, by hand
# ------------------------------------
# Here the projections are given as q = W_Q x and k = W_K x, and the chapter computes the
# weights unscaled (scale = 1) and scaled by 1/sqrt(2).
x = np.array([[1, 0, 0], [0, 1, 0], [1, 1, 1]], dtype=float)   # the, cat, sat
W_Q2 = np.array([[2, 0, -1], [0, 2, -1]], dtype=float)
W_K2 = np.array([[1, 1, -2], [-1, 1, 1]], dtype=float)
q, k = x @ W_Q2.T, x @ W_K2.T
print("Q K^T =\n", q @ k.T)
words = ["the", "cat", "sat"]
unscaled = af.attention_weights(q, k, scale=1.0)
unscaled_causal = af.attention_weights(q, k, scale=1.0, causal=True)
scaled = af.attention_weights(q, k)
print("unscaled:\n", np.round(unscaled, 4))
print("unscaled, causal:\n", np.round(unscaled_causal, 4))
print("scaled, 'sat' row:", np.round(scaled[2], 4))

fig, axes = plt.subplots(1, 3, figsize=(12, 4), constrained_layout=True)
heatmap(axes[0], unscaled, "unscaled", words, words)
heatmap(axes[1], unscaled_causal, "unscaled, causal", words, words)
heatmap(axes[2], scaled, "scaled by 1/sqrt(2)", words, words)
plt.show()
