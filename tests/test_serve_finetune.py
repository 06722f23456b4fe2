"""``mpsim serve`` fine-tunes (issue 50, item 4): the page's ``finetune`` (none, lora, qlora)
and ``lora_rank`` run the job and choose views on the model retraced with PEFT's adapters,
as ``mpsim simulate --lora`` / ``--qlora`` / ``--lora-rank`` and ``mpsim choose --lora`` do
(``api.load_job(..., fine_tune=)``, ``api.retraced``); bad values, a rank without a
fine-tune, a fine-tune in the how-many-servers view and a model with no shipped config of
its shape are refused in one line. Through the HTTP API only (no browser)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from urllib.parse import parse_qs, urlencode

import pytest

from mpsim import api
from mpsim.web.app import MpsimServer
from mpsim.web.inputs import JobInputs, from_query

MAX_MESSAGE = 600
"""A short message, as tests/test_http_corpus.py bounds the page's errors."""
SERVER, MODEL, MICROBATCHES = "rtx4090-x1", "tinyllama-1.1b", 4
"""A small fine-tune: TinyLlama on one 24 GB card, a few microbatches."""


def call_json(srv: MpsimServer, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(srv.url.rstrip("/") + path, data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_finished(srv: MpsimServer, job_id: str) -> dict:
    for _ in range(2400):  # a bound so a broken run fails the test instead of hanging it
        status, job = call_json(srv, "GET", f"/api/jobs/{job_id}")
        assert status == 200
        if job["state"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"run {job_id} did not finish")


def run_job(srv: MpsimServer, **params: object) -> dict:
    status, job = call_json(srv, "POST", "/api/jobs?" + urlencode(params))
    assert status == 200, job
    return wait_finished(srv, job["id"])


def refused(srv: MpsimServer, **params: object) -> str:
    """The page's one-line 400 for ``params``."""
    status, answer = call_json(srv, "POST", "/api/jobs?" + urlencode(params))
    assert status == 400, answer
    message = answer["error"]
    assert "\n" not in message and len(message) <= MAX_MESSAGE and "Traceback" not in message
    return message


def peak_bytes(result: dict) -> int:
    return max(g["peak_bytes"] for g in result["gpus"])


@pytest.fixture
def hf_extra() -> None:
    pytest.importorskip("peft", reason="fine-tuning traces with PEFT: the hf extra")


# --- the job view -----------------------------------------------------------------------

@pytest.mark.parametrize(("finetune", "rank", "words"), [("lora", None, "LoRA r 16 on all-linear"),
                                                         ("qlora", None, "QLoRA r 16 on all-linear"),
                                                         ("qlora", 8, "QLoRA r 8 on all-linear")])
def test_a_fine_tune_job_equals_load_job_with_the_fine_tune(server, hf_extra, finetune, rank, words):
    """The page's job is ``api.load_job(..., fine_tune=)`` and ``api.plan`` with the same
    inputs: the same iteration time and peak; its text and result carry the fine-tune line."""
    params = {"server": SERVER, "model": MODEL, "microbatch": 1, "microbatches": MICROBATCHES, "finetune": finetune}
    if rank is not None:
        params["lora_rank"] = rank
    job = run_job(server, **params)
    assert job["state"] == "done", job["error"]
    spec = api.fine_tune_of(finetune == "lora", finetune == "qlora", None, rank)
    topo, trace, _ = api.load_job(SERVER, MODEL, fine_tune=spec)
    direct = api.plan(topo, trace, "1f1b", 1, MICROBATCHES).result
    result = job["result"]
    assert result["iteration_s"] == direct.iteration_s
    assert peak_bytes(result) == max(g.peak_bytes for g in direct.gpus)
    assert result["model"] == trace.name and result["fine_tune"] == direct.fine_tune
    assert result["fine_tune"].startswith(words) and result["trainable"].startswith("trainable params: ")
    assert f"fine-tune: {direct.fine_tune}" in job["text"].splitlines()  # simulate_text's line
    assert direct.trainable in job["text"]
    query = parse_qs(job["bookmark"])
    assert query["finetune"] == [finetune] and query.get("lora_rank") == ([str(rank)] if rank else None)


def test_a_job_without_a_fine_tune_trains_every_parameter(server):
    job = run_job(server, server=SERVER, model="gpt2-xl", microbatch=1, microbatches=2)
    assert job["state"] == "done", job["error"]
    assert job["result"]["fine_tune"] is None and "fine-tune:" not in job["text"]
    assert "finetune" not in parse_qs(job["bookmark"])


def test_an_uploaded_hugging_face_config_is_traced_with_the_adapters(server, hf_extra):
    """``finetune`` on an uploaded config.json traces it as ``mpsim trace --hf CONFIG --lora`` does."""
    from mpsim.models.hf import shipped_configs

    path = shipped_configs()[MODEL]
    _, up = call_json(server, "POST", "/api/upload?kind=hf&name=config.json", path.read_bytes())
    job = run_job(server, server=SERVER, model_upload=up["upload"], microbatch=1, microbatches=MICROBATCHES,
                  finetune="lora", lora_rank=4)
    assert job["state"] == "done", job["error"]
    trace = api.trace_hf(str(path), microbatch=1, fine_tune=api.fine_tune_of(True, False, None, 4))
    direct = api.plan(SERVER, trace, "1f1b", 1, MICROBATCHES).result
    assert job["result"]["iteration_s"] == direct.iteration_s
    assert peak_bytes(job["result"]) == max(g.peak_bytes for g in direct.gpus)
    assert job["result"]["fine_tune"].startswith("LoRA r 4 ")


# --- the choose view --------------------------------------------------------------------

def test_choose_compares_servers_for_a_fine_tune_as_choose_lora_does(server, hf_extra):
    servers = ["rtx4090-x1", "h100-x1"]
    job = run_job(server, view="choose", model=MODEL, servers=",".join(servers), microbatch=1,
                  global_microbatches=MICROBATCHES, finetune="qlora")
    assert job["state"] == "done", job["error"]
    trace = api.retraced(api.load_trace(MODEL), fine_tune=api.fine_tune_of(False, True, None, None))
    direct = api.choose(trace, servers, microbatch_sizes=[1], global_microbatches=MICROBATCHES)
    rows = job["choose"]["report"]["rows"]
    assert [r["server"] for r in rows] == [r.server for r in direct.rows]
    assert [r["iteration_s"] for r in rows] == [r.result.iteration_s for r in direct.rows]
    assert [r["max_peak_bytes"] for r in rows] == [r.max_peak_bytes for r in direct.rows]
    html = job["choose"]["html"]
    assert f"fine-tune: {direct.rows[0].result.fine_tune}" in html and "trainable params: " in html
    assert parse_qs(job["bookmark"])["finetune"] == ["qlora"]


# --- refusals ---------------------------------------------------------------------------

@pytest.mark.parametrize(("params", "message"), [
    ({"finetune": "dora"}, "finetune: expected one of none, lora, qlora, got 'dora'"),
    ({"finetune": "x" * 5000}, "finetune: expected one of none, lora, qlora, got 'xxxx"),
    ({"finetune": "lora", "lora_rank": "sixteen"}, "lora_rank: expected a whole number, got 'sixteen'"),
    ({"finetune": "lora", "lora_rank": 0}, "lora_rank: expected 1 to 65536, got 0"),
    ({"finetune": "qlora", "lora_rank": 65537}, "lora_rank: expected 1 to 65536, got 65537"),
    ({"lora_rank": 8}, "lora_rank: the adapters' rank, with finetune lora or qlora"),
    ({"finetune": "none", "lora_rank": 8}, "lora_rank: the adapters' rank, with finetune lora or qlora"),
    ({"view": "scale", "finetune": "lora"}, "finetune: the how-many-servers view plans pre-training runs"),
    ({"view": "scale", "finetune": "qlora", "lora_rank": 8}, "finetune: the how-many-servers view plans"),
])
def test_bad_fine_tune_inputs_are_refused_in_one_line(server, params, message):
    assert refused(server, model=MODEL, **params).startswith(message)


def test_a_fine_tune_given_twice_is_refused_in_one_line(server):
    status, answer = call_json(server, "POST", "/api/jobs?finetune=lora&finetune=qlora")
    assert status == 400 and answer["error"] == "finetune: given 2 times; give it once"


def test_a_model_with_no_shipped_config_fails_its_run_in_one_line(server, hf_extra):
    """gpt-5.3b has no Hugging Face config.json of its shape: the run fails as ``simulate
    --lora`` is refused, in the page's words."""
    job = run_job(server, server=SERVER, model="gpt-5.3b", microbatch=1, microbatches=2, finetune="lora")
    assert job["state"] == "failed" and job["tasks"] == 0
    error = job["error"]
    assert "\n" not in error and len(error) <= MAX_MESSAGE
    assert error.startswith("finetune lora: no shipped Hugging Face config.json has gpt-5.3b's shape")
    assert error.endswith("and upload that file as the model's trace JSON")
    choose = run_job(server, view="choose", servers=SERVER, model="gpt-5.3b", microbatch=1, finetune="qlora")
    assert choose["state"] == "failed" and choose["error"].startswith("finetune qlora: no shipped")


# --- the bookmark, catalog and page -----------------------------------------------------

@pytest.mark.parametrize("inputs", [
    JobInputs(model=MODEL, server=SERVER, finetune="lora"),
    JobInputs(model=MODEL, server=SERVER, finetune="qlora", lora_rank=8),
    JobInputs(view="choose", model=MODEL, servers=(SERVER,), finetune="lora", lora_rank=64),
])
def test_the_fine_tune_round_trips_through_the_bookmark(inputs):
    assert from_query(parse_qs(inputs.query())) == inputs
    assert "finetune=" not in JobInputs().query() and "lora_rank" not in JobInputs().query()


def test_the_fine_tune_is_what_the_cli_flags_ask_for():
    assert JobInputs().fine_tune is None
    assert JobInputs(finetune="lora").fine_tune == api.fine_tune_of(True, False, None, None)
    assert JobInputs(finetune="qlora", lora_rank=8).fine_tune == api.fine_tune_of(False, True, None, 8)


def test_the_catalog_and_page_offer_the_fine_tunes(server):
    status, catalog = call_json(server, "GET", "/api/catalog")
    assert status == 200 and catalog["finetunes"] == ["none", "lora", "qlora"]
    with urllib.request.urlopen(server.url, timeout=60) as resp:
        page = resp.read()
    assert b'id="finetune"' in page and b'id="lora_rank"' in page
    with urllib.request.urlopen(server.url + "static/app.js", timeout=60) as resp:
        script = resp.read()
    assert b'q.set("finetune"' in script and b'q.set("lora_rank"' in script
