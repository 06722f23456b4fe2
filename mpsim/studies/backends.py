"""Where many independent points run: a local process pool or a Ray cluster.

``run_points(points, fn, backend=..., on_result=..., batch=...)`` calls ``fn(point)`` for
every point and yields an :class:`Outcome` per point as its batch finishes, in the order
they finish. ``fn`` must be a module-level function (it is pickled by reference), and its
result picklable. Both backends guarantee:

- every point is yielded exactly once: with its value, or with the error ``fn`` raised
  (one failing point does not stop the others, nor the rest of its batch);
- points are sent in batches (``batch`` points per task), so scheduling costs per task,
  not per point; a batch's outcomes come back together;
- a worker that dies in the middle of a batch (killed, out of host memory) loses
  nothing: the whole batch runs again elsewhere, and since outcomes are only taken from
  batches that completed, none is yielded twice. After ``RETRIES`` deaths of the same
  batch its points are yielded as failed;
- the same ``fn`` on the same point gives the same value on either backend (mpsim's
  simulations have no randomness and no wall clock in their results).

Interruption (KeyboardInterrupt, or any exception raised while the caller handles an
outcome) stops everything at once: on the local pool the queued batches are cancelled
and the workers terminated; on a Ray cluster the outstanding tasks are cancelled (force,
which kills the workers running them), and a Ray instance the backend started itself is
shut down with its tasks. Only the batches in flight are lost; the exception propagates
to the caller.
"""

from __future__ import annotations

import atexit
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import closing, contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any, Generic, Protocol, TypeVar

from mpsim.errors import MpsimError

P = TypeVar("P")
R = TypeVar("R")

RETRIES = 3  # deaths of one batch's worker before its points are reported failed
MAX_AUTO_BATCH = 8  # points per task when the caller does not choose


@dataclass(frozen=True)
class Outcome(Generic[P, R]):
    """One point's result: ``value`` when ``fn`` returned, ``error`` ("Type: message") when it raised."""

    point: P
    value: R | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def run_batch(fn: Callable[[Any], Any], batch: list[Any]) -> list[tuple[Any, str | None]]:
    """In a worker: ``fn`` on each point of a batch, an exception becoming that point's error."""
    out: list[tuple[Any, str | None]] = []
    for point in batch:
        try:
            out.append((fn(point), None))
        except Exception as exc:  # noqa: BLE001 - a failing point is an outcome, not a crash
            out.append((None, f"{type(exc).__name__}: {exc}"))
    return out


def _outcomes(batch: list[Any], results: list[tuple[Any, str | None]]) -> list[Outcome]:
    return [Outcome(p, value, error) for p, (value, error) in zip(batch, results)]


def _failed(batch: list[Any], why: str) -> list[Outcome]:
    return [Outcome(p, None, why) for p in batch]


class Backend(Protocol):
    """Runs batches of points; yields each batch's outcomes as the batch finishes."""

    name: str
    threads: bool
    """Whether calls from several threads at once may share it (``fits`` overlaps its rounds)."""

    def slots(self) -> int:
        """How many batches can run at once (to size the batches)."""
        ...

    def run_batches(self, batches: list[list[Any]], fn: Callable[[Any], Any]) -> Generator[list[Outcome], None, None]:
        ...

    def abort(self) -> None:
        """Stop all work now, from any thread: the calls under way end, and later ones fail
        with an ``MpsimError`` (an interrupted study stops at once)."""
        ...

    def close(self) -> None:
        """End what it keeps between calls, waiting for it (a study's last step: a pool left
        to the interpreter's exit may be torn down while the exit wakes it)."""
        ...


def _worker_init(parent: int) -> None:
    """In each local worker: Ctrl-C is the parent's to handle (it terminates the workers),
    and a worker whose parent (pid ``parent``) is gone, by ``kill -9`` even before this
    worker started, exits instead of running on alone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="mpsim-parent-watch").start()
    atexit.register(_end_worker)


def _end_worker() -> None:
    """A local worker's last act at its exit, after multiprocessing has sent its last
    messages (its queues are flushed before the interpreter exits): end the process now,
    without tearing down its caches (freeing them one object at a time took most of a
    second after a long study, which ``close`` waited for)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn() -> multiprocessing.context.BaseContext:
    # spawn, not fork: forking a process with threads (the progress bar's, the pool's) is
    # unsafe and warns from Python 3.12 on; nor forkserver: its workers are not the
    # caller's children, so they could not tell when it is killed
    return multiprocessing.get_context("spawn")


MANAGER_WAIT_S = 10.0
"""The longest a stopped pool's manager thread is waited for (``_stop_pool``)."""


def _stop_pool(pool: ProcessPoolExecutor) -> None:
    """Terminate the workers now and let the pool drop its queued batches (the batches in
    flight are lost). The pool's own manager thread cancels the queued ones or, having seen
    its workers die, fails them: a future cancelled from here meanwhile made Python
    3.11's manager thread fail (``InvalidStateError`` in ``terminate_broken``) and could
    leave the process hanging at its exit.

    The pool's table of workers and its manager thread are taken before ``shutdown``, which
    drops both (the manager thread was looked up after it, so never waited for): a worker
    that another thread's ``submit`` starts meanwhile (fits' search threads submit while
    the main thread stops the pool) lands in that table, and is terminated too once
    ``shutdown`` has returned, after which no submit starts one. Left running, such a
    worker would keep the pool's call queue open, and the interpreter's exit wait for it
    (``_starting_workers``)."""
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        table: dict[int, Any] = getattr(pool, "_processes", None) or {}
        manager = getattr(pool, "_executor_manager_thread", None)
        for proc in list(table.values()):
            proc.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        procs = list(table.values())  # those above, and any a submit started meanwhile
        for proc in procs:
            proc.terminate()
        deadline = time.monotonic() + 1.0
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        # the pool's manager thread ends once it has seen its workers gone and closed its
        # wake-up pipe: wait for that here (seconds on a busy machine), since the
        # interpreter's exit writes to that pipe unguarded and fails if it closes meanwhile
        if manager is not None and manager is not threading.current_thread():
            manager.join(MANAGER_WAIT_S)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


STOP_CHECK_S = 0.1
"""How long the main thread waits for batches with Ctrl-C and SIGTERM held (``_finished``)."""


def _finished(pending: Iterable[Future]) -> set[Future]:
    """The futures of ``pending`` done within a moment (at least one, unless none is by
    then). In the main thread, Ctrl-C and SIGTERM are held while it waits (for at most
    ``STOP_CHECK_S``, then delivered): one that landed inside ``concurrent.futures.wait``
    could leave its waiter's lock held, and the pool's manager thread, failing the
    futures as the pool stops, then waited for that lock forever, so the process hung
    at its exit (Python 3.11; seen beside two busy loops)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        return wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)[0]
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        return wait(pending, timeout=STOP_CHECK_S, return_when=FIRST_COMPLETED)[0]
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


class LocalBackend:
    """Worker processes on this machine (spawned, one per ``workers``); ``workers=1`` runs
    the points in this process, one after the other. The pool is kept from one
    ``run_batches`` to the next (a study's rounds reuse its warm workers and their caches)
    and ends with the backend (``close``, or when the backend is collected). A worker that
    dies breaks the pool: a fresh pool runs the unfinished batches again; an interruption
    terminates the pool, and the next call starts a fresh one. No dependency beyond the
    standard library."""

    name = "local"

    def __init__(self, workers: int = 1):
        if workers < 1:
            raise MpsimError(f"workers must be a positive integer, got {workers}")
        self.workers = workers
        self.threads = workers > 1
        """Worker processes take calls from several threads; one worker runs them in the caller."""
        self._pool: ProcessPoolExecutor | None = None
        self._aborted = False

    def abort(self) -> None:
        self._aborted = True
        pool, self._pool = self._pool, None
        if pool is not None:
            _stop_pool(pool)

    def close(self) -> None:
        """End the kept pool (its idle workers exit)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _kept_pool(self) -> ProcessPoolExecutor:
        if self._aborted:
            raise MpsimError("the work was stopped")
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=_spawn(), initializer=_worker_init,
                                             initargs=(os.getpid(),))
        return self._pool

    def slots(self) -> int:
        return self.workers

    def run_batches(self, batches: list[list[Any]], fn: Callable[[Any], Any]) -> Generator[list[Outcome], None, None]:
        if self.workers == 1 or (len(batches) <= 1 and threading.current_thread() is threading.main_thread()):
            # one batch asked from the main thread runs in it (no pickling; its caches); from
            # another thread (fits' search chains) it goes to a worker, so that the threads do
            # not take turns on this process's interpreter lock
            for batch in batches:
                yield _outcomes(batch, run_batch(fn, batch))
            return
        todo = list(batches)
        deaths = [0] * len(batches)
        index = {id(b): i for i, b in enumerate(batches)}
        while todo:
            broken: list[list[Any]] = []
            yield from self._one_pool(todo, fn, broken)
            todo = []
            for batch in broken:
                i = index[id(batch)]
                deaths[i] += 1
                if deaths[i] >= RETRIES:
                    yield _failed(batch, f"worker died {RETRIES} times running this batch")
                else:
                    todo.append(batch)

    def _one_pool(self, batches: list[list[Any]], fn: Callable[[Any], Any],
                  broken: list[list[Any]]) -> Generator[list[Outcome], None, None]:
        """Run ``batches`` on the kept pool; those lost when a worker died go to ``broken``
        (the pool is then dropped: the next round starts a fresh one)."""
        pool = self._kept_pool()
        try:
            pending = self._submit(pool, batches, fn)
            while pending:
                finished = _finished(pending)
                for fut in finished:
                    batch = pending.pop(fut)
                    try:
                        results = fut.result()
                    except BrokenProcessPool:
                        broken.append(batch)
                        continue
                    yield _outcomes(batch, results)
            if broken:
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
        except BaseException:
            self._pool = None
            _stop_pool(pool)
            raise

    @staticmethod
    def _submit(pool: ProcessPoolExecutor, batches: list[list[Any]],
                fn: Callable[[Any], Any]) -> dict[Future, list[Any]]:
        # the workers start at the first submit (``_starting_workers``)
        with _starting_workers():
            return {pool.submit(run_batch, fn, batch): batch for batch in batches}


@contextmanager
def _starting_workers() -> Iterator[None]:
    """Around the main thread's submits, which start the workers: SIGINT blocked, so the
    workers start with it blocked (a Ctrl-C to the group cannot hit one still importing),
    and SIGINT and SIGTERM only noted, then delivered to their handlers as the block ends.
    A handler that raised in the middle of starting a worker left a worker that never got
    its start-up data and was in no table: it held the pool's call queue open, and the
    process hung at its exit. Blocking alone does not hold a signal off while other
    threads run (fits' searches): the kernel hands it to a thread that does not block it,
    and Python runs the handler in the main thread all the same."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []

    def note(signum: int, frame: FrameType | None) -> None:
        noted.append(signum)

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(sig) not in (signal.SIG_IGN, None)}
    masked = hasattr(signal, "pthread_sigmask")
    if masked:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        if masked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if noted:
            signal.raise_signal(noted[0])


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise MpsimError("the ray backend needs Ray: pip install 'mpsim[ray]'") from None
    return ray


class RayBackend:
    """Tasks on a Ray cluster: ``address`` "auto" (the cluster this machine belongs to,
    as ``ray start`` made it), "HOST:PORT" (a head node's GCS address), or None (an
    instance already initialised in this process, else a new one on this machine with
    ``num_cpus`` CPUs, shut down at the end). Every worker needs mpsim installed. A task
    whose worker dies is retried by Ray (``RETRIES`` times); each batch's outcomes are
    taken once, from the one run that completed."""

    name = "ray"
    threads = False
    """Each call starts and ends its own instance when none is running."""

    def __init__(self, address: str | None = None, num_cpus: int | None = None):
        self.address, self.num_cpus = address, num_cpus

    def abort(self) -> None:
        """Nothing to do from another thread: the interrupted call cancels its own tasks."""

    def close(self) -> None:
        """Nothing kept: each call ends the instance it started."""

    def _start(self, ray: Any) -> bool:
        """Connect (or start a local instance); whether this backend started it."""
        if ray.is_initialized():
            return False
        kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, logging_level="WARNING")
        if self.address is None:  # "local": a new instance even where `ray start` left one running
            kwargs.update(num_cpus=self.num_cpus)
        main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGTERM) if main else None
        ray.init(address=self.address or "local", **kwargs)
        if main:  # ray.init installs its own SIGTERM handler: the caller's stays in charge
            signal.signal(signal.SIGTERM, previous)
        return True

    def slots(self) -> int:
        ray = _ray()
        if ray.is_initialized():
            return max(1, int(ray.cluster_resources().get("CPU", 1)))
        return self.num_cpus or os.cpu_count() or 1

    def run_batches(self, batches: list[list[Any]], fn: Callable[[Any], Any]) -> Generator[list[Outcome], None, None]:
        ray = _ray()
        owned = self._start(ray)
        remote = ray.remote(max_retries=RETRIES, retry_exceptions=False)(run_batch)
        pending: dict[Any, list[Any]] = {}
        try:
            fn_ref = ray.put(fn)
            pending = {remote.remote(fn_ref, batch): batch for batch in batches}
            while pending:
                finished, _ = ray.wait(list(pending), num_returns=1, timeout=0.2)
                for ref in finished:
                    batch = pending.pop(ref)
                    yield self._collect(ray, ref, batch)
        except BaseException:
            if not owned:  # an instance of our own goes down whole below, its tasks with it
                _cancel_all(ray, list(pending))
            raise
        finally:
            if owned:
                ray.shutdown()

    @staticmethod
    def _collect(ray: Any, ref: Any, batch: list[Any]) -> list[Outcome]:
        try:
            return _outcomes(batch, ray.get(ref))
        except ray.exceptions.RayError as exc:  # the retries spent: worker deaths, a lost node
            return _failed(batch, f"{type(exc).__name__}: {str(exc).splitlines()[0]}")


CANCEL_WAIT_S = 10.0
"""How long a closed Ray run keeps cancelling the tasks that have not ended."""


def _cancel_all(ray: Any, refs: list[Any]) -> None:
    """Force-cancel ``refs``, again every half second for those not yet ended, for at most
    ``CANCEL_WAIT_S``: a cancel that reaches a task while its worker is still being leased
    or started can be lost, and the task would then run to its end on the cluster's CPUs."""
    deadline = time.monotonic() + CANCEL_WAIT_S
    while refs:
        for ref in refs:
            ray.cancel(ref, force=True)
        if time.monotonic() >= deadline:
            return
        _, refs = ray.wait(refs, num_returns=len(refs), timeout=0.5)


def make_backend(name: str = "local", workers: int = 1, address: str | None = None) -> Backend:
    """A backend by its CLI name: ``local`` with ``workers`` processes, or ``ray`` at ``address``
    (``workers`` is then the CPUs of a Ray instance started here, when ``address`` is None)."""
    if name == "local":
        if address is not None:
            raise MpsimError("--address is for --backend ray")
        return LocalBackend(workers)
    if name == "ray":
        _ray()
        return RayBackend(address, num_cpus=workers if workers > 1 else None)
    raise MpsimError(f"unknown backend {name!r}: expected local or ray")


def backend_for(name: str = "local", workers: int = 1, address: str | None = None) -> Backend | None:
    """``make_backend``, or None (run in this process) for one local worker."""
    return None if name == "local" and workers == 1 else make_backend(name, workers, address)


def auto_batch(n_points: int, slots: int) -> int:
    """Points per task: about four tasks per slot (so a slow batch does not leave the others
    idle at the end), at most ``MAX_AUTO_BATCH``."""
    return max(1, min(MAX_AUTO_BATCH, math.ceil(n_points / (4 * max(1, slots)))))


def run_points(points: Iterable[P], fn: Callable[[P], R], backend: Backend | None = None,
               on_result: Callable[[Outcome[P, R]], None] | None = None,
               batch: int | None = None) -> Generator[Outcome[P, R], None, None]:
    """``fn`` on every point, on ``backend`` (default: this process); yields each point's
    :class:`Outcome` as its batch finishes, after ``on_result(outcome)``. Use it as a
    context (``contextlib.closing``) or drain it: closing it early stops the backend's work."""
    todo = list(points)
    backend = backend or LocalBackend(1)
    size = batch or auto_batch(len(todo), backend.slots())
    if size < 1:
        raise MpsimError(f"batch must be a positive integer, got {size}")
    batches = [todo[i:i + size] for i in range(0, len(todo), size)]
    if not batches:
        return
    with closing(backend.run_batches(batches, fn)) as finished:
        for outcomes in finished:
            for outcome in outcomes:
                if on_result:
                    on_result(outcome)
                yield outcome
