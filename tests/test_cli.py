"""The command line: golden outputs, JSON shape, and bad input rejected with one clear line."""

import json
import re
from pathlib import Path

import pytest
import yaml

from mpsim.cli import main

ROOT = Path(__file__).resolve().parent.parent


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_topo_show_prints_the_nvidia_smi_style_matrix(capsys):
    code, out, _ = run(capsys, "topo", "show", "dgx1-v100")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("dgx1-v100: DGX-1")
    row0 = next(line for line in lines if line.startswith("GPU0 ") and "NV" in line)
    assert row0.split() == ["GPU0", "X", "NV1", "NV1", "NV2", "NV2", "SYS", "SYS", "SYS", "0"]
    bw0 = [line for line in lines if line.startswith("GPU0 ")][1]
    assert bw0.split() == ["GPU0", "X", "22.5", "22.5", "45.0", "45.0", "11.6", "11.6", "11.6", "11.6"]


def test_topo_show_json(capsys):
    code, out, _ = run(capsys, "topo", "show", "a100-40gb-nvswitch", "--json", "-")
    d = json.loads(out)
    assert code == 0 and d["gpu"]["count"] == 8 and d["bandwidth_gbps"][0][1] == 270.0


def test_topo_check_accepts_a_shipped_file(capsys):
    code, out, _ = run(capsys, "topo", "check", str(ROOT / "topologies" / "dgx1-v100.yaml"))
    assert code == 0 and "ok (dgx1-v100, 8 x V100-SXM2-32GB" in out


def test_simulate_json_has_the_documented_fields(capsys, tmp_path):
    out_file = tmp_path / "r.json"
    chrome = tmp_path / "t.json"
    png = tmp_path / "m.png"
    code, out, _ = run(capsys, "simulate", "--server", "dgx1-v100", "--model", "gpt-5.3b", "--schedule", "1f1b",
                       "--microbatch", "2", "--microbatches", "16", "--json", str(out_file), "--chrome-trace",
                       str(chrome), "--plot", str(png))
    assert code == 0
    assert "iteration" in out and out.startswith("FITS on every GPU: gpt-5.3b on dgx1-v100")
    d = json.loads(out_file.read_text())
    assert {"fits", "iteration_s", "samples_per_s", "model_tflops", "gpus", "oom"} <= set(d)
    g = d["gpus"][0]
    assert {"gpu", "stage", "peak_bytes", "capacity_bytes", "breakdown"} <= set(g)
    assert {"params", "grads", "optimizer", "activations", "stash", "buffers", "workspace"} <= set(g["breakdown"])
    assert d["oom"] is None and d["fits"] is True
    assert sum(g["breakdown"].values()) == g["peak_bytes"]
    events = json.loads(chrome.read_text())["traceEvents"]
    assert {e["ph"] for e in events} == {"M", "X", "C"}
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_simulate_that_does_not_fit_exits_1_and_names_the_point(capsys):
    code, out, _ = run(capsys, "simulate", "--model", "gpt-25.5b", "--microbatch", "2", "--json", "-")
    d = json.loads(out)
    assert code == 1 and d["fits"] is False
    assert d["oom"]["gpu"] == 0 and d["oom"]["need_bytes"] > d["oom"]["free_bytes"]


def test_fits_table_and_json(capsys, tmp_path):
    out_file = tmp_path / "f.json"
    code, out, _ = run(capsys, "fits", "--server", "dgx1-v100", "--family", "gpt", "--schedule", "1f1b",
                       "--microbatch", "2", "--strategy", "none,recompute", "--layouts", "pipeline",
                       "--json", str(out_file))  # MPress's pipelines
    assert code == 0
    assert "largest that fits, by strategy:" in out and "recompute" in out
    reports = json.loads(out_file.read_text())["reports"]
    assert [r["strategy"] for r in reports] == ["none", "recompute"]
    none, recompute = reports
    assert [r["fits"] for r in none["rows"]] == [True, False, False, False, False]
    assert none["largest"]["fits"] and none["largest"]["params"] > none["rows"][0]["params"]
    # MPress Fig. 8a: recomputation trains GPT-10.3B on the DGX-1, not 15.4B
    assert [r["fits"] for r in recompute["rows"]] == [True, True, False, False, False]
    assert recompute["largest"]["params"] > none["largest"]["params"]


def test_plan_then_simulate_the_plan_file(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    code, out, _ = run(capsys, "plan", "--model", "gpt-10.3b", "--microbatch", "2", "--strategy", "cpu-swap",
                       "-o", str(plan))
    assert code == 0 and f"wrote {plan}" in out and "host" in out
    code, out2, _ = run(capsys, "simulate", "--plan", str(plan), "--json", "-")
    d = json.loads(out2)
    assert code == 0 and d["strategy"] == "cpu-swap" and d["model"] == "gpt-10.3b" and d["fits"]
    assert d["host"]["peak_bytes"] > 0
    assert any(g["saved_at_peak"]["optimizer"] or g["saved_at_peak"]["host"] for g in d["gpus"])


def test_memory_partition_fits_what_the_compute_partition_does_not(capsys):
    """GPT-10.3B on the 40 GB A100 server with 1F1B: compute-balanced stage 0 needs 52.0
    GiB; the memory-balanced partition keeps every stage under 37.8 GiB."""
    argv = ["simulate", "--server", "a100-40gb-nvswitch", "--model", "gpt-10.3b", "--microbatch", "2", "--json", "-"]
    code, out, _ = run(capsys, *argv)
    assert code == 1 and json.loads(out)["partition"][0] == [0, 8]
    code, out, _ = run(capsys, *argv, "--partition", "memory")
    d = json.loads(out)
    assert code == 0 and d["fits"]
    assert max(g["peak_bytes"] for g in d["gpus"]) < 37.8 * 2**30
    assert d["partition"] == [[0, 5], [5, 10], [10, 16], [16, 23], [23, 30], [30, 38], [38, 48], [48, 59]]


def test_topo_transfer_to_host_and_striped(capsys):
    code, out, _ = run(capsys, "topo", "transfer", "--server", "dgx1-v100", "--src", "gpu0", "--dst", "host",
                       "--size", "216MB", "--json", "-")
    d = json.loads(out)
    assert code == 0
    # PCIe 11.6 GB/s plus 10 us of latency
    assert d["copies"][0]["seconds"] == pytest.approx(216e6 / 11.6e9 + 10e-6)
    code, out, _ = run(capsys, "topo", "transfer", "--src", "gpu0", "--stripe", "gpu1,gpu3", "--size", "300MB",
                       "--json", "-")
    parts = json.loads(out)["copies"][0]["parts"]
    assert [p["bytes"] for p in parts] == [100_000_000, 200_000_000]
    # effective bandwidth rises with size: latency paid once per copy
    code, out, _ = run(capsys, "topo", "transfer", "--src", "0", "--dst", "3", "--size", "1MB,1GB", "--json", "-")
    small, big = json.loads(out)["copies"]
    assert small["effective_gbps"] < big["effective_gbps"] < 45.0


def test_help_explains(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "mpsim fits --server dgx1-v100" in out


# -- bad input: one line, exit 2, naming the file, the field and what was expected ------------

def _mutated(tmp_path, source, name, mutate):
    """A copy of a shipped data file with ``mutate`` applied to its parsed content."""
    text = (ROOT / source).read_text()
    is_yaml = source.endswith(".yaml")
    d = yaml.safe_load(text) if is_yaml else json.loads(text)
    mutate(d)
    p = tmp_path / name
    p.write_text(yaml.safe_dump(d) if is_yaml else json.dumps(d))
    return str(p)


def _topo(tmp_path, mutate):
    return _mutated(tmp_path, "topologies/dgx1-v100.yaml", "server.yaml", mutate)


def _trace(tmp_path, mutate):
    return _mutated(tmp_path, "traces/gpt-5.3b.json", "model.json", mutate)


def _set(path, value):
    def mutate(d):
        *head, last = path
        for k in head:
            d = d[k]
        if value is KeyError:
            del d[last]
        else:
            d[last] = value
    return mutate


BAD = [
    ("validate on a missing GPU", lambda t: ["validate", "--device", "cuda"], "--device cuda: no CUDA GPU is visible"),
    ("validate mixed precision on CPU", lambda t: ["validate", "--model", "gpt-5.3b"], "trains in mixed-fp16; on CPU"),
    ("validate a derived trace", lambda t: ["validate", "--model", "traces/bert-0.35b.json"],
     "a derived trace predicts no measured run"),
    ("probe a bad device", lambda t: ["topo", "probe", "--device", "tpu"],
     "--device 'tpu': expected cpu, cuda or cuda:N"),
    ("unknown server", lambda t: ["simulate", "--server", "dgx9"], "unknown server 'dgx9'"),
    ("unknown model", lambda t: ["simulate", "--model", "gpt-99b"], "unknown model 'gpt-99b'"),
    ("missing file", lambda t: ["topo", "check", str(t / "nope.yaml")], "nope.yaml: cannot read topology file"),
    ("missing field", lambda t: ["topo", "check", _topo(t, _set(["gpu", "memory_mib"], KeyError))],
     "server.yaml: gpu.memory_mib: required field is missing"),
    ("negative size", lambda t: ["topo", "check", _topo(t, _set(["gpu", "memory_mib"], -5))],
     "server.yaml: gpu.memory_mib: Input should be greater than 0"),
    ("gpu index out of range", lambda t: ["topo", "check", _topo(t, _set(["nvlink", "pairs", 0, "gpus"], [0, 9]))],
     "server.yaml: nvlink.pairs.0.gpus: GPU index 9 out of range 0..7"),
    ("gpu under two switches", lambda t: ["topo", "check", _topo(t, _set(["pcie", "switches", 1, "gpus"], [1, 2]))],
     "server.yaml: pcie.switches.1.gpus: GPU 1 is already below switch plx0"),
    ("misspelt key", lambda t: ["topo", "check", _topo(t, _set(["gpu", "memory_gb"], 32))],
     "server.yaml: gpu.memory_gb: unknown field"),
    ("wrong schema", lambda t: ["topo", "check", _topo(t, _set(["schema"], 7))],
     "server.yaml: schema: expected 1, got 7"),
    ("socket out of range", lambda t: ["topo", "check", _topo(t, _set(["pcie", "switches", 0, "socket"], 3))],
     "server.yaml: pcie.switches.0.socket: socket 3 out of range 0..1"),
    ("bad trace field", lambda t: ["simulate", "--model", _trace(t, _set(["layers", 3, "act_bytes"], -1))],
     "model.json: layers.3.act_bytes: Input should be greater than or equal to 0"),
    ("trace missing field", lambda t: ["simulate", "--model", _trace(t, _set(["microbatch"], KeyError))],
     "model.json: microbatch: required field is missing"),
    ("too few microbatches", lambda t: ["simulate", "--microbatches", "4"],
     "1f1b needs at least as many microbatches as stages to fill the pipeline: got 4 microbatches for 8 stages"),
    ("zero microbatch", lambda t: ["simulate", "--microbatch", "0"], "microbatch must be a positive integer, got 0"),
    ("unknown schedule", lambda t: ["simulate", "--schedule", "zigzag"], "unknown schedule 'zigzag'"),
    ("unknown strategy", lambda t: ["simulate", "--strategy", "magic"], "unknown strategy 'magic'"),
    ("zero stages", lambda t: ["simulate", "--stages", "0"], "the number of stages must be at least 1, got 0"),
    ("more stages than layers", lambda t: ["simulate", "--server", "dgx2-v100", "--stages", "16",
                                           "--microbatches", "16", "--schedule", "gpipe",
                                           "--model", _trace(t, lambda d: d.update(layers=d["layers"][:5]))],
     "cannot split 5 layers into 16 non-empty stages"),
    ("too many stages", lambda t: ["simulate", "--stages", "9"], "9 stages need 9 GPUs but dgx1-v100 has 8"),
    ("unknown family", lambda t: ["fits", "--family", "resnet"], "unknown model family 'resnet'"),
    ("unwritable output", lambda t: ["simulate", "--json", str(t / "no" / "such" / "dir.json")],
     "dir.json: cannot write (No such file or directory)"),
    ("non-integer option", lambda t: ["simulate", "--microbatches", "many"], "'many' is not a valid integer"),
    ("unknown partition", lambda t: ["simulate", "--partition", "random"],
     "unknown partition 'random': expected one of compute, memory"),
    ("unknown paper", lambda t: ["reproduce", "--out", str(t), "--only", "alexnet"],
     "unknown paper 'alexnet': expected one of mpress, mcap, tsplit"),
    ("unknown strategy in fits", lambda t: ["fits", "--strategy", "none,magic"], "unknown strategy 'magic'"),
    ("missing plan file", lambda t: ["simulate", "--plan", str(t / "nope.json")], "nope.json: cannot read plan file"),
    ("plan for another trace", lambda t: ["simulate", "--plan", _plan(t, lambda d: d.update(model="bert-0.35b"))],
     "stages cover layers 0..25 of bert-0.35b in order"),
    ("bad stripe in plan", lambda t: ["simulate", "--plan", _plan(t, lambda d: d["stages"][0]["actions"].append(
        {"layer": 1, "action": "peer", "peers": [{"gpu": 1, "fraction": 0.7}]}))],
     "plan.json: stages.0.actions.0.peers: stripe fractions must sum to 1, got 0.7"),
    ("transfer to a missing GPU", lambda t: ["topo", "transfer", "--src", "gpu0", "--dst", "gpu8", "--size", "1MB"],
     "--dst 'gpu8': expected host or a GPU of dgx1-v100 (gpu0..gpu7)"),
    ("transfer of a bad size", lambda t: ["topo", "transfer", "--src", "gpu0", "--dst", "host", "--size", "lots"],
     "--size: not a size: 'lots'"),
    ("transfer with dst and stripe", lambda t: ["topo", "transfer", "--src", "0", "--dst", "1", "--stripe", "2",
                                                "--size", "1MB"], "give exactly one of --dst and --stripe"),
    # non-finite and absurd numbers, refused at load rather than overflowing later
    ("infinite memory", lambda t: ["topo", "check", _topo_text(t, "memory_mib: .inf")],
     "server.yaml: gpu.memory_mib: Input should be a finite number"),
    ("memory beyond a float", lambda t: ["topo", "show", _topo_text(t, "memory_mib: 1e400")],
     "server.yaml: gpu.memory_mib: Input should be a finite number"),
    ("memory beyond 1 PiB", lambda t: ["simulate", "--server", _topo(t, _set(["gpu", "memory_mib"], 2.0**31))],
     "server.yaml: gpu.memory_mib: Input should be less than or equal to 1073741824"),
    ("a bandwidth of zero", lambda t: ["topo", "check", _topo(t, _set(["pcie", "gpu_link_gbps"], 0))],
     "server.yaml: pcie.gpu_link_gbps: Input should be greater than or equal to 0.000001"),
    ("no peak FLOP/s", lambda t: ["topo", "check", _topo(t, _set(["gpu", "peak_tflops"], {}))],
     "server.yaml: gpu.peak_tflops: Dictionary should have at least 1 item"),
    ("no NVLink pairs", lambda t: ["topo", "check", _topo(t, _set(["nvlink", "pairs"], []))],
     "server.yaml: nvlink.pairs: List should have at least 1 item"),
    ("infinite FLOPs", lambda t: ["simulate", "--model", _trace(t, _set(["layers", 1, "fwd_flops"], float("inf")))],
     "model.json: layers.1.fwd_flops: Input should be a finite number"),
    ("NaN FLOPs", lambda t: ["simulate", "--model", _trace(t, _set(["layers", 1, "bwd_flops"], float("nan")))],
     "model.json: layers.1.bwd_flops: Input should be a finite number"),
    ("a 30-digit byte count", lambda t: ["simulate", "--model", _trace(t, _set(["layers", 2, "act_bytes"], 10**30))],
     "model.json: layers.2.act_bytes: Input should be less than or equal to 1125899906842624"),
    ("bytes adding up past 1 PiB", lambda t: ["simulate", "--model", _trace(t, _all_layers("param_bytes", 2**46))],
     "model.json: layers: the layers' bytes add up to"),
    ("no work in any layer", lambda t: ["simulate", "--model", _trace(t, _no_work)],
     "model.json: layers: every layer has zero FLOPs, no bytes moved and no measured time"),
    ("no layers", lambda t: ["simulate", "--model", _trace(t, _set(["layers"], []))],
     "model.json: layers: List should have at least 1 item"),
    ("infinite plan fraction", lambda t: ["simulate", "--plan", _plan(t, lambda d: d["stages"][0]["actions"].append(
        {"layer": 1, "action": "peer", "peers": [{"gpu": 1, "fraction": float("inf")}]}))],
     "plan.json: stages.0.actions.0.peers.0.fraction: Input should be a finite number"),
    ("plan with too many microbatches", lambda t: ["simulate", "--plan", _plan(t, _set(["microbatches"], 10**6))],
     "plan.json: microbatches: Input should be less than or equal to 4096"),
    ("plan split absurdly", lambda t: ["simulate", "--plan", _plan(t, lambda d: d["stages"][0]["actions"].append(
        {"layer": 1, "split": 10**9}))], "plan.json: stages.0.actions.0.split: Input should be less than or equal"),
    # text that is not UTF-8, and repeated keys
    ("topology not UTF-8", lambda t: ["topo", "check", _bytes(t, "server.yaml", b"schema: 1\nname: gpu\xff\n")],
     "server.yaml: not UTF-8 text (byte 19, line 2): expected a topology file in YAML"),
    ("trace not UTF-8", lambda t: ["simulate", "--model", _bytes(t, "model.json", b'{"name": "\xe9"}')],
     "model.json: not UTF-8 text (byte 10, line 1): expected a trace file in JSON"),
    ("plan not UTF-8", lambda t: ["simulate", "--plan", _bytes(t, "plan.json", b"\xfe\xff{}")],
     "plan.json: not UTF-8 text (byte 0, line 1): expected a plan file in JSON"),
    ("duplicate YAML key", lambda t: ["topo", "check", _topo_text(t, "memory_mib: 32510\n  memory_mib: 16000")],
     "server.yaml: not valid YAML at line 12: duplicate key 'memory_mib' (first at line 11)"),
    ("duplicate JSON key", lambda t: ["simulate", "--model", _bytes(t, "model.json", b'{"schema": 1, "schema": 1}')],
     "model.json: schema: duplicate key"),
    # options
    ("fits with microbatch 0", lambda t: ["fits", "--microbatch", "0"], "microbatch must be a positive integer, got 0"),
    ("absurd microbatch count", lambda t: ["simulate", "--microbatches", "100000"],
     "--microbatches must be at most 4096 per iteration, got 100000"),
    ("absurd microbatch count in plan", lambda t: ["plan", "--microbatches", "5000", "-o", str(t / "p.json")],
     "--microbatches must be at most 4096 per iteration, got 5000"),
    ("absurd microbatch count in fits", lambda t: ["fits", "--global-microbatches", "5000"],
     "--global-microbatches must be from 1 to 4096 per iteration, got 5000"),
    ("absurd microbatch count in sweep",
     lambda t: ["sweep", "--global-microbatches", "5000", "--csv", str(t / "s.csv")],
     "--global-microbatches must be from 1 to 4096 per iteration, got 5000"),
    ("absurd microbatch size", lambda t: ["simulate", "--microbatch", str(10**30)],
     "microbatch must be at most 65536 samples"),
    ("transfer of an absurd size", lambda t: ["topo", "transfer", "--src", "0", "--dst", "host", "--size", "1e30"],
     "--size: a size must be at most 1 PiB"),
    ("empty item in a list", lambda t: ["sweep", "--microbatch", "1,,2", "--csv", str(t / "s.csv")],
     "--microbatch: expected a comma-separated list without empty items, got '1,,2'"),
    ("trailing comma", lambda t: ["fits", "--strategy", "none,"],
     "--strategy: expected a comma-separated list without empty items"),
    ("empty size item", lambda t: ["topo", "transfer", "--src", "0", "--dst", "host", "--size", "1MB,,2MB"],
     "--size: expected a comma-separated list without empty items"),
]


def _topo_text(tmp_path, replacement: str) -> str:
    """The shipped DGX-1 file with its ``memory_mib`` line replaced as text (YAML spellings)."""
    import re

    text = re.sub(r"memory_mib: .*", replacement, (ROOT / "topologies" / "dgx1-v100.yaml").read_text(), count=1)
    p = tmp_path / "server.yaml"
    p.write_text(text)
    return str(p)


def _bytes(tmp_path, name: str, data: bytes) -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


def _all_layers(key, value):
    def mutate(d):
        for row in d["layers"]:
            row[key] = value
    return mutate


def _no_work(d):
    for row in d["layers"]:
        row.update(fwd_flops=0, bwd_flops=0, fwd_mem_bytes=0, bwd_mem_bytes=0, fwd_fixed_mem_bytes=0,
                   bwd_fixed_mem_bytes=0, fwd_attention_flops=0, bwd_attention_flops=0)
        row.pop("fwd_ms", None)
        row.pop("bwd_ms", None)


def _plan(tmp_path, mutate) -> str:
    """A plan for gpt-5.3b on dgx1-v100 with ``mutate`` applied."""
    from mpsim.api import plan as make

    d = json.loads(make("dgx1-v100", "gpt-5.3b", "1f1b", 2, 16).plan.to_json())
    mutate(d)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    return str(path)


@pytest.mark.parametrize("case,argv,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_clear_line(capsys, tmp_path, case, argv, message):
    code, out, err = run(capsys, *argv(tmp_path))
    assert code == 2, (case, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("mpsim: error: ")
    assert message in lines[0]
    assert "Traceback" not in err


def test_yaml_syntax_error_names_the_line(capsys, tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("schema: 1\ngpu: [unclosed\n")
    code, _, err = run(capsys, "topo", "check", str(p))
    assert code == 2 and "broken.yaml: not valid YAML at line" in err


def _measured_trace(tmp_path, device: str) -> str:
    from helpers import layer, trace_dict

    d = trace_dict([layer(f"l{i}", 1.0, 2.0, act=1000, out=100, inp=100) for i in range(8)])
    d["source"] = {"kind": "measured", "device": device}
    p = tmp_path / "measured.json"
    p.write_text(json.dumps(d))
    return str(p)


def test_a_cpu_measured_trace_on_a_gpu_server_warns_in_one_line(capsys, tmp_path):
    trace = _measured_trace(tmp_path, "cpu (x86_64, 1 thread)")
    code, out, err = run(capsys, "simulate", "--model", trace, "--microbatches", "8")
    assert code == 0 and "iteration" in out
    assert err.strip().splitlines() == [
        "mpsim: warning: toy: times measured on cpu (x86_64, 1 thread), but dgx1-v100 has V100-SXM2-32GB GPUs; "
        "the measured times are used as they are"]
    code, _, err = run(capsys, "plan", "--model", trace, "--microbatches", "8", "-o", str(tmp_path / "p.json"))
    assert code == 0 and err.count("mpsim: warning: toy: times measured on cpu") == 1


@pytest.mark.parametrize("device,server,warns", [
    ("NVIDIA H100 80GB HBM3", "dgx1-v100", True),
    ("NVIDIA H100 80GB HBM3", "h100-x1", False),
    ("Tesla V100-SXM2-32GB", "dgx1-v100", False),
    ("hand-written", "dgx1-v100", False),
])
def test_measured_trace_warning_compares_device_kinds(capsys, tmp_path, device, server, warns):
    from mpsim.data.catalog import load_topology, load_trace
    from mpsim.models.trace import measured_elsewhere

    topo = load_topology(server)
    line = measured_elsewhere(load_trace(_measured_trace(tmp_path, device)), topo.spec.gpu.model, topo.name)
    assert (line is not None) == warns
    if warns:
        assert device in line and topo.spec.gpu.model in line  # type: ignore[operator]


def test_simulate_that_does_not_fit_says_so_first_in_half_open_layers(capsys):
    code, out, _ = run(capsys, "simulate", "--model", "gpt-10.3b", "--microbatch", "2")
    lines = out.splitlines()
    assert code == 1
    assert lines[0] == "DOES NOT FIT: gpt-10.3b on dgx1-v100: 1f1b, microbatch 2 x 16, strategy none"
    assert lines[1].startswith("  GPU 0 ran out at ") and "GiB free" in lines[1]
    assert lines[2] == "layers: megatron"
    assert lines[6].split()[:3] == ["0", "0", "[0,"] and lines[6].split()[3] == "8)"  # layers 0 to 7, as in JSON
    assert "layers [a, b) = a to b - 1" in out and "memory in GiB = 2^30 bytes" in out
    assert out.index("DOES NOT FIT") < out.index("throughput")
    assert "GB (10^9 bytes) carried" in out


def test_simulate_ends_a_run_that_does_not_fit_with_what_to_try_and_gives_tokens_per_second(capsys):
    code, out, _ = run(capsys, "simulate", "--model", "gpt-10.3b", "--microbatch", "2")
    assert code == 1
    assert out.splitlines()[-1] == (
        "hint: --strategy best tries every memory-saving plan (recompute, swaps, MPress, TSPLIT, offload); --dp 8 "
        "--zero 3 shards the model states (FSDP); `mpsim fits --model gpt-10.3b --server dgx1-v100` tries every "
        "layout, `mpsim choose --model gpt-10.3b` other servers")
    throughput = next(line for line in out.splitlines() if line.startswith("throughput"))
    found = re.match(r"throughput +([\d.]+) ± [\d.]+ samples/s, ([\d,]+) tokens/s", throughput)
    assert found is not None
    samples, tokens = found.groups()
    assert abs(float(samples) * 1024 - int(tokens.replace(",", ""))) <= 1024 * 0.005 + 1  # GPT: 1024 tokens a sample
    code, out, _ = run(capsys, "simulate", "--model", "gpt-5.3b", "--microbatch", "2")
    assert code == 0 and "hint:" not in out


def test_simulate_plot_of_a_run_that_does_not_fit_leaks_no_warnings(tmp_path):
    import subprocess
    import sys

    png = tmp_path / "m.png"
    proc = subprocess.run([sys.executable, "-m", "mpsim.cli", "simulate", "--model", "gpt-10.3b", "--plot", str(png)],
                          capture_output=True, text=True, check=False, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "Warning" not in proc.stderr and proc.stderr == ""
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_memory_plot_marks_the_out_of_memory_and_tells_host_from_peer_swaps():
    from mpsim.api import simulate
    from mpsim.views.plots import memory_figure

    oom = simulate("dgx1-v100", "gpt-10.3b", schedule="1f1b", microbatch=2, microbatches=16)
    fig = memory_figure(oom)
    ax = fig.axes[0]
    texts = [t.get_text() for t in ax.texts]
    assert any(t.startswith("out of memory on GPU 0 at ") for t in texts)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "capacity 31.46 GiB" in labels and any(t.startswith("out of memory: GPU 0") for t in labels)
    assert ax.get_title().startswith("DOES NOT FIT")

    swapped = simulate("dgx1-v100", "gpt-25.5b", schedule="1f1b", microbatch=2, microbatches=16, strategy="mpress")
    lanes = memory_figure(swapped).axes[1]
    labels = [t.get_text() for t in lanes.get_legend().get_texts()]
    assert {"to host", "from host", "to peer GPU (D2D)", "from peer GPU (D2D)"} <= set(labels)


@pytest.mark.parametrize("argv", [
    ["fits", "--server", "dgx9", "--family", "gpt"],
    ["sweep", "--server", "dgx9", "--model", "gpt-5.3b", "--microbatch", "1", "--csv", "{tmp}/s.csv"],
])
def test_errors_of_long_commands_are_one_line_without_a_blank_line_before(capsys, tmp_path, argv):
    code, _, err = run(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert code == 2
    assert err.splitlines() == [err.strip()] and err.startswith("mpsim: error: unknown server 'dgx9'")


def test_a_sweep_warns_once_per_server_of_a_trace_measured_elsewhere(capsys, tmp_path):
    trace = _measured_trace(tmp_path, "cpu (x86_64, 1 thread)")
    code, _, err = run(capsys, "sweep", "--server", "dgx1-v100,h100-x1", "--model", trace, "--microbatch", "1,2",
                       "--global-microbatches", "8", "--csv", str(tmp_path / "s.csv"))
    assert code == 0
    warnings = [line for line in err.splitlines() if line.startswith("mpsim: warning: toy: times measured on cpu")]
    assert len(warnings) == 2 and "dgx1-v100" in warnings[0] and "h100-x1" in warnings[1]


def test_the_html_report_shows_what_each_technique_saved_as_a_table(tmp_path, capsys):
    page = tmp_path / "r.html"
    code, _, _ = run(capsys, "simulate", "--model", "gpt-15.4b", "--microbatch", "2", "--strategy", "cpu-swap",
                     "--html", str(page))
    html = page.read_text()
    title = "what each technique saved at the GPU&#x27;s peak, and what it cost per iteration"
    assert code == 0 and title in html  # it fits on the DGX-1, swapping to host
    after = html[html.index(title):]
    assert after.index("<table>") < after.index("</section>") and "<th>saved host GiB</th>" in after
    assert "<pre>" not in after[:after.index("</section>")]
    timeline = html[html.index("aria-label=\"pipeline timeline\""):]
    timeline = timeline[:timeline.index("</svg>")]
    assert timeline.count('text-anchor="end"') == 1  # the last tick ends where the axis does, inside the svg
