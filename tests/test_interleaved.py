"""Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2): each GPU's order, each virtual
stage's task list, and GpuTurns, the SimPy component that makes a GPU's stages take turns.

The expected orders are written out by hand from Megatron-LM's rules
(``forward_backward_pipelining_with_interleaving``: warm-up (p - g - 1) * 2 + (v - 1) * p
forwards, microbatches in groups of p per chunk, backwards last chunk first) and checked
against the paper's figure 4 (p = 4, v = 2, m = 8; device 1 is GPU 0 here).
"""

from __future__ import annotations

import random

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsim.errors import MpsimError
from mpsim.plans.schedule import (
    Task,
    interleaved_bubble,
    interleaved_gpu_order,
    interleaved_stage_tasks,
    interleaved_turn_orders,
    interleaved_warmup,
)
from mpsim.sim.simpy_fast import events_scheduled
from mpsim.sim.turns import GpuTurns

PROPS = settings(max_examples=60, deadline=None, derandomize=True, database=None)


def order(text: str) -> list[tuple[int, Task]]:
    """'0F3 4B1 0U7' -> [(0, F 3), (4, B 1), (0, U 7)]: virtual stage, kind, microbatch."""
    out = []
    for word in text.split():
        kind = next(c for c in word if c in "FBU")
        stage, mb = word.split(kind)
        out.append((int(stage), Task(kind, int(mb))))  # type: ignore[arg-type]
    return out


# -- exact orders, by hand -----------------------------------------------------------------

P2_V2_M4 = {
    # GPU 0: stages 0 and 2, 4 warm-up forwards (1 * 2 + 1 * 2)
    0: order("0F0 0F1 2F0 2F1  0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1  2B2 2B3 0B2 0B3  0U3 2U3"),
    # GPU 1: stages 1 and 3, 2 warm-up forwards (0 * 2 + 1 * 2)
    1: order("1F0 1F1  3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3  1B2 1B3  1U3 3U3"),
}

P4_V2_M8 = {
    # warm-up 10: figure 4's device 1 runs forwards 1 2 3 4 1 2 3 4 5 6 (chunk 0, then chunk 1) first
    0: order("0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 "
             "0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7 0B1 "
             "0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7 "
             "0U7 4U7"),
    # warm-up 8
    1: order("1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 "
             "1F4 5B0 1F5 5B1 1F6 5B2 1F7 5B3 5F4 1B0 5F5 1B1 5F6 1B2 5F7 1B3 "
             "5B4 5B5 5B6 5B7 1B4 1B5 1B6 1B7 "
             "1U7 5U7"),
    # warm-up 6
    2: order("2F0 2F1 2F2 2F3 6F0 6F1 "
             "6F2 6B0 6F3 6B1 2F4 6B2 2F5 6B3 2F6 2B0 2F7 2B1 6F4 2B2 6F5 2B3 6F6 6B4 6F7 6B5 "
             "6B6 6B7 2B4 2B5 2B6 2B7 "
             "2U7 6U7"),
    # warm-up 4
    3: order("3F0 3F1 3F2 3F3 "
             "7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3F4 3B0 3F5 3B1 3F6 3B2 3F7 3B3 "
             "7F4 7B4 7F5 7B5 7F6 7B6 7F7 7B7 "
             "3B4 3B5 3B6 3B7 "
             "3U7 7U7"),
}


@pytest.mark.parametrize("gpu", [0, 1])
def test_p2_v2_m4_order_by_hand(gpu):
    assert interleaved_gpu_order(gpu, 2, 2, 4) == P2_V2_M4[gpu]


@pytest.mark.parametrize("gpu", [0, 1, 2, 3])
def test_p4_v2_m8_order_by_hand(gpu):
    assert interleaved_gpu_order(gpu, 4, 2, 8) == P4_V2_M8[gpu]


def test_warmups_of_figure_4():
    assert [interleaved_warmup(g, 4, 2, 8) for g in range(4)] == [10, 8, 6, 4]
    assert interleaved_warmup(0, 4, 3, 4) == 12  # 6 + 8 = 14, capped at m * v


def test_stage_tasks_are_the_gpu_order_filtered():
    assert interleaved_stage_tasks(2, 2, 2, 4) == [t for _, t in order("2F0 2F1 2B0 2B1 2F2 2F3 2B2 2B3 2U3")]
    assert interleaved_stage_tasks(1, 2, 2, 4) == [t for _, t in order("1F0 1F1 1F2 1B0 1F3 1B1 1B2 1B3 1U3")]
    assert interleaved_stage_tasks(7, 4, 2, 8) == [t for _, t in order(
        "7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 7F4 7B4 7F5 7B5 7F6 7B6 7F7 7B7 7U7")]


def test_turn_orders_index_each_stage_list():
    assert interleaved_turn_orders(2, 2, 4)[1] == [
        (1, 0), (1, 1), (3, 0), (3, 1), (3, 2), (3, 3), (1, 2), (1, 3), (1, 4), (1, 5),
        (3, 4), (3, 5), (3, 6), (3, 7), (1, 6), (1, 7), (1, 8), (3, 8)]


def test_bubble_of_figure_4():
    assert interleaved_bubble(4, 2, 8) == 3 / 16  # against 3 / 8 for 1F1B


# -- properties ----------------------------------------------------------------------------

shapes = st.tuples(st.integers(2, 4), st.integers(2, 3), st.integers(1, 4)).map(lambda t: (t[0], t[1], t[0] * t[2]))


@PROPS
@given(shapes)
def test_every_stage_runs_each_forward_and_backward_once_then_updates(shape):
    p, v, m = shape
    for stage in range(p * v):
        tasks = interleaved_stage_tasks(stage, p, v, m)
        assert sorted(t.microbatch for t in tasks if t.kind == "F") == list(range(m))
        assert sorted(t.microbatch for t in tasks if t.kind == "B") == list(range(m))
        assert tasks[-1] == Task("U", m - 1) and [t.kind for t in tasks].count("U") == 1
        # each microbatch's backward after its forward, on the stage
        assert all(tasks.index(Task("F", k)) < tasks.index(Task("B", k)) for k in range(m))
    for gpu in range(p):
        stages = {s for s, _ in interleaved_gpu_order(gpu, p, v, m)}
        assert stages == {c * p + gpu for c in range(v)}


def needs(stage: int, task: Task, n_stages: int) -> list[tuple[int, Task]]:
    """The tasks whose outputs this one takes: the activation, the gradient, the stash."""
    if task.kind == "F":
        return [(stage - 1, task)] if stage > 0 else []
    if task.kind == "B":
        later = [(stage + 1, task)] if stage < n_stages - 1 else []
        return later + [(stage, Task("F", task.microbatch))]
    return []


def run_in_some_order(p: int, v: int, m: int, rng: random.Random) -> list[tuple[int, Task]]:
    """One global order: each step, a GPU picked at random among those whose next task
    has its inputs, runs that task. Fails on a deadlock."""
    orders = {g: interleaved_gpu_order(g, p, v, m) for g in range(p)}
    at = dict.fromkeys(orders, 0)
    ran: list[tuple[int, Task]] = []
    done: set[tuple[int, Task]] = set()
    while any(at[g] < len(orders[g]) for g in orders):
        ready = [g for g in orders if at[g] < len(orders[g])
                 and all(n in done for n in needs(*orders[g][at[g]], p * v))]
        assert ready, f"deadlock at {[orders[g][at[g]] for g in orders if at[g] < len(orders[g])]}"
        g = rng.choice(ready)
        ran.append(orders[g][at[g]])
        done.add(orders[g][at[g]])
        at[g] += 1
    return ran


@PROPS
@given(shapes, st.randoms(use_true_random=False))
def test_no_deadlock_and_forwards_go_up_the_virtual_stages(shape, rng):
    p, v, m = shape
    ran = run_in_some_order(p, v, m, rng)
    when = {key: i for i, key in enumerate(ran)}
    assert len(when) == len(ran) == p * v * (2 * m + 1)
    for s in range(p * v - 1):
        for k in range(m):
            assert when[(s, Task("F", k))] < when[(s + 1, Task("F", k))]
            assert when[(s + 1, Task("B", k))] < when[(s, Task("B", k))]


@PROPS
@given(shapes)
def test_gpu_holds_at_most_warmup_plus_one_chunk_activations(shape):
    p, v, m = shape
    for gpu in range(p):
        live = peak = 0
        for _, task in interleaved_gpu_order(gpu, p, v, m):
            live += {"F": 1, "B": -1, "U": 0}[task.kind]
            peak = max(peak, live)
        assert peak == min(interleaved_warmup(gpu, p, v, m) + 1, m * v)


# -- bad inputs ----------------------------------------------------------------------------


@pytest.mark.parametrize("call,words", [
    (lambda: interleaved_gpu_order(0, 1, 2, 4), "p >= 2"),
    (lambda: interleaved_gpu_order(0, 2, 1, 4), "v >= 2"),
    (lambda: interleaved_gpu_order(0, 4, 2, 6), "m % p == 0"),
    (lambda: interleaved_gpu_order(0, 4, 2, 2), "m >= p"),
    (lambda: interleaved_gpu_order(0, 4, 2, 0), "m >= p"),
    (lambda: interleaved_gpu_order(4, 4, 2, 8), "GPU must be in 0..3"),
    (lambda: interleaved_gpu_order(0, 4, 2.0, 8), "must be an integer"),  # type: ignore[arg-type]
    (lambda: interleaved_gpu_order(0, True, 2, 8), "must be an integer"),
    (lambda: interleaved_stage_tasks(8, 4, 2, 8), "virtual stage must be in 0..7"),
    (lambda: interleaved_stage_tasks(0, 4, 2, 10), "Megatron-LM's rule"),
    (lambda: interleaved_gpu_order(0, 2, 2, 8192), "at most 4096"),
])
def test_bad_inputs_refused_in_one_line(call, words):
    with pytest.raises(MpsimError) as err:
        call()
    assert words in str(err.value) and "\n" not in str(err.value)


# -- GpuTurns -------------------------------------------------------------------------------


def two_stages_on_one_gpu(late_s: float = 0.0):
    """Stage 0 runs tasks of 2 s and 1 s, stage 1 tasks of 3 s and 1 s, on GPU 0 in the
    order 0.0, 1.0, 0.1, 1.1; stage 1's first task has its input at ``late_s``."""
    env = simpy.Environment()
    turns = GpuTurns(env, {0: [(0, 0), (1, 0), (0, 1), (1, 1)]})
    log: list[tuple[str, float, float]] = []

    def stage(s: int, durations: list[float]):
        for idx, d in enumerate(durations):
            yield from turns.wait(0, s, idx)
            if s == 1 and idx == 0 and late_s:
                yield env.timeout(late_s - env.now)  # its input lands; the GPU waits
            start = env.now
            yield env.timeout(d)
            log.append((f"{s}.{idx}", start, env.now))
            turns.done(0)

    env.process(stage(1, [3.0, 1.0]))  # the later stage asks first: it must wait
    env.process(stage(0, [2.0, 1.0]))
    env.run()
    assert turns.finished(0)
    return log, events_scheduled(env)


def test_turns_give_exact_start_times():
    log, _ = two_stages_on_one_gpu()
    assert log == [("0.0", 0.0, 2.0), ("1.0", 2.0, 5.0), ("0.1", 5.0, 6.0), ("1.1", 6.0, 7.0)]


def test_a_late_input_holds_the_gpu_in_its_order():
    log, _ = two_stages_on_one_gpu(late_s=4.0)
    # 0.1 is ready at 2 s but waits behind 1.0, as Megatron's blocking receive makes it
    assert log == [("0.0", 0.0, 2.0), ("1.0", 4.0, 7.0), ("0.1", 7.0, 8.0), ("1.1", 8.0, 9.0)]


def test_turns_are_deterministic():
    assert two_stages_on_one_gpu() == two_stages_on_one_gpu()


def test_a_turn_already_there_costs_no_event():
    env = simpy.Environment()
    turns = GpuTurns(env, {0: [(0, 0), (0, 1)], 1: [(1, 0)]})
    assert turns.take(0, 0, 0) is None
    turns.done(0)
    assert turns.take(0, 0, 1) is None and turns.take(1, 1, 0) is None
    turns.done(0)
    turns.done(1)
    assert turns.finished(0) and turns.finished(1)
    assert events_scheduled(env) == 0


def test_turns_refuse_misuse():
    env = simpy.Environment()
    with pytest.raises(ValueError, match="stage 0 is in the orders of GPUs 0 and 1"):
        GpuTurns(env, {0: [(0, 0)], 1: [(0, 1)]})
    with pytest.raises(ValueError, match="task 1 of stage 0 where task 0 is due"):
        GpuTurns(env, {0: [(0, 1), (0, 0)]})
    turns = GpuTurns(env, {0: [(0, 0), (1, 0)]})
    with pytest.raises(RuntimeError, match="no task holding its turn"):
        turns.done(0)
    with pytest.raises(RuntimeError, match="task 1 of stage 1 asks"):
        turns.take(0, 1, 1)


def simulate_interleaved(p: int, v: int, m: int, forward_s: float, backward_s: float) -> float:
    """A pipeline of p GPUs, v chunks each, free communication: each virtual stage a SimPy
    process, its GPU's stages in turn through GpuTurns. Returns the time of the last
    backward. ``forward_s`` and ``backward_s`` are one chunk's times."""
    env = simpy.Environment()
    turns = GpuTurns(env, interleaved_turn_orders(p, v, m))
    n = p * v
    ended = {(s, k, kind): env.event() for s in range(n) for k in range(m) for kind in "FB"}
    last = [0.0]

    def stage(s: int):
        for idx, task in enumerate(interleaved_stage_tasks(s, p, v, m)):
            yield from turns.wait(s % p, s, idx)
            if task.kind == "U":
                turns.done(s % p)
                continue
            before = (s - 1, task.microbatch, "F") if task.kind == "F" else (s + 1, task.microbatch, "B")
            if before in ended:
                yield ended[before]
            yield env.timeout(forward_s if task.kind == "F" else backward_s)
            ended[(s, task.microbatch, task.kind)].succeed()
            last[0] = max(last[0], env.now)
            turns.done(s % p)

    for s in range(n):
        env.process(stage(s))
    env.run()
    assert all(turns.finished(g) for g in range(p))
    return last[0]


@pytest.mark.parametrize("p,v,m", [(4, 2, 8), (2, 2, 4), (4, 3, 8), (3, 2, 6)])
def test_bubble_matches_the_paper_on_the_turns(p, v, m):
    """Chunk times 1/v of a GPU's whole forward (1 s) and backward (2 s): the iteration is
    the ideal m (1 + 2) s plus the bubble (p - 1) / (v m) of it, section 2.2.2."""
    ideal = m * 3.0
    assert simulate_interleaved(p, v, m, 1.0 / v, 2.0 / v) == pytest.approx(ideal * (1 + interleaved_bubble(p, v, m)))


# --- the engine runs it -------------------------------------------------------------------

def test_the_engine_runs_interleaved_1f1b_exactly():
    """p = 2 GPUs, v = 2 chunks, m = 2, one layer a virtual stage (F 1 ms, B 2 ms), free
    sends. GPU 0 runs F(s0) F(s0) F(s2) F(s2) B(s2) B(s2) B(s0) B(s0), GPU 1 F(s1) F(s1)
    F(s3) B(s3) F(s3) B(s3) B(s1) B(s1) (interleaved_gpu_order), each waiting for its input:
    GPU 0 F [0,1] [1,2] [2,3] [3,4], B [6,8] [9,11] [11,13] [13,15];
    GPU 1 F [1,2] [2,3] [3,4], B [4,6], F [6,7], B [7,9] [9,11] [11,13]."""
    from helpers import layer, tiny_topology, tiny_trace

    from mpsim.plans.job import JobSpec, Parallelism
    from mpsim.sim import simulate_job
    from mpsim.sim.layout import Job

    topo = tiny_topology(n_gpus=2, nvlink_gbps=1000.0)
    trace = tiny_trace([layer(f"l{i}", 1.0, 2.0) for i in range(4)])
    r = simulate_job(Job(JobSpec(topo, trace, "1f1b", 2, Parallelism(pipeline=2, virtual_stages=2))))
    ms = sorted((s.gpu, s.name[0], round(s.start_s * 1e3, 6), round(s.end_s * 1e3, 6)) for s in r.spans
                if s.lane == "compute" and s.name[0] != "U")
    assert ms == sorted(
        [(0, "F", a, a + 1) for a in (0, 1, 2, 3)] + [(0, "B", a, a + 2) for a in (6, 9, 11, 13)]
        + [(1, "F", a, a + 1) for a in (1, 2, 3, 6)] + [(1, "B", a, a + 2) for a in (4, 7, 9, 11)])
    assert r.layout == "pipeline x2 (interleaved x2)" and r.gpu_of_stage == [0, 1, 0, 1]


def test_interleaving_shrinks_the_bubble_of_a_balanced_pipeline():
    """Eight equal layers on 4 GPUs, 8 microbatches, free sends: 1F1B takes (m + p - 1)
    slots of F + B per GPU's share; interleaved with v = 2 cuts the bubble to (p-1)/(v m)."""
    from helpers import layer, tiny_topology, tiny_trace

    from mpsim.plans.job import JobSpec, Parallelism
    from mpsim.sim import simulate_job
    from mpsim.sim.layout import Job

    topo = tiny_topology(n_gpus=4, nvlink_gbps=1000.0)
    trace = tiny_trace([layer(f"l{i}", 0.5, 1.0) for i in range(8)])
    runs = {v: simulate_job(Job(JobSpec(topo, trace, "1f1b", 8, Parallelism(pipeline=4, virtual_stages=v))))
            for v in (1, 2)}
    ideal_ms = 8 * 2 * 1.5  # m x (a GPU's two layers' F + B)
    compute = {v: max(s.end_s for s in r.spans if s.lane == "compute" and s.name[0] != "U") * 1e3
               for v, r in runs.items()}
    assert compute[1] == pytest.approx(ideal_ms * (1 + 3 / 8))
    assert compute[2] == pytest.approx(ideal_ms * (1 + 3 / 16))
