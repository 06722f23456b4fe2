"""The ``mpsim`` command: thin subcommands over the library.

Every subcommand prints a readable table, writes ``--json FILE`` (``-`` for standard
output) on request, and ends bad input with one line on standard error and exit code 2.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from mpsim.errors import MpsimError
from mpsim.trace import RECIPE_HELP

if TYPE_CHECKING:
    from mpsim.workloads import Family

_SERVER_HELP = "shipped server name (see `mpsim topo list`) or a topology YAML file"
_SCHEDULE_HELP = "gpipe, 1f1b (DAPPLE, PipeDream-Flush) or pipedream (asynchronous, weight stashing)"
_MICROBATCHES_HELP = ("microbatches per iteration, at most 4096; 1f1b and pipedream need at least one per "
                      "stage")
_STRATEGY_HELP = ("memory-saving strategy: none; recompute (checkpoint transformer layers or module blocks, "
                  "fewest first, until each GPU fits); recompute-segments (the same layers, a run of consecutive ones "
                  "keeping one checkpoint and re-run whole, as Chen et al. 2016 and GPipe); recompute-all (every "
                  "one); "
                  "selective (recompute only the attention core of every transformer layer, Korthikanti et al. "
                  "2022); cpu-swap (MPress's GPU-CPU swap baseline: to host memory until it fits, each copy on "
                  "demand, the compute waiting for it); host-swap (the same, overlapped and prefetched); "
                  "d2d (swap to spare memory of NVLink peers); mpress "
                  "(host swap, recompute and D2D with device mapping; ablations mpress-no-mapping, "
                  "mpress-no-striping, mpress-d2d-only); tsplit (swap, recompute and tensor splitting by "
                  "TSPLIT's cost model); best (every planner under both partitions, the fastest that fits)")
_PARTITION_HELP = ("layers to stages: compute (balance compute time, as PipeDream/DAPPLE) or memory "
                   "(balance predicted peak memory, mCAP)")


def _emit(json_out: str | None, text: str, data: dict) -> None:
    """A command's result: ``text`` for a person (unless the JSON goes to stdout) and
    ``data`` as JSON where ``--json`` says."""
    if json_out != "-":
        click.echo(text)
    _write_json(json_out, data)


def _write_json(target: str | None, data: dict) -> None:
    if not target:
        return
    text = json.dumps(data, indent=1)
    if target == "-":
        click.echo(text)
    else:
        Path(target).write_text(text + "\n")


def _warn_measured_elsewhere(trace, topo) -> None:
    """One line on stderr when a measured trace's times come from another kind of device."""
    from mpsim.trace import measured_elsewhere

    line = measured_elsewhere(trace, topo.spec.gpu.model, topo.name)
    if line:
        click.echo(f"mpsim: warning: {line}", err=True)


def _progress(what: str):
    """A progress bar on stderr for a terminal; nothing (not even a blank line) in a log."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    return Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                    TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal)


class _PointsBar:
    """Points done, failed and left, with the time left, for a run of many points on any
    backend; drawn on a terminal only. Points found already done (a resumed sweep) are
    counted apart, so they do not make the estimate of the time left look fast."""

    def __init__(self, bar: Any, total: int):
        self.bar, self.total = bar, total
        self.done = self.failed = self.resumed = 0
        self.job = bar.add_task("", total=total, done=0, failed=0, left=total, resumed="")

    def _show(self, description: str) -> None:
        finished = self.done + self.failed
        self.bar.update(self.job, total=self.total - self.resumed, completed=finished, description=description,
                        done=self.done, failed=self.failed, left=self.total - self.resumed - finished,
                        resumed=f" ({self.resumed} already done)" if self.resumed else "")

    def point_done(self, description: str = "", resumed: bool = False) -> None:
        if resumed:
            self.resumed += 1
        else:
            self.done += 1
        self._show(description)

    def point_failed(self, description: str = "") -> None:
        self.failed += 1
        self._show(description)


@contextmanager
def _points_progress(what: str, total: int) -> Iterator[_PointsBar]:
    """A progress bar over points: done, failed, left, elapsed and estimated time left."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    console = Console(stderr=True)
    columns = (TextColumn(what), BarColumn(),
               TextColumn("done {task.fields[done]}, failed {task.fields[failed]}, left {task.fields[left]}"
                          "{task.fields[resumed]}"),
               TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(), TextColumn("{task.description}"))
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        yield _PointsBar(bar, total)


def _backend_options(f):
    """--backend, --address: where the points run (:mod:`mpsim.backends`)."""
    for opt in reversed([
        click.option("--backend", type=click.Choice(["local", "ray"]), default="local", show_default=True,
                     help="local worker processes, or tasks on a Ray cluster (pip install 'mpsim[ray]')"),
        click.option("--address", help="Ray cluster: auto (the one `ray start` joined this machine to) or "
                                       "HOST:PORT of its head  [default: a Ray instance started here, -j CPUs]"),
    ]):
        f = opt(f)
    return f


@contextmanager
def _tasks_progress(what: str) -> Iterator[None]:
    """Simulated tasks counted on a terminal while a simulate or plan runs (a planner
    simulates many candidate plans, so there is no total)."""
    from mpsim.sim.progress import reporting

    with _progress(what) as bar:
        job = bar.add_task("tasks simulated", total=None)
        count = [0]

        def on_task() -> None:  # the bar is updated every 256 tasks, so it costs nothing
            count[0] += 1
            if count[0] % 256 == 0:
                bar.advance(job, 256)

        with reporting(on_task):
            yield


def _json_option(f):
    return click.option("--json", "json_out", metavar="FILE",
                        help="write the result as JSON to FILE ('-' for stdout)")(f)


def _html_option(f):
    return click.option("--html", "html_out", type=click.Path(dir_okay=False, path_type=Path),
                        help="write the same views as one self-contained HTML file (inline CSS and SVG charts, "
                             "nothing fetched)")(f)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="mpsim")
def app() -> None:
    """Will this model train on this server, with which memory plan, and how fast?

    mpsim simulates pipeline-parallel training (GPipe, 1F1B, PipeDream) of a traced model
    on a multi-GPU server described by a topology file, and reports per-GPU peak memory,
    iteration time and throughput.

    \b
    Examples:
      mpsim fits --server dgx1-v100 --family gpt --schedule 1f1b --microbatch 2
      mpsim simulate --server dgx1-v100 --model gpt-5.3b --microbatches 16 --json out.json
      mpsim simulate --server dgx-a100-80gb --model llama-2-7b
      mpsim choose --model llama-3-8b --servers dgx-a100-80gb,dgx-h100
      mpsim trace --hf llama-3-70b -o llama.json
      mpsim topo show dgx1-v100
    """


def _job_options(f):
    """Options shared by simulate and plan."""
    for opt in reversed([
        click.option("--server", "-s", help=_SERVER_HELP + "  [default: the plan's, else dgx1-v100]"),
        click.option("--model", "-m", help="shipped model name (see traces/) or a trace JSON file"
                                           "  [default: the plan's, else gpt-5.3b]"),
        click.option("--schedule", default="1f1b", show_default=True, help=_SCHEDULE_HELP),
        click.option("--microbatch", type=int, help="samples per microbatch  [default: the trace's]"),
        click.option("--microbatches", type=int, default=16, show_default=True, help=_MICROBATCHES_HELP),
        click.option("--stages", type=int, help="pipeline stages  [default: one per GPU]"),
        click.option("--strategy", default="none", show_default=True, help=_STRATEGY_HELP),
        click.option("--partition", default="compute", show_default=True, help=_PARTITION_HELP),
    ]):
        f = opt(f)
    return f


@app.command()
@_job_options
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False, path_type=Path),
              help="run this plan file (it fixes schedule, microbatches, partition, mapping and actions)")
@_json_option
@click.option("--chrome-trace", type=click.Path(dir_okay=False, path_type=Path),
              help="write a timeline for Perfetto / chrome://tracing to this file (copy-engine lanes, link rates)")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="plot memory over time per GPU, with swap-outs and swap-ins, to this PNG")
@_html_option
def simulate(server: str | None, model: str | None, schedule: str, microbatch: int | None, microbatches: int,
             stages: int | None, strategy: str, partition: str, plan_path: Path | None, json_out: str | None,
             chrome_trace: Path | None, plot: Path | None, html_out: Path | None) -> None:
    """Simulate one training iteration: per-GPU peak memory, iteration time, throughput,
    and what each memory-saving technique saved and cost.

    Either a --strategy makes the plan (none, recompute, cpu-swap, d2d), or --plan runs a
    plan file written by `mpsim plan` or by hand. Exits 1 when the job does not fit (the
    result still names where it ran out).
    """
    from mpsim.api import simulate as run
    from mpsim.catalog import load_topology, load_trace
    from mpsim.plan import check_plan, read_plan_file
    from mpsim.views.chrome import write_chrome_trace
    from mpsim.views.plots import plot_memory
    from mpsim.views.text import simulate_text

    plan = read_plan_file(plan_path) if plan_path else None
    topo = load_topology(server or (plan.server if plan else "dgx1-v100"))
    trace = load_trace(model or (plan.model if plan else "gpt-5.3b"))
    if plan is not None:
        trace = trace.rescale(plan.microbatch)
        check_plan(plan, topo, trace, str(plan_path))  # errors name the file
    _warn_measured_elsewhere(trace, topo)
    with _tasks_progress("simulate"):
        result = run(topo, trace, schedule, microbatch, microbatches, n_stages=stages, strategy=strategy,
                     plan_file=plan, record_link_rates=chrome_trace is not None, partition=partition)
    _emit(json_out, simulate_text(result), result.to_dict())
    if chrome_trace:
        write_chrome_trace(result, chrome_trace)
    if plot:
        plot_memory(result, plot)
    if html_out:
        from mpsim.api import plan as make
        from mpsim.views.html import simulate_page

        if plan is None:  # the planner's answer is cached: this does not plan again
            plan = make(topo, trace, schedule, microbatch, microbatches, n_stages=stages, strategy=strategy,
                        partition=partition).plan
        html_out.write_text(simulate_page(result, plan), encoding="utf-8")
    if not result.fits:
        sys.exit(1)


@app.command("plan")
@_job_options
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="plan JSON file to write")
@_json_option
def plan_cmd(server: str | None, model: str | None, schedule: str, microbatch: int | None, microbatches: int,
             stages: int | None, strategy: str, partition: str, output: Path, json_out: str | None) -> None:
    """Make a memory-saving plan with a strategy and write it as a plan file.

    Prints the plan per stage and its simulated result; `mpsim simulate --plan FILE`
    runs it again, and the file can be edited by hand. Exits 1 when the plan does not fit.
    """
    from mpsim.api import plan as make
    from mpsim.catalog import load_topology, load_trace
    from mpsim.plan import write_plan_file
    from mpsim.views.text import plan_text, simulate_text

    topo, trace = load_topology(server or "dgx1-v100"), load_trace(model or "gpt-5.3b")
    _warn_measured_elsewhere(trace, topo)
    with _tasks_progress("plan"):
        planned = make(topo, trace, schedule, microbatch, microbatches, n_stages=stages,
                       strategy=strategy, partition=partition)
    write_plan_file(planned.plan, output)
    if json_out != "-":
        click.echo(plan_text(planned.plan))
        click.echo("")
        click.echo(simulate_text(planned.result))
        click.echo(f"wrote {output} ({planned.simulations} simulation(s) to plan)")
    _write_json(json_out, {"plan": json.loads(planned.plan.to_json()), "result": planned.result.to_dict()})
    if not planned.result.fits:
        sys.exit(1)


@app.command()
@click.option("--server", "-s", default="dgx1-v100", show_default=True, help=_SERVER_HELP)
@click.option("--family", default="gpt", show_default=True,
              help="size series of shipped traces: gpt (MPress's GPT-5.3B to 25.5B), bert, llama")
@click.option("--model", "-m", "models",
              help="instead of a family: comma-separated shipped models or trace files (llama-3-8b,my.json)")
@click.option("--schedule", default="1f1b", show_default=True, help=_SCHEDULE_HELP)
@click.option("--microbatch", type=int, help="samples per microbatch  [default: the traces']")
@click.option("--microbatches", type=int, default=16, show_default=True, help=_MICROBATCHES_HELP)
@click.option("--strategy", "strategies", default="none,recompute,cpu-swap,d2d,mpress,tsplit,best", show_default=True,
              help="comma-separated strategies, one column each")
@click.option("--partition", default="compute", show_default=True, help=_PARTITION_HELP)
@click.option("--workers", "-j", type=click.IntRange(min=1),
              help="worker processes (sizes and strategies in parallel; 1: all in this process)  "
                   "[default: one per core]")
@_backend_options
@_json_option
def fits(server: str, family: str, models: str | None, schedule: str, microbatch: int | None, microbatches: int,
         strategies: str, partition: str, workers: int | None, backend: str, address: str | None,
         json_out: str | None) -> None:
    """Which shipped sizes of a family (or which --model) fit under each strategy, and the
    largest that does.

    The size knob is the number of transformer layers at the shape of the largest
    size that fits; the search doubles, then bisects.
    """
    from mpsim.backends import make_backend
    from mpsim.capacity import family_traces, fits_strategies, model_traces
    from mpsim.catalog import load_topology
    from mpsim.planners import STRATEGIES
    from mpsim.schedule import check_schedule
    from mpsim.views.text import fits_strategies_text

    names = tuple(_list(strategies, option="--strategy"))
    if microbatch is not None and microbatch < 1:
        raise MpsimError(f"microbatch must be a positive integer, got {microbatch}")
    for name in names:
        if name not in STRATEGIES:
            raise MpsimError(f"unknown strategy {name!r}: expected one of {', '.join(STRATEGIES)}")
    if not names:
        raise MpsimError("--strategy needs at least one strategy")
    chosen = tuple(_list(models, option="--model")) if models else ()
    traces = model_traces(chosen) if chosen else family_traces(family)
    if chosen:
        family = str(traces[-1].spec.model.get("family", family))
    check_schedule(schedule, load_topology(server).n_gpus, microbatches)  # before the progress bar
    workers = workers or os.cpu_count() or 1
    runner = None if backend == "local" and workers == 1 else make_backend(backend, workers, address)
    # in one process a point is a simulated size (the searches' count estimated); in
    # parallel, a shipped size under a strategy, or one strategy's search
    total = (len(traces) + (10 if runner is None else 1)) * len(names)
    with _points_progress(f"fits {family}", total) as bar:
        reps = fits_strategies(server, family, schedule, microbatch, microbatches, names,
                               on_point=bar.point_done, partition=partition, models=chosen, backend=runner)
    _emit(json_out, fits_strategies_text(reps), {"reports": [r.to_dict() for r in reps]})


@app.command("reproduce")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("reports"), show_default=True,
              help="folder for the markdown reports and plots")
@click.option("--only", default="mpress,mcap,tsplit", show_default=True, help="comma-separated papers")
@_html_option
def reproduce_cmd(out: Path, only: str, html_out: Path | None) -> None:
    """Simulate the papers' comparisons from the shipped data and write a markdown report
    with plots per paper (mpress.md, mcap.md, tsplit.md), our numbers beside theirs."""
    from mpsim.reproduce import REPORTS

    names = _list(only, option="--only")
    for name in names:
        if name not in REPORTS:
            raise MpsimError(f"unknown paper {name!r}: expected one of {', '.join(REPORTS)}")
    out.mkdir(parents=True, exist_ok=True)
    texts = []
    with _progress("reproduce") as bar:
        job = bar.add_task("", total=None)
        for name in names:
            texts.append(REPORTS[name](out, lambda what: bar.update(job, description=what)))
            click.echo(f"wrote {out / (name + '.md')}")
    if html_out:
        from mpsim.views.markdown import reproduce_page

        html_out.write_text(reproduce_page(names, texts, out), encoding="utf-8")
        click.echo(f"wrote {html_out}")


def _list(text: str, cast=str, option: str = "") -> list:
    """A comma-separated option value; an empty item (``1,,2``, a trailing comma) is refused."""
    where = f"{option}: " if option else ""
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise MpsimError(f"{where}expected a comma-separated list without empty items, got {text!r}")
    try:
        return [cast(x) for x in items]
    except ValueError:
        raise MpsimError(f"{where}expected a comma-separated list of integers, got {text!r}") from None


@app.command("sweep")
@click.option("--server", "-s", "servers", default="dgx1-v100", show_default=True,
              help="comma-separated servers (" + _SERVER_HELP + ")")
@click.option("--model", "-m", "models", default="gpt-5.3b", show_default=True, help="comma-separated models")
@click.option("--schedule", default="1f1b", show_default=True, help=_SCHEDULE_HELP)
@click.option("--microbatch", "sizes", default="1,2,4,8", show_default=True, help="comma-separated microbatch sizes")
@click.option("--microbatches", "counts", default="16", show_default=True,
              help="comma-separated microbatches per iteration (each at most 4096)")
@click.option("--strategy", "strategies", default="none,recompute,cpu-swap,mpress,best", show_default=True,
              help="comma-separated strategies")
@click.option("--partition", default="compute", show_default=True, help=_PARTITION_HELP)
@click.option("--workers", "-j", type=click.IntRange(min=1), default=1, show_default=True,
              help="points run in parallel worker processes (--backend ray without --address: the CPUs of "
                   "the Ray instance started here)")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False, path_type=Path), default=Path("sweep.csv"),
              show_default=True, help="rows are appended here as points finish; points already in it are skipped")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="PNG of throughput and peak memory against microbatch size")
@_backend_options
@click.option("--batch", type=click.IntRange(min=1),
              help="points per task  [default: about four tasks per worker, at most 8 points each]")
@_json_option
@_html_option
def sweep_cmd(servers: str, models: str, schedule: str, sizes: str, counts: str, strategies: str, partition: str,
              workers: int, csv_path: Path, plot: Path | None, backend: str, address: str | None,
              batch: int | None, json_out: str | None, html_out: Path | None) -> None:
    """Throughput and peak memory over a grid of microbatch sizes, microbatch counts,
    strategies, models and servers.

    One row per point in the CSV, written as each point finishes, so an interrupted
    sweep run again with the same --csv resumes without redoing finished points. Ctrl-C
    or SIGTERM stops at once (exit 130 or 143), keeping the finished rows; a last line cut
    short by a kill is dropped on resume. A point that does not fit is a row with its
    first out-of-memory point. With --backend ray the points run as tasks on a Ray
    cluster (every node needs mpsim installed); Ctrl-C cancels the outstanding tasks.

    \b
    Example:
      mpsim sweep --server dgx1-v100 --model bert-1.67b --schedule pipedream \\
        --microbatch 1,2,4,8,12,16 --strategy none,recompute,cpu-swap,mpress,best -j 2 --plot sweep.png
      mpsim sweep --model gpt-5.3b,gpt-10.3b --microbatch 1,2,4,8 --backend ray --address auto
    """
    from mpsim.backends import make_backend
    from mpsim.sweep import SweepInterrupted, grid, sweep
    from mpsim.views.html import sweep_page
    from mpsim.views.plots import plot_sweep
    from mpsim.views.text import sweep_text

    points = grid(_list(servers, option="--server"), _list(models, option="--model"), schedule,
                  _list(sizes, int, "--microbatch"), _list(counts, int, "--microbatches"),
                  _list(strategies, option="--strategy"), partition)
    from mpsim.catalog import load_topology, load_trace

    for server_name, model_name in dict.fromkeys((p.server, p.model) for p in points):
        _warn_measured_elsewhere(load_trace(model_name), load_topology(server_name))
    runner = make_backend(backend, workers, address)
    stopped: SweepInterrupted | None = None
    with _points_progress("sweep", len(points)) as bar:

        def advance(row: dict, resumed: bool) -> None:
            what = "already in the CSV" if resumed else ("fits" if str(row["fits"]) == "True" else "OOM")
            bar.point_done(f"{row['model']} mb {row['microbatch']} {row['strategy']}: {what}", resumed)

        try:
            frame = sweep(points, csv_path, workers, advance, backend=runner, batch=batch,
                          on_failed=lambda p, error: bar.point_failed(f"{p.model} mb {p.microbatch} {p.strategy}: "
                                                                      "failed"))
        except SweepInterrupted as exc:
            stopped = exc
    if stopped:  # after the progress bar is gone: one line, and the shell's code for the signal
        click.echo(f"mpsim: {stopped}", err=True)
        sys.exit(stopped.exit_code)
    if json_out != "-":
        click.echo(sweep_text(frame))
        click.echo(f"\n{len(frame)} points in {csv_path}")
    if plot:
        plot_sweep(frame, plot)
    if html_out:
        html_out.write_text(sweep_page(frame), encoding="utf-8")
    _write_json(json_out, {"rows": frame.to_dict(orient="records")})


_ATTENTION_HELP = ("attention kernel whose saved tensors and FLOPs the trace records: eager (written out), "
                   "fused-softmax (Megatron), mem-efficient (xFormers/CUTLASS), flash (FlashAttention-2)  "
                   "[default: the preset's; otherwise what PyTorch picks on --server's GPU: flash from A100 on, "
                   "mem-efficient before; flash without --server]")


@app.command()
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="trace JSON file to write")
@click.option("--preset", help="start from a shipped configuration (gpt-5.3b, llama-3-8b ...; "
                               "see `mpsim trace --list`); other options override it")
@click.option("--list", "list_presets", is_flag=True, is_eager=True, expose_value=False,
              callback=lambda ctx, _p, v: _list_presets(ctx) if v else None, help="list the presets and exit")
@click.option("--module", "module_spec", metavar="SPEC",
              help="trace your own model: package.module:build or file.py:build returning (blocks, example input); "
                   "shipped CNNs: mpsim.cnn:resnet50, vgg16, inception_v3 ... (README); --recipe defaults to fp32")
@click.option("--family", type=click.Choice(["gpt", "bert", "llama"]),
              help="model family: gpt (GPT-2), bert, llama (RMSNorm, SwiGLU, RoPE, GQA: Llama, Mistral, Qwen2)  "
                   "[default: gpt]")
@click.option("--layers", type=click.IntRange(min=1), help="transformer layers  [default: 16]")
@click.option("--hidden", type=click.IntRange(min=1), help="hidden size  [default: 5120]")
@click.option("--heads", type=click.IntRange(min=1), help="attention heads, dividing hidden  [default: 40]")
@click.option("--kv-heads", type=click.IntRange(min=1), help="key/value heads (grouped-query attention), "
                                                            "dividing heads  [default: heads]")
@click.option("--ffn-hidden", type=click.IntRange(min=1), help="MLP inner size  [default: 4 x hidden]")
@click.option("--seq-len", type=click.IntRange(min=1), help="sequence length  [default: 1024]")
@click.option("--vocab", type=click.IntRange(min=1), help="vocabulary size  [default: 50257]")
@click.option("--dropout", type=click.FloatRange(min=0, max=1, max_open=True),
              help="dropout probability; 0 keeps no masks  [default: the preset's]")
@click.option("--attention", type=click.Choice(["eager", "fused-softmax", "mem-efficient", "flash"]),
              help=_ATTENTION_HELP)
@click.option("--server", "-s", help="with no --attention: pick the kernel PyTorch uses on this server's GPUs")
@click.option("--microbatch", type=click.IntRange(min=1), help="samples per microbatch  [default: the preset's]")
@click.option("--recipe", type=click.Choice(["mixed-fp16", "mixed-bf16", "mixed-fp16-fp32grad", "mixed-bf16-fp32grad",
                                             "fp32", "tf32"]),
              help="training precision: " + RECIPE_HELP + "  [default: the preset's]")
@click.option("--name", help="name stored in the trace  [default: the preset's, else from the shape]")
@click.option("--measure", is_flag=True, help="run the layers for real on --device and record measured times and bytes")
@click.option("--device", default="cpu", show_default=True, help="with --measure: cpu, cuda or cuda:N")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="with --measure on CPU: intra-op threads (as each pipeline process will have)")
@click.option("--repeats", type=click.IntRange(min=1), default=10, show_default=True,
              help="with --measure: timed runs per layer (the median is kept)")
@click.option("--hf", "hf_source", metavar="SOURCE",
              help="trace a Hugging Face model with its own modules: a folder with config.json, a config.json or "
                   "a shipped one (llama-2-7b, llama-3-70b, mistral-7b, qwen2.5-7b, gpt2-xl ...); takes --layers, "
                   "--hidden, --heads, --seq-len, --microbatch, --recipe, --attention, --server, --name")
def trace(output: Path, preset: str | None, family: Family | None, layers: int | None, hidden: int | None,
          heads: int | None, kv_heads: int | None, ffn_hidden: int | None, seq_len: int | None, vocab: int | None,
          dropout: float | None, attention: str | None, server: str | None, microbatch: int | None,
          recipe: str | None, name: str | None, measure: bool, device: str, threads: int, repeats: int,
          module_spec: str | None = None, hf_source: str | None = None) -> None:
    """Trace a model: a preset or a GPT, BERT or Llama-style shape.

    By default under FakeTensor mode (no memory allocated): per layer the saved-for-backward
    bytes the CUDA kernels keep, parameters, FLOPs and bytes moved; times are derived per
    GPU when simulated. `--preset llama-3-8b -o llama.json` traces a public model;
    `--preset gpt-5.3b -o traces/gpt-5.3b.json` regenerates a shipped trace.

    With --measure the layers run on --device: measured forward and backward times, real
    saved bytes and the backward's transient memory go into the trace, with the device
    named (`--preset gpt-tiny --measure --device cpu -o tiny.json`).

    With --module any PyTorch model cut into pipeline layers is traced, one row per layer
    (`--module mpsim.cnn:resnet50 -o resnet50.json`).

    With --hf a Hugging Face model is traced with its own modules from its config.json
    (`--hf llama-3-70b -o llama.json`; no weights, no network).
    """
    if module_spec is not None and hf_source is not None:
        raise MpsimError("--module and --hf each name a whole model: give one of them")
    if module_spec is not None:
        return _trace_module(output, module_spec, microbatch, recipe, name, measure)
    if hf_source is not None:
        others = {"--preset": preset, "--family": family, "--kv-heads": kv_heads, "--ffn-hidden": ffn_hidden,
                  "--vocab": vocab, "--dropout": dropout, "--measure": measure or None}
        _trace_hf(output, hf_source, {"layers": layers, "hidden": hidden, "heads": heads, "seq_len": seq_len},
                  [k for k, v in others.items() if v is not None], attention or _default_attention(server, recipe),
                  microbatch, recipe, name)
        return
    from dataclasses import replace

    from mpsim.workloads import ZOO, ModelConfig

    if preset is not None and preset not in ZOO:
        raise MpsimError(f"unknown --preset {preset!r}: expected one of {', '.join(ZOO)}")
    base, base_mb, base_recipe = ZOO[preset or "gpt-5.3b"]
    shape: dict[str, Any] = {"family": family, "layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
             "ffn_hidden": ffn_hidden, "seq_len": seq_len, "vocab": vocab, "dropout": dropout}
    changes = {k: v for k, v in shape.items() if v is not None}
    if attention is not None or server is not None or preset is None:
        changes["attention"] = attention or _default_attention(server, recipe or base_recipe)
    try:
        cfg: ModelConfig = replace(base, **changes)
    except ValueError as e:
        raise MpsimError(f"bad model shape: {e}") from None
    from mpsim.tracer import trace_model

    if name is None and preset is not None and set(changes) <= {"attention"} and cfg == base \
            and microbatch in (None, base_mb):
        name = preset
    if measure:
        from mpsim.profiler import measure_trace

        result = measure_trace(cfg, microbatch or base_mb, recipe or base_recipe, device, threads, repeats=repeats,
                               name=name)
    else:
        result = trace_model(cfg, microbatch or base_mb, recipe or base_recipe, name)
    _write_trace(output, result)


def _trace_module(output: Path, spec: str, microbatch: int | None, recipe: str | None, name: str | None,
                  measure: bool) -> None:
    """``trace --module``: a model from a builder function, fp32 unless --recipe says (TSPLIT, mCAP)."""
    from mpsim.modules import trace_builder

    if measure:
        raise MpsimError("--module traces under FakeTensor mode; --measure is for the GPT, BERT and Llama shapes")
    _write_trace(output, trace_builder(spec, microbatch, recipe or "fp32", name))


def _trace_hf(output: Path, source: str, shape: dict[str, int | None], unsupported: list[str], attention: str,
              microbatch: int | None, recipe: str | None, name: str | None) -> None:
    """``trace --hf``: the Hugging Face model's own modules (``mpsim.hf``)."""
    if unsupported:
        raise MpsimError(f"--hf does not take {', '.join(unsupported)}: set them in the config.json")
    from mpsim.hf import trace_hf

    overrides = {k: v for k, v in shape.items() if v is not None}
    _write_trace(output, trace_hf(source, microbatch, recipe, attention, overrides, name))


def _write_trace(output: Path, result) -> None:
    output.write_text(result.to_json() + "\n")
    attention = result.spec.model.get("attention", "")
    click.echo(f"wrote {output}: {result.name}, {result.spec.params / 1e9:.2f}B parameters, {result.n_layers} layers, "
               f"microbatch {result.microbatch}, {result.spec.precision.recipe}"
               + (f", {attention} attention" if attention else ""))


def _default_attention(server: str | None, recipe: str | None) -> str:
    """The kernel PyTorch's scaled_dot_product_attention picks on ``server``'s GPUs for the
    recipe's compute dtype (mixed-fp16 when none is given)."""
    from mpsim.kernels import default_attention
    from mpsim.trace import RECIPES

    dtype = RECIPES[recipe].compute_dtype if recipe in RECIPES else "fp16"
    if server is None:
        return default_attention(None, dtype)
    from mpsim.catalog import load_topology

    return default_attention(load_topology(server).spec.gpu.compute_capability, dtype)


def _list_presets(ctx: click.Context) -> None:
    from mpsim.workloads import ZOO

    for preset, (cfg, mb, recipe) in ZOO.items():
        click.echo(f"{preset:12s} {cfg.family:6s} {cfg.param_count() / 1e9:6.2f}B  {cfg.layers:3d} layers, hidden "
                   f"{cfg.hidden}, seq {cfg.seq_len}, microbatch {mb}, {recipe}, {cfg.attention} attention")
    ctx.exit(0)


@app.group()
def topo() -> None:
    """Servers: list, show, check a topology file."""


@topo.command("list")
def topo_list() -> None:
    """The shipped servers."""
    from mpsim.catalog import load_topology, shipped_topologies

    for name in shipped_topologies():
        click.echo(f"{name:22s} {load_topology(name).spec.description}")


@topo.command("show")
@click.argument("name")
@_json_option
def topo_show(name: str, json_out: str | None) -> None:
    """GPUs, the connection matrix (nvidia-smi topo -m style) and route bandwidths of NAME
    (a shipped server or a topology file)."""
    from mpsim.catalog import load_topology
    from mpsim.views.text import topo_text

    t = load_topology(name)
    _emit(json_out, topo_text(t), t.to_dict())


@topo.command("check")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
def topo_check(file: Path) -> None:
    """Validate a topology file and print a one-line summary."""
    from mpsim.topology import read_topology_file

    t = read_topology_file(file)
    click.echo(f"{file}: ok ({t.name}, {t.n_gpus} x {t.spec.gpu.model}, {len(t.links)} directed links)")


@topo.command("probe")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), help="topology YAML file to write")
@click.option("--device", default="cpu", show_default=True, help="cuda: the GPUs here; cpu: CPU processes as devices")
@click.option("--devices", type=click.IntRange(min=1), default=1, show_default=True,
              help="on CPU: how many devices (one pipeline process each)")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True, help="on CPU: threads per device")
@click.option("--memory-mib", type=click.FloatRange(min=1),
              help="on CPU: memory of each device  [default: RAM / devices]")
@click.option("--name", help="name stored in the file  [default: from what was found]")
def topo_probe(output: Path | None, device: str, devices: int, threads: int, memory_mib: float | None,
               name: str | None) -> None:
    """Write a topology file for the machine at hand, from measurements.

    On GPUs: count, model and memory, NVLink and PCIe layout from `nvidia-smi topo -m`,
    measured host-device and device-device copy bandwidth, device memory bandwidth and
    matmul throughput. On CPU: DEVICES processes with THREADS threads each, with measured
    matmul and memory-copy rates (what `mpsim validate --device cpu` simulates).
    """
    import yaml

    from mpsim.probe import probe
    from mpsim.profiler import check_device
    from mpsim.views.text import topo_text

    check_device(device)
    spec, topology = probe(device, devices, threads, memory_mib, name)
    text = yaml.safe_dump(spec, sort_keys=False)
    if output:
        output.write_text(f"# Measured by mpsim topo probe.\n{text}")
        click.echo(f"wrote {output}")
    click.echo(topo_text(topology))


@topo.command("transfer")
@click.option("--server", "-s", default="dgx1-v100", show_default=True, help=_SERVER_HELP)
@click.option("--src", required=True, help="sending GPU (gpu0, 0) or host")
@click.option("--dst", help="receiving GPU or host")
@click.option("--stripe", help="comma-separated peer GPUs for a striped D2D copy, parts sized by route bandwidth")
@click.option("--size", "sizes", required=True,
              help="bytes to move, e.g. 216MB or 1.5GiB, at most 1 PiB; comma-separated for several")
@_json_option
def topo_transfer(server: str, src: str, dst: str | None, stripe: str | None, sizes: str, json_out: str | None) -> None:
    """One-way time of a copy alone on an idle server, and its effective bandwidth.

    Each copy pays its route's setup latency once, so effective bandwidth rises with the
    size (as MPress Fig. 4 measures). With --stripe the copy is split over the peers in
    proportion to each route's bandwidth (MPress data striping) and lands with its last part.
    """
    from mpsim.catalog import load_topology
    from mpsim.plan import stripes_by_bandwidth
    from mpsim.sim.transfers import Copy, copy_times
    from mpsim.topology import HOST
    from mpsim.units import parse_bytes
    from mpsim.views.text import transfer_text

    t = load_topology(server)

    def endpoint(text: str, what: str):
        word = text.strip().lower()
        if word == HOST:
            return HOST
        num = word[3:] if word.startswith("gpu") else word
        if not num.isdigit() or int(num) >= t.n_gpus:
            raise MpsimError(f"{what} {text!r}: expected host or a GPU of {t.name} (gpu0..gpu{t.n_gpus - 1})")
        return int(num)

    if (dst is None) == (stripe is None):
        raise MpsimError("give exactly one of --dst and --stripe")
    source = endpoint(src, "--src")
    try:
        byte_sizes = [parse_bytes(x) for x in _list(sizes, option="--size")]
    except ValueError as exc:
        raise MpsimError(f"--size: {exc}") from None
    rows: list[dict[str, object]] = []
    for n in byte_sizes:
        if stripe is not None:
            if source == HOST:
                raise MpsimError("--stripe copies go from a GPU to its peers; --src must be a GPU")
            peers = [endpoint(x, "--stripe") for x in _list(stripe, option="--stripe")]
            if source in peers or len(set(peers)) != len(peers):
                raise MpsimError("--stripe peers must be distinct GPUs other than --src")
            parts = [(x.gpu, round(n * x.fraction)) for x in stripes_by_bandwidth(t, source, peers)]
            parts[-1] = (parts[-1][0], n - sum(p for _, p in parts[:-1]))
            landed = copy_times(t, [Copy(source, g, part) for g, part in parts]).landed_s
            seconds = max(landed)
            rows.append({"bytes": n, "seconds": seconds,
                         "parts": [{"dst": g, "bytes": part, "seconds": s} for (g, part), s in zip(parts, landed)]})
        else:
            target = endpoint(dst, "--dst")  # type: ignore[arg-type]
            if target == source:
                raise MpsimError("--src and --dst are the same")
            landed = copy_times(t, [Copy(source, target, n)]).landed_s
            route = t.route(source, target)
            seconds = landed[0]
            rows.append({"bytes": n, "seconds": seconds, "route": [link.name for link in route.links]})
        rows[-1]["effective_gbps"] = n / seconds / 1e9
    data = {"server": t.name, "src": source, "dst": dst and endpoint(dst, "--dst"),
            "stripe": stripe and [endpoint(x, "--stripe") for x in stripe.split(",")], "copies": rows}
    _emit(json_out, transfer_text(data), data)


@app.command("validate")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False, path_type=Path),
              help="plan JSON file to run  [default: make one with --strategy]")
@click.option("--model", "-m", default="gpt-tiny", show_default=True,
              help="model preset to build and measure (see `mpsim trace --preset`), or a measured trace JSON file")
@click.option("--server", "-s", help="topology file of this machine  [default: probe it]")
@click.option("--strategy", default="none", show_default=True, help="without --plan: " + _STRATEGY_HELP)
@click.option("--schedule", type=click.Choice(["gpipe", "1f1b"]), default="1f1b", show_default=True,
              help="without --plan: pipeline schedule")
@click.option("--microbatches", type=click.IntRange(min=1), default=4, show_default=True,
              help="without --plan: microbatches per iteration")
@click.option("--stages", type=click.IntRange(min=1), default=2, show_default=True,
              help="without --plan: pipeline stages (processes)")
@click.option("--device", default="cpu", show_default=True, help="cpu (gloo) or cuda (NCCL)")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True, help="on CPU: threads per process")
@click.option("--memory-mib", type=click.FloatRange(min=1),
              help="memory each stage may use, enforced  [default: the device's; on CPU RAM / stages]")
@click.option("--steps", type=click.IntRange(min=1), default=5, show_default=True, help="timed steps (median)")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="untimed steps before them")
@_json_option
def validate_cmd(plan_path: Path | None, model: str, server: str | None, strategy: str, schedule: str,
                 microbatches: int, stages: int, device: str, threads: int, memory_mib: float | None, steps: int,
                 warmup: int, json_out: str | None) -> None:
    """Run a plan on this machine and compare it with the simulator.

    Measures the model's layers here (or takes a measured trace), probes this machine
    (or takes --server), simulates the plan, runs it with the PyTorch executor
    (validate/executor.py, one process per stage under torchrun) and prints per stage the
    predicted and measured peak memory with its breakdown, and the iteration time, with
    the errors in percent. An out-of-memory during the run is reported as a result
    (stage, step, phase) under either schedule, and exits 1.
    """
    from mpsim.catalog import load_topology, load_trace
    from mpsim.hardware_check import RunSettings, validate_plan, validation_text
    from mpsim.job import JobSpec, pipeline
    from mpsim.plan import read_plan_file
    from mpsim.planners import plan_job
    from mpsim.probe import probe
    from mpsim.profiler import check_device, measure_trace
    from mpsim.workloads import ZOO

    check_device(device)
    plan = read_plan_file(plan_path) if plan_path else None
    if model in ZOO:
        cfg, mb, recipe = ZOO[model]
        if device.startswith("cpu") and recipe != "fp32":
            raise MpsimError(f"--model {model} trains in {recipe}; on CPU validate an fp32 preset such as gpt-tiny")
        trace = measure_trace(cfg, plan.microbatch if plan else mb, recipe, device, threads, name=model)
    else:
        trace = load_trace(model)
        if trace.spec.source.kind != "measured":
            raise MpsimError(f"--model {model}: a derived trace predicts no measured run; give a preset or a trace "
                             "made with `mpsim trace --measure`")
    n_devices = len(plan.stages) if plan else stages
    if server:
        topo = load_topology(server)
    else:
        topo = probe(device, n_devices, threads, memory_mib)[1]
    if plan is None:
        plan = plan_job(JobSpec(topo, trace, schedule, microbatches, pipeline(stages), strategy=strategy)).plan
    settings = RunSettings(device=device, threads=threads, warmup=warmup, steps=steps,
                           capacity_bytes=int(memory_mib * 2**20) if memory_mib else None)
    report = validate_plan(plan, topo, trace, settings, str(plan_path) if plan_path else "<plan>")
    _emit(json_out, validation_text(report), report)
    if report["oom"]:
        sys.exit(1)



@app.command("calibrate")
@click.option("--trace", "trace_paths", required=True, multiple=True,
              help="measured trace JSON (`mpsim trace --measure`); repeat for several shapes of one precision, "
                   "measured on one device, fitted together")
@click.option("--server", "-s", required=True, help=_SERVER_HELP)
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path),
              help="write the topology YAML with the fitted efficiency block to this file")
@click.option("--force", is_flag=True, help="fit even when the trace was measured on another kind of device")
@_json_option
def calibrate_cmd(trace_paths: tuple[str, ...], server: str, output: Path | None, force: bool,
                  json_out: str | None) -> None:
    """Fit the server GPU's matmul, attention-kernel and memory efficiencies for the trace's
    precision to the measured layer times (non-negative least squares), print them with
    each row's residual, and optionally write the topology with them."""
    from mpsim.calibrate import calibrate, calibrated_yaml, calibration_text
    from mpsim.catalog import load_topology, load_trace

    topo = load_topology(server)
    cal = calibrate([load_trace(p) for p in trace_paths], topo, force)
    if output:
        output.write_text(calibrated_yaml(topo, cal))
    if json_out != "-":
        click.echo(calibration_text(cal))
        if output:
            click.echo(f"wrote {output}")
    _write_json(json_out, cal.to_dict())

@app.command("choose")
@click.option("--model", "-m", required=True, help="shipped model name (see traces/) or a trace JSON file")
@click.option("--servers", "-s", default="all", show_default=True,
              help="comma-separated shipped servers or topology files; all: every shipped server with at least "
                   "two GPUs that the schedule can fill with one stage each")
@click.option("--schedule", default="1f1b", show_default=True, help=_SCHEDULE_HELP)
@click.option("--microbatch", "sizes", help="comma-separated microbatch sizes to try  [default: the trace's]")
@click.option("--microbatches", type=int, default=16, show_default=True, help=_MICROBATCHES_HELP)
@click.option("--strategy", "strategies", default="best", show_default=True,
              help="comma-separated strategies allowed (each single one under both partitions; best: all of them)")
@click.option("--price", "price_overrides", multiple=True, metavar="SERVER=USD/h",
              help="on-demand USD per hour of a server, instead of its file's price; repeat for several")
@click.option("--rank-by", type=click.Choice(["cost", "throughput"]), default="cost", show_default=True,
              help="cost: USD per million samples, cheapest first; throughput: fastest first")
@_json_option
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="PNG of throughput against USD per hour, the Pareto front marked")
@_html_option
def choose_cmd(model: str, servers: str, schedule: str, sizes: str | None, microbatches: int, strategies: str,
               price_overrides: tuple[str, ...], rank_by: str, json_out: str | None, plot: Path | None,
               html_out: Path | None) -> None:
    """Which server to buy or rent for a model: per server the fastest plan that fits, its
    samples/s (tokens/s for language models), peak memory, and USD per hour and per
    million samples (tokens), ranked, with a one-line recommendation.

    Prices come from each topology file's `price` block; --price overrides them. Where
    nothing fits, the row says by how much it falls short and which technique came
    closest. Exits 1 when the model fits on none of the servers.

    \b
    Example:
      mpsim choose --model llama-3-8b --servers dgx1-v100,dgx-a100-80gb,dgx-h100 --price dgx-h100=55
    """
    from mpsim.choose import choose, parse_price, parse_servers
    from mpsim.views.plots import plot_choose
    from mpsim.views.text import choose_text

    prices = dict(parse_price(p) for p in price_overrides)
    names = parse_servers(servers, schedule, microbatches)
    mb_sizes = _list(sizes, int, "--microbatch") if sizes else None
    with _progress("choose") as bar:
        job = bar.add_task("", total=None)
        report = choose(model, names, schedule, mb_sizes, tuple(_list(strategies, option="--strategy")),
                        microbatches, prices, rank_by, on_point=lambda what: bar.update(job, description=what))
    _emit(json_out, choose_text(report), report.to_dict())
    if plot:
        plot_choose(report, plot)
    if html_out:
        from mpsim.views.html import choose_page

        html_out.write_text(choose_page(report), encoding="utf-8")
    if not any(r.fits for r in report.rows):
        sys.exit(1)


@app.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to listen on; 127.0.0.1 is this machine only (anything else lets others run jobs)")
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="port to listen on; 0 picks a free one, printed at start")
@click.option("--verbose", is_flag=True, help="log every request on stderr")
def serve(host: str, port: int, verbose: bool) -> None:
    """A local web page over the same API: pick or upload a server and a model, run, and see
    the verdict, per-GPU memory, memory over time, the pipeline timeline and the plan.

    Works offline (the page and its script come with the package). Ctrl-C stops it.
    """
    from mpsim.web.app import make_server

    server = make_server(host, port, verbose)
    click.echo(f"mpsim serve: {server.url} (Ctrl-C to stop)")
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def main(argv: list[str] | None = None) -> int:
    """Entry point: runs the app and turns every expected error into one line and exit 2."""
    try:
        app.main(args=argv, prog_name="mpsim", standalone_mode=False)
    except MpsimError as exc:
        click.echo(f"mpsim: error: {exc}", err=True)
        return 2
    except OSError as exc:  # an output path that cannot be written
        where = f"{exc.filename}: " if exc.filename else ""
        click.echo(f"mpsim: error: {where}cannot write ({exc.strerror or exc})", err=True)
        return 2
    except click.exceptions.Abort:
        click.echo("mpsim: aborted", err=True)
        return 130
    except click.ClickException as exc:
        click.echo(f"mpsim: error: {exc.format_message()}", err=True)
        return 2
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def run() -> None:
    """Console-script wrapper: exit with ``main``'s code."""
    sys.exit(main())


if __name__ == "__main__":
    run()
