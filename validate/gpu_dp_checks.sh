#!/usr/bin/env bash
# The single-GPU parts of the data-parallel checks (issue 27) on one CUDA GPU: FSDP2 over a
# one-GPU mesh (ZeRO-3, reshard after forward on and off), the same job without ZeRO, and
# with OFFLOAD=1 the offload strategies instead (ZeRO-Infinity as FSDP2 with CPU offload,
# ZeRO-Offload), each run by the executor and compared with the simulator.
# Usage: [OFFLOAD=1] validate/gpu_dp_checks.sh OUTDIR
# (validate/results/h100_dp came from a run without OFFLOAD, h100_offload from one with it)
set -u -o pipefail
out=${1:?usage: validate/gpu_dp_checks.sh OUTDIR}
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c 'import torch, sys; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda)'
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
mpsim topo probe --device cuda -o "$out/probe.yaml"
mpsim trace --family gpt --layers 8 --hidden 1024 --heads 16 --seq-len 1024 --vocab 50257 --microbatch 4 \
    --recipe fp32 --name gpt-8l-1024h-fp32 --measure --device cuda -o "$out/trace_fp32.json"
validate=(mpsim validate --model "$out/trace_fp32.json" --server "$out/probe.yaml" --device cuda --steps 10 --stages 1)
if [ "${OFFLOAD:-0}" = 1 ]; then
    "${validate[@]}" --dp 1 --strategy zero-infinity --json "$out/validate_zinf1.json"
    "${validate[@]}" --dp 1 --strategy zero-offload --json "$out/validate_zoff1.json"
    exit 0
fi
"${validate[@]}" --dp 1 --zero 3 --json "$out/validate_fsdp1.json"
"${validate[@]}" --dp 1 --zero 3 --no-reshard --json "$out/validate_fsdp1_no_reshard.json"
"${validate[@]}" --dp 1 --zero 0 --json "$out/validate_ddp1.json"
