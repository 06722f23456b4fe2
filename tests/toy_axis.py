"""A toy mesh axis for tests: ``mirror``, a replicating axis (name part ``mirN``) laid
between the tensor and the data axes. Its GPUs hold the same weights and train different
samples, like data parallelism's, so a stage's gradients are reduced over them too.

It exists to show that a new axis is new code: this module and its registration, no edit
to the engine's components (``tests/test_mesh.py``)."""

from __future__ import annotations

from mpsim.plans.mesh import AxisKind, register_axis

MIRROR = register_axis(AxisKind("mirror", order=30, name_position=10, replicates=True, token="mir", label="MIRROR"))
