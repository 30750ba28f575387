"""attnfast.explain: the kernel and work split a call would get, on each tier this CPU runs.

The fast kernels must be the ones chosen for the shapes and dtypes the project cares about
(float32 and 16-bit on the SIMD tiers, bfloat16 on avx512bf16, decode for short queries),
and the plan must be what the drivers do: its split is checked against the chunk rule of
csrc/kernels/kernel_table.hpp, and a call explain() describes as a multi-chunk decode is
checked against the float64 reference (so the merge it implies really ran).
"""
import json
import subprocess
import sys

import os

import numpy as np
import pytest

import attnfast as af
from attnfast import _ext
from attnfast._formats import BFLOAT16
from attnfast._formats import quantize_int8
from conftest import simd_decode_lanes
from reference import TOLERANCE, reference_attention

TIERS = _ext.runtime_info()["isa_available"]
X86_SIMD = {"avx2", "avx512", "avx512bf16"}
SIMD_PREFILL = X86_SIMD | {"neon", "generic"}  # generic: SSE2 on x86-64 only (below)
KEYS = {"tier", "path", "kernel", "kv_source", "split", "tasks", "threads", "regime",
        "latent_kv", "rows_per_kv_read", "shared_prefix", "policy"}


def _arrays(b, h, hkv, tq, tk, d, dv=None, dtype=np.float32, kv_dtype=None):
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    z = np.zeros
    return (z((b, h, tq, d), dtype), z((b, hkv, tk, d), kv_dtype),
            z((b, hkv, tk, d if dv is None else dv), kv_dtype))


def _generic_has_simd_prefill():
    return simd_decode_lanes("generic") is not None  # x86-64's generic: SSE2 kernels


def _prefill_kernel(tier, dtype):
    if dtype == np.float64:
        return "template_f64"
    if tier == "avx512bf16" and dtype == BFLOAT16:
        return "bf16_prefill"
    if tier in X86_SIMD or tier == "neon" or (tier == "generic" and _generic_has_simd_prefill()):
        return "simd_prefill"
    return "template_prefill"


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16, np.float64],
                         ids=["f32", "f16", "bf16", "f64"])
def test_prefill_kernel_per_tier(tier, dtype):
    q, k, v = _arrays(2, 8, 2, 200, 300, 128, dtype=dtype)
    plan = af.explain(q, k, v, causal=True, num_threads=2)
    assert set(plan) == KEYS
    assert plan["tier"] == tier
    assert plan["path"] == "prefill" and plan["split"] is None
    assert plan["kv_source"] == "contiguous"
    assert plan["kernel"] == _prefill_kernel(tier, dtype)
    assert plan["tasks"] >= 1 and 1 <= plan["threads"] <= min(2, plan["tasks"])


def _decode_kernel(tier, q_dtype, kv_dtype, d):
    if q_dtype == np.float64:
        return "template_f64"
    if tier == "avx512bf16" and q_dtype == BFLOAT16 and kv_dtype == BFLOAT16 and d % 32 == 0:
        return "bf16_decode"
    if (tier == "avx512bf16" and kv_dtype == np.int8 and d % 64 == 0 and d <= 512
            and _ext.runtime_info()["int8_dot"] != "widen"):
        return "vnni_int8_decode"  # (every CPU with AVX512_BF16 has AVX512-VNNI)
    lanes = simd_decode_lanes(tier)
    if lanes and d % lanes == 0:
        return "simd_decode"
    return "template_decode"


@pytest.mark.parametrize("q_dtype,kv_dtype", [
    (np.float32, np.float32), (BFLOAT16, BFLOAT16), (np.float16, np.float16),
    (np.float32, BFLOAT16), (np.float64, np.float64)], ids=["f32", "bf16", "f16", "f32q_bf16kv", "f64"])
@pytest.mark.parametrize("d", [128, 40, 37])
def test_decode_kernel_per_tier(tier, q_dtype, kv_dtype, d):
    q, k, v = _arrays(1, 8, 2, 1, 1000, d, dtype=q_dtype, kv_dtype=kv_dtype)
    plan = af.explain(q, k, v)
    assert plan["path"] == "decode"
    assert plan["kernel"] == _decode_kernel(tier, q_dtype, kv_dtype, d)


def _chunk_keys(d, dv, elem_bytes):
    """kernel_table.hpp's decode_chunk_keys for an L2 of at least 1 MiB (the bound it is
    clamped to; a smaller L2 skips the test)."""
    keys = 4096
    while keys > 64 and keys * (d + dv) * elem_bytes > 1024 * 1024:
        keys //= 2
    return keys


def _head_groups(kv_heads, group, tq, chunks, threads):
    """decode.cpp's split_decode for a compute-shaped kernel: the heads of each KV head
    halved into groups (at least 32 rows each) while the call has at most half as many tasks
    as threads; one thread keeps one group."""
    heads = group
    while 2 * kv_heads * -(-group // heads) * chunks <= threads and heads // 2 * tq >= 32:
        heads = -(-heads // 2)
    return -(-group // heads)


def _l2_bytes():
    """The L2 size the core reads (sysconf), via getconf; 0 when it does not say."""
    try:
        out = subprocess.run(["getconf", "LEVEL2_CACHE_SIZE"], capture_output=True, text=True)
        return int(out.stdout.strip() or 0)
    except (OSError, ValueError):
        return 0


@pytest.mark.skipif(_l2_bytes() < 1 << 20, reason="the chunk rule below assumes an L2 >= 1 MiB")
def test_decode_split_follows_the_chunk_rule():
    # (2 positions x 4 heads: 8 rows per KV head, below every tier's gemm_decode bound)
    for tq, d, dtype, elem in [(1, 128, np.float32, 4), (2, 64, BFLOAT16, 2), (4, 128, np.float64, 8)]:
        tk = 10_000
        q, k, v = _arrays(3, 8, 2, tq, tk, d, dtype=dtype)
        plan = af.explain(q, k, v, num_threads=2)
        chunk = _chunk_keys(d, d, elem)
        assert plan["path"] == "decode"
        assert plan["split"] == {"chunk_keys": chunk, "chunks": -(-tk // chunk), "head_groups": 1,
                                 "tasks": 3 * 2 * -(-tk // chunk)}
        assert plan["tasks"] == plan["split"]["tasks"]
    # a window sees only the last keys: only the chunks holding them are tasks
    q, k, v = _arrays(1, 4, 4, 1, 10_000, 128)
    plan = af.explain(q, k, v, causal=True, window=(100, 0))
    assert plan["split"]["chunks"] == 1 and plan["split"]["tasks"] == 4
    # 65 query rows are a prefill (above every decode-path row limit of kernel_table.hpp; 17-20
    # rows over a long cache stay on a hand-written decode where the tier has one)
    q, k, v = _arrays(1, 4, 4, 65, 10_000, 128)
    assert af.explain(q, k, v)["path"] == "prefill"


def test_a_multi_chunk_decode_matches_the_reference(rng):
    q = rng.standard_normal((1, 4, 2, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, 9000, 64)).astype(np.float32)
    v = rng.standard_normal((1, 2, 9000, 64)).astype(np.float32)
    plan = af.explain(q, k, v, causal=True)
    assert plan["split"]["chunks"] >= 2  # the merge runs
    out, lse = af.attention(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse, _ = reference_attention(q, k, v, causal=True)
    np.testing.assert_allclose(out, ref_out, **TOLERANCE[np.dtype(np.float32)])
    np.testing.assert_allclose(lse, ref_lse, **TOLERANCE[np.dtype(np.float32)])


def test_kv_cache_calls(tier):
    b, hkv, cap, d = 2, 2, 512, 128
    q = np.zeros((b, 8, 1, d), np.float32)
    kc = np.zeros((b, hkv, cap, d), np.float32)
    plan = af.explain(q, kc, kc.copy(), cache_seqlens=[100, 300])
    assert plan["path"] == "decode" and plan["kv_source"] == "contiguous"
    assert plan["split"]["chunks"] == 1  # 300 keys fit one chunk
    # int8 cache
    k8, ks = quantize_int8(np.ones((b, hkv, cap, d), np.float32))
    plan = af.explain(q, k8, k8.copy(), cache_seqlens=[5, 6], k_scale=ks, v_scale=ks.copy())
    assert plan["kernel"] == _decode_kernel(tier, np.float32, np.int8, d)
    # paged pool, a prompt of 40 tokens: a prefill over the pool
    pool = np.zeros((8, hkv, 64, d), np.float32)
    table = np.array([[0, 1], [2, 3]])
    q40 = np.zeros((b, 8, 40, d), np.float32)
    plan = af.explain(q40, pool, pool.copy(), cache_seqlens=[10, 20], block_table=table,
                      k_new=np.ones((b, hkv, 40, d), np.float32),
                      v_new=np.ones((b, hkv, 40, d), np.float32))
    assert plan["path"] == "prefill" and plan["kv_source"] == "paged"
    assert plan["kernel"] == _prefill_kernel(tier, np.float32)
    assert not pool.any()  # nothing written


def test_forcing_a_tier_changes_the_answer():
    if len(TIERS) < 2:
        pytest.skip("one tier on this CPU")
    q, k, v = _arrays(1, 8, 2, 1, 4096, 36)  # D = 36: whole vectors of 4 lanes, not of 8 or 16
    seen = {}
    try:
        for name in TIERS:
            _ext.force_isa(name)
            seen[name] = af.explain(q, k, v)
    finally:
        _ext.force_isa("")
    assert {p["tier"] for p in seen.values()} == set(TIERS)
    if "generic" in seen and TIERS[0] in X86_SIMD:
        assert seen["generic"]["kernel"] == "simd_decode"       # SSE2, W = 4
        assert seen[TIERS[0]]["kernel"] == "template_decode"    # W = 8 or 16


def test_the_checks_are_attentions():
    q, k, v = _arrays(1, 8, 3, 4, 10, 16)  # 8 heads over 3 kv heads
    with pytest.raises(ValueError, match="multiple of kv heads"):
        af.explain(q, k, v)
    q, k, v = _arrays(1, 4, 4, 4, 10, 16)
    with pytest.raises(TypeError, match="cache_seqlens"):
        af.explain(q, k, v, block_table=np.zeros((1, 1), np.int64))
    with pytest.raises(ValueError, match="cache_seqlens"):
        af.explain(q, k, v, cache_seqlens=[11])


def test_regime_per_tier_from_rows_per_kv_read(tier):
    """The planner's regime: the GEMM-shaped decode kernel (compute) for many rows per KV
    read on the tiers with the hand-written decode -- "latent_decode" for an MLA latent cache,
    "gemm_decode" for separate K and V from 16 rows on the AVX-512 tiers and x86's SSE2
    generic, from 32 on avx2 and neon; bandwidth-shaped decode otherwise."""
    gemm_tier = simd_decode_lanes(tier) is not None
    q, k, _ = _arrays(1, 128, 1, 1, 4096, 576)
    v = k[..., :512]
    plan = af.explain(q, k, v)
    assert plan["latent_kv"] is True and plan["rows_per_kv_read"] == 128
    if gemm_tier:
        assert plan["kernel"] == "latent_decode" and plan["regime"] == "compute"
        assert plan["split"]["chunk_keys"] == 2048
    else:
        assert plan["regime"] == "bandwidth"
    few = af.explain(q[:, :4], k, v)  # 4 rows per read: one whole vector from W = 4 lanes
    assert few["rows_per_kv_read"] == 4
    assert few["regime"] == ("compute" if simd_decode_lanes(tier) == 4 else "bandwidth")
    copy = af.explain(q, k, np.ascontiguousarray(v))  # V a separate array
    assert copy["latent_kv"] is False
    if gemm_tier:
        assert copy["kernel"] == "gemm_decode" and copy["regime"] == "compute"
    else:
        assert copy["regime"] == "bandwidth"
    from_16 = gemm_tier and tier in ("avx512", "avx512bf16", "generic")
    gqa = af.explain(q[:, :16], k, np.ascontiguousarray(v))  # 16 rows
    assert gqa["rows_per_kv_read"] == 16
    assert gqa["regime"] == ("compute" if from_16 else "bandwidth")
    assert (gqa["kernel"] == "gemm_decode") == from_16
    fewer = af.explain(q[:, :12], k, np.ascontiguousarray(v))  # 12 rows: bandwidth-shaped
    assert fewer["regime"] == "bandwidth" and fewer["rows_per_kv_read"] == 12
    # past 20 positions the prefill takes fewer than 32 rows per KV head
    q24, k24, v24 = _arrays(1, 2, 2, 24, 4096, 128)
    assert af.explain(q24, k24, v24)["path"] == "prefill"
    prefill = af.explain(np.zeros((1, 8, 64, 64), np.float32), *_arrays(1, 8, 8, 1, 64, 64)[1:])
    assert prefill["regime"] == "compute" and prefill["rows_per_kv_read"] is None


# The micro-kernels' register blocks per tier (csrc/kernels): the prefill micro-tile's query
# rows Bq = kQueryVecs x W and keys kRows (simd_prefill.inl), which gemm_decode runs too.
_PREFILL_BLOCK = {"avx2": (32, 3), "avx512": (32, 12), "avx512bf16": (32, 12), "neon": (16, 5),
                  "generic": (16, 3)}
_TEMPLATE = {"rows": 4, "keys": 1, "qk": "fp32 mul+add", "pv": "fp32 mul+add"}


def _policy(rows, keys, qk, pv=None):
    return {"rows": rows, "keys": keys, "qk": qk, "pv": qk if pv is None else pv}


def _fp32(tier):
    """The SIMD layer's float32 multiply-add: fused, but for the generic tier's SSE2."""
    return "fp32 mul+add" if tier == "generic" else "fp32 fma"


def test_policy_of_decode_per_tier(tier):
    """Few rows per KV head: the decode loop's register block, 4 rows (kRowBlock) x W / 4
    keys; 32 rows: gemm_decode, the prefill's micro-tile (Bq rows x kRows keys); bfloat16 by
    vdpbf16ps on avx512bf16 (both kernels), an int8 cache's Q.K by vpdpbusd there (its P.V
    widens)."""
    lanes = simd_decode_lanes(tier)
    calls = {"f32": (np.float32, np.float32), "bf16": (BFLOAT16, BFLOAT16)}
    for name, (q_dtype, kv_dtype) in calls.items():
        few = af.explain(*_arrays(1, 8, 2, 1, 4096, 128, dtype=q_dtype, kv_dtype=kv_dtype))
        many = af.explain(*_arrays(1, 32, 1, 1, 4096, 128, dtype=q_dtype, kv_dtype=kv_dtype))
        if lanes is None:  # the template: one key per call
            assert few["policy"] == many["policy"] == _TEMPLATE
            continue
        assert many["kernel"] == "gemm_decode" and many["rows_per_kv_read"] == 32
        if tier == "avx512bf16" and name == "bf16":
            assert few["kernel"] == "bf16_decode"
            assert few["policy"] == _policy(4, 4, "vdpbf16ps")
            assert many["policy"] == _policy(*_PREFILL_BLOCK[tier], "vdpbf16ps")
        else:
            assert few["kernel"] == "simd_decode"
            assert few["policy"] == _policy(4, lanes // 4, _fp32(tier))
            assert many["policy"] == _policy(*_PREFILL_BLOCK[tier], _fp32(tier))
    q = np.zeros((1, 8, 1, 128), np.float32)
    k8, scale = quantize_int8(np.ones((1, 2, 512, 128), np.float32))
    plan = af.explain(q, k8, k8.copy(), cache_seqlens=[500], k_scale=scale, v_scale=scale.copy())
    if plan["kernel"] == "vnni_int8_decode":
        assert plan["policy"] == _policy(4, 4, "vpdpbusd", "vpdpwssd")
    elif lanes is None:
        assert plan["policy"] == _TEMPLATE
    else:
        assert plan["policy"] == _policy(4, lanes // 4, _fp32(tier))
    assert plan["kernel"] == _decode_kernel(tier, np.float32, np.int8, 128)


def test_policy_of_prefill_per_tier(tier):
    """The prefill micro-tile: Bq query rows x kRows keys, float32 multiply-adds, or
    vdpbf16ps for bfloat16 on avx512bf16; the template where a tier has no SIMD prefill."""
    f32 = af.explain(*_arrays(1, 8, 2, 200, 300, 128))
    bf16 = af.explain(*_arrays(1, 8, 2, 200, 300, 128, dtype=BFLOAT16))
    if f32["kernel"] == "template_prefill":
        assert f32["policy"] == bf16["policy"] == _TEMPLATE
        return
    rows, keys = _PREFILL_BLOCK[tier]
    assert f32["kernel"] == "simd_prefill" and f32["policy"] == _policy(rows, keys, _fp32(tier))
    product = "vdpbf16ps" if tier == "avx512bf16" else _fp32(tier)
    assert bf16["policy"] == _policy(rows, keys, product)


def test_policy_of_float64(tier):
    """float64 runs the template on every tier and path: 4 rows against one key, in fp64."""
    fp64 = _policy(4, 1, "fp64")
    for tq in (1, 200):
        plan = af.explain(*_arrays(1, 8, 2, tq, 300, 64, dtype=np.float64))
        assert plan["kernel"] == "template_f64" and plan["policy"] == fp64


_INT8_DOT_PROBE = """
import json, os, numpy as np, attnfast as af
from attnfast import _ext
q = np.zeros((1, 4, 1, 128), np.float32)
k = np.zeros((1, 1, 64, 128), np.int8)
s = np.ones((1, 1, 64), np.float32)
def state():
    return [_ext.runtime_info()["int8_dot"],
            af.explain(q, k, k, cache_seqlens=64, k_scale=s, v_scale=s)["kernel"]]
first = state()
other = "auto" if first[0] == "widen" else "widen"
os.environ["ATTNFAST_INT8_DOT"] = other  # read once: no effect now
second = state()
_ext.force_int8_dot(other)
print(json.dumps([first, second, state()]))
"""


@pytest.mark.parametrize("env", [None, "widen"])
def test_int8_dot_switch_is_read_once(env):
    """ATTNFAST_INT8_DOT=widen is read once, when the first call starts (as ATTNFAST_ISA);
    _ext.force_int8_dot switches it. Where the tier has vpdpbusd the kernel explain() names
    follows the mode; elsewhere both modes widen."""
    environ = {k: v for k, v in os.environ.items() if k not in ("ATTNFAST_INT8_DOT", "ATTNFAST_ISA")}
    if env:
        environ["ATTNFAST_INT8_DOT"] = env
    out = subprocess.run([sys.executable, "-c", _INT8_DOT_PROBE], capture_output=True, text=True,
                         env=environ, check=True).stdout
    first, second, third = json.loads(out)
    expected, flipped = ("widen", "auto") if env else ("auto", "widen")
    assert first == second and first[0] == expected and third[0] == flipped
    auto, widen = (first, third) if expected == "auto" else (third, first)
    assert widen[1] in ("simd_decode", "template_decode")
    vnni = "avx512bf16" in _ext.runtime_info()["isa_available"]
    assert auto[1] == ("vnni_int8_decode" if vnni else widen[1])


@pytest.mark.parametrize("heads,tq,latent,threads,groups", [
    (128, 1, True, 1, 1),     # one thread: never
    (128, 1, True, 2, 1),     # 8 chunks: more tasks than threads already
    (128, 1, True, 64, 4),    # DeepSeek MLA on a server: 32-row groups, 4 x 8 = 32 tasks
    (128, 2, True, 64, 8),    # with multi-token prediction: 256 rows, 8 groups
    (128, 1, True, 24, 2),    # 24 threads: 16 tasks (32 would queue on them)
    (16, 1, True, 64, 1),     # 16 rows: under one group's 32
    (4, 16, False, 64, 2),    # a 16-token tree step, 4 heads a KV head: gemm_decode, 64 rows
])
def test_compute_shaped_decode_splits_heads_with_threads(heads, tq, latent, threads, groups):
    """The head-group rule (`_head_groups`) at 16k keys, 2048 keys a chunk, for the thread
    counts of a server: explain caps num_threads at this machine's processors, so the rule
    is checked here and explain where this machine reaches it."""
    assert _head_groups(1, heads, tq, 8, threads) == groups
    q = np.empty((1, heads, tq, 576 if latent else 128), np.float32)
    k = np.empty((1, 1, 16384, q.shape[-1]), np.float32)
    v = k[..., :512] if latent else np.empty((1, 1, 16384, 128), np.float32)
    plan = af.explain(q, k, v, causal=True, num_threads=threads)
    if plan["regime"] != "compute":
        pytest.skip("no GEMM-shaped decode on this tier")
    assert plan["split"]["chunk_keys"] == 2048 and plan["split"]["chunks"] == 8
    seen = min(threads, _ext.processors())
    assert plan["split"]["head_groups"] == _head_groups(1, heads, tq, 8, seen)
    assert plan["tasks"] == 8 * plan["split"]["head_groups"]


@pytest.mark.skipif(_ext.processors() < 2, reason="head groups come with a second thread")
@pytest.mark.parametrize("case", ["mla", "mla_bf16", "tree"])
def test_head_groups_give_the_bits_of_one_thread(rng, case, tier):
    """A compute-shaped step cut into groups of heads on two threads (short: one chunk, so
    the groups are the tasks) gives the bits of one thread's single group and float64's
    answer with sinks and softcap, on every tier with such a kernel; and in a batch of two
    (two tasks: no groups) each entry's bits are those of the entry alone."""
    if case == "tree":  # 8 heads over one KV head, a 16-token tree step: gemm_decode
        H, Hkv, Tq, D, Dv = 8, 1, 16, 64, 64
    else:               # 128 heads on an MLA latent row: latent_decode
        H, Hkv, Tq, D, Dv = 128, 1, 1, 64, 48
    L, dtype = 1500, (BFLOAT16 if case == "mla_bf16" else np.float32)
    kv = rng.standard_normal((2, Hkv, L, D)).astype(dtype)
    v = kv[..., :Dv] if case != "tree" else rng.standard_normal((2, Hkv, L, Dv)).astype(dtype)
    q = rng.standard_normal((2, H, Tq, D)).astype(dtype)
    opts = dict(softcap=20.0, sinks=rng.standard_normal(H).astype(np.float32))
    lens = np.array([L, 700])
    one = af.explain(q, kv, v, cache_seqlens=lens, num_threads=1, **opts)
    two = af.explain(q, kv, v, cache_seqlens=lens, num_threads=2, **opts)
    if one["regime"] != "compute":
        pytest.skip("no GEMM-shaped decode on this tier")
    assert one["split"]["head_groups"] == two["split"]["head_groups"] == 1
    out1, lse1 = af.attention_with_kvcache(q, kv, v, lens, num_threads=1, return_lse=True, **opts)
    out2, lse2 = af.attention_with_kvcache(q, kv, v, lens, num_threads=2, return_lse=True, **opts)
    np.testing.assert_array_equal(out1, out2)
    np.testing.assert_array_equal(lse1, lse2)
    for b in range(2):  # alone: one task, two groups on two threads
        n = int(lens[b])
        grouped = af.explain(q[b:b + 1], kv[b:b + 1], v[b:b + 1], cache_seqlens=n, num_threads=2,
                             **opts)
        assert grouped["split"]["head_groups"] == 2 and grouped["tasks"] == 2
        for threads in (1, 2):
            alone, alone_lse = af.attention_with_kvcache(q[b:b + 1], kv[b:b + 1], v[b:b + 1], n,
                                                         num_threads=threads, return_lse=True,
                                                         **opts)
            np.testing.assert_array_equal(alone, out1[b:b + 1])
            np.testing.assert_array_equal(alone_lse, lse1[b:b + 1])
    # bfloat16: the output's rounding and the pair tile's bfloat16 probabilities (test_mla's)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == BFLOAT16 else TOLERANCE[np.dtype(np.float32)]
    for b in range(2):
        n = int(lens[b])
        ref, ref_lse, _ = reference_attention(q[b:b + 1].astype(np.float64),
                                              kv[b:b + 1, :, :n].astype(np.float64),
                                              v[b:b + 1, :, :n].astype(np.float64),
                                              causal=True, **opts)
        np.testing.assert_allclose(out1[b:b + 1].astype(np.float64), ref, **tol)
        np.testing.assert_allclose(lse1[b:b + 1], ref_lse, **tol)
