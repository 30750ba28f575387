"""attnfast vs sdpa as transformers' attention, on a small random-weight Llama.

    python bench/bench_transformers.py [--ctx 2048] [--new 32] [--threads 2] [--dtypes float32 bfloat16]
    # issue 47's end-to-end shape: Llama 32/8 heads, head_dim 128, 2 layers, one thread
    python bench/bench_transformers.py --heads 32x8 --head-dim 128 --layers 2 --threads 1 --ctx 8192

For each dtype and backend: prefill of a --ctx token prompt (one forward pass), then
per-token greedy decode steps after it (DynamicCache). The attention functions (and the
mask builders) are timed separately by wrapping the functions transformers calls, so the
table shows the share of time spent in attention. Speedup = sdpa time / attnfast time.
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
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--af-threads", type=int, default=None,
                   help="attnfast's threads in the model (aft.register(num_threads=...)); default --threads")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--heads", default="8x2", help="query x KV heads (8x2)")
    p.add_argument("--head-dim", type=int, default=64, help="head_dim (64)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (heads * head_dim)")
    p.add_argument("--intermediate", type=int, default=None,
                   help="MLP intermediate size (2 * hidden)")
    args = p.parse_args()
    heads, kv_heads = (int(x) for x in args.heads.split("x"))
    hidden = args.hidden or heads * args.head_dim
    torch.set_num_threads(args.threads)
    attnfast.set_num_threads(args.threads)
    aft.register(num_threads=args.af_threads)
    instrument()
    with contextlib.redirect_stdout(io.StringIO()):
        isa = attnfast.show_config()["isa"]
    print(f"torch {torch.__version__}, transformers {__import__('transformers').__version__}, "
          f"attnfast {attnfast.__version__} ({isa}), threads {args.threads} "
          f"(attnfast in the model: {args.af_threads or args.threads})")
    print(f"Llama: hidden {hidden}, intermediate {args.intermediate or 2 * hidden}, "
          f"{args.layers} layers, {heads} heads / {kv_heads} KV heads, head_dim {args.head_dim}; "
          f"random weights, prompt {args.ctx} tokens, then {args.new} greedy decode steps")
    hdr = (f"{'dtype':9s} {'phase':14s} {'backend':9s} {'total ms':>10s} {'attn ms':>9s} "
           f"{'attn %':>7s} {'mask ms':>8s}")
    print(hdr)
    for dt in args.dtypes:
        dtype = getattr(torch, dt)
        model = model_for(dtype, args.layers, heads, kv_heads, args.head_dim, hidden,
                          args.intermediate, args.ctx + args.new)
        res = {b: run(model, b, args.ctx, args.new) for b in ("sdpa", "attnfast")}
        for i, phase in enumerate(("prefill", "decode/token")):
            for b in ("sdpa", "attnfast"):
                tot, att, msk = res[b][i]
                print(f"{dt:9s} {phase:14s} {b:9s} {tot * 1e3:10.2f} {att * 1e3:9.3f} "
                      f"{100 * att / tot:6.1f}% {msk * 1e3:8.3f}")
            s, a = res["sdpa"][i], res["attnfast"][i]
            print(f"{'':9s} {phase:14s} speedup   total {s[0] / a[0]:.2f}x, attention "
                  f"{s[1] / a[1]:.2f}x, attention+mask {(s[1] + s[2]) / (a[1] + a[2]):.2f}x"
                  + (f"; tokens/s sdpa {1 / s[0]:.2f}, attnfast {1 / a[0]:.2f}" if i else ""))
        same = torch.equal(res["sdpa"][2], res["attnfast"][2])
        print(f"{dt:9s} greedy tokens identical over {args.new} steps: {same}")


if __name__ == "__main__":
    main()
