#!/usr/bin/env bash
# The offload strategies (issue 27 item 7) on one CUDA GPU: ZeRO-Infinity (FSDP2 with
# CPUOffloadPolicy: parameter shards, gradients and Adam in pinned host memory, every layer
# recomputed) and ZeRO-Offload (ZeRO-2 with Adam on the CPU over an fp32 master slice), each
# run by the executor over a one-GPU mesh and compared with the simulator.
# Usage: validate/gpu_offload_checks.sh OUTDIR
set -u -o pipefail
out=${1:?usage: validate/gpu_offload_checks.sh OUTDIR}
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c 'import torch, sys; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda)'
    free -g
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
mpsim topo probe --device cuda -o "$out/probe.yaml"
mpsim trace --family gpt --layers 8 --hidden 1024 --heads 16 --seq-len 1024 --vocab 50257 --microbatch 4 \
    --recipe fp32 --name gpt-8l-1024h-fp32 --measure --device cuda -o "$out/trace_fp32.json"
validate=(mpsim validate --model "$out/trace_fp32.json" --server "$out/probe.yaml" --device cuda --steps 10 --stages 1)
"${validate[@]}" --dp 1 --strategy zero-infinity --json "$out/validate_zinf1.json"
"${validate[@]}" --dp 1 --strategy zero-offload --json "$out/validate_zoff1.json"
