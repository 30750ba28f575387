"""attention_varlen: packed sequences against the reference, one sequence at a time."""
import numpy as np
import pytest

import attnfast as af
from reference import TOLERANCE, reference_attention


def packed(rng, lens_q, lens_k, h=4, hkv=2, d=16, dv=12, dtype=np.float32):
    q = rng.standard_normal((sum(lens_q), h, d)).astype(dtype)
    k = rng.standard_normal((sum(lens_k), hkv, d)).astype(dtype)
    v = rng.standard_normal((sum(lens_k), hkv, dv)).astype(dtype)
    return q, k, v, np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matches_reference_per_sequence(rng, causal, dtype):
    lens_q, lens_k = [5, 0, 70, 1, 33], [9, 4, 70, 100, 20]
    q, k, v, cu_q, cu_k = packed(rng, lens_q, lens_k, dtype=dtype)
    out, lse = af.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True,
                                   max_seqlen_q=70, max_seqlen_k=100)
    assert out.shape == (q.shape[0], 4, 12) and lse.shape == (4, q.shape[0])
    tol = TOLERANCE[np.dtype(dtype)]
    for b in range(len(lens_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ref_out, ref_lse, _ = reference_attention(q[qs].transpose(1, 0, 2), k[ks].transpose(1, 0, 2),
                                                  v[ks].transpose(1, 0, 2), causal=causal)
        np.testing.assert_allclose(out[qs].transpose(1, 0, 2), ref_out, **tol)
        np.testing.assert_allclose(lse[:, qs], ref_lse, **tol)


def test_out_parameter(rng):
    q, k, v, cu_q, cu_k = packed(rng, [3, 4], [3, 4])
    out = np.empty((7, 4, 12), np.float32)
    assert af.attention_varlen(q, k, v, cu_q, cu_k, out=out) is out
    np.testing.assert_array_equal(out, af.attention_varlen(q, k, v, cu_q, cu_k))


def test_errors_write_nothing(rng):
    q, k, v, cu_q, cu_k = packed(rng, [3, 4], [3, 4])
    out = np.full((7, 4, 12), 5.0, np.float32)
    bad = [
        (dict(cu_seqlens_q=[0, 3, 6]), ValueError, r"cu_seqlens_q must start at 0 and end at 7"),
        (dict(cu_seqlens_q=[0, 5, 3, 7]), ValueError, r"cu_seqlens_q must be non-decreasing"),
        (dict(cu_seqlens_k=[0.0, 3.0, 7.0]), TypeError, r"cu_seqlens_k must be an integer array"),
        (dict(cu_seqlens_k=[0, 2, 5, 7]), ValueError, r"same number of sequences; got 2 and 3"),
        (dict(max_seqlen_q=3), ValueError, r"max_seqlen_q is 3 but a sequence in cu_seqlens_q has 4"),
        (dict(q=q[:, :3]), ValueError, r"multiple of kv heads"),
        (dict(q=q[None]), ValueError, r"q must be 3-D"),
        (dict(v=v[:6]), ValueError, r"same tokens and kv heads"),
        (dict(out=out[:6]), ValueError, r"out must have shape \(7, 4, 12\)"),
        (dict(softcap=30.0), NotImplementedError, r"softcap"),
    ]
    for change, exc, match in bad:
        args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=out)
        args.update(change)
        target = args["out"]
        before = target.copy()
        with pytest.raises(exc, match=match):
            af.attention_varlen(**args)
        np.testing.assert_array_equal(target, before)
