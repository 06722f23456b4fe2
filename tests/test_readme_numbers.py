"""The README quotes figures from reports that commands regenerate; these tests hold the
quotes to the reports, so a regenerated report with other figures fails here until the
README follows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _paragraph(text: str, mark: str) -> str:
    """The README paragraph that names ``mark``, on one line."""
    return next(" ".join(p.split()) for p in text.split("\n\n") if mark in p)


def test_the_layer_figures_in_the_readme_are_those_of_reports_bench_layers():
    rows = {}
    for line in (ROOT / "reports" / "bench_layers.txt").read_text().splitlines()[2:]:
        layers, wall_s, peak_mb, *_ = line.split()
        rows[int(layers.replace(",", ""))] = (wall_s, peak_mb)
    quote = _paragraph((ROOT / "README.md").read_text(), "reports/bench_layers.txt")
    grown = re.findall(r"([\d,]+) layers[^;]*? at (\d+) MB in ([\d.]+) s", quote)
    assert len(grown) == 2
    for layers, peak_mb, wall_s in grown:
        assert rows[int(layers.replace(",", ""))] == (wall_s, peak_mb)
    refused = re.search(r"([\d,]+)-layer file is refused in one line in ([\d.]+) s", quote)
    assert refused is not None and rows[int(refused[1].replace(",", ""))][0] == refused[2]
    assert "refused in 1 line" in (ROOT / "reports" / "bench_layers.txt").read_text()


def test_the_collective_figure_in_the_readme_is_what_the_simulator_gives():
    from mpsim.data.catalog import load_topology
    from mpsim.sim.collectives import collective_time

    quote = _paragraph((ROOT / "README.md").read_text(), "mpsim topo collective`) run as one")
    found = re.search(r"\(([\d.]+) GB/s for 1 GB all-reduce on the DGX-1\)", quote)
    assert found is not None
    t = collective_time(load_topology("dgx1-v100"), "all-reduce", 10**9, list(range(8)))
    assert f"{t.busbw / 1e9:.1f}" == found[1]


def test_the_llama_3_8b_answer_in_the_readme_is_what_the_simulator_gives():
    """The data-parallel section's answer: FSDP x8 on 8 x A100 80GB (peak, samples/s,
    tokens/s) and the 1F1B pipeline on the same GPUs at the same global batch."""
    from mpsim.api import Parallelism, plan

    quote = _paragraph((ROOT / "README.md").read_text(), "Yes: FSDP over the eight GPUs")
    found = re.search(r"peaks at ([\d.]+) GiB per GPU and trains ([\d.]+) samples/s \(([\d,]+) tokens/s\)", quote)
    pipe = re.search(r"the 1F1B pipeline over the same GPUs reaches ([\d.]+)", quote)
    assert found is not None and pipe is not None
    fsdp = plan("dgx-a100-80gb", "llama-3-8b", "1f1b", 1, 2, n_stages=1,
                parallelism=Parallelism(data=8, zero_stage=3)).result
    tokens = fsdp.samples_per_s * 8192
    assert (f"{fsdp.max_peak_bytes / 2**30:.2f}", f"{fsdp.samples_per_s:.2f}", f"{tokens:,.0f}") == found.groups()
    pipeline = plan("dgx-a100-80gb", "llama-3-8b", "1f1b", 1, 16).result
    assert f"{pipeline.samples_per_s:.2f}" == pipe[1]


def test_the_data_parallel_figures_in_the_readme_are_those_of_the_reports_and_records():
    """The data-parallel section's speed and accuracy figures: reports/bench_dp.txt (dp = 8
    against dp = 2), reports/validation_dp_cpu.md (every CPU peak error) and the H100
    records in validate/results/h100_dp and h100_offload."""
    import json

    quote = _paragraph((ROOT / "README.md").read_text(), "reports/bench_dp.txt")
    bench = [line.split() for line in (ROOT / "reports" / "bench_dp.txt").read_text().splitlines()[2:]]
    events = [[int(x) for x in row[4].split("/")] for row in bench]
    assert all(e[2] <= e[1] for e in events)  # dp = 8 schedules no more events than dp = 2
    over_two = sorted(float(row[6].rstrip("x")) for row in bench)
    span = re.search(r"take ([\d.]+) to ([\d.]+) times as long", quote)
    assert span is not None and (float(span[1]), float(span[2])) == (over_two[0], over_two[-1])

    cpu = re.search(r"within (\d+)% of FSDP2, DDP and ZeroRedundancyOptimizer runs on CPU", quote)
    errors = [float(x) for x in re.findall(r"GPU \d+ ([+-][\d.]+)%", (ROOT / "reports" / "validation_dp_cpu.md")
                                           .read_text())]
    assert cpu is not None and errors and max(abs(e) for e in errors) <= float(cpu[1])

    def record(folder: str, name: str) -> dict:
        return json.loads((ROOT / "validate" / "results" / folder / f"validate_{name}.json").read_text())

    fsdp = re.search(r"within ([\d.]+)% of FSDP2 on one H100", quote)
    worst = max(abs(record("h100_dp", n)["stages"][0]["peak_error_pct"]) for n in ("fsdp1", "fsdp1_no_reshard"))
    assert fsdp is not None and f"{worst:.1f}" == fsdp[1]
    zinf = record("h100_offload", "zinf1")
    offload = re.search(r"within ([\d.]+)% of ZeRO-Infinity .* under-predicted by (\d+)%", quote)
    assert offload is not None
    peak, step = abs(zinf["stages"][0]["peak_error_pct"]), -zinf["iteration_error_pct"]
    assert (f"{peak:.1f}", f"{step:.0f}") == offload.groups()


def _report_block(name: str) -> list[str]:
    """A choose report's table and recommendation, as the README quotes them."""
    lines = (ROOT / "reports" / name).read_text().splitlines()
    table = lines[:lines.index("prices:")]
    return [x for x in table if x] + [x for x in lines if x.startswith("recommendation:")]


@pytest.mark.parametrize("model", ["llama-3-8b", "llama-3-70b"])
def test_the_choose_tables_in_the_readme_are_the_reports(model):
    readme = (ROOT / "README.md").read_text()
    start = readme.index(f"$ mpsim choose --model {model} --servers")
    quoted = [x for x in readme[start:readme.index("```", start)].splitlines()[1:] if x]
    assert quoted == _report_block(f"choose_{model}.txt")


def test_the_tensor_parallel_validation_range_in_the_readme_is_the_reports():
    rows = [x for x in (ROOT / "reports" / "validation_tp_cpu.md").read_text().splitlines() if x.startswith("| tp=2")]
    errors = [float(x.split("|")[7].strip().rstrip("%")) for x in rows]
    quote = _paragraph((ROOT / "README.md").read_text(), "reports/validation_tp_cpu.md")
    found = re.search(r"within ([+-][\d.]+)% to ([+-][\d.]+)% of the prediction", quote)
    assert found is not None and len(rows) >= 10
    assert (float(found[1]), float(found[2])) == (round(max(errors), 1), round(min(errors), 1))
    assert all(abs(e) <= 5 for e in errors)


def test_the_70b_prose_in_the_readme_is_what_the_files_say():
    """The 3-D section's figures: Llama-3-70B's model states (16 bytes a parameter), the
    40 GB A100 server's host memory (its topology file) and the DGX-1's shortfall (the report)."""
    from mpsim.data.catalog import load_topology, load_trace

    quote = _paragraph((ROOT / "README.md").read_text(), "Llama-3-70B needs about")
    states_tb = re.search(r"about ([\d.]+) TB for its weights, gradients and Adam states", quote)
    assert states_tb is not None and float(states_tb[1]) == round(load_trace("llama-3-70b").spec.params * 16 / 1e12, 1)
    prose = _paragraph((ROOT / "README.md").read_text(), "Each server's row is its best layout")
    rows = _choose_rows("choose_llama-3-70b.txt")
    speeds = re.search(r"streaming the model's states from the host, at ([\d.]+) and ([\d.]+) samples/s", prose)
    assert speeds is not None
    assert speeds.groups() == (rows["dgx1-v100"][5].split()[0], rows["a100-40gb-nvswitch"][5].split()[0])
    assert rows["dgx1-v100"][3] == rows["a100-40gb-nvswitch"][3] == "zero-infinity"
    assert load_topology("a100-40gb-nvswitch").spec.gpu.count == 8


def test_the_cluster_answer_in_the_readme_is_the_report():
    """"How many H100 servers for Llama-3-70B on 2T tokens in 30 days": the README's figures
    are the rows of reports/scale_llama-3-70b_2T.txt (made by benchmarks/make_reports.sh)."""
    quote = _paragraph((ROOT / "README.md").read_text(), "On the shipped data (`reports/scale_llama-3-70b_2T.txt`")
    report = (ROOT / "reports" / "scale_llama-3-70b_2T.txt").read_text()
    superpod, p5 = report.split("\naws-p5: ")
    rows = {int(m[1]): m for m in re.finditer(r"^(\d+)\s+\d+\s+(.+?)\s+(none|selective|recompute)\s+\d+\s+[\d.]+\s+"
                                                 r"[\d,]+\s+([\d.]+)\s+([\d,]+)", superpod, re.M)}
    pick = re.search(r"\*\*(\d+) DGX H100 servers \(([\d,]+) GPUs\), (.+?) with full recomputation: ([\d.]+) days, "
                     r"\$([\d,]+)\*\*", quote)
    assert pick is not None
    row = rows[int(pick[1])]
    assert (row[2], row[3], row[4], row[5]) == (pick[3], "recompute", pick[4], pick[5])
    assert "<- pick" in row[0] or re.search(rf"^{pick[1]}\s.*<- pick", superpod, re.M)
    assert f"64 servers would take {rows[64][4]} days" in quote
    assert f"256 servers finish in {rows[256][4]} days for ${rows[256][5]}" in quote
    assert f"512 in {rows[512][4]} days for ${rows[512][5]}" in quote
    p5_rows = {int(m[1]): float(m[2]) for m in re.finditer(r"^(\d+)\s+\d+\s+.+?\s+(?:none|selective|recompute)"
                                                          r"\s+\d+\s+[\d.]+\s+[\d,]+\s+([\d.]+)\s", p5, re.M)}
    assert "the days are within 1% of these up to 128 servers" in quote
    from mpsim.data.catalog import load_cluster

    efa = load_cluster("aws-p5").spec.fabric
    assert f"On AWS p5 (EFA, {efa.latency_us:g} us a step, {efa.efficiency:.0%} of line rate)" in quote
    assert all(abs(p5_rows[n] / float(rows[n][4]) - 1) < 0.01 for n in (16, 32, 64, 128))
    p5_256 = re.search(r"^256\s+.*?\s([\d.]+)\s+[\d,]+\s+[\d.]+\s*pareto", p5, re.M)
    assert p5_256 is not None and f"256 take {p5_256[1]} days instead of {rows[256][4]}" in quote
    price = re.search(r"^dgx-h100-superpod: .*?; \$([\d.]+) a server-hour", report, re.M)
    assert price is not None and f"at the p5 list price of ${price[1]} a server-hour" in quote
    simulated = sum(int(n) for n in re.findall(r"(\d+) configurations simulated", report))
    assert f"{simulated} configurations" in quote


def test_the_cluster_cost_of_a_simulation_in_the_readme_is_the_benchmark():
    quote = _paragraph((ROOT / "README.md").read_text(), "reports/bench_cluster.txt")
    rows = [line.split() for line in (ROOT / "reports" / "bench_cluster.txt").read_text().splitlines()[2:]
            if len(line.split()) >= 7]
    big = [r for r in rows if r[0] == "16,384" or r[0] == "16384"]
    assert big, rows
    gb = max(float(r[-3]) for r in big) / 1024
    assert f"simulates in a few seconds, {gb:.1f} GB of memory" in quote
    assert max(float(r[-5]) for r in big) < 10  # "a few seconds", cold
    text = (ROOT / "reports" / "bench_cluster.txt").read_text()
    local = re.search(r"search on local \(2 CPUs\): (\d+) configurations in (\d+) s", text)
    ray = re.search(r"search on ray \(2 CPUs\): (\d+) configurations in (\d+) s", text)
    assert local and ray and "same answer on both: True" in text
    assert (f"the search below, {local[1]} configurations, takes {local[2]} s on two local worker processes and "
            f"{ray[2]} s on a local Ray instance of two CPUs, with the same answer") in quote


def test_the_fits_example_in_the_readme_is_reports_fits_dgx1_gpt_1f1b_layouts():
    """The README's first example output is the command's output as make_reports.sh wrote it."""
    text = (ROOT / "README.md").read_text()
    command = "$ mpsim fits --server dgx1-v100 --family gpt --schedule 1f1b --microbatch 2\n"
    start = text.index(command)
    block = text[start:text.index("```", start)].split("\n", 1)[1]
    assert block == (ROOT / "reports" / "fits_dgx1_gpt_1f1b_layouts.txt").read_text()


def test_the_simulate_example_in_the_readme_is_what_the_command_prints():
    """Each line the README shows of its `mpsim simulate` example (``...`` stands for the
    lines left out) is a line of the command's output today, in the same order."""
    from helpers import run_cli

    text = (ROOT / "README.md").read_text()
    command = ("$ mpsim simulate --server dgx-a100-80gb --model llama-3-8b --dp 8 --zero 3 --microbatch 1 "
               "--microbatches 2")
    start = text.index(command)
    shown = [x for x in text[start:text.index("```", start)].splitlines()[1:] if x and x != "..."]
    code, out, _ = run_cli(300, *command.split()[2:])
    lines = out.splitlines()
    assert code == 0 and shown
    at = [lines.index(x) for x in shown]  # each shown line is printed
    assert at == sorted(at)


def test_the_resnet50_example_in_the_readme_is_what_the_commands_give(tmp_path):
    pytest.importorskip("torch")
    from helpers import run_cli

    quote = re.search(r"titanrtx-x1 +# fits: peak ([\d.]+) GiB, ([\d.]+) samples/s", (ROOT / "README.md").read_text())
    layers = re.search(r"resnet50 -o resnet50\.json +# (\d+) layers", (ROOT / "README.md").read_text())
    assert quote is not None and layers is not None
    trace = tmp_path / "resnet50.json"
    assert run_cli(300, "trace", "--module", "mpsim.models.cnn:resnet50", "-o", str(trace))[0] == 0
    from mpsim.api import plan
    from mpsim.data.catalog import load_trace

    assert len(load_trace(str(trace)).spec.layers) == int(layers[1])

    r = plan("titanrtx-x1", str(trace), "1f1b", None, 16).result
    assert r.fits and (f"{r.max_peak_bytes / 2**30:.2f}", f"{r.samples_per_s:.2f}") == quote.groups()


def test_the_search_speed_figures_in_the_readme_are_the_benchmarks():
    """The Speed section's engine, closed-form tier and fits figures are those the
    benchmarks wrote (bench_engine_vs.sh, bench_floors.py, bench_fits_vs.sh)."""
    reports = ROOT / "reports"
    text = " ".join((ROOT / "README.md").read_text().split())
    engine = (reports / "bench_engine_vs.txt").read_text()

    def ms(plan: str, side: str) -> str:
        found = re.search(rf"^{plan} {side} ms per simulated iteration, median of \d+ runs: ([\d.]+)$", engine, re.M)
        assert found, (plan, side)
        return found[1]

    def ratio(plan: str, what: str) -> float:
        found = re.search(rf"^{plan} whole process A/B {what}\s+[\d.]+\s+([\d.]+)", engine, re.M)
        assert found, (plan, what)
        return float(found[1])

    heavy_a, heavy_b = ms("swap-heavy", "A"), ms("swap-heavy", "B")
    assert (f"swap-heavy {heavy_a} ms per simulated iteration against {heavy_b} "
            f"({float(heavy_a) / float(heavy_b):.2f}x; whole process {ratio('swap-heavy', 'wall'):.2f}x), "
            f"keep {ms('keep', 'A')} against {ms('keep', 'B')} "
            f"({float(ms('keep', 'A')) / float(ms('keep', 'B')):.2f}x)") in text
    floors = {line.split()[0]: line for line in (reports / "bench_floors.txt").read_text().splitlines()[1:]}
    fits_row = re.search(r"yes\s+[\d.]+s\s+[\d.]+s\s+([\d.]+)\s+probes: (\d+) decided .*every: (\d+) simulated",
                         floors["fits"])
    choose_row = re.search(r"yes\s+[\d.]+s\s+[\d.]+s\s+([\d.]+)\s+plans: (\d+) decided .*every: (\d+) simulated",
                           floors["choose"])
    assert fits_row and choose_row
    assert (f"the same answer with {fits_row[2]} of its {fits_row[3]} probes decided by the floors, "
            f"{fits_row[1]}x the time") in text.replace("gives the same", "the same")
    assert f"the same answer with {choose_row[2]} of its {choose_row[3]} plans decided, {choose_row[1]}x" in text
    from mpsim.api import parse_servers

    assert f"over every server ({len(parse_servers('all', '1f1b', 16))} of them now)" in text
    fits_vs = (reports / "bench_fits_vs.txt").read_text()
    wall = {side: re.search(rf"^{side} wall s\s+[\d.]+\s+([\d.]+)", fits_vs, re.M) for side in ("A", "B")}
    wall_ratio = re.search(r"^A/B wall\s+[\d.]+\s+([\d.]+)", fits_vs, re.M)
    assert wall["A"] and wall["B"] and wall_ratio and "same table: yes" in fits_vs
    assert (f"{float(wall['A'][1]):.1f} s against {float(wall['B'][1]):.1f} s wall "
            f"({float(wall_ratio[1]):.2f}x), the same table") in text
    cpu = re.search(r"^A cpu s\s+[\d.]+\s+([\d.]+)", fits_vs, re.M)
    assert cpu and f"spread over 2 cores would still take {float(cpu[1]) / 2:.1f} s" in text
    bert = (reports / "bench_best_bert.txt").read_text()
    bert_wall = re.search(r"^([\d.]+) s wall", bert, re.M)
    bert_largest = re.search(r"\((\d+) layers at the shape of (\S+)\)", bert)
    assert bert_wall and bert_largest
    assert f"takes {float(bert_wall[1]):.1f} s (`benchmarks/bench_best_bert.sh`" in text
    assert f"its largest {bert_largest[1]} layers at the shape of {bert_largest[2]})" in text
    for plan in ("keep", "swap-recompute", "swap-heavy"):
        python_ms, events = _per_iteration(reports / f"bench_simulate_{plan}.txt", "python")
        compiled_ms, compiled_events = _per_iteration(reports / f"bench_simulate_{plan}_compiled.txt", "compiled")
        assert compiled_events == events  # the compiled engine schedules the same events
        assert f"(`--plan {plan}`) | {python_ms} | {compiled_ms} | {events:,} |" in text
        if plan == "swap-heavy":
            assert float(compiled_ms) <= 50 < float(python_ms)
            assert f"missed by the Python one ({float(python_ms) / 50:.2f}x)" in text
    pipedream = [_per_iteration(reports / f"bench_simulate_pipedream{tail}.txt", engine)
                 for tail, engine in (("", "python"), ("_compiled", "compiled"))]
    assert pipedream[0][1] == pipedream[1][1]
    assert f"per iteration | {pipedream[0][0]} | {pipedream[1][0]} | {pipedream[0][1]:,} |" in text
    native_vs = (reports / "bench_native_vs.txt").read_text()
    native_ms = dict(re.findall(r"^(swap-heavy [AB]|keep [AB]) ms per simulated iteration, median of \d+ runs: "
                                r"([\d.]+)", native_vs, re.M))
    fits = dict(re.findall(r"^fits ([AB] wall s|A/B wall)\s+[\d.]+\s+([\d.]+)", native_vs, re.M))
    assert "fits same table: yes" in native_vs
    same = re.search(r"^(\d+) jobs compared \(\d+ refused alike\), 0 differences; events (\d+) -> \2$",
                     (reports / "engine_equivalence_native.txt").read_text(), re.M)
    assert same and (f"compares the two over {same[1]} jobs (every strategy, layout and schedule) with 0 "
                     f"differences and {int(same[2]):,} events on each side") in text
    build_s = re.search(r"^build s ([\d.]+)$", native_vs, re.M)
    assert build_s and f"to C with mypyc in {float(build_s[1]):.0f} s on two cores" in text
    assert (f"swap-heavy {native_ms['swap-heavy A']} against {native_ms['swap-heavy B']} ms per simulated "
            f"iteration, keep {native_ms['keep A']} against {native_ms['keep B']}") in text
    assert (f"first command {float(fits['A wall s']):.1f} s against {float(fits['B wall s']):.1f} s wall "
            f"({float(fits['A/B wall']):.2f}x), the same table") in text


def _per_iteration(report: Path, engine: str) -> tuple[str, int]:
    """A ``bench_simulate`` report's ms per simulated iteration and events per run; it
    must have run on ``engine``."""
    text = report.read_text()
    per_iteration = re.search(r"wall per iteration\s+([\d.]+) ms", text)
    events = re.search(r"simpy events\s+(\d+) per run", text)
    assert per_iteration and events and re.search(rf"^engine\s+{engine} ", text, re.M), report
    return per_iteration[1], int(events[1])


def _choose_rows(name: str) -> dict[str, list[str]]:
    """A choose report's rows by server: GPUs, fits, layout, plan, mb, samples/s, tokens/s,
    max peak, capacity, USD/h, USD/M samples, USD/M tokens (columns are two spaces apart)."""
    rows = {}
    for line in (ROOT / "reports" / name).read_text().splitlines():
        if re.match(r"^\d+\. ", line):
            server, *cells = re.split(r"\s{2,}", line.strip())
            rows[server.split(". ", 1)[1]] = cells
    return rows


def test_the_selective_recompute_figures_in_the_readme_are_what_the_simulator_gives():
    """The `selective` strategy's example (gpt-5.3b, dgx1-v100, 1F1B, microbatch 2 x 16):
    peak and samples/s under selective, none (kept) and recompute-all (fully recomputed)."""
    from mpsim.api import plan

    quote = _paragraph((ROOT / "README.md").read_text(), "Strategies (`--strategy`): `none`")
    found = re.search(r"on gpt-5\.3b, dgx1-v100, 1F1B, peak ([\d.]+) GiB at ([\d.]+) samples/s against ([\d.]+) GiB "
                      r"at ([\d.]+) kept and ([\d.]+) GiB at ([\d.]+) fully recomputed", quote)
    assert found is not None
    simulated = []
    for strategy in ("selective", "none", "recompute-all"):
        r = plan("dgx1-v100", "gpt-5.3b", "1f1b", 2, 16, strategy=strategy).result
        assert r.fits
        simulated += [f"{r.max_peak_bytes / 2**30:.1f}", f"{r.samples_per_s:.2f}"]
    assert tuple(simulated) == found.groups()


def test_the_servers_that_get_fsdp_x8_in_the_readme_are_those_of_reports_choose_llama_3_8b():
    """The data-parallel section: on which 8-GPU servers `choose --model llama-3-8b` picks
    FSDP x8, and what it picks on the others (the faster plan passed over being at risk)."""
    quote = _paragraph((ROOT / "README.md").read_text(), "Yes: FSDP over the eight GPUs")
    rows = _choose_rows("choose_llama-3-8b.txt")
    names = {"dgx-a100-80gb": "the 80 GB A100s", "dgx-h100": "the H100s", "a100-40gb-nvswitch": "the 40 GB A100s",
             "dgx1-v100": "the DGX-1"}
    fsdp8 = [names[s] for s, cells in rows.items() if cells[2] == "FSDP x8"]
    assert len(rows) == 4 and len(fsdp8) == 2
    assert f"says the same on two of the four 8-GPU servers, {fsdp8[0]} and {fsdp8[1]} (the table below)" in quote
    assert f"on the 40 GB A100s it picks {rows['a100-40gb-nvswitch'][2]}" in quote
    assert f"and on the DGX-1 {rows['dgx1-v100'][2]}." in quote
    passed = re.search(r"a faster plan on a100-40gb-nvswitch \(([^,]+), [\d.]+ samples/s\) is at risk",
                       (ROOT / "reports" / "choose_llama-3-8b.txt").read_text())
    assert (passed is None) == ("is faster but at risk" not in quote)
    assert passed is None or f"({passed[1]} is faster but at risk)" in quote


def test_the_tie_in_the_readme_is_reports_choose_llama_3_8b():
    quote = _paragraph((ROOT / "README.md").read_text(), "Every throughput carries a band")
    rows = _choose_rows("choose_llama-3-8b.txt")
    assert (f"Llama-3-8B costs USD {rows['dgx-a100-80gb'][11]} per million tokens on 8 x A100 80GB and "
            f"{rows['dgx-h100'][11]} on 8 x H100, and the answer says the simulation cannot tell them apart") in quote
    assert re.search(r"^recommendation: dgx-h100: .*a tie within the time model's ±[\d.]+% band with [^:]*"
                     r"dgx-a100-80gb: which is better, the simulation cannot tell",
                     (ROOT / "reports" / "choose_llama-3-8b.txt").read_text(), re.M)
    kernel = (ROOT / "reports" / "kernel_time.md").read_text()
    bf16 = kernel[kernel.index("### bf16"):kernel.index("### fp32")]
    rms = re.search(r"Unfitted table: rms error ([\d.]+)% over", bf16)
    assert rms is not None
    assert (f"else ±{float(rms[1]):.0f}%, the unfitted H100 kernel table's rms error on our measured H100 "
            "layers") in quote


def test_the_3d_rows_in_the_readme_prose_are_reports_choose_llama_3_70b():
    prose = _paragraph((ROOT / "README.md").read_text(), "Each server's row is its best layout")
    rows = _choose_rows("choose_llama-3-70b.txt")
    h100, a100 = rows["dgx-h100"], rows["dgx-a100-80gb"]
    assert (a100[1], a100[2], a100[3]) == ("yes", "TP x8+SP", "cpu-swap")
    assert f"sequence parallelism (`{a100[2]}`), swapping to host memory (`{a100[3]}`)" in prose
    assert (h100[1], h100[2], h100[3]) == ("yes", "FSDP x8", "zero-infinity")
    assert f"(`{h100[2]}`) with ZeRO-Infinity's" in prose and f"(`{h100[3]}`), faster but dearer" in prose
    assert float(h100[5].split()[0]) > float(a100[5].split()[0]) and float(h100[11]) > float(a100[11])


def test_the_presets_sentence_in_the_readme_is_reports_presets_8gpu():
    """Seven presets; Llama-2-7B fits on both servers under every strategy, at most 35.0
    GiB; Llama-3-70B fits on both, and only under `best` (its offload fallback)."""
    quote = _paragraph((ROOT / "README.md").read_text(), "`reports/presets_8gpu.md` has the")
    cells: dict[tuple[str, str], list[str]] = {}
    for section in (ROOT / "reports" / "presets_8gpu.md").read_text().split("### ")[1:]:
        server = section.split(":", 1)[0]
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
                if line.startswith("| ") and not line.startswith("| model") and "---" not in line]
        assert len(rows) == 7 and "the seven public presets on 8 x A100 80GB and 8 x H100" in quote
        cells.update({(server, row[0]): row[3:] for row in rows})
    servers = ("dgx-a100-80gb", "dgx-h100")
    assert sorted({s for s, _ in cells}) == list(servers)
    small = [cells[(s, "llama-2-7b")] for s in servers]
    assert not any(c.startswith("OOM") for row in small for c in row)
    peak = max(float(c.split("G")[0]) for row in small for c in row)
    assert f"Llama-2-7B fits on either with room to spare, {peak:.1f} GiB at most per GPU" in quote
    big = {s: [not c.startswith("OOM") for c in cells[(s, "llama-3-70b")]] for s in servers}
    assert big == {"dgx-a100-80gb": [False, False, False, True], "dgx-h100": [False, False, False, True]}  # best
    assert "Llama-3-70B fits on either only under `best`, which offloads to the host" in quote


def test_the_cpu_and_h100_validation_figures_in_the_readme_are_the_reports():
    text = (ROOT / "README.md").read_text()
    cpu = [(row[0], row[2:]) for row in _md_rows("validation_cpu.md")]
    keep_recompute = [float(e.rstrip("%")) for name, r in cpu if name.startswith(("keep", "recompute every"))
                      for e in r[:2]]
    selective = [float(e.rstrip("%")) for name, r in cpu if name.startswith("selective") for e in r[:2]]
    swap = next(r for name, r in cpu if name.startswith("host swap"))
    swap0, swap1 = (float(e.strip("*").rstrip("%")) for e in swap[:2])
    iteration = [float(r[2].rstrip("%")) for _, r in cpu]
    assert len(keep_recompute) == 6 and len(selective) == 2 and all(e < 0 for e in iteration)
    assert min(keep_recompute + selective) > 0 and swap0 > 0 > swap1
    quote = _paragraph(text, "`reports/validation_cpu.md` has the tables")
    assert (f"peak memory per stage within {min(keep_recompute):+.1f}% to {max(keep_recompute):+.1f}% for keep and "
            f"recompute-all plans and {min(selective):+.1f}% to {max(selective):+.1f}% for selective recompute "
            f"(never under), host swap over by {swap0:.1f}% on stage 0 and under by {-swap1:.1f}% on stage 1; "
            f"iteration time under by {-max(iteration):.1f}% to {-min(iteration):.1f}%") in quote
    h100 = {row[0].split()[0]: row for row in _md_rows("validation_h100.md")}
    quote = _paragraph(text, "`reports/validation_h100.md`")
    times = sorted(float(r[6].rstrip("%")) for r in h100.values())
    assert (f"peak memory {h100['keep'][3]} (keep), {h100['recompute'][3]} (recompute), {h100['selective'][3]} "
            f"(selective recompute), {h100['host'][3].strip('*')} (host swap); iteration time "
            f"{times[0]:+.1f}% to {times[-1]:+.1f}%") in quote


def _md_rows(name: str) -> list[list[str]]:
    """The body rows of a report's first markdown table, cell by cell."""
    lines = (ROOT / "reports" / name).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    table = lines[start:end]
    return [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]


def test_the_cpu_iteration_errors_of_data_and_tensor_parallel_runs_in_the_readme_are_the_reports():
    quote = _paragraph((ROOT / "README.md").read_text(), "Collectives (`mpsim topo collective`) run as one")
    dp = [-float(r[4].rstrip("%")) for r in _md_rows("validation_dp_cpu.md")]
    assert len(dp) >= 7 and f"is under-predicted by {min(dp):.1f}% to {max(dp):.1f}% (gloo's" in quote
    tp = [float(m[2]) / float(m[1]) for m in
          (re.search(r"(\d+) / (\d+) ms", r[8]) for r in _md_rows("validation_tp_cpu.md")) if m]
    assert len(tp) >= 10 and f"on CPU its iteration time is {min(tp):.1f}-{max(tp):.1f}x the prediction" in quote


def test_the_hf_llama_extra_bytes_in_the_readme_are_what_the_tracers_give():
    """A Llama-2-7B block of transformers' modules keeps 4*s*b*h - 8*s*d bytes more than
    mpsim's own preset layer (tests/test_hf.py has the terms); the shares of both presets."""
    pytest.importorskip("transformers")
    from dataclasses import replace

    from mpsim.models import hf
    from mpsim.models.tracer import trace_model
    from mpsim.models.workloads import PRESETS

    quote = _paragraph((ROOT / "README.md").read_text(), "so a Llama-2-7B block keeps")
    found = re.search(r"a Llama-2-7B block keeps 4\*s\*b\*h - 8\*s\*d bytes \((\d+)%\) more than mpsim's own `--preset "
                      r"llama-2-7b` layer with its fused RMSNorm, Llama-3-70B's (\d+)% more", quote)
    assert found is not None
    shares = []
    for preset in ("llama-2-7b", "llama-3-70b"):
        cfg, mb, recipe = PRESETS[preset]
        ours = trace_model(replace(cfg, layers=2), mb, recipe).spec.layers[1].act_bytes
        theirs = hf.trace_hf(preset, overrides={"layers": 2}).spec.layers[1].act_bytes
        if preset == "llama-2-7b":
            assert theirs - ours == 4 * cfg.seq_len * mb * cfg.hidden - 8 * cfg.seq_len * cfg.head_dim
        shares.append(f"{(theirs / ours - 1) * 100:.0f}")
    assert tuple(shares) == found.groups()


def test_the_mpress_fig9_figures_in_the_readme_are_reports_mpress():
    quote = _paragraph((ROOT / "README.md").read_text(), "Fig. 9's")
    report = (ROOT / "reports" / "mpress.md").read_text()
    x100 = re.search(r"^\| dgx1-v100 \| 1\.000 \| 1\.000 \| 1\.000 \| [\d.]+ s / [\d.]+ s \(([\d.]+)\) \|$",
                     report, re.M)
    d2d = re.search(r"^\| dgx1-v100 \| [\d.]+ s \| [\d.]+ s \([\d.]+\) \| [\d.]+ s \(1\.000\) \| "
                    r"[\d.]+ s \(([\d.]+)\) \| [\d.]+ s \(([\d.]+)\) \|$", report, re.M)
    paper = re.search(r"The paper: on the DGX-1 mapping adds ([\d.]+)% and striping ([\d.]+)%", report)
    assert x100 and d2d and paper and float(x100[1]) < 1.01
    assert "our default plan for GPT-15.4B runs under 1% faster even with 100x faster NVLinks" in quote
    gains = [f"{(float(g) - 1) * 100:.1f}%" for g in d2d.groups()]
    assert (f"the fastest neighbour and striping gain {gains[0]} and {gains[1]} over the slowest neighbour, "
            f"against the paper's {paper[1]}% and {paper[2]}% (`reports/mpress.md`)") in quote


def test_the_planner_sweep_and_fits_figures_in_the_readme_are_the_benchmarks():
    """The Speed section's planners table: reports/bench_planners.txt (the latest run),
    bench_sweep.txt (its first, 1,000-point run) and bench_fits.txt."""
    text = " ".join((ROOT / "README.md").read_text().split())
    planners = (ROOT / "reports" / "bench_planners.txt").read_text()
    mapping = re.search(r"^device-mapping search, dgx1-v100 \(8 GPUs, 40320 maps\): (\d+) ms", planners, re.M)
    partition = re.search(r"^memory-balanced partition, 100 layers over 8 GPUs .*?: ([\d.]+) ms", planners, re.M)
    mpress = re.search(r"^MPress plan, gpt-25\.5b on dgx1-v100: ([\d.]+) s, (\d+) simulations", planners, re.M)
    assert mapping and partition and mpress
    assert f"| 133 ms | 132 ms ({mapping[1]} ms in the latest run) |" in text
    assert f"| 1.8 ms | 1.8 ms ({partition[1]} ms in the latest run) |" in text
    assert f"{mpress[1]} s ({mpress[2]} simulations) in the latest run" in text
    sweep = (ROOT / "reports" / "bench_sweep.txt").read_text().split("\n\n")[0]
    one = re.search(r"1 worker \(in process\): 1000 points in ([\d.]+) s", sweep)
    two = re.search(r"2 workers: 1000 points in ([\d.]+) s = [\d.]+ points/s, ([\d.]+)x", sweep)
    ray = re.search(r"local Ray, 2 CPUs: 1000 points in ([\d.]+) s = [\d.]+ points/s, ([\d.]+)x", sweep)
    init = re.search(r"ray\.init, local instance with 2 CPUs: ([\d.]+) s", sweep)
    overhead = re.search(r"([\d.]+) ms per task of one trivial point; ([\d.]+) ms per trivial point in tasks of 8",
                         sweep)
    assert one and two and ray and init and overhead
    assert (f"{one[1]} s on 1 worker, {two[1]} s on 2 ({two[2]}x), {ray[1]} s on local Ray with 2 CPUs ({ray[2]}x; "
            f"`ray.init` {init[1]} s apart)") in text
    assert (f"{overhead[1]} ms per task of one point; {float(overhead[2]):.2f} ms per point in tasks of 8") in text
    loaded = re.search(r"^local Ray, 2 CPUs: 200 points in [\d.]+ s = [\d.]+ points/s, ([\d.]+)x",
                       (ROOT / "reports" / "bench_sweep.txt").read_text(), re.M)
    assert loaded and f"an earlier run under load had Ray at {loaded[1]}x" in text
    fits_vs = re.search(r"^A wall s\s+[\d.]+\s+([\d.]+)", (ROOT / "reports" / "bench_fits_vs.txt").read_text(), re.M)
    assert fits_vs and f"met since, {float(fits_vs[1]):.1f} s over five layouts" in text
    fits = (ROOT / "reports" / "bench_fits.txt").read_text()
    before = re.search(r"^before .*?:\s+([\d.]+) s wall", fits, re.M)
    after = re.search(r"^\+ best's search probes one layer past .*?:\s+([\d.]+) s wall", fits, re.M)
    ratio = re.search(r"^ratio: ([\d.]+)x faster", fits, re.M)
    assert before and after and ratio
    assert (f"then {float(before[1]):.0f} s before and {float(after[1]):.0f} s after `best`'s probes run their "
            f"planners in parallel and its search probes one layer past the single planners' largest first "
            f"({ratio[1]}x, same table; `reports/bench_fits.txt`)") in text


def test_the_golden_job_count_in_the_readme_is_benchmarks_golden():
    import importlib.util

    spec = importlib.util.spec_from_file_location("golden", ROOT / "benchmarks" / "golden.py")
    assert spec is not None and spec.loader is not None
    golden = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(golden)
    n = len(golden.TRACES) * len(golden.SERVERS) * len(golden.SCHEDULES) * len(golden.STRATEGIES)
    words = {3: "three", 7: "seven"}
    text = " ".join((ROOT / "README.md").read_text().split())
    assert (f"for {n:,} jobs, all shipped traces of mpsim's own layers x {words[len(golden.SERVERS)]} servers x "
            f"{words[len(golden.SCHEDULES)]} schedules x {words[len(golden.STRATEGIES)]} strategies") in text


def test_the_time_model_paragraph_in_the_readme_is_what_the_tables_give():
    """The kernel-table section: the H100 table's rms error on our layers, and how much faster
    the DGX-1 would run GPT-5.3B with the V100's transferred table than with its roofline."""
    from mpsim.data.catalog import load_topology, load_trace
    from mpsim.hardware.gpu_tables import H100_LAYER_RMS_PCT
    from mpsim.timing.costs import cost_model

    quote = _paragraph((ROOT / "README.md").read_text(), "Layer times come kernel by kernel")
    assert f"checked against our measured H100 layers,\n{H100_LAYER_RMS_PCT:g}% rms)".replace("\n", " ") in quote
    gpu = load_topology("dgx1-v100").spec.gpu
    trace = load_trace("gpt-5.3b")
    roof, kern = (cost_model(trace, gpu.model_copy(update={"time_model": m})).layer_times for m in
                  ("roofline", "kernels"))
    ratio = (roof.fwd_s.sum() + roof.bwd_s.sum()) / (kern.fwd_s.sum() + kern.bwd_s.sum())
    assert f"about {ratio:.1f}x faster than today" in quote
