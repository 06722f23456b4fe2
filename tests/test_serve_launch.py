"""``mpsim serve`` downloads the job view's plan and the choose view's pick as the frameworks'
own configurations (issue 52, item 1): ``GET /api/jobs/<id>/launch/<format>`` serves, as an
attachment, what ``mpsim plan --emit`` and ``mpsim choose --emit`` write for the same job
(``api.launch_of``, ``api.pick_launch``, ``mpsim.launch.formats.emit``), made once when the
run ended; the run's status names each format's file or the one line why the format cannot
state the job; bad requests are refused in one line. Through the HTTP API only (no browser)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from email.message import Message
from urllib.parse import urlencode

import pytest

from mpsim import api
from mpsim.data.catalog import data_dir
from mpsim.errors import MpsimError
from mpsim.launch import formats
from mpsim.web.app import HttpError, MpsimServer
from mpsim.web.inputs import JobInputs
from mpsim.web.jobs import PageRun

MAX_MESSAGE = 600
"""A short message, as tests/test_http_corpus.py bounds the page's errors."""
SERVER, MODEL, MICROBATCH, MICROBATCHES = "dgx1-v100", "gpt-5.3b", 2, 16
"""The job: a pipeline over the 8 GPUs, which Megatron-LM and DeepSpeed state, torchtitan (no
GPT-5.3B model) and Accelerate (no pipeline) cannot."""
CONTENT_TYPES = {"megatron": "text/x-shellscript", "deepspeed": "application/json",
                 "accelerate": "application/yaml", "torchtitan": "application/toml"}


def call(srv: MpsimServer, method: str, path: str, body: bytes | None = None) -> tuple[int, Message, bytes]:
    req = urllib.request.Request(srv.url.rstrip("/") + path, data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def call_json(srv: MpsimServer, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    status, _, raw = call(srv, method, path, body)
    return status, json.loads(raw)


def wait_finished(srv: MpsimServer, job_id: str) -> dict:
    for _ in range(2400):  # a bound so a broken run fails the test instead of hanging it
        status, job = call_json(srv, "GET", f"/api/jobs/{job_id}")
        assert status == 200
        if job["state"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"run {job_id} did not finish")


def run(srv: MpsimServer, **params: object) -> dict:
    status, job = call_json(srv, "POST", "/api/jobs?" + urlencode(params))
    assert status == 200, job
    done = wait_finished(srv, job["id"])
    assert done["state"] == "done", done["error"]
    return done


def download(srv: MpsimServer, job: dict, fmt: str) -> tuple[Message, str]:
    status, headers, body = call(srv, "GET", f"/api/jobs/{job['id']}/launch/{fmt}")
    assert status == 200, body
    return headers, body.decode()


def refused(srv: MpsimServer, path: str) -> str:
    """The page's one-line 400 for ``GET path``."""
    status, _, raw = call(srv, "GET", path)
    assert status == 400, raw
    message = json.loads(raw)["error"]
    assert "\n" not in message and len(message) <= MAX_MESSAGE and "Traceback" not in message
    return message


def emitted(fmt: str, launch: object) -> str:
    """``formats.emit``'s configuration, or its one-line refusal."""
    try:
        return formats.emit(fmt, launch)  # type: ignore[arg-type]
    except MpsimError as exc:
        return f"refused: {exc}"


@pytest.fixture(scope="module")
def job_run(server: MpsimServer) -> dict:
    return run(server, view="job", server=SERVER, model=MODEL, microbatch=MICROBATCH, microbatches=MICROBATCHES)


@pytest.fixture(scope="module")
def cli_launch() -> object:
    """What ``mpsim plan --emit`` writes for the job view's job (``plan_cmd``)."""
    job = api.job_of(api.load_topology(SERVER), api.load_trace(MODEL), microbatch=MICROBATCH,
                     microbatches=MICROBATCHES)
    return api.launch_of(job, api.plan_job(job), MODEL, SERVER)


def test_the_job_views_plan_downloads_as_plan_emit_writes_it(server, job_run, cli_launch):
    text = formats.emit("megatron", cli_launch)
    headers, body = download(server, job_run, "megatron")
    assert body == text
    assert headers["Content-Disposition"] == 'attachment; filename="mpsim-plan.megatron.sh"'
    assert headers["Content-Type"].startswith("text/x-shellscript")
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert "# predicted: fits, peak" in body and "iteration 4.161 s" in body
    where = formats.Where(model=MODEL, server=SERVER)
    assert formats.parse("megatron", body, "page.sh", where) == cli_launch.model_copy(update={"predicted": None})
    headers, body = download(server, job_run, "deepspeed")
    assert body == formats.emit("deepspeed", cli_launch)
    assert headers["Content-Type"] == "application/json"
    assert headers["Content-Disposition"] == 'attachment; filename="mpsim-plan.deepspeed.json"'


def test_the_status_names_each_formats_file_or_why_it_cannot_state_the_job(server, job_run, cli_launch):
    launch = job_run["launch"]
    assert launch["of"] == "plan" and launch["reason"] is None
    assert [f["format"] for f in launch["formats"]] == list(api.FORMATS)
    for entry in launch["formats"]:
        fmt = entry["format"]
        expected = emitted(fmt, cli_launch)
        if expected.startswith("refused: "):
            assert entry["reason"] == expected.removeprefix("refused: ")
            assert refused(server, f"/api/jobs/{job_run['id']}/launch/{fmt}") == f"{fmt}: {entry['reason']}"
        else:
            assert entry["reason"] is None and entry["file"].startswith(f"mpsim-plan.{fmt}.")
            headers, body = download(server, job_run, fmt)
            assert body == expected and headers["Content-Type"].startswith(CONTENT_TYPES[fmt])
    reasons = {f["format"]: f["reason"] for f in launch["formats"]}
    assert reasons["torchtitan"].startswith("torchtitan: gpt-5.3b is no torchtitan model")
    assert reasons["accelerate"] == "pipeline 8: Accelerate's configuration has no pipeline parallelism"


def test_a_download_is_made_once_not_again_per_click(server, job_run, monkeypatch):
    """The files were made in the worker when the run ended: with the worker gone and the
    formats unable to run in the server, a download still answers, the same bytes each time."""
    first = download(server, job_run, "megatron")[1]
    server.app.jobs.worker.stop()

    def no_emit(*args: object) -> None:
        raise AssertionError("a download made the configuration again")

    monkeypatch.setattr(api, "write_emits", no_emit)
    monkeypatch.setattr(formats, "emit", no_emit)
    assert download(server, job_run, "megatron")[1] == first


@pytest.fixture(scope="module")
def cli_pick() -> object:
    """What ``mpsim choose --emit`` writes for the choose view's comparison (``choose_cmd``)."""
    trace = api.load_trace(MODEL)
    report = api.choose(trace, [SERVER], microbatch_sizes=[MICROBATCH], global_microbatches=MICROBATCHES)
    return api.pick_launch(report, trace, MODEL)


def test_the_choose_views_pick_downloads_as_choose_emit_writes_it(server, cli_pick):
    job = run(server, view="choose", servers=SERVER, model=MODEL, microbatch=MICROBATCH,
              global_microbatches=MICROBATCHES)
    pick = cli_pick
    launch = job["launch"]
    assert launch["of"] == "pick" and launch["reason"] is None
    stated = [f["format"] for f in launch["formats"] if f["reason"] is None]
    assert "megatron" in stated
    for fmt in api.FORMATS:
        expected = emitted(fmt, pick)
        if fmt in stated:
            headers, body = download(server, job, fmt)
            assert body == expected
            assert headers["Content-Disposition"].startswith(f'attachment; filename="mpsim-pick.{fmt}.')
        else:
            assert expected == f"refused: {next(f['reason'] for f in launch['formats'] if f['format'] == fmt)}"
    assert "choose" in job and "launch" not in job["choose"]  # the result JSON is the report alone
    status, _, raw = call(server, "GET", f"/api/jobs/{job['id']}/result.json")
    assert status == 200 and "launch" not in json.loads(raw)


def test_a_fine_tune_has_one_reason_for_every_format(server):
    job = run(server, view="job", server="rtx4090-x1", model="tinyllama-1.1b", finetune="lora", microbatches=4)
    launch = job["launch"]
    assert launch["reason"] == "fine-tunes (LoRA, QLoRA) are written for no framework yet"
    assert {f["reason"] for f in launch["formats"]} == {launch["reason"]}
    assert refused(server, f"/api/jobs/{job['id']}/launch/megatron") == f"megatron: {launch['reason']}"


def test_uploads_are_named_as_the_user_called_them_and_no_server_folder_leaks(server, cli_launch):
    """An uploaded trace and server are named in the files by their upload names, the rest
    as for the shipped ones; nothing names the server's scratch folder."""
    _, trace = call_json(server, "POST", "/api/upload?kind=trace&name=my-gpt.json",
                         (data_dir("traces") / f"{MODEL}.json").read_bytes())
    _, topo = call_json(server, "POST", "/api/upload?kind=server&name=my-box.yaml",
                        (data_dir("topologies") / f"{SERVER}.yaml").read_bytes())
    job = run(server, view="job", server_upload=topo["upload"], model_upload=trace["upload"], microbatch=MICROBATCH,
              microbatches=MICROBATCHES)
    _, body = download(server, job, "megatron")
    shipped = formats.emit("megatron", cli_launch)
    assert body == shipped.replace(MODEL, "my-gpt.json").replace(SERVER, "my-box.yaml")
    root = str(server.app.uploads.root)
    for entry in job["launch"]["formats"]:
        assert root not in (entry["reason"] or "")
        if entry["reason"] is None:
            assert root not in download(server, job, entry["format"])[1]
    torchtitan = next(f for f in job["launch"]["formats"] if f["format"] == "torchtitan")
    assert torchtitan["reason"].startswith("torchtitan: my-gpt.json is no torchtitan model")


def test_an_uploaded_server_picked_in_the_choose_view_is_named_by_its_file(server, cli_pick):
    _, topo = call_json(server, "POST", "/api/upload?kind=server&name=my-box.yaml",
                        (data_dir("topologies") / f"{SERVER}.yaml").read_bytes())
    job = run(server, view="choose", servers="", server_upload=topo["upload"], model=MODEL, microbatch=MICROBATCH,
              global_microbatches=MICROBATCHES)
    _, body = download(server, job, "megatron")
    assert body == formats.emit("megatron", cli_pick).replace(SERVER, "my-box.yaml")
    assert str(server.app.uploads.root) not in json.dumps(job["launch"])


def test_bad_requests_are_refused_in_one_line(server, job_run):
    base = f"/api/jobs/{job_run['id']}/launch"
    assert refused(server, f"{base}/pytorch").startswith("format 'pytorch': expected one of megatron, torchtitan, "
                                                         "deepspeed, accelerate")
    assert refused(server, f"{base}/").startswith("format '': expected one of")
    long = refused(server, f"{base}/{'x' * 5000}")
    assert len(long) < 200
    assert refused(server, f"{base}/%2e%2e").startswith("format '%2e%2e'")
    status, _, raw = call(server, "GET", f"{base}/../../../etc/passwd")
    assert status == 404 and "\n" not in json.loads(raw)["error"]
    status, _, raw = call(server, "GET", f"/api/jobs/{'0' * 32}/launch/megatron")
    assert status == 404 and json.loads(raw)["error"] == "no such run (the server keeps the last 32)"
    status, _, raw = call(server, "POST", f"{base}/megatron")
    assert status == 405


def test_a_run_without_a_plan_has_no_configuration(server):
    failed = wait_finished(server, call_json(server, "POST", "/api/jobs?" + urlencode(
        {"view": "job", "server": SERVER, "model": MODEL, "layout": "tp16"}))[1]["id"])
    assert failed["state"] == "failed" and "launch" not in failed
    assert refused(server, f"/api/jobs/{failed['id']}/launch/megatron") == \
        "this run has no megatron configuration to download: it failed"
    scale = PageRun("f" * 32, JobInputs(view="scale"), state="done", outcome={"report": {}, "html": ""})
    with pytest.raises(HttpError, match="the scale view's result is no plan"):
        server.app.launch(scale, "megatron")
