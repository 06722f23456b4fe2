"""Property-based fuzzing of the layout grammar, jobs built from layouts, and the server,
cluster and plan files (issue 45, item 9): every input is accepted whole or refused with one
``MpsimError`` whose message is a single line, in bounded time, never another exception.

- Layout names (``mpsim.plans.mesh.parse_layout``): strings made of the grammar's tokens
  (``ddp fsdp hsdp zeroN tp sp pp v mir``, sizes from 0 to thousands of digits, ``x``) and
  junk (unicode digits and letters, whitespace, control characters). A name parses into a
  layout whose ``layout_name`` parses back to the same layout, or is refused; through the
  command line (``choose``, ``fits``, ``sweep`` ``--layouts``) a refused name exits 2 with
  one line on stderr.
- Jobs (``JobSpec``) of random layouts on shipped servers (dgx1-v100, dgx-a100-80gb,
  mi300x-x8, gb200-nvl72) and clusters: built (then the mesh's size is the GPUs used, no
  more than the GPUs there are, and its name reads back) or refused; a few are simulated
  on a tiny trace and give a result that fits or says where it ran out.
- Topology files of schema 1 and 2 and cluster files: the shipped ones with a key dropped,
  a number made 0, negative, non-finite, huge, a string or a list, a GPU listed twice or
  out of range, a GPU count of 100,000: a ``Topology`` (or ``Cluster``), or one
  ``SchemaError`` naming the field; the values that cannot be right (non-finite or
  negative numbers, a GPU twice or out of range, another GPU count) always refused.
- Plan files of schemas 2, 3 and 4 made by the planner, mutated likewise and read with
  ``parse_plan`` and ``check_plan``; a GPU placed twice or out of range, or a ``mesh``
  layout that says another layout, always refused.

Every example runs under a time limit (``signal.alarm``: a hang fails the example, no wall
clock is asserted). Examples are derandomized, so CI runs the same short form each time.
The long form, on demand: ``MPSIM_FUZZ_EXAMPLES=N`` runs every property with at least N
examples (the simulating one with N/20), e.g.
``MPSIM_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz_mesh_and_files.py``.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import signal
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import toy_axis  # noqa: F401 - registers the mirror axis (name part mirN)
import yaml
from helpers import layer, run_cli, tiny_trace
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mpsim.data.catalog import cluster_from_data, load_cluster, load_topology, load_trace
from mpsim.errors import MpsimError, SchemaError
from mpsim.hardware.cluster import Cluster
from mpsim.hardware.schema1 import MAX_GPUS
from mpsim.hardware.topology import HOST, Topology, parse_topology
from mpsim.models.trace import Trace
from mpsim.plans.job import JobSpec
from mpsim.plans.mesh import Parallelism, data_parallel, describe, layout_name, parse_layout
from mpsim.plans.plan import PlanFile, check_plan, parse_plan

ROOT = Path(__file__).resolve().parent.parent
LONG = int(os.environ.get("MPSIM_FUZZ_EXAMPLES", "0") or 0)
"""The long form's examples per property (0: the short form CI runs)."""
LIMIT_S = 30
"""Time limit of one example's work (generous: a hang, not a slow machine)."""
MAX_MESSAGE = 1500


def fuzz(short: int, long_share: float = 1.0) -> Callable[[Any], Any]:
    """Hypothesis settings: derandomized, ``short`` examples (or the long form's share)."""
    return settings(derandomize=True, deadline=None, database=None,
                    max_examples=max(short, int(LONG * long_share)),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.function_scoped_fixture])


class Hang(Exception):
    """Work that ran past ``LIMIT_S``."""


@contextlib.contextmanager
def time_limit(seconds: int = LIMIT_S) -> Iterator[None]:
    def alarm(signum: int, frame: object) -> None:
        raise Hang(f"ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def one_line(exc: BaseException) -> str:
    """``exc``'s message, asserted to be one non-empty line of bounded length."""
    text = str(exc)
    assert text.strip(), repr(exc)
    assert len(text.splitlines()) == 1 and "\r" not in text, text[:3000]
    assert len(text) <= MAX_MESSAGE, text[:300]
    return text


# -- 1. layout names -------------------------------------------------------------------------------

SIZES = ["0", "1", "2", "3", "4", "8", "16", "64", "65", "72", "1024", "1025", "65536", "65537", "007",
         "9" * 20, "9" * 21, "9" * 5000]
TOKENS = ["ddp", "fsdp", "hsdp", "zero", "zero0", "zero1", "zero2", "zero3", "zero4", "tp", "sp", "pp", "v", "mir",
          "x", "x", "x", *SIZES,
          # junk: unicode digits (Arabic-Indic, fullwidth, superscript), letters, whitespace, controls
          "", " ", "\t", "\n", "-", "+", "_", ".", "²", "٣", "８", "İ", "ß", "é", "\x00", "\u200b", "X", "DDP", "Pp",
          "ep", "cp"]
PART_FORMS: list[list[Callable[[str], str]]] = [
    [lambda n: f"ddp{n}", lambda n: f"fsdp{n}", lambda n: f"hsdp{n}", lambda n: f"zero0x{n}", lambda n: f"zero1x{n}",
     lambda n: f"zero2x{n}", lambda n: f"zero3x{n}"],
    [lambda n: f"mir{n}"],
    [lambda n: f"tp{n}", lambda n: f"tp{n}sp"],
    [lambda n: f"pp{n}", lambda n: f"pp{n}v2", lambda n: f"pp2v{n}", lambda n: f"pp{n}v{n}"]]
"""The forms of each part, in the grammar's order: data, the registered mirror axis, tensor, pipeline."""


@st.composite
def layout_texts(draw: st.DrawFn) -> str:
    """A string near the grammar: tokens joined, any text, or parts in the grammar's order
    (sometimes shuffled, or with one changed)."""
    how = draw(st.sampled_from(["tokens", "parts", "parts", "parts", "text"]))
    if how == "tokens":
        return "".join(draw(st.lists(st.sampled_from(TOKENS), max_size=8)))
    if how == "text":
        return draw(st.text(max_size=24))
    kinds = [forms for forms in PART_FORMS if draw(st.booleans())] or [PART_FORMS[3]]
    parts = [draw(st.sampled_from(forms))(draw(st.sampled_from(SIZES[:13]))) for forms in kinds]
    change = draw(st.integers(0, 5))
    if change == 0:
        parts = draw(st.permutations(parts))
    elif change == 1:
        i = draw(st.integers(0, len(parts) - 1))
        parts[i] = draw(st.sampled_from([parts[i].upper(), f" {parts[i]} ", parts[i] + draw(st.sampled_from(TOKENS)),
                                         draw(st.sampled_from(TOKENS))]))
    return draw(st.sampled_from(["x", "x", "x", "x", "", "X", "xx"])).join(parts)


def check_name(text: str) -> Parallelism | None:
    """``text`` parsed (its name written and read back to the same layout), or None if refused in one line."""
    try:
        with time_limit():
            p = parse_layout(text)
    except MpsimError as exc:
        one_line(exc)
        event("refused")
        return None
    event("parsed")
    n = p.pipeline or 1
    name = layout_name(p, n)
    assert parse_layout(name) == p, (text, name)
    assert layout_name(parse_layout(name), n) == name
    words = describe(p, n)
    assert words and "\n" not in words
    return p


@fuzz(400)
@given(text=layout_texts())
def test_a_layout_name_parses_back_or_is_refused_in_one_line(text: str) -> None:
    check_name(text)


@pytest.mark.parametrize("text", ["tp1sp", "tp1spxpp2", "ddp2xtp1sp", "pp" + "9" * 5000, "tp" + "7" * 4301,
                                  "pp٣", "pp８", "ddp٢xpp２", "mir" + "9" * 30, "x" * 100_000, "ddp2" * 30_000])
def test_layout_names_the_fuzzing_found(text: str) -> None:
    """Regressions: ``tp1sp`` parsed into a layout (sequence parallel, no tensor split) whose
    name ``pp1`` read back as another; a size of over 4,300 digits raised Python's
    ``ValueError`` (its integer-string limit); Unicode digits were read as sizes; a long
    name was quoted whole in the error."""
    with pytest.raises(MpsimError) as exc:
        parse_layout(text)
    assert len(one_line(exc.value)) < 600
    if "sp" in text:
        assert "sequence parallel" in str(exc.value)


@pytest.mark.parametrize(("text", "name", "words"), [
    ("ddp1xmir2xpp1v2", "mir2xpp1v2", "MIRROR x2 x pipeline x1 (interleaved x2)"),
    ("fsdp2xpp1v2", "fsdp2xpp1v2", "FSDP x2 x pipeline x1 (interleaved x2)")])
def test_virtual_stages_of_a_one_stage_pipeline_stay_in_the_name(text: str, name: str, words: str) -> None:
    """Regression: the pipeline's part was left out of a name whenever it had one stage, its
    virtual stages with it, so ``ddp1xmir2xpp1v2`` was written ``mir2`` and read back
    without them (a job refuses such a layout; its name must still say it)."""
    p = parse_layout(text)
    assert (layout_name(p, 1), describe(p, 1)) == (name, words)
    assert parse_layout(name) == p


def test_a_registered_axis_has_a_largest_size() -> None:
    with pytest.raises(MpsimError, match="mirror of size 65537: at most 65536"):
        parse_layout("mir65537")
    assert parse_layout("mir65536").axes == (("mirror", 65536),)


def _cli_argvs(name: str, tmp: Path) -> list[tuple[str, ...]]:
    layouts = f"--layouts={name}"
    return [("choose", "--model", "gpt-5.3b", "--servers", "dgx1-v100", "--strategy", "none", layouts),
            ("fits", "--model", "gpt-5.3b", "--server", "dgx1-v100", "--strategy", "none", layouts, "-j", "1"),
            ("sweep", "--server", "dgx1-v100", "--model", "gpt-5.3b", "--microbatch", "1", "--strategy", "none",
             layouts, "--csv", str(tmp / "never.csv"))]


CLI_TOKENS = [t for t in TOKENS if t not in ("\x00", "\n")]
"""Tokens a command line can carry (no NUL, no line break: argv and the comma-separated list)."""


@fuzz(12)
@given(text=st.one_of(st.lists(st.sampled_from(CLI_TOKENS), min_size=1, max_size=6).map("".join),
                      layout_texts().map(lambda t: t.replace("\x00", "").replace("\n", ""))))
def test_a_refused_layout_name_exits_2_with_one_line_in_every_command(tmp_path_factory: Any, text: str) -> None:
    text = text.replace(",", "")
    if not text.strip() or check_name(text) is not None:
        return  # a name that parses would start a study: the parser's own property covers it
    tmp = tmp_path_factory.mktemp("cli")
    for argv in _cli_argvs(text, tmp):
        code, out, err = run_cli(LIMIT_S, *argv)
        assert "Traceback" not in out + err, err[-2000:]
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (argv, code, err[-2000:])
        assert lines[0].startswith("mpsim: error: ") and len(lines[0]) <= MAX_MESSAGE + 20, lines[0][:300]
    assert not (tmp / "never.csv").exists()


# -- 2. jobs from layouts --------------------------------------------------------------------------

SERVERS = ("dgx1-v100", "dgx-a100-80gb", "mi300x-x8", "gb200-nvl72")
CLUSTERS = ("dgx-a100-superpod", "gb200-nvl72-pod")


@cache
def server(name: str) -> Topology:
    return load_topology(name)


@cache
def cluster(name: str) -> Cluster:
    return load_cluster(name)


@cache
def toy_trace() -> Trace:
    """Six small layers with parameters, activations and times."""
    return tiny_trace([layer(f"l{i}", fwd_ms=1.0, bwd_ms=2.0, act=2**20, out=2**18, inp=2**18, params=2**16)
                       for i in range(6)])


@cache
def llama() -> Trace:
    """A shipped transformer whose heads split 2, 4 and 8 ways (tensor parallelism needs an
    mpsim model's trace)."""
    return load_trace("llama-3-8b").rescale(1)


@cache
def gpt() -> Trace:
    """A shipped transformer (tensor parallelism needs an mpsim model's trace)."""
    return load_trace("gpt-5.3b").rescale(1)


Layout = tuple[int, int, int | None, dict[str, object]]
"""The arguments of ``data_parallel``: replicas, ZeRO stage, pipeline depth (None: derived), options."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def layouts(draw: st.DrawFn, n_gpus: int) -> Layout:
    """A layout for ``n_gpus`` GPUs: mostly one whose degrees divide them (tensor, then
    replicas, a mirror axis, the pipeline), else degrees drawn from anywhere in and out of
    their ranges."""
    options: dict[str, object] = {}
    zero = draw(st.sampled_from([0, 0, 1, 2, 3]))
    if draw(st.integers(0, 3)):
        tensor = draw(st.sampled_from([t for t in (1, 1, 2, 4, 8) if n_gpus % t == 0]))
        rest = n_gpus // tensor
        data = draw(st.sampled_from(divisors(rest)))
        rest //= data
        if rest % 2 == 0 and not zero and draw(st.integers(0, 3)) == 0:
            options["axes"] = (("mirror", 2),)
            rest //= 2
        stages: int | None = draw(st.sampled_from([None, rest, rest, max(1, rest // 2)]))
        if tensor > 1:
            options |= {"tensor": tensor, "sequence_parallel": draw(st.booleans())}
        if (stages or rest) > 1 and draw(st.integers(0, 3)) == 0:
            options["virtual_stages"] = draw(st.sampled_from([2, 3]))
        if zero == 3 and draw(st.booleans()):
            options["hsdp"] = True
        return data, zero, stages, options
    data = draw(st.sampled_from([1, 2, 3, 9, 72, 144, 1024, 65536, 65537, 0, -1]))
    stages = draw(st.sampled_from([None, 1, 3, 9, 72, 1024, 1025, 0]))
    options["tensor"] = draw(st.sampled_from([1, 2, 3, 16, 64, 65, 0]))
    options["sequence_parallel"] = draw(st.booleans())
    options["virtual_stages"] = draw(st.sampled_from([1, 2, 64, 65, 0]))
    options["hsdp"] = draw(st.booleans())
    if draw(st.booleans()):
        options["axes"] = (("mirror", draw(st.sampled_from([2, 3, 1, 0, 65536, 65537]))),)
    return data, draw(st.sampled_from([0, 1, 2, 3, 4, -1])), stages, options


def check_job(job_of: Callable[[], JobSpec]) -> JobSpec | None:
    """The job built and checked, or None if refused in one line."""
    try:
        with time_limit():
            job = job_of()
    except MpsimError as exc:
        one_line(exc)
        event("refused")
        return None
    event("built")
    p, n = job.parallelism, job.n_stages
    assert job.gpus_used <= job.n_gpus
    assert p.mesh(n).size == job.gpus_used == p.stage_gpus * n
    assert job.samples_per_iteration == p.replicas * job.microbatches * job.microbatch
    assert parse_layout(layout_name(p, n)) == p.model_copy(update={"pipeline": n})
    assert "\n" not in job.layout_name
    return job


@st.composite
def placed_layouts(draw: st.DrawFn, where: tuple[str, ...]) -> tuple[str, int, Layout]:
    """A server or cluster of ``where``, its servers (1 on a server) and a layout for its GPUs."""
    name = draw(st.sampled_from(where))
    servers = draw(st.sampled_from([1, 1, 2, 4, 0, 257])) if name in CLUSTERS else 1
    n_gpus = (cluster(name).server if name in CLUSTERS else server(name)).n_gpus * max(1, min(servers, 4))
    return name, servers, draw(layouts(n_gpus))


@fuzz(150)
@given(placed=placed_layouts(SERVERS + CLUSTERS), schedule=st.sampled_from(["1f1b", "1f1b", "gpipe", "pipedream"]),
       microbatches=st.sampled_from([8, 16, 16, 1, 2, 4, 0, -1]), partition=st.sampled_from(["compute", "memory"]),
       transformer=st.sampled_from([True, True, False]))
def test_a_job_of_any_layout_is_built_whole_or_refused_in_one_line(
        placed: tuple[str, int, Layout], schedule: str, microbatches: int, partition: str, transformer: bool) -> None:
    where, servers, (data, zero, stages, options) = placed
    trace = llama() if transformer else toy_trace()

    def build() -> JobSpec:
        par = data_parallel(data, zero, stages, **options)
        if where in CLUSTERS:
            c = cluster(where)
            return JobSpec(c.server, trace, schedule, microbatches, par, partition, cluster=c, servers=servers)
        return JobSpec(server(where), trace, schedule, microbatches, par, partition)

    check_job(build)


@fuzz(10, long_share=1 / 20)
@given(placed=placed_layouts(SERVERS), schedule=st.sampled_from(["1f1b", "gpipe"]),
       microbatches=st.sampled_from([4, 8]))
def test_a_built_job_simulates_to_a_result(placed: tuple[str, int, Layout], schedule: str, microbatches: int) -> None:
    from mpsim.sim import Job, SimResult, simulate_job

    where, _, (data, zero, stages, options) = placed
    options = {k: v for k, v in options.items() if k not in ("tensor", "sequence_parallel", "hsdp")}
    job = check_job(lambda: JobSpec(server(where), toy_trace(), schedule, microbatches,
                                    data_parallel(data, zero, stages, **options)))
    if job is None:
        return
    if job.model_stages > job.trace.n_layers:
        # A known gap: JobSpec (mpsim/plans/job.py) checks the layers against the stages only
        # under interleaving; a plain pipeline deeper than the model is refused when partitioned.
        with pytest.raises(MpsimError, match="non-empty stages") as exc:
            simulate_job(Job(job))
        one_line(exc.value)
        return
    with time_limit(120):
        result = simulate_job(Job(job))
    assert isinstance(result, SimResult)
    assert result.fits or result.oom is not None
    assert result.gpus_used == job.gpus_used and math.isfinite(result.iteration_s) and result.iteration_s > 0


def test_a_derived_pipeline_deeper_than_any_layout_is_refused() -> None:
    """Regression: ZeRO-1 x1 on 257 servers of 8 GPUs derived a pipeline of 2,056 stages,
    which a layout (at most 1,024: ``Parallelism.pipeline``) and a plan file cannot hold;
    the job was built, and its name did not parse back."""
    c = cluster("dgx-a100-superpod")
    with pytest.raises(MpsimError, match="a pipeline of 2056 stages, at most 1024") as exc:
        JobSpec(c.server, llama(), "gpipe", 8, data_parallel(1, 1, None), cluster=c, servers=257)
    one_line(exc.value)
    assert data_parallel(2, 1, None).stages_on(c.server, 256) == 1024  # the deepest a layout holds
    with pytest.raises(MpsimError, match="into 1024 non-empty stages"):  # deeper than this model, though
        JobSpec(c.server, llama(), "gpipe", 8, data_parallel(2, 1, None), cluster=c, servers=256)


# -- mutations of data files -----------------------------------------------------------------------

Path_ = tuple[Any, ...]
BAD_NUMBERS: list[object] = [-1, -0.5, -(10**30), float("nan"), float("inf"), float("-inf")]
"""Values no number of these files may take."""
ODD_VALUES: list[object] = [0, 0.0, 1e-300, 1e308, 10**30, 2**63, True, None, "", "8", "abc", [], [1], {}, {"a": 1}]
"""Values of another magnitude or type, which a field may or may not take."""


def paths(obj: object, prefix: Path_ = ()) -> Iterator[Path_]:
    """Every path to a value inside nested mappings and lists (the root left out)."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield (*prefix, k)
        yield from paths(v, (*prefix, k))


def get(obj: Any, path: Path_) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def put(obj: Any, path: Path_, value: object) -> Any:
    out = copy.deepcopy(obj)
    get(out, path[:-1])[path[-1]] = value
    return out


def drop(obj: Any, path: Path_) -> Any:
    out = copy.deepcopy(obj)
    del get(out, path[:-1])[path[-1]]
    return out


def is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def gpu_lists(d: dict) -> list[Path_]:
    """Paths of the lists of GPU indices in a server, cluster or plan file."""
    patterns = [("pcie", "switches", "*", "gpus"), ("host", "cpus", "*", "gpus"),
                ("host", "cpus", "*", "switches", "*", "gpus"), ("fabric", "nic_groups", "*", "gpus"),
                ("data_parallel", "replicas", "*"), ("tensor_parallel", "groups", "*", "*")]
    out = []
    for p in paths(d):
        for pattern in patterns:
            if (len(p) == len(pattern) and all(a == "*" or a == b for a, b in zip(pattern, p, strict=True))
                    and isinstance(get(d, p), list) and get(d, p)):
                out.append(p)
    return out


@st.composite
def mutated(draw: st.DrawFn, base: dict, n_gpus: int) -> tuple[dict, str]:
    """``base`` with one change, and what kind it is: ``drop`` (a key or list item), ``odd``
    (a value of another type or magnitude), ``bad`` (a negative or non-finite number),
    ``twice`` (a GPU listed twice), ``range`` (a GPU index out of range), ``count`` (another
    GPU count, huge or not), or ``more`` (two changes of the first two kinds)."""
    kind = draw(st.sampled_from(["drop", "odd", "odd", "bad", "twice", "range", "count", "more"]))
    lists = gpu_lists(base)
    if kind in ("twice", "range") and not lists or kind == "count" and "gpu" not in base:
        kind = "odd"
    if kind in ("drop", "odd", "more"):
        d = base
        for _ in range(2 if kind == "more" else 1):
            where = list(paths(d))
            path = draw(st.sampled_from(where))
            how = "drop" if kind == "drop" else "odd" if kind == "odd" else draw(st.sampled_from(["drop", "odd"]))
            d = drop(d, path) if how == "drop" else put(d, path, draw(st.sampled_from(ODD_VALUES + BAD_NUMBERS)))
        return d, kind
    if kind == "bad":
        numbers = [p for p in paths(base) if is_number(get(base, p))]
        return put(base, draw(st.sampled_from(numbers)), draw(st.sampled_from(BAD_NUMBERS))), kind
    if kind == "count":
        count = base["gpu"]["count"]
        return put(base, ("gpu", "count"), draw(st.sampled_from([c for c in (1, 2, 7, 9, 71, MAX_GPUS, MAX_GPUS + 1,
                                                                               100_000, 10**18) if c != count]))), kind
    path = draw(st.sampled_from(lists))
    gpus = list(get(base, path))
    i = draw(st.integers(0, len(gpus) - 1))
    if kind == "twice":
        gpus.insert(draw(st.integers(0, len(gpus))), gpus[i])
    else:
        gpus[i] = draw(st.sampled_from([n_gpus, n_gpus + 1, -1, 10**6, 2**63]))
    return put(base, path, gpus), kind


def must_refuse(kind: str) -> bool:
    return kind in ("bad", "twice", "range", "count")


def check_file(read: Callable[[], object], kind: str, d: dict, unnamed: tuple[str, ...] = ()) -> object | None:
    """What ``read`` makes of a mutated file, or None if refused in one line naming a field
    (or, a known gap, in one line starting with one of ``unnamed``)."""
    try:
        with time_limit():
            got = read()
    except SchemaError as exc:
        one_line(exc)
        assert exc.field, f"no field named: {exc}"
        event(f"{kind}: refused")
        return None
    except MpsimError as exc:
        assert one_line(exc).startswith(unnamed) and unnamed, f"a refusal naming no field: {exc}"
        event(f"{kind}: refused, no field named")
        return None
    event(f"{kind}: accepted")
    assert not must_refuse(kind), f"a {kind} change was accepted: {d}"
    return got


def shipped(folder: Path) -> dict[str, dict]:
    return {p.stem: yaml.safe_load(p.read_text()) for p in sorted(folder.glob("*.yaml"))}


TOPOLOGIES = shipped(ROOT / "topologies")
CLUSTER_FILES = shipped(ROOT / "topologies" / "clusters")


# -- 3. topology files -----------------------------------------------------------------------------

@st.composite
def mutated_topologies(draw: st.DrawFn) -> tuple[dict, str]:
    base = TOPOLOGIES[draw(st.sampled_from(sorted(TOPOLOGIES)))]
    return draw(mutated(base, base["gpu"]["count"]))


@fuzz(300)
@given(case=mutated_topologies())
def test_a_mutated_topology_is_a_server_or_one_line_naming_the_field(case: tuple[dict, str]) -> None:
    d, kind = case
    topo = check_file(lambda: parse_topology(d, "fuzz.yaml"), kind, d)
    if isinstance(topo, Topology):
        n = topo.n_gpus
        assert topo.route(0, HOST).bandwidth > 0 and topo.route(HOST, n - 1).bandwidth > 0
        if n > 1:
            assert topo.route(0, n - 1).bandwidth > 0 and topo.connection(0, n - 1)


def test_every_shipped_topology_parses() -> None:
    assert all(isinstance(parse_topology(d, name), Topology) for name, d in TOPOLOGIES.items())


def test_a_huge_gpu_count_is_refused_before_any_route_is_derived(monkeypatch: pytest.MonkeyPatch) -> None:
    """100,000 GPUs, listed in full: the count's limit refuses the file before a route is made."""
    from mpsim.hardware import tiers

    def never(self: object) -> None:
        raise AssertionError("routes derived")

    monkeypatch.setattr(tiers.Wiring, "routes", never)
    n = 100_000
    d = copy.deepcopy(TOPOLOGIES["gb200-nvl72"])
    d["gpu"]["count"] = n
    d["host"]["cpus"] = [dict(d["host"]["cpus"][0], gpus=list(range(n)))]
    with pytest.raises(SchemaError, match="gpu.count"):
        parse_topology(d, "huge.yaml")


@pytest.mark.parametrize(("name", "field"), [("dgx1-v100", "pcie.switches"), ("gb200-nvl72", "host.cpus")])
def test_a_count_of_many_gpus_left_unplaced_is_named_in_a_short_line(name: str, field: str) -> None:
    """Regression: a GPU count of 1,024 in a file that places 8 (or 72) listed every
    missing GPU, a line of about 5,000 characters."""
    d = put(TOPOLOGIES[name], ("gpu", "count"), MAX_GPUS)
    with pytest.raises(SchemaError) as exc:
        parse_topology(d, "many.yaml")
    assert exc.value.field == field and len(one_line(exc.value)) < 200
    assert "..., 1023] (" in str(exc.value)


# -- 4. cluster files ------------------------------------------------------------------------------

@st.composite
def mutated_clusters(draw: st.DrawFn) -> tuple[dict, str]:
    name = draw(st.sampled_from(sorted(CLUSTER_FILES)))
    base = CLUSTER_FILES[name]
    n_gpus = server(base["server"]).n_gpus
    if draw(st.booleans()):  # NIC groups: the even spread written out, or broken
        per = draw(st.sampled_from([g for g in (1, 2, 4, 8) if n_gpus % g == 0]))
        groups = [{"gpus": list(range(i, i + per)), "nics": 1} for i in range(0, n_gpus, per)]
        base = put(base, ("fabric",), {**base["fabric"], "nic_groups": groups, "nics_per_server": len(groups)})
        if draw(st.booleans()):
            return base, "groups"
    how = draw(st.sampled_from(["mutate", "mutate", "servers", "server"]))
    if how == "servers":
        return put(base, (draw(st.sampled_from(["max_servers", "fabric"])),) if False else ("max_servers",),
                   draw(st.sampled_from([0, -1, 65536, 65537, 100_000, 10**18]))), "servers"
    if how == "server":
        return put(base, ("server",), draw(st.sampled_from([*SERVERS, "h100-x1", "no-such-server", "", "../x.yaml",
                                                            "/dev/zero", "topologies"]))), "server"
    return draw(mutated(base, n_gpus))


@fuzz(200)
@given(case=mutated_clusters())
def test_a_mutated_cluster_is_a_cluster_or_one_line_naming_the_field(case: tuple[dict, str]) -> None:
    d, kind = case
    if kind == "servers":
        kind = "bad" if not 1 <= d["max_servers"] <= 65536 else "odd"
    got = check_file(lambda: cluster_from_data(d, "fuzz.yaml"), kind, d)
    if isinstance(got, Cluster):
        g = got.gpus_per_server
        assert all(got.cross_bytes_per_s(i) > 0 for i in range(g))
        if got.spec.max_servers >= 2:
            view = got.view(2)
            assert view.route(0, g).bandwidth > 0 and view.mirror_route(g - 1).bandwidth > 0


def test_fewer_nics_than_a_rack_has_gpus_share_them_evenly() -> None:
    """Regression: one NIC for a 72-GPU server made a NIC group of 72 GPUs, over the
    group's limit of 64, and raised pydantic's ``ValidationError`` (a traceback); a group
    may hold every GPU of a server."""
    d = put(CLUSTER_FILES["gb200-nvl72-pod"], ("fabric", "nics_per_server"), 1)
    c = cluster_from_data(d, "one-nic.yaml")
    assert [len(g.gpus) for g in c.nic_groups] == [72] and c.nic_bytes_per_s(0) == c.nic_bytes_per_s(71)
    groups = [{"gpus": list(range(72)), "nics": 2}]
    d = put(d, ("fabric",), {**d["fabric"], "nics_per_server": 2, "nic_groups": groups})
    assert len(cluster_from_data(d, "two-nics.yaml").nic_groups[0].gpus) == 72
    d = put(d, ("fabric", "nic_groups", 0, "gpus"), [*range(71), 5])
    with pytest.raises(SchemaError, match="fabric.nic_groups.0.gpus: GPU 5 is already in another group"):
        cluster_from_data(d, "twice.yaml")


def test_every_shipped_cluster_parses() -> None:
    assert all(isinstance(cluster_from_data(d, name), Cluster) for name, d in CLUSTER_FILES.items())


# -- 5. plan files ---------------------------------------------------------------------------------

PLAN_LAYOUTS = {2: ("ddp2xpp4", "recompute"), 3: ("zero1x2xtp2spxpp2", "none"), 4: ("ddp2xmir2xpp2", "none")}
"""A plan of each schema the planner writes: DDP with recompute actions (2), 3-D with
tensor-parallel groups (3), a registered axis only a mesh names (4)."""


@pytest.fixture(scope="module")
def plans() -> dict[int, dict]:
    import json

    from mpsim.planners.registry import plan_job

    out = {}
    for schema, (name, strategy) in PLAN_LAYOUTS.items():
        job = JobSpec(server("dgx-a100-80gb"), gpt(), "1f1b", 8, parse_layout(name), strategy=strategy)
        out[schema] = json.loads(plan_job(job).plan.to_json())
        assert out[schema]["schema"] == schema
    return out


def read_plan(d: dict) -> PlanFile:
    plan = parse_plan(d, "fuzz.json")
    check_plan(plan, server("dgx-a100-80gb"), gpt(), "fuzz.json")
    return plan


@fuzz(200)
@given(data=st.data())
def test_a_mutated_plan_is_read_whole_or_refused_in_one_line(plans: dict[int, dict], data: st.DataObject) -> None:
    base = plans[data.draw(st.sampled_from(sorted(plans)))]
    how = data.draw(st.sampled_from(["mutate", "mutate", "mutate", "schema", "stage-gpu", "mesh"]))
    if how == "schema":
        d, kind = put(base, ("schema",), data.draw(st.sampled_from([0, 1, 2, 3, 4, 5, -1, 2**63]))), "odd"
    elif how == "stage-gpu":
        s = data.draw(st.integers(0, len(base["stages"]) - 1))
        other = data.draw(st.sampled_from([st_["gpu"] for st_ in base["stages"] if st_ is not base["stages"][s]]
                                          + [8, -1, 10**9]))
        d, kind = put(base, ("stages", s, "gpu"), other), "range"
    elif how == "mesh":
        text = data.draw(layout_texts())
        d = put(base, ("schema",), 4)
        mesh = base.get("mesh") or {"axes": [["data", 1]]}
        d = put(d, ("mesh",), {**mesh, "layout": text})
        kind = "odd"
        try:
            said = parse_layout(text)
        except MpsimError:
            kind = "bad"
        else:
            if "mesh" in base and said != parse_layout(base["mesh"]["layout"]):
                kind = "bad"  # a name that says another layout than the plan's
    else:
        d, kind = data.draw(mutated(base, 8))
    check_file(lambda: read_plan(d), kind, d)  # check_plan names microbatches when the schedule refuses them


def test_every_plan_made_reads_back(plans: dict[int, dict]) -> None:
    for d in plans.values():
        read_plan(d)
