"""What a run does, through the same API as the CLI: ``mpsim.api.plan`` (whose result is
what ``mpsim simulate`` prints for the same inputs) and, for the choose view,
``mpsim.api.choose``; shown by the CLI's views (``mpsim.views``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpsim import api
from mpsim.api import Planned, Topology, Trace
from mpsim.errors import MpsimError
from mpsim.views.html import choose_html, scale_html
from mpsim.views.text import plan_text, simulate_text
from mpsim.web.inputs import JobInputs, UploadStore
from mpsim.web.jobs import Cancelled, Job


@dataclass
class JobOutcome:
    planned: Planned
    warning: str | None
    headroom_gib: float


def server_of(inputs: JobInputs, uploads: UploadStore) -> Topology:
    if inputs.server_upload is not None:
        value = uploads.get(inputs.server_upload, ("server",)).value
        assert isinstance(value, Topology)
        return value
    return api.load_topology(inputs.server)  # a catalog name, checked by inputs.check_shipped


def model_of(inputs: JobInputs, uploads: UploadStore) -> Trace:
    """A shipped trace, an uploaded one, or an uploaded Hugging Face config traced as
    ``mpsim trace --hf`` does."""
    if inputs.model_upload is None:
        return api.load_trace(inputs.model)
    upload = uploads.get(inputs.model_upload, ("trace", "hf"))
    if isinstance(upload.value, Trace):
        return upload.value
    assert isinstance(upload.value, Path)
    try:
        return api.trace_hf(str(upload.value), microbatch=inputs.microbatch)
    except MpsimError as exc:
        raise MpsimError(str(exc).replace(f"{upload.path.parent}/", "")) from None


PAGE_MAX_WORK = 2_000_000
"""The most layer-microbatches times planner runs (``mpsim.strategies.planner_runs``: 16
for ``best``) a run from the page may ask for: GPT-25.5B (145 layers) under best at 256
microbatches is 593,920; a 10,000-layer upload at 256 is refused before planning (the
command line has no such bound)."""


def check_work(trace: Trace, inputs: JobInputs) -> None:
    """Refuse a run whose simulated work (layers x microbatches x planner runs) is past
    ``PAGE_MAX_WORK``, in one line, before anything is planned."""
    plans = api.planner_runs(inputs.strategy)
    work = trace.n_layers * inputs.microbatches * plans
    if work > PAGE_MAX_WORK:
        raise MpsimError(f"this run would simulate {trace.n_layers:,} layers x {inputs.microbatches} microbatches x "
                         f"{plans} plan(s) = {work:,}; the page takes at most {PAGE_MAX_WORK:,} (fewer microbatches, "
                         "one strategy, or the command line)")


def run_job(inputs: JobInputs, uploads: UploadStore, job: Job) -> JobOutcome:
    topo, trace = server_of(inputs, uploads), model_of(inputs, uploads)
    check_work(trace, inputs)
    warning = api.measured_warning(trace, topo)
    layout = api.parse_layout(inputs.layout) if inputs.layout else None
    planned = api.plan(topo, trace, inputs.schedule, inputs.microbatch, inputs.microbatches, n_stages=inputs.stages,
                       strategy=inputs.strategy, partition=inputs.partition, parallelism=layout)
    return JobOutcome(planned, warning, inputs.headroom)


def run_choose(inputs: JobInputs, uploads: UploadStore, job: Job) -> dict[str, Any]:
    """The choose view: ``mpsim.api.choose`` over the chosen servers (every shipped one
    the schedule can fill when none is chosen), shown as ``mpsim choose --html`` shows it."""
    uploaded = [server_of(inputs, uploads)] if inputs.server_upload is not None else []
    servers: list[str | Topology] = [*inputs.servers, *uploaded]
    report = api.choose(model_of(inputs, uploads), servers or "all", schedule=inputs.schedule,
                        microbatch_sizes=[inputs.microbatch] if inputs.microbatch else None,
                        microbatches=inputs.microbatches, headroom_gib=inputs.headroom)
    return {"report": report.to_dict(), "html": choose_html(report)}


def run_scale(inputs: JobInputs, uploads: UploadStore, job: Job) -> dict[str, Any]:
    """The "how many servers" view: ``mpsim.api.scale`` (``mpsim choose --tokens``) over
    the chosen clusters and server counts, shown as ``scale_html``."""
    report = api.scale(model_of(inputs, uploads), list(inputs.clusters), inputs.tokens, inputs.days, inputs.budget,
                       microbatch_sizes=(inputs.microbatch or 1,), min_servers=inputs.min_servers,
                       max_servers=inputs.max_servers)
    if job.cancel.is_set():  # each configuration left stopped at its first task: none of them counts
        raise Cancelled
    return {"report": report.to_dict(), "html": scale_html(report)}


def job_payload(outcome: JobOutcome) -> dict:
    """What the page shows of a finished job: the verdict first, the CLI's text, the
    result and plan as their JSON files."""
    r, plan_file = outcome.planned.result, outcome.planned.plan
    text = simulate_text(r, outcome.headroom_gib)
    return {"verdict": text.splitlines()[0], "oom": text.splitlines()[1].strip() if r.oom else None,
            "fits": r.fits, "at_risk": r.at_risk(outcome.headroom_gib), "warning": outcome.warning,
            "text": text, "plan_text": plan_text(plan_file),
            "result": r.to_dict(), "plan": json.loads(plan_file.to_json())}
