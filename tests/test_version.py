"""`attnfast --version` and `python -m attnfast --version` print the installed version."""
import os
import subprocess
import sys
import sysconfig

import pytest

import attnfast as af


def test_module_version():
    for flag in ("--version", "-V"):
        proc = subprocess.run([sys.executable, "-m", "attnfast", flag], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == f"attnfast {af.__version__}"


def test_version_matches_metadata():
    from importlib.metadata import version
    assert af.__version__ == version("attnfast")


def test_console_script_version():
    script = os.path.join(sysconfig.get_path("scripts"), "attnfast")
    if sys.platform == "win32":
        script += ".exe"
    if not os.path.exists(script):
        pytest.skip(f"no installed `attnfast` script at {script}")
    proc = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"attnfast {af.__version__}"
