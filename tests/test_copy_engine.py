"""Copy engines (mpsim.sim.copy_engine): a pool keeps ``simpy.Resource``'s event order,
requests granted in place included; host copies run as callbacks keep the process's."""

from __future__ import annotations

from collections.abc import Callable, Generator

import pytest
import simpy

from mpsim.hardware.topology import Link, Route
from mpsim.plans.job import job_of
from mpsim.sim import Job
from mpsim.sim.context import RunContext
from mpsim.sim.copy_engine import EnginePool
from mpsim.sim.layout import resolve
from mpsim.sim.network import Network
from mpsim.sim.simpy_fast import Detached, Steps, call_soon, events_scheduled, run_until_empty, sleep

Log = list[tuple[float, str]]


def _model(env: simpy.Environment, pool: object, log: Log) -> None:
    """Users that ask at once, at the same later instant, and alone; each holds the
    engine a while and logs when it gets it and gives it back."""

    def user(name: str, at_s: float, hold_s: float) -> Generator[simpy.Event, object, None]:
        if at_s:
            yield sleep(env, at_s)
        with pool.request() as req:  # type: ignore[attr-defined]
            yield req
            log.append((env.now, f"{name} granted"))
            yield sleep(env, hold_s)
        log.append((env.now, f"{name} released"))

    for name, at_s, hold_s in (("a", 0.0, 1.0), ("b", 0.0, 0.5), ("c", 1.0, 0.25), ("d", 3.0, 1.0),
                               ("e", 5.0, 0.0), ("f", 5.0, 1.0)):
        Detached(env, user(name, at_s, hold_s))


@pytest.mark.parametrize("capacity", [1, 2])
def test_the_pool_grants_in_the_order_of_a_simpy_resource(capacity):
    def run(make: Callable[[simpy.Environment], object]) -> Log:
        env = simpy.Environment()
        log: Log = []
        _model(env, make(env), log)
        run_until_empty(env)
        return log

    assert run(lambda env: EnginePool(env, capacity)) == run(lambda env: simpy.Resource(env, capacity))


def test_a_free_engine_at_a_quiet_instant_is_granted_without_an_event():
    env = simpy.Environment()
    pool = EnginePool(env, 1)
    req = pool.request()
    assert req.processed and pool.users == [req] and events_scheduled(env) == 0


def _one_link() -> tuple[simpy.Environment, Network, Route, Log, Callable[[str, int], Steps]]:
    """A network of one link (1 GB/s, 1 us), the log of landings, and a copy over the link
    that waits on its transfer's event and logs (time, name) when it lands."""
    env = simpy.Environment()
    net = Network(env)
    route = Route((Link("l", 1e9, 1e-6),))
    landed: Log = []

    def copy(name: str, n_bytes: int) -> Generator[simpy.Event, object, None]:
        yield net.transfer(route, n_bytes)
        landed.append((env.now, name))

    return env, net, route, landed, copy


def test_a_landing_that_is_the_next_event_fires_in_place_and_keeps_the_times():
    env, _, _, landed, copy = _one_link()
    Detached(env, copy("small", 1000))
    Detached(env, copy("large", 3000))
    run_until_empty(env)
    assert [name for _, name in landed] == ["small", "large"]
    assert landed[0][0] == pytest.approx(1e-6 + 2000 / 1e9)
    assert landed[1][0] == pytest.approx(1e-6 + 4000 / 1e9)


def _host_copies(callbacks: bool) -> Log:
    """Three host copies (two on one GPU's d2h engine, one h2d), started at once, as
    callbacks or as processes: when each lands, and its span."""
    ctx = RunContext(resolve(Job(job_of("dgx1-v100", "gpt-5.3b"))))  # nothing run yet
    env = ctx.env
    log: Log = []

    def copy(k: int, gpu: int, n_bytes: int, to_host: bool) -> None:
        def landed() -> None:
            log.append((env.now, f"copy {k}"))

        def steps() -> Generator[simpy.Event, object, None]:
            yield from ctx.host_copy(gpu, n_bytes, to_host, f"c{k}")
            landed()

        if callbacks:
            call_soon(env, lambda _e: ctx.start_host_copy(gpu, n_bytes, to_host, f"c{k}", landed))
        else:
            Detached(env, steps())

    for k, (gpu, n_bytes, to_host) in enumerate(((0, 1 << 20, True), (0, 1 << 22, True), (1, 1 << 21, False))):
        copy(k, gpu, n_bytes, to_host)
    run_until_empty(env)
    return log + [(s.start_s, s.name) for s in ctx.spans]


def test_a_host_copy_as_callbacks_keeps_the_process_version_s_order_and_times():
    by_callbacks = _host_copies(True)
    assert by_callbacks == _host_copies(False) and len(by_callbacks) == 6


def test_a_transfer_with_a_callback_lands_in_the_place_of_a_transfers_event():
    """``Network.transfer_then`` calls back where ``transfer``'s event would be processed:
    copies of both kinds, some landing together, log the same times and order as copies
    that all wait on events."""

    def run(callbacks: bool) -> Log:
        env, net, route, landed, copy = _one_link()

        def copy_then(name: str, n_bytes: int) -> Callable[[simpy.Event], None]:
            def land(_event: simpy.Event | None) -> None:
                landed.append((env.now, name))

            return lambda _e: net.transfer_then(route, n_bytes, land)

        for i, n_bytes in enumerate((1000, 1000, 3000, 0, 2000)):
            name = f"copy {i}"
            if callbacks and i % 2:
                call_soon(env, copy_then(name, n_bytes))
            else:
                Detached(env, copy(name, n_bytes))
        run_until_empty(env)
        return landed

    assert run(True) == run(False)


def test_a_holder_is_granted_without_events_as_it_asks_and_by_the_release():
    """``EnginePool.take``: a free engine is granted at once, even with other events
    queued for the instant; a queued holder gets the engine from the release itself."""
    env = simpy.Environment()
    pool = EnginePool(env, 1)
    granted: list[str] = []

    class Holder:
        def __init__(self, name: str) -> None:
            self.name = name

        def granted(self, _event: simpy.Event | None) -> None:
            granted.append(self.name)

    sleep(env, 0.0)  # an event queued for this instant
    first, second = Holder("first"), Holder("second")
    assert pool.take(first) and not pool.take(second)
    assert pool.users == [first] and granted == []
    pool.release(first)
    assert pool.users == [second] and granted == ["second"] and events_scheduled(env) == 1
