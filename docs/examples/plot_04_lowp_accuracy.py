"""
16-bit, int8 and float8 KV caches: how much accuracy they cost
===============================================================

A decode step reads every cached byte once, so a smaller cache is a faster one: bfloat16 and
float16 halve the bytes of float32, int8 and float8 e4m3 (one float32 scale per token row)
quarter them. int8 caches store keys rotated by an orthonormal Hadamard matrix (the default;
``key_rotation=None`` stores them as given, shown as ``int8_unrotated``). All
arithmetic still accumulates in float32. This example measures the attention output's error
against a float64 reference over float32 keys and values, for each storage type, on random
normal data and on data with a few outlier key channels (as real models have).
"""
import os

import matplotlib.pyplot as plt
import ml_dtypes
import numpy as np

import attnfast as af

SMALL = bool(os.environ.get("ATTNFAST_DOCS_SMALL"))
H, Hkv, D = 8, 2, 128
L = 512 if SMALL else 4096
rng = np.random.default_rng(0)


def reference(q, k, v):
    """float64 softmax(q k^T / sqrt(D)) v, GQA by repeating K/V heads."""
    g = q.shape[1] // k.shape[1]
    k64 = np.repeat(k.astype(np.float64), g, axis=1)
    v64 = np.repeat(v.astype(np.float64), g, axis=1)
    s = q.astype(np.float64) @ k64.transpose(0, 1, 3, 2) / np.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v64


formats = {"float32": (np.float32, "auto"), "bfloat16": (ml_dtypes.bfloat16, "auto"),
           "float16": (np.float16, "auto"), "int8": ("int8", "auto"),
           "int8_unrotated": ("int8", None), "float8": (ml_dtypes.float8_e4m3fn, "auto")}
errors = {}
for data in ("normal", "outlier channels"):
    k = rng.standard_normal((1, Hkv, L, D)).astype(np.float32)
    v = rng.standard_normal((1, Hkv, L, D)).astype(np.float32)
    if data == "outlier channels":
        k[..., :4] *= 20.0            # 4 of 128 key channels 20x larger
    q = (2.0 * rng.standard_normal((1, H, 1, D))).astype(np.float32)
    expect = reference(q, k, v)
    for name, (dtype, rotation) in formats.items():
        cache = af.KVCache(1, Hkv, D, capacity=L, dtype=dtype, key_rotation=rotation)
        cache.append(k, v)
        out = cache.attend(q)
        rel = np.abs(out - expect).mean() / np.abs(expect).mean()
        errors[name, data] = rel
        print(f"{data:17s} {name:9s} mean |error| / mean |out| = {100 * rel:7.4f} %")

# %%
# int8's error comes from its one scale per token row: unrotated, an outlier channel sets the
# scale of every row, so the other channels lose resolution; the rotation spreads each channel
# over all of them, so the scale fits every channel (q is rotated alike: q . k is unchanged).
fig, ax = plt.subplots(figsize=(8, 3.5), constrained_layout=True)
x = np.arange(len(formats))
for i, data in enumerate(("normal", "outlier channels")):
    ax.bar(x + 0.4 * i - 0.2, [100 * errors[n, data] for n in formats], width=0.4, label=data)
ax.set_xticks(x, list(formats))
ax.set_yscale("log")
ax.set_ylabel("mean |error| / mean |out| (%)")
ax.set_title(f"decode over L = {L} cached tokens, D = {D}")
ax.legend()
plt.show()
