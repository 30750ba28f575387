"""The Python-side cost of one decode call: checks, conversion and dispatch, per entry point.

    python bench/bench_overhead.py                      # H=8/2 and 32/8, D=128, L=16
    python bench/bench_overhead.py --heads 32x8 --threads 1 --repeat 31
    # issue 47's tiny shape: one KV head, D = 8, 16 keys, medians of 3,000 single calls
    python bench/bench_overhead.py --heads 1x1 --head-dim 8 --threads 1 --number 1 \
        --repeat 3000 --rounds 1 --no-torch --clock thread

Each entry point runs a decode-shaped problem small enough (B=1, one query token, L=16
cached keys; KVCache.step appends, up to L=31 over a round) that the C++ kernel takes a few
microseconds, and is timed with timeit (the
median over ``--repeat`` rounds of ``--number`` calls, per call). The ``kernel`` row is the
floor: the Cython entry ``attnfast._ext.run_attention`` called directly with arguments
already prepared (its own argument parsing plus the C++ kernel); ``overhead`` is an entry
point's time minus that floor, i.e. what attnfast's Python layer adds to a call.

Rows:
    kernel                      _ext.run_attention, prepared 4-D arrays (the floor)
    kernel, L..L+15             the same over the lengths a KVCache.step round sees (its floor)
    KVCache.step                append one token, attend (numpy inputs); the length grows from
                                L0 over a round and is truncated back between rounds (untimed)
    KVCache.attend              attend only (numpy)
    attention_with_kvcache      caller-owned caches, one new token written at cache_seqlens
                                (the same slot every call, so L stays fixed)
    attention_with_kvcache/ro   the same without new tokens (attend only)
    attention_with_kvcache/ro(out=)  the same into a caller's out (what engines reuse)
    attention_with_kvcache/ro(int)   the same with cache_seqlens a Python int
    attention_with_kvcache/paged     the same over a pool of 8 blocks of 16 (block_table=)
    attention                   attention(q, k, v) with k, v (1, Hkv, L, D), causal
    attention(return_lse)       the same, returning (out, lse)
    attention (L+1 each call)   attention(out=) over new k, v one key longer each call, as
                                transformers' DynamicCache hands them over (L .. L+299: more
                                lengths than the 256 plans a memo keeps, none repeating soon)
    PagedKVCache.attend / .step  one sequence in pools of 8 and 100,000 blocks (step appends,
                                the round's tokens truncated between rounds)
    PagedKVCache.step+truncate  step then truncate back, both timed (a speculative step
                                rejected, or one decode step of a benchmark loop)
    torch: ...                  the same calls with torch tensors in and out
    transformers backend        attnfast.integrations.transformers.attention_forward (decode:
                                query (1, H, 1, D), key/value (1, Hkv, L, D), no mask), as a
                                transformers model calls it in every layer; "(L+1 each call)":
                                key/value one key longer each call, as a DynamicCache grows

With ``--baseline DIR`` every case also runs on another attnfast, imported from DIR (a
directory holding an ``attnfast`` package), interleaved with this one in the same process
(A B A B ..., the best round's median of each): e.g. an older commit's Python files with this
build's extension module copied next to them::

    git archive <commit> src/attnfast | tar -x -C /tmp/base --strip-components=1
    cp src/attnfast/_ext*.so /tmp/base/attnfast/     # (the editable build's: see --help)
    python bench/bench_overhead.py --threads 1 --baseline /tmp/base

Also importable from pytest-benchmark (``bench/test_bench_overhead.py``).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import os
import platform
import statistics
import sys
import time
import timeit

import numpy as np

import attnfast as af
from attnfast import _ext


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _attnfast_modules() -> dict:
    return {k: m for k, m in sys.modules.items() if k == "attnfast" or k.startswith("attnfast.")}


@contextlib.contextmanager
def _as_attnfast(modules: dict):
    """sys.modules' attnfast entries are `modules` inside the block (the lazy imports of a
    case's construction then find that attnfast), and what they were again after it."""
    saved = _attnfast_modules()
    for k in saved:
        del sys.modules[k]
    sys.modules.update(modules)
    try:
        yield
    finally:
        for k in _attnfast_modules():
            del sys.modules[k]
        sys.modules.update(saved)


def import_baseline(path: str) -> dict:
    """The attnfast package in directory `path`, imported beside the running one: its
    modules (sys.modules entries), for _as_attnfast. The editable install's import hook is
    left out while importing, so that `path` is where attnfast comes from."""
    hooks = [f for f in sys.meta_path if "editable" in type(f).__module__]
    for f in hooks:
        sys.meta_path.remove(f)
    sys.path.insert(0, os.path.abspath(path))
    try:
        with _as_attnfast({}):
            base = importlib.import_module("attnfast")
            importlib.import_module("attnfast.integrations.transformers")
            if not os.path.abspath(base.__file__).startswith(os.path.abspath(path)):
                raise SystemExit(f"--baseline {path}: imported attnfast from {base.__file__}")
            return _attnfast_modules()
    finally:
        sys.path.remove(os.path.abspath(path))
        sys.meta_path[0:0] = hooks


POOL_BLOCKS = (8, 100_000)  # the PagedKVCache rows' pool sizes (--pools)


def make_cases(heads: int, kv_heads: int, head_dim: int = 128, length: int = 32,
               capacity: int = 4096, threads: int | None = None, use_torch: bool = True,
               modules: dict | None = None):
    """{name: (call, reset)}: `call()` runs one decode call; `reset()` (untimed, once per round)
    restores state a round changed (the KVCache's length). `modules`: another attnfast's
    (import_baseline) instead of the running one."""
    if modules is not None:
        with _as_attnfast(modules):
            return _make_cases(heads, kv_heads, head_dim, length, capacity, threads, use_torch,
                               modules["attnfast"], modules["attnfast._ext"])
    return _make_cases(heads, kv_heads, head_dim, length, capacity, threads, use_torch, af, _ext)


def _make_cases(heads, kv_heads, head_dim, length, capacity, threads, use_torch, af, _ext):
    rng = np.random.default_rng(0)
    B, H, Hkv, D, L = 1, heads, kv_heads, head_dim, length
    f32 = np.float32
    q = rng.standard_normal((B, H, 1, D), dtype=f32)
    k_tok = rng.standard_normal((B, Hkv, 1, D), dtype=f32)
    v_tok = rng.standard_normal((B, Hkv, 1, D), dtype=f32)
    k_cache = rng.standard_normal((B, Hkv, capacity, D), dtype=f32)
    v_cache = rng.standard_normal((B, Hkv, capacity, D), dtype=f32)
    seqlens = np.full(B, L - 1, dtype=np.int64)
    k_full, v_full = k_cache[:, :, :L].copy(), v_cache[:, :, :L].copy()
    nt = {} if threads is None else {"num_threads": threads}
    n_threads = af.get_num_threads() if threads is None else threads

    cache = af.KVCache(B, Hkv, D, capacity)
    cache.append(k_cache[:, :, :L - 1], v_cache[:, :, :L - 1])

    def reset_cache():
        cache.truncate(L - 1)

    out4 = np.empty((B, H, 1, D), f32)
    lens_after = seqlens + 1
    scale = float(1.0 / np.sqrt(D))  # a Python float, as transformers passes module.scaling

    def kernel():
        _ext.run_attention(q, k_cache, v_cache, out4, None, causal=True, scale=scale,
                           window_left=-1, window_right=-1, num_threads=n_threads,
                           seqlens_k=lens_after)

    # The same over L = length .. length + 15, as KVCache.step sees in a round of 16 calls
    grown = itertools.cycle([seqlens + 1 + i for i in range(16)])

    def kernel_grown():
        _ext.run_attention(q, k_cache, v_cache, out4, None, causal=True, scale=scale,
                           window_left=-1, window_right=-1, num_threads=n_threads,
                           seqlens_k=next(grown))

    def nothing():
        pass

    k_pool = rng.standard_normal((8, Hkv, 16, D), dtype=f32)
    v_pool = rng.standard_normal((8, Hkv, 16, D), dtype=f32)
    table = np.array([[3, 5]] * B, dtype=np.int32)

    # New C-contiguous k, v one key longer each call (a DynamicCache's torch.cat), cycling
    # over more lengths than a plan memo keeps
    growing = [(rng.standard_normal((B, Hkv, n, D), dtype=f32),
                rng.standard_normal((B, Hkv, n, D), dtype=f32)) for n in range(L, L + GROWING)]
    grow = itertools.cycle(growing)

    def attention_grown():
        k, v = next(grow)
        af.attention(q, k, v, causal=True, out=out4, **nt)

    cases = {
        "kernel": (kernel, nothing),
        "kernel, L..L+15": (kernel_grown, nothing),
        "KVCache.step": (lambda: cache.step(q, k_tok, v_tok, **nt), reset_cache),
        "KVCache.attend": (lambda: cache.attend(q, **nt), reset_cache),
        "attention_with_kvcache": (
            lambda: af.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_tok, v_tok, **nt),
            nothing),
        "attention_with_kvcache/ro": (
            lambda: af.attention_with_kvcache(q, k_cache, v_cache, lens_after, **nt), nothing),
        "attention_with_kvcache/ro(out=)": (
            lambda: af.attention_with_kvcache(q, k_cache, v_cache, lens_after, out=out4, **nt),
            nothing),
        "attention_with_kvcache/ro(int)": (  # cache_seqlens a Python int
            lambda: af.attention_with_kvcache(q, k_cache, v_cache, L, **nt), nothing),
        "attention_with_kvcache/paged": (  # block_table=, a pool of 8 blocks of 16
            lambda: af.attention_with_kvcache(q, k_pool, v_pool, lens_after, block_table=table,
                                              **nt), nothing),
        "attention": (lambda: af.attention(q, k_full, v_full, causal=True, **nt), nothing),
        "attention(return_lse)": (
            lambda: af.attention(q, k_full, v_full, causal=True, return_lse=True, **nt), nothing),
        "attention (L+1 each call)": (attention_grown, nothing),
    }
    # A paged pool's per-call cost must not grow with the pool (issue 47): one sequence of
    # L - 1 tokens in pools of 8 and 100,000 blocks of 16.
    for blocks in POOL_BLOCKS:
        pool = af.PagedKVCache(num_blocks=blocks, block_size=16, kv_heads=Hkv, head_dim=D)
        sid = pool.add_sequence()
        pool.append([sid], k_cache[:, :, :L - 1], v_cache[:, :, :L - 1])
        cases[f"PagedKVCache.attend ({blocks} blocks)"] = (
            lambda pool=pool, sid=sid: pool.attend([sid], q, **nt), nothing)
        cases[f"PagedKVCache.step ({blocks} blocks)"] = (
            lambda pool=pool, sid=sid: pool.step([sid], q, k_tok, v_tok, **nt),
            lambda pool=pool, sid=sid: pool.truncate(sid, L - 1))

        def step_truncate(pool=pool, sid=sid):
            pool.step([sid], q, k_tok, v_tok, **nt)
            pool.truncate(sid, L - 1)
        cases[f"PagedKVCache.step+truncate ({blocks} blocks)"] = (step_truncate, nothing)
    if not use_torch:
        return cases
    try:
        import torch
    except ImportError:
        return cases
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k_tok, v_tok))
    tkc, tvc = torch.from_numpy(k_cache), torch.from_numpy(v_cache)
    tkf, tvf = torch.from_numpy(k_full), torch.from_numpy(v_full)
    tseq, tlens = torch.from_numpy(seqlens), torch.from_numpy(lens_after)
    tcache = af.KVCache(B, Hkv, D, capacity)
    tcache.append(k_cache[:, :, :L - 1], v_cache[:, :, :L - 1])
    tout = torch.empty(B, 1, H, D).transpose(1, 2)  # as the transformers backend's out

    def reset_tcache():
        tcache.truncate(L - 1)

    cases.update({
        "torch: KVCache.step": (lambda: tcache.step(tq, tk, tv, **nt), reset_tcache),
        "torch: attention_with_kvcache": (
            lambda: af.attention_with_kvcache(tq, tkc, tvc, tseq, tk, tv, **nt), nothing),
        "torch: attention_with_kvcache/ro(out=)": (
            lambda: af.attention_with_kvcache(tq, tkc, tvc, tlens, out=tout, **nt), nothing),
        "torch: attention(out=)": (
            lambda: af.attention(tq, tkf, tvf, causal=True, out=tout, **nt), nothing),
    })
    try:
        aft = importlib.import_module("attnfast.integrations.transformers")
    except ImportError:
        return cases

    class _Module:  # what attention_forward reads off a transformers attention layer
        is_causal = True

    module = _Module()
    saved = dict(aft._SETTINGS)
    aft._SETTINGS["num_threads"] = threads

    def backend():
        aft.attention_forward(module, tq, tkf, tvf, None, scaling=scale)

    cases["torch: transformers backend"] = (backend, nothing)
    tgrow = itertools.cycle([(torch.from_numpy(k), torch.from_numpy(v)) for k, v in growing])

    def backend_grown():
        tkg, tvg = next(tgrow)
        aft.attention_forward(module, tq, tkg, tvg, None, scaling=scale)

    cases["torch: transformers backend (L+1 each call)"] = (backend_grown, nothing)
    del saved
    return cases


GROWING = 300  # lengths the "(L+1 each call)" rows cycle over

CLOCKS = {"wall": time.perf_counter,
          # CPU time of the calling thread: time other processes take is not counted (with
          # one attnfast thread the kernels run in the calling thread)
          "thread": time.thread_time}


def time_case(call, reset, number: int, repeat: int, clock=time.perf_counter) -> float:
    """Median seconds per call over `repeat` rounds of `number` calls (reset between rounds)."""
    for _ in range(3):
        call()
    reset()
    times = []
    for _ in range(repeat):
        reset()
        times.append(timeit.timeit(call, number=number, timer=clock) / number)
    return statistics.median(times)


def run(heads_list, *, head_dim=128, length=16, number=16, repeat=201, threads=None,
        use_torch=True, rounds=3, clock="wall", baseline=None):
    """{(heads, kv_heads): {name: median µs}}; cases are interleaved `rounds` times (the best
    round's median counts for each case: noise from other processes only adds time). With
    `baseline` (import_baseline's modules) each case also runs on that attnfast, right
    before this one's, under the name "before: <case>"."""
    results = {}
    for H, Hkv in heads_list:
        variants = [("", make_cases(H, Hkv, head_dim, length, threads=threads,
                                    use_torch=use_torch))]
        if baseline is not None:
            variants.insert(0, ("before: ", make_cases(H, Hkv, head_dim, length,
                                                       threads=threads, use_torch=use_torch,
                                                       modules=baseline)))
        names = list(variants[-1][1])
        best = {prefix + name: float("inf") for prefix, _ in variants for name in names}
        for _ in range(rounds):
            for name in names:
                for prefix, cases in variants:
                    call, reset = cases[name]
                    t = time_case(call, reset, number, repeat, CLOCKS[clock])
                    best[prefix + name] = min(best[prefix + name], t * 1e6)
        results[(H, Hkv)] = best
    return results


def format_table(results, length, number, head_dim=128) -> str:
    lines = []
    for (H, Hkv), times in results.items():
        before = any(name.startswith("before: ") for name in times)
        lines.append(f"\nH={H}/Hkv={Hkv}, D={head_dim}, B=1, one query token, L={length} "
                     f"(KVCache.step: L={length}..{length + number - 1})")
        if before:
            lines.append(f"{'entry point':32s} {'before us':>10s} {'(overhead)':>10s} "
                         f"{'after us':>10s} {'(overhead)':>10s}")
            lines.append(f"{'-' * 32} {'-' * 10} {'-' * 10} {'-' * 10} {'-' * 10}")
        else:
            lines.append(f"{'entry point':32s} {'us/call':>9s} {'overhead us':>12s}")
            lines.append(f"{'-' * 32} {'-' * 9} {'-' * 12}")
        for name, t in times.items():
            if name.startswith("before: "):
                continue
            # KVCache.step appends: its kernel reads L .. L+15 keys over a round
            floor_name = "kernel, L..L+15" if name.endswith("KVCache.step") else "kernel"
            cells = []
            for prefix in (("before: ", "") if before else ("",)):
                value, floor = times[prefix + name], times[prefix + floor_name]
                over = "(floor)" if name.startswith("kernel") else f"{value - floor:.2f}"
                cells.append((value, over))
            if before:
                lines.append(f"{name:32s} " + " ".join(f"{v:10.2f} {o:>10s}" for v, o in cells))
            else:
                lines.append(f"{name:32s} {cells[0][0]:9.2f} {cells[0][1]:>12s}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", default="8x2,32x8", help="HxHkv list, e.g. 8x2,32x8")
    p.add_argument("--head-dim", type=int, default=128, help="head dim D (128)")
    p.add_argument("--length", type=int, default=16, help="cached keys L at the start (16)")
    p.add_argument("--number", type=int, default=16, help="calls per timed round (16)")
    p.add_argument("--repeat", type=int, default=201, help="timed rounds; median counts (201)")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved passes over the cases; the best median counts (3)")
    p.add_argument("--threads", type=int, default=None,
                   help="num_threads for every call (default: attnfast.get_num_threads())")
    p.add_argument("--no-torch", action="store_true", help="skip the torch rows")
    p.add_argument("--pools", default="8,100000",
                   help="blocks in the PagedKVCache rows' pools (8,100000; e.g. 8,1000000)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall time (default), or the calling thread's CPU time (use with "
                        "--threads 1 on a busy machine)")
    p.add_argument("--baseline", metavar="DIR", default=None,
                   help="also time the attnfast package in DIR (e.g. an older commit's "
                        "src/attnfast with this build's _ext*.so copied in; the editable "
                        "build's is under build/*/ or attnfast._ext.__file__), interleaved")
    args = p.parse_args(argv)
    global POOL_BLOCKS
    POOL_BLOCKS = tuple(int(x) for x in args.pools.split(","))
    baseline = import_baseline(args.baseline) if args.baseline else None
    heads = [tuple(int(x) for x in s.split("x")) for s in args.heads.split(",")]
    from attnfast._runtime import config
    cfg = config()
    threads = args.threads if args.threads is not None else af.get_num_threads()
    print(f"attnfast {cfg['version']}  kernel tier {cfg['isa']}  threads {threads}  "
          f"clock {args.clock}  "
          f"Python {platform.python_version()}  numpy {np.__version__}")
    print(f"CPU: {cpu_name()} ({os.cpu_count()} CPUs), load average "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print("command: " + " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])))
    results = run(heads, head_dim=args.head_dim, length=args.length, number=args.number,
                  repeat=args.repeat,
                  threads=args.threads, use_torch=not args.no_torch, rounds=args.rounds,
                  clock=args.clock, baseline=baseline)
    print(format_table(results, args.length, args.number, args.head_dim))
    return 0


if __name__ == "__main__":
    sys.exit(main())
