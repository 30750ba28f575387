#!/usr/bin/env bash
# HISTORY 36 on AMD EPYC Zen 4 (family 25 model 17; lscpu.txt), second session of 2026-12-05.
# Run from the repository root with nothing else running. DIR_BEFORE holds the 6f4c063
# package (main before the change) renamed attnfast_before: in a clone at 6f4c063,
#   pip wheel --no-build-isolation --no-deps . -w W && unzip W/*.whl -d U &&
#   mkdir -p $DIR_BEFORE && mv U/attnfast $DIR_BEFORE/attnfast_before
set -x
D=bench/results/zen4-2026-12-05b
B=${DIR_BEFORE:-/tmp/orig}
lscpu > $D/lscpu.txt
for isa in avx512bf16 avx512 avx2 generic; do
  ATTNFAST_ISA=$isa python $D/decode_formats_before_after.py $B > $D/decode_formats_$isa.md 2>&1
done
