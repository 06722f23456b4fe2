"""``mpsim topo probe``: a topology file for the machine at hand, from measurements.

GPUs (CUDA, or ROCm's HIP through the same torch API): count, model and memory from torch;
NVLink bundles and PCIe placement from ``nvidia-smi topo -m`` (``NV<n>`` is a bundle of n
links, ``PIX``/``PXB`` share a PCIe switch, ``SYS`` crosses sockets), or on AMD GPUs the
Infinity Fabric pairs of ``rocm-smi --showtopotype`` (``ROCM_LINKS``); without either tool
every pair is taken across sockets and the file's description says so; measured host-to-device and device-to-device copy
bandwidth (pinned, 256 MiB), device memory bandwidth (a device copy) and dense matmul
throughput per datatype. Measured rates go in as the peak with efficiency 1.0.

CPU only: ``devices`` CPU "devices" (one per pipeline process), each with ``threads``
intra-op threads: fp32 matmul rate as the peak, memory-copy rate as the memory bandwidth
and as the (PCIe-like) route between devices and to "host" memory, and each device's
share of host RAM (or ``memory_mib``) as its capacity. This is what the CPU validation
simulates, so predicted and measured runs see the same machine.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

from mpsim.errors import MpsimError
from mpsim.hardware.topology import Topology, parse_topology
from mpsim.models.profiler import sync_device
from mpsim.units import MiB

_MATMUL_N = {"cpu": 1024, "cuda": 8192}


def _median_seconds(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after one untimed run."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_tflops(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> float:
    """Dense n x n matmul throughput, TFLOP/s (2 n^3 FLOPs per product)."""
    n = _MATMUL_N[device.type]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    s = _median_seconds(lambda: a @ b, lambda: sync_device(device), repeats)
    return 2 * n**3 / s / 1e12


def copy_gbps(src: torch.Tensor, dst: torch.Tensor, repeats: int = 5) -> float:
    """One-way copy bandwidth from ``src`` to ``dst``, GB/s."""
    def sync() -> None:
        sync_device(src.device)
        sync_device(dst.device)

    s = _median_seconds(lambda: dst.copy_(src, non_blocking=True), sync, repeats)
    return src.numel() * src.element_size() / s / 1e9


ADAM_PROBE_PARAMS = 8 * 2**20
"""Parameters of the CPU Adam step timed by ``cpu_adam_gparams_per_s`` (32 MiB of fp32)."""


def cpu_adam_gparams_per_s(threads: int, repeats: int = 3) -> float:
    """Parameters per second, 1e9, that torch's Adam updates on the CPU with ``threads``
    threads: the step a host optimizer (ZeRO-Offload, FSDP2's CPU offload) runs, timed on
    ``ADAM_PROBE_PARAMS`` fp32 parameters with gradients, median of ``repeats`` steps."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        param = torch.nn.Parameter(torch.randn(ADAM_PROBE_PARAMS))
        param.grad = torch.randn(ADAM_PROBE_PARAMS)
        opt = torch.optim.Adam([param], lr=1e-3)
        step_s = _median_seconds(opt.step, lambda: None, repeats)
    finally:
        torch.set_num_threads(previous)
    return ADAM_PROBE_PARAMS / step_s / 1e9


def _host_memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 16.0


def probe_cpu(devices: int = 1, threads: int = 1, memory_mib: float | None = None, name: str | None = None) -> dict:
    """Topology dict of ``devices`` CPU processes with ``threads`` threads each (module doc)."""
    if devices < 1 or threads < 1:
        raise MpsimError("--devices and --threads must be at least 1")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tflops = matmul_tflops(torch.device("cpu"), torch.float32)
        n = 64 * 2**20 // 4
        src, dst = torch.randn(n), torch.empty(n)
        copy = copy_gbps(src, dst)
        small_src, small_dst = torch.empty(1024), torch.empty(1024)
        latency_s = _median_seconds(lambda: small_dst.copy_(small_src), lambda: None, 20)
    finally:
        torch.set_num_threads(previous)
    host_gib = _host_memory_gib()
    per_device = memory_mib or host_gib * 1024 / devices
    label = f"cpu ({platform.machine()}, {threads} thread{'s' if threads > 1 else ''})"
    return {
        "schema": 1,
        "name": name or f"cpu-probe-x{devices}",
        "description": (f"{devices} CPU process(es) on {platform.node() or 'this machine'}, "
                        "measured by mpsim topo probe"),
        "gpu": {"model": label, "count": devices, "memory_mib": round(per_device, 1), "reserved_mib": 0,
                "peak_tflops": {"fp32": round(tflops, 4)}, "memory_bandwidth_gbps": round(2 * copy, 2),
                "matmul_efficiency": 1.0, "memory_efficiency": 1.0, "peer_copy_engines": 1},
        "host": {"memory_gib": round(host_gib, 1), "sockets": 1,
                 "cpu_adam_gparams_per_s": round(cpu_adam_gparams_per_s(threads), 4)},
        "pcie": {"gpu_link_gbps": round(copy, 2), "latency_us": round(latency_s * 1e6, 2),
                 "switches": [{"name": "memory", "socket": 0, "gpus": list(range(devices)),
                               "uplink_gbps": round(copy, 2)}]},
    }


def nvidia_smi_matrix() -> list[list[str]] | None:
    """The GPU-to-GPU block of ``nvidia-smi topo -m`` (X, NV<n>, PIX, PXB, PHB, NODE, SYS)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    text = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, check=False).stdout
    return _gpu_rows(text)


def _gpu_rows(text: str) -> list[list[str]] | None:
    """The square block of a tool's GPU-to-GPU table: the rows ``GPU<i>`` whose own cell (the
    i-th) is the diagonal's ``X`` (nvidia-smi) or ``0`` (rocm-smi), which leaves out the
    header line of column names; their first n cells (colour codes dropped). None without one."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).split() for line in text.splitlines()]
    rows = [r for r in lines if r and re.fullmatch(r"GPU\d+", r[0]) and _on_diagonal(r)]
    n = len(rows)
    ordered = all(r[0] == f"GPU{i}" for i, r in enumerate(rows))
    return [r[1:n + 1] for r in rows] if n and ordered and all(len(r) > n for r in rows) else None


def _on_diagonal(row: list[str]) -> bool:
    i = int(row[0][3:])
    return len(row) > i + 1 and row[i + 1] in ("X", "0")


ROCM_LINKS = {"XGMI": "NV1", "PCIE": "PHB", "0": "X"}
"""``rocm-smi --showtopotype``'s link types as ``nvidia-smi topo -m``'s labels: an AMD Instinct
pair joined by Infinity Fabric (xGMI) has one link of its own (the full mesh of an 8-GPU
platform: one link per pair), PCIe goes through the host bridge; the diagonal is the GPU."""


def rocm_smi_matrix() -> list[list[str]] | None:
    """The GPU-to-GPU link types of ``rocm-smi --showtopotype`` (AMD GPUs under ROCm), as
    ``nvidia-smi topo -m``'s labels (``ROCM_LINKS``; an unknown type: SYS); None without the tool."""
    exe = shutil.which("rocm-smi")
    if exe is None:
        return None
    text = subprocess.run([exe, "--showtopotype"], capture_output=True, text=True, check=False).stdout
    return rocm_links(text)


def rocm_links(text: str) -> list[list[str]] | None:
    """``rocm-smi --showtopotype``'s table (``text``) as ``nvidia-smi``'s labels (``rocm_smi_matrix``)."""
    rows = _gpu_rows(text)
    return None if rows is None else [[ROCM_LINKS.get(cell.upper(), "SYS") for cell in row] for row in rows]


def link_matrix(n: int) -> tuple[list[list[str]], str]:
    """The first ``n`` GPUs' link labels and where they came from: ``nvidia-smi topo -m``, else
    ``rocm-smi --showtopotype``, else every pair across sockets (SYS) with a line saying no
    tool was found (the file's description carries it)."""
    for source, read in (("nvidia-smi topo -m", nvidia_smi_matrix), ("rocm-smi --showtopotype", rocm_smi_matrix)):
        matrix = read()
        if matrix is not None and len(matrix) >= n:
            return matrix, f"links from {source}"
    return ([["X" if a == b else "SYS" for b in range(n)] for a in range(n)],
            "no nvidia-smi or rocm-smi topology found: every GPU pair assumed to cross sockets over PCIe (SYS); "
            "edit the links by hand")


def _nvlink_pairs(matrix: list[list[str]], n: int, size: int) -> tuple[list[dict], list[float]]:
    """The NVLinked pairs of the first ``n`` GPUs of ``nvidia-smi topo -m``'s ``matrix`` with
    their link counts, and the measured bandwidth per link of the first three pairs (copies
    of ``size`` bytes)."""
    pairs = []
    per_link: list[float] = []
    for a in range(n):
        for b in range(a + 1, n):
            label = matrix[a][b]
            if label.startswith("NV"):
                links = int(label[2:])
                pairs.append({"gpus": [a, b], "links": links})
                if len(per_link) < 3:
                    other = torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", b))
                    per_link.append(copy_gbps(torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", a)),
                                              other) / links)
    return pairs, per_link


def _pcie_switches(matrix: list[list[str]], n: int) -> list[int]:
    """Per GPU of the first ``n``, the PCIe switch it sits behind, named by its first GPU:
    GPUs joined by PIX or PXB share a switch."""
    switch_of = list(range(n))  # GPUs joined by PIX/PXB share a switch
    for a in range(n):
        for b in range(a):
            if matrix[a][b] in ("PIX", "PXB"):
                switch_of[a] = switch_of[b]
                break
    return switch_of


def _sockets(matrix: list[list[str]], n: int) -> list[int]:
    """Per GPU of the first ``n``, its CPU socket: that of the first GPU it reaches without
    crossing sockets (not SYS), else the next socket."""
    socket_of = [0] * n
    for a in range(n):
        socket_of[a] = next((socket_of[b] for b in range(a) if matrix[a][b] != "SYS"),
                            max(socket_of[:a], default=-1) + 1)
    return socket_of


def probe_cuda(name: str | None = None, threads: int = 1) -> dict:
    """Topology dict of the CUDA GPUs visible here (module doc); the host's Adam rate with
    ``threads`` CPU threads, as the executor runs a host optimizer."""
    if not torch.cuda.is_available():
        raise MpsimError("no CUDA GPU is visible on this machine; use --device cpu")
    n = torch.cuda.device_count()
    dev0 = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(dev0)
    peak = {"fp16": matmul_tflops(dev0, torch.float16), "fp32": matmul_tflops(dev0, torch.float32)}
    if torch.cuda.is_bf16_supported():
        peak["bf16"] = matmul_tflops(dev0, torch.bfloat16)
    size = 256 * 2**20
    d_src = torch.empty(size, dtype=torch.uint8, device=dev0)
    d_dst = torch.empty_like(d_src)
    mem_bw = 2 * copy_gbps(d_src, d_dst)
    h = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    h2d, d2h = copy_gbps(h, d_src), copy_gbps(d_src, h)
    matrix, links_from = link_matrix(n)
    pairs, per_link = _nvlink_pairs(matrix, n, size)
    switch_of, socket_of = _pcie_switches(matrix, n), _sockets(matrix, n)
    sockets = max(socket_of) + 1
    switches = [{"name": f"switch{s}", "socket": socket_of[s], "gpus": [g for g in range(n) if switch_of[g] == s],
                 "uplink_gbps": round(min(h2d, d2h), 2)} for s in sorted(set(switch_of))]
    spec: dict = {
        "schema": 1,
        "name": name or f"probe-{n}x-{props.name.replace(' ', '-').lower()}",
        "description": f"{n} x {props.name}, measured by mpsim topo probe (torch {torch.__version__}; {links_from})",
        "gpu": {"model": props.name, "count": n, "memory_mib": round(props.total_memory / MiB, 1),
                "reserved_mib": 0, "peak_tflops": {k: round(v, 2) for k, v in peak.items()},
                "memory_bandwidth_gbps": round(mem_bw, 1), "matmul_efficiency": 1.0, "memory_efficiency": 1.0},
        "host": {"memory_gib": round(_host_memory_gib(), 1), "sockets": sockets,
                 "cpu_adam_gparams_per_s": round(cpu_adam_gparams_per_s(threads), 4)},
        "pcie": {"gpu_link_gbps": round(min(h2d, d2h), 2), "latency_us": 10, "switches": switches},
    }
    if pairs:
        spec["nvlink"] = {"link_bandwidth_gbps": round(statistics.median(per_link), 2), "pairs": pairs}
    if sockets > 1:
        spec["socket_link"] = {"name": "UPI", "bandwidth_gbps": round(min(h2d, d2h), 2)}
    return spec


def probe(device: str = "cpu", devices: int = 1, threads: int = 1, memory_mib: float | None = None,
          name: str | None = None) -> tuple[dict, Topology]:
    """The probed topology as a file dict and as a validated ``Topology``."""
    spec = probe_cuda(name, threads) if device.startswith("cuda") else probe_cpu(devices, threads, memory_mib, name)
    return spec, parse_topology(spec, "<probe>")
