"""The command line: `python -m attnfast info | bench`, and the bench cost model."""
import json
import subprocess
import sys

import numpy as np
import pytest

import attnfast as af
from attnfast.bench import costs, options, timing
from reference import visible_mask


def run_cli(*args, cwd=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "attnfast", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout)


def test_info():
    proc = run_cli("info")
    assert proc.returncode == 0, proc.stderr
    assert f"attnfast {af.__version__}" in proc.stdout
    assert af._runtime.config()["isa"] in proc.stdout


def test_usage_and_unknown_command():
    assert run_cli().returncode == 0
    proc = run_cli("nonsense")
    assert proc.returncode == 2 and "usage: attnfast" in proc.stdout


def test_bench_rejects_bad_options():
    proc = run_cli("bench", "--heads", "32/5")
    assert proc.returncode == 2 and "H % Hkv" in proc.stderr
    proc = run_cli("bench", "--decode-L", "1k,x")
    assert proc.returncode == 2 and "--decode-L" in proc.stderr


def test_bench_quick_tiny_shapes(tmp_path):
    """The whole pipeline on tiny shapes: tables printed, JSON consistent with the cost model,
    cached generation equal to recomputing full causal attention."""
    json_path = tmp_path / "out.json"
    proc = run_cli("bench", "--quick", "--threads", "1", "--prefill-T", "64,128",
                   "--decode-L", "128,256,512", "--heads", "4/2", "--head-dim", "32",
                   "--tokens", "3", "--prompt", "16", "--recompute-max-L", "256",
                   "--bandwidth-mib", "16", "--budget", "0.01", "--png", "none",
                   "--json", str(json_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for heading in ("Machine limits", "(a) Prefill", "(b) Decode step", "Linear fit",
                    "(c) Per-token cost", "Generating N tokens"):
        assert heading in text
    assert "done" in proc.stderr  # the progress bar finished

    res = json.loads(json_path.read_text())
    assert [r["T"] for r in res["prefill"]] == [64, 128]
    for r in res["prefill"]:
        flops = 2 * 1 * 8 * r["T"] * (r["T"] + 1) // 2 * (32 + 32)  # prefill heads default 8/8
        assert r["flops"] == flops
        assert r["gflops"] == pytest.approx(flops / r["median_s"] / 1e9)
    assert [r["L"] for r in res["decode"]] == [128, 256, 512]
    for r in res["decode"]:
        assert r["bytes"] == 2 * r["L"] * (32 + 32) * 4
        assert r["gbps"] == pytest.approx(r["bytes"] / r["median_s"] / 1e9)
        assert min(r["times_s"]) > 0
    assert [r["L"] for r in res["recompute"]] == [128, 256]
    gen = res["generation"]["1"]
    assert gen["tokens"] == 3 and len(gen["cached_step_s"]) == 3
    assert gen["max_abs_diff"] < 1e-5
    assert res["limits"]["1"]["read_bandwidth"]["gbps"] > 0


def test_bench_several_dtypes(tmp_path):
    """--dtype as a comma list: one decode row per dtype and L, bytes counted as stored (int8
    with its float32 scales, int4 as packed blocks), one linear fit per dtype; prefill in the
    first dtype that is not a cache-only one."""
    json_path = tmp_path / "out.json"
    proc = run_cli("bench", "--quick", "--threads", "1", "--prefill-T", "64",
                   "--decode-L", "128,256", "--heads", "4/2", "--head-dim", "32",
                   "--tokens", "2", "--prompt", "8", "--recompute-max-L", "128",
                   "--bandwidth-mib", "16", "--budget", "0.01", "--png", "none",
                   "--dtype", "int8,int4,bfloat16,float32", "--json", str(json_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(json_path.read_text())
    assert res["dtype"] == "bfloat16" and res["dtypes"] == ["int8", "int4", "bfloat16", "float32"]
    per_token = {"int8": 2 * ((32 + 32) * 1 + 8), "int4": 2 * (20 + 20),
                 "bfloat16": 2 * (32 + 32) * 2, "float32": 2 * (32 + 32) * 4}
    assert sorted((r["dtype"], r["L"]) for r in res["decode"]) == sorted(
        (d, L) for d in per_token for L in (128, 256))
    for r in res["decode"]:
        assert r["bytes"] == r["L"] * per_token[r["dtype"]]
    assert sorted(f["dtype"] for f in res["decode_fit"].values()) == sorted(per_token)
    assert "vs int8" in proc.stdout
    proc = run_cli("bench", "--dtype", "float32,int3")
    assert proc.returncode == 2 and "int3" in proc.stderr


def test_bench_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    proc = run_cli("bench", "--quick", "--threads", "1", "--prefill-T", "32",
                   "--decode-L", "64,128", "--heads", "2/1", "--head-dim", "16", "--tokens", "2",
                   "--prompt", "8", "--bandwidth-mib", "8", "--budget", "0.01", "--png", str(png),
                   "--json", "none", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("tq,tk", [(1, 1), (5, 5), (3, 7), (7, 3), (1, 9), (64, 64)])
def test_visible_pairs_matches_reference_mask(tq, tk):
    for causal in (False, True):
        assert costs.visible_pairs(tq, tk, causal) == visible_mask(tq, tk, causal).sum()
    assert costs.attention_flops(2, 3, tq, tk, 4, 5, True) == \
        2 * 2 * 3 * (4 + 5) * visible_mask(tq, tk, True).sum()


def test_linear_fit():
    xs = np.array([1024, 2048, 4096, 8192])
    fit = timing.linear_fit(xs, 3e-9 * xs + 2e-5)
    assert fit["slope"] == pytest.approx(3e-9) and fit["intercept"] == pytest.approx(2e-5)
    assert fit["r2"] == pytest.approx(1.0)
    noisy = timing.linear_fit(xs, [1.0, 3.0, 2.0, 2.5])
    assert 0 <= noisy["r2"] < 0.9


def test_parse_lists():
    assert options.parse_int_list("1k, 4k,100", "x") == [1024, 4096, 100]
    assert options.parse_heads("32/8") == (32, 8) and options.parse_heads("8") == (8, 8)


def test_progress_without_tqdm(monkeypatch, capsys):
    """Without tqdm (the bench extra installs it) progress is one line per step on stderr."""
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import fails
    progress = timing.Progress(2)
    progress.step("first step")
    progress.step("second step")
    progress.finish()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("s  ", 1)[1] for line in lines] == ["first step", "second step", "done"]
    quiet = timing.Progress(2, enabled=False)
    quiet.step("x")
    quiet.finish()
    assert capsys.readouterr().err == ""
