"""The HTTP server of ``mpsim serve``: the standard library's threading server, a page
and its script from the installed package, and a small JSON API over ``work`` and ``jobs``.

Every request is answered, errors included: a bad input is a 4xx with the CLI's one-line
message as ``{"error": ...}``, anything unexpected a 500 with one line; the server goes on.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from mpsim import api
from mpsim.errors import MpsimError
from mpsim.web import charts
from mpsim.web.inputs import MAX_UPLOAD_BYTES, UPLOAD_KINDS, JobInputs, UploadStore, check_size, from_query
from mpsim.web.jobs import Busy, Job, JobRunner
from mpsim.web.work import JobOutcome, job_payload, run_choose, run_job

#: The page's files: URL path to (file in ``mpsim/web/static``, content type). Nothing
#: else is ever read from disk for a request.
STATIC = {"/": ("index.html", "text/html; charset=utf-8"),
          "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/static/app.css": ("app.css", "text/css; charset=utf-8")}
LOOPBACK_NAMES = {"127.0.0.1", "localhost", "::1"}
_DRAIN_LIMIT_BYTES = 64 * 2**20
"""An oversized upload is read and dropped up to this, so the browser sees the answer."""


class HttpError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class App:
    """What the server holds between requests: uploads and runs."""

    def __init__(self) -> None:
        self.uploads = UploadStore()
        self.jobs = JobRunner()

    def catalog(self) -> dict:
        return {"servers": list(api.shipped_topologies()), "models": list(api.shipped_traces()),
                "schedules": ["1f1b", "gpipe", "pipedream"], "strategies": list(api.STRATEGIES),
                "partitions": ["compute", "memory"], "upload_kinds": list(UPLOAD_KINDS),
                "max_upload_bytes": MAX_UPLOAD_BYTES}

    def start(self, inputs: JobInputs) -> Job:
        work = run_choose if inputs.view == "choose" else run_job
        return self.jobs.start(inputs, lambda job: work(inputs, self.uploads, job))

    def job(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise HttpError(HTTPStatus.NOT_FOUND, "no such run (the server keeps the last 32)")
        return job

    def status(self, job: Job) -> dict:
        out = job.status()
        inputs: JobInputs = job.inputs
        out.update(view=inputs.view, inputs=inputs.to_dict(), bookmark=inputs.query(),
                   bookmarkable=inputs.bookmarkable)
        if job.state == "done":
            if "payload" not in job.cache:
                outcome = job.outcome
                job.cache["payload"] = job_payload(outcome) if isinstance(outcome, JobOutcome) else {"choose": outcome}
            out.update(job.cache["payload"])
        return out

    def chart(self, job: Job, name: str, fmt: str) -> bytes:
        if not isinstance(job.outcome, JobOutcome) or name not in charts.CHARTS or fmt not in charts.FORMATS:
            raise HttpError(HTTPStatus.NOT_FOUND, f"no chart {name}.{fmt} for this run")
        key = f"chart:{name}.{fmt}"
        if key not in job.cache:
            with self.jobs.compute_lock:  # matplotlib's pyplot is not thread-safe
                job.cache[key] = charts.render(job.outcome.planned.result, name, fmt)
        return job.cache[key]


class Handler(BaseHTTPRequestHandler):
    server: MpsimServer
    server_version = "mpsim-serve"
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        if self.server.verbose:
            super().log_message(format, *args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        try:
            self._check_host()
            url = urlsplit(self.path)
            route = self._route(method, url.path)
            route(parse_qs(url.query, keep_blank_values=True))
        except HttpError as exc:
            self._send_json({"error": str(exc)}, exc.status)
        except MpsimError as exc:
            self._send_json({"error": str(exc)}, HTTPStatus.BAD_REQUEST)
        except Busy as exc:
            self._send_json({"error": str(exc)}, HTTPStatus.TOO_MANY_REQUESTS)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # one bad request never stops the server
            print(f"mpsim serve: {method} {self.path}: {type(exc).__name__}: {exc}", file=sys.stderr)
            self._send_json({"error": f"internal error: {type(exc).__name__}"}, HTTPStatus.INTERNAL_SERVER_ERROR)

    def _check_host(self) -> None:
        """Bound to loopback, answer only requests addressed to it (no DNS rebinding)."""
        if self.server.server_address[0] not in ("127.0.0.1", "::1"):
            return
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]")
        if host not in LOOPBACK_NAMES:
            raise HttpError(HTTPStatus.FORBIDDEN, f"Host {host!r} refused: this server answers 127.0.0.1 only")

    def _route(self, method: str, path: str) -> Callable[[dict[str, list[str]]], None]:
        if method == "GET" and path in STATIC:
            return lambda _: self._static(path)
        for route_method, pattern, handler in ROUTES:
            match = re.fullmatch(pattern, path)
            if match and route_method == method:
                return lambda query, h=handler, m=match: h(self, query, *m.groups())  # type: ignore[misc]
        raise HttpError(HTTPStatus.NOT_FOUND, f"no page {path}")

    def _static(self, path: str) -> None:
        name, content_type = STATIC[path]
        body = resources.files("mpsim.web").joinpath("static", name).read_bytes()
        self._send(body, content_type)

    def _send(self, body: bytes, content_type: str, status: HTTPStatus = HTTPStatus.OK,
              download: str | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        if download:
            self.send_header("Content-Disposition", f'attachment; filename="{download}"')
        self.end_headers()
        self.wfile.write(body)

    def _send_json(self, data: object, status: HTTPStatus = HTTPStatus.OK, download: str | None = None) -> None:
        self._send((json.dumps(data, indent=1) + "\n").encode(), "application/json", status, download)

    def _body(self, name: str, required: bool = True) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None and not required:
            return b""
        if length is None or not length.isdigit():
            raise HttpError(HTTPStatus.LENGTH_REQUIRED, "the upload needs a Content-Length")
        n_bytes = int(length)
        try:
            check_size(name, n_bytes)
        except MpsimError as exc:
            self._drain(n_bytes)
            raise HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, str(exc)) from None
        return self.rfile.read(n_bytes)

    def _drain(self, n_bytes: int) -> None:
        if n_bytes > _DRAIN_LIMIT_BYTES:
            self.close_connection = True
            return
        while n_bytes > 0:
            chunk = self.rfile.read(min(n_bytes, 2**20))
            if not chunk:
                break
            n_bytes -= len(chunk)

    # --- the API -----------------------------------------------------------------------

    def api_catalog(self, query: dict) -> None:
        self._send_json(self.server.app.catalog())

    def api_upload(self, query: dict) -> None:
        kind, name = (query.get(k, [""])[0] for k in ("kind", "name"))
        body = self._body(name or "upload")
        upload = self.server.app.uploads.add(kind, name, body)
        self._send_json({"upload": upload.id, "kind": upload.kind, "name": upload.name})

    def api_start(self, query: dict) -> None:
        self._body("request", required=False)  # a query-only POST; any body is read and ignored
        job = self.server.app.start(from_query(query))
        self._send_json(self.server.app.status(job))

    def api_status(self, query: dict, job_id: str) -> None:
        app = self.server.app
        self._send_json(app.status(app.job(job_id)))

    def api_cancel(self, query: dict, job_id: str) -> None:
        self._body("request", required=False)
        app = self.server.app
        job = app.job(job_id)
        job.cancel.set()
        self._send_json(app.status(job))

    def api_download(self, query: dict, job_id: str, what: str) -> None:
        app = self.server.app
        status = app.status(app.job(job_id))
        if status["state"] != "done" or (what == "plan" and "plan" not in status):
            raise HttpError(HTTPStatus.NOT_FOUND, f"this run has no {what} to download ({status['state']})")
        data = status.get("choose") if what == "result" and status["view"] == "choose" else status[what]
        self._send_json(data, download=f"mpsim-{what}.json")

    def api_chart(self, query: dict, job_id: str, name: str, fmt: str) -> None:
        app = self.server.app
        job = app.job(job_id)
        body = app.chart(job, name, fmt)
        self._send(body, charts.FORMATS[fmt], download=f"mpsim-{name}.png" if fmt == "png" else None)


_ID = r"([0-9a-f]{32})"
ROUTES: list[tuple[str, str, Callable[..., None]]] = [
    ("GET", r"/api/catalog", Handler.api_catalog),
    ("POST", r"/api/upload", Handler.api_upload),
    ("POST", r"/api/jobs", Handler.api_start),
    ("GET", rf"/api/jobs/{_ID}", Handler.api_status),
    ("POST", rf"/api/jobs/{_ID}/cancel", Handler.api_cancel),
    ("GET", rf"/api/jobs/{_ID}/(result|plan)\.json", Handler.api_download),
    ("GET", rf"/api/jobs/{_ID}/chart/(\w+)\.(svg|png)", Handler.api_chart),
]


class MpsimServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, verbose: bool = False) -> None:
        self.app = App()
        self.verbose = verbose
        super().__init__((host, port), Handler)

    @property
    def url(self) -> str:
        host, port = str(self.server_address[0]), self.server_address[1]
        return f"http://{host}:{port}/"

    def server_close(self) -> None:
        super().server_close()
        self.app.uploads.close()


def make_server(host: str = "127.0.0.1", port: int = 0, verbose: bool = False) -> MpsimServer:
    """A server bound to ``host``:``port`` (0: a free port), not yet serving."""
    if not re.fullmatch(r"[0-9A-Za-z.:-]+", host):
        raise MpsimError(f"--host: not a host name or address: {host!r}")
    try:
        return MpsimServer(host, port, verbose)
    except OSError as exc:
        raise MpsimError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None


def serve_in_thread(server: MpsimServer) -> threading.Thread:
    """Serve in a daemon thread (tests); ``server.shutdown()`` stops it."""
    thread = threading.Thread(target=server.serve_forever, name="mpsim-serve", daemon=True)
    thread.start()
    return thread
