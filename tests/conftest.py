import os
import sys

import numpy as np
import pytest

from attnfast import _ext

sys.path.insert(0, os.path.dirname(__file__))  # tests/reference.py


@pytest.fixture(params=_ext.runtime_info()["isa_available"])
def tier(request):
    """Runs the test on one kernel tier this CPU can run (each in turn), then goes back to the
    automatic choice. (ATTNFAST_ISA=... pins the automatic choice; the tiers are still forced
    one by one here.)"""
    _ext.force_isa(request.param)
    assert _ext.runtime_info()["isa"] == request.param
    yield request.param
    _ext.force_isa("")


@pytest.fixture
def int8_widen():
    """int8 caches' Q.K through the exact widening (ATTNFAST_INT8_DOT=widen, which is read
    once) for this test, then back to the mode before."""
    before = _ext.runtime_info()["int8_dot"]
    _ext.force_int8_dot("widen")
    yield
    _ext.force_int8_dot(before)


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture(params=["default", "ignored"], ids=["parent-default-sigint", "parent-ignores-sigint"])
def parent_sigint(request):
    """This process's SIGINT disposition as a parent may leave it: Python's default handler,
    or ignored (pytest started from a background job of a non-interactive shell; children
    inherit an ignored SIGINT). Tests of Ctrl-C set the disposition they mean to test
    themselves, and must pass under both."""
    import signal
    handler = signal.default_int_handler if request.param == "default" else signal.SIG_IGN
    previous = signal.signal(signal.SIGINT, handler)
    yield request.param
    signal.signal(signal.SIGINT, previous)


def simd_decode_lanes(tier):
    """Lanes W of the tier's hand-written decode (simd_decode, gemm_decode: D and Dv whole
    vectors of W), or None where decode runs the template policy only (the aarch64 build's
    generic tier). x86-64's generic tier runs them on SSE2 (W = 4)."""
    import platform
    if tier == "generic":
        return 4 if platform.machine().lower() in ("x86_64", "amd64") else None
    return {"avx2": 8, "avx512": 16, "avx512bf16": 16, "neon": 4}.get(tier)
