"""The discrete-event simulator (SimPy): network, memory, engine, results.

The compiled engine, when built for these sources, is put in place before anything else
is imported (``mpsim.native``)."""

from mpsim import native

native.install()

# the engine's modules are imported after the compiled engine's hook is in place
from mpsim.sim.engine import Job, Layout, simulate_job, simulate_layout  # noqa: E402
from mpsim.sim.result import GpuResult, SimResult, Span  # noqa: E402

__all__ = ["GpuResult", "Job", "Layout", "SimResult", "Span", "simulate_job", "simulate_layout"]
