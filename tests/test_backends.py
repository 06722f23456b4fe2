"""Backends: every point once, errors as outcomes, a dead worker's batch run again, the
same rows on the local pool and on Ray (a Ray instance on this machine, 2 CPUs)."""

import csv
import os
import signal
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest

from mpsim.errors import MpsimError
from mpsim.studies.backends import LocalBackend, Outcome, RayBackend, auto_batch, run_points
from mpsim.studies.sweep import FIELDS, KEY, grid, sweep

TESTS = Path(__file__).parent


def square_or_fail(point: int) -> int:
    if point == 3:
        raise ValueError("three is refused")
    return point * point


def die_once(point: tuple[int, str]) -> int:
    """The first call for point 2 kills its own worker (SIGKILL): the batch must run again."""
    value, marker_dir = point
    if value == 2:
        try:
            fd = os.open(Path(marker_dir) / "died", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass
        else:
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)
    return value * 10


def worker_pid(point: int) -> int:
    import os
    import time

    time.sleep(0.05)  # long enough that both workers take a batch
    return os.getpid()


def test_a_local_backend_keeps_its_workers_from_one_run_to_the_next_until_closed():
    """A study's rounds (fits: the sizes, then the searches) run on the same warm workers."""
    import os

    backend = LocalBackend(2)
    first = {o.value for o in run_points(range(8), worker_pid, backend, batch=1)}
    second = {o.value for o in run_points(range(8), worker_pid, backend, batch=1)}
    assert first == second and os.getpid() not in first and len(first) == 2
    backend.close()
    third = {o.value for o in run_points(range(8), worker_pid, backend, batch=1)}
    assert not third & first  # a fresh pool after close
    backend.close()


class _WritesAtTeardown:
    """Writes a file when freed: at a worker's teardown, if the worker tears down."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __del__(self) -> None:
        Path(self.path).write_text("torn down")


_KEPT: list[_WritesAtTeardown] = []


def keep_till_exit(point: tuple[int, str]) -> int:
    """Holds, in a module global of the worker, an object that marks its teardown."""
    value, marker_dir = point
    _KEPT.append(_WritesAtTeardown(str(Path(marker_dir) / f"freed-{os.getpid()}")))
    return value


def test_closed_workers_exit_at_once_without_freeing_their_caches(tmp_path):
    """``close`` ends the idle workers after their results are in; a worker then ends its
    process without tearing down what it holds (after a long study, freeing its caches
    object by object took most of a second that ``close`` waited for)."""
    backend = LocalBackend(2)
    got = sorted(o.value or 0 for o in run_points([(k, str(tmp_path)) for k in range(8)], keep_till_exit, backend,
                                                  batch=1))
    pool = backend._pool
    assert pool is not None
    procs = list(pool._processes.values())
    backend.close()
    assert got == list(range(8))
    assert all(not p.is_alive() and p.exitcode == 0 for p in procs)
    assert not list(tmp_path.glob("freed-*"))


def _check_once(outcomes: list[Outcome], n: int) -> None:
    values = sorted(o.point[0] if isinstance(o.point, tuple) else o.point for o in outcomes)
    assert values == list(range(n)), "every point exactly once"


@pytest.mark.parametrize("workers", [1, 2])
def test_every_point_once_and_errors_are_outcomes(workers):
    seen: list[Outcome] = []
    got = list(run_points(range(7), square_or_fail, LocalBackend(workers), on_result=seen.append, batch=2))
    assert got == seen
    _check_once(got, 7)
    by_point = {o.point: o for o in got}
    assert by_point[3].error == "ValueError: three is refused" and not by_point[3].ok
    assert all(by_point[i].value == i * i for i in range(7) if i != 3)


def test_auto_batch_keeps_tasks_per_worker_and_a_cap():
    assert auto_batch(1000, 2) == 8 and auto_batch(10, 2) == 2 and auto_batch(1, 8) == 1


@pytest.mark.processes
def test_a_local_worker_that_dies_has_its_batch_run_again(tmp_path):
    points = [(i, str(tmp_path)) for i in range(6)]
    got = list(run_points(points, die_once, LocalBackend(2), batch=2))
    assert (tmp_path / "died").exists()
    _check_once(got, 6)
    assert all(o.ok and o.value == o.point[0] * 10 for o in got)


@pytest.fixture(scope="module")
def ray_local():
    """A Ray instance on the loopback interface with 2 CPUs, for this module; its workers
    import this test module (for die_once) from tests/."""
    ray = pytest.importorskip("ray")
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS)] + ([previous] if previous else []))
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False, logging_level="WARNING")
    finally:
        if previous is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = previous
    yield ray
    ray.shutdown()


def _sweep_points():
    return grid(["dgx1-v100"], ["gpt-5.3b"], "1f1b", [1, 2, 4], [16], ["none", "recompute"])


def _rows_without_timing(path: Path) -> list[list[str]]:
    """The CSV's lines as written, sorted by point, without plan_s (a wall-clock time)."""
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == FIELDS
    keep = [i for i, name in enumerate(FIELDS) if name != "plan_s"]
    return sorted([row[i] for i in keep] for row in rows[1:])


@pytest.mark.ray
def test_ray_gives_the_local_pools_rows_bit_for_bit(tmp_path, ray_local):
    sweep(_sweep_points(), tmp_path / "local.csv", workers=2)
    sweep(_sweep_points(), tmp_path / "ray.csv", backend=RayBackend(), batch=2)
    local, on_ray = _rows_without_timing(tmp_path / "local.csv"), _rows_without_timing(tmp_path / "ray.csv")
    assert len(local) == 6 and local == on_ray


@pytest.mark.ray
def test_ray_errors_are_outcomes_and_a_dead_worker_loses_nothing(tmp_path, ray_local):
    got = list(run_points(range(5), square_or_fail, RayBackend(), batch=2))
    _check_once(got, 5)
    assert [o.error for o in got if not o.ok] == ["ValueError: three is refused"]
    dying = [(i, str(tmp_path)) for i in range(8)]
    died = list(run_points(dying, die_once, RayBackend(), batch=2))
    assert (tmp_path / "died").exists()
    _check_once(died, 8)
    assert all(o.ok and o.value == o.point[0] * 10 for o in died)


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


def _descends_from_this_process(pid: int) -> bool:
    while pid > 1:
        try:
            pid = _parent(pid)
        except (OSError, ValueError):
            return False
        if pid == os.getpid():
            return True
    return False


def _busy_ray_workers() -> list[int]:
    """Workers of this test's Ray instance (its raylet is our child) running one of our
    batches (Ray titles them by the task); other users' Ray workers are left alone."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if cmd.startswith(b"ray::run_batch") and _descends_from_this_process(int(d.name)):
                pids.append(int(d.name))
    return pids


@pytest.mark.ray
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds Ray's workers in /proc")
def test_a_ray_worker_killed_mid_sweep_loses_no_point_and_writes_none_twice(tmp_path, ray_local):
    """Once the first row is in, a watcher thread kills the first worker it sees running a batch."""
    import threading

    killed: list[int] = []
    first_row, finished = threading.Event(), threading.Event()

    def watch() -> None:
        first_row.wait()
        while not killed and not finished.is_set():
            for pid in _busy_ray_workers()[:1]:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # 64 microbatches: points of a few tenths of a second, so a batch is running when the watcher looks
    points = grid(["dgx1-v100"], ["gpt-5.3b"], "1f1b", [1, 2, 4, 8], [64], ["none", "recompute"])
    try:
        frame = sweep(points, tmp_path / "s.csv", backend=RayBackend(), batch=1,
                      on_row=lambda row, resumed: first_row.set())
    finally:
        finished.set()
        first_row.set()
        watcher.join()
    assert killed, "no busy Ray worker found to kill"
    assert len(frame) == len(points) and not frame.duplicated(list(KEY)).any()
    with (tmp_path / "s.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(points)


@pytest.mark.ray
def test_closing_a_ray_run_early_cancels_its_outstanding_tasks(ray_local):
    # Six tasks of 300 s on 2 CPUs: were any left running, a task submitted after the close
    # would wait 300 s for a CPU. (Ray's available_resources is a report the GCS updates when
    # it hears from the raylet, so it is not asked here.)
    outcomes = run_points([0.0] + [300.0] * 6, time.sleep, RayBackend(), batch=1)
    with closing(outcomes):
        first = next(outcomes)
    assert first.ok
    both = ray_local.remote(num_cpus=2)(lambda: None).remote()
    ready, _ = ray_local.wait([both], timeout=120)
    assert ready, "the cancelled tasks still hold the CPUs"


def test_fits_in_parallel_gives_the_same_reports_as_in_one_process():
    from mpsim.studies.capacity import fits_strategies

    args = ("dgx1-v100", "gpt", "1f1b", 2, 16, ("recompute", "none"))
    one = [r.to_dict() for r in fits_strategies(*args)]
    seen: list[str] = []
    two = [r.to_dict() for r in fits_strategies(*args, backend=LocalBackend(2), on_point=seen.append)]
    assert one == two
    assert len(seen) == 2 * 5 + 2 and "recompute: search" in seen


def test_best_search_with_its_planners_in_parallel_gives_the_same_report():
    """With a backend, each probe of ``best``'s search runs its single planners in worker
    processes and combines them in this one: the same largest, plan and times as
    ``plan_best`` run whole in one process."""
    from mpsim.studies.capacity import fits_strategies

    args = ("gtx1080ti-x1", "gpt", "1f1b", 2, 4, ("recompute", "best"))
    one = fits_strategies(*args)
    seen: list[str] = []
    two = fits_strategies(*args, backend=LocalBackend(2), on_point=seen.append)
    assert [r.to_dict() for r in one] == [r.to_dict() for r in two]
    recompute, best = one[0].largest, one[1].largest
    assert recompute is not None and best is not None and best.layers > recompute.layers
    assert two[1].largest is not None and two[1].largest.result.strategy == best.result.strategy
    assert seen[-1] == "best: search" and seen.count("best: search") == 1


def test_best_plans_the_size_a_single_planner_reached_beside_its_first_probe(monkeypatch):
    """``best``'s search on a backend starts at the largest size a single planner reached
    (MPress's 111 layers on the four TITAN RTX) and asks whether one layer more fits; the
    full plan of that size, where the search ends here, is made beside that probe on a
    thread of its own (``plan_ahead``): the same reports as in one process."""
    import mpsim.studies.capacity as capacity

    ahead: list[int] = []
    plan_ahead = capacity._Search.plan_ahead

    def noted(self: capacity._Search, n: int) -> None:
        ahead.append(n)
        plan_ahead(self, n)

    args = ("titanrtx-x4-pcie", "gpt", "1f1b", 2, 8, ("mpress", "best"))
    one = capacity.fits_strategies(*args)
    monkeypatch.setattr(capacity._Search, "plan_ahead", noted)
    two = capacity.fits_strategies(*args, backend=LocalBackend(2))
    assert [r.to_dict() for r in one] == [r.to_dict() for r in two]
    mpress, best = one[0].largest, one[1].largest
    assert mpress is not None and best is not None and best.layers == mpress.layers
    assert ahead == [mpress.layers]


def test_best_alone_in_parallel_plans_each_sizes_parts_at_once_and_gives_the_same_report():
    """With no single strategy asked there is nothing to reuse: each shipped size runs
    ``best``'s parts in parallel (keeping everything first, the rest where that does not
    fit), and the rows, the largest and its plan are those of one process."""
    from mpsim.studies.capacity import fits_strategies

    args = ("gtx1080ti-x1", "gpt", "1f1b", 2, 4, ("best",))
    one = fits_strategies(*args)
    two = fits_strategies(*args, backend=LocalBackend(2))
    assert [r.to_dict() for r in one] == [r.to_dict() for r in two]
    assert any(not row.result.fits for row in one[0].rows) and one[0].largest is not None


def test_cli_refuses_an_address_without_ray(capsys, tmp_path):
    from test_cli import run

    code, _, err = run(capsys, "sweep", "--address", "auto", "--csv", str(tmp_path / "s.csv"))
    assert code == 2 and "--address is for --backend ray" in err and not (tmp_path / "s.csv").exists()


@pytest.mark.ray
@pytest.mark.processes
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and process groups")
def test_ctrl_c_on_a_ray_sweep_keeps_the_rows_and_a_rerun_completes(tmp_path):
    """``mpsim sweep --backend ray`` (its own Ray instance) interrupted once a row is in:
    exit 130 with the finished rows kept; the same sweep on the local pool then adds the
    rest, each point once."""
    import subprocess

    pytest.importorskip("ray")
    from test_sweep_interrupt import _check_rows_unique, _rows, ctrl_c_default

    csv_path = tmp_path / "s.csv"
    # points that take seconds in all, so that on a busy machine the signal finds the sweep running
    args = [sys.executable, "-m", "mpsim.cli", "sweep", "--model", "gpt-10.3b,gpt-15.4b", "--microbatch", "1,2,4,8",
            "--strategy", "none,recompute,cpu-swap,mpress", "--csv", str(csv_path), "--batch", "1"]
    proc = subprocess.Popen(args + ["--backend", "ray", "-j", "2"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True,
                            preexec_fn=ctrl_c_default)
    try:
        deadline = time.monotonic() + 240
        while _rows(csv_path) < 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 1 <= _rows(csv_path) < 32, "no row to interrupt after, or the sweep ended first"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "mpsim: sweep interrupted by SIGINT" in err.strip().splitlines()[-1]
    kept = len(_check_rows_unique(csv_path))
    done = subprocess.run(args + ["-j", "2"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(_check_rows_unique(csv_path)) == 32 >= kept >= 1


def test_an_aborted_local_backend_stops_its_workers_and_refuses_more_work():
    """``fits`` stops its other thread's rounds this way when interrupted: the workers are
    gone at once, and a round still to come fails in one line instead of starting more."""
    backend = LocalBackend(2)
    pids = {o.value for o in run_points(range(4), worker_pid, backend, batch=1) if o.value is not None}
    backend.abort()
    for pid in pids:
        assert not _alive(pid)
    with pytest.raises(MpsimError, match="the work was stopped"):
        list(run_points(range(4), worker_pid, backend, batch=1))


def _alive(pid: int) -> bool:

    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_an_interrupted_fits_over_layouts_stops_both_its_threads_and_the_workers():
    """Ctrl-C (here raised by the progress callback at the first search that ends) while the
    single strategies' searches run on their own thread: the interruption reaches the
    caller, the workers are stopped and nothing runs on."""
    from mpsim.studies.capacity import family_job, family_traces, fits_layouts

    traces = family_traces("gpt")[:2]
    job = family_job("dgx1-v100", traces, "1f1b", 2, 16, "none", "compute")
    backend = LocalBackend(2)

    def interrupt(name: str) -> None:
        if name.endswith("search"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fits_layouts(job, "gpt", traces, ("none", "recompute", "best"), "pp8,ddp8", 16, on_point=interrupt,
                     backend=backend)
    assert backend._pool is None
    with pytest.raises(MpsimError, match="the work was stopped"):
        list(run_points(range(2), worker_pid, backend, batch=1))


class _NoWork(LocalBackend):
    """A backend that refuses every batch: what reaches it was not known already."""

    def run_batches(self, batches, fn):
        raise AssertionError(f"planned again: {[p.strategy for b in batches for p in b]}")


def test_a_single_search_hands_its_largest_plan_to_best_which_does_not_plan_it_again():
    """A single strategy's search in a worker returns the plan of its largest size by its
    cache key; the process running ``best``'s search adopts it, and ``best``'s part for
    that job (the same planner and partition) is taken from it, not sent to a worker."""
    from mpsim.planners import cache
    from mpsim.studies.capacity import _fits_unit, _FitsUnit, _parts_planned, family_job, shipped_or_named

    traces = shipped_or_named("gpt", ())
    job = family_job("gtx1080ti-x1", traces, "1f1b", 2, 4, "recompute", "compute")
    rows = tuple(_fits_unit(_FitsUnit(job, "gpt", (), (), ())).report.rows)  # the shipped sizes
    searched = _fits_unit(_FitsUnit(job, "gpt", (), rows, ()))
    assert searched.report.largest is not None and searched.largest_plan is not None
    key, planned = searched.largest_plan
    assert planned.result.iteration_s == searched.report.largest.result.iteration_s
    template = next(t for t in traces if t.name == searched.report.largest_template)
    largest = job.but(trace=template.with_layers(searched.report.largest.layers).rescale(2))
    cache._CACHE.clear()
    with pytest.raises(AssertionError, match="planned again"):
        _parts_planned(largest, [("recompute", "compute")], _NoWork(1))
    cache.adopt_plan(key, planned)
    assert _parts_planned(largest, [("recompute", "compute")], _NoWork(1)) == {("recompute", "compute"): planned}


def test_fits_over_layouts_in_parallel_gives_the_reports_of_one_process():
    """On workers (the shipped sizes in one round, the single searches a round per layout on
    a thread of their own, ``best``'s beside them): every report (the rows, the largest,
    what a later layout could not beat) is that of the layouts run one after the other in
    one process."""
    from mpsim.studies.capacity import family_job, family_traces, fits_layouts

    traces = family_traces("gpt")[:2]
    job = family_job("titanrtx-x4-pcie", traces, "1f1b", 2, 8, "none", "compute")
    args = (job, "gpt", traces, ("none", "recompute", "cpu-swap", "best"), "pp4,ddp4,fsdp4", 8)
    one = fits_layouts(*args)
    seen: list[str] = []
    two = fits_layouts(*args, on_point=seen.append, backend=LocalBackend(2))
    assert [[r.to_dict() for r in a.reports] for a in one] == [[r.to_dict() for r in a.reports] for a in two]
    assert any(r.not_above for a in one for r in a.reports)  # FSDP's searches could not beat the pipeline's
    assert len(seen) == 3 * 2 * 4 + 3 * 4 and seen.count("pipeline x4: best: search") == 1
