"""Key rotation for quantised KV caches: an orthonormal block Hadamard matrix along D.

Keys with a few large channels (the outlier channels real models have) lose most of a
per-token int8 / int4 scale to those channels. Multiplying every key by an orthonormal
Hadamard matrix H spreads each channel over the whole block, so the per-token scale fits
all of them; queries get the same H before the kernel reads them, and since H is
orthonormal q . k = (H q) . (H k): attention over the rotated cache is attention over the
keys as given (values are not rotated). Stateless (no per-sequence statistics), so it works
unchanged for paged pools, forks, truncation and caller-owned arrays.

H is block-diagonal with blocks of b = the largest power of two dividing D (D = 128: one
128-block; D = 576: nine 64-blocks; odd D: b = 1, no rotation), each the Sylvester Hadamard
matrix divided by sqrt(b), applied by the fast Walsh-Hadamard transform in O(D log b).
"""
from __future__ import annotations

import numpy as np

from . import _ext

KEY_ROTATIONS = (None, "hadamard")


def hadamard_block(head_dim: int) -> int:
    """The block size of the rotation for head_dim: its largest power-of-two divisor."""
    return head_dim & -head_dim


def hadamard_rotate(x: np.ndarray) -> np.ndarray:
    """x (any shape, last axis D) times the orthonormal block Hadamard matrix along D, in
    float32 (a new array). The matrix is symmetric and its own inverse. Applied block by
    block by the fast Walsh-Hadamard transform in C++ (attnfast._ext.hadamard_rotate_rows:
    float32 butterflies, then the float32 1 / sqrt(b)), never by a BLAS product:
    every decode step rotates its query rows, and a threaded BLAS woken for that spins on
    the cores attention then runs on (OpenBLAS, two threads, int8 cache, 32/8 heads: a step
    took 8.0 ms instead of about 1.2). Never through the D x D matrix with its off-block zeros
    either: an inf would meet them (inf * 0 = NaN) and spoil the finite blocks of its row.

    Non-finite input is expected here and gives non-finite output without a warning (NaN
    in, NaN out): within a block, a NaN or an inf reaches every entry of the block (two
    infs of opposite sign give NaN), and finite entries past float32's range give +-inf."""
    out = np.array(x, dtype=np.float32, order="C")
    D = out.shape[-1] if out.ndim else 0
    b = hadamard_block(D) if D else 1
    if b > 1 and out.size:
        _ext.hadamard_rotate_rows(out.reshape(-1, D), b)
    return out


def rotate_queries(q: np.ndarray) -> np.ndarray:
    """q rotated as the cached keys are, in float32 whatever q's dtype: a rotated entry can
    grow by up to sqrt(b) (all of a block's weight on one entry), so a 16-bit q rounded back
    to its dtype could overflow (float16: 65504) where the keys' own dot product does not.
    The kernels take a float32 q over every cache q may read with rotated keys (int8,
    float8, int4); the caller rounds the result to q's dtype once."""
    return hadamard_rotate(q)
