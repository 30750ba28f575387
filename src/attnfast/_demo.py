"""`python -m attnfast demo`: the two worked examples, then a timed 4k-token causal prefill."""
from __future__ import annotations

import argparse
import time

import numpy as np

from . import _api, _runtime


def cat_sat_it():
    """Worked example 1: "The cat sat ... it", one head, causal, scale 1/sqrt(2).

    Returns (Q, K, V) as float64 arrays of shape (4, 2).
    """
    X = np.array([[1.0, 0.0, 0.0],   # The
                  [0.0, 1.0, 0.0],   # cat
                  [0.0, 0.0, 1.0],   # sat
                  [0.2, 0.3, 0.0]])  # it
    W_Q = np.array([[0, 1], [2, 0], [0, 1]], dtype=float)
    W_K = np.array([[0.5, 0], [4, 0], [0, 2]], dtype=float)
    W_V = np.array([[1, 0], [0, 1], [0.5, 0.5]], dtype=float)
    return X @ W_Q, X @ W_K, X @ W_V


def the_cat_sat():
    """Worked example 2: "the cat sat", q = W_Q x and k = W_K x (d_k = 2). Returns (Q, K)."""
    x = np.array([[1, 0, 0], [0, 1, 0], [1, 1, 1]], dtype=float)  # the, cat, sat
    W_Q = np.array([[2, 0, -1], [0, 2, -1]], dtype=float)
    W_K = np.array([[1, 1, -2], [-1, 1, 1]], dtype=float)
    return x @ W_Q.T, x @ W_K.T


def _print_matrix(title, m, digits=4):
    print(title)
    with np.printoptions(precision=digits, suppress=True):
        print("  " + str(np.asarray(m)).replace("\n", "\n  "))


def run(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="attnfast demo", description=__doc__)
    parser.add_argument("--tokens", type=int, default=4096, help="prefill length T (default 4096)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)

    print("== Worked example 1: 'The cat sat ... it' (causal, scale 1/sqrt(2)) ==")
    Q, K, V = cat_sat_it()
    _print_matrix("scores of 'it' before scaling:", Q[3] @ K.T, 2)
    _print_matrix("weights:", _api.attention_weights(Q, K, causal=True))
    _print_matrix("output:", _api.attention(Q, K, V, causal=True))

    print("\n== Worked example 2: 'the cat sat' ==")
    Q2, K2 = the_cat_sat()
    _print_matrix("Q K^T:", Q2 @ K2.T, 0)
    _print_matrix("unscaled, no mask:", _api.attention_weights(Q2, K2, scale=1.0))
    _print_matrix("unscaled, causal:", _api.attention_weights(Q2, K2, scale=1.0, causal=True))
    _print_matrix("scaled by 1/sqrt(2), no mask:", _api.attention_weights(Q2, K2))

    T, H, D = args.tokens, args.heads, args.head_dim
    threads = _runtime.resolve_threads(args.threads)
    print(f"\n== Causal prefill: T={T}, H={H}, D={D}, float32, {threads} thread(s) ==")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((H, T, D), dtype=np.float32) for _ in range(3))
    _api.attention(q[:, :64], k[:, :64], v[:, :64], causal=True, num_threads=threads)  # warm up
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        _api.attention(q, k, v, causal=True, num_threads=threads)
        times.append(time.perf_counter() - t0)
    best = float(np.median(times))
    flops = 2.0 * H * T * T * (D + D) / 2  # causal: half the square is useful work
    naive_gb = H * T * T * 4 / 1e9
    print(f"attnfast: {best * 1e3:.1f} ms (median of 3), {flops / best / 1e9:.1f} GFLOP/s; "
          f"the {T}x{T} score matrices it never builds would take {naive_gb:.2f} GB in float32")
    return 0
