#!/usr/bin/env bash
# The engine against an earlier commit, in the same run: farm-bench alternates the two
# (A: this checkout, B: BASE), and each run's own "wall per iteration" is kept; prints the
# whole-process A/B ratios and the medians of the per-iteration figures.
#   git worktree add /tmp/base COMMIT && benchmarks/bench_engine_vs.sh /tmp/base > reports/bench_engine_vs.txt
set -euo pipefail
. "$(dirname "$0")/ab_simulate.sh"
base=$1
here=$(pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "# A: $(git -C "$here" rev-parse --short HEAD) (this checkout), B: $(git -C "$base" rev-parse --short HEAD) ($base)"
ab_simulate "cd $here && PYTHONPATH=$here" "cd $base && PYTHONPATH=$base" "$out"
