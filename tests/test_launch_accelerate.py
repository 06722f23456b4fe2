"""Accelerate's configuration file of a launch job (``mpsim.launch.accelerate``): what it
and its labelled training-script block state comes back unchanged, the rest is refused in
one line, and Accelerate's own ``ClusterConfig`` and FSDP plugin accept what is written."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsim.errors import MpsimError
from mpsim.launch import accelerate
from mpsim.launch.formats import Where
from mpsim.launch.job import LaunchJob, Prediction

BASE: dict[str, Any] = {"model": "llama-3-8b", "server": "dgx-a100-80gb", "seq_len": 8192, "recipe": "mixed-bf16",
                        "microbatch": 2, "microbatches": 8}
ONE = Where("llama-3-8b", "dgx-a100-80gb")
TWO = Where("llama-3-8b", "dgx-a100-80gb", "ib-2", 2)
STATED: dict[str, tuple[dict[str, Any], Where]] = {
    "one GPU": ({}, ONE),
    "ddp8": ({"data": 8, "runtime": "eager"}, ONE),
    "ddp8 checkpointing, 50 MiB buckets": ({"data": 8, "recompute": "full", "bucket_mib": 50.0}, ONE),
    "fsdp8": ({"data": 8, "zero_stage": 3}, ONE),
    "fsdp8 fp16 kept gathered (SHARD_GRAD_OP)": ({"data": 8, "zero_stage": 3, "reshard_after_forward": False,
                                                  "recipe": "mixed-fp16"}, ONE),
    "fsdp8 offload recompute": ({"data": 8, "zero_stage": 3, "offload": "params", "recompute": "full"}, ONE),
    "fsdp8 tf32": ({"data": 8, "zero_stage": 3, "recipe": "tf32"}, ONE),
    "fsdp8 fp32 grads": ({"data": 8, "zero_stage": 3, "recipe": "mixed-bf16-fp32grad"}, ONE),
    "hsdp16 on two servers": ({"data": 16, "zero_stage": 3, "hsdp": True, "servers": 2, "cluster": "ib-2"}, TWO),
    "fsdp16 on two servers": ({"data": 16, "zero_stage": 3, "servers": 2, "cluster": "ib-2"}, TWO),
}


def _job(**kw: Any) -> LaunchJob:
    return LaunchJob.model_validate({**BASE, **kw})


@pytest.mark.parametrize("case", list(STATED))
def test_export_then_import_is_the_same_job(case: str) -> None:
    kw, where = STATED[case]
    job = _job(**kw, predicted=Prediction(fits=True, peak_gib=30.0, iteration_s=0.9, samples_per_s=17.0))
    text = accelerate.emit(job)
    assert text.startswith("# Written by mpsim")
    assert accelerate.parse(text, "acc.yaml", where) == job.model_copy(update={"predicted": None})


def test_the_keys_accelerate_reads() -> None:
    config = yaml.safe_load(accelerate.emit(_job(data=16, zero_stage=3, hsdp=True, servers=2, cluster="ib-2",
                                                 reshard_after_forward=False, offload="params")))
    assert (config["distributed_type"], config["num_processes"], config["num_machines"]) == ("FSDP", 16, 2)
    fsdp = config["fsdp_config"]
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_reshard_after_forward"] is False
    assert fsdp["fsdp_offload_params"] is True and fsdp["fsdp_activation_checkpointing"] is False
    assert config["parallelism_config"]["parallelism_config_dp_replicate_size"] == 2
    assert config["parallelism_config"]["parallelism_config_dp_shard_size"] == 8
    assert config["mixed_precision"] == "bf16"
    ddp = yaml.safe_load(accelerate.emit(_job(data=4, recipe="fp32")))
    assert (ddp["distributed_type"], ddp["mixed_precision"], "fsdp_config" in ddp) == ("MULTI_GPU", "no", False)


@pytest.mark.parametrize(("bad", "match"), [
    ({"recipe": "mxfp8"}, "FP8"),
    ({"tensor": 2}, "tensor 2"),
    ({"pipeline": 2}, "pipeline"),
    ({"context": 2}, "context 2"),
    ({"data": 2, "expert": 2}, "expert"),
    ({"data": 8, "zero_stage": 1}, "ZeRO-1"),
    ({"data": 8, "zero_stage": 2}, "ZeRO-2"),
    ({"recompute": "selective"}, "selective"),
    ({"recompute": "full", "recompute_layers": 4}, "every transformer layer"),
    ({"data": 8, "zero_stage": 3, "offload": "optimizer"}, "optimizer offload"),
    ({"data": 8, "zero_stage": 3, "offload": "params", "offload_device": "nvme"}, "NVMe"),
    ({"data": 8, "hsdp": True}, "HSDP without ZeRO-3"),
    ({"data": 8, "zero_stage": 3, "hsdp": True}, "one server"),
    ({"data": 8, "reshard_after_forward": False}, "only FSDP"),
])
def test_what_accelerate_cannot_state_is_refused_in_one_line(bad: dict[str, Any], match: str) -> None:
    with pytest.raises(MpsimError, match=match) as e:
        accelerate.emit(_job(**bad))
    assert "\n" not in str(e.value)


FSDP1 = """\
# mpsim job: {"seq_len": 4096, "recipe": "mixed-bf16", "microbatch": 1, "microbatches": 1}
# training script (not Accelerate's):
#   per_device_train_batch_size: 4
#   gradient_accumulation_steps: 2
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 1
  fsdp_sharding_strategy: {strategy}
  fsdp_offload_params: false
mixed_precision: bf16
num_machines: 2
num_processes: 16
"""


@pytest.mark.parametrize(("strategy", "zero", "reshard", "hsdp"), [
    ("FULL_SHARD", 3, True, False), ("SHARD_GRAD_OP", 3, False, False), ("NO_SHARD", 0, True, False),
    ("HYBRID_SHARD", 3, True, True), ("HYBRID_SHARD_ZERO2", 3, False, True)])
def test_fsdp1_sharding_strategies_are_read(strategy: str, zero: int, reshard: bool, hsdp: bool) -> None:
    job = accelerate.parse(FSDP1.replace("{strategy}", strategy), "acc.yaml", TWO)
    assert (job.zero_stage, job.reshard_after_forward, job.hsdp) == (zero, reshard, hsdp)
    assert (job.microbatch, job.microbatches, job.data, job.seq_len) == (4, 2, 16, 4096)


@pytest.mark.parametrize(("edit", "match"), [
    (lambda t: t.replace("# mpsim job:", "# job:"), "sequence length"),
    (lambda t: t.replace("#   gradient_accumulation_steps: 8\n", ""), "gradient_accumulation_steps"),
    (lambda t: t.replace("distributed_type: FSDP", "distributed_type: DEEPSPEED"), "DEEPSPEED"),
    (lambda t: t.replace("num_machines: 1", "num_machines: 4"), "num_machines"),
    (lambda t: t + "parallelism_config:\n  parallelism_config_tp_size: 2\n", "tensor or context"),
    (lambda t: t.replace("fsdp_reshard_after_forward: true", "fsdp_reshard_after_forward: SOMETIMES"), "SOMETIMES"),
    (lambda t: t + "broken: [unclosed\n", "not YAML"),
])
def test_what_mpsim_cannot_read_is_refused_in_one_line(edit: Any, match: str) -> None:
    text = edit(accelerate.emit(_job(data=8, zero_stage=3)))
    with pytest.raises(MpsimError, match=match) as e:
        accelerate.parse(text, "acc.yaml", ONE)
    assert "\n" not in str(e.value)


@st.composite
def _stated(draw: st.DrawFn) -> tuple[LaunchJob, Where]:
    """A job Accelerate's file states: one GPU, DDP, FSDP2 or HSDP on one to four servers."""
    servers = draw(st.integers(1, 4))
    where = Where("llama-3-8b", "dgx-a100-80gb", "ib" if servers > 1 else None, servers)
    kind = draw(st.sampled_from(["ddp", "fsdp"] + (["hsdp"] if servers > 1 else [])))
    data = servers * draw(st.integers(1, 8))
    kw: dict[str, Any] = {"data": data, "servers": servers, "cluster": where.cluster,
                          "microbatch": draw(st.integers(1, 16)), "microbatches": draw(st.integers(1, 64)),
                          "seq_len": draw(st.sampled_from([1024, 4096, 8192])),
                          "recipe": draw(st.sampled_from(["mixed-fp16", "mixed-bf16", "mixed-bf16-fp32grad", "fp32",
                                                          "tf32"])),
                          "bucket_mib": draw(st.sampled_from([25.0, 1.5, 100.0, 0.3])),
                          "runtime": draw(st.sampled_from(["eager", "megatron-lm", "deepspeed"])),
                          "recompute": draw(st.sampled_from(["none", "full"])),
                          "offload_device": draw(st.sampled_from(["host", "nvme"]))}
    if kind != "ddp":
        kw.update(zero_stage=3, hsdp=kind == "hsdp", reshard_after_forward=draw(st.booleans()))
        if kw["offload_device"] == "host":
            kw["offload"] = draw(st.sampled_from(["none", "params"]))
    return _job(**kw), where


@settings(max_examples=150, deadline=None)
@given(_stated())
def test_every_job_accelerate_states_comes_back(case: tuple[LaunchJob, Where]) -> None:
    job, where = case
    assert accelerate.parse(accelerate.emit(job), "acc.yaml", where) == job


@pytest.mark.parametrize("case", list(STATED))
def test_accelerates_own_parsers_accept_the_file(case: str, tmp_path: Path) -> None:
    try:
        cluster_config = importlib.import_module("accelerate.commands.config.config_args").ClusterConfig
        utils = importlib.import_module("accelerate.utils")
    except Exception as exc:  # noqa: BLE001 - any failure to import means no accelerate here
        pytest.skip(f"accelerate does not import here ({type(exc).__name__}: {exc})")
    kw, _ = STATED[case]
    job = _job(**kw)
    path = tmp_path / "accelerate.yaml"
    path.write_text(accelerate.emit(job))
    config = cluster_config.from_yaml_file(str(path))
    assert (config.num_processes, config.num_machines) == (job.gpus, job.servers)
    if config.fsdp_config:
        fsdp = {k.removeprefix("fsdp_"): v for k, v in config.fsdp_config.items()}
        plugin = utils.FullyShardedDataParallelPlugin(
            fsdp_version=fsdp["version"], reshard_after_forward=fsdp["reshard_after_forward"],
            cpu_offload=fsdp["offload_params"], activation_checkpointing=fsdp["activation_checkpointing"],
            state_dict_type=fsdp["state_dict_type"], auto_wrap_policy=fsdp["auto_wrap_policy"],
            cpu_ram_efficient_loading=fsdp["cpu_ram_efficient_loading"])
        assert plugin.reshard_after_forward is job.reshard_after_forward
        assert plugin.activation_checkpointing is (job.recompute == "full")
    if config.parallelism_config:
        sizes = {k.removeprefix("parallelism_config_"): v for k, v in config.parallelism_config.items()}
        mesh = utils.ParallelismConfig(**sizes)
        assert (mesh.dp_replicate_size, mesh.dp_shard_size, mesh.total_size) == (job.servers, job.data // job.servers,
                                                                                  job.gpus)
