"""Reading YAML and JSON data files with one clear error for each way they can be wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from mpsim.errors import MpsimError, SchemaError, from_pydantic
from mpsim.limits import check_trace_text


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that repeats a key (it would keep the last)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
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


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


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
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise MpsimError(f"{path}: cannot read {what} file ({exc.strerror})") from None
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
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
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
