"""``mpsim serve``: the HTTP API (fast, no browser) and the page driven in a real headless
Chromium (marker ``browser``; Debian's /usr/bin/chromium through Playwright).

Set ``MPSIM_SCREENSHOTS=DIR`` to save the browser tests' screenshots as DIR/serve_*.png.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import parse_qs, urlencode

import pytest

from mpsim import api
from mpsim.cli import main
from mpsim.data.catalog import load_trace
from mpsim.web.app import MpsimServer
from mpsim.web.inputs import MAX_UPLOAD_BYTES, JobInputs, from_query

SCREENSHOTS = Path(os.environ["MPSIM_SCREENSHOTS"]).resolve() if os.environ.get("MPSIM_SCREENSHOTS") else None
TOPOLOGY_WITH_SCHEMA_ERROR = "name: my-box\ngpu: {count: 2}\n"


def call(srv: MpsimServer, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(srv.url.rstrip("/") + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def call_json(srv: MpsimServer, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    status, raw = call(srv, method, path, body)
    return status, json.loads(raw)


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


def cli_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
              args: list[str]) -> str:
    """The one line the CLI prints for ``args``, run in ``tmp_path``, without its prefix."""
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("mpsim: error: ") and "\n" not in line
    return line.removeprefix("mpsim: error: ")


# --- the HTTP API ------------------------------------------------------------------------

def test_catalog_names_the_shipped_servers_models_and_strategies(server):
    status, catalog = call_json(server, "GET", "/api/catalog")
    assert status == 200
    assert "dgx1-v100" in catalog["servers"] and "gpt-5.3b" in catalog["models"]
    assert {"none", "mpress", "best"} <= set(catalog["strategies"])


def test_page_and_script_come_from_the_package(server):
    status, page = call(server, "GET", "/")
    assert status == 200 and b'src="/static/app.js"' in page and b"http" not in page.split(b"<body>")[1]
    status, script = call(server, "GET", "/static/app.js")
    assert status == 200 and b"/api/jobs" in script


def test_json_downloads_equal_the_cli_json(server, tmp_path, capsys):
    job = run_job(server, server="dgx1-v100", model="gpt-10.3b", microbatch=2, strategy="cpu-swap")
    assert job["state"] == "done" and job["verdict"].startswith("FITS")
    _, result = call_json(server, "GET", f"/api/jobs/{job['id']}/result.json")
    _, plan = call_json(server, "GET", f"/api/jobs/{job['id']}/plan.json")
    args = ["--server", "dgx1-v100", "--model", "gpt-10.3b", "--microbatch", "2", "--strategy", "cpu-swap"]
    assert main(["simulate", *args, "--json", str(tmp_path / "sim.json")]) == 0
    assert main(["plan", *args, "-o", str(tmp_path / "plan.json")]) == 0
    capsys.readouterr()
    assert result == json.loads((tmp_path / "sim.json").read_text())
    assert plan == json.loads((tmp_path / "plan.json").read_text())


def test_a_run_that_does_not_fit_names_where_it_ran_out(server):
    job = run_job(server, server="dgx1-v100", model="gpt-10.3b", microbatch=2, strategy="none")
    assert job["state"] == "done" and not job["fits"]
    assert job["verdict"].startswith("DOES NOT FIT") and job["oom"].startswith("GPU ")
    for chart in ("bars", "memory", "timeline"):
        status, svg = call(server, "GET", f"/api/jobs/{job['id']}/chart/{chart}.svg")
        assert status == 200 and svg.lstrip().startswith(b"<?xml") and b"<svg" in svg
        status, png = call(server, "GET", f"/api/jobs/{job['id']}/chart/{chart}.png")
        assert status == 200 and png.startswith(b"\x89PNG")


@pytest.mark.parametrize(("kind", "name", "text", "cli"), [
    ("server", "bad.yaml", "gpu: [1, 2\n", ["topo", "check", "bad.yaml"]),
    ("server", "bad.yaml", TOPOLOGY_WITH_SCHEMA_ERROR, ["topo", "check", "bad.yaml"]),
    ("server", "bad.yaml", "a: 1\na: 2\n", ["topo", "check", "bad.yaml"]),
    ("trace", "bad.json", '{"name": "x",', ["simulate", "--model", "bad.json"]),
    ("trace", "bad.json", '{"name": "x"}', ["simulate", "--model", "bad.json"]),
    ("trace", "bad.json", "[1, 2]", ["simulate", "--model", "bad.json"]),
])
def test_bad_uploads_get_the_cli_message(server, tmp_path, monkeypatch, capsys, kind, name, text, cli):
    (tmp_path / name).write_text(text)
    expected = cli_error(tmp_path, monkeypatch, capsys, cli)
    status, answer = call_json(server, "POST", f"/api/upload?kind={kind}&name={name}", text.encode())
    assert status == 400
    assert answer == {"error": expected}


def test_wrong_file_types_and_huge_files_are_refused_in_one_line(server):
    status, answer = call_json(server, "POST", "/api/upload?kind=server&name=notes.txt", b"hello")
    assert status == 400 and answer["error"] == "notes.txt: expected a topology file in YAML (.yaml or .yml)"
    status, answer = call_json(server, "POST", "/api/upload?kind=trace&name=big.json", b" " * (MAX_UPLOAD_BYTES + 1))
    assert status == 413 and answer["error"] == "big.json: 4.0 MiB is over the upload limit of 4 MiB"
    status, answer = call_json(server, "POST", "/api/upload?kind=model&name=x.json", b"{}")
    assert status == 400 and answer["error"].startswith("upload kind: expected one of server, trace, hf")
    assert call_json(server, "GET", "/api/catalog")[0] == 200  # still serving


def test_choose_compares_an_uploaded_server_beside_the_shipped_ones(server):
    yaml_text = (Path(__file__).resolve().parents[1] / "topologies" / "h100-x1.yaml").read_text()
    mine = yaml_text.replace("name: h100-x1", "name: my-h100", 1).encode()
    assert mine != yaml_text.encode()
    _, topo = call_json(server, "POST", "/api/upload?kind=server&name=mine.yaml", mine)
    job = run_job(server, view="choose", servers="dgx1-v100", server_upload=topo["upload"], model="gpt-5.3b",
                  microbatch=2)
    assert job["state"] == "done", job["error"]
    assert sorted(r["server"] for r in job["choose"]["report"]["rows"]) == ["dgx1-v100", "my-h100"]


def test_a_run_past_the_pages_work_bound_is_refused_before_planning(server):
    big = load_trace("gpt-5.3b").with_layers(800)  # 802 layers x 256 microbatches x best's 20 plans (offload too)
    compact = json.dumps(json.loads(big.to_json()), separators=(",", ":")).encode()  # under the 4 MiB upload limit
    _, up = call_json(server, "POST", "/api/upload?kind=trace&name=big.json", compact)
    job = run_job(server, server="dgx1-v100", model_upload=up["upload"], microbatch=2, microbatches=256,
                  strategy="best")
    assert job["state"] == "failed" and job["tasks"] == 0
    assert job["error"] == ("this run would simulate 802 layers x 256 microbatches x 20 plan(s) = 4,106,240; the page "
                            "takes at most 2,000,000 (fewer microbatches, one strategy, or the command line)")


def test_a_job_takes_its_parallel_layout_by_name_from_the_page(server):
    job = run_job(server, server="dgx-a100-80gb", model="llama-3-8b", microbatch=1, microbatches=2, layout="fsdp8")
    assert job["state"] == "done", job["error"]
    direct = api.plan("dgx-a100-80gb", "llama-3-8b", "1f1b", 1, 2, parallelism=api.parse_layout("fsdp8")).result
    assert job["result"]["layout"] == "FSDP x8" and job["result"]["iteration_s"] == direct.iteration_s
    assert "layout=fsdp8" in job["bookmark"]
    status, answer = call_json(server, "POST", "/api/jobs?" + urlencode({"server": "dgx1-v100", "layout": "fsdp"}))
    assert status == 400 and answer["error"].startswith("unknown layout 'fsdp': expected")


@pytest.mark.parametrize("layout, words, gpus", [("ddp2xpp2", "DDP x2 x pipeline x2", 2), ("pp4", "pipeline x4", 4)])
def test_the_page_runs_the_pipeline_depth_its_layout_names(server, layout, words, gpus):
    """``ddp2xpp2`` on the DGX A100 ran as DDP x2 x pipeline x4 and ``pp4`` as pipeline x8."""
    job = run_job(server, server="dgx-a100-80gb", model="gpt-5.3b", microbatch=1, microbatches=4, layout=layout)
    assert job["state"] == "done", job["error"]
    result = job["result"]
    assert result["layout"] == words and len(result["gpu_of_stage"]) == gpus
    assert (result["gpus_used"], result["gpus_available"]) == (4, 8)
    assert job["verdict"].endswith("runs on 4 of 8 GPUs"), job["verdict"]
    refused = run_job(server, server="dgx-a100-80gb", model="gpt-5.3b", microbatch=1, microbatches=4,
                      layout=layout, stages=8)
    assert refused["state"] == "failed" and "but 8 were asked for" in refused["error"]


def test_a_job_takes_its_stage_count_from_the_page(server):
    job = run_job(server, server="dgx1-v100", model="gpt-5.3b", microbatch=2, stages=4)
    assert job["state"] == "done", job["error"]
    assert len(job["result"]["gpu_of_stage"]) == 4 and "stages=4" in job["bookmark"]
    refused = run_job(server, server="dgx1-v100", model="gpt-5.3b", microbatch=2, microbatches=2)
    assert refused["state"] == "failed" and "stages" in refused["error"]


def test_an_uploaded_server_and_trace_run_and_cannot_be_bookmarked(server):
    from mpsim.data.catalog import data_dir

    yaml_text = (data_dir("topologies") / "dgx1-v100.yaml").read_bytes()
    trace_text = (data_dir("traces") / "gpt-5.3b.json").read_bytes()
    _, topo = call_json(server, "POST", "/api/upload?kind=server&name=mine.yaml", yaml_text)
    _, trace = call_json(server, "POST", "/api/upload?kind=trace&name=mine.json", trace_text)
    job = run_job(server, server_upload=topo["upload"], model_upload=trace["upload"], microbatch=2)
    shipped = run_job(server, server="dgx1-v100", model="gpt-5.3b", microbatch=2)
    assert job["state"] == "done" and not job["bookmarkable"]
    assert "upload" not in job["bookmark"] and "server=" not in job["bookmark"]
    assert job["result"]["iteration_s"] == shipped["result"]["iteration_s"]


def test_an_uploaded_hugging_face_config_is_traced_as_trace_hf_does(server):
    pytest.importorskip("transformers", reason="the hf extra")
    from mpsim.models.hf import shipped_configs, trace_hf

    path = shipped_configs()["gpt2-xl"]
    _, up = call_json(server, "POST", "/api/upload?kind=hf&name=config.json", path.read_bytes())
    job = run_job(server, server="dgx1-v100", model_upload=up["upload"], microbatch=2)
    assert job["state"] == "done", job["error"]
    assert job["result"]["model"] == trace_hf(str(path), microbatch=2).name
    status, answer = call_json(server, "POST", "/api/upload?kind=hf&name=config.json", b'{"model_type": "bogus"}')
    assert status == 400 and answer["error"].startswith("config.json: model_type 'bogus' is not supported")


def test_a_200_byte_config_asking_for_20000_layers_is_refused_in_one_line_and_leaves_no_file(server):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_hidden_layers": 20000, "vocab_size": 1000}
    body = json.dumps(config).encode()
    assert len(body) < 200
    before = set(server.app.uploads.root.iterdir())
    rss_before_mib = _rss_mib()
    status, answer = call_json(server, "POST", "/api/upload?kind=hf&name=config.json", body)
    assert status == 400 and answer["error"] == "config.json: num_hidden_layers: expected 1 to 9,998, got 20000"
    assert set(server.app.uploads.root.iterdir()) == before  # the rejected upload's folder is gone
    assert _rss_mib() - rss_before_mib < 32  # read and refused, never traced (it once took 9.98 GB)


def _rss_mib() -> float:
    """This process's resident memory (the server runs in a thread of it)."""
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


@pytest.mark.parametrize("query", ["server=../../etc/passwd", "model=/etc/passwd", "model=../traces/gpt-5.3b.json",
                                   "server_upload=../../x", "model_upload=0123", "servers=dgx1-v100,/etc"])
def test_paths_in_inputs_are_refused(server, query):
    status, answer = call_json(server, "POST", "/api/jobs?view=job&" + query)
    assert status == 400 and "\n" not in answer["error"]


@pytest.mark.parametrize("path", ["/static/../pyproject.toml", "/static/%2e%2e/app.py", "/api/jobs/../../etc/passwd",
                                  "/static/index.html/..", "//etc/passwd"])
def test_no_file_outside_the_page_is_served(server, path):
    status, _ = call(server, "GET", path)
    assert status == 404


def test_an_upload_name_cannot_leave_the_upload_folder(server, tmp_path):
    text = (Path(__file__).parent.parent / "topologies" / "h100-x1.yaml").read_bytes()
    status, answer = call_json(server, "POST", "/api/upload?kind=server&name=../../../evil.yaml", text)
    assert status == 200 and answer["name"] == "evil.yaml"
    stored = server.app.uploads.get(answer["upload"], ("server",)).path
    assert stored.parent.parent == server.app.uploads.root


def test_requests_for_another_host_are_refused(server):
    status, raw = call(server, "GET", "/api/catalog", headers={"Host": "evil.example:80"})
    assert status == 403 and b"127.0.0.1 only" in raw


@pytest.mark.parametrize("inputs", [
    JobInputs(),
    JobInputs(server="dgx-h100", model="llama-3-8b", schedule="gpipe", microbatch=4, microbatches=32,
              strategy="mpress", partition="memory"),
    JobInputs(view="choose", model="gpt-10.3b", servers=("dgx1-v100", "dgx-h100"), microbatch=2),
    JobInputs(view="scale", model="llama-3-70b", clusters=("aws-p5", "dgx-h100-superpod"), tokens=2e12, days=30.0,
              budget=7.5e6, min_servers=64, max_servers=128),
])
def test_the_bookmark_query_round_trips(server, inputs):
    assert from_query(parse_qs(inputs.query())) == inputs
    status, job = call_json(server, "POST", "/api/jobs?" + inputs.query())
    assert status == 200 and job["bookmarkable"]
    assert from_query(parse_qs(job["bookmark"])) == inputs
    call(server, "POST", f"/api/jobs/{job['id']}/cancel")
    wait_finished(server, job["id"])


def test_bad_parameters_are_one_line_errors(server):
    for query, message in [("microbatch=two", "microbatch: expected a whole number, got 'two'"),
                           ("view=scale&tokens=lots", "tokens: expected a positive number"),
                           ("view=scale&clusters=../etc/passwd", "unknown cluster '../etc/passwd'"),
                           ("view=scale&min_servers=64&max_servers=8", "servers: expected 1 <= min_servers"),
                           ("colour=red", "unknown parameter 'colour'"), ("view=all", "view: expected one of"),
                           ("strategy=magic", None)]:
        status, answer = call_json(server, "POST", "/api/jobs?" + query)
        if message is None:  # checked by the API, in the run, as the CLI does
            job = wait_finished(server, answer["id"])
            assert job["state"] == "failed" and job["error"].startswith("unknown strategy 'magic'")
        else:
            assert status == 400 and answer["error"].startswith(message)


def test_cancel_stops_a_long_run(server):
    status, job = call_json(server, "POST", "/api/jobs?" + urlencode(
        {"model": "gpt-25.5b", "microbatch": 2, "microbatches": 64, "strategy": "best"}))
    for _ in range(2400):
        if call_json(server, "GET", f"/api/jobs/{job['id']}")[1]["tasks"] > 0:
            break
        time.sleep(0.05)
    pid = server.app.jobs.worker.pid
    status, _ = call_json(server, "POST", f"/api/jobs/{job['id']}/cancel")
    finished = wait_finished(server, job["id"])
    assert finished["state"] == "cancelled" and pid is not None and _gone(pid)  # its memory with it
    assert call_json(server, "GET", f"/api/jobs/{job['id']}")[1]["tasks"] == finished["tasks"]
    status, answer = call_json(server, "GET", f"/api/jobs/{job['id']}/result.json")
    assert status == 404 and "cancelled" in answer["error"]


def _wait_running(srv: MpsimServer, job_id: str) -> dict:
    for _ in range(2400):
        job = call_json(srv, "GET", f"/api/jobs/{job_id}")[1]
        if job["state"] != "waiting":
            return job
        time.sleep(0.01)
    raise AssertionError(f"run {job_id} never started")


def _worker_pid(srv: MpsimServer) -> int:
    for _ in range(2400):
        if (pid := srv.app.jobs.worker.pid) is not None:
            return pid
        time.sleep(0.01)
    raise AssertionError("no worker started")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_cancel_during_planning_ends_the_worker_and_the_next_run_gets_a_fresh_one(server):
    """Cancel while an uploaded config is still being traced (no task simulated yet): the
    run is cancelled, its worker process is gone with all of its memory, and the next run
    starts a new worker and finishes."""
    pytest.importorskip("transformers", reason="the hf extra")
    from mpsim.models.hf import shipped_configs

    server.app.jobs.worker.stop()  # a cold worker: tracing waits for torch's import
    _, up = call_json(server, "POST", "/api/upload?kind=hf&name=config.json",
                      shipped_configs()["gpt2-xl"].read_bytes())
    status, job = call_json(server, "POST", "/api/jobs?" + urlencode(
        {"server": "dgx1-v100", "model_upload": up["upload"], "microbatch": 2}))
    assert _wait_running(server, job["id"])["state"] == "running"
    pid = _worker_pid(server)
    call_json(server, "POST", f"/api/jobs/{job['id']}/cancel")
    finished = wait_finished(server, job["id"])
    assert (finished["state"], finished["tasks"]) == ("cancelled", 0)
    assert _gone(pid) and server.app.jobs.worker.pid is None
    after = run_job(server, model="gpt-5.3b", microbatch=2, microbatches=8)
    assert after["state"] == "done" and server.app.jobs.worker.pid not in (None, pid)


def test_a_worker_killed_mid_run_fails_its_run_in_one_line_and_the_server_goes_on(server):
    status, job = call_json(server, "POST", "/api/jobs?" + urlencode(
        {"model": "gpt-25.5b", "microbatch": 2, "microbatches": 64, "strategy": "best"}))
    _wait_running(server, job["id"])
    os.kill(_worker_pid(server), 9)
    finished = wait_finished(server, job["id"])
    assert finished["state"] == "failed" and "\n" not in finished["error"]
    assert finished["error"].startswith("the run's worker process ended without an answer (exit code -9)")
    assert run_job(server, model="gpt-5.3b", microbatch=2, microbatches=8)["state"] == "done"


def test_choose_view_ranks_the_servers_as_mpsim_choose_does(server):
    """The page's choose view is ``mpsim.studies.choose.choose``: the same ranking as the command."""
    from mpsim.studies.choose import choose

    job = run_job(server, view="choose", model="gpt-5.3b", servers="dgx1-v100,dgx-a100-80gb", microbatch=2)
    assert job["state"] == "done", job
    status, answer = call_json(server, "GET", f"/api/jobs/{job['id']}/result.json")
    direct = choose("gpt-5.3b", ["dgx1-v100", "dgx-a100-80gb"], microbatch_sizes=[2]).to_dict()
    assert status == 200
    assert [r["server"] for r in answer["report"]["rows"]] == [r["server"] for r in direct["rows"]]
    assert "<svg" in answer["html"] and "dgx-a100-80gb" in answer["html"]


def test_scale_view_answers_how_many_servers_as_choose_tokens_does(server):
    """The page's "how many servers" view is ``mpsim.studies.scale.scale``: the same rows and pick."""
    from mpsim.studies.scale import scale

    job = run_job(server, view="scale", model="gpt2-xl", clusters="dgx-h100-superpod", tokens="1e10",
                  min_servers=1, max_servers=2)
    assert job["state"] == "done", job
    status, answer = call_json(server, "GET", f"/api/jobs/{job['id']}/result.json")
    direct = scale("gpt2-xl", ["dgx-h100-superpod"], 1e10, min_servers=1, max_servers=2).to_dict()
    assert status == 200 and answer["report"] == direct
    assert "<svg" in answer["html"] and answer["report"]["recommendation"] in answer["html"]


def test_mpsim_serve_prints_its_address_and_answers(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "from mpsim.cli import run; run()", "serve", "--port", "0"],
                            stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("mpsim serve: http://127.0.0.1:")
        url = line.split()[2]
        with urllib.request.urlopen(url + "api/catalog", timeout=30) as resp:
            assert "dgx1-v100" in json.loads(resp.read())["servers"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_sigterm_stops_mpsim_serve_and_removes_its_uploads(tmp_path):
    """As Ctrl-C does: the upload folder (under TMPDIR) is gone, the exit code is 143."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", "from mpsim.cli import run; run()", "serve", "--port", "0"],
                            stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().split()[2]
        trace = (Path(__file__).resolve().parents[1] / "traces" / "gpt-5.3b.json").read_bytes()
        req = urllib.request.Request(url + "api/upload?kind=trace&name=t.json", data=trace, method="POST")
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
        [folder] = tmp_path.glob("mpsim-serve-*")
        assert any(folder.iterdir())
    finally:
        proc.terminate()
        code = proc.wait(timeout=30)
    assert code == 143 and not list(tmp_path.glob("mpsim-serve-*"))


# --- the page in a real browser ----------------------------------------------------------

@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(120_000)
    pg.goto(server.url)
    pg.wait_for_selector("body[data-ready='1']")
    yield pg
    context.close()


def screenshot(page, name: str) -> None:
    if SCREENSHOTS:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"serve_{name}.png"), full_page=True)


def fill_job(page, model: str, microbatch: int, strategy: str, microbatches: int = 16) -> None:
    page.select_option("#server", "dgx1-v100")
    page.select_option("#model", model)
    page.fill("#microbatch", str(microbatch))
    page.fill("#microbatches", str(microbatches))
    page.select_option("#strategy", strategy)


def charts_loaded(page) -> bool:
    return page.evaluate("[...document.querySelectorAll('img.chart')].every(i => i.complete && i.naturalWidth > 0)")


@pytest.mark.browser
def test_browser_runs_a_job_and_shows_verdict_charts_and_plan(page, server):
    fill_job(page, "gpt-10.3b", 2, "mpress")
    page.click("#run")
    page.wait_for_selector("#result:not([hidden])")
    # MPress fills the V100s to within the default 1 GiB headroom: it fits, at risk, and says where
    assert page.inner_text("#verdict").startswith("FITS on every GPU, AT RISK: gpt-10.3b on dgx1-v100")
    assert page.inner_text("#oom").startswith("at risk: GPU ") and "GiB reserved for" in page.inner_text("#oom")
    page.wait_for_function("[...document.querySelectorAll('img.chart')].every(i => i.complete && i.naturalWidth > 0)")
    assert charts_loaded(page)
    actions = page.eval_on_selector_all("#plan-table td:nth-child(4)", "cells => cells.map(c => c.textContent)")
    made = api.plan("dgx1-v100", "gpt-10.3b", "1f1b", 2, 16, strategy="mpress").plan  # what the page should show
    chosen = {a.layer: a.action for st in made.stages for a in st.actions}
    assert actions == [chosen.get(j, "keep") for j in range(len(load_trace("gpt-10.3b").spec.layers))]
    assert {"peer", "recompute"} <= set(actions)
    peers = page.eval_on_selector_all("#plan-table td:nth-child(5)", "cells => cells.map(c => c.textContent)")
    assert any(p.startswith("gpu") and p.endswith("%") for p in peers)  # mpress swaps some layers to peers
    assert "server=dgx1-v100" in page.url and "strategy=mpress" in page.url and "run=1" in page.url
    screenshot(page, "result")
    bookmarked = page.context.new_page()  # the address alone brings the same view back
    bookmarked.goto(page.url)
    bookmarked.wait_for_selector("#result:not([hidden])")
    assert bookmarked.inner_text("#verdict") == page.inner_text("#verdict")
    assert bookmarked.input_value("#strategy") == "mpress"


@pytest.mark.browser
def test_browser_answers_how_many_servers(page, server):
    page.click("#tab-scale")
    assert page.is_visible("#scale-field") and not page.is_visible("#server-field")
    page.select_option("#model", "gpt2-xl")
    page.select_option("#clusters", ["dgx-h100-superpod"])
    page.fill("#tokens", "1e10")
    page.fill("#min_servers", "1")
    page.fill("#max_servers", "2")
    page.click("#run")
    page.wait_for_selector("#choose-result:not([hidden])")
    assert page.inner_text("#choose-heading") == "How many servers: time and cost to train"
    assert page.inner_text("#choose-out .verdict").startswith("1 server of dgx-h100-superpod")
    assert page.query_selector("#choose-out svg") is not None
    assert "view=scale" in page.url and "clusters=dgx-h100-superpod" in page.url
    screenshot(page, "scale")


@pytest.mark.browser
def test_browser_shows_where_a_job_runs_out_of_memory(page):
    fill_job(page, "gpt-10.3b", 2, "none")
    page.click("#run")
    page.wait_for_selector("#result:not([hidden])")
    assert page.inner_text("#verdict").startswith("DOES NOT FIT")
    assert "ran out at" in page.inner_text("#oom")
    page.wait_for_function("[...document.querySelectorAll('img.chart')].every(i => i.complete && i.naturalWidth > 0)")
    screenshot(page, "oom")


@pytest.mark.browser
def test_browser_shows_the_one_line_message_of_a_bad_upload(page, tmp_path, monkeypatch, capsys):
    (tmp_path / "bad.yaml").write_text(TOPOLOGY_WITH_SCHEMA_ERROR)
    expected = cli_error(tmp_path, monkeypatch, capsys, ["topo", "check", "bad.yaml"])
    page.set_input_files("#server-file", files=[{"name": "bad.yaml", "mimeType": "application/yaml",
                                                 "buffer": TOPOLOGY_WITH_SCHEMA_ERROR.encode()}])
    page.wait_for_selector("#error:not([hidden])")
    assert page.inner_text("#error") == f"error: {expected}"
    screenshot(page, "bad_upload")
    page.set_input_files("#trace-file", files=[{"name": "notes.txt", "mimeType": "text/plain", "buffer": b"hi"}])
    page.wait_for_function("document.getElementById('error').textContent.includes('notes.txt')")
    assert page.inner_text("#error") == "error: notes.txt: expected a trace file in JSON (.json)"


@pytest.mark.browser
def test_browser_uploads_a_server_and_says_it_cannot_be_bookmarked(page):
    text = (Path(__file__).parent.parent / "topologies" / "dgx1-v100.yaml").read_bytes()
    page.set_input_files("#server-file", files=[{"name": "my-box.yaml", "mimeType": "application/yaml",
                                                 "buffer": text}])
    page.wait_for_function("document.getElementById('server').value === '__upload__'")
    fill_job(page, "gpt-5.3b", 2, "none")
    page.select_option("#server", "__upload__")
    page.click("#run")
    page.wait_for_selector("#result:not([hidden])")
    assert page.inner_text("#verdict").startswith("FITS")
    assert "cannot be bookmarked" in page.inner_text("#bookmark-note")


@pytest.mark.browser
def test_browser_sets_the_stage_count_of_a_job(page):
    fill_job(page, "gpt-5.3b", 2, "none")
    page.fill("#stages", "4")
    page.click("#run")
    page.wait_for_selector("#result:not([hidden])")
    assert "gpt-5.3b on dgx1-v100" in page.inner_text("#verdict")
    stages = page.eval_on_selector_all("#plan-table td:nth-child(2)", "cells => cells.map(c => c.textContent)")
    assert sorted(set(stages)) == ["0", "1", "2", "3"] and "stages=4" in page.url


@pytest.mark.browser
def test_browser_compares_an_uploaded_server_in_choose(page):
    text = (Path(__file__).parent.parent / "topologies" / "h100-x1.yaml").read_text()
    page.click("#tab-choose")
    assert page.is_visible("#servers-field") and not page.is_visible("#strategy-label")
    assert not page.is_visible("#stages-label")
    page.select_option("#servers", ["dgx1-v100"])
    page.set_input_files("#servers-file", files=[{"name": "mine.yaml", "mimeType": "application/yaml",
                                                  "buffer": text.replace("name: h100-x1", "name: my-h100").encode()}])
    page.wait_for_function("[...document.getElementById('servers').selectedOptions].length === 2")
    page.select_option("#model", "gpt-5.3b")
    page.fill("#microbatch", "2")
    page.click("#run")
    page.wait_for_selector("#choose-result:not([hidden])")
    table = page.inner_text("#choose-out")
    assert "my-h100" in table and "dgx1-v100" in table
    assert "cannot be bookmarked" in page.inner_text("#bookmark-note")


@pytest.mark.browser
def test_browser_cancels_a_long_run(page):
    fill_job(page, "gpt-25.5b", 2, "best", microbatches=64)
    page.click("#run")
    page.wait_for_function("/running: [1-9]/.test(document.getElementById('progress').textContent)")
    screenshot(page, "running")
    page.click("#cancel")
    page.wait_for_function("document.getElementById('progress').textContent.startsWith('cancelled')")
    assert page.is_hidden("#cancel") and page.is_hidden("#result")


def test_a_cancelled_scale_run_is_cancelled_not_done(server):
    status, job = call_json(server, "POST", "/api/jobs?" + urlencode(
        {"view": "scale", "model": "llama-3-70b", "clusters": "dgx-h100-superpod", "min_servers": 16,
         "max_servers": 256}))
    for _ in range(2400):
        if call_json(server, "GET", f"/api/jobs/{job['id']}")[1]["tasks"] > 0:
            break
        time.sleep(0.05)
    call_json(server, "POST", f"/api/jobs/{job['id']}/cancel")
    assert wait_finished(server, job["id"])["state"] == "cancelled"


def test_the_catalog_says_a_word_on_each_server_and_strategy(server):
    status, catalog = call_json(server, "GET", "/api/catalog")
    assert status == 200
    assert catalog["labels"]["servers"]["dgx1-v100"] == "8 x V100-SXM2-32GB"
    assert set(catalog["labels"]["strategies"]) <= set(catalog["strategies"])
    assert {"none", "recompute", "mpress", "tsplit", "best"} <= set(catalog["labels"]["strategies"])
