"""The expert axis of a mesh: expert parallelism (``ep8``, ``EP x8``).

Its GPUs hold the same dense weights and train different samples, so for the dense part
of every layer it is data parallelism (it ``replicates``: its size multiplies an
iteration's samples and its GPUs join a stage's dense gradient reduction); each holds
1/e of every mixture-of-experts layer's routed experts (``mpsim.models.expert_parallel``),
whose gradients are reduced over the data axis only (the expert-data-parallel group),
and the tokens travel between them in all-to-alls (``mpsim.sim.expert_group``). It lies
between the tensor and the data axes, as Megatron-Core orders them (tensor, context,
expert, data, pipeline), so an expert group stays inside a server when it fits there.
"""

from __future__ import annotations

from mpsim.plans.mesh import AxisKind, register_axis

EXPERT = register_axis(AxisKind("expert", order=30, name_position=15, replicates=True, token="ep", label="EP"))
