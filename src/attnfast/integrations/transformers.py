"""attnfast as an attention backend for Hugging Face transformers (5.x; optional extra).

    import attnfast.integrations.transformers as aft
    aft.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="attnfast")

:func:`register` adds the name "attnfast" to transformers' ``AttentionInterface`` (the
attention function) and ``AttentionMaskInterface`` (the mask builder). Both are needed: a
custom attention function registered alone receives ``attention_mask=None`` and would
silently ignore padding.

How masks are used: the mask builder materialises transformers' own mask (the sdpa one:
causal, sliding window, padding, static-cache tail, bidirectional, local/global windows) once
per forward pass and attaches attnfast's plan for it. Where the mask is, per sequence, a key
range ``[start, end)`` with causal / sliding-window structure (derived, then rebuilt and
checked element by element against transformers' mask), the plan is that range plus
attnfast options (``causal``, ``window=(left, 0)``, ``query_offset``): left padding becomes a
per-sequence key range (one attnfast call per sequence; a batch whose sequences share the
range is one call) and the empty part of a static cache is never read. Any other mask (a
padding hole, packed sequences, bidirectional sliding windows, per-head masks, an additive
float mask with a bias, custom 4-D masks passed to the model) goes to the kernels as
``attention(mask=)``: bool or additive, read through its broadcast strides (never expanded
over heads). GQA runs natively (no repeated K/V).

Under ``torch.compile`` the mask builder returns transformers' mask unanalysed and the
attention runs as the custom op :func:`attnfast.integrations.torch.attention` with that mask
(``fullgraph=True`` compiles: no graph break at attention).

Training: when gradients are recorded (query, key, value or the sinks require grad) the
attention runs as the differentiable custom op :func:`attnfast.integrations.torch.attention`
with transformers' mask, so ``loss.backward()`` gets attnfast's gradients (fine-tuning with
``attn_implementation="attnfast"``).

Sparse attention (DeepSeek-V3.2's and GLM-5's ``indices=``, the lightning indexer's top-k per
query): attention over exactly those keys (attnfast's ``key_index=``), the mask read at the
listed positions only, eagerly; with gradients, and under torch.compile (which then hands
these models their mask rather than skipping it: their indexer reads it), through the
differentiable custom op, whose backward also reads only the listed keys.

Raises: ValueError for tensors that live on another device; NotImplementedError for
dropout > 0 and for any keyword argument of the attention function that attnfast does not
implement (``position_bias``,
``output_attentions=True``, packed ``cu_seq_lens_q``, ...), named in the message: never
silently dropped. The keyword arguments
transformers passes to every attention function without changing what it computes
(``position_ids``, ``use_cache``, ...) are accepted.
Softcap (Gemma 2) and attention sinks (gpt-oss's s_aux) are passed to attnfast's options.
"""
from __future__ import annotations

import numpy as np

import attnfast as _af
from attnfast._ext import tensor_view
from attnfast._interop import to_numpy, wrap_like
from attnfast.integrations import torch as _torch_ops  # the custom ops (imports torch)

__all__ = ["register", "attention_forward", "attention_mask", "NAME"]

NAME = "attnfast"
_PLAN = "_attnfast_plan"


_SETTINGS = {"num_threads": None}
# indices= over a prompt selecting at least 1 / _DENSE_SHARE of the keys per query runs as a
# masked prefill (see _sparse).
_DENSE_SHARE = 8


def register(name: str = NAME, *, num_threads: int | None = None) -> None:
    """Register attnfast with transformers' AttentionInterface and AttentionMaskInterface
    under ``name`` (default "attnfast"), so ``attn_implementation=name`` selects it.

    ``num_threads``: attnfast's threads for the model's attention calls (default: attnfast's
    global setting, :func:`attnfast.get_num_threads`). torch and attnfast run separate
    OpenMP thread pools; on a machine with few cores, fewer attnfast threads than torch's can
    be faster for decoding (see bench/bench_transformers.py).
    """
    _SETTINGS["num_threads"] = num_threads
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("attnfast.integrations.transformers needs transformers>=5 and torch: "
                          "pip install 'attnfast[transformers]'") from e
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)


# ---------------------------------------------------------------------------------------------
# The mask builder: transformers' mask, plus attnfast's plan for it.

def attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                   mask_function=None, attention_mask=None, **kwargs):
    """transformers' sdpa boolean mask (batch, 1, q_length, kv_length) with attnfast's plan
    attached (computed once per forward, used by every layer): derived from the definition
    for unpadded causal / bidirectional masks, otherwise analysed from the materialised mask.
    Never skipped (None) in eager mode; under torch.compile it is transformers' sdpa mask as
    is (None where sdpa would skip it, except for models whose own code reads it: DeepSeek-V3.2
    / GLM-5's indexer), analysed by no Python code."""
    import torch
    from transformers.masking_utils import causal_mask_function, sdpa_mask
    mask_function = mask_function or causal_mask_function
    compiling = torch.compiler.is_compiling()
    fast = None if compiling else _plain_plan(batch_size, q_length, kv_length, q_offset,
                                              kv_offset, mask_function, attention_mask)
    if fast is not None:
        # No padding, plain causal or bidirectional: the plan follows from the definitions of
        # those two mask functions (kv_idx <= q_idx; everything), with no analysis. The mask
        # handed over is still the true one (a broadcast compare, shared by the batch), so a
        # caller that copies it and loses the attached plan gets the same plan re-derived.
        causal, off = fast[0][2], fast[0][3]
        if causal:
            keep = torch.arange(kv_length)[None, :] <= torch.arange(q_length)[:, None] + off
        else:
            keep = torch.ones((), dtype=torch.bool).expand(q_length, kv_length)
        mask = keep.expand(batch_size, 1, q_length, kv_length)
        setattr(mask, _PLAN, fast)
        return mask
    kwargs.pop("allow_is_causal_skip", None)
    kwargs.pop("allow_is_bidirectional_skip", None)
    kwargs.pop("dtype", None)
    config = kwargs.pop("config", None)
    reads_mask = getattr(config, "index_topk", None) is not None  # (the sparse models' indexer)
    mask = sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                     mask_function=mask_function,
                     attention_mask=attention_mask, allow_is_causal_skip=compiling and not reads_mask,
                     allow_is_bidirectional_skip=False, **kwargs)
    if mask is not None and not compiling:
        _plan(mask)
    return mask


def _plain_plan(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                attention_mask):
    """The plan without a mask, for the two standard patterns when no key they would see is
    padding (transformers pads a short 2-D mask with False); None otherwise."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    if mask_function is bidirectional_mask_function:
        plan = (0, kv_length, False, None, -1)
    elif mask_function is causal_mask_function:
        off = q_offset - kv_offset   # query i at key index i + off; keys past the last query unseen
        end = min(kv_length, off + q_length)
        if end <= 0:
            return None
        plan = (0, end, True, off, -1)
    else:
        return None
    if attention_mask is not None:   # (batch, kv positions): every key the plan reads is real
        seen = attention_mask[:, kv_offset:kv_offset + plan[1]]
        if attention_mask.ndim != 2 or seen.shape[-1] != plan[1] or not bool(seen.all()):
            return None
    return (plan,) * batch_size


USE_MASK = "mask"   # the plan of a mask that is not key ranges: pass it as attention(mask=)


def _plan(mask):
    """Per sequence: None (no query sees a key) or (start, end, causal, query_offset, left),
    checked to reproduce ``mask`` exactly; or :data:`USE_MASK` when the mask is not of that
    form (it is then given to the kernels as it is). Cached on the mask tensor."""
    cached = getattr(mask, _PLAN, None)
    if cached is not None:
        return cached
    plans = _key_ranges(mask)
    try:
        setattr(mask, _PLAN, plans)
    except (AttributeError, TypeError):  # pragma: no cover - exotic tensor subclasses
        pass
    return plans


def _key_ranges(mask):
    """_plan's analysis (uncached)."""
    import torch
    m = mask
    if m.ndim != 4:
        return USE_MASK
    if m.dtype != torch.bool:   # additive float mask: 0 keeps, the dtype's minimum / -inf drops
        drop = m <= torch.finfo(m.dtype).min / 2
        if not torch.all((m == 0) | drop):
            return USE_MASK     # a bias
        m = ~drop
    if m.shape[1] != 1:
        if not torch.equal(m, m[:, :1].expand_as(m)):
            return USE_MASK     # differs between heads
        m = m[:, :1]
    m = m[:, 0]                                       # (B, Tq, Tk)
    B, Tq, Tk = m.shape
    idx = torch.arange(Tk)
    any_ = m.any(-1)
    lo = torch.where(m, idx, Tk).amin(-1)
    hi = torch.where(m, idx, -1).amax(-1)
    count = m.sum(-1)
    if not bool(torch.all(~any_ | (count == hi - lo + 1))):
        return USE_MASK         # a row sees a non-contiguous set of keys (holes, packing)
    plans = []
    rows = torch.arange(Tq)
    for b in range(B):
        r = any_[b]
        if not bool(r.any()):
            plans.append(None)
            continue
        s, e = int(lo[b][r].min()), int(hi[b][r].max()) + 1
        lo_b, hi_b = lo[b] - s, hi[b] - s
        if bool(r.all()) and bool((lo_b == 0).all()) and bool((hi_b == e - s - 1).all()):
            plan = (s, e, False, None, -1)
        else:
            r0 = int(torch.nonzero(r)[0])
            off = int(hi_b[r0]) - r0
            pos = rows + off
            shifted = r & (lo_b > 0)
            left = int((pos - lo_b)[shifted].max()) if bool(shifted.any()) else -1
            plan = (s, e, True, off, left)
        # Rebuild the mask the plan means and require equality: exact, or the mask itself.
        keys = torch.arange(e - s)
        _, _, causal, off, left = plan
        keep = torch.ones(Tq, e - s, dtype=torch.bool)
        if causal:
            pos = (rows + off)[:, None]
            keep &= keys[None, :] <= pos
            if left >= 0:
                keep &= keys[None, :] >= pos - left
        full = torch.zeros(Tq, Tk, dtype=torch.bool)
        full[:, s:e] = keep
        if not torch.equal(full, m[b]):
            return USE_MASK     # e.g. bidirectional sliding windows, block masks
        plans.append(plan)
    return tuple(plans)


# ---------------------------------------------------------------------------------------------
# The attention function.

# Keyword arguments transformers passes to every attention function that do not change what
# attention computes, accepted and not used (as transformers' sdpa_attention_forward does):
# they arrive through the models' **kwargs (TransformersKwargs and the decoder layers' own).
_HARMLESS_KWARGS = frozenset({
    # positions are already in q and k (RoPE); packed sequences found from them are in the
    # mask transformers builds (masking_utils.find_packed_sequence_indices), read as a mask
    "position_ids",
    # the cache and the outputs of other parts of the model (the model handles them)
    "use_cache", "past_key_values", "past_key_value", "cache_position", "position_embeddings",
    "output_hidden_states", "output_router_logits", "return_dict", "num_items_in_batch",
    "seq_idx",  # packed-sequence ids for state-space layers
    # flash-attention's settings: attnfast is deterministic, and the maxima are only bounds
    # (the sequences themselves come with cu_seq_lens_q / cu_seq_lens_k: refused below)
    "deterministic", "max_length_q", "max_length_k",
})
_REFUSAL_HINTS = {
    "block_indices": "block-sparse attention",
    "cu_seq_lens_q": "packed (varlen) sequences: pass position_ids instead (transformers then "
                     "builds the packed sequences' mask, which attnfast reads)",
    "cu_seq_lens_k": "packed (varlen) sequences: pass position_ids instead (transformers then "
                     "builds the packed sequences' mask, which attnfast reads)",
    "output_attentions": "the attention weights (use attn_implementation=\"eager\" for them)",
    "sinks": "per-token attention sinks (attnfast takes per-head sinks as s_aux)",
}


def _refuse_unknown(kwargs) -> None:
    """Every keyword argument of the attention function that attnfast does not implement is
    refused by name (NotImplementedError), never dropped: an argument a model passes changes
    what its attention computes (DeepSeek-V3.2's ``indices=``: dense attention would run
    instead of the model's sparse one). Accepted: the harmless ones above, and None (an
    option that is off), and ``output_attentions=False``."""
    for name, value in kwargs.items():
        if value is None or name in _HARMLESS_KWARGS:
            continue
        if name == "output_attentions" and value is False:
            continue
        if name == "position_bias":
            raise NotImplementedError("attnfast backend: position_bias is not supported yet")
        hint = _REFUSAL_HINTS.get(name)
        raise NotImplementedError(
            f"attnfast backend: the attention argument {name}= is not implemented"
            + (f" ({hint})" if hint else "") + "; attnfast refuses it rather than ignore it")


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, softcap=None, sliding_window=None, s_aux=None, **kwargs):
    """transformers' attention-function contract: query (B, H, Tq, D), key/value (B, Hkv, Tk,
    D|Dv) (Hkv may divide H: GQA without repeating), ``attention_mask`` from
    :func:`attention_mask`, a custom 4-D mask (bool, or additive float) or None; returns
    (attn_output (B, Tq, H, Dv), None). A keyword argument attnfast does not implement
    (e.g. ``indices=``, sparse attention) raises NotImplementedError naming it."""
    import torch
    indices = kwargs.pop("indices", None)
    if kwargs:
        _refuse_unknown(kwargs)
    if dropout:
        raise NotImplementedError(f"attnfast backend: attention dropout ({dropout}) is not "
                                  "supported (attnfast is for inference: call model.eval())")
    needs_grad = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
        or (s_aux is not None and s_aux.requires_grad))
    if indices is not None:
        return _sparse(module, query, key, value, attention_mask, indices, scaling, is_causal,
                       softcap, s_aux, needs_grad, torch.compiler.is_compiling()), None
    if (attention_mask is None and softcap is None and s_aux is None and not needs_grad
            and not torch.compiler.is_compiling()):
        # A decode step's common case (no mask, no score options), with the fewest steps:
        # NumPy views of the tensors in one C call each and attnfast's NumPy fast path
        out = _eager_unmasked(module, query, key, value, scaling, is_causal, sliding_window)
        if out is not None:
            return out, None
    sinks = s_aux
    if sinks is not None and sinks.requires_grad and not torch.is_grad_enabled():
        sinks = sinks.detach()   # a parameter; no gradient is being recorded
    options = dict(scale=scaling, softcap=softcap, sinks=sinks)
    options = {k: v for k, v in options.items() if v is not None}
    if attention_mask is not None and attention_mask.shape[-1] > key.shape[2]:
        attention_mask = attention_mask[..., :key.shape[2]]   # as sdpa: the tail is unused
    causal = window = None
    if attention_mask is None:   # no mask from transformers: the module's own structure
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        window = (sliding_window - 1, 0) if causal and sliding_window else None

    # One custom op: no Python of attnfast is traced; with gradients, its backward is
    # attnfast.attention_backward (the mask as transformers built it).
    if torch.compiler.is_compiling() or needs_grad:
        out = _torch_ops.attention(query, key, value, causal=bool(causal), mask=attention_mask,
                        window=None if window is None else list(window),
                        num_threads=_SETTINGS["num_threads"], **options)
        return out.transpose(1, 2).contiguous(), None

    # Eager: NumPy views of the tensors (once per call), attnfast's NumPy fast path, and the
    # output allocated by NumPy and shared with the returned tensor.
    q, k, v = (to_numpy(t, name) for t, name in ((query, "query"), (key, "key"),
                                                 (value, "value")))
    B, H, Tq, _ = q.shape
    out = np.empty((B, Tq, H, v.shape[-1]), q.dtype)
    out_h = out.transpose(0, 2, 1, 3)                 # (B, H, Tq, Dv) view of out
    if attention_mask is None:
        _call(q, k, v, out_h, causal=causal, window=window, **options)
        return wrap_like(out, query), None
    plans = _plan(attention_mask)
    if plans == USE_MASK:
        _call(q, k, v, out_h, mask=attention_mask, **options)
    elif len(set(plans)) == 1 and plans[0] is not None:
        _run_plan(plans[0], q, k, v, out_h, options)
    else:
        for b, plan in enumerate(plans):
            if plan is None:
                out[b] = 0                            # no key visible: zeros, as attnfast does
            else:
                sl = slice(b, b + 1)
                _run_plan(plan, q[sl], k[sl], v[sl], out_h[sl], options)
    return wrap_like(out, query), None


def _sparse(module, query, key, value, attention_mask, indices, scaling, is_causal, softcap,
            sinks, needs_grad, compiling):
    """attention_forward with DeepSeek-V3.2 / GLM-5's ``indices`` (B, Tq, topk): attention
    over the listed keys (attnfast's ``key_index=``). The mask transformers built (causal,
    padding) is read at the listed positions only: a listed key it drops becomes -1, so the
    keys attended are those sdpa's dense mask of the top-k leaves. With needs_grad, or under
    torch.compile, the differentiable custom op (its backward reads only the listed keys too);
    compiled, the mask must be transformers' own (boolean, one head: checked by shape and
    dtype, as no value can be looked at while tracing)."""
    import torch
    Tk = key.shape[2]
    idx = indices.to(torch.int64)
    causal = False
    if attention_mask is None:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    else:
        m = attention_mask[..., :Tk]
        if compiling:  # no value can be looked at while tracing: shape and dtype only
            if m.dtype != torch.bool or m.shape[1] != 1:
                raise NotImplementedError(
                    "attnfast backend: indices= under torch.compile takes transformers' boolean "
                    f"mask (B, 1, Tq, Tk), got {m.dtype} {tuple(m.shape)}")
        else:
            if m.dtype != torch.bool:   # additive: 0 keeps, the dtype's minimum / -inf drops
                drop = m <= torch.finfo(m.dtype).min / 2
                if not bool(torch.all((m == 0) | drop)):
                    raise NotImplementedError("attnfast backend: indices= with an additive bias "
                                              "in the mask is not implemented")
                m = ~drop
            if m.shape[1] != 1 and not torch.equal(m, m[:, :1].expand_as(m)):
                raise NotImplementedError("attnfast backend: indices= with a mask that differs "
                                          "between heads is not implemented")
        keep = m[:, 0].expand(idx.shape[0], idx.shape[1], Tk)
        seen = torch.gather(keep, -1, idx.clamp(min=0)) & (idx >= 0)
        idx = torch.where(seen, idx, torch.full_like(idx, -1))
    options = {n: x for n, x in (("scale", scaling), ("softcap", softcap), ("sinks", sinks)) if x is not None}
    if needs_grad or compiling:
        out = _torch_ops.attention(query, key, value, causal=causal, key_index=idx.to(torch.int32),
                                   num_threads=_SETTINGS["num_threads"], **options)
        return out.transpose(1, 2).contiguous()
    q, k, v = (to_numpy(t, name) for t, name in ((query, "query"), (key, "key"), (value, "value")))
    B, H, Tq, _ = q.shape
    out = np.empty((B, Tq, H, v.shape[-1]), q.dtype)
    if Tq > 1 and idx.dim() == 3 and idx.shape[-1] * _DENSE_SHARE >= Tk:
        # A prompt whose queries each select 1 / _DENSE_SHARE of the keys or more: the prefill
        # kernel under the selection's mask (sdpa's way) beats one gathered problem per query
        # (DeepSeek-V3.2, prompt 4096, top-2048: 0.37x sdpa, now 1.45x; HISTORY 47). It reads
        # the unselected keys, as sdpa over its dense mask does.
        selected = torch.zeros((B, Tq, Tk + 1), dtype=torch.bool)
        selected.scatter_(-1, torch.where(idx >= 0, idx, Tk), True)
        _call(q, k, v, out.transpose(0, 2, 1, 3), causal=causal,
              mask=selected[:, None, :, :Tk].numpy(), **options)
        return wrap_like(out, query)
    _call(q, k, v, out.transpose(0, 2, 1, 3), causal=causal,
          key_index=idx.to(torch.int32).numpy(), **options)
    return wrap_like(out, query)


def _eager_unmasked(module, query, key, value, scaling, is_causal, sliding_window):
    """attention_forward without a mask or score options, eagerly: attn_output (B, Tq, H, Dv)
    as a tensor sharing attnfast's output, or None when a tensor is not a plain dense CPU
    tensor (the general path then converts it, or says why it cannot)."""
    q, k, v = tensor_view(query), tensor_view(key), tensor_view(value)
    if q is None or k is None or v is None or q.ndim != 4:
        return None
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = (sliding_window - 1, 0) if causal and sliding_window else None
    B, H, Tq, _ = q.shape
    out = np.empty((B, Tq, H, v.shape[-1]), q.dtype)
    _af.attention(q, k, v, out=out.transpose(0, 2, 1, 3), causal=causal, window=window,
                  scale=scaling, num_threads=_SETTINGS["num_threads"])  # no option to refuse
    return wrap_like(out, query)


def _run_plan(plan, q, k, v, out, options):
    s, e, causal, off, left = plan
    window = (left, 0) if causal and left >= 0 else None
    if s != 0 or e != k.shape[2]:
        k, v = k[:, :, s:e], v[:, :, s:e]
    _call(q, k, v, out, causal=causal, window=window,
          query_offset=off, **options)


def _call(q, k, v, out, **options):
    try:
        _af.attention(q, k, v, out=out, num_threads=_SETTINGS["num_threads"], **options)
    except NotImplementedError as e:
        raise NotImplementedError(f"attnfast backend: this model's attention uses an option "
                                  f"attnfast does not implement yet ({e})") from None
