"""attnfast against other CPU attention implementations, in ONE process, same inputs, same threads.

    python bench/compare_peers.py                      # all shapes, 1 and 2 threads
    python bench/compare_peers.py --quick              # a smoke run
    python bench/compare_peers.py --markdown bench/out/peers.md --json bench/out/peers.json
    python bench/compare_peers.py --dtype float32,bfloat16,float16   # 16-bit rows in the same run

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
(bench_common.py). The machine's limits are measured in the same run at each thread count,
before and again after that count's engines, each source at its better reading (a shared
machine can slow down for minutes): memory-read bandwidth (attnfast._bench.measure_read_bandwidth:
the best of a threaded NumPy sum, threaded BLAS dot and attnfast's native read kernel over
1 GiB, each the best of its repeats) and float32 GEMM throughput (the best of NumPy's BLAS and
torch.mm on 2048^3). Prefill GFLOP/s counts useful FLOPs (half the square when causal);
decode GB/s counts each K/V byte once: B * Hkv * L * (D + Dv) * 4.

16-bit rows (``--dtype``, a comma list of float32 (default), bfloat16, float16): the same
float32 random inputs, rounded once (untimed) to the dtype, go to every peer, and each output is
checked against the float64 reference of those SAME rounded inputs with a per-dtype tolerance
(TOLERANCE below: the output itself is rounded to 16 bits, and attnfast's bfloat16 kernel rounds P
to bfloat16 for vdpbf16ps). A peer that misses it is reported "wrong", never accepted.

* attnfast    q, k, v as ``ml_dtypes.bfloat16`` / ``numpy.float16`` arrays, out= of that dtype.
              The tier in use is in the version string, and the report's header repeats
              show_config()'s 16-bit line (which instructions each path uses; the
              ``avx512bf16`` tier uses vdpbf16ps for bfloat16 decode and, since 73a627c,
              prefill). To compare with the widening kernel (bfloat16 loaded and widened to
              float32 in registers) run once more with ``ATTNFAST_ISA=avx512``.
* torch       torch.bfloat16 / torch.float16 tensors (converted once, untimed), SDPA as above.
* openvino    bfloat16: a model with ov.Type.bf16 inputs, INFERENCE_PRECISION_HINT=bf16; its
              runtime model runs SDPA in bf16 end to end (the alternative, f32 inputs with the
              bf16 hint, also runs a bf16 SDPA but converts f32 -> bf16 on the way in and
              bf16 -> f32 on the way out, so it is not used). float16: ov.Type.f16 inputs with
              INFERENCE_PRECISION_HINT=f16 only if the CPU reports FP16 in
              OPTIMIZATION_CAPABILITIES; otherwise (Zen 4: no AVX512_FP16) the f16 hint makes
              OpenVINO run the SDPA in bf16, too coarse for float16's tolerance, so f32 is used
              and OpenVINO converts f16 -> f32 internally (as attnfast's widening kernel does).
              The SDPA node's runtime precision is recorded in each row ("note").
* onnxruntime float16 MultiHeadAttention / GroupQueryAttention on the CPU EP (onnxruntime 1.32
              has both kernels); bfloat16 is tried and the CPU EP rejects it (NOT_IMPLEMENTED):
              the row is recorded as skipped, "no CPU kernel".
* numpy       skipped for 16-bit: NumPy has no 16-bit GEMM (float16 matmul is a scalar loop,
              ml_dtypes.bfloat16 matmul a generic object-style loop), so it would measure NumPy's
              fallback, not a 16-bit attention.

16-bit limits: the GEMM limit of a 16-bit dtype is the best of torch.mm on (gemm_n)^2 tensors of
that dtype and the float32 GEMM (converting tiles to float32 is always available, so no 16-bit
row is held to a bar below float32's); the limits table shows each source. Decode GB/s counts
the bytes of the stored dtype: B * Hkv * L * (D + Dv) * itemsize (2 for 16-bit).

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
# Max |error| of a 16-bit output against the float64 reference of the same rounded inputs
# (outputs are O(1)): bfloat16 keeps 8 significant bits (output rounding alone is up to ~4e-3 for
# |out| ~ 2), float16 11 bits (~1e-3).
TOLERANCES = {"float32": TOLERANCE, "bfloat16": 3e-2, "float16": 3e-3}
DTYPES = tuple(TOLERANCES)


def parse_dtype_list(text: str) -> list[str]:
    """--dtype: a comma list of float32, bfloat16, float16 (in the order given, no repeats)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if part not in DTYPES:
            raise argparse.ArgumentTypeError(
                f"--dtype: unknown {part!r}; choose from {', '.join(DTYPES)}")
        if part not in out:
            out.append(part)
    if not out:
        raise argparse.ArgumentTypeError("--dtype: empty list")
    return out


def numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class NoKernel(Exception):
    """The peer has no kernel for this dtype on this device: the row is recorded as skipped."""


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
        """FLOPs (prefill) or bytes (decode) that set the rate, for float32."""
        return self.work_for(4)

    def work_for(self, itemsize: int) -> int:
        """FLOPs (prefill) or bytes of the stored dtype (decode) that set the rate."""
        if self.kind == "prefill":
            return ab.attention_flops(self.b, self.h, self.tq, self.tk, self.d, self.dv, self.causal)
        return ab.decode_bytes(self.b, self.hkv, self.tk, self.d, self.dv, itemsize)


# ----------------------------------------------------------------------------- engines
# Each engine's prepare(case, arrays, threads) does all untimed work (layout copies, graph
# building, compiling) and returns (run, output): run() is what is timed, output() returns the
# last result as a (B, H, Tq, Dv) NumPy array. arrays are q, k, v of one dtype (float32,
# ml_dtypes.bfloat16 or float16); dtype_skip(name) gives the reason an engine cannot run a dtype
# at all (None: it can), and prepare raises NoKernel when the peer rejects the dtype itself.

class AttnfastEngine:
    name = "attnfast"

    def available(self):
        return None

    def version(self):
        cfg = af._runtime.config()
        return f"{cfg['version']} ({cfg['isa']})"

    def dtype_skip(self, dtype):
        return None

    def prepare(self, case, arrays, threads):
        q, k, v = arrays
        box = [None]
        if case.kind == "decode":
            # The decode API over caller-owned arrays: attend over all L cached keys.
            seqlens = np.full(case.b, case.tk, dtype=np.int64)

            def run():
                box[0] = af.attention_with_kvcache(q, k, v, seqlens, num_threads=threads)
        else:
            out = np.empty((case.b, case.h, case.tq, case.dv), q.dtype)

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

    def dtype_skip(self, dtype):
        return None

    @staticmethod
    def _tensor(a):
        import torch
        if a.dtype.name == "bfloat16":  # torch.from_numpy knows no ml_dtypes: share the bits
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    @staticmethod
    def _numpy(t):
        import torch
        # bfloat16 -> float32 is exact; the accuracy check sees the values torch produced
        return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()

    def prepare(self, case, arrays, threads):
        import torch
        import torch.nn.functional as F
        torch.set_num_threads(threads)
        q, k, v = (self._tensor(a) for a in arrays)
        box = [None]
        if self.fold:
            g = case.h // case.hkv
            qf = q.reshape(case.b, case.hkv, g * case.tq, case.d)

            def run():
                box[0] = F.scaled_dot_product_attention(qf, k, v)

            return run, lambda: self._numpy(box[0].reshape(case.b, case.h, case.tq, case.dv))
        # torch's is_causal is top-left aligned; identical to attnfast's for Tq == Tk, and a
        # single decode query sees every key, so it needs no mask at all.
        causal = case.causal and case.tq > 1
        gqa = case.h != case.hkv

        def run():
            box[0] = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        return run, lambda: self._numpy(box[0])


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

    def dtype_skip(self, dtype):
        return None

    @staticmethod
    def _precision(dtype):
        """(input element type, INFERENCE_PRECISION_HINT) for a dtype name; see the docstring."""
        import openvino as ov
        if dtype == "bfloat16":
            return ov.Type.bf16, "bf16"
        if dtype == "float16":
            has_fp16 = "FP16" in _ov_core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
            return ov.Type.f16, "f16" if has_fp16 else "f32"
        return ov.Type.f32, "f32"

    def prepare(self, case, arrays, threads):
        import openvino as ov
        import openvino.opset13 as ops
        q, k, v = arrays
        dtype = q.dtype.name
        g = case.h // case.hkv
        if case.kind == "decode" and g > 1:
            q = q.reshape(case.b, case.hkv, g * case.tq, case.d)  # fold: exact for Tq == 1
        elif g > 1:
            raise NotImplementedError("GQA prefill is not wired for openvino")
        causal = case.causal and case.tq > 1
        element, hint = self._precision(dtype)
        params = [ops.parameter(list(a.shape), element, name=n) for n, a in zip("qkv", (q, k, v))]
        sdpa = ops.scaled_dot_product_attention(*params, causal=causal)
        model = ov.Model([sdpa.output(0)], params, "sdpa")
        compiled = _ov_core().compile_model(model, "CPU", {
            "INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": hint,
            "PERFORMANCE_HINT": "LATENCY"})
        request = compiled.create_infer_request()
        keep = tuple(np.ascontiguousarray(a) for a in (q, k, v))  # the shared tensors point here
        for i, a in enumerate(keep):
            if dtype == "bfloat16":  # ov.Tensor knows no ml_dtypes: share the bits as bf16
                tensor = ov.Tensor(a.view(np.uint16), a.shape, ov.Type.bf16)
            else:
                tensor = ov.Tensor(a, shared_memory=True)
            request.set_input_tensor(i, tensor)

        def output():
            _ = keep  # the shared buffers must outlive the timing
            data = request.get_output_tensor(0).data
            if dtype == "bfloat16":  # .data of a bf16 tensor comes as float16: reinterpret
                data = data.view(np.uint16).view(q.dtype)
            return data.reshape(case.b, case.h, case.tq, case.dv).copy()

        self.note = f"hint {hint}, SDPA runs {_ov_sdpa_precision(compiled)}"
        return request.infer, output


def _ov_sdpa_precision(compiled) -> str:
    """The runtime precision of the compiled model's SDPA node(s) (what OpenVINO really ran)."""
    found = []
    for op in compiled.get_runtime_model().get_ordered_ops():
        rt = op.get_rt_info()
        if "ScaledDotProductAttention" in op.get_friendly_name() and "runtimePrecision" in rt:
            found.append(rt["runtimePrecision"].astype(str))
    return "/".join(dict.fromkeys(found)) or "?"


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
        try:
            return ort.InferenceSession(model.SerializeToString(), so,
                                        providers=["CPUExecutionProvider"])
        except Exception as exc:
            # The CPU EP registers these contrib ops per element type; a missing one is
            # NOT_IMPLEMENTED ("Could not find an implementation for ...").
            if "NOT_IMPLEMENTED" in str(exc) or "Could not find an implementation" in str(exc):
                raise NoKernel(f"no CPU kernel: {node.op_type} in "
                               f"{_onnx_type_name(inputs[0].type.tensor_type.elem_type)}") from None
            raise

    def dtype_skip(self, dtype):
        return None  # tried per shape: the CPU EP's own answer is the skip reason

    def prepare(self, case, arrays, threads):
        import onnxruntime as ort
        from onnx import TensorProto, helper
        q, k, v = arrays
        f32 = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16,
               "bfloat16": TensorProto.BFLOAT16}[q.dtype.name]  # the element type of q, k, v, out
        i32 = TensorProto.INT32
        info = helper.make_tensor_value_info
        b, h, hkv, d, dv = case.b, case.h, case.hkv, case.d, case.dv

        def bsh(x):  # (B, N, S, D) -> (B, S, N*D), the layout these ops take
            return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1))

        out = np.empty((b, case.tq, h * dv), q.dtype)
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


def _onnx_type_name(elem_type: int) -> str:
    from onnx import TensorProto
    return TensorProto.DataType.Name(elem_type).lower()


class NumpyEngine:
    name = "numpy"

    def available(self):
        return None

    def dtype_skip(self, dtype):
        if dtype != "float32":
            return ("no 16-bit GEMM in NumPy (float16 / ml_dtypes.bfloat16 matmul are scalar "
                    "fallback loops): not a 16-bit attention peer")
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
                   settle: float, dtypes=("float32",)) -> dict:
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
        gemm["torch"] = 2 * gemm_n ** 3 / min(times) / 1e9
    best = max(gemm, key=gemm.get) if gemm else None
    # 16-bit GEMM limits: torch.mm on tensors of that dtype, or the float32 GEMM if faster
    # (a kernel can always widen tiles to float32, so no 16-bit row gets a lower bar).
    extra = {}
    for name in dtypes:
        if name == "float32":
            continue
        cands = {}
        if use_torch:
            import torch
            tdt = getattr(torch, name)
            time.sleep(settle)
            # A probe first: torch's float16 mm on a CPU without FP16 arithmetic is a slow
            # fallback (~1 GFLOP/s on Zen 4), which at gemm_n = 2048 would take minutes.
            for size in dict.fromkeys((min(256, gemm_n), gemm_n)):
                a = torch.randn(size, size).to(tdt)
                b = torch.randn(size, size).to(tdt)
                c = torch.empty(size, size, dtype=tdt)
                times = ab.time_call(lambda: torch.mm(a, b, out=c), budget=0.0, min_repeats=3)
                rate = 2 * size ** 3 / min(times) / 1e9
                if size == gemm_n:
                    cands[f"torch {name}"] = rate
                elif best and rate < 0.25 * gemm[best]:
                    cands[f"torch {name} (n={size})"] = rate  # far below float32: stop here
                    break
        if best:
            cands[f"float32 {best}"] = gemm[best]
        extra[name] = cands
    return limits_from(bw["kernels"], gemm, extra)


def limits_from(read_kernels: dict, gemm: dict, dtype_gemm: dict) -> dict:
    """One thread count's limits from each source's reading (GB/s by read kernel, GFLOP/s by
    GEMM source, and per 16-bit dtype its GEMM candidates): each limit is its best source."""
    def top(rates: dict):
        name = max(rates, key=rates.get) if rates else None
        return (rates[name] if name else None), name

    limits = {"read_kernels": read_kernels, "gemm": gemm}
    limits["read_gbps"], limits["read_kernel"] = top(read_kernels)
    limits["gemm_gflops"], limits["gemm_source"] = top(gemm)
    if dtype_gemm:
        limits["dtype_gemm"] = {}
        for name, cands in dtype_gemm.items():
            rate, source = top(cands)
            limits["dtype_gemm"][name] = {"gemm_gflops": rate, "gemm_source": source, "gemm": cands}
    return limits


def best_limits(first: dict, second: dict) -> dict:
    """The limits of two measurements of the same thread count, each source at its better one:
    a limit is the best the machine does, and one measurement can land in a slow minute of a
    shared machine (then results read above 100 %)."""
    def best(a: dict, b: dict) -> dict:
        return {k: max(x for x in (a.get(k), b.get(k)) if x is not None) for k in {**a, **b}}

    dtypes = first.get("dtype_gemm", {})
    second_dtypes = second.get("dtype_gemm", {})
    out = limits_from(best(first["read_kernels"], second["read_kernels"]),
                      best(first["gemm"], second["gemm"]),
                      {name: best(lim["gemm"], second_dtypes.get(name, {}).get("gemm", {}))
                       for name, lim in dtypes.items()})
    out["measured"] = 2
    return out


def gemm_limit(lim: dict, dtype: str):
    """The GEMM GFLOP/s a prefill row of ``dtype`` is measured against (None: not measured)."""
    if dtype == "float32":
        return lim["gemm_gflops"]
    return lim.get("dtype_gemm", {}).get(dtype, {}).get("gemm_gflops")


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
    p.add_argument("--dtype", type=parse_dtype_list, default=["float32"],
                   help="comma list of float32 (default), bfloat16, float16: one set of rows "
                        "per dtype, on the same (rounded) inputs")
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
    dtypes = args.dtype
    if any(d != "float32" for d in dtypes):
        try:
            import ml_dtypes  # noqa: F401
        except ImportError:
            if "bfloat16" in dtypes:
                parser.error("--dtype bfloat16 needs ml_dtypes (pip install ml_dtypes)")
    # (engine, dtype) pairs an engine cannot run at all, with the reason
    def dtype_skip(engine, dtype):  # an engine without dtype_skip runs float32 only
        ask = getattr(engine, "dtype_skip", None)
        if ask is None:
            return None if dtype == "float32" else "not wired for 16-bit inputs"
        return ask(dtype)

    dtype_skipped = {e.name: {d: dtype_skip(e, d) for d in dtypes if dtype_skip(e, d)}
                     for e in engines}
    dtype_skipped = {k: v for k, v in dtype_skipped.items() if v}

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
        "attnfast_16bit": af._runtime.config().get("lowp_instructions"),
        "skipped": skipped,
        "dtypes": dtypes,
        "tolerances": {d: TOLERANCES[d] for d in dtypes},
        "dtype_skipped": dtype_skipped,
        "isa_env": {k: os.environ.get(k) for k in (
            "ATTNFAST_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
            "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if os.environ.get(k) is not None},
    }
    if os.environ.get("OPENBLAS_CORETYPE"):
        print("warning: OPENBLAS_CORETYPE is set; NumPy's GEMM (a machine-limit candidate and the "
              "numpy peer) may be slower than this CPU allows. For the record run: "
              "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/compare_peers.py ...",
              file=sys.stderr)

    def runs(engine, case, dtype):
        return (getattr(engine, "applies", lambda _: True)(case)
                and dtype not in dtype_skipped.get(engine.name, {}))

    steps = len(threads_list) * (2 + sum(
        1 for c in cases for d in dtypes for e in engines if runs(e, c, d)))
    progress = ab.Progress(steps, enabled=not args.no_progress)
    rng = np.random.default_rng(args.seed)
    limits, results = {}, []
    for n in threads_list:
        progress.step(f"machine limits, {n} thread(s)")
        time.sleep(args.settle)
        limits[n] = measure_limits(n, args.bandwidth_mib * ab.MIB, args.gemm_n, have_torch,
                                   args.settle, dtypes)
        for case in cases:
            q32 = rng.standard_normal((case.b, case.h, case.tq, case.d), dtype=np.float32)
            k32 = rng.standard_normal((case.b, case.hkv, case.tk, case.d), dtype=np.float32)
            v32 = rng.standard_normal((case.b, case.hkv, case.tk, case.dv), dtype=np.float32)
            rows = sample_rows(case.tq)
            for dtype in dtypes:
                # the same inputs rounded once to the dtype (untimed); the reference uses these
                ndt = numpy_dtype(dtype)
                q, k, v = ((q32, k32, v32) if dtype == "float32"
                           else tuple(a.astype(ndt) for a in (q32, k32, v32)))
                tolerance = TOLERANCES[dtype]
                tag = "" if dtypes == ["float32"] else f" {dtype}"
                for engine in engines:
                    if not runs(engine, case, dtype):
                        continue
                    progress.step(f"{case.kind} {case.label}{tag}, {engine.name}, {n} thread(s)")
                    entry = {"kind": case.kind, "case": case.label, "threads": n,
                             "engine": engine.name, "shape": case.__dict__.copy(),
                             "work": case.work_for(ndt.itemsize), "dtype": dtype}
                    engine.note = None
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
                                     rate=entry["work"] / ab.median(times) / 1e9,
                                     max_abs_error=err, ok=bool(err <= tolerance))
                        if engine.note:
                            entry["note"] = engine.note
                    except NoKernel as exc:  # the peer itself says it has no kernel for the dtype
                        entry.update(skipped=str(exc)[:200])
                    except Exception as exc:  # a peer that cannot run a shape is reported, not fatal
                        entry.update(error=f"{type(exc).__name__}: {exc}"[:200])
                    results.append(entry)
                    run = output = None
        # Measured again after this thread count's engines: each source at its better reading.
        progress.step(f"machine limits again, {n} thread(s)")
        time.sleep(args.settle)
        limits[n] = best_limits(limits[n], measure_limits(n, args.bandwidth_mib * ab.MIB, args.gemm_n,
                                                          have_torch, args.settle, dtypes))
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
        self.dtypes = list(meta.get("dtypes", ["float32"]))
        # A float32-only run renders exactly as before --dtype existed.
        self.multi = self.dtypes != ["float32"]

    def _table(self, headers, rows, markdown):
        return ab.format_markdown_table(headers, rows) if markdown else ab.format_table(headers, rows)

    def _get(self, kind, case, threads, engine, dtype="float32"):
        for r in self.results:
            if ((r["kind"], r["case"], r["threads"], r["engine"], r.get("dtype", "float32"))
                    == (kind, case, threads, engine, dtype)):
                return r
        return None

    def _limit(self, kind, threads, dtype):
        lim = self.limits[threads]
        return gemm_limit(lim, dtype) if kind == "prefill" else lim["read_gbps"]

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
        if self.multi:
            out.append("dtypes: " + ", ".join(self.dtypes))
            if m.get("attnfast_16bit"):
                out.append(f"attnfast 16-bit kernels: {m['attnfast_16bit']}")
        for name, whys in m.get("dtype_skipped", {}).items():
            for dtype, why in whys.items():
                out.append(f"skipped {name} in {dtype}: {why}")
        no_kernel = {}
        for r in self.results:
            if "skipped" in r:
                no_kernel.setdefault((r["engine"], r["dtype"]), {})[r["skipped"]] = None
        for (name, dtype), whys in no_kernel.items():
            out.append(f"skipped {name} in {dtype}: {'; '.join(whys)}")

        out.append(f"\n{h2}Machine limits, measured in this run")
        if any(lim.get("measured") == 2 for lim in self.limits.values()):
            out.append("each source's best reading, before and after the engines of its thread count")
        extra = [d for d in self.dtypes if d != "float32"]
        rows = []
        for n, lim in self.limits.items():
            reads = ", ".join(f"{k} {v:.1f}" for k, v in lim["read_kernels"].items())
            gemms = ", ".join(f"{k} {v:.1f}" for k, v in lim["gemm"].items())
            row = [n, f"{lim['read_gbps']:.1f}", reads,
                   f"{lim['gemm_gflops']:.1f}" if lim["gemm_gflops"] else "n/a"]
            for d in extra:
                g = gemm_limit(lim, d)
                row.append(f"{g:.1f}" if g else "n/a")
                gemms += "".join(f", {k} {v:.1f}" for k, v in
                                 lim.get("dtype_gemm", {}).get(d, {}).get("gemm", {}).items()
                                 if not k.startswith("float32"))
            rows.append(row + [gemms])
        out.append(self._table(["threads", "read GB/s", "read kernels (GB/s)",
                                "GEMM GFLOP/s" if not extra else "float32 GEMM GFLOP/s"]
                               + [f"{d} GEMM GFLOP/s" for d in extra] + ["GEMM sources"],
                               rows, markdown))
        if extra:
            out.append("A 16-bit GEMM limit is the best of torch.mm in that dtype and the float32 "
                       "GEMM.")

        for dtype in self.dtypes:
            out.extend(self._kind_tables(dtype, llc, h2, markdown))

        out.append(self.targets(markdown))
        if self.multi:
            out.append(self.targets_16bit(markdown))

        if self.multi:
            tol = ", ".join(f"{d} {TOLERANCES[d]:g}" for d in self.dtypes)
        else:
            tol = f"{TOLERANCE:g}"
        out.append(f"\n{h2}Every engine: median time, rate, % of the machine limit, max |error| vs "
                   f"the float64 reference (sampled rows; tolerance {tol})")
        rows = []
        for r in self.results:
            dtype = r.get("dtype", "float32")
            lim = self._limit(r["kind"], r["threads"], dtype)
            head = [r["kind"], r["case"], r["threads"], r["engine"]] + ([dtype] if self.multi else [])
            tail = [r.get("note", "")] if self.multi else []
            if "median_s" in r:
                rows.append(head + [ab.fmt_time(r["median_s"]),
                             f"{r['rate']:.1f} {'GFLOP/s' if r['kind'] == 'prefill' else 'GB/s'}",
                             f"{100 * r['rate'] / lim:.0f}%" if lim else "n/a",
                             f"{r['max_abs_error']:.1e}" + ("" if r["ok"] else " FAIL")] + tail)
            elif "skipped" in r:
                rows.append(head + ["skipped", r["skipped"], "", ""] + tail)
            else:
                rows.append(head + ["error", r["error"], "", ""] + tail)
        out.append(self._table(["kind", "shape", "thr", "engine"] + (["dtype"] if self.multi else [])
                               + ["time", "rate", "% limit", "max err"]
                               + (["note"] if self.multi else []), rows, markdown))
        return "\n".join(out)

    def _kind_tables(self, dtype, llc, h2, markdown) -> list[str]:
        """The prefill and decode tables of one dtype: attnfast's rate and its speedup over peers."""
        m = self.meta
        out = []
        skipped_here = m.get("dtype_skipped", {})
        peers = [p for p in self.peers if dtype not in skipped_here.get(p, {})]
        itemsize = numpy_dtype(dtype).itemsize if dtype != "float32" else 4
        for kind, unit in (("prefill", "GFLOP/s"), ("decode", "GB/s")):
            cases = list(dict.fromkeys(r["case"] for r in self.results if r["kind"] == kind
                                       and r.get("dtype", "float32") == dtype))
            if not cases:
                continue
            limit_name = (f"measured {dtype} GEMM" if self.multi else "measured GEMM")
            what = (f"useful FLOPs (half the square when causal) per second; % of {limit_name}"
                    if kind == "prefill" else
                    f"K+V bytes read per step (B*Hkv*L*(D+Dv)*{itemsize}) per second; % of measured "
                    f"read bandwidth; one query token")
            title = f"{kind.capitalize()}" + (f", {dtype}" if self.multi else "")
            out.append(f"\n{h2}{title}: attnfast {unit}, and attnfast's speedup over "
                       f"each peer (peer time / attnfast time; >1 = attnfast faster)")
            out.append(f"{what}")
            headers = ["shape", "thr", "attnfast", unit, "% limit"] + peers + ["best peer"]
            rows = []
            for n in self.limits:
                for c in cases:
                    a = self._get(kind, c, n, "attnfast", dtype)
                    if a is None:
                        continue
                    lim = self._limit(kind, n, dtype)
                    if "median_s" in a:
                        flag = " *" if kind == "decode" and a["work"] <= llc else ""
                        row = [c, n, ab.fmt_time(a["median_s"]) + ("" if a["ok"] else " WRONG"),
                               f"{a['rate']:.1f}",
                               (f"{100 * a['rate'] / lim:.0f}%" if lim else "n/a") + flag]
                    else:
                        row = [c, n, "error", "", ""]
                    best = None
                    for p in peers:
                        r = self._get(kind, c, n, p, dtype)
                        if r is None:
                            row.append("-")
                        elif "skipped" in r:
                            row.append("no kernel")
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
                                        and r.get("dtype", "float32") == dtype
                                        for r in self.results):
                out.append(f"\n\\* the K/V bytes fit in the last-level cache "
                           f"({m['last_level_cache_mib']} MiB): read from cache, not DRAM, so the "
                           f"fraction of DRAM read bandwidth can pass 100%.")
        return out

    @staticmethod
    def _summarise(checks, title, table, markdown) -> str:
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
        return f"\n{h2}{title}\n" + table(["target", "shapes met", "missed (value)"], rows, markdown)

    def targets(self, markdown: bool) -> str:
        """The issue's float32 targets, met or missed, shape by shape (attnfast rows only)."""
        checks = []  # (target, shape label, threads, value text, met)
        for a in self.results:
            if (a["engine"] != "attnfast" or "median_s" not in a
                    or a.get("dtype", "float32") != "float32"):
                continue
            n, lim = a["threads"], self.limits[a["threads"]]
            peers = [r for r in self.results if r["engine"] != "attnfast" and r.get("ok")
                     and r.get("dtype", "float32") == "float32"
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
        return self._summarise(checks, "Targets (issue 4, float32)", self._table, markdown)

    def targets_16bit(self, markdown: bool) -> str:
        """Issue 7's bfloat16 targets, met or missed, shape by shape (attnfast rows only)."""
        checks = []
        for a in self.results:
            if a["engine"] != "attnfast" or "median_s" not in a or a.get("dtype") != "bfloat16":
                continue
            n, kind = a["threads"], a["kind"]
            same = (kind, a["case"], n)

            def peer(engine, dtype="bfloat16"):
                for r in self.results:
                    if (r["engine"] == engine and r.get("dtype", "float32") == dtype
                            and (r["kind"], r["case"], r["threads"]) == same
                            and "median_s" in r and r.get("ok")):
                        return r
                return None

            gemm = gemm_limit(self.limits[n], "bfloat16")
            if kind == "prefill" and a["shape"]["tq"] >= 1024 and gemm:
                frac = a["rate"] / gemm
                checks.append(("bf16 prefill >= 85% of bf16 GEMM (T >= 1024)", a["case"], n,
                               f"{100 * frac:.0f}%", frac >= 0.85))
            ov = peer("openvino")
            if kind == "prefill" and a["shape"]["causal"] and a["shape"]["tq"] >= 1024 and ov:
                ratio = ov["median_s"] / a["median_s"]
                checks.append(("bf16 causal prefill >= 1.5x openvino bf16 (T >= 1024)", a["case"],
                               n, f"{ratio:.2f}x", ratio >= 1.5))
            if kind == "decode" and a["shape"]["tk"] >= 16384:
                frac = a["rate"] / self.limits[n]["read_gbps"]
                checks.append(("bf16 decode >= 85% of read bandwidth (L >= 16k)", a["case"], n,
                               f"{100 * frac:.0f}%", frac >= 0.85))
                f32 = peer("attnfast", "float32")
                if f32:
                    ratio = f32["median_s"] / a["median_s"]
                    checks.append(("bf16 decode step >= 1.8x faster than float32 (L >= 16k)",
                                   a["case"], n, f"{ratio:.2f}x", ratio >= 1.8))
        return self._summarise(checks, "Targets (issue 7, bfloat16)", self._table, markdown)


if __name__ == "__main__":
    sys.exit(main())
