"""The page's defects of issue 45 ("The web page", item 5, and the scale view's bound of
item 3): an upload in flight disables Run and shows progress; a refused upload clears the
old result; an at-risk verdict looks at risk; the "How many servers" view has the job
view's work bound and refuses a microbatch of 0; it takes an uploaded Hugging Face config
as ``mpsim choose --tokens`` takes its trace; a config uploaded as a trace is pointed to
the page's Hugging Face upload.

HTTP-level tests need no browser; the ``browser`` ones drive the page's script in Debian's
Chromium through Playwright (``tests/conftest.py``). Every wait is bounded by a count, never
by a measured duration.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from test_serve import call, call_json, run_job, wait_finished

from mpsim import api
from mpsim.cli import main
from mpsim.web.app import MpsimServer
from mpsim.web.inputs import HF_UPLOAD_LABEL, JobInputs
from mpsim.web.work import PAGE_MAX_WORK, scale_work

ROOT = Path(__file__).resolve().parents[1]


def _page_file(name: str) -> str:
    return resources.files("mpsim.web").joinpath("static", name).read_text()


def _cancel(srv: MpsimServer, job_id: str) -> None:
    call(srv, "POST", f"/api/jobs/{job_id}/cancel")
    wait_finished(srv, job_id)


# --- D: the scale view's work bound and its microbatch ------------------------------------

def test_a_scale_search_past_the_pages_work_bound_is_refused_before_simulating(server):
    """Absurd tokens, days and server range on every shipped cluster ran on past 60 s; now
    refused in one line naming the bound, with nothing simulated."""
    query = {"view": "scale", "model": "llama-3-70b", "clusters": ",".join(api.shipped_clusters()),
             "tokens": "9e15", "days": "3650", "min_servers": 1, "max_servers": 4096}
    status, job = call_json(server, "POST", "/api/jobs?" + urlencode(query))
    assert status == 200, job
    try:
        for _ in range(1200):  # bounded: before the fix the search runs for many minutes
            _, job = call_json(server, "GET", f"/api/jobs/{job['id']}")
            if job["state"] in ("done", "failed", "cancelled") or job["tasks"] > 0:
                break
            time.sleep(0.05)
        assert job["state"] == "failed" and job["tasks"] == 0, (job["state"], job["tasks"])
    finally:
        _cancel(server, job["id"])
    error = job["error"]
    assert "\n" not in error
    assert error.startswith("this search would simulate up to ") and "layer-microbatches" in error
    assert f"the page takes at most {PAGE_MAX_WORK:,}" in error and "mpsim choose --tokens" in error


@pytest.mark.parametrize("model, low, high", [("llama-3-70b", 16, 256), ("gpt-5.3b", 16, 256), ("gpt2-xl", 1, 4096),
                                              ("bert-0.35b", 1, 4096), ("qwen2.5-7b", 4, 64)])
def test_the_scale_bound_counts_at_least_what_the_search_simulates(model, low, high):
    """``scale_work`` is the study's own count (``mpsim.studies.scale.search_work``): every
    configuration the search simulates, each at the microbatches it simulates, under every
    strategy it may try."""
    from mpsim.studies.scale import (
        STRATEGIES,
        ClusterPoint,
        job_of_point,
        server_counts,
        shapes,
        simulated_microbatches,
    )

    trace = api.load_trace(model)
    assert trace.seq_len is not None
    batch = max(1, api.DEFAULT_BATCH_TOKENS // trace.seq_len)
    cluster = api.load_cluster("dgx-h100-superpod")
    points = work = 0
    for n in (c for c in server_counts(cluster, low) if c <= high):
        for shape in shapes(cluster, trace, (1,)):
            job = job_of_point(ClusterPoint("dgx-h100-superpod", model, n, shape, batch), cluster, trace)
            if job is None:
                continue
            m1, m2 = simulated_microbatches(job.n_stages)
            points += 1
            work += trace.n_layers * (job.microbatches if job.microbatches <= m1 + m2 else m1 + m2)
    inputs = JobInputs(view="scale", model=model, clusters=("dgx-h100-superpod",), min_servers=low, max_servers=high)
    configurations, bound = scale_work(trace, inputs)
    assert (configurations, bound) == (points, work * len(STRATEGIES))


def test_the_pages_default_scale_searches_stay_within_the_bound():
    for model in ("gpt-5.3b", "llama-3-70b", "gpt-25.5b"):
        inputs = JobInputs(view="scale", model=model)
        assert scale_work(api.load_trace(model), inputs)[1] <= PAGE_MAX_WORK, model


@pytest.mark.parametrize("view, extra", [("scale", {"clusters": "dgx-h100-superpod", "min_servers": 1,
                                                    "max_servers": 2, "tokens": "1e10"}),
                                         ("choose", {"servers": "dgx1-v100"}), ("job", {"server": "dgx1-v100"})])
def test_a_microbatch_of_0_is_refused_in_one_line_in_every_view(server, view, extra):
    """The scale view answered it with results at microbatch 1, the choose view at the trace's own."""
    status, answer = call_json(server, "POST", "/api/jobs?" + urlencode(
        {"view": view, "model": "gpt2-xl", "microbatch": 0, **extra}))
    if status == 200:
        _cancel(server, answer["id"])
    assert status == 400, answer
    assert answer["error"] == "microbatch: expected at least 1 sample (leave it empty for the trace's own), got 0"


# --- E: an uploaded Hugging Face config in the scale view ---------------------------------

def test_the_scale_view_takes_an_uploaded_hugging_face_config_as_the_cli_takes_its_trace(server, tmp_path,
                                                                                           monkeypatch, capsys):
    """It ended "fits on none ... 0 configurations": each configuration was simulated from
    the model's name, and a traced config has none (its source is "<traced>"). The CLI's
    way: ``mpsim trace --hf`` to a file, then ``mpsim choose --model FILE --tokens``."""
    pytest.importorskip("transformers", reason="the hf extra")
    from mpsim.models.hf import shipped_configs

    config = shipped_configs()["gpt2-xl"]
    _, up = call_json(server, "POST", "/api/upload?kind=hf&name=config.json", config.read_bytes())
    job = run_job(server, view="scale", model_upload=up["upload"], clusters="dgx-h100-superpod", tokens="1e10",
                  min_servers=1, max_servers=2)
    assert job["state"] == "done", job["error"]
    report = job["choose"]["report"]
    assert report["clusters"][0]["simulated"] > 0 and report["clusters"][0]["rows"], report["recommendation"]

    monkeypatch.chdir(tmp_path)
    assert main(["trace", "--hf", str(config), "-o", "t.json"]) == 0
    assert main(["choose", "--model", "t.json", "--tokens", "1e10", "--clusters", "dgx-h100-superpod",
                 "--min-servers", "1", "--max-servers", "2", "--json", "cli.json"]) == 0
    capsys.readouterr()
    assert report == json.loads((tmp_path / "cli.json").read_text())
    assert not list(server.app.uploads.root.glob("run-*"))  # the run's trace file went with it


# --- F: a Hugging Face config uploaded as a trace -----------------------------------------

def test_a_hugging_face_config_uploaded_as_a_trace_is_pointed_to_the_hf_upload(server):
    """The trace reader's hint named ``mpsim trace --hf`` on the upload's temporary file."""
    body = json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4}).encode()
    before = set(server.app.uploads.root.iterdir())
    status, answer = call_json(server, "POST", "/api/upload?kind=trace&name=config.json", body)
    assert status == 400
    error = answer["error"]
    assert error == ("config.json: a Hugging Face config.json (it has model_type), not an mpsim trace: upload it "
                     f"under Model, \"{HF_UPLOAD_LABEL}\", which traces it as `mpsim trace --hf` does")
    assert str(server.app.uploads.root) not in error and "--model" not in error and "-o " not in error
    assert HF_UPLOAD_LABEL in _page_file("index.html")  # the field the hint names is on the page
    assert set(server.app.uploads.root.iterdir()) == before
    status, answer = call_json(server, "POST", "/api/upload?kind=trace&name=t.json", b'{"name": "x"}')
    assert status == 400 and "Hugging Face" not in answer["error"]  # a broken trace keeps the reader's message


# --- C: an at-risk verdict, over HTTP -------------------------------------------------------

def test_a_verdict_at_risk_is_classed_apart_from_one_that_fits(server):
    """MPress fills the V100s to within the default 1 GiB headroom: it fits, at risk; the
    page styled it with the green of a plain fit."""
    risky = run_job(server, server="dgx1-v100", model="gpt-10.3b", microbatch=2, strategy="mpress")
    assert risky["state"] == "done" and risky["fits"] and risky["at_risk"]
    assert risky["verdict_class"] == "at-risk" and "AT RISK" in risky["verdict"]
    safe = run_job(server, server="dgx1-v100", model="gpt-5.3b", microbatch=2, microbatches=8)
    assert safe["state"] == "done" and safe["verdict_class"] == "fits" and not safe["at_risk"]
    oom = run_job(server, server="dgx1-v100", model="gpt-10.3b", microbatch=2, microbatches=8)
    assert oom["state"] == "done" and oom["verdict_class"] == "oom"
    css = _page_file("app.css")
    assert "#verdict.at-risk" in css and "#verdict.fits" in css


# --- the page in a real browser: A, B, C ----------------------------------------------------

@pytest.fixture
def page(browser: Any, server: MpsimServer) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(120_000)
    pg.goto(server.url)
    pg.wait_for_selector("body[data-ready='1']")
    yield pg
    context.close()


def _fill_job(page: Any, model: str, microbatch: int, strategy: str, microbatches: int) -> None:
    page.select_option("#server", "dgx1-v100")
    page.select_option("#model", model)
    page.fill("#microbatch", str(microbatch))
    page.fill("#microbatches", str(microbatches))
    page.select_option("#strategy", strategy)


@pytest.mark.browser
def test_browser_an_upload_in_flight_disables_run_and_shows_progress(page):
    """Clicking Run during an upload simulated the model selected before it."""
    held: list[Any] = []
    page.route("**/api/upload?*", lambda route: held.append(route))  # the upload waits until the test lets it go
    trace = (ROOT / "traces" / "gpt-5.3b.json").read_bytes()
    page.select_option("#model", "gpt2-xl")
    page.set_input_files("#trace-file", files=[{"name": "mine.json", "mimeType": "application/json",
                                                "buffer": trace}])
    page.wait_for_function("/^upload(ing|ed) mine\\.json/.test(document.getElementById('progress').textContent)")
    assert page.is_disabled("#run")
    page.evaluate("document.getElementById('form').requestSubmit()")  # Enter in a field: no run either
    for _ in range(200):
        if held:
            break
        page.wait_for_timeout(50)
    assert len(held) == 1 and "run=1" not in page.url and page.is_hidden("#cancel")
    held[0].continue_()
    page.wait_for_function("document.getElementById('model').value === '__upload__'")
    page.wait_for_function("!document.getElementById('run').disabled")
    assert page.inner_text("#progress").startswith("uploaded mine.json")


@pytest.mark.browser
def test_browser_a_refused_upload_clears_the_old_result(page):
    _fill_job(page, "gpt-5.3b", 2, "none", 8)
    page.click("#run")
    page.wait_for_selector("#result:not([hidden])")
    page.set_input_files("#server-file", files=[{"name": "bad.yaml", "mimeType": "application/yaml",
                                                 "buffer": b"gpu: [1, 2\n"}])
    page.wait_for_selector("#error:not([hidden])")
    assert page.is_hidden("#result") and page.is_hidden("#choose-result")
    assert not page.is_disabled("#run")


@pytest.mark.browser
def test_browser_an_at_risk_verdict_does_not_look_like_a_fit(page):
    _fill_job(page, "gpt-10.3b", 2, "mpress", 16)
    page.click("#run")
    page.wait_for_selector("#result:not([hidden])")
    assert page.inner_text("#verdict").startswith("FITS on every GPU, AT RISK")
    assert page.get_attribute("#verdict", "class") == "at-risk"
    risky = page.eval_on_selector("#verdict", "e => getComputedStyle(e).color")
    fits = page.eval_on_selector("#verdict", """e => { const saved = e.className; e.className = 'fits';
        const color = getComputedStyle(e).color; e.className = saved; return color; }""")
    assert risky != fits
