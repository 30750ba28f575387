"""attnfast vs sdpa as transformers' attention, on a small random-weight Llama: greedy generation
end to end (prefill time, decode tokens/s, the same tokens).

    python bench/bench_transformers.py [--ctx 2048] [--new 32] [--threads 2] [--dtypes float32 bfloat16]
    # issue 47's end-to-end grid: Llama 32/8 heads, head_dim 128, 2 layers, prompts of 4k,
    # 16k and 32k tokens, 1 and 2 threads, float32 and bfloat16 (a summary table, and JSON)
    python bench/bench_transformers.py --heads 32x8 --head-dim 128 --layers 2 \
        --ctx 4096 16384 32768 --threads 1 2 --json bench/results/generate/<cpu-kind>.json

For each dtype, prompt length (--ctx, several allowed), thread count (--threads, several
allowed) and backend: prefill of the prompt (one forward pass), then --new per-token greedy
decode steps after it (DynamicCache). The attention functions (and the mask builders) are
timed separately by wrapping the functions transformers calls, so the table shows the
share of time spent in attention. Speedup = sdpa time / attnfast time. With several
settings a summary follows (one line per dtype, prompt and threads); --json stores every
row, the model and the machine for the results page (attnfast.bench.generate_results).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import time

import torch
from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface

import attnfast
import attnfast.integrations.transformers as aft
from attnfast.bench.sparse_results import store_part

TIMES = {"attn": 0.0, "mask": 0.0}


def _timed(fn, key):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[key] += time.perf_counter() - t0
    return wrapper


def instrument():
    for name in ("sdpa", "attnfast"):
        AttentionInterface._global_mapping[name] = _timed(AttentionInterface._global_mapping[name], "attn")
        AttentionMaskInterface._global_mapping[name] = _timed(AttentionMaskInterface._global_mapping[name], "mask")


def model_for(dtype, layers, heads=8, kv_heads=2, head_dim=64, hidden=None, intermediate=None,
              positions=8192):
    hidden = hidden or heads * head_dim
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=1024,
                      max_position_embeddings=max(8192, positions))
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval().to(dtype)


def reset():
    TIMES["attn"] = TIMES["mask"] = 0.0


@torch.inference_mode()
def run(model, attn, ctx, new):
    model.set_attn_implementation(attn)
    ids = torch.randint(3, model.config.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(1))
    # warm-up (small)
    model(ids[:, :64], cache=DynamicCache(config=model.config))
    reset()
    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    logits = model(ids, cache=cache).logits
    prefill = (time.perf_counter() - t0, TIMES["attn"], TIMES["mask"])
    tok = logits[:, -1:].argmax(-1)
    reset()
    t0 = time.perf_counter()
    out = []
    for _ in range(new):
        logits = model(tok, cache=cache).logits
        tok = logits[:, -1:].argmax(-1)
        out.append(tok)
    decode = ((time.perf_counter() - t0) / new, TIMES["attn"] / new, TIMES["mask"] / new)
    return prefill, decode, torch.cat(out, 1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ctx", type=int, nargs="+", default=[2048], help="prompt lengths (2048)")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--threads", type=int, nargs="+", default=[2], help="thread counts (2)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--af-threads", type=int, default=None,
                   help="attnfast's threads in the model (aft.register(num_threads=...)); default --threads")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--heads", default="8x2", help="query x KV heads (8x2)")
    p.add_argument("--head-dim", type=int, default=64, help="head_dim (64)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (heads * head_dim)")
    p.add_argument("--intermediate", type=int, default=None,
                   help="MLP intermediate size (2 * hidden)")
    p.add_argument("--json", metavar="PATH", default=None, help="write every row as JSON")
    args = p.parse_args()
    heads, kv_heads = (int(x) for x in args.heads.split("x"))
    hidden = args.hidden or heads * args.head_dim
    aft.register()
    instrument()
    with contextlib.redirect_stdout(io.StringIO()):
        isa = attnfast.show_config()["isa"]
    print(f"torch {torch.__version__}, transformers {__import__('transformers').__version__}, "
          f"attnfast {attnfast.__version__} ({isa}), threads {args.threads} "
          f"(attnfast in the model: {args.af_threads or 'the same'})")
    print(f"Llama: hidden {hidden}, intermediate {args.intermediate or 2 * hidden}, "
          f"{args.layers} layers, {heads} heads / {kv_heads} KV heads, head_dim {args.head_dim}; "
          f"random weights, prompts of {args.ctx} tokens, then {args.new} greedy decode steps")
    hdr = (f"{'dtype':9s} {'ctx':>6s} {'thr':>3s} {'phase':14s} {'backend':9s} {'total ms':>10s} "
           f"{'attn ms':>9s} {'attn %':>7s} {'mask ms':>8s}")
    print(hdr)
    rows, summary = [], []
    for dt in args.dtypes:
        dtype = getattr(torch, dt)
        model = model_for(dtype, args.layers, heads, kv_heads, args.head_dim, hidden,
                          args.intermediate, max(args.ctx) + args.new)
        for threads in args.threads:
            torch.set_num_threads(threads)
            attnfast.set_num_threads(threads)
            aft._SETTINGS["num_threads"] = args.af_threads or threads  # (register's setting)
            for ctx in args.ctx:
                res = {b: run(model, b, ctx, args.new) for b in ("sdpa", "attnfast")}
                same = torch.equal(res["sdpa"][2], res["attnfast"][2])
                for i, phase in enumerate(("prefill", "decode/token")):
                    for b in ("sdpa", "attnfast"):
                        tot, att, msk = res[b][i]
                        print(f"{dt:9s} {ctx:6d} {threads:3d} {phase:14s} {b:9s} "
                              f"{tot * 1e3:10.2f} {att * 1e3:9.3f} {100 * att / tot:6.1f}% "
                              f"{msk * 1e3:8.3f}")
                        rows.append(dict(dtype=dt, ctx=ctx, threads=threads, phase=phase,
                                         backend=b, seconds=tot, attention_seconds=att,
                                         mask_seconds=msk, same_tokens=same))
                    s, a = res["sdpa"][i], res["attnfast"][i]
                    print(f"{'':24s} {phase:14s} speedup   total {s[0] / a[0]:.2f}x, attention "
                          f"{s[1] / a[1]:.2f}x, attention+mask {(s[1] + s[2]) / (a[1] + a[2]):.2f}x"
                          + (f"; tokens/s sdpa {1 / s[0]:.2f}, attnfast {1 / a[0]:.2f}" if i
                             else ""))
                print(f"{dt:9s} {ctx:6d} {threads:3d} greedy tokens identical over {args.new} "
                      f"steps: {same}")
                (ps, _, _), (ds, _, _) = res["sdpa"][:2]
                (pa, _, _), (da, _, _) = res["attnfast"][:2]
                summary.append(f"{dt:9s} {ctx:6d} {threads:7d} {ps * 1e3:10.1f} {pa * 1e3:10.1f} "
                               f"{ps / pa:8.2f}x "
                               f"{1 / ds:10.2f} {1 / da:10.2f} {ds / da:8.2f}x  {same}")
    if len(summary) > 1:
        print(f"\n{'dtype':9s} {'ctx':>6s} {'threads':>7s} {'prefill ms':>10s} {'attnfast':>10s} "
              f"{'speedup':>9s} {'sdpa tok/s':>10s} {'attnfast':>10s} {'speedup':>9s}  same tokens")
        print("\n".join(summary))
    if args.json:
        store_part(args.json, "llama", rows, torch=torch.__version__,
                   transformers=__import__("transformers").__version__,
                   model=dict(hidden=hidden, intermediate=args.intermediate or 2 * hidden,
                              layers=args.layers, heads=heads, kv_heads=kv_heads,
                              head_dim=args.head_dim),
                   new_tokens=args.new)


if __name__ == "__main__":
    main()
