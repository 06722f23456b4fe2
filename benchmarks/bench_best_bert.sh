#!/usr/bin/env bash
# best's largest-size search on the A100 server's BERT family (issue 31's "best on the A100
# BERT family" target: 2 minutes; it ran past 27 minutes before existence-first probes):
#   benchmarks/bench_best_bert.sh > reports/bench_best_bert.txt
set -euo pipefail
out=$(mktemp)
trap 'rm -f "$out"' EXIT
cmd="mpsim fits --server a100-40gb-nvswitch --family bert --schedule pipedream --microbatch 12 --strategy best --layouts pipeline"
echo "# $cmd ($(nproc) cores, $(git rev-parse --short HEAD))"
/usr/bin/time -f "%e s wall, %U s user" $cmd 2>&1 >"$out" | tail -1
grep -E "^  best " "$out"
