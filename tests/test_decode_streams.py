"""The two ways the float32 decode streams its K and V, chosen by the per-core L2 size
(csrc/kernels/simd_decode.inl: below 1 MiB, one row reads K then V as two plain streams and
several rows pipeline blocks of 32 keys). ATTNFAST_L2_BYTES forces the size, so each choice
runs here, whatever this machine's L2, in a fresh process (the size is read once).
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from reference import TOLERANCE, reference_attention

# (name, heads, kv_heads, query rows, keys, window)
CASES = [("one_row", 3, 3, 1, 1500, None),        # one row per KV head
         ("gqa", 8, 2, 1, 1337, None),            # four rows: pipelined
         ("gqa_window", 6, 2, 2, 901, (300, 0))]  # six rows, a sliding window

# Runs in the child (after CASES): decode steps over a float32 cache, one and two threads, every output
# and the planner's chunk length saved for the parent to check.
CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import attnfast as af
    rng = np.random.default_rng(7)
    out = {}
    for name, heads, kv_heads, tq, length, window in CASES:
        q = rng.standard_normal((1, heads, tq, 128)).astype(np.float32)
        k = rng.standard_normal((1, kv_heads, length, 128)).astype(np.float32)
        v = rng.standard_normal((1, kv_heads, length, 128)).astype(np.float32)
        kw = dict(causal=True, window=window, return_lse=True)
        o1, l1 = af.attention(q, k, v, num_threads=1, **kw)
        o2, l2 = af.attention(q, k, v, num_threads=2, **kw)
        plan = af.explain(q, k, v, causal=True, window=window, num_threads=1)
        out.update({name + "_q": q, name + "_k": k, name + "_v": v, name + "_out1": o1,
                    name + "_lse1": l1, name + "_out2": o2, name + "_lse2": l2,
                    name + "_chunk": plan["split"]["chunk_keys"],
                    name + "_path": plan["path"] + "/" + plan["kernel"], "tier": plan["tier"]})
    np.savez(sys.argv[1], **out)
""")



@pytest.mark.parametrize("l2_bytes, chunk_keys", [(256 << 10, 256), (4 << 20, 1024)],
                         ids=["small_l2", "large_l2"])
def test_float32_decode_streams_match_reference(tmp_path, l2_bytes, chunk_keys):
    path = tmp_path / "out.npz"
    env = dict(os.environ, ATTNFAST_L2_BYTES=str(l2_bytes))
    code = f"CASES = {CASES!r}\n" + CHILD
    res = subprocess.run([sys.executable, "-c", code, str(path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    got = np.load(path)
    tol = TOLERANCE[np.dtype(np.float32)]
    for name, _, _, _, _, window in CASES:
        # the forced size reached the planner: float32 K + V at D = 128 is 1 KiB per key,
        # and a chunk spans the L2 size clamped to [256 KiB, 1 MiB]
        assert int(got[name + "_chunk"]) == chunk_keys, name
        # the hand-written x86 decode, where the stream choice lives, ran
        if str(got["tier"]) in ("avx2", "avx512", "avx512bf16"):
            assert str(got[name + "_path"]) == "decode/simd_decode", got[name + "_path"]
        q, k, v = got[name + "_q"], got[name + "_k"], got[name + "_v"]
        ref_out, ref_lse, _ = reference_attention(q, k, v, causal=True, window=window)
        np.testing.assert_allclose(got[name + "_out1"], ref_out, **tol, err_msg=name)
        np.testing.assert_allclose(got[name + "_lse1"], ref_lse, **tol, err_msg=name)
        # the same bits on one thread and two
        assert np.array_equal(got[name + "_out1"], got[name + "_out2"]), name
        assert np.array_equal(got[name + "_lse1"], got[name + "_lse2"]), name
