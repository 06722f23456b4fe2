"""The pipeline timeline draws for every layout (issue 45): data- and tensor-parallel jobs
add ``nccl`` spans (their groups' collectives), which the figure once looked up among the
compute and copy lanes only, so the page's timeline answered HTTP 500 for every such job."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from urllib.parse import urlencode

import pytest
from matplotlib.figure import Figure

from mpsim import api
from mpsim.views.plots import timeline_figure
from mpsim.web.app import MpsimServer

SERVER, MODEL = "dgx-a100-80gb", "llama-3-8b"
#: One of each layout: data parallel (DDP, FSDP, ZeRO-2), tensor parallel with and without
#: sequence parallelism, the hybrids with a pipeline, and the pure pipelines.
LAYOUTS = ["ddp8", "fsdp8", "zero2x4xpp2", "tp8", "tp4spxpp2", "ddp2xpp4", "pp8", "pp4v2"]


def _legend(fig: Figure) -> set[str]:
    legend = fig.axes[0].get_legend()
    assert legend is not None
    return {t.get_text() for t in legend.get_texts()}


def _result(layout: str) -> api.SimResult:
    return api.plan(SERVER, MODEL, "1f1b", 1, 8, parallelism=api.parse_layout(layout)).result


@pytest.mark.parametrize("layout", LAYOUTS)
def test_timeline_draws_every_span_of_every_layout_in_its_gpus_row(layout):
    r = _result(layout)
    fig = timeline_figure(r)
    ax = fig.axes[0]
    rows = {g.gpu: i for i, g in enumerate(r.gpus)}
    # every span is one bar, and each bar lies inside its GPU's row
    bars = [path.get_extents() for coll in ax.collections for path in coll.get_paths()]
    assert len(bars) == len(r.spans)
    centres = sorted(round((b.y0 + b.y1) / 2, 6) for b in bars)
    assert all(-0.5 < c < len(rows) - 0.5 for c in centres)
    gpus_with_spans = {s.gpu for s in r.spans}
    assert {round(c) for c in centres} == {rows[g] for g in gpus_with_spans}
    legend = _legend(fig)
    lanes = {s.lane for s in r.spans}
    assert ("collective (NCCL)" in legend) == ("nccl" in lanes)
    if layout.startswith(("ddp", "fsdp", "zero", "tp")):
        assert "nccl" in lanes  # the case that failed: the groups' collectives are drawn
    assert {"forward", "backward", "optimizer update"} <= legend


def test_timeline_draws_a_lane_it_does_not_know_under_its_own_name():
    r = _result("ddp8")
    r.spans.append(r.spans[0]._replace(lane="nvme", name="shard fetch"))
    legend = _legend(timeline_figure(r))
    assert "nvme" in legend


# --- through the page's HTTP endpoint ------------------------------------------------------

def _call(srv: MpsimServer, method: str, path: str) -> tuple[int, bytes]:
    req = urllib.request.Request(srv.url.rstrip("/") + path, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:  # bounds the test only
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _run(srv: MpsimServer, **params: object) -> dict:
    status, raw = _call(srv, "POST", "/api/jobs?" + urlencode(params))
    assert status == 200, raw
    job_id = json.loads(raw)["id"]
    for _ in range(2400):  # a bound so a broken run fails the test instead of hanging it
        status, raw = _call(srv, "GET", f"/api/jobs/{job_id}")
        job = json.loads(raw)
        if job["state"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"run {job_id} did not finish")


@pytest.mark.parametrize("layout", ["ddp8", "fsdp8", "tp8", "tp4spxpp2", "ddp2xpp4"])
def test_the_pages_timeline_answers_for_data_and_tensor_parallel_jobs(server, layout):
    job = _run(server, server=SERVER, model=MODEL, microbatch=1, microbatches=4, layout=layout)
    assert job["state"] == "done", job
    status, svg = _call(server, "GET", f"/api/jobs/{job['id']}/chart/timeline.svg")
    assert status == 200, svg[:300]
    assert svg.lstrip().startswith(b"<?xml") and b"<svg" in svg and b"collective (NCCL)" in svg
    status, png = _call(server, "GET", f"/api/jobs/{job['id']}/chart/timeline.png")
    assert status == 200 and png.startswith(b"\x89PNG")
