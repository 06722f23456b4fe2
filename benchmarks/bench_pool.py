"""The local worker pool kept across a study's rounds against a new pool per round: one
``fits`` (sizes, then the searches, then best's probes) run both ways in turn, pair by pair.

    taskset -c 0,1 python benchmarks/bench_pool.py > reports/bench_pool.txt
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Generator
from dataclasses import replace
from typing import Any

from mpsim.api import fits_request
from mpsim.studies.backends import LocalBackend, Outcome

ARGS = dict(server="dgx1-v100", family="gpt", models=["gpt-5.3b", "gpt-10.3b"],
            strategies=["none", "recompute", "mpress"], layouts="pipeline,fsdp8", workers=2)
COMMAND = ("mpsim fits --server dgx1-v100 --model gpt-5.3b,gpt-10.3b --strategy none,recompute,mpress "
           "--layouts pipeline,fsdp8 -j 2")
PAIRS = 3


class FreshPools(LocalBackend):
    """A new pool for every round, as before the pool was kept."""

    def run_batches(self, batches: list[list[Any]], fn: Callable[[Any], Any]) -> Generator[list[Outcome], None, None]:
        try:
            yield from super().run_batches(batches, fn)
        finally:
            self.close()


def _run(backend: LocalBackend) -> tuple[float, list[dict]]:
    request = fits_request(**ARGS)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    reports = replace(request, backend=backend).run()
    seconds = time.perf_counter() - t0
    backend.close()
    return seconds, [r.to_dict() for r in reports]


def main() -> None:
    kept, fresh = [], []
    for _ in range(PAIRS):
        a, out_a = _run(LocalBackend(2))
        b, out_b = _run(FreshPools(2))
        assert out_a == out_b  # the same answer either way
        kept.append(a)
        fresh.append(b)
    ratios = [a / b for a, b in zip(kept, fresh, strict=True)]
    print(f"# {COMMAND}, in one process, {PAIRS} pairs run in turn (A: pool kept across rounds, B: a new pool per")
    print("# round); the reports of A and B are identical")
    print(f"A wall s    min {min(kept):.3f}   median {statistics.median(kept):.3f}   max {max(kept):.3f}")
    print(f"B wall s    min {min(fresh):.3f}   median {statistics.median(fresh):.3f}   max {max(fresh):.3f}")
    print(f"A/B wall    min {min(ratios):.4f}   median {statistics.median(ratios):.4f}   max {max(ratios):.4f}")


if __name__ == "__main__":
    main()
