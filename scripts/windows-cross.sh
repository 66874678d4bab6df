#!/usr/bin/env bash
# scripts/windows-cross.sh: cross-builds TrainStream's Windows binaries on a
# Debian 12 machine with MinGW-w64 (issue 23; docs/windows.md). This first stage
# builds the CPU compute kernels (kernels/cpu) and their C++ tests as .exe
# files; scripts/windows-check.sh runs them under wine64.
#
# Steps, each skipped when its result is already there:
#   1. tools: installs g++-mingw-w64-x86-64-posix and wine64 from the
#      distribution's registry (apt-get, as root), saying what it installs.
#   2. catch2: fetches Debian's catch2 source package (`apt-get source`, which
#      needs a deb-src entry: one is added for the configured registry) and
#      installs it, configured with the toolchain file, into the cache's prefix.
#   3. kernels: configures cmake/windows (the kernels and their tests only,
#      with cmake/mingw-w64-x86_64.cmake) in the build folder and builds it.
#
# Environment:
#   TRAINSTREAM_WINDOWS_CACHE  cross-built dependencies, sources, the wine
#                              prefix (default $HOME/.cache/trainstream-windows)
#   TRAINSTREAM_WINDOWS_BUILD  the build folder (default build-windows in the repo)
#   TRAINSTREAM_WINDOWS_JOBS   parallel compile jobs (default: nproc)
#   STEPS                      which steps to run (default "tools catch2 kernels")
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${TRAINSTREAM_WINDOWS_CACHE:-$HOME/.cache/trainstream-windows}
build=${TRAINSTREAM_WINDOWS_BUILD:-$root/build-windows}
jobs=${TRAINSTREAM_WINDOWS_JOBS:-$(nproc)}
steps=${STEPS:-tools catch2 kernels}
toolchain=$root/cmake/mingw-w64-x86_64.cmake
prefix=$cache/prefix  # what was cross-built, installed (include/, lib/)

log() { echo "windows-cross: $*"; }
die() { echo "windows-cross: $*" >&2; exit 1; }
has_step() { [[ " $steps " == *" $1 "* ]]; }
mkdir -p "$cache/src" "$prefix"

# --- 1. tools --------------------------------------------------------------------
# The -posix compiler: std::thread needs the winpthreads-based libstdc++
# (cmake/mingw-w64-x86_64.cmake).
apt_install() {
  [[ $(id -u) -eq 0 ]] || die "installing $* needs root: run as root, or install them first"
  log "installing from the distribution's registry: $*"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@"
}
if has_step tools; then
  missing=()
  command -v x86_64-w64-mingw32-g++-posix > /dev/null || missing+=(g++-mingw-w64-x86-64-posix)
  # Debian's wine64 package puts the loader in /usr/lib/wine, not on PATH (the
  # /usr/bin wrapper is in the `wine` package, which pulls in 32-bit Wine).
  command -v wine64 > /dev/null || [[ -x /usr/lib/wine/wine64 ]] || missing+=(wine64)
  command -v cmake > /dev/null || missing+=(cmake)
  command -v ninja > /dev/null || missing+=(ninja-build)
  command -v dpkg-source > /dev/null || missing+=(dpkg-dev)
  if [[ ${#missing[@]} -gt 0 ]]; then
    apt_install "${missing[@]}"
  else
    log "tools: MinGW-w64 (posix threads), wine64, cmake, ninja already installed"
  fi
fi
command -v x86_64-w64-mingw32-g++-posix > /dev/null ||
  die "x86_64-w64-mingw32-g++-posix not found (run the tools step)"

# --- 2. Catch2, from Debian's source package ---------------------------------------
# apt-get source reads deb-src entries; add them for the registry the machine
# already uses (same URIs, suites and key), in a file of our own.
ensure_deb_src() {
  if grep -rqsE '^(Types:.*deb-src|deb-src )' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    return
  fi
  [[ $(id -u) -eq 0 ]] || die "apt-get source needs a deb-src entry; adding one needs root"
  local src=/etc/apt/sources.list.d/debian.sources
  if [[ -f $src ]]; then
    log "adding deb-src entries for $src's registry: /etc/apt/sources.list.d/trainstream-deb-src.sources"
    sed 's/^Types:.*/Types: deb-src/' "$src" > /etc/apt/sources.list.d/trainstream-deb-src.sources
  elif [[ -f /etc/apt/sources.list ]]; then
    log "adding deb-src lines for /etc/apt/sources.list's registry: /etc/apt/sources.list.d/trainstream-deb-src.list"
    sed -n 's/^deb /deb-src /p' /etc/apt/sources.list > /etc/apt/sources.list.d/trainstream-deb-src.list
  else
    die "no Debian sources found to derive a deb-src entry from"
  fi
  apt-get update
}
if has_step catch2; then
  if [[ -f $prefix/lib/cmake/Catch2/Catch2Config.cmake ]]; then
    log "catch2: already in $prefix"
  else
    t0=$(date +%s)
    ensure_deb_src
    (cd "$cache/src" && apt-get source catch2)
    catch_src=$(find "$cache/src" -maxdepth 1 -type d -name 'catch2-*' | sort | tail -1)
    [[ -n $catch_src ]] || die "apt-get source catch2 left no catch2-* folder in $cache/src"
    log "catch2: building $catch_src into $prefix"
    cmake -S "$catch_src" -B "$cache/build/catch2" -G Ninja \
      -DCMAKE_TOOLCHAIN_FILE="$toolchain" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_INSTALL_PREFIX="$prefix" -DCATCH_BUILD_TESTING=OFF \
      -DCATCH_INSTALL_DOCS=OFF -DCATCH_INSTALL_HELPERS=OFF
    cmake --build "$cache/build/catch2" -j "$jobs"
    cmake --install "$cache/build/catch2"
    log "catch2: done in $(($(date +%s) - t0)) s"
  fi
fi

# --- 3. the kernels and their tests ------------------------------------------------
if has_step kernels; then
  t0=$(date +%s)
  launcher=()
  command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  cmake -S "$root/cmake/windows" -B "$build" -G Ninja \
    -DCMAKE_TOOLCHAIN_FILE="$toolchain" -DTRAINSTREAM_WINDOWS_PREFIX="$prefix" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo "${launcher[@]}"
  cmake --build "$build" -j "$jobs"
  log "kernels: built in $(($(date +%s) - t0)) s; the tests are in $build/bin:"
  ls "$build"/bin/*.exe
fi
