"""Expert-parallel shards of a mixture-of-experts trace: what one GPU of an expert group runs.

Expert parallelism (GShard, Lepikhin et al. 2020, section 2.2; Megatron-Core's MoE) splits
each MoE layer's E routed experts over the e GPUs of an expert-parallel group, E/e on each;
the layer's dense part (attention, router, shared experts, norms) is replicated on them, and
they train different samples, so for the dense part the group is data parallelism. Each
token's k routed copies travel to the GPUs of their experts and back: a dispatch and a
combine all-to-all in the forward, the same two in reverse in the backward
(``LayerRow.dispatch_bytes`` each, before the split).

One GPU's shard of a row (``expert_shard``):

- parameters, gradients and optimizer states: the dense part whole, the routed experts'
  1/e (``expert_params / e`` at the recipe's bytes per parameter);
- work and saved bytes: the experts' share of the routed tokens. Under uniform routing
  every GPU receives T k / e token copies for its E/e experts, as many as it sends, so its
  expert FLOPs and saved bytes are the unsplit layer's. Under a stated load
  (``ExpertLoad``) the simulated GPU is the busiest: its experts receive ``s`` times the
  mean (``ExpertLoad.rank_factor``), and so do its expert FLOPs, saved bytes and the
  all-to-alls it takes part in; the other GPUs wait for it at the combine.

The shard keeps the load factor and the degree in its model block (``expert_parallel``);
the engine scales the experts' part of each layer's time by it (their share of the layer's
FLOPs) and runs the all-to-alls over the group (``mpsim.sim.expert_group``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpsim.caches import Lru
from mpsim.datafile import read_data_file
from mpsim.errors import MpsimError
from mpsim.models.trace import LayerRow, Trace

SHARDS = 64
"""Expert shards remembered per process."""
_SHARDS: Lru[tuple[object, ...], Trace] = Lru(SHARDS)
MAX_HISTOGRAM_EXPERTS = 1 << 16
"""The most experts a measured histogram may list (``LayerRow.experts``' bound)."""


@dataclass(frozen=True)
class ExpertLoad:
    """How routed tokens spread over the experts: uniform (the default), the busiest
    expert's share of the routed tokens (``busiest_share``), or a measured share per
    expert (``shares``, in expert order; Megatron-Core places experts on expert-parallel
    ranks in contiguous blocks)."""

    busiest_share: float | None = None
    shares: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.busiest_share is not None and not 0 < self.busiest_share <= 1:
            raise MpsimError(f"the busiest expert's share of routed tokens is in (0, 1], got {self.busiest_share}")

    @property
    def uniform(self) -> bool:
        return self.busiest_share is None and not self.shares

    def describe(self) -> str:
        """The assumption in words, as outputs name it."""
        if self.busiest_share is not None:
            return f"busiest expert gets {self.busiest_share:.1%} of routed tokens"
        if self.shares:
            return f"measured load over {len(self.shares)} experts (busiest {max(self.shares):.1%})"
        return "uniform routing (every expert the same share of tokens)"

    def rank_factor(self, experts: int, degree: int) -> float:
        """The busiest expert-parallel GPU's routed tokens over the mean, with ``experts``
        split over ``degree`` GPUs in contiguous blocks of m = experts / degree. A stated
        busiest share p puts that expert on one GPU with m - 1 others at the mean of the
        rest: e (p + (m - 1)(1 - p)/(E - 1)); measured shares: e times the largest block's
        sum. 1 under uniform routing and on one GPU."""
        if self.uniform or degree == 1:
            return 1.0
        m = experts // degree
        if self.shares:
            if len(self.shares) != experts:
                raise MpsimError(f"the measured expert load lists {len(self.shares)} experts, but the layers have "
                                 f"{experts}")
            return degree * max(sum(self.shares[i:i + m]) for i in range(0, experts, m))
        p = self.busiest_share
        assert p is not None
        if p < 1 / experts:
            raise MpsimError(f"the busiest expert's share {p:.4g} is below the uniform 1/{experts}: give at least "
                             f"{1 / experts:.4g}")
        rest = (m - 1) * (1 - p) / (experts - 1) if experts > 1 else 0.0
        return degree * (p + rest)


UNIFORM = ExpertLoad()


def parse_expert_load(text: str) -> ExpertLoad:
    """``uniform``; a number, the busiest expert's share of routed tokens (0.1 or 10%);
    or a JSON file listing tokens per expert (a list of numbers, or {"tokens": [...]}),
    normalised to shares. One-line ``MpsimError`` otherwise."""
    value = text.strip()
    if value.lower() == "uniform":
        return UNIFORM
    number = value[:-1] if value.endswith("%") else value
    try:
        share = float(number) / (100 if value.endswith("%") else 1)
    except ValueError:
        return _histogram(Path(value))
    if not math.isfinite(share):
        raise MpsimError(f"--expert-load {text!r}: expected a share in (0, 1], a percentage, 'uniform' or a JSON file")
    return ExpertLoad(busiest_share=share)


def _histogram(path: Path) -> ExpertLoad:
    if not path.exists():
        raise MpsimError(f"--expert-load {str(path)!r}: not 'uniform', a share in (0, 1] or a JSON file of tokens "
                         "per expert")
    data = read_data_file(path, "json", "expert load")
    tokens = data.get("tokens") if isinstance(data, dict) else data
    if (not isinstance(tokens, list) or not 2 <= len(tokens) <= MAX_HISTOGRAM_EXPERTS
            or not all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t >= 0
                       for t in tokens) or not sum(tokens)):
        raise MpsimError(f"{path}: expected a list of 2 to {MAX_HISTOGRAM_EXPERTS} token counts per expert, not "
                         "negative, not all zero (or {\"tokens\": [...]})")
    total = float(sum(tokens))
    return ExpertLoad(shares=tuple(t / total for t in tokens))


def moe_experts(trace: Trace) -> int:
    """Routed experts of ``trace``'s MoE layers (one count for all of them); 0 for a dense model."""
    counts = {r.experts for r in trace.layers if r.experts}
    if len(counts) > 1:
        raise MpsimError(f"{trace.name}: MoE layers with different expert counts ({sorted(counts)}) are not "
                         "split over an expert-parallel group")
    return counts.pop() if counts else 0


def check_expert_parallel(trace: Trace, degree: int) -> None:
    """One-line ``MpsimError`` unless ``trace``'s experts split evenly over ``degree`` GPUs."""
    if degree == 1:
        return
    if "expert_parallel" in trace.spec.model:
        raise MpsimError(f"{trace.name} is already one GPU's expert-parallel shard; give the whole model's trace")
    experts = moe_experts(trace)
    if not experts:
        raise MpsimError(f"{trace.name} has no mixture-of-experts layers: expert parallelism (--ep {degree}) "
                         "splits routed experts; use data parallelism for a dense model")
    if experts % degree:
        raise MpsimError(f"{trace.name}: {experts} experts do not split over an expert-parallel degree of {degree}")


def expert_shard(trace: Trace, degree: int, load: ExpertLoad = UNIFORM) -> Trace:
    """One GPU's shard of ``trace`` over an expert-parallel group of ``degree`` (module
    doc), the busiest GPU under ``load``; the trace itself when ``degree`` is 1."""
    if degree == 1:
        return trace
    key = (trace.content_hash, degree, load)
    found = _SHARDS.get(key)
    if found is not None:
        return found
    check_expert_parallel(trace, degree)
    factor = load.rank_factor(moe_experts(trace), degree)
    precision = trace.spec.precision
    per_param = (precision.weight_bytes_per_param, precision.grad_bytes_per_param,
                 precision.optimizer_bytes_per_param)
    rows = [_shard_row(r, degree, factor, per_param) if r.experts else r for r in trace.layers]
    model = dict(trace.spec.model, expert_parallel={"degree": degree, "load_factor": factor,
                                                    "load": load.describe()})
    dropped = sum(r.params - s.params for r, s in zip(trace.layers, rows))
    spec = trace.spec.model_copy(update={"layers": rows, "model": model, "params": trace.spec.params - dropped})
    return _SHARDS.put(key, Trace(spec, trace.source))


def _shard_row(row: LayerRow, degree: int, factor: float, per_param: tuple[int, int, int]) -> LayerRow:
    """``row`` on one GPU of the group: 1/degree of its experts' states, ``factor`` times
    their saved bytes and the all-to-alls' bytes (the busiest GPU's tokens; its time is
    scaled by the engine, ``busiest_times``)."""
    moved = row.expert_params - row.expert_params // degree
    weight, grad, optimizer = (moved * b for b in per_param)
    extra_act = round(row.expert_act_bytes * (factor - 1))
    return row.model_copy(update={
        "params": row.params - moved, "expert_params": row.expert_params - moved, "experts": row.experts // degree,
        "experts_per_token": min(row.experts_per_token, row.experts // degree),
        "param_bytes": max(0, row.param_bytes - weight), "grad_bytes": max(0, row.grad_bytes - grad),
        "optimizer_bytes": max(0, row.optimizer_bytes - optimizer),
        "act_bytes": row.act_bytes + extra_act, "expert_act_bytes": row.expert_act_bytes + extra_act,
        "dispatch_bytes": round(row.dispatch_bytes * factor),
    })


def busiest_times(pass_s: np.ndarray, rows: list[LayerRow], factor: float, backward: bool) -> np.ndarray:
    """``pass_s`` (each row's forward or backward seconds) on the busiest GPU, whose load is
    ``factor`` times the mean: a row's time grows by 1 + (factor - 1) x the experts' share of
    the pass's FLOPs (a dense row's not at all); ``pass_s`` itself under uniform load."""
    if factor == 1.0:
        return pass_s
    shares = [(r.expert_bwd_flops / r.bwd_flops if r.bwd_flops else 0.0) if backward
              else (r.expert_fwd_flops / r.fwd_flops if r.fwd_flops else 0.0) for r in rows]
    return pass_s * (1.0 + (factor - 1.0) * np.asarray(shares))


def shard_info(trace: Trace) -> tuple[int, float]:
    """(degree, load factor) of an expert shard; (1, 1.0) for any other trace."""
    info = trace.spec.model.get("expert_parallel")
    if not isinstance(info, dict):
        return 1, 1.0
    return int(info["degree"]), float(info["load_factor"])



def experts_line(trace: Trace, degree: int, load: ExpertLoad) -> str:
    """What outputs say of a mixture of experts (empty for a dense model): experts and
    top-k, active parameters and the routing assumed (the layout names the split)."""
    experts = moe_experts(trace)
    if not experts:
        return ""
    top_k = max(r.experts_per_token for r in trace.layers)
    factor = load.rank_factor(experts, degree)
    busiest = f"; the busiest of EP x{degree}, simulated, gets {factor:.2f}x the mean" if factor != 1.0 else ""
    return (f"{experts} routed experts, top-{top_k}, {trace.active_params / 1e9:.3g}B of "
            f"{trace.spec.params / 1e9:.3g}B parameters active; {load.describe()}{busiest}{_dropped(trace)}")


def _dropped(trace: Trace) -> str:
    """What a configured capacity factor drops, per MoE layer and microbatch at the trace's
    microbatch (``model.moe.dropped_copies``), in words; "" without a capacity factor."""
    moe = trace.spec.model.get("moe")
    if not isinstance(moe, dict) or moe.get("capacity_factor") is None:
        return ""
    dropped = moe.get("dropped_copies", 0)
    return (f"; capacity factor {moe['capacity_factor']:g}: {dropped:,} routed copies dropped per MoE layer and "
            f"microbatch of {trace.microbatch}")
