"""What an installed package checks before its compiled parts run.

* ``check_torch()``: ``_C`` is compiled against one torch's C++ ABI, so ``import
  trainstream`` with any other torch fails at once, naming both versions and the
  reinstall command, instead of an undefined symbol deep in the first ``wrap()``.
* ``explain_missing_library()``: ``_control`` and the two binaries link gRPC, protobuf
  and abseil from the distribution (docs/install.md); a missing one becomes an
  error naming the package to install rather than the loader's bare soname.

Neither loads ``_C`` or ``_control``: ``import trainstream`` stays light.
"""
from __future__ import annotations

import re
from typing import Optional

REINSTALL = "pip install --no-build-isolation --force-reinstall --no-deps <trainstream checkout or sdist>"

# soname prefix -> the Debian 12 package that ships it (the wheel's run-time needs;
# tests/install checks the table against the built files' NEEDED entries).
DEBIAN_PACKAGES = (
    ("libgrpc++.so", "libgrpc++1.51"),
    ("libgrpc.so", "libgrpc29"),
    ("libgpr.so", "libgrpc29"),
    ("libaddress_sorting.so", "libgrpc29"),
    ("libupb.so", "libgrpc29"),
    ("libprotobuf.so", "libprotobuf32"),
    ("libabsl_", "libabsl20220623"),
    ("libre2.so", "libre2-9"),
    ("libcares.so", "libc-ares2"),
    ("libspdlog.so", "libspdlog1.10"),
    ("libfmt.so", "libfmt9"),
    ("libcrypto.so", "libssl3"),  # the daemon: SHA-256 of recovery tokens
)

_SONAME = re.compile(r"(lib[\w+.-]+\.so[\w.]*)")


def check_torch(built: Optional[str] = None, running: Optional[str] = None) -> None:
    """Raise ImportError when the running torch is not the one ``_C`` was built for.

    ``built`` defaults to ``_build_info.TORCH_VERSION`` (written by CMake; a source
    checkout without it is not checked) and ``running`` to ``torch.__version__``.
    """
    if built is None:
        try:
            from .. import _build_info  # noqa: PLC0415 (absent in a source checkout)
        except ImportError:
            return
        built = _build_info.TORCH_VERSION
    if running is None:
        import torch  # noqa: PLC0415
        running = torch.__version__
    if str(running) != built:
        raise ImportError(
            f"trainstream was built for torch {built}, but this environment runs torch {running}; "
            f"its torch extension only works with the torch it was compiled against. Reinstall "
            f"trainstream against this torch: {REINSTALL} (or install torch=={built})")


def debian_package(soname: str) -> Optional[str]:
    """The Debian 12 package that ships ``soname``, or None when it is none of ours."""
    for prefix, package in DEBIAN_PACKAGES:
        if soname.startswith(prefix):
            return package
    return None


def explain_missing_library(text: str) -> Optional[str]:
    """For a loader error (``ImportError`` text or a binary's stderr) that names a
    shared library the wheel needs, a sentence naming the package to install."""
    if "cannot open shared object file" not in text:
        return None
    for soname in _SONAME.findall(text):
        package = debian_package(soname)
        if package is not None:
            return (f"{soname} is missing: TrainStream's compiled parts link gRPC, protobuf and "
                    f"abseil from the system. Install them with `apt-get install {package}` "
                    f"(Debian 12; docs/install.md lists every package), or source the "
                    f"air-gapped bundle's env.sh (deploy/bundle-deps.sh)")
    return None


def import_error(err: ImportError, module: str) -> ImportError:
    """``err`` with the missing system package named, when that is its cause."""
    hint = explain_missing_library(str(err))
    if hint is None:
        return err
    return ImportError(f"cannot load trainstream.{module}: {hint}. (The loader said: {err})")
