"""Turns on a GPU shared by several pipeline stages: interleaved 1F1B's virtual stages.

Under interleaved 1F1B (Narayanan et al. 2021, section 2.2.2; ``mpsim.plans.schedule``'s
``interleaved_gpu_order``) each GPU holds v model chunks, each a virtual stage with its own
task list and its own process in the engine. The GPU still runs one program: Megatron-LM's
``forward_backward_pipelining_with_interleaving`` issues the chunks' forwards and backwards
on one compute stream in one fixed order, and a task whose input has not arrived holds
the GPU (its receive blocks) while the other chunks' tasks wait behind it. ``GpuTurns``
keeps that order: a stage's task starts only when every task before it in its GPU's
order has ended.

How a stage's process uses it (``stage`` and ``idx`` index the stage's own task list,
``interleaved_stage_tasks``; the orders come from ``interleaved_turn_orders``)::

    turns = GpuTurns(env, interleaved_turn_orders(p, v, m))
    ...
    for idx, task in enumerate(tasks):
        yield from turns.wait(gpu, stage, idx)   # before waiting for the task's input
        ...                                      # the task, on the GPU's compute stream
        turns.done(gpu)

Cost: ``wait`` yields no event when the turn is already there (the GPU's task before it
was the same stage's, or ended before the stage asked); ``take`` does the same without a
generator, for a hot loop. A turn passing to a stage that is already waiting costs one
event, triggered by ``done`` in the instant the task before it ends. Deterministic: at
most one waiter per turn, woken in the GPU's order. No deadlock of its own: the orders
are checked to list each stage's tasks in the stage's own order, so the turn after a
finished task always belongs to a task its stage will ask for next; a data dependency
the order breaks (a task before its input's producer on the same GPU) would still stall,
and ``interleaved_gpu_order`` has none.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence

import simpy


class GpuTurns:
    """The task order of each GPU whose stages share it (module doc).

    ``orders`` maps each GPU to its order as (stage, index of the task in that stage's own
    task list); every stage is on one GPU and its indices run 0, 1, 2, ... in order."""

    def __init__(self, env: simpy.Environment, orders: Mapping[int, Sequence[tuple[int, int]]]) -> None:
        self.env = env
        self._orders: dict[int, tuple[tuple[int, int], ...]] = {g: tuple(o) for g, o in orders.items()}
        self._gpu_of: dict[int, int] = {}
        for gpu, order in self._orders.items():
            count: dict[int, int] = {}
            for stage, idx in order:
                if self._gpu_of.setdefault(stage, gpu) != gpu:
                    raise ValueError(f"stage {stage} is in the orders of GPUs {self._gpu_of[stage]} and {gpu}")
                if idx != count.get(stage, 0):
                    raise ValueError(f"GPU {gpu}'s order has task {idx} of stage {stage} where task "
                                     f"{count.get(stage, 0)} is due")
                count[stage] = idx + 1
        self._next = dict.fromkeys(self._orders, 0)
        """Each GPU's position in its order: the task that has the turn, running or not."""
        self._running = dict.fromkeys(self._orders, False)
        self._due = dict.fromkeys(self._gpu_of, 0)
        """Each stage's next task index to ask for a turn."""
        self._waiting: dict[int, dict[tuple[int, int], simpy.Event]] = {g: {} for g in self._orders}
        """Per GPU, the early stages' wake-up events by (stage, task index)."""

    def is_turn(self, gpu: int, stage: int, idx: int) -> bool:
        """Whether task ``idx`` of ``stage`` may start now on ``gpu`` (its turn, not yet taken)."""
        pos = self._next[gpu]
        order = self._orders[gpu]
        return not self._running[gpu] and pos < len(order) and order[pos] == (stage, idx)

    def wait(self, gpu: int, stage: int, idx: int) -> Generator[simpy.Event, object, None]:
        """Wait until task ``idx`` of ``stage`` has the turn on ``gpu``, then hold it until
        ``done(gpu)``; returns at once, without an event, when the turn is already there.
        A stage asks for its tasks in its own order, each once."""
        woken = self.take(gpu, stage, idx)
        if woken is not None:
            yield woken

    def take(self, gpu: int, stage: int, idx: int) -> simpy.Event | None:
        """``wait`` without a generator: take the turn and return None when it is there,
        else the event to yield, triggered when the turn comes (the turn is then held)."""
        if self._gpu_of.get(stage) != gpu or self._due[stage] != idx:
            raise RuntimeError(f"task {idx} of stage {stage} asks for a turn on GPU {gpu}; "
                               f"due: task {self._due.get(stage)} on GPU {self._gpu_of.get(stage)}")
        self._due[stage] = idx + 1
        if self.is_turn(gpu, stage, idx):
            self._running[gpu] = True
            return None
        woken = self._waiting[gpu][(stage, idx)] = self.env.event()
        return woken

    def done(self, gpu: int) -> None:
        """The task holding ``gpu``'s turn has ended: the next in the order gets it, and
        its stage resumes now if it was waiting."""
        if not self._running[gpu]:
            raise RuntimeError(f"done on GPU {gpu} with no task holding its turn")
        self._running[gpu] = False
        pos = self._next[gpu] = self._next[gpu] + 1
        order = self._orders[gpu]
        if pos < len(order):
            woken = self._waiting[gpu].pop(order[pos], None)
            if woken is not None:
                self._running[gpu] = True
                woken.succeed()

    def finished(self, gpu: int) -> bool:
        """Whether every task in ``gpu``'s order has run (a check for the end of a run)."""
        return self._next[gpu] == len(self._orders[gpu])
