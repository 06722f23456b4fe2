"""Megatron-LM launch scripts (issue 52, ``mpsim.launch.megatron``): every job Megatron-LM
can state comes back from its script unchanged; what it cannot state is refused in one
line; a script with the arguments people add (learning rate, data, logging) reads, and an
argument mpsim does not model is named."""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsim.errors import MpsimError
from mpsim.launch import megatron
from mpsim.launch.formats import Where
from mpsim.launch.job import LaunchJob

WHERE = Where("llama-3-8b", "dgx-a100-80gb")
BASE = {"model": "llama-3-8b", "server": "dgx-a100-80gb", "seq_len": 8192, "recipe": "mixed-bf16", "microbatch": 1,
        "microbatches": 8}


@st.composite
def megatron_jobs(draw: st.DrawFn) -> LaunchJob:
    """Jobs of 8 GPUs a Megatron-LM script states."""
    tensor = draw(st.sampled_from([1, 2, 4]))
    pipeline = draw(st.sampled_from([1, 2]))
    context = draw(st.sampled_from([1, 2])) if tensor * pipeline <= 4 else 1
    data = 8 // (tensor * pipeline * context)
    recompute = draw(st.sampled_from(["none", "selective", "full"]))
    return LaunchJob.model_validate({
        **BASE, "data": data, "tensor": tensor, "sequence_parallel": tensor > 1 and draw(st.booleans()),
        "pipeline": pipeline, "virtual_stages": draw(st.sampled_from([1, 2])) if pipeline > 1 else 1,
        "context": context,
        "context_attention": draw(st.sampled_from(["ring", "all-gather", "all-to-all"])) if context > 1 else "ring",
        "zero_stage": draw(st.sampled_from([0, 1, 3])), "recompute": recompute,
        "recompute_layers": draw(st.sampled_from([None, 2])) if recompute == "full" else None,
        "recipe": draw(st.sampled_from(["mixed-bf16", "mixed-bf16-fp32grad", "fp8-delayed", "mxfp8"])),
        "microbatch": draw(st.sampled_from([1, 2])), "microbatches": draw(st.sampled_from([1, 4, 8])),
        "runtime": draw(st.sampled_from(["megatron-lm", "megatron-lm-sync-grads", "megatron-core-tp-overlap"]))})


@settings(max_examples=60, deadline=None, derandomize=True)
@given(megatron_jobs())
def test_every_job_megatron_states_comes_back(job: LaunchJob) -> None:
    assert megatron.parse(megatron.emit(job), "job.sh", WHERE) == job


def test_the_prediction_is_a_comment_and_is_not_read_back() -> None:
    job = LaunchJob.model_validate({**BASE, "data": 8, "zero_stage": 3, "predicted": {
        "fits": True, "peak_gib": 41.5, "iteration_s": 2.5, "samples_per_s": 3.2}})
    text = megatron.emit(job)
    assert "# predicted: fits, peak 41.50 GiB per GPU, iteration 2.500 s, 3.2 samples/s" in text
    assert megatron.parse(text, "job.sh", WHERE) == job.model_copy(update={"predicted": None})


@pytest.mark.parametrize("update, message", [
    ({"data": 8, "zero_stage": 2}, "ZeRO-2 has no Megatron-LM flag"),
    ({"data": 8, "zero_stage": 3, "offload": "params"}, "parameter offload"),
    ({"data": 8, "runtime": "deepspeed"}, "another framework's"),
    ({"data": 8, "recipe": "nvfp4"}, "recipe nvfp4"),
    ({"data": 2, "pipeline": 4, "virtual_stages": 3}, "do not split"),
])
def test_what_megatron_cannot_state_is_refused(update: dict, message: str) -> None:
    with pytest.raises(MpsimError, match=message) as e:
        megatron.emit(LaunchJob.model_validate({**BASE, **update}))
    assert "\n" not in str(e.value)


SCRIPT = """#!/bin/bash
GPT_ARGS="--lr 3e-4"  # a shell variable is a word too
torchrun --nproc_per_node 8 --master_port 6000 pretrain_gpt.py \\
    --tensor-model-parallel-size 2 --sequence-parallel \\
    --pipeline-model-parallel-size 2 \\
    --use-distributed-optimizer --overlap-grad-reduce \\
    --micro-batch-size 1 --global-batch-size 32 --seq-length 8192 \\
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8 \\
    --bf16 --recompute-granularity selective \\
    --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \\
    --train-iters 1000 --data-path /data/my_text_document --save /ckpt --log-interval 10
"""


def test_a_hand_written_script_reads() -> None:
    job = megatron.parse(SCRIPT, "train.sh", WHERE)
    assert (job.tensor, job.sequence_parallel, job.pipeline, job.data, job.zero_stage) == (2, True, 2, 2, 1)
    assert (job.microbatches, job.recipe, job.recompute, job.runtime) == (16, "mixed-bf16-fp32grad", "selective",
                                                                          "megatron-lm")


@pytest.mark.parametrize("extra, message", [
    ("--moe-router-topk 2", "--moe-router-topk is not modelled"),
    ("--num-layers 40", "--num-layers 40 but the model has 32"),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 4", "not modelled"),
    ("--global-batch-size 33", "no whole number"),
])
def test_what_mpsim_cannot_simulate_is_named(extra: str, message: str) -> None:
    with pytest.raises(MpsimError, match=message) as e:
        megatron.parse(SCRIPT.rstrip() + f" \\\n    {extra}\n", "train.sh", WHERE)
    assert "\n" not in str(e.value)


def test_megatrons_own_parser_takes_the_arguments() -> None:
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.training") is None:
        pytest.skip("Megatron-LM's training package (megatron.training.arguments) is not installed here: it is not "
                    "on PyPI (megatron-core holds megatron.core only)")
    from megatron.training.arguments import parse_args  # type: ignore[import-not-found]  # pragma: no cover

    text = megatron.emit(LaunchJob.model_validate({**BASE, "data": 4, "tensor": 2, "sequence_parallel": True}))
    words = text.split("pretrain_gpt.py", 1)[1].replace("\\\n", " ").split()
    import sys

    sys.argv = ["pretrain_gpt.py", *words]
    args = parse_args()
    assert args.tensor_model_parallel_size == 2
