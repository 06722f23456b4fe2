"""Errors a user can act on. The CLI prints their message as one line and exits non-zero."""

from __future__ import annotations

from pathlib import Path


class MpsimError(Exception):
    """Any problem with the user's input that mpsim can explain in one line."""


class SchemaError(MpsimError):
    """A data file (topology, trace, plan) that does not match its schema.

    The message names the file, the field (as a dotted path) and what was expected.
    """

    def __init__(self, path: Path | str, field: str, expected: str) -> None:
        self.path = str(path)
        self.field = field
        self.expected = expected
        where = f"{self.path}: " if self.path else ""
        super().__init__(f"{where}{field}: {expected}" if field else f"{where}{expected}")


def from_pydantic(path: Path | str, exc: object) -> SchemaError:
    """Turn the first error of a pydantic ValidationError into a SchemaError."""
    errors = exc.errors()  # type: ignore[attr-defined]
    first = errors[0]
    field = ".".join(str(p) for p in first["loc"])
    msg = first["msg"]
    if first["type"] == "missing":
        msg = "required field is missing"
    elif first["type"] == "extra_forbidden":
        msg = "unknown field (check the spelling and the units in the key)"
    extra = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return SchemaError(path, field, f"{msg}{extra}")
