"""A PyTorch profiler (Kineto) trace of a few training steps of mpsim's own layers, for
``mpsim calibrate --profile``: the GEMMs, attention and memory-bound kernels a GPU runs for
a model shape, each with its input shapes (``record_shapes=True``).

    python validate/profile_layers.py --preset llama-3-8b --layers 2 --recipe mixed-bf16 \\
        --device cuda -o profile_bf16.json
    mpsim calibrate --profile profile_bf16.json --dtype bf16 --server h100-x1 -o h100-kernels.yaml

On a CPU the trace has no GPU kernels (``mpsim calibrate`` then says so); the script still
runs there, which is how the tests check it.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from mpsim.models.trace import RECIPES
from mpsim.models.tracer import DTYPES
from mpsim.models.workloads import PRESETS, build_layers


def profile_layers(preset: str, layers: int, microbatch: int, recipe: str, device: str, steps: int,
                   output: Path, seq_len: int | None = None) -> Path:
    """Run ``steps`` forward and backward passes of ``preset`` at ``layers`` layers (and
    ``seq_len`` tokens, when given) under the profiler, after one untimed step, and write
    its Chrome trace to ``output``."""
    cfg = dataclasses.replace(PRESETS[preset][0], layers=layers, seq_len=seq_len or PRESETS[preset][0].seq_len)
    dtype = DTYPES[RECIPES[recipe].compute_dtype]
    modules = [m.to(device=device, dtype=dtype) for m in build_layers(cfg)]
    tokens = torch.randint(0, cfg.vocab, (microbatch, cfg.seq_len), device=device)

    def step() -> None:
        x = tokens
        for m in modules[:-1]:
            x = m(x)
        modules[-1](x, tokens).backward()

    step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(output))
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-3-8b", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--microbatch", type=int, default=1)
    parser.add_argument("--recipe", default="mixed-bf16", choices=sorted(RECIPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, help="tokens per sample  [default: the preset's]")
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    path = profile_layers(args.preset, args.layers, args.microbatch, args.recipe, args.device, args.steps,
                          args.output, args.seq_len)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
