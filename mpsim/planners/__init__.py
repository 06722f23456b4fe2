"""Planners: each turns a job (server, trace, schedule) into a plan and its simulated result.

``STRATEGIES`` maps the names accepted by ``--strategy`` to planners.
"""

from mpsim.planners.baselines import STRATEGIES, Planned, plan_job

__all__ = ["STRATEGIES", "Planned", "plan_job"]
