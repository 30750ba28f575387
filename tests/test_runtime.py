"""Thread settings, show_config, and the environment variables."""
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

import attnfast as af


def run_python(code, **env):
    full_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full_env, timeout=120)


PROCESSORS = af.show_config.__globals__["_PROCESSORS"]


def test_set_and_get_num_threads():
    try:
        af.set_num_threads(1)
        assert af.get_num_threads() == 1
        with pytest.raises(ValueError, match="n must be >= 1"):
            af.set_num_threads(0)
        with pytest.raises(TypeError, match="n must be an int"):
            af.set_num_threads(2.0)
        assert af.get_num_threads() == 1  # a rejected call changes nothing
        af.set_num_threads(2**40)  # more than the machine: clamped to its processors
        assert af.get_num_threads() == PROCESSORS
    finally:
        af.set_num_threads(None)


def test_environment_thread_variables():
    code = "import attnfast; print(attnfast.get_num_threads())"
    assert run_python(code, ATTNFAST_NUM_THREADS="1").stdout.strip() == "1"
    assert run_python(code, ATTNFAST_NUM_THREADS="100000").stdout.strip() == str(PROCESSORS)
    assert run_python(code, OMP_NUM_THREADS="100000",
                      ATTNFAST_NUM_THREADS="").stdout.strip() == str(PROCESSORS)
    assert run_python(code, OMP_NUM_THREADS="1", ATTNFAST_NUM_THREADS="").stdout.strip() == "1"


def test_invalid_thread_variable_is_ignored_with_a_reason():
    """An invalid ATTNFAST_NUM_THREADS does not break import: a warning, the OpenMP default,
    and show_config() says why."""
    code = "import attnfast; attnfast.show_config()"
    bad = run_python(code, ATTNFAST_NUM_THREADS="zero", OMP_NUM_THREADS="1")
    assert bad.returncode == 0, bad.stderr
    assert "RuntimeWarning" in bad.stderr and "ATTNFAST_NUM_THREADS='zero' ignored" in bad.stderr
    assert "note: ATTNFAST_NUM_THREADS='zero' ignored" in bad.stdout
    assert "threads: 1 " in bad.stdout


def test_threadpoolctl_limits_are_respected():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if os.environ.get("ATTNFAST_NUM_THREADS"):
        pytest.skip("ATTNFAST_NUM_THREADS overrides the OpenMP limit")
    with threadpoolctl.threadpool_limits(limits=1, user_api="openmp"):
        assert af.get_num_threads() == 1


def test_show_config(capsys):
    info = af.show_config()
    text = capsys.readouterr().out
    assert f"attnfast {af.__version__}" in text
    assert info["isa"] in info["isa_available"] and info["isa"] in text
    assert "OpenMP" in text
    assert info["num_threads"] == af.get_num_threads()
    assert f"16-bit / int8: {info['lowp_instructions']}" in text


@pytest.mark.parametrize("tier", af.show_config.__globals__["_ext"].runtime_info()["isa_available"])
def test_show_config_names_the_16bit_instructions_of_each_tier(tier):
    """show_config says what the 16-bit paths of the forced tier run on: vdpbf16ps only on the
    tier that uses it, F16C's conversion on the other x86 SIMD tiers, SSE2's and NEON's
    widening where the hand-written prefill runs on them."""
    code = "import attnfast; print(attnfast.show_config()['lowp_instructions'])"
    res = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ATTNFAST_ISA": tier},
                         capture_output=True, text=True, check=True)
    words = res.stdout.strip().splitlines()[-1]
    assert ("vdpbf16ps" in words) == (tier == "avx512bf16")
    assert ("vcvtph2ps" in words) == (tier in ("avx2", "avx512", "avx512bf16"))
    x86_64 = platform.machine().lower() in ("x86_64", "amd64")
    assert ("SSE2" in words) == (tier == "generic" and x86_64)  # its hand-written prefill
    assert ("fcvtl" in words) == (tier == "neon")  # the NEON branch of the same prefill


@pytest.mark.parametrize("threads", [1, 2])
def test_concurrent_python_threads(rng, threads):
    """Python threads calling at once (GIL released; each call's OpenMP team shrunk to what
    the cores leave free) each get the bits of a lone call."""
    from concurrent.futures import ThreadPoolExecutor

    q = rng.standard_normal((4, 256, 64)).astype(np.float32)
    expected = af.attention(q, q, q, causal=True, num_threads=threads)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: af.attention(q, q, q, causal=True, num_threads=threads),
                                range(8)))
    for r in results:
        np.testing.assert_array_equal(r, expected)
