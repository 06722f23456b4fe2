"""The frameworks' configurations a launch job is written as and read from, by name.

Each format is a module of ``mpsim.launch`` with ``NAME``, ``SUFFIX``, ``emit(launch) ->
str`` (the configuration, with a comment block naming the mpsim prediction it came from,
``header``) and ``parse(text, source, where) -> LaunchJob`` (``where``: the model, server
and cluster the command line gives, since a configuration names none of them in mpsim's
terms). ``emit`` refuses in one line what the framework cannot say; ``parse`` what mpsim
cannot simulate, naming the option. Export then import gives the same job
(``tests/test_launch.py``)."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from types import ModuleType

from mpsim.errors import MpsimError
from mpsim.launch import FORMATS
from mpsim.launch.job import LaunchJob


@dataclass(frozen=True)
class Where:
    """What the command line says and a configuration does not: mpsim's model and server
    names, the cluster and its servers, and the sequence length where the configuration
    leaves it to the training script (``--seq-len``; it wins over an mpsim header's)."""

    model: str
    server: str
    cluster: str | None = None
    servers: int = 1
    seq_len: int | None = None


def format_module(name: str) -> ModuleType:
    """The module of format ``name``; one line naming the formats otherwise."""
    if name not in FORMATS:
        raise MpsimError(f"--emit/--from format {name!r}: expected one of {', '.join(FORMATS)}")
    return importlib.import_module(f"mpsim.launch.{name}")


def emit(name: str, launch: LaunchJob) -> str:
    return str(format_module(name).emit(launch))


def parse(name: str, text: str, source: str, where: Where) -> LaunchJob:
    job = format_module(name).parse(text, source, where)
    assert isinstance(job, LaunchJob)
    return job


def load_json(text: str, source: str, what: str = "JSON") -> object:
    """``text`` parsed as JSON; refused in one line naming ``source`` where it is not JSON,
    repeats a key in an object (Python's parser would keep the last), is nested too deeply,
    or holds a number too long to convert (more than 4,300 digits)."""
    def unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
        out: dict[str, object] = {}
        for key, value in pairs:
            if key in out:
                raise MpsimError(f"{source}: {what} repeats the key {key!r}; give it once")
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as exc:
        raise MpsimError(f"{source}: not {what} ({exc.msg}, line {exc.lineno})") from None
    except RecursionError:
        raise MpsimError(f"{source}: not {what} (nested too deeply)") from None
    except ValueError as exc:  # a number of more than sys.get_int_max_str_digits() digits
        raise MpsimError(f"{source}: not {what} ({str(exc).split(':')[0]})") from None


def header(launch: LaunchJob, comment: str) -> str:
    """The comment block above an emitted configuration (each line begins ``comment``):
    the mpsim job and prediction it came from, and the runtime profile assumed."""
    lines = [f"Written by mpsim for {launch.model} on {launch.servers} x {launch.server}"
             + (f" ({launch.cluster})" if launch.cluster else "") + f", {launch.gpus} GPUs.",
             f"mpsim job: {launch.model_dump_json(exclude={'predicted'}, exclude_defaults=True)}"]
    p = launch.predicted
    if p is not None:
        lines.append(f"predicted: {'fits' if p.fits else 'DOES NOT FIT'}, peak {p.peak_gib:.2f} GiB per GPU, "
                     f"iteration {p.iteration_s:.3f} s, {p.samples_per_s:.3g} samples/s, "
                     f"runtime profile {launch.runtime}")
    return "".join(f"{comment} {line}\n" for line in lines)
