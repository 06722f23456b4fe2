"""The importable front door: load servers and models, simulate one job.

>>> from mpsim import simulate
>>> r = simulate("dgx1-v100", "gpt-5.3b", schedule="1f1b", microbatch=2, microbatches=16)
>>> r.fits, round(r.iteration_s, 2)
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from mpsim.catalog import _resolve, load_topology, shipped_traces
from mpsim.sim import Job, SimResult, simulate_job
from mpsim.topology import Topology
from mpsim.trace import Trace, read_trace_file


@lru_cache(maxsize=64)
def _load_trace_cached(path: str, mtime: float) -> Trace:
    return read_trace_file(Path(path))


def load_trace(name_or_path: str) -> Trace:
    """A shipped model by name (``gpt-5.3b``) or a trace JSON file."""
    path = _resolve(name_or_path, shipped_traces(), "model")
    return _load_trace_cached(str(path), path.stat().st_mtime)


def simulate(server: str | Topology, model: str | Trace, schedule: str = "1f1b", microbatch: int | None = None,
             microbatches: int = 16, n_stages: int | None = None, strategy: str = "none") -> SimResult:
    """Simulate one training iteration of ``model`` on ``server``.

    ``microbatch`` rescales the trace (None keeps the traced size); one stage per GPU
    unless ``n_stages`` says otherwise; compute-balanced partition.
    """
    topo = load_topology(server) if isinstance(server, str) else server
    trace = load_trace(model) if isinstance(model, str) else model
    if microbatch is not None:
        trace = trace.rescale(microbatch)
    return simulate_job(Job(topo, trace, schedule, microbatches, n_stages=n_stages, strategy=strategy))


__all__ = ["load_topology", "load_trace", "simulate"]
