#!/usr/bin/env bash
# One or more benchmarks/compare.py runs, for scripts/gpu-check.sh's "compare" stage.
# COMPARE_ARGS holds the runs' arguments, separated by ';' (benchmarks/headtohead/
# coverage.py packs one device call so); they run in turn within one COMPARE_TIMEOUT
# (seconds, default 480), sharing the checkpoint in CKPT_DIR. One run writes
# $OUT/compare/; several write $OUT/compare-<n>/results.json each (their results.md is
# dropped: a device call returns 8 files). Progress goes to $OUT/compare.log.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?OUT names the folder the results go to}"
mkdir -p "$OUT"
IFS=';' read -ra runs <<< "${COMPARE_ARGS:-}"
[ ${#runs[@]} -gt 0 ] || runs=("")
deadline=$((SECONDS + ${COMPARE_TIMEOUT:-480}))
rc=0
for i in "${!runs[@]}"; do
  dir=$OUT/compare
  [ ${#runs[@]} -eq 1 ] || dir=$OUT/compare-$((i + 1))
  left=$((deadline - SECONDS))
  echo "== compare ${runs[$i]} (${left} s left)" | tee -a "$OUT/compare.log"
  if [ $left -le 0 ]; then
    rc=1; echo "compare: COMPARE_TIMEOUT spent before this run" | tee -a "$OUT/compare.log"; continue
  fi
  # shellcheck disable=SC2086  # a run's arguments split on spaces, as typed
  timeout $left python3 benchmarks/compare.py --out "$dir" --ckpt-dir "${CKPT_DIR:-/tmp/compare-ckpt}" \
    --no-charts ${runs[$i]} >> "$OUT/compare.log" 2>&1 || { rc=1; echo "compare failed"; }
  [ ${#runs[@]} -eq 1 ] || rm -f "$dir/results.md"
done
exit $rc
