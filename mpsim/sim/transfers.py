"""Copies on an otherwise idle server, through the same links and fluid model as a run.

``copy_times`` starts every copy at time 0 and returns when each lands, so users (``mpsim
topo transfer``) and tests can see what contention alone costs: two GPUs behind one PCIe
switch sharing its uplink, or a striped D2D copy over several NVLink routes. Effective
bandwidth grows with size because each copy pays its route's setup latency once (MPress
Fig. 4 shows the same rise).
"""

from __future__ import annotations

from dataclasses import dataclass

import simpy

from mpsim.hardware.topology import Endpoint, Topology
from mpsim.sim.network import Network


@dataclass(frozen=True)
class Copy:
    src: Endpoint
    dst: Endpoint
    n_bytes: int


@dataclass(frozen=True)
class CopyTimes:
    landed_s: list[float]
    """When each copy's last byte landed, in the order given."""
    bytes_by_link: dict[str, int]


def copy_times(topo: Topology, copies: list[Copy]) -> CopyTimes:
    env = simpy.Environment()
    net = Network(env)
    landed = [0.0] * len(copies)

    def one(i: int, c: Copy):
        yield net.transfer(topo.route(c.src, c.dst), c.n_bytes)
        landed[i] = env.now

    for i, c in enumerate(copies):
        env.process(one(i, c))
    env.run()
    return CopyTimes(landed, {k: int(v) for k, v in sorted(net.bytes_by_link.items())})
