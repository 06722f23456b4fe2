#!/usr/bin/env bash
# Regenerates every figure in reports/ from the shipped data (run from the repo root).
set -euo pipefail
python benchmarks/mpress_table2.py > reports/mpress_table2.md
# the README's "What it prints" block (tests/test_readme_numbers.py holds it to this file)
mpsim fits --server dgx1-v100 --family gpt --schedule 1f1b --microbatch 2 > reports/fits_dgx1_gpt_1f1b_layouts.txt
for server in dgx1-v100 a100-40gb-nvswitch; do
  short=${server%%-*}
  mpsim fits --server "$server" --family gpt --schedule 1f1b --microbatch 2 --layouts pipeline \
    > "reports/fits_${short}_gpt_1f1b.txt"
  # with best on the DGX-1 only; on the A100 server best's search over the BERT-6.2B shape
  # (159 layers and up) is benchmarks/bench_best_bert.sh's (reports/bench_best_bert.txt)
  strategies=none,recompute,cpu-swap,d2d,mpress,tsplit
  [ "$server" = dgx1-v100 ] && strategies=$strategies,best
  mpsim fits --server "$server" --family bert --schedule pipedream --microbatch 12 --strategy "$strategies" --layouts pipeline \
    > "reports/fits_${short}_bert_pipedream.txt"
done
{
  mpsim topo transfer --server dgx1-v100 --src gpu0 --dst host --size 216MB,1152MB
  echo
  mpsim topo transfer --server dgx1-v100 --src gpu0 --stripe gpu1,gpu2,gpu3,gpu4 --size 216MB,1152MB
  echo
  mpsim topo transfer --server dgx1-v100 --src gpu0 --stripe gpu3,gpu4 --size 216MB,1152MB
  echo
  mpsim topo transfer --server dgx1-v100 --src gpu0 --dst gpu3 --size 4KB,64KB,1MB,16MB,216MB
} > reports/transfers_dgx1.txt
python benchmarks/bench_floors.py > reports/bench_floors.txt
# against an earlier commit (here the one issue 31's work started from), in the same run:
#   git worktree add /tmp/base 11bdc20
#   benchmarks/bench_engine_vs.sh /tmp/base > reports/bench_engine_vs.txt
#   benchmarks/bench_fits_vs.sh /tmp/base > reports/bench_fits_vs.txt
for plan in keep swap-recompute swap-heavy; do
  MPSIM_ENGINE=python taskset -c 0,1 python benchmarks/bench_simulate.py --plan "$plan" > "reports/bench_simulate_${plan}.txt"
done
MPSIM_ENGINE=python taskset -c 0,1 python benchmarks/bench_simulate.py --model bert-1.67b --schedule pipedream \
  --microbatch 12 > reports/bench_simulate_pipedream.txt
# the compiled engine: built by bench_native_vs.sh, then checked against the Python one and timed
benchmarks/bench_native_vs.sh > reports/bench_native_vs.txt
python benchmarks/engine_equivalence.py --native > reports/engine_equivalence_native.txt
for plan in keep swap-recompute swap-heavy; do
  MPSIM_ENGINE=compiled taskset -c 0,1 python benchmarks/bench_simulate.py --plan "$plan" \
    > "reports/bench_simulate_${plan}_compiled.txt"
done
MPSIM_ENGINE=compiled taskset -c 0,1 python benchmarks/bench_simulate.py --model bert-1.67b --schedule pipedream \
  --microbatch 12 > reports/bench_simulate_pipedream_compiled.txt
mpsim simulate --model gpt-15.4b --microbatch 2 --strategy cpu-swap --plot reports/memory_gpt-15.4b_dgx1_cpu-swap.png > reports/simulate_gpt-15.4b_dgx1_cpu-swap.txt || true
taskset -c 0,1 python benchmarks/bench_planners.py > reports/bench_planners.txt
taskset -c 0,1 python benchmarks/bench_layers.py > reports/bench_layers.txt
python benchmarks/validation_dp.py > reports/validation_dp_cpu.md
python benchmarks/validation_tp.py > reports/validation_tp_cpu.md
python benchmarks/validation_moe.py > reports/validation_moe_cpu.md
taskset -c 0,1 python benchmarks/bench_dp.py > reports/bench_dp.txt
taskset -c 0,1 python benchmarks/bench_tp.py > reports/bench_tp.txt
rm -f reports/sweep_bert-1.67b_dgx1.csv  # a sweep resumes from the rows it finds: start afresh
mpsim sweep --server dgx1-v100 --model bert-1.67b --schedule pipedream --microbatch 1,2,4,8,12,16 \
  --strategy none,recompute,cpu-swap,mpress,best -j 2 --csv reports/sweep_bert-1.67b_dgx1.csv \
  --plot reports/sweep_bert-1.67b_dgx1.png > reports/sweep_bert-1.67b_dgx1.txt
python benchmarks/presets_table.py --server dgx-a100-80gb,dgx-h100 --strategy none,selective,recompute,best > reports/presets_8gpu.md
mpsim reproduce --out reports
for model in gpt-10.3b llama-3-8b llama-3-70b; do
  mpsim choose --model "$model" --servers dgx1-v100,a100-40gb-nvswitch,dgx-a100-80gb,dgx-h100 \
    --plot "reports/choose_${model}.png" --html "reports/choose_${model}.html" > "reports/choose_${model}.txt"
done
taskset -c 0,1 python benchmarks/bench_cluster.py > reports/bench_cluster.txt
mpsim choose --model llama-3-70b --tokens 2e12 --days 30 --clusters dgx-h100-superpod,aws-p5 --min-servers 16 \
  --max-servers 1024 -j 2 --json reports/scale_llama-3-70b_2T.json --plot reports/scale_llama-3-70b_2T.png \
  > reports/scale_llama-3-70b_2T.txt
python benchmarks/kernel_time_report.py > reports/kernel_time.md
python benchmarks/framework_activations.py --output reports/framework_activations.md
python benchmarks/bench_cancel.py > reports/bench_cancel.txt
taskset -c 0,1 python benchmarks/bench_pool.py > reports/bench_pool.txt

# Mixtures of experts (README "Mixtures of experts"): what fits on one DGX H100, how many servers for 1T tokens,
# the all-to-all alone on the server.
mpsim fits --model mixtral-8x7b --server dgx-h100 > reports/fits_mixtral-8x7b_dgx-h100.txt
mpsim choose --model mixtral-8x7b --tokens 1e12 --days 30 --clusters dgx-h100-superpod --max-servers 16 > reports/scale_mixtral-8x7b_1T.txt
mpsim topo collective --server dgx-h100 --op all-to-all --size 64MiB,1GiB > reports/alltoall_dgx-h100.txt
mpsim choose --model deepseek-v3 --tokens 14.8e12 --days 60 --clusters dgx-h100-superpod --min-servers 64 --max-servers 512 --batch-tokens 62914560 -j 2 > reports/scale_deepseek-v3_14.8T.txt

# The 2026 hardware (README "Workstations and the 2026 servers").
mpsim simulate --server rtx4090-x1 --model tinyllama-1.1b --microbatches 8 > reports/simulate_tinyllama-1.1b_rtx4090.txt
mpsim choose --model llama-3-70b --servers hgx-h200-x8,dgx-b200,gb200-nvl72,mi300x-x8 --strategy none,selective,recompute --layouts data,3d > reports/choose_llama-3-70b_2026_bf16.txt
mpsim choose --model llama-3-70b --servers hgx-h200-x8,dgx-b200,gb200-nvl72,mi300x-x8 --strategy none,selective,recompute --layouts data,3d --recipe fp8-delayed > reports/choose_llama-3-70b_2026_fp8.txt

# Long context (README "Long context"): Llama-3-8B at 128k on one DGX H100 with and without context
# parallelism, and how many servers train Llama-3-70B at a million tokens a sequence.
mpsim choose --model llama-3-8b --seq-len 131072 --servers dgx-h100 --global-microbatches 8 > reports/choose_llama-3-8b_128k_dgx-h100.txt
mpsim choose --model llama-3-8b --seq-len 131072 --servers dgx-h100 --global-microbatches 8 --layouts pipeline,ddp8,zero1x8,zero2x8,fsdp8,tp8sp,fsdp2xtp4sp,zero1x2xtp4sp,fsdp4xtp2sp > reports/choose_llama-3-8b_128k_dgx-h100_without-cp.txt
mpsim choose --model llama-3-70b --seq-len 1048576 --tokens 1e10 --days 30 --clusters dgx-h100-superpod --max-servers 64 -j 2 > reports/scale_llama-3-70b_1M.txt
python benchmarks/validation_cp.py > reports/validation_cp_cpu.md
python benchmarks/validation_lora.py > reports/validation_lora_cpu.md
python benchmarks/attention_long_report.py --into reports/kernel_time.md

# Fine-tuning (README "Fine-tuning"): QLoRA of Llama-3-8B on one RTX 4090, LoRA of Llama-3-70B on a DGX A100
mpsim simulate --server rtx4090-x1 --model llama-3-8b --qlora --seq-len 4096 --microbatches 1 --strategy recompute-all > reports/simulate_llama-3-8b_qlora_rtx4090.txt
mpsim simulate --server dgx-a100-80gb --model llama-3-70b --lora --seq-len 4096 --dp 8 --zero 3 --microbatch 1 --microbatches 2 --strategy recompute-all > reports/simulate_llama-3-70b_lora_dgx-a100.txt

# From plan to launch (README "From plan to launch"): choose's pick as torchtitan and Megatron-LM configurations, read back
mkdir -p reports/launch
mpsim choose --model llama-3-8b --emit torchtitan=reports/launch/llama-3-8b-pick.torchtitan.toml --emit megatron=reports/launch/llama-3-8b-pick.megatron.sh --servers dgx-a100-80gb,dgx-h100 > /dev/null
mpsim simulate --from reports/launch/llama-3-8b-pick.torchtitan.toml --model llama-3-8b --server dgx-h100 > reports/launch/simulate_from_torchtitan.txt
