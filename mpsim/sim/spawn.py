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

from collections.abc import Generator

import simpy
from simpy.core import URGENT

Steps = Generator[simpy.Event, object, None]


class _Spawned:
    __slots__ = ("_steps",)

    def __init__(self, env: simpy.Environment, steps: Steps) -> None:
        self._steps = steps
        start = simpy.Event(env)
        start._ok = True
        start._value = None
        start.callbacks.append(self._resume)
        env.schedule(start, URGENT)

    def _resume(self, event: simpy.Event) -> None:
        """Send the event's value in (throw its failure), and wait on what comes next."""
        steps = self._steps
        while True:
            try:
                if event._ok:
                    event = steps.send(event._value)
                else:
                    event._defused = True
                    event = steps.throw(event._value)
            except StopIteration:
                return
            if event.callbacks is not None:  # not processed yet: wait for it
                event.callbacks.append(self._resume)
                return


def spawn(env: simpy.Environment, steps: Steps) -> None:
    """Run ``steps`` as a process that nobody waits on."""
    _Spawned(env, steps)
