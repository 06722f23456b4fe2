"""The ZeRO offload systems MPress compares against (Fig. 8), as strategies: each owns its
ZeRO stage and plans the job's replicas with it.

- ``zero-offload`` (Ren et al. 2021, "ZeRO-Offload"): ZeRO-2 (gradients and optimizer
  states sharded over the replicas); each GPU's optimizer-state shard lives in host
  memory and the Adam step runs on the CPU: the gradient shard goes to the host, the
  updated weights come back (``StagePlan.optimizer`` ``host-update``).
- ``zero-infinity`` (Rajbhandari et al. 2021, "ZeRO-Infinity"): ZeRO-3 with the parameter
  shards offloaded too, each fetched to its GPU before its layer's all-gather, and the
  optimizer states and step on the host as above; in host memory when every replica's
  shards fit there, else on the server's NVMe drives (topology field ``nvme``), whose
  bandwidth the fetches and the optimizer step then share.

Both checkpoint every transformer layer's activations (DeepSpeed's activation
checkpointing, as MPress II-B describes the ZeRO series: "combine both recomputation and
swap"). A job planned as a pure pipeline (one replica) gets the same: ZeRO over one GPU
shards nothing, so what remains is the offload itself.
"""

from __future__ import annotations

from dataclasses import replace

from mpsim.models.trace import RECOMPUTABLE
from mpsim.planners.context import Ctx, Planned
from mpsim.plans.plan import LayerAction


def _with_zero(ctx: Ctx, stage: int) -> Ctx:
    """The context with the job's ZeRO stage raised to ``stage`` (the strategy's own)."""
    par = ctx.job.parallelism
    if par.zero_stage >= stage:
        return ctx
    return replace(ctx, job=ctx.job.but(parallelism=par.model_copy(update={"zero_stage": stage})))


def _on_host(ctx: Ctx) -> dict[int, str]:
    return dict.fromkeys(range(len(ctx.stages)), "host-update")


def _checkpointed(ctx: Ctx) -> dict[int, list[LayerAction]]:
    rows = ctx.trace.layers
    return {s: [LayerAction(layer=j, action="recompute") for j in range(a, b) if rows[j].kind in RECOMPUTABLE]
            for s, (a, b) in enumerate(ctx.stages)}


def plan_zero_offload(ctx: Ctx) -> Planned:
    ctx = _with_zero(ctx, 2)
    plan = ctx.plan("zero-offload", _checkpointed(ctx), optimizer=_on_host(ctx))
    return Planned(plan, ctx.simulate(plan))


def plan_zero_infinity(ctx: Ctx) -> Planned:
    ctx = _with_zero(ctx, 3)
    plan = ctx.plan("zero-infinity", _checkpointed(ctx), optimizer=_on_host(ctx), offload_params=True)
    result = ctx.simulate(plan)
    host_short = result.oom is not None and result.oom["gpu"] == "host"
    if not host_short or ctx.topo.spec.nvme is None:
        return Planned(plan, result)
    on_nvme = ctx.plan("zero-infinity", _checkpointed(ctx), optimizer=_on_host(ctx), offload_params=True,
                       offload_device="nvme")
    return Planned(on_nvme, ctx.simulate(on_nvme), 2)


PLANNERS = {"zero-offload": plan_zero_offload, "zero-infinity": plan_zero_infinity}
