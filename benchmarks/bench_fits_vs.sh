#!/usr/bin/env bash
# The README's first command against an earlier commit, in the same run (farm-bench
# alternates A: this checkout and B: BASE, two pairs), and whether both print the same table.
#   git worktree add /tmp/base COMMIT && benchmarks/bench_fits_vs.sh /tmp/base > reports/bench_fits_vs.txt
set -euo pipefail
base=$1
here=$(pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cmd="fits --server dgx1-v100 --family gpt --schedule 1f1b --microbatch 2"
echo "# mpsim $cmd; A: $(git -C "$here" rev-parse --short HEAD) (this checkout), B: $(git -C "$base" rev-parse --short HEAD) ($base)"
farm-bench -n 2 --timeout 1200 \
  --vs "sh -c 'cd $base && PYTHONPATH=$base exec python -m mpsim.cli $cmd > $out/b.txt 2>&1'" \
  -- sh -c "cd $here && PYTHONPATH=$here exec python -m mpsim.cli $cmd > $out/a.txt 2>&1" \
  | grep -E "^(A|B) (cpu|wall) s|^A/B (cpu|wall)"
if cmp -s "$out/a.txt" "$out/b.txt"; then echo "same table: yes"; else echo "same table: NO"; fi
