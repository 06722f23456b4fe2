"""What a run does, through the same API as the CLI: ``mpsim.api.plan`` (whose result is
what ``mpsim simulate`` prints for the same inputs) and, for the choose view,
``mpsim.api.choose``; shown by the CLI's views (``mpsim.views``).

A run is a ``RunRequest`` (the inputs with their uploads read), computed in the worker
process by the function ``WORKS`` names for its view; what it returns goes back to the
server by pickle."""

from __future__ import annotations

import html
import json
import re
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mpsim import api
from mpsim.api import Planned, Topology, Trace
from mpsim.errors import MpsimError
from mpsim.views.html import choose_html, scale_html
from mpsim.views.text import plan_text, simulate_text
from mpsim.web.inputs import JobInputs, UploadStore
from mpsim.web.launches import Launches, LaunchFolder


@dataclass
class JobOutcome:
    planned: Planned
    warning: str | None
    headroom_gib: float
    launches: Launches | None = None
    """The plan as the frameworks' configurations (``mpsim.web.launches``)."""


@dataclass
class ChooseOutcome:
    """The choose view's answer: ``run_choose``'s report and page, and the pick as the
    frameworks' configurations."""

    data: dict[str, Any]
    launches: Launches


@dataclass(frozen=True)
class RunRequest:
    """One run as the worker gets it: the page's inputs and what their uploads hold."""

    inputs: JobInputs
    server: Topology | None = None
    """The uploaded server, if one is named."""
    model: Trace | Path | None = None
    """The uploaded trace, or the checked file of an uploaded Hugging Face config."""
    scratch: Path | None = None
    """A folder the server owns and removes when it stops, where a run may keep files
    (``run_scale``: its model as a trace file); a run removes its own when it ends."""
    server_name: str = "server.yaml"
    model_name: str = "model.json"
    """The uploads' file names (cleaned, ``inputs.safe_file_name``): what the frameworks'
    configurations call an uploaded server or model (``mpsim.web.launches``)."""


def request_of(inputs: JobInputs, uploads: UploadStore) -> RunRequest:
    request = RunRequest(inputs, scratch=uploads.root)
    if inputs.server_upload is not None:
        server = uploads.get(inputs.server_upload, ("server",))
        assert isinstance(server.value, Topology)
        request = replace(request, server=server.value, server_name=server.name)
    if inputs.model_upload is not None:
        model = uploads.get(inputs.model_upload, ("trace", "hf"))
        assert isinstance(model.value, Trace | Path)
        request = replace(request, model=model.value, model_name=model.name)
    return request


def server_of(request: RunRequest) -> Topology:
    if request.server is not None:
        return request.server
    return api.load_topology(request.inputs.server)  # a catalog name, checked by inputs.check_shipped


def model_of(request: RunRequest) -> Trace:
    """A shipped trace, an uploaded one, or an uploaded Hugging Face config traced as
    ``mpsim trace --hf`` does; fine-tuned as ``finetune`` and ``lora_rank`` ask, as
    ``--lora``/``--qlora`` and ``--lora-rank`` do: a trace retraced through the shipped
    config.json of its shape (``api.retraced``, as ``api.load_job``), an uploaded config
    traced with the adapters (``mpsim trace --hf CONFIG --lora``)."""
    model, spec = request.model, request.inputs.fine_tune
    if isinstance(model, Path):
        try:
            return api.trace_hf(str(model), microbatch=request.inputs.microbatch, fine_tune=spec)
        except MpsimError as exc:
            raise MpsimError(page_words(str(exc).replace(f"{model.parent}/", ""))) from None
    trace = api.load_trace(request.inputs.model) if model is None else model
    if spec is None:
        return trace
    try:
        return api.retraced(trace, fine_tune=spec)
    except MpsimError as exc:
        raise MpsimError(page_words(str(exc))) from None


_FLAGS = ((re.compile(r"^--(q?lora): "), r"finetune \1: "),
          (re.compile(r" and give that file as --model$"), " and upload that file as the model's trace JSON"))
"""A fine-tune's refusals name the command line's flags (``mpsim.models.retrace.at_finetune``);
the page names its own inputs."""


def page_words(message: str) -> str:
    """``message`` with the fine-tuning flags it starts with, and its last advice, in the page's words."""
    for pattern, words in _FLAGS:
        message = pattern.sub(words, message)
    return message


PAGE_MAX_WORK = 2_000_000
"""The most layer-microbatches times planner runs (``mpsim.plans.strategies.planner_runs``: 16
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


def run_job(request: RunRequest) -> JobOutcome:
    inputs = request.inputs
    topo, trace = server_of(request), model_of(request)
    check_work(trace, inputs)
    warning = api.measured_warning(trace, topo)
    layout = api.parse_layout(inputs.layout) if inputs.layout else None
    if layout is not None:  # as api.plan: a ZeRO stage the strategy cannot run refused in one line
        api.check_zero_stage(inputs.strategy, layout.zero_stage, layout.hsdp, given=layout.zero_stage != 0)
    job = api.job_of(topo, trace, schedule=inputs.schedule, microbatch=inputs.microbatch,
                     microbatches=inputs.microbatches, n_stages=inputs.stages, strategy=inputs.strategy,
                     partition=inputs.partition, parallelism=layout, runtime_profile=inputs.runtime)
    planned = api.plan_job(job)
    with LaunchFolder(request.scratch) as folder:
        launches = folder.launches("plan", lambda: api.launch_of(
            job, planned, _model_named(folder, request, trace),
            folder.server(topo, request.server_name) if request.server is not None else inputs.server))
    return JobOutcome(planned, warning, inputs.headroom, launches)


def _model_named(folder: LaunchFolder, request: RunRequest, trace: Trace) -> str:
    """The model as a launch job names it: its shipped name, or an upload's file in ``folder``."""
    if request.model is None:
        return request.inputs.model
    if isinstance(request.model, Path):  # a Hugging Face config, traced
        return folder.model(trace, request.model.name, hf=True)
    return folder.model(trace, request.model_name, hf=False)


def run_choose(request: RunRequest) -> dict[str, Any]:
    """The choose view: ``mpsim.api.choose`` over the chosen servers (every shipped one
    the schedule can fill when none is chosen), shown as ``mpsim choose --html`` shows it."""
    return _choose_data(_choose(request)[0])


def _choose(request: RunRequest) -> tuple[api.ChooseReport, Trace]:
    inputs = request.inputs
    uploaded = [request.server] if request.server is not None else []
    servers: list[str | Topology] = [*inputs.servers, *uploaded]
    trace = model_of(request)
    report = api.choose(trace, servers or "all", schedule=inputs.schedule,
                        microbatch_sizes=[inputs.microbatch] if inputs.microbatch is not None else None,
                        global_microbatches=inputs.global_microbatches, headroom_gib=inputs.headroom,
                        runtime_profile=inputs.runtime)
    return report, trace


def _choose_data(report: api.ChooseReport) -> dict[str, Any]:
    return {"report": report.to_dict(), "html": fine_tune_html(report) + choose_html(report)}


def run_choose_pick(request: RunRequest) -> ChooseOutcome:
    """The page's choose view: ``run_choose``, and its pick (the first ranked server where a
    plan fits, as ``mpsim choose --emit`` writes it: ``api.pick_launch``, which plans it once
    more) as the frameworks' configurations. A fine-tune is refused before that plan
    (``api.launch_of`` writes none yet); an uploaded server or model is named as the
    upload (``mpsim.web.launches``)."""
    report, trace = _choose(request)
    with LaunchFolder(request.scratch) as folder:
        launches = folder.launches("pick", lambda: _pick(folder, request, report, trace))
    return ChooseOutcome(_choose_data(report), launches)


FINE_TUNE_REFUSED = "fine-tunes (LoRA, QLoRA) are written for no framework yet"
"""``api.launch_of``'s refusal in the page's words, said before the pick is planned again."""


def _pick(folder: LaunchFolder, request: RunRequest, report: api.ChooseReport, trace: Trace) -> Any:
    """``api.pick_launch``, the model and an uploaded pick named as ``mpsim.web.launches`` says."""
    if trace.spec.finetune is not None:
        raise MpsimError(FINE_TUNE_REFUSED)
    launch = api.pick_launch(report, trace, _model_named(folder, request, trace))
    row = next(r for r in report.rows if r.fits)  # pick_launch's: it has refused where none fits
    if request.server is not None and row.source == request.server.source:  # the upload, named by its file
        launch = launch.model_copy(update={"server": folder.server(request.server, request.server_name)})
    return launch


def fine_tune_html(report: api.ChooseReport) -> str:
    """A fine-tune's adapters and PEFT's count line, as ``mpsim choose`` prints them under its
    table (``mpsim.views.text``), for the choose view; empty when every parameter trains."""
    first = report.rows[0].result if report.rows else None
    if first is None or not first.fine_tune:
        return ""
    lines = [f"fine-tune: {first.fine_tune}", *([first.trainable] if first.trainable else [])]
    return f"<p class=\"note fine-tune\">{'<br>'.join(html.escape(line) for line in lines)}</p>"


def scale_work(trace: Trace, inputs: JobInputs) -> tuple[int, int]:
    """The configurations the scale search would simulate and its work, at most
    (``mpsim.api.search_work``: layers x microbatches simulated x memory strategies, the
    job view's measure, ``check_work``), counted before anything runs."""
    if not trace.seq_len:
        return 0, 0  # the search refuses it in one line (no sequence length)
    sizes = (inputs.microbatch if inputs.microbatch is not None else 1,)
    return api.search_work(trace, list(inputs.clusters), microbatch_sizes=sizes, min_servers=inputs.min_servers,
                           max_servers=inputs.max_servers)


def check_scale_work(trace: Trace, inputs: JobInputs) -> None:
    """Refuse a scale search whose work (``scale_work``) is past ``PAGE_MAX_WORK``, the job
    view's bound, in one line, before anything is simulated."""
    configurations, work = scale_work(trace, inputs)
    if work > PAGE_MAX_WORK:
        raise MpsimError(f"this search would simulate up to {work:,} layer-microbatches ({configurations:,} "
                         f"configurations of {trace.n_layers:,} layers, each with every memory strategy it may "
                         f"need); the page takes at most {PAGE_MAX_WORK:,} (fewer clusters or server counts, "
                         "a larger microbatch, or the command line: mpsim choose --tokens)")


def run_scale(request: RunRequest) -> dict[str, Any]:
    """The "how many servers" view: ``mpsim.api.scale`` (``mpsim choose --tokens``) over
    the chosen clusters and server counts, shown as ``scale_html``.

    The search simulates each configuration from its model's name or file (as
    ``mpsim choose --tokens --model FILE`` does), so an uploaded model, a traced Hugging
    Face config above all (which has neither), is written as a trace file in the run's own
    scratch folder first, as ``mpsim trace --hf CONFIG -o FILE`` writes it."""
    inputs = request.inputs
    trace = model_of(request)
    check_scale_work(trace, inputs)
    sizes = (inputs.microbatch if inputs.microbatch is not None else 1,)
    if request.model is None:  # a shipped name
        return _scale(trace, inputs, sizes)
    folder = Path(tempfile.mkdtemp(prefix="run-", dir=request.scratch))
    try:
        path = folder / "model-trace.json"
        path.write_text(trace.to_json())
        return _scale(str(path), inputs, sizes)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _scale(model: str | Trace, inputs: JobInputs, sizes: tuple[int, ...]) -> dict[str, Any]:
    report = api.scale(model, list(inputs.clusters), inputs.tokens, inputs.days, inputs.budget,
                       microbatch_sizes=sizes, min_servers=inputs.min_servers, max_servers=inputs.max_servers)
    return {"report": report.to_dict(), "html": scale_html(report)}


WORKS = {"job": run_job, "choose": run_choose_pick, "scale": run_scale}
"""The worker's function for each view."""


VERDICT_CLASSES = ("fits", "at-risk", "oom")
"""How the page styles a job's verdict (``#verdict``'s class in static/app.css)."""


def verdict_class(fits: bool, at_risk: str) -> str:
    """``fits``, ``at-risk`` (it fits, but closer to the memory than the headroom) or ``oom``."""
    if not fits:
        return "oom"
    return "at-risk" if at_risk else "fits"


def job_payload(outcome: JobOutcome) -> dict:
    """What the page shows of a finished job: the verdict first, the CLI's text, the
    result and plan as their JSON files."""
    r, plan_file = outcome.planned.result, outcome.planned.plan
    text = simulate_text(r, outcome.headroom_gib)
    at_risk = r.at_risk(outcome.headroom_gib)
    return {"verdict": text.splitlines()[0], "oom": text.splitlines()[1].strip() if r.oom else None,
            "verdict_class": verdict_class(r.fits, at_risk),
            "fits": r.fits, "at_risk": at_risk, "warning": outcome.warning,
            "text": text, "plan_text": plan_text(plan_file),
            "result": r.to_dict(), "plan": json.loads(plan_file.to_json())}
