"""The two hand-computed examples of ../shared/worked-examples.md, to the digits given."""
import numpy as np
import pytest

import attnfast as af
from attnfast._demo import cat_sat_it, the_cat_sat


def assert_digits(actual, expected, digits):
    """Equal to `expected` when rounded to the `digits` decimals it was written with."""
    np.testing.assert_allclose(actual, expected, rtol=0, atol=0.5 * 10.0 ** -digits + 1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cat_sat_it(dtype):
    Q, K, V = (a.astype(dtype) for a in cat_sat_it())
    assert_digits(Q[3] @ K.T, [0.30, 2.40, 0.40, 0.78], 2)
    assert_digits((Q[3] @ K.T) / np.sqrt(2), [0.21, 1.70, 0.28, 0.55], 2)
    weights = af.attention_weights(Q, K, causal=True)
    assert_digits(weights[:, :1], [[1.0], [0.007], [0.1636], [0.1267]], 3)
    assert_digits(weights, [[1.0, 0.0, 0.0, 0.0],
                            [0.007, 0.993, 0.0, 0.0],
                            [0.1636, 0.1636, 0.6728, 0.0],
                            [0.1267, 0.5594, 0.136, 0.1779]], 3)
    assert_digits(weights[2:], [[0.1636, 0.1636, 0.6728, 0.0],
                                [0.1267, 0.5594, 0.1360, 0.1779]], 4)
    out = af.attention(Q, K, V, causal=True)
    assert out.dtype == dtype
    assert_digits(out, [[1.0, 0.0], [0.007, 0.993], [0.5, 0.5], [0.2303, 0.6808]], 3)
    assert_digits(out[3], [0.2303, 0.6808], 4)


def test_cat_sat_it_variations():
    Q, K, V = cat_sat_it()
    # With x_it = [0, 0, 1] the "it" row attends like "sat".
    X = np.array([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [0, 0, 1.0]])
    W_Q = np.array([[0, 1], [2, 0], [0, 1]], dtype=float)
    W_K = np.array([[0.5, 0], [4, 0], [0, 2]], dtype=float)
    w = af.attention_weights(X @ W_Q, X @ W_K, causal=True)
    # "it" (row 3) sees one more key equal to "sat"'s; over the first three keys its weights
    # are proportional to "sat"'s row.
    np.testing.assert_allclose(w[3, :3] / w[3, :3].sum(), w[2, :3], rtol=1e-12)
    # Without the scale and with X * 4 the weights become nearly one-hot.
    X4 = np.array([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [0.2, 0.3, 0]]) * 4
    w4 = af.attention_weights(X4 @ W_Q, X4 @ W_K, causal=True, scale=1.0)
    assert (w4.max(axis=1) > 0.99).all()


def test_the_cat_sat():
    Q, K = the_cat_sat()
    np.testing.assert_array_equal(Q, [[2, 0], [0, 2], [1, 1]])
    np.testing.assert_array_equal(K, [[1, -1], [1, 1], [0, 1]])
    np.testing.assert_array_equal(Q @ K.T, [[2, 2, 0], [-2, 2, 2], [0, 2, 1]])
    assert_digits(af.attention_weights(Q, K, scale=1.0),
                  [[0.4683, 0.4683, 0.0634], [0.0091, 0.4955, 0.4955], [0.0900, 0.6652, 0.2447]], 4)
    assert_digits(af.attention_weights(Q, K, scale=1.0, causal=True),
                  [[1.0, 0.0, 0.0], [0.018, 0.982, 0.0], [0.0900, 0.6652, 0.2447]], 3)
    assert_digits(af.attention_weights(Q, K)[2], [0.1400, 0.5760, 0.2840], 4)
    # attention() blends values with the same weights: one-hot values read the weights back.
    V = np.eye(3)
    assert_digits(af.attention(Q, K, V, scale=1.0), af.attention_weights(Q, K, scale=1.0), 12)
