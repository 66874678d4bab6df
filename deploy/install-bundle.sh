#!/bin/bash
# install-bundle.sh: on an air-gapped host, install a bundle made by
# bundle-deps.sh. Checks the checksums, unpacks every .deb into PREFIX with
# `dpkg -x` (no dpkg database, no root needed for a writable prefix, nothing of
# the host's packages is touched) and writes PREFIX/env.sh with the exports that
# CMake, the compiler, the linker and the loader need. With --system and root,
# also installs the daemon binaries, unit and config from the bundle.
#
# Usage: install-bundle.sh [--bundle DIR] [--prefix PREFIX] [--system]
#   --bundle DIR     the bundle (default: the directory of this script)
#   --prefix PREFIX  where to unpack (default /opt/trainstream-deps)
#   --system         also install trainstreamd/trainstreamctl to /usr/local/bin,
#                    the systemd unit and /etc/trainstream/trainstreamd.conf
# Then:  source PREFIX/env.sh
set -euo pipefail

bundle=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
prefix=/opt/trainstream-deps
system=0
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) bundle=$(cd "${2:?}" && pwd); shift 2 ;;
    --prefix) prefix=${2:?}; shift 2 ;;
    --system) system=1; shift ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install-bundle.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

command -v dpkg >/dev/null || { echo "install-bundle.sh: needs dpkg (Debian/Ubuntu)" >&2; exit 1; }
ls "$bundle"/*.deb >/dev/null 2>&1 || { echo "install-bundle.sh: no .deb files in $bundle" >&2; exit 1; }
if [ -f "$bundle/SHA256SUMS" ]; then
  (cd "$bundle" && sha256sum --quiet -c SHA256SUMS) || {
    echo "install-bundle.sh: checksum mismatch in $bundle (copy it again)" >&2; exit 1; }
else
  echo "install-bundle.sh: warning: no SHA256SUMS in $bundle; not verified" >&2
fi

mkdir -p "$prefix"
prefix=$(cd "$prefix" && pwd)
n=0
for deb in "$bundle"/*.deb; do
  dpkg -x "$deb" "$prefix"
  n=$((n + 1))
done
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)
lib=$prefix/usr/lib/$multiarch

cat > "$prefix/env.sh" <<ENV
# Source this (bash) to build or run TrainStream against the bundled packages.
export TS_DEPS_PREFIX=$prefix
export PATH=$prefix/usr/bin\${PATH:+:\$PATH}
export LD_LIBRARY_PATH=$lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
# gRPC's CMake config links plain -lre2 / -lcares: the linker needs the path too.
export LIBRARY_PATH=$lib\${LIBRARY_PATH:+:\$LIBRARY_PATH}
export CMAKE_PREFIX_PATH=$prefix/usr\${CMAKE_PREFIX_PATH:+:\$CMAKE_PREFIX_PATH}
# Use the bundled protoc and libprotobuf (the version grpc_cpp_plugin was built
# with), not a different one the host may have:
export TS_PROTOBUF_CMAKE_ARGS="-DProtobuf_PROTOC_EXECUTABLE=$prefix/usr/bin/protoc -DProtobuf_INCLUDE_DIR=$prefix/usr/include -DProtobuf_LIBRARY=$lib/libprotobuf.so"
ENV
echo "install-bundle.sh: unpacked $n packages into $prefix"

if [ "$system" = 1 ]; then
  [ "$(id -u)" = 0 ] || { echo "install-bundle.sh: --system needs root" >&2; exit 1; }
  [ -d "$bundle/trainstream" ] || { echo "install-bundle.sh: the bundle has no binaries (bundle-deps.sh --binaries)" >&2; exit 1; }
  install -m 0755 "$bundle/trainstream/trainstreamd" "$bundle/trainstream/trainstreamctl" /usr/local/bin/
  # The binaries find the bundled libraries through a drop-in, not a global ld.so change.
  install -D -m 0644 "$bundle/trainstream/trainstreamd.service" /etc/systemd/system/trainstreamd.service
  mkdir -p /etc/systemd/system/trainstreamd.service.d
  printf '[Service]\nEnvironment=LD_LIBRARY_PATH=%s\n' "$lib" > /etc/systemd/system/trainstreamd.service.d/deps.conf
  [ -f /etc/trainstream/trainstreamd.conf ] ||
    install -D -m 0644 "$bundle/trainstream/trainstreamd.conf.example" /etc/trainstream/trainstreamd.conf
  getent group trainstream >/dev/null || groupadd --system trainstream
  command -v systemctl >/dev/null && systemctl daemon-reload || true
  echo "install-bundle.sh: installed; start with: systemctl enable --now trainstreamd"
fi
echo "next: source $prefix/env.sh"
for whl in "$bundle"/trainstream-*.whl; do
  [ -f "$whl" ] && echo "  then, in the environment with torch: pip install --no-deps $whl"
done
