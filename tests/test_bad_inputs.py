"""Bad-input matrix: every public function x every argument x a kind of bad value.

Each case must raise TypeError or ValueError whose message names the argument, and leave
every array the caller handed in (inputs, `out`, caller-owned caches) and every KVCache's
k, v and lengths byte-identical. A few huge integers are allowed either to be rejected that
way or to be accepted (thread counts clamp, a huge max_seqlen is a true bound): then the call
must give the same result as a sane value.
"""
import os
import re

import numpy as np
import pytest

import attnfast as af

F32 = np.float32
B, H, HKV, TQ, TK, D, DV, CAP = 2, 4, 2, 3, 5, 8, 6, 16
HUGE = [2**31, 2**63, 10**30]


def make_env():
    rng = np.random.default_rng(7)
    n = lambda *s: rng.standard_normal(s).astype(F32)  # noqa: E731
    env = dict(
        q=n(B, H, TQ, D), k=n(B, HKV, TK, D), v=n(B, HKV, TK, DV),
        out=np.full((B, H, TQ, DV), 7.0, F32),
        # KV cache (object and caller-owned arrays), 3 tokens held, one new token
        qc=n(B, H, 1, D), k_new=n(B, HKV, 1, D), v_new=n(B, HKV, 1, DV),
        outc=np.full((B, H, 1, DV), 7.0, F32),
        kc=n(B, HKV, CAP, D), vc=n(B, HKV, CAP, DV), seqlens=np.array([3, 2]),
        # varlen: two sequences, 7 query and 9 key tokens
        qp=n(7, H, D), kp=n(9, HKV, D), vp=n(9, HKV, DV),
        cu_q=np.array([0, 3, 7], np.int32), cu_k=np.array([0, 4, 9], np.int32),
        outp=np.full((7, H, DV), 7.0, F32),
        # merge: two shards
        outs=[n(H, TQ, DV), n(H, TQ, DV)], lses=[n(H, TQ), n(H, TQ)],
    )
    cache = af.KVCache(B, HKV, D, CAP, v_head_dim=DV)
    cache.append(n(B, HKV, 3, D), n(B, HKV, 3, DV))
    env["cache"] = cache
    return env


# ---- how each entry point is called; `a` holds the defaults from make_env, overridden
CALLS = {
    "attention": (lambda e, a: af.attention(a["q"], a["k"], a["v"], **_opts(a, "out")),
                  dict(q="q", k="k", v="v", out="out")),
    "attention_weights": (lambda e, a: af.attention_weights(a["q"], a["k"], **_opts(a)),
                          dict(q="q", k="k")),
    "attention_varlen": (lambda e, a: af.attention_varlen(
        a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], **_opts(a, "out")),
        dict(q="qp", k="kp", v="vp", cu_seqlens_q="cu_q", cu_seqlens_k="cu_k", out="outp")),
    "merge_attention_states": (lambda e, a: af.merge_attention_states(a["outs"], a["lses"]),
                               dict(outs="outs", lses="lses")),
    "KVCache": (lambda e, a: af.KVCache(**{**dict(batch=B, kv_heads=HKV, head_dim=D,
                                                  capacity=CAP), **_opts(a)}), {}),
    "KVCache.append": (lambda e, a: e["cache"].append(a["k_new"], a["v_new"], **_opts(a)),
                       dict(k_new="k_new", v_new="v_new")),
    "KVCache.attend": (lambda e, a: e["cache"].attend(a["q"], **_opts(a, "out")),
                       dict(q="qc", out="outc")),
    "KVCache.step": (lambda e, a: e["cache"].step(a["q"], a["k_new"], a["v_new"], **_opts(a, "out")),
                     dict(q="qc", k_new="k_new", v_new="v_new", out="outc")),
    "KVCache.truncate": (lambda e, a: e["cache"].truncate(a["n"]), dict(n=None)),
    "attention_with_kvcache": (lambda e, a: af.attention_with_kvcache(
        a["q"], a["k_cache"], a["v_cache"], a["cache_seqlens"], a["k_new"], a["v_new"],
        **_opts(a, "out")),
        dict(q="qc", k_cache="kc", v_cache="vc", cache_seqlens="seqlens", k_new="k_new",
             v_new="v_new", out="outc")),
    "set_num_threads": (lambda e, a: af.set_num_threads(a["n"]), dict(n=None)),
}
POSITIONAL = {"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "outs", "lses", "k_new", "v_new",
              "n", "k_cache", "v_cache", "cache_seqlens"}


def _opts(a, *also):
    return {k: v for k, v in a.items() if k not in POSITIONAL or k in also}


def _arrays(obj):
    if isinstance(obj, np.ndarray):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _arrays(x)
    elif isinstance(obj, af.KVCache):
        yield from (obj.k, obj.v, obj.lengths)


def snapshot(env, extra):
    arrays = list(_arrays(list(env.values()))) + list(_arrays(extra))
    return arrays, [a.tobytes() for a in arrays]


# ---- the matrix: (function, argument, label, value maker env -> value, expectation)
# expectation: "reject" (TypeError/ValueError naming the argument), "reject_or_accept", or
# a regex the message must match (instead of the argument's name).
SHARED_OPTIONS = {
    "scale": [("str", lambda e: "0.5"), ("array", lambda e: np.ones(2)), ("complex", lambda e: 1j),
              ("nan", lambda e: float("nan")), ("inf", lambda e: float("inf")),
              ("-inf", lambda e: -np.inf), ("negative", lambda e: -0.5), ("zero", lambda e: 0.0),
              ("not finite in float32", lambda e: 1e39), ("huge int", lambda e: 10**400)],
    "window": [("str", lambda e: "ab"), ("one value", lambda e: (1,)), ("three values", lambda e: (1, 2, 3)),
               ("float", lambda e: (1.5, 2)), ("nan", lambda e: (float("nan"), 1)),
               ("None inside", lambda e: (None, 1)), ("negative", lambda e: (-2, 0)),
               ("negative right", lambda e: (0, -5)), ("very negative", lambda e: (-2**63 - 1, 0))],
    "num_threads": [("zero", lambda e: 0), ("negative", lambda e: -1), ("float", lambda e: 2.5),
                    ("str", lambda e: "2"), ("bool", lambda e: True), ("nan", lambda e: float("nan"))]
    + [(f"huge {h}", (lambda h: lambda e: h)(h), "reject_or_accept") for h in HUGE],
    "causal": [("array", lambda e: np.ones(3))],
}
OPTION_USERS = ["attention", "attention_weights", "attention_varlen", "KVCache.attend",
                "KVCache.step", "attention_with_kvcache"]


def _tensor_cases(name, ref):
    """Wrong type / rank / dtype / shape for an array argument whose valid value is env[ref]."""
    free_last_axis = name in ("v", "v_cache")  # Dv may be anything >= 1
    return [
        ("None", lambda e: None), ("str", lambda e: "abc"), ("list of str", lambda e: ["a", "b"]),
        ("int dtype", lambda e: e[ref].astype(np.int64)),
        ("complex dtype", lambda e: e[ref].astype(np.complex64)),
        ("object dtype", lambda e: e[ref].astype(object)),
        ("1-D", lambda e: e[ref].reshape(-1)),
        ("5-D", lambda e: e[ref][None]),
        ("wrong axis 0", lambda e: np.concatenate([e[ref], e[ref]], axis=0)),
        ("float64", lambda e: e[ref].astype(np.float64)),
    ] + ([] if free_last_axis else [("wrong last axis", lambda e: e[ref][..., :1])])


def _out_cases(ref, inputs):
    cases = [("list", lambda e: e[ref].tolist()), ("wrong shape", lambda e: e[ref][..., :1].copy()),
             ("float64", lambda e: e[ref].astype(np.float64)),
             ("read-only", lambda e: _readonly(e[ref].copy()))]
    for inp in inputs:
        cases.append((f"overlaps {inp}", (lambda inp: lambda e: _alias(e, inp, e[ref].shape))(inp)))
    return cases


def _readonly(a):
    a.flags.writeable = False
    return a


def _alias(env, key, shape):
    """An array of `shape` whose memory is the start of env[key] (or of a KVCache's k)."""
    base = env["cache"].k if key == "cache.k" else env[key]
    flat = base.reshape(-1)
    assert flat.base is not None and flat.size >= int(np.prod(shape))
    return flat[:int(np.prod(shape))].reshape(shape)


CASES = []


def add(func, arg, label, make, expect="reject", match=None):
    CASES.append(pytest.param(func, arg, make, expect, match, id=f"{func}-{arg}-{label}"))


for func in OPTION_USERS:
    for arg, items in SHARED_OPTIONS.items():
        for item in items:
            add(func, arg, *item)
for func in ["attention", "attention_varlen", "KVCache.attend", "KVCache.step",
             "attention_with_kvcache"]:
    add(func, "return_lse", "array", lambda e: np.ones(3))
for func, refs in [("attention", dict(q="q", k="k", v="v")),
                   ("attention_weights", dict(q="q", k="k")),
                   ("attention_varlen", dict(q="qp", k="kp", v="vp")),
                   ("KVCache.append", dict(k_new="k_new", v_new="v_new")),
                   ("KVCache.attend", dict(q="qc")),
                   ("KVCache.step", dict(q="qc", k_new="k_new", v_new="v_new")),
                   ("attention_with_kvcache", dict(q="qc", k_new="k_new", v_new="v_new",
                                                   k_cache="kc", v_cache="vc"))]:
    for arg, ref in refs.items():
        for label, make in _tensor_cases(arg, ref):
            if arg in ("k_new", "v_new") and label == "None" and func == "attention_with_kvcache":
                continue  # both None is valid there (no new tokens)
            # a packed q of the wrong length may be reported through cu_seqlens_q
            both = r"cu_seqlens_q|(?<![A-Za-z_])q\b" if (func, arg, label) == (
                "attention_varlen", "q", "wrong axis 0") else None
            add(func, arg, label, make, match=both)
for func, ref, inputs in [("attention", "out", ["q", "k"]), ("attention_varlen", "outp", ["qp"]),
                          ("KVCache.attend", "outc", ["qc", "cache.k"]),
                          ("KVCache.step", "outc", ["qc", "cache.k"]),
                          ("attention_with_kvcache", "outc", ["qc", "kc", "vc"])]:
    for label, make in _out_cases(ref, inputs):
        add(func, "out", label, make)

# varlen specifics
for arg, ref in (("cu_seqlens_q", "cu_q"), ("cu_seqlens_k", "cu_k")):
    for label, make in [("None", lambda e: None), ("float", (lambda r: lambda e: e[r].astype(float))(ref)),
                        ("2-D", (lambda r: lambda e: e[r][None])(ref)),
                        ("empty", lambda e: np.array([], np.int32)),
                        ("negative", lambda e: np.array([0, -1, 7])),
                        ("not starting at 0", lambda e: np.array([1, 3, 7])),
                        ("decreasing", lambda e: np.array([0, 5, 3, 7])),
                        ("huge", lambda e: np.array([0, 2**63 - 1, 7], np.int64)),
                        ("huge uint64", lambda e: np.array([0, 2**63, 7], np.uint64)),
                        ("other batch", lambda e: np.array([0, 7]))]:
        add("attention_varlen", arg, label, make)
for arg in ("max_seqlen_q", "max_seqlen_k"):
    add("attention_varlen", arg, "float", lambda e: 4.0)
    add("attention_varlen", arg, "str", lambda e: "4")
    add("attention_varlen", arg, "negative", lambda e: -1)
    add("attention_varlen", arg, "too small", lambda e: 1)
    for h in HUGE:
        add("attention_varlen", arg, f"huge {h}", (lambda h: lambda e: h)(h), "reject_or_accept")
add("attention_varlen", "q", "heads not a multiple of kv heads",
    lambda e: np.ones((7, 3, D), F32), match=r"\(7, 3, 8\)")  # the user's shape, not a per-sequence view

# merge
for arg in ("outs", "lses"):
    add("merge_attention_states", arg, "None", lambda e: None)
    add("merge_attention_states", arg, "int", lambda e: 5)
    add("merge_attention_states", arg, "one array", (lambda a: lambda e: e[a][0])(arg))
    add("merge_attention_states", arg, "empty", lambda e: [])
    add("merge_attention_states", arg, "one shard", (lambda a: lambda e: e[a][:1])(arg))
    add("merge_attention_states", arg, "float64 shard",
        (lambda a: lambda e: [e[a][0], e[a][1].astype(np.float64)])(arg))
    add("merge_attention_states", arg, "wrong shape shard",
        (lambda a: lambda e: [e[a][0], e[a][1][:1]])(arg))
    add("merge_attention_states", arg, "str shard", (lambda a: lambda e: [e[a][0], "x"])(arg))

# KVCache constructor
for arg in ("batch", "kv_heads", "head_dim", "capacity", "v_head_dim"):
    for label, make in [("zero", lambda e: 0), ("negative", lambda e: -1), ("float", lambda e: 2.5),
                        ("str", lambda e: "2"), ("bool", lambda e: True), ("nan", lambda e: float("nan")),
                        ("huge 2**63", lambda e: 2**63), ("huge 10**30", lambda e: 10**30)]:
        add("KVCache", arg, label, make)
for label, make in [("int", lambda e: np.int32), ("str", lambda e: "float7"), ("object", lambda e: object)]:
    add("KVCache", "dtype", label, make)

# batch_index, cache_seqlens, truncate n, set_num_threads n
for func in ("KVCache.append", "KVCache.attend", "KVCache.step"):
    for label, make in [("empty list", lambda e: []), ("float", lambda e: 0.5), ("str", lambda e: "0"),
                        ("negative", lambda e: -1), ("out of range", lambda e: B),
                        ("repeated", lambda e: [0, 0]), ("2-D", lambda e: [[0, 1]]),
                        ("bool", lambda e: True)] + [(f"huge {h}", (lambda h: lambda e: h)(h)) for h in HUGE]:
        add(func, "batch_index", label, make,
            match=r"batch_index(?!.*float64)" if label == "empty list" else None)
for label, make in [("float", lambda e: 2.5), ("float array", lambda e: np.array([1.0, 2.0])),
                    ("negative", lambda e: -1), ("wrong shape", lambda e: np.array([1, 2, 3])),
                    ("str", lambda e: "1"), ("None", lambda e: None), ("full", lambda e: CAP)] + \
        [(f"huge {h}", (lambda h: lambda e: h)(h)) for h in HUGE]:
    add("attention_with_kvcache", "cache_seqlens", label, make)
add("attention_with_kvcache", "k_cache", "read-only", lambda e: _readonly(e["kc"].copy()))
add("attention_with_kvcache", "v_cache", "read-only", lambda e: _readonly(e["vc"].copy()))
add("attention_with_kvcache", "v_cache", "same memory as k_cache", lambda e: e["kc"][..., :DV])
for label, make in [("negative", lambda e: -1), ("float", lambda e: 1.5), ("str", lambda e: "1"),
                    ("None", lambda e: None), ("longer than held", lambda e: 4),
                    ("wrong shape", lambda e: [1, 1, 1])] + \
        [(f"huge {h}", (lambda h: lambda e: h)(h)) for h in HUGE]:
    add("KVCache.truncate", "n", label, make, match=r"(?<![A-Za-z_])n\b|truncate")
for label, make in [("zero", lambda e: 0), ("negative", lambda e: -1), ("float", lambda e: 2.5),
                    ("str", lambda e: "2"), ("bool", lambda e: True)]:
    add("set_num_threads", "n", label, make)
for h in [2**40] + HUGE:
    add("set_num_threads", "n", f"huge {h}", (lambda h: lambda e: h)(h), "reject_or_accept")


@pytest.fixture(autouse=True)
def _restore_threads():
    yield
    af.set_num_threads(None)


@pytest.mark.parametrize("func,arg,make,expect,match", CASES)
def test_bad_input_rejected_and_nothing_written(func, arg, make, expect, match):
    env = make_env()
    call, defaults = CALLS[func]
    args = {name: env[ref] for name, ref in defaults.items() if ref is not None}
    if func == "KVCache.truncate":
        args["n"] = 1
    args[arg] = make(env)
    arrays, before = snapshot(env, args[arg])
    threads_before = af.get_num_threads()
    try:
        result = call(env, args)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        pattern = match or rf"(?<![A-Za-z_]){re.escape(arg)}(?![A-Za-z])"
        assert re.search(pattern, message), f"message does not name {arg!r}: {message!r}"
        assert type(exc).__name__ in ("TypeError", "ValueError")
        if func != "set_num_threads":
            assert af.get_num_threads() == threads_before
    except Exception as exc:  # noqa: BLE001 - anything else is the wrong exception
        pytest.fail(f"{type(exc).__name__} instead of TypeError/ValueError: {exc}")
    else:
        assert expect == "reject_or_accept", f"accepted {arg}={args[arg]!r}"
        _check_accepted(func, arg, env, args, result)
        return
    for a, b in zip(arrays, before):
        assert a.tobytes() == b, f"{func}: an array changed although the call was rejected"


def _check_accepted(func, arg, env, args, result):
    """A huge value that was accepted must act like a sane one."""
    cores = os.cpu_count()
    if func == "set_num_threads":
        assert 1 <= af.get_num_threads() <= cores
        af.attention(env["q"], env["k"], env["v"])  # later calls work
        return
    fresh = make_env()
    sane = {k: fresh[ref] for k, ref in CALLS[func][1].items() if ref is not None}
    sane.pop("out", None)
    expected = CALLS[func][0](fresh, sane)
    got = result
    np.testing.assert_array_equal(got, expected)
