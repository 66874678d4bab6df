"""The installed package's checks (trainstream/_native/runtime_check.py): the torch _C
was built for, and the system libraries the compiled parts link. The end-to-end
install is tests/install/test_install.py."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from trainstream._native import runtime_check


def test_same_torch_passes():
    runtime_check.check_torch(built=torch.__version__, running=torch.__version__)


def test_other_torch_names_both_versions_and_the_reinstall_command():
    with pytest.raises(ImportError) as e:
        runtime_check.check_torch(built="2.11.0+cu130", running="2.11.0+cpu")
    msg = str(e.value)
    assert "built for torch 2.11.0+cu130" in msg and "runs torch 2.11.0+cpu" in msg
    assert "pip install --no-build-isolation --force-reinstall --no-deps" in msg


def test_loader_error_names_the_package():
    err = ImportError("libgrpc++.so.1.51: cannot open shared object file: No such file or directory")
    out = runtime_check.import_error(err, "_control")
    assert "apt-get install libgrpc++1.51" in str(out) and "trainstream._control" in str(out)
    daemon_log = ("trainstreamd: error while loading shared libraries: libabsl_synchronization.so.20220623: "
                  "cannot open shared object file: No such file or directory")
    assert "apt-get install libabsl20220623" in runtime_check.explain_missing_library(daemon_log)


def test_other_import_errors_pass_through():
    err = ImportError("undefined symbol: _ZN3c106detail14torchCheckFail")
    assert runtime_check.import_error(err, "_C") is err
    other = ImportError("libfoo.so.3: cannot open shared object file: No such file or directory")
    assert runtime_check.import_error(other, "_C") is other


def _built_files(build_dir: Path):
    files = [build_dir / "bin" / "trainstreamd", build_dir / "bin" / "trainstreamctl"]
    files += sorted((build_dir / "python" / "trainstream").glob("_control*.so"))
    return files


@pytest.mark.skipif(shutil.which("readelf") is None or shutil.which("dpkg") is None,
                    reason="needs readelf and dpkg (Debian/Ubuntu) to read what the built files link")
def test_table_names_the_package_of_every_library_the_built_files_need(build_dir):
    """Every non-libc library the daemon, trainstreamctl and _control link is in the
    table, under the package that ships it here (so docs/install.md's list stays true)."""
    base = {"libc.so", "libm.so", "libstdc++.so", "libgcc_s.so", "ld-linux", "libpthread.so", "libdl.so",
            "librt.so"}
    files = _built_files(build_dir)
    assert len(files) == 3, f"build {build_dir} first: {files}"
    needed = set()
    for f in files:
        out = subprocess.run(["readelf", "-d", str(f)], capture_output=True, text=True, check=True).stdout
        needed |= set(re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out))
    ours = sorted(n for n in needed if not any(n.startswith(b) for b in base))
    assert any(n.startswith("libgrpc++") for n in ours), ours
    for soname in ours:
        package = runtime_check.debian_package(soname)
        assert package is not None, f"{soname} is not in runtime_check.DEBIAN_PACKAGES"
        if os.environ.get("TS_DEPS_PREFIX"):
            continue  # the bundle's libraries are unpacked, not dpkg-installed
        owner = subprocess.run(["dpkg", "-S", soname], capture_output=True, text=True)
        assert owner.returncode == 0, f"dpkg knows no package holding {soname}"
        assert owner.stdout.split(":")[0] == package, f"{soname}: dpkg says {owner.stdout.strip()}, table {package}"
