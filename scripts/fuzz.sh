#!/usr/bin/env bash
# scripts/fuzz.sh <target> <seconds>: runs one libFuzzer target for that long
# and merges the inputs that add coverage into tests/fuzz/corpus/<target>.
#
#   <target>   a name given to trainstream_add_fuzz_target (tests/fuzz/CMakeLists.txt),
#              e.g. safetensors or control_request
#   <seconds>  how long to fuzz (libFuzzer -max_total_time)
#
# Builds in build-fuzz (TRAINSTREAM_FUZZ_BUILD_DIR overrides) with clang,
# -DTRAINSTREAM_BUILD_FUZZERS=ON and every library compiled with
# -fsanitize=fuzzer-no-link,address,undefined, so the daemon code a target
# links is instrumented too. Needs clang with libFuzzer; on Debian 12:
#   apt-get install -y clang-14 libclang-rt-14-dev
# (not in install-system-deps.sh: CI only replays corpora, with g++).
#
# The fuzzer runs on a copy of the corpus, one job (TRAINSTREAM_FUZZ_JOBS for
# more). Afterwards `-merge=1 -use_counters=0` adds to the corpus only the new
# inputs that reach new edges (hit counts do not count: merging by libFuzzer's
# full feature set keeps several times more files for the same edges); if the
# corpus then holds more than TRAINSTREAM_FUZZ_MAX_FILES files (500) or
# TRAINSTREAM_FUZZ_MAX_BYTES bytes (4 MB) it is minimised as a whole the same way. A crash stops the run: the input is left
# under build-fuzz/fuzz-artifacts/<target>/ and the script exits 1; add it to
# the corpus once the daemon code is fixed, so fuzz_replay_<target> keeps it
# fixed. Extra libFuzzer flags go after `--` (e.g. -- -max_len=65536).
set -euo pipefail

usage() {
  echo "usage: $0 <target> <seconds> [-- <libFuzzer flags>]" >&2
  exit 2
}
[[ $# -ge 2 ]] || usage
target=${1%_fuzz}
seconds=$2
shift 2
if [[ $# -gt 0 ]]; then
  [[ $1 == "--" ]] || usage
  shift
fi
[[ $seconds =~ ^[0-9]+$ ]] || { echo "seconds: '$seconds' is not a whole number" >&2; exit 2; }

repo=$(cd "$(dirname "$0")/.." && pwd)
build=${TRAINSTREAM_FUZZ_BUILD_DIR:-$repo/build-fuzz}
corpus=$repo/tests/fuzz/corpus/$target
max_files=${TRAINSTREAM_FUZZ_MAX_FILES:-500}
max_bytes=${TRAINSTREAM_FUZZ_MAX_BYTES:-4000000}
jobs=${TRAINSTREAM_FUZZ_JOBS:-1}
[[ -d $corpus ]] || { echo "no corpus folder $corpus (is '$target' a fuzz target?)" >&2; exit 2; }

cxx=""
for c in clang++ clang++-14 clang++-15 clang++-16; do
  if command -v "$c" >/dev/null; then cxx=$c; break; fi
done
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' \
  >"$probe/p.cc"
if [[ -z $cxx ]] || ! "$cxx" -fsanitize=fuzzer "$probe/p.cc" -o "$probe/p" 2>/dev/null; then
  echo "need clang with libFuzzer: apt-get install -y clang-14 libclang-rt-14-dev" >&2
  exit 1
fi
cc=${cxx/clang++/clang}

if [[ ! -f $build/CMakeCache.txt ]]; then
  flags="-fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer"
  cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
    -DTRAINSTREAM_BUILD_FUZZERS=ON -DTRAINSTREAM_WITH_CUDA=OFF -DTRAINSTREAM_WITH_PYTHON=OFF \
    -DTRAINSTREAM_BUILD_BENCHMARKS=OFF -DTRAINSTREAM_BUILD_TESTS=OFF
fi
ninja -C "$build" "${target}_fuzz"
bin=$build/bin/${target}_fuzz

work=$build/fuzz-work/$target
artifacts=$build/fuzz-artifacts/$target
rm -rf "$work"
mkdir -p "$work" "$artifacts"
cp "$corpus"/* "$work"/
echo "fuzzing $target for $seconds s on a copy of $(ls "$corpus" | wc -l) corpus files"
parallel=()
[[ $jobs -gt 1 ]] && parallel=(-jobs="$jobs" -workers="$jobs")
# The full log is kept; the terminal gets libFuzzer's progress lines.
set +e
(cd "$build" && "$bin" "$work" -max_total_time="$seconds" "${parallel[@]}" \
  -artifact_prefix="$artifacts/" -print_final_stats=1 "$@") 2>&1 |
  tee "$build/fuzz-$target.log" |
  grep --line-buffered -E '^#[0-9]+[[:space:]]+(INITED|DONE|pulse)|ERROR|SUMMARY|stat::'
status=${PIPESTATUS[0]}
set -e
if [[ $status -ne 0 ]]; then
  echo "$target: the fuzzer stopped with status $status; see $build/fuzz-$target.log and" >&2
  ls -1 "$artifacts" >&2
  exit 1
fi

before=$(ls "$corpus" | wc -l)
"$bin" -merge=1 -use_counters=0 -artifact_prefix="$artifacts/" "$corpus" "$work" 2>&1 | tail -n 1
files=$(ls "$corpus" | wc -l)
bytes=$(du -sb "$corpus" | cut -f1)
if [[ $files -gt $max_files || $bytes -gt $max_bytes ]]; then
  echo "corpus has $files files / $bytes bytes (caps $max_files / $max_bytes): minimising"
  small=$build/fuzz-min/$target
  rm -rf "$small"
  mkdir -p "$small"
  "$bin" -merge=1 -use_counters=0 -artifact_prefix="$artifacts/" "$small" "$corpus" 2>&1 |
    tail -n 1
  rm -f "$corpus"/*
  cp "$small"/* "$corpus"/
  files=$(ls "$corpus" | wc -l)
  bytes=$(du -sb "$corpus" | cut -f1)
fi
echo "$target: corpus $before -> $files files ($bytes bytes) in $corpus"
