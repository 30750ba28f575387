"""The error of rounding P to bfloat16 in the vdpbf16ps kernels (avx512bf16 tier), measured.

Runs the same bfloat16 attention on the avx512bf16 tier (P rounded to bfloat16 for P.V) and on
the avx512 tier (everything widened to float32, P kept in float32), and prints each one's max
and mean |error| against a float64 reference computed from the same bfloat16 inputs, for
prefill and decode shapes. Both outputs are rounded to bfloat16 at the end; the difference
between the two rows is what rounding P costs.

    python bench/bf16_rounding_error.py
"""
import os
import subprocess
import sys

import numpy as np

CASES = [("prefill T=1024 causal", 1, 8, 8, 1024, 1024, True),
         ("prefill T=4096 causal", 1, 8, 8, 4096, 4096, True),
         ("decode L=16k 32/8", 1, 32, 8, 1, 16384, True)]


def reference(q, k, v, causal):
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    tq, tk = s.shape[-2:]
    if causal:
        s = np.where(np.arange(tk)[None, :] <= np.arange(tq)[:, None] + (tk - tq), s, -np.inf)
    s -= s.max(-1, keepdims=True)
    w = np.exp(s)
    return (w / w.sum(-1, keepdims=True)) @ v


def run_tier():
    import ml_dtypes
    import attnfast as af
    rng = np.random.default_rng(0)
    for name, b, h, hkv, tq, tk, causal in CASES:
        q = rng.standard_normal((b, h, tq, 128)).astype(ml_dtypes.bfloat16)
        k = rng.standard_normal((b, hkv, tk, 128)).astype(ml_dtypes.bfloat16)
        v = rng.standard_normal((b, hkv, tk, 128)).astype(ml_dtypes.bfloat16)
        out = af.attention(q, k, v, causal=causal).astype(np.float64)
        rows = slice(None) if tq == 1 else slice(tq - 256, tq)  # the rows seeing most keys
        ref = reference(q[:, :, rows], k, v, causal) if tq == 1 else reference(q, k, v, causal)[:, :, rows]
        err = np.abs(out[:, :, rows] - ref)
        print(f"{os.environ['ATTNFAST_ISA']:10s} {name:22s} max {err.max():.3e}  mean {err.mean():.3e}"
              f"  (|out| mean {np.abs(ref).mean():.3e})", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--tier":
        run_tier()
    else:
        for tier in ("avx512bf16", "avx512"):
            subprocess.run([sys.executable, __file__, "--tier"], env={**os.environ, "ATTNFAST_ISA": tier},
                           check=True)
