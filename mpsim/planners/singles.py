"""The registry of single planners: every strategy but ``best``, in the order ``--help``
lists them and ``best`` tries them.

Adding a strategy is one planner (a function ``Ctx -> Planned`` in its own module, citing
the paper it follows) and one ``Strategy`` line below. Nothing else in the package names a
strategy: ``best`` tries those with ``in_best``, mCAP's memory-balanced partition predicts
each stage's peak as the strategy's ``keeps`` says, and the CLI, the page and the studies
take their lists from here (``mpsim.planners.registry.STRATEGIES``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from mpsim.planners.baselines import BASELINES
from mpsim.planners.context import Ctx, Planned
from mpsim.planners.mpress import MPRESS_STRATEGIES
from mpsim.planners.tsplit import plan_tsplit

Keeps = Literal["keep", "recompute", "selective"]


@dataclass(frozen=True)
class Strategy:
    name: str
    planner: Callable[[Ctx], Planned]
    keeps: Keeps = "keep"
    """What the memory-balanced partition (mCAP) assumes of the activations when it predicts
    a stage's peak: kept, every recomputable layer checkpointed, or every attention core
    recomputed (``make_context``)."""
    in_best: bool = False
    """Whether the combined planner (``best``) tries it, under both partitions."""
    combines: bool = False
    """A planner that combines the single ones (``best``): it runs them under both
    partitions itself, so studies do not vary its partition; ``fits`` runs it last and
    starts its search from what they reached, and its parts may run in parallel."""


def _table(*strategies: Strategy) -> dict[str, Strategy]:
    return {s.name: s for s in strategies}


SINGLES: dict[str, Strategy] = _table(
    Strategy("none", BASELINES["none"], in_best=True),
    Strategy("recompute", BASELINES["recompute"], keeps="recompute", in_best=True),
    Strategy("recompute-segments", BASELINES["recompute-segments"], keeps="recompute"),
    Strategy("recompute-all", BASELINES["recompute-all"], keeps="recompute"),
    Strategy("selective", BASELINES["selective"], keeps="selective", in_best=True),
    Strategy("cpu-swap", BASELINES["cpu-swap"], in_best=True),
    Strategy("host-swap", BASELINES["host-swap"], in_best=True),
    Strategy("d2d", BASELINES["d2d"], in_best=True),
    Strategy("mpress", MPRESS_STRATEGIES["mpress"], in_best=True),
    Strategy("mpress-no-mapping", MPRESS_STRATEGIES["mpress-no-mapping"]),
    Strategy("mpress-no-striping", MPRESS_STRATEGIES["mpress-no-striping"]),
    Strategy("mpress-no-mapping-no-striping", MPRESS_STRATEGIES["mpress-no-mapping-no-striping"]),
    Strategy("mpress-d2d-only", MPRESS_STRATEGIES["mpress-d2d-only"]),
    Strategy("tsplit", plan_tsplit, in_best=True),
)
