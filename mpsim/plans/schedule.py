"""Pipeline schedules: per stage, the ordered list of tasks for one measured run.

A task is (kind, microbatch): ``F`` forward, ``B`` backward, ``U`` optimizer update.

- ``gpipe`` (GPipe): all m forwards, then all m backwards, then the update. Stage i holds
  the activations of all m microbatches before its first backward.
- ``1f1b`` (DAPPLE, PipeDream-Flush): stage i runs min(p - i - 1, m) warm-up forwards, then
  alternates one forward and one backward, then drains; at most p - i microbatches of
  activations are live on stage i. Synchronous: one update after the flush.
- ``pipedream`` (PipeDream, asynchronous 1F1B with weight stashing): no flush; stage i
  admits p - i microbatches, then alternates backward (followed by its weight update) and
  forward. Iterations of m microbatches are simulated back to back and one in the steady
  state is measured (``PIPEDREAM_ITERATIONS``, ``PIPEDREAM_MEASURED``). Stage i keeps p - i
  weight versions: the live weights and p - i - 1 stashed copies.
- interleaved 1F1B (Megatron-LM's virtual pipeline stages): each of p GPUs holds v model
  chunks, virtual stages c * p + g, run in one order per GPU (``interleaved_gpu_order``).
  Not in ``SCHEDULES`` yet: its stages share GPUs, so the engine must make them take
  turns (``mpsim.sim.turns.GpuTurns``).
"""

from __future__ import annotations

from numbers import Integral
from typing import Literal, NamedTuple

from mpsim.errors import MpsimError
from mpsim.limits import MAX_MICROBATCH, check_microbatch  # noqa: F401 - read from here as before

ScheduleName = Literal["gpipe", "1f1b", "pipedream"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "pipedream")
PIPEDREAM_ITERATIONS = 4
PIPEDREAM_MEASURED = 2
"""The measured PipeDream iteration: the third of four, past the fill and before the drain."""
MAX_MICROBATCHES = 4096
"""The most microbatches per iteration a job may have: one iteration simulates every one
of them on every stage (PipeDream four iterations), so beyond this a run takes minutes and
gigabytes without telling more."""
class Task(NamedTuple):
    kind: Literal["F", "B", "U"]
    microbatch: int


def min_microbatches(name: str, n_stages: int) -> int:
    """The fewest microbatches per iteration ``name`` runs ``n_stages`` stages with: 1f1b and
    pipedream need one per stage to fill the pipeline, gpipe one in all."""
    return n_stages if name in ("1f1b", "pipedream") else 1


def check_schedule(name: str, n_stages: int, n_microbatches: int) -> None:
    if name not in SCHEDULES:
        raise MpsimError(f"unknown schedule {name!r}: expected one of {', '.join(SCHEDULES)}")
    if n_microbatches < 1:
        raise MpsimError(f"--microbatches must be at least 1, got {n_microbatches}")
    if n_microbatches > MAX_MICROBATCHES:
        raise MpsimError(f"--microbatches must be at most {MAX_MICROBATCHES} per iteration, got {n_microbatches}")
    if n_microbatches < min_microbatches(name, n_stages):
        raise MpsimError(
            f"{name} needs at least as many microbatches as stages to fill the pipeline: "
            f"got {n_microbatches} microbatches for {n_stages} stages"
        )


def stage_tasks(name: str, stage: int, n_stages: int, n_microbatches: int) -> list[Task]:
    """The task order of ``stage`` (0-based) in a pipeline of ``n_stages``."""
    check_schedule(name, n_stages, n_microbatches)
    m, p, i = n_microbatches, n_stages, stage
    if name == "gpipe":
        return [Task("F", k) for k in range(m)] + [Task("B", k) for k in range(m)] + [Task("U", m - 1)]
    if name == "1f1b":
        warmup = min(p - i - 1, m)
        tasks = [Task("F", k) for k in range(warmup)]
        for k in range(m - warmup):
            tasks += [Task("F", warmup + k), Task("B", k)]
        tasks += [Task("B", k) for k in range(m - warmup, m)]
        return tasks + [Task("U", m - 1)]
    total = m * PIPEDREAM_ITERATIONS
    in_flight = min(p - i, total)
    tasks = [Task("F", k) for k in range(in_flight)]
    for k in range(total):
        tasks += [Task("B", k), Task("U", k)]
        if in_flight + k < total:
            tasks.append(Task("F", in_flight + k))
    return tasks


def weight_versions(name: str, stage: int, n_stages: int) -> int:
    """Weight copies stage ``stage`` holds: p - i under PipeDream's weight stashing, else 1."""
    return n_stages - stage if name == "pipedream" else 1


# -- interleaved 1F1B (virtual pipeline stages) --------------------------------------------


def check_interleaved(p: int, v: int, m: int) -> None:
    """Refuse an interleaved pipeline Megatron-LM would not run, in one line each:
    p >= 2 GPUs, v >= 2 chunks a GPU, m a multiple of p and at least p (its
    ``forward_backward_pipelining_with_interleaving``, one group of p microbatches per chunk)."""
    for name, value in (("pipeline GPUs (p)", p), ("model chunks per GPU (v)", v), ("microbatches (m)", m)):
        if isinstance(value, bool) or not isinstance(value, Integral):
            raise MpsimError(f"interleaved 1F1B: {name} must be an integer, got {value!r}")
    if p < 2:
        raise MpsimError(f"interleaved 1F1B needs at least 2 pipeline GPUs (p >= 2), got p={p}")
    if v < 2:
        raise MpsimError(f"interleaved 1F1B needs at least 2 model chunks per GPU (v >= 2), got v={v}; "
                         f"with one chunk use 1f1b")
    if m < p or m % p:
        raise MpsimError(f"interleaved 1F1B needs the microbatches to be a multiple of the pipeline GPUs "
                         f"(m % p == 0 and m >= p, Megatron-LM's rule), got m={m}, p={p}")
    if m > MAX_MICROBATCHES:
        raise MpsimError(f"--microbatches must be at most {MAX_MICROBATCHES} per iteration, got {m}")


def interleaved_warmup(gpu: int, p: int, v: int, m: int) -> int:
    """Forwards GPU ``gpu`` runs before its first backward: (p - gpu - 1) * 2 + (v - 1) * p,
    capped at m * v (Megatron-LM's ``get_pp_rank_microbatches``)."""
    check_interleaved(p, v, m)
    _check_gpu(gpu, p)
    return min((p - gpu - 1) * 2 + (v - 1) * p, m * v)


def interleaved_gpu_order(gpu: int, p: int, v: int, m: int) -> list[tuple[int, Task]]:
    """The (virtual stage, task) order GPU ``gpu`` of a p-GPU pipeline with v model chunks a
    GPU runs for one iteration of m microbatches: interleaved 1F1B (Narayanan et al. 2021,
    "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
    section 2.2.2 and figure 4), in the order Megatron-LM's
    ``forward_backward_pipelining_with_interleaving`` runs it (default
    ``microbatch_group_size_per_vp_stage`` = p).

    Chunk c of GPU g is virtual stage c * p + g; a microbatch goes through virtual stages
    0 .. p * v - 1 in order, so it crosses every GPU v times. The GPU runs m * v forwards
    and m * v backwards, numbered k = 0 .. m * v - 1 each: forward k is chunk
    (k // p) % v on microbatch (k // (p * v)) * p + k % p (microbatches advance in groups
    of p through each chunk in turn, Megatron's ``get_model_chunk_id``); backward k is the
    same with the chunks reversed (chunk v - 1 - (k // p) % v), the last chunk first. The
    GPU runs ``interleaved_warmup`` forwards ((p - g - 1) * 2 + (v - 1) * p, capped at
    m * v), then one forward and one backward while forwards remain, then the remaining
    backwards, then one optimizer update (kind ``U``, microbatch m - 1) per virtual stage,
    chunk 0 first: synchronous, one flush an iteration, as 1F1B.

    Bubble: each chunk's forward and backward take 1/v of a whole-GPU microbatch, so the
    fill and drain cost (p - 1) / v microbatch times and the bubble is (p - 1) / (v * m) of
    the ideal time, against (p - 1) / m for 1F1B (section 2.2.2; ``interleaved_bubble``).
    The price is more point-to-point sends (v times as many) and more activations: GPU g
    holds up to ``interleaved_warmup`` + 1 microbatch-chunks of activations (each 1/v of a
    microbatch's on the GPU): GPU 0 holds 2 (p - 1) + (v - 1) p + 1 of them, p + (p - 1) / v
    microbatches' worth, against p for 1F1B (when m * v exceeds the warm-up).

    To run it, give each virtual stage its own task list (``interleaved_stage_tasks``) and
    process, and make the stages of one GPU take turns on its compute stream in this order
    with ``mpsim.sim.turns.GpuTurns(env, interleaved_turn_orders(p, v, m))``.
    """
    check_interleaved(p, v, m)
    _check_gpu(gpu, p)
    total = m * v
    warmup = interleaved_warmup(gpu, p, v, m)

    def forward(k: int) -> tuple[int, Task]:
        chunk = (k // p) % v
        return chunk * p + gpu, Task("F", (k // (p * v)) * p + k % p)

    def backward(k: int) -> tuple[int, Task]:
        chunk = v - 1 - (k // p) % v
        return chunk * p + gpu, Task("B", (k // (p * v)) * p + k % p)

    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order + [(c * p + gpu, Task("U", m - 1)) for c in range(v)]


def interleaved_stage_tasks(stage: int, p: int, v: int, m: int) -> list[Task]:
    """The tasks of virtual stage ``stage`` (0 .. p * v - 1, on GPU ``stage % p``) in the
    order its GPU runs them: ``interleaved_gpu_order`` filtered to the stage. Every
    microbatch's forward and backward once each, then one ``U``; the list a stage's
    process walks, as ``stage_tasks`` gives for the other schedules."""
    check_interleaved(p, v, m)
    if isinstance(stage, bool) or not isinstance(stage, Integral) or not 0 <= stage < p * v:
        raise MpsimError(f"interleaved 1F1B: virtual stage must be in 0..{p * v - 1} (p * v - 1), got {stage!r}")
    return [task for s, task in interleaved_gpu_order(stage % p, p, v, m) if s == stage]


def interleaved_turn_orders(p: int, v: int, m: int) -> dict[int, list[tuple[int, int]]]:
    """For ``mpsim.sim.turns.GpuTurns``: each GPU's order as (virtual stage, index of the
    task in ``interleaved_stage_tasks(stage, p, v, m)``)."""
    orders: dict[int, list[tuple[int, int]]] = {}
    for gpu in range(p):
        seen: dict[int, int] = {}
        turns = orders[gpu] = []
        for stage, _ in interleaved_gpu_order(gpu, p, v, m):
            turns.append((stage, seen.get(stage, 0)))
            seen[stage] = seen.get(stage, 0) + 1
    return orders


def interleaved_bubble(p: int, v: int, m: int) -> float:
    """The pipeline bubble of interleaved 1F1B as a fraction of the ideal (bubble-free)
    iteration time: (p - 1) / (v * m) (Narayanan et al. 2021, section 2.2.2); 1F1B's is
    (p - 1) / m, the same formula with v = 1."""
    check_interleaved(p, v, m)
    return (p - 1) / (v * m)


def _check_gpu(gpu: int, p: int) -> None:
    if isinstance(gpu, bool) or not isinstance(gpu, Integral) or not 0 <= gpu < p:
        raise MpsimError(f"interleaved 1F1B: GPU must be in 0..{p - 1} (p - 1), got {gpu!r}")
