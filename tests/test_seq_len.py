"""``--seq-len`` in simulate, plan and choose (issue 45): the model retraced at that sequence
length from the shape its trace records (the mechanism of ``mpsim trace --seq-len``), so the
simulated memory and time move with it; its own length changes nothing; a model that cannot
be retraced, or a length past its positions or ``mpsim.limits.MAX_SEQ_LEN``, is refused in
one line naming the model and the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpsim import api
from mpsim.cli import main
from mpsim.limits import MAX_SEQ_LEN

TINY_SEQ = 128
"""gpt-tiny's sequence length (``mpsim trace --preset gpt-tiny``)."""
SIMULATE = ["simulate", "--server", "dgx1-v100", "--stages", "2", "--microbatches", "4"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpt-tiny as a trace file: a trace JSON that records its whole shape."""
    path = tmp_path_factory.mktemp("seq") / "tiny.json"
    trace = api.trace_shape("gpt-tiny", {})
    assert trace.seq_len == TINY_SEQ
    path.write_text(trace.to_json())
    return path


def _simulated(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    code = main([*SIMULATE, *args, "--json", "-"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def _max_peak(result: dict) -> int:
    return max(g["peak_bytes"] for g in result["gpus"])


def test_memory_and_time_grow_with_the_sequence(capsys, tiny):
    runs = [_simulated(capsys, "--model", str(tiny), "--seq-len", str(s)) for s in (TINY_SEQ, 2 * TINY_SEQ,
                                                                                   4 * TINY_SEQ)]
    peaks = [_max_peak(r) for r in runs]
    times = [r["iteration_s"] for r in runs]
    assert peaks[0] < peaks[1] < peaks[2], peaks
    assert times[0] < times[1] < times[2], times
    assert runs[1]["model"] == "gpt-tiny-seq256"


def test_its_own_length_gives_the_identical_result(capsys, tiny):
    plain = _simulated(capsys, "--model", str(tiny))
    same = _simulated(capsys, "--model", str(tiny), "--seq-len", str(TINY_SEQ))
    assert same == plain


@pytest.mark.parametrize("name", ["gpt-5.3b", "llama-3-8b", "bert-0.35b"])
def test_a_shipped_model_retraced_at_its_own_length_is_its_shipped_trace(name):
    """The retrace is the tracer run on the shape the trace records: at the shipped length it
    gives back the shipped trace, so another length differs from it by the sequence alone."""
    from mpsim.models.tracer import trace_model
    from mpsim.models.workloads import shape_of

    shipped = api.load_trace(name)
    shape = shape_of(dict(shipped.spec.model))
    assert not isinstance(shape, str)
    again = trace_model(shape, shipped.microbatch, shipped.spec.precision.recipe, shipped.name)
    assert again.spec.layers == shipped.spec.layers and again.spec.params == shipped.spec.params


def test_plan_takes_the_flag_too(capsys, tiny, tmp_path):
    out = tmp_path / "p.json"
    code = main(["plan", "--server", "dgx1-v100", "--stages", "2", "--model", str(tiny), "--seq-len", "512",
                 "-o", str(out), "--json", "-"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and out.exists()
    assert data["result"]["model"] == "gpt-tiny-seq512"


def test_choose_ranks_at_the_sequence_asked(capsys, tiny):
    base = ["choose", "--model", str(tiny), "--servers", "dgx1-v100", "--strategy", "none", "--layouts", "pp2",
            "--json", "-"]
    reports = []
    for seq in (TINY_SEQ, 4 * TINY_SEQ):
        assert main([*base, "--seq-len", str(seq)]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert [r["seq_len"] for r in reports] == [TINY_SEQ, 4 * TINY_SEQ]
    short, long = (r["rows"][0] for r in reports)
    assert long["max_peak_bytes"] > short["max_peak_bytes"] and long["iteration_s"] > short["iteration_s"]


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], *words: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("mpsim: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    return err


def _edited(tiny: Path, tmp_path: Path, name: str, **model: object) -> Path:
    data = json.loads(tiny.read_text())
    for key, value in model.items():
        if value is None:
            del data["model"][key]
        else:
            data["model"][key] = value
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_a_model_that_cannot_be_retraced_is_refused(capsys, tiny, tmp_path):
    no_shape = _edited(tiny, tmp_path, "no-shape.json", hidden=None)
    _refused(capsys, [*SIMULATE, "--model", str(no_shape), "--seq-len", "256"], "--seq-len", "gpt-tiny",
             "cannot be retraced")
    no_seq = _edited(tiny, tmp_path, "no-seq.json", seq_len=None)  # a CNN's model block has no sequence
    _refused(capsys, [*SIMULATE, "--model", str(no_seq), "--seq-len", "256"], "--seq-len", "gpt-tiny",
             "no sequence length")
    hf = _edited(tiny, tmp_path, "hf.json", model_type="gpt2", source="hf:gpt2")
    _refused(capsys, [*SIMULATE, "--model", str(hf), "--seq-len", "256"], "--seq-len", "gpt-tiny", "model_type")
    _refused(capsys, ["choose", "--model", str(no_shape), "--servers", "dgx1-v100", "--seq-len", "256"],
             "--seq-len", "gpt-tiny")


def test_a_length_past_the_positions_or_the_limit_is_refused(capsys, tiny, tmp_path):
    _refused(capsys, [*SIMULATE, "--model", str(tiny), "--seq-len", str(MAX_SEQ_LEN + 1)], "--seq-len",
             "gpt-tiny", "MAX_SEQ_LEN")
    bounded = _edited(tiny, tmp_path, "bounded.json", max_position_embeddings=512)
    _refused(capsys, [*SIMULATE, "--model", str(bounded), "--seq-len", "1024"], "--seq-len 1024", "gpt-tiny",
             "512 positions")
    _refused(capsys, [*SIMULATE, "--model", str(tiny), "--seq-len", "0"], "--seq-len")
