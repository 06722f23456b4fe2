"""Where the time of a parallel ``mpsim fits`` goes: seconds from the start at which each
shipped size and each largest-size search finishes (``on_point``), and the total.

    python benchmarks/fits_rounds.py [--server S] [--family F] [--schedule X] [--microbatch B] [-j N]

The rounds: every shipped size under every strategy, then the single strategies'
searches, then ``best``'s search; the last line of each round ends it.
"""

from __future__ import annotations

import argparse
import time

from mpsim.studies.backends import make_backend
from mpsim.studies.capacity import fits_strategies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", default="dgx1-v100")
    ap.add_argument("--family", default="gpt")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatch", type=int, default=2)
    ap.add_argument("-j", "--workers", type=int, default=2)
    args = ap.parse_args()
    start = time.perf_counter()

    def on_point(name: str) -> None:
        print(f"{time.perf_counter() - start:7.1f} s  {name}", flush=True)

    fits_strategies(args.server, args.family, args.schedule, args.microbatch, on_point=on_point,
                    backend=make_backend("local", args.workers))
    print(f"{time.perf_counter() - start:7.1f} s  total")


if __name__ == "__main__":
    main()
