#!/usr/bin/env bash
# One or more benchmarks/compare.py runs, for scripts/gpu-check.sh's "compare" stage.
# COMPARE_ARGS holds the runs' arguments, separated by ';' (benchmarks/headtohead/
# coverage.py packs one device call so; newlines count as spaces, empty runs are
# skipped); they run in turn within one COMPARE_TIMEOUT (whole seconds, default 480),
# sharing the checkpoint in CKPT_DIR. One run writes $OUT/compare/; several write
# $OUT/compare-<n>/results.json each (their results.md is dropped: a device call
# returns 8 files). Progress goes to $OUT/compare.log; the exit status is 1 if any run
# failed, was cut by the deadline or found none left.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
: "${OUT:?OUT names the folder the results go to}"
mkdir -p "$OUT"
limit=${COMPARE_TIMEOUT:-480}
if ! [[ $limit =~ ^[0-9]+$ ]]; then
  echo "compare-runs.sh: COMPARE_TIMEOUT=$limit: accepted whole seconds (e.g. 480)" >&2
  exit 2
fi
runs=()
IFS=';' read -r -a parts <<< "${COMPARE_ARGS//$'\n'/ }"
for p in "${parts[@]}"; do
  [[ $p =~ [^[:space:]] ]] && runs+=("$p")
done
[ ${#runs[@]} -gt 0 ] || runs=("")
deadline=$((SECONDS + limit))
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
    --no-charts ${runs[$i]} >> "$OUT/compare.log" 2>&1
  status=$?
  if [ $status -eq 124 ]; then
    rc=1; echo "compare: cut by COMPARE_TIMEOUT (results.json keeps the engines that finished)" | tee -a "$OUT/compare.log"
  elif [ $status -ne 0 ]; then
    rc=1; echo "compare failed (exit $status)" | tee -a "$OUT/compare.log"
  fi
  [ ${#runs[@]} -eq 1 ] || rm -f "$dir/results.md"
done
exit $rc
