#!/usr/bin/env bash
# The 14B NF4 paging case again, alternating trees (before, after, before), each
# tree's own scripts and build; logs in $OUT/<n>-<side>.
# Prepared as scripts/gpu-before-after.sh says; run through the device tool the same way.
set -uo pipefail
root=$PWD
ln -sfn "$root/.deps" "$root/.before/src/.deps"
(cd .before/src && STAGES=lean OUT=$OUT/build-before scripts/gpu-check.sh > /dev/null 2>&1; echo "before build rc=$?")
(STAGES=lean OUT=$OUT/build-after scripts/gpu-check.sh > /dev/null 2>&1; echo "after build rc=$?")
rm -rf "$OUT/build-before" "$OUT/build-after"
n=0
for side in ${SIDES:-before after before}; do
  n=$((n+1))
  pkill -x trainstreamd 2>/dev/null; sleep 1
  if [ "$side" = before ]; then cd "$root/.before/src"; else cd "$root"; fi
  t0=$(date +%s)
  STAGES=paging PAGING_CASES=14b-lora-nf4 PAGING_SNAPSHOT=0 OUT=$OUT/$n-$side scripts/gpu-check.sh > /dev/null 2>&1
  echo "== $n $side ($(( $(date +%s) - t0 )) s)"
  grep -h "^| 14b" "$OUT/$n-$side"/bench-paging-14b-lora-nf4.log
  rm -f "$OUT/$n-$side/bench.log" "$OUT/$n-$side/machine.txt"
done
pkill -x trainstreamd 2>/dev/null
