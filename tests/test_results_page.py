"""python -m attnfast.bench.results: docs/results.md from compare_peers JSON, on a small
synthetic run whose every number is known."""
import json
import sys
from pathlib import Path

import pytest

from attnfast.bench import results
from attnfast.bench.generate_results import load_generate_runs
from attnfast.bench.lowbit_results import load_lowbit_runs
from attnfast.bench.many_rows_results import load_many_rows_runs
from attnfast.bench.sparse_results import load_sparse_runs
from attnfast.bench.limits import limits_from
from attnfast.bench.report import table

PREFILL = {"kind": "prefill", "case": "T=1k D=64 H=2 causal", "threads": 2, "dtype": "float32",
           "shape": {"kind": "prefill", "b": 1, "h": 2, "hkv": 2, "tq": 1024, "tk": 1024,
                     "d": 64, "dv": 64, "causal": True},
           "work": 268_697_600}  # 2 * B*H * (D+Dv) * 1024*1025/2
DECODE = {"kind": "decode", "case": "L=2k H=4/2 D=32", "threads": 2, "dtype": "float32",
          "shape": {"kind": "decode", "b": 1, "h": 4, "hkv": 2, "tq": 1, "tk": 2048, "d": 32,
                    "dv": 32, "causal": False},
          "work": 1_048_576}  # B*Hkv*L*(D+Dv)*4


def row(base, engine, seconds, ok=True):
    return dict(base, engine=engine, median_s=seconds, rate=base["work"] / seconds / 1e9,
                max_abs_error=1e-7 if ok else 0.5, ok=ok)


def synthetic_run():
    meta = {"command": "python bench/compare_peers.py --threads 2", "date": "2026-01-02T03:04:05+00:00",
            "commit": "abc1234", "attnfast_isa": "avx512bf16", "cpu": "Test CPU 9000",
            "cpu_flags": ["fpu", "sse2", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "rdrand"],
            "cpus": 2, "last_level_cache_mib": 1, "blas": "openblas test",
            "versions": {"attnfast": "0.1.0 (avx512bf16)", "torch": "9.9", "numpy": "2.0"},
            "skipped": {}, "dtypes": ["float32"], "tolerances": {"float32": 1e-4},
            "dtype_skipped": {}, "isa_env": {}}
    lim = limits_from({"numpy-sum": 15.0, "native-read": 20.0}, {"numpy": 100.0, "torch": 80.0}, {})
    lim["measured"] = 2
    rows = [row(PREFILL, "attnfast", 0.004), row(PREFILL, "torch", 0.008),
            row(PREFILL, "numpy", 0.002),
            row(DECODE, "attnfast", 1e-4), row(DECODE, "torch", 3e-4),
            row(DECODE, "numpy", 5e-5, ok=False)]  # faster but wrong: not the best peer
    return {"meta": meta, "limits": {"2": lim}, "results": rows}


def cells(page, first_cell):
    """The cells of the markdown table row that starts with ``first_cell``."""
    for line in page.splitlines():
        parts = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and parts[0] == first_cell:
            return parts
    raise AssertionError(f"no row {first_cell!r}")


def test_page_from_json(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "test-kind.json").write_text(json.dumps(synthetic_run()))
    out = tmp_path / "docs" / "results.md"
    assert results.main(["--results-dir", str(tmp_path / "results"), "--out", str(out),
                         "--no-plots"]) == 0
    page = out.read_text()
    assert page.startswith("# Results\n")
    assert "## Test CPU 9000: test-kind" in page
    assert "`avx2` `fma` `avx512f` `avx512_bf16` `amx_tile`." in page  # SIMD flags only
    assert "`fpu`" not in page and "`rdrand`" not in page
    assert "Run 2026-01-02T03:04:05+00:00 at commit `abc1234`" in page
    assert "    python bench/compare_peers.py --threads 2" in page
    # limits: the best source of each
    assert cells(page, "2") == ["2", "20.0", "numpy-sum 15.0, native-read 20.0", "100.0",
                                "numpy 100.0, torch 80.0"]
    # prefill: 268.7 MFLOP in 4 ms = 67.2 GFLOP/s = 67 % of 100; torch 2x slower, numpy 2x faster
    assert cells(page, "T=1k D=64 H=2 causal") == ["T=1k D=64 H=2 causal", "2", "4.00 ms",
                                                   "67.2", "67%", "2.00x", "0.50x", "numpy 0.50x"]
    # decode: 1 MiB in 100 us = 10.5 GB/s = 52 % of 20, flagged: it fits the 1 MiB cache; the
    # wrong numpy is no best peer
    assert cells(page, "L=2k H=4/2 D=32") == ["L=2k H=4/2 D=32", "2", "100.0 us", "10.5",
                                              "52% *", "3.00x", "wrong", "torch 3.00x"]
    assert "fit in the last-level cache (1 MiB)" in page
    assert ("prefill float32: at least as fast as the fastest peer in 0 of 1 cells "
            "(fastest peer's time / attnfast's 0.50x-0.50x)") in page
    assert "decode float32: at least as fast as the fastest peer in 1 of 1 cells" in page
    assert "### Plots" not in page


def test_a_new_run_replaces_the_section(tmp_path):
    """Regenerating after a new run of the same kind shows the new numbers only."""
    (tmp_path / "results").mkdir()
    path = tmp_path / "results" / "test-kind.json"
    run = synthetic_run()
    path.write_text(json.dumps(run))
    out = tmp_path / "results.md"
    results.main(["--results-dir", str(tmp_path / "results"), "--out", str(out), "--no-plots"])
    run["results"][0] = row(PREFILL, "attnfast", 0.008)
    path.write_text(json.dumps(run))
    results.main(["--results-dir", str(tmp_path / "results"), "--out", str(out), "--no-plots"])
    page = out.read_text()
    assert page.count("## Test CPU 9000") == 1
    assert cells(page, "T=1k D=64 H=2 causal")[2:5] == ["8.00 ms", "33.6", "34%"]


def test_plots_written(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "test-kind.json").write_text(json.dumps(synthetic_run()))
    out = tmp_path / "docs" / "results.md"
    results.main(["--results-dir", str(tmp_path / "results"), "--out", str(out)])
    for what in ("decode", "prefill"):
        png = tmp_path / "docs" / "images" / f"test-kind-{what}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"](images/test-kind-{what}.png)" in out.read_text()


def test_table_without_tabulate(monkeypatch):
    monkeypatch.setitem(sys.modules, "tabulate", None)  # import fails: the markdown fallback
    assert table(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |"


def test_committed_page_is_generated_from_the_committed_runs():
    """docs/results.md is what the generator makes of bench/results/*.json (never hand-edited,
    never stale after a new run)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "bench" / "results").is_dir():
        pytest.skip("no bench/results beside the tests (installed wheel)")
    runs = results.load_runs(str(root / "bench" / "results"))
    assert "zen4-avx512bf16" in runs
    plots = {kind: [results.plot_ref(kind, what, "images") for what in ("decode", "prefill")
                    if (root / "docs" / "images" / f"{kind}-{what}.png").exists()]
             for kind in runs}
    sparse = load_sparse_runs(str(root / "bench" / "results"))
    assert "zen4-avx512bf16" in sparse
    lowbit = load_lowbit_runs(str(root / "bench" / "results"))
    assert "zen4-avx512bf16" in lowbit
    generate = load_generate_runs(str(root / "bench" / "results"))
    many_rows = load_many_rows_runs(str(root / "bench" / "results"))
    assert (root / "docs" / "results.md").read_text() == results.render_page(
        runs, plots, sparse, lowbit, generate, many_rows)


def page_with_part(tmp_path, file, part, rows, **extra):
    """The page generated from one stored part (results/<file>, as a bench's --json writes
    it) beside a synthetic compare_peers run."""
    from attnfast.bench import sparse_results
    sparse_results.store_part(str(tmp_path / "results" / file), part, rows, **extra)
    (tmp_path / "results" / "test-kind.json").write_text(json.dumps(synthetic_run()))
    out = tmp_path / "results.md"
    results.main(["--results-dir", str(tmp_path / "results"), "--out", str(out), "--no-plots"])
    return out.read_text()


def test_generate_section_from_json(tmp_path):
    """bench_transformers.py --json renders as the page's generation table: per dtype, prompt
    and threads each backend's prefill and decode step with its attention share, and the
    speed-ups computed from the stored times."""
    def row(phase, backend, seconds, attention, mask=0.0):
        return dict(dtype="float32", ctx=8192, threads=1, phase=phase, backend=backend,
                    seconds=seconds, attention_seconds=attention, mask_seconds=mask,
                    same_tokens=True)
    rows = [row("prefill", "sdpa", 12.0, 6.0), row("prefill", "attnfast", 10.0, 3.5, 0.5),
            row("decode/token", "sdpa", 0.080, 0.040), row("decode/token", "attnfast", 0.050, 0.010)]
    page = page_with_part(tmp_path, "generate/test-kind.json", "llama", rows, new_tokens=16,
                          model=dict(hidden=4096, layers=2, heads=32, kv_heads=8, head_dim=128))
    assert "## Generating with transformers: test-kind" in page
    assert "32 heads / 8 KV heads, head_dim 128; 16 decode steps" in page
    assert cells(page, "float32") == ["float32", "8192", "1", "12000.0 ms (50 %)",
                                      "10000.0 ms (40 %)", "1.20x", "80.0 ms (50 %)",
                                      "50.0 ms (20 %)", "1.60x", "4.0x", "yes"]


def test_lowbit_section_from_json(tmp_path):
    """bench_lowbit_decode.py --json renders as the page's low-bit table: per dtype the ms,
    the speed-up over float32 computed from the stored times, and the share of the read kernel."""
    row = dict(heads="32/8", L=16384, threads=1, read_gbs=30.0,
               dtypes={"float32": dict(ms=6.0, of_read=0.6, kernel="simd_decode"),
                       "int8": dict(ms=2.5, of_read=0.36, kernel="vnni_int8_decode")})
    page = page_with_part(tmp_path, "lowbit/decode-test-kind.json", "decode", [row])
    assert "## Low-bit KV caches: test-kind" in page
    assert cells(page, "32/8")[:6] == ["32/8", "16384", "1", "30.0", "6.00 = 1.00x (60 %)",
                                       "2.50 = 2.40x (36 %)"]
    assert "bfloat16 ms" not in page  # only the dtypes stored


def test_many_rows_section_from_json(tmp_path):
    """bench_many_rows.py --json renders as the page's many-rows table: per Tq the kernel, the
    ms, the ms per token computed from them, and the share of the roofline."""
    row = dict(dtype="float32", threads=1, heads="32/8", L=16384, D=128, tq=16, kernel="gemm_decode",
               ms=25.6, gflops=168.0, read_gbs=38.5, peak_gflops=228.0, of_roofline=0.73)
    page = page_with_part(tmp_path, "many_rows/test-kind.json", "many_rows", [row])
    assert "## Many query rows per KV head: test-kind" in page
    assert cells(page, "float32")[2:] == ["32/8", "16384", "16", "`gemm_decode`", "25.60", "1.60", "168",
                                          "73 %", "38.5", "228"]


def test_sparse_section_from_json(tmp_path):
    """bench_mla.py / bench_sparse.py --json parts render as the page's sparse tables, with
    the ratios computed from the stored times."""
    from attnfast.bench import sparse_results
    path = tmp_path / "results" / "sparse" / "test-kind.json"
    mla_row = dict(threads=1, L=32768, dtype="bfloat16", kernel="latent_decode", regime="compute",
                   attnfast_ms=100.0, torch_ms=200.0, top_k=2048, sparse_ms=4.0, torch_sparse_ms=6.0,
                   sparse_roofline_ms=3.0, sparse_of_roofline=0.75, dense_over_sparse=25.0)
    sparse_results.store_part(str(path), "mla", [mla_row])
    sparse_results.store_part(str(path), "prefill", [dict(threads=1, heads="8/2", D=128, new=4096,
                                                          prompt=32768, topk=2048, sparse_s=2.0,
                                                          dense_s=7.0)])
    sparse_results.store_part(str(path), "model", [dict(
        threads=1, model="deepseek_v32", prompt=8192, new=16, topk=2048, decode_tokens_s=3.0,
        sdpa_decode_tokens_s=2.0, prefill_s=10.0, sdpa_prefill_s=12.5, same_tokens=True)])
    data = json.loads(path.read_text())
    assert set(data) == {"mla", "prefill", "model"}  # each part kept the others
    assert data["mla"]["meta"]["tier"] and data["mla"]["meta"]["command"].startswith("python ")
    (tmp_path / "results" / "test-kind.json").write_text(json.dumps(synthetic_run()))
    out = tmp_path / "results.md"
    assert results.main(["--results-dir", str(tmp_path / "results"), "--out", str(out),
                         "--no-plots"]) == 0
    page = out.read_text()
    assert "## Sparse attention (DeepSeek-V3.2 / GLM-5): test-kind" in page
    assert cells(page, "1")[:10] == ["1", "32768", "bfloat16", "2048", "4.00", "75 %", "100.0", "25.0x",
                                     "6.00", "1.50x"]
    prefill = [line for line in page.splitlines() if line.startswith("| 1 | 8/2 |")]
    assert prefill and prefill[0].rstrip(" |").endswith("3.5x")
    model = [line for line in page.splitlines() if line.startswith("| 1 | deepseek_v32 |")]
    assert model and [c.strip() for c in model[0].strip("| ").split("|")][4:] == \
        ["3.00", "2.00", "1.50x", "10.0", "12.5", "1.25x", "yes"]
