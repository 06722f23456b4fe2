"""Many simulations: ``fits``, ``sweep``, ``reproduce``, ``choose`` and ``calibrate``."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import click

from mpsim import api
from mpsim.cli.options import (
    PARTITION_HELP,
    SCHEDULE_HELP,
    SEQ_LEN_HELP,
    SERVER_HELP,
    backend_options,
    comma_list,
    emit,
    fine_tune_options,
    global_microbatches_options,
    headroom_option,
    html_option,
    int_list,
    json_option,
    layouts_option,
    recipe_option,
    refuse_given,
    refuse_per_replica,
    runtime_option,
    warn,
    write_json,
)
from mpsim.cli.progress import points_progress, steps_progress, stops_on_signals


@click.command()
@click.option("--server", "-s", default=api.DEFAULT_SERVER, show_default=True, help=SERVER_HELP)
@click.option("--family", default="gpt", show_default=True,
              help="size series of shipped traces: gpt (MPress's GPT-5.3B to 25.5B), bert, llama")
@click.option("--model", "-m", "models",
              help="instead of a family: comma-separated shipped models or trace files (llama-3-8b,my.json)")
@click.option("--schedule", default=api.DEFAULT_SCHEDULE, show_default=True, help=SCHEDULE_HELP)
@click.option("--microbatch", type=int, help="samples per microbatch  [default: the traces']")
@global_microbatches_options("fits", api.DEFAULT_MICROBATCHES)
@click.option("--strategy", "strategies", default="none,recompute,cpu-swap,d2d,mpress,tsplit,best", show_default=True,
              help="comma-separated strategies, one column each; here best combines the planners that keep "
                   "model states on the GPUs, and the offload strategies (zero-offload, zero-infinity) are "
                   "columns of their own")
@click.option("--partition", default="compute", show_default=True, help=PARTITION_HELP)
@runtime_option
@fine_tune_options
@layouts_option(api.DEFAULT_LAYOUTS)
@click.option("--workers", "-j", type=click.IntRange(min=1),
              help="worker processes (sizes and strategies in parallel; 1: all in this process)  "
                   "[default: one per core]")
@click.option("--no-largest", is_flag=True,
              help="simulate the shipped sizes only: skip the search for the largest size that fits (most of the time)")
@backend_options
@headroom_option
@json_option
def fits(server: str, family: str, models: str | None, schedule: str, microbatch: int | None,
         global_microbatches: int, per_replica_microbatches: str | None, strategies: str, partition: str,
         runtime_profile: str, fine_tune: api.FineTune | None, layouts: str, workers: int | None, no_largest: bool,
         backend: str, address: str | None, headroom_gib: float, json_out: str | None) -> None:
    """Which shipped sizes of a family (or which --model) fit under each strategy, in which
    parallel layout, and the largest that does.

    Per model and strategy the fastest of --layouts that fits answers, at one global batch:
    --global-microbatches per iteration over all replicas (a layout of dp replicas runs
    ceil(N / dp) each). --microbatches, which counts one replica's microbatches in
    simulate and plan, is refused here: a per-replica count would train each layout on
    another global batch, and the layouts would no longer be compared on the same work.
    The size knob is the number of transformer layers at the shape of the largest size
    that fits; the search doubles, then bisects; the largest is the largest any layout
    reaches. With --lora, --qlora or --peft-config each model is a fine-tune of it (a
    shipped Llama, Mistral, Qwen2 or GPT-2 shape: `mpsim fits --family llama --qlora
    --server rtx4090-x1`).
    """
    from mpsim.views.text import fits_layouts_text

    refuse_per_replica("fits", per_replica_microbatches)
    names = comma_list(strategies, "--strategy")
    chosen = comma_list(models, "--model") if models else []
    with tempfile.TemporaryDirectory(prefix="mpsim-fits-") as folder:
        if fine_tune is not None:  # the workers load each model by name: the fine-tunes as files
            chosen = api.fine_tuned_files(family, chosen, fine_tune, Path(folder))
        request = api.fits_request(server, family, chosen, schedule, microbatch, global_microbatches, names,
                                   partition, workers, backend, address, layouts, search=not no_largest,
                                   runtime_profile=runtime_profile)
        with stops_on_signals("fits", STOPPED), points_progress(f"fits {request.family}", request.points) as bar:
            reps = request.run(on_point=bar.point_done)
    emit(json_out, fits_layouts_text(reps, headroom_gib),
         {"headroom_gib": headroom_gib, "reports": [r.to_dict(headroom_gib) for r in reps]})


@click.command("reproduce")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("reports"), show_default=True,
              help="folder for the markdown reports and plots")
@click.option("--only", default="mpress,mcap,tsplit", show_default=True, help="comma-separated papers")
@html_option
def reproduce_cmd(out: Path, only: str, html_out: Path | None) -> None:
    """Simulate the papers' comparisons from the shipped data and write a markdown report
    with plots per paper (mpress.md, mcap.md, tsplit.md), our numbers beside theirs."""
    from mpsim.views.markdown import reproduce_page

    names = comma_list(only, "--only")
    with steps_progress("reproduce") as step:
        texts = api.reproduce(names, out, step, lambda path: click.echo(f"wrote {path}"))
    if html_out:
        html_out.write_text(reproduce_page(names, texts, out), encoding="utf-8")
        click.echo(f"wrote {html_out}")


@click.command("sweep")
@click.option("--server", "-s", "servers", default=api.DEFAULT_SERVER, show_default=True,
              help="comma-separated servers (" + SERVER_HELP + ")")
@click.option("--model", "-m", "models", default=api.DEFAULT_MODEL, show_default=True, help="comma-separated models")
@click.option("--schedule", default=api.DEFAULT_SCHEDULE, show_default=True, help=SCHEDULE_HELP)
@click.option("--microbatch", "sizes", default="1,2,4,8", show_default=True, help="comma-separated microbatch sizes")
@global_microbatches_options("sweep", "16", many=True)
@click.option("--strategy", "strategies", default="none,recompute,cpu-swap,mpress,best", show_default=True,
              help="comma-separated strategies")
@click.option("--partition", default="compute", show_default=True, help=PARTITION_HELP)
@layouts_option("pipeline")
@click.option("--workers", "-j", type=click.IntRange(min=1), default=1, show_default=True,
              help="points run in parallel worker processes (--backend ray without --address: the CPUs of "
                   "the Ray instance started here)")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False, path_type=Path), default=Path("sweep.csv"),
              show_default=True, help="rows are appended here as points finish; points already in it are skipped")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="PNG of throughput and peak memory against microbatch size")
@backend_options
@click.option("--batch", type=click.IntRange(min=1),
              help="points per task  [default: about four tasks per worker, at most 8 points each]")
@json_option
@html_option
def sweep_cmd(servers: str, models: str, schedule: str, sizes: str, global_microbatches: str,
              per_replica_microbatches: str | None, strategies: str, partition: str,
              layouts: str, workers: int, csv_path: Path, plot: Path | None, backend: str, address: str | None,
              batch: int | None, json_out: str | None, html_out: Path | None) -> None:
    """Throughput and peak memory over a grid of microbatch sizes, microbatch counts,
    strategies, parallel layouts, models and servers.

    The counts are --global-microbatches, per iteration over all replicas, so every
    layout of a point trains on the same global batch (a layout of dp replicas runs
    ceil(N / dp) each; the CSV's microbatches column holds that global count).
    --microbatches, which counts one replica's microbatches in simulate and plan, is
    refused here.

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
    from mpsim.views.html import sweep_page
    from mpsim.views.plots import plot_sweep
    from mpsim.views.text import sweep_text

    refuse_per_replica("sweep", per_replica_microbatches)
    points = api.grid(comma_list(servers, "--server"), comma_list(models, "--model"), schedule,
                      int_list(sizes, "--microbatch"), int_list(global_microbatches, "--global-microbatches"),
                      comma_list(strategies, "--strategy"), partition, layouts)
    for line in api.sweep_warnings(points):
        warn(line)
    runner = api.make_backend(backend, workers, address)
    stopped: api.SweepInterrupted | None = None
    with points_progress("sweep", len(points)) as bar:

        def advance(row: dict, resumed: bool) -> None:
            what = "already in the CSV" if resumed else ("fits" if str(row["fits"]) == "True" else "OOM")
            bar.point_done(f"{row['model']} {row['layout']} mb {row['microbatch']} {row['strategy']}: {what}", resumed)

        try:
            frame = api.sweep(points, csv_path, workers, advance, backend=runner, batch=batch,
                              on_failed=lambda p, error: bar.point_failed(f"{p.model} mb {p.microbatch} "
                                                                          f"{p.strategy}: failed"))
        except api.SweepInterrupted as exc:
            stopped = exc
        finally:
            runner.close()
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
    write_json(json_out, {"rows": frame.to_dict(orient="records")})


@click.command("calibrate")
@click.option("--trace", "trace_paths", multiple=True,
              help="measured trace JSON (`mpsim trace --measure`); repeat for several shapes of one precision, "
                   "measured on one device, fitted together")
@click.option("--profile", "profile_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="instead of --trace: a PyTorch profiler trace (Chrome JSON, .json.gz; record_shapes=True) whose "
                   "kernels fit the GPU's kernel table (mpsim.timing.kernel_time) per class")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32", "tf32"]), default="bf16", show_default=True,
              help="with --profile: the precision whose kernels are fitted")
@click.option("--server", "-s", required=True, help=SERVER_HELP)
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path),
              help="write the topology YAML with the fitted efficiency block to this file")
@click.option("--force", is_flag=True, help="fit even when the trace was measured on another kind of device")
@json_option
def calibrate_cmd(trace_paths: tuple[str, ...], profile_path: Path | None, dtype: str, server: str,
                  output: Path | None, force: bool, json_out: str | None) -> None:
    """Fit the server GPU's matmul, attention-kernel and memory efficiencies for the trace's
    precision to the measured layer times (non-negative least squares), print them with
    each row's residual, and optionally write the topology with them.

    With --profile, fit the GPU's kernel table instead (GEMM, attention and memory-bound
    kernels each scaled by one factor) to the kernels of a PyTorch profiler trace, print
    the factors with each class's residuals, and optionally write the topology with the
    table (gpu.kernels, time_model: kernels)."""
    from mpsim.views.measured import calibration_text

    topo = api.load_topology(server)
    if (profile_path is None) == (not trace_paths):
        raise click.UsageError("give either --trace (measured layers) or --profile (a profiler trace)")
    if profile_path is not None:
        _calibrate_profile(profile_path, dtype, topo, output, json_out)
        return
    cal = api.calibrate([api.load_trace(p) for p in trace_paths], topo, force)
    if output:
        output.write_text(api.calibrated_yaml(topo, cal))
    if json_out != "-":
        click.echo(calibration_text(cal))
        if output:
            click.echo(f"wrote {output}")
    write_json(json_out, cal.to_dict())


def _calibrate_profile(path: Path, dtype: str, topo: api.Topology, output: Path | None, json_out: str | None) -> None:
    cal = api.calibrate_profile_file(topo, path, dtype)
    if output:
        output.write_text(api.kernel_table_yaml(topo, cal, path.name))
    if json_out != "-":
        click.echo(cal.text())
        if output:
            click.echo(f"wrote {output}")
    write_json(json_out, cal.to_dict())


@click.command("choose")
@click.option("--model", "-m", required=True, help="shipped model name (see traces/) or a trace JSON file")
@click.option("--servers", "-s", default="all", show_default=True,
              help="comma-separated shipped servers or topology files; all: every shipped server with at least "
                   "two GPUs that the schedule can fill with one stage each")
@click.option("--schedule", default=api.DEFAULT_SCHEDULE, show_default=True, help=SCHEDULE_HELP)
@click.option("--microbatch", "sizes", help="comma-separated microbatch sizes to try  [default: the trace's]")
@global_microbatches_options("choose", api.DEFAULT_MICROBATCHES)
@click.option("--seq-len", type=click.IntRange(min=1), help=SEQ_LEN_HELP)
@recipe_option
@fine_tune_options
@click.option("--strategy", "strategies", default="best", show_default=True,
              help="comma-separated strategies allowed (each single one under both partitions; best: all of them)")
@layouts_option(api.CHOOSE_LAYOUTS)
@click.option("--price", "price_overrides", multiple=True, metavar="SERVER=USD/h",
              help="on-demand USD per hour of a server, instead of its file's price; repeat for several")
@click.option("--rank-by", type=click.Choice(["cost", "throughput"]), default="cost", show_default=True,
              help="cost: USD per million samples, cheapest first; throughput: fastest first")
@runtime_option
@click.option("--tokens", type=float, help="train on this many tokens: answer how many servers of each cluster, "
                                           "with which layout, for how long and at what cost (e.g. 2e12)")
@click.option("--days", type=float, help="with --tokens: the deadline; the pick is the fewest servers within it")
@click.option("--budget", type=float, help="with --tokens: the most to spend, USD")
@click.option("--clusters", default=",".join(api.DEFAULT_CLUSTERS), show_default=True,
              help="with --tokens: shipped clusters (mpsim topo list) or cluster YAML files, comma-separated")
@click.option("--batch-tokens", type=int, default=api.DEFAULT_BATCH_TOKENS, show_default=True,
              help="with --tokens: tokens an iteration (the global batch, fixed whatever the layout)")
@click.option("--discount", type=float, default=0.0, show_default=True,
              help="with --tokens: fraction off the list price (a reserved or negotiated cluster)")
@click.option("--min-servers", type=click.IntRange(min=1), default=1, show_default=True,
              help="with --tokens: the fewest servers tried (counts are powers of two)")
@click.option("--max-servers", type=click.IntRange(min=1),
              help="with --tokens: the most servers tried  [default: each cluster's max_servers]")
@click.option("--workers", "-j", type=click.IntRange(min=1), default=1, show_default=True,
              help="worker processes (or Ray CPUs) the servers (with --tokens: the configurations) run on")
@backend_options
@headroom_option
@json_option
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="PNG of throughput against USD per hour, the Pareto front marked")
@html_option
@click.option("--emit", "emits", multiple=True, metavar="FORMAT[=FILE]",
              help="write the recommended plan as a framework's configuration (megatron, torchtitan, deepspeed, "
                   "accelerate), with the prediction in a comment  [FILE default: MODEL-pick.FORMAT.SUFFIX here]")
def choose_cmd(model: str, servers: str, schedule: str, sizes: str | None, global_microbatches: int,
               per_replica_microbatches: str | None, seq_len: int | None, recipe: str | None,
               fine_tune: api.FineTune | None, strategies: str, layouts: str, price_overrides: tuple[str, ...],
               rank_by: str, runtime_profile: str, tokens: float | None, days: float | None,
               budget: float | None, clusters: str, batch_tokens: int, discount: float, min_servers: int,
               max_servers: int | None, workers: int, backend: str, address: str | None, headroom_gib: float,
               json_out: str | None, plot: Path | None, html_out: Path | None, emits: tuple[str, ...]) -> None:
    """Which server to buy or rent for a model: per server the fastest plan that fits (parallel
    layout x strategy x microbatch size), its samples/s (tokens/s for language models),
    peak memory, and USD per hour and per million samples (tokens), ranked, with a
    one-line recommendation.

    Prices come from each topology file's `price` block; --price overrides them. Where
    nothing fits, the row says by how much it falls short and which technique came
    closest. Exits 1 when the model fits on none of the servers.

    Every layout trains on the same global batch, --global-microbatches per iteration over
    all replicas (a layout of dp replicas runs ceil(N / dp) each), so the servers and
    layouts are compared on the same work. --microbatches, which counts one replica's
    microbatches in simulate and plan, is refused here; with --tokens the global batch is
    --batch-tokens instead.

    With --tokens it answers "how many servers": per cluster (--clusters) and server count
    (powers of two) the fastest layout that fits (tensor parallel inside a server, pipeline
    and ZeRO-1, FSDP or HSDP across; expert parallel for a mixture of experts; context
    parallel from 16,384 tokens, --seq-len retracing a shipped model), the days and the cost
    to train, the Pareto front of days against cost (--plot), and the fewest servers within
    --days and --budget.

    \b
    Examples:
      mpsim choose --model llama-3-8b --servers dgx1-v100,dgx-a100-80gb,dgx-h100 --price dgx-h100=55
      mpsim choose --model llama-3-70b --tokens 2e12 --days 30 --clusters dgx-h100-superpod -j 2
      mpsim choose --model llama-3-70b --seq-len 1048576 --tokens 1e10 --clusters dgx-h100-superpod -j 2
    """
    from mpsim.views.html import choose_page, scale_page
    from mpsim.views.plots import plot_choose, plot_scale
    from mpsim.views.text import choose_text, scale_text

    if tokens is None and (days is not None or budget is not None):
        raise click.UsageError("--days and --budget go with --tokens")
    if tokens is not None:
        _refuse_with_tokens(per_replica_microbatches, recipe, fine_tune)
        if emits:
            raise click.UsageError("--emit and --tokens: the search over clusters writes no configuration yet; "
                                   "write one server's pick with choose --servers ... --emit")
        if servers != "all":
            raise click.UsageError("--tokens searches clusters (--clusters); --servers is for one server")
        refuse_given(_NOT_WITH_TOKENS, lambda option: f"{option} and --tokens: {_NOT_WITH_TOKENS_WHY[option]}; "
                                                      f"leave {option} out")
        runner = api.backend_for(backend, workers, address)
        with stops_on_signals("choose", STOPPED), _ending(runner), steps_progress("choose") as step:
            scaled = api.scale(model, comma_list(clusters, "--clusters"), tokens, days, budget, batch_tokens,
                               tuple(int_list(sizes, "--microbatch")) if sizes else (1,), discount, runner,
                               on_point=lambda t: step(f"{t.point.servers} x {t.point.cluster}: {t.layout}"),
                               min_servers=min_servers, max_servers=max_servers, seq_len=seq_len)
        for answer in scaled.answers:  # what each search left out, and why
            if answer.skipped or answer.failed or not answer.simulated:
                warn(answer.searched())
        _show(json_out, scale_text(scaled), scaled.to_dict(), (lambda: plot_scale(scaled, plot)) if plot else None,
              html_out, lambda: scale_page(scaled))
        if not any(a.rows for a in scaled.answers):
            sys.exit(1)
        return

    refuse_per_replica("choose", per_replica_microbatches)
    refuse_given(_ONLY_WITH_TOKENS, lambda option: f"{option} goes with --tokens (the search over clusters); "
                                                   f"give --tokens or leave {option} out")
    prices = dict(api.parse_price(p) for p in price_overrides)
    names = api.parse_servers(servers, schedule, global_microbatches)
    mb_sizes = int_list(sizes, "--microbatch") if sizes else None
    if emits and fine_tune is not None:  # before the model is retraced for it
        raise click.UsageError("--emit: fine-tunes (LoRA, QLoRA) are written for no framework yet")
    to_emit = api.parse_emits(emits, Path(f"{Path(model).stem}-pick.json"), check=True)  # before the search
    chosen = (model if seq_len is None and recipe is None and fine_tune is None else
              api.retraced(api.load_trace(model), seq_len, recipe, fine_tune))
    runner = api.backend_for(backend, workers, address)
    with stops_on_signals("choose", STOPPED), _ending(runner), steps_progress("choose") as step:
        report = api.choose(chosen, names, schedule, mb_sizes, tuple(comma_list(strategies, "--strategy")),
                            global_microbatches, prices, rank_by, on_point=step, layouts=layouts,
                            headroom_gib=headroom_gib, backend=runner, runtime_profile=runtime_profile)
    _show(json_out, choose_text(report), report.to_dict(), (lambda: plot_choose(report, plot)) if plot else None,
          html_out, lambda: choose_page(report))
    if to_emit:
        trace = chosen if isinstance(chosen, api.Trace) else api.load_trace(chosen)
        for path in api.write_emits(api.pick_launch(report, trace, model), to_emit):
            click.echo(f"wrote {path}", err=True)  # stdout may be the JSON
    if not any(r.fits for r in report.rows):
        sys.exit(1)


_NOT_WITH_TOKENS = {"schedule": "--schedule", "strategies": "--strategy", "layouts": "--layouts",
                    "rank_by": "--rank-by", "headroom_gib": "--headroom", "price_overrides": "--price",
                    "global_microbatches": "--global-microbatches", "runtime_profile": "--runtime"}
"""``choose`` options (parameter -> option) the search over clusters does not use."""
_NOT_WITH_TOKENS_WHY = {
    "--schedule": "the search over clusters runs 1f1b",
    "--strategy": "the search over clusters tries none, then selective, then full recomputation",
    "--layouts": "the search over clusters tries its own layouts (tensor parallel inside a server; pipeline and "
                 "ZeRO-1, FSDP or HSDP across)",
    "--rank-by": "the search over clusters picks the fewest servers within --days and --budget",
    "--headroom": "the search over clusters marks no plan at risk",
    "--price": "the search over clusters prices each cluster from its file (--discount takes a fraction off)",
    "--global-microbatches": "the search over clusters holds --batch-tokens (tokens per iteration over all "
                             "replicas) fixed instead",
    "--runtime": "the search over clusters runs the default runtime profile (megatron-lm)",
}
_ONLY_WITH_TOKENS = {"clusters": "--clusters", "batch_tokens": "--batch-tokens", "discount": "--discount",
                     "min_servers": "--min-servers", "max_servers": "--max-servers"}
"""``choose`` options only the search over clusters (``--tokens``) uses."""


def _refuse_with_tokens(per_replica_microbatches: str | None, recipe: str | None,
                        fine_tune: api.FineTune | None = None) -> None:
    """``choose --tokens``: --microbatches, --recipe and fine-tuning refused in one line
    naming what the search over clusters takes instead."""
    if per_replica_microbatches is not None:
        raise click.UsageError("--microbatches and --tokens: the search over clusters derives each replica's "
                               "microbatches from --batch-tokens (tokens per iteration over all replicas); give "
                               "--batch-tokens or leave --microbatches out")
    if recipe is not None:
        raise click.UsageError("--recipe and --tokens: the search over clusters runs the model under its traced "
                               "recipe; trace it under another (mpsim trace --preset NAME --recipe R -o FILE) and give "
                               "that file as --model")
    if fine_tune is not None:
        raise click.UsageError("--lora, --qlora and --peft-config with --tokens: the search over clusters plans "
                               "pre-training runs; compare servers for a fine-tune with choose --servers")


STOPPED = "stopped with its worker processes, if any; nothing was written"
"""What ``fits`` and ``choose`` say after Ctrl-C or SIGTERM (``stops_on_signals``)."""


class _Runner(Protocol):
    """What ``_ending`` needs of a backend (``mpsim.studies.backends.Backend``)."""

    def abort(self) -> None: ...

    def close(self) -> None: ...


@contextmanager
def _ending(runner: _Runner | None) -> Iterator[None]:
    """Close ``runner`` after the block; when the block raised (Ctrl-C, SIGTERM), stop its
    work first (``Backend.abort``: a close alone waits for the batches under way)."""
    try:
        yield
    except BaseException:
        if runner is not None:
            runner.abort()
        raise
    finally:
        if runner is not None:
            runner.close()


def _show(json_out: str | None, text: str, data: dict, draw: Callable[[], None] | None, html_out: Path | None,
          html: Callable[[], str]) -> None:
    """A study's text or JSON, its plot (``draw``, when asked) and its HTML file (when asked)."""
    emit(json_out, text, data)
    if draw:
        draw()
    if html_out:
        html_out.write_text(html(), encoding="utf-8")
