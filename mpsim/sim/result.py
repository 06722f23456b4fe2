"""What ``simulate`` returns: JSON-safe summary plus series for plots and timelines."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from mpsim.limits import DEFAULT_HEADROOM_GIB
from mpsim.sim.reserved import ReservedEstimate, estimate
from mpsim.units import GiB

COSTS: tuple[str, ...] = ("recompute_s", "selective_s", "swap_wait_s", "peer_wait_s", "memory_wait_s", "split_s",
                          "optimizer_s", "dp_wait_s", "tp_comm_s", "ep_comm_s",
                          "cp_comm_s")
"""Time a plan's techniques cost a GPU per iteration: recompute and selective (attention
core) recompute on the compute stream,
backward waits on host and on D2D swap-ins, waits for room while swap-outs land, extra
time of split micro-ops, optimizer update time beyond the GPU's own, and waits for
data-parallel collectives (ZeRO-3 gathers, reductions before the update, the gather after it),
the tensor-parallel collectives each layer runs on the critical path, and the
expert-parallel all-to-alls of each MoE layer (``mpsim.sim.expert_group``), and the
context-parallel communication of each attention layer, hidden or not
(``mpsim.sim.context_group``)."""


class Span(NamedTuple):
    """A busy interval on one GPU lane (``compute`` or ``copy``)."""

    gpu: int
    lane: str
    name: str
    start_s: float
    end_s: float


@dataclass
class GpuResult:
    gpu: int
    stage: int | None
    layers: tuple[int, int] | None
    peak_bytes: int
    capacity_bytes: int
    reserved_bytes: int
    breakdown: dict[str, int]
    """Bytes per category at this GPU's peak."""
    compute_s: float
    """Compute-stream busy time per iteration."""
    memory_times_s: np.ndarray = field(repr=False)
    memory_used_bytes: np.ndarray = field(repr=False)
    saved_at_peak: dict[str, int] = field(default_factory=dict)
    """Bytes each technique kept off this GPU at its peak (``mpsim.sim.memory`` ledger)."""
    costs_s: dict[str, float] = field(default_factory=dict)
    """Seconds each technique cost this GPU per iteration (``COSTS``)."""
    compute_capability: float | None = None
    """The GPU's (its cuBLAS workspace size follows it: ``mpsim.sim.reserved``)."""
    nccl_peers: int = 0
    """Peers this GPU runs NCCL collectives with on each channel (their buffers count)."""
    _reserved: dict[str, ReservedEstimate] = field(default_factory=dict, repr=False, compare=False)
    """The estimate once made (``reserved``), shared with the replicas copied from this GPU
    (``dataclasses.replace`` hands them this same dict: one replay serves them all)."""

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes

    @property
    def device_bytes(self) -> int:
        return self.capacity_bytes + self.reserved_bytes

    def reserved(self, expandable: bool = False) -> ReservedEstimate:
        """This GPU's memory through PyTorch's caching allocator (``mpsim.sim.reserved``),
        computed on first use; ``expandable``: with the ``expandable_segments:True`` replay
        too (made only when asked: the verdicts need the first alone)."""
        made = self._reserved.get("estimate")
        if made is None or (expandable and made.expandable_peak_bytes is None):
            made = self._reserved["estimate"] = estimate(self.memory_used_bytes, self.device_bytes,
                                                         self.compute_capability, self.nccl_peers, expandable)
        return made

    def to_dict(self) -> dict:
        return {
            "gpu": self.gpu,
            "stage": self.stage,
            "layers": list(self.layers) if self.layers else None,
            "peak_bytes": self.peak_bytes,
            "capacity_bytes": self.capacity_bytes,
            "reserved_bytes": self.reserved_bytes,
            "fits": self.fits,
            "compute_s": self.compute_s,
            "breakdown": dict(self.breakdown),
            "saved_at_peak": dict(self.saved_at_peak),
            "costs_s": dict(self.costs_s),
            "reserved": self.reserved(expandable=True).to_dict(),
        }


@dataclass
class SimResult:
    server: str
    model: str
    schedule: str
    strategy: str
    microbatch: int
    microbatches: int
    stages: list[tuple[int, int]]
    gpu_of_stage: list[int]
    iteration_s: float
    samples_per_s: float
    model_tflops: float
    """Forward FLOPs x 3 per sample (as MPress IV-A counts), all GPUs together."""
    gpus: list[GpuResult]
    oom: dict | None
    """First point where a GPU ran out: gpu, time_s, task, need_bytes, free_bytes."""
    links: dict[str, dict]
    spans: list[Span] = field(repr=False)
    makespan_s: float = 0.0
    sim_events: int = 0
    """SimPy events scheduled by the run (a measure of simulation work)."""
    host_peak_bytes: int = 0
    """Peak of pinned host memory (swapped tensors, offloaded optimizer states, stashes)."""
    host_capacity_bytes: int = 0
    host_memory_times_s: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    host_memory_used_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), repr=False)
    """Pinned host memory over time (swapped tensors, offloaded states, stashes)."""
    link_rates: list[tuple[float, dict[str, float]]] = field(default_factory=list, repr=False)
    """Link rates (bytes/s) at every change, when the job asked to record them."""
    layout: str = ""
    """The parallel layout (``JobSpec.layout_name``): ``pipeline x8``, ``FSDP x8``, ..."""
    mesh: str = ""
    """The layout's name as ``--layouts`` and ``parse_layout`` read it (``fsdp2xtp4sp``)."""
    replicas: int = 1
    """Data-parallel replicas (``samples_per_s`` and ``model_tflops`` count them all)."""
    gpus_used: int = 0
    """GPUs the layout uses (its mesh's size); 0 when not recorded."""
    gpus_available: int = 0
    """GPUs of the server or servers the job was given; more than ``gpus_used`` when the
    layout names a pipeline that leaves some idle (``runs_on``)."""
    framework: str = ""
    """How the model's layers are written, which sets their activations (the trace's
    ``model.framework``: ``mpsim.models.workloads.FRAMEWORKS``; empty for a traced module)."""
    family: str = ""
    """The trace's ``model.family`` (gpt, bert, llama; empty when it has none)."""
    fine_tune: str = ""
    """A fine-tune's adapters (``mpsim.models.finetune``); empty when every parameter trains."""
    trainable: str = ""
    """A fine-tune's trainable and total parameters, as PEFT prints them; empty otherwise."""
    seq_len: int | None = None
    """Tokens per sample (the trace's ``model.seq_len``; None for a model without one)."""
    time_band_pct: float = 0.0
    """The iteration time's error band, % either side (``CostModel.time_band``)."""
    time_band_source: str = ""
    runtime_profile: str = ""
    """The runtime profile the engine applied (``mpsim.timing.runtime``)."""
    experts: str = ""
    """A mixture of experts: its experts, active parameters and the routing assumed for the
    simulated (busiest) GPU (``mpsim.models.expert_parallel``); empty for a dense model."""

    @property
    def runs_on(self) -> str | None:
        """``runs on 6 of 8 GPUs`` when the layout leaves some of the job's GPUs idle, else None."""
        if 0 < self.gpus_used < self.gpus_available:
            return f"runs on {self.gpus_used} of {self.gpus_available} GPUs"
        return None

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.seq_len is None else self.samples_per_s * self.seq_len

    @property
    def samples_per_s_band(self) -> float:
        """Samples/s either side: a time t(1 +- e) gives a throughput within about +- e of it."""
        return self.samples_per_s * self.time_band_pct / 100

    @property
    def data_parallel(self) -> bool:
        """Whether the layout names data parallelism (DDP, ZeRO or FSDP), not a pipeline only."""
        return bool(self.layout) and not self.layout.startswith("pipeline")

    @property
    def fits(self) -> bool:
        return self.oom is None

    def at_risk(self, headroom_gib: float = DEFAULT_HEADROOM_GIB) -> str:
        """Why a plan that fits may still run out, or ``""``: the first GPU (of those the
        stages run on; the others replicate them) whose caching-allocator reserve, with the
        CUDA context and NCCL buffers (``GpuResult.reserved``), leaves less than
        ``headroom_gib`` of its memory free. ``""`` as well when the plan does not fit."""
        if not self.fits:
            return ""
        own = set(self.gpu_of_stage)
        for g in self.gpus:
            if g.gpu not in own:
                continue
            r = g.reserved()
            if r.at_risk(headroom_gib):
                r = g.reserved(expandable=True)  # for the hint below
                outside = sum(r.outside_bytes.values())
                free = r.free_bytes() / GiB
                verdict = (f"leave {free:.2f} GiB of {r.device_bytes / GiB:.2f} GiB free, under the {headroom_gib:g} "
                           "GiB headroom" if free >= 0
                           else f"come to {-free:.2f} GiB more than its {r.device_bytes / GiB:.2f} GiB")
                hint = (f"; with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True about "
                        f"{(r.expandable_peak_bytes or 0) / GiB:.2f} GiB reserved, out of risk"
                        if r.expandable_helps(headroom_gib) else "")
                return (f"GPU {g.gpu}: {r.reserved_peak_bytes / GiB:.2f} GiB reserved for {g.peak_bytes / GiB:.2f} "
                        f"GiB allocated, plus {outside / GiB:.2f} GiB of CUDA context and NCCL buffers, {verdict}"
                        f"{hint}")
        return ""

    @property
    def max_peak_bytes(self) -> int:
        return max(g.peak_bytes for g in self.gpus)

    def link_utilization(self) -> dict[str, float]:
        """Share of the run each link carried at least one transfer."""
        return {k: v["busy_s"] / self.makespan_s if self.makespan_s else 0.0 for k, v in self.links.items()}

    def to_dict(self) -> dict:
        utilization = self.link_utilization()
        return {
            "fits": self.fits,
            "time_band_pct": self.time_band_pct,
            "time_band_source": self.time_band_source,
            "runtime_profile": self.runtime_profile,
            "experts": self.experts,
            "samples_per_s_band": self.samples_per_s_band,
            "tokens_per_s": self.tokens_per_s,
            "server": self.server,
            "model": self.model,
            "schedule": self.schedule,
            "strategy": self.strategy,
            "layout": self.layout,
            "mesh": self.mesh,
            "framework": self.framework,
            "fine_tune": self.fine_tune or None,
            "trainable": self.trainable or None,
            "replicas": self.replicas,
            "gpus_used": self.gpus_used,
            "gpus_available": self.gpus_available,
            "microbatch": self.microbatch,
            "microbatches": self.microbatches,
            "iteration_s": self.iteration_s,
            "samples_per_s": self.samples_per_s,
            "model_tflops": self.model_tflops,
            "partition": [list(s) for s in self.stages],
            "gpu_of_stage": list(self.gpu_of_stage),
            "gpus": [g.to_dict() for g in self.gpus],
            "host": {"peak_bytes": self.host_peak_bytes, "capacity_bytes": self.host_capacity_bytes},
            "oom": self.oom,
            "links": {k: {"bytes": v["bytes"], "utilization": utilization[k]} for k, v in self.links.items()},
        }
