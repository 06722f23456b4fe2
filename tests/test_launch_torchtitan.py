"""torchtitan job configs (issue 52, ``mpsim.launch.torchtitan``): every job torchtitan can
state comes back from its TOML file unchanged; what it cannot state is refused in one line;
a hand-written file with optimizer, data, logging and checkpoint keys reads, and a key mpsim
does not model is named; torchtitan's own config manager reads what is written."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsim.errors import MpsimError
from mpsim.launch import torchtitan
from mpsim.launch.formats import Where
from mpsim.launch.job import LaunchJob

WHERE = Where("llama-3-8b", "dgx-h100")
MOE = Where("qwen3-30b-a3b", "dgx-h100")
PAIR = Where("llama-3-8b", "dgx-h100", cluster="dgx-h100-superpod", servers=2)
BASE = {"model": "llama-3-8b", "server": "dgx-h100", "seq_len": 8192, "recipe": "mixed-bf16", "microbatch": 1,
        "microbatches": 8}


def job(**update: Any) -> LaunchJob:
    return LaunchJob.model_validate({**BASE, **update})


def where_of(launch: LaunchJob) -> Where:
    return Where(launch.model, launch.server, launch.cluster, launch.servers)


@st.composite
def torchtitan_jobs(draw: st.DrawFn) -> LaunchJob:
    """Jobs of 8 GPUs of a dgx-h100 a torchtitan config states."""
    tensor = draw(st.sampled_from([1, 2, 4]))
    pipeline = draw(st.sampled_from([1, 2]))
    context = draw(st.sampled_from([1, 2])) if tensor * pipeline <= 4 else 1
    data = 8 // (tensor * pipeline * context)
    ddp = tensor * pipeline * context == 1 and draw(st.booleans())
    zero = 0 if ddp or data * context == 1 else 3
    recompute = draw(st.sampled_from(["none", "full"]))
    mixed_ok = zero == 3 or tensor * pipeline == 1
    recipe = draw(st.sampled_from(["mixed-bf16", "fp8-current", "mxfp8", "fp32"] if mixed_ok else ["fp32"]))
    runtimes = ["eager"] if recipe == "mxfp8" and tensor > 1 else ["eager", "megatron-lm", "torchtitan-async-tp"]
    return job(data=data, zero_stage=zero, tensor=tensor, sequence_parallel=tensor > 1, pipeline=pipeline,
               virtual_stages=draw(st.sampled_from([1, 2, 3])) if pipeline > 1 else 1, context=context,
               context_attention=draw(st.sampled_from(["ring", "all-gather"])) if context > 1 else "ring",
               recompute=recompute, recipe=recipe, microbatch=draw(st.sampled_from([1, 2])),
               microbatches=draw(st.sampled_from([1, 4, 8])), runtime=draw(st.sampled_from(runtimes)),
               offload="params" if zero == 3 and recompute == "full" and draw(st.booleans()) else "none",
               reshard_after_forward=draw(st.booleans()), bucket_mib=100.0 if ddp else 25.0)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(torchtitan_jobs())
def test_every_job_torchtitan_states_comes_back(launch: LaunchJob) -> None:
    assert torchtitan.parse(torchtitan.emit(launch), "job.toml", WHERE) == launch


LAYOUTS = {
    "one GPU": job(),
    "DDP x8": job(data=8, bucket_mib=100.0),
    "FSDP x8": job(data=8, zero_stage=3),
    "FSDP x8 kept gathered": job(data=8, zero_stage=3, reshard_after_forward=False),
    "HSDP 2 x 8": job(servers=2, cluster="dgx-h100-superpod", data=16, zero_stage=3, hsdp=True),
    "HSDP 2 x 4 x TP2": job(servers=2, cluster="dgx-h100-superpod", data=8, zero_stage=3, hsdp=True, tensor=2,
                            sequence_parallel=True),
    "TP8+SP fp32": job(tensor=8, sequence_parallel=True, recipe="fp32"),
    "FSDP x2 x TP4+SP async": job(data=2, zero_stage=3, tensor=4, sequence_parallel=True,
                                  runtime="torchtitan-async-tp"),
    "FSDP x4 x PP2 1F1B": job(data=4, zero_stage=3, pipeline=2, microbatch=2),
    "FSDP x2 x PP4 interleaved x2": job(data=2, zero_stage=3, pipeline=4, virtual_stages=2),
    "FSDP x4 x PP2 interleaved x3": job(data=4, zero_stage=3, pipeline=2, virtual_stages=3),
    "PP8 fp32 eager": job(pipeline=8, recipe="fp32", runtime="eager"),
    "CP8 ring": job(zero_stage=3, context=8, context_attention="ring"),
    "FSDP x2 x CP4 all-gather x TP": job(data=1, zero_stage=3, context=4, context_attention="all-gather", tensor=2,
                                         sequence_parallel=True),
    "EP4 x FSDP2": job(model="qwen3-30b-a3b", data=2, expert=4, zero_stage=3),
    "EP2 x TP2 x FSDP2": job(model="qwen3-30b-a3b", data=2, expert=2, tensor=2, sequence_parallel=True, zero_stage=3),
    "EP8 mxfp8": job(model="qwen3-30b-a3b", expert=8, zero_stage=3, recipe="mxfp8"),
    "full recompute": job(data=8, zero_stage=3, recompute="full"),
    "CPU offload": job(data=8, zero_stage=3, recompute="full", offload="params"),
    "fp8-current": job(data=8, zero_stage=3, recipe="fp8-current"),
    "mxfp8 eager TP": job(data=4, zero_stage=3, tensor=2, sequence_parallel=True, recipe="mxfp8", runtime="eager"),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_layout_comes_back(name: str) -> None:
    launch = LAYOUTS[name]
    assert torchtitan.parse(torchtitan.emit(launch), "job.toml", where_of(launch)) == launch


def test_the_degrees_are_torchtitans() -> None:
    hsdp = torchtitan.emit(LAYOUTS["HSDP 2 x 4 x TP2"])
    assert "data_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 4\n" in hsdp
    ep = torchtitan.emit(LAYOUTS["EP2 x TP2 x FSDP2"])
    assert "data_parallel_shard_degree = 4\n" in ep and "expert_tensor_parallel_degree = 2\n" in ep
    cp = torchtitan.emit(LAYOUTS["CP8 ring"])
    assert 'context_parallel_rotate_method = "alltoall"' in cp and "data_parallel_shard_degree = 1\n" in cp
    pp = torchtitan.emit(LAYOUTS["FSDP x4 x PP2 interleaved x3"])
    assert 'pipeline_parallel_schedule = "Interleaved1F1B"' in pp and "pipeline_parallel_layers_per_stage = 6" in pp
    assert "local_batch_size = 8\nglobal_batch_size = 32\n" in pp  # 8 microbatches of 1 in one schedule, 4 replicas


def test_the_prediction_is_a_comment_and_is_not_read_back() -> None:
    launch = job(data=8, zero_stage=3, predicted={"fits": True, "peak_gib": 41.5, "iteration_s": 2.5,
                                                  "samples_per_s": 3.2})
    text = torchtitan.emit(launch)
    assert "# predicted: fits, peak 41.50 GiB per GPU, iteration 2.500 s, 3.2 samples/s" in text
    assert torchtitan.parse(text, "job.toml", WHERE) == launch.model_copy(update={"predicted": None})


@pytest.mark.parametrize("update, message", [
    ({"data": 8, "zero_stage": 1}, "ZeRO-1 has no torchtitan setting"),
    ({"data": 8, "zero_stage": 2, "offload": "optimizer"}, "optimizer offload"),
    ({"data": 8, "zero_stage": 3, "recompute": "full", "offload": "params", "offload_device": "nvme"}, "not on NVMe"),
    ({"data": 8, "zero_stage": 3, "offload": "params"}, "every layer recomputed"),
    ({"data": 8, "zero_stage": 3, "recompute": "selective"}, "not mpsim's attention-core"),
    ({"data": 8, "zero_stage": 3, "recompute": "full", "recompute_layers": 2}, "first N layers"),
    ({"data": 4, "zero_stage": 3, "tensor": 2}, "always splits the norms"),
    ({"zero_stage": 3, "context": 8, "context_attention": "all-to-all"}, "DeepSpeed-Ulysses"),
    ({"context": 8}, "shards parameters over the context"),
    ({"data": 4, "tensor": 2, "sequence_parallel": True, "recipe": "fp32"}, "one-dimensional"),
    ({"data": 8}, "its DDP buckets are 100 MiB"),
    ({"data": 8, "zero_stage": 3, "bucket_mib": 50.0}, "under FSDP"),
    ({"zero_stage": 3}, "FSDP over one GPU"),
    ({"data": 8, "zero_stage": 3, "runtime": "deepspeed"}, "another framework's"),
    ({"data": 8, "zero_stage": 3, "recipe": "mixed-fp16"}, "recipe mixed-fp16"),
    ({"data": 8, "zero_stage": 3, "recipe": "mixed-bf16-fp32grad"}, "recipe mixed-bf16-fp32grad"),
    ({"data": 8, "zero_stage": 3, "recipe": "fp8-delayed"}, "recipe fp8-delayed"),
    ({"tensor": 8, "sequence_parallel": True}, "trains in fp32"),
    ({"data": 4, "zero_stage": 3, "tensor": 2, "sequence_parallel": True, "recipe": "mxfp8"}, "does not compile"),
    ({"model": "gpt-5.3b", "data": 8, "zero_stage": 3}, "no torchtitan model"),
    ({"model": "qwen3-30b-a3b", "data": 8, "zero_stage": 3, "recipe": "fp8-current"}, "scale per row"),
    ({"data": 2, "zero_stage": 3, "pipeline": 4, "virtual_stages": 4}, "do not split"),
    ({"data": 8, "zero_stage": 3, "hsdp": True}, "replicas of whole servers"),
    ({"model": "qwen3-30b-a3b", "data": 8, "expert": 1, "zero_stage": 3, "hsdp": True, "servers": 2,
      "cluster": "dgx-h100-superpod", "context": 2}, "HSDP with context"),
])
def test_what_torchtitan_cannot_state_is_refused(update: dict, message: str) -> None:
    with pytest.raises(MpsimError, match=message) as e:
        torchtitan.emit(job(**update))
    assert "\n" not in str(e.value)


CONFIG = """# a torchtitan job config as people write them
[job]
dump_folder = "./outputs"
description = "Llama 3 8B, 8 H100s"

[profiling]
enable_profiling = true
save_traces_folder = "profile_trace"
profile_freq = 100

[metrics]
log_freq = 10
enable_tensorboard = true

[model]
name = "llama3"
flavor = "8B"
hf_assets_path = "./assets/hf/Llama-3.1-8B"

[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 200

[training]
local_batch_size = 2
global_batch_size = 64
seq_len = 8192
max_norm = 1.0
steps = 1000
dataset = "c4"

[training.dataloader]
num_workers = 2

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 2
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable = false
folder = "checkpoint"
interval = 500

[activation_checkpoint]
mode = "full"

[compile]
enable = true
components = ["model", "loss"]

[validation]
enable = false
"""


def test_a_hand_written_config_reads() -> None:
    launch = torchtitan.parse(CONFIG, "llama3_8b.toml", WHERE)
    assert (launch.data, launch.zero_stage, launch.tensor, launch.sequence_parallel) == (4, 3, 2, True)
    assert (launch.microbatch, launch.microbatches, launch.global_batch) == (2, 8, 64)
    assert (launch.recipe, launch.recompute, launch.runtime) == ("mixed-bf16", "full", "megatron-lm")


def edited(old: str, new: str) -> str:
    assert old in CONFIG
    return CONFIG.replace(old, new)


@pytest.mark.parametrize("text, message", [
    (edited("[validation]", "[float8]\nenable_float8_linear = true\n[validation]"), "float8 is not modelled"),
    (edited("max_norm = 1.0", "max_norm = 1.0\nfoo = 3"), "training.foo is not modelled"),
    (edited('mode = "full"', 'mode = "selective"\nselective_ac_option = "op"'), "op policy keeps attention"),
    (edited('mode = "full"', 'mode = "selective"'), "every n-th block"),
    (edited('[activation_checkpoint]\nmode = "full"\n', ""), "every n-th block"),
    (edited('mode = "full"', 'mode = "memory_budget"'), "memory_budget"),
    (edited("steps = 1000", 'steps = 1000\ndtype = "bfloat16"'), "without an fp32 copy"),
    (edited("pipeline_parallel_degree = 1", 'pipeline_parallel_degree = 2\npipeline_parallel_schedule = "GPipe"'),
     "1F1B or Interleaved1F1B"),
    (edited("pipeline_parallel_degree = 1", "pipeline_parallel_degree = 2"), "accumulation steps each drain"),
    (edited("tensor_parallel_degree = 2", "tensor_parallel_degree = 2\ndisable_loss_parallel = true"),
     "splits the loss"),
    (edited('name = "AdamW"', 'name = "Lion"'), "Adam's two moments"),
    (edited('flavor = "8B"', 'flavor = "70B"'), "the job was given llama-3-8b"),
    (edited("global_batch_size = 64", "global_batch_size = 65"), "whole number of local batches"),
    (edited("tensor_parallel_degree = 2", "tensor_parallel_degree = true"), "expected a whole number"),
    (edited("tensor_parallel_degree = 2", "tensor_parallel_degree = 3"), "do not split"),
    (edited("data_parallel_replicate_degree = 1", "data_parallel_replicate_degree = 2"), "under HSDP"),
    (edited('flavor = "8B"', 'flavor = "8B"\nconverters = ["quantize.linear.float8"]').replace(
        "[validation]", '[quantize.linear.float8]\nrecipe_name = "rowwise"\n[validation]'), "tensorwise"),
    (edited('flavor = "8B"', 'flavor = "8B"\nconverters = ["quantize.linear.float8"]'), "keeps exactly the head"),
    (edited("enable = true\ncomponents", "enable = false\ncomponents").replace(
        "tensor_parallel_degree = 2", "tensor_parallel_degree = 2\nenable_async_tensor_parallel = true"),
     "async TP needs compile"),
    (edited("steps = 1000", "steps = 1000\nenable_cpu_offload = true").replace('"full"', '"none"'),
     "every layer recomputed"),
    (edited("[model]", "[model\n"), "not a TOML file"),
])
def test_what_mpsim_cannot_simulate_is_named(text: str, message: str) -> None:
    with pytest.raises(MpsimError, match=message) as e:
        torchtitan.parse(text, "llama3_8b.toml", WHERE if "superpod" not in text else PAIR)
    assert "\n" not in str(e.value)


def test_what_the_shard_degree_leaves_is_read_from_the_servers() -> None:
    text = edited("data_parallel_replicate_degree = 1", "data_parallel_replicate_degree = 2")
    launch = torchtitan.parse(text.replace("data_parallel_shard_degree = -1", "data_parallel_shard_degree = 4"),
                              "two.toml", PAIR)
    assert (launch.data, launch.hsdp, launch.microbatches) == (8, True, 4)


# ---------------------------------------------------------------------------- torchtitan's own parser

@pytest.fixture
def config_manager() -> Iterator[Any]:
    """torchtitan's ``ConfigManager`` (0.1 to 0.2.2, the TOML releases), its package
    imported without ``torchtitan/__init__.py``, which loads the models and their GPU
    kernels (triton); the modules are removed again after the test."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or spec.submodule_search_locations is None:
        pytest.skip("torchtitan is not installed here (pip install 'torchtitan<0.3' --no-deps, with tyro)")
    locations = list(spec.submodule_search_locations)
    if not (Path(locations[0]) / "config" / "job_config.py").exists():
        pytest.skip("the installed torchtitan has no TOML job config (0.3 reads Python config registries)")
    saved = {k: v for k, v in sys.modules.items() if k == "torchtitan" or k.startswith("torchtitan.")}
    package = types.ModuleType("torchtitan")
    package.__path__ = locations
    sys.modules["torchtitan"] = package
    try:
        try:
            manager = importlib.import_module("torchtitan.config.manager")
        except ImportError as exc:
            pytest.skip(f"torchtitan's config manager does not import here: {exc}")
        yield manager.ConfigManager
    finally:
        for key in [k for k in sys.modules if k == "torchtitan" or k.startswith("torchtitan.")]:
            del sys.modules[key]
        sys.modules.update(saved)


@pytest.mark.parametrize("name", ["HSDP 2 x 4 x TP2", "FSDP x4 x PP2 interleaved x3", "CP8 ring",
                                  "EP2 x TP2 x FSDP2", "CPU offload", "fp8-current", "EP8 mxfp8", "DDP x8"])
def test_torchtitans_own_config_manager_reads_it(name: str, config_manager: Any, tmp_path: Path) -> None:
    launch = LAYOUTS[name]
    path = tmp_path / "job.toml"
    path.write_text(torchtitan.emit(launch), encoding="utf-8")
    config = config_manager().parse_args(["--job.config_file", str(path)])
    par, training = config.parallelism, config.training
    replicate, shard = par.data_parallel_replicate_degree, par.data_parallel_shard_degree
    assert replicate * shard == launch.data * launch.expert
    assert (par.tensor_parallel_degree, par.pipeline_parallel_degree) == (launch.tensor, launch.pipeline)
    assert (par.context_parallel_degree, par.expert_parallel_degree) == (launch.context, launch.expert)
    assert training.global_batch_size == launch.global_batch and training.seq_len == launch.seq_len
    assert config.activation_checkpoint.mode == launch.recompute
    assert training.enable_cpu_offload == (launch.offload == "params")
    assert (config.model.name, config.model.flavor) == torchtitan.MODELS[launch.model]
    dims = importlib.import_module("torchtitan.distributed.parallel_dims").ParallelDims(  # its own mesh checks
        dp_replicate=replicate, dp_shard=shard, cp=par.context_parallel_degree, tp=par.tensor_parallel_degree,
        pp=par.pipeline_parallel_degree, ep=par.expert_parallel_degree, etp=par.expert_tensor_parallel_degree,
        world_size=launch.gpus)
    assert (shard * dims.cp * dims.tp) % (dims.etp * dims.ep) == 0  # the experts' FSDP group is whole
