"""SimPy's fast path (mpsim.sim.simpy_fast): the internals check, and the same event order
as SimPy's own run loop and processes."""

from __future__ import annotations

import gc
import re
from collections.abc import Callable, Generator
from pathlib import Path
from types import SimpleNamespace

import pytest
import simpy

from mpsim.errors import MpsimError
from mpsim.sim.simpy_fast import (
    Detached,
    SimpyInternalsError,
    call_inner,
    check_simpy,
    events_scheduled,
    fire_in_place,
    gc_paused,
    go_on_now,
    mark_processed,
    missing_internals,
    run_until_empty,
)


def test_the_installed_simpy_has_the_internals():
    check_simpy()


def _fakes() -> tuple[SimpleNamespace, SimpleNamespace]:
    event = SimpleNamespace(_ok=True, _value=None, _defused=True)
    env = SimpleNamespace(_queue=[(0.0, 1, 0, event)], _now=0.0, _eid=iter(range(1, 10)))
    return env, event


def test_fakes_with_every_internal_pass():
    env, event = _fakes()
    assert missing_internals(env, event) == []
    check_simpy(env, event)


@pytest.mark.parametrize("owner,name,named", [("env", "_eid", "Environment._eid"),
                                              ("env", "_queue", "Environment._queue"),
                                              ("event", "_defused", "Event._defused"),
                                              ("event", "_ok", "Event._ok")])
def test_a_missing_internal_is_one_line_naming_it_and_the_version(owner, name, named):
    env, event = _fakes()
    delattr(env if owner == "env" else event, name)
    with pytest.raises(SimpyInternalsError) as info:
        check_simpy(env, event)
    msg = str(info.value)
    assert isinstance(info.value, MpsimError) and "\n" not in msg
    assert named in msg and f"simpy {simpy.__version__}" in msg


def test_a_queue_of_another_shape_is_named():
    env, event = _fakes()
    env._queue = [(0.0, event)]
    assert missing_internals(env, event) == ["Environment._queue as a list of (time, priority, id, event)"]


def _model(env: simpy.Environment, log: list[tuple[float, str]],
           start: Callable[[simpy.Environment, Generator[simpy.Event, object, None]], object]) -> None:
    """Processes that wait on timeouts, on each other, on a shared event (also fired in
    place), on a resource, and on a failed event they catch."""
    gate = env.event()
    res = simpy.Resource(env, capacity=1)

    def worker(k: int) -> Generator[simpy.Event, object, None]:
        yield env.timeout(0.5 * k)
        log.append((env.now, f"w{k} start"))
        with res.request() as req:
            yield req
            yield env.timeout(1.0)
        log.append((env.now, f"w{k} done"))
        if k == 1:
            fire_in_place(gate)
        yield gate
        log.append((env.now, f"w{k} through gate"))

    def failing() -> Generator[simpy.Event, object, None]:
        ev = env.event()
        ev.fail(ValueError("caught"))
        try:
            yield ev
        except ValueError:
            log.append((env.now, "caught"))
        yield env.timeout(0.25)
        log.append((env.now, "after failure"))

    for k in range(3):
        start(env, worker(k))
    start(env, failing())


@pytest.mark.parametrize("detached", [False, True])
def test_the_fast_run_gives_the_same_events_in_the_same_order(detached):
    def start(env: simpy.Environment, steps: Generator[simpy.Event, object, None]) -> object:
        return Detached(env, steps) if detached else env.process(steps)

    plain: list[tuple[float, str]] = []
    env = simpy.Environment()
    _model(env, plain, start)
    env.run()
    fast: list[tuple[float, str]] = []
    env2 = simpy.Environment()
    _model(env2, fast, start)
    run_until_empty(env2)
    assert fast == plain and len(plain) == 11
    assert env2.now == env.now
    assert events_scheduled(env2) == next(env._eid)


def test_detached_processes_keep_the_order_of_simpy_processes():
    def run(detached: bool) -> list[tuple[float, str]]:
        log: list[tuple[float, str]] = []
        env = simpy.Environment()
        _model(env, log, lambda e, s: Detached(e, s) if detached else e.process(s))
        run_until_empty(env)
        return log

    assert run(True) == run(False)


def test_an_undefused_failure_is_raised_as_simpy_raises_it():
    def model(env: simpy.Environment) -> None:
        env.event().fail(RuntimeError("nobody waits"))

    env = simpy.Environment()
    model(env)
    with pytest.raises(RuntimeError, match="nobody waits") as plain:
        env.run()
    env2 = simpy.Environment()
    model(env2)
    with pytest.raises(RuntimeError, match="nobody waits") as fast:
        run_until_empty(env2)
    assert type(fast.value.__cause__) is type(plain.value.__cause__) is RuntimeError


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_during_the_loop_and_left_as_found(enabled):
    seen: list[bool] = []
    env = simpy.Environment()
    env.timeout(1.0).callbacks.append(lambda _e: seen.append(gc.isenabled()))
    env.event().fail(RuntimeError("nobody waits"))
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with pytest.raises(RuntimeError):
            run_until_empty(env)
        assert gc.isenabled() is enabled
        run_until_empty(env)  # the timeout, after the failure
        assert seen == [False] and gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_no_other_module_touches_simpy_internals():
    root = Path(__file__).resolve().parent.parent / "mpsim"
    internal = re.compile(r"\._queue|\._now|\._ok|\._value|_defused|_eid")
    hits = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py") if internal.search(p.read_text()))
    assert hits == ["sim/simpy_fast.py"]


def test_go_on_now_only_when_nothing_else_is_queued_for_the_instant():
    env = simpy.Environment()
    seen: list[bool] = []
    env.timeout(1.0).callbacks.append(lambda _e: seen.append(go_on_now(env)))  # alone at t=1
    env.timeout(2.0).callbacks.append(lambda _e: seen.append(go_on_now(env)))  # t=2 has another
    env.timeout(2.0)
    run_until_empty(env)
    assert seen == [True, False]


def test_go_on_now_says_no_under_an_inner_firing():
    env = simpy.Environment()
    seen: list[bool] = []
    gate = env.event()
    gate.callbacks.append(lambda _e: seen.append(go_on_now(env)))
    call_inner(fire_in_place, gate)
    assert seen == [False] and go_on_now(env)


def test_a_marked_event_lets_its_process_go_on_at_once():
    env = simpy.Environment()
    log: list[str] = []

    def proc() -> Generator[simpy.Event, object, None]:
        ev = env.event()
        mark_processed(ev)
        value = yield ev
        log.append(f"on at {env.now} with {value}")

    Detached(env, proc())
    run_until_empty(env)
    assert log == ["on at 0 with None"] and events_scheduled(env) == 1  # the start only


def test_a_pause_of_the_collector_is_left_as_found_and_an_inner_one_leaves_it_to_the_outer():
    was = gc.isenabled()
    gc.enable()
    try:
        with pytest.raises(ValueError), gc_paused():
            with gc_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()  # the inner pause found it off and left it off
            raise ValueError("the block fails")
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
