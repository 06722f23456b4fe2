"""``mpsim validate --from FILE``: a framework's configuration (``mpsim plan --emit`` writes
them, ``mpsim.launch``) run by the executor as the plan it states, made from the model
measured here. The round trip holds on CPU: the Megatron-LM script emitted beside a plan
runs that plan (two ranks, gpt-tiny, one step; the same predicted peaks and iteration as
``validate --plan``). The other formats and layouts are checked with the executor's run
stubbed out (``hardware_check.measure``: the plan it would run is compared, after the
executor's own refusals), and what the executor cannot run is refused in one line.
torchtitan is not among them: it writes only its own model families, no GPT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mpsim import api
from mpsim.cli import main
from mpsim.models.probe import probe
from mpsim.models.profiler import measure_trace
from mpsim.models.workloads import ZOO
from mpsim.studies import hardware_check
from mpsim.studies.hardware_check import simulate_plan

RUN = ["--steps", "1", "--warmup", "0"]
MIXTRAL = str(Path(__file__).resolve().parent / "data" / "tiny-mixtral.json")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[str, str]:
    """gpt-tiny measured here as a trace file (what `mpsim trace --measure` writes) and a
    two-device CPU topology file: the same prediction every time they are read."""
    folder = tmp_path_factory.mktemp("validate-from")
    cfg, mb, recipe = ZOO["gpt-tiny"]
    trace = folder / "gpt-tiny.json"
    trace.write_text(measure_trace(cfg, mb, recipe, "cpu", threads=1, warmup=1, repeats=5, name="gpt-tiny").to_json())
    server = folder / "cpu2.yaml"
    server.write_text(yaml.safe_dump(probe("cpu", devices=2, threads=1, memory_mib=2048)[0]))
    return str(trace), str(server)


def _emit(files: tuple[str, str], tmp_path: Path, fmt: str, *layout: str) -> tuple[Path, Path]:
    """``mpsim plan ... --emit fmt`` on the measured trace: the plan file and the configuration."""
    trace, server = files
    conf = tmp_path / {"megatron": "job.sh", "deepspeed": "job.json", "accelerate": "job.yaml"}[fmt]
    plan = tmp_path / "plan.json"
    code = main(["plan", "--model", trace, "--server", server, "--microbatches", "2", *layout,
                 "--emit", f"{fmt}={conf}", "-o", str(plan), "--json", str(tmp_path / "planned.json")])
    assert code == 0 and conf.is_file()
    return plan, conf


@pytest.fixture
def runs(monkeypatch) -> list:
    """The executor's run stubbed out: each (plan, topology, trace) it would run, after
    ``check_runnable`` passed them."""
    seen: list = []

    def stub(plan, topo, trace, model, settings, workdir=None):
        seen.append((plan, topo, trace))
        return {"stub": True}, []

    monkeypatch.setattr(hardware_check, "measure", stub)
    return seen


@pytest.mark.torchrun
def test_an_emitted_megatron_script_runs_the_plan_it_came_from(files, tmp_path, capsys):
    trace, server = files
    plan, script = _emit(files, tmp_path, "megatron", "--stages", "2")
    assert "--pipeline-model-parallel-size 2" in script.read_text()
    reports, texts = [], []
    for given in (["--from", str(script)], ["--plan", str(plan)]):
        out_json = tmp_path / "report.json"
        capsys.readouterr()
        code = main(["validate", *given, "--model", trace, "--server", server, *RUN, "--json", str(out_json)])
        out, err = capsys.readouterr()
        assert code == 0, err
        reports.append(json.loads(out_json.read_text()))
        texts.append(out)
    came, planned = reports
    assert came["configuration"] == {"file": str(script), "format": "megatron"} and "configuration" not in planned
    assert f"ran the megatron configuration {script}" in texts[0] and "configuration" not in texts[1]
    for key in ("schedule", "strategy", "microbatch", "microbatches", "replicas", "zero_stage", "tensor"):
        assert came[key] == planned[key], key
    assert came["predicted_iteration_s"] == planned["predicted_iteration_s"]
    assert [r["predicted_peak_bytes"] for r in came["stages"]] == [r["predicted_peak_bytes"] for r in planned["stages"]]
    assert [r["layers"] for r in came["stages"]] == [r["layers"] for r in planned["stages"]]
    assert came["oom"] is None and all(r["measured_peak_bytes"] > 0 for r in came["stages"])


@pytest.mark.parametrize("fmt, layout", [
    ("megatron", ["--stages", "2", "--strategy", "recompute-all"]),
    ("megatron", ["--stages", "1", "--dp", "2", "--zero", "1"]),
    ("megatron", ["--stages", "1", "--dp", "2", "--strategy", "selective"]),
    ("deepspeed", ["--stages", "1", "--dp", "2", "--zero", "2"]),
    ("deepspeed", ["--stages", "2"]),
    ("accelerate", ["--stages", "1", "--dp", "2", "--zero", "3"]),
    ("accelerate", ["--stages", "1", "--dp", "2"]),
])
def test_each_format_runs_the_plan_validate_plan_runs(files, tmp_path, runs, fmt, layout):
    trace, server = files
    plan, conf = _emit(files, tmp_path, fmt, *layout)
    report = api.validate(trace, None, server, steps=1, warmup=0, from_path=conf)
    assert report == {"stub": True, "configuration": {"file": str(conf), "format": fmt}}
    api.validate(trace, plan, server, steps=1, warmup=0)
    (came, topo, came_trace), (planned, _, planned_trace) = runs
    assert came.model_dump() == planned.model_dump()
    a, b = simulate_plan(came, topo, came_trace), simulate_plan(planned, topo, planned_trace)
    assert a.iteration_s == b.iteration_s and [g.peak_bytes for g in a.gpus] == [g.peak_bytes for g in b.gpus]


def test_a_preset_measured_here_runs_the_script_written_for_its_trace(files, tmp_path, runs):
    # the reader checks the script's shape against gpt-tiny's (a derived trace of the preset)
    trace, server = files
    plan, script = _emit(files, tmp_path, "megatron", "--stages", "2")
    api.validate("gpt-tiny", None, server, steps=1, warmup=0, from_path=script)
    api.validate(trace, plan, server, steps=1, warmup=0)
    (came, _, came_trace), (planned, _, _) = runs
    assert came.model_dump() == planned.model_dump() and came_trace.spec.source.kind == "measured"


def test_megatron_block_recompute_recomputes_the_first_layers_of_each_stage(files, tmp_path, runs):
    trace, server = files
    _, script = _emit(files, tmp_path, "megatron", "--stages", "2")
    text = script.read_text().replace("--pipeline-model-parallel-size 2 \\",
                                      "--pipeline-model-parallel-size 2 --recompute-granularity full "
                                      "--recompute-method block --recompute-num-layers 2 \\")
    script.write_text(text)
    api.validate(trace, None, server, steps=1, warmup=0, from_path=script)
    ((plan, _, came_trace),) = runs
    assert plan.strategy == "recompute-first-2"
    kinds = [r.kind for r in came_trace.layers]
    for stage in plan.stages:
        blocks = [i for i in range(*stage.layers) if kinds[i] == "transformer"]
        assert [a.layer for a in stage.actions if a.action == "recompute"] == blocks[:2]


def test_a_configuration_that_leaves_the_length_to_the_script_runs_at_the_models(files, tmp_path, runs):
    trace, server = files
    _, conf = _emit(files, tmp_path, "deepspeed", "--stages", "1", "--dp", "2")
    config = json.loads(conf.read_text())
    del config["mpsim"]  # no header: DeepSpeed's own keys only
    conf.write_text(json.dumps(config))
    api.validate(trace, None, server, steps=1, warmup=0, from_path=conf)
    ((plan, _, came_trace),) = runs
    assert came_trace.seq_len == 128 and plan.replicas == 2 and plan.microbatch == 4


@pytest.mark.parametrize("fmt, stages", [("megatron", 2), ("accelerate", 1)])
def test_this_machine_is_probed_for_the_processes_the_configuration_starts(files, tmp_path, runs, fmt, stages):
    # without --server: probed for the reader (one device per core here), then again for the
    # configuration's processes where they differ, as validate --plan probes for its plan's
    _, conf = _emit(files, tmp_path, fmt, "--stages", str(stages))
    report = api.validate("gpt-tiny", None, None, steps=1, warmup=0, memory_mib=1024, from_path=conf)
    ((plan, topo, _),) = runs
    assert report["configuration"]["format"] == fmt
    assert topo.n_gpus == stages and topo.spec.gpu.memory_mib == 1024 and len(plan.stages) == stages


def _refused(capsys, argv: list[str]) -> str:
    capsys.readouterr()  # what `mpsim plan` printed
    code = main(["validate", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("edits, says", [
    ([("--seq-length 128", "--seq-length 256")],
     "trains at sequence length 256 but {trace} is measured at 128"),
    ([("--seq-length 128", "--seq-length 128 --bf16")],
     "trains in mixed-bf16-fp32grad but {trace} is measured in fp32"),
    ([("--seq-length 128", "--seq-length 64 --fp16 --grad-reduce-in-bf16")],
     "trains at sequence length 64 in mixed-fp16 but {trace} is measured at 128 in fp32"),
    ([("--seq-length 128", "--seq-length 128 --num-layers-per-virtual-pipeline-stage 2")],
     "virtual_stages 2: the executor runs one stage per GPU"),
    ([("--nproc-per-node 2", "--nproc-per-node 64"), ("--global-batch-size 8", "--global-batch-size 256")],
     "the run needs 64 processes x 1 thread(s)"),
    ([("--num-layers 8", "--num-layers 12")], "--num-layers 12 but the model has 8"),
])
def test_what_the_executor_cannot_run_is_refused_in_one_line(files, tmp_path, capsys, runs, edits, says):
    trace, server = files
    _, script = _emit(files, tmp_path, "megatron", "--stages", "2")
    text = script.read_text()
    for old, new in edits:
        assert old in text
        text = text.replace(old, new)
    script.write_text(text)
    line = _refused(capsys, ["--from", str(script), "--model", trace, "--server", server, *RUN])
    assert says.format(trace=trace) in line and runs == []


@pytest.mark.parametrize("argv, says", [
    (["--plan", "p.json"], "--from and --plan each give the whole job: give one of them"),
    (["--stages", "2"], "--stages and --from: the configuration states the job; leave --stages out"),
    (["--dp", "2"], "--dp and --from"),
    (["--strategy", "recompute-all"], "--strategy and --from"),
    (["--lora"], "--lora and --from"),
    (["--model", MIXTRAL], "is a mixture of experts' config.json"),
    (["--from-format", "accelerate"], "job.sh: expected a mapping"),
])
def test_options_the_configuration_states_are_refused_in_one_line(files, tmp_path, capsys, runs, argv, says):
    trace, server = files
    _, script = _emit(files, tmp_path, "megatron", "--stages", "2")
    model = [] if "--model" in argv else ["--model", trace]
    line = _refused(capsys, ["--from", str(script), *model, "--server", server, *RUN, *argv])
    assert says in line and runs == []


def test_a_suffix_that_names_no_format_is_refused_in_one_line(files, tmp_path, capsys):
    trace, server = files
    conf = tmp_path / "job.cfg"
    conf.write_text("")
    assert "cannot tell its format from the suffix '.cfg'" in _refused(
        capsys, ["--from", str(conf), "--model", trace, "--server", server])
