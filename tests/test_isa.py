"""Kernel correctness on every kernel tier (ISA) this machine runs, against tests/reference.py.

Each test runs once per tier in ``isa_available`` through attnfast._ext.force_isa; the tier
is restored to the automatic choice afterwards. Tiers may differ from each other in the last
bits; each must match the float64 reference within the float32 tolerance, and give the same
bits for any thread count.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import attnfast as af
from attnfast import _ext
from reference import TOLERANCE, reference_attention



def make_qkv(rng, b, h, hkv, tq, tk, d, dv, dtype=np.float32, scale=1.0):
    q = (rng.standard_normal((b, h, tq, d)) * scale).astype(dtype)
    k = (rng.standard_normal((b, hkv, tk, d)) * scale).astype(dtype)
    v = rng.standard_normal((b, hkv, tk, dv)).astype(dtype)
    return q, k, v


def check_against_reference(q, k, v, *, causal=False, window=None, scale=None, tol=None, num_threads=None):
    out, lse = af.attention(q, k, v, causal=causal, window=window, scale=scale,
                            return_lse=True, num_threads=num_threads)
    ref_out, ref_lse, _ = reference_attention(q, k, v, causal=causal, scale=scale, window=window)
    tol = tol or TOLERANCE[np.dtype(q.dtype)]
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref_out, **tol)
    seen = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), seen)  # -inf exactly where no key is seen
    np.testing.assert_allclose(lse[seen], ref_lse[seen], **tol)
    assert np.all(lse[~seen] == -np.inf)
    return out, lse


@pytest.mark.parametrize("d", [1, 3, 59, 111, 256])
@pytest.mark.parametrize("t", [1, 17, 97])
@pytest.mark.parametrize("causal", [False, True])
def test_odd_head_dims_and_lengths(tier, rng, d, t, causal):
    q, k, v = make_qkv(rng, 1, 2, 2, t, t, d, d)
    check_against_reference(q, k, v, causal=causal)


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (59, 111), (3, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence(tier, rng, d, dv, causal):
    # 1025 keys: several KV tiles and super-tiles, a partial last tile and last query block.
    q, k, v = make_qkv(rng, 1, 1, 1, 1025, 1025, d, dv)
    check_against_reference(q, k, v, causal=causal)


@pytest.mark.parametrize("tq,tk", [(17, 97), (97, 17), (1, 1025), (33, 32), (1025, 300)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_causal_unequal_lengths(tier, rng, tq, tk, dtype):
    # Bottom-right aligned; with tq > tk the first tq - tk rows see no key: zeros, lse -inf.
    q, k, v = make_qkv(rng, 1, 2, 2, tq, tk, 40, 24, dtype)
    out, lse = check_against_reference(q, k, v, causal=True)
    if tq > tk:
        blind = tq - tk
        assert np.all(out[:, :, :blind] == 0)
        assert np.all(lse[:, :, :blind] == -np.inf)
        assert np.all(np.isfinite(lse[:, :, blind:]))


@pytest.mark.parametrize("h,hkv", [(4, 2), (8, 1), (6, 3), (12, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa(tier, rng, h, hkv, causal):
    q, k, v = make_qkv(rng, 2, h, hkv, 70, 150, 32, 48)
    check_against_reference(q, k, v, causal=causal)


@pytest.mark.parametrize("window", [(0, 0), (5, 3), (40, -1), (-1, 2), (200, 0)])
def test_sliding_window(tier, rng, window):
    q, k, v = make_qkv(rng, 1, 2, 1, 130, 300, 24, 24)
    check_against_reference(q, k, v, window=window)
    check_against_reference(q, k, v, window=window, causal=True)


@pytest.mark.parametrize("window", [(100, 0), (300, 50), (-1, 700)])
def test_sliding_window_long(tier, rng, window):
    # Long enough that a task groups several row blocks over shared KV super-tiles, and
    # skips the tiles left of each block's window.
    q, k, v = make_qkv(rng, 1, 4, 2, 1100, 1100, 64, 64)
    check_against_reference(q, k, v, window=window, causal=window[1] == 0)


def test_window_row_that_sees_nothing(tier, rng):
    # With Tq > Tk and window=(0, 0), rows aligned before key 0 see nothing.
    q, k, v = make_qkv(rng, 1, 1, 1, 50, 20, 16, 16)
    out, lse = check_against_reference(q, k, v, window=(0, 0))
    assert np.all(out[0, 0, :30] == 0) and np.all(lse[0, 0, :30] == -np.inf)


@pytest.mark.parametrize("causal", [False, True])
def test_large_logits(tier, rng, causal):
    # Scores of magnitude ~1e4: exp must not overflow (the running max is subtracted) and
    # scores thousands below the max must flush to exactly 0, not NaN.
    d, t = 64, 257
    q, k, v = make_qkv(rng, 1, 2, 2, t, t, d, d, scale=(1e4 / np.sqrt(d)) ** 0.5)
    out, lse = af.attention(q, k, v, causal=causal, scale=1.0, return_lse=True)
    ref_out, ref_lse, _ = reference_attention(q, k, v, causal=causal, scale=1.0)
    q64, k64 = q.astype(np.float64), k.astype(np.float64)
    assert np.median(np.abs(np.einsum("bhid,bhjd->bhij", q64, k64))) > 3e3
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    # float32 logits carry an error up to ~eps * sum_d |q_d k_d| (a few units here); the
    # output moves by at most that much times max|v| (rows with a near tie), lse by that much.
    logit_err = 4 * np.finfo(np.float32).eps * np.einsum("bhid,bhjd->bhij", np.abs(q64), np.abs(k64)).max()
    assert logit_err < 0.1
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=2 * logit_err * np.abs(v).max() + 2e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=logit_err)


def test_strided_inputs(tier, rng):
    # (B, T, H, D) arrays passed as (B, H, T, D) views: K and V rows are strided.
    b, t, h, hkv, d = 2, 77, 4, 2, 40
    q = rng.standard_normal((b, t, h, d)).astype(np.float32).transpose(0, 2, 1, 3)
    k = rng.standard_normal((b, t, hkv, d)).astype(np.float32).transpose(0, 2, 1, 3)
    v = rng.standard_normal((b, t, hkv, d)).astype(np.float32).transpose(0, 2, 1, 3)
    check_against_reference(q, k, v, causal=True)


def test_negative_strides(tier, rng):
    # Reversed views: every row stride is negative.
    q, k, v = make_qkv(rng, 1, 2, 2, 70, 90, 33, 20)
    check_against_reference(q[:, :, ::-1], k[:, :, ::-1], v[:, :, ::-1], causal=True)


@pytest.mark.parametrize("d,dv", [(512, 512), (1000, 7), (7, 1000)])
def test_wide_heads(tier, rng, d, dv):
    q, k, v = make_qkv(rng, 1, 2, 1, 50, 300, d, dv)
    check_against_reference(q, k, v, causal=True)


def test_no_keys(tier, rng):
    q, k, v = make_qkv(rng, 1, 2, 2, 5, 0, 8, 3)
    out, lse = af.attention(q, k, v, return_lse=True)
    assert out.shape == (1, 2, 5, 3) and np.all(out == 0) and np.all(lse == -np.inf)


@pytest.mark.parametrize("shape", [
    # b, h, hkv, tq, tk, d, dv
    (2, 4, 2, 500, 500, 64, 64),     # pairs of GQA heads share one task
    (2, 8, 2, 520, 600, 40, 24),     # four GQA heads share one task
    (1, 4, 4, 1100, 1100, 64, 64),   # K and V over half of L2: several row blocks per task
    (3, 3, 1, 97, 1025, 59, 111),
])
@pytest.mark.parametrize("causal", [False, True])
def test_thread_count_bit_identity(tier, rng, shape, causal):
    b, h, hkv, tq, tk, d, dv = shape
    q, k, v = make_qkv(rng, b, h, hkv, tq, tk, d, dv)
    out1, lse1 = af.attention(q, k, v, causal=causal, return_lse=True, num_threads=1)
    ref_out, _, _ = reference_attention(q, k, v, causal=causal)
    np.testing.assert_allclose(out1, ref_out, **TOLERANCE[np.dtype(np.float32)])
    for threads in (2, 3):
        out, lse = af.attention(q, k, v, causal=causal, return_lse=True, num_threads=threads)
        np.testing.assert_array_equal(out, out1)
        np.testing.assert_array_equal(lse, lse1)


def test_float64(tier, rng):
    q, k, v = make_qkv(rng, 1, 4, 2, 65, 130, 33, 17, np.float64)
    check_against_reference(q, k, v, causal=True)


def _run_python(code, **env):
    full_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True,
                          text=True, timeout=120)


def test_env_forces_generic_tier():
    code = ("import attnfast, numpy as np; from attnfast import _ext; "
            "print(_ext.runtime_info()['isa']); "
            "q = np.ones((1, 3, 4), np.float32); print(attnfast.attention(q, q, q).shape)")
    res = _run_python(code, ATTNFAST_ISA="generic")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["generic", "(1,", "3,", "4)"]


def test_env_unknown_tier_is_an_error_at_import():
    res = _run_python("import attnfast", ATTNFAST_ISA="sse9")
    assert res.returncode != 0
    assert "RuntimeError" in res.stderr and "unknown kernel tier 'sse9'" in res.stderr


def test_env_unsupported_tier_is_an_error_at_import():
    info = _ext.runtime_info()
    missing = [t for t in info["isa_compiled"] if t not in info["isa_available"]]
    if not missing:
        pytest.skip("this CPU runs every tier built in")
    res = _run_python("import attnfast", ATTNFAST_ISA=missing[0])
    assert res.returncode != 0
    assert "cannot run on this CPU" in res.stderr


def test_force_isa_rejects_unknown_and_keeps_tier():
    before = _ext.runtime_info()["isa"]
    with pytest.raises(ValueError, match="unknown kernel tier"):
        _ext.force_isa("sse9")
    assert _ext.runtime_info()["isa"] == before


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_full_scale_head(tier, rng, causal):
    # One 4096 x 4096 head at D = 128: K and V exceed L2, so tasks group row blocks over
    # several KV super-tiles with the next tile prefetched.
    q, k, v = make_qkv(rng, 1, 1, 1, 4096, 4096, 128, 128)
    check_against_reference(q, k, v, causal=causal)


@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("nbytes", [0, 7, 8, 1001, (4 << 20) + 13, (9 << 20) + 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_read_kernel_folds_every_word(tier, rng, offset, nbytes, threads):
    # The benchmarks' read kernel (the best tier's loads, whichever tier is forced) must touch
    # every whole 8-byte word: its result is their XOR, computed here by NumPy.
    raw = rng.integers(0, 256, nbytes + offset, dtype=np.uint8)
    buf = raw[offset:]
    words = np.frombuffer(buf[: nbytes // 8 * 8].tobytes(), dtype=np.uint64)
    expected = int(np.bitwise_xor.reduce(words)) if words.size else 0
    assert _ext.read_bytes(buf, threads) == expected


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_peak_probe_counts_its_flops(tier, bf16, threads):
    # The benchmarks' compute limit runs the best tier's widest multiply-adds, whichever tier
    # is forced: each round is 12 chains of one vector (2 FLOPs a float32 lane; vdpbf16ps 4, two
    # products), on every thread.
    import platform

    best = _ext.runtime_info()["isa_available"][0]
    lanes = {"avx512bf16": 16, "avx512": 16, "avx2": 8, "neon": 4}.get(
        best, 4 if platform.machine() in ("x86_64", "AMD64") else 1)
    per_lane = 4 if bf16 and best == "avx512bf16" else 2
    assert _ext.peak_flops(1, bf16, 1) == 12 * lanes * per_lane
    assert _ext.peak_flops(1000, bf16, threads) == 1000 * threads * 12 * lanes * per_lane
    assert _ext.peak_flops(0, bf16, threads) == 0
