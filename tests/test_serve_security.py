"""``mpsim serve`` refuses cross-site requests and foreign Host headers (the module docstring
of ``mpsim.web.app``): raw ``http.client`` requests to 127.0.0.1, headers exactly as written.
"""

from __future__ import annotations

import http.client
import json
import re
import time

import pytest

from mpsim.data.catalog import data_dir
from mpsim.web.app import TOKEN_HEADER, MpsimServer, make_server, serve_in_thread

JOB_QUERY = "/api/jobs?server=dgx1-v100&model=gpt-5.3b&microbatch=2"
UPLOAD_QUERY = "/api/upload?kind=server&name=mine.yaml"
TOPOLOGY = (data_dir("topologies") / "dgx1-v100.yaml").read_bytes()  # a good upload: stored where accepted


@pytest.fixture
def started(server: MpsimServer, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The inputs of every run the server starts during the test."""
    runs: list[object] = []
    start = server.app.start

    def spy(inputs):
        runs.append(inputs)
        return start(inputs)

    monkeypatch.setattr(server.app, "start", spy)
    return runs


def send(srv: MpsimServer, method: str, path: str, headers: list[tuple[str, str]] | None = None,
         body: bytes = b"", host: str | None = None) -> tuple[int, bytes]:
    """One request with exactly these headers; Host is ``host`` (default this server's), or none if ''."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=60)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        if host != "":
            conn.putheader("Host", host or f"127.0.0.1:{srv.server_address[1]}")
        for name, value in headers or []:
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def own_origin(srv: MpsimServer) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def page_headers(srv: MpsimServer, token: str | None = None) -> list[tuple[str, str]]:
    """What Chromium sends with the page's fetch() POSTs."""
    return [("Origin", own_origin(srv)), ("Sec-Fetch-Site", "same-origin"), (TOKEN_HEADER, token or srv.token)]


def one_line_error(raw: bytes) -> str:
    error = json.loads(raw)["error"]
    assert isinstance(error, str) and "\n" not in error
    return error


def stored_uploads(srv: MpsimServer) -> int:
    return sum(1 for _ in srv.app.uploads.root.iterdir())


def cancel(srv: MpsimServer, job_id: str) -> None:
    send(srv, "POST", f"/api/jobs/{job_id}/cancel", page_headers(srv))
    for _ in range(2400):
        status, raw = send(srv, "GET", f"/api/jobs/{job_id}")
        if json.loads(raw)["state"] in ("done", "failed", "cancelled"):
            return
        time.sleep(0.05)
    raise AssertionError(f"run {job_id} did not finish")


CROSS_SITE = [
    pytest.param([("Origin", "http://evil.example")], id="origin-evil"),
    pytest.param([("Origin", "null")], id="origin-null"),
    pytest.param([("Origin", "http://127.0.0.1:1")], id="origin-other-port"),
    pytest.param([("Origin", "http://127.0.0.1.evil.example")], id="origin-prefix"),
    pytest.param([("Sec-Fetch-Site", "cross-site")], id="sec-fetch-cross-site"),
    pytest.param([("Sec-Fetch-Site", "same-site")], id="sec-fetch-same-site"),
]


@pytest.mark.parametrize("headers", CROSS_SITE)
def test_cross_site_runs_are_refused_even_with_the_token(server, started, headers):
    status, raw = send(server, "POST", JOB_QUERY, [*headers, (TOKEN_HEADER, server.token)])
    assert status == 403 and one_line_error(raw)
    assert started == []


@pytest.mark.parametrize("headers", CROSS_SITE)
def test_cross_site_uploads_are_refused_and_nothing_is_stored(server, headers):
    before = stored_uploads(server)
    status, raw = send(server, "POST", UPLOAD_QUERY, [*headers, (TOKEN_HEADER, server.token)], TOPOLOGY)
    assert status == 403 and one_line_error(raw)
    assert stored_uploads(server) == before


@pytest.mark.parametrize("path", [JOB_QUERY, UPLOAD_QUERY, "/api/jobs/" + "0" * 32 + "/cancel"])
@pytest.mark.parametrize("token", [None, "", "wrong", "x" * 43], ids=["missing", "empty", "wrong", "same-length"])
def test_a_browser_request_without_the_right_token_is_refused(server, started, path, token):
    before = stored_uploads(server)
    headers = [("Origin", own_origin(server)), ("Sec-Fetch-Site", "same-origin")]
    if token is not None:
        headers.append((TOKEN_HEADER, token))
    status, raw = send(server, "POST", path, headers, TOPOLOGY)
    assert status == 403 and TOKEN_HEADER in one_line_error(raw)
    assert started == [] and stored_uploads(server) == before


def test_a_wrong_token_is_refused_without_browser_headers_too(server, started):
    status, raw = send(server, "POST", JOB_QUERY, [(TOKEN_HEADER, "wrong")])
    assert status == 403 and TOKEN_HEADER in one_line_error(raw)
    status, raw = send(server, "POST", JOB_QUERY, [(TOKEN_HEADER, server.token), (TOKEN_HEADER, server.token)])
    assert status == 403 and started == []


def test_the_page_with_its_token_runs_and_uploads(server, started):
    status, raw = send(server, "POST", JOB_QUERY, page_headers(server))
    assert status == 200, raw
    cancel(server, json.loads(raw)["id"])
    assert len(started) == 1
    before = stored_uploads(server)
    status, raw = send(server, "POST", UPLOAD_QUERY, page_headers(server), TOPOLOGY)
    assert status == 200 and json.loads(raw)["name"] == "mine.yaml", raw
    assert stored_uploads(server) == before + 1


def test_a_page_from_localhost_may_post_to_localhost(server, started):
    port = server.server_address[1]
    headers = [("Origin", f"http://localhost:{port}"), (TOKEN_HEADER, server.token)]
    status, raw = send(server, "POST", JOB_QUERY, headers, host=f"localhost:{port}")
    assert status == 200, raw
    cancel(server, json.loads(raw)["id"])
    status, _ = send(server, "POST", JOB_QUERY, headers)  # Origin localhost, Host 127.0.0.1: another origin
    assert status == 403


def test_the_page_carries_this_servers_token_and_its_script_sends_it(server):
    status, page = send(server, "GET", "/")
    assert status == 200
    match = re.search(rb'<meta name="mpsim-token" content="([^"]+)">', page)
    assert match and match.group(1).decode() == server.token and len(server.token) >= 40
    status, script = send(server, "GET", "/static/app.js")
    assert status == 200 and TOKEN_HEADER.encode() in script
    other = make_server("127.0.0.1", 0)  # unguessable: a new one each start
    try:
        assert other.token != server.token
    finally:
        other.server_close()


@pytest.mark.parametrize("path", ["/", "/static/app.js", "/static/app.css", "/api/catalog"])
def test_reads_need_no_token_and_ignore_a_foreign_origin(server, path):
    assert send(server, "GET", path)[0] == 200
    assert send(server, "GET", path, [("Origin", "http://evil.example"), ("Sec-Fetch-Site", "cross-site")])[0] == 200


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize("host", ["127.0.0.1:{port}@evil.example", "127.0.0.1:{port} evil.example", "",
                                  "127.0.0.1:{port}:{port}", "http://127.0.0.1:{port}", "127.0.0.1:abc", "[::1"])
def test_malformed_host_headers_are_400(server, started, method, host):
    status, raw = send(server, method, JOB_QUERY if method == "POST" else "/api/catalog", page_headers(server),
                       host=host.format(port=server.server_address[1]) or "")
    assert status == 400 and one_line_error(raw)
    assert started == []


def test_two_host_headers_are_400(server, started):
    port = server.server_address[1]
    for second in (f"127.0.0.1:{port}", "evil.example"):
        status, raw = send(server, "POST", JOB_QUERY, [("Host", second), *page_headers(server)])
        assert status == 400 and one_line_error(raw) == "expected one Host header, got 2"
    assert started == []


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1", "127.0.0.1:1",
                                  "localhost:{other}", "127.0.0.2:{port}", "[::1]:{port}", "0x7f000001:{port}"])
def test_hosts_other_than_this_server_are_refused(server, started, host):
    port = server.server_address[1]
    host = host.format(port=port, other=port + 1)
    for method, path in (("GET", "/api/catalog"), ("GET", "/"), ("POST", JOB_QUERY)):
        status, raw = send(server, method, path, page_headers(server), host=host)
        assert status == 403 and "refused" in one_line_error(raw), (method, host)
    assert started == []


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST:{port}"])
def test_this_servers_own_names_are_answered(server, host):
    assert send(server, "GET", "/api/catalog", host=host.format(port=server.server_address[1]))[0] == 200


# --- what a real browser sends ----------------------------------------------------------

FORM_POST = """url => { const f = document.createElement("form"); f.method = "POST"; f.action = url;
                        document.body.append(f); f.submit(); }"""


@pytest.mark.browser
def test_a_page_on_another_port_cannot_run_jobs_here(browser, server, started):
    other = make_server("127.0.0.1", 0)  # another local page, the nearest a hostile one can get
    serve_in_thread(other)
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(other.url)
        target = server.url.rstrip("/") + JOB_QUERY
        answer = page.evaluate("url => fetch(url, {method: 'POST', mode: 'no-cors'}).then(r => r.type)", target)
        assert answer == "opaque"  # sent, and its answer hidden from the page
        cors = page.evaluate("(args) => fetch(args[0], {method: 'POST', headers: {'X-Mpsim-Token': args[1]}})"
                             ".then(r => r.status, e => 'blocked')", [target, "guessed"])
        assert cors == "blocked"  # a custom header needs a CORS preflight that is never granted
        page.evaluate(FORM_POST, target)
        page.wait_for_url(target)
        assert "refused" in page.inner_text("body")
        assert started == []
    finally:
        context.close()
        other.shutdown()
        other.server_close()


@pytest.mark.browser
def test_the_servers_own_page_needs_the_token_too(browser, server, started):
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(server.url)
        page.wait_for_selector("body[data-ready='1']")
        status = page.evaluate("url => fetch(url, {method: 'POST'}).then(r => r.status)", JOB_QUERY)
        assert status == 403 and started == []
        page.evaluate(FORM_POST, JOB_QUERY)
        page.wait_for_url(server.url.rstrip("/") + JOB_QUERY)
        assert "X-Mpsim-Token" in page.inner_text("body") and started == []
    finally:
        context.close()
