"""Planners: each turns a job (server, trace, schedule) into a plan and its simulated result.

``STRATEGIES`` maps the names accepted by ``--strategy`` to planners; ``plan_job`` runs one.
"""

from mpsim.planners.context import Planned
from mpsim.planners.registry import STRATEGIES, plan_job
from mpsim.plans.job import PARTITIONS

__all__ = ["PARTITIONS", "STRATEGIES", "Planned", "plan_job"]
