"""``offload-activations``: per-layer activation offloading to host memory as training
frameworks run it for long sequences (issue 49, item 4).

What it follows:

- Megatron-Core's CPU offloading (``--cpu-offloading --cpu-offloading-num-layers N
  --cpu-offloading-activations``; ``TransformerConfig.cpu_offloading_num_layers``, 0 to
  ``num_layers - 1``): the saved activations of the first N transformer layers go to pinned
  host memory during the forward, each copy on a side stream beside the next layer's
  compute, and each comes back ahead of its layer's backward, one layer ahead (the reload of
  layer j - 1 is issued as layer j's backward starts). The last layer is never offloaded:
  its backward follows its forward at once, so its copy would only cost.
- PyTorch's saved-tensor hooks (``torch.autograd.graph.save_on_cpu(pin_memory=True)``, and
  the activation offloading torchtitan and torchtune build on them): every tensor autograd
  saves inside the wrapped layers is packed to pinned host memory and unpacked back before
  the backward that reads it.

Unlike ``host-swap`` (MPress's baseline made to overlap: it picks what to swap, longest live
interval first, optimizer states and stashed weights included, until each GPU fits), this
is a fixed recipe: it offloads its layers whether the job needs it or not, never the
optimizer states, the embedding or the head, and does not search. The plan is one
simulation.

Per stage (``Ctx.stages``; a pipeline stage, or a chunk of interleaved 1F1B), the layers
offloaded are the first ``layers`` of the stage's transformer layers (blocks of a
``--module`` trace, ``trace.RECOMPUTABLE``) that save anything, in forward order; the
default is all of them but the last, as Megatron-Core's ``num_layers - 1``. The
registered strategy runs the default; ``plan_offload_activations(ctx, layers=N)`` takes
another count from Python (the job has no per-strategy option). Megatron-Core refuses
pipeline parallelism with CPU offloading (it needs ``pipeline_model_parallel_size`` 1);
PyTorch's hooks work per stage, and so does this planner.

Each offloaded layer gets the engine's ``host`` action with ``prefetch`` timing
(``mpsim.plans.plan``): the swap-out starts as the layer's forward ends and runs on the
GPU's device-to-host copy engine beside the following compute; the swap-in is started so
that, alone on its route, it lands when the layer's backward needs it, and its memory is
taken only when it starts. For a copy no longer than the next layer's backward that is the
frameworks' one-layer-ahead prefetch; a longer one the engine starts earlier than a
framework would (the copy engine still runs them one at a time, so the backward still
waits for PCIe, as it does in the framework). What the engine cannot say is the
framework's own bookkeeping: its pinned staging buffers and the double buffer of
Megatron-Core's group handler are not counted.

``best`` does not try it (``Strategy.in_best`` False): it adds no action of its own (``host``
copies, prefetched, are ``host-swap``'s, which searches them and moves only what must go),
it offloads where nothing needs to and so is rarely the fastest plan that fits, and trying
it would add a simulation under each partition to every job of ``best``, ``fits`` and
``choose``.

When it does not fit the simulation says so as for every other planner: a GPU that still
runs out (``SimResult.oom`` names it) or host memory too small for what is offloaded (the
out-of-memory on ``"host"``).
"""

from __future__ import annotations

from mpsim.errors import MpsimError
from mpsim.models.trace import RECOMPUTABLE, Trace
from mpsim.planners.context import Ctx, Planned
from mpsim.plans.plan import LayerAction

STRATEGY = "offload-activations"


def offloaded_layers(trace: Trace, stage: tuple[int, int], layers: int | None = None) -> list[int]:
    """The layers of ``stage`` (first, one past the last) whose saved activations go to the
    host: the first ``layers`` of its transformer layers (module blocks) that save anything,
    in forward order; ``None``: all of them but the last (Megatron-Core's ``num_layers - 1``).
    A count beyond what the stage has takes them all, the last included."""
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 0):
        raise MpsimError(f"layers to offload must be a whole number >= 0, got {layers!r}")
    a, b = stage
    rows = trace.layers
    candidates = [j for j in range(a, b) if rows[j].kind in RECOMPUTABLE and rows[j].act_bytes > 0]
    if layers is None:
        return candidates[:-1]
    return candidates[:layers]


def offload_actions(ctx: Ctx, layers: int | None = None) -> dict[int, list[LayerAction]]:
    """Per stage, a ``host`` action on each of its ``offloaded_layers``."""
    return {s: [LayerAction(layer=j, action="host") for j in offloaded_layers(ctx.trace, stage, layers)]
            for s, stage in enumerate(ctx.stages)}


def plan_offload_activations(ctx: Ctx, layers: int | None = None) -> Planned:
    """The job with every stage's transformer layers but the last (or its first ``layers``)
    offloaded to host memory, overlapped and prefetched; one simulation."""
    plan = ctx.plan(STRATEGY, offload_actions(ctx, layers), swap_timing="prefetch")
    return Planned(plan, ctx.simulate(plan))
