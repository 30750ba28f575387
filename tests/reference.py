"""Independent float64 reference: materialised softmax attention in plain NumPy.

Written for the tests only; shares no code with attnfast.
"""
import numpy as np


def visible_mask(tq, tk, causal=False, window=None, query_offset=None, rows=None):
    """(tq, tk) bool: row i sees key j (bottom-right aligned: i' = i + tk - tq, or
    i' = i + query_offset when given); with `rows`, only those query rows (len(rows), tk)."""
    i = (np.arange(tq) if rows is None else np.asarray(rows))[:, None] + (
        tk - tq if query_offset is None else query_offset)
    j = np.arange(tk)[None, :]
    keep = np.ones((i.shape[0], tk), dtype=bool)
    if causal:
        keep &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
    return keep


def _per_query_head(q, k, v):
    """q, k, v in float64, with k and v repeated to one KV head per query head (GQA/MQA)."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    h, hkv = (q.shape[-3], k.shape[-3]) if q.ndim >= 3 else (1, 1)
    if h != hkv:
        k = np.repeat(k, h // hkv, axis=-3)
        v = np.repeat(v, h // hkv, axis=-3)
    return q, k, v


def reference_attention(q, k, v, causal=False, scale=None, window=None, softcap=None,
                        alibi_slopes=None, sinks=None, mask=None):
    """Returns (out, lse, weights) in float64 for q (.., H, Tq, D), k/v (.., Hkv, Tk, D/Dv).

    Options as attnfast documents them: softcap c: s -> c tanh(s / c); alibi_slopes (H,) or
    (B, H): s -= slope |i' - j|; mask: bool (True keeps) or added; sinks (H,): one more
    logit per head in the denominator. Applied in that order, then causal / window."""
    q, k, v = _per_query_head(q, k, v)
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / np.sqrt(d)
    scores = np.einsum("...id,...jd->...ij", q, k) * scale
    tq, tk = scores.shape[-2:]
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, np.float64)
        dist = np.abs(np.arange(tq)[:, None] + (tk - tq) - np.arange(tk)[None, :])
        scores = scores - slopes[..., None, None] * dist
    if mask is not None:
        mask = np.asarray(mask)
        scores = np.where(mask, scores, -np.inf) if mask.dtype == bool else scores + mask
    keep = visible_mask(tq, tk, causal, window)
    scores = np.where(keep, scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True, initial=-np.inf)
    if sinks is not None:
        sink = np.asarray(sinks, np.float64)[:, None, None]
        top = np.maximum(top, sink)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(scores - top)
    total = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sink - top)
    weights = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
    out = np.einsum("...ij,...jd->...id", weights, v)
    with np.errstate(divide="ignore"):
        lse = np.where(total[..., 0] > 0, top[..., 0] + np.log(total[..., 0]), -np.inf)
    return out, lse, weights


def float32_score_rounding(q, k, v, weights, out, scale=None):
    """(out_atol (.., H, Tq, Dv), lse_atol (.., H, Tq)): the error float32 rounding of the
    scores alone may cause, from the float64 reference's `weights` and `out`.

    A float32 dot product of length D carries an absolute error of about
    sqrt(D) u Σ_d |q_d k_d| (u = 2^-24); it moves the weight of key j by that relative amount,
    so out_id moves by Σ_j p_ij δs_ij |v_jd - out_id| and lse_i by Σ_j p_ij δs_ij. A fixed
    tolerance holds for O(1) scores; this one, with a factor 4 of headroom, holds where scores
    reach the hundreds (hypothesis found q, k of magnitude 3 at scale 1.875: scores of 292,
    an error of 7e-5 that is float32's, not the kernel's)."""
    q, k, v = _per_query_head(q, k, v)
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / np.sqrt(d) if d else 1.0
    ds = 4.0 * np.sqrt(d) * 2.0**-24 * abs(scale) * np.einsum("...id,...jd->...ij",
                                                                np.abs(q), np.abs(k))
    pds = np.nan_to_num(weights * ds)                                # (.., H, Tq, Tk)
    spread = np.abs(v[..., None, :, :] - out[..., :, None, :])       # (.., H, Tq, Tk, Dv)
    out_atol = np.einsum("...ij,...ijd->...id", pds, np.nan_to_num(spread))
    return out_atol, pds.sum(axis=-1)


# Per-dtype tolerances against the float64 reference (absolute, outputs are O(1)).
TOLERANCE = {
    np.dtype(np.float32): dict(rtol=2e-5, atol=2e-5),
    np.dtype(np.float64): dict(rtol=1e-12, atol=1e-12),
}


def reference_nonfinite_rows(q, k, v, causal=False, window=None, scale=None):
    """The non-finite rule, from the inputs alone: (out_nan (.., H, Tq, Dv) bool, lse_nan
    (.., H, Tq) bool, sees_none (.., H, Tq) bool) for q (.., H, Tq, D), k/v (.., Hkv, Tk, ..).

    (scale > 0 does not change the pattern.) A row that sees at least one key has NaN out and lse when its q row, or a key row it sees,
    holds a NaN or inf; column d of its out is also NaN when column d of a value row it sees
    holds a NaN. A row that sees no key gives zeros and lse = -inf (never NaN).
    """
    q, k, v = _per_query_head(q, k, v)
    tq, tk = q.shape[-2], k.shape[-2]
    keep = visible_mask(tq, tk, causal, window)                       # (Tq, Tk)
    bad_q = ~np.isfinite(q).all(axis=-1)                              # (.., H, Tq)
    bad_k = ~np.isfinite(k).all(axis=-1)                              # (.., H, Tk)
    nan_v = np.isnan(v)                                               # (.., H, Tk, Dv)
    sees = keep.any(axis=-1)                                          # (Tq,)
    sees_bad_k = (keep & bad_k[..., None, :]).any(axis=-1)            # (.., H, Tq)
    # A key whose float32 weight underflows to exactly 0 (score more than ~87 below the row's
    # max) adds nothing, not even 0 x NaN: only keys of weight >= 1e-30 (in float64, from
    # the finite parts of the inputs) must carry a NaN value into the row.
    with np.errstate(over="ignore", invalid="ignore"):
        _, _, w = reference_attention(np.nan_to_num(q), np.nan_to_num(k), np.nan_to_num(v),
                                      causal=causal, scale=scale, window=window)
    weighty = (keep & (w >= 1e-30)).astype(np.int64)                 # (.., H, Tq, Tk)
    # (.., H, Tq, Dv): row i gives a key with a NaN in column d of v real weight
    sees_nan_v = np.einsum("...ij,...jd->...id", weighty, nan_v.astype(np.int64)) > 0
    lse_nan = (bad_q | sees_bad_k) & sees
    out_nan = lse_nan[..., None] | (sees_nan_v & sees[:, None])
    return out_nan, lse_nan, np.broadcast_to(~sees, lse_nan.shape)


def nan_leak_allowed(out_shape, v, sees_none):
    """attnfast's documented limit of the non-finite rule, (.., H, Tq, Dv) bool: a NaN in
    column d of a value row that a query row does not see, but that shares a key tile with
    rows that do, may also reach column d of that row (0 x NaN). True where that may happen:
    rows that see some key, columns where some value row of their KV head holds a NaN."""
    v = np.asarray(v, dtype=np.float64)
    h = out_shape[-3] if len(out_shape) >= 3 else 1
    hkv = v.shape[-3] if v.ndim >= 3 else 1
    cols = np.isnan(v).any(axis=-2)                          # (.., Hkv, Dv)
    if v.ndim >= 3 and h != hkv:
        cols = np.repeat(cols, h // hkv, axis=-2)            # (.., H, Dv)
    return (~np.asarray(sees_none))[..., None] & cols[..., None, :]
