#!/bin/bash
# The runs of the closing round for issues 21-24 (one session, one CPU), in this order, on an
# otherwise idle 2-core AMD EPYC Zen 3 (lscpu.txt). Each output is the file of its name.
cd "$(dirname "$0")/../../.."
out=bench/results/zen3-2026-12-03c
export OMP_WAIT_POLICY=PASSIVE
lscpu > $out/lscpu.txt
python bench/bench_backward.py --T 1024 --reps 3 > $out/backward_1k.txt 2>&1
python bench/bench_backward.py --T 4096 --dtypes float32 --reps 3 > $out/backward_4k.txt 2>&1
python bench/bench_backward.py --T 8192 --dtypes float32 --threads 2 --reps 3 > $out/backward_8k.txt 2>&1
python bench/bench_lowbit_decode.py --dtypes float32,bfloat16,int8,fp8,int4 --layouts 32/8,8/8 \
    --threads 1,2 --lengths 16384,65536 --repeats 5 > $out/lowbit_decode.txt 2>&1
for t in 1 2; do
  python bench/bench_shared_prefix.py --threads $t --dtypes float32,bfloat16 --repeats 5 > $out/shared_prefix_t$t.txt 2>&1
  python bench/bench_shared_prefix.py --threads $t --forks 64 --heads 8/8 --dtypes float32 --repeats 5 > $out/shared_prefix_64_t$t.txt 2>&1
done
python bench/bench_mla.py --lengths 8192,32768 --dtypes float32,bfloat16 --threads 1,2 --repeats 5 > $out/mla.txt 2>&1
for t in 1 2; do
  for h in 32/8 8/8; do
    python bench/bench_tree.py --threads $t --heads $h --repeats 3 > $out/tree_t${t}_${h/\//-}.txt 2>&1
  done
  python bench/bench_ragged.py --threads $t --repeats 5 > $out/ragged_t$t.txt 2>&1
done
python bench/bench_compile.py --threads 1 --seq 512,2048 --repeats 7 > $out/compile.txt 2>&1
python bench/bench_overhead.py --rounds 3 > $out/overhead.txt 2>&1
# Later in the session (outputs beside these):
#   python bench/bench_backward.py --T 4096 --dtypes bfloat16 --threads 2 --reps 2 > $out/backward_4k_bf16.txt
#   python bench/lowbit_peers.py --rounds 7 --slow-fill-heads 1/1 --json $out/lowbit_peers.json --markdown $out/lowbit_peers.md
#   python bench/bench_overhead.py --rounds 5 --threads 1 --clock thread > $out/overhead.txt   (the PASSIVE run above was void: OpenMP wake-ups)
#   gemm_inplace_ab.py / fp8_widen_ab.txt: A/B of two builds in alternating processes (bench/HISTORY.md 29.1, 29.2)
#   final build: bench_lowbit_decode.py (as above) > $out/lowbit_decode_final.txt; lowbit_peers.py (as above) -> lowbit_peers_final.*
