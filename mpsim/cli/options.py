"""What the commands share: option declarations and help strings, comma-separated lists,
and the way a result is printed (text for a person, JSON on request)."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from mpsim import api
from mpsim.errors import MpsimError

F = TypeVar("F", bound=Callable[..., Any])

SERVER_HELP = "shipped server name (see `mpsim topo list`) or a topology YAML file"
SCHEDULE_HELP = "gpipe, 1f1b (DAPPLE, PipeDream-Flush) or pipedream (asynchronous, weight stashing)"
MICROBATCHES_HELP = ("microbatches each replica (pipeline) runs per iteration, as Megatron-LM counts them; at "
                     "most 4096; 1f1b and pipedream need at least one per stage")
GLOBAL_MICROBATCHES_HELP = ("microbatches per iteration over all replicas (the global batch, held fixed across "
                            "layouts): a layout of dp replicas runs ceil(N / dp) each, at least one per stage for "
                            "1f1b and pipedream")
SEQ_LEN_HELP = ("tokens per sample: retrace the model (a shipped transformer, or a trace file that records its "
                "shape) at this sequence length under FakeTensor, at most its max positions if it records them  "
                "[default: the trace's]")
STRATEGY_HELP = api.STRATEGY_HELP
RUNTIME_HELP = ("what the framework does at run time: megatron-lm (tensor-parallel collectives on the critical "
                "path, gradient reduction overlapped with the backward), megatron-lm-sync-grads (gradients reduced "
                "after the backward), megatron-core-tp-overlap and torchtitan-async-tp (tensor-parallel collectives "
                "hidden behind their layer's GEMMs), megatron-core-ep-overlap (mixture-of-experts all-to-alls "
                "hidden behind compute as far as the layer's GEMMs last), eager (every kernel launched from Python, "
                "8 us of host time "
                "each), deepspeed (eager, gradients reduced after the backward); with --plan it applies too")
PARTITION_HELP = ("layers to stages: compute (balance compute time, as PipeDream/DAPPLE) or memory "
                  "(balance predicted peak memory, mCAP)")


def _apply(f: F, options: list[Callable[[F], F]]) -> F:
    for opt in reversed(options):
        f = opt(f)
    return f


def job_options(f: F) -> F:
    """Options shared by simulate and plan."""
    return _apply(f, [
        click.option("--server", "-s", help=SERVER_HELP + "  [default: the plan's, else dgx1-v100]"),
        click.option("--model", "-m", help="shipped model name (see traces/) or a trace JSON file"
                                           "  [default: the plan's, else gpt-5.3b]"),
        click.option("--schedule", default=api.DEFAULT_SCHEDULE, show_default=True, help=SCHEDULE_HELP),
        click.option("--microbatch", type=int, help="samples per microbatch  [default: the trace's]"),
        click.option("--microbatches", type=int, default=api.DEFAULT_MICROBATCHES, show_default=True,
                     help=MICROBATCHES_HELP),
        click.option("--seq-len", type=click.IntRange(min=1), help=SEQ_LEN_HELP),
        recipe_option,
        fine_tune_options,
        click.option("--stages", type=int, help="pipeline stages  [default: one per GPU of each replica]"),
        click.option("--strategy", default="none", show_default=True, help=STRATEGY_HELP),
        click.option("--partition", default="compute", show_default=True, help=PARTITION_HELP),
        runtime_option,
        expert_load_option,
    ])


RECIPE_OPTION_HELP = ("training precision: retrace the model (a shipped transformer, or a trace file that records its "
                      "shape) under this recipe: " + api.RECIPE_HELP + "  [default: the trace's]")
recipe_option = click.option("--recipe", type=click.Choice(list(api.RECIPES)), help=RECIPE_OPTION_HELP)
"""``--recipe``: the model retraced under another training precision (``api.at_recipe``)."""

FINE_TUNE_HELP = {
    "lora": "fine-tune with LoRA (Hu et al. 2021): the model frozen, PEFT's adapters of rank 16 (alpha 32, dropout "
            "0.05) on every linear layer of its blocks trained; the model retraced through its transformers modules "
            "(a shipped Llama, Mistral, Qwen2 or GPT-2 shape)",
    "qlora": "fine-tune with QLoRA (Dettmers et al. 2023): --lora's adapters on a base whose linear layers are "
             "stored in 4-bit NF4 with double quantization (0.516 bytes a weight), dequantized for each GEMM",
    "peft": "a PEFT adapter_config.json (or its folder): its rank, alpha, dropout, target modules, DoRA and "
            "modules_to_save; with --qlora on the 4-bit base",
    "rank": "the adapters' rank with --lora or --qlora  [default: 16]",
}


def fine_tune_options(f: F) -> F:
    """``--lora``, ``--qlora``, ``--peft-config`` and ``--lora-rank``, handed to the command
    as one ``fine_tune`` (``api.fine_tune_of``: None when none is given)."""

    @functools.wraps(f)
    def command(*args: Any, lora: bool, qlora: bool, peft_config: Path | None, lora_rank: int | None,
                **kwargs: Any) -> Any:
        try:
            fine_tune = api.fine_tune_of(lora, qlora, peft_config, lora_rank)
        except MpsimError as exc:
            raise click.UsageError(str(exc)) from None
        return f(*args, fine_tune=fine_tune, **kwargs)

    return _apply(command, [  # type: ignore[return-value]
        click.option("--lora", is_flag=True, help=FINE_TUNE_HELP["lora"]),
        click.option("--qlora", is_flag=True, help=FINE_TUNE_HELP["qlora"]),
        click.option("--peft-config", type=click.Path(path_type=Path), help=FINE_TUNE_HELP["peft"]),
        click.option("--lora-rank", type=click.IntRange(1, 1 << 16), help=FINE_TUNE_HELP["rank"]),
    ])


FROM_FILES = ("a Megatron-LM launch script (.sh), torchtitan TOML, DeepSpeed JSON or Accelerate FSDP YAML (`mpsim "
              "plan --emit` writes them)")


def from_options(what: str) -> Callable[[F], F]:
    """``--from FILE`` (``what`` the command does with the configuration) and ``--from-format``."""
    return lambda f: _apply(f, [
        click.option("--from", "from_path", type=click.Path(dir_okay=False, path_type=Path),
                     help=what.format(files=FROM_FILES)),
        click.option("--from-format", type=click.Choice(list(api.FORMATS)),
                     help="the --from file's format  [default: from its suffix]"),
    ])


def _expert_load(_ctx: click.Context, _param: click.Parameter, value: str) -> api.ExpertLoad:
    try:
        return api.parse_expert_load(value)
    except MpsimError as exc:
        raise click.BadParameter(str(exc)) from None


expert_load_option = click.option(
    "--expert-load", "expert_load", default="uniform", show_default=True, callback=_expert_load,
    help="how a mixture of experts routes tokens, for the busiest expert-parallel GPU: uniform; the busiest "
         "expert's share of routed tokens (0.1 or 10%); or a JSON file of tokens per expert (measured)")
"""``--expert-load``, handed to the command as an ``ExpertLoad`` (``mpsim.models.expert_parallel``)."""

runtime_option = click.option("--runtime", "runtime_profile", type=click.Choice(list(api.PROFILES)),
                              default=api.DEFAULT_PROFILE, show_default=True, help=RUNTIME_HELP)
"""``--runtime``, handed to the command as ``runtime_profile`` (``mpsim.timing.runtime``)."""


def global_microbatches_options(command: str, default: int | str, many: bool = False) -> Callable[[F], F]:
    """``--global-microbatches`` (``many``: a comma-separated list), the count a study that
    compares layouts at one global batch holds fixed, and ``--microbatches``, which such a
    command refuses (``refuse_per_replica``): everywhere else it counts one replica's, and a
    per-replica count would give each layout another global batch."""
    return lambda f: _apply(f, [
        click.option("--global-microbatches", "global_microbatches", type=str if many else int, default=default,
                     show_default=True,
                     help=("comma-separated counts, each " if many else "") + GLOBAL_MICROBATCHES_HELP),
        click.option("--microbatches", "per_replica_microbatches", metavar="N",
                     help=f"refused here: it counts one replica's microbatches (as in simulate and plan), and "
                          f"{command} compares layouts at a fixed global batch; give --global-microbatches"),
    ])


def refuse_per_replica(command: str, given_value: str | None) -> None:
    """Refuse ``--microbatches`` in a command that holds the global batch fixed, in one line
    naming ``--global-microbatches``."""
    if given_value is not None:
        raise click.UsageError(f"--microbatches counts one replica's microbatches (as in simulate and plan); {command} "
                               f"compares layouts at a fixed global batch: give --global-microbatches {given_value} "
                               "(per iteration over all replicas) instead")


def layout_options(f: F) -> F:
    """--dp, --zero, --bucket-mib, --reshard/--no-reshard, --tp, --sp, --virtual-stages,
    handed to the command as one ``layout`` (a ``Parallelism``; its pipeline depth comes from --stages)."""

    @functools.wraps(f)
    def with_layout(*args: Any, dp: int, zero: int, bucket_mib: float, reshard: bool, tp: int, sp: bool,
                    virtual_stages: int, hsdp: bool, ep: int, cp: int, cp_attention: str, **kwargs: Any) -> Any:
        if hsdp and given("zero") and zero != 3:
            raise click.UsageError(f"--hsdp and --zero {zero}: HSDP shards the states inside each server as ZeRO-3 "
                                   "does (it implies --zero 3); leave --zero out or give --zero 3")
        if cp == 1 and given("cp_attention"):
            raise click.UsageError(f"--cp-attention {cp_attention}: it says how context-parallel GPUs share keys and "
                                   "values; give --cp 2 or more")
        axes = tuple((name, n) for name, n in (("context", cp), ("expert", ep)) if n > 1)
        return f(*args, layout=api.data_parallel(dp, 3 if hsdp else zero, None, bucket_mib=bucket_mib,
                                                 reshard_after_forward=reshard, tensor=tp, sequence_parallel=sp,
                                                 virtual_stages=virtual_stages, hsdp=hsdp, axes=axes,
                                                 context_attention=cp_attention),
                 **kwargs)

    return _apply(with_layout, [  # type: ignore[return-value]
        click.option("--dp", type=click.IntRange(min=1), default=1, show_default=True,
                     help="data-parallel replicas of the pipeline (DDP; ZeRO or FSDP with --zero); the pipeline "
                          "takes the GPUs left per replica unless --stages says"),
        click.option("--zero", type=click.IntRange(0, 3), default=0, show_default=True,
                     help="ZeRO stage of the replicas: 1 shards optimizer states, 2 also gradients, 3 also "
                          "parameters (FSDP)"),
        click.option("--bucket-mib", type=click.FloatRange(min=0, min_open=True), default=25.0, show_default=True,
                     help="gradient bucket of DDP and ZeRO-1/2, MiB"),
        click.option("--reshard/--no-reshard", default=True, show_default=True,
                     help="ZeRO-3 / FSDP: free each layer's gathered parameters after its forward "
                          "(reshard_after_forward)"),
        click.option("--tp", type=click.IntRange(min=1, max=64), default=1, show_default=True,
                     help="tensor-parallel GPUs per stage (Megatron-LM: heads, MLP and vocabulary split t ways, "
                          "two all-reduces per layer each way), placed on the fastest links"),
        click.option("--sp/--no-sp", default=False, show_default=True,
                     help="sequence parallel with --tp: norms and dropout on a sequence shard, all-gather and "
                          "reduce-scatter instead of all-reduce (Korthikanti et al. 2022)"),
        click.option("--ep", type=click.IntRange(min=1), default=1, show_default=True,
                     help="expert-parallel GPUs (mixture-of-experts models): each MoE layer's routed experts split "
                          "over them, the dense layers data parallel over them, tokens sent to their experts and "
                          "back in all-to-alls; --dp replicas of that, as Megatron-Core lays them out"),
        click.option("--cp", type=click.IntRange(min=1), default=1, show_default=True,
                     help="context-parallel GPUs: every sequence split over them (long context), each running its "
                          "tokens and its queries' attention over the whole sequence; weights shared, gradients "
                          "reduced over --dp x --cp; --cp-attention says how keys and values travel"),
        click.option("--cp-attention", type=click.Choice(["ring", "all-gather", "all-to-all"]), default="ring",
                     show_default=True,
                     help="with --cp: ring (key/value blocks passed peer to peer beside the attention, Megatron-Core), "
                          "all-gather (keys and values gathered first, Llama 3) or all-to-all (a split over heads, "
                          "DeepSpeed-Ulysses)"),
        click.option("--hsdp", is_flag=True, default=False,
                     help="on a cluster: shard states inside each server, replicate them across servers (FSDP2's "
                          "HSDP; implies --zero 3)"),
        click.option("--virtual-stages", type=click.IntRange(min=1, max=64), default=1, show_default=True,
                     help="model chunks per GPU: interleaved 1F1B (Narayanan et al. 2021), with --schedule 1f1b "
                          "and microbatches a multiple of the stages"),
    ])


def cluster_options(f: F) -> F:
    """--cluster, --servers: run on that many servers of a cluster (``mpsim.hardware.cluster``)."""
    return _apply(f, [
        click.option("--cluster", help="a shipped cluster (mpsim topo list) or a cluster YAML file: servers of one "
                                       "type and the fabric joining them; --server defaults to its server"),
        click.option("--servers", type=click.IntRange(min=1), default=1, show_default=True,
                     help="with --cluster: servers the job fills (data x tensor x pipeline = all their GPUs)"),
    ])


def layouts_option(default: str) -> Callable[[F], F]:
    """--layouts: the parallel layouts a study searches (``mpsim.plans.layouts``), ``default`` unless told."""
    return click.option("--layouts", default=default, show_default=True, help=api.LAYOUTS_HELP)


def backend_options(f: F) -> F:
    """--backend, --address: where the points run (local processes or a Ray cluster)."""
    return _apply(f, [
        click.option("--backend", type=click.Choice(["local", "ray"]), default="local", show_default=True,
                     help="local worker processes, or tasks on a Ray cluster (pip install 'mpsim[ray]')"),
        click.option("--address", help="Ray cluster: auto (the one `ray start` joined this machine to) or "
                                       "HOST:PORT of its head  [default: a Ray instance started here, -j CPUs]"),
    ])


def json_option(f: F) -> F:
    return click.option("--json", "json_out", metavar="FILE",
                        help="write the result as JSON to FILE ('-' for stdout)")(f)


class FiniteFloatRange(click.FloatRange):
    """click's ``FloatRange`` that also refuses ``nan`` (which every comparison with a bound
    lets through) and infinities, in click's one-line form."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            low, high = ("" if b is None else f"{b:g}" for b in (self.min, self.max))
            self.fail(f"{value!r} is not a finite number; expected one from {low or '-inf'} to {high or 'inf'}",
                      param, ctx)
        return number


def headroom_option(f: F) -> F:
    """``--headroom GiB``: the margin a plan should leave (``mpsim.sim.reserved``), a finite
    number from 0 to ``api.MAX_HEADROOM_GIB`` (``nan`` once passed and cleared every at-risk
    mark, since no comparison with it is true)."""
    return click.option(
        "--headroom", "headroom_gib", type=FiniteFloatRange(min=0, max=api.MAX_HEADROOM_GIB),
        default=api.DEFAULT_HEADROOM_GIB,
        show_default=True, help="GiB a plan should leave free: a plan that fits but whose reserved estimate (caching "
                                "allocator, CUDA context, NCCL buffers) comes closer to a GPU's memory is 'at risk'")(f)


def html_option(f: F) -> F:
    return click.option("--html", "html_out", type=click.Path(dir_okay=False, path_type=Path),
                        help="write the same views as one self-contained HTML file (inline CSS and SVG charts, "
                             "nothing fetched)")(f)


def given(name: str) -> bool:
    """Whether the running command's parameter ``name`` was given (on the command line or
    from the environment), not left at its default: a default is nobody's choice."""
    source = click.get_current_context().get_parameter_source(name)
    return source is not None and source not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)


def refuse_given(options: dict[str, str], message: Callable[[str], str]) -> None:
    """Refuse, in one line (``message(option)``, naming it and what it clashes with), the
    first of ``options`` (parameter name -> option) that was given where it is not used."""
    for name, option in options.items():
        if given(name):
            raise click.UsageError(message(option))


def check_strategy_layout(strategy: str, layout: api.Parallelism) -> None:
    """Refuse --zero or --hsdp that contradict the strategy's own ZeRO stage (ZeRO-Offload
    runs ZeRO-2, ZeRO-Infinity ZeRO-3) instead of letting the strategy override them."""
    api.check_zero_stage(strategy, layout.zero_stage, layout.hsdp, given=given("zero"))


def comma_list(text: str, option: str = "") -> list[str]:
    """A comma-separated option value; an empty item (``1,,2``, a trailing comma) is refused."""
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise MpsimError(f"{_where(option)}expected a comma-separated list without empty items, got {text!r}")
    return items


def int_list(text: str, option: str = "") -> list[int]:
    """A comma-separated option value of integers."""
    items = comma_list(text, option)
    try:
        return [int(x) for x in items]
    except ValueError:
        raise MpsimError(f"{_where(option)}expected a comma-separated list of integers, got {text!r}") from None


def _where(option: str) -> str:
    return f"{option}: " if option else ""


def emit(json_out: str | None, text: str, data: dict) -> None:
    """A command's result: ``text`` for a person (unless the JSON goes to stdout) and
    ``data`` as JSON where ``--json`` says."""
    if json_out != "-":
        click.echo(text)
    write_json(json_out, data)


def write_json(target: str | None, data: dict) -> None:
    """``data`` as JSON to ``target`` (``-``: standard output; None: nowhere)."""
    if not target:
        return
    text = json.dumps(data, indent=1)
    if target == "-":
        click.echo(text)
    else:
        Path(target).write_text(text + "\n")


def warn(line: str | None) -> None:
    """A warning line on standard error (nothing for None)."""
    if line:
        click.echo(f"mpsim: warning: {line}", err=True)
