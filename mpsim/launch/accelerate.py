"""A launch job as Hugging Face Accelerate's configuration file (the YAML ``accelerate
config`` writes and ``accelerate launch --config_file`` reads).

What maps: one GPU (``distributed_type: NO``), DDP (``MULTI_GPU``), FSDP2 (``FSDP``,
``fsdp_version: 2``) as ZeRO-3 with ``fsdp_reshard_after_forward`` (off is FSDP1's
SHARD_GRAD_OP: parameters stay gathered from the forward to the backward, which mpsim
simulates as ZeRO-3 without resharding; mpsim's ZeRO-2 keeps whole parameters on every
GPU and gathers them after the update, DeepSpeed's stage 2), HSDP (``parallelism_config``
with ``dp_replicate_size`` the servers and ``dp_shard_size`` the GPUs of the data axis on
each; FSDP1's HYBRID_SHARD reads the same), ``fsdp_activation_checkpointing`` (every
transformer layer: full recomputation), ``fsdp_offload_params`` (parameters, gradients
and the optimizer step on the host: mpsim's parameter offload to host), ``mixed_precision``
bf16/fp16/no from the recipe, ``num_processes`` (GPUs) and ``num_machines`` (servers).
The parser also reads FSDP1's ``fsdp_sharding_strategy`` / string ``fsdp_reshard_after_forward``.

The microbatch and gradient accumulation are the training script's
(``per_device_train_batch_size``, ``Accelerator(gradient_accumulation_steps=...)``), as are
DDP's bucket (``DistributedDataParallelKwargs(bucket_cap_mb=...)``) and, under DDP,
gradient checkpointing: they are written in a comment block labelled
``training script (not Accelerate's):`` that the parser reads back. The header's mpsim job
gives the sequence length, fp32 against tf32, the gradient dtype and the runtime profile.

Refused, one line each: tensor, pipeline, context and expert parallelism (mpsim plans them
with Megatron-LM or torchtitan; Accelerate's parallelism_config TP/CP is not mapped),
ZeRO-1 and ZeRO-2 (DeepSpeed's: ``--emit deepspeed``), selective recomputation, the
first N layers only, optimizer-only offload and NVMe (FSDP offloads parameters to the
host), FP8 and FP4 recipes."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import ValidationError

from mpsim.datafile import UniqueKeyLoader
from mpsim.errors import MpsimError
from mpsim.launch import formats
from mpsim.launch.job import LaunchJob
from mpsim.models.trace import RECIPES
from mpsim.plans.mesh import DEFAULT_BUCKET_MIB
from mpsim.timing.runtime import DEFAULT_PROFILE

NAME = "accelerate"
SUFFIX = ".yaml"
SCRIPT = "training script (not Accelerate's):"
"""The label of the comment block the parser reads back."""
_JOB = "mpsim job: "
_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no", "tf32": "no"}
_SHARDING = {"FULL_SHARD": (3, True, False), "SHARD_GRAD_OP": (3, False, False), "NO_SHARD": (0, True, False),
             "HYBRID_SHARD": (3, True, True), "HYBRID_SHARD_ZERO2": (3, False, True)}
"""FSDP1's sharding strategies: ZeRO stage, reshard after forward, HSDP."""


def _refuse(launch: LaunchJob) -> None:
    p = RECIPES[launch.recipe]
    checks = [
        (p.gemm_dtype is not None, f"recipe {launch.recipe}: mpsim does not map its FP8/FP4 recipes to Accelerate's "
                                   "mixed_precision fp8"),
        (launch.tensor > 1, f"tensor {launch.tensor}: not mapped to Accelerate (plan it with --emit megatron or "
                            "torchtitan)"),
        (launch.pipeline > 1, f"pipeline {launch.pipeline}: Accelerate's configuration has no pipeline parallelism"),
        (launch.context > 1, f"context {launch.context}: not mapped to Accelerate (plan it with --emit torchtitan)"),
        (launch.expert > 1, f"expert {launch.expert}: Accelerate's configuration has no expert parallelism"),
        (launch.zero_stage in (1, 2), f"ZeRO-{launch.zero_stage}: Accelerate's FSDP shards parameters too (ZeRO-3); "
                                      "ZeRO-1/2 are DeepSpeed's (--emit deepspeed)"),
        (launch.recompute == "selective", "selective recomputation: FSDP's activation checkpointing wraps whole "
                                          "transformer layers"),
        (launch.recompute_layers is not None, f"recompute_layers {launch.recompute_layers}: FSDP's activation "
                                              "checkpointing wraps every transformer layer"),
        (launch.offload == "optimizer", "optimizer offload: FSDP offloads parameters, gradients and the step "
                                        "together (fsdp_offload_params)"),
        (launch.offload != "none" and launch.offload_device == "nvme", "NVMe offload: FSDP offloads to host memory"),
        (launch.hsdp and launch.zero_stage != 3, "HSDP without ZeRO-3: HSDP shards as FSDP does"),
        (launch.hsdp and launch.servers == 1, "HSDP on one server: it shards as FSDP does (dp_replicate_size 1)"),
        (launch.hsdp and launch.data % launch.servers != 0,
         f"HSDP over data {launch.data} on {launch.servers} servers: dp_shard_size must divide evenly"),
        (not launch.reshard_after_forward and launch.zero_stage == 0,
         "reshard_after_forward off under DDP: only FSDP reshards"),
    ]
    for bad, line in checks:
        if bad:
            raise MpsimError(line)


def emit(launch: LaunchJob) -> str:
    """Accelerate's configuration of ``launch`` under the header and the script's block (module doc)."""
    _refuse(launch)
    fsdp = launch.zero_stage == 3
    kind = "FSDP" if fsdp else "MULTI_GPU" if launch.data > 1 else "NO"
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": kind,
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": _PRECISION[RECIPES[launch.recipe].compute_dtype],
        "num_machines": launch.servers,
        "num_processes": launch.gpus,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if fsdp:
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": launch.reshard_after_forward,
            "fsdp_offload_params": launch.offload == "params",
            "fsdp_activation_checkpointing": launch.recompute == "full",
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
        }
    if launch.hsdp:
        config["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": launch.servers,
            "parallelism_config_dp_shard_size": launch.data // launch.servers,
            "parallelism_config_tp_size": 1,
            "parallelism_config_cp_size": 1,
        }
    script = [f"per_device_train_batch_size: {launch.microbatch}",
              f"gradient_accumulation_steps: {launch.microbatches}",
              f"ddp_bucket_cap_mb: {launch.bucket_mib!r}"]
    if launch.recompute == "full" and not fsdp:
        script.append("gradient_checkpointing: true")
    block = "".join(f"#   {line}\n" for line in script)
    return (formats.header(launch, "#") + f"# {SCRIPT}\n" + block
            + yaml.safe_dump(config, sort_keys=True, default_flow_style=False))


def _comments(text: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The header's mpsim job and the script block's settings."""
    job: dict[str, Any] = {}
    script: dict[str, str] = {}
    inside = False
    for raw in text.splitlines():
        if not raw.startswith("#"):
            inside = False
            continue
        line = raw[1:].strip()
        if line.startswith(_JOB):
            found = formats.load_json(line[len(_JOB):], "the header's mpsim job")
            job = found if isinstance(found, dict) else {}
        elif line == SCRIPT:
            inside = True
        elif inside and ":" in line:
            name, value = line.split(":", 1)
            script[name.strip()] = value.strip()
    return job, script


def _number(script: dict[str, str], name: str, source: str, kind: type = int) -> Any:
    try:
        return kind(script[name])
    except KeyError:
        raise MpsimError(f"{source}: Accelerate's configuration does not state {name} (the training script's); "
                         f"write it in the '# {SCRIPT}' block") from None
    except ValueError:
        raise MpsimError(f"{source}: {name} {script[name]!r}: expected a number") from None


def _sharding(config: dict[str, Any], fsdp: dict[str, Any], gpus: int, where: formats.Where,
              source: str) -> tuple[int, bool, bool]:
    """ZeRO stage, resharding after the forward and HSDP, from FSDP2's or FSDP1's keys and
    the parallelism config."""
    stage, reshard, hsdp = 0, True, False
    if config.get("distributed_type") == "FSDP":
        strategy = fsdp.get("fsdp_sharding_strategy", fsdp.get("fsdp_reshard_after_forward", True))
        if isinstance(strategy, bool):
            stage, reshard = 3, strategy
        elif str(strategy).upper() in _SHARDING:
            stage, reshard, hsdp = _SHARDING[str(strategy).upper()]
        else:
            raise MpsimError(f"{source}: FSDP sharding {strategy!r}: expected true/false or one of "
                             f"{', '.join(_SHARDING)}")
    par = config.get("parallelism_config") or {}
    sizes = {str(k).removeprefix("parallelism_config_"): v for k, v in par.items()} if isinstance(par, dict) else {}
    for axis in ("tp_size", "cp_size", "sp_size"):
        if sizes.get(axis, 1) not in (1, None):
            raise MpsimError(f"{source}: parallelism_config {axis} {sizes[axis]!r}: mpsim does not read Accelerate's "
                             "tensor or context parallelism")
    replicate = sizes.get("dp_replicate_size", 1)
    if replicate not in (1, None) and stage == 3:
        hsdp = True
        shard = sizes.get("dp_shard_size", 1)
        if type(replicate) is not int or type(shard) is not int or replicate * shard != gpus:
            raise MpsimError(f"{source}: dp_replicate_size {replicate} x dp_shard_size {shard} is not num_processes "
                             f"{gpus}")
    if hsdp and replicate not in (1, None, where.servers):
        raise MpsimError(f"{source}: dp_replicate_size {replicate}: mpsim's HSDP replicates across the "
                         f"{where.servers} servers")
    return stage, reshard, hsdp


def _recipe(config: dict[str, Any], base: dict[str, Any], source: str) -> str:
    precision = config.get("mixed_precision", "no") or "no"
    matches = [r for r in RECIPES if RECIPES[r].gemm_dtype is None
               and _PRECISION[RECIPES[r].compute_dtype] == precision]
    if not matches:
        raise MpsimError(f"{source}: mixed_precision {precision!r}: mpsim reads no, fp16 and bf16")
    hint = base.get("recipe")
    return hint if isinstance(hint, str) and hint in matches else matches[0]


def _load(text: str, source: str, seq_len: int | None = None) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    try:
        config = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader refusing repeated keys
        base, script = _comments(text)
    except yaml.YAMLError as exc:
        raise MpsimError(f"{source}: not YAML ({str(exc).splitlines()[0]})") from None
    except RecursionError:
        raise MpsimError(f"{source}: not YAML (nested too deeply)") from None
    except MpsimError as exc:
        raise MpsimError(f"{source}: {exc}") from None
    if not isinstance(config, dict):
        raise MpsimError(f"{source}: expected a mapping")
    if seq_len is not None:  # the command line's --seq-len
        base = {**base, "seq_len": seq_len}
    if "seq_len" not in base:
        raise MpsimError(f"{source}: Accelerate's configuration does not state the sequence length, and it has no "
                         "'# mpsim job:' header that does: give --seq-len")
    return config, base, script


def parse(text: str, source: str, where: formats.Where) -> LaunchJob:
    """The launch job of Accelerate's configuration ``text`` with its header and script block
    (module doc). Refused in one line otherwise."""
    config, base, script = _load(text, source, where.seq_len)
    kind = config.get("distributed_type")
    if kind not in ("NO", "MULTI_GPU", "FSDP"):
        raise MpsimError(f"{source}: distributed_type {kind!r}: mpsim reads NO, MULTI_GPU (DDP) and FSDP")
    gpus = config.get("num_processes", 1)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise MpsimError(f"{source}: num_processes {gpus!r}: expected the GPUs of the job")
    if config.get("num_machines", 1) != where.servers:
        raise MpsimError(f"{source}: num_machines {config.get('num_machines')!r} but the command line says "
                         f"{where.servers} servers")
    fsdp = config.get("fsdp_config") or {}
    if not isinstance(fsdp, dict):
        raise MpsimError(f"{source}: fsdp_config: expected a mapping")
    stage, reshard, hsdp = _sharding(config, fsdp, gpus, where, source)
    checkpointing = fsdp.get("fsdp_activation_checkpointing") is True if kind == "FSDP" else (
        script.get("gradient_checkpointing") == "true")
    offload = kind == "FSDP" and fsdp.get("fsdp_offload_params") is True
    fields: dict[str, Any] = {
        "model": where.model, "server": where.server, "cluster": where.cluster, "servers": where.servers,
        "seq_len": base["seq_len"], "recipe": _recipe(config, base, source),
        "microbatch": _number(script, "per_device_train_batch_size", source),
        "microbatches": _number(script, "gradient_accumulation_steps", source),
        "data": gpus, "zero_stage": stage, "hsdp": hsdp, "reshard_after_forward": reshard,
        "recompute": "full" if checkpointing else "none", "offload": "params" if offload else "none",
        # the device says nothing without an offload: the header's
        "offload_device": "host" if offload else base.get("offload_device", "host"),
        "bucket_mib": _number(script, "ddp_bucket_cap_mb", source, float) if "ddp_bucket_cap_mb" in script
        else DEFAULT_BUCKET_MIB,
        "runtime": base.get("runtime", DEFAULT_PROFILE),
    }
    try:
        return LaunchJob.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise MpsimError(f"{source}: {'.'.join(str(x) for x in first['loc']) or 'job'}: {first['msg']}") from None
