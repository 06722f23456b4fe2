# Sourced by bench_engine_vs.sh and bench_native_vs.sh: ab_simulate A_PREFIX B_PREFIX OUT
# runs bench_simulate's swap-heavy and keep plans as A and B in turn (farm-bench), each
# command line starting with its prefix (a `cd` or variables, then `exec python ...`),
# and prints the whole-process A/B ratios and the medians of each run's own "wall per
# iteration"; OUT is a scratch directory.
ab_simulate() {
  local a=$1 b=$2 out=$3 plan side
  for plan in swap-heavy keep; do
    farm-bench -n 5 --timeout 900 \
      --vs "sh -c '$b exec python benchmarks/bench_simulate.py --plan $plan --repeat 10 >> $out/b_$plan.txt 2>&1'" \
      -- sh -c "$a exec python benchmarks/bench_simulate.py --plan $plan --repeat 10 >> $out/a_$plan.txt 2>&1" \
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
}
