#!/usr/bin/env bash
# The compiled engine against the Python one, same checkout, same run: farm-bench
# alternates the two (A: MPSIM_ENGINE=compiled, B: MPSIM_ENGINE=python). For the swap-heavy
# and keep plans each run's own "wall per iteration" is kept and its medians printed; for
# the README's fits the whole-process ratios, and whether both print the same table.
# Builds the engine first (and says how long that took).
#   benchmarks/bench_native_vs.sh > reports/bench_native_vs.txt
set -euo pipefail
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
mpsim engine build --json "$out/build.json" > /dev/null 2>&1
echo "# $(git rev-parse --short HEAD); A: MPSIM_ENGINE=compiled, B: MPSIM_ENGINE=python; $(mpsim engine status | head -1)"
python -c 'import json, sys; print("build s", json.load(open(sys.argv[1]))["seconds"])' "$out/build.json"
for plan in swap-heavy keep; do
  farm-bench -n 5 --timeout 900 \
    --vs "sh -c 'MPSIM_ENGINE=python exec python benchmarks/bench_simulate.py --plan $plan --repeat 10 >> $out/b_$plan.txt 2>&1'" \
    -- sh -c "MPSIM_ENGINE=compiled exec python benchmarks/bench_simulate.py --plan $plan --repeat 10 >> $out/a_$plan.txt 2>&1" \
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
fits="mpsim fits --server dgx1-v100 --family gpt --schedule 1f1b --microbatch 2"
farm-bench -n 3 --timeout 900 \
  --vs "sh -c 'MPSIM_ENGINE=python exec $fits > $out/fits_b.txt 2>/dev/null'" \
  -- sh -c "MPSIM_ENGINE=compiled exec $fits > $out/fits_a.txt 2>/dev/null" \
  | grep -E "^(A|B) (wall|cpu) s|^A/B (cpu|wall)" | sed "s/^/fits /"
if cmp -s "$out/fits_a.txt" "$out/fits_b.txt"; then echo "fits same table: yes"; else echo "fits same table: NO"; fi
