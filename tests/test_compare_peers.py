"""bench/compare_peers.py on tiny shapes: float32 and 16-bit rows in one run, the per-dtype
accuracy check (against bench_common's float64 reference) and the report."""
import importlib.util
import json
import math
import os
import sys

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
pytest.importorskip("ml_dtypes")


@pytest.fixture(scope="module")
def compare_peers():
    path = os.path.join(BENCH, "compare_peers.py")
    if not os.path.exists(path):  # tests copied out of the source tree (tools/build_wheel.sh)
        pytest.skip("bench/compare_peers.py is not beside tests/: run from a source checkout")
    spec = importlib.util.spec_from_file_location("compare_peers", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["compare_peers"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("compare_peers", None)


TINY = ["--quick", "--threads", "1", "--prefill-T", "64", "--prefill-D", "32", "--prefill-heads",
        "2", "--decode-L", "96", "--decode-heads", "4/2", "--decode-D", "32", "--budget", "0",
        "--min-repeats", "1", "--settle", "0", "--bandwidth-mib", "8", "--gemm-n", "64",
        "--no-progress"]


class OffByEngine:
    """A peer whose output is attnfast's plus a constant: the accuracy check must flag it."""
    name = "offby"

    def __init__(self, offset):
        self.offset = offset

    def available(self):
        return None

    def version(self):
        return "test"

    def dtype_skip(self, dtype):
        return None

    def prepare(self, case, arrays, threads):
        import attnfast as af
        q, k, v = arrays
        box = [None]

        def run():
            if case.kind == "decode":
                box[0] = af.attention_with_kvcache(q, k, v, np.full(case.b, case.tk, np.int64))
            else:
                box[0] = af.attention(q, k, v, causal=case.causal)

        return run, lambda: np.asarray(box[0], dtype=np.float64) + self.offset


def run_json(compare_peers, tmp_path, monkeypatch, extra, engines=None):
    if engines is not None:
        monkeypatch.setattr(compare_peers, "ENGINES", engines)
    path = tmp_path / "peers.json"
    rc = compare_peers.main(TINY + ["--json", str(path), "--markdown", str(tmp_path / "p.md")]
                            + extra)
    return rc, json.loads(path.read_text()), (tmp_path / "p.md").read_text()


def test_bfloat16_and_float16_rows(compare_peers, tmp_path, monkeypatch):
    peers = "torch" if importlib.util.find_spec("torch") else ""
    rc, data, md = run_json(compare_peers, tmp_path, monkeypatch,
                            ["--dtype", "float32,bfloat16,float16", "--peers", peers])
    assert rc == 0
    assert data["meta"]["dtypes"] == ["float32", "bfloat16", "float16"]
    mine = [r for r in data["results"] if r["engine"] == "attnfast"]
    assert sorted({r["dtype"] for r in mine}) == ["bfloat16", "float16", "float32"]
    for r in mine:
        assert math.isfinite(r["rate"]) and r["rate"] > 0 and r["ok"], r
        assert r["max_abs_error"] <= compare_peers.TOLERANCES[r["dtype"]]
        if r["kind"] == "decode":  # bytes of the stored dtype
            s = r["shape"]
            itemsize = 4 if r["dtype"] == "float32" else 2
            assert r["work"] == s["b"] * s["hkv"] * s["tk"] * (s["d"] + s["dv"]) * itemsize
    # 16-bit rounding is visible: the check is not vacuous (bf16 error >> float32 error)
    err = {r["dtype"]: r["max_abs_error"] for r in mine if r["kind"] == "decode"}
    assert err["bfloat16"] > 10 * err["float32"] and err["bfloat16"] > err["float16"]
    if peers:
        torch_rows = [r for r in data["results"] if r["engine"] == "torch"]
        assert {r["dtype"] for r in torch_rows} == {"float32", "bfloat16", "float16"}
        assert all(r.get("ok") for r in torch_rows), torch_rows
        lim = data["limits"]["1"]["dtype_gemm"]
        assert lim["bfloat16"]["gemm_gflops"] > 0 and "torch bfloat16" in str(lim["bfloat16"])
    for title in ("Prefill, bfloat16", "Decode, float16", "Prefill, float32",
                  "bfloat16 GEMM GFLOP/s"):
        assert title in md


def test_wrong_peer_is_reported_failing(compare_peers, tmp_path, monkeypatch):
    engines = [compare_peers.AttnfastEngine(), OffByEngine(0.01)]
    rc, data, md = run_json(compare_peers, tmp_path, monkeypatch,
                            ["--dtype", "float32,bfloat16,float16", "--peers", "offby",
                             "--skip", "prefill"], engines)
    assert rc == 0  # attnfast itself passed
    ok = {r["dtype"]: r["ok"] for r in data["results"] if r["engine"] == "offby"}
    # 0.01 is within bfloat16's tolerance only
    assert ok == {"float32": False, "bfloat16": True, "float16": False}
    assert "wrong" in md


def test_float32_only_report_has_no_dtype_columns(compare_peers, tmp_path, monkeypatch):
    rc, data, md = run_json(compare_peers, tmp_path, monkeypatch, ["--peers", "", "--skip",
                                                                   "prefill"])
    assert rc == 0 and data["meta"]["dtypes"] == ["float32"]
    assert "dtype_gemm" not in data["limits"]["1"]
    assert "Decode: attnfast GB/s" in md and "bfloat16" not in md


def test_dtype_option_rejects_unknown(compare_peers):
    with pytest.raises(SystemExit):
        compare_peers.build_parser().parse_args(["--dtype", "float32,int4"])
    assert compare_peers.parse_dtype_list("bfloat16, float32,bfloat16") == ["bfloat16", "float32"]


def test_limits_keep_each_sources_better_reading(compare_peers):
    # Two measurements of one thread count: every source keeps its better reading, and the
    # limit is the best source of the merged readings (not of either measurement alone).
    first = {"read_kernels": {"numpy-sum": 20.0, "native-read": 30.0}, "gemm": {"numpy": 80.0},
             "dtype_gemm": {"bfloat16": {"gemm": {"torch bfloat16": 50.0, "float32 numpy": 80.0}}}}
    second = {"read_kernels": {"numpy-sum": 33.0, "native-read": 29.0}, "gemm": {"numpy": 100.0,
                                                                                   "torch": 90.0},
              "dtype_gemm": {"bfloat16": {"gemm": {"torch bfloat16": 40.0, "float32 numpy": 100.0}}}}
    best = compare_peers.best_limits(first, second)
    assert best["read_kernels"] == {"numpy-sum": 33.0, "native-read": 30.0}
    assert (best["read_gbps"], best["read_kernel"]) == (33.0, "numpy-sum")
    assert best["gemm"] == {"numpy": 100.0, "torch": 90.0}
    assert (best["gemm_gflops"], best["gemm_source"]) == (100.0, "numpy")
    bf16 = best["dtype_gemm"]["bfloat16"]
    assert (bf16["gemm_gflops"], bf16["gemm_source"]) == (100.0, "float32 numpy")
    assert bf16["gemm"]["torch bfloat16"] == 50.0


def test_engines_take_turns(compare_peers):
    """Each round runs every engine once (min_repeats 3 over 3 rounds, no budget), the order
    rotated; an engine that raises keeps its exception and is not called again."""
    log = []

    def call(name, fail_at=None):
        def run():
            log.append(name)
            if fail_at is not None and log.count(name) == fail_at:
                raise RuntimeError(f"{name} broke")
        return name, run

    times = compare_peers.interleaved_times([call("a"), call("b"), call("c", fail_at=3)],
                                            rounds=3, budget=0, min_repeats=3, settle=0)
    # round 0: each engine's untimed warm-up call, then its timed one; rounds 1 and 2 start
    # one engine later each; c raises on its third call and is skipped from then on
    assert log == ["a", "a", "b", "b", "c", "c", "b", "c", "a", "a", "b"]
    assert [len(t) for t in times[:2]] == [3, 3]
    assert isinstance(times[2], RuntimeError) and "c broke" in str(times[2])
    assert all(x >= 0 for x in times[0] + times[1])


def test_rounds_must_be_positive(compare_peers):
    with pytest.raises(SystemExit):
        compare_peers.main(TINY + ["--rounds", "0"])
