#!/usr/bin/env bash
# The whole GPU-host check in one command (run through the device tool, with .deps
# carried; see docs/building.md, "The GPU-host check"):
#   build, every test (the GPU ones included), and the benchmarks. Logs go to
#   $OUT (or ./gpu-check-out) so they come back even when a step fails.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STAGES=${STAGES:-"build test bench"}  # also: lean, pytest, cudafiles, roofline, offload, dp, base, paging, scale, capdiag, frontdoor, compare, quality, recovery, fp8diag

if [ -f .deps/unpack.sh ]; then
  # shellcheck disable=SC1091
  source .deps/unpack.sh
  export TRAINSTREAM_SKIP_SYSTEM_DEPS=1
  # Quoted: make hands CMAKE_ARGS to a shell, where ';' would end the command.
  CMAKE_ARGS="'-DCMAKE_PREFIX_PATH=$TS_TORCH_CMAKE_PREFIX;$TS_PYBIND11_CMAKE_DIR;$TS_DEPS_PREFIX/usr' $TS_PROTOBUF_CMAKE_ARGS"
fi
export CMAKE_ARGS=${CMAKE_ARGS:-}
export TRAINSTREAM_HF=${TRAINSTREAM_HF:-0}  # transformers/peft are not needed by these tests
{ nvidia-smi -L; nproc; python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; \
  grep -o -m1 -E 'avx512_bf16' /proc/cpuinfo; } > "$OUT/machine.txt" 2>&1

rc=0
# Configures build-gpu (tests and benchmarks ON or OFF) and builds only the targets named.
build_targets() {  # tests, benchmarks, target...
  local tests=$1 benches=$2; shift 2
  make venv PYTHON=python3 >> "$OUT/build.log" 2>&1
  eval cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DPython_EXECUTABLE="$PWD/.venv/bin/python" -DTRAINSTREAM_BUILD_TESTS="$tests" \
    -DTRAINSTREAM_BUILD_BENCHMARKS="$benches" "$CMAKE_ARGS" >> "$OUT/build.log" 2>&1 &&
  cmake --build build-gpu -j "$(nproc)" --target "$@" >> "$OUT/build.log" 2>&1 ||
    { rc=1; tail -40 "$OUT/build.log"; }
}
if [[ $STAGES == *build* ]]; then
  make build PYTHON=python3 BUILD=build-gpu CMAKE_ARGS="$CMAKE_ARGS" > "$OUT/build.log" 2>&1 || { rc=1; tail -40 "$OUT/build.log"; }
fi
# "lean": only what the Python tests and benchmarks load (no C++ tests or benches;
# the scriptable test client and the test-only extension trainstream_testing are
# among those: the daemon and AdamW tests load them).
# LEAN_TARGETS narrows it (compare and fp8diag need only the daemon, its CLI and the
# package: "trainstreamd trainstreamctl trainstream_C trainstream_control trainstream_python_files").
if [[ $STAGES == *lean* ]]; then
  # shellcheck disable=SC2086
  build_targets ON OFF ${LEAN_TARGETS:-trainstreamd trainstreamctl trainstream_C trainstream_control \
    trainstream_python_files trainstream-test-client trainstream_testing}
fi
# "pytest": just the Python tests in $PYTEST_FILES (default: all of tests/python).
if [[ $STAGES == *pytest* ]]; then
  PYTHONPATH=$PWD/build-gpu/python TRAINSTREAM_BUILD_DIR=$PWD/build-gpu \
    .venv/bin/python -m pytest -q -rs ${PYTEST_FILES:-tests/python} > "$OUT/pytest.log" 2>&1 || rc=1
  tail -30 "$OUT/pytest.log"
fi
# "cudafiles": the Python test files that run on the GPU (the ones a change of the
# daemon, the client or the kernels must pass there), verbose, so that a call cut off by
# its time limit still says which tests passed and which failed.
if [[ $STAGES == *cudafiles* ]]; then
  PYTHONPATH=$PWD/build-gpu/python TRAINSTREAM_BUILD_DIR=$PWD/build-gpu \
    timeout "${CUDAFILES_TIMEOUT:-480}" .venv/bin/python -m pytest -v -rfs --tb=short \
    tests/python/test_wrap_cuda.py tests/python/test_wrap_gpu_mode.py \
    tests/python/test_paging_cuda.py tests/python/test_quant_cuda.py \
    tests/python/test_base_cache_cuda.py tests/python/test_base_vram.py \
    tests/python/test_dp_cuda.py tests/python/test_hf_trainer_paging.py \
    tests/python/test_base_cache.py tests/python/test_compare_scripts.py \
    > "$OUT/cudafiles.log" 2>&1 || rc=1
  grep -E "FAILED|ERROR|passed|failed" "$OUT/cudafiles.log" | tail -30
fi
if [[ $STAGES == *test* && $STAGES != *pytest* ]]; then
  make test PYTHON=python3 BUILD=build-gpu CMAKE_ARGS="$CMAKE_ARGS" PYTEST_ARGS="-rs" > "$OUT/test.log" 2>&1 || rc=1
  grep -E "tests passed|tests failed|FAILED|Failed|passed|failed" "$OUT/test.log" | tail -30
fi
if [[ $STAGES == *bench* ]]; then
  export PYTHONPATH=$PWD/build-gpu/python
  bench() {  # name, command...
    local name=$1; shift
    echo "== $name: $*" | tee -a "$OUT/bench.log"
    timeout 240 "$@" > "$OUT/bench-$name.log" 2>&1 || { rc=1; echo "bench $name failed"; }
    tail -30 "$OUT/bench-$name.log" | tee -a "$OUT/bench.log"
  }
  bench control build-gpu/bin/trainstream-bench-control --json
  bench adamw python3 benchmarks/adamw/bench_torch_adamw.py --bench build-gpu/bin/trainstream-bench-adamw \
    --params 67108864 --threads 1,4,8,16 --iters 10
  bench quant python3 benchmarks/quant/bench_quant.py --json "$OUT/quant_bench.json"
  bench zero-copy python3 benchmarks/wrap/bench_zero_copy.py
fi
# The host's DRAM ceiling for the AdamW engine's access patterns, then the engine and
# torch's fused AdamW in the same call (docs/adamw.md, "The ceiling").
if [[ $STAGES == *roofline* ]]; then
  build_targets ON ON trainstream-bench-roofline trainstream-bench-adamw adamw_kernel_test \
    adamw_engine_test
  # The AVX-512 kernels (split master included) only run on a host that has AVX-512.
  for t in adamw_kernel_test adamw_engine_test; do
    build-gpu/bin/$t > "$OUT/$t.log" 2>&1 || { rc=1; echo "$t failed"; }
    tail -3 "$OUT/$t.log"
  done
  # Read-only and write-only here; bench_torch_adamw.py --roofline runs the AdamW patterns.
  echo "== roofline" | tee -a "$OUT/bench.log"
  timeout 200 build-gpu/bin/trainstream-bench-roofline --elems 67108864 --threads ${ROOFLINE_THREADS:-1,4,8,16} \
    --patterns read,write --iters 10 > "$OUT/bench-roofline.log" 2>&1 || { rc=1; echo "bench roofline failed"; }
  cat "$OUT/bench-roofline.log" | tee -a "$OUT/bench.log"
  timeout 300 .venv/bin/python benchmarks/adamw/bench_torch_adamw.py --bench build-gpu/bin/trainstream-bench-adamw \
    --roofline build-gpu/bin/trainstream-bench-roofline \
    --params 67108864 --threads ${ROOFLINE_THREADS:-1,4,8,16} --iters 10 > "$OUT/bench-adamw.log" 2>&1 \
    || { rc=1; echo "bench adamw failed"; }
  tail -30 "$OUT/bench-adamw.log" | tee -a "$OUT/bench.log"
  # ADAMW_CHUNKS="16384 65536 ...": the fp32 configurations again at each engine chunk
  # size (elements per work item), after torch's figures above.
  for c in ${ADAMW_CHUNKS:-}; do
    for check in chunk param; do
      timeout 60 build-gpu/bin/trainstream-bench-adamw --params 67108864 --threads ${ROOFLINE_THREADS:-1,4,8,16} \
        --grad-dtype fp32 --moment-dtype fp32 --param-dtype master --check $check --chunk-elems "$c" \
        --iters 10 2>&1 | sed "s/^/chunk $c  /" | tee -a "$OUT/bench-adamw-chunks.log" || rc=1
    done
  done
fi
# Heavier end-to-end benchmarks, each its own stage (STAGES="... offload").
if [[ $STAGES == *offload* ]]; then
  export PYTHONPATH=$PWD/build-gpu/python
  echo "== offload" | tee -a "$OUT/bench.log"
  timeout 540 python3 benchmarks/wrap/bench_offload.py --cap-gib 24 --timeout 200 \
    ${OFFLOAD_MODES:+--modes "$OFFLOAD_MODES"} \
    > "$OUT/bench-offload.log" 2>&1 || { rc=1; echo "bench offload failed"; }
  tail -20 "$OUT/bench-offload.log" | tee -a "$OUT/bench.log"
fi
# Data parallel on a 2-GPU host: shared state against 1 rank and per-rank copies, then
# two simulated machines (gloo against NCCL for the cross-machine all-reduce).
if [[ $STAGES == *dp* ]]; then
  export PYTHONPATH=$PWD/build-gpu/python TRAINSTREAM_BUILD_DIR=$PWD/build-gpu
  echo "== dp" | tee -a "$OUT/bench.log"
  timeout 300 .venv/bin/python benchmarks/dp/bench_dp.py --ranks 2 > "$OUT/bench-dp.log" 2>&1 || { rc=1; echo "bench dp failed"; }
  tail -12 "$OUT/bench-dp.log" | tee -a "$OUT/bench.log"
  if [[ ${DP_NODES:-1} == 1 ]]; then
    timeout 240 .venv/bin/python benchmarks/dp/bench_dp.py --nodes 2 --ranks 1 > "$OUT/bench-dp-nodes.log" 2>&1 || { rc=1; echo "bench dp nodes failed"; }
    tail -12 "$OUT/bench-dp-nodes.log" | tee -a "$OUT/bench.log"
  fi
fi
# The 14B-shaped NF4 base load, then two processes sharing it in VRAM.
if [[ $STAGES == *base* ]]; then
  export PYTHONPATH=$PWD/build-gpu/python TRAINSTREAM_BUILD_DIR=$PWD/build-gpu
  echo "== base" | tee -a "$OUT/bench.log"
  BASE_DIR=${BASE_DIR:-/tmp/ts-bench-14b}
  timeout 500 .venv/bin/python benchmarks/base/bench_base_load.py --dir "$BASE_DIR" --keep --reuse \
    --clients 2 --share-vram > "$OUT/bench-base.log" 2>&1 || { rc=1; echo "bench base failed"; }
  tail -25 "$OUT/bench-base.log" | tee -a "$OUT/bench.log"
fi
# Training bigger than VRAM under a 24 GiB cap, one case per process run (PAGING_ARGS: more
# bench_paging.py flags, e.g. --profile); a failed case
# leaves the allocator's history in $OUT/snapshot-CASE.pickle (PAGING_SNAPSHOT=0: not).
if [[ $STAGES == *paging* ]]; then
  export PYTHONPATH=$PWD/build-gpu/python TRAINSTREAM_BUILD_DIR=$PWD/build-gpu
  for c in ${PAGING_CASES:-7b-full 32b-lora-nf4 oom}; do
    echo "== paging $c" | tee -a "$OUT/bench.log"
    TS_BENCH_SNAPSHOT=$([[ ${PAGING_SNAPSHOT:-1} == 1 ]] && echo "$OUT/snapshot-$c.pickle") timeout ${PAGING_TIMEOUT:-300} .venv/bin/python \
      benchmarks/paging/bench_paging.py --cases "$c" --cap-gib 24 --seq 1024 --timeout 280 ${PAGING_ARGS:-} \
      > "$OUT/bench-paging-$c.log" 2>&1 || { rc=1; echo "bench paging $c failed"; }
    tail -8 "$OUT/bench-paging-$c.log" | tee -a "$OUT/bench.log"
  done
fi
# Scale per byte of host RAM (docs/paging.md, "On the GPU host: host bytes per trained
# parameter"): the parts in SCALE_PARTS, in order, each under its own timeout, results
# appended to $OUT/scale.jsonl. pool7b: the 7B full fine-tune with gradient slots and with the pool in
# one invocation; layers: the 14B widths at SCALE_LAYERS blocks (40), full fine-tune, then
# the first depth refused at wrap(); 70b: LoRA r=16 on a 72B-shaped NF4 base; load: the
# 14B checkpoint loaded as NF4 warm and cold beside dd and bitsandbytes (its wheel
# carried in .whl/); nojournal7b, journal7b and adamw: the 7B step with and without the
# redo journal, and the host AdamW alone (below).
if [[ $STAGES == *scale* ]]; then
  export PYTHONPATH=$PWD/build-gpu/python TRAINSTREAM_BUILD_DIR=$PWD/build-gpu
  paging=(.venv/bin/python benchmarks/paging/bench_paging.py --cap-gib 24 --seq 1024
          --jsonl "$OUT/scale.jsonl")
  for part in ${SCALE_PARTS:-layers 70b}; do
    echo "== scale $part" | tee -a "$OUT/bench.log"
    case $part in
      pool7b) cmd=(timeout 330 "${paging[@]}" --cases 7b-full --grad-pool slots,pool
                   --max-warmup 8 --timeout 160) ;;
      layers) cmd=(timeout 360 "${paging[@]}" --cases full-layers,full-layers-refuse
                   --grad-pool pool --layers "${SCALE_LAYERS:-40}" --timeout 250) ;;
      70b) cmd=(timeout 240 "${paging[@]}" --cases 70b-lora-nf4 --max-warmup 8 --timeout 230) ;;
      # The 7B step's regression (docs/staging-pool.md): the update without the undo
      # journal, and the host AdamW with and without the journal and the split master.
      nojournal7b) cmd=(timeout 200 "${paging[@]}" --cases 7b-full --grad-pool pool
                        --max-warmup 8 --timeout 160 --daemon-args "--recovery-grace 0") ;;
      journal7b) cmd=(timeout 200 "${paging[@]}" --cases 7b-full --grad-pool pool
                      --max-warmup 8 --timeout 160) ;;
      adamw)
        build_targets ON ON trainstream-bench-adamw
        for pd in bf16 bf16-split; do for d in 0 1; do
          build-gpu/bin/trainstream-bench-adamw --params 268435456 --tensor-elems 16777216 \
            --threads 0 --grad-dtype bf16 --moment-dtype bf16 --param-dtype $pd --check param \
            --durable $d --iters 6 --warmup 2 >> "$OUT/scale-adamw.log" 2>&1 || rc=1
        done; done
        tail -4 "$OUT/scale-adamw.log" | tee -a "$OUT/bench.log"; continue ;;
      load)
        if compgen -G ".whl/*.whl" > /dev/null; then
          python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl >> "$OUT/scale-load.log" 2>&1
          export PYTHONPATH=$PYTHONPATH:/tmp/site
        fi
        cmd=(timeout 300 python3 benchmarks/base/bench_load_threads.py --shape 14b
             --dir "${BASE_DIR:-/tmp/ts-bench-14b}" --reuse --keep --formats nf4
             --threads "$(nproc)" --modes warm,cold --jsonl "$OUT/scale.jsonl") ;;
      *) echo "SCALE_PARTS: unknown part $part"; rc=1; continue ;;
    esac
    "${cmd[@]}" >> "$OUT/scale-$part.log" 2>&1 || { rc=1; echo "scale $part failed"; }
    tail -14 "$OUT/scale-$part.log" | tee -a "$OUT/bench.log"
  done
fi
# The Hugging Face front door under a 24 GiB cap: the reference's QLoRA recipe
# through TrainStreamTrainer at 512 and 2,048 tokens, a 1.5B full fine-tune through it,
# then the chunked loss against F.cross_entropy (and Liger's, when its wheel is carried
# in .whl/).
if [[ $STAGES == *frontdoor* ]]; then
  export PYTHONPATH=${TS_PYTHONPATH:-$PWD/build-gpu/python}${PYTHONPATH:+:$PYTHONPATH} TRAINSTREAM_BUILD_DIR=$PWD/build-gpu
  echo "== frontdoor" | tee -a "$OUT/bench.log"
  timeout ${FRONTDOOR_TIMEOUT:-420} python3 benchmarks/huggingface/bench_trainer.py \
    --cases "${FRONTDOOR_CASES:-qlora14b:512,qlora14b:2048,full1.5b}" --cap-gib 24 \
    --dir "${BASE_DIR:-/tmp/ts-bench-14b}" ${FRONTDOOR_ARGS:-} > "$OUT/bench-trainer.log" 2>&1 || { rc=1; echo "bench trainer failed"; }
  tail -8 "$OUT/bench-trainer.log" | tee -a "$OUT/bench.log"
  if [ -f benchmarks/losses/bench_chunked_ce.py ]; then
    timeout 180 python3 benchmarks/losses/bench_chunked_ce.py --out "$OUT/bench-losses.jsonl" ${LOSS_ARGS:-} \
      > "$OUT/bench-losses.log" 2>&1 || { rc=1; echo "bench losses failed"; }
    tail -20 "$OUT/bench-losses.log" | tee -a "$OUT/bench.log"
  fi
fi
# Recovery with a CUDA model (docs/recovery.md): the kill loop's 20 daemon
# SIGKILLs over 200 steps with the model on the GPU, bit-identical to an uninterrupted
# run, then the short loop's CUDA test (skipped on the CPU machine).
if [[ $STAGES == *recovery* ]]; then
  export PYTHONPATH=$PWD/build-gpu/python TRAINSTREAM_BUILD_DIR=$PWD/build-gpu
  echo "== recovery" | tee -a "$OUT/bench.log"
  ls /dev/shm > "$OUT/shm-before.txt" 2>&1
  timeout ${RECOVERY_TIMEOUT:-300} .venv/bin/python tests/recovery/kill_loop.py --device cuda \
    --build-dir "$PWD/build-gpu" ${RECOVERY_ARGS:-} > "$OUT/recovery.log" 2>&1 || { rc=1; echo "kill loop failed"; }
  tail -3 "$OUT/recovery.log" | tee -a "$OUT/bench.log"
  timeout 200 .venv/bin/python -m pytest -q -rs tests/python/test_kill_loop.py -k cuda \
    >> "$OUT/recovery.log" 2>&1 || rc=1
  tail -8 "$OUT/recovery.log" | tee -a "$OUT/bench.log"
  ls /dev/shm | diff "$OUT/shm-before.txt" - | tee -a "$OUT/bench.log"
fi
# Head-to-head against other libraries and the formats' perplexity
# (docs/benchmarks-compare.md). The peers' wheels come in .whl/ (carried; made with
# benchmarks/headtohead/peer_wheels.py) and install into /tmp/site. COMPARE_ARGS picks
# the scenarios, engines and caps; results land in $OUT/compare/ ($OUT/compare-<n>/ for
# several runs; written after every engine, so a call cut off by its limit still returns
# the engines that finished). No charts there (a call returns at most 8 files):
# compare.py --merge draws them here.
if [[ $STAGES == *compare* || $STAGES == *quality* ]]; then
  export PYTHONPATH=$PWD/build-gpu/python TRAINSTREAM_BUILD_DIR=$PWD/build-gpu
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl >> "$OUT/compare.log" 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
fi
# COMPARE_ARGS may hold several runs separated by ';' (scripts/compare-runs.sh).
if [[ $STAGES == *compare* ]]; then
  OUT=$OUT bash scripts/compare-runs.sh || rc=1
  tail -40 "$OUT/compare.log" | tee -a "$OUT/bench.log"
fi
if [[ $STAGES == *quality* ]]; then
  echo "== quality" | tee -a "$OUT/bench.log"
  timeout ${QUALITY_TIMEOUT:-300} python3 benchmarks/quality.py --out "$OUT/quality.json" ${QUALITY_ARGS:-} \
    >> "$OUT/quality.log" 2>&1 || { rc=1; echo "quality failed"; }
  tail -12 "$OUT/quality.log" | tee -a "$OUT/bench.log"
fi
# The FP8 base's fit with its tensor-core forward against the dequantized path, and the
# forward's GPU tests (docs/benchmarks-compare.md, "What the runs show": the FP8 base's slower fit).
if [[ $STAGES == *fp8diag* ]]; then
  export PYTHONPATH=$PWD/build-gpu/python TRAINSTREAM_BUILD_DIR=$PWD/build-gpu
  timeout ${FP8DIAG_TIMEOUT:-300} .venv/bin/python benchmarks/base/diag_fp8_fit.py --json "$OUT/fp8diag.json" \
    ${FP8DIAG_ARGS:-} > "$OUT/fp8diag.log" 2>&1 || { rc=1; echo "fp8diag failed"; }
  timeout ${FP8DIAG_TEST_TIMEOUT:-200} .venv/bin/python -m pytest -q -rs tests/python/test_quant_cuda.py -k "fp8" \
    >> "$OUT/fp8diag.log" 2>&1 || rc=1
  tail -25 "$OUT/fp8diag.log"
fi
# The CUDA cap test's scenario with the allocator's history recorded (diag_cap.py).
if [[ $STAGES == *capdiag* ]]; then
  export PYTHONPATH=$PWD/build-gpu/python TRAINSTREAM_BUILD_DIR=$PWD/build-gpu
  OUT=$OUT timeout 120 .venv/bin/python benchmarks/paging/diag_cap.py ${CAPDIAG_ARGS:-} \
    > "$OUT/capdiag.log" 2>&1 || { rc=1; echo "capdiag failed"; }
  grep -E "^step|out of memory" "$OUT/capdiag.log"
  gzip -f "$OUT/cap.pickle" 2>/dev/null
fi
exit $rc
