#!/usr/bin/env bash
# Issue 20 on AMD EPYC Zen 4 (family 25 model 17; lscpu.txt), 2026-12-05: the paged prefill
# read in place with one tile per super-tile and the next tile's prefetch shared by the
# sub-blocks (HISTORY 35). Run from the repository root with nothing else running.
# DIR_BEFORE holds cd46575 (main before the change) as attnfast_before: `pip wheel
# --no-build-isolation --no-deps . -w W` in a clone at cd46575, unzip, rename the package.
set -x
D=bench/results/zen4-2026-12-05
BEFORE=${DIR_BEFORE:-/tmp/before_cd4}
lscpu > $D/lscpu.txt
for dt in float32 bfloat16; do
  for n in 1 2; do
    python $D/paged_before_after.py $BEFORE --dtype $dt --threads $n > $D/paged_${dt}_${n}t.md 2>&1
  done
done
# The project's paged prefill grid (2 threads, both dtypes, blocks of 16 and 128):
python bench/bench_paged_prefill.py > $D/paged_grid.txt 2>&1
# Contiguous prefill before / after (the change is for paged pools only):
python bench/results/zen4-2026-12-04/before_after.py $BEFORE prefill > $D/prefill_vs_cd46575.md 2>&1
# bfloat16 non-causal prefill against OpenVINO, the engines timed one after the other (--rounds 1,
# as before) and in turns (the default since a7a2d7e):
env OMP_WAIT_POLICY=PASSIVE python bench/compare_peers.py --skip decode --prefill-T 1k,4k --causal no \
    --dtype bfloat16 --peers openvino --no-progress --rounds 1 > $D/prefill_bf16_openvino_sequential.txt 2>&1
env OMP_WAIT_POLICY=PASSIVE python bench/compare_peers.py --skip decode --prefill-T 1k,4k --causal no \
    --dtype bfloat16 --peers openvino --no-progress > $D/prefill_bf16_openvino_turns.txt 2>&1
# attnfast's two-thread bfloat16 prefill in fast and slow phases, OpenVINO beside it:
python $D/bf16_two_thread_turns.py 1024 128
