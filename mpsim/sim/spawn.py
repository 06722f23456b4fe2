"""Fire-and-forget processes: copies and sends that nobody waits for as a whole.

``spawn`` runs a generator the way ``simpy.Environment.process`` does, with the same
events in the same order (it starts through an urgent event scheduled in the instant it
is spawned, and resumes on each event it yields, at once when that event has already
been processed), but without SimPy's end-of-process event: nothing waits on these
processes, so that event would only be popped and dropped. Leaving it out changes no
other event's place in the queue (SimPy orders by time, priority, then scheduling
order), so a run's results are unchanged; it is one event fewer per copy or send.
"""

from __future__ import annotations

import simpy

from mpsim.sim.simpy_fast import Detached, Steps


def spawn(env: simpy.Environment, steps: Steps) -> None:
    """Run ``steps`` as a process that nobody waits on (``simpy_fast.Detached``)."""
    Detached(env, steps)
