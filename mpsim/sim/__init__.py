"""The discrete-event simulator (SimPy): network, memory, engine, results."""

from mpsim.sim.engine import Job, simulate_job
from mpsim.sim.result import GpuResult, SimResult, Span

__all__ = ["GpuResult", "Job", "SimResult", "Span", "simulate_job"]
