"""Timelines in the Chrome trace event format, for Perfetto and chrome://tracing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from mpsim.units import GiB
from mpsim.views.plots import downsample

if TYPE_CHECKING:
    from mpsim.sim import SimResult


def write_chrome_trace(r: SimResult, path: Path) -> None:
    """Chrome trace event format (opens in Perfetto and chrome://tracing): per GPU a compute
    lane, one lane per copy engine kind (peer copies, device-to-host, host-to-device) and
    one for data- and tensor-parallel collectives,
    a memory counter in GiB, and, when the run recorded them, link rates in GB/s."""
    lanes = {"compute": 1, "copy": 2, "d2h": 3, "h2d": 4, "nccl": 5}
    names = {"compute": "compute stream", "copy": "peer copy engines", "d2h": "copy engine to host",
             "h2d": "copy engine from host", "nccl": "collectives (NCCL)"}
    events: list[dict] = []
    for g in r.gpus:
        label = f"GPU {g.gpu}" + (f" (stage {g.stage})" if g.stage is not None else "")
        events.append({"name": "process_name", "ph": "M", "pid": g.gpu, "args": {"name": label}})
        for lane, tid in lanes.items():
            events.append({"name": "thread_name", "ph": "M", "pid": g.gpu, "tid": tid, "args": {"name": names[lane]}})
        t, u = downsample(g.memory_times_s, g.memory_used_bytes)
        events += [{"name": "memory GiB", "ph": "C", "pid": g.gpu, "ts": float(ts) * 1e6,
                    "args": {"used": float(v) / GiB}} for ts, v in zip(t, u)]
    for s in r.spans:
        events.append({"name": s.name, "ph": "X", "pid": s.gpu, "tid": lanes[s.lane], "ts": s.start_s * 1e6,
                       "dur": (s.end_s - s.start_s) * 1e6})
    if r.link_rates:
        links_pid = len(r.gpus)
        events.append({"name": "process_name", "ph": "M", "pid": links_pid, "args": {"name": "links (GB/s)"}})
        active: set[str] = set()
        for ts, rates in r.link_rates:
            for name in sorted(active | set(rates)):
                events.append({"name": name, "ph": "C", "pid": links_pid, "ts": ts * 1e6,
                               "args": {"GB/s": rates.get(name, 0.0) / 1e9}})
            active = set(rates)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
