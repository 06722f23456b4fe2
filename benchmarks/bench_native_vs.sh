#!/usr/bin/env bash
# The compiled engine against the Python one, same checkout, same run: farm-bench
# alternates the two (A: MPSIM_ENGINE=compiled, B: MPSIM_ENGINE=python). For the swap-heavy
# and keep plans each run's own "wall per iteration" is kept and its medians printed; for
# the README's fits the whole-process ratios, and whether both print the same table.
# Builds the engine first (and says how long that took).
#   benchmarks/bench_native_vs.sh > reports/bench_native_vs.txt
set -euo pipefail
. "$(dirname "$0")/ab_simulate.sh"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
mpsim engine build --json "$out/build.json" > /dev/null 2>&1
echo "# $(git rev-parse --short HEAD); A: MPSIM_ENGINE=compiled, B: MPSIM_ENGINE=python; $(mpsim engine status | head -1)"
python -c 'import json, sys; print("build s", json.load(open(sys.argv[1]))["seconds"])' "$out/build.json"
ab_simulate "MPSIM_ENGINE=compiled" "MPSIM_ENGINE=python" "$out"
fits="mpsim fits --server dgx1-v100 --family gpt --schedule 1f1b --microbatch 2"
farm-bench -n 3 --timeout 900 \
  --vs "sh -c 'MPSIM_ENGINE=python exec $fits > $out/fits_b.txt 2>/dev/null'" \
  -- sh -c "MPSIM_ENGINE=compiled exec $fits > $out/fits_a.txt 2>/dev/null" \
  | grep -E "^(A|B) (wall|cpu) s|^A/B (cpu|wall)" | sed "s/^/fits /"
if cmp -s "$out/fits_a.txt" "$out/fits_b.txt"; then echo "fits same table: yes"; else echo "fits same table: NO"; fi
