"""Topology files of schema 1, the NVIDIA-shaped format: ``nvlink`` pairs or an
``nvswitch``, a PCIe tree below host sockets; and the parts both schemas share (the GPU
block with its efficiencies and kernel table, host, NVMe, price) with their ranges.

A checked file becomes tiers (``tier_model``, ``mpsim.hardware.tiers``), which
``mpsim.hardware.topology.Topology`` wires into links and routes, as it does schema 2's
(``mpsim.hardware.schema2``).
"""

from __future__ import annotations

import datetime
import re
from typing import Final, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from mpsim.datafile import FileModel
from mpsim.errors import SchemaError
from mpsim.hardware.ceilings import check_efficiency, check_table
from mpsim.hardware.gpu_tables import KernelTable, shipped_table
from mpsim.hardware.tiers import (
    CpuLink,
    HostPort,
    PeerBundle,
    ScaleUp,
    Tiers,
)
from mpsim.units import MAX_BYTES, GiB, MiB

SCHEMA_VERSION = 1
"""Schema of the NVIDIA-shaped format (``TopologyFile``); ``mpsim.hardware.schema2`` reads 2."""

MAX_GPUS: Final = 1024
"""The most GPUs one server (one scale-up domain and its hosts) may have: an NVL72 rack
is 72, NVL576 576; every GPU pair's route is derived when the server is loaded."""


# Sane ranges of physical quantities: wide enough for any real or imagined server, narrow
# enough that every derived byte count and time stays a finite, exact number.
MAX_MEMORY_MIB = MAX_BYTES // MiB
MIN_GBPS, MAX_GBPS = 1e-6, 1e6
"""Bandwidths from 1 kB/s to 1 PB/s."""
MIN_TFLOPS, MAX_TFLOPS = 1e-6, 1e6
MAX_LATENCY_US = 1e6



def gpu_list(gpus: list[int], show: int = 8) -> str:
    """GPU indices as an error names them: the list, or beyond ``show`` its first few, the
    last and the count (``[8, 9, 10, ..., 1023] (1016 GPUs)``), so that a file of many
    GPUs still gets a short line."""
    if len(gpus) <= show:
        return str(gpus)
    return f"[{', '.join(map(str, gpus[:show - 1]))}, ..., {gpus[-1]}] ({len(gpus)} GPUs)"


Dtype = Literal["fp16", "bf16", "fp32", "tf32", "fp8", "fp4"]
"""Precisions a GPU lists peaks and efficiencies for; ``fp4`` only where it has FP4 tensor cores
(Blackwell, MI355X), its dense rate."""


class OpEfficiency(FileModel):
    """Fractions of peak that one operation class reaches at one precision, and where the
    figures come from. A layer's time is the sum over classes (``mpsim.timing.costs``):
    matmul FLOPs at ``matmul`` x peak, FLOPs inside a fused attention kernel (flash,
    memory-efficient) at ``attention`` x peak, bytes moved by non-matmul ops at
    ``memory`` x memory bandwidth."""

    matmul: float = Field(gt=0, le=1, description="fraction of the dtype's peak that GEMMs reach")
    attention: float = Field(gt=0, le=1, description="fraction of the dtype's peak a fused attention kernel reaches")
    memory: float = Field(gt=0, le=1, description="fraction of memory bandwidth that element-wise work reaches")
    source: str = Field(min_length=1, description="where the three figures come from (paper, benchmark, calibration)")

    @model_validator(mode="after")
    def _source_not_blank(self) -> OpEfficiency:
        if not self.source.strip():
            raise ValueError("source must name where the efficiencies come from")
        return self


class GpuSpec(FileModel):
    model: str = Field(description="GPU model name, e.g. V100-SXM2-32GB")
    count: int = Field(gt=0, le=MAX_GPUS, description="number of GPUs in the server")
    memory_mib: float = Field(gt=0, le=MAX_MEMORY_MIB, description="device memory as nvidia-smi reports it, MiB")
    reserved_mib: float = Field(
        ge=0, le=MAX_MEMORY_MIB, default=300, description="CUDA context and allocator slack per GPU, MiB")
    peak_tflops: dict[Dtype, float] = Field(
        min_length=1, description="dense peak TFLOP/s per datatype (vendor datasheet)"
    )
    memory_bandwidth_gbps: float = Field(ge=MIN_GBPS, le=MAX_GBPS, description="device memory bandwidth, GB/s")
    matmul_efficiency: float = Field(
        ge=1e-3, le=1, default=0.5,
        description="fraction of peak FLOP/s that a layer's math reaches, for a precision `efficiency` lacks"
    )
    memory_efficiency: float = Field(
        ge=1e-3, le=1, default=0.8,
        description="fraction of memory bandwidth that element-wise work reaches, for a precision `efficiency` "
                    "lacks (and the optimizer update)"
    )
    efficiency: dict[Dtype, OpEfficiency] | None = Field(
        default=None, description="per precision: matmul, attention-kernel and memory-bound efficiencies with "
                                  "their source")
    peer_copy_engines: int = Field(
        default=2, ge=1, le=16, description="copies to peer GPUs a GPU runs at once (more queue)"
    )
    compute_capability: float | None = Field(
        default=None, ge=1, le=20, description="CUDA compute capability (7.0 V100, 8.0 A100, 9.0 H100): which "
                                               "attention kernel PyTorch uses")
    kernels: KernelTable | None = Field(
        default=None, description="the GPU's kernel table (mpsim.hardware.gpu_tables); absent: the shipped one for its "
                                  "model, if any")
    time_model: Literal["auto", "kernels", "roofline"] = Field(
        default="auto", description="kernels: each kernel timed from its shape (mpsim.timing.kernel_time) where the "
                                    "trace records kernels and a table exists; roofline: the per-class "
                                    "efficiencies of `efficiency`; auto: kernels where the GPU's table rests on "
                                    "kernel-level data of that GPU or has been checked against its measurements "
                                    "(KernelTable.by_default), else roofline")

    @model_validator(mode="after")
    def _reserved_below_memory(self) -> GpuSpec:
        if self.reserved_mib >= self.memory_mib:
            raise ValueError("reserved_mib must be smaller than memory_mib")
        for dtype, tflops in self.peak_tflops.items():
            if not MIN_TFLOPS <= tflops <= MAX_TFLOPS:
                raise ValueError(f"peak_tflops.{dtype} must be between {MIN_TFLOPS:g} and {MAX_TFLOPS:g}")
        for dtype, eff in (self.efficiency or {}).items():
            if dtype not in self.peak_tflops:
                raise ValueError(f"efficiency.{dtype}: no peak_tflops.{dtype} to take a fraction of")
            above = check_efficiency(self.model, dtype, eff.matmul, eff.attention, eff.memory)
            if above:
                raise ValueError(f"efficiency.{above[0]}")
        if self.kernels is not None and (above := check_table(self.model, self.kernels)):
            raise ValueError(f"kernels: {above[0]}")
        return self

    def kernel_table(self) -> KernelTable | None:
        """The table that times this GPU's kernels: its own, else the shipped one for its
        model (``mpsim.hardware.gpu_tables.shipped_table``); None under ``time_model: roofline``."""
        table = self.kernels or shipped_table(self.model)
        if self.time_model == "roofline" or (self.time_model == "auto" and not (table and table.by_default)):
            return None
        return table

    def op_efficiency(self, dtype: Dtype) -> OpEfficiency:
        """The efficiencies at ``dtype``: its ``efficiency`` block, else the GPU-wide
        ``matmul_efficiency`` (for fused attention too) and ``memory_efficiency``."""
        block = (self.efficiency or {}).get(dtype)
        if block is not None:
            return block
        return OpEfficiency(matmul=self.matmul_efficiency, attention=self.matmul_efficiency,
                            memory=self.memory_efficiency, source="matmul_efficiency and memory_efficiency")


CPU_ADAM_BYTES_PER_PARAM: Final = 28
"""DRAM traffic of one mixed-precision Adam step per parameter on the CPU: read the fp32
master weight, momentum and variance and the fp32 gradient (16 bytes), write the three
back (12 bytes); the fp16 copy of the weight is the GPU's business."""
CPU_STREAM_EFFICIENCY: Final = 0.6
"""Share of the DRAM channels' peak a vectorized, all-core streaming kernel reaches
(STREAM-like triad on two-socket servers); an estimate, not measured here."""


class HostSpec(FileModel):
    memory_gib: float = Field(gt=0, le=MAX_BYTES // GiB, description="host DRAM, GiB")
    sockets: int = Field(gt=0, le=8, description="CPU sockets")
    memory_bandwidth_gbps: float | None = Field(
        default=None, ge=MIN_GBPS, le=MAX_GBPS,
        description="peak DRAM bandwidth of all sockets together, GB/s (channels x transfer rate x 8 bytes)")
    cpu_adam_gparams_per_s: float = Field(
        ge=1e-6, le=1e6, default=1.0,
        description="optimizer update rate on the CPU when memory_bandwidth_gbps is not given, 1e9 params/s "
                    "(estimate)")

    @property
    def adam_params_per_s(self) -> float:
        """Parameters per second the CPU's Adam step updates (ZeRO-Offload's CPU-Adam is
        memory bound): the DRAM bandwidth at ``CPU_STREAM_EFFICIENCY`` over
        ``CPU_ADAM_BYTES_PER_PARAM``, or the stated rate when the bandwidth is not given."""
        if self.memory_bandwidth_gbps is None:
            return self.cpu_adam_gparams_per_s * 1e9
        return self.memory_bandwidth_gbps * 1e9 * CPU_STREAM_EFFICIENCY / CPU_ADAM_BYTES_PER_PARAM


class NvmeSpec(FileModel):
    """Local NVMe drives, all together: where ZeRO-Infinity keeps what host memory cannot."""

    capacity_gib: float = Field(gt=0, le=MAX_BYTES // GiB, description="usable NVMe capacity, GiB")
    read_gbps: float = Field(ge=MIN_GBPS, le=MAX_GBPS, description="sequential read bandwidth, all drives, GB/s")
    write_gbps: float = Field(ge=MIN_GBPS, le=MAX_GBPS, description="sequential write bandwidth, all drives, GB/s")
    source: str = Field(default="", description="where the figures come from")


class NvlinkPair(FileModel):
    gpus: tuple[int, int] = Field(description="the two GPU indices this bundle joins")
    links: int = Field(gt=0, le=18, description="number of NVLinks in the bundle")


class NvlinkSpec(FileModel):
    link_bandwidth_gbps: float = Field(
        ge=MIN_GBPS, le=MAX_GBPS, description="effective bandwidth of one link per direction, GB/s")
    latency_us: float = Field(
        ge=0, le=MAX_LATENCY_US, default=10.0, description="per-transfer setup latency, microseconds")
    pairs: list[NvlinkPair] = Field(min_length=1, description="point-to-point NVLink bundles")


class NvswitchSpec(FileModel):
    gpu_bandwidth_gbps: float = Field(
        ge=MIN_GBPS, le=MAX_GBPS, description="effective bandwidth of each GPU into the fabric per direction, GB/s")
    links_per_gpu: int = Field(gt=0, le=64, description="NVLinks from each GPU to the switches (shown as NV<n>)")
    latency_us: float = Field(
        ge=0, le=MAX_LATENCY_US, default=10.0, description="per-transfer setup latency, microseconds")


class PcieSwitch(FileModel):
    name: str
    socket: int = Field(ge=0, le=7, description="CPU socket the switch's uplink goes to")
    gpus: list[int] = Field(min_length=1, max_length=64, description="GPU indices below this switch")
    uplink_gbps: float = Field(
        ge=MIN_GBPS, le=MAX_GBPS, description="effective switch-to-CPU bandwidth per direction, GB/s")


class PcieSpec(FileModel):
    gpu_link_gbps: float = Field(
        ge=MIN_GBPS, le=MAX_GBPS, description="effective GPU-to-switch bandwidth per direction, GB/s")
    latency_us: float = Field(
        ge=0, le=MAX_LATENCY_US, default=10.0, description="per-transfer setup latency, microseconds")
    switches: list[PcieSwitch] = Field(min_length=1)


class SocketLinkSpec(FileModel):
    name: str = Field(default="QPI", description="QPI, UPI, Infinity Fabric ...")
    bandwidth_gbps: float = Field(
        ge=MIN_GBPS, le=MAX_GBPS, description="effective socket-to-socket bandwidth per direction, GB/s")


PRICE_DATE_PATTERN = r"^[0-9]{4}(-[0-9]{2}(-[0-9]{2})?)?$"
MAX_USD = 1e9
"""The most any one price may be: a server bought for a billion dollars is a typo."""


class _PriceBase(FileModel):
    source: str = Field(min_length=1, description="where the figure comes from (provider, list, region)")
    date: str = Field(description="when it was listed: YYYY, YYYY-MM or YYYY-MM-DD")

    @field_validator("date", mode="before")
    @classmethod
    def _date_as_text(cls, value: object) -> object:
        """YAML reads an unquoted 2024-05-01 as a date; keep it as the text it was."""
        return value.isoformat() if isinstance(value, datetime.date) else value

    @field_validator("date")
    @classmethod
    def _date_form(cls, value: str) -> str:
        if not re.fullmatch(PRICE_DATE_PATTERN, value):
            raise ValueError(f"expected a date as YYYY, YYYY-MM or YYYY-MM-DD, got {value!r}")
        return value

    @model_validator(mode="after")
    def _source_not_blank(self) -> _PriceBase:
        if not self.source.strip():
            raise ValueError("source must name where the price comes from")
        return self


class HourlyPrice(_PriceBase):
    usd_per_hour: float = Field(gt=0, le=MAX_USD, description="on-demand rent of the whole server, USD per hour")


class PurchasePrice(_PriceBase):
    usd: float = Field(gt=0, le=MAX_USD, description="purchase price of the whole server, USD")


class PriceSpec(FileModel):
    """What the server costs: an on-demand hourly rent and/or a purchase price, each with
    its source and date (prices change; `mpsim choose --price` overrides)."""

    on_demand: HourlyPrice | None = None
    purchase: PurchasePrice | None = None

    @model_validator(mode="after")
    def _some_price(self) -> PriceSpec:
        if self.on_demand is None and self.purchase is None:
            raise ValueError("give on_demand (usd_per_hour) and/or purchase (usd), each with source and date")
        return self


class TopologyFile(FileModel):
    """The on-disk schema of a topology file."""

    schema_: int = Field(alias="schema", description="format version, currently 1")
    name: str
    description: str = ""
    gpu: GpuSpec
    host: HostSpec
    nvlink: NvlinkSpec | None = None
    nvswitch: NvswitchSpec | None = None
    pcie: PcieSpec
    nvme: NvmeSpec | None = Field(default=None, description="local NVMe drives (ZeRO-Infinity's offload target)")
    socket_link: SocketLinkSpec | None = None
    price: PriceSpec | None = Field(default=None, description="list prices with source and date (`mpsim choose`)")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)

    def tiers(self, source: str = "") -> Tiers:
        """The file checked (``_check``, errors naming ``source``) and as tiers."""
        _check(source, self)
        return _tiers_of_schema1(self)

    def with_faster_scale_up(self, factor: float) -> TopologyFile:
        """The same server with its NVLink (or NVSwitch) bandwidth ``factor`` times higher."""
        return _faster_schema1(self, factor)


def _faster_schema1(spec: TopologyFile, factor: float) -> TopologyFile:
    update: dict[str, object] = {}
    if spec.nvlink is not None:
        update["nvlink"] = spec.nvlink.model_copy(
            update={"link_bandwidth_gbps": spec.nvlink.link_bandwidth_gbps * factor})
    if spec.nvswitch is not None:
        update["nvswitch"] = spec.nvswitch.model_copy(
            update={"gpu_bandwidth_gbps": spec.nvswitch.gpu_bandwidth_gbps * factor})
    return spec.model_copy(update=update)


def schema_expected(got: object) -> str:
    return f"expected {SCHEMA_VERSION}, got {got} (or 2, the tiered format: topologies/README.md)"


def _check(path: str, spec: TopologyFile) -> None:
    """Cross-field rules pydantic cannot state per field; raise the first violation."""
    if spec.schema_ != SCHEMA_VERSION:
        raise SchemaError(path, "schema", schema_expected(spec.schema_))
    if spec.nvlink and spec.nvswitch:
        raise SchemaError(path, "nvlink", "give either nvlink pairs or an nvswitch fabric, not both")
    if spec.nvlink:
        _check_nvlink_pairs(path, spec.nvlink.pairs, spec.gpu.count)
    _check_pcie(path, spec)
    if spec.host.sockets > 1 and spec.socket_link is None:
        raise SchemaError(path, "socket_link", "required when the host has more than one socket")


def _check_nvlink_pairs(path: str, pairs: list[NvlinkPair], n: int) -> None:
    """Each NVLink pair joins two distinct GPUs of the server, and is listed once."""
    seen: set[frozenset[int]] = set()
    for i, pair in enumerate(pairs):
        a, b = pair.gpus
        for g in (a, b):
            if not 0 <= g < n:
                raise SchemaError(path, f"nvlink.pairs.{i}.gpus", f"GPU index {g} out of range 0..{n - 1}")
        if a == b:
            raise SchemaError(path, f"nvlink.pairs.{i}.gpus", f"a GPU cannot link to itself ({a})")
        key = frozenset((a, b))
        if key in seen:
            raise SchemaError(path, f"nvlink.pairs.{i}.gpus", f"pair {a}-{b} listed twice")
        seen.add(key)


def _check_pcie(path: str, spec: TopologyFile) -> None:
    """Every GPU sits below exactly one PCIe switch, and every switch on a host socket."""
    n = spec.gpu.count
    placed: dict[int, str] = {}
    for i, sw in enumerate(spec.pcie.switches):
        if sw.socket >= spec.host.sockets:
            raise SchemaError(path, f"pcie.switches.{i}.socket",
                              f"socket {sw.socket} out of range 0..{spec.host.sockets - 1}")
        for g in sw.gpus:
            if not 0 <= g < n:
                raise SchemaError(path, f"pcie.switches.{i}.gpus", f"GPU index {g} out of range 0..{n - 1}")
            if g in placed:
                raise SchemaError(path, f"pcie.switches.{i}.gpus", f"GPU {g} is already below switch {placed[g]}")
            placed[g] = sw.name
    missing = sorted(set(range(n)) - set(placed))
    if missing:
        raise SchemaError(path, "pcie.switches",
                          f"every GPU must sit below a PCIe switch; missing {gpu_list(missing)}")


def _tiers_of_schema1(spec: TopologyFile) -> Tiers:
    """A checked schema-1 file as tiers: its NVLink pairs a mesh of ``nvlink`` bundles, its
    NVSwitch a switch, each PCIe switch a port of its socket, the socket link between
    every two sockets (at the PCIe latency, as schema 1 always timed it)."""
    if spec.nvlink is not None:
        nv = spec.nvlink
        bundles = tuple(PeerBundle(p.gpus[0], p.gpus[1], p.links, p.links * nv.link_bandwidth_gbps) for p in nv.pairs)
        scale_up = ScaleUp("mesh", "nvlink", "NV", nv.latency_us, bundles=bundles)
    elif spec.nvswitch is not None:
        sw = spec.nvswitch
        scale_up = ScaleUp("switch", "nvswitch", "NV", sw.latency_us, gpu_gbps=sw.gpu_bandwidth_gbps,
                           links_per_gpu=sw.links_per_gpu)
    else:
        scale_up = ScaleUp("none")
    pcie = spec.pcie
    ports = tuple(HostPort(sw.socket, "pcie", tuple(sw.gpus), pcie.gpu_link_gbps, pcie.latency_us, sw.name,
                           sw.uplink_gbps) for sw in pcie.switches)
    link = spec.socket_link
    cpu_link = None if link is None else CpuLink(link.name.lower(), link.bandwidth_gbps, pcie.latency_us)
    return Tiers(spec.gpu.count, spec.host.sockets, scale_up, ports, cpu_link)


