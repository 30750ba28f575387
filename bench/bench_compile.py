"""torch.compile against eager for a transformers Llama on attnfast's attention backend.

    python bench/bench_compile.py [--threads 1] [--seq 512,2048] [--layers 4] [--repeats 7]

A Llama-shaped model (hidden 1024, 16 / 4 heads, D = 64, random weights, float32) runs one
causal forward over a prompt of --seq tokens with attn_implementation="attnfast": eager, and
torch.compile(fullgraph=True) with the inductor backend (compiled once, outside the timing);
"sdpa" eager is the reference. Rounds interleave the variants (A B C A B C ...); the table
gives median milliseconds and compiled / eager (the issue's "no slower than eager": <= 1.0x),
and checks that the compiled logits equal eager's to float32 rounding.
"""
from __future__ import annotations

import argparse
import statistics
import time


def build(attn, layers, torch, transformers):
    cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816,
                                   num_hidden_layers=layers, num_attention_heads=16,
                                   num_key_value_heads=4, vocab_size=1024,
                                   max_position_embeddings=8192)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation(attn)
    return model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seq", default="512,2048")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)

    import torch
    import transformers
    from attnfast.integrations.transformers import register

    torch.set_num_threads(args.threads)
    register(num_threads=args.threads)
    eager = build("attnfast", args.layers, torch, transformers)
    sdpa = build("sdpa", args.layers, torch, transformers)
    compiled = torch.compile(build("attnfast", args.layers, torch, transformers),
                             fullgraph=True, backend="inductor")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"threads {args.threads}, layers {args.layers}")
    print("| tokens | attnfast eager ms | attnfast compiled ms | sdpa eager ms | compiled / eager |")
    print("|---|---|---|---|---|")
    for T in [int(x) for x in args.seq.split(",")]:
        ids = torch.randint(3, 1024, (1, T), generator=torch.Generator().manual_seed(T))
        variants = {"eager": eager, "compiled": compiled, "sdpa": sdpa}
        times = {name: [] for name in variants}
        with torch.no_grad():
            ref = eager(ids).logits
            got = compiled(ids).logits  # compiles (not timed)
            torch.testing.assert_close(got, ref, rtol=2e-4, atol=2e-4)
            for _ in range(args.repeats):
                for name, model in variants.items():
                    t0 = time.perf_counter()
                    model(ids)
                    times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"| {T} | {med['eager']:.1f} | {med['compiled']:.1f} | {med['sdpa']:.1f} | "
              f"{med['compiled'] / med['eager']:.2f} |")


if __name__ == "__main__":
    main()
