#!/usr/bin/env python3
"""Fail if the built extension uses instructions a baseline x86-64 CPU lacks outside the
AVX2/AVX-512 kernels. The logic lives in tests/isa_scan.py (so the test suite, wherever it is
copied, carries it; tests/test_wheel_isa.py runs it in CI).

    python tools/check_isa_scan.py [path/to/_ext*.so]    # default: the installed attnfast._ext
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import isa_scan  # noqa: E402

if __name__ == "__main__":
    sys.exit(isa_scan.main())
