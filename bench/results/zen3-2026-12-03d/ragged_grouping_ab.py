"""attention_varlen over a serving step of many decode rows and one short prompt chunk: the
decode rows checked as one problem (group_decodes, now) against one problem per sequence (as
before), alternated in one process; tiny contexts, so the Python side dominates."""
import statistics, time
import numpy as np
import attnfast as af
from attnfast import _varlen

inner = _varlen._ragged_problems
rng = np.random.default_rng(0)
H, HKV, D, BS = 32, 8, 128, 16
for decodes in (8, 32):
    q_lens = [1] * decodes + [16]
    k_lens = [64] * decodes + [64]
    nb = sum(-(-n // BS) for n in k_lens)
    kp = rng.standard_normal((nb, HKV, BS, D)).astype(np.float32); vp = kp.copy()
    table = rng.permutation(nb).astype(np.int32).reshape(len(k_lens), -1)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), H, D)).astype(np.float32)
    used = np.array(k_lens, np.int32)
    run = lambda: af.attention_varlen(q, kp, vp, cu, seqused_k=used, block_table=table, causal=True, num_threads=1)
    def per_sequence():
        _varlen._ragged_problems = lambda *a, **kw: inner(*a, **{**kw, "group_decodes": False})
        try:
            return run()
        finally:
            _varlen._ragged_problems = inner
    assert np.array_equal(run(), per_sequence())
    res = {"grouped": [], "per sequence": []}
    for _ in range(15):
        for name, f in (("grouped", run), ("per sequence", per_sequence)):
            t0 = time.perf_counter()
            for _ in range(10): f()
            res[name].append((time.perf_counter() - t0) / 10 * 1e3)
    print(f"{decodes} decode rows + a 16-token chunk, L = 64, 32/8 heads: grouped "
          f"{statistics.median(res['grouped']):.2f} ms, per sequence {statistics.median(res['per sequence']):.2f} ms")
