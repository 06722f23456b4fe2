"""DeepSpeed's JSON configuration of a launch job (``mpsim.launch.deepspeed``): what it
states comes back unchanged, what it cannot state is refused in one line, and DeepSpeed's
own ``DeepSpeedConfig`` accepts what is written (where deepspeed imports)."""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsim.errors import MpsimError
from mpsim.launch import deepspeed
from mpsim.launch.formats import Where
from mpsim.launch.job import LaunchJob, Prediction

BASE: dict[str, Any] = {"model": "llama-3-8b", "server": "dgx-a100-80gb", "seq_len": 8192, "recipe": "mixed-bf16",
                        "microbatch": 2, "microbatches": 8}
WHERE = Where("llama-3-8b", "dgx-a100-80gb")
STATED: dict[str, dict[str, Any]] = {
    "ddp8": {"data": 8},
    "ddp8 deepspeed profile": {"data": 8, "runtime": "deepspeed"},
    "zero1x8 eager fp16": {"data": 8, "zero_stage": 1, "runtime": "eager", "recipe": "mixed-fp16"},
    "zero2x8 offload fp32 grads": {"data": 8, "zero_stage": 2, "offload": "optimizer",
                                   "recipe": "mixed-bf16-fp32grad"},
    "zero3x8 infinity nvme": {"data": 8, "zero_stage": 3, "offload": "params", "offload_device": "nvme"},
    "zero3x8 kept gathered, 64 MiB": {"data": 8, "zero_stage": 3, "reshard_after_forward": False,
                                      "bucket_mib": 64.0},
    "zero3x8 recompute (script)": {"data": 8, "zero_stage": 3, "recompute": "full"},
    "fp32 and tf32": {"data": 2, "recipe": "tf32"},
    "fp32": {"data": 2, "recipe": "fp32", "bucket_mib": 0.5},
    "ddp2 pp4 recompute": {"data": 2, "pipeline": 4, "recompute": "full"},
    "zero1x4 pp2": {"data": 4, "zero_stage": 1, "pipeline": 2},
    "autotp4 x zero3x2": {"data": 2, "tensor": 4, "zero_stage": 3},
    "ulysses4 x ddp2": {"data": 2, "context": 4, "context_attention": "all-to-all"},
    "one GPU": {},
}


def _job(**kw: Any) -> LaunchJob:
    return LaunchJob.model_validate({**BASE, **kw})


@pytest.mark.parametrize("case", list(STATED))
def test_export_then_import_is_the_same_job(case: str) -> None:
    job = _job(**STATED[case], predicted=Prediction(fits=True, peak_gib=41.5, iteration_s=1.25, samples_per_s=12.8))
    text = deepspeed.emit(job)
    assert deepspeed.parse(text, "ds.json", WHERE) == job.model_copy(update={"predicted": None})


def test_the_keys_deepspeed_reads() -> None:
    job = _job(data=4, zero_stage=2, offload="optimizer", microbatches=6, bucket_mib=25.0)
    config = json.loads(deepspeed.emit(job))
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == (2 * 6 * 4, 2, 6)
    zero = config["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"] == {"device": "cpu"} and "offload_param" not in zero
    assert zero["reduce_bucket_size"] == 25 * 2**20 // 2 and zero["overlap_comm"] is True
    assert config["bf16"] == {"enabled": True} and "fp16" not in config
    header = config["mpsim"]["header"]
    assert header[0].startswith("Written by mpsim") and header[1].startswith("mpsim job: ")
    fp32 = json.loads(deepspeed.emit(_job(data=4, zero_stage=1, recipe="mixed-bf16-fp32grad", runtime="deepspeed")))
    assert fp32["zero_optimization"]["reduce_bucket_size"] == 25 * 2**20 // 4
    assert fp32["data_types"] == {"grad_accum_dtype": "fp32"} and fp32["zero_optimization"]["overlap_comm"] is False


def test_the_prediction_is_written_and_not_read_back() -> None:
    p = Prediction(fits=False, peak_gib=90.0, iteration_s=2.0, samples_per_s=8.0)
    text = deepspeed.emit(_job(data=8, predicted=p))
    assert any("DOES NOT FIT" in line for line in json.loads(text)["mpsim"]["header"])
    assert deepspeed.parse(text, "ds.json", WHERE).predicted is None


@pytest.mark.parametrize(("bad", "match"), [
    ({"recipe": "fp8-delayed"}, "FP8"),
    ({"data": 2, "expert": 2}, "AutoEP"),
    ({"data": 2, "pipeline": 2, "virtual_stages": 2}, "interleaved"),
    ({"data": 8, "zero_stage": 3, "hsdp": True}, "HSDP"),
    ({"tensor": 2, "sequence_parallel": True}, "sequence parallelism"),
    ({"context": 2}, "Ulysses"),
    ({"context": 2, "context_attention": "all-to-all", "tensor": 2}, "data x sequence"),
    ({"tensor": 2, "pipeline": 2}, "pipeline engine"),
    ({"data": 2, "zero_stage": 2, "pipeline": 2}, "ZeRO 0-1"),
    ({"data": 2, "zero_stage": 1, "offload": "params"}, "stage 3"),
    ({"recompute": "selective"}, "selective"),
    ({"recompute": "full", "recompute_layers": 2}, "first N"),
    ({"data": 2, "reshard_after_forward": False}, "only ZeRO-3"),
    ({"data": 2, "bucket_mib": 0.1}, "whole number"),
])
def test_what_deepspeed_cannot_state_is_refused_in_one_line(bad: dict[str, Any], match: str) -> None:
    with pytest.raises(MpsimError, match=match) as e:
        deepspeed.emit(_job(**bad))
    assert "\n" not in str(e.value)


def _edited(job: LaunchJob, **changes: Any) -> str:
    config = json.loads(deepspeed.emit(job))
    for path, value in changes.items():
        *outer, last = path.split("__")
        node = config
        for k in outer:
            node = node.setdefault(k, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return json.dumps(config)


def test_a_hand_edited_configuration_is_read_as_deepspeed_says() -> None:
    job = _job(data=4, zero_stage=1, runtime="deepspeed")
    again = deepspeed.parse(_edited(job, zero_optimization__stage=3, zero_optimization__overlap_comm=None,
                                    train_batch_size=128), "ds.json", WHERE)
    assert (again.zero_stage, again.data, again.runtime) == (3, 4 * 2, "deepspeed")
    eager = deepspeed.parse(_edited(job, zero_optimization__overlap_comm=True), "ds.json", WHERE)
    assert eager.runtime == "eager"
    fp16 = deepspeed.parse(_edited(job, bf16=None, fp16={"enabled": True}), "ds.json", WHERE)
    assert fp16.recipe == "mixed-fp16"
    default_bucket = deepspeed.parse(_edited(job, zero_optimization__reduce_bucket_size=None), "ds.json", WHERE)
    assert default_bucket.bucket_mib == 5e8 * 2 / 2**20


@pytest.mark.parametrize(("changes", "match"), [
    ({"mpsim": None}, "sequence length"),
    ({"train_batch_size": 33}, "data-parallel ranks"),
    ({"fp16": {"enabled": True}}, "both enabled"),
    ({"zero_optimization__stage": 4}, "expected 0-3"),
    ({"zero_optimization__offload_param": {"device": "cpu"}}, "one device"),
    ({"pipeline": {"stages": 2, "activation_checkpoint_interval": 3}}, "does not plan"),
])
def test_what_mpsim_cannot_read_is_refused_in_one_line(changes: dict[str, Any], match: str) -> None:
    text = _edited(_job(data=4, zero_stage=1), **changes)
    with pytest.raises(MpsimError, match=match) as e:
        deepspeed.parse(text, "ds.json", WHERE)
    assert "\n" not in str(e.value)
    with pytest.raises(MpsimError, match="not JSON"):
        deepspeed.parse("{", "ds.json", WHERE)


@st.composite
def _stated(draw: st.DrawFn) -> LaunchJob:
    """A job DeepSpeed's JSON states: data with ZeRO 0-3, or with one of AutoTP, Ulysses, the pipeline engine."""
    extra = draw(st.sampled_from(["none", "tensor", "context", "pipeline"]))
    zero = draw(st.sampled_from([0, 1] if extra == "pipeline" else [0, 1, 2, 3]))
    kw: dict[str, Any] = {"data": draw(st.integers(1, 16)), "zero_stage": zero,
                          "microbatch": draw(st.integers(1, 8)), "microbatches": draw(st.integers(1, 32)),
                          "seq_len": draw(st.sampled_from([2048, 4096, 8192])),
                          "recipe": draw(st.sampled_from(["mixed-fp16", "mixed-bf16", "mixed-fp16-fp32grad",
                                                          "mixed-bf16-fp32grad", "fp32", "tf32"])),
                          "bucket_mib": draw(st.sampled_from([1.0, 25.0, 40.0, 0.25, 512.0])),
                          "runtime": draw(st.sampled_from(["megatron-lm", "deepspeed", "eager"])),
                          "recompute": draw(st.sampled_from(["none", "full"]))}
    if extra != "none":
        kw[extra] = draw(st.integers(2, 8))
    if extra == "context":
        kw["context_attention"] = "all-to-all"
    if zero > 0:
        kw["offload"] = draw(st.sampled_from(["none", "optimizer"] + (["params"] if zero == 3 else [])))
        kw["offload_device"] = draw(st.sampled_from(["host", "nvme"]))
    if zero == 3:
        kw["reshard_after_forward"] = draw(st.booleans())
    return _job(**kw)


@settings(max_examples=150, deadline=None)
@given(_stated())
def test_every_job_deepspeed_states_comes_back(job: LaunchJob) -> None:
    assert deepspeed.parse(deepspeed.emit(job), "ds.json", WHERE) == job


def _deepspeed_config() -> Any:
    try:
        ds_config = importlib.import_module("deepspeed.runtime.config")
    except Exception as exc:  # noqa: BLE001 - any failure to import means no deepspeed here
        pytest.skip(f"deepspeed does not import here ({type(exc).__name__}: {exc})")
    return ds_config


@pytest.mark.parametrize("case", [c for c in STATED if "ulysses" not in c])
def test_deepspeeds_own_parser_accepts_the_file(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ds_config = _deepspeed_config()
    job = _job(**STATED[case])

    class Mpu:  # the data-parallel ranks DeepSpeed's batch identity counts
        def get_data_parallel_world_size(self) -> int:
            return job.data

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda: 0)
    config = ds_config.DeepSpeedConfig(json.loads(deepspeed.emit(job)), mpu=Mpu())
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (
        job.global_batch, job.microbatch, job.microbatches)
    assert config.zero_optimization_stage == job.zero_stage
    assert config.zero_config.reduce_bucket_size * (4 if "grad" in job.recipe or job.recipe in ("fp32", "tf32")
                                                    else 2) == job.bucket_mib * 2**20
    assert config.bfloat16_config.enabled == job.recipe.startswith("mixed-bf16")
    assert config.tensor_parallel_config.autotp_size in (0, job.tensor) and config.world_size == job.data
    if job.pipeline > 1:
        assert config.pipeline["stages"] == job.pipeline
    offload = config.zero_config.offload_param
    assert (offload is not None and offload.device != "none") == (job.offload == "params")
