"""Per-stage memory templates and static allocations of a pipeline stage.

Memory model of one layer j (trace row; ``in``/``out`` its input and output bytes):

forward, at its start: + saved activations other than the input, + output, + workspace;
at its end: - workspace, and - input unless the layer saved it. The last layer's output
on a non-last stage is the boundary buffer, freed when its send lands.

backward (layers in reverse), at its start: + gradient of the input (none for the
embedding, whose input is token ids), + workspace (taken equal to the forward's);
at its end: - workspace, - saved activations (input included if saved), - gradient of
the output. The gradient of the stage's first layer input is the boundary buffer sent
back, freed when its send lands.

Parameters, gradients and optimizer states are allocated once, before the first task
(gradients as persistent buffers, as Megatron-LM and DeepSpeed keep them); PipeDream
adds p - i - 1 stashed weight versions on stage i.
"""

from __future__ import annotations

import numpy as np

from mpsim.sim.memory import CAT, Template
from mpsim.trace import LayerRow


def _template(events: list[tuple[float, int, str, str]]) -> Template:
    return Template(
        offsets_s=np.array([e[0] for e in events], dtype=float),
        deltas=np.array([e[1] for e in events], dtype=np.int64),
        cats=np.array([CAT[e[2]] for e in events], dtype=np.int64),
        labels=tuple(e[3] for e in events),
    )


def forward_template(rows: list[LayerRow], fwd_s: np.ndarray, first: int, is_first_stage: bool,
                     is_last_stage: bool) -> Template:
    """``rows`` are the stage's layers, ``first`` the index of rows[0] in the model."""
    ev: list[tuple[float, int, str, str]] = []
    if is_first_stage:
        ev.append((0.0, rows[0].input_bytes, "buffers", "input tokens"))
    t = 0.0
    last = len(rows) - 1
    for k, r in enumerate(rows):
        name = f"layer {first + k} ({r.name})"
        in_cat = "buffers" if k == 0 else "activations"
        out_cat = "buffers" if (k == last and not is_last_stage) else "activations"
        own = r.act_bytes - (r.input_bytes if r.saves_input else 0)
        ev += [(t, own, "activations", f"{name} saved activations"),
               (t, r.output_bytes, out_cat, f"{name} output"),
               (t, r.workspace_bytes, "workspace", f"{name} workspace")]
        t += float(fwd_s[k])
        ev.append((t, -r.workspace_bytes, "workspace", f"{name} workspace freed"))
        if not r.saves_input:
            ev.append((t, -r.input_bytes, in_cat, f"{name} input freed"))
        if k == last and is_last_stage:
            ev.append((t, -r.output_bytes, out_cat, f"{name} loss freed"))
    return _template(ev)


def backward_template(rows: list[LayerRow], bwd_s: np.ndarray, first: int, is_first_stage: bool,
                      is_last_stage: bool) -> Template:
    ev: list[tuple[float, int, str, str]] = []
    t = 0.0
    last = len(rows) - 1
    for k in range(last, -1, -1):
        r = rows[k]
        name = f"layer {first + k} ({r.name})"
        in_cat = "buffers" if k == 0 else "activations"
        grad_out_cat = "buffers" if (k == last and not is_last_stage) else "activations"
        grad_out = 0 if (k == last and is_last_stage) else r.output_bytes
        grad_in = 0 if r.kind == "embedding" else r.input_bytes
        grad_in_cat = "buffers" if (k == 0 and not is_first_stage) else "activations"
        own = r.act_bytes - (r.input_bytes if r.saves_input else 0)
        ev += [(t, grad_in, grad_in_cat, f"{name} input gradient"),
               (t, r.workspace_bytes, "workspace", f"{name} backward workspace")]
        t += float(bwd_s[k])
        ev += [(t, -r.workspace_bytes, "workspace", f"{name} backward workspace freed"),
               (t, -own, "activations", f"{name} saved activations freed")]
        if r.saves_input:
            ev.append((t, -r.input_bytes, in_cat, f"{name} saved input freed"))
        ev.append((t, -grad_out, grad_out_cat, f"{name} output gradient freed"))
        if k == 0 and is_first_stage and grad_in:
            ev.append((t, -grad_in, grad_in_cat, f"{name} input gradient freed"))
    return _template(ev)


def static_bytes(rows: list[LayerRow], weight_versions: int) -> dict[str, int]:
    params = sum(r.param_bytes for r in rows)
    return {
        "params": params,
        "grads": sum(r.grad_bytes for r in rows),
        "optimizer": sum(r.optimizer_bytes for r in rows),
        "stash": (weight_versions - 1) * params,
    }


def update_seconds(rows: list[LayerRow], memory_rate: float) -> float:
    """Adam step, memory bound: read gradients, read and write master weights and moments,
    write the working weights."""
    n_bytes = sum(r.grad_bytes + 2 * r.optimizer_bytes + r.param_bytes for r in rows)
    return n_bytes / memory_rate
