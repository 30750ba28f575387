#!/usr/bin/env bash
# HISTORY 38 on AMD EPYC Zen 4 (family 25 model 17; lscpu.txt), third session of 2026-12-05.
# Run from the repository root with nothing else running. DIR_BEFORE holds the b64fb21 package
# (main before HISTORY 38) renamed attnfast_before: in a clone at b64fb21,
#   pip wheel --no-build-isolation --no-deps . -w W && unzip W/*.whl -d U &&
#   mkdir -p $DIR_BEFORE && mv U/attnfast $DIR_BEFORE/attnfast_before
set -x
D=bench/results/zen4-2026-12-05c
B=${DIR_BEFORE:-/tmp/orig}
lscpu > $D/lscpu.txt
g++ -O2 -mavx512f -std=c++17 $D/scattered_read.cpp -o /tmp/scattered_read && /tmp/scattered_read > $D/scattered_read.txt
python $D/paged_decode_before_after.py $B > $D/paged_decode_avx512bf16.md 2>&1
ATTNFAST_ISA=avx512 python $D/paged_decode_before_after.py $B --blocks 16,256 > $D/paged_decode_avx512.md 2>&1
ATTNFAST_ISA=avx2 python $D/paged_decode_before_after.py $B --blocks 16,256 --layouts head-major \
    > $D/paged_decode_avx2.md 2>&1  # unchanged code on this tier: the run's noise band
