"""The importable front door: load servers and models, plan and simulate one job.

>>> from mpsim import simulate
>>> r = simulate("dgx1-v100", "gpt-10.3b", schedule="1f1b", microbatch=2, strategy="cpu-swap")
>>> r.fits, round(r.iteration_s, 2)
"""

from __future__ import annotations

from mpsim.catalog import load_topology, load_trace
from mpsim.job import job_of
from mpsim.plan import PlanFile
from mpsim.planners import Planned, plan_job
from mpsim.sim import SimResult, simulate_job
from mpsim.sim.layout import job_of_plan
from mpsim.topology import Topology
from mpsim.trace import Trace


def plan(server: str | Topology, model: str | Trace, schedule: str = "1f1b", microbatch: int | None = None,
         microbatches: int = 16, n_stages: int | None = None, strategy: str = "none",
         partition: str = "compute") -> Planned:
    """Make a plan with a named strategy; returns it with its simulated result."""
    return plan_job(job_of(server, model, schedule=schedule, microbatch=microbatch, microbatches=microbatches,
                           n_stages=n_stages, strategy=strategy, partition=partition))


def simulate(server: str | Topology, model: str | Trace, schedule: str = "1f1b", microbatch: int | None = None,
             microbatches: int = 16, n_stages: int | None = None, strategy: str = "none",
             plan_file: PlanFile | None = None, record_link_rates: bool = False,
             partition: str = "compute") -> SimResult:
    """Simulate one training iteration of ``model`` on ``server``.

    With ``plan_file`` the plan says schedule, microbatches, partition, mapping and
    actions (the trace is rescaled to its microbatch). Otherwise ``strategy`` makes the
    plan: ``microbatch`` rescales the trace (None keeps the traced size); one stage per
    GPU unless ``n_stages`` says otherwise; ``partition`` ``compute`` (balanced compute
    time, as PipeDream and DAPPLE) or ``memory`` (balanced predicted peak, mCAP).
    """
    if plan_file is not None:
        topo = load_topology(server) if isinstance(server, str) else server
        trace = load_trace(model) if isinstance(model, str) else model
        return simulate_job(job_of_plan(topo, trace, plan_file, record_link_rates))
    return plan_job(job_of(server, model, schedule=schedule, microbatch=microbatch, microbatches=microbatches,
                           n_stages=n_stages, strategy=strategy, partition=partition,
                           record_link_rates=record_link_rates)).result


__all__ = ["load_topology", "load_trace", "plan", "simulate"]
