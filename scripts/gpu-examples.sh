#!/usr/bin/env bash
# The four examples at full shape on the GPU host (1x H200), logs under $OUT.
# One command: `bash scripts/gpu-examples.sh` after the build (build/python, build/bin),
# then the summary lines it prints. Budget: under 8 minutes in all.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-examples}
mkdir -p "$OUT"
[ -f .deps/unpack.sh ] && source .deps/unpack.sh
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
# gpu-check.sh builds into build-gpu/; a plain `make build` into build/.
BUILD=${TRAINSTREAM_BUILD_DIR:-$( [ -d build-gpu/bin ] && echo "$PWD/build-gpu" || echo "$PWD/build" )}
export PYTHONPATH=$PWD/python:$BUILD/python:${PYTHONPATH:-}
export TRAINSTREAM_BUILD_DIR=$BUILD
# A private daemon with room for a 1.8B fp32 state (masters, moments, staging).
sockdir=$(mktemp -d); shmdir=$(mktemp -d -p /dev/shm)
"$BUILD/bin/trainstreamd" --foreground --socket "$sockdir/sock" --shm-dir "$shmdir" \
  --budget 90% >"$OUT/trainstreamd.log" 2>&1 &
daemon=$!
trap 'kill $daemon; wait $daemon; rm -rf "$sockdir" "$shmdir"' EXIT
for _ in $(seq 100); do "$BUILD/bin/trainstreamctl" --socket "$sockdir/sock" ping >/dev/null 2>&1 && break; sleep 0.1; done
export TRAINSTREAM_SOCKET=$sockdir/sock
status=0
run() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" | tee "$OUT/$name.log"
  timeout "$limit" "$PY" "$@" >>"$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name: exit $rc" | tee -a "$OUT/$name.log"
  grep -E "^(SUMMARY|VERDICT|wrap:|model:|largest|peak VRAM)|\[ *(ok|FAIL|skip)\]" "$OUT/$name.log"
  [ $rc -eq 0 ] || status=1
}
run bigger_than_vram 120 examples/train_bigger_than_vram.py --vram-gb 4 --moments bf16
run bigger_than_vram_fp32 80 examples/train_bigger_than_vram.py --vram-gb 4 --steps 4
run verify_gpt 60 examples/verify_ram_offload.py --gpt --vram-cap-gb 24
run verify_hf 60 examples/verify_ram_offload.py --hf --vram-cap-gb 24
run lora_14b_nf4 110 examples/lora_large_model.py --size 14b --quantize nf4 --prefer speed --vram-gb 24 --steps 8
run hf_finetune 50 examples/hf_finetune.py --model qwen2.5-0.5b --compare --steps 10
exit $status
