"""Memory and time against the number of layers: `mpsim simulate` on GPT-5.3B's shape grown
to many transformer layers (``Trace.with_layers``), as a whole process, and the refusal of
a trace over ``MAX_LAYERS``.

    python benchmarks/bench_layers.py > reports/bench_layers.txt

Each row is one run of ``mpsim simulate --server dgx1-v100 --model FILE`` in a fresh
process: its wall time and its peak resident memory (the child's ``ru_maxrss``). The
quoted figures in the README come from this report (``tests/test_readme_numbers.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from mpsim.data.catalog import load_trace
from mpsim.limits import MAX_LAYERS
from mpsim.models.trace import Trace

MEASURE = ("import resource, subprocess, sys, time\n"
           "t = time.perf_counter()\n"
           "r = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
           "wall = time.perf_counter() - t\n"
           "lines = (r.stderr or r.stdout).strip().splitlines()\n"
           "print(wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode, len(lines))\n")


def run(trace_file: Path) -> tuple[float, float, int, int]:
    """(wall s, peak MB, exit code, lines printed to stderr or else stdout) of one simulate."""
    cmd = [sys.executable, "-c", MEASURE, sys.executable, "-m", "mpsim.cli", "simulate", "--server", "dgx1-v100",
           "--model", str(trace_file)]
    wall, rss_kib, code, lines = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
    return float(wall), int(rss_kib) / 1024, int(code), int(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default=f"2000,{MAX_LAYERS},100000", help="total layers per run, comma-separated")
    args = ap.parse_args()
    template = load_trace("gpt-5.3b")
    extra = template.n_layers - sum(1 for r in template.layers if r.kind == "transformer")
    print(f"mpsim simulate --server dgx1-v100 on gpt-5.3b's shape with more layers (MAX_LAYERS = {MAX_LAYERS:,})")
    print(f"{'layers':>8} {'wall s':>7} {'peak MB':>8}  outcome")
    with tempfile.TemporaryDirectory() as tmp:
        for total in (int(n) for n in args.layers.split(",")):
            path = Path(tmp) / f"gpt-{total}-layers.json"
            path.write_text(template.with_layers(total - extra).to_json() if total <= MAX_LAYERS
                            else _over_limit(template, total - extra))
            wall, peak_mb, code, lines = run(path)
            outcome = "simulated" if code in (0, 1) else f"refused in {lines} line (exit {code})"
            print(f"{total:>8,} {wall:>7.2f} {peak_mb:>8.0f}  {outcome}")


def _over_limit(template: Trace, n_transformer: int) -> str:
    """A trace file over the limit, its rows written directly (no Trace that size is made)."""
    data = json.loads(template.to_json())
    head = [r for r in data["layers"] if r["kind"] != "transformer"]
    block = next(r for r in data["layers"] if r["kind"] == "transformer")
    data["layers"] = head[:1] + [block] * n_transformer + head[1:]
    return json.dumps(data)


if __name__ == "__main__":
    main()
