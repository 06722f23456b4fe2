"""``--microbatches`` means one thing (issue 45): the microbatches each replica (pipeline)
runs per iteration, as Megatron-LM counts them, in every command and on the page. The
commands that compare layouts at one global batch (``fits``, ``sweep``, ``choose``) take
that batch as ``--global-microbatches`` and refuse ``--microbatches`` in one line naming
both; ``choose --tokens`` refuses either, naming ``--batch-tokens``."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import parse_qs

import pytest
from click.testing import CliRunner

from mpsim import api
from mpsim.cli import app, main
from mpsim.errors import MpsimError
from mpsim.web.inputs import JobInputs, from_query


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], *names: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("mpsim: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for name in names:
        assert name in err, (name, err)
    return err


@pytest.mark.parametrize("argv", [
    ["fits", "--microbatches", "8"],
    ["sweep", "--microbatches", "8"],
    ["choose", "--model", "gpt-5.3b", "--microbatches", "8"],
])
def test_a_study_at_a_fixed_global_batch_refuses_a_per_replica_count(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    err = _refused(capsys, argv, "--microbatches", "--global-microbatches 8", "fixed global batch")
    assert argv[0] in err
    assert not (tmp_path / "sweep.csv").exists()  # refused before any point ran


@pytest.mark.parametrize(("flag", "value"), [("--microbatches", "8"), ("--global-microbatches", "8")])
def test_choose_tokens_names_batch_tokens_for_either_count(capsys, flag, value):
    _refused(capsys, ["choose", "--model", "llama-3-8b", "--tokens", "1e10", flag, value], flag, "--tokens",
             "--batch-tokens")


def test_each_help_says_what_the_count_means():
    runner = CliRunner()
    for command in ("simulate", "plan"):
        text = " ".join(runner.invoke(app, [command, "--help"], terminal_width=200).output.split())
        assert "microbatches each replica (pipeline) runs per iteration" in text, command
        assert "--global-microbatches" not in text
    for command in ("fits", "sweep", "choose"):
        text = " ".join(runner.invoke(app, [command, "--help"], terminal_width=200).output.split())
        assert "--global-microbatches" in text and "per iteration over all replicas" in text, command
        assert "--microbatches N refused here" in text, command


def test_fits_json_names_the_global_count_and_each_layout_s_per_replica_count(capsys):
    code = main(["fits", "--server", "dgx1-v100", "--model", "gpt-5.3b", "--strategy", "none", "--layouts",
                 "pp8,ddp8", "--no-largest", "-j", "1", "--global-microbatches", "16", "--json", "-"])
    out = capsys.readouterr().out
    assert code == 0
    [answer] = json.loads(out)["reports"]
    assert answer["global_microbatches"] == 16 and "microbatches" not in answer
    per_layout = {rep["layout"]: rep["microbatches"] for rep in answer["layouts"]}
    assert per_layout == {"pipeline x8": 16, "DDP x8": 2}  # 16 over 8 replicas: 2 each, the same global batch


def test_the_global_count_is_checked_as_its_own_flag(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _refused(capsys, ["fits", "--global-microbatches", "0"], "--global-microbatches must be from 1 to 4096")
    _refused(capsys, ["sweep", "--global-microbatches", "16,5000"], "--global-microbatches", "5000")
    with pytest.raises(MpsimError, match="--global-microbatches must be from 1"):
        api.choose("gpt-5.3b", ["dgx1-v100"], global_microbatches=0)


def test_simulate_counts_microbatches_per_replica():
    result = api.simulate("dgx1-v100", "gpt-5.3b", microbatch=1, microbatches=4,
                          parallelism=api.data_parallel(2, 3, 4))
    assert result.microbatches == 4 and result.replicas == 2  # not 4 over both replicas


# -- the page ------------------------------------------------------------------------------

def test_the_page_labels_its_counts_per_replica_and_over_all_replicas():
    html = (Path(api.__file__).parents[1] / "web" / "static" / "index.html").read_text()
    assert ">microbatches per replica <input" in html and 'id="microbatches"' in html
    assert ">microbatches over all replicas <input" in html and 'id="global_microbatches"' in html


def test_the_choose_view_takes_the_global_count_and_the_job_view_the_per_replica_one():
    choose = JobInputs(view="choose", servers=("dgx1-v100",), global_microbatches=32)
    assert "global_microbatches=32" in choose.query() and "microbatches=16" not in choose.query()
    assert from_query(parse_qs(choose.query())) == choose
    job = JobInputs(microbatches=8)
    assert "microbatches=8" in job.query() and "global_microbatches" not in job.query()
    with pytest.raises(MpsimError, match="^microbatches: the choose view compares layouts at a fixed global batch: "
                                         "give global_microbatches"):
        from_query({"view": ["choose"], "microbatches": ["8"]})
    with pytest.raises(MpsimError, match="^global_microbatches: the job view runs one layout.*give microbatches"):
        from_query({"view": ["job"], "global_microbatches": ["8"]})
    with pytest.raises(MpsimError, match="global_microbatches: at most 256 on the page"):
        from_query({"view": ["choose"], "global_microbatches": ["300"]})


def test_the_choose_view_runs_choose_at_its_global_count(monkeypatch):
    from mpsim.web import work

    seen: dict[str, object] = {}

    class _Report:
        rows: list = []  # no server answered: nothing to name under the table

        def to_dict(self) -> dict:
            return {}

    def fake_choose(*args: object, **kwargs: object) -> _Report:
        seen.update(kwargs)
        return _Report()

    monkeypatch.setattr(api, "choose", fake_choose)
    monkeypatch.setattr(work, "choose_html", lambda report: "")
    request = work.RunRequest(JobInputs(view="choose", servers=("dgx1-v100",), global_microbatches=32, microbatches=3))
    work.run_choose(request)
    assert seen["global_microbatches"] == 32 and "microbatches" not in seen
