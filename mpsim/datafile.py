"""Reading YAML and JSON data files with one clear error for each way they can be wrong."""

from __future__ import annotations

import json
import os
import stat
from importlib import resources
from pathlib import Path
from typing import Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from mpsim.errors import MpsimError, SchemaError, from_pydantic
from mpsim.limits import check_trace_text

MAX_FILE_BYTES = 2**30
"""The largest trace or plan file read: 1 GiB. A trace at ``MAX_LAYERS`` is about 64 MiB
(about 6 KiB a layer row); below this bound a deeper one still gets the layer count's
clearer message (``mpsim.limits``: a 100,000-layer trace is about 400 MB)."""
MAX_SMALL_FILE_BYTES = 16 * 2**20
"""The largest server, cluster or Hugging Face config file read: 16 MiB (the shipped ones
are a few KiB)."""
_FILE_LIMITS = {"trace": MAX_FILE_BYTES, "plan": MAX_FILE_BYTES}


def _kind_of(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    for test, name in ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def read_bounded(path: Path, what: str, limit: int | None = None) -> bytes:
    """The bytes of ``path``, read only if it is a regular file of at most ``limit`` bytes
    (``MAX_FILE_BYTES`` for a trace or plan, ``MAX_SMALL_FILE_BYTES`` for anything else):
    a FIFO (which would block until a writer came), a device such as ``/dev/zero`` (which
    never ends), a folder or an oversized file is refused in one line naming the path and
    why, before anything is read. The file is opened without blocking and checked again
    once open, so swapping it for a FIFO after the first check does not hang either."""
    limit = _FILE_LIMITS.get(what, MAX_SMALL_FILE_BYTES) if limit is None else limit
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise MpsimError(f"{path}: cannot read {what} file: it is {_kind_of(mode)}, not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise MpsimError(f"{path}: cannot read {what} file: it is {_kind_of(info.st_mode)}, "
                                 "not a regular file")
            if info.st_size > limit:
                raise MpsimError(f"{path}: {what} file is {info.st_size:,} bytes; mpsim reads at most "
                                 f"{limit:,} (see MAX_FILE_BYTES in mpsim/datafile.py)")
            raw = f.read(limit + 1)  # a file growing while read still stops here
    except OSError as exc:
        raise MpsimError(f"{path}: cannot read {what} file ({exc.strerror})") from None
    if len(raw) > limit:
        raise MpsimError(f"{path}: {what} file is over {limit:,} bytes; mpsim reads at most {limit:,} "
                         "(see MAX_FILE_BYTES in mpsim/datafile.py)")
    return raw


class FileModel(BaseModel):
    """The base of every file format's models (servers, clusters, traces, plans, kernel
    tables): an unknown key is refused, a loaded value never changes, numbers are finite."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that repeats a key (it would keep the last)."""


def _unique_mapping(loader: UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[object, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # '<<': merged keys may be overridden
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key (a list or mapping): construct_mapping explains it
            break
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {first})", key_node.start_mark)
        seen[key] = key_node.start_mark.line + 1
    loader.flatten_mapping(node)
    return loader.construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _json_no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(k)
        out[k] = v
    return out


def read_data_file(path: Path, fmt: Literal["yaml", "json"], what: str) -> object:
    """Parse ``path`` as ``fmt``; a missing file, text that is not UTF-8, a syntax error or a
    repeated key names the file (and line). A trace (``what`` "trace") with more layers than
    ``mpsim.limits.MAX_LAYERS`` is refused before it is parsed (``parse_trace`` counts its
    rows exactly before validating them)."""
    text = _read_text(path, fmt, what)
    if what == "trace":
        check_trace_text(text, path)
    return _parse(path, text, fmt)


def _read_text(path: Path, fmt: Literal["yaml", "json"], what: str) -> str:
    raw = read_bounded(path, what)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise SchemaError(path, "", f"not UTF-8 text (byte {exc.start}, line {line}): expected a {what} "
                                    f"file in {fmt.upper()}") from None
    return text


def _parse(path: Path, text: str, fmt: Literal["yaml", "json"]) -> object:
    if fmt == "json":
        try:
            return json.loads(text, object_pairs_hook=_json_no_duplicates)
        except json.JSONDecodeError as exc:
            raise SchemaError(path, "", f"not valid JSON at line {exc.lineno}") from None
        except ValueError as exc:  # a repeated key, from the hook
            raise SchemaError(path, str(exc), "duplicate key (a key may appear once in an object)") from None
        except RecursionError:
            raise SchemaError(path, "", "not valid JSON (nested too deeply)") from None
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.constructor.ConstructorError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}" if mark else ""
        raise SchemaError(path, "", f"not valid YAML{where}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise SchemaError(path, "", f"not valid YAML{where}") from None
    except RecursionError:
        raise SchemaError(path, "", "not valid YAML (nested too deeply)") from None


M = TypeVar("M", bound=BaseModel)


def validate(schema: type[M], data: object, source: str) -> M:
    """Validate parsed data against a pydantic schema; the first problem becomes a
    SchemaError naming ``source``, the field and what was expected."""
    if not isinstance(data, dict):
        raise SchemaError(source, "", "expected a mapping of fields at the top level")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise from_pydantic(source, exc) from None


#: The packages the shipped files are installed as (the top-level ``topologies/`` and
#: ``traces/`` folders, mapped into the package at build time, see pyproject.toml).
DATA_PACKAGES = {"topologies": "mpsim.data.topologies", "traces": "mpsim.data.traces",
                 "hf_configs": "mpsim.data.hf_configs", "clusters": "mpsim.data.clusters"}
_CHECKOUT_PATHS = {"clusters": "topologies/clusters"}
"""Where a folder sits under ``MPSIM_DATA`` when not at its top (clusters live with servers)."""


def data_dir(kind: str) -> Path:
    """The folder of shipped ``topologies`` or ``traces``, found with ``importlib.resources``.

    Set ``MPSIM_DATA`` to a folder with ``topologies/`` and ``traces/`` in it (a checkout
    of the repository, say) to use those files instead.
    """
    if kind not in DATA_PACKAGES:
        raise ValueError(f"unknown data folder {kind!r}: expected one of {', '.join(DATA_PACKAGES)}")
    env = os.environ.get("MPSIM_DATA")
    if env:
        return Path(env) / _CHECKOUT_PATHS.get(kind, kind)
    root = resources.files(DATA_PACKAGES[kind])
    if not isinstance(root, Path):  # a zipped install: the files have no path of their own
        raise MpsimError(f"{DATA_PACKAGES[kind]} is not installed as files; set MPSIM_DATA to a folder with {kind}/")
    return root
