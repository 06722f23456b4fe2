"""Bad tensor-parallel, sequence-parallel and interleaved-1F1B inputs: one line, no traceback.

Each case is an input a careless or hostile user might give to ``--tp``, ``--sp``,
``--virtual-stages``, ``--layouts`` or a schema-3 plan file (``tensor_parallel``,
``virtual_stages``), run in-process through ``mpsim.cli.main``. Every one must end with
exit 2 and exactly one line on stderr, ``mpsim: error: ...``, naming what is wrong (the
key words checked), never a traceback and never a hang. The Python API's checked
constructors (``data_parallel``, ``job_of``, ``parse_layout``) must raise a one-line
``MpsimError``. All cases are refused before a shard is traced, so they run fast.
"""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import pytest
from helpers import run_cli

from mpsim.errors import MpsimError

ROOT = Path(__file__).resolve().parent.parent
RUN_LIMIT_S = 60
A100 = ("--server", "dgx-a100-80gb")
LLAMA = ("--model", "llama-3-8b")
MB8 = ("--microbatches", "8")

# What `mpsim plan --server dgx-a100-80gb --model llama-3-8b --tp 2 --sp --stages 2
# --virtual-stages 2 --microbatches 8` writes: TP x2+SP x pipeline x2, interleaved x2.
BASE_PLAN = {
    "schema": 3, "model": "llama-3-8b", "server": "dgx-a100-80gb", "microbatch": 1, "microbatches": 8,
    "schedule": "1f1b", "strategy": "none",
    "stages": [{"gpu": 0, "layers": [0, 9]}, {"gpu": 2, "layers": [9, 18]},
               {"gpu": 0, "layers": [18, 27]}, {"gpu": 2, "layers": [27, 34]}],
    "tensor_parallel": {"degree": 2, "sequence_parallel": True, "groups": [[[0, 1], [2, 3], [0, 1], [2, 3]]]},
    "virtual_stages": 2,
}
TWO_REPLICAS = {"degree": 2, "zero_stage": 1, "replicas": [[0, 2, 0, 2], [4, 6, 4, 6]]}
TWO_REPLICA_GROUPS = [[[0, 1], [2, 3], [0, 1], [2, 3]], [[4, 5], [6, 7], [4, 5], [6, 7]]]


def _cli(*argv: str) -> tuple[int, str, str]:
    return run_cli(RUN_LIMIT_S, *argv)


def _refused(argv: tuple[str, ...], words: tuple[str, ...]) -> None:
    code, out, err = _cli(*argv)
    assert "Traceback" not in out + err, err[-2000:]
    lines = err.strip().splitlines()
    assert code == 2, (code, err[-500:])
    assert len(lines) == 1, err[-2000:]
    assert lines[0].startswith("mpsim: error: "), lines[0]
    for w in words:
        assert w.lower() in lines[0].lower(), (w, lines[0])


# --- mpsim simulate / plan / validate with --tp, --sp, --virtual-stages ---------------------

CLI_CASES = {
    "tp3-llama-32-heads": (("simulate", *A100, *LLAMA, "--tp", "3", *MB8),
                           ("32 attention heads", "tensor-parallel degree of 3")),
    "tp16-on-8-gpus": (("simulate", *A100, *LLAMA, "--tp", "16", *MB8), ("need 16 GPUs", "has 8")),
    "tp0": (("simulate", *A100, *LLAMA, "--tp", "0"), ("--tp", "0")),
    "tp65": (("simulate", *A100, *LLAMA, "--tp", "65"), ("--tp", "65")),
    "tp-negative": (("simulate", *A100, *LLAMA, "--tp", "-1"), ("--tp", "-1")),
    "tp-not-a-number": (("simulate", *A100, *LLAMA, "--tp", "abc"), ("--tp",)),
    "sp-without-tp": (("simulate", *A100, *LLAMA, "--sp", *MB8), ("sequence parallel", "degree of 2 or more")),
    "tp16-llama70b-8-kv-heads": (("simulate", "--server", "dgx2-v100", "--model", "llama-3-70b", "--tp", "16", *MB8),
                                 ("8 KV heads", "degree of 16")),
    "tp2-gpt2xl-25-heads": (("simulate", *A100, "--model", "gpt2-xl", "--tp", "2", *MB8),
                            ("25 attention heads",)),
    "tp64-on-16-gpus": (("simulate", "--server", "dgx2-v100", "--model", "llama-3-70b", "--tp", "64", *MB8),
                        ("need 64 GPUs", "has 16")),
    "tp2-pipedream": (("simulate", *A100, *LLAMA, "--tp", "2", "--schedule", "pipedream", *MB8),
                      ("pipedream", "not simulated")),
    "v2-gpipe": (("simulate", *A100, *LLAMA, "--virtual-stages", "2", "--schedule", "gpipe", *MB8),
                 ("interleaved 1F1B", "gpipe")),
    "v2-pipedream": (("simulate", *A100, *LLAMA, "--virtual-stages", "2", "--schedule", "pipedream", *MB8),
                     ("interleaved 1F1B", "pipedream")),
    "v2-microbatches-not-multiple": (("simulate", *A100, *LLAMA, "--virtual-stages", "2", "--microbatches", "12"),
                                     ("multiple of the pipeline GPUs", "m=12", "p=8")),
    "v8-more-chunks-than-layers": (("simulate", *A100, *LLAMA, "--virtual-stages", "8", *MB8),
                                   ("64 layers", "34")),
    "v2-one-stage": (("simulate", *A100, *LLAMA, "--virtual-stages", "2", "--stages", "1", *MB8),
                     ("at least 2 pipeline GPUs",)),
    "v0": (("simulate", *A100, *LLAMA, "--virtual-stages", "0"), ("--virtual-stages",)),
    "v65": (("simulate", *A100, *LLAMA, "--virtual-stages", "65"), ("--virtual-stages",)),
    "v2-memory-partition": (("simulate", *A100, *LLAMA, "--virtual-stages", "2", "--partition", "memory", *MB8),
                            ("memory-balanced partition",)),
    "tp2-dp4-pp2-needs-16": (("simulate", *A100, *LLAMA, "--tp", "2", "--dp", "4", "--stages", "2", *MB8),
                             ("need 16 GPUs", "has 8")),
    "plan-tp3": (("plan", *A100, *LLAMA, "--tp", "3", *MB8, "-o", "{tmp}/never.json"), ("32 attention heads",)),
    "plan-v2-gpipe": (("plan", *A100, *LLAMA, "--virtual-stages", "2", "--schedule", "gpipe", *MB8,
                       "-o", "{tmp}/never.json"), ("interleaved 1F1B",)),
    "validate-tp0": (("validate", "--tp", "0"), ("--tp",)),
    "validate-v0": (("validate", "--virtual-stages", "0"), ("--virtual-stages",)),
}


def _trace_with(tmp_path: Path, name: str, **model: object) -> str:
    """The shipped llama-3-8b trace with its ``model`` block changed."""
    d = json.loads((ROOT / "traces" / "llama-3-8b.json").read_text())
    d["model"] = {k: v for k, v in {**d["model"], **model}.items() if v is not None}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(d))
    return str(path)


@pytest.mark.parametrize("name", sorted(CLI_CASES))
def test_cli_refuses(name, tmp_path):
    argv, words = CLI_CASES[name]
    _refused(tuple(a.format(tmp=tmp_path) for a in argv), words)
    assert not (tmp_path / "never.json").exists()


TRACE_CASES: dict[str, tuple[dict, tuple[str, ...], tuple[str, ...]]] = {
    "sp-odd-sequence": ({"seq_len": 1023}, ("--tp", "2", "--sp"), ("sequence 1023", "sequence parallel")),
    "tp2-one-kv-head": ({"kv_heads": 1}, ("--tp", "2"), ("1 KV heads", "degree of 2")),
    "tp2-odd-mlp": ({"ffn_hidden": 14337}, ("--tp", "2"), ("14337 MLP width",)),
    "tp2-not-an-mpsim-model": ({"family": "resnet"}, ("--tp", "2"), ("mpsim model", "re-traced")),
    "tp2-already-a-shard": ({"tensor_parallel": {"degree": 2}}, ("--tp", "2"), ("already", "shard")),
}


@pytest.mark.parametrize("name", sorted(TRACE_CASES))
def test_trace_refused(name, tmp_path):
    model, flags, words = TRACE_CASES[name]
    trace = _trace_with(tmp_path, name, **model)
    _refused(("simulate", *A100, "--model", trace, *flags, *MB8), words)


# --- --layouts on choose, fits and sweep ----------------------------------------------------

def _choose(layouts: str, *more: str) -> tuple[str, ...]:
    return ("choose", *LLAMA, "--servers", "dgx-a100-80gb", "--strategy", "none", "--layouts", layouts, *more)


def _sweep(layouts: str, *more: str) -> tuple[str, ...]:
    return ("sweep", *A100, *LLAMA, "--microbatch", "1", "--strategy", "none", "--layouts", layouts, *more)


LAYOUT_CASES = {
    "choose-gpt53b-tp8sp": (("choose", "--model", "gpt-5.3b", "--servers", "dgx-a100-80gb", "--strategy", "none",
                             "--layouts", "tp8sp"), ("30 attention heads", "degree of 8")),
    "choose-tpsp-no-degree": (_choose("tpsp"), ("unknown layout 'tpsp'",)),
    "choose-3d-one-gpu": (("choose", "--model", "gpt-5.3b", "--servers", "h100-x1", "--strategy", "none",
                           "--layouts", "3d"), ("no layout fits", "h100-x1")),
    "choose-tp0": (_choose("tp0"), ("tp0", "tensor")),
    "choose-pp0": (_choose("pp0"), ("pp0", "pipeline")),
    "choose-pp4v0": (_choose("pp4v0"), ("pp4v0", "virtual_stages")),
    "choose-tp1sp": (_choose("tp1sp"), ("sequence parallel",)),
    "choose-pp1v2": (_choose("pp1v2"), ("at least 2 pipeline GPUs",)),
    "choose-tp-huge": (_choose("tp99999999999999999999"), ("tensor", "64")),
    "choose-v-huge": (_choose("pp2v99999999999999999"), ("virtual_stages", "64")),
    "choose-empty-item": (_choose("tp2,,pp4"), ("empty items",)),
    "choose-wrong-order": (_choose("tp2xpp2xddp2"), ("unknown layout",)),
    "choose-trailing-x": (_choose("tp2x"), ("unknown layout",)),
    "choose-zero4": (_choose("zero4x2"), ("unknown layout",)),
    "choose-tp8-pipedream": (_choose("tp8", "--schedule", "pipedream"), ("pipedream", "not simulated")),
    "choose-tp3-llama": (_choose("tp3"), ("32 attention heads",)),
    "sweep-singular-option": (("sweep", *A100, *LLAMA, "--layout", "tp2spxpp4"), ("--layout",)),
    "sweep-tp4spxpp2-pipedream": (_sweep("tp4spxpp2", "--schedule", "pipedream", "--csv", "{tmp}/s.csv"),
                                  ("pipedream",)),
    "sweep-pp4v2-gpipe": (_sweep("pp4v2", "--schedule", "gpipe", "--csv", "{tmp}/s.csv"), ("interleaved 1F1B",)),
    "sweep-pp4v2-6-microbatches": (_sweep("pp4v2", "--global-microbatches", "6", "--csv", "{tmp}/s.csv"),
                                   ("multiple of the pipeline GPUs",)),
    "sweep-pp4v2-memory-partition": (_sweep("pp4v2", "--partition", "memory", "--csv", "{tmp}/s.csv"),
                                     ("memory-balanced partition",)),
    "sweep-tp3-llama": (_sweep("tp3", "--csv", "{tmp}/s.csv"), ("32 attention heads",)),
    "fits-3d-one-gpu": (("fits", "--model", "gpt-5.3b", "--server", "h100-x1", "--strategy", "none", "--layouts",
                         "3d", "-j", "1"), ("no layout fits", "h100-x1")),
}


@pytest.mark.parametrize("name", sorted(LAYOUT_CASES))
def test_layouts_refused(name, tmp_path):
    argv, words = LAYOUT_CASES[name]
    _refused(tuple(a.format(tmp=tmp_path) for a in argv), words)


# --- schema-3 plan files ---------------------------------------------------------------------

def _tp(d: dict) -> dict:
    return d["tensor_parallel"]


PLAN_CASES = {
    "group-too-big": (lambda d: _tp(d).update(groups=[[[0, 1, 4], [2, 3], [0, 1, 4], [2, 3]]]),
                      ("tensor_parallel.groups.0.0", "expected 2 GPUs")),
    "group-empty": (lambda d: _tp(d).update(groups=[[[], [2, 3], [], [2, 3]]]),
                    ("tensor_parallel.groups.0.0", "expected 2 GPUs")),
    "gpu-twice-in-group": (lambda d: _tp(d).update(groups=[[[0, 0], [2, 3], [0, 0], [2, 3]]]),
                           ("tensor_parallel.groups.0.0", "GPU 0")),
    "gpu-in-two-groups": (lambda d: _tp(d).update(groups=[[[0, 1], [2, 1], [0, 1], [2, 1]]]),
                          ("tensor_parallel.groups.0.1", "GPU 1")),
    "group-not-led-by-stage-gpu": (lambda d: _tp(d).update(groups=[[[1, 0], [2, 3], [1, 0], [2, 3]]]),
                                   ("stage's own GPU 0 first",)),
    "groups-for-two-replicas": (lambda d: _tp(d).update(groups=TWO_REPLICA_GROUPS),
                                ("tensor_parallel.groups", "1 replicas", "got 2")),
    "groups-for-no-replica": (lambda d: _tp(d).update(groups=[]), ("tensor_parallel.groups", "at least 1")),
    "groups-too-few-stages": (lambda d: _tp(d).update(groups=[[[0, 1], [2, 3]]]), ("each of 4 stages", "got 2")),
    "groups-too-many-stages": (lambda d: _tp(d).update(groups=[[[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]]]),
                               ("each of 4 stages", "got 5")),
    "virtual-group-not-repeating": (lambda d: _tp(d).update(groups=[[[0, 1], [2, 3], [0, 4], [2, 3]]]),
                                    ("tensor_parallel.groups.0.2", "virtual stage 2")),
    "group-gpu-out-of-range": (lambda d: _tp(d).update(groups=[[[0, 9], [2, 3], [0, 9], [2, 3]]]),
                               ("GPU 9 does not exist",)),
    "group-gpu-negative": (lambda d: _tp(d).update(groups=[[[0, -1], [2, 3], [0, -1], [2, 3]]]),
                           ("GPU -1 does not exist",)),
    "group-gpu-fraction": (lambda d: _tp(d).update(groups=[[[0, 1.5], [2, 3], [0, 1.5], [2, 3]]]),
                           ("tensor_parallel.groups.0.0.1", "integer")),
    "degree-negative": (lambda d: _tp(d).update(degree=-2), ("tensor_parallel.degree", "greater than or equal to 2")),
    "degree-0": (lambda d: _tp(d).update(degree=0), ("tensor_parallel.degree",)),
    "degree-1": (lambda d: _tp(d).update(degree=1, groups=[[[0], [2], [0], [2]]]), ("tensor_parallel.degree",)),
    "degree-65": (lambda d: _tp(d).update(degree=65), ("tensor_parallel.degree", "less than or equal to 64")),
    "degree-huge": (lambda d: _tp(d).update(degree=10**20), ("tensor_parallel.degree",)),
    "degree-fraction": (lambda d: _tp(d).update(degree=2.5), ("tensor_parallel.degree", "integer")),
    "degree-4-groups-of-2": (lambda d: _tp(d).update(degree=4), ("expected 4 GPUs",)),
    "degree-3-heads-do-not-split": (
        lambda d: _tp(d).update(degree=3, sequence_parallel=False,
                                groups=[[[0, 1, 4], [2, 3, 5], [0, 1, 4], [2, 3, 5]]]),
        ("32 attention heads", "degree of 3")),
    "degree-16-on-8-gpus": (
        lambda d: _tp(d).update(degree=16, groups=[[list(range(16)), [2, *range(16, 31)], list(range(16)),
                                                    [2, *range(16, 31)]]]),
        ("does not exist",)),
    "sequence-parallel-null": (lambda d: _tp(d).update(sequence_parallel=None),
                               ("tensor_parallel.sequence_parallel", "boolean")),
    "tensor-parallel-a-list": (lambda d: d.update(tensor_parallel=[]), ("tensor_parallel", "dictionary")),
    "tensor-parallel-unknown-key": (lambda d: _tp(d).update(foo=1), ("tensor_parallel.foo", "unknown field")),
    "tensor-parallel-no-groups": (lambda d: _tp(d).pop("groups"), ("tensor_parallel.groups", "missing")),
    "tensor-parallel-no-degree": (lambda d: _tp(d).pop("degree"), ("tensor_parallel.degree", "missing")),
    "schema-2-with-tensor-parallel": (lambda d: d.update(schema=2), ("tensor_parallel", "needs schema 3")),
    "schema-2-with-virtual-stages": (lambda d: (d.update(schema=2), d.pop("tensor_parallel")),
                                     ("virtual_stages", "needs schema 3")),
    "schema-5": (lambda d: d.update(schema=5), ("schema", "got 5")),
    "virtual-with-gpipe": (lambda d: d.update(schedule="gpipe"), ("virtual_stages", "got gpipe")),
    "virtual-with-pipedream": (lambda d: d.update(schedule="pipedream"), ("virtual_stages", "got pipedream")),
    "tensor-parallel-with-pipedream": (
        lambda d: d.update(schedule="pipedream", virtual_stages=1,
                           stages=[{"gpu": 0, "layers": [0, 17]}, {"gpu": 2, "layers": [17, 34]}],
                           tensor_parallel=dict(_tp(d), groups=[[[0, 1], [2, 3]]])),
        ("tensor_parallel", "pipedream")),
    "virtual-stage-gpu-not-repeating": (lambda d: d["stages"][2].update(gpu=4), ("stages.2.gpu", "stage 0's GPU 0")),
    "virtual-3-of-4-stages": (lambda d: d.update(virtual_stages=3), ("multiple of virtual_stages 3",)),
    "virtual-4-but-two-gpus": (lambda d: d.update(virtual_stages=4), ("stages.1.gpu", "virtual stage 1")),
    "virtual-0": (lambda d: d.update(virtual_stages=0), ("virtual_stages", "greater than or equal to 1")),
    "virtual-negative": (lambda d: d.update(virtual_stages=-1), ("virtual_stages",)),
    "virtual-huge": (lambda d: d.update(virtual_stages=10**30), ("virtual_stages", "less than or equal to 64")),
    "virtual-null": (lambda d: d.update(virtual_stages=None), ("virtual_stages", "integer")),
    "virtual-left-out-gpus-repeat": (lambda d: d.pop("virtual_stages"), ("stages.2.gpu", "already runs stage 0")),
    "virtual-microbatches-not-multiple": (lambda d: d.update(microbatches=3), ("multiple of the pipeline GPUs",)),
    "virtual-too-few-microbatches": (lambda d: d.update(microbatches=1), ("microbatches",)),
    "peer-swap-to-tensor-rank": (
        lambda d: d["stages"][0].update(actions=[{"layer": 1, "action": "peer", "peers": [{"gpu": 1, "fraction": 1}]}]),
        ("stages.0.actions.0.peers", "tensor-parallel rank")),
    "peer-swap-to-tensor-rank-in-virtual-stage": (
        lambda d: d["stages"][2].update(actions=[{"layer": 19, "action": "peer",
                                                  "peers": [{"gpu": 3, "fraction": 1}]}]),
        ("stages.2.actions.0.peers", "tensor-parallel rank")),
    "replicas-without-their-groups": (lambda d: d.update(data_parallel=TWO_REPLICAS),
                                      ("tensor_parallel.groups", "2 replicas", "got 1")),
    "replica-groups-overlap": (
        lambda d: d.update(data_parallel={**TWO_REPLICAS, "replicas": [[0, 2, 0, 2], [1, 3, 1, 3]]},
                           tensor_parallel=dict(_tp(d), groups=[TWO_REPLICA_GROUPS[0],
                                                                [[1, 4], [3, 5], [1, 4], [3, 5]]])),
        ("GPU 1",)),
    "group-takes-other-replicas-gpu": (
        lambda d: d.update(data_parallel=TWO_REPLICAS,
                           tensor_parallel=dict(_tp(d), groups=[[[0, 4], [2, 3], [0, 4], [2, 3]],
                                                                TWO_REPLICA_GROUPS[1]])),
        ("GPU 4",)),
    "replica-virtual-gpus-not-repeating": (
        lambda d: d.update(data_parallel={**TWO_REPLICAS, "replicas": [[0, 2, 0, 2], [4, 6, 5, 6]]},
                           tensor_parallel=dict(_tp(d), groups=TWO_REPLICA_GROUPS)),
        ("data_parallel.replicas.1.2", "virtual stage 2")),
}

_counter = itertools.count()


@pytest.mark.parametrize("name", sorted(PLAN_CASES))
def test_plan_refused(name, tmp_path):
    mutate, words = PLAN_CASES[name]
    d = copy.deepcopy(BASE_PLAN)
    mutate(d)
    path = tmp_path / f"plan{next(_counter)}.json"  # a new name each: files are cached by path and time
    path.write_text(json.dumps(d))
    _refused(("simulate", "--plan", str(path)), words)


def test_plan_on_a_one_gpu_server(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(BASE_PLAN))
    _refused(("simulate", "--plan", str(path), "--server", "h100-x1"), ("2 stages need 2 GPUs", "h100-x1"))


def test_plan_for_another_model(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(BASE_PLAN))
    _refused(("simulate", "--plan", str(path), "--model", "gpt-5.3b"), ("stages.3.layers", "gpt-5.3b"))


# --- the Python API's checked constructors ---------------------------------------------------

def _job(**kw):
    from mpsim.plans.job import job_of

    return job_of("dgx-a100-80gb", "llama-3-8b", microbatches=8, **kw)


def _par(**kw):
    from mpsim.plans.job import Parallelism

    return Parallelism(**kw)


def _data_parallel(*args, **kw):
    from mpsim.plans.job import data_parallel

    return data_parallel(*args, **kw)


def _parse(text):
    from mpsim.plans.layouts import parse_layout

    return parse_layout(text)


API_CASES = {
    "data-parallel-tensor-0": (lambda: _data_parallel(1, 0, 1, tensor=0), ("tensor",)),
    "data-parallel-tensor-65": (lambda: _data_parallel(1, 0, 1, tensor=65), ("tensor", "64")),
    "data-parallel-tensor-fraction": (lambda: _data_parallel(1, 0, 1, tensor=2.5), ("tensor",)),
    "data-parallel-virtual-0": (lambda: _data_parallel(1, 0, 4, virtual_stages=0), ("virtual_stages",)),
    "job-sp-without-tp": (lambda: _job(parallelism=_par(sequence_parallel=True)), ("sequence parallel",)),
    "job-tp3": (lambda: _job(parallelism=_par(tensor=3)), ("32 attention heads",)),
    "job-tp16": (lambda: _job(parallelism=_par(tensor=16)), ("need 16 GPUs",)),
    "job-virtual-memory-partition": (lambda: _job(partition="memory", parallelism=_par(virtual_stages=2)),
                                     ("memory-balanced",)),
    "job-virtual-gpipe": (lambda: _job(schedule="gpipe", parallelism=_par(virtual_stages=2)), ("interleaved",)),
    "job-virtual-one-stage": (lambda: _job(n_stages=1, parallelism=_par(virtual_stages=2)), ("p >= 2",)),
    "job-tp-pipedream": (lambda: _job(schedule="pipedream", parallelism=_par(tensor=2)), ("pipedream",)),
    "parse-tpsp": (lambda: _parse("tpsp"), ("unknown layout",)),
    "parse-tp-space-sp": (lambda: _parse("tp2 sp"), ("unknown layout",)),
    "parse-superscript": (lambda: _parse("tp²"), ("unknown layout",)),
    "parse-tp0": (lambda: _parse("tp0"), ("tensor",)),
}


@pytest.mark.parametrize("name", sorted(API_CASES))
def test_api_refuses(name):
    call, words = API_CASES[name]
    with pytest.raises(MpsimError) as info:
        call()
    text = str(info.value)
    assert len(text.strip().splitlines()) == 1, text
    for w in words:
        assert w.lower() in text.lower(), (w, text)
