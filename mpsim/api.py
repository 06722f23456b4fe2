"""The importable front door: load servers and models, simulate one job.

>>> from mpsim import simulate
>>> r = simulate("dgx1-v100", "gpt-5.3b", schedule="1f1b", microbatch=2, microbatches=16)
>>> r.fits, round(r.iteration_s, 2)
"""

from __future__ import annotations

from mpsim.catalog import load_topology, load_trace
from mpsim.sim import Job, SimResult, simulate_job
from mpsim.topology import Topology
from mpsim.trace import Trace


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
