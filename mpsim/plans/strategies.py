"""The registry of strategies: every name ``--strategy`` accepts, in the order the help,
the errors and ``best`` list them, and what each one is.

Adding a strategy is one planner (a function ``Ctx -> Planned`` in its own module under
``mpsim/planners/``, citing the paper it follows) and one ``Strategy`` line below. Nothing
else in the package names a strategy: a ``JobSpec`` checks its name here, ``best`` tries
those with ``in_best``, mCAP's memory-balanced partition predicts each stage's peak as the
strategy ``keeps``, ``fits`` and ``choose`` ask ``combines``, and the CLI, the page and the
studies take their lists from here.

The registry is data: a planner is named by its import path and imported when it first
runs, so checking a job's strategy imports no planner (and the job type stays upstream of
the planners that plan it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from mpsim.errors import MpsimError
from mpsim.plans.partition import PARTITIONS

Keeps = Literal["keep", "recompute", "selective"]


@dataclass(frozen=True)
class Strategy:
    name: str
    planner: str
    """``module:attribute`` of the planner: a function ``Ctx -> Planned``, or a table of
    them by strategy name (one module's variants)."""
    keeps: Keeps = "keep"
    """What the memory-balanced partition (mCAP) assumes of the activations when it predicts
    a stage's peak: kept, every recomputable layer checkpointed, or every attention core
    recomputed (``mpsim.planners.context.make_context``)."""
    in_best: bool = False
    """Whether the combined planner (``best``) tries it, under both partitions (see also
    ``best_fallback``)."""
    combines: bool = False
    """A planner that combines the single ones (``best``): it runs them under both
    partitions itself, so studies do not vary its partition; ``fits`` runs it last and
    starts its search from what they reached, and its parts may run in parallel."""
    help: str | None = ""
    """What ``--strategy``'s help says of it, after its name ("": the name alone; None: said
    with another, as MPress's ablations are)."""
    word: str = ""
    """A few words on it for a list (the page's strategy menu); "": the name alone."""
    exists: str = ""
    """``module:attribute`` of a check ``Ctx -> bool`` that says whether the planner finds a
    plan that fits, stopping at the first (no tuning), or a table of them by name; "":
    plan and look (``mpsim.planners.registry.plan_fits``)."""
    offloads_model_states: bool = False
    """Whether its plans may keep weights or gradients off the GPU (ZeRO-Offload and
    ZeRO-Infinity): the memory floor of ``mpsim.studies.bounds`` does not hold for it."""
    zero_stage: int | None = None
    """The ZeRO stage its plans run whatever the job's (ZeRO-Offload 2, ZeRO-Infinity 3):
    a job that asks for another contradicts it (``check_zero_stage``); None: the job's."""
    best_fallback: bool = False
    """Whether ``best`` tries it when none of the ``in_best`` planners fits (the offload
    systems: slow, so only as a last resort, which keeps ``best``'s cost where it was
    whenever something else fits)."""
    optimizer_on_gpu: bool = False
    """Whether every plan of it keeps the optimizer states on the GPU (none streams them to
    the host, as the swap planners and MPress may): the memory floor of ``mpsim.studies.bounds``
    then counts them with the weights and gradients."""

    def planner_fn(self) -> Callable[[Any], Any]:
        """The planner itself (imported on first use)."""
        return self._imported(self.planner)

    def exists_fn(self) -> Callable[[Any], bool] | None:
        """Its existence check (``exists``), or None."""
        return self._imported(self.exists) if self.exists else None

    def _imported(self, where: str) -> Callable[[Any], Any]:
        module, _, attribute = where.partition(":")
        found = getattr(importlib.import_module(module), attribute)
        return found[self.name] if isinstance(found, Mapping) else found


def _table(*strategies: Strategy) -> dict[str, Strategy]:
    return {s.name: s for s in strategies}


_BASELINES = "mpsim.planners.baselines:BASELINES"
_MPRESS = "mpsim.planners.mpress:MPRESS_STRATEGIES"
_MPRESS_EXISTS = "mpsim.planners.mpress:MPRESS_EXISTS"

STRATEGIES: dict[str, Strategy] = _table(
    Strategy("none", _BASELINES, in_best=True, optimizer_on_gpu=True, word="keep everything on the GPU"),
    Strategy("recompute", _BASELINES, keeps="recompute", in_best=True, optimizer_on_gpu=True,
             word="recompute layers until it fits",
             help="checkpoint transformer layers or module blocks, fewest first, until each GPU fits"),
    Strategy("recompute-segments", _BASELINES, keeps="recompute", optimizer_on_gpu=True,
             word="recompute runs of layers (GPipe, DAPPLE)",
             help="the same layers, a run of consecutive ones keeping one checkpoint and re-run whole, as Chen "
                  "et al. 2016 and GPipe"),
    Strategy("recompute-all", _BASELINES, keeps="recompute", optimizer_on_gpu=True,
             word="recompute every layer", help="every one"),
    Strategy("selective", _BASELINES, keeps="selective", in_best=True, optimizer_on_gpu=True,
             word="recompute the attention core (Megatron)",
             help="recompute only the attention core of every transformer layer, Korthikanti et al. 2022"),
    Strategy("cpu-swap", _BASELINES, in_best=True, word="swap to host on demand (MPress baseline)",
             help="MPress's GPU-CPU swap baseline: to host memory until it fits, each copy on demand, the "
                  "compute waiting for it"),
    Strategy("host-swap", _BASELINES, in_best=True, word="swap to host, prefetched",
             help="the same, overlapped and prefetched"),
    Strategy("offload-activations", "mpsim.planners.activation_offload:plan_offload_activations",
             optimizer_on_gpu=True, word="offload every layer's activations to host (Megatron-Core)",
             help="every transformer layer's saved activations but each stage's last to pinned host memory, "
                  "overlapped and prefetched a layer ahead, whether needed or not, as Megatron-Core's "
                  "--cpu-offloading and PyTorch's save_on_cpu"),
    Strategy("d2d", _BASELINES, in_best=True, optimizer_on_gpu=True, word="swap to NVLink peers' spare memory",
             help="swap to spare memory of NVLink peers"),
    Strategy("mpress", _MPRESS, exists=_MPRESS_EXISTS, in_best=True, word="MPress: host swap, recompute and D2D",
             help="host swap, recompute and D2D with device mapping; ablations mpress-no-mapping, "
                  "mpress-no-striping, mpress-d2d-only"),
    Strategy("mpress-no-mapping", _MPRESS, exists=_MPRESS_EXISTS, help=None),
    Strategy("mpress-no-striping", _MPRESS, exists=_MPRESS_EXISTS, help=None),
    Strategy("mpress-no-mapping-no-striping", _MPRESS, exists=_MPRESS_EXISTS, help=None),
    Strategy("mpress-d2d-only", _MPRESS, exists=_MPRESS_EXISTS, help=None),
    Strategy("tsplit", "mpsim.planners.tsplit:plan_tsplit", in_best=True, optimizer_on_gpu=True,
             word="TSPLIT: swap, recompute, split tensors",
             help="swap, recompute and tensor splitting by TSPLIT's cost model"),
    Strategy("zero-offload", "mpsim.planners.offload:PLANNERS", word="ZeRO-Offload: optimizer on the host CPU",
             offloads_model_states=True, zero_stage=2, best_fallback=True,
             help="ZeRO-Offload: ZeRO-2 over the replicas, optimizer states and Adam on the host CPU"),
    Strategy("zero-infinity", "mpsim.planners.offload:PLANNERS", word="ZeRO-Infinity: states in host memory",
             offloads_model_states=True, zero_stage=3, best_fallback=True,
             help="ZeRO-Infinity: ZeRO-3, parameter shards and optimizer states in host memory (NVMe when short)"),
    Strategy("best", "mpsim.planners.best:plan_best", combines=True, word="every planner, the fastest that fits",
             offloads_model_states=True,  # its last resort is the offload systems (``best_fallback``)
             help="every planner under both partitions, the fastest that fits"),
)
"""Every strategy, in the order ``--help``, the errors and ``best`` list them."""

IN_BEST: tuple[str, ...] = tuple(name for name, s in STRATEGIES.items() if s.in_best)
"""The single planners ``best`` tries, in the registry's order (ties go to the first)."""

BEST_FALLBACK: tuple[str, ...] = tuple(name for name, s in STRATEGIES.items() if s.best_fallback)
"""The planners ``best`` tries only when none of ``IN_BEST`` fits (``Strategy.best_fallback``)."""


STRATEGY_HELP = "memory-saving strategy: " + "; ".join(
    s.name + (f" ({s.help})" if s.help else "") for s in STRATEGIES.values() if s.help is not None)
"""``--strategy``'s help, from the registry."""


def strategy_named(name: str) -> Strategy:
    """The registered strategy called ``name``; the one place an unknown name is refused."""
    strategy = STRATEGIES.get(name)
    if strategy is None:
        raise MpsimError(f"unknown strategy {name!r}: expected one of {', '.join(STRATEGIES)}")
    return strategy


def check_zero_stage(name: str, zero_stage: int, hsdp: bool = False, given: bool = True) -> None:
    """Refuse, in one line naming both options, a ZeRO stage (``--zero``) or HSDP that
    contradicts the strategy ``name``'s own (``Strategy.zero_stage``). ``given``: whether the
    stage was asked for (a default stage of 0 is the strategy's to raise)."""
    own = strategy_named(name).zero_stage
    if own is None:
        return
    if hsdp and own != 3:
        raise MpsimError(f"--hsdp and --strategy {name}: {name} runs ZeRO-{own}, HSDP is ZeRO-3 within a server; "
                         "leave one out")
    if given and zero_stage != own:
        raise MpsimError(f"--zero {zero_stage} and --strategy {name}: {name} runs ZeRO-{own} over the replicas; "
                         f"leave --zero out or give --zero {own}")


def combines(name: str) -> bool:
    """Whether the strategy ``name`` combines the single planners (``Strategy.combines``)."""
    return strategy_named(name).combines


def planner_runs(name: str) -> int:
    """The most planner runs one job under ``name`` makes: every ``IN_BEST`` planner under
    both partitions for a combining one (fewer where the layout has one partition, or
    keeping everything fits), else one."""
    return (len(IN_BEST) + len(BEST_FALLBACK)) * len(PARTITIONS) if combines(name) else 1


def base_name(label: str) -> str:
    """The strategy a result's label names: ``best`` for ``best (mpress, compute partition)``."""
    return label.split(" (", 1)[0]
