"""The HTTP server of ``mpsim serve``: the standard library's threading server, a page
and its script from the installed package, and a small JSON API over ``work`` and ``jobs``.

Every request is answered, errors included: a bad input is a 4xx with the CLI's one-line
message as ``{"error": ...}``, anything unexpected a 500 with one line; the server goes on.

Cross-site protection: another page open in the user's browser must not run jobs or store
uploads here, and a rebound DNS name must not reach the server at all.

* Host, every request: exactly one ``Host`` header of the form ``name[:port]``, else 400.
  Bound to loopback, the name must be one this address answers to (``localhost`` and
  ``127.0.0.1``, or ``[::1]``) and the port this server's (no port only on port 80, as a
  browser writes it), else 403 (DNS rebinding). Bound elsewhere, any name is answered.
* Any method but GET and HEAD (state-changing): ``Sec-Fetch-Site``, where sent, must be
  ``same-origin`` and ``Origin``, where sent, exactly ``http://`` + the request's Host, so
  ``null`` and other ports are refused too; then the per-server token (``secrets``, new at
  each start) must come in ``X-Mpsim-Token``, compared with ``hmac.compare_digest``. All
  three refusals are 403. The token lives only in the page: ``GET /`` serves index.html
  with it in ``<meta name="mpsim-token">``, and app.js sends it on every POST. Another
  origin cannot read that page (the same-origin policy, with the Host check against
  rebinding), cannot send the header without a CORS preflight this server never grants,
  and a plain form post has no way to add it.
* A request with none of ``Origin``, ``Sec-Fetch-Site`` and the token is not from a
  browser (browsers send ``Origin`` on every POST, ``null`` where they hide it): a script
  or curl on this machine, which could read the token from ``GET /`` anyway, so it is
  answered without one. Anything carrying browser headers must carry the token.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import re
import secrets
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
from mpsim.web.inputs import (
    FINETUNES,
    MAX_UPLOAD_BYTES,
    UPLOAD_KINDS,
    JobInputs,
    UploadStore,
    check_size,
    from_query,
)
from mpsim.web.jobs import Busy, JobRunner, PageRun, short_message
from mpsim.web.launches import Launches, LaunchFile
from mpsim.web.work import WORKS, ChooseOutcome, JobOutcome, job_payload, request_of

#: The page's files: URL path to (file in ``mpsim/web/static``, content type). Nothing
#: else is ever read from disk for a request.
STATIC = {"/": ("index.html", "text/html; charset=utf-8"),
          "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/static/app.css": ("app.css", "text/css; charset=utf-8")}
#: The names a browser may use for a server bound to a loopback address, in Host and Origin.
LOOPBACK_NAMES = {"127.0.0.1": ("localhost", "127.0.0.1"), "::1": ("localhost", "[::1]")}
SAFE_METHODS = ("GET", "HEAD")
TOKEN_HEADER = "X-Mpsim-Token"
TOKEN_PLACEHOLDER = b"__MPSIM_TOKEN__"
"""Where index.html takes this server's token (a ``secrets.token_urlsafe``: HTML-safe)."""
_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[0-9A-Za-z.-]+)(?::([0-9]{1,5}))?")
_DRAIN_LIMIT_BYTES = 64 * 2**20
"""An oversized upload is read and dropped up to this, so the browser sees the answer."""
CONNECTION_TIMEOUT_S = 30.0
"""A connection idle this long (no request line, no headers, a body that stops short of its
Content-Length) is closed: each holds a thread."""
MAX_CONNECTIONS = 64
"""Connections served at once; one more is answered 503 and closed (the page needs a few)."""


class HttpError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def _labels() -> dict[str, dict[str, str]]:
    """A word on each server (its GPUs) and strategy (``Strategy.word``) for the page's lists."""
    servers = {}
    for name in api.shipped_topologies():
        topo = api.load_topology(name)
        servers[name] = f"{topo.n_gpus} x {topo.spec.gpu.model}"
    return {"servers": servers, "strategies": {name: s.word for name, s in api.STRATEGIES.items() if s.word}}


class App:
    """What the server holds between requests: uploads and runs."""

    def __init__(self) -> None:
        self.uploads = UploadStore()
        self.jobs = JobRunner()
        self._chart_lock = threading.Lock()

    def catalog(self) -> dict:
        return {"servers": list(api.shipped_topologies()), "models": list(api.shipped_traces()),
                "schedules": ["1f1b", "gpipe", "pipedream"], "strategies": list(api.STRATEGIES),
                "partitions": ["compute", "memory"], "runtimes": list(api.PROFILES),
                "finetunes": list(FINETUNES),
                "upload_kinds": list(UPLOAD_KINDS),
                "max_upload_bytes": MAX_UPLOAD_BYTES, "clusters": list(api.shipped_clusters()),
                "labels": _labels()}


    def start(self, inputs: JobInputs) -> PageRun:
        work = WORKS[inputs.view]
        return self.jobs.start(inputs, lambda job: self.jobs.worker.run(work, request_of(inputs, self.uploads),
                                                                        job.set_tasks, job.cancel))

    def job(self, job_id: str) -> PageRun:
        job = self.jobs.get(job_id)
        if job is None:
            raise HttpError(HTTPStatus.NOT_FOUND, "no such run (the server keeps the last 32)")
        return job

    def status(self, job: PageRun) -> dict:
        out = job.status()
        inputs: JobInputs = job.inputs
        out.update(view=inputs.view, inputs=inputs.to_dict(), bookmark=inputs.query(),
                   bookmarkable=inputs.bookmarkable)
        if job.state == "done":
            if "payload" not in job.cache:
                job.cache["payload"] = _payload(job.outcome)
            out.update(job.cache["payload"])
        return out

    def launch(self, job: PageRun, fmt: str) -> LaunchFile:
        """The run's job as format ``fmt``, made when the run ended (``mpsim.web.launches``);
        one line where the format is unknown, the run has none, or the format cannot state it."""
        if fmt not in api.FORMATS:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"format {fmt[:40]!r}: expected one of {', '.join(api.FORMATS)}")
        launches = getattr(job.outcome, "launches", None) if job.state == "done" else None
        if not isinstance(launches, Launches):
            why = _NOT_DONE.get(job.state, f"the {job.inputs.view} view's result is no plan (the job and choose "
                                           "views write theirs)")
            raise HttpError(HTTPStatus.BAD_REQUEST, f"this run has no {fmt} configuration to download: {why}")
        found = launches.get(fmt)
        assert found is not None
        if found.text is None:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"{fmt}: {found.reason}")
        return found

    def chart(self, job: PageRun, name: str, fmt: str) -> bytes:
        if not isinstance(job.outcome, JobOutcome) or name not in charts.CHARTS or fmt not in charts.FORMATS:
            raise HttpError(HTTPStatus.NOT_FOUND, f"no chart {name}.{fmt} for this run")
        key = f"chart:{name}.{fmt}"
        if key not in job.cache:
            with self._chart_lock:  # matplotlib's pyplot is not thread-safe
                job.cache[key] = charts.render(job.outcome.planned.result, name, fmt)
        return job.cache[key]


_NOT_DONE = {"waiting": "it has not started", "running": "it is still running", "failed": "it failed",
             "cancelled": "it was cancelled"}


def _payload(outcome: object) -> dict:
    """What the page shows of a finished run: a job's verdict, plan and result, or the choose
    and scale views' report and page; with the plan or pick as each framework's configuration."""
    if isinstance(outcome, JobOutcome):
        payload = job_payload(outcome)
    else:
        payload = {"choose": outcome.data if isinstance(outcome, ChooseOutcome) else outcome}
    launches = getattr(outcome, "launches", None)
    if isinstance(launches, Launches):
        payload["launch"] = launches.summary()
    return payload


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

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_OPTIONS(self) -> None:
        self._dispatch("OPTIONS")

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.timeout_s)  # idle and short bodies: see CONNECTION_TIMEOUT_S

    def _dispatch(self, method: str) -> None:
        try:
            self._check_framing()
            host = self._check_host()
            if method not in SAFE_METHODS:
                self._check_same_origin(host)
            url = urlsplit(self.path)
            route = self._route(method, url.path)
            route(parse_qs(url.query, keep_blank_values=True))
        except HttpError as exc:
            if exc.status in (HTTPStatus.BAD_REQUEST, HTTPStatus.FORBIDDEN, HTTPStatus.NOT_FOUND,
                              HTTPStatus.METHOD_NOT_ALLOWED):
                self.close_connection = True  # refused before its body was read: no next request on it
            self._send_json({"error": short_message(str(exc))}, exc.status)
        except MpsimError as exc:
            self._send_json({"error": short_message(str(exc))}, HTTPStatus.BAD_REQUEST)
        except Busy as exc:
            self._send_json({"error": short_message(str(exc))}, HTTPStatus.TOO_MANY_REQUESTS)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except TimeoutError:  # a body that stopped short of its Content-Length
            self.close_connection = True
            self._send_json({"error": f"the request's body did not arrive within {self.server.timeout_s:g} s"},
                            HTTPStatus.REQUEST_TIMEOUT)
        except Exception as exc:  # one bad request never stops the server
            print(f"mpsim serve: {method} {self.path}: {type(exc).__name__}: {exc}", file=sys.stderr)
            self._send_json({"error": f"internal error: {type(exc).__name__}"}, HTTPStatus.INTERNAL_SERVER_ERROR)

    def _check_framing(self) -> None:
        """One way to read the body, or none: at most one Content-Length (a number), no
        Transfer-Encoding (never parsed here, so its bytes would be read as a request), and
        every header line a ``name: value`` (a line without a colon would hide the rest).
        400 and the connection closed otherwise."""
        if self.headers.defects:
            raise HttpError(HTTPStatus.BAD_REQUEST, "malformed header line (no colon): headers are name: value")
        if self.headers.get_all("Transfer-Encoding"):
            raise HttpError(HTTPStatus.BAD_REQUEST, "Transfer-Encoding is not supported: send a Content-Length")
        lengths = self.headers.get_all("Content-Length") or []
        if len(lengths) > 1:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"{len(lengths)} Content-Length headers: send one")
        if lengths and not lengths[0].strip().isdigit():
            raise HttpError(HTTPStatus.BAD_REQUEST, f"Content-Length {lengths[0][:40]!r} is not a number")

    def _check_host(self) -> str:
        """The request's one ``Host``, checked (see the module docstring); 400 or 403 if not."""
        values = self.headers.get_all("Host") or []
        if len(values) != 1:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"expected one Host header, got {len(values)}")
        host = values[0].strip().lower()
        match = _HOST.fullmatch(host)
        if match is None:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"Host {values[0][:100]!r} refused: not a host name and port")
        names = self.server.host_names
        if not names:  # bound to a non-loopback address: any name
            return host
        name, port = match.groups()
        if name not in names:
            raise HttpError(HTTPStatus.FORBIDDEN,
                            f"Host {name!r} refused: this server answers {' and '.join(names)} only")
        server_port = self.server.server_address[1]
        if port != str(server_port) and not (port is None and server_port == 80):
            raise HttpError(HTTPStatus.FORBIDDEN, f"Host {host!r} refused: this server is on port {server_port}")
        return host

    def _check_same_origin(self, host: str) -> None:
        """A state-changing request comes from this server's own page, with its token, or from no browser."""
        sites = self.headers.get_all("Sec-Fetch-Site") or []
        if any(site.strip().lower() != "same-origin" for site in sites):
            raise HttpError(HTTPStatus.FORBIDDEN, f"request from another site or port refused "
                            f"(Sec-Fetch-Site: {sites[0][:40]})")
        origins = self.headers.get_all("Origin") or []
        if len(origins) > 1 or (origins and origins[0].strip().lower() != f"http://{host}"):
            raise HttpError(HTTPStatus.FORBIDDEN, f"Origin {origins[0][:100]!r} refused: only this server's page "
                            "may change anything")
        tokens = self.headers.get_all(TOKEN_HEADER) or []
        if not (tokens or origins or sites):  # not a browser: see the module docstring
            return
        if len(tokens) != 1 or not hmac.compare_digest(tokens[0].encode(), self.server.token.encode()):
            raise HttpError(HTTPStatus.FORBIDDEN, f"missing or wrong {TOKEN_HEADER}: reload the page "
                            "(the token changes each time the server starts)")

    def _route(self, method: str, path: str) -> Callable[[dict[str, list[str]]], None]:
        if method == "GET" and path in STATIC:
            return lambda _: self._static(path)
        for route_method, pattern, handler in ROUTES:
            match = re.fullmatch(pattern, path)
            if match and route_method == method:
                return lambda query, h=handler, m=match: h(self, query, *m.groups())  # type: ignore[misc]
        allowed = sorted({m for m, pattern, _ in ROUTES if re.fullmatch(pattern, path)}
                         | ({"GET"} if path in STATIC else set()))
        if allowed:
            raise HttpError(HTTPStatus.METHOD_NOT_ALLOWED, f"{method[:10]} {path[:100]}: use {' or '.join(allowed)}")
        raise HttpError(HTTPStatus.NOT_FOUND, f"no page {path[:100]}")

    def _static(self, path: str) -> None:
        name, content_type = STATIC[path]
        body = resources.files("mpsim.web").joinpath("static", name).read_bytes()
        if name == "index.html":
            body = body.replace(TOKEN_PLACEHOLDER, self.server.token.encode())
        self._send(body, content_type)

    def _send(self, body: bytes, content_type: str, status: HTTPStatus = HTTPStatus.OK,
              download: str | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("X-Frame-Options", "DENY")  # no clicking Run through another site's frame
        if download:
            self.send_header("Content-Disposition", f'attachment; filename="{download}"')
        self.end_headers()
        if self.command != "HEAD":  # a HEAD answer has the headers of the body it leaves out
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
        data = status.get("choose") if what == "result" and status["view"] in ("choose", "scale") else status[what]
        self._send_json(data, download=f"mpsim-{what}.json")

    def api_launch(self, query: dict, job_id: str, fmt: str) -> None:
        app = self.server.app
        found = app.launch(app.job(job_id), fmt)
        assert found.text is not None
        self._send(found.text.encode(), found.content_type, download=found.file)

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
    ("GET", rf"/api/jobs/{_ID}/launch/([^/]*)", Handler.api_launch),
]


class MpsimServer(ThreadingHTTPServer):
    """The standard library's threading server, bounded: ``max_connections`` at once (one
    more is answered 503 and closed) and each closed after ``timeout_s`` idle
    (``CONNECTION_TIMEOUT_S``). The page is a local tool for one person: a few
    connections, small bodies, no TLS; the standard library's server with these bounds and
    the framing checks of ``Handler._check_framing`` keeps mpsim free of a web stack."""

    daemon_threads = True

    def __init__(self, host: str, port: int, verbose: bool = False, timeout_s: float = CONNECTION_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.app = App()
        self.verbose = verbose
        self.token = secrets.token_urlsafe(32)  # the page's X-Mpsim-Token, new at each start
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__((host, port), Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            body = json.dumps({"error": "too many connections to mpsim serve at once"}).encode()
            with contextlib.suppress(OSError):
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    @property
    def host_names(self) -> tuple[str, ...]:
        """The names a request's Host may use: those of the loopback address bound, or () for any."""
        return LOOPBACK_NAMES.get(str(self.server_address[0]), ())

    @property
    def url(self) -> str:
        host, port = str(self.server_address[0]), self.server_address[1]
        return f"http://{host}:{port}/"

    def server_close(self) -> None:
        super().server_close()
        self.app.jobs.close()
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
