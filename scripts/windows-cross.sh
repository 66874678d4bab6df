#!/usr/bin/env bash
# scripts/windows-cross.sh: cross-builds TrainStream's Windows binaries on a
# Debian 12 machine with MinGW-w64 (docs/windows.md). So far it
# builds the CPU compute kernels (kernels/cpu), the daemon's AdamW engine
# (daemon/optimizer), the platform seam (platform/), common/, proto/, the client
# library, trainstreamctl.exe (with TRAINSTREAM_WINDOWS_WITH_DAEMON=ON also
# trainstreamd.exe) and their C++ tests as .exe files, which
# scripts/windows-check.sh runs under wine64, and the control plane's
# dependencies.
#
# Steps, each skipped when its result is already there:
#   1. tools: installs g++-mingw-w64-x86-64-posix and wine64 from the
#      distribution's registry (apt-get, as root), saying what it installs.
#   2. catch2: fetches Debian's catch2 source package (`apt-get source`, which
#      needs a deb-src entry: one is added for the configured registry) and
#      installs it, configured with the toolchain file, into the cache's prefix.
#   3. deps: the control plane's dependencies, each from Debian's own source
#      package and each skipped when it is already in the prefix: zlib, c-ares,
#      openssl, abseil, re2, protobuf and gRPC, cross-built as static
#      libraries, in that order (each needs the ones before it), then the
#      daemon's fmt, spdlog, CLI11 and nlohmann_json. First it
#      checks that the build machine's protoc and grpc_cpp_plugin are the
#      versions of the protobuf and gRPC sources: the generated code must
#      match the library it is compiled against.
#   4. kernels: configures cmake/windows (the targets above and their tests,
#      with cmake/mingw-w64-x86_64.cmake) in the build folder and builds it.
#
# Environment:
#   TRAINSTREAM_WINDOWS_CACHE  cross-built dependencies, sources, the wine
#                              prefix (default $HOME/.cache/trainstream-windows)
#   TRAINSTREAM_WINDOWS_BUILD  the build folder (default build-windows in the repo)
#   TRAINSTREAM_WINDOWS_JOBS   parallel compile jobs (default: nproc)
#   STEPS                      which steps to run (default "tools catch2 deps kernels")
#   DEPS                       which dependencies the deps step builds (default: all)
#   TRAINSTREAM_WINDOWS_WITH_DAEMON  ON (default): the kernels step also builds daemon/
#                              (trainstreamd.exe and the daemon core's tests that build for Windows)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${TRAINSTREAM_WINDOWS_CACHE:-$HOME/.cache/trainstream-windows}
build=${TRAINSTREAM_WINDOWS_BUILD:-$root/build-windows}
jobs=${TRAINSTREAM_WINDOWS_JOBS:-$(nproc)}
steps=${STEPS:-tools catch2 deps kernels}
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

# --- 3. the control plane's dependencies, from Debian's source packages -----------
# fetch_source PKG GLOB: the unpacked source folder of Debian's source package
# PKG (a folder in the cache matching GLOB), fetched when there is none.
# Note [Older source versions]: the registry's index can name a version whose
# files the mirror does not serve (on 2026-12-02 the bookworm-security .dsc of
# zlib and openssl answered 404), so when `apt-get source PKG` fails, the
# older versions the index lists are tried, newest first.
fetch_source() {
  local pkg=$1 glob=$2 dir version
  dir=$(find "$cache/src" -maxdepth 1 -type d -name "$glob" | sort -V | tail -1)
  if [[ -z $dir ]]; then
    ensure_deb_src
    for version in $(apt-cache showsrc "$pkg" | sed -n 's/^Version: //p' | sort -rV -u); do
      if (cd "$cache/src" && apt-get source -q "$pkg=$version") >&2; then
        break
      fi
      log "apt-get source $pkg=$version failed; trying an older version" >&2
    done
    dir=$(find "$cache/src" -maxdepth 1 -type d -name "$glob" | sort -V | tail -1)
    [[ -n $dir ]] || die "apt-get source $pkg left no $glob folder in $cache/src"
  fi
  echo "$dir"
}
# cmake_dep NAME SOURCE [CMAKE ARGS...]: configure, build and install a CMake
# project for Windows into the prefix, static and Release.
cmake_dep() {
  local name=$1 src=$2
  shift 2
  cmake -S "$src" -B "$cache/build/$name" -G Ninja \
    -DCMAKE_TOOLCHAIN_FILE="$toolchain" -DTRAINSTREAM_WINDOWS_PREFIX="$prefix" \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$prefix" \
    -DBUILD_SHARED_LIBS=OFF -DCMAKE_CXX_STANDARD=17 "$@"
  cmake --build "$cache/build/$name" -j "$jobs"
  cmake --install "$cache/build/$name"
}
deps=${DEPS:-zlib c-ares openssl abseil re2 protobuf grpc fmt spdlog cli11 nlohmann-json}
has_dep() { [[ " $deps " == *" $1 "* ]]; }
# dep NAME ARTIFACT: true (and says so) when NAME has to be built, i.e. it is
# asked for and ARTIFACT, relative to the prefix, is not there yet.
dep() {
  has_dep "$1" || return 1
  if [[ -e $prefix/$2 ]]; then
    log "$1: already in $prefix"
    return 1
  fi
  dep_t0=$(date +%s)
  log "$1: building"
}
dep_done() { log "$1: done in $(($(date +%s) - dep_t0)) s"; }

build_zlib() {
  local src
  src=$(fetch_source zlib 'zlib-*')
  # Only the static library: zlib's install would also put zlib1.dll and its
  # import library into the prefix, and CMake's FindZLIB would pick those.
  cmake -S "$src" -B "$cache/build/zlib" -G Ninja \
    -DCMAKE_TOOLCHAIN_FILE="$toolchain" -DCMAKE_BUILD_TYPE=Release
  cmake --build "$cache/build/zlib" -j "$jobs" --target zlibstatic
  mkdir -p "$prefix/include" "$prefix/lib"
  cp "$src/zlib.h" "$cache/build/zlib/zconf.h" "$prefix/include/"
  cp "$cache/build/zlib/libzlibstatic.a" "$prefix/lib/libz.a"
}
build_openssl() {
  local src
  src=$(fetch_source openssl 'openssl-*')
  # OpenSSL's own build (perl Configure and make), out of the source tree.
  # Only libcrypto and libssl and their headers (build_libs, install_dev):
  # neither the openssl program nor the manuals.
  mkdir -p "$cache/build/openssl"
  (cd "$cache/build/openssl" &&
    "$src/Configure" mingw64 no-shared no-tests \
      CC=x86_64-w64-mingw32-gcc-posix AR=x86_64-w64-mingw32-ar \
      RANLIB=x86_64-w64-mingw32-ranlib RC=x86_64-w64-mingw32-windres \
      --prefix="$prefix" --libdir=lib &&
    make -j "$jobs" build_libs && make install_dev)
}
build_re2() {
  local src
  src=$(fetch_source re2 're2-*')
  # Debian's source (+dfsg) leaves out the three tables made from Unicode's
  # data; debian/rules makes them again (REBUILD_TABLES=1), from the
  # unicode-data package (debian/patches/debian-unicode-data.patch) with perl
  # and python3-six, the package's Build-Depends. They are host files, the
  # same for every target.
  if [[ ! -f $src/re2/unicode_groups.cc ]]; then
    missing=()
    [[ -d /usr/share/unicode ]] || missing+=(unicode-data)
    python3 -c 'import six' 2> /dev/null || missing+=(python3-six)
    [[ ${#missing[@]} -eq 0 ]] || apt_install "${missing[@]}"
    make -C "$src" REBUILD_TABLES=1 re2/perl_groups.cc re2/unicode_casefold.cc re2/unicode_groups.cc
  fi
  cmake_dep re2 "$src" -DRE2_BUILD_TESTING=OFF
}

if has_step deps; then
  # The host's code generators: protoc and grpc_cpp_plugin from the
  # distribution, checked against the source packages' versions below.
  if has_dep protobuf || has_dep grpc; then
    missing=()
    command -v protoc > /dev/null || missing+=(protobuf-compiler)
    command -v grpc_cpp_plugin > /dev/null || missing+=(protobuf-compiler-grpc)
    [[ ${#missing[@]} -eq 0 ]] || apt_install "${missing[@]}"
    protoc_version=$(protoc --version | awk '{print $2}')
    plugin_version=$(dpkg-query -W -f='${Version}' protobuf-compiler-grpc | sed 's/-[^-]*$//')
    protobuf_src=$(fetch_source protobuf 'protobuf-*')
    grpc_src=$(fetch_source grpc 'grpc-*')
    [[ $(basename "$protobuf_src") == "protobuf-$protoc_version" ]] ||
      die "host protoc is $protoc_version, the protobuf source is $(basename "$protobuf_src")"
    [[ $(basename "$grpc_src") == "grpc-$plugin_version" ]] ||
      die "host grpc_cpp_plugin is $plugin_version, the gRPC source is $(basename "$grpc_src")"
    log "host protoc $protoc_version and grpc_cpp_plugin $plugin_version match the sources"
  fi
  if dep zlib lib/libz.a; then
    build_zlib
    dep_done zlib
  fi
  if dep c-ares lib/cmake/c-ares/c-ares-config.cmake; then
    # Debian's fix for CVE-2023-31130 (debian/patches) spells the IPv4
    # address size INADDRSZ, which glibc's <arpa/nameser_compat.h> defines and
    # Windows' headers do not (c-ares' own name, NS_INADDRSZ, is 4 there too).
    cmake_dep c-ares "$(fetch_source c-ares 'c-ares-*')" -DCARES_STATIC=ON -DCARES_SHARED=OFF \
      -DCARES_BUILD_TOOLS=OFF -DCARES_BUILD_TESTS=OFF -DCMAKE_C_FLAGS=-DINADDRSZ=4
    dep_done c-ares
  fi
  if dep openssl lib/libcrypto.a; then
    build_openssl
    dep_done openssl
  fi
  if dep abseil lib/cmake/absl/abslConfig.cmake; then
    # C++17 as the daemon: absl's types (absl::optional and so on) are
    # aliases of std's only when absl itself is built as C++17.
    cmake_dep abseil "$(fetch_source abseil 'abseil-*')" -DABSL_PROPAGATE_CXX_STD=ON \
      -DBUILD_TESTING=OFF -DABSL_ENABLE_INSTALL=ON
    dep_done abseil
  fi
  if dep re2 lib/cmake/re2/re2Config.cmake; then
    build_re2
    dep_done re2
  fi
  if dep protobuf lib/cmake/protobuf/protobuf-config.cmake; then
    # The library only: the generated code comes from the host protoc.
    cmake_dep protobuf "$protobuf_src" -Dprotobuf_BUILD_TESTS=OFF \
      -Dprotobuf_BUILD_PROTOC_BINARIES=OFF -Dprotobuf_BUILD_LIBPROTOC=OFF \
      -Dprotobuf_WITH_ZLIB=ON -DZLIB_ROOT="$prefix"
    dep_done protobuf
  fi
  if dep grpc lib/cmake/grpc/gRPCConfig.cmake; then
    # Every dependency from the prefix ("package"), none of gRPC's bundled
    # copies; no code generators (the host's are used), so also none of the
    # libraries generated from gRPC's own .proto files (reflection, channelz).
    cmake_dep grpc "$grpc_src" -DgRPC_INSTALL=ON -DgRPC_BUILD_TESTS=OFF \
      -DgRPC_ZLIB_PROVIDER=package -DgRPC_CARES_PROVIDER=package \
      -DgRPC_SSL_PROVIDER=package -DgRPC_ABSL_PROVIDER=package \
      -DgRPC_RE2_PROVIDER=package -DgRPC_PROTOBUF_PROVIDER=package \
      -DgRPC_PROTOBUF_PACKAGE_TYPE=CONFIG -DgRPC_BUILD_CODEGEN=OFF \
      -DgRPC_BUILD_CSHARP_EXT=OFF -DgRPC_BUILD_GRPC_CPP_PLUGIN=OFF \
      -DgRPC_BUILD_GRPC_CSHARP_PLUGIN=OFF -DgRPC_BUILD_GRPC_NODE_PLUGIN=OFF \
      -DgRPC_BUILD_GRPC_OBJECTIVE_C_PLUGIN=OFF -DgRPC_BUILD_GRPC_PHP_PLUGIN=OFF \
      -DgRPC_BUILD_GRPC_PYTHON_PLUGIN=OFF -DgRPC_BUILD_GRPC_RUBY_PLUGIN=OFF \
      -DOPENSSL_ROOT_DIR="$prefix" -DOPENSSL_USE_STATIC_LIBS=TRUE -DZLIB_ROOT="$prefix"
    dep_done grpc
  fi
  # The daemon's and trainstreamctl's other libraries, the versions the Linux
  # build gets from Debian (libfmt-dev, libspdlog-dev, libcli11-dev,
  # nlohmann-json3-dev). spdlog's +ds source has no bundled fmt, so it is
  # built on the fmt above (SPDLOG_FMT_EXTERNAL).
  if dep fmt lib/cmake/fmt/fmt-config.cmake; then
    cmake_dep fmt "$(fetch_source fmtlib 'fmtlib-*')" -DFMT_TEST=OFF -DFMT_DOC=OFF -DFMT_INSTALL=ON
    dep_done fmt
  fi
  if dep spdlog lib/cmake/spdlog/spdlogConfig.cmake; then
    cmake_dep spdlog "$(fetch_source spdlog 'spdlog-*')" -DSPDLOG_FMT_EXTERNAL=ON \
      -DSPDLOG_BUILD_EXAMPLE=OFF -DSPDLOG_BUILD_TESTS=OFF -DSPDLOG_INSTALL=ON
    dep_done spdlog
  fi
  if dep cli11 include/CLI/CLI.hpp; then
    cmake_dep cli11 "$(fetch_source cli11 'cli11-*')" -DCLI11_BUILD_TESTS=OFF \
      -DCLI11_BUILD_EXAMPLES=OFF -DCLI11_BUILD_DOCS=OFF -DCLI11_INSTALL=ON
    dep_done cli11
  fi
  if dep nlohmann-json include/nlohmann/json.hpp; then
    cmake_dep nlohmann-json "$(fetch_source nlohmann-json3 'nlohmann-json3-*')" \
      -DJSON_BuildTests=OFF -DJSON_Install=ON
    dep_done nlohmann-json
  fi
fi

# --- 4. the kernels and their tests ------------------------------------------------
if has_step kernels; then
  t0=$(date +%s)
  launcher=()
  command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  # proto/ and its tests too once the deps step has installed gRPC.
  with_grpc=OFF
  [[ -f $prefix/lib/cmake/grpc/gRPCConfig.cmake ]] && with_grpc=ON
  cmake -S "$root/cmake/windows" -B "$build" -G Ninja \
    -DCMAKE_TOOLCHAIN_FILE="$toolchain" -DTRAINSTREAM_WINDOWS_PREFIX="$prefix" \
    -DTRAINSTREAM_WINDOWS_WITH_GRPC="$with_grpc" \
    -DTRAINSTREAM_WINDOWS_WITH_DAEMON="${TRAINSTREAM_WINDOWS_WITH_DAEMON:-ON}" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo "${launcher[@]}"
  cmake --build "$build" -j "$jobs"
  log "kernels: built in $(($(date +%s) - t0)) s; the tests are in $build/bin:"
  ls "$build"/bin/*.exe
fi
