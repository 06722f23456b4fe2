"""The job view's plan and the choose view's pick as the frameworks' own configurations
(issue 52): Megatron-LM, torchtitan, DeepSpeed and Accelerate (``mpsim.api.FORMATS``), as
``mpsim plan --emit`` and ``mpsim choose --emit`` write them (``api.launch_of``,
``api.pick_launch``, ``api.write_emits``).

Each format's file is made once, in the worker, when the run ends, and kept with the run's
outcome (``Launches``); ``GET /api/jobs/<id>/launch/<format>`` serves it as an attachment
and the status names each format's file or, where the framework cannot state the job, its
one-line reason. Nothing is simulated again for a download.

No name from a request reaches the filesystem: the formats read the model's shape (and
torchtitan an HSDP server's GPUs) by the names the launch job carries, which the catalog
takes as shipped names or file paths. A shipped model or server is named as it is; an
uploaded one is written into a folder of the run's own under the server's scratch folder,
under the upload's cleaned file name (``inputs.safe_file_name``), and named by that path;
the folder is cut from every file and reason, so they name the upload as the user called it
(the file to give ``mpsim simulate --from`` as ``--model``/``--server``; a Hugging Face
config is named ``<stem>-trace.json``, the trace ``mpsim trace --hf`` writes)."""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from mpsim import api
from mpsim.errors import MpsimError

CONTENT_TYPES = {".sh": "text/x-shellscript; charset=utf-8", ".toml": "application/toml; charset=utf-8",
                 ".json": "application/json", ".yaml": "application/yaml; charset=utf-8"}
"""The content type of each format's file, by its suffix (plain text for any other)."""
PLAIN_TEXT = "text/plain; charset=utf-8"
LABELS = {"megatron": "Megatron-LM launch script", "torchtitan": "torchtitan TOML", "deepspeed": "DeepSpeed JSON",
          "accelerate": "Accelerate FSDP YAML"}
"""How the page names each format's file (the format's own name for any other)."""


@dataclass(frozen=True)
class LaunchFile:
    """One format's configuration of the run's job, or the one line why it cannot state it."""

    format: str
    file: str
    """The download's file name: ``mpsim-<plan|pick>.<format><suffix>``, as ``--emit`` names it."""
    text: str | None
    reason: str | None

    @property
    def content_type(self) -> str:
        return CONTENT_TYPES.get(Path(self.file).suffix, PLAIN_TEXT)


@dataclass(frozen=True)
class Launches:
    """A run's job as every format (``LaunchFile`` each, in ``api.FORMATS`` order)."""

    of: str
    """``plan`` (the job view) or ``pick`` (the choose view)."""
    files: tuple[LaunchFile, ...]
    reason: str | None = None
    """Where no format can state the job (a fine-tune, nothing fits, a plan no framework's
    flags state): the one line, also each file's reason."""

    def get(self, fmt: str) -> LaunchFile | None:
        return next((f for f in self.files if f.format == fmt), None)

    def summary(self) -> dict[str, Any]:
        """What the status says: each format's file name, or its reason."""
        return {"of": self.of, "reason": self.reason,
                "formats": [{"format": f.format, "label": LABELS.get(f.format, f.format), "file": f.file,
                             "reason": f.reason} for f in self.files]}


def file_names(of: str) -> dict[str, str]:
    """Each format's download name, as ``--emit FORMAT`` names a plan file's neighbour
    (``api.parse_emits``: ``<stem>.<format><suffix>``)."""
    return {name: path.name for name, path in api.parse_emits(tuple(api.FORMATS), Path(f"mpsim-{of}.json"))}


_PAGE_WORDS = ((re.compile(r"^--emit: "), ""),
               (re.compile(r"; write it with mpsim plan --emit$"),
                "; run it in the One server view with that layout, strategy and microbatch"))
"""``launch_of`` and ``pick_launch`` refuse in the command line's words; the page's own."""


def page_reason(message: str) -> str:
    for pattern, words in _PAGE_WORDS:
        message = pattern.sub(words, message)
    return " ".join(message.split())


class LaunchFolder:
    """A folder of the run's own (under ``scratch``, the server's; the system's temporary
    folder without one), removed when the ``with`` block ends: an uploaded model or server
    written for the formats to read (module doc), and each format's file written by
    ``api.write_emits`` and read back."""

    def __init__(self, scratch: Path | None) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="launch-", dir=scratch))
        self.inputs = self.root / "in"
        self.inputs.mkdir()
        self._folders = re.compile("|".join(re.escape(str(folder)) + r"(?:/[^/\s'\"]+)*/"
                                            for folder in (self.root, *([scratch] if scratch else []))))

    def __enter__(self) -> LaunchFolder:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def model(self, trace: api.Trace, upload_name: str, hf: bool) -> str:
        """``trace`` as a trace file named as the upload (``<stem>-trace.json`` for a Hugging Face config)."""
        name = f"{Path(upload_name).stem}-trace.json" if hf else upload_name
        path = self.inputs / name
        path.write_text(trace.to_json(), encoding="utf-8")
        return str(path)

    def server(self, topology: api.Topology, upload_name: str) -> str:
        """``topology`` as a topology file (JSON, which YAML reads) named as the upload."""
        path = self.inputs / upload_name
        path.write_text(json.dumps(topology.spec.model_dump(by_alias=True, mode="json")), encoding="utf-8")
        return str(path)

    def scrub(self, text: str) -> str:
        """``text`` with no folder of this one's or the scratch folder's: a file there (an
        upload above all) named by its own name."""
        return self._folders.sub("", text)

    def launches(self, of: str, make: Callable[[], Any]) -> Launches:
        """Every format's file of the launch job ``make()`` returns (``api.launch_of`` or
        ``api.pick_launch``); one reason for all where it refuses, each format's where it does."""
        names = file_names(of)
        try:
            launch = make()
        except Exception as exc:  # noqa: BLE001 - the run's result stands; the page says why in one line
            reason = self._reason(exc)
            return Launches(of, tuple(LaunchFile(n, names[n], None, reason) for n in api.FORMATS), reason)
        files = []
        for name in api.FORMATS:
            path = self.root / names[name]
            try:
                api.write_emits(launch, [(name, path)])
                files.append(LaunchFile(name, names[name], self.scrub(path.read_text(encoding="utf-8")), None))
            except Exception as exc:  # noqa: BLE001 - one format's refusal leaves the others
                files.append(LaunchFile(name, names[name], None, self._reason(exc)))
        return Launches(of, tuple(files))

    def _reason(self, exc: Exception) -> str:
        if isinstance(exc, MpsimError):
            return page_reason(self.scrub(str(exc)))
        traceback.print_exc(file=sys.stderr)  # the worker's stderr keeps the trace
        return f"internal error: {type(exc).__name__}"
