"""attnfast against other CPU attention implementations, in ONE process, same inputs, same threads.

    python bench/compare_peers.py                      # all shapes, 1 and 2 threads
    python bench/compare_peers.py --quick              # a smoke run
    python bench/compare_peers.py --markdown bench/out/peers.md --json bench/out/peers.json

Peers (each optional: skipped with a note when not installed; `pip install "attnfast[peers]"`):

* torch       ``torch.nn.functional.scaled_dot_product_attention`` (``enable_gqa=True`` for GQA),
              threads via ``torch.set_num_threads``. For GQA decode also ``torch-fold``: the same
              call with the H/Hkv query heads of each KV head folded into query rows (exact for
              one decode token, and often faster).
* openvino    ``openvino.opset13.scaled_dot_product_attention`` compiled for CPU with
              INFERENCE_NUM_THREADS and INFERENCE_PRECISION_HINT=f32 (CPUs with bf16 support
              otherwise default to bf16), inputs shared, not copied. GQA decode uses the folded
              form (the 5-D broadcast form is decomposed into MatMul/Softmax and is slower).
* onnxruntime com.microsoft MultiHeadAttention for prefill (BSH inputs, unidirectional=1 when
              causal); com.microsoft GroupQueryAttention for decode, past and present K/V bound to
              one buffer through IOBinding (the in-place KV cache; it also writes the new token).
              Graphs are built with the ``onnx`` package; intra_op_num_threads = threads.
* numpy       materialised softmax(Q K^T) V in float32; BLAS limited with threadpoolctl (the
              elementwise passes are single-threaded).

Every output is checked against an independent float64 reference on a sample of query rows
(bench_common.py). The machine's limits are measured in the same run at each thread count:
memory-read bandwidth (attnfast._bench.measure_read_bandwidth: the best of a threaded NumPy sum
and threaded BLAS dot over 1 GiB) and float32 GEMM throughput (the best of NumPy's BLAS and
torch.mm on 2048^3). Prefill GFLOP/s counts useful FLOPs (half the square when causal);
decode GB/s counts each K/V byte once: B * Hkv * L * (D + Dv) * 4.

If OPENBLAS_CORETYPE is set (it is on some machines here, for old OpenBLAS builds) NumPy's GEMM
can be slower than the CPU allows; run with `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE`.

To judge a lower attnfast tier (ATTNFAST_ISA=avx2) on a CPU that has more, hold the peers and
the GEMM limit to the same ISA in the environment: PyTorch's own kernels
ATEN_CPU_CAPABILITY=avx2, its MKL GEMM (and torch.mm, a GEMM-limit candidate)
MKL_ENABLE_INSTRUCTIONS=AVX2 (without it SDPA's blocks and torch.mm run AVX-512),
oneDNN (PyTorch, OpenVINO) ONEDNN_MAX_CPU_ISA=AVX2, NumPy's OpenBLAS OPENBLAS_CORETYPE=Haswell
(with OPENBLAS_L2_SIZE unset). The report's metadata records these variables.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

import attnfast as af
from attnfast import _bench as ab

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import max_abs_error, sample_rows  # noqa: E402

TOLERANCE = 1e-4  # float32 output vs the float64 reference (outputs are O(1))


@dataclass(frozen=True)
class Case:
    kind: str  # "prefill" or "decode"
    b: int
    h: int
    hkv: int
    tq: int
    tk: int
    d: int
    dv: int
    causal: bool

    @property
    def label(self) -> str:
        if self.kind == "prefill":
            return (f"T={ab.fmt_len(self.tq)} D={self.d} H={self.h}"
                    f"{'' if self.h == self.hkv else '/' + str(self.hkv)} "
                    f"{'causal' if self.causal else 'full'}")
        return f"L={ab.fmt_len(self.tk)} H={self.h}/{self.hkv} D={self.d}"

    @property
    def work(self) -> int:
        """FLOPs (prefill) or bytes (decode) that set the rate."""
        if self.kind == "prefill":
            return ab.attention_flops(self.b, self.h, self.tq, self.tk, self.d, self.dv, self.causal)
        return ab.decode_bytes(self.b, self.hkv, self.tk, self.d, self.dv, 4)


# ----------------------------------------------------------------------------- engines
# Each engine's prepare(case, arrays, threads) does all untimed work (layout copies, graph
# building, compiling) and returns (run, output): run() is what is timed, output() returns the
# last result as a (B, H, Tq, Dv) NumPy array.

class AttnfastEngine:
    name = "attnfast"

    def available(self):
        return None

    def version(self):
        cfg = af._runtime.config()
        return f"{cfg['version']} ({cfg['isa']})"

    def prepare(self, case, arrays, threads):
        q, k, v = arrays
        box = [None]
        if case.kind == "decode":
            # The decode API over caller-owned arrays: attend over all L cached keys.
            seqlens = np.full(case.b, case.tk, dtype=np.int64)

            def run():
                box[0] = af.attention_with_kvcache(q, k, v, seqlens, num_threads=threads)
        else:
            out = np.empty((case.b, case.h, case.tq, case.dv), np.float32)

            def run():
                box[0] = af.attention(q, k, v, causal=case.causal, out=out, num_threads=threads)
        return run, lambda: np.asarray(box[0])


class TorchEngine:
    name = "torch"
    fold = False

    def available(self):
        try:
            import torch  # noqa: F401
        except ImportError:
            return "not installed (pip install torch==2.13.0)"
        return None

    def version(self):
        import torch
        return torch.__version__

    def applies(self, case):
        return not self.fold or (case.kind == "decode" and case.h != case.hkv)

    def prepare(self, case, arrays, threads):
        import torch
        import torch.nn.functional as F
        torch.set_num_threads(threads)
        q, k, v = (torch.from_numpy(a) for a in arrays)
        box = [None]
        if self.fold:
            g = case.h // case.hkv
            qf = q.reshape(case.b, case.hkv, g * case.tq, case.d)

            def run():
                box[0] = F.scaled_dot_product_attention(qf, k, v)

            return run, lambda: box[0].reshape(case.b, case.h, case.tq, case.dv).numpy()
        # torch's is_causal is top-left aligned; identical to attnfast's for Tq == Tk, and a
        # single decode query sees every key, so it needs no mask at all.
        causal = case.causal and case.tq > 1
        gqa = case.h != case.hkv

        def run():
            box[0] = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        return run, lambda: box[0].numpy()


class TorchFoldEngine(TorchEngine):
    name = "torch-fold"
    fold = True


class OpenVINOEngine:
    name = "openvino"

    def available(self):
        try:
            import openvino  # noqa: F401
        except ImportError:
            return "not installed (pip install openvino)"
        return None

    def version(self):
        import openvino
        return openvino.__version__.split("-")[0]

    def prepare(self, case, arrays, threads):
        import openvino as ov
        import openvino.opset13 as ops
        q, k, v = arrays
        g = case.h // case.hkv
        if case.kind == "decode" and g > 1:
            q = q.reshape(case.b, case.hkv, g * case.tq, case.d)  # fold: exact for Tq == 1
        elif g > 1:
            raise NotImplementedError("GQA prefill is not wired for openvino")
        causal = case.causal and case.tq > 1
        params = [ops.parameter(list(a.shape), ov.Type.f32, name=n) for n, a in zip("qkv", (q, k, v))]
        sdpa = ops.scaled_dot_product_attention(*params, causal=causal)
        model = ov.Model([sdpa.output(0)], params, "sdpa")
        compiled = _ov_core().compile_model(model, "CPU", {
            "INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32",
            "PERFORMANCE_HINT": "LATENCY"})
        request = compiled.create_infer_request()
        for i, a in enumerate((q, k, v)):
            request.set_input_tensor(i, ov.Tensor(np.ascontiguousarray(a), shared_memory=True))
        keep = (q, k, v)  # the shared tensors point into these

        def output():
            _ = keep  # the shared buffers must outlive the timing
            return request.get_output_tensor(0).data.reshape(case.b, case.h, case.tq, case.dv).copy()

        return request.infer, output


_OV_CORE = None


def _ov_core():
    global _OV_CORE
    if _OV_CORE is None:
        import openvino as ov
        _OV_CORE = ov.Core()
    return _OV_CORE


class OnnxRuntimeEngine:
    name = "onnxruntime"

    def available(self):
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            return "not installed (pip install onnxruntime)"
        try:
            import onnx  # noqa: F401
        except ImportError:
            return "needs the onnx package to build its graphs (pip install onnx)"
        return None

    def version(self):
        import onnxruntime
        return onnxruntime.__version__

    @staticmethod
    def _session(node, inputs, outputs, threads):
        import onnxruntime as ort
        from onnx import helper
        graph = helper.make_graph([node], "attention", inputs, outputs)
        model = helper.make_model(graph, opset_imports=[
            helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        return ort.InferenceSession(model.SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])

    def prepare(self, case, arrays, threads):
        import onnxruntime as ort
        from onnx import TensorProto, helper
        f32, i32 = TensorProto.FLOAT, TensorProto.INT32
        info = helper.make_tensor_value_info
        q, k, v = arrays
        b, h, hkv, d, dv = case.b, case.h, case.hkv, case.d, case.dv

        def bsh(x):  # (B, N, S, D) -> (B, S, N*D), the layout these ops take
            return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1))

        out = np.empty((b, case.tq, h * dv), np.float32)
        if case.kind == "prefill":
            if h != hkv:
                raise NotImplementedError("GQA prefill is not wired for onnxruntime")
            node = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"],
                                    domain="com.microsoft", num_heads=h,
                                    unidirectional=int(case.causal))
            sess = self._session(node, [info("q", f32, [b, case.tq, h * d]),
                                        info("k", f32, [b, case.tk, h * d]),
                                        info("v", f32, [b, case.tk, h * dv])],
                                 [info("o", f32, [b, case.tq, h * dv])], threads)
            feeds = {"q": bsh(q), "k": bsh(k), "v": bsh(v)}
            outs = {"o": out}
        else:
            # The cache holds L tokens; the last one is "new": GQA writes it into slot L-1 of
            # the shared buffer (the same values: idempotent) and attends over all L.
            L = case.tk
            node = helper.make_node(
                "GroupQueryAttention", ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total"],
                ["o", "present_k", "present_v"], domain="com.microsoft",
                num_heads=h, kv_num_heads=hkv)
            sess = self._session(node, [
                info("q", f32, [b, 1, h * d]), info("k", f32, [b, 1, hkv * d]),
                info("v", f32, [b, 1, hkv * dv]), info("past_k", f32, [b, hkv, L, d]),
                info("past_v", f32, [b, hkv, L, dv]), info("seqlens_k", i32, [b]),
                info("total", i32, [])],
                [info("o", f32, [b, 1, h * dv]), info("present_k", f32, [b, hkv, L, d]),
                 info("present_v", f32, [b, hkv, L, dv])], threads)
            feeds = {"q": bsh(q), "k": bsh(k[:, :, L - 1:]), "v": bsh(v[:, :, L - 1:]),
                     "past_k": k, "past_v": v,
                     "seqlens_k": np.full(b, L - 1, np.int32), "total": np.array(L, np.int32)}
            outs = {"o": out, "present_k": k, "present_v": v}
        values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in {**feeds, **outs}.items()}
        binding = sess.io_binding()
        for n in feeds:
            binding.bind_ortvalue_input(n, values[n])
        for n in outs:
            binding.bind_ortvalue_output(n, values[n])
        keep = (feeds, outs)

        def run():
            sess.run_with_iobinding(binding)

        def output():
            _ = keep  # the shared buffers must outlive the timing
            return out.reshape(b, case.tq, h, dv).transpose(0, 2, 1, 3)

        return run, output


class NumpyEngine:
    name = "numpy"

    def available(self):
        return None

    def version(self):
        return np.__version__

    def prepare(self, case, arrays, threads):
        q, k, v = arrays
        g = case.h // case.hkv
        # (B, Hkv, G, Tq, D) against (B, Hkv, 1, Tk, D): GQA without repeating K/V.
        q5 = q.reshape(case.b, case.hkv, g, case.tq, case.d)
        kt = k[:, :, None].swapaxes(-1, -2)
        v5 = v[:, :, None]
        scale = np.float32(1.0 / np.sqrt(case.d))
        bias = None
        if case.causal and case.tq > 1:
            i = np.arange(case.tq)[:, None] + (case.tk - case.tq)
            bias = np.where(np.arange(case.tk)[None, :] <= i, 0.0, -np.inf).astype(np.float32)
        box = [None]

        def run():
            with ab._blas_limits(threads) or _nullcontext():
                s = np.matmul(q5, kt)
                s *= scale
                if bias is not None:
                    s += bias
                s -= s.max(axis=-1, keepdims=True)
                np.exp(s, out=s)
                s /= s.sum(axis=-1, keepdims=True)
                box[0] = np.matmul(s, v5)

        return run, lambda: box[0].reshape(case.b, case.h, case.tq, case.dv)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


ENGINES = [AttnfastEngine(), TorchEngine(), TorchFoldEngine(), OpenVINOEngine(),
           OnnxRuntimeEngine(), NumpyEngine()]


# ----------------------------------------------------------------------------- machine limits

def measure_limits(threads: int, bandwidth_bytes: int, gemm_n: int, use_torch: bool,
                   settle: float) -> dict:
    bw = ab.measure_read_bandwidth(threads, bandwidth_bytes)
    gemm = {}
    numpy_gemm = ab.measure_gemm(threads, gemm_n)
    if numpy_gemm is not None:
        gemm["numpy"] = numpy_gemm["gflops"]
    time.sleep(settle)
    if use_torch:
        import torch
        torch.set_num_threads(threads)
        a = torch.randn(gemm_n, gemm_n)
        b = torch.randn(gemm_n, gemm_n)
        c = torch.empty(gemm_n, gemm_n)
        times = ab.time_call(lambda: torch.mm(a, b, out=c), budget=0.0, min_repeats=3)
        gemm["torch"] = 2 * gemm_n ** 3 / ab.median(times) / 1e9
    best = max(gemm, key=gemm.get) if gemm else None
    return {"read_gbps": bw["gbps"], "read_kernel": bw["kernel"], "read_kernels": bw["kernels"],
            "gemm_gflops": gemm[best] if best else None, "gemm_source": best, "gemm": gemm}


# ----------------------------------------------------------------------------- main

def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Lengths accept a k suffix (1k = 1024).")
    p.add_argument("--threads", default="1,2", help="comma list (default 1,2)")
    p.add_argument("--prefill-T", default="256,1k,4k,8k", help="default 256,1k,4k,8k")
    p.add_argument("--prefill-D", default="64,128", help="default 64,128")
    p.add_argument("--prefill-heads", type=int, default=8, help="default 8")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--decode-L", default="1k,4k,16k,64k", help="default 1k,4k,16k,64k")
    p.add_argument("--decode-heads", default="32/8,8/8", help="comma list of H/Hkv (default 32/8,8/8)")
    p.add_argument("--decode-D", type=int, default=128, help="default 128")
    p.add_argument("--peers", default="torch,torch-fold,openvino,onnxruntime,numpy",
                   help="comma list of peers to run (default: all installed)")
    p.add_argument("--skip", default="", help="'prefill' or 'decode' to run only the other half")
    p.add_argument("--budget", type=float, default=1.0,
                   help="seconds of repeats per timing (default 1.0; at least --min-repeats)")
    p.add_argument("--min-repeats", type=int, default=3)
    p.add_argument("--settle", type=float, default=0.3,
                   help="seconds of pause before each timing, so other thread pools go idle "
                        "(default 0.3)")
    p.add_argument("--bandwidth-mib", type=int, default=1024)
    p.add_argument("--gemm-n", type=int, default=2048)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: T 256,1k; D 128; L 1k,16k; budget 0.2 s (explicit options win)")
    p.add_argument("--markdown", metavar="FILE", help="also write the report as markdown")
    p.add_argument("--json", metavar="FILE", help="also write raw results as JSON")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p


QUICK = {"prefill_T": "256,1k", "prefill_D": "128", "decode_L": "1k,16k", "budget": 0.2,
         "bandwidth_mib": 256, "gemm_n": 1024}


def make_cases(args) -> list[Case]:
    cases = []
    if "prefill" not in args.skip:
        causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
        for d in ab.parse_int_list(args.prefill_D, "--prefill-D"):
            for T in ab.parse_int_list(args.prefill_T, "--prefill-T"):
                for causal in causals:
                    h = args.prefill_heads
                    cases.append(Case("prefill", 1, h, h, T, T, d, d, causal))
    if "decode" not in args.skip:
        for heads in args.decode_heads.split(","):
            h, hkv = ab.parse_heads(heads.strip())
            for L in ab.parse_int_list(args.decode_L, "--decode-L"):
                cases.append(Case("decode", 1, h, hkv, 1, L, args.decode_D, args.decode_D, False))
    return cases


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if "--quick" in argv:
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    threads_list = ab.parse_int_list(args.threads, "--threads")
    cases = make_cases(args)
    wanted = {"attnfast"} | {p.strip() for p in args.peers.split(",") if p.strip()}
    engines, skipped = [], {}
    for e in ENGINES:
        if e.name not in wanted:
            continue
        why = e.available()
        if why:
            skipped[e.name] = why
        else:
            engines.append(e)
    names = [e.name for e in engines]
    have_torch = "torch" in names or "torch-fold" in names

    load_before = ab.load_average()
    warning = ab.busy_warning(load_before, ab.available_cpus())
    if warning:
        print(warning, file=sys.stderr)
    meta = {
        "load_average_before": load_before, "busy_warning": warning,
        "command": "python bench/compare_peers.py " + " ".join(argv),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu": ab.cpu_name(), "cpus": ab.available_cpus(),
        "last_level_cache_mib": (ab.last_level_cache_bytes() or 0) // ab.MIB,
        "blas": ab.blas_description(),
        "versions": {e.name: e.version() for e in engines},
        "skipped": skipped,
        "isa_env": {k: os.environ.get(k) for k in (
            "ATTNFAST_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
            "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if os.environ.get(k) is not None},
    }
    if os.environ.get("OPENBLAS_CORETYPE"):
        print("warning: OPENBLAS_CORETYPE is set; NumPy's GEMM (a machine-limit candidate and the "
              "numpy peer) may be slower than this CPU allows. For the record run: "
              "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/compare_peers.py ...",
              file=sys.stderr)

    steps = len(threads_list) * (1 + sum(
        1 for c in cases for e in engines if getattr(e, "applies", lambda _: True)(c)))
    progress = ab.Progress(steps, enabled=not args.no_progress)
    rng = np.random.default_rng(args.seed)
    limits, results = {}, []
    for n in threads_list:
        progress.step(f"machine limits, {n} thread(s)")
        time.sleep(args.settle)
        limits[n] = measure_limits(n, args.bandwidth_mib * ab.MIB, args.gemm_n, have_torch,
                                   args.settle)
        for case in cases:
            q = rng.standard_normal((case.b, case.h, case.tq, case.d), dtype=np.float32)
            k = rng.standard_normal((case.b, case.hkv, case.tk, case.d), dtype=np.float32)
            v = rng.standard_normal((case.b, case.hkv, case.tk, case.dv), dtype=np.float32)
            rows = sample_rows(case.tq)
            for engine in engines:
                if not getattr(engine, "applies", lambda _: True)(case):
                    continue
                progress.step(f"{case.kind} {case.label}, {engine.name}, {n} thread(s)")
                entry = {"kind": case.kind, "case": case.label, "threads": n,
                         "engine": engine.name, "shape": case.__dict__.copy(), "work": case.work}
                try:
                    run, output = engine.prepare(case, (q, k, v), n)
                    # Let the previous engine's idle worker threads stop spinning (OpenBLAS and
                    # OpenMP pools busy-wait for a while; measured: torch at 2 threads runs at
                    # 60% right after a NumPy GEMM) so they do not steal this engine's cores.
                    time.sleep(args.settle)
                    times = ab.time_call(run, budget=args.budget,
                                         min_repeats=args.min_repeats if case.kind == "prefill"
                                         else max(args.min_repeats, 5))
                    err = max_abs_error(output(), q, k, v, causal=case.causal, rows=rows)
                    entry.update(times_s=times, median_s=ab.median(times),
                                 rate=case.work / ab.median(times) / 1e9, max_abs_error=err,
                                 ok=bool(err <= TOLERANCE))
                except Exception as exc:  # a peer that cannot run a shape is reported, not fatal
                    entry.update(error=f"{type(exc).__name__}: {exc}"[:200])
                results.append(entry)
                run = output = None
    progress.finish()

    report = Report(meta, limits, results, names)
    print(report.render(markdown=False))
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(report.render(markdown=True) + "\n")
        print(f"\nmarkdown: {args.markdown}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "limits": limits, "results": results}, f, indent=1,
                      default=str)
        print(f"json: {args.json}")
    failed = [r for r in results if r.get("engine") == "attnfast" and not r.get("ok")]
    return 1 if failed else 0


# ----------------------------------------------------------------------------- report

class Report:
    def __init__(self, meta, limits, results, engine_names):
        self.meta, self.limits, self.results = meta, limits, results
        self.engines = engine_names
        self.peers = [e for e in engine_names if e != "attnfast"]

    def _table(self, headers, rows, markdown):
        return ab.format_markdown_table(headers, rows) if markdown else ab.format_table(headers, rows)

    def _get(self, kind, case, threads, engine):
        for r in self.results:
            if (r["kind"], r["case"], r["threads"], r["engine"]) == (kind, case, threads, engine):
                return r
        return None

    def render(self, markdown: bool) -> str:
        m = self.meta
        llc = m["last_level_cache_mib"] * ab.MIB
        h2 = "### " if markdown else ""
        out = []
        if markdown:
            out.append(f"Run {m['date']}: `{m['command']}`\n")
        else:
            out.append(f"command: {m['command']}  ({m['date']})")
        out.append(f"CPU: {m['cpu']}, {m['cpus']} CPUs, last-level cache {m['last_level_cache_mib']} MiB; "
                   f"NumPy BLAS: {m['blas']}")
        out.append("versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()))
        if m.get("isa_env"):
            out.append("ISA environment: " + " ".join(f"{k}={v}" for k, v in m["isa_env"].items()))
        if m.get("busy_warning"):
            out.append(m["busy_warning"])
        for name, why in m["skipped"].items():
            out.append(f"skipped {name}: {why}")

        out.append(f"\n{h2}Machine limits, measured in this run")
        rows = []
        for n, lim in self.limits.items():
            reads = ", ".join(f"{k} {v:.1f}" for k, v in lim["read_kernels"].items())
            gemms = ", ".join(f"{k} {v:.1f}" for k, v in lim["gemm"].items())
            rows.append([n, f"{lim['read_gbps']:.1f}", reads,
                         f"{lim['gemm_gflops']:.1f}" if lim["gemm_gflops"] else "n/a", gemms])
        out.append(self._table(["threads", "read GB/s", "read kernels (GB/s)", "GEMM GFLOP/s",
                                "GEMM sources"], rows, markdown))

        for kind, unit, limit_key in (("prefill", "GFLOP/s", "gemm_gflops"),
                                      ("decode", "GB/s", "read_gbps")):
            cases = list(dict.fromkeys(r["case"] for r in self.results if r["kind"] == kind))
            if not cases:
                continue
            what = ("useful FLOPs (half the square when causal) per second; % of measured GEMM"
                    if kind == "prefill" else
                    "K+V bytes read per step (B*Hkv*L*(D+Dv)*4) per second; % of measured read "
                    "bandwidth; one query token")
            out.append(f"\n{h2}{kind.capitalize()}: attnfast {unit}, and attnfast's speedup over "
                       f"each peer (peer time / attnfast time; >1 = attnfast faster)")
            out.append(f"{what}")
            headers = ["shape", "thr", "attnfast", unit, "% limit"] + self.peers + ["best peer"]
            rows = []
            for n in self.limits:
                for c in cases:
                    a = self._get(kind, c, n, "attnfast")
                    if a is None:
                        continue
                    lim = self.limits[n][limit_key]
                    if "median_s" in a:
                        flag = " *" if kind == "decode" and a["work"] <= llc else ""
                        row = [c, n, ab.fmt_time(a["median_s"]) + ("" if a["ok"] else " WRONG"),
                               f"{a['rate']:.1f}",
                               (f"{100 * a['rate'] / lim:.0f}%" if lim else "n/a") + flag]
                    else:
                        row = [c, n, "error", "", ""]
                    best = None
                    for p in self.peers:
                        r = self._get(kind, c, n, p)
                        if r is None:
                            row.append("-")
                        elif "median_s" not in r:
                            row.append("error")
                        elif not r["ok"]:
                            row.append("wrong")
                        elif "median_s" in a:
                            row.append(f"{r['median_s'] / a['median_s']:.2f}x")
                            if best is None or r["median_s"] < best["median_s"]:
                                best = r
                        else:
                            row.append(ab.fmt_time(r["median_s"]))
                    row.append(f"{best['engine']} {best['median_s'] / a['median_s']:.2f}x"
                               if best and "median_s" in a else "-")
                    rows.append(row)
            out.append(self._table(headers, rows, markdown))
            if kind == "decode" and any(r["kind"] == "decode" and r["work"] <= llc
                                        for r in self.results):
                out.append(f"\n\\* the K/V bytes fit in the last-level cache "
                           f"({m['last_level_cache_mib']} MiB): read from cache, not DRAM, so the "
                           f"fraction of DRAM read bandwidth can pass 100%.")

        out.append(self.targets(markdown))

        out.append(f"\n{h2}Every engine: median time, rate, % of the machine limit, max |error| vs "
                   f"the float64 reference (sampled rows; tolerance {TOLERANCE:g})")
        rows = []
        for r in self.results:
            lim = self.limits[r["threads"]]["gemm_gflops" if r["kind"] == "prefill" else "read_gbps"]
            if "median_s" in r:
                rows.append([r["kind"], r["case"], r["threads"], r["engine"], ab.fmt_time(r["median_s"]),
                             f"{r['rate']:.1f} {'GFLOP/s' if r['kind'] == 'prefill' else 'GB/s'}",
                             f"{100 * r['rate'] / lim:.0f}%" if lim else "n/a",
                             f"{r['max_abs_error']:.1e}" + ("" if r["ok"] else " FAIL")])
            else:
                rows.append([r["kind"], r["case"], r["threads"], r["engine"], "error", r["error"], "", ""])
        out.append(self._table(["kind", "shape", "thr", "engine", "time", "rate", "% limit",
                                "max err"], rows, markdown))
        return "\n".join(out)


    def targets(self, markdown: bool) -> str:
        """The issue's float32 targets, met or missed, shape by shape (attnfast rows only)."""
        checks = []  # (target, shape label, threads, value text, met)
        for a in self.results:
            if a["engine"] != "attnfast" or "median_s" not in a:
                continue
            n, lim = a["threads"], self.limits[a["threads"]]
            peers = [r for r in self.results if r["engine"] != "attnfast" and r.get("ok")
                     and (r["kind"], r["case"], r["threads"]) == (a["kind"], a["case"], n)]
            if a["kind"] == "prefill" and a["shape"]["tq"] >= 1024 and lim["gemm_gflops"]:
                frac = a["rate"] / lim["gemm_gflops"]
                checks.append(("prefill >= 90% of GEMM (T >= 1024)", a["case"], n,
                               f"{100 * frac:.0f}%", frac >= 0.9))
            if a["kind"] == "prefill" and peers:
                best = min(peers, key=lambda r: r["median_s"])
                ratio = best["median_s"] / a["median_s"]
                checks.append(("prefill at least as fast as the best peer", a["case"], n,
                               f"{ratio:.2f}x vs {best['engine']}", ratio >= 1.0))
            torch = [r for r in peers if r["engine"] == "torch"]
            if a["kind"] == "prefill" and a["shape"]["causal"] and torch:
                ratio = torch[0]["median_s"] / a["median_s"]
                checks.append(("causal prefill >= 1.15x torch", a["case"], n, f"{ratio:.2f}x",
                               ratio >= 1.15))
            if a["kind"] == "decode" and a["shape"]["tk"] >= 16384:
                frac = a["rate"] / lim["read_gbps"]
                checks.append(("decode >= 85% of read bandwidth (L >= 16k)", a["case"], n,
                               f"{100 * frac:.0f}%", frac >= 0.85))
        if not checks:
            return ""
        rows = []
        for target in dict.fromkeys(c[0] for c in checks):
            mine = [c for c in checks if c[0] == target]
            missed = [c for c in mine if not c[4]]
            worst = ", ".join(f"{c[1]} ({c[2]} thr): {c[3]}" for c in missed[:4])
            if len(missed) > 4:
                worst += f", ... {len(missed) - 4} more"
            rows.append([target, f"{len(mine) - len(missed)}/{len(mine)}", worst or "-"])
        h2 = "### " if markdown else ""
        return (f"\n{h2}Targets (issue 4, float32)\n"
                + self._table(["target", "shapes met", "missed (value)"], rows, markdown))


if __name__ == "__main__":
    sys.exit(main())
