"""How fast a run on `mpsim serve` stops when cancelled, and what the server's resident
memory does: each run is started through the HTTP API, cancelled after a while, and timed
until the server reports it cancelled. The run computes in the server's worker process;
"worker MiB" is that process's resident memory at the cancel, which the cancel gives back
by ending it ("gone").

    python benchmarks/bench_cancel.py > reports/bench_cancel.txt
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from urllib.parse import urlencode

from mpsim.web.app import make_server, serve_in_thread

RUNS = (
    ("job, best, GPT-25.5B, 256 microbatches", {"server": "dgx1-v100", "model": "gpt-25.5b", "microbatch": 2,
                                                "microbatches": 256, "strategy": "best"}, 3.0),
    ("choose, Llama-3-70B, every server", {"view": "choose", "model": "llama-3-70b", "global_microbatches": 16}, 3.0),
    ("job, mpress, GPT-25.5B, 256 microbatches", {"server": "dgx1-v100", "model": "gpt-25.5b", "microbatch": 2,
                                                  "microbatches": 256, "strategy": "mpress"}, 0.3),
)


def _rss_mib(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) // 1024


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


def main() -> None:
    server = make_server("127.0.0.1", 0)
    serve_in_thread(server)

    def call(method: str, path: str) -> dict:
        req = urllib.request.Request(server.url.rstrip("/") + path, method=method)
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())

    print(f"{'run':42s} {'cancelled after':>15s} {'stop took':>9s} {'state':>9s} {'tasks':>7s} "
          f"{'server MiB':>11s} {'worker MiB':>15s}")
    for label, params, after_s in RUNS:
        before = _rss_mib()
        job = call("POST", "/api/jobs?" + urlencode(params))
        time.sleep(after_s)
        pid = server.app.jobs.worker.pid
        assert pid is not None
        worker_mib = _rss_mib(pid)
        t0 = time.perf_counter()
        call("POST", f"/api/jobs/{job['id']}/cancel")
        while (status := call("GET", f"/api/jobs/{job['id']}"))["state"] not in ("cancelled", "done", "failed"):
            time.sleep(0.01)
        took = time.perf_counter() - t0
        worker = f"{worker_mib}->{'gone' if _gone(pid) else _rss_mib(pid)}"
        print(f"{label:42s} {after_s:14.1f}s {took:8.2f}s {status['state']:>9s} {status['tasks']:7d} "
              f"{before:5d}->{_rss_mib():<5d} {worker:>15s}")
    server.shutdown()
    server.server_close()


if __name__ == "__main__":
    main()
