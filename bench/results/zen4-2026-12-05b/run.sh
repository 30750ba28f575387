#!/usr/bin/env bash
# HISTORY 36-37 on AMD EPYC Zen 4 (family 25 model 17; lscpu.txt), second session of 2026-12-05.
# Run from the repository root with nothing else running. DIR_BEFORE holds the 6f4c063
# package (main before HISTORY 36) renamed attnfast_before: in a clone at 6f4c063,
#   pip wheel --no-build-isolation --no-deps . -w W && unzip W/*.whl -d U &&
#   mkdir -p $DIR_BEFORE && mv U/attnfast $DIR_BEFORE/attnfast_before
# decode_formats_<tier>.md are HISTORY 36's run (the V prefetch dropped for narrow caches);
# onekey_<tier>.md the run after HISTORY 37 (one key at a time, float32 too).
set -x
D=bench/results/zen4-2026-12-05b
B=${DIR_BEFORE:-/tmp/orig}
lscpu > $D/lscpu.txt
if [ "${STEP:-37}" = 36 ]; then
  for isa in avx512bf16 avx512 avx2 generic; do
    ATTNFAST_ISA=$isa python $D/decode_formats_before_after.py $B > $D/decode_formats_$isa.md 2>&1
  done
  exit
fi
for isa in avx512bf16 avx512; do
  ATTNFAST_ISA=$isa python $D/decode_formats_before_after.py $B > $D/onekey_$isa.md 2>&1
  ATTNFAST_ISA=$isa python $D/decode_formats_before_after.py $B --head-dim 64 --formats float32,bfloat16,int8 \
      --lengths 16384 > $D/onekey_d64_$isa.md 2>&1
  ATTNFAST_ISA=$isa python $D/decode_formats_before_after.py $B --head-dim 256 --formats float32,bfloat16,int8 \
      --lengths 16384 > $D/onekey_d256_$isa.md 2>&1
done
for isa in avx2 generic; do  # unchanged code on these tiers: the run's noise band
  ATTNFAST_ISA=$isa python $D/decode_formats_before_after.py $B --lengths 16384 --formats float32,bfloat16,int8 \
      > $D/onekey_$isa.md 2>&1
done
python $D/paged_decode_before_after.py $B > $D/onekey_paged.md 2>&1
