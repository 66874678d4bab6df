#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages TrainStream builds against, only those that
# are missing. Needs root or sudo for the install itself; says what it installs.
# Set TRAINSTREAM_SKIP_SYSTEM_DEPS=1 when the dependencies come from elsewhere
# (an air-gapped host with deploy/bundle-deps.sh's bundle sourced).
set -euo pipefail
[ "${TRAINSTREAM_SKIP_SYSTEM_DEPS:-0}" = 1 ] && exit 0

pkgs=(build-essential cmake ninja-build pkg-config ccache
      libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
      libboost-dev libspdlog-dev libcli11-dev nlohmann-json3-dev catch2
      libssl-dev  # SHA-256 of recovery tokens (daemon/security/token.cc; gRPC's -dev pulls it in too)
      python3)  # the system interpreter: tests run clients as an unprivileged uid with it
if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "install-system-deps: not a Debian/Ubuntu system; install these yourself: ${pkgs[*]}" >&2
  exit 0
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# python3-venv is needed only when the interpreter lacks the venv module.
${PYTHON:-python3} -c "import venv, ensurepip" 2>/dev/null || missing+=(python3-venv)
[ ${#missing[@]} -eq 0 ] && exit 0

echo "install-system-deps: installing missing packages: ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then sudo=(); elif command -v sudo >/dev/null; then sudo=(sudo); else
  echo "install-system-deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
