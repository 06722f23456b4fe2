from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from mpsim.web.app import MpsimServer

sys.path.insert(0, str(Path(__file__).parent))

# The suite tests the Python engine unless told otherwise (MPSIM_ENGINE=compiled runs it
# all on the compiled one, `mpsim engine build`): a build left in the cache changes nothing.
os.environ.setdefault("MPSIM_ENGINE", "python")


# -- a headless Chromium for the page's browser tests (test_serve, test_serve_security) ------

CHROMIUM = os.environ.get("MPSIM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no chromium binary at {CHROMIUM} (apt-get install chromium; .ci/run installs it)")
    playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    with playwright_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def server() -> Iterator[MpsimServer]:
    """``mpsim serve`` on a free loopback port, in a thread of this process."""
    from mpsim.web.app import make_server, serve_in_thread

    srv = make_server("127.0.0.1", 0)
    serve_in_thread(srv)
    yield srv
    srv.shutdown()
    srv.server_close()
