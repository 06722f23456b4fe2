"""The context axis of a mesh: context parallelism (``cp4``, ``CP x4``).

Its GPUs hold the same weights and split every sequence between them: each runs its part of
every token-wise op and its queries' attention over the whole sequence, the keys and values
of the other parts reached by passing blocks around a ring (Liu et al. 2023, Ring
Attention; Megatron-Core's context parallelism), by an all-gather (Llama 3, Dubey et al.
2024, section 3.3.2) or by an all-to-all that turns the split over the sequence into one over
heads (DeepSpeed-Ulysses, Jacobs et al. 2023); ``Parallelism.context_attention`` picks one,
``mpsim.models.context_parallel`` writes what one GPU runs and ``mpsim.sim.context_group``
runs the communication. Each GPU's gradients are partial sums over its tokens, so the axis
joins a stage's gradient reduction (it ``replicates``), but its GPUs share each sample, so
its size does not multiply an iteration's samples (``splits_samples``). It lies between the
tensor and the expert axes, as Megatron-Core orders them (tensor, context, expert, data,
pipeline): a context group stays inside a server when it fits there.
"""

from __future__ import annotations

from mpsim.plans.mesh import AxisKind, register_axis

CONTEXT = register_axis(AxisKind("context", order=20, name_position=17, replicates=True, token="cp", label="CP",
                                 splits_samples=True))
