#!/usr/bin/env bash
# One side of a before/after comparison of two commits on the GPU host:
# Prepare on the dev machine (.before/ is git-ignored through .git/info/exclude):
#   mkdir -p .before/src && git archive <before-commit> | tar -x -C .before/src
# then through the device tool, carrying [".deps", ".before"]: scripts/gpu-before-after.sh before|after
#   It builds that tree (lean) and runs the 1.5B offload
#   benchmark (daemon AdamW mode) and the 14B NF4 LoRA paging case; logs in $OUT/<side>.
set -uo pipefail
side=$1
root=$PWD
if [ "$side" = before ]; then tree=$root/.before/src; else tree=$root; fi
ln -sfn "$root/.deps" "$tree/.deps"
# A daemon left by an earlier call keeps cached bases in RAM.
pkill -x trainstreamd 2>/dev/null; sleep 1
cd "$tree"
mkdir -p "$OUT/$side"
t0=$(date +%s)
STAGES="lean" OUT=$OUT/$side scripts/gpu-check.sh > "$OUT/$side/stages.log" 2>&1
echo "build: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/$side/stages.log"
t0=$(date +%s)
STAGES="offload paging" OFFLOAD_MODES=${OFFLOAD_MODES:-trainstream} PAGING_CASES=14b-lora-nf4 PAGING_SNAPSHOT=0 \
  OUT=$OUT/$side scripts/gpu-check.sh >> "$OUT/$side/stages.log" 2>&1
echo "bench: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/$side/stages.log"
pkill -x trainstreamd 2>/dev/null
rm -f "$OUT/$side/bench.log"
grep -h -E "RESULT|step_s|\|" "$OUT/$side"/bench-*.log | tail -20
