"""The discrete-event simulator (SimPy): network, memory, engine, results."""

from mpsim.sim.engine import Job, Layout, simulate_job, simulate_layout
from mpsim.sim.result import GpuResult, SimResult, Span

__all__ = ["GpuResult", "Job", "Layout", "SimResult", "Span", "simulate_job", "simulate_layout"]
