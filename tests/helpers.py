"""Tiny hand-built servers and traces with round numbers, so timelines can be written by hand."""

from __future__ import annotations

import contextlib
import copy
import io
import signal

from mpsim.hardware.topology import Topology, parse_topology
from mpsim.models.trace import Trace, parse_trace

GB = 10**9


def topology_dict(n_gpus: int = 2, nvlink_gbps: float = 1.0, latency_us: float = 0.0, memory_mib: float = 1024.0,
                  pcie_gbps: float = 1.0) -> dict:
    """``n_gpus`` GPUs in a chain of NVLink pairs i-(i+1), all behind one PCIe switch."""
    return {
        "schema": 1,
        "name": f"tiny{n_gpus}",
        "gpu": {"model": "toy", "count": n_gpus, "memory_mib": memory_mib, "reserved_mib": 0,
                "peak_tflops": {"fp16": 1.0}, "memory_bandwidth_gbps": 1.0},
        "host": {"memory_gib": 64, "sockets": 1},
        "nvlink": {"link_bandwidth_gbps": nvlink_gbps, "latency_us": latency_us,
                   "pairs": [{"gpus": [i, i + 1], "links": 1} for i in range(n_gpus - 1)]} if n_gpus > 1 else None,
        "pcie": {"gpu_link_gbps": pcie_gbps, "latency_us": latency_us,
                 "switches": [{"name": "sw0", "socket": 0, "gpus": list(range(n_gpus)), "uplink_gbps": pcie_gbps}]},
    }


def tiny_topology(**kw: float) -> Topology:
    d = topology_dict(**kw)  # type: ignore[arg-type]
    if d["nvlink"] is None:
        del d["nvlink"]
    return parse_topology(d, "tiny.yaml")


def layer(name: str = "l", fwd_ms: float = 1.0, bwd_ms: float = 2.0, act: int = 0, out: int = 0, inp: int = 0,
          saves_input: bool = False, params: int = 0, workspace: int = 0, kind: str = "transformer",
          flops: float = 1e9) -> dict:
    return {"name": name, "kind": kind, "params": params, "param_bytes": 2 * params, "grad_bytes": 2 * params,
            "optimizer_bytes": 12 * params, "act_bytes": act, "saves_input": saves_input, "input_bytes": inp,
            "output_bytes": out, "workspace_bytes": workspace, "fwd_flops": flops, "bwd_flops": 2 * flops,
            "fwd_mem_bytes": 0.0, "bwd_mem_bytes": 0.0, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "split_dims": []}


def trace_dict(layers: list[dict], microbatch: int = 1) -> dict:
    return {"schema": 1, "name": "toy", "model": {"family": "toy"},
            "params": max(1, sum(row["params"] for row in layers)), "microbatch": microbatch,
            "source": {"kind": "measured", "device": "hand-written"}, "layers": copy.deepcopy(layers)}


def tiny_trace(layers: list[dict], microbatch: int = 1) -> Trace:
    return parse_trace(trace_dict(layers, microbatch), "toy.json")


class CliHang(Exception):
    """A command that ran past its time limit (a hang, not a slow machine: the limit is generous)."""


def run_cli(limit_s: int, *argv: str) -> tuple[int, str, str]:
    """``mpsim argv`` in this process: its exit code, stdout and stderr; ``CliHang`` past ``limit_s``."""
    from mpsim.cli import main

    def alarm(signum: int, frame: object) -> None:
        raise CliHang(f"a command ran past {limit_s} s")

    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(limit_s)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return code, out.getvalue(), err.getvalue()
