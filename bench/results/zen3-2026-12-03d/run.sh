#!/usr/bin/env bash
# The closing benchmarks of the session of 2026-12-03 (fourth; AMD EPYC Zen 3, tier avx2), run
# from the repository root with nothing else running; vLLM's in its own venv (tools/test_vllm.sh).
set -x
D=bench/results/zen3-2026-12-03d
VP=build/venv-vllm/bin/python
lscpu > $D/lscpu.txt
for t in 1 2; do
  $VP bench/bench_vllm.py --threads $t --repeats 15 > $D/vllm_decode_t$t.txt 2>&1
  $VP bench/bench_vllm.py --batch ragged --threads $t --repeats 7 > $D/vllm_ragged_t$t.txt 2>&1
done
$VP bench/bench_vllm.py --kv-cache-dtype fp8 --threads 1 --repeats 15 > $D/vllm_decode_fp8_t1.txt 2>&1
python bench/bench_ragged.py --threads 1 --repeats 7 > $D/ragged_t1.txt 2>&1
python bench/bench_ragged.py --threads 2 --repeats 7 > $D/ragged_t2.txt 2>&1
python bench/bench_overhead.py --rounds 5 --threads 1 --clock thread > $D/overhead.txt 2>&1
python bench/bench_lowbit_decode.py --dtypes float32,bfloat16,int8,fp8,int4 --layouts 32/8,8/8 --threads 1,2 --lengths 16384 --repeats 5 > $D/lowbit_decode.txt 2>&1
# After the paged fast path (HISTORY 30.2) and grouped decode rows (30.3): the vLLM runs again.
for t in 1 2; do
  $VP bench/bench_vllm.py --threads $t --repeats 15 > $D/vllm_decode_t${t}_final.txt 2>&1
done
$VP bench/bench_vllm.py --batch ragged --threads 2 --repeats 7 > $D/vllm_ragged_t2_final.txt 2>&1
