"""A launch job as DeepSpeed's JSON configuration (``deepspeed.initialize(config=...)``).

JSON has no comments. DeepSpeed's ``DeepSpeedConfig`` reads the top-level keys it knows by
name and never looks at the others (only ``zero_optimization`` and the other sections it
builds as pydantic models refuse unknown keys), so the header (``formats.header``) and what
the training script must do go under a top-level ``"mpsim"`` key, which DeepSpeed ignores.

What maps, key by key:

- ``train_micro_batch_size_per_gpu`` = microbatch, ``gradient_accumulation_steps`` =
  microbatches (under the pipeline engine, the pipeline's microbatches), and
  ``train_batch_size`` = microbatch x microbatches x data, DeepSpeed's own identity over the
  data-parallel ranks. The parser reads the data degree off it.
- ``bf16`` / ``fp16`` ``enabled`` from the recipe; ``data_types.grad_accum_dtype: "fp32"``
  for the ``-fp32grad`` recipes; neither for fp32 and tf32 (TF32 matmuls are the script's
  ``torch.backends`` switch: the header's recipe tells them apart). FP8 and FP4 recipes
  are refused (DeepSpeed's JSON has no FP8 training recipe).
- ``zero_optimization.stage`` 0-3; ``offload_optimizer`` (mpsim's optimizer offload) and,
  for parameter offload (ZeRO-Infinity, stage 3), ``offload_param`` and
  ``offload_optimizer`` together, ``device`` cpu (host) or nvme (``nvme_path`` is a
  placeholder the user sets).
- ``reduce_bucket_size`` and ``allgather_bucket_size`` count elements, mpsim's bucket
  MiB: elements = bucket_mib x 2**20 / bytes of one gradient element (2 under bf16/fp16,
  4 under fp32 gradients: the recipe's ``grad_bytes_per_param``; the all-gather bucket at
  the weights' bytes). A bucket that is not a whole number of elements is refused, so
  reading back multiplies exactly. DeepSpeed's stage 0 all-reduces in fixed buffers of
  5e8 elements and reads neither key; they are written so that the bucket comes back.
- ``overlap_comm``: at stages 0-1 whether the runtime profile reduces gradients beside the
  backward (mpsim's ``deepspeed`` profile does not: DeepSpeed's DDP path and ZeRO-1 reduce
  after it; ``eager`` does); at stages 2-3 true, as mpsim simulates them in every profile.
  ``contiguous_gradients`` true (DeepSpeed's default; it only avoids fragmentation).
- ZeRO-3 without resharding after the forward: ``stage3_max_live_parameters`` and
  ``stage3_max_reuse_distance`` of 1e15 elements, more than any model, so DeepSpeed
  releases no gathered parameter before the backward that reuses it.
- Tensor parallelism: DeepSpeed's AutoTP training (``tensor_parallel.autotp_size``),
  without sequence parallelism, not under the pipeline engine.
- Context parallelism with all-to-all attention: DeepSpeed-Ulysses
  (``data_parallel_size`` and ``sequence_parallel_size``, the mesh ``deepspeed.initialize``
  builds; the script wraps its attention in ``DistributedAttention``).
- Pipeline: DeepSpeed's pipeline engine (``PipelineModule(num_stages=N)`` in the script;
  ``pipeline.stages`` records N), 1F1B, ZeRO 0-1 only; full recomputation as
  ``pipeline.activation_checkpoint_interval: 1`` (every layer checkpointed).

Recomputation without the pipeline engine is not in DeepSpeed's JSON: its
``activation_checkpointing`` section only tunes ``deepspeed.checkpointing`` (partitioned or
CPU checkpoints) for a Megatron-DeepSpeed model that calls it, and a Hugging Face model
turns it on with ``gradient_checkpointing_enable()``. Full recomputation is then written
under ``mpsim.training_script`` and read back from there. Refused, one line each:
selective recomputation, the first N layers only, expert parallelism (AutoEP folds the
experts into the data-parallel ranks with ZeRO groups of its own, not checked against
mpsim's expert axis), virtual pipeline stages, HSDP (ZeRO++'s hpZ keeps a second copy of
the parameters, not HSDP; MiCS was removed), ring and all-gather context attention."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from mpsim.errors import MpsimError
from mpsim.launch import formats
from mpsim.launch.job import LaunchJob
from mpsim.models.trace import RECIPES
from mpsim.timing.runtime import DEFAULT_PROFILE, PROFILES

NAME = "deepspeed"
SUFFIX = ".json"
KEY = "mpsim"
"""The top-level key of the header and the script's part (DeepSpeed reads no key it does not know)."""
MiB = 2**20
KEEP = 10**15
"""ZeRO-3's live and reuse limits, in elements, that release no gathered parameter before its backward."""
NVME_PATH = "/local_nvme"
_JOB = "mpsim job: "
_RECOMPUTE = "recompute: full"


def _precision(recipe: str) -> tuple[str | None, bool]:
    """DeepSpeed's 16-bit mode of ``recipe`` (bf16, fp16 or None) and whether gradients accumulate in fp32."""
    dtype = {"fp16": "fp16", "bf16": "bf16"}.get(RECIPES[recipe].compute_dtype)
    return dtype, dtype is not None and recipe.endswith("-fp32grad")


def _elements(mib: float, nbytes: int, what: str) -> int:
    n = mib * MiB / nbytes
    if n != int(n):
        raise MpsimError(f"bucket {mib:g} MiB is {n:g} {nbytes}-byte elements; DeepSpeed's {what} counts whole "
                         "elements: use a bucket that is a whole number of them")
    return int(n)


def _refuse(launch: LaunchJob) -> None:
    """One line for the first thing DeepSpeed's JSON cannot state."""
    p = RECIPES[launch.recipe]
    checks = [
        (p.gemm_dtype is not None, f"recipe {launch.recipe}: DeepSpeed's configuration has no FP8/FP4 training "
                                   "recipe (Transformer Engine is the model's)"),
        (launch.expert > 1, f"expert {launch.expert}: DeepSpeed's AutoEP folds the experts into the data-parallel "
                            "ranks with ZeRO groups of its own, not checked against mpsim's expert axis"),
        (launch.virtual_stages > 1, f"virtual_stages {launch.virtual_stages}: DeepSpeed's pipeline engine runs one "
                                    "model chunk per stage (no interleaved 1F1B)"),
        (launch.hsdp, "HSDP: DeepSpeed shards ZeRO-3 over the whole data-parallel group (ZeRO++'s hpZ keeps a second "
                      "copy of the parameters, and MiCS was removed)"),
        (launch.sequence_parallel, "sequence parallelism: DeepSpeed's AutoTP splits the linear layers only"),
        (launch.context > 1 and launch.context_attention != "all-to-all",
         f"context attention {launch.context_attention}: DeepSpeed's context parallelism is Ulysses (all-to-all)"),
        (launch.context > 1 and (launch.tensor > 1 or launch.pipeline > 1),
         "Ulysses with tensor or pipeline parallelism: DeepSpeed's JSON states its mesh as data x sequence only"),
        (launch.tensor > 1 and launch.pipeline > 1,
         "AutoTP under the pipeline engine: the engine takes its tensor degree from the script's topology"),
        (launch.pipeline > 1 and launch.zero_stage > 1,
         f"ZeRO-{launch.zero_stage} with pipeline {launch.pipeline}: DeepSpeed's pipeline engine runs ZeRO 0-1"),
        (launch.offload == "params" and launch.zero_stage < 3,
         f"parameter offload at ZeRO-{launch.zero_stage}: DeepSpeed's offload_param needs stage 3"),
        (launch.recompute == "selective", "selective recomputation: DeepSpeed checkpoints whole layers (the "
                                          "attention core alone is Megatron-LM's --recompute-granularity selective)"),
        (launch.recompute_layers is not None, f"recompute_layers {launch.recompute_layers}: DeepSpeed checkpoints "
                                              "every layer or none (the first N is Megatron-LM's block method)"),
        (not launch.reshard_after_forward and launch.zero_stage < 3,
         f"reshard_after_forward off at ZeRO-{launch.zero_stage}: only ZeRO-3 reshards"),
    ]
    for bad, line in checks:
        if bad:
            raise MpsimError(line)


def _zero(launch: LaunchJob) -> dict[str, Any]:
    """The ``zero_optimization`` section of ``launch`` (module doc)."""
    p = RECIPES[launch.recipe]
    zero: dict[str, Any] = {
        "stage": launch.zero_stage,
        "reduce_bucket_size": _elements(launch.bucket_mib, p.grad_bytes_per_param, "reduce_bucket_size"),
        "allgather_bucket_size": _elements(launch.bucket_mib, p.weight_bytes_per_param, "allgather_bucket_size"),
        "overlap_comm": launch.zero_stage >= 2 or PROFILES[launch.runtime].grad_reduce_overlap,
        "contiguous_gradients": True,
    }
    if launch.offload != "none":
        device = {"host": "cpu", "nvme": "nvme"}[launch.offload_device]
        target = {"device": device, **({"nvme_path": NVME_PATH} if device == "nvme" else {})}
        zero["offload_optimizer"] = dict(target)
        if launch.offload == "params":
            zero["offload_param"] = dict(target)
    if launch.zero_stage == 3 and not launch.reshard_after_forward:
        zero["stage3_max_live_parameters"] = KEEP
        zero["stage3_max_reuse_distance"] = KEEP
    return zero


def _script(launch: LaunchJob) -> list[str]:
    """What the training script does that DeepSpeed's JSON does not say."""
    lines = [(launch.pipeline > 1, f"PipelineModule(num_stages={launch.pipeline}) builds the model; DeepSpeed's "
                                   "pipeline engine runs it"),
             (launch.recompute == "full" and launch.pipeline == 1,
              f"{_RECOMPUTE}: every transformer layer checkpointed by the script "
              "(model.gradient_checkpointing_enable() or deepspeed.checkpointing.checkpoint)"),
             (launch.context > 1, "attention wrapped in deepspeed.sequence.layer.DistributedAttention (Ulysses)"),
             (launch.recipe == "tf32", "torch.backends.cuda.matmul.allow_tf32 = True"),
             (launch.offload != "none" and launch.offload_device == "nvme",
              f"nvme_path {NVME_PATH} is a placeholder: set it to the node's NVMe mount")]
    return [line for wanted, line in lines if wanted]


def emit(launch: LaunchJob) -> str:
    """DeepSpeed's configuration of ``launch``, the header under ``"mpsim"`` (module doc)."""
    _refuse(launch)
    dtype, fp32grad = _precision(launch.recipe)
    config: dict[str, Any] = {
        "train_batch_size": launch.microbatch * launch.microbatches * launch.data,
        "train_micro_batch_size_per_gpu": launch.microbatch,
        "gradient_accumulation_steps": launch.microbatches,
    }
    if dtype is not None:
        config[dtype] = {"enabled": True}
    if fp32grad:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    config["zero_optimization"] = _zero(launch)
    if launch.tensor > 1:
        config["tensor_parallel"] = {"autotp_size": launch.tensor}
    if launch.context > 1:
        config["data_parallel_size"] = launch.data
        config["sequence_parallel_size"] = launch.context
    if launch.pipeline > 1:
        config["pipeline"] = {"stages": launch.pipeline,
                              "activation_checkpoint_interval": 1 if launch.recompute == "full" else 0}
    script = _script(launch)
    config[KEY] = {"header": [line.removeprefix("# ") for line in formats.header(launch, "#").splitlines()],
                   **({"training_script": script} if script else {})}
    return json.dumps(config, indent=2) + "\n"


def _int(value: object, key: str, source: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise MpsimError(f"{source}: {key} {value!r}: expected a whole number of at least {low}")
    return value


def _mpsim_job(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The header's mpsim job (what DeepSpeed does not state), or {} without one."""
    block = config.get(KEY)
    lines = block.get("header", []) if isinstance(block, dict) else []
    for line in lines if isinstance(lines, list) else []:
        if isinstance(line, str) and line.startswith(_JOB):
            job = formats.load_json(line[len(_JOB):], source, "the header's mpsim job as JSON")
            if isinstance(job, dict):
                return job
    return {}


def _script_says(config: dict[str, Any], prefix: str) -> bool:
    block = config.get(KEY)
    lines = block.get("training_script", []) if isinstance(block, dict) else []
    return any(isinstance(x, str) and x.startswith(prefix) for x in (lines if isinstance(lines, list) else []))


def _device(section: object, key: str, source: str) -> str | None:
    if section is None:
        return None
    device = section.get("device", "none") if isinstance(section, dict) else section
    if device not in ("none", "cpu", "nvme"):
        raise MpsimError(f"{source}: zero_optimization.{key}.device {device!r}: expected cpu or nvme")
    return None if device == "none" else str(device)


def _batch(config: dict[str, Any], source: str) -> tuple[int, int, int]:
    """Microbatch, accumulation steps and data-parallel ranks, off DeepSpeed's batch identity."""
    micro = _int(config.get("train_micro_batch_size_per_gpu"), "train_micro_batch_size_per_gpu", source)
    gas = _int(config.get("gradient_accumulation_steps", 1), "gradient_accumulation_steps", source)
    if "train_batch_size" in config:
        batch = _int(config["train_batch_size"], "train_batch_size", source)
        if batch % (micro * gas):
            raise MpsimError(f"{source}: train_batch_size {batch} is not micro {micro} x accumulation {gas} x the "
                             "data-parallel ranks")
        data = batch // (micro * gas)
    else:
        data = _int(config.get("data_parallel_size", 1), "data_parallel_size", source)
    if "data_parallel_size" in config and config["data_parallel_size"] != data:
        raise MpsimError(f"{source}: data_parallel_size {config['data_parallel_size']!r} but train_batch_size says "
                         f"{data} data-parallel ranks")
    return micro, gas, data


def _recipe(config: dict[str, Any], base: dict[str, Any], source: str) -> str:
    """The recipe DeepSpeed's precision keys state; the header's where they cannot tell (fp32, tf32)."""
    for section in ("fp16", "bf16"):
        if not isinstance(config.get(section, {}), dict):
            raise MpsimError(f"{source}: {section} {config[section]!r}: expected an object "
                             "({\"enabled\": true})")
    fp16 = isinstance(config.get("fp16"), dict) and config["fp16"].get("enabled") is True
    bf16 = isinstance(config.get("bf16"), dict) and config["bf16"].get("enabled") is True
    if fp16 and bf16:
        raise MpsimError(f"{source}: fp16 and bf16 both enabled")
    types = config.get("data_types")
    accum = types.get("grad_accum_dtype") if isinstance(types, dict) else None
    dtype = "fp16" if fp16 else "bf16" if bf16 else None
    if accum not in (None, "fp32", "fp16", "bf16") or (accum in ("fp16", "bf16") and accum != dtype):
        raise MpsimError(f"{source}: data_types.grad_accum_dtype {accum!r} with {dtype or 'fp32'} weights: mpsim "
                         "accumulates gradients in the weights' dtype or fp32")
    key = (dtype, dtype is not None and accum == "fp32")
    recipes = [r for r in RECIPES if RECIPES[r].gemm_dtype is None and _precision(r) == key]
    hint = base.get("recipe")
    return hint if isinstance(hint, str) and hint in recipes else recipes[0]


def _zero_fields(config: dict[str, Any], base: dict[str, Any], recipe: str, source: str) -> dict[str, Any]:
    """The launch job's ZeRO stage, offload, bucket, resharding and runtime profile."""
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise MpsimError(f"{source}: zero_optimization {zero!r}: expected an object with a stage (the boolean form "
                         "is DeepSpeed's deprecated one)")
    stage = zero.get("stage", 0)
    if type(stage) is not int or stage not in (0, 1, 2, 3):
        raise MpsimError(f"{source}: zero_optimization.stage {stage!r}: expected 0-3")
    elements = _int(zero.get("reduce_bucket_size", 500_000_000), "zero_optimization.reduce_bucket_size", source)
    optimizer = _device(zero.get("offload_optimizer"), "offload_optimizer", source)
    params = _device(zero.get("offload_param"), "offload_param", source)
    if params is not None and optimizer != params:
        raise MpsimError(f"{source}: offload_param to {params} with the optimizer on {optimizer or 'the GPU'}: "
                         "mpsim's ZeRO-Infinity offloads both to one device")
    keep = all(_int(zero.get(k, 10**9), f"zero_optimization.{k}", source, 0) >= KEEP
               for k in ("stage3_max_live_parameters", "stage3_max_reuse_distance"))
    overlap = zero.get("overlap_comm")
    overlap = stage == 3 if overlap is None else overlap is True
    runtime = base.get("runtime", DEFAULT_PROFILE)  # the header leaves defaults out
    if not isinstance(runtime, str) or runtime not in PROFILES or (
            stage < 2 and PROFILES[runtime].grad_reduce_overlap != overlap):
        runtime = "eager" if stage < 2 and overlap else "deepspeed"
    return {"zero_stage": stage, "offload": "params" if params else "optimizer" if optimizer else "none",
            # without an offload the device says nothing to DeepSpeed: the header's
            "offload_device": {"cpu": "host", "nvme": "nvme", None: base.get("offload_device", "host")}[
                params or optimizer],
            "bucket_mib": elements * RECIPES[recipe].grad_bytes_per_param / MiB,
            "reshard_after_forward": not (stage == 3 and keep), "runtime": runtime}


def _mesh_fields(config: dict[str, Any], base: dict[str, Any], source: str) -> dict[str, Any]:
    """AutoTP, Ulysses and the pipeline engine's degrees, and the recomputation."""
    tp = config.get("tensor_parallel", {})
    tensor = _int(tp.get("autotp_size", 0) or 1, "tensor_parallel.autotp_size", source) if isinstance(tp, dict) else 1
    context = _int(config.get("sequence_parallel_size", 1), "sequence_parallel_size", source)
    pipe = config.get("pipeline", {})
    pipe = pipe if isinstance(pipe, dict) else {}
    stages = pipe.get("stages", "auto")
    pipeline = _int(base.get("pipeline", 1) if stages == "auto" else stages,
                    "the header's pipeline" if stages == "auto" else "pipeline.stages", source)
    if pipeline > 1:
        interval = _int(pipe.get("activation_checkpoint_interval", 0), "pipeline.activation_checkpoint_interval",
                        source, 0)
        if interval > 1:
            raise MpsimError(f"{source}: pipeline.activation_checkpoint_interval {interval} keeps one input per "
                             f"{interval} layers, which mpsim does not plan; use 0 or 1")
        recompute = "full" if interval == 1 else "none"
    else:
        recompute = "full" if _script_says(config, _RECOMPUTE) else "none"
    return {"tensor": tensor, "context": context, "pipeline": pipeline, "recompute": recompute,
            "context_attention": "all-to-all" if context > 1 else base.get("context_attention", "ring")}


def parse(text: str, source: str, where: formats.Where) -> LaunchJob:
    """The launch job of DeepSpeed's configuration ``text``; the header's mpsim job gives
    what DeepSpeed does not state (sequence length; fp32 against tf32; the runtime profile;
    recomputation outside the pipeline engine). Refused in one line otherwise."""
    config = formats.load_json(text, source)
    if not isinstance(config, dict):
        raise MpsimError(f"{source}: expected a JSON object")
    base = _mpsim_job(config, source)
    if where.seq_len is not None:  # the command line's --seq-len
        base = {**base, "seq_len": where.seq_len}
    if "seq_len" not in base:
        raise MpsimError(f"{source}: DeepSpeed's configuration does not state the sequence length, and it has no "
                         f"mpsim header ({KEY}.header) that does: give --seq-len")
    micro, gas, data = _batch(config, source)
    recipe = _recipe(config, base, source)
    fields: dict[str, Any] = {
        "model": where.model, "server": where.server, "cluster": where.cluster, "servers": where.servers,
        "seq_len": base["seq_len"], "recipe": recipe, "microbatch": micro, "microbatches": gas, "data": data,
        **_zero_fields(config, base, recipe, source), **_mesh_fields(config, base, source),
    }
    try:
        return LaunchJob.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise MpsimError(f"{source}: {'.'.join(str(x) for x in first['loc']) or 'job'}: {first['msg']}") from None
