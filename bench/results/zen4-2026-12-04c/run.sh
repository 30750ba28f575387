#!/usr/bin/env bash
# Issue 20 on AMD EPYC Zen 4 (family 25 model 17; lscpu.txt), third session of 2026-12-04, after
# HISTORY 34 (the next K rows prefetched inside the V pass). Run from the repository root with
# nothing else running. Two "before" builds, each a wheel unzipped with its package renamed
# attnfast_before (see ../zen4-2026-12-04b/run.sh for the commands):
#   DIR_F83  f83a37f, the commit before issue 20's first step (the issue's baseline)
#   DIR_PREV 8bfe72c, main before this session's kernel change
set -x
D=bench/results/zen4-2026-12-04c
F83=${DIR_F83:-/tmp/before}
PREV=${DIR_PREV:-/tmp/origb}
lscpu > $D/lscpu.txt
for isa in avx512bf16 avx512 avx2 generic; do
  ATTNFAST_ISA=$isa python bench/results/zen4-2026-12-04/before_after.py $F83 decode > $D/decode_vs_f83a37f_$isa.md 2>&1
done
for isa in avx512bf16 avx2; do
  ATTNFAST_ISA=$isa python bench/results/zen4-2026-12-04/before_after.py $PREV decode > $D/decode_vs_8bfe72c_$isa.md 2>&1
done
# Decode against ONNX Runtime's GroupQueryAttention (and the other installed peers), same run:
env OMP_WAIT_POLICY=PASSIVE python bench/compare_peers.py --skip prefill --decode-L 16k,64k \
    --dtype float32,bfloat16 --no-progress --markdown $D/peers_decode.md > $D/peers_decode.txt 2>&1
# The results page's run for this CPU kind (replaces bench/results/zen4-avx512bf16.json; then
# `python -m attnfast.bench.results` regenerates docs/results.md and its plots):
env OMP_WAIT_POLICY=PASSIVE python bench/compare_peers.py --prefill-T 1k,4k --decode-L 16k,64k \
    --dtype float32,bfloat16 --no-progress --markdown $D/peers.md \
    --json bench/results/zen4-avx512bf16.json > $D/peers.txt 2>&1
