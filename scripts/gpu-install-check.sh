#!/usr/bin/env bash
# The GPU host's half of the install check (docs/install.md) in one command (through the device tool, with .deps
# carried): `pip install --no-build-isolation .` with the host's python3 into a fresh
# venv that sees the host's torch (and scikit-build-core, pybind11), then the CUDA test
# files against the installed package: no PYTHONPATH to a build tree, no
# TRAINSTREAM_BUILD_DIR (tests/python/conftest.py then takes the daemon from the
# installed package's trainstream/bin). Prints times and counts; logs go to $OUT.
#   PYTEST_FILES  the test files (default: the CUDA ones below)
#   PYTHON        the interpreter with torch (default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$PWD/gpu-install-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
VENV=${VENV:-/tmp/ts-install-venv}
BUILD_DIR=${BUILD_DIR:-$PWD/build-gpu-pip}
FILES=${PYTEST_FILES:-"tests/python/test_wrap_cuda.py tests/python/test_wrap_gpu_mode.py tests/python/test_quant_cuda.py
  tests/python/test_paging_cuda.py tests/python/test_base_cache_cuda.py tests/python/test_base_vram.py
  tests/python/test_dp_cuda.py"}
unset PYTHONPATH TRAINSTREAM_BUILD_DIR TRAINSTREAM_DAEMON TRAINSTREAM_SOCKET
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }

if [ -f .deps/unpack.sh ]; then
  # shellcheck disable=SC1091
  source .deps/unpack.sh  # gRPC, protobuf, abseil (run time too: LD_LIBRARY_PATH)
  PREFIX_PATH="$TS_TORCH_CMAKE_PREFIX;$TS_PYBIND11_CMAKE_DIR;$TS_DEPS_PREFIX/usr"
  export CMAKE_ARGS="${TS_PROTOBUF_CMAKE_ARGS:-}"  # scikit-build-core passes CMAKE_ARGS to CMake
else
  PREFIX_PATH=""
fi
{ nvidia-smi -L; nproc; "$PYTHON" -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'; \
  "$PYTHON" -c 'import scikit_build_core, pybind11; print("scikit-build-core", scikit_build_core.__version__, "pybind11", pybind11.__version__)'; } \
  > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

# A fresh venv that sees the host interpreter's packages through one .pth file (the
# same as tests/install/test_install.py and scripts/setup-venv.sh).
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV" || { echo "venv failed"; exit 1; }
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PYTHON" -c "import sys; print('\n'.join(p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))))" \
  > "$site/_parent_site.pth"
"$VENV/bin/python" -c 'import torch, scikit_build_core, pybind11' ||
  { echo "the venv does not see torch, scikit-build-core and pybind11 of $PYTHON"; exit 1; }

stamp "pip install --no-build-isolation . (build dir $BUILD_DIR)"
config=(-Cbuild-dir="$BUILD_DIR")
[ -n "$PREFIX_PATH" ] && config+=(-Ccmake.define.CMAKE_PREFIX_PATH="$PREFIX_PATH")
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$VENV/bin/python" -m pip install -v --no-deps --no-build-isolation \
  --disable-pip-version-check "${config[@]}" "$REPO" > "$OUT/pip-install.log" 2>&1
rc=$?
stamp "pip install exited $rc"
if [ $rc != 0 ]; then tail -40 "$OUT/pip-install.log"; exit 1; fi
"$VENV/bin/python" -m pip show -f trainstream > "$OUT/installed-files.txt" 2>&1

# From a directory outside the checkout: the tests are copied there, so nothing of
# the checkout's python/ can be imported by accident.
work=$(mktemp -d /tmp/ts-install-tests.XXXXXX)
mkdir -p "$work/tests"
cp -r tests/python "$work/tests/"
cp -r docs "$work/"  # quant_helpers.py checks docs/quantization.md
cd "$work"
"$VENV/bin/python" - <<'PY' 2>&1 | tee "$OUT/where.txt"
import trainstream, trainstream._native as n
print("package", trainstream.__file__)
print("_C", n.C().__file__)
print("_control", n.control().__file__)
from trainstream._native import daemon
print("daemon", daemon.daemon_binary())
PY
"$VENV/bin/trainstreamctl" daemon-path | tee -a "$OUT/where.txt"
grep -q "$site/trainstream/__init__.py" "$OUT/where.txt" || { echo "not the installed package"; exit 1; }

stamp "pytest $(echo $FILES | wc -w) files"
# shellcheck disable=SC2086
"$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider $FILES > "$OUT/pytest.log" 2>&1
rc=$?
stamp "pytest exited $rc"
tail -25 "$OUT/pytest.log"
cd "$REPO" && rm -rf "$work"
exit $rc
