"""Pipeline schedules: per stage, the ordered list of tasks for one measured run.

A task is (kind, microbatch): ``F`` forward, ``B`` backward, ``U`` optimizer update.

- ``gpipe`` (GPipe): all m forwards, then all m backwards, then the update. Stage i holds
  the activations of all m microbatches before its first backward.
- ``1f1b`` (DAPPLE, PipeDream-Flush): stage i runs min(p - i - 1, m) warm-up forwards, then
  alternates one forward and one backward, then drains; at most p - i microbatches of
  activations are live on stage i. Synchronous: one update after the flush.
- ``pipedream`` (PipeDream, asynchronous 1F1B with weight stashing): no flush; stage i
  admits p - i microbatches, then alternates backward (followed by its weight update) and
  forward. Iterations of m microbatches are simulated back to back and one in the steady
  state is measured (``PIPEDREAM_ITERATIONS``, ``PIPEDREAM_MEASURED``). Stage i keeps p - i
  weight versions: the live weights and p - i - 1 stashed copies.
"""

from __future__ import annotations

from numbers import Integral
from typing import Literal, NamedTuple

from mpsim.errors import MpsimError

ScheduleName = Literal["gpipe", "1f1b", "pipedream"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "pipedream")
PIPEDREAM_ITERATIONS = 4
PIPEDREAM_MEASURED = 2
MAX_MICROBATCHES = 4096
"""The most microbatches per iteration a job may have: one iteration simulates every one
of them on every stage (PipeDream four iterations), so beyond this a run takes minutes and
gigabytes without telling more."""
MAX_MICROBATCH = 65536
"""The largest microbatch size (samples) a trace is rescaled to."""
"""The measured PipeDream iteration: the third of four, past the fill and before the drain."""


def check_microbatch(microbatch: int) -> None:
    """The one check of a microbatch size (samples per microbatch)."""
    if isinstance(microbatch, bool) or not isinstance(microbatch, Integral) or microbatch < 1:
        raise MpsimError(f"microbatch must be a positive integer, got {microbatch}")
    if microbatch > MAX_MICROBATCH:
        raise MpsimError(f"microbatch must be at most {MAX_MICROBATCH} samples, got {microbatch}")


class Task(NamedTuple):
    kind: Literal["F", "B", "U"]
    microbatch: int


def min_microbatches(name: str, n_stages: int) -> int:
    """The fewest microbatches per iteration ``name`` runs ``n_stages`` stages with: 1f1b and
    pipedream need one per stage to fill the pipeline, gpipe one in all."""
    return n_stages if name in ("1f1b", "pipedream") else 1


def check_schedule(name: str, n_stages: int, n_microbatches: int) -> None:
    if name not in SCHEDULES:
        raise MpsimError(f"unknown schedule {name!r}: expected one of {', '.join(SCHEDULES)}")
    if n_microbatches < 1:
        raise MpsimError(f"--microbatches must be at least 1, got {n_microbatches}")
    if n_microbatches > MAX_MICROBATCHES:
        raise MpsimError(f"--microbatches must be at most {MAX_MICROBATCHES} per iteration, got {n_microbatches}")
    if n_microbatches < min_microbatches(name, n_stages):
        raise MpsimError(
            f"{name} needs at least as many microbatches as stages to fill the pipeline: "
            f"got {n_microbatches} microbatches for {n_stages} stages"
        )


def stage_tasks(name: str, stage: int, n_stages: int, n_microbatches: int) -> list[Task]:
    """The task order of ``stage`` (0-based) in a pipeline of ``n_stages``."""
    check_schedule(name, n_stages, n_microbatches)
    m, p, i = n_microbatches, n_stages, stage
    if name == "gpipe":
        return [Task("F", k) for k in range(m)] + [Task("B", k) for k in range(m)] + [Task("U", m - 1)]
    if name == "1f1b":
        warmup = min(p - i - 1, m)
        tasks = [Task("F", k) for k in range(warmup)]
        for k in range(m - warmup):
            tasks += [Task("F", warmup + k), Task("B", k)]
        tasks += [Task("B", k) for k in range(m - warmup, m)]
        return tasks + [Task("U", m - 1)]
    total = m * PIPEDREAM_ITERATIONS
    in_flight = min(p - i, total)
    tasks = [Task("F", k) for k in range(in_flight)]
    for k in range(total):
        tasks += [Task("B", k), Task("U", k)]
        if in_flight + k < total:
            tasks.append(Task("F", in_flight + k))
    return tasks


def weight_versions(name: str, stage: int, n_stages: int) -> int:
    """Weight copies stage ``stage`` holds: p - i under PipeDream's weight stashing, else 1."""
    return n_stages - stage if name == "pipedream" else 1
