"""Sparse attention (key_index=) against the same attention as a dense masked call, for a
prompt chunk whose every query attends its own top-k (issue 48's prefill target).

    python bench/bench_sparse.py --heads 8x2 --prompt 32768 --new 4096 --topk 2048 --threads 1 [--json F]

Each of the `new` queries (the last tokens; causal) lists `topk` random distinct positions it
may see; attnfast.attention(..., key_index=) reads only those rows, the dense call reads every
key under a bool mask of the same selection (built here: Tq x L bytes). One run of each, in
turns, `--repeats` times; medians, and the largest difference of the two outputs.

    python bench/bench_sparse.py --backward --heads 8x2 --prompt 0 --new 4096 --topk 256

times attention_backward over the same selection instead: key_index= against the dense
masked backward (the forward's out and lse computed once, untimed); medians, and the largest
difference of the gradients.

    python bench/bench_sparse.py --indexer --index-heads 64 --keys 131072 --topk 2048

times attnfast.index_topk for one decode query (64 indexer heads x 128, float8 e4m3 keys
with a scale per token, or --key-dtype float32 / bfloat16; q of each of --q-dtypes, float32
and bfloat16 by default, in turns), the same with topk = 1 (the
scores alone: the rest is the top-k's share), and its roofline max(132 B x L / read, FLOPs
/ bfloat16 GEMM) from the machine limits measured in the same run.

    python bench/bench_sparse.py --model deepseek_v32 --prompt 8192 --new 16 --topk 2048

times greedy generation by a random-weight transformers DeepseekV32ForCausalLM (or
glm_moe_dsa; 2 layers, 16 heads, MLA 128 + 64 / 128, its lightning indexer choosing the top
`topk` keys per query) with attn_implementation="attnfast" (attention over the selected keys)
against "sdpa" (transformers folds them into a dense mask): the prompt's prefill and the
decode tokens/s, each backend in turns, `--repeats` times; the greedy tokens must agree.
"""
import argparse
import statistics
import time

import ml_dtypes
import numpy as np

import attnfast
from attnfast.bench.limits import cpu_name


def indexer(args):
    from attnfast.bench import limits as machine
    rng = np.random.default_rng(0)
    Hi, Di, L = args.index_heads, args.index_dim, args.keys
    dtypes = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "bfloat16": ml_dtypes.bfloat16,
              "float32": np.float32}
    dtype = dtypes[args.key_dtype]
    q32 = rng.standard_normal((1, Hi, 1, Di), dtype=np.float32)
    w = rng.standard_normal((1, 1, Hi), dtype=np.float32)
    k = rng.standard_normal((1, L, Di), dtype=np.float32).astype(dtype)
    scale = rng.uniform(0.5, 2, (1, L)).astype(np.float32)
    lim = machine.measure_limits(args.threads, 512 << 20, 2048, True, 0.5, dtypes=("bfloat16",))
    ways = {}
    for q_name in args.q_dtypes.split(","):
        q = q32.astype(dtypes[q_name])
        for n in (args.topk, 1):
            ways[q_name, n] = (lambda q=q, n=n: attnfast.index_topk(q, w, k, n, k_scale=scale,
                                                                   num_threads=args.threads))
    times = {key: [] for key in ways}
    for fn in ways.values():
        fn()
    for _ in range(max(args.repeats, 5)):
        for key, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    flops = 2 * Hi * Di * L
    gemm = machine.gemm_limit(lim, "bfloat16")
    roof = max((Di * np.dtype(dtype).itemsize + 4) * L / (lim["read_gbps"] * 1e9), flops / (gemm * 1e9))
    print(f"{cpu_name()}, tier {attnfast._ext.runtime_info()['isa']}, {args.threads} thread(s): read "
          f"{lim['read_gbps']:.1f} GB/s, bfloat16 GEMM {gemm:.0f} GFLOP/s")
    rows = []
    for q_name in args.q_dtypes.split(","):
        full, scores = (statistics.median(times[q_name, n]) for n in (args.topk, 1))
        print(f"index_topk {Hi} x {Di}, {q_name} q, {args.key_dtype} keys, L = {L}, top-{args.topk}: "
              f"{full * 1e3:.1f} ms ({flops / full / 1e9:.0f} GFLOP/s) = {100 * roof / full:.0f} % of its "
              f"roofline ({roof * 1e3:.1f} ms); top-1: {scores * 1e3:.1f} ms, so the top-k is "
              f"{100 * (full - scores) / full:.1f} %")
        rows.append(dict(
            threads=args.threads, heads=Hi, dim=Di, q_dtype=q_name, key_dtype=args.key_dtype, L=L,
            topk=args.topk, ms=full * 1e3, gflops=flops / full / 1e9, roofline_ms=roof * 1e3,
            of_roofline=roof / full, topk_share=(full - scores) / full, read_gbps=lim["read_gbps"],
            bf16_gemm_gflops=gemm))
    if args.json:
        from attnfast.bench.sparse_results import store_part
        store_part(args.json, "indexer", rows)


def model(args):
    import torch
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    import attnfast.integrations.transformers as aft
    aft.register(num_threads=args.threads)
    torch.set_num_threads(args.threads)
    Config, Model = {"deepseek_v32": (DeepseekV32Config, DeepseekV32ForCausalLM),
                     "glm_moe_dsa": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM)}[args.model]
    cfg = Config(vocab_size=1024, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
                 num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=16,
                 num_key_value_heads=16, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
                 topk_group=1, n_shared_experts=1, q_lora_rank=384, kv_lora_rank=256,
                 qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=16,
                 index_head_dim=128, index_topk=args.topk,
                 max_position_embeddings=args.prompt + args.new + 8, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2)
    torch.manual_seed(0)
    net = Model(cfg).eval()
    ids = torch.randint(3, cfg.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    class Clock:  # generate()'s streamer: put() gets the prompt, then each new token
        def __init__(self):
            self.stamps = []

        def put(self, _):
            self.stamps.append(time.perf_counter())

        def end(self):
            pass

    times = {name: {"prefill": [], "decode": []} for name in ("attnfast", "sdpa")}
    tokens = {}
    with torch.no_grad():
        for _ in range(args.repeats):
            for name in times:
                net.set_attn_implementation(name)
                clock = Clock()
                out = net.generate(ids, max_new_tokens=args.new + 1, min_new_tokens=args.new + 1,
                                   do_sample=False, streamer=clock)
                prompt_in, first, last = clock.stamps[0], clock.stamps[1], clock.stamps[-1]
                times[name]["prefill"].append(first - prompt_in)  # the prompt's forward: token 1
                times[name]["decode"].append((last - first) / args.new)
                tokens[name] = out[0, args.prompt:].tolist()
    med = {name: {part: statistics.median(v) for part, v in parts.items()} for name, parts in times.items()}
    a, b = med["attnfast"], med["sdpa"]
    print(f"{cpu_name()}, tier {attnfast._ext.runtime_info()['isa']}; {args.model} (random weights, 2 layers, "
          f"16 heads), prompt {args.prompt}, top-{args.topk}, {args.threads} thread(s): decode "
          f"{1 / a['decode']:.1f} tokens/s against sdpa's {1 / b['decode']:.1f} -> "
          f"{b['decode'] / a['decode']:.2f}x; prefill {a['prefill']:.2f} s against {b['prefill']:.2f} s -> "
          f"{b['prefill'] / a['prefill']:.2f}x; greedy tokens {'equal' if tokens['attnfast'] == tokens['sdpa'] else 'DIFFER'}")
    if args.json:
        from attnfast.bench.sparse_results import store_part
        store_part(args.json, "model", [dict(
            threads=args.threads, model=args.model, prompt=args.prompt, new=args.new, topk=args.topk,
            decode_tokens_s=1 / a["decode"], sdpa_decode_tokens_s=1 / b["decode"],
            prefill_s=a["prefill"], sdpa_prefill_s=b["prefill"],
            same_tokens=tokens["attnfast"] == tokens["sdpa"])])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="8x2", help="query x kv heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--new", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--indexer", action="store_true", help="time index_topk instead")
    ap.add_argument("--model", choices=("deepseek_v32", "glm_moe_dsa"),
                    help="time greedy generation of this transformers model instead")
    ap.add_argument("--backward", action="store_true", help="time attention_backward instead")
    ap.add_argument("--index-heads", type=int, default=64)
    ap.add_argument("--index-dim", type=int, default=128)
    ap.add_argument("--keys", type=int, default=131072)
    ap.add_argument("--key-dtype", default="float8_e4m3fn")
    ap.add_argument("--q-dtypes", default="float32,bfloat16", help="indexer q dtypes, timed in turns")
    ap.add_argument("--json", default=None,
                    help="store the result as the \"prefill\" (or, with --indexer, \"indexer\") "
                         "part of this sparse results file (bench/results/sparse/<cpu-kind>.json)")
    args = ap.parse_args()
    if args.indexer:
        return indexer(args)
    if args.model:
        return model(args)
    H, Hkv = (int(x) for x in args.heads.split("x"))
    D, P, T, topk = args.head_dim, args.prompt, args.new, args.topk
    rng = np.random.default_rng(0)
    L = P + T
    q = rng.standard_normal((1, H, T, D), dtype=np.float32)
    k = rng.standard_normal((1, Hkv, L, D), dtype=np.float32)
    v = rng.standard_normal((1, Hkv, L, D), dtype=np.float32)
    index = np.full((1, T, topk), -1, np.int32)
    for t in range(T):
        seen = min(P + t + 1, topk)
        index[0, t, :seen] = rng.choice(P + t + 1, size=seen, replace=False)
    mask = np.zeros((1, 1, T, L), bool)
    for t in range(T):
        mask[0, 0, t, index[0, t][index[0, t] >= 0]] = True
    ways = {"sparse": lambda: attnfast.attention(q, k, v, causal=True, key_index=index,
                                                 num_threads=args.threads),
            "dense masked": lambda: attnfast.attention(q, k, v, causal=True, mask=mask,
                                                       num_threads=args.threads)}
    if args.backward:
        out, lse = attnfast.attention(q, k, v, causal=True, key_index=index, return_lse=True)
        dout = rng.standard_normal(out.shape, dtype=np.float32)
        ways = {"sparse": lambda: attnfast.attention_backward(
                    dout, q, k, v, out, lse, causal=True, key_index=index, num_threads=args.threads),
                "dense masked": lambda: attnfast.attention_backward(
                    dout, q, k, v, out, lse, causal=True, mask=mask, num_threads=args.threads)}
    times = {name: [] for name in ways}
    outs = {}
    for _ in range(args.repeats):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - t0)
    s, d = (statistics.median(times[n]) for n in ways)
    pairs = (zip(outs["sparse"], outs["dense masked"]) if args.backward  # (dq, dk, dv) each
             else [(outs["sparse"], outs["dense masked"])])
    diff = max(float(np.abs(a - b).max()) for a, b in pairs)
    print(f"{cpu_name()}, tier {attnfast._ext.runtime_info()['isa']}; "
          f"{'backward, ' if args.backward else ''}"
          f"H={H}/{Hkv} D={D}, {T} new tokens after {P}, top-{topk}, {args.threads} thread(s): "
          f"sparse {s:.2f} s, dense masked {d:.2f} s -> {d / s:.1f}x; max |diff| "
          f"{diff:.1e}")
    if args.json:
        from attnfast.bench.sparse_results import store_part
        store_part(args.json, "backward" if args.backward else "prefill",
                   [dict(threads=args.threads, heads=f"{H}/{Hkv}", D=D, new=T, prompt=P, topk=topk,
                         sparse_s=s, dense_s=d)])


if __name__ == "__main__":
    main()
