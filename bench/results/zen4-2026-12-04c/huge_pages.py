"""Decode time by where K and V live, one process, interleaved (HISTORY 33): numpy's arrays
(transparent huge pages here: numpy madvises large allocations) against copies in mmap'd
buffers that ask for huge pages ("huge") or not ("4k"), and with V moved 2 KiB off K's cache
sets. The per-mapping lines say what each buffer got (in the recorded run: no huge pages for
either mmap kind, so both are 4 KiB pages).
HEADS=32/8 DT=f32|bf16 L=16384 THREADS=1,2; ATTNFAST_ISA picks the tier."""
import sys, time, statistics, os, mmap, re
import numpy as np, ml_dtypes, attnfast
from attnfast.bench.limits import measure_read_bandwidth
L = int(os.environ.get("L", "16384")); H, HKV = map(int, os.environ.get("HEADS", "32/8").split("/"))
dt = {"bf16": ml_dtypes.bfloat16, "f32": np.float32}[os.environ.get("DT", "f32")]
shape = (1, HKV, L, 128)
rng = np.random.default_rng(0)
k0 = rng.standard_normal(shape, dtype=np.float32).astype(dt)
v0 = rng.standard_normal(shape, dtype=np.float32).astype(dt)
q = rng.standard_normal((1, H, 1, 128), dtype=np.float32).astype(dt)
sl = np.array([L], dtype=np.int32)
keep = []
def place(src, huge, off):
    nb = src.nbytes
    m = mmap.mmap(-1, nb + (4 << 20))
    m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    keep.append(m)
    buf = np.frombuffer(m, dtype=np.uint8)
    base = buf.ctypes.data
    start = (-base) % (2 << 20) + off
    a = buf[start:start + nb].view(src.dtype).reshape(src.shape)
    a[...] = src
    return a
def backing(a):
    """kB of the mapping holding array a that are transparent huge pages, and its size in kB."""
    addr = a.ctypes.data
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m and int(m.group(1), 16) <= addr < int(m.group(2), 16):
            for l2 in lines[i + 1:i + 30]:
                if l2.startswith("AnonHugePages"): return f"{l2.split()[1]} of {(int(m.group(2), 16) - int(m.group(1), 16)) >> 10} kB huge"
    return "?"
def anon_huge():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages"): return line.split()[1]
print("numpy arrays: AnonHugePages kB", anon_huge(), "k addr mod 2M", k0.ctypes.data % (2<<20), "v", v0.ctypes.data % (2<<20))
layouts = {"numpy": (k0, v0)}
layouts["huge"] = (place(k0, True, 0), place(v0, True, 0))
print("after huge: AnonHugePages kB", anon_huge())
layouts["4k"] = (place(k0, False, 0), place(v0, False, 0))
layouts["huge_v+2k"] = (layouts["huge"][0], place(v0, True, 2048))
layouts["4k_v+2k"] = (layouts["4k"][0], place(v0, False, 2048))
print("final: AnonHugePages kB", anon_huge())
for nm, (k, v) in layouts.items(): print(f"  {nm}: K {backing(k)}, V {backing(v)}")
nbytes = 2 * k0.nbytes
for n in map(int, os.environ.get("THREADS", "1,2").split(",")):
    def run(name, calls=8):
        k, v = layouts[name]
        t0 = time.perf_counter()
        for _ in range(calls): attnfast.attention_with_kvcache(q, k, v, sl, num_threads=n)
        return (time.perf_counter() - t0) / calls
    names = list(layouts)
    for nm in names: run(nm, 2)
    ts = {nm: [] for nm in names}; rd = []
    for r in range(int(os.environ.get("ROUNDS", "9"))):
        for nm in (names if r % 2 == 0 else names[::-1]): ts[nm].append(run(nm))
        if r % 3 == 0: rd.append(measure_read_bandwidth(n, nbytes=256 << 20, repeats=2)["gbps"])
    lim = max(rd)
    med = {nm: statistics.median(x) for nm, x in ts.items()}
    print(f"{os.environ.get('ATTNFAST_ISA','auto')} T={n} {H}/{HKV} L={L} {os.environ.get('DT','f32')} read {lim:.1f} GB/s: " + "  ".join(
        f"{nm} {med[nm]*1e3:.2f} ms {nbytes/med[nm]/1e9/lim*100:.0f}%" for nm in names), flush=True)
