# Does where the cache lives move a one-thread decode step (8/8 heads, D = 128, float32)?
# One process, turns A B A B, medians: the arrays as compare_peers makes them, fresh copies,
# and copies in 2 MiB huge pages (an mmap with MADV_HUGEPAGE); AnonHugePages of each array.
import re, sys, time, numpy as np, attnfast as af
def huge_kib(a):
    addr = a.__array_interface__['data'][0]; tot = 0
    cur = None
    for line in open('/proc/self/smaps'):
        m = re.match(r'^([0-9a-f]+)-([0-9a-f]+) ', line)
        if m:
            lo, hi = int(m.group(1), 16), int(m.group(2), 16)
            cur = lo <= addr < hi
        elif cur and line.startswith('AnonHugePages:'):
            tot += int(line.split()[1])
    return tot
rng = np.random.default_rng(0)
L = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
q = rng.standard_normal((1, 8, 1, 128), dtype=np.float32)
k = rng.standard_normal((1, 8, L, 128), dtype=np.float32)
v = rng.standard_normal((1, 8, L, 128), dtype=np.float32)
k2 = np.empty_like(k); k2[...] = k; v2 = np.empty_like(v); v2[...] = v
print("huge KiB  rng k/v:", huge_kib(k), huge_kib(v), " copies:", huge_kib(k2), huge_kib(v2), " bytes each", k.nbytes >> 10)
sl = np.full(1, L, np.int64)
def t(kk, vv, n=60):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); af.attention_with_kvcache(q, kk, vv, sl, num_threads=1); ts.append(time.perf_counter() - t0)
    return np.median(ts)
A, B = [], []
for r in range(9):
    A.append(t(k, v)); B.append(t(k2, v2))
gb = 2 * k.nbytes / 1e9
print(f"rng arrays  {np.median(A)*1e3:.3f} ms {gb/np.median(A):.1f} GB/s")
print(f"copies      {np.median(B)*1e3:.3f} ms {gb/np.median(B):.1f} GB/s")
import mmap
def huge_array(shape, dtype=np.float32):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    mm = mmap.mmap(-1, n + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    buf = np.frombuffer(mm, np.uint8)
    off = (-buf.__array_interface__['data'][0]) % (2 << 20)
    a = buf[off:off + n].view(dtype).reshape(shape)
    return a, mm
k3, m1 = huge_array(k.shape); k3[...] = k
v3, m2 = huge_array(v.shape); v3[...] = v
print("huge KiB  madvised:", huge_kib(k3), huge_kib(v3))
A, B, C = [], [], []
for r in range(9):
    A.append(t(k, v)); C.append(t(k3, v3))
print(f"4k pages    {np.median(A)*1e3:.3f} ms {gb/np.median(A):.1f} GB/s")
print(f"huge pages  {np.median(C)*1e3:.3f} ms {gb/np.median(C):.1f} GB/s  ratio {np.median(A)/np.median(C):.3f}x")
