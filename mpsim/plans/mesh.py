"""The parallel layout as a device mesh: named axes with sizes, one grammar for their names.

PyTorch's ``DeviceMesh`` and Megatron-Core's process groups see a job as named axes whose
sizes multiply to the GPUs it uses; a GPU's rank is its coordinate on every axis, read
with the innermost axis varying fastest. Megatron-Core's default order, innermost first,
is tensor, context, expert, data, pipeline, and that is the order a ``DeviceMesh`` lays
axes onto the hardware here: the innermost axis on the fastest tier
(``mpsim.sim.placement``, ``mpsim.plans.cluster_placement.place_on_cluster``).

An axis is of a registered kind (``AxisKind``, ``register_axis``). The kinds every job
knows are ``tensor`` (Megatron-LM's column/row split, with sequence parallelism),
``data`` (DDP, ZeRO-1/2/3, FSDP, HSDP: Rajbhandari et al. 2020) and ``pipeline`` (with
virtual stages); a new kind is new code: a module that registers an ``AxisKind`` and
says what its GPUs share. A kind that ``replicates`` holds copies of the same weights on
GPUs that train different samples: its size multiplies the samples of an iteration, and
its GPUs join the gradient reduction of a stage (``Parallelism.replicas``).

Layout names (``parse_layout``, ``layout_name``) are parts joined by ``x``, one per axis,
data first, then the registered axes, then tensor, then pipeline (Megatron-LM's order
read outward): ``pp8``, ``pp4v2``, ``ddp8``, ``zero1x8``, ``zero2x4``, ``fsdp8``
(= ``zero3x8``), ``hsdp16``, ``ddp2xpp4``, ``tp4spxpp2``, ``zero1x2xtp2spxpp2``. Outputs
describe a layout in words (``describe``): ``FSDP x2 x TP x4+SP x pipeline x2``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mpsim.errors import MpsimError
from mpsim.hardware.topology import Topology
from mpsim.limits import MAX_REPLICAS
from mpsim.models.context_parallel import ContextAttention

DEFAULT_BUCKET_MIB = 25.0
"""DDP's default gradient bucket (``bucket_cap_mb``)."""
MAX_STAGES = 1024
"""The deepest pipeline: a layout's stages, given (``Parallelism.pipeline``) or derived from
the GPUs (``Parallelism.stages_on``), as a plan file's ``stages`` list holds them."""
MAX_AXIS_SIZE = MAX_REPLICAS
"""The largest size of a registered mesh axis, as of the data axis (``Parallelism.data``:
``mpsim.limits.MAX_REPLICAS``, the one limit plan files use too)."""
DP_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP"}
"""How outputs name data parallelism by ZeRO stage (ZeRO-3 as PyTorch's FSDP runs it)."""


@dataclass(frozen=True)
class AxisKind:
    """A kind of mesh axis: where it lies on the hardware, what its GPUs share, how a
    layout's name writes it.

    Kinds beyond the three every job knows hold only a size (``Parallelism.axes``); their
    name part is ``token`` and the size (``ep8``), their description ``label x size``."""

    name: str
    """The axis' name in a mesh (``tensor``, ``data``, ``pipeline``)."""
    order: int
    """Placement rank: the lowest is innermost, laid on the fastest tier (Megatron-Core:
    tensor 10, context 20, expert 30, data 40, pipeline 50)."""
    name_position: int
    """Where its part stands in a layout's name (data 0, registered kinds 10-19, tensor
    20, pipeline 30)."""
    replicates: bool
    """Its GPUs hold the same weights and train different samples: its size multiplies an
    iteration's samples and its GPUs join a stage's gradient reduction."""
    token: str = ""
    """The name part's prefix of a registered kind (``ep`` of ``ep8``)."""
    label: str = ""
    """How outputs name it (``EP`` of ``EP x8``)."""
    splits_samples: bool = False
    """Its GPUs share each sample (the context axis: each holds a part of every sequence),
    so though it ``replicates`` (same weights, the gradient reduction joined) its size does
    not multiply an iteration's samples (``Parallelism.sample_ways``)."""


TENSOR = AxisKind("tensor", order=10, name_position=20, replicates=False, token="tp", label="TP")
DATA = AxisKind("data", order=40, name_position=0, replicates=True)
PIPELINE = AxisKind("pipeline", order=50, name_position=30, replicates=False, token="pp", label="pipeline")
BUILT_IN: tuple[AxisKind, ...] = (TENSOR, DATA, PIPELINE)
_KINDS: dict[str, AxisKind] = {k.name: k for k in BUILT_IN}


def register_axis(kind: AxisKind) -> AxisKind:
    """Make ``kind`` known to meshes and names: its name and token must be new, its token
    letters only, and its place in a name between the data and the tensor parts."""
    if kind.name in _KINDS:
        if _KINDS[kind.name] == kind:
            return kind
        raise MpsimError(f"a mesh axis named {kind.name!r} is already registered")
    if not re.fullmatch(r"[a-z_]+", kind.name):
        raise MpsimError(f"a mesh axis' name is lowercase letters and underscores, got {kind.name!r}")
    if not re.fullmatch(r"[a-z]+", kind.token) or any(kind.token == k.token for k in _KINDS.values()):
        raise MpsimError(f"mesh axis {kind.name!r}: its token must be new lowercase letters, got {kind.token!r}")
    if not DATA.name_position < kind.name_position < TENSOR.name_position:
        raise MpsimError(f"mesh axis {kind.name!r}: its name part stands between data and tensor "
                         f"({DATA.name_position + 1}..{TENSOR.name_position - 1})")
    _KINDS[kind.name] = kind
    return kind


def axis_kind(name: str) -> AxisKind:
    """The registered kind named ``name``; one line naming the known ones otherwise."""
    try:
        return _KINDS[name]
    except KeyError:
        raise MpsimError(f"unknown mesh axis {name!r}: known are {', '.join(sorted(_KINDS))}") from None


def registered_axes() -> tuple[AxisKind, ...]:
    """The kinds beyond the built-in three, in their names' order."""
    return tuple(sorted((k for k in _KINDS.values() if k not in BUILT_IN), key=lambda k: k.name_position))


@dataclass(frozen=True)
class DeviceMesh:
    """Named axes and their sizes, innermost first; rank r's coordinate on axis k is
    ``(r // stride_k) % size_k``, the stride the product of the sizes inside it."""

    axes: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        names = [n for n, _ in self.axes]
        if len(set(names)) != len(names):
            raise MpsimError(f"a mesh names each axis once, got {', '.join(names)}")
        for name, size in self.axes:
            axis_kind(name)
            if size < 1:
                raise MpsimError(f"mesh axis {name}: its size must be at least 1, got {size}")

    @property
    def size(self) -> int:
        """GPUs the mesh spans."""
        return math.prod(s for _, s in self.axes)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    def size_of(self, *names: str) -> int:
        """The product of the named axes' sizes (1 for an axis the mesh lacks)."""
        sizes = dict(self.axes)
        return math.prod(sizes.get(n, 1) for n in names)

    def _strides(self) -> dict[str, int]:
        out, stride = {}, 1
        for name, size in self.axes:
            out[name] = stride
            stride *= size
        return out

    def coords(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s coordinate on every axis."""
        if not 0 <= rank < self.size:
            raise MpsimError(f"rank {rank} is outside the mesh's {self.size} GPUs")
        return {name: (rank // stride) % size
                for (name, size), stride in zip(self.axes, self._strides().values(), strict=True)}

    def rank(self, coords: Mapping[str, int]) -> int:
        """The rank at ``coords`` (an axis left out: coordinate 0)."""
        strides = self._strides()
        unknown = set(coords) - set(strides)
        if unknown:
            raise MpsimError(f"the mesh has no axis {', '.join(sorted(unknown))}")
        return sum(strides[n] * c for n, c in coords.items())

    def group(self, axes: str | tuple[str, ...], rank: int) -> tuple[int, ...]:
        """The ranks that differ from ``rank`` only along ``axes``, the first axis varying
        fastest: rank's group for a collective over those axes."""
        names = (axes,) if isinstance(axes, str) else axes
        at = self.coords(rank)
        sizes = dict(self.axes)
        out = []
        for index in range(self.size_of(*names)):
            moved = dict(at)
            for name in names:
                moved[name] = index % sizes.get(name, 1)
                index //= sizes.get(name, 1)
            out.append(self.rank(moved))
        return tuple(out)

    def groups(self, axes: str | tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Every group along ``axes``, ordered by their first rank; they partition the mesh."""
        seen: dict[int, tuple[int, ...]] = {}
        for r in range(self.size):
            g = self.group(axes, r)
            seen.setdefault(g[0], g)
        return tuple(seen[k] for k in sorted(seen))


class Parallelism(BaseModel):
    """How the job's GPUs share the work: a mesh of named axes whose sizes multiply to the
    GPUs used (``mesh``). ``data``, ``tensor`` and ``pipeline`` are the built-in axes'
    sizes with their options; ``axes`` holds the sizes of registered kinds
    (``register_axis``). Placement follows Megatron-LM's order: each stage's
    tensor-parallel group innermost, on the fastest links, then the registered axes, the
    data-parallel replicas, then the pipeline (``mpsim.sim.placement``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: int = Field(default=1, ge=1, le=MAX_REPLICAS, description="data-parallel replicas (DDP, ZeRO, FSDP)")
    tensor: int = Field(default=1, ge=1, le=64, description="tensor-parallel degree (Megatron-LM column/row split)")
    sequence_parallel: bool = Field(default=False, description="with tensor > 1: norms and dropout split "
                                                               "along the sequence (Korthikanti et al. 2022)")
    pipeline: int | None = Field(default=None, ge=1, le=MAX_STAGES,
                                 description="pipeline stages; None: one per GPU of the server")
    virtual_stages: int = Field(default=1, ge=1, le=64, description="model chunks per GPU (interleaved 1F1B)")
    zero_stage: Literal[0, 1, 2, 3] = Field(default=0, description="ZeRO stage: 1 shards optimizer states, "
                                                                   "2 also gradients, 3 also parameters")
    bucket_mib: float = Field(default=DEFAULT_BUCKET_MIB, gt=0, le=65536,
                              description="gradient bucket size of DDP and ZeRO-1/2, MiB")
    reshard_after_forward: bool = Field(default=True, description="ZeRO-3 / FSDP2: free gathered parameters "
                                                                  "after each unit's forward")
    hsdp: bool = Field(default=False, description="with ZeRO-3 on a cluster: shard inside each server, replicate "
                                                  "across servers (HSDP)")
    axes: tuple[tuple[str, int], ...] = Field(default=(), description="sizes of the registered mesh axes beyond "
                                                                      "data, tensor and pipeline (``register_axis``)")
    context_attention: ContextAttention = Field(
        default="ring", description="with context parallelism, how attention sees the other GPUs' keys and values: "
                                    "ring (P2P blocks overlapped with compute), all-gather (Llama 3), all-to-all "
                                    "over heads (DeepSpeed-Ulysses); ``mpsim.models.context_parallel``")

    @field_validator("axes")
    @classmethod
    def _registered(cls, axes: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
        for name, size in axes:
            if name in _KINDS and _KINDS[name] in BUILT_IN or name not in _KINDS:
                raise ValueError(f"{name!r} is not a registered mesh axis (register_axis)")
            if size < 2:
                raise ValueError(f"mesh axis {name} of size {size}: leave an axis of size 1 out")
            if size > MAX_AXIS_SIZE:
                raise ValueError(f"mesh axis {name} of size {size}: at most {MAX_AXIS_SIZE}")
        if len({n for n, _ in axes}) != len(axes):
            raise ValueError("each mesh axis once")
        return tuple(sorted(axes, key=lambda a: _KINDS[a[0]].name_position))

    def unsupported(self) -> str | None:
        """What of this layout the engine cannot simulate, or None."""
        if self.sequence_parallel and self.tensor == 1:
            return ("sequence parallel splits what tensor parallelism replicates: it needs a tensor-parallel "
                    "degree of 2 or more")
        if self.hsdp and self.zero_stage != 3:
            return "HSDP shards parameters (ZeRO-3) inside a server and replicates them across: use zero stage 3"
        if self.context > 1 and self.hsdp:
            return f"{describe(self, 1)}: HSDP with context parallelism is not simulated yet"
        if self.expert > 1 and self.zero_stage > 1:
            return (f"{describe(self, 1)}: with expert parallelism ZeRO-1 (Megatron-Core's distributed optimizer) "
                    "is simulated; ZeRO-2, FSDP and HSDP are not yet")
        if self.zero_stage and any(n not in ("expert", "context") for n, _ in self.axes):
            return (f"{describe(self, 1)}: ZeRO shards over the data, expert and context axes; sharded states "
                    "with another replicating axis are not simulated")
        return None

    @property
    def expert(self) -> int:
        """GPUs each mixture-of-experts layer's routed experts are split over (1: none)."""
        return dict(self.axes).get("expert", 1)

    @property
    def replicas(self) -> int:
        """Copies of each stage that train different samples: the product of the
        replicating axes (data and any registered kind that ``replicates``); a stage's
        gradients are reduced over that many GPUs."""
        return self.data * math.prod(s for n, s in self.axes if _KINDS[n].replicates)

    @property
    def sample_ways(self) -> int:
        """Copies of each stage that train different samples: ``replicas`` less the axes
        whose GPUs share each sample (``AxisKind.splits_samples``: context parallelism);
        an iteration's samples are this times a replica's microbatches."""
        return self.replicas // math.prod(s for n, s in self.axes if _KINDS[n].splits_samples)

    @property
    def context(self) -> int:
        """GPUs each sequence is split over (context parallelism; 1: none)."""
        return dict(self.axes).get("context", 1)

    @property
    def stage_gpus(self) -> int:
        """GPUs each pipeline stage spans: every axis but the pipeline."""
        return self.data * self.tensor * math.prod(s for _, s in self.axes)

    def mesh(self, n_stages: int) -> DeviceMesh:
        """The mesh of this layout with ``n_stages`` pipeline stages, innermost first
        (``AxisKind.order``)."""
        sizes = [(TENSOR, self.tensor), (DATA, self.data), (PIPELINE, n_stages)]
        sizes += [(_KINDS[n], s) for n, s in self.axes]
        return DeviceMesh(tuple((k.name, s) for k, s in sorted(sizes, key=lambda ks: ks[0].order)))

    def shard_ways(self, across: int = 1) -> int:
        """GPUs a stage's sharded states are split over when its data-parallel group spans
        ``across`` servers: the group, or under HSDP its GPUs on one server. With expert
        parallelism (ZeRO-1 only) the dense states are split over data x expert GPUs, as
        Megatron-Core's distributed optimizer does (``expert_shard_ways`` for the experts'), and
        with context parallelism over data x context GPUs (Megatron-Core's distributed
        optimizer and torchtitan's FSDP shard over DP x CP)."""
        return self.data // across if self.hsdp else self.replicas

    def expert_shard_ways(self) -> int:
        """GPUs the routed experts' optimizer states are split over under ZeRO-1: the
        expert-data-parallel group (the data and context axes; the experts themselves are
        split over the expert axis already)."""
        return self.data * self.context

    def optimizer_shards(self, across: int = 1) -> int:
        """Parts one GPU's optimizer states are split into: ``shard_ways`` from ZeRO-1 on
        (ZeRO, Rajbhandari et al. 2020, section 5.1: P_os), else 1."""
        return self.shard_ways(across) if self.zero_stage >= 1 else 1

    def derived_stages(self, n_gpus: int) -> int:
        """The pipeline depth when none is given: the GPUs left per replica, at least one."""
        return max(1, n_gpus // self.stage_gpus)

    def stages_on(self, topo: Topology, servers: int = 1, fill: bool = True) -> int:
        """The pipeline depth on ``servers`` servers like ``topo``, checked: at least one
        stage, a tensor-parallel group of GPUs for each stage of each data-parallel replica
        (None: the GPUs left per replica, which must fill the GPUs unless not ``fill``)."""
        per_stage = self.stage_gpus
        n_gpus = topo.n_gpus * servers
        p = self.derived_stages(n_gpus) if self.pipeline is None else self.pipeline
        where = topo.name if servers == 1 else f"{servers} x {topo.name}"
        if p > MAX_STAGES:
            raise MpsimError(f"{describe(self, p)} on the {n_gpus} GPUs of {where}: a pipeline of {p} stages, at most "
                             f"{MAX_STAGES}; give more replicas or tensor-parallel GPUs per stage")
        if p * per_stage > n_gpus and self.context > 1:  # context GPUs share samples: no replicas to count
            raise MpsimError(f"{describe(self, p)} needs {p * per_stage} GPUs but {where} has {n_gpus}")
        if p * per_stage > n_gpus:
            stages = f"{p} stage" + ("s" if p > 1 else "")
            what = stages if self.replicas == 1 else f"{self.replicas} replicas of {stages}"
            if per_stage // self.replicas > 1:
                what += f" of {per_stage // self.replicas} GPUs each"
            raise MpsimError(f"{what} need {p * per_stage} GPUs but {where} has {n_gpus}")
        if fill and self.pipeline is None and p * per_stage != n_gpus:
            raise MpsimError(f"{describe(self, p)} uses {p * per_stage} of the {n_gpus} GPUs of {where}: "
                             f"{per_stage} GPUs a stage do not divide them; give the pipeline's depth (--stages "
                             f"{p}) to run on {p * per_stage} of {n_gpus} on purpose")
        return p

    def describe(self, n_stages: int) -> str:
        """The layout as outputs name it (``describe``)."""
        return describe(self, n_stages)


PIPELINE_ONLY = Parallelism()


def _one_line(exc: ValidationError) -> MpsimError:
    err = exc.errors()[0]
    where = ".".join(str(x) for x in err["loc"])
    return MpsimError(f"{where}: {err['msg']}, got {err.get('input')!r}")


def data_parallel(data: int, zero_stage: int = 0, n_stages: int | None = 1, **options: object) -> Parallelism:
    """``data`` replicas of a pipeline of ``n_stages`` (None: the GPUs left per replica),
    states sharded by ZeRO ``zero_stage``; refused in one line when out of range."""
    try:
        return Parallelism(data=data, zero_stage=zero_stage, pipeline=n_stages, **options)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise _one_line(exc) from None


def pipeline(n_stages: int | None) -> Parallelism:
    """A pure pipeline of ``n_stages`` (None: one stage per GPU), refused in one line when
    the count is not a positive number."""
    if n_stages is not None and n_stages < 1:
        raise MpsimError(f"the number of stages must be at least 1, got {n_stages}")
    try:
        return Parallelism(pipeline=n_stages)
    except ValidationError as exc:
        raise MpsimError(f"stages: {exc.errors()[0]['msg']}, got {n_stages}") from None


# --- names -----------------------------------------------------------------------------

_DATA_PART = r"(?P<dkind>ddp|fsdp|hsdp)(?P<dn>[0-9]+)|zero(?P<zero>[0-3])x(?P<zn>[0-9]+)"
_TENSOR_PART = r"tp(?P<tp>[0-9]+)(?P<sp>sp)?"
_PIPELINE_PART = r"pp(?P<pp>[0-9]+)(?:v(?P<v>[0-9]+))?"
MAX_NAME_DIGITS = 20
"""The most digits a size in a layout's name may have: every size is checked against its
range (at most 65,536), and a longer number is refused before it is read (Python refuses
to read one of over 4,300 digits, and it would fill the message)."""


def _parts() -> list[tuple[str, str]]:
    """(axis, regex of its name part) in names' order: data, registered kinds, tensor, pipeline."""
    extra = [(k.name, rf"{k.token}(?P<ax_{k.name}>[0-9]+)") for k in registered_axes()]
    return [("data", _DATA_PART), *extra, ("tensor", _TENSOR_PART), ("pipeline", _PIPELINE_PART)]


def layout_forms() -> str:
    """The name forms ``parse_layout`` reads, for its error and ``--layouts``' help."""
    extra = "".join(f", {k.token}N ({k.name})" for k in registered_axes())
    return ("pp8 (pipeline of 8), pp4v2 (interleaved, 2 virtual stages), ddp8, zero1x8, zero2x4, fsdp8 (= zero3x8), "
            "hsdp16 (FSDP inside a server, replicas across), replicas of a pipeline: ddp2xpp4, fsdp2xpp4, or "
            f"tensor-parallel stages: tp8, tp4spxpp2 (sequence parallel), zero1x2xtp2spxpp2{extra}")


def _split_parts(name: str) -> Iterator[tuple[str, re.Match[str]]]:
    """Each part of ``name`` with the axis it names, in the names' order; None-free."""
    rest = name
    for axis, regex in _parts():
        m = re.match(rf"(?:{regex})(?:x|$)", rest)
        if m is not None:
            yield axis, m
            rest = rest[m.end():]
    if rest:
        raise ValueError(rest)


def _shown(text: str) -> str:
    """``text`` as an error quotes it: its repr (one line whatever it holds), cut to 60 characters."""
    return repr(text) if len(text) <= 60 else repr(text[:60]) + f"... ({len(text)} characters)"


def parse_layout(text: str) -> Parallelism:
    """A layout from its name (``pp8``, ``fsdp8``, ``zero2x4``, ``hsdp16``, ``ddp2xpp4``,
    ``tp4spxpp2``, ``pp4v2``, and registered axes' parts; ASCII digits, each size in its
    range); one-line ``MpsimError`` naming the forms for anything else. Every layout it
    returns is one ``layout_name`` writes back: sequence parallelism without a
    tensor-parallel degree of 2 or more (``tp1sp``), which no name says, is refused."""
    name = text.strip().lower()
    try:
        found = dict(_split_parts(name)) if name and not name.endswith("x") else {}
    except ValueError:
        found = {}
    if not found:
        raise MpsimError(f"unknown layout {_shown(text)}: expected {layout_forms()}")
    longest = max(re.findall(r"[0-9]+", name), key=len)
    if len(longest) > MAX_NAME_DIGITS:
        raise MpsimError(f"layout {_shown(text)}: a size of {len(longest)} digits; no size is above "
                         f"{MAX_AXIS_SIZE}")
    fields: dict[str, object] = {}
    registered = []
    for axis, m in found.items():
        if axis in _PARSERS:
            fields.update(_PARSERS[axis](m))
        else:
            registered.append((axis, int(m[f"ax_{axis}"])))
    if registered:
        fields["axes"] = tuple(registered)
    data, zero = int(fields.pop("data", 1)), int(fields.pop("zero_stage", 0))  # type: ignore[call-overload]
    n_stages = int(fields.pop("pipeline", 1))  # type: ignore[call-overload]
    try:
        p = data_parallel(data, zero, n_stages, **fields)
    except MpsimError as exc:
        raise MpsimError(f"layout {_shown(text)}: {exc}") from None
    if p.sequence_parallel and p.tensor == 1:
        raise MpsimError(f"layout {_shown(text)}: {p.unsupported()}")
    return p


def _parse_data(m: re.Match[str]) -> dict[str, object]:
    if m["zn"]:
        return {"data": int(m["zn"]), "zero_stage": int(m["zero"])}
    kind = m["dkind"]
    return {"data": int(m["dn"]), "zero_stage": 0 if kind == "ddp" else 3, **({"hsdp": True} if kind == "hsdp" else {})}


def _parse_tensor(m: re.Match[str]) -> dict[str, object]:
    return {"tensor": int(m["tp"]), "sequence_parallel": bool(m["sp"])}


def _parse_pipeline(m: re.Match[str]) -> dict[str, object]:
    return {"pipeline": int(m["pp"]), "virtual_stages": int(m["v"] or 1)}


_PARSERS: dict[str, Callable[[re.Match[str]], dict[str, object]]] = {
    "data": _parse_data, "tensor": _parse_tensor, "pipeline": _parse_pipeline}


def _has_data(p: Parallelism) -> bool:
    return p.data > 1 or p.zero_stage > 0 or p.hsdp


def layout_name(p: Parallelism, n_stages: int) -> str:
    """The name ``parse_layout`` reads back: ``pp8``, ``fsdp8``, ``zero2x4xpp2``, ``tp4spxpp2``."""
    parts = []
    if _has_data(p):
        kind = "hsdp" if p.hsdp else {0: "ddp", 3: "fsdp"}.get(p.zero_stage, f"zero{p.zero_stage}x")
        parts.append(f"{kind}{p.data}")
    parts += [f"{axis_kind(n).token}{s}" for n, s in p.axes]
    if p.tensor > 1:
        parts.append(f"tp{p.tensor}" + ("sp" if p.sequence_parallel else ""))
    if n_stages > 1 or not parts or p.virtual_stages > 1:
        parts.append(f"pp{n_stages}" + (f"v{p.virtual_stages}" if p.virtual_stages > 1 else ""))
    return "x".join(parts)


def describe(p: Parallelism, n_stages: int) -> str:
    """The layout of ``n_stages`` as outputs name it (a context axis' attention when not the
    ring's: ``CP x4 (all-to-all)``): ``pipeline x4``, ``DDP x8``,
    ``ZeRO-2 x4 x pipeline x2``, ``FSDP x8`` (ZeRO-3), ``HSDP x16``, ``TP x8``, ``TP x4+SP
    x pipeline x2``, ``FSDP x2 x TP x4`` (Megatron-LM's order read outward: data, the
    registered axes, tensor, pipeline)."""
    parts = []
    if _has_data(p):
        parts.append(f"{'HSDP' if p.hsdp else DP_NAMES[p.zero_stage]} x{p.data}")
    parts += [f"{axis_kind(n).label or n} x{s}" + (f" ({p.context_attention})" if n == "context" and
                                                   p.context_attention != "ring" else "") for n, s in p.axes]
    if p.tensor > 1:
        parts.append(f"TP x{p.tensor}" + ("+SP" if p.sequence_parallel else ""))
    if n_stages > 1 or not parts or p.virtual_stages > 1:
        parts.append(f"pipeline x{n_stages}" + (f" (interleaved x{p.virtual_stages})"
                                                if p.virtual_stages > 1 else ""))
    return " x ".join(parts)
