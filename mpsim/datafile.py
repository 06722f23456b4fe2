"""Reading YAML and JSON data files with one clear error for each way they can be wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from mpsim.errors import MpsimError, SchemaError, from_pydantic


def read_data_file(path: Path, fmt: Literal["yaml", "json"], what: str) -> object:
    """Parse ``path`` as ``fmt``; a missing file or a syntax error names the file (and line)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise MpsimError(f"{path}: cannot read {what} file ({exc.strerror})") from None
    if fmt == "json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise SchemaError(path, "", f"not valid JSON at line {exc.lineno}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise SchemaError(path, "", f"not valid YAML{where}") from None


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
