"""What the page asks for: one job's inputs as a URL query, shipped names checked against
the catalog, and uploaded files kept in a temporary folder the server owns.

No input names a path: a server or model is a shipped name (looked up in the catalog) or
the id of an upload (looked up in ``UploadStore``); an upload's own file name is reduced to
a plain base name and only ever used inside the store's folder.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from mpsim import api
from mpsim.api import Topology, Trace
from mpsim.errors import MpsimError

MAX_UPLOAD_BYTES = 4 * 2**20
"""Largest upload accepted (the biggest shipped trace is about 64 kB)."""
MAX_UPLOADS = 64
"""Uploads kept at once; the oldest is dropped beyond this."""

#: Upload kinds: what the file must be called and what it is read as.
UPLOAD_KINDS = {"server": ((".yaml", ".yml"), "a topology file in YAML (.yaml or .yml)"),
                "trace": ((".json",), "a trace file in JSON (.json)"),
                "hf": ((".json",), "a Hugging Face config.json (.json)")}

VIEWS = ("job", "choose", "scale")
FINETUNES = ("none", "lora", "qlora")
"""The page's fine-tuning choice: every parameter trains, ``--lora`` or ``--qlora``."""
MAX_LORA_RANK = 1 << 16
"""The largest ``lora_rank`` (``--lora-rank``'s bound, ``FineTune.r``'s)."""
_INT_KEYS = ("microbatch", "microbatches", "global_microbatches", "stages", "min_servers", "max_servers",
             "lora_rank")
_FLOAT_KEYS = ("tokens", "days", "budget")
_KEYS = ("view", "server", "model", "servers", "schedule", "microbatch", "microbatches", "global_microbatches",
         "stages", "layout", "strategy", "partition", "runtime", "finetune", "lora_rank",
         "server_upload", "model_upload", "clusters", "tokens", "days", "budget", "min_servers", "max_servers",
         "headroom", "run")
_NUMBER = re.compile(r"[0-9]{1,16}(\.[0-9]{0,16})?([eE]\+?[0-9]{1,2})?")
SCALE_CLUSTERS: tuple[str, ...] = ("dgx-h100-superpod",)
SCALE_SERVERS = (16, 256)
"""The page's "how many servers" view searches one cluster and 16 to 256 servers unless told."""
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class JobInputs:
    """One run as the page asks for it; ``query()`` and ``from_query`` round-trip."""

    view: str = "job"
    server: str = api.DEFAULT_SERVER
    model: str = api.DEFAULT_MODEL
    servers: tuple[str, ...] = ()
    """The servers a ``choose`` view compares (empty: every shipped one)."""
    schedule: str = api.DEFAULT_SCHEDULE
    microbatch: int | None = None
    microbatches: int = api.DEFAULT_MICROBATCHES
    """Microbatches each replica (pipeline) runs per iteration: the job view's, as
    ``--microbatches`` counts them."""
    global_microbatches: int = api.DEFAULT_MICROBATCHES
    """Microbatches per iteration over all replicas: the choose view compares layouts at this
    global batch (``mpsim choose --global-microbatches``)."""
    stages: int | None = None
    """Pipeline stages of a job view (None: one per GPU)."""
    layout: str = ""
    """A job view's parallel layout by name (``mpsim.plans.layouts.parse_layout``: ``fsdp8``,
    ``tp4spxpp2``, ...); empty: the pipeline over the GPUs."""
    strategy: str = "none"
    partition: str = "compute"
    runtime: str = api.DEFAULT_PROFILE
    """The runtime profile the job and choose views run under (``--runtime``)."""
    finetune: str = "none"
    """What trains in the job and choose views: ``none`` (every parameter), ``lora`` or
    ``qlora`` (``--lora``, ``--qlora``: the model retraced with PEFT's adapters,
    ``api.retraced``)."""
    lora_rank: int | None = None
    """The adapters' rank with ``lora`` or ``qlora`` (``--lora-rank``; None: 16)."""
    server_upload: str | None = None
    model_upload: str | None = None
    clusters: tuple[str, ...] = SCALE_CLUSTERS
    """The clusters a ``scale`` view searches (``mpsim choose --tokens``)."""
    tokens: float = 2e12
    days: float | None = None
    budget: float | None = None
    min_servers: int = SCALE_SERVERS[0]
    max_servers: int = SCALE_SERVERS[1]
    headroom: float = api.DEFAULT_HEADROOM_GIB
    """GiB a plan should leave free (``--headroom``), 0 to ``api.MAX_HEADROOM_GIB``."""

    @property
    def fine_tune(self) -> api.FineTune | None:
        """What ``finetune`` and ``lora_rank`` ask for, as ``--lora``/``--qlora`` and
        ``--lora-rank`` do (``api.fine_tune_of``); None when every parameter trains."""
        if self.finetune == "none":
            return None
        return api.fine_tune_of(self.finetune == "lora", self.finetune == "qlora", None, self.lora_rank)

    @property
    def bookmarkable(self) -> bool:
        """Uploads live only as long as the server: a URL cannot bring them back."""
        return self.server_upload is None and self.model_upload is None

    def query(self) -> str:
        """The URL query of these inputs (uploads left out: they cannot be bookmarked)."""
        pairs: list[tuple[str, str]] = [("view", self.view)]
        if self.view == "scale":
            pairs += [("clusters", ",".join(self.clusters)), ("tokens", f"{self.tokens:g}"),
                      ("min_servers", str(self.min_servers)), ("max_servers", str(self.max_servers))]
            pairs += [(k, f"{v:g}") for k, v in (("days", self.days), ("budget", self.budget)) if v is not None]
        elif self.view == "choose":
            pairs.append(("servers", ",".join(self.servers)))
        elif self.server_upload is None:
            pairs.append(("server", self.server))
        if self.model_upload is None:
            pairs.append(("model", self.model))
        pairs.append(("schedule", self.schedule))
        if self.view == "job":
            pairs.append(("microbatches", str(self.microbatches)))
        elif self.view == "choose":
            pairs.append(("global_microbatches", str(self.global_microbatches)))
        pairs += [("strategy", self.strategy), ("partition", self.partition)]
        if self.runtime != api.DEFAULT_PROFILE and self.view != "scale":
            pairs.append(("runtime", self.runtime))
        pairs += self._fine_tune_pairs()
        if self.microbatch is not None:
            pairs.append(("microbatch", str(self.microbatch)))
        if self.stages is not None and self.view == "job":
            pairs.append(("stages", str(self.stages)))
        if self.layout and self.view == "job":
            pairs.append(("layout", self.layout))
        if self.headroom != api.DEFAULT_HEADROOM_GIB and self.view != "scale":
            pairs.append(("headroom", f"{self.headroom:g}"))
        return urlencode(pairs)

    def _fine_tune_pairs(self) -> list[tuple[str, str]]:
        """``finetune`` unless ``none`` (the default), and ``lora_rank`` where given."""
        pairs = [("finetune", self.finetune)] if self.finetune != "none" else []
        return pairs + ([("lora_rank", str(self.lora_rank))] if self.lora_rank is not None else [])

    def to_dict(self) -> dict:
        return {"view": self.view, "server": self.server, "model": self.model, "servers": list(self.servers),
                "schedule": self.schedule, "microbatch": self.microbatch, "microbatches": self.microbatches,
                "global_microbatches": self.global_microbatches, "stages": self.stages, "layout": self.layout,
                "strategy": self.strategy, "partition": self.partition, "runtime": self.runtime,
                "finetune": self.finetune, "lora_rank": self.lora_rank, "server_upload": self.server_upload,
                "model_upload": self.model_upload, "clusters": list(self.clusters), "tokens": self.tokens,
                "days": self.days, "budget": self.budget, "min_servers": self.min_servers,
                "max_servers": self.max_servers, "headroom": self.headroom}


def _whole_number(key: str, text: str) -> int:
    if not re.fullmatch(r"[0-9]{1,9}", text.strip()):
        raise MpsimError(f"{key}: expected a whole number, got {text!r}")
    return int(text)


def _number(key: str, text: str) -> float:
    if not _NUMBER.fullmatch(text.strip()) or not 0 < float(text) < 1e16:
        raise MpsimError(f"{key}: expected a positive number such as 2e12, got {text!r}")
    return float(text)


def _headroom(text: str) -> float:
    if not _NUMBER.fullmatch(text.strip()) or not 0 <= float(text) <= api.MAX_HEADROOM_GIB:
        raise MpsimError(f"headroom: expected GiB from 0 to {api.MAX_HEADROOM_GIB:g}, got {text!r}")
    return float(text)


def _one_value(query: Mapping[str, list[str]], key: str) -> str | None:
    values = query.get(key)
    if not values:
        return None
    if len(values) > 1:
        raise MpsimError(f"{key}: given {len(values)} times; give it once")
    return values[0]


def from_query(query: Mapping[str, list[str]]) -> JobInputs:
    """Inputs from a parsed query (``urllib.parse.parse_qs``), checked: known keys, a view,
    whole numbers, shipped names in the catalog and upload ids of the right form. The rest
    (schedule, strategy, ranges) is checked by the API, with the CLI's messages."""
    unknown = sorted(set(query) - set(_KEYS))
    if unknown:
        raise MpsimError(f"unknown parameter {unknown[0]!r}: expected some of {', '.join(_KEYS)}")
    given = {k: v for k in _KEYS if (v := _one_value(query, k)) is not None}
    given.pop("run", None)
    inputs = JobInputs()
    if "view" in given and given["view"] not in VIEWS:
        raise MpsimError(f"view: expected one of {', '.join(VIEWS)}, got {given['view']!r}")
    _check_microbatch_keys(given.get("view", inputs.view), given)
    ints = {k: _whole_number(k, given.pop(k)) for k in _INT_KEYS if k in given}
    floats = {k: _number(k, given.pop(k)) for k in _FLOAT_KEYS if k in given}
    lists: dict[str, tuple[str, ...]] = {k: tuple(x for x in given.pop(k).split(",") if x)
                                         for k in ("servers", "clusters") if k in given}
    for key in ("server_upload", "model_upload"):
        if key in given and not _UPLOAD_ID.fullmatch(given[key]):
            raise MpsimError(f"{key}: not an upload id")
    if "headroom" in given:
        floats["headroom"] = _headroom(given.pop("headroom"))
    fields: dict[str, Any] = {**given, **ints, **floats, **lists}
    if "servers" in fields:
        fields["servers"] = tuple(dict.fromkeys(fields["servers"]))  # each server once
    inputs = replace(inputs, **fields)
    check_shipped(inputs)
    check_cost(inputs)
    if inputs.layout:
        api.parse_layout(inputs.layout)  # a bad name refused in one line before the run starts
    if inputs.runtime not in api.PROFILES:
        raise MpsimError(f"runtime: expected one of {', '.join(api.PROFILES)}, got {inputs.runtime!r}")
    if inputs.view == "scale" and inputs.runtime != api.DEFAULT_PROFILE:
        raise MpsimError("runtime: the how-many-servers view runs the default runtime profile (megatron-lm); "
                         "leave it out")
    check_fine_tune(inputs)
    return inputs


def check_fine_tune(inputs: JobInputs) -> None:
    """``finetune`` one of ``FINETUNES``; ``lora_rank`` 1 to ``MAX_LORA_RANK`` and only with
    a fine-tune (``--lora-rank`` alone is refused too); no fine-tune in the how-many-servers
    view, which plans pre-training runs (``choose --tokens`` refuses ``--lora``)."""
    if inputs.finetune not in FINETUNES:
        raise MpsimError(f"finetune: expected one of {', '.join(FINETUNES)}, got {inputs.finetune[:40]!r}")
    if inputs.lora_rank is not None:
        if not 1 <= inputs.lora_rank <= MAX_LORA_RANK:
            raise MpsimError(f"lora_rank: expected 1 to {MAX_LORA_RANK}, got {inputs.lora_rank}")
        if inputs.finetune == "none":
            raise MpsimError("lora_rank: the adapters' rank, with finetune lora or qlora; give one or leave it out")
    if inputs.view == "scale" and inputs.finetune != "none":
        raise MpsimError("finetune: the how-many-servers view plans pre-training runs; compare servers for a "
                         "fine-tune in the choose view")


PAGE_MAX_MICROBATCHES = 256
"""Microbatches per iteration a run from the page may ask for, per replica in the job view and
over all replicas in the choose view (the command line: 4096)."""
PAGE_MAX_MICROBATCH = 256
"""Samples per microbatch a run from the page may ask for."""


def check_cost(inputs: JobInputs) -> None:
    """The page's bounds on a run's work, stricter than the command line's: the simulator's
    events grow with the microbatches and their size, ``choose`` with the servers (each
    named once) and ``best``'s planners; the page serves one person at a time."""
    for key, count in (("microbatches", inputs.microbatches), ("global_microbatches", inputs.global_microbatches)):
        if count > PAGE_MAX_MICROBATCHES:
            raise MpsimError(f"{key}: at most {PAGE_MAX_MICROBATCHES} on the page, got {count} "
                             "(the command line takes up to 4096)")
    if inputs.microbatch is not None and inputs.microbatch > PAGE_MAX_MICROBATCH:
        raise MpsimError(f"microbatch: at most {PAGE_MAX_MICROBATCH} samples on the page, got {inputs.microbatch}")
    if inputs.microbatch == 0:  # every view: the choose and scale views once ran it as "the trace's" or 1
        raise MpsimError("microbatch: expected at least 1 sample (leave it empty for the trace's own), got 0")


_MICROBATCH_KEY = {"job": "microbatches", "choose": "global_microbatches"}
"""The microbatch count each view takes: the job view one replica's (``--microbatches``), the
choose view the global batch its layouts share (``--global-microbatches``)."""


_OTHER_COUNT = {"job": "the job view runs one layout, each replica its microbatches: give microbatches",
                "choose": "the choose view compares layouts at a fixed global batch: give global_microbatches "
                          "(per iteration over all replicas)"}


def _check_microbatch_keys(view: str, given: Mapping[str, str]) -> None:
    """Refuse, in one line naming both keys, the microbatch count the job or choose view does
    not take (the scale view derives its own from the tokens per iteration and reads neither)."""
    wanted = _MICROBATCH_KEY.get(view)
    for key in ("microbatches", "global_microbatches"):
        if wanted is not None and key in given and key != wanted:
            raise MpsimError(f"{key}: {_OTHER_COUNT[view]}")


def check_shipped(inputs: JobInputs) -> None:
    """Shipped names must be in the catalog (the server never reads a path from a request)."""
    topologies, traces = api.shipped_topologies(), api.shipped_traces()
    named = [inputs.server] if inputs.view == "job" and inputs.server_upload is None else []
    for name in [*named, *inputs.servers]:
        if name not in topologies:
            raise MpsimError(f"unknown server {name!r}: expected one of {', '.join(topologies)}")
    if inputs.model_upload is None and inputs.model not in traces:
        raise MpsimError(f"unknown model {inputs.model!r}: expected one of {', '.join(traces)}")
    if inputs.view == "scale":
        clusters = api.shipped_clusters()
        for name in inputs.clusters or ("",):
            if name not in clusters:
                raise MpsimError(f"unknown cluster {name!r}: expected one of {', '.join(clusters)}")
        if not 1 <= inputs.min_servers <= inputs.max_servers <= 4096:
            raise MpsimError(f"servers: expected 1 <= min_servers <= max_servers <= 4096, got {inputs.min_servers} "
                             f"and {inputs.max_servers}")


def safe_file_name(name: str) -> str:
    """The base name of an uploaded file, with nothing but letters, digits, ``.``, ``-``, ``_``."""
    base = re.split(r"[\\/]", name)[-1]
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", base).lstrip(".")[:100]
    return cleaned or "upload"


@dataclass
class Upload:
    id: str
    kind: str
    name: str
    path: Path
    value: Topology | Trace | Path = field(repr=False)
    """The parsed server or trace; for a Hugging Face config, its checked file."""


class UploadStore:
    """Uploaded files in a temporary folder, read with the CLI's own readers; their
    messages name the file as the user called it."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="mpsim-serve-"))
        self._uploads: OrderedDict[str, Upload] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, kind: str, file_name: str, body: bytes) -> Upload:
        """Store and read one upload; a wrong kind, size or content raises MpsimError."""
        name = safe_file_name(file_name)
        if kind not in UPLOAD_KINDS:
            raise MpsimError(f"upload kind: expected one of {', '.join(UPLOAD_KINDS)}, got {kind!r}")
        suffixes, what = UPLOAD_KINDS[kind]
        if not name.lower().endswith(suffixes):
            raise MpsimError(f"{name}: expected {what}")
        check_size(name, len(body))
        upload_id = uuid.uuid4().hex
        folder = self.root / upload_id
        folder.mkdir()
        path = folder / name
        path.write_bytes(body)
        try:
            value = _read_upload(kind, path)
        except MpsimError as exc:
            shutil.rmtree(folder, ignore_errors=True)
            raise MpsimError(str(exc).replace(f"{folder}/", "")) from None
        except BaseException:  # an internal error keeps no file either
            shutil.rmtree(folder, ignore_errors=True)
            raise
        upload = Upload(upload_id, kind, name, path, value)
        self._keep(upload)
        return upload

    def _keep(self, upload: Upload) -> None:
        with self._lock:
            self._uploads[upload.id] = upload
            while len(self._uploads) > MAX_UPLOADS:
                _, old = self._uploads.popitem(last=False)
                shutil.rmtree(old.path.parent, ignore_errors=True)

    def get(self, upload_id: str, kinds: tuple[str, ...]) -> Upload:
        with self._lock:
            upload = self._uploads.get(upload_id)
        if upload is None or upload.kind not in kinds:
            raise MpsimError("the uploaded file is gone (the server was restarted or it was replaced): upload it again")
        return upload

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def check_size(name: str, n_bytes: int) -> None:
    if n_bytes > MAX_UPLOAD_BYTES:
        raise MpsimError(f"{name}: {n_bytes / 2**20:.1f} MiB is over the upload limit of "
                         f"{MAX_UPLOAD_BYTES / 2**20:.0f} MiB")


HF_UPLOAD_LABEL = "or a Hugging Face config.json"
"""The words of the page's Hugging Face upload field (static/index.html), named in the hint
a config uploaded as a trace gets."""


def _refuse_hf_config_as_trace(path: Path) -> None:
    """A Hugging Face config uploaded as a trace: the CLI's hint names ``mpsim trace --hf``
    on the upload's own file; the page's answer is its Hugging Face upload, which traces it.
    Called only once the trace reader refused the file (so the file is JSON, or nothing is said)."""
    try:
        data = json.loads(path.read_bytes())
    except ValueError:
        return
    if not isinstance(data, dict) or "schema" in data:
        return
    key = next((k for k in ("model_type", "architectures") if k in data), None)
    if key is not None:
        raise MpsimError(f"{path.name}: a Hugging Face config.json (it has {key}), not an mpsim trace: upload it "
                         f"under Model, \"{HF_UPLOAD_LABEL}\", which traces it as `mpsim trace --hf` does")


def _read_upload(kind: str, path: Path) -> Topology | Trace | Path:
    if kind == "server":
        return api.read_topology_file(path)
    if kind == "trace":
        try:
            return api.read_trace_file(path)
        except MpsimError:
            _refuse_hf_config_as_trace(path)
            raise
    api.hf_config(str(path))  # the checks of `mpsim trace --hf`; tracing is the job's work
    return path
