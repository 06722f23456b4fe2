"""The layer limit (mpsim.limits.MAX_LAYERS): refused in one line before anything big is
built, and a trace at the limit still reads and partitions."""

import json

import numpy as np
import pytest

from mpsim.data.catalog import load_trace
from mpsim.errors import MpsimError
from mpsim.limits import MAX_LAYERS, TooManyLayersError, check_trace_data, count_layer_rows
from mpsim.models.trace import read_trace_file
from mpsim.planners.mcap import mcap_partition
from mpsim.plans.partition import compute_balanced
from mpsim.timing.costs import cost_model


def _trace_text(n_layers: int) -> str:
    """gpt-5.3b's file with its transformer row repeated: ``n_layers`` rows in all, written
    by joining the rows' text (a 100,000-row file in a fraction of a second)."""
    spec = json.loads(load_trace("gpt-5.3b").to_json())
    emb, layer, head = spec["layers"][0], spec["layers"][1], spec["layers"][-1]
    spec["layers"] = []
    spec["model"]["layers"] = n_layers - 2
    head_text, _ = json.dumps(spec).rsplit("[]", 1)
    rows = [json.dumps(emb), *[json.dumps(layer)] * (n_layers - 2), json.dumps(head)]
    return head_text + "[" + ", ".join(rows) + "]}"


@pytest.fixture(scope="module")
def at_limit(tmp_path_factory):
    path = tmp_path_factory.mktemp("limit") / "at-limit.json"
    path.write_text(_trace_text(MAX_LAYERS))
    return path


def test_a_100000_layer_file_is_refused_in_one_line(tmp_path):
    path = tmp_path / "model.json"
    path.write_text(_trace_text(100_000))
    with pytest.raises(TooManyLayersError) as info:
        read_trace_file(path)
    message = str(info.value)
    assert message == (f"{path} has 100000 layers; mpsim handles at most {MAX_LAYERS} "
                       "(see MAX_LAYERS in mpsim/limits.py)")
    assert "\n" not in message and isinstance(info.value, MpsimError)


def test_the_cli_refuses_it_in_one_line_and_exits_2(tmp_path, capsys):
    from mpsim.cli import main

    path = tmp_path / "model.json"
    path.write_text(_trace_text(MAX_LAYERS + 1))
    assert main(["simulate", "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"mpsim: error: {path} has {MAX_LAYERS + 1} layers; mpsim handles at most {MAX_LAYERS} " \
                  "(see MAX_LAYERS in mpsim/limits.py)\n"


def test_the_raw_count_matches_the_rows_and_ignores_strings_that_only_mention_kind():
    text = _trace_text(50)
    assert count_layer_rows(text) == 50
    spec = json.loads(text)
    spec["name"] = 'a "kind": "head" name'
    spec["layers"][1]["name"] = "kind"
    assert count_layer_rows(json.dumps(spec)) == 50


def test_rows_counted_exactly_once_parsed():
    """A kind written with escapes escapes the raw count, not the parsed one."""
    rows = [{"kind": "transformer"}] * (MAX_LAYERS + 1)
    text = json.dumps({"layers": rows}).replace('"kind"', '"\\u006bind"')
    assert count_layer_rows(text) == 0
    with pytest.raises(TooManyLayersError, match=f"has {MAX_LAYERS + 1} layers"):
        check_trace_data(json.loads(text), "x.json")
    check_trace_data({"layers": rows[:MAX_LAYERS]}, "x.json")


def test_a_trace_at_the_limit_reads_and_partitions_in_linear_memory(at_limit):
    """Both partitions of a trace at the limit; the old whole tables would be 800 MB each."""
    import tracemalloc

    from mpsim.data.catalog import load_topology

    trace = read_trace_file(at_limit)
    assert trace.n_layers == MAX_LAYERS
    times = cost_model(trace, load_topology("dgx1-v100").spec.gpu).layer_times
    tracemalloc.start()
    stages = compute_balanced(times.fwd_s + times.bwd_s, 8)
    memory = mcap_partition(trace, "1f1b", 2, 4)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 100 * 2**20
    assert stages[0][0] == 0 and stages[-1][1] == MAX_LAYERS
    assert all(abs(b - a - MAX_LAYERS / 8) < 10 for a, b in stages)
    assert memory[0][0] == 0 and memory[-1][1] == MAX_LAYERS and memory[0][1] < MAX_LAYERS // 2


def test_tracing_more_layers_than_the_limit_is_refused_before_tracing():
    from dataclasses import replace

    from mpsim.models.tracer import trace_model
    from mpsim.models.workloads import ZOO

    cfg = replace(ZOO["gpt-5.3b"][0], layers=MAX_LAYERS - 1)
    with pytest.raises(TooManyLayersError, match=f"has {MAX_LAYERS + 1} layers; mpsim handles at most"):
        trace_model(cfg, 1)


def test_compute_balanced_memory_is_linear():
    """20,000 layers over 8 stages: the old (n + 1)^2 table would be 3.2 GB; blocks are 8 MiB."""
    import tracemalloc

    cost = np.random.default_rng(0).random(20_000)
    tracemalloc.start()
    compute_balanced(cost, 8)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 50 * 2**20
    # signed costs take the blocked programme, not the bisection: 5,000 layers, old table 200 MB
    tracemalloc.start()
    compute_balanced(np.random.default_rng(1).random(5_000) - 0.5, 8)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 50 * 2**20
