"""The engines bench/compare_peers.py times: attnfast and its peers, each behind one small
adapter.

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

In 16-bit (``--dtype``), each engine gets the same float32 inputs rounded once to the dtype:

* attnfast    q, k, v as ``ml_dtypes.bfloat16`` / ``numpy.float16`` arrays, out= of that dtype.
              The tier in use is in the version string, and the report's header repeats
              show_config()'s 16-bit line (which instructions each path uses; the
              ``avx512bf16`` tier uses vdpbf16ps for bfloat16 decode and prefill). To compare
              with the widening kernel (bfloat16 loaded and widened to float32 in registers)
              run once more with ``ATTNFAST_ISA=avx512``.
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
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

import attnfast as af
from attnfast.bench.costs import attention_flops, decode_bytes
from attnfast.bench.limits import blas_threads
from attnfast.bench.options import parse_dtypes
from attnfast.bench.report import fmt_len

TOLERANCE = 1e-4  # float32 output vs the float64 reference (outputs are O(1))
# Max |error| of a 16-bit output against the float64 reference of the same rounded inputs
# (outputs are O(1)): bfloat16 keeps 8 significant bits (output rounding alone is up to ~4e-3 for
# |out| ~ 2), float16 11 bits (~1e-3).
TOLERANCES = {"float32": TOLERANCE, "bfloat16": 3e-2, "float16": 3e-3}
DTYPES = tuple(TOLERANCES)


def parse_dtype_list(text: str) -> list[str]:
    """--dtype: a comma list of float32, bfloat16, float16 (in the order given, no repeats)."""
    return [dt.name for dt in parse_dtypes(text, DTYPES)]


class NoKernel(Exception):
    """The peer has no kernel for this dtype on this device: the row is recorded as skipped."""


@dataclass(frozen=True)
class Case:
    """One shape: prefill (Tq == Tk) or a one-token decode step over Tk cached keys."""

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
            return (f"T={fmt_len(self.tq)} D={self.d} H={self.h}"
                    f"{'' if self.h == self.hkv else '/' + str(self.hkv)} "
                    f"{'causal' if self.causal else 'full'}")
        return f"L={fmt_len(self.tk)} H={self.h}/{self.hkv} D={self.d}"

    @property
    def work(self) -> int:
        """FLOPs (prefill) or bytes (decode) that set the rate, for float32."""
        return self.work_for(4)

    def work_for(self, itemsize: int) -> int:
        """FLOPs (prefill) or bytes of the stored dtype (decode) that set the rate."""
        if self.kind == "prefill":
            return attention_flops(self.b, self.h, self.tq, self.tk, self.d, self.dv, self.causal)
        return decode_bytes(self.b, self.hkv, self.tk, self.d, self.dv, itemsize)



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
            with blas_threads(threads) or contextlib.nullcontext():
                s = np.matmul(q5, kt)
                s *= scale
                if bias is not None:
                    s += bias
                s -= s.max(axis=-1, keepdims=True)
                np.exp(s, out=s)
                s /= s.sum(axis=-1, keepdims=True)
                box[0] = np.matmul(s, v5)

        return run, lambda: box[0].reshape(case.b, case.h, case.tq, case.dv)


ENGINES = [AttnfastEngine(), TorchEngine(), TorchFoldEngine(), OpenVINOEngine(),
           OnnxRuntimeEngine(), NumpyEngine()]
