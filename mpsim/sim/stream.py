"""A stage's compute stream: its task list in schedule order on its GPU."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, cast

import simpy

from mpsim.plans.schedule import Task, interleaved_stage_tasks, stage_tasks
from mpsim.sim.channels import PeerChannels
from mpsim.sim.context import RunContext
from mpsim.sim.data_parallel import DataParallel
from mpsim.sim.layer_groups import LayerGroups
from mpsim.sim.program import Piece, StageProgram, SwapIn
from mpsim.sim.result import Span
from mpsim.sim.simpy_fast import sleep
from mpsim.sim.spawn import spawn
from mpsim.sim.swapper import STASH, Swapper
from mpsim.sim.turns import GpuTurns
from mpsim.sim.update import Updater

_Step = tuple[Piece, int, int, int, str]
"""A piece of a task and its climbs before, while and after it runs (``program.climbs``),
and the cost its wait for a swap-in is charged to (``""`` when it waits for none)."""


class ComputeStream:
    """The compute stream of one stage; the process is the stream, so tasks of a GPU
    never overlap.

    Timing: a forward waits for its activation (a backward for its gradient), then runs
    its pieces (``mpsim.sim.program``) back to back; a piece waits for the swap-in it
    needs, and for room while a free is under way on the GPU, and holds its highest
    point while it runs. The swap-ins of a backward are launched when the task before
    it starts, timed from that task's estimated length. After a forward the activation
    is sent on (and a PipeDream weight version stashed), after a backward the gradient
    is sent back; the update runs where the schedule puts it. With data parallelism
    (``dp``) a ZeRO-3 piece first waits for its layer's gathered parameters, a backward
    hands each layer's gradients to the reduction as they are ready, and the update waits
    for the reductions (``data_parallel``). With tensor parallelism (``tp``) each piece's
    collectives run over the group once its compute is done, and the stream waits for
    them (``tensor_group``); with expert parallelism likewise each MoE layer's all-to-alls
    (``expert_group``). Under interleaved 1F1B several virtual stages share the GPU:
    each task waits for its turn in the GPU's order (``turns``) before it waits for its
    input, as Megatron-LM's blocking receive holds the GPU.

    From a task's start, a swap-in's landing or a piece's end to the next wait (a piece's
    end, a swap-in, room), a step of prefetched swaps without data or tensor parallelism
    defers its memory poke's recheck to the step's end (``DeviceMemory.defer_pokes``,
    ``settle``): the waiters see the state the step leaves, as they would through the
    poke's event; a step that leaves ``_run_pieces`` for the next task schedules the
    recheck there."""

    def __init__(self, run: RunContext, stage: int, program: StageProgram, swapper: Swapper, updater: Updater,
                 channels: PeerChannels, stash_in: SwapIn | None, dp: DataParallel | None = None,
                 tp: LayerGroups | None = None, turns: GpuTurns | None = None) -> None:
        layout = run.layout
        self.run = run
        self.stage = stage
        self.gpu = layout.gpu_of[stage]
        self.memory = run.memory[self.gpu]
        self.program = program
        self.swapper = swapper
        self.updater = updater
        self.channels = channels
        self.stash_in = stash_in
        """The weight version a backward needs from the host (PipeDream, stash on host)."""
        self.first = stage == 0
        self.last = stage == layout.n_stages - 1
        a, b = layout.stages[stage]
        self.output_bytes = layout.trace.layers[b - 1].output_bytes
        self.input_grad_bytes = layout.trace.layers[a].input_bytes
        v = layout.parallelism.virtual_stages
        self.rank = stage % (layout.n_stages // v)
        """The stage's place in the pipeline of GPUs (its GPU's turn key under interleaving)."""
        if v > 1:
            self.tasks = interleaved_stage_tasks(stage, layout.n_stages // v, v, layout.microbatches)
        else:
            self.tasks = stage_tasks(layout.schedule, stage, layout.n_stages, layout.microbatches)
        self.turns = turns
        """Interleaved 1F1B: the virtual stages sharing the GPU take turns in its order."""
        self.dp = dp
        self.tp = tp
        """The groups the stage's layers communicate over (tensor, expert, context): a piece's
        collectives run on them after its compute, or beside it (``LayerGroups.split``)."""
        self.last_backward = max(i for i, t in enumerate(self.tasks) if t.kind == "B")
        self._estimate_s = {"F": program.forward_s, "B": program.backward_s, "U": updater.gpu_update_s}
        self._forward_steps = self._steps(program.forward, program.forward_climbs)
        self._backward_steps = self._steps(program.backward, program.backward_climbs)

    def process(self) -> Generator[simpy.Event, object, None]:
        for idx, task in enumerate(self.tasks):
            if self.turns is not None:
                yield from self.turns.wait(self.rank, self.stage, idx)
            if task.kind == "U":
                self._prefetch_for(idx)
                start = self.run.env.now
                if self.dp is not None:
                    yield from self.dp.before_update()
                yield from self.updater.update()
                if self.dp is not None:
                    yield from self.dp.after_update()
            else:
                climbs = self.program.forward_climbs if task.kind == "F" else self.program.backward_climbs
                self.memory.set_climb(climbs[0][0])  # what the task will take once its input lands
                yield from self._wait_for_inputs(task)
                self._prefetch_for(idx)
                start = self.run.env.now
                yield from self._run_pieces(task, idx == self.last_backward)
            self.run.spans.append(Span(self.gpu, "compute", f"{task.kind}{task.microbatch}", start, self.run.env.now))
            if task.kind != "U":
                self._after(task)
            if self.turns is not None:
                self.turns.done(self.rank)
            if self.run.on_task is not None:
                self.run.on_task()

    def _prefetch_for(self, idx: int) -> None:
        """Launch the swap-ins of the backward after task ``idx`` as that task starts."""
        nxt = self.tasks[idx + 1] if idx + 1 < len(self.tasks) else None
        if nxt is None or nxt.kind != "B":
            return
        env = self.run.env
        need_base_s = env.now + self._estimate_s[self.tasks[idx].kind]
        for si in self.program.swap_ins:
            self.swapper.start_swap_in(nxt.microbatch, si, need_base_s + si.need_offset_s)
        if self.stash_in is not None:
            self.swapper.start_swap_in(nxt.microbatch, self.stash_in, need_base_s)

    def _wait_for_inputs(self, task: Task) -> Generator[simpy.Event, object, None]:
        signals = self.run.signals
        if task.kind == "F":
            if not self.first:
                yield signals("activation", self.stage, task.microbatch)
            return
        if not self.last:
            yield signals("gradient", self.stage, task.microbatch)
        if self.stash_in is not None:
            yield from self._wait_for_swap_in(task.microbatch, STASH, "swap_wait_s")

    def _wait_for_swap_in(self, mb: int, layer: int, cost: str) -> Generator[simpy.Event, object, None]:
        """Mark the point reached (a held prefetch may go now) and wait for the swap-in."""
        signals = self.run.signals
        signals.reach((self.stage, mb, layer))
        self.memory.poke()
        yield from self._wait(signals("in", self.stage, mb, layer), cost)

    def _wait(self, event: simpy.Event, cost: str) -> Generator[simpy.Event, object, None]:
        """Wait for ``event`` if it has not happened, the time charged to ``cost``."""
        if not event.processed:
            start = self.run.env.now
            yield event
            self.run.costs.add(self.gpu, cost, self.run.env.now - start)

    def _run_pieces(self, task: Task, last_backward: bool) -> Generator[simpy.Event, object, None]:
        run, mb, dp, memory = self.run, task.microbatch, self.dp, self.memory
        env, signals, stage = run.env, run.signals, self.stage
        forward = task.kind == "F"
        steps = self._forward_steps if forward else self._backward_steps
        word = "forward" if forward else "backward"
        label = f"{word} of microbatch {mb} on stage {stage}:"
        defer = not run.on_demand and dp is None and self.tp is None  # see DeviceMemory.settle
        memory.defer_pokes(defer)  # from the task's start to its first wait: one recheck at the wait
        for piece, climb_before, climb_running, climb_after, wait_cost in steps:
            memory.set_climb(climb_before)
            if piece.wait_for is not None:  # _wait_for_swap_in, written out for the hot loop
                signals.reach((stage, mb, piece.wait_for))
                memory.poke()
                landed = signals("in", stage, mb, piece.wait_for)
                if cast(Any, landed).callbacks is not None:  # not processed yet
                    start_s = env.now
                    memory.settle()
                    yield landed
                    run.costs.add(self.gpu, wait_cost, env.now - start_s)
                    memory.defer_pokes(defer)  # from the swap-in's landing to the next wait
            if dp is not None and piece.layer is not None:
                yield from dp.wait_for_gather(mb, task.kind, piece.layer)
            template = piece.template
            if dp is None and not memory.task_must_wait(template):  # the common case: no generator, one call
                memory.start_piece(template, label, climb_running)
            else:  # a wait for room settles the step once its waiter is in line (DeviceMemory._until)
                yield from self._start_piece(piece, label, climb_running, task, last_backward)
            if piece.overlap_s and self.tp is not None:  # collectives beside the piece's last GEMMs
                yield from self._overlapped(piece, f"{word} of microbatch {mb}")
            else:
                if piece.duration_s:
                    ends = sleep(env, piece.duration_s)
                    memory.settle()
                    yield ends
                    memory.defer_pokes(defer)  # from this piece's end to the next wait
                if piece.collectives and self.tp is not None:
                    yield from self.tp.communicate(piece.collectives, f"{word} of microbatch {mb}")
            memory.end_piece(template, climb_after)
            if piece.swap_out is not None:
                self.swapper.start_swap_out(mb, piece.swap_out)
                if run.on_demand:  # the compute goes on once the swap-out has landed
                    yield from self._wait(signals("out", stage, mb, piece.swap_out.layer), "swap_wait_s")
        memory.settle(last_act=False)  # the step goes on in process(): the recheck waits for it
        if dp is not None and last_backward:
            dp.after_last_backward()

    def _overlapped(self, piece: Piece, label: str) -> Generator[simpy.Event, object, None]:
        """A piece whose collectives run beside its last ``overlap_s`` seconds of compute
        (GEMMs under an overlapping runtime, ``mpsim.timing.runtime``; a ring attention's
        blocks): they start that long before its compute ends; the stream goes on when both
        are done, after the collectives that do not overlap (``LayerGroups.split``). The
        compute is one sleep of the piece's length, as a piece without collectives runs, so
        it ends at the instant its template's frees are logged at (two sleeps summing to it
        can end an ulp early and start the next piece before them)."""
        env, memory, tp = self.run.env, self.memory, self.tp
        assert tp is not None
        beside, after = tp.split(piece.collectives)
        comm = env.process(self._beside(piece.duration_s - piece.overlap_s, beside, label)) if beside else None
        ends = sleep(env, piece.duration_s)
        memory.settle()
        yield ends
        if comm is not None and not comm.processed:
            yield comm
        if after:
            yield from tp.communicate(after, label)
        memory.defer_pokes(False)

    def _beside(self, delay_s: float, collectives: list[tuple[str, int]],
                label: str) -> Generator[simpy.Event, object, None]:
        """``collectives`` over the stage's groups, started ``delay_s`` from now."""
        assert self.tp is not None
        if delay_s > 0:
            yield sleep(self.run.env, delay_s)
        yield from self.tp.communicate(collectives, label)

    def _start_piece(self, piece: Piece, label: str, climb_running: int, task: Task,
                     last_backward: bool) -> Generator[simpy.Event, object, None]:
        """A piece starts once its highest point fits (or no free is under way); under
        data parallelism a backward piece hands its layers' gradients on as it starts."""
        memory = self.memory
        if memory.task_must_wait(piece.template):
            waited_s = yield from memory.acquire_task(piece.template, label)
            self.run.costs.add(self.gpu, "memory_wait_s", waited_s)
        else:
            memory.start_task(piece.template, label)
        if self.dp is not None and task.kind == "B":
            self.dp.backward_piece_started(task.microbatch, piece, last_backward)
        memory.set_climb(climb_running)

    def _steps(self, pieces: list[Piece], climbs: list[tuple[int, int, int]]) -> list[_Step]:
        """Each piece with its climbs and the cost its swap-in wait is charged to."""
        steps = []
        for piece, (before, running, after) in zip(pieces, climbs, strict=True):
            cost = ""
            if piece.wait_for is not None:
                cost = "swap_wait_s" if self.program.actions[piece.wait_for].action == "host" else "peer_wait_s"
            steps.append((piece, before, running, after, cost))
        return steps

    def _after(self, task: Task) -> None:
        """Costs, sends and stashes that follow a forward or a backward."""
        run, mb, prog = self.run, task.microbatch, self.program
        if task.kind == "F":
            run.costs.add(self.gpu, "split_s", prog.split_forward_s)
            if self.stash_in is not None:
                spawn(run.env, self.swapper.stash_out(mb, self.stash_in.n_bytes))
            if not self.last:
                self.channels.send("activation", self.stage, self.stage + 1, mb, self.output_bytes)
            return
        run.costs.add(self.gpu, "recompute_s", prog.recompute_s)
        run.costs.add(self.gpu, "selective_s", prog.selective_s)
        run.costs.add(self.gpu, "split_s", prog.split_backward_s)
        if self.stash_in is not None:
            label = f"weight version of microbatch {mb} released"
            n = self.stash_in.n_bytes
            self.memory.change([(-n, "stash", label), (n, "saved:stash", label)])
        if not self.first:
            self.channels.send("gradient", self.stage, self.stage - 1, mb, self.input_grad_bytes)
