"""32/8 float32 decode (L = 16k, D = 128) on torch tensors, 1 and 2 threads, medians, and how much
of the process is on transparent huge pages. Run in alternating processes with and without
THP_MEM_ALLOC_ENABLE=1 (torch's switch to madvise its large allocations), e.g.
for i in 1 2 3; do python torch_huge_pages.py; THP_MEM_ALLOC_ENABLE=1 python torch_huge_pages.py; done"""
import os, time, statistics, torch, attnfast
L, H, HKV = 16384, 32, 8
g = torch.Generator().manual_seed(0)
k = torch.randn(1, HKV, L, 128, generator=g); v = torch.randn(1, HKV, L, 128, generator=g)
q = torch.randn(1, H, 1, 128, generator=g); sl = torch.tensor([L], dtype=torch.int32)
def ah():
    for l in open("/proc/self/smaps_rollup"):
        if l.startswith("AnonHugePages"): return int(l.split()[1]) >> 10
out = {}
for n in (1, 2):
    f = lambda: attnfast.attention_with_kvcache(q, k, v, sl, num_threads=n)
    f(); ts = []
    for _ in range(9):
        t0 = time.perf_counter()
        for _ in range(8): f()
        ts.append((time.perf_counter() - t0) / 8)
    out[n] = statistics.median(ts) * 1e3
print(f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '-')} AnonHugePages {ah()} MiB  1 thread {out[1]:.2f} ms  2 threads {out[2]:.2f} ms")
