#!/bin/bash
# bundle-deps.sh: on a machine that reaches a Debian/Ubuntu package registry,
# download every package TrainStream needs to BUILD and RUN (gRPC C++ and its
# protobuf/abseil/re2/c-ares, spdlog, fmt, CLI11, nlohmann-json, Catch2), with a
# checksum manifest, into one directory. Carry it to the air-gapped host and run
# install-bundle.sh there (docs/daemon.md, "Air-gapped install").
#
# The packages must come from the same distribution release as the target host
# (or an older one the target's libc can run): bundle on Debian 12 for Debian 12,
# or, as verified for the GPU host, Debian 12 packages unpacked into a private
# prefix on Ubuntu 24.04.
#
# Usage: deploy/bundle-deps.sh DEST [--binaries BUILD_DIR] [--wheel WHEEL] [extra-package ...]
#   --binaries BUILD_DIR  also copy BUILD_DIR/bin/{trainstreamd,trainstreamctl},
#                         the unit and the example config into DEST/trainstream/
#   --wheel WHEEL         also copy a trainstream wheel (pip wheel --no-build-isolation .)
#                         into DEST, and its two binaries, the unit and the config into
#                         DEST/trainstream/ (so install-bundle.sh --system works from it);
#                         on the host: source env.sh, then pip install --no-deps DEST/*.whl
set -euo pipefail

usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
[ $# -ge 1 ] || usage 1
case "$1" in -h|--help) usage 0 ;; esac
dest=$1; shift
binaries=""
wheel=""
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --binaries) binaries=${2:?--binaries needs a build directory}; shift 2 ;;
    --wheel) wheel=${2:?--wheel needs a .whl file}; shift 2
             [ -f "$wheel" ] && [[ $wheel == *.whl ]] ||
               { echo "bundle-deps.sh: --wheel $wheel is not a .whl file" >&2; exit 1; } ;;
    *) extra+=("$1"); shift ;;
  esac
done

command -v apt-get >/dev/null || { echo "bundle-deps.sh: needs apt-get (Debian/Ubuntu)" >&2; exit 1; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)

# Runtime libraries first, then what building needs. Names are Debian 12's; on
# other releases pass the right versions as extra packages.
runtime=(libgrpc++1.51 libgrpc29 libprotobuf32 libabsl20220623 libre2-9 libc-ares2
         libspdlog1.10 libfmt9)
build=(libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev libprotoc32
       protobuf-compiler libabsl-dev libre2-dev libc-ares-dev libspdlog-dev libfmt-dev
       libcli11-dev nlohmann-json3-dev catch2 libssl-dev)

if ! compgen -G "/var/lib/apt/lists/*_Packages*" >/dev/null; then
  echo "bundle-deps.sh: apt lists are empty; running apt-get update" >&2
  apt-get update -qq
fi

missing=()
for p in "${runtime[@]}" "${build[@]}" "${extra[@]}"; do
  apt-cache show "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bundle-deps.sh: the registry has no package named: ${missing[*]}" >&2
  echo "  (different release? pass the right names as extra arguments)" >&2
  exit 1
fi

echo "bundle-deps.sh: downloading $(( ${#runtime[@]} + ${#build[@]} + ${#extra[@]} )) packages into $dest"
(cd "$dest" && apt-get download "${runtime[@]}" "${build[@]}" "${extra[@]}")

if [ -n "$binaries" ]; then
  mkdir -p "$dest/trainstream"
  for b in trainstreamd trainstreamctl; do
    [ -x "$binaries/bin/$b" ] || { echo "bundle-deps.sh: $binaries/bin/$b is missing (build first)" >&2; exit 1; }
    cp "$binaries/bin/$b" "$dest/trainstream/"
  done
  cp "$here/trainstreamd.service" "$here/trainstreamd.conf.example" "$dest/trainstream/"
fi

if [ -n "$wheel" ]; then
  mkdir -p "$dest/trainstream"
  cp "$wheel" "$dest/"
  # The wheel is a zip: its trainstream/bin/ holds the same two binaries.
  python3 - "$wheel" "$dest/trainstream" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in ("trainstreamd", "trainstreamctl"):
        out = os.path.join(sys.argv[2], name)
        with z.open(f"trainstream/bin/{name}") as src, open(out, "wb") as dst:
            dst.write(src.read())
        os.chmod(out, 0o755)
PY
  cp "$here/trainstreamd.service" "$here/trainstreamd.conf.example" "$dest/trainstream/"
fi

cp "$here/install-bundle.sh" "$dest/"
(
  cd "$dest"
  {
    echo "# TrainStream dependency bundle"
    echo "# made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME") ($(dpkg --print-architecture))"
    for f in *.deb; do
      printf '%s\t%s\n' "$(dpkg-deb -f "$f" Package)" "$(dpkg-deb -f "$f" Version)"
    done
  } > MANIFEST
  find . -type f ! -name SHA256SUMS -printf '%P\n' | sort | xargs sha256sum > SHA256SUMS
)
echo "bundle-deps.sh: $(ls "$dest"/*.deb | wc -l) packages, $(du -sh "$dest" | cut -f1) in $dest"
echo "  on the offline host:  $dest/install-bundle.sh --prefix /opt/trainstream-deps"
