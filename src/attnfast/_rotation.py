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

import functools

import numpy as np

KEY_ROTATIONS = (None, "hadamard")


def hadamard_block(head_dim: int) -> int:
    """The block size of the rotation for head_dim: its largest power-of-two divisor."""
    return head_dim & -head_dim


def hadamard_rotate(x: np.ndarray) -> np.ndarray:
    """x (any shape, last axis D) times the orthonormal block Hadamard matrix along D, in
    float32 (a new array). The matrix is symmetric and its own inverse. Applied block by
    block: x seen as (rows, b) times the b x b block (one float32 matrix product; a BLAS
    product beats NumPy's seven butterfly passes at every size a cache call sees, a query
    row: ~5x). Never through the D x D matrix with its off-block zeros: an inf would meet
    them (inf * 0 = NaN, "invalid value" from NumPy) and spoil the finite blocks of its row.

    Non-finite input is expected here and gives non-finite output without a warning (NaN
    in, NaN out): within a block, a NaN or an inf reaches every entry of the block (two
    infs of opposite sign give NaN), and finite entries past float32's range give +-inf."""
    x = np.asarray(x, dtype=np.float32)
    D = x.shape[-1]
    b = hadamard_block(D) if D else 1
    if b == 1:
        return x.copy()
    rows = np.ascontiguousarray(x).reshape(-1, b)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.matmul(rows, _block(b)).reshape(x.shape)


@functools.lru_cache(maxsize=16)
def _block(b: int) -> np.ndarray:
    """The b x b orthonormal Sylvester Hadamard block (read-only), from the transform."""
    m = _walsh_hadamard(np.eye(b, dtype=np.float32))
    m.flags.writeable = False
    return m


def _walsh_hadamard(x: np.ndarray) -> np.ndarray:
    """The fast Walsh-Hadamard transform of x's last axis in blocks (see the module)."""
    D = x.shape[-1]
    b = hadamard_block(D) if D else 1
    y = x.reshape(-1, D // b if D else 0, b).copy()
    n, groups = y.shape[0], y.shape[1]
    h = 1
    while h < b:  # one butterfly stage: pairs (i, i + h) within each run of 2h
        y = y.reshape(n, groups, b // (2 * h), 2, h)
        lo, hi = y[:, :, :, 0, :], y[:, :, :, 1, :]
        y = np.stack((lo + hi, lo - hi), axis=3).reshape(n, groups, b)
        h *= 2
    if b > 1:
        y *= np.float32(1.0 / np.sqrt(b))
    return y.reshape(x.shape)


def rotate_queries(q: np.ndarray) -> np.ndarray:
    """q rotated as the cached keys are, in float32 whatever q's dtype: a rotated entry can
    grow by up to sqrt(b) (all of a block's weight on one entry), so a 16-bit q rounded back
    to its dtype could overflow (float16: 65504) where the keys' own dot product does not.
    The kernels take a float32 q over every cache q may read with rotated keys (int8,
    float8, int4); the caller rounds the result to q's dtype once."""
    return hadamard_rotate(q)
