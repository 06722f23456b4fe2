"""The HTTP API of ``mpsim serve`` under hostile requests (hypothesis, derandomized, bounded,
loopback only): odd methods, paths, query values, headers and bodies. Every request is
answered, never with a 500 or a Python traceback, every error is one line, and the server
answers a plain request afterwards. Runs a request starts are cancelled after each example,
so the fuzzing costs no simulation time beyond one task each."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpsim.web.app import MpsimServer, serve_in_thread

FUZZ = settings(derandomize=True, deadline=None, max_examples=150, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

PATHS = ["/", "/api/catalog", "/api/upload", "/api/jobs", "/api/jobs/" + "0" * 32, "/api/jobs/" + "a" * 32 + "/cancel",
         "/api/jobs/" + "b" * 32 + "/result.json", "/api/jobs/" + "c" * 32 + "/chart/memory.svg", "/static/app.js",
         "/../../etc/passwd", "/api/jobs/../../x", "/%00", "/api//jobs", "/" + "x" * 5000]
KEYS = ["view", "server", "model", "servers", "schedule", "microbatch", "microbatches", "stages", "strategy",
        "partition", "server_upload", "model_upload", "clusters", "tokens", "days", "budget", "min_servers",
        "max_servers", "headroom", "run", "kind", "name", "bogus"]
VALUES = ["", "0", "-1", "1", "2", "4096", "4097", "99999999999", "1e400", "nan", "inf", "1.5", "x", "best", "none",
          "mpress", "job", "choose", "scale", "dgx1-v100", "gpt-5.3b", "llama-3-70b", "../../etc/passwd", "/etc/passwd",
          "a" * 32, "dgx1-v100," * 50, "%ff", "%00", "\u00e9", "1f1b", "gpipe", "memory", "hf", "trace", "server",
          "c.json", "../x.yaml", "dgx-h100-superpod"]
BODIES = [b"", b"{}", b"[]", b"null", b"{" * 5000, b'{"model_type": "llama", "num_hidden_layers": 20000}',
          b'{"model_type": "llama", "hidden_size": "abc", "num_hidden_layers": 2, "num_attention_heads": 1, '
          b'"vocab_size": 10}', b"name: x\ngpu: {count: -1}\n", b"\xff\xfe\x00garbage", b"a: &a [*a]\n",
          b"x" * 70000]


#: Requests that would run, the fuzzed keys changing one or two of their values.
BASES = {"/api/jobs": {"view": "job", "server": "dgx1-v100", "model": "gpt-5.3b", "microbatch": "2",
                       "microbatches": "8", "strategy": "none"},
         "/api/upload": {"kind": "hf", "name": "config.json"}}


@st.composite
def requests(draw) -> tuple[bytes, bool]:
    """One raw request, and whether it is well framed (a complete request line, headers and body)."""
    method = draw(st.sampled_from(["POST"] * 5 + ["GET"] * 3 + ["HEAD", "PUT", "OPTIONS", "G\x00T"]))
    path = draw(st.sampled_from(["/api/jobs"] * 6 + ["/api/upload"] * 4 + PATHS))
    base = dict(BASES.get(path, {}))
    for key, value in draw(st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(VALUES)), max_size=3)):
        base[key] = value
    pairs = list(base.items()) + draw(st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(VALUES)), max_size=1))
    query = "&".join(f"{k}={v}" for k, v in pairs)
    target = path + ("?" + query if query else "")
    body = draw(st.sampled_from(BODIES))
    headers = [b"Host: HOST"]
    for name, value in draw(st.lists(st.sampled_from([
            (b"Origin", b"http://evil.example"), (b"Origin", b"null"), (b"Sec-Fetch-Site", b"cross-site"),
            (b"X-Mpsim-Token", b"guess"), (b"Host", b"127.0.0.1:1@evil.example"), (b"Content-Type", b"text/plain"),
            (b"Content-Length", b"-5"), (b"Content-Length", b"99999999999999999999"), (b"Expect", b"100-continue"),
            (b"Connection", b"keep-alive"), (b"Transfer-Encoding", b"chunked"), (b"X-Long", b"y" * 9000),
    ]), max_size=3)):
        headers.append(name + b": " + value)
    if not any(h.startswith(b"Content-Length") for h in headers):
        headers.append(b"Content-Length: %d" % len(body))
    headers.append(b"Connection: close")
    raw = method.encode("latin-1") + b" " + target.encode("utf-8") + b" HTTP/1.1\r\n" + b"\r\n".join(headers)
    return raw + b"\r\n\r\n" + body, True


def _send(port: int, raw: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused before the body: answer waiting
            sock.sendall(raw)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
    return b"".join(chunks)


def _cancel_all(server) -> None:
    for job in list(server.app.jobs._jobs.values()):
        job.cancel.set()


@pytest.fixture(scope="module")
def quick_server() -> Iterator[MpsimServer]:
    """A server whose connections time out after 1 s (a declared body that never comes)."""
    srv = MpsimServer("127.0.0.1", 0, timeout_s=1.0)
    serve_in_thread(srv)
    yield srv
    srv.shutdown()
    srv.server_close()


@FUZZ
@given(request=requests())
def test_hostile_requests_get_one_line_answers_and_no_500(quick_server, request):
    server = quick_server
    raw, _ = request
    port = server.server_address[1]
    raw = raw.replace(b"Host: HOST", b"Host: 127.0.0.1:%d" % port, 1)
    try:
        reply = _send(port, raw)
    finally:
        _cancel_all(server)
    assert b"Traceback" not in reply
    while reply.startswith(b"HTTP/1.1 100"):  # Expect: 100-continue answered first
        reply = reply.partition(b"\r\n\r\n")[2]
    if reply:
        status_line, _, rest = reply.partition(b"\r\n")
        parts = status_line.split()
        assert parts[0].startswith(b"HTTP/"), status_line
        status = int(parts[1])
        assert status != 500, reply[:500]
        head, _, body = rest.partition(b"\r\n\r\n")
        if status >= 400 and b"application/json" in head and body:
            error = json.loads(body)["error"]
            assert "\n" not in error and "internal error" not in error, error
    assert _send(port, b"GET /api/catalog HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: close\r\n\r\n" % port) \
        .startswith(b"HTTP/1.1 200")
