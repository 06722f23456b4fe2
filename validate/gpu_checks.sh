#!/usr/bin/env bash
# Every check that needs a GPU, in one run, each step's output kept in OUTDIR:
#   env.txt               GPU, driver, torch and CUDA versions
#   probe.yaml            `mpsim topo probe --device cuda` of this machine
#   trace_fp32*.json      measured fp32 GPT layers, two shapes (trace_fp32.json is what the executor trains)
#   trace_bf16*.json      measured mixed-bf16 Llama layers, three shapes (flash attention, fused RMSNorm)
#   calibrate_*.json      `mpsim calibrate` of each precision against the shipped single-GPU server
#   validate_*.json       `mpsim validate --device cuda`: keep, recompute, selective, host swap;
#                         peer swap too where there are two or more GPUs; each stage's measured
#                         max_memory_reserved beside the caching-allocator model's prediction
#   validate_bf16_*.json  the same for the mixed-bf16 Llama layers, validate_bert_*.json for BERT
#   profile_*.json        PyTorch profiler traces of the Llama (bf16) and GPT (fp32) layers
#   kernels_*.yaml        `mpsim calibrate --profile`: the GPU's kernel table fitted to them
#   log.txt               everything printed
# A step that fails or outlasts STEP_TIMEOUT_S is logged and the next one runs.
# Usage: validate/gpu_checks.sh OUTDIR [SERVER]   (SERVER: shipped topology to calibrate against)
set -u -o pipefail
out=${1:?usage: validate/gpu_checks.sh OUTDIR [SERVER]}
server=${2:-h100-x1}
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1

step() {  # each step at most STEP_TIMEOUT_S seconds (default 300); SIGINT first, so Python says where it was
    echo "== $*"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=10 "${STEP_TIMEOUT_S:-300}" "$@" || echo "!! exit $? after $((SECONDS - t0)) s: $*"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c 'import torch, sys; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version()); print("gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0), "cc", torch.cuda.get_device_capability(0))'
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

gpt=(--family gpt --layers 8 --hidden 1024 --heads 16 --seq-len 1024 --vocab 50257 --microbatch 4)
step mpsim topo probe --device cuda -o "$out/probe.yaml"
step mpsim trace "${gpt[@]}" --recipe fp32 --name gpt-8l-1024h-fp32 --measure --device cuda -o "$out/trace_fp32.json"
# more shapes of each precision: differing mixes of matmul, attention and memory work make the fit separable
step mpsim trace --family gpt --layers 2 --hidden 2048 --heads 16 --seq-len 512 --vocab 50257 --microbatch 8 \
    --recipe fp32 --measure --device cuda -o "$out/trace_fp32_b.json"
step mpsim trace --preset llama-3-8b --layers 2 --recipe mixed-bf16 --microbatch 1 --measure --device cuda \
    -o "$out/trace_bf16.json"
step mpsim trace --preset llama-3-8b --layers 2 --seq-len 2048 --recipe mixed-bf16 --microbatch 4 --measure \
    --device cuda -o "$out/trace_bf16_b.json"
step mpsim trace --family llama --layers 2 --hidden 2048 --heads 16 --kv-heads 4 --ffn-hidden 5632 --seq-len 4096 \
    --vocab 32000 --recipe mixed-bf16 --microbatch 2 --measure --device cuda -o "$out/trace_bf16_c.json"
step mpsim calibrate --trace "$out/trace_fp32.json" --trace "$out/trace_fp32_b.json" --server "$server" --force \
    --json "$out/calibrate_fp32.json"
step mpsim calibrate --trace "$out/trace_bf16.json" --trace "$out/trace_bf16_b.json" --trace "$out/trace_bf16_c.json" \
    --server "$server" --force --json "$out/calibrate_bf16.json"

validate=(mpsim validate --model "$out/trace_fp32.json" --server "$out/probe.yaml" --device cuda --steps 10)
for s in none recompute selective; do
    step "${validate[@]}" --stages 1 --strategy "$s" --json "$out/validate_$s.json"
done
python3 - "$out" <<'EOF'
"""A one-stage host-swap plan of the traced GPT: layers 2-7 swapped to pinned host memory."""
import json, sys
actions = [{"layer": i, "action": "host", "peers": [], "split": 1, "split_dim": None, "split_slowdown": None}
           for i in range(2, 8)]
plan = {"schema": 1, "model": "gpt-8l-1024h-fp32", "server": "probe", "microbatch": 4, "microbatches": 4,
        "schedule": "1f1b", "strategy": "host-swap",
        "stages": [{"gpu": 0, "layers": [0, 10], "optimizer": "gpu", "stash": "gpu", "actions": actions}]}
json.dump(plan, open(f"{sys.argv[1]}/plan_host.json", "w"), indent=1)
EOF
step "${validate[@]}" --plan "$out/plan_host.json" --json "$out/validate_host.json"
# the layers of other families and precisions, with their reserved memory (issue 30)
step mpsim trace --family bert --layers 4 --hidden 1024 --heads 16 --seq-len 512 --vocab 30522 --microbatch 8 \
    --recipe mixed-fp16 --measure --device cuda -o "$out/trace_bert.json"
for s in none recompute; do
    step mpsim validate --model "$out/trace_bf16.json" --server "$out/probe.yaml" --device cuda --steps 10 --stages 1 \
        --strategy "$s" --json "$out/validate_bf16_$s.json"
    step mpsim validate --model "$out/trace_bert.json" --server "$out/probe.yaml" --device cuda --steps 10 --stages 1 \
        --strategy "$s" --json "$out/validate_bert_$s.json"
done
# kernel tables fitted to profiler traces of the same layers (mpsim.timing.kernel_time; issue 30)
step python3 validate/profile_layers.py --preset llama-3-8b --layers 2 --recipe mixed-bf16 --device cuda \
    -o "$out/profile_bf16.json"
step mpsim calibrate --profile "$out/profile_bf16.json" --dtype bf16 --server "$server" \
    --json "$out/calibrate_kernels_bf16.json" -o "$out/kernels_bf16.yaml"
step python3 validate/profile_layers.py --preset gpt2-xl --layers 2 --recipe fp32 --device cuda \
    -o "$out/profile_fp32.json"
step mpsim calibrate --profile "$out/profile_fp32.json" --dtype fp32 --server "$server" \
    --json "$out/calibrate_kernels_fp32.json" -o "$out/kernels_fp32.yaml"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    step "${validate[@]}" --stages 2 --strategy d2d --json "$out/validate_peer.json"
else
    echo "== peer swap skipped: one GPU here, and a D2D swap needs an NVLink peer"
fi
