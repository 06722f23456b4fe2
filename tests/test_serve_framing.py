"""``mpsim serve`` at the socket: framing refused where a body could be read two ways,
connections closed when idle or short of their body, and a cap on connections at once.
Each test talks raw HTTP/1.1 to a server of its own with short bounds."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from mpsim.web.app import MpsimServer, serve_in_thread

TIMEOUT_S = 1.0
"""The test servers' idle timeout (the shipped one is CONNECTION_TIMEOUT_S)."""


@pytest.fixture
def small_server() -> Iterator[MpsimServer]:
    srv = MpsimServer("127.0.0.1", 0, timeout_s=TIMEOUT_S, max_connections=3)
    serve_in_thread(srv)
    yield srv
    srv.shutdown()
    srv.server_close()


def _connect(srv: MpsimServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=30)  # bounds the test only


def _exchange(srv: MpsimServer, raw: bytes) -> bytes:
    """Send ``raw`` and read until the server closes the connection."""
    with _connect(srv) as sock:
        sock.sendall(raw)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _host(srv: MpsimServer) -> bytes:
    return f"127.0.0.1:{srv.server_address[1]}".encode()


def _answers(reply: bytes) -> list[tuple[int, dict]]:
    """Each HTTP response in ``reply``: its status and JSON body."""
    out = []
    while reply:
        head, _, rest = reply.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        length = next(int(h.split(":", 1)[1]) for h in lines[1:] if h.lower().startswith("content-length:"))
        out.append((int(lines[0].split()[1]), json.loads(rest[:length])))
        reply = rest[length:]
    return out


def test_two_content_lengths_are_refused_and_the_connection_closed(small_server):
    raw = (b"POST /api/jobs?view=job HTTP/1.1\r\nHost: " + _host(small_server) + b"\r\n"
           b"Content-Length: 0\r\nContent-Length: 40\r\n\r\n")
    [(status, body)] = _answers(_exchange(small_server, raw))
    assert status == 400 and body["error"] == "2 Content-Length headers: send one"


def test_a_chunked_body_is_refused_and_never_read_as_a_second_request(small_server):
    smuggled = b"GET /api/catalog HTTP/1.1\r\nHost: " + _host(small_server) + b"\r\n\r\n"
    chunk = b"%x\r\n%s\r\n0\r\n\r\n" % (len(smuggled), smuggled)
    raw = (b"POST /api/jobs?view=job HTTP/1.1\r\nHost: " + _host(small_server) + b"\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n" + chunk)
    answers = _answers(_exchange(small_server, raw))
    assert answers == [(400, {"error": "Transfer-Encoding is not supported: send a Content-Length"})]


def test_a_header_line_without_a_colon_is_refused(small_server):
    raw = (b"POST /api/jobs?view=job HTTP/1.1\r\nHost: " + _host(small_server) + b"\r\nBogus line\r\n"
           b"Origin: http://evil.example\r\n\r\n")
    [(status, body)] = _answers(_exchange(small_server, raw))
    assert status == 400 and body["error"].startswith("malformed header line")


def test_a_body_short_of_its_content_length_is_closed_by_the_timeout(small_server):
    raw = (b"POST /api/upload?kind=trace&name=t.json HTTP/1.1\r\nHost: " + _host(small_server) + b"\r\n"
           b"Content-Length: 1000\r\n\r\n{\"short\": ")
    [(status, body)] = _answers(_exchange(small_server, raw))
    assert status == 408 and body["error"] == f"the request's body did not arrive within {TIMEOUT_S:g} s"


def test_an_idle_connection_is_closed_by_the_timeout(small_server):
    with _connect(small_server) as sock:
        assert sock.recv(1) == b""  # closed by the server (the test's own socket timeout is far longer)


def test_connections_past_the_cap_are_answered_503_and_the_cap_frees_again(small_server):
    held = [_connect(small_server) for _ in range(3)]
    try:
        for sock in held:  # each is being served: its request line is awaited
            sock.sendall(b"GET /api/catalog HTTP/1.1\r\nHost: " + _host(small_server) + b"\r\n")
        [(status, body)] = _answers(_exchange(small_server, b""))
        assert status == 503 and body == {"error": "too many connections to mpsim serve at once"}
    finally:
        for sock in held:
            sock.close()
    for _ in range(100):  # the held ones' threads end as their sockets close
        reply = _exchange(small_server, b"GET /api/catalog HTTP/1.1\r\nHost: " + _host(small_server)
                          + b"\r\nConnection: close\r\n\r\n")
        if reply.startswith(b"HTTP/1.1 200"):
            break
    assert reply.startswith(b"HTTP/1.1 200")
