#!/usr/bin/env bash
# Where the redo journal's time goes (docs/staging-pool.md, "The journal"): run on the
# GPU host through the device tool, carrying .deps, with decomposition.patch applied
# first (`git apply benchmarks/adamw/journal/decomposition.patch`; it is an experiment
# and is not part of the daemon: TS_JX_SUB picks the sub-chunk at run time, TS_JX_MODE
# drops parts of the journal, which makes the results wrong on purpose). Then
#   bash benchmarks/adamw/journal/decomposition.sh
set -uo pipefail
source .deps/unpack.sh; export TRAINSTREAM_SKIP_SYSTEM_DEPS=1
CMAKE_ARGS="'-DCMAKE_PREFIX_PATH=$TS_TORCH_CMAKE_PREFIX;$TS_PYBIND11_CMAKE_DIR;$TS_DEPS_PREFIX/usr' $TS_PROTOBUF_CMAKE_ARGS"
make venv PYTHON=python3 > $OUT/build.log 2>&1
eval cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython_EXECUTABLE="$PWD/.venv/bin/python" -DTRAINSTREAM_BUILD_TESTS=ON -DTRAINSTREAM_BUILD_BENCHMARKS=ON "$CMAKE_ARGS" >> $OUT/build.log 2>&1
cmake --build build-gpu -j16 --target trainstream-bench-adamw adamw_kernel_test >> $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
build-gpu/bin/adamw_kernel_test > $OUT/kernel_test.log 2>&1; echo "adamw_kernel_test rc=$?"; tail -3 $OUT/kernel_test.log
lscpu | grep -E "Model name|L1d|L2|L3|NUMA" 
B="build-gpu/bin/trainstream-bench-adamw --params 268435456 --tensor-elems 16777216 --threads 0 --grad-dtype bf16 --moment-dtype bf16 --check param --iters 6 --warmup 2"
run() { echo "== $*"; env "$@" | tail -1; }
for pd in bf16-split bf16; do
  run $B --param-dtype $pd --durable 0
  for sub in 4096 16384 65536; do for m in 0 4; do
    run TS_JX_SUB=$sub TS_JX_MODE=$m $B --param-dtype $pd --durable 1
  done; done
  for m in 1 2 8 3; do run TS_JX_SUB=4096 TS_JX_MODE=$m $B --param-dtype $pd --durable 1; done
done 2>&1 | tee $OUT/jx.log | grep -E "^==|ms/step" | paste - - | sed -E 's/build-gpu.*--param-dtype ([a-z0-9-]+) --durable ([01]).*/\1 d=\2/; s/threads.*durable?:? *//'
