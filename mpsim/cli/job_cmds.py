"""One job: ``simulate``, ``plan`` and ``validate``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from mpsim import api
from mpsim.cli.options import (
    STRATEGY_HELP,
    FiniteFloatRange,
    check_strategy_layout,
    cluster_options,
    emit,
    fine_tune_options,
    from_options,
    headroom_option,
    html_option,
    job_options,
    json_option,
    layout_options,
    refuse_given,
    warn,
    write_json,
)
from mpsim.cli.progress import stops_on_signals, tasks_progress


@click.command()
@job_options
@layout_options
@cluster_options
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False, path_type=Path),
              help="run this plan file (it fixes schedule, microbatches, partition, mapping and actions)")
@from_options("run a framework's configuration: {files}; give --model (the model it trains) and --server or "
              "--cluster with --servers")
@json_option
@click.option("--chrome-trace", type=click.Path(dir_okay=False, path_type=Path),
              help="write a timeline for Perfetto / chrome://tracing to this file (copy-engine lanes, link rates)")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="plot memory over time per GPU, with swap-outs and swap-ins, to this PNG")
@html_option
@headroom_option
def simulate(server: str | None, model: str | None, schedule: str, microbatch: int | None, microbatches: int,
             seq_len: int | None, recipe: str | None, fine_tune: api.FineTune | None, stages: int | None,
             strategy: str, partition: str,
             runtime_profile: str, expert_load: api.ExpertLoad, layout: api.Parallelism, cluster: str | None,
             servers: int,
             plan_path: Path | None, from_path: Path | None, from_format: str | None, json_out: str | None,
             chrome_trace: Path | None, plot: Path | None, html_out: Path | None, headroom_gib: float) -> None:
    """Simulate one training iteration: per-GPU peak memory, iteration time, throughput,
    and what each memory-saving technique saved and cost.

    Either a --strategy makes the plan (none, recompute, cpu-swap, d2d), or --plan runs a
    plan file written by `mpsim plan` or by hand (it fixes the layout: --dp, --tp and the
    like are then refused). --dp and --zero replicate the pipeline (DDP, ZeRO-1/2, FSDP):
    `mpsim simulate --server dgx-a100-80gb --model llama-3-8b --dp 8 --zero 3 --microbatch 1`
    is FSDP on eight GPUs; --tp 4 --sp splits each stage over 4 GPUs as Megatron-LM does.
    --cluster and --servers fill that many servers of a cluster: `mpsim simulate --cluster
    dgx-h100-superpod --servers 16 --model llama-3-70b --tp 8 --sp --dp 16 --zero 1` is ZeRO-1
    across 16 DGX H100s, tensor parallel inside each.
    Exits 1 when the job does not fit (the result still names where it ran out).
    """
    from mpsim.views.chrome import write_chrome_trace
    from mpsim.views.html import simulate_page
    from mpsim.views.plots import plot_memory
    from mpsim.views.text import Asked, simulate_text

    check_strategy_layout(strategy, layout)
    if from_path is not None:
        _simulate_from(from_path, from_format, api.Where(model or "", server or "", cluster, servers, seq_len),
                       plan_path, json_out, headroom_gib)
        return
    if plan_path is not None and layout != api.data_parallel(1, 0, None):
        raise click.UsageError("--dp, --zero, --tp, --sp, --virtual-stages and the bucket and reshard options: the "
                               "plan file fixes the layout; leave them out with --plan")
    if plan_path is not None and not expert_load.uniform:
        raise click.UsageError("--expert-load with --plan: plan files do not record the expert load yet; give the "
                               "layout (--ep) and --strategy instead of --plan")
    if plan_path is not None and (cluster is not None or servers != 1):
        raise click.UsageError("--cluster and --servers: plan files describe one server; leave them out with --plan")
    if cluster is not None and server is None:
        server = api.load_cluster(cluster).server.source
    topo, trace, plan_file = api.load_job(server, model, plan_path, seq_len, recipe, fine_tune)
    warn(api.measured_warning(trace, topo))
    with tasks_progress("simulate"):
        if plan_file is None:  # the plan too, for --html
            planned = api.plan(topo, trace, schedule, microbatch, microbatches, n_stages=stages, strategy=strategy,
                               partition=partition, record_link_rates=chrome_trace is not None, parallelism=layout,
                               cluster=cluster, servers=servers, runtime_profile=runtime_profile,
                               expert_load=expert_load)
            result, plan_file = planned.result, planned.plan
        else:
            result = api.simulate(topo, trace, plan_file=plan_file, record_link_rates=chrome_trace is not None,
                                  runtime_profile=runtime_profile)
    data = result.to_dict()
    for g, d in zip(result.gpus, data["gpus"], strict=True):
        d["reserved"] = g.reserved(expandable=True).to_dict(headroom_gib)  # to_dict's at the default headroom
    emit(json_out, simulate_text(result, headroom_gib, Asked(model, server, cluster)), data)
    if chrome_trace:
        write_chrome_trace(result, chrome_trace)
    if plot:
        plot_memory(result, plot)
    if html_out:
        html_out.write_text(simulate_page(result, plan_file, headroom_gib), encoding="utf-8")
    if not result.fits:
        sys.exit(1)


_FROM_FILE = {"schedule": "--schedule", "microbatch": "--microbatch", "microbatches": "--microbatches",
              "recipe": "--recipe", "stages": "--stages", "strategy": "--strategy",
              "partition": "--partition", "runtime_profile": "--runtime", "dp": "--dp", "zero": "--zero",
              "tp": "--tp", "sp": "--sp", "cp": "--cp", "ep": "--ep", "virtual_stages": "--virtual-stages",
              "lora": "--lora", "qlora": "--qlora", "peft_config": "--peft-config", "lora_rank": "--lora-rank"}
"""``simulate`` options a ``--from`` configuration states itself."""


def _simulate_from(path: Path, fmt: str | None, where: api.Where, plan_path: Path | None, json_out: str | None,
                   headroom_gib: float) -> None:
    """``simulate --from``: a framework's configuration read and simulated (``where``: what
    the command line says of it, the server the cluster's when not given); exits 1 when it
    does not fit."""
    from dataclasses import replace

    from mpsim.views.text import Asked, simulate_text

    _check_from(where.model or None, plan_path)
    if not where.server:
        where = replace(where, server=api.load_cluster(where.cluster).server.source if where.cluster
                        else api.DEFAULT_SERVER)
    result = api.simulate_from(path, fmt, where)[3]
    emit(json_out, simulate_text(result, headroom_gib, Asked(where.model, where.server, where.cluster)),
         result.to_dict())
    if not result.fits:
        sys.exit(1)


def _check_from(model: str | None, plan_path: Path | None) -> None:
    """``simulate --from``: the model named, and nothing the configuration states given again."""
    if plan_path is not None:
        raise click.UsageError("--from and --plan each give the whole job: give one of them")
    if model is None:
        raise click.UsageError("--from needs --model: the model the configuration trains (a shipped name or a "
                               "trace file)")
    refuse_given({k: v for k, v in _FROM_FILE.items() if _is_param(k)},
                 lambda option: f"{option} and --from: the configuration states it; leave {option} out")


def _is_param(name: str) -> bool:
    return any(p.name == name for p in click.get_current_context().command.params)


@click.command("plan")
@job_options
@layout_options
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="plan JSON file to write")
@click.option("--emit", "emits", multiple=True, metavar="FORMAT[=FILE]",
              help="also write the job as a framework's own configuration: megatron (a torchrun script of "
                   "pretrain_gpt.py's arguments), torchtitan (its TOML), deepspeed (its JSON) or accelerate (its "
                   "FSDP config YAML), with the prediction in a comment; FILE defaults to the plan's beside it "
                   "(plan.megatron.sh ...); repeat for several")
@json_option
def plan_cmd(server: str | None, model: str | None, schedule: str, microbatch: int | None, microbatches: int,
             seq_len: int | None, recipe: str | None, fine_tune: api.FineTune | None, stages: int | None,
             strategy: str, partition: str,
             runtime_profile: str, expert_load: api.ExpertLoad, layout: api.Parallelism, output: Path,
             emits: tuple[str, ...], json_out: str | None) -> None:
    """Make a memory-saving plan with a strategy and write it as a plan file.

    Prints the plan per stage and its simulated result; `mpsim simulate --plan FILE`
    runs it again, and the file can be edited by hand. Exits 1 when the plan does not fit.
    With --emit the job is also written as Megatron-LM, torchtitan, DeepSpeed or
    Accelerate configuration (`mpsim simulate --from FILE` reads it back).
    """
    from mpsim.views.text import plan_text, simulate_text

    check_strategy_layout(strategy, layout)
    if emits and fine_tune is not None:  # before the model is retraced for it
        raise click.UsageError("--emit: fine-tunes (LoRA, QLoRA) are written for no framework yet")
    to_emit = api.parse_emits(emits, output, plan_file=True, check=True)  # refused before anything is planned
    topo, trace, _ = api.load_job(server, model, seq_len=seq_len, recipe=recipe, fine_tune=fine_tune)
    warn(api.measured_warning(trace, topo))
    with tasks_progress("plan"):
        job = api.job_of(topo, trace, schedule=schedule, microbatch=microbatch, microbatches=microbatches,
                         n_stages=stages, strategy=strategy, partition=partition, parallelism=layout,
                         runtime_profile=runtime_profile, expert_load=expert_load)
        planned = api.plan_job(job)
    written = (api.write_emits(api.launch_of(job, planned, model or api.DEFAULT_MODEL, server or topo.name), to_emit)
               if to_emit else [])
    api.write_plan_file(planned.plan, output)
    if json_out != "-":
        click.echo(plan_text(planned.plan))
        click.echo("")
        click.echo(simulate_text(planned.result))
        click.echo(f"wrote {output} ({planned.simulations} simulation(s) to plan)")
        for path in written:
            click.echo(f"wrote {path}")
    write_json(json_out, {"plan": json.loads(planned.plan.to_json()), "result": planned.result.to_dict()})
    if not planned.result.fits:
        sys.exit(1)


@click.command("validate")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False, path_type=Path),
              help="plan JSON file to run  [default: make one with --strategy]")
@from_options("run the plan a framework's configuration states: {files}, training --model at its measured "
              "sequence length and recipe")
@click.option("--model", "-m", default="gpt-tiny", show_default=True,
              help="model preset to build and measure (see `mpsim trace --preset`), a measured trace JSON file, or "
                   "a mixture of experts' Hugging Face config.json (traced as `mpsim trace --hf` does; with --ep); "
                   "with --lora, --qlora or --peft-config a Llama decoder's transformers config.json")
@click.option("--server", "-s", help="topology file of this machine  [default: probe it]")
@click.option("--strategy", default="none", show_default=True, help="without --plan: " + STRATEGY_HELP)
@click.option("--schedule", type=click.Choice(["gpipe", "1f1b"]), default=api.DEFAULT_SCHEDULE,
              show_default=True,
              help="without --plan: pipeline schedule")
@click.option("--microbatches", type=click.IntRange(min=1), default=4, show_default=True,
              help="without --plan: microbatches each replica (pipeline) runs per iteration")
@click.option("--stages", type=click.IntRange(min=1), default=2, show_default=True,
              help="without --plan: pipeline stages (processes)")
@click.option("--device", default="cpu", show_default=True, help="cpu (gloo) or cuda (NCCL)")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True, help="on CPU: threads per process")
@click.option("--memory-mib", type=FiniteFloatRange(min=1),
              help="memory each stage may use, enforced  [default: the device's; on CPU RAM / stages]")
@click.option("--steps", type=click.IntRange(min=1), default=5, show_default=True, help="timed steps (median)")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="untimed steps before them")
@layout_options
@fine_tune_options
@json_option
def validate_cmd(plan_path: Path | None, from_path: Path | None, from_format: str | None, model: str,
                 server: str | None, strategy: str, schedule: str, microbatches: int, stages: int, device: str,
                 threads: int, memory_mib: float | None, steps: int, warmup: int, layout: api.Parallelism,
                 fine_tune: api.FineTune | None, json_out: str | None) -> None:
    """Run a plan on this machine and compare it with the simulator.

    Measures the model's layers here (or takes a measured trace), probes this machine
    (or takes --server), simulates the plan, runs it with the PyTorch executor
    (validate/executor.py, one process per stage and replica under torchrun: DDP, ZeRO-1/2
    and FSDP2 with --dp and --zero) and prints per GPU the predicted and measured peak
    memory with its breakdown, and the iteration time, with the errors in percent. An
    out-of-memory during the run is reported as a result (stage, step, phase) under either
    schedule, and exits 1. Ctrl-C or SIGTERM ends torchrun and its ranks and removes the
    scratch folder (exit 130 or 143, one line).

    A mixture of experts runs from its Hugging Face config.json (Mixtral, OLMoE, Qwen3-MoE)
    with expert parallelism: `mpsim validate --model tests/data/tiny-mixtral.json --ep 2
    --dp 2 --stages 1` (validate/expert_parallel.py: experts split over the --ep ranks,
    tokens dispatched and combined with all-to-alls, routing forced to the trace's uniform
    load); each GPU's routed copies per MoE layer are printed beside the prediction.
    One pipeline stage, DDP (no ZeRO), no tensor parallelism.

    A LoRA or QLoRA fine-tune runs from a Llama decoder's transformers config.json with
    --lora, --qlora or --peft-config: `mpsim validate --model config.json --lora --lora-rank 8
    --stages 1 --dp 2` (validate/finetune.py: the transformers model, PEFT's get_peft_model,
    QLoRA's base stored in 4 bits, AdamW over the adapters). Each GPU's trainable parameters,
    the trace's and PEFT's, are printed beside the peaks, and on CPU the prediction again with
    the loss head's backward workspace measured (a derived trace takes its forward's, which
    under-counts the peak). One pipeline stage, DDP (no ZeRO), no tensor parallelism.

    --from runs the job a framework's configuration states, exactly as `mpsim simulate --from`
    reads it: `mpsim plan --model trace.json --server cpu.yaml --stages 2 --emit
    megatron=job.sh -o plan.json`, then `mpsim validate --from job.sh --model trace.json
    --server cpu.yaml` runs the plan that `mpsim validate --plan plan.json` runs. The model is
    the one measured here: a configuration at another sequence length or recipe is refused.
    """
    from mpsim.views.measured import validation_text

    if from_path is not None:
        _check_validate_from(plan_path)
    elif plan_path is None:
        check_strategy_layout(strategy, layout)
    with stops_on_signals("validate", "no process of it was left running"):  # during the run: torchrun's own line
        if from_path is not None:
            report = api.validate(model, None, server, device=device, threads=threads, memory_mib=memory_mib,
                                  steps=steps, warmup=warmup, from_path=from_path, from_format=from_format)
        else:
            report = api.validate(model, plan_path, server, strategy=strategy, schedule=schedule,
                                  microbatches=microbatches, stages=stages, device=device, threads=threads,
                                  memory_mib=memory_mib, steps=steps, warmup=warmup, parallelism=layout,
                                  fine_tune=fine_tune)
    emit(json_out, validation_text(report) + _routed_text(report) + _fine_tune_text(report)
         + _configuration_text(report), report)
    if report["oom"]:
        sys.exit(1)


_VALIDATE_FROM_FILE = {"strategy": "--strategy", "schedule": "--schedule", "microbatches": "--microbatches",
                       "stages": "--stages", "dp": "--dp", "zero": "--zero", "bucket_mib": "--bucket-mib",
                       "reshard": "--reshard/--no-reshard", "tp": "--tp", "sp": "--sp", "ep": "--ep", "cp": "--cp",
                       "cp_attention": "--cp-attention", "hsdp": "--hsdp", "virtual_stages": "--virtual-stages",
                       "lora": "--lora", "qlora": "--qlora", "peft_config": "--peft-config",
                       "lora_rank": "--lora-rank"}
"""``validate`` options a ``--from`` configuration states itself (or that it cannot run with)."""


def _check_validate_from(plan_path: Path | None) -> None:
    """``validate --from``: no plan beside it, and nothing the configuration states given again."""
    if plan_path is not None:
        raise click.UsageError("--from and --plan each give the whole job: give one of them")
    refuse_given(_VALIDATE_FROM_FILE, lambda option: f"{option} and --from: the configuration states the job; leave "
                                                     f"{option} out")


def _configuration_text(report: dict) -> str:
    """``validate --from``: the configuration the plan came from."""
    conf = report.get("configuration")
    return f"\nran the {conf['format']} configuration {conf['file']}" if conf else ""


def _routed_text(report: dict) -> str:
    """A mixture of experts' routed copies per GPU (``api.validate``'s rows): predicted per
    MoE layer and microbatch, received (routing forced), and what the real router chose."""
    rows = [r for r in report["stages"] if "measured_routed_copies" in r]
    if not rows:
        return ""
    lines = ["", f"routed copies per MoE layer and microbatch ({report['routing']}; EP x{report['expert_parallel']}):"]
    for r in rows:
        got, router = r["measured_routed_copies"], r["router_routed_copies"]
        lines.append(f"  GPU {r['gpu']} (ep rank {r['ep_rank']}): predicted {r['predicted_routed_copies']}, received "
                     f"{min(got)}-{max(got)}, the real router's choice {min(router)}-{max(router)}")
    return "\n".join(lines)


def _fine_tune_text(report: dict) -> str:
    """A fine-tune's rows (``api.validate``'s with --lora, --qlora or --peft-config): per GPU
    the plain prediction's peak and error, on CPU the prediction again with the loss head's
    backward workspace measured (labelled so; the plain one stays the report's), and the
    trainable and all parameters, the trace's against PEFT's on the rank."""
    if "fine_tune" not in report:
        return ""
    mib = 2**20
    head = report.get("head_backward_workspace_bytes")
    lines = ["", f"fine-tune: {report['fine_tune']}; trainable parameters predicted "
                 f"{report['predicted_trainable_params']:,} of {report['predicted_params']:,}"]
    cols = f"  {'GPU':>3} {'predicted MiB':>13} {'measured MiB':>12} {'error':>7}"
    if head is not None:
        cols += f"   {'with measured head bwd workspace':>32}"
    lines.append(cols + f"   {'trainable (trace / PEFT)':>26}   {'all params (trace / PEFT)':>26}")
    for r in report["stages"]:
        measured = r.get("measured_peak_bytes")
        line = f"  {r['gpu']:>3} {r['predicted_peak_bytes'] / mib:13.3f} "
        if measured is not None:
            line += f"{measured / mib:12.3f} {r['peak_error_pct']:+6.2f}%"
        else:
            line += f"{'-':>12} {'-':>7}"
        if head is not None:
            again = f"{r['predicted_peak_bytes_measured_head'] / mib:.3f} MiB"
            if "peak_error_pct_measured_head" in r:
                again += f", {r['peak_error_pct_measured_head']:+.2f}%"
            line += f"   {again:>32}"
        peft = r.get("peft_params")
        trainable = f"{r['predicted_trainable_params']:,} / " + (f"{peft['trainable']:,}" if peft else "-")
        total = f"{report['predicted_params']:,} / " + (f"{peft['all']:,}" if peft else "-")
        lines.append(line + f"   {trainable:>26}   {total:>26}")
    if head is not None:
        lines.append(f"(head backward workspace: the derived trace takes the forward's {head['trace']:,} bytes for it; "
                     f"measured here {head['measured']:,}; the plain prediction is the one above)")
    return "\n".join(lines)
