#!/usr/bin/env bash
# The 7B full fine-tune's step against a baseline tree, on one machine: this tree, with and
# without recovery's journal, beside the same case run by the baseline tree (5a66be0: gradient and weight slots, no journal, no
# split master), in the order ORDER gives, every run on the same warm machine.
#
#   git archive 5a66be0 --prefix=.baseline-5a66be0/ | tar -x     # here (git-ignored), then
#   on the GPU host, with carry: [".deps", ".baseline-5a66be0"] (6 MB):
#   BASELINE_DIR=.baseline-5a66be0 ORDER="base journal nojournal" \
#     bash benchmarks/paging/against_baseline_tree.sh
#
# ORDER words: base (the old tree), journal (this tree, defaults), nojournal (this tree,
# --recovery-grace 0), threadsN (this tree, defaults, the daemon with N AdamW threads),
# slots (this tree, journal off, a gradient slot per parameter as the old tree had: tells
# the pool's share of a difference from the split master's), poolN (this tree, journal
# off, an N GiB gradient pool instead of the sized 2 GiB).
# Each run's last lines go to $OUT/baseline-tree.log and its step times to $OUT/baseline-tree.jsonl.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit
ROOT=$PWD
OUT=${OUT:-$PWD/gpu-check-out}
BASELINE_DIR=${BASELINE_DIR:?the old tree, from git archive}
mkdir -p "$OUT"
rc=0
log() { echo "$*" | tee -a "$OUT/baseline-tree.log"; }
# What could make one host's runs differ: NUMA nodes (where the daemon's pages and its
# AdamW threads land), transparent huge pages, the CPU.
log "host: $(nproc) cores, $(lscpu 2>/dev/null | awk -F: '/^NUMA node\(s\)|^Model name/ {gsub(/^ +/, "", $2); printf "%s; ", $2}')THP $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"

# Build both trees once (a warm machine keeps build-gpu/ of each).
if [[ ${BUILD:-1} == 1 ]]; then
  OUT=$OUT STAGES=lean bash scripts/gpu-check.sh > "$OUT/baseline-tree-build.log" 2>&1 || rc=1
  ln -sfn "$ROOT/.deps" "$BASELINE_DIR/.deps"
  (cd "$BASELINE_DIR" && OUT=$OUT/baseline-build STAGES=lean bash scripts/gpu-check.sh) \
    >> "$OUT/baseline-tree-build.log" 2>&1 || rc=1
  tail -3 "$OUT/baseline-tree-build.log" | tee -a "$OUT/baseline-tree.log"
fi
# shellcheck disable=SC1091
source .deps/unpack.sh

flags=(--cases 7b-full --cap-gib 24 --seq 1024 --max-warmup 8 --timeout 170)
for what in ${ORDER:-base journal nojournal}; do
  pkill -x trainstreamd 2>/dev/null; sleep 1
  tree=$ROOT extra=(--grad-pool pool)
  case $what in
    base) tree=$(cd "$BASELINE_DIR" && pwd) extra=() ;;
    journal) ;;
    nojournal) extra+=(--daemon-args "--recovery-grace 0") ;;
    threads*) extra+=(--daemon-args "--threads ${what#threads}") ;;
    slots) extra=(--grad-pool slots --daemon-args "--recovery-grace 0") ;;
    pool[0-9]*) extra=(--grad-pool "$(( ${what#pool} << 30 ))" --daemon-args "--recovery-grace 0") ;;
    *) log "ORDER: unknown word $what"; rc=1; continue ;;
  esac
  log "== $what ($(date -u +%T), $(free -g | awk '/Mem/ {print $7}') GiB available)"
  (cd "$tree" && PYTHONPATH=$tree/build-gpu/python TRAINSTREAM_BUILD_DIR=$tree/build-gpu \
     timeout 220 .venv/bin/python benchmarks/paging/bench_paging.py "${flags[@]}" "${extra[@]}") \
    > "$OUT/baseline-tree-run.log" 2>&1 || { rc=1; log "$what failed"; }
  python3 - "$what" "$OUT/baseline-tree-run.log" "$OUT/baseline-tree.jsonl" <<'EOF' | tee -a "$OUT/baseline-tree.log"
# The run's printed JSON, not bench_paging's --jsonl: the filed tree's has no --jsonl.
import json, re, sys
what, path, out = sys.argv[1:]
text = open(path).read()
found = None
for m in re.finditer(r'^\{\n.*?^\}$', text, re.S | re.M):  # the per-case JSON
    try:
        r = json.loads(m.group(0))
    except ValueError:
        continue
    if r.get("case") == "7b-full":
        found = r
if found is None:
    print(f"{what}: no result; last lines:\n" + "\n".join(text.splitlines()[-15:]))
    sys.exit(0)
keep = {k: found.get(k) for k in ("step_s", "step_times", "peak_vram_gib", "error",
                                   "daemon_shm_gib", "host_bytes_per_trained_param",
                                   "pool_waits", "pool_wait_s", "warmup_steps")}
keep["what"] = what
open(out, "a").write(json.dumps(keep) + "\n")
print(json.dumps(keep))
EOF
done
exit $rc
