"""The launch job (issue 52): a plan mpsim made, stated as a launcher states it
(``mpsim.launch.job``), simulates to the same iteration and peak; plans no framework
states are refused in one line."""

from __future__ import annotations

import pytest

from mpsim import api
from mpsim.errors import MpsimError
from mpsim.launch.job import LaunchJob, from_planned, simulate
from mpsim.planners import plan_job
from mpsim.plans.job import job_of

LAYOUTS = {
    "fsdp8 recompute": ("recompute-all", "fsdp8", None),
    "fsdp2xtp4sp selective": ("selective", "fsdp2xtp4sp", None),
    "zero1x2xpp4": ("none", "zero1x2xpp4", None),
    "ddp2xtp2xpp2 interleaved": ("none", "ddp2xtp2spxpp2", 2),
    "zero2x8 offload": ("zero-offload", "zero2x8", None),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_a_plan_as_a_launch_job_simulates_the_same(case: str) -> None:
    strategy, layout, stages = LAYOUTS[case]
    parallelism = api.parse_layout(layout)
    if stages:  # two model chunks a GPU
        parallelism = parallelism.model_copy(update={"virtual_stages": stages})
    job = job_of("dgx-a100-80gb", "llama-3-8b", microbatch=1, microbatches=8, strategy=strategy,
                 parallelism=parallelism)
    planned = plan_job(job)
    launch = from_planned(job, planned.plan, planned.result, "llama-3-8b", "dgx-a100-80gb")
    assert launch.gpus == 8 and launch.global_batch == 8 * launch.sample_ways
    again = LaunchJob.model_validate_json(launch.model_dump_json())
    _, _, result = simulate(again)
    assert (result.iteration_s, result.max_peak_bytes) == (planned.result.iteration_s, planned.result.max_peak_bytes)


def test_first_layers_of_each_stage_recomputed_as_megatrons_block_method() -> None:
    launch = LaunchJob(model="llama-3-8b", server="dgx-a100-80gb", seq_len=8192, recipe="mixed-bf16", microbatch=1,
                       microbatches=8, data=4, pipeline=2, recompute="full", recompute_layers=3)
    job, plan, result = simulate(launch)
    recomputed = [[a.layer for a in st.actions if a.action == "recompute"] for st in plan.stages]
    firsts = [[i for i in range(*st.layers) if job.trace.layers[i].kind == "transformer"][:3] for st in plan.stages]
    assert recomputed == firsts and all(len(r) == 3 for r in recomputed)
    assert from_planned(job, plan, result, "llama-3-8b", "dgx-a100-80gb").recompute_layers == 3


def test_plans_no_framework_states_are_refused() -> None:
    job = job_of("dgx1-v100", "gpt-15.4b", microbatch=2, microbatches=8, strategy="cpu-swap")
    planned = plan_job(job)
    with pytest.raises(MpsimError, match="no framework's configuration states") as e:
        from_planned(job, planned.plan, planned.result, "gpt-5.3b", "dgx1-v100")
    assert "\n" not in str(e.value)


def test_bad_launch_jobs_are_refused() -> None:
    base = {"model": "llama-3-8b", "server": "dgx-a100-80gb", "seq_len": 8192, "recipe": "mixed-bf16",
            "microbatch": 1, "microbatches": 8}
    for bad in ({"recipe": "fp9"}, {"runtime": "nope"}, {"recompute_layers": 2},
                {"offload": "optimizer"}, {"context_attention": "all-gather"}):
        with pytest.raises(ValueError):
            LaunchJob.model_validate({**base, **bad})


def test_plan_emits_and_simulate_reads_it_back(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """``plan --emit megatron`` then ``simulate --from`` runs the same job: the same iteration
    and peak as the plan file."""
    import json

    from mpsim.cli import main

    plan = tmp_path / "p.json"
    assert main(["plan", "--server", "dgx-a100-80gb", "--model", "llama-3-8b", "--dp", "2", "--zero", "1", "--tp", "4",
                 "--sp", "--microbatch", "1", "--microbatches", "8", "--strategy", "selective", "-o", str(plan),
                 "--emit", "megatron", "--json", "-"]) == 0
    planned = json.loads(capsys.readouterr().out)["result"]
    script = tmp_path / "p.megatron.sh"
    assert "--recompute-granularity selective" in script.read_text()
    assert main(["simulate", "--from", str(script), "--model", "llama-3-8b", "--server", "dgx-a100-80gb",
                 "--json", "-"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["iteration_s"] == planned["iteration_s"]
    assert [g["peak_bytes"] for g in again["gpus"]] == [g["peak_bytes"] for g in planned["gpus"]]


@pytest.mark.parametrize("argv, message", [
    (["plan", "-o", "x.json", "--emit", "slurm"], "expected one of megatron"),
    (["simulate", "--from", "x.sh"], "--from needs --model"),
    (["simulate", "--from", "x.sh", "--model", "llama-3-8b", "--dp", "2"], "--dp and --from"),
    (["simulate", "--from", "x.cfg", "--model", "llama-3-8b"], "cannot tell its format"),
])
def test_launch_flags_refuse_in_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    from mpsim.cli import main

    assert main(argv) != 0
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) <= 2, err


def test_choose_writes_its_pick_and_it_simulates_the_same(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """``choose --emit megatron=FILE``: the recommended plan as a script; read back, it runs
    the pick's iteration."""
    import json

    from mpsim.cli import main

    script = tmp_path / "pick.sh"
    assert main(["choose", "--model", "llama-3-8b", "--servers", "dgx-a100-80gb,dgx-h100", "--json", "-",
                 "--emit", f"megatron={script}"]) == 0
    out = capsys.readouterr()
    pick = json.loads(out.out)["rows"][0]
    assert f"wrote {script}" in out.err
    assert main(["simulate", "--from", str(script), "--model", "llama-3-8b", "--server", pick["server"],
                 "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["iteration_s"] == pick["iteration_s"]


SEARCHED = {  # plans choose and fits make: layout, strategy, microbatch size
    "ddp8": ("ddp8", "none", 1), "zero1x8": ("zero1x8", "recompute-all", 1), "zero2x8": ("zero2x8", "none", 1),
    "fsdp8": ("fsdp8", "selective", 2), "tp8sp": ("tp8sp", "none", 1), "fsdp2xtp4sp": ("fsdp2xtp4sp", "none", 1),
    "zero1x2xtp2spxpp2": ("zero1x2xtp2spxpp2", "recompute-all", 1), "pp8": ("pp8", "none", 1),
    "fsdp4xcp2": ("fsdp4xcp2", "none", 1), "zero3x8 offload": ("fsdp8", "zero-infinity", 1),
}


@pytest.mark.parametrize("case", list(SEARCHED))
def test_every_format_that_states_a_searched_plan_gives_it_back(case: str) -> None:
    """Export then import gives the same job, in every format that can state the plan; a
    format that cannot refuses in one line; at least one format states each."""
    from mpsim.launch import FORMATS, formats

    layout, strategy, microbatch = SEARCHED[case]
    job = job_of("dgx-h100", "llama-3-8b", microbatch=microbatch, microbatches=8, strategy=strategy,
                 parallelism=api.parse_layout(layout))
    planned = plan_job(job)
    launch = from_planned(job, planned.plan, planned.result, "llama-3-8b", "dgx-h100")
    where = formats.Where("llama-3-8b", "dgx-h100", seq_len=launch.seq_len)
    stated = []
    for name in FORMATS:
        try:
            text = formats.emit(name, launch)
        except MpsimError as e:
            assert "\n" not in str(e)
            continue
        assert formats.parse(name, text, f"job.{name}", where) == launch.model_copy(update={"predicted": None})
        stated.append(name)
    assert stated, f"no format states {case}"
