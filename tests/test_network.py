"""Fluid links: exact completion times for transfers alone and sharing links max-min fairly."""

import pytest
import simpy

from mpsim.hardware.topology import Link, Route
from mpsim.sim.network import Network

GB = 1e9


def run_transfers(specs):
    """specs: list of (start_s, route, bytes). Returns completion times in order."""
    env = simpy.Environment()
    net = Network(env)
    done: list[float | None] = [None] * len(specs)

    def go(i, start, route, n):
        yield env.timeout(start)
        yield net.transfer(route, n)
        done[i] = env.now

    for i, (start, route, n) in enumerate(specs):
        env.process(go(i, start, route, n))
    env.run()
    return done, net


def test_alone_takes_latency_plus_bytes_over_bandwidth():
    link = Link("a", 10 * GB, 5e-6)
    (t,), _ = run_transfers([(0.0, Route((link,)), 10**9)])
    assert t == pytest.approx(5e-6 + 0.1, rel=1e-12)


def test_two_concurrent_transfers_each_get_half():
    link = Link("a", 10 * GB, 0.0)
    (t1, t2), _ = run_transfers([(0.0, Route((link,)), 10**9), (0.0, Route((link,)), 10**9)])
    assert t1 == pytest.approx(0.2, rel=1e-12)
    assert t2 == pytest.approx(0.2, rel=1e-12)


def test_rates_are_recomputed_when_a_transfer_joins_and_leaves():
    # A alone for 0.05 s moves 0.5 GB; then both share (5 GB/s each) until A's last 0.5 GB
    # lands at 0.15 s; B has 0.5 GB left and finishes alone at 0.2 s.
    link = Link("a", 10 * GB, 0.0)
    (ta, tb), _ = run_transfers([(0.0, Route((link,)), 10**9), (0.05, Route((link,)), 10**9)])
    assert ta == pytest.approx(0.15, rel=1e-12)
    assert tb == pytest.approx(0.20, rel=1e-12)


def test_max_min_fairness_gives_the_unconstrained_flow_the_rest():
    wide = Link("wide", 10 * GB, 0.0)
    narrow = Link("narrow", 2 * GB, 0.0)
    # B crosses the narrow link and gets 2 GB/s; A gets the 8 GB/s left on the wide one.
    (ta, tb), _ = run_transfers([(0.0, Route((wide,)), 8 * 10**8), (0.0, Route((wide, narrow)), 2 * 10**8)])
    assert ta == pytest.approx(0.1, rel=1e-12)
    assert tb == pytest.approx(0.1, rel=1e-12)


def test_link_bytes_are_accounted():
    link = Link("a", 10 * GB, 0.0)
    _, net = run_transfers([(0.0, Route((link,)), 123), (0.0, Route((link,)), 77)])
    assert net.bytes_by_link["a"] == 200


@pytest.mark.parametrize("b_bytes", [10**9, 10**8])
def test_a_flow_that_joins_alone_lands_on_time_whether_it_lands_before_or_after_the_others(b_bytes):
    # B starts on a link of its own while A flows: A keeps its rate and landing (0.1 s);
    # B lands after A (kept wake-up) or before it (a new one), at 0.01 s + its bytes' time.
    a, b = Link("a", 10 * GB, 0.0), Link("b", 10 * GB, 0.0)
    (ta, tb), net = run_transfers([(0.0, Route((a,)), 10**9), (0.01, Route((b,)), b_bytes)])
    assert ta == pytest.approx(0.1, rel=1e-12)
    assert tb == pytest.approx(0.01 + b_bytes / (10 * GB), rel=1e-12)
    assert net.busy_s_by_link["a"] == pytest.approx(0.1, rel=1e-12)
    assert net.busy_s_by_link["b"] == pytest.approx(b_bytes / (10 * GB), rel=1e-12)
