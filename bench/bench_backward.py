"""Backward (and forward+backward) of attnfast against PyTorch's CPU SDPA backward.

    python bench/bench_backward.py --T 1024 4096 --D 64 128 --threads 1 2 --reps 3
    python bench/bench_backward.py --memory 32768     # peak scratch of one backward

Medians of interleaved repetitions (attnfast, torch, attnfast, ...). FLOPs: forward
4 * B * H * Tq * Tk * D (halved under causal), backward 2.5x that (FlashAttention-2's
count); "of GEMM" is the backward's FLOP rate over the best float32 2048^3 matmul of torch
and NumPy on the same threads (best of 7 each, measured once at the start). Also says
whether torch's dq is bit-identical on 1 and 2 threads.
"""
import argparse
import json
import resource
import statistics
import time

import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F

import attnfast


def gemm_flops(threads, dtype):
    """The machine's float32 GEMM limit on `threads` threads: the best of 7 runs of a
    2048^3 matmul in torch and in NumPy's BLAS (whichever is faster on this CPU)."""
    from threadpoolctl import threadpool_limits
    torch.set_num_threads(threads)
    a = torch.randn(2048, 2048, dtype=dtype)
    b = torch.randn(2048, 2048, dtype=dtype)
    an, bn = a.numpy(), b.numpy()
    best = float("inf")
    with threadpool_limits(threads):
        for run in (lambda: a @ b, lambda: an @ bn):
            run()
            for _ in range(7):
                t0 = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - t0)
    return 2 * 2048 ** 3 / best


def numpy_of(t):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def one(T, D, H, causal, dtype, threads, reps):
    torch.manual_seed(0)
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    q, k, v, dout = (torch.randn(1, H, T, D, dtype=tdt) for _ in range(4))
    qn, kn, vn, dn = (numpy_of(x) for x in (q, k, v, dout))
    torch.set_num_threads(threads)
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))

    def af_fwd():
        return attnfast.attention(qn, kn, vn, causal=causal, return_lse=True, num_threads=threads)

    out, lse = af_fwd()

    def af_bwd():
        return attnfast.attention_backward(dn, qn, kn, vn, out, lse, causal=causal,
                                           num_threads=threads)

    def af_both():
        o, l = af_fwd()
        return attnfast.attention_backward(dn, qn, kn, vn, o, l, causal=causal,
                                           num_threads=threads)

    ref = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)

    def pt_bwd():
        return torch.autograd.grad(ref, (qg, kg, vg), dout, retain_graph=True)

    def pt_both():
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        return torch.autograd.grad(o, (qg, kg, vg), dout)

    res = {}
    for name, (fa, fp) in {"bwd": (af_bwd, pt_bwd), "fwd+bwd": (af_both, pt_both)}.items():
        ta, tp = [], []
        fa(), fp()
        for _ in range(reps):
            t0 = time.perf_counter(); fa(); ta.append(time.perf_counter() - t0)
            t0 = time.perf_counter(); fp(); tp.append(time.perf_counter() - t0)
        res[name] = (statistics.median(ta), statistics.median(tp))
    flops_fwd = 4 * H * T * T * D * (0.5 if causal else 1.0)
    res["bwd_gflops"] = 2.5 * flops_fwd / res["bwd"][0] / 1e9
    return res


def torch_thread_invariant(T=1024, D=64, H=8):
    torch.manual_seed(1)
    q, k, v, dout = (torch.randn(1, H, T, D) for _ in range(4))
    bits = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
        bits.append(torch.autograd.grad(o, (qg, kg, vg), dout))
    return all(torch.equal(a, b) for a, b in zip(*bits))


def memory(T, H=8, D=128, causal=True, threads=2):
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, H, T, D), dtype=np.float32) for _ in range(4))
    out, lse = attnfast.attention(q, k, v, causal=causal, return_lse=True, num_threads=threads)
    grads_bytes = 3 * q.nbytes
    with open("/proc/self/statm") as f:
        rss0 = int(f.read().split()[1]) * resource.getpagesize()
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    grads = attnfast.attention_backward(dout, q, k, v, out, lse, causal=causal, num_threads=threads)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del grads
    return dict(T=T, H=H, D=D, causal=causal, seconds=seconds, rss_before_mb=rss0 / 2**20,
                peak_before_mb=peak0 / 2**20, peak_mb=peak / 2**20,
                scratch_mb=(peak - rss0 - grads_bytes) / 2**20)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[1024])
    ap.add_argument("--D", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--causal", nargs="+", default=["0", "1"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--memory", type=int, default=0)
    ap.add_argument("--memory-heads", type=int, default=8)
    args = ap.parse_args()
    if args.memory:
        print(json.dumps(memory(args.memory, H=args.memory_heads)))
        return
    print("torch CPU SDPA backward bit-identical on 1 and 2 threads:", torch_thread_invariant())
    gemm = {t: gemm_flops(t, torch.float32) for t in args.threads}
    for threads in args.threads:
        print(f"GEMM float32 on {threads} thread(s): {gemm[threads] / 1e9:.0f} GFLOP/s")
    print("| T | D | causal | dtype | threads | bwd attnfast ms | bwd torch ms | ratio | fwd+bwd attnfast ms | fwd+bwd torch ms | ratio | bwd GFLOP/s | of GEMM |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for T in args.T:
        for D in args.D:
            for causal in args.causal:
                for dtype in args.dtypes:
                    for threads in args.threads:
                        r = one(T, D, args.H, causal == "1", dtype, threads, args.reps)
                        (ab, pb), (af, pf) = r["bwd"], r["fwd+bwd"]
                        print(f"| {T} | {D} | {causal == '1'} | {dtype} | {threads} | {ab*1e3:.0f} | {pb*1e3:.0f} | "
                              f"{pb/ab:.2f} | {af*1e3:.0f} | {pf*1e3:.0f} | {pf/af:.2f} | "
                              f"{r['bwd_gflops']:.0f} | {r['bwd_gflops'] * 1e9 / gemm[threads]:.0%} |",
                              flush=True)


if __name__ == "__main__":
    main()
