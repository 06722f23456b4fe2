"""Plan files: what a memory-saving plan tells the simulator and the executor (JSON).

A plan fixes the pipeline (schedule, microbatches, the layers of each stage and the GPU it
runs on) and, per stage, what happens to each layer's saved activations and to the
stage's optimizer states and stashed weights. Layers a stage does not list are kept.

Actions on a layer's saved activations (everything its backward needs, its input
included when it saves it):

- ``keep``: resident from the layer's forward to its backward;
- ``recompute``: dropped after the forward, the layer input kept as the checkpoint, the
  forward re-run on the compute stream just before the backward;
- ``selective``: selective activation recomputation (Korthikanti et al. 2022, section
  4.2): only what the attention core keeps beyond its inputs (the trace's
  ``attention_core_bytes``: softmax probabilities, dropout mask, scores) is dropped after
  the forward; the core's forward (``attention_core_flops`` and
  ``attention_core_mem_bytes``) re-runs on the compute stream just before the layer's
  backward. Only for layers whose core keeps something (eager attention; a flash
  kernel keeps almost nothing);
- ``host``: copied to pinned host memory after the forward, back before the backward;
- ``peer``: the same over NVLink to other GPUs' spare memory, striped over ``peers``
  (MPress III-C, "data striping"): each peer takes its ``fraction`` of the bytes.

``split`` (p >= 1) runs the layer's forward and backward as p micro-ops over one of the
layer's splittable dimensions (TSPLIT III-A), combined with any action above (with
``selective``, the core's recompute runs as p micro-ops too).

Per stage, ``optimizer`` is ``gpu`` (default), ``host-update`` (ZeRO-Offload style: the
optimizer states live on the host and the update runs on the CPU) or ``host-stream``
(states live on the host and are streamed in and out around a GPU update);
``optimizer_layers`` narrows the last two to the named layers' states, the others
staying on the GPU (MPress's GPU-CPU swap of model data, tensor by tensor); ``stash`` is
``gpu`` or ``host`` (PipeDream's stashed weight versions kept in host memory, the
version a backward needs copied in before it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, StrictBool, StrictInt

from mpsim.datafile import FileModel, read_data_file, validate
from mpsim.errors import MpsimError, SchemaError
from mpsim.hardware.topology import Topology
from mpsim.limits import MAX_REPLICAS
from mpsim.models.context_parallel import ContextAttention
from mpsim.models.finetune import FineTune
from mpsim.models.trace import LayerRow, Trace
from mpsim.plans.mesh import parse_layout
from mpsim.plans.schedule import MAX_MICROBATCH, MAX_MICROBATCHES, SCHEDULES, check_schedule

SCHEMA_VERSION = 4
SCHEMA_VERSIONS = (1, 2, 3, 4)
"""Versions read; 1 has no ``data_parallel``, 2 no ``tensor_parallel``, 3 no ``mesh``.
``make_plan`` writes the oldest that says the plan: 2 unless it has tensor-parallel groups
or virtual stages (3), or a layout only a mesh names (4: HSDP, registered axes), so plans
older readers take stay readable."""
STRIPE_TOLERANCE = 1e-6
DEFAULT_SPLIT_SLOWDOWN_PER_EXTRA_OP = 0.03
"""Default cost of a split: each micro-op beyond the first adds 3% of the layer's time
(kernel launches and lower utilisation of smaller kernels, TSPLIT III-B and Fig. 5; the
split and merge copies themselves are under 1% of the run, TSPLIT V-B)."""


MAX_SPLIT = 1024
"""The most micro-ops a layer may be split into."""



class Stripe(FileModel):
    gpu: int = Field(description="peer GPU that holds this part")
    fraction: float = Field(gt=0, le=1, description="share of the tensor's bytes on this peer")


class LayerAction(FileModel):
    layer: int = Field(description="layer index in the trace (0-based)")
    action: Literal["keep", "recompute", "selective", "host", "peer"] = "keep"
    peers: list[Stripe] = Field(default_factory=list, description="stripes of a peer swap; fractions sum to 1")
    split: int = Field(
        default=1, le=MAX_SPLIT, description="micro-ops the layer runs as (TSPLIT p_num); 1 = not split")
    split_dim: Literal["batch", "sequence", "hidden"] | None = Field(
        default=None, description="dimension split along  [default: the layer's first splittable one]")
    split_slowdown: float | None = Field(
        default=None, ge=1, le=1e3, description="layer time factor when split  [default: 1 + 0.03 (p - 1)]")

    def slowdown(self) -> float:
        if self.split <= 1:
            return 1.0
        if self.split_slowdown is not None:
            return self.split_slowdown
        return 1.0 + DEFAULT_SPLIT_SLOWDOWN_PER_EXTRA_OP * (self.split - 1)


class StagePlan(FileModel):
    gpu: int = Field(description="GPU the stage runs on")
    layers: tuple[int, int] = Field(description="first layer and one past the last")
    optimizer: Literal["gpu", "host-update", "host-stream"] = "gpu"
    optimizer_layers: list[int] | None = Field(
        default=None, description="with host-update or host-stream: the layers whose optimizer states live on the "
                                  "host, the rest staying on the GPU  [default: all the stage's layers]")
    stash: Literal["gpu", "host"] = "gpu"
    actions: list[LayerAction] = Field(default_factory=list, description="layers not listed are kept")


class DataParallelPlan(FileModel):
    """Data-parallel replicas of the plan's pipeline (schema 2)."""

    degree: int = Field(ge=1, le=MAX_REPLICAS, description="replicas of the pipeline")
    zero_stage: Literal[0, 1, 2, 3] = Field(default=0, description="0: DDP; 1: optimizer states sharded; "
                                                                   "2: and gradients; 3 (FSDP): and parameters")
    bucket_mib: float = Field(default=25.0, gt=0, le=65536, description="gradient bucket, MiB (ZeRO 0-2)")
    reshard_after_forward: bool = Field(default=True, description="ZeRO-3: free gathered parameters after "
                                                                  "each layer's forward")
    replicas: list[list[int]] = Field(min_length=1, max_length=MAX_REPLICAS,
                                      description="per replica, the GPU of each stage; replica 0 is the stages' own")
    offload_params: bool = Field(default=False, description="ZeRO-3: parameter shards live off the GPU and are "
                                                            "fetched before each gather (ZeRO-Infinity)")
    offload_device: Literal["host", "nvme"] = Field(
        default="host", description="where offloaded parameters and optimizer states live: host memory or the "
                                    "server's NVMe drives (ZeRO-Infinity)")

    def group(self, stage: int) -> tuple[int, ...]:
        """Stage ``stage``'s data-parallel group: its GPU in every replica."""
        return tuple(r[stage] for r in self.replicas)


class TensorParallelPlan(FileModel):
    """Each stage of each replica run by a tensor-parallel group (schema 3): Megatron-LM's
    column- and row-parallel layers (Shoeybi et al. 2019, section 3), with sequence
    parallelism on the rest (Korthikanti et al. 2022, section 4.2.2)."""

    degree: StrictInt = Field(ge=2, le=64, description="GPUs of each stage's tensor-parallel group")
    sequence_parallel: StrictBool = Field(default=False, description="norms and dropout on a sequence shard; "
                                                                     "all-gather and reduce-scatter instead of "
                                                                     "all-reduce")
    groups: list[list[list[StrictInt]]] = Field(
        min_length=1, max_length=MAX_REPLICAS,
        description="per replica (as data_parallel.replicas), per stage, the GPUs of its tensor-parallel group, "
                    "the replica's stage GPU first")

    def group(self, replica: int, stage: int) -> tuple[int, ...]:
        return tuple(self.groups[replica][stage])


class MeshPlan(FileModel):
    """The layout as a device mesh (schema 4, ``mpsim.plans.mesh``): its name, and its axes
    with their sizes in rank order. Written where schemas 2 and 3 cannot say the layout
    (HSDP, axes beyond data, tensor and pipeline); the data and tensor blocks still place
    the GPUs."""

    layout: str = Field(min_length=1, max_length=200,
                        description="the layout's name (`mpsim.plans.mesh` grammar): hsdp16, ddp2xmir2xpp2")
    axes: list[tuple[str, StrictInt]] = Field(min_length=1, max_length=16,
                                              description="the mesh's axes and their sizes, innermost first")
    context_attention: ContextAttention = Field(
        default="ring", description="with a context axis: how attention reaches the other GPUs' keys and values "
                                    "(ring, all-gather, all-to-all; ``Parallelism.context_attention``)")


SwapTiming = Literal["prefetch", "on-demand"]
"""When swaps run: ``PlanFile.swap_timing``."""
Checkpoints = Literal["layer", "segment"]
"""What a recomputed layer keeps as checkpoint: ``PlanFile.recompute_checkpoints``."""


class PlanFile(FileModel):
    """The on-disk schema of a plan."""

    schema_: int = Field(alias="schema", description="format version, currently 3 (1 and 2 still read)")
    model: str = Field(description="trace the plan was made for")
    server: str = Field(description="topology the plan was made for")
    microbatch: int = Field(gt=0, le=MAX_MICROBATCH)
    microbatches: int = Field(gt=0, le=MAX_MICROBATCHES)
    schedule: Literal["gpipe", "1f1b", "pipedream"]
    strategy: str = Field(default="custom", description="what produced the plan")
    swap_timing: SwapTiming = Field(
        default="prefetch",
        description="prefetch: a swap-out runs beside the compute and a swap-in is prefetched to land when its "
                    "backward needs it; on-demand: the compute waits for each swap-out to land and each swap-in "
                    "starts when the backward reaches its layer (the GPU-CPU swap baseline of MPress IV-B)")
    recompute_checkpoints: Checkpoints = Field(
        default="layer",
        description="layer: every recomputed layer keeps its input and re-runs alone before its backward "
                    "(Megatron-LM, Hugging Face gradient checkpointing); segment: consecutive recomputed layers "
                    "keep only the first one's input and re-run together before the last one's backward "
                    "(Chen et al. 2016; GPipe's and DAPPLE's re-materialization of a stage)")
    stages: list[StagePlan] = Field(min_length=1, max_length=1024)
    data_parallel: DataParallelPlan | None = Field(
        default=None, description="schema 2: replicas of this pipeline and how they shard model states "
                                  "[default: one replica]")
    tensor_parallel: TensorParallelPlan | None = Field(
        default=None, description="schema 3: the tensor-parallel group of every stage  [default: one GPU a stage]")
    virtual_stages: StrictInt = Field(
        default=1, ge=1, le=64, description="schema 3: model chunks per GPU (interleaved 1F1B): of p x v stages, "
                                            "stage c * p + g runs on stage g's GPU  [default: 1]")
    mesh: MeshPlan | None = Field(
        default=None, description="schema 4: the layout as a device mesh, where schemas 2 and 3 cannot name it "
                                  "[default: the layout the data and tensor blocks say]")
    finetune: FineTune | None = Field(
        default=None, description="the fine-tune the plan was made for (LoRA, QLoRA: mpsim.models.finetune); "
                                  "absent: every parameter trains")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)

    def to_json(self) -> str:
        """The file's text; schema 3's fields are left out while they hold their defaults,
        so a plan without tensor parallelism or virtual stages reads as schema 2 did (and a
        mesh's context attention while it is the ring's)."""
        data = self.model_dump(by_alias=True, exclude_defaults=False)
        if data["tensor_parallel"] is None:
            del data["tensor_parallel"]
        if data["virtual_stages"] == 1:
            del data["virtual_stages"]
        if data["finetune"] is None:
            del data["finetune"]
        if data["mesh"] is None:
            del data["mesh"]
        elif data["mesh"]["context_attention"] == "ring":  # the default, and all a mesh without context says
            del data["mesh"]["context_attention"]
        return json.dumps(data, indent=1)

    @property
    def replicas(self) -> int:
        return 1 if self.data_parallel is None else self.data_parallel.degree

    def replica_gpus(self) -> list[list[int]]:
        """Per replica, the GPU of each stage (one replica, the stages' own, without
        ``data_parallel``)."""
        if self.data_parallel is None:
            return [[st.gpu for st in self.stages]]
        return self.data_parallel.replicas

    @property
    def tensor(self) -> int:
        return 1 if self.tensor_parallel is None else self.tensor_parallel.degree

    @property
    def expert(self) -> int:
        """The expert-parallel degree (the mesh's ``expert`` axis; 1 without)."""
        return 1 if self.mesh is None else dict(self.mesh.axes).get("expert", 1)

    @property
    def context(self) -> int:
        """The context-parallel degree (the mesh's ``context`` axis; 1 without)."""
        return 1 if self.mesh is None else dict(self.mesh.axes).get("context", 1)

    def gpus_used(self) -> set[int]:
        """Every GPU the job runs on, in any replica and tensor-parallel group."""
        if self.tensor_parallel is not None:
            return {g for r in self.tensor_parallel.groups for group in r for g in group}
        return {g for r in self.replica_gpus() for g in r}

    def action_of(self, stage: int) -> dict[int, LayerAction]:
        return {a.layer: a for a in self.stages[stage].actions}


_Bad = Callable[[str, str], SchemaError]
"""Makes the SchemaError of a plan entry: (field, expected)."""


def check_plan(plan: PlanFile, topo: Topology, trace: Trace, source: str = "") -> None:
    """Rules that need the server and the model; raises a SchemaError naming the entry."""
    def bad(field: str, expected: str) -> SchemaError:
        return SchemaError(source, field, expected)

    if plan.schema_ not in SCHEMA_VERSIONS:
        raise bad("schema", f"expected one of {', '.join(map(str, SCHEMA_VERSIONS))}, got {plan.schema_}")
    if plan.finetune != trace.spec.finetune:
        made = "full training" if plan.finetune is None else plan.finetune.describe()
        runs = "full training" if trace.spec.finetune is None else trace.spec.finetune.describe()
        raise bad("finetune", f"the plan was made for {made}, but the model is traced for {runs}: give the same "
                              "--lora/--qlora/--peft-config, or none")
    _check_schema_fields(plan, bad)
    if plan.schedule not in SCHEDULES:
        raise bad("schedule", f"expected one of {', '.join(SCHEDULES)}")
    _check_virtual_stages(plan, bad)
    n, L, p = topo.n_gpus, trace.n_layers, len(plan.stages) // plan.virtual_stages
    if p > n:
        raise bad("stages", f"{p} stages need {p} GPUs but {topo.name} has {n}")
    expected_first = 0
    gpus_seen: dict[int, int] = {}
    for s, st in enumerate(plan.stages):
        if s < p:  # a later chunk runs on its first chunk's GPU (_check_virtual_stages)
            _check_stage_gpu(st, s, topo, gpus_seen, bad)
        _check_stage_layers(st, s, expected_first, trace, bad)
        expected_first = st.layers[1]
        _check_optimizer_layers(st, f"stages.{s}", bad)
        if st.stash == "host" and plan.schedule != "pipedream":
            raise bad(f"stages.{s}.stash", "'host' applies to pipedream only (other schedules stash no weights)")
        seen: set[int] = set()
        for k, act in enumerate(st.actions):
            _check_action(plan, topo, trace, s, st, k, act, seen, bad)
    if expected_first != L:
        raise bad("stages", f"the stages end at layer {expected_first} but {trace.name} has {L} layers")
    try:
        check_schedule(plan.schedule, p, plan.microbatches)
    except MpsimError as exc:
        raise bad("microbatches", str(exc)) from None
    _check_data_parallel(plan, topo, bad)
    _check_tensor_parallel(plan, topo, bad)
    _check_mesh(plan, bad)


def _check_mesh(plan: PlanFile, bad: _Bad) -> None:
    """Schema 4's mesh: a layout name that parses, saying what the other blocks say (the
    stages, the replicas and their ZeRO stage, the tensor-parallel degree), and its axes."""
    if plan.mesh is None:
        return
    try:
        par = parse_layout(plan.mesh.layout)
    except MpsimError as exc:
        raise bad("mesh.layout", str(exc)) from None
    p, v = len(plan.stages) // plan.virtual_stages, plan.virtual_stages
    dp, tp = plan.data_parallel, plan.tensor_parallel
    said = {"stages": (par.pipeline, p), "virtual stages": (par.virtual_stages, v),
            "replicas": (par.replicas, plan.replicas), "ZeRO stage": (par.zero_stage, dp.zero_stage if dp else 0),
            "tensor-parallel degree": (par.tensor, plan.tensor),
            "sequence parallel": (par.sequence_parallel, tp is not None and tp.sequence_parallel)}
    for what, (named, planned) in said.items():
        if named != planned:
            raise bad("mesh.layout", f"{plan.mesh.layout} names {what} {named} but the plan has {planned}")
    axes = [tuple(a) for a in par.mesh(p).axes]
    if [tuple(a) for a in plan.mesh.axes] != axes:
        raise bad("mesh.axes", f"{plan.mesh.layout} is the mesh {axes}, innermost first")


def _check_tensor_parallel(plan: PlanFile, topo: Topology, bad: _Bad) -> None:
    """Schema 3's groups: one per stage of each replica, ``degree`` GPUs of ``topo`` each,
    the replica's stage GPU first, no GPU twice; no peer swap to a GPU the job runs on;
    no PipeDream."""
    tp = plan.tensor_parallel
    if tp is None:
        return
    if plan.schedule == "pipedream":
        raise bad("tensor_parallel", "is not simulated with pipedream; use gpipe or 1f1b")
    replicas = plan.replica_gpus()
    if len(tp.groups) != len(replicas):
        raise bad("tensor_parallel.groups", f"expected a list for each of {len(replicas)} replicas, "
                                            f"got {len(tp.groups)}")
    seen: set[int] = set()
    p = len(plan.stages) // plan.virtual_stages
    for r, (stages, own) in enumerate(zip(tp.groups, replicas)):
        if len(stages) != len(own):
            raise bad(f"tensor_parallel.groups.{r}", f"expected a group for each of {len(own)} stages, "
                                                     f"got {len(stages)}")
        _check_repeats(stages, p, len(own), f"tensor_parallel.groups.{r}", bad)
        for s, (group, first) in enumerate(zip(stages[:p], own)):
            _check_tp_group(group, first, tp.degree, f"tensor_parallel.groups.{r}.{s}", topo, seen, bad)
    _check_peers_off(plan, seen, "runs a tensor-parallel rank; a peer swap goes to GPUs the job does not run on", bad)


def _check_peers_off(plan: PlanFile, busy_gpus: set[int], why: str, bad: _Bad) -> None:
    """No peer swap of the plan goes to one of ``busy_gpus`` (GPUs the job runs on)."""
    for s, st in enumerate(plan.stages):
        for k, act in enumerate(st.actions):
            busy = [x.gpu for x in act.peers if x.gpu in busy_gpus]
            if busy:
                raise bad(f"stages.{s}.actions.{k}.peers", f"GPU {busy[0]} {why}")


def _check_data_parallel(plan: PlanFile, topo: Topology, bad: _Bad) -> None:
    """Schema 2's replicas: one GPU per stage each, replica 0 the stages' own, no GPU
    twice; a peer swap of a replicated pipeline goes to GPUs the job does not run on."""
    dp = plan.data_parallel
    if dp is None:
        return
    if len(dp.replicas) != dp.degree:
        raise bad("data_parallel.replicas", f"expected {dp.degree} replicas (degree), got {len(dp.replicas)}")
    own = [st.gpu for st in plan.stages]
    if dp.replicas[0] != own:
        raise bad("data_parallel.replicas.0", f"expected the stages' own GPUs {own}, got {dp.replicas[0]}")
    if dp.offload_params and dp.zero_stage != 3:
        raise bad("data_parallel.offload_params", "offloads parameter shards, which only ZeRO stage 3 has")
    if dp.offload_device == "nvme" and topo.spec.nvme is None:
        raise bad("data_parallel.offload_device", f"{topo.name} states no NVMe drives (topology field nvme)")
    seen: set[int] = set()
    p = len(own) // plan.virtual_stages
    for r, gpus in enumerate(dp.replicas):
        at = f"data_parallel.replicas.{r}"
        _check_repeats(gpus, p, len(own), at, bad)
        _check_replica(gpus[:p], at, p, topo, seen, bad)
    if dp.degree > 1:
        _check_peers_off(plan, seen, "runs a replica; a replicated pipeline swaps to GPUs it does not run on", bad)


def _check_schema_fields(plan: PlanFile, bad: _Bad) -> None:
    """A field newer than the file's schema is refused."""
    if plan.data_parallel is not None and plan.schema_ < 2:
        raise bad("data_parallel", "needs schema 2")
    if plan.tensor_parallel is not None and plan.schema_ < 3:
        raise bad("tensor_parallel", "needs schema 3")
    if plan.virtual_stages > 1 and plan.schema_ < 3:
        raise bad("virtual_stages", "needs schema 3")
    if plan.mesh is not None and plan.schema_ < 4:
        raise bad("mesh", "needs schema 4")


def _check_repeats(per_stage: list, p: int, n_stages: int, at: str, bad: _Bad) -> None:
    """Under interleaved 1F1B a per-stage list has an entry for each of the p x v stages,
    stage s's the same as stage s mod p's."""
    if len(per_stage) != n_stages:
        raise bad(at, f"expected an entry for each of {n_stages} stages, got {len(per_stage)}")
    for s in range(p, n_stages):
        if per_stage[s] != per_stage[s % p]:
            raise bad(f"{at}.{s}", f"virtual stage {s} runs where stage {s % p} does ({per_stage[s % p]}), "
                                   f"got {per_stage[s]}")


def _check_virtual_stages(plan: PlanFile, bad: _Bad) -> None:
    """Interleaved 1F1B: p x v stages under 1f1b, stage c * p + g on stage g's GPU; the
    replicas and tensor-parallel groups list every stage, repeating likewise."""
    v = plan.virtual_stages
    if v == 1:
        return
    if plan.schedule != "1f1b":
        raise bad("virtual_stages", f"run the interleaved 1F1B schedule: expected schedule 1f1b, got {plan.schedule}")
    if len(plan.stages) % v:
        raise bad("stages", f"expected a multiple of virtual_stages {v}, got {len(plan.stages)} stages")
    p = len(plan.stages) // v
    for s, st in enumerate(plan.stages[p:], start=p):
        if st.gpu != plan.stages[s % p].gpu:
            raise bad(f"stages.{s}.gpu", f"virtual stage {s} runs on stage {s % p}'s GPU "
                                         f"{plan.stages[s % p].gpu}, got {st.gpu}")


def _check_tp_group(group: list[int], first: int, degree: int, at: str, topo: Topology, seen: set[int],
                    bad: _Bad) -> None:
    """One tensor-parallel group: ``degree`` GPUs of ``topo``, the stage's own first, none
    in ``seen`` (recorded there)."""
    if len(group) != degree:
        raise bad(at, f"expected {degree} GPUs (degree), got {group}")
    if group[0] != first:
        raise bad(at, f"expected the stage's own GPU {first} first, got {group}")
    _claim_gpus(group, at, topo, seen, bad)


def _check_stage_gpu(st: StagePlan, s: int, topo: Topology, gpus_seen: dict[int, int], bad: _Bad) -> None:
    """Stage ``s`` runs on a GPU of ``topo`` that no earlier stage runs on (recorded in ``gpus_seen``)."""
    n = topo.n_gpus
    if not 0 <= st.gpu < n:
        raise bad(f"stages.{s}.gpu", f"GPU {st.gpu} does not exist on {topo.name} (0..{n - 1})")
    if st.gpu in gpus_seen:
        raise bad(f"stages.{s}.gpu", f"GPU {st.gpu} already runs stage {gpus_seen[st.gpu]}")
    gpus_seen[st.gpu] = s


def _check_stage_layers(st: StagePlan, s: int, expected_first: int, trace: Trace, bad: _Bad) -> None:
    """Stage ``s``'s layers start where the previous stage's end and are a non-empty range of ``trace``'s."""
    a, b = st.layers
    L = trace.n_layers
    if a != expected_first or b <= a or b > L:
        raise bad(f"stages.{s}.layers", f"expected [{expected_first}, e) with {expected_first} < e <= {L} "
                  f"(stages cover layers 0..{L - 1} of {trace.name} in order), got [{a}, {b})")


def _check_action(plan: PlanFile, topo: Topology, trace: Trace, s: int, st: StagePlan, k: int, act: LayerAction,
                  seen: set[int], bad: _Bad) -> None:
    """Action ``k`` of stage ``s``: on a layer of the stage not listed before (in ``seen``), a split the
    layer allows, and an action the layer and the plan's swap timing allow."""
    at = f"stages.{s}.actions.{k}"
    a, b = st.layers
    if not a <= act.layer < b:
        raise bad(f"{at}.layer", f"layer {act.layer} is not in stage {s} (layers {a}..{b - 1})")
    if act.layer in seen:
        raise bad(f"{at}.layer", f"layer {act.layer} is listed twice")
    seen.add(act.layer)
    row = trace.layers[act.layer]
    _check_split(at, act, row, bad)
    if act.split > 1 and act.action in ("host", "peer") and plan.swap_timing == "on-demand":
        raise bad(f"{at}.split", "on-demand swaps move whole layers; split swapped layers with "
                  "swap_timing 'prefetch'")
    if act.action == "selective" and row.attention_core_bytes == 0:
        raise bad(f"{at}.action",
                  f"layer {act.layer} keeps nothing in its attention core; use recompute or keep")
    if act.action == "peer":
        _check_peers(at, act, st, topo, bad)
    elif act.peers:
        raise bad(f"{at}.peers", f"stripes belong to action 'peer', not {act.action!r}")


def _check_split(at: str, act: LayerAction, row: LayerRow, bad: _Bad) -> None:
    """``act``'s split: at least 1, and above 1 only along a dimension ``row`` can be split on."""
    if act.split < 1:
        raise bad(f"{at}.split", f"p must be at least 1, got {act.split}")
    if act.split > 1:
        if not row.split_dims:
            raise bad(f"{at}.split",
                      f"layer {act.layer} ({row.name}) cannot be split (no splittable dimension)")
        if act.split_dim is not None and act.split_dim not in row.split_dims:
            raise bad(f"{at}.split_dim", f"layer {act.layer} splits along {', '.join(row.split_dims)} only")


def _check_peers(at: str, act: LayerAction, st: StagePlan, topo: Topology, bad: _Bad) -> None:
    """A peer swap's stripes: fractions summing to 1, each to a distinct other GPU that ``st``'s GPU
    reaches over NVLink."""
    if not act.peers:
        raise bad(f"{at}.peers", "a peer swap needs at least one stripe")
    total = sum(x.fraction for x in act.peers)
    if abs(total - 1.0) > STRIPE_TOLERANCE:
        raise bad(f"{at}.peers", f"stripe fractions must sum to 1, got {total:.6g}")
    targets = [x.gpu for x in act.peers]
    if len(set(targets)) != len(targets):
        raise bad(f"{at}.peers", "a peer GPU is listed twice")
    for x in act.peers:
        if x.gpu == st.gpu or not 0 <= x.gpu < topo.n_gpus:
            raise bad(f"{at}.peers", f"GPU {x.gpu} is not a peer of GPU {st.gpu} on {topo.name}")
        if not topo.nvlinks_between(st.gpu, x.gpu):
            raise bad(f"{at}.peers", f"no NVLink route from GPU {st.gpu} to GPU {x.gpu} on {topo.name}")


def _check_optimizer_layers(st: StagePlan, where: str, bad: _Bad) -> None:
    if st.optimizer_layers is None:
        return
    if st.optimizer == "gpu":
        raise bad(f"{where}.optimizer_layers", "names layers whose optimizer states live on the host; "
                  "set optimizer to host-update or host-stream, or leave it out")
    a, b = st.layers
    if not st.optimizer_layers:
        raise bad(f"{where}.optimizer_layers", "is empty; leave it out for all the stage's layers, or set "
                  "optimizer to gpu")
    for j in st.optimizer_layers:
        if not a <= j < b:
            raise bad(f"{where}.optimizer_layers", f"layer {j} is not in the stage (layers {a}..{b - 1})")
    if len(set(st.optimizer_layers)) != len(st.optimizer_layers):
        raise bad(f"{where}.optimizer_layers", "a layer is listed twice")


def _check_replica(gpus: list[int], at: str, n_stages: int, topo: Topology, seen: set[int], bad: _Bad) -> None:
    """One replica: a GPU of ``topo`` for each stage, none in ``seen`` (recorded there)."""
    if len(gpus) != n_stages:
        raise bad(at, f"expected a GPU for each of {n_stages} stages, got {gpus}")
    _claim_gpus(gpus, at, topo, seen, bad)


def _claim_gpus(gpus: list[int], at: str, topo: Topology, seen: set[int], bad: _Bad) -> None:
    """``gpus`` exist on ``topo`` and none is in ``seen`` (each recorded there)."""
    for g in gpus:
        if not 0 <= g < topo.n_gpus:
            raise bad(at, f"GPU {g} does not exist on {topo.name} (0..{topo.n_gpus - 1})")
        if g in seen:
            raise bad(at, f"GPU {g} runs another stage, replica or group already")
        seen.add(g)


def host_optimizer_layers(st: StagePlan) -> tuple[int, ...]:
    """The layers of a stage whose optimizer states live on the host."""
    if st.optimizer == "gpu":
        return ()
    if st.optimizer_layers is None:
        return tuple(range(*st.layers))
    return tuple(sorted(st.optimizer_layers))


def optimizer_label(st: StagePlan) -> str:
    """Where a stage's optimizer states live, for tables: ``host-stream (3 of 11 layers)``
    when only some layers' states are on the host."""
    if st.optimizer_layers is None:
        return st.optimizer
    return f"{st.optimizer} ({len(st.optimizer_layers)} of {st.layers[1] - st.layers[0]} layers)"


def parse_plan(data: object, source: str = "<plan>") -> PlanFile:
    return validate(PlanFile, data, source)


def read_plan_file(path: Path) -> PlanFile:
    return parse_plan(read_data_file(path, "json", "plan"), str(path))


def write_plan_file(plan: PlanFile, path: Path) -> None:
    path.write_text(plan.to_json() + "\n")


def make_plan(trace: Trace, topo: Topology, schedule: str, microbatches: int,
              stages: list[tuple[int, int]], gpu_of_stage: list[int], strategy: str,
              actions: dict[int, list[LayerAction]] | None = None,
              optimizer: dict[int, str] | None = None, stash: dict[int, str] | None = None,
              swap_timing: SwapTiming = "prefetch", optimizer_layers: dict[int, list[int]] | None = None,
              recompute_checkpoints: Checkpoints = "layer",
              data_parallel: DataParallelPlan | None = None,
              tensor_parallel: TensorParallelPlan | None = None, virtual_stages: int = 1,
              mesh: MeshPlan | None = None) -> PlanFile:
    """A plan from its parts; ``actions``/``optimizer``/``stash``/``optimizer_layers``
    are keyed by stage."""
    actions = actions or {}
    optimizer = optimizer or {}
    optimizer_layers = optimizer_layers or {}
    stash = stash or {}
    return PlanFile(
        schema=4 if mesh is not None else 3 if tensor_parallel is not None or virtual_stages > 1 else 2,
        model=trace.name, mesh=mesh,
        server=topo.name, microbatch=trace.microbatch, virtual_stages=virtual_stages,
        microbatches=microbatches, schedule=schedule, strategy=strategy,  # type: ignore[arg-type]
        swap_timing=swap_timing, recompute_checkpoints=recompute_checkpoints, data_parallel=data_parallel,
        tensor_parallel=tensor_parallel, finetune=trace.spec.finetune,
        stages=[StagePlan(gpu=g, layers=(a, b), optimizer=optimizer.get(s, "gpu"),  # type: ignore[arg-type]
                          optimizer_layers=optimizer_layers.get(s),
                          stash=stash.get(s, "gpu"), actions=actions.get(s, []))  # type: ignore[arg-type]
                for s, ((a, b), g) in enumerate(zip(stages, gpu_of_stage))],
    )


def stripes_by_bandwidth(topo: Topology, src: int, peers: list[int]) -> list[Stripe]:
    """MPress III-C data striping: parts sized in proportion to each route's bandwidth, so
    that on an idle server all parts land together."""
    bw = [topo.route(src, g).bandwidth for g in peers]
    total = sum(bw)
    fractions = [b / total for b in bw]
    fractions[-1] = 1.0 - sum(fractions[:-1])
    return [Stripe(gpu=g, fraction=f) for g, f in zip(peers, fractions)]


def fit_stripes(topo: Topology, src: int, need_bytes: float, spare_bytes: Mapping[int, float]) -> list[Stripe] | None:
    """Bandwidth-weighted stripes over the NVLink neighbours of ``src`` whose spare memory
    takes their part of ``need_bytes``; None when no such neighbour is left."""
    peers = [q for q in topo.nvlink_peers(src) if spare_bytes.get(q, 0) > 0]
    while peers:
        stripes = stripes_by_bandwidth(topo, src, peers)
        short = [x.gpu for x in stripes if need_bytes * x.fraction > spare_bytes[x.gpu]]
        if not short:
            return stripes
        peers = [q for q in peers if q not in short]
    return None
