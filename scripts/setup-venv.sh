#!/usr/bin/env bash
# Creates the project venv (--system-site-packages, so an installed torch is
# reused) and installs into it only what is missing, pinned to the GPU host's
# versions. PYTHON picks the interpreter, VENV the folder.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup-venv: creating $VENV from $($PYTHON -c 'import sys; print(sys.executable)')"
  "$PYTHON" -m venv --system-site-packages "$VENV"
  # --system-site-packages reaches the base interpreter's packages only. When
  # PYTHON is itself a venv (as on the GPU host, where torch lives in one), make
  # its packages visible too, so an installed torch is reused, not downloaded.
  parent_site=$("$PYTHON" -c 'import sys, site; print(":".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else "")')
  if [ -n "$parent_site" ]; then
    own_site=$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')
    echo "$parent_site" | tr ':' '\n' > "$own_site/_trainstream_parent_env.pth"
    echo "setup-venv: $PYTHON is a venv; its packages are visible in $VENV"
  fi
fi
py="$VENV/bin/python"
# name==version importname
want=("torch==2.11.0 torch" "numpy numpy" "pybind11 pybind11" "pytest pytest")
if [ "${TRAINSTREAM_HF:-1}" = 1 ]; then
  want+=("transformers==5.17.0 transformers" "peft==0.21.0 peft" "accelerate==1.15.0 accelerate" "safetensors safetensors")
fi
missing=()
for w in "${want[@]}"; do
  spec=${w% *}; mod=${w#* }
  if [[ $spec == *==* ]]; then
    ver=${spec#*==}
    have=$("$py" -c "import importlib.metadata as m; print(m.version('${spec%%==*}'))" 2>/dev/null || true)
    # A local build tag (2.11.0+cu130) is the same release.
    [ "${have%%+*}" = "$ver" ] || missing+=("$spec")
  else
    "$py" -c "import $mod" 2>/dev/null || missing+=("$spec")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "setup-venv: installing into $VENV: ${missing[*]}"
# --no-cache-dir: torch and its CUDA libraries come to about 5 GB installed; a
# cached copy of the wheels would nearly double what the install needs on disk.
if ! "$py" -m pip install -q --disable-pip-version-check --no-cache-dir "${missing[@]}"; then
  # Say where the space went, so that a failed install on a CI machine can be
  # told apart from a broken pin.
  echo "setup-venv: pip failed; free space where the venv and pip's temporary files live:" >&2
  df -h "$(dirname "$(readlink -f "$VENV")")" "${TMPDIR:-/tmp}" >&2 || true
  exit 1
fi
