"""A/B: two builds, or two settings of one build, timed in turns in ONE process.

    python bench/ab.py CASE [CASE ...] [--before REF | --before-dir DIR]
                       [--a-isa TIER] [--b-isa TIER] [--threads 1,2] [--rounds 9] [--json PATH]

Side A is the build before (``--before REF``: a git commit or branch, built once into
build/ab/<sha>/ and imported as the package ``attnfast_before``; ``--before-dir DIR``: a
directory already holding ``attnfast_before``), or, without either, the installed build. Side B
is the installed build (the working tree). ``--a-isa`` / ``--b-isa`` force a kernel tier on
each side (default: the best this CPU runs), so one build can be compared with itself at two
tiers. Each extension loads RTLD_LOCAL, so the two builds share no symbols.

Cases (``kind:key=value,...``; sizes take k = 1024):

    decode:H=32,Hkv=8,L=16k,D=128,dtype=bfloat16[,format=int8][,block=16][,Tq=1][,B=1][,Dv=..][,latent=1][,topk=..]
        one KV-cache step (latent=1: an MLA latent cache, V the first Dv elements of each K row,
        e.g. decode:H=128,Hkv=1,D=576,Dv=512,latent=1,L=8k; topk=K: sparse attention over K
        distinct random positions per query row, key_index=, the same on both sides)
        (KVCache.attend, or PagedKVCache.attend with block=), the cache
        holding the same tokens on both sides; format is the cache's dtype (float32,
        bfloat16, float16, int8, float8_e4m3fn, float8_e5m2, int4), dtype that of q. Beside it, attnfast's
        native read kernel over a buffer of the cache's bytes, timed in the same rounds: "% read".
    prefill:T=4k,H=8,Hkv=8,D=128,dtype=float32[,causal=1][,B=1]
        attention(q, k, v); beside it the machine's multiply-add peak for q's dtype, measured in
        the same run (attnfast's native probe): "% peak".

Every round times each side (and the read kernel) over enough calls for ~0.1 s, the order
swapped every round; the table gives medians, B's speed over A's and whether the two outputs
have the same bits. With ``--json`` the rows, the CPU (model and flags) and the tiers are
written as data (bench/results/<machine-date>/, with the command in a run.sh beside them).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import zipfile

import ml_dtypes
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORMATS = {"float32": np.float32, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16,
           "float16": np.float16, "int8": "int8", "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
           "float8_e5m2": ml_dtypes.float8_e5m2, "int4": "int4"}
CASE_DEFAULTS = {
    "decode": {"B": 1, "H": 32, "Hkv": 8, "L": 16384, "D": 128, "Dv": None, "latent": 0, "Tq": 1,
               "dtype": "float32", "format": None, "block": None, "topk": 0},
    "prefill": {"B": 1, "H": 8, "Hkv": 8, "T": 4096, "D": 128, "dtype": "float32", "causal": 0},
}


def parse_case(text: str) -> dict:
    """'decode:H=32,L=16k' -> {'kind': 'decode', 'H': 32, 'L': 16384, ...} (defaults filled)."""
    kind, _, rest = text.partition(":")
    if kind not in CASE_DEFAULTS:
        raise SystemExit(f"case {text!r}: kind must be one of {sorted(CASE_DEFAULTS)}")
    case = dict(CASE_DEFAULTS[kind], kind=kind)
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in case:
            raise SystemExit(f"case {text!r}: unknown key {key!r} (known: {sorted(case)})")
        if key in ("dtype", "format"):
            if value not in FORMATS:
                raise SystemExit(f"case {text!r}: {key} must be one of {sorted(FORMATS)}")
            case[key] = value
        else:
            case[key] = int(value[:-1]) * 1024 if value.endswith("k") else int(value)
    if case.get("format") is None and kind == "decode":
        case["format"] = case["dtype"]
    if kind == "decode" and case["Dv"] is None:
        case["Dv"] = case["D"]
    return case


def case_label(case: dict) -> str:
    skip = ("kind", "format") if case.get("format") == case.get("dtype") else ("kind",)
    return case["kind"] + " " + ",".join(f"{k}={v}" for k, v in case.items()
                                         if k not in skip and v is not None)


def build_before(ref: str) -> str:
    """A directory holding git `ref`'s build as the package attnfast_before (built once)."""
    sha = subprocess.check_output(["git", "-C", ROOT, "rev-parse", ref], text=True).strip()
    home = os.path.join(ROOT, "build", "ab", sha[:12])
    pkg_dir = os.path.join(home, "site")
    if os.path.isdir(os.path.join(pkg_dir, "attnfast_before")):
        return pkg_dir
    tree, wheels = os.path.join(home, "tree"), os.path.join(home, "wheel")
    if not os.path.isdir(tree):
        subprocess.check_call(["git", "-C", ROOT, "worktree", "add", "--detach", tree, sha])
    subprocess.check_call([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation",
                           "--no-deps", "-w", wheels, tree])
    wheel = [f for f in os.listdir(wheels) if f.endswith(".whl")][0]
    unpacked = os.path.join(home, "unpacked")
    with zipfile.ZipFile(os.path.join(wheels, wheel)) as z:
        z.extractall(unpacked)
    os.makedirs(pkg_dir, exist_ok=True)
    shutil.move(os.path.join(unpacked, "attnfast"), os.path.join(pkg_dir, "attnfast_before"))
    return pkg_dir


def timed(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def same_bits(a, b) -> bool:
    a, b = np.ascontiguousarray(np.asarray(a)), np.ascontiguousarray(np.asarray(b))
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


class Side:
    """One side of the comparison: an attnfast module and the tier it runs."""

    def __init__(self, name, module, isa):
        self.name, self.af, self.isa = name, module, isa or ""

    def tier(self) -> str:
        self.af._ext.force_isa(self.isa)
        return self.af._ext.runtime_info()["isa"]

    def call(self, fn):
        def run():
            self.af._ext.force_isa(self.isa)
            return fn()
        return run


def decode_call(side: Side, case: dict, tokens, q, threads: int, index=None):
    """(the timed call, the cache's bytes) for one side's cache holding `tokens` (index: the
    key_index of a sparse case, else None)."""
    af, (k, v) = side.af, tokens
    options = {} if index is None else {"key_index": index}
    fmt = FORMATS[case["format"]]
    shape = dict(v_head_dim=case["Dv"], latent=bool(case["latent"]))
    if case["latent"]:
        v = None  # the values are the first Dv elements of each K row
    if case["block"]:
        per_seq = -(-case["L"] // case["block"])
        cache = af.PagedKVCache(case["B"] * per_seq, case["block"], case["Hkv"], case["D"], dtype=fmt, **shape)
        seqs = [cache.add_sequence() for _ in range(case["B"])]
        cache.append(seqs, k, v)
        fn = lambda: cache.attend(seqs, q, num_threads=threads, **options)
    else:
        cache = af.KVCache(case["B"], case["Hkv"], case["D"], case["L"], dtype=fmt, **shape)
        cache.append(k, v)
        fn = lambda: cache.attend(q, num_threads=threads, **options)
    nbytes = sum(np.asarray(a).nbytes for a in (cache.k, cache.v, cache.k_scale, cache.v_scale)
                 if a is not None and not (a is cache.v and np.shares_memory(cache.k, cache.v)))
    return side.call(fn), nbytes


def run_case(case: dict, a: Side, b: Side, threads: int, rounds: int, rng) -> dict:
    from attnfast import _ext

    act = FORMATS[case["dtype"]]
    row = {"case": case_label(case), "threads": threads, "tier_a": a.tier(), "tier_b": b.tier()}
    if case["kind"] == "decode":
        # (a quantised cache, int or float8, takes float32 tokens and quantises them)
        fmt = FORMATS[case["format"]]
        kv_dtype = fmt if fmt in (np.float32, np.float64, np.float16, ml_dtypes.bfloat16) else np.float32
        shape = (case["B"], case["Hkv"], case["L"])
        tokens = tuple(rng.standard_normal(shape + (d,), dtype=np.float32).astype(kv_dtype)
                       for d in (case["D"], case["Dv"]))
        q = rng.standard_normal((case["B"], case["H"], case["Tq"], case["D"]), dtype=np.float32).astype(act)
        index = None
        if case["topk"]:  # a sparse step reads its selected rows only
            index = np.stack([rng.choice(case["L"], case["topk"], replace=False)
                              for _ in range(case["B"] * case["Tq"])]).astype(np.int32)
            index = index.reshape(case["B"], case["Tq"], case["topk"])
        fa, nbytes = decode_call(a, case, tokens, q, threads, index)
        fb, _ = decode_call(b, case, tokens, q, threads, index)
        if index is not None:
            nbytes = nbytes * case["topk"] // case["L"]
        buf = np.ones(nbytes, dtype=np.uint8)
        fns = {"a": fa, "b": fb, "read": lambda: _ext.read_bytes(buf, threads)}
        row["bytes"] = nbytes
    else:
        T, D = case["T"], case["D"]
        q = rng.standard_normal((case["B"], case["H"], T, D), dtype=np.float32).astype(act)
        k, v = (rng.standard_normal((case["B"], case["Hkv"], T, D), dtype=np.float32).astype(act)
                for _ in range(2))
        causal = bool(case["causal"])
        fns = {s.name: s.call(lambda s=s: s.af.attention(q, k, v, causal=causal, num_threads=threads))
               for s in (a, b)}
        row["flops"] = 4 * case["B"] * case["H"] * T * T * D * (0.5 if causal else 1.0)
    row["same_bits"] = same_bits(fns["a"](), fns["b"]())
    calls = {key: max(1, int(0.1 / max(timed(fn, 1), 1e-7))) for key, fn in fns.items()}
    times = {key: [] for key in fns}
    for r in range(rounds):
        order = list(fns) if r % 2 == 0 else list(fns)[::-1]
        for key in order:
            times[key].append(timed(fns[key], calls[key]))
    med = {key: statistics.median(ts) for key, ts in times.items()}
    row.update(ms_a=med["a"] * 1e3, ms_b=med["b"] * 1e3, b_over_a=med["a"] / med["b"])
    if "read" in med:
        row["read_gbps"] = row["bytes"] / med["read"] / 1e9
        row["pct_read_a"] = 100 * med["read"] / med["a"]
        row["pct_read_b"] = 100 * med["read"] / med["b"]
    else:
        gflops = compute_peak(threads, case["dtype"])
        row["peak_gflops"] = gflops
        row["pct_peak_a"] = 100 * row["flops"] / med["a"] / 1e9 / gflops
        row["pct_peak_b"] = 100 * row["flops"] / med["b"] / 1e9 / gflops
    return row


_PEAKS: dict = {}


def compute_peak(threads: int, dtype: str) -> float:
    """A prefill row's compute limit: the machine's multiply-add peak for q's dtype
    (attnfast.bench.limits.measure_peak; bfloat16: vdpbf16ps where the CPU has it), measured
    once per run. A BLAS GEMM can sit far below the machine (OpenBLAS and torch's float32 GEMM
    on AMD Zen 5: ~110 GFLOP/s, which the float32 prefill passed at 176 %)."""
    from attnfast.bench.limits import measure_peak

    if (threads, dtype) not in _PEAKS:
        _PEAKS[threads, dtype] = measure_peak(threads, bf16=dtype == "bfloat16")
    return _PEAKS[threads, dtype]


def markdown_row(row: dict) -> str:
    limit = ("% read", "pct_read") if "pct_read_a" in row else ("% peak", "pct_peak")
    pa, pb = row.get(limit[1] + "_a"), row.get(limit[1] + "_b")
    pct = lambda x: "-" if x is None else f"{x:.0f} %"
    return (f"| {row['case']} | {row['threads']} | {row['tier_a']} / {row['tier_b']} | "
            f"{row['ms_a']:.3f} | {pct(pa)} | {row['ms_b']:.3f} | {pct(pb)} | "
            f"{row['b_over_a']:.2f}x | {row['same_bits']} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="+", help="decode:... or prefill:... (see the module docstring)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--before", help="git ref built as side A")
    src.add_argument("--before-dir", help="directory holding the package attnfast_before (side A)")
    p.add_argument("--a-isa", default="", help="kernel tier forced on side A")
    p.add_argument("--b-isa", default="", help="kernel tier forced on side B")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--json", help="write the rows and the machine here")
    args = p.parse_args(argv)

    import attnfast
    from attnfast.bench.limits import cpu_flags, cpu_name, load_average

    before_dir = build_before(args.before) if args.before else args.before_dir
    if before_dir:
        sys.path.insert(0, before_dir)
        import attnfast_before as module_a
    else:
        module_a = attnfast
    a, b = Side("a", module_a, args.a_isa), Side("b", attnfast, args.b_isa)
    cases = [parse_case(c) for c in args.cases]
    machine = {"cpu": cpu_name(), "isa_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma"))),
               "load_average": load_average(), "a": before_dir or "installed", "b": "installed",
               "command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:]))}
    print(f"{machine['cpu']} ({' '.join(machine['isa_flags'])}); A = {machine['a']}, B = installed; "
          f"load {machine['load_average']}", flush=True)
    print("| case | threads | tier A / B | A ms | A % limit | B ms | B % limit | B speed / A | same bits |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    rng = np.random.default_rng(0)
    for case in cases:
        for n in [int(x) for x in args.threads.split(",")]:
            rows.append(run_case(case, a, b, n, args.rounds, rng))
            print(markdown_row(rows[-1]), flush=True)
    a.af._ext.force_isa("")
    b.af._ext.force_isa("")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
