"""bench/lowbit_peers.py on a tiny cache: each engine's first step checked against the float64
reference (a compressed peer must show its format's error, not float32's), the summary's
ratio to the fastest peer low-bit cache, and the report."""
import importlib.util
import json
import os
import sys

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


@pytest.fixture(scope="module")
def lowbit_peers():
    path = os.path.join(BENCH, "lowbit_peers.py")
    if not os.path.exists(path):  # tests copied out of the source tree (tools/build_wheel.sh)
        pytest.skip("bench/lowbit_peers.py is not beside tests/: run from a source checkout")
    sys.path.insert(0, BENCH)
    spec = importlib.util.spec_from_file_location("lowbit_peers", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["lowbit_peers"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("lowbit_peers", None)


def _run(module, tmp_path, engines, *extra):
    out = tmp_path / "peers.json"
    assert module.main([*extra, "--L", "200", "--heads", "4/2", "--D", "64", "--threads", "1",
                        "--rounds", "1", "--settle", "0", "--engines", ",".join(engines),
                        "--json", str(out), "--markdown", str(tmp_path / "peers.md")]) == 0
    return json.loads(out.read_text())


def test_attnfast_rows_and_errors(lowbit_peers, tmp_path):
    report = _run(lowbit_peers, tmp_path, ["attnfast float32", "attnfast int8"])
    rows = {r["engine"]: r for r in report["results"]}
    assert rows["attnfast float32"]["err"] < 1e-6
    assert 1e-4 < rows["attnfast int8"]["err"] < 0.05  # int8's storage error, not float32's
    for r in rows.values():
        assert r["median_s"] > 0 and r["bytes"] > 0 and len(r["times_s"]) == 1
    assert rows["attnfast float32"]["speedup_vs_attnfast_f32"] == 1.0
    assert "| attnfast int8 | int8 |" in (tmp_path / "peers.md").read_text()


def test_openvino_compressed_cache_is_really_compressed(lowbit_peers, tmp_path):
    pytest.importorskip("openvino")
    engines = ["attnfast float32", "attnfast int8", "openvino f32", "openvino u8",
               "openvino u4 g32"]
    report = _run(lowbit_peers, tmp_path, engines, "--slow-fill-heads", "all")
    rows = {r["engine"]: r for r in report["results"]}
    assert rows["openvino f32"]["err"] < 1e-5
    assert 1e-4 < rows["openvino u8"]["err"] < 0.05
    assert 0.02 < rows["openvino u4 g32"]["err"] < 0.3  # 4-bit: far coarser than u8
    # without --slow-fill-heads covering 4/2, the u4 row is recorded as not run, with why
    report = _run(lowbit_peers, tmp_path, engines)
    u4 = [r for r in report["results"] if r["engine"] == "openvino u4 g32"][0]
    assert "O(L^2)" in u4["error"] and "median_s" not in u4
    assert report["summary"] and report["summary"][0]["fastest_peer"].startswith("openvino u")


def test_summary_ratio_to_the_fastest_peer(lowbit_peers):
    base = {"case": "c", "threads": 1}
    results = [dict(base, engine="attnfast float32", storage="float32", median_s=4.0),
               dict(base, engine="attnfast int8", storage="int8", median_s=1.0),
               dict(base, engine="vllm float32", storage="float32", median_s=0.5),
               dict(base, engine="vllm fp8", storage="fp8 e4m3, one scale per tensor",
                    median_s=3.0),
               dict(base, engine="openvino u8", storage="u8 per token", median_s=2.5),
               dict(base, engine="openvino u4 g32", storage="u4", error="not run")]
    (s,) = lowbit_peers.summary(results)
    assert s["fastest_peer"] == "openvino u8" and s["ratio"] == pytest.approx(2.5)
    assert s["met"] and s["attnfast"] == "attnfast int8"
    results[4]["median_s"] = 1.5
    assert not lowbit_peers.summary(results)[0]["met"]
    assert np.isfinite(lowbit_peers.summary(results)[0]["ratio"])
