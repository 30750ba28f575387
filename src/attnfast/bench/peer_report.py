"""The report of a bench/compare_peers.py run, from the data its JSON holds.

The same tables serve the run's own output (text, or markdown with ``--markdown``) and the
results page that :mod:`attnfast.bench.results` writes from stored runs.
"""
from __future__ import annotations

from .limits import MIB, gemm_limit
from .report import fmt_time, table

__all__ = ["PeerReport", "ITEMSIZE"]

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class PeerReport:
    """Tables of one compare_peers run.

    Parameters
    ----------
    meta : dict
        The run's metadata (compare_peers JSON ``meta``).
    limits : dict
        Machine limits by thread count (keys int, or str as JSON stores them).
    results : list of dict
        One row per (kind, shape, threads, engine, dtype).
    engine_names : sequence of str, optional
        Column order of the engines; default: the order they appear in ``results``.
    """

    def __init__(self, meta, limits, results, engine_names=None):
        self.meta, self.results = meta, results
        self.limits = {int(n): lim for n, lim in limits.items()}
        if engine_names is None:
            engine_names = list(dict.fromkeys(r["engine"] for r in results))
        self.engines = engine_names
        self.peers = [e for e in engine_names if e != "attnfast"]
        self.dtypes = list(meta.get("dtypes", ["float32"]))
        # A float32-only run renders exactly as before --dtype existed.
        self.multi = self.dtypes != ["float32"]

    @classmethod
    def from_json(cls, data: dict) -> "PeerReport":
        """The report of a run from its JSON (``meta``, ``limits``, ``results``)."""
        names = list(data["meta"].get("versions", {})) or None
        return cls(data["meta"], data["limits"], data["results"], names)

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
        """The whole report: run details, limits, per-dtype tables, targets, every row."""
        m = self.meta
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
        out.append(self.limits_table(markdown))
        for dtype in self.dtypes:
            out.extend(self.kind_tables(dtype, markdown, h2))

        out.append(self.targets(markdown))
        if self.multi:
            out.append(self.targets_16bit(markdown))

        tolerances = m.get("tolerances", {})
        tol = ", ".join((f"{d} " if self.multi else "") + f"{tolerances[d]:g}"
                        for d in self.dtypes if d in tolerances)
        out.append(f"\n{h2}Every engine: median time, rate, % of the machine limit, max |error| vs "
                   f"the float64 reference (sampled rows; tolerance {tol})")
        rows = []
        for r in self.results:
            dtype = r.get("dtype", "float32")
            lim = self._limit(r["kind"], r["threads"], dtype)
            head = [r["kind"], r["case"], r["threads"], r["engine"]] + ([dtype] if self.multi else [])
            tail = [r.get("note", "")] if self.multi else []
            if "median_s" in r:
                rows.append(head + [fmt_time(r["median_s"]),
                             f"{r['rate']:.1f} {'GFLOP/s' if r['kind'] == 'prefill' else 'GB/s'}",
                             f"{100 * r['rate'] / lim:.0f}%" if lim else "n/a",
                             (f"{r['max_abs_error']:.1e}" if r.get("max_abs_error") is not None else "n/a")
                             + ("" if r["ok"] else " FAIL")] + tail)
            elif "skipped" in r:
                rows.append(head + ["skipped", r["skipped"], "", ""] + tail)
            else:
                rows.append(head + ["error", r["error"], "", ""] + tail)
        out.append(table(["kind", "shape", "thr", "engine"] + (["dtype"] if self.multi else [])
                               + ["time", "rate", "% limit", "max err"]
                               + (["note"] if self.multi else []), rows, markdown))
        return "\n".join(out)

    def limits_table(self, markdown: bool) -> str:
        """The machine limits of each thread count, with every source's reading."""
        out = []
        if any(lim.get("measured") == 2 for lim in self.limits.values()):
            out.append("each source's best reading, before and after the engines of its thread "
                       "count\n")
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
        out.append(table(["threads", "read GB/s", "read kernels (GB/s)",
                          "GEMM GFLOP/s" if not extra else "float32 GEMM GFLOP/s"]
                         + [f"{d} GEMM GFLOP/s" for d in extra] + ["GEMM sources"],
                         rows, markdown))
        if extra:
            out.append("\nA 16-bit GEMM limit is the best of torch.mm in that dtype and the float32 "
                       "GEMM.")
        return "\n".join(out)

    def kind_tables(self, dtype: str, markdown: bool, h2: str = "") -> list[str]:
        """The prefill and decode tables of one dtype: attnfast's rate and its speedup over
        each peer (peer time / attnfast time), one row per shape and thread count."""
        m = self.meta
        llc = m["last_level_cache_mib"] * MIB
        out = []
        skipped_here = m.get("dtype_skipped", {})
        peers = [p for p in self.peers if dtype not in skipped_here.get(p, {})]
        itemsize = ITEMSIZE[dtype]
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
            out.append(f"{what}\n")
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
                        row = [c, n, fmt_time(a["median_s"]) + ("" if a["ok"] else " WRONG"),
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
                            row.append(fmt_time(r["median_s"]))
                    row.append(f"{best['engine']} {best['median_s'] / a['median_s']:.2f}x"
                               if best and "median_s" in a else "-")
                    rows.append(row)
            out.append(table(headers, rows, markdown))
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
        """The float32 targets, met or missed, shape by shape (attnfast rows only)."""
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
        return self._summarise(checks, "Targets, float32", table, markdown)

    def targets_16bit(self, markdown: bool) -> str:
        """The bfloat16 targets, met or missed, shape by shape (attnfast rows only)."""
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
        return self._summarise(checks, "Targets, bfloat16", table, markdown)

