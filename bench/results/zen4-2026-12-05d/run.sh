#!/bin/sh
# 2026-12-05, fourth session (issue 20): the results page's run, ONNX Runtime in turns, huge pages.
# AMD EPYC Zen 4 (lscpu.txt), tier avx512bf16, main at 81cef09. From the repository root.
set -e
env OMP_WAIT_POLICY=PASSIVE python bench/compare_peers.py --prefill-T 1k,4k --decode-L 16k,64k \
    --dtype float32,bfloat16 --no-progress --markdown bench/results/zen4-2026-12-05d/peers_full.md \
    --json bench/results/zen4-avx512bf16.json
python -m attnfast.bench.results
OMP_WAIT_POLICY=PASSIVE python bench/results/zen4-2026-12-05d/ort_turns.py > bench/results/zen4-2026-12-05d/ort_turns.txt
for L in 16384 65536; do python bench/results/zen4-2026-12-05d/hugepages_decode.py $L; done > bench/results/zen4-2026-12-05d/hugepages_decode.txt
