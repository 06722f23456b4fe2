"""Plans as the frameworks' configurations and back (issue 52): ``plan --emit`` and
``simulate --from`` (``mpsim.launch``)."""

from __future__ import annotations

from pathlib import Path

from mpsim.errors import MpsimError
from mpsim.launch import FORMATS
from mpsim.launch.formats import Where, emit, format_module, parse
from mpsim.launch.job import LaunchJob, from_planned, simulate
from mpsim.models.trace import Trace
from mpsim.planners import Planned
from mpsim.plans.job import JobSpec
from mpsim.plans.plan import PlanFile
from mpsim.sim import SimResult
from mpsim.studies.choose import ChooseReport

SUFFIXES = {".sh": "megatron", ".txt": "megatron", ".toml": "torchtitan", ".json": "deepspeed", ".yaml": "accelerate",
            ".yml": "accelerate"}
"""The format a configuration's file suffix says (``simulate --from``)."""


def launch_of(job: JobSpec, planned: Planned, model: str, server: str) -> LaunchJob:
    """The launch job of ``planned`` (``mpsim.launch.job.from_planned``); a fine-tune is
    written for no framework yet."""
    if job.trace.spec.finetune is not None:
        raise MpsimError("--emit: fine-tunes (LoRA, QLoRA) are written for no framework yet")
    return from_planned(job, planned.plan, planned.result, model, server)


def parse_emits(values: tuple[str, ...], output: Path) -> list[tuple[str, Path]]:
    """``--emit FORMAT[=FILE]`` values: each format and its file (default: beside the plan
    file, ``<stem>.<format><suffix>``); one line naming the formats for an unknown one."""
    emits = []
    for value in values:
        name, _, file = value.partition("=")
        module = format_module(name)
        emits.append((name, Path(file) if file else output.with_name(f"{output.stem}.{name}{module.SUFFIX}")))
    return emits


def write_emits(launch: LaunchJob, emits: list[tuple[str, Path]]) -> list[Path]:
    """Each format's configuration of ``launch`` written to its file (all made before any is written,
    so a format that cannot state the job leaves no file behind)."""
    texts = [(emit(name, launch), path) for name, path in emits]
    for text, path in texts:
        path.write_text(text, encoding="utf-8")
    return [path for _, path in texts]


def format_of(path: Path, given: str | None) -> str:
    """The format of a configuration file: ``given``, else its suffix's (``SUFFIXES``)."""
    if given is not None:
        format_module(given)
        return given
    found = SUFFIXES.get(path.suffix.lower())
    if found is None:
        raise MpsimError(f"--from {path}: cannot tell its format from the suffix {path.suffix!r}; give --from-format "
                         f"({', '.join(FORMATS)})")
    return found


def simulate_from(path: Path, fmt: str | None, where: Where) -> tuple[LaunchJob, JobSpec, PlanFile, SimResult]:
    """A framework's configuration read (``mpsim.launch.<format>.parse``) and simulated."""
    name = format_of(path, fmt)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MpsimError(f"--from {path}: cannot read it ({type(e).__name__}: {e})") from None
    launch = parse(name, text, str(path), where)
    job, plan, result = simulate(launch)
    return launch, job, plan, result


def pick_launch(report: ChooseReport, trace: Trace, model: str) -> LaunchJob:
    """``choose --emit``: the launch job of the recommended plan (the first ranked server
    where a plan fits), planned again from its layout, strategy, microbatch and partition;
    refused in one line where nothing fits or the plan does not come out the same."""
    from mpsim.planners import plan_job
    from mpsim.planners.best import part_of
    from mpsim.plans.job import job_of
    from mpsim.plans.mesh import parse_layout

    row = next((r for r in report.rows if r.fits), None)
    if row is None:
        raise MpsimError("--emit: the model fits on none of the servers, so there is no plan to write")
    r = row.result
    strategy, partition = part_of(r.strategy) or (r.strategy, next(
        (t.partition for t in row.tried if t.fits and t.layout == r.layout and t.strategy == r.strategy
         and t.microbatch == r.microbatch and t.samples_per_s == r.samples_per_s), "compute"))
    job = job_of(row.source, trace.rescale(r.microbatch), schedule=r.schedule, microbatches=r.microbatches,
                 strategy=strategy, partition=partition, parallelism=parse_layout(r.mesh),
                 runtime_profile=report.runtime_profile)
    planned = plan_job(job)
    if planned.result.iteration_s != r.iteration_s:
        raise MpsimError(f"--emit: {r.strategy} on {row.server} ({r.layout}) planned again runs "
                         f"{planned.result.iteration_s:.4g} s, not the pick's {r.iteration_s:.4g} s; write it with "
                         "mpsim plan --emit")
    return launch_of(job, planned, model, row.server)
