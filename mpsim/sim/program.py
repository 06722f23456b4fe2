"""A stage's program: its forward and backward cut into pieces, with the plan's actions.

Memory model of one layer j (trace row; ``in``/``out`` its input and output bytes, ``own``
its saved activations other than its input):

forward, at its start: + own, + out, + workspace; at its end: - workspace, and - in
unless the layer holds it (it saves it, or it is the recompute checkpoint). The last
layer's output on a non-last stage is the boundary buffer, freed when its send lands.

backward (layers in reverse), at its start: + gradient of the input (none for the
embedding, whose input is token ids), + backward workspace (measured traces have it,
otherwise taken equal to the forward's); at its
end: - workspace, - own, - in if held, - gradient of the output. The gradient of the
stage's first layer input is the boundary buffer sent back, freed when its send lands.

Actions (``mpsim.plans.plan``):

- recompute: own is freed at the end of the forward; before the backward the forward is
  re-run on the compute stream (+ own, + out, + workspace at its start; - workspace,
  - out at its end), so the cost is exactly the forward time. The layer keeps its input
  as checkpoint. With segments (``PlanFile.recompute_checkpoints = "segment"``: Chen et
  al. 2016 section 3; GPipe's re-materialization of a stage), consecutive recomputed
  layers keep only the first one's input: the others drop theirs at the end of their
  forward, and before the backward of the last one the whole run is re-run in order,
  each re-run output kept as the next layer's input until that layer's backward ends;
- selective (Korthikanti et al. 2022, section 4.2): only the attention core's kept bytes
  (``attention_core_bytes``, at most own) are freed at the end of the forward; before the
  backward the core's forward re-runs on the compute stream (+ those bytes at its start,
  for ``mpsim.timing.costs.attention_core_seconds``), and the backward frees them with the rest of own. The
  core's transient tensors while it re-runs are not modelled (they are its kept ones);
- host / peer swap: after the forward a swap-out of own (+ in when saved) starts; it frees
  them when it lands (``mpsim.sim.engine``). The backward's piece for the layer starts
  only once the swap-in has landed;
- split into p micro-ops (TSPLIT III-A): each micro-op allocates 1/p of own, out and
  workspace at its start and releases 1/p of what the layer lets go (workspace, an input
  it does not hold, own when recomputed, the core's bytes under selective) at its end,
  and each swapped micro-tensor leaves as soon as its micro-op is done. The transient
  peak of a layer that releases its input falls from in + out to max(in, out) +
  min(in, out) / p, by (p - 1) / p x min(in, out) (TSPLIT equation 5). The layer's
  times are multiplied by the split slowdown.

A forward is cut after every micro-op that swaps, a backward before every layer whose
swap-in it must wait for; each piece is one simulation event with a memory template.
Parameters, gradients and optimizer states are allocated once, before the first task;
PipeDream adds p - i - 1 stashed weight versions on stage i.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from mpsim.models.trace import Collective, LayerRow
from mpsim.plans.plan import LayerAction
from mpsim.sim.memory import Template, make_template

_KEEP = LayerAction(layer=-1)
_REMAT = ("recompute", "selective")
"""Actions that drop saved bytes after the forward and re-run (part of) it before the backward."""
Event = tuple[float, int, str, str]


def chunk(n_bytes: int, c: int, p: int) -> int:
    """Bytes of micro-tensor ``c`` of ``p``: sizes differ by at most one and sum to ``n_bytes``."""
    return n_bytes * (c + 1) // p - n_bytes * c // p


@dataclass(frozen=True)
class SwapOut:
    """A micro-tensor leaving the GPU when the piece before it ends."""

    layer: int
    own_bytes: int
    input_bytes: int
    input_cat: str
    target: str
    """``host`` or ``peer``."""


@dataclass(frozen=True)
class SwapIn:
    """What a swapped layer brings back before its backward."""

    layer: int
    own_bytes: int
    input_bytes: int
    input_cat: str
    target: str
    peers: tuple[tuple[int, float], ...]
    chunks: int
    need_offset_s: float
    """When the backward needs it, from the start of the backward task (no waits)."""

    @property
    def n_bytes(self) -> int:
        return self.own_bytes + self.input_bytes


@dataclass(frozen=True)
class Sharding:
    """How a stage's model states are split over its data-parallel group (ZeRO, Rajbhandari
    et al. 2020, section 5): ``replicas`` GPUs, ``zero_stage`` 0 (DDP) to 3 (FSDP)."""

    replicas: int = 1
    zero_stage: int = 0
    reshard_after_forward: bool = True
    offload_params: bool = False
    """ZeRO-Infinity: the shards live off the GPU, each fetched before its layer's gather."""
    offload_grads: bool = False
    """ZeRO-Offload and ZeRO-Infinity (stage 2 and 3 with the optimizer on the host): each
    reduced gradient shard goes to host memory, none stays on the GPU."""
    expert_replicas: int = 0
    """With expert parallelism, GPUs the routed experts' states are split over (the
    expert-data-parallel group); 0: the same as ``replicas``."""

    @property
    def per_layer(self) -> bool:
        """ZeRO-3 gathers each layer's parameters before its forward and its backward."""
        return self.zero_stage == 3

    def shard(self, n_bytes: int) -> int:
        """This GPU's part of ``n_bytes`` split over the group (rounded up, as FSDP pads)."""
        return -(-n_bytes // self.replicas)

    def optimizer_share(self, row: LayerRow) -> int:
        """This GPU's part of ``row``'s optimizer states under ZeRO-1 and up: the dense part
        over ``replicas``, the routed experts' (their share of the parameters) over
        ``expert_replicas``; all of them without ZeRO."""
        if self.zero_stage == 0:
            return row.optimizer_bytes
        expert = row.expert_part(row.optimizer_bytes)
        return self.shard(row.optimizer_bytes - expert) + -(-expert // (self.expert_replicas or self.replicas))

    def gathered(self, row: LayerRow) -> int:
        """Bytes a ZeRO-3 layer's parameters add while gathered: the whole layer, since the
        all-gather writes into a buffer of its own beside the shard, which stays (FSDP2's
        unsharded parameters, DeepSpeed's full tensor beside ``ds_tensor``; measured: one
        H100, FSDP2 over one GPU, validate/results/h100_dp/); on one GPU too, where the
        copy into that buffer is all the gather does."""
        if not self.per_layer:
            return 0
        return row.param_bytes


NOT_SHARDED = Sharding()


CONTEXT_PREFIX = "context/"
"""How a piece's collective names the context group as its owner (``op_key``)."""


def op_key(collective: Collective) -> str:
    """The (op) a piece carries for ``collective``: ``context/send-recv/3`` (op and ring
    steps) for the context group's, the op itself for the tensor group's."""
    if collective.axis != "context":
        return collective.op
    return f"{CONTEXT_PREFIX}{collective.op}/{collective.steps}"


def is_ring_step(op: str) -> bool:
    """Whether a piece's op is a ring attention's sends (run beside the attention)."""
    return op.startswith(f"{CONTEXT_PREFIX}send-recv/")


@dataclass(frozen=True)
class Piece:
    template: Template
    duration_s: float
    swap_out: SwapOut | None = None
    wait_for: int | None = None
    """Layer whose swap-in must have landed before this piece starts."""
    layer: int | None = None
    """Under ZeRO-3, the layer whose (re-)computation the piece starts: its gathered
    parameters must have landed first."""
    grads_done: tuple[tuple[float, int], ...] = ()
    """With data parallelism, (offset from the piece's start, layer) of every layer whose
    backward ends in the piece: its gradients are ready to reduce."""
    collectives: tuple[tuple[str, int], ...] = ()
    """With tensor parallelism, the (op, bytes) the piece's layers run over the stage's
    tensor-parallel group once its compute is done, on the critical path (the trace's
    ``fwd_collectives``/``bwd_collectives``; a recomputed layer's forward ones again
    before its backward's); with expert parallelism, its MoE layers' all-to-alls over the
    expert-parallel group (``build_program``)."""
    overlap_s: float = 0.0
    """Under a runtime that overlaps tensor-parallel communication with GEMMs
    (``mpsim.timing.runtime``): the seconds of the piece's GEMMs, at its end, that its
    collectives run beside; 0: they run after its compute."""


@dataclass
class StageProgram:
    forward: list[Piece]
    backward: list[Piece]
    swap_ins: list[SwapIn]
    """In the order the backward needs them."""
    forward_s: float
    backward_s: float
    recompute_s: float
    """Recompute time per backward task."""
    selective_s: float
    """Selective (attention core) recompute time per backward task."""
    split_forward_s: float
    """Extra time of split micro-ops per forward task."""
    split_backward_s: float
    """Extra time of split micro-ops (recompute included) per backward task."""
    actions: dict[int, LayerAction] = field(default_factory=dict)
    forward_climbs: list[tuple[int, int, int]] = field(init=False)
    """Per forward piece, the task's climb ahead while it runs and after (``climbs``)."""
    backward_climbs: list[tuple[int, int, int]] = field(init=False)

    def __post_init__(self) -> None:
        self.forward_climbs = climbs(self.forward)
        self.backward_climbs = climbs(self.backward)


def climbs(pieces: list[Piece]) -> list[tuple[int, int, int]]:
    """Per piece of a task, how far above its level the task will still climb: before
    the piece starts (it may wait for a swap-in), while it runs (its highest point held)
    and once it has ended (its net kept). A prefetch that does not leave that much room
    would take what the task allocates next (TSPLIT eq. 3: the swapped-in tensor must fit
    at every point until its use)."""
    out: list[tuple[int, int, int]] = []
    level = 0
    levels, peaks = [], []
    for piece in pieces:
        levels.append(level)
        peaks.append(level + piece.template.peak_bytes)
        level += piece.template.net_bytes
    levels.append(level)
    for i in range(len(pieces)):
        ahead = max(peaks[i + 1:], default=levels[-1])
        out.append((max(0, max(ahead, peaks[i]) - levels[i]), max(0, ahead - peaks[i]), max(0, ahead - levels[i + 1])))
    return out


def _template(events: list[Event], start_s: float) -> Template:
    """A piece's template: events in absolute task time, made relative to the piece."""
    return make_template([(t - start_s, d, c, lbl) for (t, d, c, lbl) in events])


@dataclass(frozen=True)
class _Layer:
    """What the forward and the backward both need of one stage layer."""

    row: LayerRow
    k: int
    """Index within the stage."""
    j: int
    """Index in the model."""
    act: LayerAction
    p: int
    """Micro-ops it runs as."""
    slowdown: float
    name: str
    input_cat: str
    own: int
    """Saved activations other than its input."""
    dropped: int
    """Bytes dropped after the forward and re-made before the backward: own under
    recompute, the attention core's kept bytes (at most own) under selective, else 0."""

    @property
    def remat(self) -> bool:
        return self.act.action in _REMAT

    @property
    def ledger(self) -> str:
        """The ledger category of what it drops."""
        return f"saved:{self.act.action}"

    def chunks(self, n_bytes: int, c: int) -> int:
        return chunk(n_bytes, c, self.p)


def _layer(rows: list[LayerRow], k: int, first: int, actions: dict[int, LayerAction]) -> _Layer:
    r = rows[k]
    act = actions.get(first + k, _KEEP)
    own = r.own_bytes
    dropped = {"recompute": own, "selective": min(own, r.attention_core_bytes)}.get(act.action, 0)
    return _Layer(r, k, first + k, act, act.split, act.slowdown(), f"layer {first + k} ({r.name})",
                  "buffers" if k == 0 else "activations", own, dropped)


def received_bytes(rows: list[LayerRow], is_first_stage: bool, is_last_stage: bool) -> int:
    """Bytes a stage receives per microbatch: its input activation and its output gradient."""
    return (0 if is_first_stage else rows[0].input_bytes) + (0 if is_last_stage else rows[-1].output_bytes)


@dataclass(frozen=True)
class _StageRows:
    rows: list[LayerRow]
    first: int
    is_first: bool
    is_last: bool
    actions: dict[int, LayerAction]
    keep_input: bool
    """The received activation lives in a preallocated buffer (never freed)."""
    keep_grad: bool
    """The received gradient lives in a preallocated buffer (never freed)."""
    segments: bool = False
    """Consecutive recomputed layers share one checkpoint (``build_program``)."""
    sharding: Sharding | None = None
    """Data parallelism (``Sharding``); None: one GPU, no gradient hand-off."""
    tensor_parallel: bool = False
    """The rows are a tensor-parallel shard's: every layer is a piece of its own, followed
    by its collectives."""
    expert_parallel: bool = False
    """The rows are an expert-parallel shard's: every layer is a piece of its own, an MoE
    layer's followed by its all-to-alls (dispatch and combine)."""

    @property
    def per_layer(self) -> bool:
        return self.sharding is not None and self.sharding.per_layer

    @property
    def cut_every_layer(self) -> bool:
        return self.per_layer or self.tensor_parallel or self.expert_parallel

    @property
    def last(self) -> int:
        return len(self.rows) - 1

    def _whole_recompute(self, k: int) -> bool:
        act = self.actions.get(self.first + k)
        return act is not None and act.action == "recompute" and act.split == 1

    def follows(self, k: int) -> bool:
        """Whether layer k is recomputed in a segment after its predecessor (it keeps no
        checkpoint of its own)."""
        return self.segments and 0 < k <= self.last and self._whole_recompute(k) and self._whole_recompute(k - 1)

    def segment_start(self, k: int) -> int:
        while self.follows(k):
            k -= 1
        return k

    def layer(self, k: int) -> _Layer:
        return _layer(self.rows, k, self.first, self.actions)


def build_program(rows: list[LayerRow], fwd_s: np.ndarray, bwd_s: np.ndarray, first: int, is_first_stage: bool,
                  is_last_stage: bool, actions: dict[int, LayerAction], keep_received: bool = False,
                  core_s: np.ndarray | None = None, segments: bool = False,
                  sharding: Sharding | None = None, tensor_parallel: bool = False,
                  overlap: tuple[np.ndarray, np.ndarray] | None = None, expert_parallel: bool = False) -> StageProgram:
    """``rows`` are the stage's layers, ``first`` the index of rows[0] in the model,
    ``actions`` keyed by model layer index (missing: keep). With ``keep_received`` the
    received activation (input of the first layer) and gradient (of the last layer's
    output) live in receive buffers allocated once per microbatch, so they are never freed.
    ``core_s``: per layer, the attention core's forward seconds (``CostModel.attention_core_s``;
    needed only by selective recompute, else zeros). ``segments``: consecutive recomputed
    layers share the first one's checkpoint and re-run together (module doc). ``sharding``:
    the data-parallel group's (None: one GPU), see ``Sharding`` and the module doc.
    ``tensor_parallel``: the rows are a tensor-parallel shard's (``Piece.collectives``);
    ``overlap``: per layer, the forward's and the backward's GEMM seconds that its
    collectives hide behind (``Piece.overlap_s``; None: no overlap). ``expert_parallel``: the
    rows are an expert-parallel shard's, each MoE layer's dispatch and combine all-to-alls
    (``LayerRow.dispatch_bytes`` each) on the critical path after its pass, in the backward
    after a recomputed layer's forward ones (``Piece.collectives``, op ``all-to-all``)."""
    st = _StageRows(rows, first, is_first_stage, is_last_stage, actions, keep_received and not is_first_stage,
                    keep_received and not is_last_stage, segments, sharding, tensor_parallel, expert_parallel)
    forward, forward_s, split_forward_s, forward_ends = _forward(st, fwd_s)
    redo_s = {"recompute": fwd_s, "selective": np.zeros(len(rows)) if core_s is None else core_s}
    backward, swap_ins, backward_s, remat_s, split_backward_s, ends = _backward(st, redo_s, bwd_s)
    if tensor_parallel or expert_parallel:
        forward = _with_collectives(forward, _layer_collectives(st, forward_ends, False, overlap))
        backward = _with_collectives(backward, _layer_collectives(st, ends, True, overlap))
    return StageProgram(forward, backward, swap_ins, forward_s, backward_s, remat_s["recompute"],
                        remat_s["selective"], split_forward_s, split_backward_s, dict(actions))


# ---- forward ---------------------------------------------------------------------------
def _forward(st: _StageRows, fwd_s: np.ndarray) -> tuple[list[Piece], float, float, list[tuple[float, int]]]:
    """The forward's pieces, its length, the extra time of its split micro-ops, and (end
    time, layer) of each layer's forward in order."""
    ev: list[Event] = []
    cuts: list[tuple[int, float, SwapOut | None, int | None]] = []
    ends: list[tuple[float, int]] = []
    if st.is_first:
        ev.append((0.0, st.rows[0].input_bytes, "buffers", "input tokens"))
    t = split_s = 0.0
    for k in range(len(st.rows)):
        lay = st.layer(k)
        if st.cut_every_layer and k:  # ZeRO-3: a layer's forward starts once its parameters are gathered
            cuts.append((len(ev), t, None, lay.j if st.per_layer else None))
        dur = float(fwd_s[k]) * lay.slowdown
        split_s += dur - float(fwd_s[k])
        _forward_layer(st, lay, t, dur, ev, cuts)
        t += dur
        ends.append((t, lay.j))
        if st.per_layer and st.sharding is not None and st.sharding.reshard_after_forward:
            n = st.sharding.gathered(lay.row)
            ev.append((t, -n, "params", f"{lay.name} parameters resharded after the forward"))
        if k == st.last and st.is_last:
            ev.append((t, -lay.row.output_bytes, "activations", f"{lay.name} loss freed"))
    forward: list[Piece] = []
    i0, start = 0, 0.0
    layer = st.first if st.per_layer else None
    for i1, c1, swap, next_layer in cuts:
        forward.append(Piece(_template(ev[i0:i1], start), c1 - start, swap, layer=layer))
        i0, start, layer = i1, c1, next_layer
    if i0 < len(ev) or t > start or not forward:
        forward.append(Piece(_template(ev[i0:], start), t - start, layer=layer))
    return forward, t, split_s, ends


def _forward_layer(st: _StageRows, lay: _Layer, t: float, dur: float, ev: list[Event],
                   cuts: list[tuple[int, float, SwapOut | None, int | None]]) -> None:
    """Events of one layer's forward from ``t``; a swapped micro-tensor cuts the piece."""
    r, act, p, name = lay.row, lay.act, lay.p, lay.name
    out_cat = "buffers" if (lay.k == st.last and not st.is_last) else "activations"
    follower = st.follows(lay.k)
    releases_input = not r.saves_input and (act.action != "recompute" or follower)
    if p > 1:  # what the unsplit op would hold, minus what the split one holds
        ev.append((t, lay.own + r.output_bytes + r.workspace_bytes, "saved:split", f"{name} split"))
        rel = r.workspace_bytes + (r.input_bytes if releases_input else 0) + lay.dropped
        ev.append((t + dur, -rel, "saved:split", f"{name} split"))
    dt = dur / p
    for c in range(p):
        c0, c1 = t + c * dt, t + (c + 1) * dt
        o, out_c, ws = lay.chunks(lay.own, c), lay.chunks(r.output_bytes, c), lay.chunks(r.workspace_bytes, c)
        part = f" (micro-op {c + 1}/{p})" if p > 1 else ""
        ev += [(c0, o, "activations", f"{name} saved activations{part}"),
               (c0, out_c, out_cat, f"{name} output{part}"),
               (c0, ws, "workspace", f"{name} workspace{part}"),
               (c1, -ws, "workspace", f"{name} workspace freed{part}")]
        if p > 1:
            ev += [(c0, -(o + out_c + ws), "saved:split", f"{name} split"), (c1, ws, "saved:split", f"{name} split")]
        inp_c = lay.chunks(r.input_bytes, c)
        if releases_input and not (lay.k == 0 and st.keep_input):
            ev.append((c1, -inp_c, lay.input_cat, f"{name} input freed{part}"))
            if p > 1:
                ev.append((c1, inp_c, "saved:split", f"{name} split"))
        if lay.remat:
            d = lay.chunks(lay.dropped, c)
            ev += [(c1, -d, "activations", f"{name} saved activations dropped ({act.action}){part}"),
                   (c1, d, lay.ledger, f"{name} dropped")]
            if p > 1:
                ev.append((c1, d, "saved:split", f"{name} split"))
        if act.action in ("host", "peer"):
            cuts.append((len(ev), c1, SwapOut(lay.j, o, inp_c if r.saves_input else 0, lay.input_cat, act.action),
                         None))
    if act.action == "recompute" and not r.saves_input and not follower:  # the checkpoint outlives the layer
        ev.append((t + dur, -r.input_bytes, "saved:recompute", f"{name} input kept as checkpoint"))
    if follower and r.saves_input:  # the segment's first layer keeps the only checkpoint
        ev += [(t + dur, -r.input_bytes, "activations", f"{name} saved input dropped (recompute segment)"),
               (t + dur, r.input_bytes, "saved:recompute", f"{name} dropped")]


# ---- backward --------------------------------------------------------------------------
def _backward(st: _StageRows, redo_s: dict[str, np.ndarray], bwd_s: np.ndarray
              ) -> tuple[list[Piece], list[SwapIn], float, dict[str, float], float, list[tuple[float, int]]]:
    """The backward's pieces (cut before every layer whose swap-in it waits for, and under
    ZeRO-3 before every layer), its swap-ins, length, re-run time per action in
    ``redo_s`` (the seconds each re-runs per layer), extra time of split micro-ops, and
    (end time, layer) of each layer's backward in order."""
    ev: list[Event] = []
    cuts: list[tuple[int, float, int | None, int | None]] = []
    grads_done: list[tuple[float, int]] = []
    swap_ins: list[SwapIn] = []
    remat_s = dict.fromkeys(_REMAT, 0.0)
    t = split_s = 0.0
    for k in range(st.last, -1, -1):
        lay = st.layer(k)
        swapped = lay.act.action in ("host", "peer")
        if swapped or st.cut_every_layer:
            cuts.append((len(ev), t, lay.j if swapped else None, lay.j if st.per_layer else None))
        if swapped:
            swap_ins.append(SwapIn(lay.j, lay.own, lay.row.input_bytes if lay.row.saves_input else 0, lay.input_cat,
                                   lay.act.action, tuple((x.gpu, x.fraction) for x in lay.act.peers), lay.p, t))
        t, extra_s = _remat_before(st, lay, k, redo_s, t, ev, remat_s)
        split_s += extra_s
        dur = float(bwd_s[k]) * lay.slowdown
        split_s += dur - float(bwd_s[k])
        _gradient_events(st, lay, t, dur, ev)
        _backward_layer(st, lay, t, dur, ev)
        t += dur
        grads_done.append((t, lay.j))
    return _backward_pieces(st, ev, cuts, grads_done, t), swap_ins, t, remat_s, split_s, grads_done


def _remat_before(st: _StageRows, lay: _Layer, k: int, redo_s: dict[str, np.ndarray], t: float, ev: list[Event],
                  remat_s: dict[str, float]) -> tuple[float, float]:
    """The re-run before layer k's backward (a whole recompute segment before its last
    layer's), from ``t``; returns the time after it and the extra time of its split."""
    if st.follows(k) or st.follows(k + 1):  # in a recompute segment (never split)
        if not st.follows(k + 1):  # the segment's last layer: re-run the whole segment first
            dur = _recompute_segment(st, range(st.segment_start(k), k + 1), redo_s["recompute"], t, ev)
            remat_s["recompute"] += dur
            t += dur
        return t, 0.0
    if not lay.remat:
        return t, 0.0
    base = float(redo_s[lay.act.action][k])
    dur = base * lay.slowdown
    remat_s[lay.act.action] += dur
    _recompute_layer(lay, t, dur, ev)
    return t + dur, dur - base


def _gradient_events(st: _StageRows, lay: _Layer, t: float, dur: float, ev: list[Event]) -> None:
    """ZeRO-2/3: the layer's full gradient exists from its backward's start until its
    reduce-scatter lands (``DataParallel`` frees it); ZeRO-3 reshards the layer's
    gathered parameters when its backward ends (all stay gathered until the iteration's
    last backward when ``reshard_after_forward`` is off)."""
    sh = st.sharding
    if sh is None:
        return
    if sh.zero_stage >= 2:
        ev.append((t, lay.row.grad_bytes, "grads", f"{lay.name} full gradient"))
    if sh.per_layer and sh.reshard_after_forward:
        ev.append((t + dur, -sh.gathered(lay.row), "params", f"{lay.name} parameters resharded after the backward"))


def _backward_pieces(st: _StageRows, ev: list[Event], cuts: list[tuple[int, float, int | None, int | None]],
                     grads_done: list[tuple[float, int]], end_s: float) -> list[Piece]:
    """The backward cut at ``cuts`` (event index, time, swap-in waited for, layer
    gathered first); with data parallelism each piece lists the layers whose backward
    ends in it."""
    bounds: list[tuple[int, float, int | None, int | None]] = []
    i0, start, wait_for, layer = 0, 0.0, None, None
    for i1, c_t, c_wait, c_layer in cuts:
        if i1 > i0 or c_t > start or wait_for is not None or layer is not None:
            bounds.append((i0, start, wait_for, layer))
        i0, start, wait_for, layer = i1, c_t, c_wait, c_layer
    bounds.append((i0, start, wait_for, layer))
    pieces = []
    k = 0  # grads_done is in time order: each piece takes the ends up to its own, one pass in all
    for n, (i0, start, wait_for, layer) in enumerate(bounds):
        i1, end = (bounds[n + 1][0], bounds[n + 1][1]) if n + 1 < len(bounds) else (len(ev), end_s)
        done: list[tuple[float, int]] = []
        while st.sharding is not None and k < len(grads_done) and grads_done[k][0] <= end:
            done.append((grads_done[k][0] - start, grads_done[k][1]))
            k += 1
        pieces.append(Piece(_template(ev[i0:i1], start), end - start, wait_for=wait_for, layer=layer,
                            grads_done=tuple(done)))
    return pieces


_LayerComm = tuple[float, list[tuple[str, int]], float]
"""(end time, collectives, GEMM seconds they may hide behind) of one layer's pass."""


def _layer_collectives(st: _StageRows, ends: list[tuple[float, int]], backward: bool,
                       overlap: tuple[np.ndarray, np.ndarray] | None) -> list[_LayerComm]:
    """(end time, collectives, overlap seconds) of each layer in ``ends`` (``_forward``'s or
    ``_backward``'s): its forward's, or in the backward a fully recomputed layer's forward
    ones (its re-run) and then its backward's; with ``overlap``, the GEMM seconds of the
    same passes."""
    out: list[_LayerComm] = []
    for t, j in ends:
        k = j - st.first
        row, act = st.rows[k], st.actions.get(j)
        redone = backward and act is not None and act.action == "recompute"
        run = (*(row.fwd_collectives if redone else []), *row.bwd_collectives) if backward else row.fwd_collectives
        comm: list[tuple[str, int]] = [(op_key(c), c.n_bytes) for c in run]
        if st.expert_parallel and row.dispatch_bytes:  # dispatch and combine, again for a recomputed forward
            comm += [("all-to-all", row.dispatch_bytes)] * (2 + (2 if redone else 0) if backward else 2)
        gemm_s = 0.0
        if overlap is not None:
            fwd_gemm_s, bwd_gemm_s = float(overlap[0][k]), float(overlap[1][k])
            gemm_s = (bwd_gemm_s + (fwd_gemm_s if redone else 0.0)) if backward else fwd_gemm_s
        out.append((t, comm, gemm_s))
    return out


def _with_collectives(pieces: list[Piece], ends: list[_LayerComm]) -> list[Piece]:
    """Each layer's collectives on the piece its compute ends in (the first piece that
    ends at or after it: pieces are cut at every layer), with the GEMM seconds they hide
    behind (at most the piece's own length)."""
    per_piece: list[list[tuple[str, int]]] = [[] for _ in pieces]
    hidden_s = [0.0] * len(pieces)
    i, end = 0, pieces[0].duration_s
    for t, collectives, gemm_s in ends:
        while end < t * (1 - 1e-12) and i < len(pieces) - 1:
            i += 1
            end += pieces[i].duration_s
        per_piece[i] += collectives
        hidden_s[i] += gemm_s
    return [replace(p, collectives=tuple(c), overlap_s=min(h, p.duration_s)) if c else p
            for p, c, h in zip(pieces, per_piece, hidden_s)]


def _recompute_layer(lay: _Layer, t: float, dur: float, ev: list[Event]) -> None:
    """The re-run before the backward, for ``dur``: the whole forward (recompute: its
    dropped activations, output and workspace) or the attention core alone (selective:
    its dropped bytes; Korthikanti et al. 2022, section 4.2)."""
    r, name, dt = lay.row, lay.name, dur / lay.p
    full = lay.act.action == "recompute"
    what = "recomputed activations" if full else "recomputed attention core"
    for c in range(lay.p):
        c0, c1 = t + c * dt, t + (c + 1) * dt
        o = lay.chunks(lay.dropped, c)
        ev += [(c0, o, "activations", f"{name} {what}"), (c0, -o, lay.ledger, f"{name} recomputed")]
        if full:
            out_c, ws = lay.chunks(r.output_bytes, c), lay.chunks(r.workspace_bytes, c)
            ev += [(c0, out_c, "workspace", f"{name} recomputed output"),
                   (c0, ws, "workspace", f"{name} recompute workspace"),
                   (c1, -ws - out_c, "workspace", f"{name} recompute workspace freed")]


def _recompute_segment(st: _StageRows, members: range, fwd_s: np.ndarray, t: float, ev: list[Event]) -> float:
    """The re-run of a recompute segment before its last layer's backward, from ``t``:
    each member's forward in order (its dropped activations, its workspace), each output
    but the last kept as the next member's input until that member's backward frees it
    (while held it is memory a kept run would not hold, or would hold as the next layer's
    saved input: the ledger follows). Returns the re-run's length."""
    start = t
    for k in members:
        lay = st.layer(k)
        r, name, d = lay.row, lay.name, float(fwd_s[k])
        ev += [(t, lay.dropped, "activations", f"{name} recomputed activations"),
               (t, -lay.dropped, lay.ledger, f"{name} recomputed"),
               (t, r.workspace_bytes, "workspace", f"{name} recompute workspace"),
               (t + d, -r.workspace_bytes, "workspace", f"{name} recompute workspace freed")]
        if k < members[-1]:
            nxt = st.rows[k + 1].input_bytes
            ev += [(t, nxt, "activations", f"{name} recomputed output, kept for the next layer"),
                   (t, -nxt, "saved:recompute", f"{name} recomputed output")]
        else:
            ev += [(t, r.output_bytes, "workspace", f"{name} recomputed output"),
                   (t + d, -r.output_bytes, "workspace", f"{name} recomputed output freed")]
        t += d
    return t - start


def _backward_layer(st: _StageRows, lay: _Layer, t: float, dur: float, ev: list[Event]) -> None:
    """Events of one layer's backward from ``t``."""
    r, k, p, name = lay.row, lay.k, lay.p, lay.name
    grad_out_cat = "buffers" if (k == st.last and not st.is_last) else "activations"
    grad_out = 0 if (k == st.last and st.is_last) else r.output_bytes
    grad_in = 0 if r.kind == "embedding" else r.input_bytes
    grad_in_cat = "buffers" if (k == 0 and not st.is_first) else "activations"
    holds_input = r.saves_input or lay.act.action == "recompute"
    bwd_ws = r.workspace_bytes if r.bwd_workspace_bytes is None else r.bwd_workspace_bytes
    if p > 1:
        ev.append((t, grad_in + bwd_ws, "saved:split", f"{name} split"))
        ev.append((t + dur, -(bwd_ws + lay.own + (r.input_bytes if holds_input else 0) + grad_out),
                   "saved:split", f"{name} split"))
    dt = dur / p
    for c in range(p):
        c0, c1 = t + c * dt, t + (c + 1) * dt
        gi, ws = lay.chunks(grad_in, c), lay.chunks(bwd_ws, c)
        o, inp_c, go = lay.chunks(lay.own, c), lay.chunks(r.input_bytes, c), lay.chunks(grad_out, c)
        ev += [(c0, gi, grad_in_cat, f"{name} input gradient"),
               (c0, ws, "workspace", f"{name} backward workspace"),
               (c1, -ws, "workspace", f"{name} backward workspace freed"),
               (c1, -o, "activations", f"{name} saved activations freed")]
        if holds_input and not (k == 0 and st.keep_input):
            ev.append((c1, -inp_c, lay.input_cat, f"{name} saved input freed"))
        if not (k == st.last and st.keep_grad):
            ev.append((c1, -go, grad_out_cat, f"{name} output gradient freed"))
        if p > 1:
            ev.append((c0, -(gi + ws), "saved:split", f"{name} split"))
            ev.append((c1, ws + o + (inp_c if holds_input else 0) + go, "saved:split", f"{name} split"))
    if lay.act.action == "recompute" and not r.saves_input:
        ev.append((t + dur, r.input_bytes, "saved:recompute", f"{name} checkpoint freed"))
    if k == 0 and st.is_first and grad_in:
        ev.append((t + dur, -grad_in, grad_in_cat, f"{name} input gradient freed"))


def static_bytes(rows: list[LayerRow], weight_versions: int, receive_buffers: int = 0,
                 sharding: Sharding = NOT_SHARDED, weight_cache_per_param: float = 0.0) -> dict[str, int]:
    """What a stage allocates once: weights, gradients, optimizer states, stashed weight
    versions, and ``receive_buffers`` bytes of preallocated receive buffers. Under ZeRO
    (``Sharding``) this GPU holds 1/N of the optimizer states (stage 1), of the gradients
    too (stage 2) and of the parameters too (stage 3): mixed-precision Adam's 16 bytes per
    parameter become 4 + 12/N, 2 + 14/N and 16/N (ZeRO section 5.1, Figure 1). A
    low-precision recipe's quantized weight copies, cached over the iteration
    (``weight_cache_per_param`` bytes a parameter, ``Precision.weight_cache_bytes_per_param``),
    are weights too; under ZeRO-3 each gathered layer is cast anew, nothing cached."""
    params = sum(r.param_bytes for r in rows)
    z, shard = sharding.zero_stage, sharding.shard
    grads, optimizer = sum(r.grad_bytes for r in rows), sum(r.optimizer_bytes for r in rows)
    cache = round(sum(r.params for r in rows) * weight_cache_per_param) if z < 3 else 0
    return {
        "params": shard(params) if z >= 3 else params + cache,
        "grads": (0 if sharding.offload_grads else shard(grads)) if z >= 2 else grads,
        "optimizer": (shard(optimizer) if not sharding.expert_replicas else
                      sum(sharding.optimizer_share(r) for r in rows)) if z >= 1 else optimizer,
        "stash": (weight_versions - 1) * params,
        "buffers": receive_buffers,
    }
