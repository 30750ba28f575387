"""attnfast.integrations.torch: attnfast's entry points as torch.library custom ops, checked
against torch's sdpa in float64 and against the NumPy API; torch.compile(fullgraph=True) of a
transformers Llama using the "attnfast" backend, against eager sdpa."""
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import attnfast as af  # noqa: E402
import attnfast.integrations.torch as aft  # noqa: E402

F = torch.nn.functional


def _qkv(B=2, H=4, Hkv=2, Tq=5, Tk=9, D=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, Tq, D, generator=g, dtype=dtype),
            torch.randn(B, Hkv, Tk, D, generator=g, dtype=dtype),
            torch.randn(B, Hkv, Tk, D, generator=g, dtype=dtype))


def _sdpa(q, k, v, **kw):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                          v.repeat_interleave(rep, 1), **kw)


def test_attnfast_and_its_integrations_package_do_not_import_torch():
    code = ("import sys, attnfast, attnfast.integrations; "
            "assert 'torch' not in sys.modules, 'attnfast imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ops_are_registered_with_schemas():
    assert torch.ops.attnfast.attention.default._schema.name == "attnfast::attention"
    schema = str(torch.ops.attnfast.attention_with_kvcache.default._schema)
    assert "Tensor(a1!) k_cache" in schema and "Tensor(a2!) v_cache" in schema


@pytest.mark.parametrize("kind", ["causal", "bool_mask", "additive_mask", "window"])
def test_attention_op_matches_sdpa_float64(kind):
    q, k, v = _qkv(Tq=9)
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(2, 1, 9, 9, generator=g) > 0.3
    keep[..., 0] = True
    if kind == "causal":
        got, ref = aft.attention(q, k, v, causal=True), _sdpa(q, k, v, is_causal=True)
    elif kind == "bool_mask":
        got, ref = aft.attention(q, k, v, mask=keep), _sdpa(q, k, v, attn_mask=keep)
    elif kind == "additive_mask":
        bias = torch.randn(1, 4, 1, 9, generator=g, dtype=torch.float64)
        got, ref = aft.attention(q, k, v, bias), _sdpa(q, k, v, attn_mask=bias)
    else:
        i = torch.arange(9)
        band = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - 2)
        got = aft.attention(q, k, v, causal=True, window=[2, 0], scale=0.3)
        ref = _sdpa(q, k, v, attn_mask=band, scale=0.3)
    assert got.dtype == torch.float64 and got.shape == (2, 4, 9, 16)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)


def test_opcheck_fake_implementations():
    """torch's own checks of a custom op: schema, fake (meta) implementation, dispatch."""
    q, k, v = _qkv(dtype=torch.float32)
    torch.library.opcheck(aft.attention_forward, (q, k, v), {"causal": True})
    mask = torch.ones(1, 1, 5, 9, dtype=torch.bool)
    torch.library.opcheck(aft.attention_forward, (q, k, v, mask), {"scale": 0.5})
    kc, vc = torch.zeros(2, 2, 12, 16), torch.zeros(2, 2, 12, 16)
    lens = torch.tensor([3, 4])
    torch.library.opcheck(aft.attention_with_kvcache, (q[:, :, :1], kc, vc, lens,
                                                       k[:, :, :1], v[:, :, :1]))


def test_errors_name_the_argument_and_write_nothing():
    q, k, v = _qkv(dtype=torch.float32)
    with pytest.raises(ValueError, match="head dim"):
        aft.attention(q, k[..., :8], v)
    with pytest.raises(TypeError, match="window"):
        aft.attention(q, k, v, window=[1, 2, 3])
    kc = torch.zeros(2, 2, 6, 16)
    vc = torch.zeros(2, 2, 6, 16)
    with pytest.raises(ValueError, match="cache_seqlens"):   # no room for 2 new tokens
        aft.attention_with_kvcache(q[:, :, :2], kc, vc, torch.tensor([5, 1]), k[:, :, :2],
                                   v[:, :, :2])
    assert not kc.any() and not vc.any()


def test_gradients_match_sdpa():
    q, k, v = _qkv(Tq=9, dtype=torch.float32)
    for t in (q, k, v):
        t.requires_grad_(True)
    out = aft.attention(q, k, v, causal=True)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    ref = _sdpa(q, k, v, is_causal=True)
    want = torch.autograd.grad(ref, (q, k, v), g)
    torch.testing.assert_close(out.detach(), ref.detach(), atol=1e-5, rtol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_gradcheck_float64_with_sinks_gqa_softcap():
    torch.manual_seed(3)
    q = torch.randn(1, 4, 7, 5, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 9, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 9, 3, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(4, dtype=torch.float32)
    assert torch.autograd.gradcheck(
        lambda q, k, v: aft.attention(q, k, v, None, sinks, causal=True, softcap=3.0),
        (q, k, v))
    # the sinks' gradient (float32 parameter): against float64 finite differences of the op
    sinks.requires_grad_(True)
    out = aft.attention(q.detach(), k.detach(), v.detach(), None, sinks, causal=True)
    (dsinks,) = torch.autograd.grad(out.sum(), sinks)
    eps = 1e-3
    for h in range(4):
        bump = torch.zeros(4)
        bump[h] = eps
        f = lambda s: aft.attention(q.detach(), k.detach(), v.detach(), None, s, causal=True).sum()
        numeric = (f(sinks.detach() + bump) - f(sinks.detach() - bump)) / (2 * eps)
        assert abs(float(dsinks[h]) - float(numeric)) < 1e-3 * max(1.0, abs(float(numeric)))


def test_opcheck_backward_ops():
    q, k, v = _qkv(Tq=9, dtype=torch.float32)
    torch.library.opcheck(aft.attention_lse, (q, k, v), {"causal": True})
    out, lse = aft.attention_lse(q, k, v, causal=True)
    torch.library.opcheck(aft.attention_backward, (torch.randn_like(out), q, k, v, out, lse),
                          {"causal": True})


def test_compiled_training_step_matches_eager():
    torch.manual_seed(5)
    q0, k0, v0 = (torch.randn(1, 4, 33, 16) for _ in range(3))

    def step(q, k, v):
        return (aft.attention(q, k, v, causal=True) ** 2).sum()

    grads = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
        fn(q, k, v).backward()
        grads.append((q.grad, k.grad, v.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_kvcache_op_writes_and_matches_numpy_api_compiled():
    q, k, v = _qkv(Tq=1, Tk=3, dtype=torch.float32)
    kc, vc = torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16)
    kc_np, vc_np = np.zeros((2, 2, 8, 16), np.float32), np.zeros((2, 2, 8, 16), np.float32)
    lens = torch.tensor([0, 0])

    def step(q, kc, vc, lens, kn, vn):
        return aft.attention_with_kvcache(q, kc, vc, lens, kn, vn) * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for t in range(3):
        kn, vn = k[:, :, t:t + 1].contiguous(), v[:, :, t:t + 1].contiguous()
        got = compiled(q, kc, vc, lens + t, kn, vn)
        ref = af.attention_with_kvcache(q.numpy(), kc_np, vc_np, np.full(2, t), kn.numpy(),
                                        vn.numpy())
        np.testing.assert_allclose(got.numpy(), 2 * ref, atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(kc.numpy(), kc_np)     # the compiled op wrote the cache
    torch.testing.assert_close(kc[:, :, :3], k)


# ---------------------------------------------------------------------------------------------
# transformers under torch.compile

def _llama(attn):
    transformers = pytest.importorskip("transformers")
    import attnfast.integrations.transformers as afhf
    afhf.register()
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   max_position_embeddings=128, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation(attn)
    return model


def _inputs():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    return ids, mask


def _compile_and_compare(backend):
    ref_model, model = _llama("sdpa"), _llama("attnfast")
    ids, mask = _inputs()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(ids, attention_mask=mask)
        assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        for kw in ({}, {"attention_mask": mask}):   # no mask (skipped), a padding mask
            ref = ref_model(ids, **kw).logits
            got = compiled(ids, **kw).logits
            keep = kw["attention_mask"].bool() if kw else torch.ones(2, 12, dtype=torch.bool)
            torch.testing.assert_close(got[keep], ref[keep], atol=1e-4, rtol=1e-4)


def test_llama_fullgraph_compiles_and_matches_sdpa():
    """fullgraph=True through dynamo and AOTAutograd (the fake implementations), no graph
    break at attention; logits equal eager sdpa's."""
    _compile_and_compare("aot_eager")


@pytest.mark.slow
def test_llama_inductor_fullgraph_matches_sdpa():
    _compile_and_compare("inductor")
