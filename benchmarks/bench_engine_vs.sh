#!/usr/bin/env bash
# The engine against an earlier commit, in the same run: farm-bench alternates the two
# (A: this checkout, B: BASE), and each run's own "wall per iteration" is kept; prints the
# whole-process A/B ratios and the medians of the per-iteration figures.
#   git worktree add /tmp/base COMMIT && benchmarks/bench_engine_vs.sh /tmp/base > reports/bench_engine_vs.txt
set -euo pipefail
base=$1
here=$(pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "# A: $(git -C "$here" rev-parse --short HEAD) (this checkout), B: $(git -C "$base" rev-parse --short HEAD) ($base)"
for plan in swap-heavy keep; do
  farm-bench -n 5 --timeout 900 \
    --vs "sh -c 'cd $base && PYTHONPATH=$base exec python benchmarks/bench_simulate.py --plan $plan --repeat 10 >> $out/b_$plan.txt 2>&1'" \
    -- sh -c "cd $here && PYTHONPATH=$here exec python benchmarks/bench_simulate.py --plan $plan --repeat 10 >> $out/a_$plan.txt 2>&1" \
    | grep -E "^A/B (cpu|wall)" | sed "s/^/$plan whole process /"
  for side in a b; do
    python - "$out/${side}_$plan.txt" "$plan" "$side" <<'PY'
import re, statistics, sys
ms = [float(x) for x in re.findall(r"wall per iteration\s+([\d.]+) ms", open(sys.argv[1]).read())]
side = "A" if sys.argv[3] == "a" else "B"
print(f"{sys.argv[2]} {side} ms per simulated iteration, median of {len(ms)} runs: {statistics.median(ms):.1f}")
PY
  done
done
