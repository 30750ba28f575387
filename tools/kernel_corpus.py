"""The kernels' output corpus: a fixed, seeded set of attention calls covering every kernel
path, run on every tier this CPU runs, their outputs kept byte for byte.

    python tools/kernel_corpus.py record  [--file build/corpus/kernels.npz]
    python tools/kernel_corpus.py compare [--file build/corpus/kernels.npz] [--tiers avx2,...]

Record once from the code before a change, then compare after it: a refactoring of the
kernel layer that must not move a bit passes only if every case of every tier is
byte-identical; where a change is meant to move last bits, compare prints for each changed
output (#0 out, #1 lse) its largest difference in ulps of the output's largest magnitude. The cases cover prefill (Tq > 16) and decode (Tq <= 16) for float32,
float64, float16 and bfloat16; float32 q over float16 / bfloat16 / int8 caches and 16-bit q
over int8; GQA and MQA; Dv != D, odd D and the head dims the SIMD kernels specialise; causal,
window, query_offset, softcap, ALiBi, sinks, bool and additive masks; paged caches, varlen
and return_lse; long caches split into several decode chunks.
"""
from __future__ import annotations

import argparse
import os
import sys
import zlib

import ml_dtypes
import numpy as np

import attnfast
from attnfast import _ext
from attnfast._formats import BFLOAT16
from attnfast._formats import quantize_int8

F32, F64, F16 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)
DEFAULT_FILE = os.path.join("build", "corpus", "kernels.npz")


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))  # seeded by the case's name


def _randn(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _options(rng, opts: dict, B, H, Tq, Tk):
    """attention()'s keyword arguments for the option names in `opts`."""
    kw = {}
    for name, value in opts.items():
        if name in ("causal", "window", "query_offset", "softcap", "return_lse"):
            kw[name] = value
        elif name == "alibi":
            kw["alibi_slopes"] = rng.uniform(0.01, 0.3, (H,)).astype(F32)
        elif name == "sinks":
            kw["sinks"] = rng.standard_normal(H).astype(F32)
        elif name == "bool_mask":
            kw["mask"] = rng.random((B, 1, Tq, Tk)) > 0.3
        elif name == "add_mask":
            kw["mask"] = (rng.standard_normal((1, H, Tq, Tk)) * value).astype(F32)
        elif name == "add_mask64":
            kw["mask"] = rng.standard_normal((B, H, 1, Tk)) * value
        else:
            raise KeyError(name)
    return kw


def _outputs(result):
    return list(result) if isinstance(result, tuple) else [result]


def dense_case(name, *, B=1, H=4, Hkv=4, Tq=70, Tk=150, D=64, Dv=None, dtype=F32,
               kv_dtype=None, **opts):
    """attention() on contiguous float inputs, or (int8 kv_dtype) attention_with_kvcache."""
    def run():
        rng = _rng(name)
        dv = D if Dv is None else Dv
        kvd = dtype if kv_dtype is None else kv_dtype
        q = _randn(rng, (B, H, Tq, D), dtype)
        kw = _options(rng, opts, B, H, Tq, Tk)
        if kvd == np.int8:
            k8, ks = quantize_int8(_randn(rng, (B, Hkv, Tk, D), F32))
            v8, vs = quantize_int8(_randn(rng, (B, Hkv, Tk, dv), F32))
            kw.setdefault("causal", False)
            return _outputs(attnfast.attention_with_kvcache(
                q, k8, v8, Tk, k_scale=ks, v_scale=vs, num_threads=2, **kw))
        k = _randn(rng, (B, Hkv, Tk, D), kvd)
        v = _randn(rng, (B, Hkv, Tk, dv), kvd)
        return _outputs(attnfast.attention(q, k, v, num_threads=2, **kw))
    return name, run


def cache_case(name, *, B=3, H=8, Hkv=2, Tq=1, capacity=640, D=64, Dv=None, dtype=F32,
               kv_dtype=None, paged=False, block_size=32, new_tokens=0, **opts):
    """attention_with_kvcache over a cache of ragged lengths (cache_seqlens), optionally
    paged (a shuffled block table) and with new tokens written first."""
    def run():
        rng = _rng(name)
        dv = D if Dv is None else Dv
        kvd = dtype if kv_dtype is None else kv_dtype
        lengths = rng.integers(capacity // 3, capacity - new_tokens + 1, B)
        lengths[0] = capacity - new_tokens  # one full
        q = _randn(rng, (B, H, Tq, D), dtype)
        kw = _options(rng, opts, B, H, Tq, capacity)
        kf = _randn(rng, (B, Hkv, capacity, D), F32)
        vf = _randn(rng, (B, Hkv, capacity, dv), F32)
        if kvd == np.int8:
            k, ks = quantize_int8(kf)
            v, vs = quantize_int8(vf)
            kw.update(k_scale=ks, v_scale=vs)
        else:
            k, v = kf.astype(kvd), vf.astype(kvd)
        if new_tokens:
            newd = F32 if kvd == np.int8 else kvd
            kw.update(k_new=_randn(rng, (B, Hkv, new_tokens, D), newd),
                      v_new=_randn(rng, (B, Hkv, new_tokens, dv), newd))
        if paged:
            per_seq = capacity // block_size
            ids = rng.permutation(B * per_seq + 3)
            table = ids[:B * per_seq].reshape(B, per_seq).astype(np.int64)

            def pool(x, scales=False):
                shape = (B * per_seq + 3,) + x.shape[1:2] + (block_size,) + x.shape[3:]
                out = np.zeros(shape, x.dtype)
                for b in range(B):
                    for i in range(per_seq):
                        out[table[b, i]] = x[b, :, i * block_size:(i + 1) * block_size]
                return out
            k, v = pool(k), pool(v)
            if kvd == np.int8:
                kw["k_scale"], kw["v_scale"] = pool(kw["k_scale"]), pool(kw["v_scale"])
            kw["block_table"] = table
        res = _outputs(attnfast.attention_with_kvcache(q, k, v, lengths, num_threads=2, **kw))
        if new_tokens:  # the cache rows written (rounded / quantised) are an output too
            res += [k, v]
        return res
    return name, run


def varlen_case(name, *, H=4, Hkv=2, D=64, dtype=F32, q_lens=(5, 40, 90), k_lens=(30, 40, 200),
                **opts):
    def run():
        rng = _rng(name)
        cq = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
        ck = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int64)
        q = _randn(rng, (cq[-1], H, D), dtype)
        k = _randn(rng, (ck[-1], Hkv, D), dtype)
        v = _randn(rng, (ck[-1], Hkv, D), dtype)
        return _outputs(attnfast.attention_varlen(q, k, v, cq, ck, num_threads=2, **opts))
    return name, run


def cases():
    c = []
    lowp = [("f32", F32), ("f64", F64), ("f16", F16), ("bf16", BFLOAT16)]
    for path, tq, tk in (("prefill", 70, 150), ("decode", 4, 700)):
        for tag, dt in lowp:
            for d in (64, 128, 37, 80):  # the specialised dims, an odd one, one of 16 lanes
                c.append(dense_case(f"{path}/{tag}/D{d}", Tq=tq, Tk=tk, D=d, dtype=dt,
                                    causal=True, return_lse=True))
            c.append(dense_case(f"{path}/{tag}/gqa_dv", H=8, Hkv=2, Tq=tq, Tk=tk, D=64, Dv=32,
                                dtype=dt))
            c.append(dense_case(f"{path}/{tag}/mqa_odd", H=6, Hkv=1, Tq=tq, Tk=tk, D=33, Dv=48,
                                dtype=dt, return_lse=True))
            c.append(dense_case(f"{path}/{tag}/window", Tq=tq, Tk=tk, dtype=dt, causal=True,
                                window=(50, 0)))
            c.append(dense_case(f"{path}/{tag}/softcap_alibi", Tq=tq, Tk=tk, dtype=dt,
                                softcap=5.0, alibi=True, causal=True, return_lse=True))
            c.append(dense_case(f"{path}/{tag}/sinks", H=8, Hkv=2, Tq=tq, Tk=tk, dtype=dt,
                                sinks=True, causal=True, return_lse=True))
            c.append(dense_case(f"{path}/{tag}/bool_mask", Tq=tq, Tk=tk, dtype=dt,
                                bool_mask=True, return_lse=True))
            c.append(dense_case(f"{path}/{tag}/add_mask", Tq=tq, Tk=tk, dtype=dt, add_mask=2.0,
                                sinks=True))
            c.append(dense_case(f"{path}/{tag}/add_mask64_offset", Tq=tq, Tk=tk, dtype=dt,
                                add_mask64=1.0, causal=True, query_offset=tk // 3))
        for kv_tag, q_dt, kv_dt in (("f32q_f16kv", F32, F16), ("f32q_bf16kv", F32, BFLOAT16),
                                    ("f32q_i8kv", F32, np.int8), ("f16q_i8kv", F16, np.int8),
                                    ("bf16q_i8kv", BFLOAT16, np.int8)):
            for d in (64, 128, 37):
                c.append(dense_case(f"{path}/{kv_tag}/D{d}", H=8, Hkv=2, Tq=tq, Tk=tk, D=d,
                                    dtype=q_dt, kv_dtype=kv_dt, causal=True, return_lse=True))
            c.append(dense_case(f"{path}/{kv_tag}/options", Tq=tq, Tk=tk, dtype=q_dt,
                                kv_dtype=kv_dt, softcap=8.0, alibi=True, sinks=True,
                                bool_mask=True, return_lse=True))
    for tq in (1, 16, 40):  # decode: one token, the longest decode query; then prefill
        for tag, dt, kvd in (("f32", F32, None), ("f64", F64, None), ("f16", F16, None),
                             ("bf16", BFLOAT16, None), ("f32q_bf16kv", F32, BFLOAT16),
                             ("f32q_i8kv", F32, np.int8), ("bf16q_i8kv", BFLOAT16, np.int8)):
            for paged in (False, True):
                kind = "paged" if paged else "cache"
                c.append(cache_case(f"{kind}/Tq{tq}/{tag}", Tq=tq, dtype=dt, kv_dtype=kvd,
                                    paged=paged, causal=True, return_lse=True))
            c.append(cache_case(f"paged/Tq{tq}/{tag}/options", Tq=tq, dtype=dt, kv_dtype=kvd,
                                paged=True, new_tokens=2, softcap=6.0, alibi=True,
                                sinks=True, window=(300, 0), return_lse=True))
    # long caches: several decode chunks per (batch, kv head), merged
    for tag, dt, kvd in (("f32", F32, None), ("f64", F64, None), ("bf16", BFLOAT16, None),
                         ("f16q_i8kv", F16, np.int8)):
        c.append(cache_case(f"long/{tag}", B=2, H=8, Hkv=1, Tq=2, capacity=9000, D=128,
                            dtype=dt, kv_dtype=kvd, causal=True, return_lse=True))
        c.append(cache_case(f"long_paged/{tag}/sinks", B=2, H=4, Hkv=2, Tq=1, capacity=6144,
                            D=64, dtype=dt, kv_dtype=kvd, paged=True, block_size=64,
                            sinks=True, return_lse=True))
    for tag, dt in (("f32", F32), ("bf16", BFLOAT16), ("f64", F64)):
        c.append(varlen_case(f"varlen/{tag}", dtype=dt, causal=True, return_lse=True))
        c.append(varlen_case(f"varlen/{tag}/softcap", dtype=dt, softcap=4.0))
    names = [name for name, _ in c]
    assert len(names) == len(set(names)), "case names must be unique"
    return c


class _KernelTally:
    """Counts, per tier, the kernel calls by (path, kernel) as the core's own planner names
    them (attnfast.explain's), so a report shows every kernel the corpus reached. Absent
    from builds without _ext.plan_attention: then nothing is counted."""

    def __init__(self):
        self.counts = {}
        self.tier = None
        self._run = _ext.run_attention

    def __enter__(self):
        if hasattr(_ext, "plan_attention"):
            def run_attention(q, k, v, out, lse, *, interruptible=False, **kwargs):
                plan = _ext.plan_attention(q, k, v, **kwargs)
                key = (plan["path"], plan["kernel"], plan["kv_source"])
                tally = self.counts.setdefault(self.tier, {})
                tally[key] = tally.get(key, 0) + 1
                return self._run(q, k, v, out, lse, interruptible=interruptible, **kwargs)
            _ext.run_attention = run_attention
        return self

    def __exit__(self, *exc):
        _ext.run_attention = self._run

    def report(self, tier):
        tally = self.counts.get(tier)
        if tally:
            print("             kernel calls: " + ", ".join(
                f"{path} {kernel} {source} x{n}" for (path, kernel, source), n in sorted(tally.items())))


def run_all(tiers, tally):
    """{f"{tier}|{case}|{i}": output bytes as uint8} for every tier and case."""
    result = {}
    with tally:
        for tier in tiers:
            _ext.force_isa(tier)  # (ValueError when this CPU cannot run it)
            tally.tier = tier
            for name, run in cases():
                for i, arr in enumerate(run()):
                    result[f"{tier}|{name}|{i}"] = np.frombuffer(
                        np.ascontiguousarray(arr).tobytes(), np.uint8)
                    result[f"{tier}|{name}|{i}|dtype"] = np.array(arr.dtype.name)
    _ext.force_isa("")
    return result


_FLOATS = {"float16": (np.float16, 10), "bfloat16": (ml_dtypes.bfloat16, 7),
           "float32": (np.float32, 23), "float64": (np.float64, 52)}


def ulps(before: np.ndarray, now: np.ndarray, dtype_name: str):
    """How far two recordings of one float output are apart: the largest |difference| in
    ulps of the output's largest finite magnitude (an ulp of each element would make a
    value that cancels to near zero look far off). inf where NaN or inf moved; None when
    the output is not a float array or the sizes differ."""
    if dtype_name not in _FLOATS or before.size != now.size:
        return None
    dtype, mantissa = _FLOATS[dtype_name]
    a = before.view(dtype).astype(np.float64)
    b = now.view(dtype).astype(np.float64)
    finite = np.isfinite(a) & np.isfinite(b)
    if not np.array_equal(np.isfinite(a), np.isfinite(b)) or np.any(a[~finite] != b[~finite]) and \
            not np.array_equal(np.isnan(a), np.isnan(b)):
        return float("inf")
    if not finite.any():
        return 0.0
    top = np.abs(a[finite]).max()
    if top == 0:
        return 0.0 if np.all(b[finite] == 0) else float("inf")
    ulp = 2.0 ** (np.floor(np.log2(top)) - mantissa)
    return float(np.abs(a[finite] - b[finite]).max() / ulp)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("record", "compare"))
    ap.add_argument("--file", default=DEFAULT_FILE)
    ap.add_argument("--tiers", default=None,
                    help="comma-separated tiers (default: every tier this CPU runs)")
    args = ap.parse_args(argv)
    tiers = (args.tiers.split(",") if args.tiers else _ext.runtime_info()["isa_available"])
    print(f"attnfast from {os.path.dirname(attnfast.__file__)}; tiers: {', '.join(tiers)}; "
          f"{len(cases())} cases per tier")
    tally = _KernelTally()
    now = run_all(tiers, tally)
    if args.action == "record":
        os.makedirs(os.path.dirname(args.file) or ".", exist_ok=True)
        np.savez_compressed(args.file, **now)
        print(f"recorded {len(now)} outputs to {args.file}")
        for tier in tiers:
            tally.report(tier)
        return 0
    with np.load(args.file) as saved:
        before = {key: saved[key] for key in saved.files}
    failed = 0
    for tier in tiers:
        keys = [key for key in now if key.startswith(tier + "|") and not key.endswith("|dtype")]
        cases_seen = {key.split("|")[1] for key in keys}
        changed = [key for key in keys if key not in before or not np.array_equal(before[key], now[key])]
        bad = sorted({key.split("|")[1] for key in changed})
        # Per changed case, the largest ulp distance of each output (0: out, 1: lse, ...),
        # where the recording names its dtype (recordings before dtypes were kept: not known).
        distances = {}
        for key in changed:
            name, index = key.split("|")[1:3]
            if key in before and key + "|dtype" in before:
                d = ulps(before[key], now[key], str(before[key + "|dtype"]))
                distances.setdefault(name, []).append(f"#{index} {'?' if d is None else f'{d:.3g}'} ulp")
        missing = sorted({key.split("|")[1] for key in before
                          if key.startswith(tier + "|") and key not in now})
        status = "identical" if not bad and not missing else "DIFFERENT"
        print(f"{tier:>11}: {len(cases_seen) - len(bad)}/{len(cases_seen)} cases "
              f"({len(keys)} arrays) bit-identical: {status}")
        for name in bad + missing:
            print(f"             differs: {name}" +
                  (f" ({', '.join(distances[name])})" if name in distances else ""))
        tally.report(tier)
        failed += len(bad) + len(missing)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
