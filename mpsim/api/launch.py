"""Plans as the frameworks' configurations and back (issue 52): ``plan --emit`` and
``simulate --from`` (``mpsim.launch``)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from mpsim.datafile import read_bounded
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


def parse_emits(values: tuple[str, ...], output: Path, plan_file: bool = False,
                check: bool = False) -> list[tuple[str, Path]]:
    """``--emit FORMAT[=FILE]`` values: each format and its file (default: beside the plan
    file, ``<stem>.<format><suffix>``). Refused in one line: an unknown format, ``FORMAT=``
    without a file, one file twice (or, with ``plan_file``, the plan file ``output``); with
    ``check`` a file that cannot be written (``check_target``; with ``plan_file`` the plan
    file too), so the command stops before it plans anything."""
    emits = []
    seen: dict[Path, str] = {output.resolve(): "the plan file"} if plan_file else {}
    for value in values:
        name, eq, file = value.partition("=")
        module = format_module(name)
        if eq and not file.strip():
            raise MpsimError(f"--emit {value}: give a file after '=' or leave '=' out ({name} beside the plan file)")
        path = Path(file) if eq else output.with_name(f"{output.stem}.{name}{module.SUFFIX}")
        if path.resolve() in seen:
            raise MpsimError(f"--emit {value}: {path} is already {seen[path.resolve()]}; give each its own file")
        seen[path.resolve()] = f"the {name} file"
        emits.append((name, path))
    if check:
        for path in [output] * plan_file + [path for _, path in emits]:
            check_target(path)
    return emits


def check_target(path: Path) -> None:
    """``path`` can be written as a file: its folder exists and it is not a folder, a FIFO
    (writing one would block until a reader came) or a device; one line naming it otherwise."""
    folder = path.parent
    if not folder.is_dir():
        raise MpsimError(f"{path}: cannot write it: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise MpsimError(f"{path}: cannot write it: the folder {folder} is not writable")
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise MpsimError(f"{path}: cannot write it ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        raise MpsimError(f"{path}: cannot write it: it is {'a folder' if stat.S_ISDIR(mode) else 'not a regular file'}")


def write_emits(launch: LaunchJob, emits: list[tuple[str, Path]]) -> list[Path]:
    """Each format's configuration of ``launch`` written to its file (all made before any is written,
    so a format that cannot state the job leaves no file behind; the files this call made are
    removed again when a later one cannot be written)."""
    texts = [(emit(name, launch), path) for name, path in emits]
    made: list[Path] = []
    try:
        for text, path in texts:
            check_target(path)
            new = not path.exists()
            path.write_text(text, encoding="utf-8")
            if new:
                made.append(path)
    except (OSError, MpsimError):
        for path in made:
            path.unlink(missing_ok=True)
        raise
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
        text = read_bounded(path, "launch configuration").decode("utf-8")
    except MpsimError as e:
        raise MpsimError(f"--from {e}") from None
    except UnicodeDecodeError as e:
        raise MpsimError(f"--from {path}: not UTF-8 text (byte {e.start}): expected a {name} configuration") from None
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
