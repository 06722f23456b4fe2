"""hypothesis strategies for small random jobs: servers, traces, schedules, partitions, plans.

Everything drawn is plain data (``Case``), so a shrunk counterexample prints as numbers
that can be pasted into a hand-built regression test. Sizes are chosen so that one
simulation takes milliseconds: 1-4 GPUs, 2-8 layers, 1-6 microbatches, tensors of at
most a megabyte on links of 0.1-16 GB/s (so copies take about as long as the 0.1-5 ms
layers), and a GPU capacity drawn around the job's own peak so that some jobs run out
of memory and some do not.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache

from helpers import layer, tiny_trace, topology_dict
from hypothesis import strategies as st

from mpsim.hardware.topology import Topology, parse_topology
from mpsim.models.trace import Trace
from mpsim.plans.plan import LayerAction, PlanFile, make_plan, stripes_by_bandwidth
from mpsim.sim import Job, SimResult, simulate_job
from mpsim.sim.layout import job_of_plan

MiB = 2**20
SCHEDULES = ("gpipe", "1f1b", "pipedream")
OPTIMIZER = ("gpu", "host-update", "host-stream")
UNLIMITED = 2**40
"""A capacity no drawn job reaches (1 TiB)."""


def _short(obj: object) -> str:
    """Python source for ``obj`` that leaves out fields at their defaults (readable counterexamples)."""
    if isinstance(obj, LayerAction):
        d = obj.model_dump(exclude_defaults=True)
        peers = ", ".join(f"Stripe(gpu={x.gpu}, fraction={x.fraction!r})" for x in obj.peers)
        args = [f"{k}={v!r}" for k, v in d.items() if k != "peers"] + ([f"peers=[{peers}]"] if peers else [])
        return f"LayerAction({', '.join(args)})"
    if isinstance(obj, tuple):
        inner = ", ".join(_short(x) for x in obj)
        return f"({inner},)" if len(obj) == 1 else f"({inner})"
    if hasattr(obj, "__dataclass_fields__"):
        args = [f"{f.name}={_short(getattr(obj, f.name))}" for f in fields(obj)  # type: ignore[arg-type]
                if getattr(obj, f.name) != f.default]
        return f"{type(obj).__name__}({', '.join(args)})"
    return repr(obj)


class _Short:
    def __repr__(self) -> str:
        return _short(self)

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(_short(self))


@dataclass(frozen=True, repr=False)
class Server(_Short):
    n_gpus: int
    capacity_bytes: int
    nvlink_gbps: float = 1.0
    pcie_gbps: float = 1.0
    latency_us: float = 0.0
    peer_copy_engines: int = 2

    def topology(self) -> Topology:
        return _topology(self)

    def build_topology(self) -> Topology:
        """``tests/helpers.topology_dict``: an NVLink chain i-(i+1), one PCIe switch, no
        reserved memory, so the capacity is exactly ``capacity_bytes``."""
        d = topology_dict(n_gpus=self.n_gpus, nvlink_gbps=self.nvlink_gbps, latency_us=self.latency_us,
                          memory_mib=self.capacity_bytes / MiB, pcie_gbps=self.pcie_gbps)
        d["gpu"]["peer_copy_engines"] = self.peer_copy_engines
        if d["nvlink"] is None:
            del d["nvlink"]
        topo = parse_topology(d, "tiny.yaml")
        assert topo.capacity_bytes == self.capacity_bytes
        return topo


@dataclass(frozen=True, repr=False)
class Layer(_Short):
    """The varying fields of ``tests/helpers.layer``; ``inp`` equals the previous layer's ``out``."""

    fwd_ms: float
    bwd_ms: float
    act: int = 0
    out: int = 0
    inp: int = 0
    saves_input: bool = False
    params: int = 0
    workspace: int = 0
    kind: str = "transformer"
    splittable: bool = False
    core: int = 0
    """Attention core's kept bytes (part of ``act``); selective recompute re-runs the core
    for ``core_share`` of the layer's forward."""
    core_share: float = 0.0

    def row(self, i: int) -> dict:
        d = layer(f"l{i}", self.fwd_ms, self.bwd_ms, act=self.act, out=self.out, inp=self.inp,
                  saves_input=self.saves_input, params=self.params, workspace=self.workspace, kind=self.kind)
        if self.splittable:
            d["split_dims"] = ["batch"]
        if self.core:
            d.update(attention_core_bytes=self.core, attention_core_flops=self.core_share * d["fwd_flops"])
        return d


@dataclass(frozen=True, repr=False)
class Case(_Short):
    """One job: server, model, and plan (schedule, partition, mapping, actions)."""

    server: Server
    layers: tuple[Layer, ...]
    schedule: str
    microbatches: int
    stages: tuple[tuple[int, int], ...]
    gpus: tuple[int, ...]
    actions: tuple[tuple[LayerAction, ...], ...] = ()
    """Per stage; empty means every layer kept."""
    optimizer: tuple[str, ...] = ()
    """Per stage; empty means all on the GPU."""
    stash: tuple[str, ...] = ()
    """Per stage; empty means all on the GPU."""
    checkpoints: str = "layer"
    """``PlanFile.recompute_checkpoints``."""

    def trace(self) -> Trace:
        return tiny_trace([lay.row(i) for i, lay in enumerate(self.layers)])

    def plan(self, topo: Topology, trace: Trace) -> PlanFile:
        return make_plan(trace, topo, self.schedule, self.microbatches, list(self.stages), list(self.gpus), "prop",
                         {s: list(a) for s, a in enumerate(self.actions)},
                         optimizer=dict(enumerate(self.optimizer)), stash=dict(enumerate(self.stash)),
                         recompute_checkpoints=self.checkpoints)  # type: ignore[arg-type]

    def job(self) -> Job:
        topo, trace = self.server.topology(), self.trace()
        return job_of_plan(topo, trace, self.plan(topo, trace))

    def run(self) -> SimResult:
        return simulate_job(self.job())

    def with_capacity(self, capacity_bytes: int) -> Case:
        return replace(self, server=replace(self.server, capacity_bytes=capacity_bytes))

    def kept(self) -> Case:
        """The same job with every layer kept (optimizer and stash placement unchanged)."""
        return replace(self, actions=())

    def static_bytes(self) -> tuple[dict[int, int], int]:
        """What stays allocated between iterations: per GPU, weights, gradients, optimizer
        states kept on the GPU and stashed weight versions kept there; on the host, the
        optimizer states and stashed versions kept there."""
        per_gpu = {g: 0 for g in range(self.server.n_gpus)}
        host = 0
        p = len(self.stages)
        for s, ((a, b), g) in enumerate(zip(self.stages, self.gpus)):
            rows = [lay.row(i) for i, lay in enumerate(self.layers)][a:b]
            params = sum(r["param_bytes"] for r in rows)
            opt = sum(r["optimizer_bytes"] for r in rows)
            versions = p - s if self.schedule == "pipedream" else 1
            stash = (versions - 1) * params
            per_gpu[g] += params + sum(r["grad_bytes"] for r in rows)
            if (self.optimizer[s] if self.optimizer else "gpu") == "gpu":
                per_gpu[g] += opt
            else:
                host += opt
            if (self.stash[s] if self.stash else "gpu") == "host":
                host += stash
            else:
                per_gpu[g] += stash
        return per_gpu, host


# ---- building blocks ---------------------------------------------------------------------

ms = st.integers(1, 50).map(lambda k: k / 10)
"""0.1 to 5 ms."""
nbytes = st.integers(0, 1_000_000)
small_params = st.integers(0, 20_000)
"""Parameters; a layer then holds 16 bytes each (weights, gradients, Adam states)."""


@st.composite
def layer_lists(draw: st.DrawFn, min_layers: int = 2, max_layers: int = 8) -> tuple[Layer, ...]:
    n = draw(st.integers(min_layers, max_layers))
    out: list[Layer] = []
    inp = draw(nbytes)  # the first layer's input: tokens or a batch
    for i in range(n):
        saves = draw(st.booleans())
        own = draw(nbytes)
        o = draw(nbytes)
        kind = "embedding" if i == 0 and draw(st.booleans()) else "transformer"
        core = draw(st.one_of(st.just(0), st.integers(0, own))) if kind == "transformer" else 0
        out.append(Layer(
            fwd_ms=draw(ms), bwd_ms=draw(ms), act=own + (inp if saves else 0), out=o, inp=inp, saves_input=saves,
            params=draw(small_params), workspace=draw(st.sampled_from([0, 0, 1000, 100_000, 500_000])),
            kind=kind, splittable=draw(st.booleans()), core=core,
            core_share=draw(st.sampled_from([0.0, 0.05, 0.3])) if core else 0.0,
        ))
        inp = o
    return tuple(out)


@st.composite
def servers(draw: st.DrawFn, n_gpus: int, copy_bound: bool = False) -> Server:
    """``copy_bound``: links slow enough that copies outlast layers and queue for engines."""
    return Server(
        n_gpus=n_gpus, capacity_bytes=UNLIMITED,
        nvlink_gbps=draw(st.sampled_from([0.5, 1.0] if copy_bound else [0.5, 1.0, 2.0, 10.0])),
        pcie_gbps=draw(st.sampled_from([0.1, 0.5] if copy_bound else [0.5, 1.0, 4.0, 16.0])),
        latency_us=draw(st.sampled_from([0.0, 0.0, 5.0, 50.0])),
        peer_copy_engines=draw(st.sampled_from([1, 2])),
    )


@lru_cache(maxsize=256)
def _topology(server: Server) -> Topology:
    return server.build_topology()


def nvlink_neighbours(server: Server, g: int) -> list[int]:
    return [q for q in (g - 1, g + 1) if 0 <= q < server.n_gpus]


@st.composite
def layer_action(draw: st.DrawFn, j: int, lay: Layer, server: Server, g: int, choices: tuple[str, ...],
                 splits: bool) -> LayerAction | None:
    action = draw(st.sampled_from(choices))
    split = draw(st.sampled_from([1, 2, 4])) if splits and lay.splittable else 1
    if action == "selective" and not lay.core:
        action = "recompute"  # the plan refuses selective on a layer whose core keeps nothing
    if action == "keep" and split == 1:
        return None
    if action == "peer":
        near = nvlink_neighbours(server, g)
        if not near:
            action = "host"
        else:
            peers = draw(st.lists(st.sampled_from(near), min_size=1, max_size=len(near), unique=True))
            return LayerAction(layer=j, action="peer", split=split,
                               peers=stripes_by_bandwidth(server.topology(), g, sorted(peers)))
    return LayerAction(layer=j, action=action, split=split)  # type: ignore[arg-type]


@st.composite
def plan_actions(draw: st.DrawFn, case: Case,
                 choices: tuple[str, ...] = ("keep", "recompute", "selective", "host", "peer"),
                 splits: bool = True) -> tuple[tuple[LayerAction, ...], ...]:
    per_stage = []
    for (a, b), g in zip(case.stages, case.gpus):
        acts = [draw(layer_action(j, case.layers[j], case.server, g, choices, splits)) for j in range(a, b)]
        per_stage.append(tuple(x for x in acts if x is not None))
    return tuple(per_stage)


@st.composite
def pipelines(draw: st.DrawFn, schedules: tuple[str, ...] = SCHEDULES, max_gpus: int = 4, max_stages: int = 4,
              copy_bound: bool = False) -> Case:
    """Server, trace, schedule, partition and mapping; every layer kept."""
    n_gpus = draw(st.integers(1, max_gpus))
    server = draw(servers(n_gpus, copy_bound))
    layers = draw(layer_lists())
    schedule = draw(st.sampled_from(schedules))
    p = draw(st.integers(1, min(n_gpus, len(layers), max_stages)))
    # 1f1b and pipedream need at least as many microbatches as stages (check_schedule)
    m = draw(st.integers(1 if schedule == "gpipe" else p, 6 if schedule != "pipedream" else 4))
    cuts = sorted(draw(st.lists(st.integers(1, len(layers) - 1), min_size=p - 1, max_size=p - 1, unique=True)))
    bounds = [0, *cuts, len(layers)]
    stages = tuple((bounds[i], bounds[i + 1]) for i in range(p))
    gpus = tuple(draw(st.permutations(range(n_gpus)))[:p])
    return Case(server, layers, schedule, m, stages, gpus)


@st.composite
def cases(draw: st.DrawFn, schedules: tuple[str, ...] = SCHEDULES, capacity: str = "around-peak",
          choices: tuple[str, ...] = ("keep", "recompute", "selective", "host", "peer"), splits: bool = True,
          offload: bool = True, max_stages: int = 4, percent: tuple[int, int] = (50, 130),
          copy_bound: bool = False) -> Case:
    """A whole job. ``capacity``: ``around-peak`` draws the GPU capacity between
    ``percent`` of the job's peak with unlimited memory; ``unlimited`` leaves it at 1 TiB.
    ``choices``: the layer actions drawn from; ``splits``: whether splittable layers may
    split; ``offload``: whether optimizer states and stashes may live on the host;
    ``copy_bound``: slow links (see ``servers``)."""
    case = draw(pipelines(schedules, max_stages=max_stages, copy_bound=copy_bound))
    p = len(case.stages)
    optimizer = tuple(draw(st.sampled_from(OPTIMIZER if offload else ("gpu",))) for _ in range(p))
    stash = tuple(draw(st.sampled_from(("gpu", "host") if offload and case.schedule == "pipedream" else ("gpu",)))
                  for _ in range(p))
    case = replace(case, optimizer=optimizer, stash=stash, checkpoints=draw(st.sampled_from(("layer", "segment"))))
    case = replace(case, actions=draw(plan_actions(case, choices, splits)))
    if capacity == "around-peak":
        peak = case.run().max_peak_bytes
        share = draw(st.integers(*percent))
        case = case.with_capacity(max(1, peak * share // 100))
    return case
