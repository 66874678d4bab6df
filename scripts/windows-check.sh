#!/usr/bin/env bash
# scripts/windows-check.sh: runs the Windows C++ tests that
# scripts/windows-cross.sh built, under wine64 (issue 23; docs/windows.md).
# These are the tests of the CPU kernels, the daemon's AdamW engine and the
# platform seam's threads side (build-windows/bin/*_test.exe).
# Each test picks the instruction sets the CPU has (cpu_features.h), as on
# Linux; a path the CPU lacks is reported by the test itself.
#
# Prints one line per test and a summary; exits 1 when any test fails (or none
# was found), so a CI job can run it as it is.
#
# Environment:
#   TRAINSTREAM_WINDOWS_CACHE  as for windows-cross.sh; the wine prefix is its
#                              wineprefix/ (created on the first run)
#   TRAINSTREAM_WINDOWS_BUILD  the build folder (default build-windows in the repo)
#   TESTS                      test names to run (default: every *_test.exe
#                              but the excluded ones below)
# A test's whole output is in <build>/wine-logs/<test>.log.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${TRAINSTREAM_WINDOWS_CACHE:-$HOME/.cache/trainstream-windows}
build=${TRAINSTREAM_WINDOWS_BUILD:-$root/build-windows}
logs=$build/wine-logs

wine=$(command -v wine64 || true)
[[ -n $wine ]] || wine=/usr/lib/wine/wine64  # Debian's wine64 package (windows-cross.sh)
[[ -x $wine ]] || { echo "windows-check: wine64 not found (scripts/windows-cross.sh installs it)" >&2; exit 1; }
wineserver=$(dirname "$wine")/wineserver
export WINEPREFIX=$cache/wineprefix WINEDEBUG=-all
mkdir -p "$WINEPREFIX" "$logs"

# One wineserver for the whole run, stopped at the end: when each test starts
# its own, a test can connect just as the previous one's server times out and
# exits ("wine client error:0: recvmsg: Connection reset by peer", seen once in
# four fresh runs).
"$wineserver" -p
trap '"$wineserver" -k 2> /dev/null || true' EXIT

if [[ ! -f $WINEPREFIX/system.reg ]]; then
  echo "windows-check: creating the wine prefix $WINEPREFIX"
  # A 64-bit-only Wine cannot start the 32-bit rundll32 wineboot asks for; the
  # prefix is complete without it.
  "$wine" wineboot --init > "$logs/wineboot.log" 2>&1 || true
fi

# Tests that check what Wine does not do, each with the reason; they are built
# for a Windows machine, and TESTS can still name them.
declare -A excluded=(
  [platform_shm_windows_test]="Wine 8.0 keeps no file DACL: it reports one made from the Unix mode, whatever CreateFileW or SetSecurityInfo set"
)
if [[ -n ${TESTS:-} ]]; then
  tests=()
  for t in $TESTS; do tests+=("$build/bin/${t%.exe}.exe"); done
else
  tests=()
  for exe in "$build"/bin/*_test.exe; do
    name=$(basename "$exe" .exe)
    if [[ -n ${excluded[$name]:-} ]]; then
      echo "SKIP  $name: not run under Wine: ${excluded[$name]}"
    else
      tests+=("$exe")
    fi
  done
fi
[[ ${#tests[@]} -gt 0 && -e ${tests[0]} ]] || { echo "windows-check: no tests in $build/bin (run scripts/windows-cross.sh)" >&2; exit 1; }

passed=0
failed=()
for exe in "${tests[@]}"; do
  name=$(basename "$exe" .exe)
  t0=$(date +%s)
  "$wine" "$exe" > "$logs/$name.log" 2>&1
  rc=$?
  seconds=$(($(date +%s) - t0))
  # Catch2's last summary line: "All tests passed (...)" or "test cases: ...".
  summary=$(grep -aE '^(All tests passed|test cases:)' "$logs/$name.log" | tail -1)
  if [[ $rc -eq 0 ]]; then
    passed=$((passed + 1))
    echo "PASS  $name (${seconds} s): $summary"
  else
    failed+=("$name")
    echo "FAIL  $name (${seconds} s, exit $rc): ${summary:-no Catch2 summary} (log: $logs/$name.log)"
  fi
  # Paths a test could not run on this CPU (TS_SKIP in catch_compat.h).
  grep -aho 'TS_SKIPPED: .*' "$logs/$name.log" | sort -u | sed 's/^/      /'
done

n_excluded=0
[[ -n ${TESTS:-} ]] || n_excluded=${#excluded[@]}
echo "windows-check: ${passed} of ${#tests[@]} test binaries passed under $("$wine" --version)" \
  "(${n_excluded} excluded)"
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "windows-check: failed: ${failed[*]}"
  exit 1
fi
