#!/usr/bin/env bash
# Regenerates every figure in reports/ from the shipped data (run from the repo root).
set -euo pipefail
python benchmarks/mpress_table2.py > reports/mpress_table2.md
mpsim fits --server dgx1-v100 --family gpt --schedule 1f1b --microbatch 2 > reports/fits_dgx1_gpt_1f1b.txt
mpsim fits --server dgx1-v100 --family bert --schedule pipedream --microbatch 12 > reports/fits_dgx1_bert_pipedream.txt
mpsim fits --server a100-40gb-nvswitch --family gpt --schedule 1f1b --microbatch 2 > reports/fits_a100_gpt_1f1b.txt
taskset -c 0,1 python benchmarks/bench_simulate.py > reports/bench_simulate.txt
taskset -c 0,1 python benchmarks/bench_simulate.py --model bert-1.67b --schedule pipedream --microbatch 12 \
  > reports/bench_simulate_pipedream.txt
