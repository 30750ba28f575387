"""Two peers' own test grids, ported (issue 46, item 9: "Nothing lost").

Every case is checked against a float64 NumPy reference written here (materialised softmax,
one KV head group at a time) with flash-attention's accuracy rule (`assert_flash_rule`):
attnfast's error against the float64 reference may be at most twice (three times for
gradients) the error of a *same-precision naive* implementation -- the same reference
computed in the inputs' dtype, rounding after every operation as PyTorch does in flash-attn's
``attention_ref(..., upcast=False, reorder_ops=True)`` (float32 sums inside the products of
16-bit inputs, as GPU matmuls; float32 inputs computed in float32) -- plus a slack of 8
float32 (float64 for float64 inputs) ulps of the output's magnitude, for cases where the naive
error happens to vanish. Where that fails, the larger naive error of flash-attn's two orders
(reorder_ops True and False) counts. For float32 / float64 inputs, which flash-attn does not
test, the factors are 1.5x flash-attn's (`flash_factor` says why, with the measurements).
Float32 / float64 gradients at softcap 50 exceed the rule (attnfast's backward recomputes the
probabilities from a float32 lse): xfail, see `SOFTCAP_GRADS_REASON`; so does one long MQA
float64 backward (its dv accumulation order: `BACKWARD_XFAILS`).

1. flash-attention, tests/test_flash_attn.py (Dao-AILab/flash-attention, main):
   - test_flash_attn_output: seqlen pairs, head dims 32..256 (40, 59, 80, 111 included),
     MHA / MQA / GQA (6 heads over 6, 1, 2; 4 heads with softcap), causal, local windows
     (random (left, right) below seqlen_k), ALiBi ((B, H) slopes in [0, 0.3)), softcap 50 (q
     scaled by 50), kvpacked (k and v as views of one packed buffer), deterministic (here:
     the bits of num_threads=1 equal those of the default), dtypes float16 and bfloat16
     (attnfast adds float32 and float64). Layout as flash-attn's: (B, S, H, D) buffers passed
     transposed.
   - test_flash_attn_varlen_output -> attnfast.attention_varlen (padding lengths drawn as
     flash-attn's "random" mode: max(1, s - 20)..s per sequence).
   - gradients (in test_flash_attn_output and the varlen test) -> attnfast.attention_backward
     and attention_varlen_backward against float64 gradients derived by hand in NumPy (no
     autograd; checked against finite differences), with flash-attn's factor 3.
   - test_flash_attn_kvcache -> attnfast.attention_with_kvcache: seqlen_q / seqlen_k pairs,
     cache_seqlens drawn per sequence, new k / v appended (seqlen_new = seqlen_q or drawn in
     1..seqlen_q), contiguous or paged with block size 256 (flash-attn's (num_blocks,
     block_size, Hkv, D) pool passed transposed, blocks placed by a random permutation),
     num_splits 1 / 0 -> num_threads 1 / default, MHA / MQA / GQA (6 over 6, 1, 3).
   Not ported: dropout (attnfast has none), rotary embeddings, cache_leftpad and
   cache_batch_idx (no attnfast equivalent).
2. llama.cpp, tests/test-backend-ops.cpp (ggml-org/llama.cpp, master): every
   test_flash_attn_ext case of make_test_cases_eval's FLASH_ATTN_EXT loops -- head sizes
   40..512 with their Dv (192/128, 320/256 and 576/512 (DeepSeek MLA: v a view of k)), GQA
   factors nr2 1..32, batch nr3 1 / 3, masks (f16 values in [-1, 1] with 128 x 64 blocks of
   -inf / 0), sinks (uniform in [-10, 10]), ALiBi (max_bias 8: ggml's slopes, applied by
   attnfast as positional ALiBi), logit_softcap 10, kv 113 / 512 / 1024, nb 1 / 3 / 32 / 75,
   permuted (token-major) layouts and K / V as views of a cache twice as long, with a float32
   q over F32 / F16 / BF16 K and V, and Q8_0 -> KVCache(dtype="int8"), Q4_1 ->
   KVCache(dtype="int4") (compared over the cache's dequantised contents). Not ported:
   prec (attnfast always accumulates in float32, so F32 and DEFAULT are the same call), Q5_0 /
   Q5_1 / Q4_0 / IQ4_NL / Q1_0 and mixed K / V types (no attnfast format).

Sizes: flash-attn's whole grid (23,040 output cases at batch 4) does not fit in minutes on a
2-core machine, so each flash-attn grid is every (seqlen pair x head dim x dtype) with the
option axes turned through all their combinations (`rotate`; `test_grids_cover_every_pair`
checks each grid holds every pair of values of any two axes); batch 2 (1 from 1024 x 1024 on),
and the float64 reference is taken on a sample of the query rows for long queries (every row
up to 512; beyond, the first and last 64 and every 7th between: every residue of the tile
sizes), while attnfast computes all of them. flash-attn's kvcache lengths of 128k keys run with
batch 1 and one KV head (16-bit: 256 MB of cache at D = 256 otherwise); 20000 keys with batch 1.
llama.cpp's grid is small and runs whole.

Each grid's cases are marked `slow` (``pytest -m slow``); every Nth of them also runs in the
default run (ids starting with "fast-"), and a few run on every kernel tier (`tier`).
"""
import itertools
import math
import zlib

import ml_dtypes
import numpy as np
import pytest
from threadpoolctl import threadpool_limits

import attnfast as af
from reference import reference_attention, visible_mask

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
DTYPE_NAMES = {F16: "fp16", BF16: "bf16", F32: "fp32", F64: "fp64"}


@pytest.fixture(autouse=True, scope="module")
def _one_blas_thread():
    """The references run on one BLAS thread: OpenBLAS's threads fight attnfast's OpenMP
    threads (and the machine's other jobs) for 2 cores, slowing small products 50x."""
    with threadpool_limits(1, user_api="blas"):
        yield


# ============================================================================ the rule

def flash_slack(ref, dtype, ulps=8.0):
    """The absolute slack of the rule: `ulps` ulps of the accumulation type (float32; float64
    for float64 inputs) at the reference's magnitude (at least 1)."""
    acc = F64 if np.dtype(dtype) == F64 else F32
    return ulps * float(np.finfo(acc).eps) * max(1.0, float(np.max(np.abs(ref), initial=0.0)))


def flash_factor(dtype, gradients=False):
    """The rule's factor: flash-attn's, 2 for outputs and 3 for gradients, for its own dtypes
    (float16, bfloat16), whose naive error is the 16-bit rounding of every step and dwarfs
    attnfast's (measured: at most 0.5 of the allowance on every tier). For float32 / float64
    inputs (attnfast's additions) 1.5x that: there the naive error is one draw of the same
    rounding attnfast makes, and moves with the summation order -- 20-40 % between
    flash-attn's two orders, ~10 % with OpenBLAS's thread count (1.25e-5 vs 1.39e-5 on
    varlen 1024x1023-d256-fp32-mqa-causal-kvpacked-softcap), up to 2x for attnfast between
    kernel tiers -- so flash-attn's factor would pass or fail on the BLAS and CPU at hand
    (measured at factor 2 / 3: up to 1.08 forward and 1.23 for gradients without softcap)."""
    base = 3.0 if gradients else 2.0
    return base if np.dtype(dtype).itemsize < 4 else 1.5 * base


def assert_flash_rule(got, ref, naive, *, dtype, factor=2.0, what="out", extra=0.0):
    """flash-attention's accuracy rule: ``max|got - ref| <= factor * max|naive - ref| + slack``.

    `ref` is the float64 reference; `naive` the same reference computed in the inputs'
    precision (flash-attn: ``attention_ref(..., upcast=False, reorder_ops=True)``, i.e. what a
    plain implementation in that dtype gets), or a list of such implementations (their
    largest error counts: flash-attn's two orders, reorder_ops True and False, see
    `check_output`); `got` is attnfast's result. flash-attn uses factor 2 for outputs and 3
    for gradients. The slack (`flash_slack`: 8 ulps of float32, or float64 for float64 inputs,
    at the output's magnitude) keeps the rule meaningful where the naive error vanishes
    (float64, or all-zero rows); `extra` is added to it where a kernel rounds by design
    (`int8_weight_rounding`). Non-finite values must match exactly. Returns (attnfast's
    error, the naive error)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    naives = [np.asarray(n, dtype=np.float64) for n in (naive if isinstance(naive, list)
                                                          else [naive])]
    assert all(got.shape == ref.shape == n.shape for n in naives), (what, got.shape, ref.shape)
    bad = ~np.isfinite(ref)
    np.testing.assert_array_equal(~np.isfinite(got), bad, err_msg=f"{what}: non-finite entries")
    err = float(np.max(np.abs(np.where(bad, 0, got - ref)), initial=0.0))
    base = max(float(np.max(np.abs(np.where(bad, 0, n - ref)), initial=0.0)) for n in naives)
    slack = flash_slack(np.where(bad, 0, ref), dtype) + extra
    assert err <= factor * base + slack, (
        f"{what}: attnfast's error {err:.3g} > {factor} x the naive {np.dtype(dtype).name} "
        f"error {base:.3g} + slack {slack:.2g} (max |ref| {np.max(np.abs(ref)):.3g})")
    return err, base


# ============================================================================ references

def _precision(naive):
    """(accumulation dtype, rounding function) for the float64 reference (naive None) or the
    naive implementation in dtype `naive`: 16-bit values rounded after every operation and
    summed in float32 inside products, float32 / float64 computed in themselves."""
    if naive is None:
        return F64, (lambda x: x)
    naive = np.dtype(naive)
    acc = F32 if naive.itemsize < 4 else naive
    return acc, (lambda x: np.asarray(x).astype(naive).astype(acc))


def _dot(a, b, naive):
    """a @ b, and in the naive implementation summed in another order (the contraction split
    in two halves, each a float32 / dtype product, then added): with flash-attn's reorder_ops
    alone, a float64 naive product equals the reference's whenever the scale is a power of
    two (D = 64, 256), and its error would be 0 instead of float64's."""
    if naive is None or a.shape[-1] < 2:
        return a @ b
    h = a.shape[-1] // 2
    return a[..., :h] @ b[..., :h, :] + a[..., h:] @ b[..., h:, :]


def attention_ref(q, k, v, *, scale=None, causal=False, window=None, softcap=None, alibi=None,
                  sinks=None, mask=None, kv_lens=None, rows=None, naive=None, order="k",
                  grad=None):
    """Materialised attention of q (B, H, Tq, D) over k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv).

    In float64 (naive=None; q scaled, as flash-attn's reference) or as a plain implementation
    in dtype `naive` (`_precision`) in one of flash-attn's two orders: order="k" is its
    reorder_ops=True (k scaled, not q; here also every product summed in two halves, `_dot`),
    order="q" its reorder_ops=False (q scaled, plain products). Options as attnfast documents them:
    softcap c: s -> c tanh(s / c); alibi (B, H): s -= slope |i' - j|; mask (additive float or
    bool, broadcastable to (B, H, Tq, Tk)); causal / window bottom-right aligned; sinks (H,)
    join the denominator. kv_lens (B,): sequence b uses its first kv_lens[b] keys (and aligns
    to them). rows: the query rows computed (default all). A row that sees nothing gives 0.

    With grad = dout (B, H, Tq, Dv) (all rows): returns (dq, dk, dv) instead, from
    dv = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O)), through the softcap's
    1 - tanh^2 and the scale (GQA: dk, dv summed over each KV head's query heads).
    Otherwise returns (out (B, H, len(rows), Dv), lse (B, H, len(rows)))."""
    B, H, Tq, D = q.shape
    Hkv, Tk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    rows = np.arange(Tq) if rows is None else np.asarray(rows)
    R = len(rows)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc, rnd = _precision(naive)
    cast = acc.type
    if mask is not None:
        mask = np.broadcast_to(np.asarray(mask), (B, H, Tq, Tk))
    out = np.zeros((B, H, R, Dv))
    lse = np.full((B, H, R), -np.inf)
    if grad is not None:
        assert R == Tq
        dq, dk, dv = np.zeros((B, H, Tq, D)), np.zeros((B, Hkv, Tk, D)), np.zeros((B, Hkv, Tk, Dv))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for b in range(B):
            n = Tk if kv_lens is None else int(kv_lens[b])
            if n == 0:
                continue
            keep = visible_mask(Tq, n, causal, window, rows=rows)
            dist = np.abs(rows[:, None] + (n - Tq) - np.arange(n)[None, :]).astype(acc)
            for g in range(Hkv):
                hs = slice(g * G, (g + 1) * G)
                Q = np.asarray(q[b, hs][:, rows]).astype(acc).reshape(G * R, D)
                K = np.asarray(k[b, g, :n]).astype(acc)
                V = np.asarray(v[b, g, :n]).astype(acc)
                split = naive if order == "k" else None  # `_dot` sums in halves if not None
                if naive is None or order == "q":  # the scale on q (A = q scale, B = k)
                    A, Bm = rnd(Q * cast(scale)), K
                else:  # on k (A = q, B = k scale)
                    A, Bm = Q, rnd(K * cast(scale))
                X = rnd(_dot(A, Bm.T, split))
                X = X.reshape(G, R, n)
                S = X
                if softcap:
                    T = rnd(np.tanh(rnd(X / cast(softcap))))
                    S = rnd(T * cast(softcap))
                if alibi is not None:
                    slopes = np.asarray(alibi, np.float64)[b, hs].astype(acc)
                    S = S - slopes[:, None, None] * dist
                if mask is not None:
                    m = mask[b, hs][:, rows, :n]
                    S = np.where(m, S, -np.inf) if m.dtype == bool else S + m.astype(acc)
                S = np.where(keep, S, -np.inf)
                top = S.max(axis=-1, keepdims=True)
                if sinks is not None:
                    sink = np.asarray(sinks, np.float64)[hs].astype(acc)[:, None, None]
                    top = np.maximum(top, sink)
                top = np.where(np.isfinite(top), top, 0)
                e = np.exp(S - top)
                total = e.sum(-1, keepdims=True)
                if sinks is not None:
                    total = total + np.exp(sink - top)
                P = rnd(np.where(total > 0, e / np.where(total > 0, total, 1), 0))
                O = rnd(_dot(P.reshape(G * R, n), V, split))
                out[b, hs] = O.reshape(G, R, Dv)
                t = total[..., 0]
                lse[b, hs] = np.where(t > 0, top[..., 0] + np.log(np.where(t > 0, t, 1)), -np.inf)
                if grad is None:
                    continue
                dO = np.asarray(grad[b, hs]).astype(acc).reshape(G * Tq, Dv)
                P2 = P.reshape(G * Tq, n)
                dv[b, g, :n] = rnd(_dot(P2.T, dO, split))
                dP = rnd(_dot(dO, V.T, split))
                # rowsum(dO * O) = rowsum(P * dP) (PyTorch's softmax backward uses the latter)
                delta = (rnd((P2 * dP).sum(-1, keepdims=True)) if naive is not None
                         else (dO * O).sum(-1, keepdims=True))
                dS = rnd(P2 * (dP - delta)).reshape(G, Tq, n)
                if softcap:
                    dS = rnd(rnd(rnd(dS * cast(softcap)) * (1 - T * T)) / cast(softcap))
                dS = dS.reshape(G * Tq, n)
                dA, dB = rnd(_dot(dS, Bm, split)), rnd(_dot(dS.T, A, split))  # d/dA, d/dBm
                if A is Q:  # the scale sits on k
                    dq[b, hs] = dA.reshape(G, Tq, D)
                    dk[b, g, :n] = rnd(dB * cast(scale))
                else:
                    dq[b, hs] = rnd(dA * cast(scale)).reshape(G, Tq, D)
                    dk[b, g, :n] = dB
    if grad is not None:
        return dq, dk, dv
    return out, lse


def sample_rows(tq):
    """The query rows the reference computes: all up to 512, else the first and last 64 and
    every 7th row between (7 is prime to the tile sizes: every residue of 16, 32, 64)."""
    if tq <= 512:
        return np.arange(tq)
    return np.array(sorted(set(range(64)) | set(range(tq - 64, tq)) | set(range(64, tq - 64, 7))))


def check_output(got, q, k, v, dtype, rows=None, what="out", factor=None, extra=0.0, **opts):
    """got (B, H, Tq, Dv) against the float64 reference on `rows`, by `assert_flash_rule`
    with the naive `dtype` implementation in flash-attn's order (reorder_ops=True), and where
    that fails, the larger naive error of both of flash-attn's orders: a naive error is one
    draw of float32 / float64 rounding (with scores near softcap 50, D = 256, a float32 score
    carries ~3e-6 of it, by summation order alone), and the larger of two keeps the rule from
    turning on which draw came up; for 16-bit inputs it changes nothing (their rounding
    dominates)."""
    rows = sample_rows(q.shape[2]) if rows is None else rows
    factor = flash_factor(dtype) if factor is None else factor
    got = np.asarray(got)[:, :, rows]
    ref, _ = attention_ref(q, k, v, rows=rows, **opts)
    naive = [attention_ref(q, k, v, rows=rows, naive=dtype, **opts)[0]]
    try:
        return assert_flash_rule(got, ref, naive, dtype=dtype, factor=factor, what=what,
                                 extra=extra)
    except AssertionError:
        naive.append(attention_ref(q, k, v, rows=rows, naive=dtype, order="q", **opts)[0])
        return assert_flash_rule(got, ref, naive, dtype=dtype, factor=factor, what=what,
                                 extra=extra)


def check_grads(grads, q, k, v, dout, dtype, factor=None, **opts):
    """attnfast's (dq, dk, dv) against the float64 gradients and the naive `dtype` ones (both
    orders where one is not enough, as `check_output`), by `flash_factor` (flash-attn's 3)."""
    factor = flash_factor(dtype, gradients=True) if factor is None else factor
    exact = attention_ref(q, k, v, grad=dout, **opts)
    naive = [attention_ref(q, k, v, grad=dout, naive=dtype, **opts)]
    for i, (name, got, ref) in enumerate(zip(("dq", "dk", "dv"), grads, exact)):
        try:
            assert_flash_rule(got, ref, [n[i] for n in naive], dtype=dtype, factor=factor,
                              what=name)
        except AssertionError:
            if len(naive) > 1:
                raise
            naive.append(attention_ref(q, k, v, grad=dout, naive=dtype, order="q", **opts))
            assert_flash_rule(got, ref, [n[i] for n in naive], dtype=dtype, factor=factor,
                              what=name)


# ============================================================================ grids

def rotate(sizes, options, stride):
    """Every size case (a dict) with one combination of the option axes (dict name ->
    values), chosen greedily: case i takes the combination that adds the most pairs not yet
    held (option with option, and option with each of the case's size values), then one not
    used yet, ties broken in the order (i * stride) mod their number. Deterministic; the
    first cases take each combination once while pairs allow, so with at least as many
    cases as combinations nearly all of them run (`test_grids_cover_every_pair` checks the
    pairs)."""
    names = list(options)
    combos = np.array(list(itertools.product(*(range(len(options[n])) for n in names))))
    ncomb = len(combos)
    assert math.gcd(stride, ncomb) == 1
    size_axes = list(sizes[0])
    size_values = {a: sorted({repr(s[a]) for s in sizes}) for a in size_axes}
    covered = {}
    for x, y in itertools.combinations(range(len(names)), 2):
        covered[x, y] = np.zeros((len(options[names[x]]), len(options[names[y]])), bool)
    for a in size_axes:
        for y in range(len(names)):
            covered[a, y] = np.zeros((len(size_values[a]), len(options[names[y]])), bool)
    used = np.zeros(ncomb, bool)
    out = []
    for i, size in enumerate(sizes):
        score = np.zeros(ncomb, np.int64)
        for x, y in itertools.combinations(range(len(names)), 2):
            score += ~covered[x, y][combos[:, x], combos[:, y]]
        sidx = {a: size_values[a].index(repr(size[a])) for a in size_axes}
        for a in size_axes:
            for y in range(len(names)):
                score += ~covered[a, y][sidx[a], combos[:, y]]
        order = (np.arange(ncomb) - i * stride) % ncomb
        pick = int(np.argmax((2 * score + ~used) * ncomb - order))
        used[pick] = True
        for x, y in itertools.combinations(range(len(names)), 2):
            covered[x, y][combos[pick, x], combos[pick, y]] = True
        for a in size_axes:
            for y in range(len(names)):
                covered[a, y][sidx[a], combos[pick, y]] = True
        out.append(dict(size, **{n: options[n][combos[pick, j]] for j, n in enumerate(names)}))
    return out


def pairs_missing(cases, axes):
    """The (axis, value, axis, value) pairs of `axes` (name -> values) no case holds."""
    missing = []
    for a, b in itertools.combinations(axes, 2):
        seen = {(c[a], c[b]) for c in cases}
        missing += [(a, x, b, y) for x in axes[a] for y in axes[b] if (x, y) not in seen]
    return missing


def seed_of(case_id):
    return zlib.crc32(case_id.encode())


def params(cases, ids, every, offset=0, xfails=None, fast_if=None):
    """pytest params: the whole grid as "<id>" marked slow, and every `every`-th case (from
    `offset`) of those `fast_if(case)` allows (default: all) as "fast-<id>" in the default run.
    xfails: id -> (reason, strict), an xfail in both."""
    xfails = xfails or {}

    def marks(cid):
        if cid not in xfails:
            return []
        reason, strict = xfails[cid]
        return [pytest.mark.xfail(strict=strict, reason=reason)]
    cheap = [(c, cid) for c, cid in zip(cases, ids) if fast_if is None or fast_if(c)]
    fast = [pytest.param(c, id="fast-" + cid, marks=marks(cid))
            for i, (c, cid) in enumerate(cheap) if i % every == offset]
    return fast + [pytest.param(c, id=cid, marks=marks(cid) + [pytest.mark.slow])
                   for c, cid in zip(cases, ids)]


FLASH_DTYPES = [F16, BF16, F32, F64]  # flash-attn: float16, bfloat16; attnfast adds two
FLASH_OPTIONS = dict(causal=[False, True], local=[False, True], alibi=[False, True],
                     softcap=[0.0, 50.0], mha_type=["mha", "mqa", "gqa"],
                     kvpacked=[False, True], deterministic=[False, True])

# test_flash_attn_output / test_flash_attn_varlen_output's lists
FLASH_OUTPUT_SEQLENS = [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256),
                        (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048)]
FLASH_OUTPUT_DIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
FLASH_VARLEN_SEQLENS = [(1, 147)] + FLASH_OUTPUT_SEQLENS
FLASH_VARLEN_DIMS = [32, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
# test_flash_attn_kvcache's lists
FLASH_KVCACHE_SEQLENS = [(1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799),
                         (64, 2048), (16, 20000), (1, 128 * 1024), (16, 128 * 1024), (128, 128)]
FLASH_KVCACHE_DIMS = [32, 59, 64, 80, 128, 256]
FLASH_KVCACHE_OPTIONS = dict(causal=[False, True], local=[False, True], alibi=[False, True],
                             new_kv=[False, True], seqlen_new_eq_seqlen_q=[True, False],
                             paged_kv_block_size=[None, 256], mha_type=["mha", "mqa", "gqa"],
                             num_splits=[1, 0])
FLASH_KVCACHE_DTYPES = [F16, BF16, F32]  # flash-attn: float16


def _flash_id(c, extra=()):
    flags = [n for n in ("causal", "local", "alibi", "kvpacked", "deterministic", "new_kv")
             if c.get(n)]
    if c.get("softcap"):
        flags.append("softcap")
    flags += list(extra)
    return "-".join([f"{c['seqlen_q']}x{c['seqlen_k']}", f"d{c['d']}", DTYPE_NAMES[c["dtype"]],
                     c["mha_type"]] + flags)


def _flash_grid(seqlens, dims, stride, dtypes=None, keep=lambda sq, sk: True):
    """Every (seqlen pair x head dim), with every dtype (`dtypes`) or the dtype turned with
    the options (None), the option axes turned through their combinations (`rotate`)."""
    sizes = [dict(seqlen_q=sq, seqlen_k=sk, d=d) for (sq, sk), d in itertools.product(seqlens, dims)
             if keep(sq, sk)]
    if dtypes is None:
        cases = rotate(sizes, dict(FLASH_OPTIONS, dtype=FLASH_DTYPES), stride=stride)
    else:
        cases = rotate([dict(size, dtype=dt) for size in sizes for dt in dtypes], FLASH_OPTIONS,
                       stride=stride)
    return cases, [_flash_id(c) for c in cases]


def flash_output_cases():
    return _flash_grid(FLASH_OUTPUT_SEQLENS, FLASH_OUTPUT_DIMS, 53, dtypes=FLASH_DTYPES)


def flash_backward_cases():
    """test_flash_attn_output's gradients: every (seqlen pair x head dim), the dtype turned
    with the options (the backward costs ~3 forwards and its reference has no row sample)."""
    return _flash_grid(FLASH_OUTPUT_SEQLENS, FLASH_OUTPUT_DIMS, 97)


def flash_varlen_cases():
    return _flash_grid(FLASH_VARLEN_SEQLENS, FLASH_VARLEN_DIMS, 59, dtypes=FLASH_DTYPES)


def flash_varlen_backward_cases():
    return _flash_grid(FLASH_VARLEN_SEQLENS, FLASH_VARLEN_DIMS, 71,
                       keep=lambda sq, sk: sq * sk <= 512 * 512)


def flash_kvcache_cases():
    sizes = [dict(seqlen_q=sq, seqlen_k=sk, d=d, dtype=dt)
             for (sq, sk), d, dt in itertools.product(FLASH_KVCACHE_SEQLENS, FLASH_KVCACHE_DIMS,
                                                      FLASH_KVCACHE_DTYPES)]
    cases = rotate(sizes, FLASH_KVCACHE_OPTIONS, stride=37)
    ids = []
    for c in cases:
        extra = ["paged256"] if c["paged_kv_block_size"] else []
        if c["new_kv"] and not c["seqlen_new_eq_seqlen_q"]:
            extra.append("newlt")
        extra.append(f"splits{c['num_splits']}")
        ids.append(_flash_id(c, extra))
    return cases, ids


# ---------------------------------------------------------------------------- llama.cpp

# ported of the loop's F32 F16 BF16 Q8_0 Q5_1 Q5_0 Q4_1 Q4_0 IQ4_NL
LLAMA_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_1"]


def llama_cases():
    """make_test_cases_eval's FLASH_ATTN_EXT loops, as (hsk, hsv, nh, nr2, nr3, kv, nb, mask,
    sinks, max_bias, logit_softcap, type_KV, permuted) dicts (prec and the unported types
    left out: see the module's docstring)."""
    cases = []
    for hsk, hsv in itertools.product([40, 64, 72, 80, 96, 128, 192, 256, 320, 512, 576],
                                      [40, 64, 72, 80, 96, 128, 192, 256, 512]):
        if hsk not in (192, 320, 576) and hsk != hsv:
            continue
        if (hsk == 192 and hsv not in (128, 192)) or (hsk == 576 and hsv != 512) \
                or (hsk == 320 and hsv != 256):
            continue
        for mask, sinks, max_bias, softcap, nh, nr3, nr2 in itertools.product(
                [True, False], [True, False], [0.0, 8.0], [0.0, 10.0], [1, 4], [1, 3],
                [1, 4, 8, 12, 16, 20, 32]):
            if (not mask and max_bias > 0) or (hsk != 128 and softcap != 0):
                continue
            if nh == 1 and hsk not in (320, 576):
                continue
            if hsk > 64 and nr3 > 1:
                continue
            if (nr2 == 8 and hsk != 192) or (nr2 == 12 and hsk != 128) \
                    or (nr2 == 16 and hsk != 192) or (nr2 == 20 and (nh != 1 or hsk != 576)) \
                    or (nr2 == 32 and (nh != 1 or hsk != 320)):
                continue
            for kv, nb, t in itertools.product([113, 512, 1024], [1, 3, 32, 75], LLAMA_TYPES):
                if nr2 != 1 and kv != 512:
                    continue
                if t != "f16" and hsk not in (64, 72):
                    continue
                base = dict(hsk=hsk, hsv=hsv, nh=nh, nr2=nr2, nr3=nr3, kv=kv, nb=nb, mask=mask,
                            sinks=sinks, max_bias=max_bias, softcap=softcap, type=t)
                cases.append(dict(base, permuted=False))
                if mask and max_bias == 0 and softcap == 0 and kv == 512:
                    cases.append(dict(base, permuted=True))
    ids = ["hs{hsk}-{hsv}-nh{nh}-nr{nr2}x{nr3}-kv{kv}-nb{nb}-{type}".format(**c)
           + "".join(s for s, on in (("-mask", c["mask"]), ("-sinks", c["sinks"]),
                                     ("-alibi", c["max_bias"]), ("-softcap", c["softcap"]),
                                     ("-permuted", c["permuted"])) if on)
           for c in cases]
    return cases, ids


# ============================================================================ data

def _flash_heads(c):
    H = 6 if not c["softcap"] else 4  # flash-attn: "softcap reference impl takes more memory"
    Hkv = {"mha": H, "mqa": 1, "gqa": 2}[c["mha_type"]]
    return H, Hkv


def _flash_window(rng, c):
    if not c["local"]:
        return None
    left, right = (int(x) for x in rng.integers(0, c["seqlen_k"], 2))
    return (left, 0) if c["causal"] else (left, right)


def _flash_qkv(rng, c, B, H, Hkv, sq, sk):
    """q, k, v as flash-attn lays them out ((B, S, H, D), k and v in one packed (B, S, 2, Hkv,
    D) buffer when kvpacked), passed to attnfast as transposed views."""
    d, dt = c["d"], c["dtype"]
    q = rng.standard_normal((B, sq, H, d), dtype=np.float32)
    if c["softcap"]:
        q *= c["softcap"]  # flash-attn: "ensure the values of qk are at least within softcap range"
    q = q.astype(dt).transpose(0, 2, 1, 3)
    if c["kvpacked"]:
        kv = rng.standard_normal((B, sk, 2, Hkv, d), dtype=np.float32).astype(dt)
        k, v = kv[:, :, 0].transpose(0, 2, 1, 3), kv[:, :, 1].transpose(0, 2, 1, 3)
    else:
        k = rng.standard_normal((B, sk, Hkv, d), dtype=np.float32).astype(dt).transpose(0, 2, 1, 3)
        v = rng.standard_normal((B, sk, Hkv, d), dtype=np.float32).astype(dt).transpose(0, 2, 1, 3)
    return q, k, v


def _flash_batch(sq, sk):
    return 1 if sq * sk >= 1024 * 1000 else 2


def _opts(c, window, slopes):
    return dict(causal=c["causal"], window=window, softcap=c["softcap"] or None, alibi=slopes)


def _af_opts(o):
    return dict(causal=o["causal"], window=o["window"], softcap=o["softcap"],
                alibi_slopes=o["alibi"])


# ============================================================================ flash-attn tests

OUTPUT_CASES, OUTPUT_IDS = flash_output_cases()
BACKWARD_CASES, BACKWARD_IDS = flash_backward_cases()
VARLEN_CASES, VARLEN_IDS = flash_varlen_cases()
VARLEN_BACKWARD_CASES, VARLEN_BACKWARD_IDS = flash_varlen_backward_cases()
KVCACHE_CASES, KVCACHE_IDS = flash_kvcache_cases()
LLAMA_CASES, LLAMA_IDS = llama_cases()

# What the whole grid found (run on the avx2 and generic tiers): float32 / float64 gradients
# at softcap 50 exceed the rule. attnfast's backward recomputes every probability as
# exp(s - lse) from the forward's lse, which is float32 for float32 inputs: with scores near
# +-50, |lse| ~ 50 and one float32 ulp of it (3.8e-6) is a relative error of ~4e-6 in every
# probability (float64: the same with 2^-53, plus the rounding of s - lse at |s| ~ 50), where
# a naive implementation normalises its probabilities directly. Float64 gradients computed
# from attnfast's float32 lse alone reproduce the size of its error (varlen
# 1x147-d224-fp32-mqa-causal-local-softcap, sequence 1: dv 2.5e-5 from attnfast, 9.8e-6 from
# float64 with its lse, 2.0e-6 naive float32). 24 of the grid's 44 such cases exceed
# flash-attn's factor 3 on both tiers, 26 on one (at most 2.8x the allowance); at this file's
# factor 4.5 they straddle the rule depending on tier, so the grid marks the whole category
# xfail (not strict) and `test_float_gradients_at_softcap_50` holds the four that exceed
# flash-attn's factor 3 by >= 1.6x on both tiers as strict xfails.
SOFTCAP_GRADS_REASON = (
    "float32/float64 gradients at softcap 50: attnfast's backward recomputes P = exp(s - lse) "
    "from the forward's lse (float32 for float32 inputs; |lse| ~ 50), a relative error of "
    "~|lse| ulp in every probability: 3-8x a naive same-precision implementation's error")


def _softcap_grads_xfails(cases, ids):
    return {cid: (SOFTCAP_GRADS_REASON, False) for c, cid in zip(cases, ids)
            if c["softcap"] and np.dtype(c["dtype"]).itemsize >= 4}


OUTPUT_XFAILS = {}
BACKWARD_XFAILS = dict(_softcap_grads_xfails(BACKWARD_CASES, BACKWARD_IDS), **{
    # MQA, causal, 2048 x 2048: key 0 is seen by all 6 x 2048 query rows, and its dv row sums
    # those 12288 contributions in one running float64 sum: 6.6e-14 (avx2; generic 6.9e-14)
    # against the naive's 5.3e-15 (|dv| 8); a float64 sum of the same P (from lse) in one
    # sequential pass (np.einsum) gives 7.1e-14, in 64-row blocks added up 1.2e-14. Fails
    # on both tiers at 1.6-1.7x the allowance (the float32 case 2048x2048-d64-fp32-mqa: dk,
    # 1.3x at flash-attn's factor 3, passes at 4.5).
    "2048x2048-d128-fp64-mqa-causal": (
        "long MQA backward: dv of the first keys accumulates all H x Tq = 12288 (head, row) "
        "contributions in one running sum: 12x the naive float64 error at key 0 (6.6e-14 vs "
        "5.3e-15, |dv| 8); blocked or pairwise accumulation of the per-tile partial sums "
        "would bring it to ~1.2e-14", True)})
VARLEN_XFAILS = {}
VARLEN_BACKWARD_XFAILS = _softcap_grads_xfails(VARLEN_BACKWARD_CASES, VARLEN_BACKWARD_IDS)
KVCACHE_XFAILS = {}
LLAMA_XFAILS = {}


def _not_huge(c):
    """The default run leaves the 2048 x 2048 cases to the slow run."""
    return c["seqlen_q"] * c["seqlen_k"] < 2048 * 2048


def _flash_problem(c, case_id):
    """A flash-attn grid case's generator (after drawing), q, k, v and options."""
    rng = np.random.default_rng(seed_of(case_id))
    sq, sk = c["seqlen_q"], c["seqlen_k"]
    B = _flash_batch(sq, sk)
    H, Hkv = _flash_heads(c)
    window = _flash_window(rng, c)
    q, k, v = _flash_qkv(rng, c, B, H, Hkv, sq, sk)
    slopes = (rng.random((B, H)) * 0.3).astype(np.float32) if c["alibi"] else None
    return rng, q, k, v, _opts(c, window, slopes)


def run_flash_output(c, case_id):
    _, q, k, v, o = _flash_problem(c, case_id)
    out = af.attention(q, k, v, **_af_opts(o))
    B, H, sq = q.shape[:3]
    assert out.dtype == c["dtype"] and out.shape == (B, H, sq, c["d"])
    if c["deterministic"]:
        np.testing.assert_array_equal(af.attention(q, k, v, num_threads=1, **_af_opts(o)), out)
    check_output(out, q, k, v, c["dtype"], **o)


@pytest.mark.parametrize("case", params(OUTPUT_CASES, OUTPUT_IDS, every=17, offset=3,
                                        xfails=OUTPUT_XFAILS, fast_if=_not_huge))
def test_flash_attn_output(case, request):
    run_flash_output(case, request.node.callspec.id.removeprefix("fast-"))


@pytest.mark.parametrize("case", params(BACKWARD_CASES, BACKWARD_IDS, every=11, offset=1,
                                        xfails=BACKWARD_XFAILS, fast_if=_not_huge))
def test_flash_attn_output_grads(case, request):
    run_flash_grads(case, request.node.callspec.id.removeprefix("fast-"))


def run_flash_grads(c, case_id, factor=None):
    rng, q, k, v, o = _flash_problem(c, case_id)
    dt = c["dtype"]
    out, lse = af.attention(q, k, v, return_lse=True, **_af_opts(o))
    dout = rng.standard_normal(out.shape, dtype=np.float32).astype(dt)
    grads = af.attention_backward(dout, q, k, v, out, lse, **_af_opts(o))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert all(g.dtype == dt for g in grads)
    if c["deterministic"]:
        again = af.attention_backward(dout, q, k, v, out, lse, num_threads=1, **_af_opts(o))
        for g, h in zip(grads, again):
            np.testing.assert_array_equal(g, h)
    check_grads(grads, q, k, v, dout, dt, factor=factor, **o)


def _varlen_data(rng, c):
    """Packed sequences as flash-attn's varlen test builds them: batch 2 (1 from 1024 x 1024
    on: flash-attn uses 4), lengths drawn in max(1, s - 20)..s ("random" padding mode)."""
    sq, sk = c["seqlen_q"], c["seqlen_k"]
    B = _flash_batch(sq, sk)
    H, Hkv = _flash_heads(c)
    lq = rng.integers(max(1, sq - 20), sq + 1, B)
    lk = rng.integers(max(1, sk - 20), sk + 1, B)
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    d, dt = c["d"], c["dtype"]
    q = rng.standard_normal((cu_q[-1], H, d), dtype=np.float32)
    if c["softcap"]:
        q *= c["softcap"]
    q = q.astype(dt)
    if c["kvpacked"]:
        kv = rng.standard_normal((cu_k[-1], 2, Hkv, d), dtype=np.float32).astype(dt)
        k, v = kv[:, 0], kv[:, 1]
    else:
        k = rng.standard_normal((cu_k[-1], Hkv, d), dtype=np.float32).astype(dt)
        v = rng.standard_normal((cu_k[-1], Hkv, d), dtype=np.float32).astype(dt)
    slopes = (rng.random((B, H)) * 0.3).astype(np.float32) if c["alibi"] else None
    window = _flash_window(rng, c)
    return B, cu_q, cu_k, q, k, v, slopes, window


def _seq(a, cu, b):
    """Sequence b of a packed (total, H, D) array as (1, H, T, D)."""
    return a[cu[b]:cu[b + 1]].transpose(1, 0, 2)[None]


@pytest.mark.parametrize("case", params(VARLEN_CASES, VARLEN_IDS, every=17, offset=5,
                                        xfails=VARLEN_XFAILS, fast_if=_not_huge))
def test_flash_attn_varlen_output(case, request):
    run_flash_varlen(case, request.node.callspec.id.removeprefix("fast-"))


def run_flash_varlen(c, case_id):
    rng = np.random.default_rng(seed_of(case_id))
    B, cu_q, cu_k, q, k, v, slopes, window = _varlen_data(rng, c)
    opts = dict(causal=c["causal"], window=window, softcap=c["softcap"] or None,
                alibi_slopes=slopes)
    out = af.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=c["seqlen_q"],
                              max_seqlen_k=c["seqlen_k"], **opts)
    assert out.shape == (cu_q[-1], q.shape[1], c["d"]) and out.dtype == c["dtype"]
    if c["deterministic"]:
        np.testing.assert_array_equal(
            af.attention_varlen(q, k, v, cu_q, cu_k, num_threads=1, **opts), out)
    for b in range(B):
        qb, kb, vb = _seq(q, cu_q, b), _seq(k, cu_k, b), _seq(v, cu_k, b)
        o = _opts(c, window, None if slopes is None else slopes[b:b + 1])
        check_output(_seq(out, cu_q, b), qb, kb, vb, c["dtype"], what=f"out of sequence {b}", **o)


@pytest.mark.parametrize("case", params(VARLEN_BACKWARD_CASES, VARLEN_BACKWARD_IDS, every=11,
                                        offset=2, xfails=VARLEN_BACKWARD_XFAILS))
def test_flash_attn_varlen_output_grads(case, request):
    run_flash_varlen_grads(case, request.node.callspec.id.removeprefix("fast-"))


def run_flash_varlen_grads(c, case_id, factor=None):
    rng = np.random.default_rng(seed_of(case_id))
    B, cu_q, cu_k, q, k, v, slopes, window = _varlen_data(rng, c)
    opts = dict(causal=c["causal"], window=window, softcap=c["softcap"] or None,
                alibi_slopes=slopes)
    out, lse = af.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape, dtype=np.float32).astype(c["dtype"])
    dq, dk, dv = af.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **opts)
    for b in range(B):
        qb, kb, vb = _seq(q, cu_q, b), _seq(k, cu_k, b), _seq(v, cu_k, b)
        o = _opts(c, window, None if slopes is None else slopes[b:b + 1])
        check_grads((_seq(dq, cu_q, b), _seq(dk, cu_k, b), _seq(dv, cu_k, b)), qb, kb, vb,
                    _seq(dout, cu_q, b), c["dtype"], factor=factor, **o)


def run_flash_kvcache(c, case_id):
    rng = np.random.default_rng(seed_of(case_id))
    sq, sk, d, dt = c["seqlen_q"], c["seqlen_k"], c["d"], c["dtype"]
    B = 2 if sk <= 4096 else 1  # flash-attn: 2
    H = 6
    Hkv = {"mha": 6, "mqa": 1, "gqa": 3}[c["mha_type"]] if sk < 100_000 else 1
    new_kv = c["new_kv"]
    window = _flash_window(rng, c)
    q = rng.standard_normal((B, sq, H, d), dtype=np.float32).astype(dt).transpose(0, 2, 1, 3)
    t_new = sq if c["seqlen_new_eq_seqlen_q"] else int(rng.integers(1, sq + 1))
    if new_kv:
        k_new = rng.standard_normal((B, t_new, Hkv, d), dtype=np.float32).astype(dt)
        v_new = rng.standard_normal((B, t_new, Hkv, d), dtype=np.float32).astype(dt)
        k_new, v_new = k_new.transpose(0, 2, 1, 3), v_new.transpose(0, 2, 1, 3)
        seqlens = rng.integers(0, sk - t_new + 1, B)
    else:
        k_new = v_new = None
        t_new = 0
        seqlens = rng.integers(1, sk + 1, B)
    bs = c["paged_kv_block_size"]
    if bs is None:
        k_cache = rng.standard_normal((B, sk, Hkv, d), dtype=np.float32).astype(dt)
        v_cache = rng.standard_normal((B, sk, Hkv, d), dtype=np.float32).astype(dt)
        k_arg, v_arg = k_cache.transpose(0, 2, 1, 3), v_cache.transpose(0, 2, 1, 3)
        table = None

        def logical(a):  # (B, Hkv, sk, d) as the sequences see the cache
            return a.transpose(0, 2, 1, 3)
    else:
        nblk = -(-sk // bs)
        num_blocks = nblk * B * (3 if sk <= 4096 else 1) + 1  # flash-attn: 3x, in random order
        k_pool = rng.standard_normal((num_blocks, bs, Hkv, d), dtype=np.float32).astype(dt)
        v_pool = rng.standard_normal((num_blocks, bs, Hkv, d), dtype=np.float32).astype(dt)
        table = rng.permutation(num_blocks)[:B * nblk].reshape(B, nblk).astype(np.int32)
        k_arg, v_arg = k_pool.transpose(0, 2, 1, 3), v_pool.transpose(0, 2, 1, 3)

        def logical(pool):
            return pool[table].reshape(B, nblk * bs, Hkv, d)[:, :sk].transpose(0, 2, 1, 3)
    k_expect, v_expect = logical(k_arg.transpose(0, 2, 1, 3)).copy(), logical(
        v_arg.transpose(0, 2, 1, 3)).copy()
    if new_kv:
        for b in range(B):
            k_expect[b, :, seqlens[b]:seqlens[b] + t_new] = k_new[b]
            v_expect[b, :, seqlens[b]:seqlens[b] + t_new] = v_new[b]
    slopes = (rng.random((B, H)) * 0.3).astype(np.float32) if c["alibi"] else None
    opts = dict(causal=c["causal"], window=window, alibi_slopes=slopes,
                num_threads=1 if c["num_splits"] == 1 else None)
    out = af.attention_with_kvcache(q, k_arg, v_arg, seqlens.copy(), k_new, v_new,
                                    block_table=table, **opts)
    assert out.shape == (B, H, sq, d) and out.dtype == dt
    # flash-attn checks the cache holds the new tokens (here: bit for bit, and nothing else moved)
    np.testing.assert_array_equal(logical(k_arg.transpose(0, 2, 1, 3)), k_expect)
    np.testing.assert_array_equal(logical(v_arg.transpose(0, 2, 1, 3)), v_expect)
    o = dict(causal=c["causal"], window=window, alibi=slopes, kv_lens=seqlens + t_new)
    check_output(out, q, k_expect, v_expect, dt, **o)


@pytest.mark.parametrize("case", params(KVCACHE_CASES, KVCACHE_IDS, every=13, offset=7,
                                        xfails=KVCACHE_XFAILS,
                                        fast_if=lambda c: c["seqlen_k"] <= 20000))
def test_flash_attn_kvcache(case, request):
    run_flash_kvcache(case, request.node.callspec.id.removeprefix("fast-"))


# ============================================================================ llama.cpp tests

def ggml_alibi_slopes(n_head, max_bias):
    """ggml's ALiBi slopes for n_head query heads (ggml_soft_max / flash_attn_ext): m0 =
    2^(-max_bias / n), m1 = 2^(-max_bias / 2 / n), n the largest power of two <= n_head;
    head h < n gets m0^(h + 1), the others m1^(2 (h - n) + 1)."""
    n = 1 << int(math.floor(math.log2(n_head)))
    m0, m1 = 2.0 ** (-max_bias / n), 2.0 ** (-(max_bias / 2.0) / n)
    return np.array([m0 ** (h + 1) if h < n else m1 ** (2 * (h - n) + 1) for h in range(n_head)],
                    dtype=np.float32)


def ggml_kq_mask(rng, kv, nb, nr3):
    """llama.cpp's test mask (init_tensor_kq_mask): f16 values uniform in [-1, 1], then
    int(0.2 * kv * nb * nr3 / (128 * 64)) blocks of 64 query rows x 128 keys at random places
    set to -inf or 0 (each with probability 1/2). Shape (nr3, 1, nb, kv), float32."""
    m = rng.uniform(-1, 1, (nr3, 1, nb, kv)).astype(np.float16).astype(np.float32)
    for _ in range(int(0.2 * kv * nb * nr3 / (128 * 64))):
        p3, p1, p0 = rng.integers(nr3), rng.integers(nb), rng.integers(kv)
        m[p3, 0, p1:p1 + 64, p0:p0 + 128] = -np.inf if rng.integers(2) else 0.0
    return m


def int4_decode(packed, dim):
    """float64 (..., dim) from int4 rows, per attnfast's documented layout (docs/user_guide/
    formats.md): blocks of 20 bytes, a uint32 of the bfloat16 scale s (low half) and minimum m
    (high half), then byte i = n[i] | n[i + 16] << 4; value i = s n[i] + m."""
    packed = np.asarray(packed)
    blocks = packed.reshape(packed.shape[:-1] + (-1, 20))
    head = blocks[..., :4].copy().view(np.uint32)[..., 0]
    s = (head & 0xFFFF).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    m = (head >> 16).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    nib = blocks[..., 4:20]
    n = np.concatenate([nib & 15, nib >> 4], axis=-1).astype(np.float64)  # values 0..15, 16..31
    vals = n * s[..., None] + m[..., None]
    return vals.reshape(packed.shape[:-1] + (-1,))[..., :dim]


def int8_mirrored_query(q, scale):
    """The query a vpdpbusd int8 decode reads (docs/user_guide/formats.md: each row of q x
    scale x log2 e, the kernels' base-2 units, quantised to int8 with its own scale
    max|x| / 127, round to nearest even), as the float64 q it stands for. A tier without
    that path reads q itself."""
    scale = scale * math.log2(math.e)
    x = q.astype(np.float32) * np.float32(scale)
    sq = (np.max(np.abs(x), axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(sq > 0, np.float32(1) / np.where(sq > 0, sq, 1), 0).astype(np.float32)
    return sq.astype(np.float64) * np.clip(np.rint(x * inv), -127, 127) / scale


def int8_pairs_run():
    """Whether an int8 cache's decode takes the vpdpbusd / vpdpwssd path here: the avx512bf16
    tier on a CPU with AVX512-VNNI, the int8 dot mode left at "auto"."""
    from attnfast import _ext
    from attnfast.bench.limits import cpu_flags
    info = _ext.runtime_info()
    return (info["isa"] == "avx512bf16" and info["int8_dot"] == "auto"
            and "avx512_vnni" in cpu_flags())


def int8_weight_rounding(q, kd, vd, **opts):
    """What P.V by vpdpwssd may add to an output (docs/user_guide/formats.md): each weight,
    probability times its V row's scale, is rounded to 1/32767 of the largest in its block of
    128 keys, at most half a step, so a row's error is at most the sum over its blocks of
    (keys in the block) x max_j (p_j max|v_j|) / 65534, with p the float64 reference's
    probabilities (read off as attention over one-hot values)."""
    B, Hkv, n, _ = kd.shape
    p, _ = attention_ref(q, kd, np.broadcast_to(np.eye(n), (B, Hkv, n, n)), **opts)
    vmax = np.abs(vd).max(axis=-1)                                       # (B, Hkv, n)
    pv = p * np.repeat(vmax, q.shape[1] // Hkv, axis=1)[:, :, None, :]  # (B, H, Tq, n)
    bound = sum(pv[..., lo:lo + 128].shape[-1] * pv[..., lo:lo + 128].max(axis=-1)
                for lo in range(0, n, 128)) / 65534
    return float(np.max(bound))


def _llama_cache(c, k, v, permuted):
    """Q8_0 / Q4_1 K and V (float32 (B, Hkv, kv, D)) stored in attnfast's int8 / int4 cache:
    a KVCache (unrotated: llama.cpp's formats are not rotated), or for the permuted cases
    caller-owned token-major arrays written by attention_with_kvcache. Returns (call, kd, vd):
    call(q, **options) -> out, and the float64 K, V the cache holds."""
    B, Hkv, kv, D = k.shape
    Dv = v.shape[-1]
    fmt = "int8" if c["type"] == "q8_0" else "int4"
    if not permuted:
        cache = af.KVCache(B, Hkv, D, kv, dtype=fmt, v_head_dim=Dv, key_rotation=None)
        cache.append(k, v)
        if fmt == "int8":
            kd = cache.k.astype(np.float64) * cache.k_scale[..., None]
            vd = cache.v.astype(np.float64) * cache.v_scale[..., None]
        else:
            kd, vd = int4_decode(cache.k, D), int4_decode(cache.v, Dv)
        return (lambda q, **o: cache.attend(q, causal=False, **o)), kd, vd
    if fmt == "int8":
        kc = np.zeros((B, kv, Hkv, D), np.int8).transpose(0, 2, 1, 3)
        vc = np.zeros((B, kv, Hkv, Dv), np.int8).transpose(0, 2, 1, 3)
        ks = np.zeros((B, kv, Hkv), np.float32).transpose(0, 2, 1)
        vs = np.zeros((B, kv, Hkv), np.float32).transpose(0, 2, 1)
        extra = dict(k_scale=ks, v_scale=vs)
    else:
        from attnfast._int4 import packed_size
        kc = np.zeros((B, kv, Hkv, packed_size(D)), np.uint8).transpose(0, 2, 1, 3)
        vc = np.zeros((B, kv, Hkv, packed_size(Dv)), np.uint8).transpose(0, 2, 1, 3)
        extra = dict(v_head_dim=Dv)
    state = {"written": False}

    def call(q, **o):
        if state["written"]:  # attend only
            return af.attention_with_kvcache(q, kc, vc, np.full(B, kv), causal=False,
                                             **extra, **o)
        state["written"] = True
        return af.attention_with_kvcache(q, kc, vc, np.zeros(B, np.int64), k, v,
                                         causal=False, **extra, **o)
    # the first call writes the tokens: do it with a throwaway query to read the cache back
    call(np.zeros((B, Hkv, 1, D), np.float32))
    if fmt == "int8":
        kd = kc.astype(np.float64) * ks[..., None]
        vd = vc.astype(np.float64) * vs[..., None]
    else:
        kd, vd = int4_decode(kc, D), int4_decode(vc, Dv)
    return call, kd, vd


def run_llama(c, case_id):
    rng = np.random.default_rng(seed_of(case_id))
    B, H, Hkv, Tq, Tk = c["nr3"], c["nh"] * c["nr2"], c["nh"], c["nb"], c["kv"]
    D, Dv, perm = c["hsk"], c["hsv"], c["permuted"]

    def tensor(heads, t, dim, dtype, view=True):
        """uniform [-1, 1] data in ggml's layout: (B, T, heads, dim) memory when permuted, else
        (B, heads, T, dim); k and v are views of a buffer twice as long (ggml: "the K tensor is
        usually a view of the K cache")."""
        n = 2 if view else 1
        if perm:
            buf = rng.uniform(-1, 1, (B, t, n * heads, dim)).astype(np.float32).astype(dtype)
            return buf[:, :, :heads].transpose(0, 2, 1, 3)
        buf = rng.uniform(-1, 1, (B, heads, n * t, dim)).astype(np.float32).astype(dtype)
        return buf[:, :, :t]

    kv_dtype = {"f32": F32, "f16": F16, "bf16": BF16}.get(c["type"], F32)
    q = tensor(H, Tq, D, F32, view=False)
    k = tensor(Hkv, Tk, D, kv_dtype)
    mla = c["type"] == "f16" and (D, Dv) == (576, 512)
    v = k[..., :Dv] if mla else tensor(Hkv, Tk, Dv, kv_dtype)
    mask = ggml_kq_mask(rng, Tk, Tq, B) if c["mask"] else None
    sinks = rng.uniform(-10, 10, H).astype(np.float32) if c["sinks"] else None
    slopes = ggml_alibi_slopes(H, c["max_bias"]) if c["max_bias"] else None
    softcap = c["softcap"] or None
    af_opts = dict(mask=mask, sinks=sinks, softcap=softcap,
                   alibi_slopes=None if slopes is None else slopes)
    ref_opts = dict(mask=mask, sinks=sinks, softcap=softcap,
                    alibi=None if slopes is None else np.broadcast_to(slopes, (B, H)))
    if c["type"] in ("q8_0", "q4_1"):
        call, kd, vd = _llama_cache(c, np.ascontiguousarray(k, dtype=np.float32),
                                    np.ascontiguousarray(v, dtype=np.float32), perm)
        out = call(q, **af_opts)
        assert out.shape == (B, H, Tq, Dv) and out.dtype == F32
        if c["type"] == "q8_0" and int8_pairs_run():
            # the vpdpbusd / vpdpwssd decode rounds q, and the weights per block; a call it
            # does not take (prefill rows) reads q itself and passes the first try
            qq = int8_mirrored_query(q, 1 / math.sqrt(D))
            try:
                check_output(out, q, kd, vd, F32, **ref_opts)
            except AssertionError:
                check_output(out, qq, kd, vd, F32,
                             extra=int8_weight_rounding(qq, kd, vd, **ref_opts), **ref_opts)
        else:
            check_output(out, q, kd, vd, F32, **ref_opts)
        if c["type"] == "q8_0":  # and the storage error stays what the docs state (< 0.02)
            exact, _ = attention_ref(q, k, v, **ref_opts)
            assert np.max(np.abs(out - exact)) < 0.02
        return
    out = af.attention(q, k, v, **af_opts)
    assert out.shape == (B, H, Tq, Dv) and out.dtype == F32
    check_output(out, q, k, v, F32, **ref_opts)


@pytest.mark.parametrize("case", params(LLAMA_CASES, LLAMA_IDS, every=41, offset=11,
                                        xfails=LLAMA_XFAILS))
def test_llama_cpp_flash_attn_ext(case, request):
    run_llama(case, request.node.callspec.id.removeprefix("fast-"))


@pytest.mark.xfail(strict=True, reason=SOFTCAP_GRADS_REASON)
@pytest.mark.parametrize("grid,case_id", [
    ("output", "1024x1024-d128-fp64-mqa-causal-local-alibi-kvpacked-deterministic-softcap"),
    ("output", "512x256-d128-fp64-mqa-local-alibi-softcap"),
    ("varlen", "512x256-d160-fp64-gqa-causal-alibi-kvpacked-deterministic-softcap"),
    ("varlen", "1x147-d224-fp32-mqa-causal-local-softcap")])
def test_float_gradients_at_softcap_50(grid, case_id):
    """flash-attn's own rule (factor 3) on the grid's float32 / float64 softcap gradients that
    exceed it most on every tier here (2.1, 1.6, 1.9, 1.8x the allowance at least): a fix of
    the cause (e.g. lse, or s - lse, kept in float64) turns these into XPASS."""
    if grid == "output":
        run_flash_grads(BACKWARD_CASES[BACKWARD_IDS.index(case_id)], case_id, factor=3.0)
    else:
        run_flash_varlen_grads(VARLEN_BACKWARD_CASES[VARLEN_BACKWARD_IDS.index(case_id)],
                               case_id, factor=3.0)


# ============================================================================ tiers and meta

TIER_OUTPUT = [i for i, c in enumerate(OUTPUT_CASES) if c["seqlen_q"] * c["seqlen_k"] < 30000][:6]
TIER_KVCACHE = [i for i, c in enumerate(KVCACHE_CASES) if c["seqlen_k"] <= 1024][:4]
TIER_LLAMA = [i for i, c in enumerate(LLAMA_CASES)
              if c["type"] in ("bf16", "q8_0", "q4_1") and c["kv"] == 113
              and c["nb"] in (1, 3)][::5]
TIER_GRADS = [i for i, c in enumerate(BACKWARD_CASES)
              if c["seqlen_q"] * c["seqlen_k"] < 30000 and not c["softcap"]][:3]
TIER_VARLEN = [i for i, c in enumerate(VARLEN_CASES) if c["seqlen_q"] * c["seqlen_k"] < 30000][:3]


@pytest.mark.parametrize("which,index", [("output", i) for i in TIER_OUTPUT]
                         + [("kvcache", i) for i in TIER_KVCACHE]
                         + [("llama", i) for i in TIER_LLAMA]
                         + [("grads", i) for i in TIER_GRADS]
                         + [("varlen", i) for i in TIER_VARLEN],
                         ids=lambda x: str(x))
def test_grids_on_every_tier(tier, which, index):
    """A few small cases of each grid on every kernel tier this CPU runs."""
    cases, ids, run = {"output": (OUTPUT_CASES, OUTPUT_IDS, run_flash_output),
                       "kvcache": (KVCACHE_CASES, KVCACHE_IDS, run_flash_kvcache),
                       "llama": (LLAMA_CASES, LLAMA_IDS, run_llama),
                       "grads": (BACKWARD_CASES, BACKWARD_IDS, run_flash_grads),
                       "varlen": (VARLEN_CASES, VARLEN_IDS, run_flash_varlen)}[which]
    run(cases[index], ids[index])


@pytest.mark.parametrize("name", ["output", "backward", "varlen", "varlen_backward", "kvcache"])
def test_grids_cover_every_pair(name):
    """Each flash-attn grid holds every value of every ported axis, and every pair of values
    of any two axes (seqlen pair, head dim, dtype and each option)."""
    cases, lists = {
        "output": (OUTPUT_CASES, dict(FLASH_OPTIONS, seqlens=FLASH_OUTPUT_SEQLENS,
                                      d=FLASH_OUTPUT_DIMS, dtype=FLASH_DTYPES)),
        "backward": (BACKWARD_CASES, dict(FLASH_OPTIONS, seqlens=FLASH_OUTPUT_SEQLENS,
                                          d=FLASH_OUTPUT_DIMS, dtype=FLASH_DTYPES)),
        "varlen": (VARLEN_CASES, dict(FLASH_OPTIONS, seqlens=FLASH_VARLEN_SEQLENS,
                                      d=FLASH_VARLEN_DIMS, dtype=FLASH_DTYPES)),
        "varlen_backward": (VARLEN_BACKWARD_CASES, dict(
            FLASH_OPTIONS, seqlens=[p for p in FLASH_VARLEN_SEQLENS if p[0] * p[1] <= 512 * 512],
            d=FLASH_VARLEN_DIMS, dtype=FLASH_DTYPES)),
        "kvcache": (KVCACHE_CASES, dict(FLASH_KVCACHE_OPTIONS, seqlens=FLASH_KVCACHE_SEQLENS,
                                        d=FLASH_KVCACHE_DIMS, dtype=FLASH_KVCACHE_DTYPES)),
    }[name]
    cases = [dict(c, seqlens=(c["seqlen_q"], c["seqlen_k"])) for c in cases]
    assert pairs_missing(cases, lists) == []
    ids = {"output": OUTPUT_IDS, "backward": BACKWARD_IDS, "varlen": VARLEN_IDS,
           "varlen_backward": VARLEN_BACKWARD_IDS, "kvcache": KVCACHE_IDS}[name]
    assert len(set(ids)) == len(ids)


def test_llama_grid_is_the_loops():
    """The ported llama.cpp cases: the loops' count less prec (x2 at hsk 128) and the unported
    types, each case once."""
    assert len(LLAMA_IDS) == len(set(LLAMA_IDS))
    by_type = {t: sum(c["type"] == t for c in LLAMA_CASES) for t in LLAMA_TYPES}
    assert by_type == {"f32": 336, "f16": 2136, "bf16": 336, "q8_0": 336, "q4_1": 336}
    assert {(c["hsk"], c["hsv"]) for c in LLAMA_CASES} >= {(576, 512), (320, 256), (192, 128),
                                                           (40, 40), (512, 512)}


def test_reference_and_rule_can_fail():
    """The reference here agrees with tests/reference.py, the naive float16 reference carries
    float16's error, and the rule rejects an error a little over twice the naive one."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 9, 24)).astype(np.float16)
    k = rng.standard_normal((2, 2, 13, 24)).astype(np.float16)
    v = rng.standard_normal((2, 2, 13, 24)).astype(np.float16)
    slopes = rng.random((2, 4)) * 0.3
    sinks = rng.standard_normal(4)
    mask = rng.random((2, 1, 9, 13)) > 0.2
    opts = dict(causal=True, window=(5, 0), softcap=3.0, sinks=sinks, mask=mask)
    mine, lse = attention_ref(q, k, v, alibi=slopes, **opts)
    theirs, their_lse, _ = reference_attention(q, k, v, alibi_slopes=slopes, **opts)
    np.testing.assert_allclose(mine, theirs, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, their_lse, rtol=1e-12, atol=1e-12)
    naive, _ = attention_ref(q, k, v, alibi=slopes, naive=F16, **opts)
    base = np.max(np.abs(naive - mine))
    assert 1e-4 < base < 1e-2
    assert_flash_rule(mine + 2 * base, mine, naive, dtype=F16)
    with pytest.raises(AssertionError, match="naive float16 error"):
        assert_flash_rule(mine + 2.1 * base, mine, naive, dtype=F16)
    # gradients: the float64 ones match finite differences of the reference
    dout = rng.standard_normal((2, 4, 9, 24))
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    o = dict(opts, alibi=slopes)
    dq, dk, dv = attention_ref(q64, k64, v64, grad=dout, **o)
    eps = 1e-6
    for name, x, g in (("q", q64, dq), ("k", k64, dk), ("v", v64, dv)):
        idx = tuple(rng.integers(s) for s in x.shape)
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        args = {"q": (q64, k64, v64), "k": (q64, k64, v64), "v": (q64, k64, v64)}[name]
        plus = [xp if a is x else a for a in args]
        minus = [xm if a is x else a for a in args]
        fd = (np.sum(attention_ref(*plus, **o)[0] * dout)
              - np.sum(attention_ref(*minus, **o)[0] * dout)) / (2 * eps)
        assert abs(fd - g[idx]) < 1e-6 * max(1, abs(fd)), (name, fd, g[idx])
