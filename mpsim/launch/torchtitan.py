"""A launch job as a torchtitan job config: the TOML file ``--job.config_file`` reads (the
sections and keys of ``torchtitan/config/job_config.py``, torchtitan 0.1 to 0.2.2; 0.3
replaced the TOML files with Python config registries).

- Data: ``[parallelism] data_parallel_replicate_degree`` and ``data_parallel_shard_degree``.
  torchtitan is FSDP2 or DDP: shard > 1 (or a context group, which torchtitan always
  shards over) is mpsim's ZeRO-3, replicate x shard both > 1 is HSDP (mpsim shards inside
  each server: the shard degree must be the server's GPUs of a stage's data group),
  replicate alone is DDP, which torchtitan runs on a one-dimensional mesh only and with
  100 MiB buckets. ZeRO-1/2 have no torchtitan setting.
- Tensor: ``tensor_parallel_degree``; torchtitan's tensor-parallel plan always splits the
  norms along the sequence, so a job is sequence parallel with it.
- Pipeline: ``pipeline_parallel_degree``, ``pipeline_parallel_schedule`` 1F1B or
  Interleaved1F1B; stages per rank are 2 by default, else said by
  ``pipeline_parallel_layers_per_stage`` (ceil((layers + first_less + last_less) / per
  stage) virtual stages over the ranks) or by ``module_fqns_per_model_part``. Stage
  boundaries are mpsim's own (its partition by compute time), not torchtitan's split.
- Context: ``context_parallel_degree`` with ``context_parallel_rotate_method``: "alltoall"
  passes each key/value shard on to the next rank step by step (mpsim's ring),
  "allgather" gathers all of them (mpsim's all-gather); DeepSpeed-Ulysses' all-to-all
  over heads has no torchtitan setting. The head-tail load balancer is mpsim's causal
  balance.
- Expert: ``expert_parallel_degree``, carved out of the shard degree (mpsim's expert GPUs
  train different samples), with ``expert_tensor_parallel_degree`` the tensor degree.
- Batch: ``[training] local_batch_size`` per GPU and accumulation step,
  ``global_batch_size`` = local x (replicate x shard) x accumulation steps; under a
  pipeline the local batch is cut into ``pipeline_parallel_microbatch_size`` microbatches
  in one schedule (accumulation steps would each drain the pipeline: refused).
- Precision: ``mixed_precision_param`` "bfloat16" (FSDP's policy, or autocast for DDP and
  one GPU) is mixed-bf16 (fp32 parameters, gradients and Adam moments, bf16 compute: 16
  bytes a parameter); "float32" is fp32 (torchtitan leaves TF32 off). Tensor or pipeline
  parallelism without FSDP trains in fp32 whatever it says. FP8: ``model.converters``
  ``quantize.linear.float8`` with the tensorwise recipe (torchao's dynamic per-tensor
  scaling: fp8-current, its weights cast every microbatch where mpsim counts a cached
  copy) or ``quantize.linear.mx`` mxfp8_cublas (mxfp8; MoE experts by
  ``quantize.grouped_mm.mx``), the output head and routers left in bf16 as mpsim keeps
  them.
- Recomputation: ``[activation_checkpoint] mode`` "none" or "full" (every transformer
  block; "selective" with option "1" says the same). torchtitan's other selective modes
  are not mpsim's attention-core recomputation: the "op" policy keeps the attention
  outputs and every other matmul and recomputes the rest; an integer n checkpoints every
  n-th block, not the first N of each stage.
- Offload: ``training.enable_cpu_offload`` is FSDP2's CPUOffloadPolicy: parameter,
  gradient and optimizer shards on the host and the step there, mpsim's ZeRO-Infinity
  (parameters offloaded, with every layer recomputed as it plans it).
- Runtime: ``[compile] enable`` with "model" compiled is the default profile (no host
  dispatch bound, collectives as they come); with
  ``enable_async_tensor_parallel`` torchtitan-async-tp; not compiled, eager.
- Model: ``[model] name`` and ``flavor`` of the shipped models torchtitan also ships.

``parse`` reads such a file with ``tomllib``, torchtitan's defaults where a key is absent;
what changes neither memory nor time (optimizer hyperparameters, data, logging,
checkpoints) is read past, and any other key mpsim cannot express is refused in one line
naming it."""

from __future__ import annotations

import math
import tomllib
from collections.abc import Iterator
from typing import TypeVar

from pydantic import ValidationError

from mpsim.errors import MpsimError
from mpsim.launch.formats import Where, header
from mpsim.launch.job import LaunchJob, Recompute
from mpsim.models.context_parallel import ContextAttention
from mpsim.plans.mesh import DEFAULT_BUCKET_MIB
from mpsim.timing.runtime import DEFAULT_PROFILE

NAME = "torchtitan"
SUFFIX = ".toml"
DDP_BUCKET_MIB = 100.0
"""torchtitan's DDP (``replicate(..., bucket_cap_mb=100)``)."""
MODELS = {"llama-3-8b": ("llama3", "8B"), "llama-3-70b": ("llama3", "70B"), "deepseek-v3": ("deepseek_v3", "671B"),
          "qwen3-30b-a3b": ("qwen3", "30B-A3B"), "qwen3-235b-a22b": ("qwen3", "235B-A22B"),
          "llama-4-scout": ("llama4", "17bx16e")}
"""mpsim's shipped models torchtitan ships, as its model name and flavor."""
_ROTATE: dict[ContextAttention, str] = {"ring": "alltoall", "all-gather": "allgather"}
_RUNTIMES = ("eager", DEFAULT_PROFILE, "torchtitan-async-tp")
_FLOAT8, _MX, _MX_EXPERTS = "quantize.linear.float8", "quantize.linear.mx", "quantize.grouped_mm.mx"
_KEEP_BF16 = ["output", "router.gate"]
"""Modules the FP8 converters leave alone: the head and the MoE routers (mpsim's ``keep_precision``)."""

Toml = dict[str, object]
T = TypeVar("T")


# ---------------------------------------------------------------------------- emit

def emit(launch: LaunchJob) -> str:
    """The job config (module doc); refused in one line where torchtitan has no setting."""
    moe = _is_moe(launch.model)
    sections: list[tuple[str, Toml]] = [
        ("job", {"description": f"mpsim: {launch.model} on {launch.gpus} GPUs"}),
        ("model", _model_section(launch, moe)),
        ("training", _training_section(launch)),
        ("parallelism", _parallelism_section(launch)),
        ("activation_checkpoint", _recompute_section(launch)),
        ("compile", _compile_section(launch)),
        *_quantize_sections(launch, moe)]
    body = "\n".join(f"[{name}]\n" + "".join(f"{k} = {_value(v)}\n" for k, v in table.items())
                     for name, table in sections)
    return header(launch, "#") + "\n" + body


def _value(v: object) -> str:
    """One TOML value: a boolean, a whole number, a string or a list of strings."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"no TOML value for {v!r}")


def _is_moe(model: str) -> bool:
    from mpsim.data.catalog import load_trace

    return bool(load_trace(model).spec.model.get("moe"))


def _layers(model: str) -> int:
    from mpsim.data.catalog import load_trace

    return int(load_trace(model).spec.model["layers"])


def _server_gpus(server: str) -> int:
    from mpsim.data.catalog import load_topology

    return load_topology(server).n_gpus


def _model_section(launch: LaunchJob, moe: bool) -> Toml:
    if launch.model not in MODELS:
        raise MpsimError(f"torchtitan: {launch.model} is no torchtitan model; it ships "
                         f"{', '.join(f'{m} ({n} {f})' for m, (n, f) in MODELS.items())}")
    name, flavor = MODELS[launch.model]
    table: Toml = {"name": name, "flavor": flavor}
    if launch.recipe == "fp8-current":
        if moe:
            raise MpsimError("torchtitan: its float8 grouped GEMMs for the experts scale per row, which mpsim does "
                             "not model; give mxfp8 or mixed-bf16 for a mixture of experts")
        table["converters"] = [_FLOAT8]
    elif launch.recipe == "mxfp8":
        table["converters"] = [_MX, _MX_EXPERTS] if moe else [_MX]
    return table


def _training_section(launch: LaunchJob) -> Toml:
    local = launch.microbatch * (launch.microbatches if launch.pipeline > 1 else 1)
    table: Toml = {"local_batch_size": local, "global_batch_size": launch.global_batch, "seq_len": launch.seq_len,
                   "dtype": "float32", "mixed_precision_param": _param_dtype(launch),
                   "mixed_precision_reduce": "float32"}
    if launch.offload == "optimizer":
        raise MpsimError("torchtitan: optimizer offload (ZeRO-Offload) has no torchtitan setting; its CPU offload "
                         "moves parameters too (offload params, ZeRO-Infinity)")
    if launch.offload == "params":
        if launch.offload_device != "host":
            raise MpsimError("torchtitan: FSDP2's CPU offload keeps the shards in host memory, not on NVMe")
        if launch.recompute != "full" or launch.recompute_layers is not None:
            raise MpsimError("torchtitan: mpsim plans offloaded parameters (ZeRO-Infinity) with every layer "
                             "recomputed; give recompute full")
        table["enable_cpu_offload"] = True
    return table


def _param_dtype(launch: LaunchJob) -> str:
    recipe = launch.recipe
    if recipe == "fp32":
        return "float32"
    if recipe not in ("mixed-bf16", "fp8-current", "mxfp8"):
        raise MpsimError(f"torchtitan: recipe {recipe} has no torchtitan setting; it trains mixed-bf16 (fp32 "
                         "parameters, gradients and moments, bf16 compute), fp32, fp8-current (float8 tensorwise) "
                         "or mxfp8")
    if launch.zero_stage != 3 and (launch.tensor > 1 or launch.pipeline > 1):
        raise MpsimError(f"torchtitan: {recipe} with tensor or pipeline parallelism needs FSDP (zero stage 3): "
                         "without it torchtitan turns mixed precision off and trains in fp32")
    return "bfloat16"


def _parallelism_section(launch: LaunchJob) -> Toml:
    replicate, shard = _data_degrees(launch)
    table: Toml = {"data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard,
                   "fsdp_reshard_after_forward": "always" if launch.reshard_after_forward else "never",
                   "tensor_parallel_degree": launch.tensor}
    if launch.tensor > 1 and not launch.sequence_parallel:
        raise MpsimError("torchtitan: its tensor parallelism always splits the norms along the sequence; give "
                         "sequence parallelism (sp) with tp")
    if launch.runtime == "torchtitan-async-tp":
        table["enable_async_tensor_parallel"] = True
    table["pipeline_parallel_degree"] = launch.pipeline
    if launch.pipeline > 1:
        table["pipeline_parallel_schedule"] = "Interleaved1F1B" if launch.virtual_stages > 1 else "1F1B"
        table["pipeline_parallel_microbatch_size"] = launch.microbatch
        if launch.virtual_stages > 2:
            table["pipeline_parallel_layers_per_stage"] = _layers_per_stage(launch)
    elif launch.virtual_stages > 1:
        raise MpsimError("torchtitan: virtual stages need a pipeline")
    table["context_parallel_degree"] = launch.context
    if launch.context > 1:
        if launch.context_attention not in _ROTATE:
            raise MpsimError("torchtitan: context attention all-to-all over heads (DeepSpeed-Ulysses) has no "
                             "torchtitan setting; its rotate methods are alltoall (the ring) and allgather")
        table["context_parallel_rotate_method"] = _ROTATE[launch.context_attention]
        table["context_parallel_load_balancer"] = "headtail"
    table["expert_parallel_degree"] = launch.expert
    if launch.expert > 1:
        table["expert_tensor_parallel_degree"] = launch.tensor
    return table


def _data_degrees(launch: LaunchJob) -> tuple[int, int]:
    """torchtitan's replicate and shard degrees of the job's data (and expert) GPUs."""
    batch = launch.data * launch.expert
    if launch.zero_stage in (1, 2):
        raise MpsimError(f"torchtitan: ZeRO-{launch.zero_stage} has no torchtitan setting (it runs FSDP2 or DDP); "
                         "give zero stage 3 or 0")
    if launch.zero_stage == 0:
        if launch.context > 1 or launch.expert > 1:
            raise MpsimError("torchtitan: it shards parameters over the context and expert GPUs (FSDP over data x "
                             "context, experts carved out of the shard degree); give zero stage 3")
        if batch > 1 and launch.tensor * launch.pipeline > 1:
            raise MpsimError("torchtitan: its DDP runs on a one-dimensional mesh only; give FSDP (zero stage 3) "
                             "with tensor or pipeline parallelism")
        want = DDP_BUCKET_MIB if batch > 1 else DEFAULT_BUCKET_MIB
        if launch.bucket_mib != want:
            raise MpsimError(f"torchtitan: a {launch.bucket_mib:g} MiB gradient bucket has no torchtitan setting "
                             + ("(its DDP buckets are 100 MiB); give a 100 MiB bucket" if batch > 1 else
                                f"(one replica reduces nothing); leave it at {DEFAULT_BUCKET_MIB:g}"))
        return batch, 1
    if launch.bucket_mib != DEFAULT_BUCKET_MIB:
        raise MpsimError(f"torchtitan: a {launch.bucket_mib:g} MiB gradient bucket has no torchtitan setting under "
                         f"FSDP; leave it at {DEFAULT_BUCKET_MIB:g}")
    if batch * launch.context == 1:
        raise MpsimError("torchtitan: FSDP over one GPU shards nothing and torchtitan applies none; give zero stage 0")
    if not launch.hsdp:
        return 1, batch
    if launch.context > 1 or launch.expert > 1:
        raise MpsimError("torchtitan: HSDP with context or expert parallelism is not simulated by mpsim")
    shard = _hsdp_shard(launch.data, launch.tensor, _server_gpus(launch.server))
    if shard == launch.data or launch.data % shard:
        raise MpsimError(f"torchtitan: HSDP x{launch.data} does not split into replicas of whole servers; give FSDP")
    return launch.data // shard, shard


def _hsdp_shard(data: int, tensor: int, gpus_per_server: int) -> int:
    """The GPUs of a stage's data group on one server: mpsim's HSDP shard group
    (``cluster_placement.place_on_cluster``'s ``local``)."""
    return max(1, min(data, gpus_per_server // tensor))


def _layers_per_stage(launch: LaunchJob) -> int:
    """The ``pipeline_parallel_layers_per_stage`` that gives ``virtual_stages`` per rank
    with torchtitan's default one layer less on the first and the last stage."""
    layers, chunks = _layers(launch.model), launch.pipeline * launch.virtual_stages
    for per in range(1, layers + 3):
        if math.ceil((layers + 2) / per) == chunks:
            return per
    raise MpsimError(f"torchtitan: {layers} layers do not split into {launch.pipeline} x {launch.virtual_stages} "
                     "model chunks by pipeline_parallel_layers_per_stage")


def _recompute_section(launch: LaunchJob) -> Toml:
    if launch.recompute == "selective":
        raise MpsimError("torchtitan: its selective checkpointing is not mpsim's attention-core recomputation (the "
                         "op policy keeps attention outputs and every other matmul, an integer n every n-th block); "
                         "give recompute none or full")
    if launch.recompute_layers is not None:
        raise MpsimError("torchtitan: full checkpointing covers every block; the first N layers of each stage have "
                         "no torchtitan setting")
    return {"mode": launch.recompute}


def _compile_section(launch: LaunchJob) -> Toml:
    if launch.runtime not in _RUNTIMES:
        raise MpsimError(f"torchtitan: runtime profile {launch.runtime} is another framework's; torchtitan runs "
                         f"{', '.join(_RUNTIMES)}")
    compiled = launch.runtime != "eager"
    if compiled and launch.recipe == "mxfp8" and launch.tensor > 1:
        raise MpsimError("torchtitan: mxfp8 with tensor parallelism does not compile in torchtitan; give the eager "
                         "runtime profile")
    return {"enable": compiled, "components": ["model", "loss"]} if compiled else {"enable": False}


def _quantize_sections(launch: LaunchJob, moe: bool) -> list[tuple[str, Toml]]:
    if launch.recipe == "fp8-current":
        return [("quantize.linear.float8", {"recipe_name": "tensorwise", "filter_fqns": _KEEP_BF16})]
    if launch.recipe == "mxfp8":
        mx: list[tuple[str, Toml]] = [("quantize.linear.mx", {"recipe_name": "mxfp8_cublas",
                                                              "filter_fqns": _KEEP_BF16})]
        return mx + ([("quantize.grouped_mm.mx", {"recipe_name": "mxfp8", "fqns": ["experts"]})] if moe else [])
    return []


# ---------------------------------------------------------------------------- parse

_READ = {
    "model": {"name", "flavor", "converters"},
    "training": {"local_batch_size", "global_batch_size", "seq_len", "dtype", "mixed_precision_param",
                 "mixed_precision_reduce", "enable_cpu_offload"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "tensor_parallel_degree", "disable_loss_parallel", "enable_async_tensor_parallel",
                    "pipeline_parallel_degree", "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv",
                    "pipeline_parallel_microbatch_size", "pipeline_parallel_layers_per_stage",
                    "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
                    "pipeline_parallel_last_stage_less_layers", "context_parallel_degree",
                    "context_parallel_rotate_method", "context_parallel_load_balancer", "expert_parallel_degree",
                    "expert_tensor_parallel_degree", "expert_parallel_comm_backend",
                    "pipeline_parallel_expert_parallel_overlap"},
    "activation_checkpoint": {"mode", "selective_ac_option"},
    "compile": {"enable", "components"},
    "quantize.linear.float8": {"recipe_name", "filter_fqns", "emulate", "enable_fsdp_float8_all_gather",
                               "precompute_float8_dynamic_scale_for_fsdp"},
    "quantize.linear.mx": {"recipe_name", "filter_fqns", "mxfp8_dim1_cast_kernel_choice"},
    "quantize.grouped_mm.mx": {"recipe_name", "fqns"},
    "quantize.grouped_mm.float8": {"fqns"},
    "optimizer": {"name", "early_step_in_backward"},
    "job": {"custom_config_module"},
    "experimental": {"custom_args_module"},
    "fault_tolerance": {"enable"},
}
"""Keys ``parse`` reads and checks, by section."""
_PAST = {
    "job": None, "profiling": None, "metrics": None, "lr_scheduler": None, "checkpoint": None, "comm": None,
    "memory_estimation": None, "validation": None, "debug": None, "fault_tolerance": None, "experimental": None,
    "model": {"hf_assets_path", "tokenizer_path", "print_after_conversion"},
    "optimizer": {"lr", "beta1", "beta2", "eps", "weight_decay", "implementation"},
    "training": {"dataset", "dataset_path", "max_norm", "steps", "gc_freq", "gc_debug", "dataloader"},
    "activation_checkpoint": {"per_op_sac_force_recompute_mm_shapes_by_fqns", "early_stop", "memory_budget",
                              "visualize_memory_budget_pareto", "preserve_rng_state", "determinism_check", "debug"},
    "compile": {"backend"},
}
"""Keys that change neither memory nor time, read past (None: the whole section)."""


def parse(text: str, source: str, where: Where) -> LaunchJob:
    """The launch job of a torchtitan job config (module doc)."""
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise MpsimError(f"{source}: not a TOML file: {str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise MpsimError(f"{source}: not a TOML file: nested too deeply") from None
    except ValueError as exc:  # an integer of more than sys.get_int_max_str_digits() digits
        raise MpsimError(f"{source}: not a TOML file: {str(exc).split(':')[0]}") from None
    cfg = _Config(dict(_keys(table, source)), source)
    cfg.check_others(where)
    par = "parallelism."
    tensor, pipeline = cfg.whole(par + "tensor_parallel_degree", 1), cfg.whole(par + "pipeline_parallel_degree", 1)
    context, expert = cfg.whole(par + "context_parallel_degree", 1), cfg.whole(par + "expert_parallel_degree", 1)
    replicate = cfg.whole(par + "data_parallel_replicate_degree", 1)
    shard = cfg.get(par + "data_parallel_shard_degree", -1, int)
    if shard == -1:  # what the world leaves
        world = where.servers * _server_gpus(where.server)
        shard, left = divmod(world, replicate * context * tensor * pipeline)
        if left or shard < 1:
            raise MpsimError(f"{source}: {world} GPUs do not split into replicate {replicate} x context {context} x "
                             f"tensor {tensor} x pipeline {pipeline}")
    elif shard < 1:
        raise MpsimError(f"{source}: parallelism.data_parallel_shard_degree {shard}: expected -1 or at least 1")
    fsdp = shard * context > 1
    data, hsdp = _data_of(cfg, where, replicate, shard, tensor, pipeline, context, expert)
    virtual_stages = _virtual_stages(cfg, pipeline, where.model)
    microbatch, microbatches = _batch_of(cfg, replicate * shard, pipeline)
    recompute = _recompute_of(cfg)
    offload = cfg.flag("training.enable_cpu_offload")
    if offload and (not fsdp or recompute != "full"):
        raise MpsimError(f"{source}: training.enable_cpu_offload " + (
            "without FSDP offloads nothing mpsim models" if not fsdp else
            "with activation_checkpoint.mode " + repr(cfg.get("activation_checkpoint.mode", "selective", str))
            + ": mpsim simulates offloaded parameters (ZeRO-Infinity) with every layer recomputed; give mode full"))
    fields = {
        "model": where.model, "server": where.server, "cluster": where.cluster, "servers": where.servers,
        "seq_len": cfg.whole("training.seq_len", 2048), "recipe": _recipe_of(cfg, fsdp, tensor, pipeline, where.model),
        "microbatch": microbatch, "microbatches": microbatches, "data": data, "zero_stage": 3 if fsdp else 0,
        "hsdp": hsdp, "tensor": tensor, "sequence_parallel": tensor > 1, "pipeline": pipeline,
        "virtual_stages": virtual_stages, "context": context,
        "context_attention": _context_attention(cfg) if context > 1 else "ring", "expert": expert,
        "recompute": recompute, "offload": "params" if offload else "none",
        "bucket_mib": DDP_BUCKET_MIB if replicate > 1 and not fsdp else DEFAULT_BUCKET_MIB,
        "reshard_after_forward": _reshard_of(cfg, pipeline > 1), "runtime": _runtime_of(cfg)}
    try:
        return LaunchJob.model_validate(fields)
    except ValidationError as exc:
        raise MpsimError(f"{source}: {exc.errors()[0]['msg']}") from None


def _keys(table: dict, source: str, prefix: str = "") -> Iterator[tuple[str, object]]:
    """Dotted keys of the file (``parallelism.tensor_parallel_degree``) and their values;
    a key mpsim neither reads nor reads past refused, named."""
    for key, value in table.items():
        section, name = prefix.rstrip("."), prefix + key
        past = _PAST.get(section, set())
        if key in _READ.get(section, ()):
            yield name, value
        elif past is None or key in past:
            continue
        elif isinstance(value, dict) and any(s == name or s.startswith(name + ".") for s in (*_READ, *_PAST)):
            yield from _keys(value, source, name + ".")
        else:
            raise MpsimError(f"{source}: {name} is not modelled by mpsim (it reads torchtitan's layout, batch, "
                             "precision, checkpointing and compile keys); remove it or ask for it")


class _Config:
    """The file's keys, read with torchtitan's defaults and checked, one line each."""

    def __init__(self, keys: dict[str, object], source: str) -> None:
        self.keys, self.source = keys, source

    def get(self, key: str, default: T, kind: type[T]) -> T:
        value = self.keys.get(key, default)
        if (kind is int and type(value) is not int) or not isinstance(value, kind):
            raise MpsimError(f"{self.source}: {key} {value!r}: expected {_KIND[kind]}")
        return value

    def whole(self, key: str, default: int) -> int:
        value = self.get(key, default, int)
        if value < 1:
            raise MpsimError(f"{self.source}: {key} {value}: expected at least 1")
        return value

    def flag(self, key: str) -> bool:
        return self.get(key, False, bool)

    def names(self, key: str, default: list[str]) -> list[str]:
        value = self.keys.get(key, default)
        if isinstance(value, str):  # torchtitan's comma-separated form
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise MpsimError(f"{self.source}: {key} {value!r}: expected a list of names")
        return value

    def refuse(self, key: str, why: str) -> MpsimError:
        return MpsimError(f"{self.source}: {key} {self.keys.get(key)!r}: {why}")

    def expect(self, key: str, default: object, allowed: tuple[object, ...], why: str) -> None:
        if self.keys.get(key, default) not in allowed:
            raise self.refuse(key, why)

    def check_others(self, where: Where) -> None:
        """The keys that must hold torchtitan's defaults (or a value mpsim models)."""
        self.expect("job.custom_config_module", "", ("",), "a custom job config is not modelled by mpsim")
        self.expect("experimental.custom_args_module", "", ("",), "a custom job config is not modelled by mpsim")
        self.expect("fault_tolerance.enable", False, (False,), "TorchFT's replica groups are not modelled by mpsim")
        self.expect("optimizer.name", "AdamW", ("AdamW", "Adam"), "mpsim models Adam's two moments (AdamW, Adam)")
        self.expect("optimizer.early_step_in_backward", False, (False,),
                    "the optimizer step inside the backward is not modelled by mpsim")
        par = "parallelism."
        self.expect(par + "disable_loss_parallel", False, (False,),
                    "mpsim splits the loss over the tensor group as torchtitan does by default")
        self.expect(par + "pipeline_parallel_schedule_csv", "", ("", None), "mpsim runs 1F1B or Interleaved1F1B")
        self.expect(par + "expert_parallel_comm_backend", "standard", ("standard",),
                    "mpsim runs PyTorch's all-to-alls (standard)")
        self.expect(par + "context_parallel_load_balancer", "headtail", ("headtail",),
                    "mpsim balances the causal mask with head-tail chunks (headtail)")
        self.expect("training.mixed_precision_reduce", "float32", ("float32",), "torchtitan reduces in float32")
        self.expect("training.dtype", "float32", ("float32",),
                    "bf16 parameters and optimizer states without an fp32 copy are no mpsim recipe")
        if where.model in MODELS:
            name, flavor = MODELS[where.model]
            self.expect("model.name", "llama3", (name,), f"the job was given {where.model} ({name} {flavor})")
            self.expect("model.flavor", "debugmodel", (flavor,), f"the job was given {where.model} ({name} {flavor})")


_KIND = {int: "a whole number", bool: "true or false", str: "a string"}


def _data_of(cfg: _Config, where: Where, replicate: int, shard: int, tensor: int, pipeline: int, context: int,
             expert: int) -> tuple[int, bool]:
    """mpsim's data degree and HSDP of torchtitan's data degrees (module doc)."""
    source, par = cfg.source, "parallelism."
    fsdp = shard * context > 1
    batch = replicate * shard
    if expert > 1:
        etp = cfg.whole(par + "expert_tensor_parallel_degree", 1)
        if etp != tensor:
            raise cfg.refuse(par + "expert_tensor_parallel_degree",
                             f"mpsim splits the routed experts over the tensor group too ({tensor})")
        if replicate > 1 or shard % expert:
            raise cfg.refuse(par + "expert_parallel_degree",
                             f"mpsim carves the expert GPUs out of the shard degree ({shard}), without replicas")
        return batch // expert, False
    if replicate > 1 and not fsdp and tensor * pipeline > 1:
        raise cfg.refuse(par + "data_parallel_replicate_degree",
                         "torchtitan's DDP runs on a one-dimensional mesh only")
    if replicate == 1 or not fsdp:
        return batch, False
    if context > 1:
        raise cfg.refuse(par + "data_parallel_replicate_degree",
                         "HSDP with context parallelism is not simulated by mpsim")
    want = _hsdp_shard(batch, tensor, _server_gpus(where.server))
    if shard != want:
        raise MpsimError(f"{source}: parallelism.data_parallel_shard_degree {shard} under HSDP: mpsim shards over a "
                         f"stage's GPUs on one server ({want} on {where.server})")
    return batch, True


def _batch_of(cfg: _Config, batch: int, pipeline: int) -> tuple[int, int]:
    """The microbatch and the microbatches each replica runs (module doc)."""
    local = cfg.whole("training.local_batch_size", 8)
    total = cfg.get("training.global_batch_size", -1, int)
    steps, left = divmod(total, local * batch) if total != -1 else (1, 0)
    if left or steps < 1:
        raise cfg.refuse("training.global_batch_size",
                         f"expected a whole number of local batches x data-parallel degree ({local} x {batch})")
    if pipeline == 1:
        return local, steps
    size = cfg.whole("parallelism.pipeline_parallel_microbatch_size", 1)
    if local % size:
        raise cfg.refuse("parallelism.pipeline_parallel_microbatch_size",
                         f"does not divide training.local_batch_size {local}")
    if steps > 1:
        raise cfg.refuse("training.global_batch_size",
                         f"{steps} accumulation steps each drain the pipeline, which mpsim does not simulate; give "
                         "the microbatches to one local batch")
    return size, local // size


def _virtual_stages(cfg: _Config, pipeline: int, model: str) -> int:
    """Stages per pipeline rank (module doc)."""
    par = "parallelism."
    schedule = cfg.get(par + "pipeline_parallel_schedule", "1F1B", str)
    looped = schedule.lower() == "interleaved1f1b"
    if not looped and schedule.lower() != "1f1b":
        raise cfg.refuse(par + "pipeline_parallel_schedule", "mpsim runs 1F1B or Interleaved1F1B")
    if pipeline == 1:
        return 1
    parts = cfg.keys.get(par + "module_fqns_per_model_part")
    layers_per = cfg.get(par + "pipeline_parallel_layers_per_stage", 0, int)
    if parts is not None:
        if not isinstance(parts, list):
            raise cfg.refuse(par + "module_fqns_per_model_part", "expected a list of lists of module names")
        chunks = len(parts)
    elif layers_per:
        first = cfg.get(par + "pipeline_parallel_first_stage_less_layers", 1, int)
        last = cfg.get(par + "pipeline_parallel_last_stage_less_layers", 1, int)
        chunks = math.ceil((_layers(model) + first + last) / layers_per)
    else:
        chunks = pipeline * (2 if looped else 1)
    per_rank, left = divmod(chunks, pipeline)
    if left or per_rank < 1 or (per_rank == 1) == looped:
        raise MpsimError(f"{cfg.source}: {chunks} model chunks over {pipeline} ranks do not suit {schedule} (1F1B "
                         "runs one per rank, Interleaved1F1B two or more)")
    return per_rank


def _context_attention(cfg: _Config) -> ContextAttention:
    key = "parallelism.context_parallel_rotate_method"
    method = cfg.get(key, "allgather", str)
    found: ContextAttention | None = next((k for k, v in _ROTATE.items() if v == method), None)
    if found is None:
        raise cfg.refuse(key, "expected allgather or alltoall")
    return found


def _recompute_of(cfg: _Config) -> Recompute:
    key = "activation_checkpoint.mode"
    mode = cfg.get(key, "selective", str)
    if mode in ("none", "full"):
        return "none" if mode == "none" else "full"
    if mode == "selective":
        option = cfg.get("activation_checkpoint.selective_ac_option", "2", str)
        if option in ("0", "1"):  # every block checkpointed: full
            return "full"
        raise MpsimError(f"{cfg.source}: activation_checkpoint.selective_ac_option {option!r} is not modelled by "
                         "mpsim (" + ("the op policy keeps attention outputs and every other matmul, not mpsim's "
                                      "attention-core recomputation" if option == "op" else
                                      "every n-th block; mpsim recomputes every block or none") + "); give mode "
                         "none or full")
    raise cfg.refuse(key, "mpsim models none or full checkpointing (memory_budget is the compiler's own trade)")


def _recipe_of(cfg: _Config, fsdp: bool, tensor: int, pipeline: int, model: str) -> str:
    """The mpsim recipe: the parameter dtype where torchtitan applies it, and FP8 converters."""
    param = cfg.get("training.mixed_precision_param", "bfloat16", str)
    if param not in ("bfloat16", "float32"):
        raise cfg.refuse("training.mixed_precision_param", "expected bfloat16 or float32")
    mixed = param == "bfloat16" and (fsdp or tensor * pipeline == 1)
    converters = cfg.names("model.converters", [])
    if not converters:
        return "mixed-bf16" if mixed else "fp32"
    moe = _is_moe(model)
    if converters == [_FLOAT8] and not moe:
        f8 = "quantize.linear.float8."
        cfg.expect(f8 + "recipe_name", None, ("tensorwise", None), "mpsim models tensorwise scaling (fp8-current)")
        cfg.expect(f8 + "emulate", False, (False,), "emulated float8 runs bf16 GEMMs")
        cfg.expect(f8 + "enable_fsdp_float8_all_gather", False, (False,), "mpsim gathers bf16 weights")
        recipe = "fp8-current"
        kept = cfg.names(f8 + "filter_fqns", [])
        key = f8 + "filter_fqns"
    elif sorted(converters) == sorted([_MX, _MX_EXPERTS] if moe else [_MX]):
        mx = "quantize.linear.mx."
        cfg.expect(mx + "recipe_name", "mxfp8_cublas", ("mxfp8_cublas",), "mpsim models mxfp8 on cuBLAS")
        if moe and cfg.names("quantize.grouped_mm.mx.fqns", []) != ["experts"]:
            raise cfg.refuse("quantize.grouped_mm.mx.fqns", "mpsim runs every expert's GEMMs in mxfp8 ([\"experts\"])")
        recipe = "mxfp8"
        kept = cfg.names(mx + "filter_fqns", ["output"])
        key = mx + "filter_fqns"
    else:
        raise cfg.refuse("model.converters", "mpsim models quantize.linear.float8 (dense models) or "
                                             "quantize.linear.mx (with quantize.grouped_mm.mx for experts)")
    if sorted(kept) != sorted(_KEEP_BF16):
        raise cfg.refuse(key, f"mpsim keeps exactly the head and the routers in bf16 ({_KEEP_BF16})")
    if not mixed:
        raise cfg.refuse("training.mixed_precision_param", f"{recipe} needs bf16 mixed precision where torchtitan "
                                                           "applies it (FSDP, or DDP and one GPU)")
    return recipe


def _reshard_of(cfg: _Config, pipelined: bool) -> bool:
    key = "parallelism.fsdp_reshard_after_forward"
    policy = cfg.get(key, "default", str)
    if policy not in ("default", "always", "never"):
        raise cfg.refuse(key, "expected default, always or never")
    return policy == "always" or (policy == "default" and not pipelined)


def _runtime_of(cfg: _Config) -> str:
    compiled = cfg.flag("compile.enable") and "model" in cfg.names("compile.components", ["model", "loss"])
    if cfg.flag("parallelism.enable_async_tensor_parallel"):
        if not compiled:
            raise cfg.refuse("parallelism.enable_async_tensor_parallel",
                             "async TP needs compile.enable with model in compile.components")
        return "torchtitan-async-tp"
    return DEFAULT_PROFILE if compiled else "eager"
