#!/usr/bin/env bash
# Issue 20's closing benchmarks on AMD EPYC Zen 4 (family 25 model 17; lscpu.txt), second
# session of 2026-12-04, after the prefill and decode fixes of HISTORY 32; run from the
# repository root with nothing else running. DIR_BEFORE holds the build of f83a37f (the commit
# before issue 20's first step) as the package attnfast_before:
#   git worktree add /tmp/base f83a37f && pip wheel --no-build-isolation --no-deps -w /tmp/basewheel /tmp/base
#   mkdir /tmp/before && cd /tmp/before && python -m zipfile -e /tmp/basewheel/*.whl x && mv x/attnfast attnfast_before
set -x
# (the before / after script is the first run's: bench/results/zen4-2026-12-04/before_after.py)
D=bench/results/zen4-2026-12-04b
B=${DIR_BEFORE:-/tmp/before}
lscpu > $D/lscpu.txt
for isa in avx512bf16 avx512 avx2 generic; do
  ATTNFAST_ISA=$isa python bench/results/zen4-2026-12-04/before_after.py $B decode > $D/decode_before_after_$isa.md 2>&1
done
for isa in avx512bf16 avx2; do
  ATTNFAST_ISA=$isa python bench/results/zen4-2026-12-04/before_after.py $B prefill --repeats 5 > $D/prefill_before_after_$isa.md 2>&1
done
python bench/bench_paged_prefill.py --dtypes float32,bfloat16 --repeats 5 > $D/paged_prefill.txt 2>&1
# The results page's run for this CPU kind (replaces bench/results/zen4-avx512bf16.json).
env OMP_WAIT_POLICY=PASSIVE python bench/compare_peers.py --prefill-T 1k,4k --decode-L 16k,64k \
    --dtype float32,bfloat16 --no-progress --markdown $D/peers.md \
    --json bench/results/zen4-avx512bf16.json > $D/peers.txt 2>&1
# The bfloat16 non-causal prefill against OpenVINO again, the prefill half alone (the full run had T = 4k D = 64 on 2 threads at 0.83x):
env OMP_WAIT_POLICY=PASSIVE python bench/compare_peers.py --skip decode --prefill-T 1k,4k --causal no --dtype bfloat16 --peers openvino --no-progress --markdown $D/prefill_bf16_openvino.md > $D/prefill_bf16_openvino.txt 2>&1
