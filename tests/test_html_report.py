"""The HTML reports carry the facts the text prints (issue 45, "every flag means one
thing"): the layout, the throughput's ± band and tokens/s, and AT RISK where the text says it."""

from __future__ import annotations

import re
from html import unescape

import pytest

from mpsim.api import data_parallel, plan
from mpsim.views.html import simulate_page, verdict_html
from mpsim.views.text import simulate_text


@pytest.fixture(scope="module")
def fsdp():
    """Llama-3-8B as FSDP over the A100 80GB server's eight GPUs (the README's simulate example)."""
    return plan("dgx-a100-80gb", "llama-3-8b", "1f1b", 1, 2, parallelism=data_parallel(8, 3, None))


def _text_of(page: str) -> str:
    return unescape(re.sub(r"<[^>]+>", " ", page))


def test_the_html_verdict_names_the_layout_the_band_and_tokens(fsdp):
    r = fsdp.result
    assert r.data_parallel and r.tokens_per_s is not None and r.time_band_pct
    page = _text_of(simulate_page(r, fsdp.plan))
    text = simulate_text(r)
    assert text.splitlines()[0] in page  # the same verdict line, layout included
    assert f"{r.layout}, 1f1b" in page
    throughput = re.search(r"throughput +(.+)", text)
    assert throughput is not None and throughput[1] in page  # rate ± band, tokens/s, TFLOP/s
    assert f"{r.tokens_per_s:,.0f} tokens/s" in page and " ± " in page
    assert f"± {r.time_band_pct:g}%: {r.time_band_source}" in page


def test_at_risk_is_marked_in_the_html_where_the_text_marks_it(fsdp):
    r = fsdp.result
    assert r.fits and r.at_risk(80.0) and not r.at_risk(0.0)
    risky, safe = verdict_html(r, 80.0), verdict_html(r, 0.0)
    assert "AT RISK" in simulate_text(r, 80.0) and "AT RISK" in risky and 'class="verdict risk"' in risky
    assert r.at_risk(80.0) in unescape(risky)  # the GPU and why, as the text's second line says
    assert "AT RISK" not in safe and 'class="verdict fits"' in safe
    assert "<td>at risk</td>" in simulate_page(r, headroom_gib=80.0)
    assert "<td>at risk</td>" not in simulate_page(r, headroom_gib=0.0)


def test_a_job_that_does_not_fit_says_where_in_the_html():
    r = plan("dgx1-v100", "gpt-15.4b", "1f1b", 2, 16).result
    page = _text_of(verdict_html(r))
    assert not r.fits and r.oom is not None
    assert "DOES NOT FIT" in page and f"GPU {r.oom['gpu']} ran out at" in page
    assert "as if the GPUs had the memory" in page and "AT RISK" not in page


def test_simulate_html_takes_the_headroom_the_command_was_given(tmp_path):
    """`simulate --html --headroom 80`: the page marks at risk what the text marks (the
    command passed no headroom to the page before, so it judged at the default 1 GiB)."""
    from helpers import run_cli

    args = ["simulate", "-s", "dgx-a100-80gb", "-m", "llama-3-8b", "--dp", "8", "--zero", "3", "--microbatch", "1",
            "--microbatches", "2"]
    for headroom, marked in (("80", True), ("0", False)):
        page = tmp_path / f"h{headroom}.html"
        code, text, _ = run_cli(120, *args, "--headroom", headroom, "--html", str(page))
        assert code == 0 and ("AT RISK" in text) == marked
        assert ("AT RISK" in page.read_text()) == marked
