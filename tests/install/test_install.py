"""`pip install --no-build-isolation .` end to end (docs/install.md): a fresh virtual
environment that sees the installed torch, the package built from this checkout and
installed into it, then used from a directory outside the checkout with no PYTHONPATH:
training through wrap() with the daemon started on demand from the installed package,
`trainstreamctl status --json`, and `pip uninstall` leaving no TrainStream file behind.

The fresh environment is `python -m venv` plus one .pth file listing the parent
interpreter's site-packages (as scripts/setup-venv.sh does): only the standard library
is needed, torch is seen where it is installed instead of copied or downloaded, and pip
installs and uninstalls in the new environment's own site-packages, which come first
on sys.path. scikit-build-core is installed into it when the parent lacks it (pinned).

Run by `make test-install` (part of `make test`). Settings (environment):
  TRAINSTREAM_INSTALL_PYTHON     interpreter whose torch the venv sees (default: this one)
  TRAINSTREAM_INSTALL_BUILD_DIR  scikit-build-core's build directory, kept between runs
                                 so ninja and ccache make a rebuild fast (default:
                                 <repo>/build-pip, at the depth of build/ so the two
                                 builds' compile lines match for ccache)
  TRAINSTREAM_INSTALL_VENV       where the venv is made (default: <build dir>/venv)
  TRAINSTREAM_INSTALL_LIKE       a CMake build dir (make build's) whose compilers the wheel
                                 build uses: scikit-build-core would otherwise take
                                 Python's (g++ where CMake chose c++), and ccache keys
                                 on the compiler
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SKBUILD_CORE = "scikit-build-core==1.1.2"
PARENT_PTH = "_parent_site.pth"  # named so the leftover check below can tell it apart

PARENT = os.environ.get("TRAINSTREAM_INSTALL_PYTHON", sys.executable)
BUILD_DIR = Path(os.environ.get("TRAINSTREAM_INSTALL_BUILD_DIR", REPO / "build-pip")).resolve()
VENV = Path(os.environ.get("TRAINSTREAM_INSTALL_VENV", BUILD_DIR / "venv")).resolve()


def _clean_env(**extra) -> dict:
    """This process's environment less everything that would point at a build tree."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TRAINSTREAM_BUILD_DIR", "TRAINSTREAM_DAEMON", "TRAINSTREAM_SOCKET",
                        "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(extra)
    return env


def _run(cmd, *, timeout=120, check=True, **kw):
    t0 = time.monotonic()
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    r.seconds = time.monotonic() - t0
    if check:
        assert r.returncode == 0, \
            f"{' '.join(map(str, cmd))} exited {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    return r


def _site_packages(python) -> Path:
    out = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout
    return Path(out.strip())


@pytest.fixture(scope="module")
def venv():
    """A fresh venv seeing PARENT's packages, with the checkout installed into it."""
    if VENV.exists():
        shutil.rmtree(VENV)
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    base = _run([PARENT, "-c", "import sys; print(getattr(sys, '_base_executable', sys.executable))"]).stdout.strip()
    _run([base, "-m", "venv", VENV])
    py = VENV / "bin" / "python"
    parent_paths = _run([PARENT, "-c", "import sys; print('\\n'.join(p for p in sys.path if "
                         "p.endswith(('site-packages', 'dist-packages'))))"], env=_clean_env()).stdout
    (_site_packages(py) / PARENT_PTH).write_text(parent_paths)
    _run([py, "-c", "import torch"], env=_clean_env())  # the parent's torch is visible
    if _run([py, "-c", "import scikit_build_core"], check=False, env=_clean_env()).returncode != 0:
        _run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", SKBUILD_CORE], timeout=300)

    config = [f"-Cbuild-dir={BUILD_DIR}"]
    launcher = shutil.which("ccache")
    if launcher:
        config += [f"-Ccmake.define.CMAKE_CXX_COMPILER_LAUNCHER={launcher}",
                   f"-Ccmake.define.CMAKE_CUDA_COMPILER_LAUNCHER={launcher}"]
    like = os.environ.get("TRAINSTREAM_INSTALL_LIKE")
    if like and (Path(like) / "CMakeCache.txt").exists():
        cache = (Path(like) / "CMakeCache.txt").read_text()
        for lang in ("C", "CXX", "CUDA"):
            for line in cache.splitlines():
                if line.startswith(f"CMAKE_{lang}_COMPILER:"):
                    config.append(f"-Ccmake.define.CMAKE_{lang}_COMPILER={line.split('=', 1)[1]}")
    env = _clean_env(CCACHE_NOHASHDIR="1")  # (the Makefile sets CCACHE_BASEDIR)
    r = _run([py, "-m", "pip", "install", "-v", "--disable-pip-version-check", "--no-build-isolation",
              *config, REPO], timeout=1800, env=env)
    (BUILD_DIR / "pip-install.log").write_text(r.stdout + r.stderr)
    print(f"\npip install --no-build-isolation . took {r.seconds:.1f} s (log: {BUILD_DIR / 'pip-install.log'})")
    return py


def _installed_files(py) -> list[str]:
    out = _run([py, "-m", "pip", "show", "-f", "trainstream"], env=_clean_env()).stdout
    return [line.strip() for line in out.split("Files:", 1)[1].splitlines() if line.strip()]


def test_wheel_contents(venv):
    files = _installed_files(venv)
    for want in ("trainstream/__init__.py", "trainstream/_build_info.py", "trainstream/bin/trainstreamd",
                 "trainstream/bin/trainstreamctl", "trainstream/optim/offload_adamw.py"):
        assert want in files, f"{want} is not installed; installed: {files}"
    for module in ("trainstream/_C.", "trainstream/_control."):
        assert any(f.startswith(module) and f.endswith(".so") for f in files), f"no {module}*.so in {files}"
    for exe in ("trainstreamd", "trainstreamctl"):
        path = VENV / "bin" / exe
        assert path.is_file() and os.access(path, os.X_OK), f"{exe} is not on the venv's PATH"
    # Only what the package is: no test-only module, no benchmark, no .so of a checkout.
    assert not [f for f in files if "testing" in f or "bench" in f], files


def test_daemon_path_and_build_info(venv, tmp_path):
    site = _site_packages(venv)
    r = _run([VENV / "bin" / "trainstreamctl", "daemon-path"], cwd=tmp_path, env=_clean_env())
    assert r.stdout.strip() == str(VENV / "bin" / "trainstreamd")
    r = _run([site / "trainstream" / "bin" / "trainstreamctl", "daemon-path"], cwd=tmp_path, env=_clean_env())
    assert r.stdout.strip() == str(site / "trainstream" / "bin" / "trainstreamd")
    r = _run([venv, "-c", "import torch, trainstream._build_info as b; print(b.TORCH_VERSION, torch.__version__)"],
             cwd=tmp_path, env=_clean_env())
    built, running = r.stdout.split()
    assert built == running


TRAIN = textwrap.dedent("""
    import copy, json, os
    import torch
    import torch.nn.functional as F
    import trainstream
    from trainstream._native import C, daemon

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    ours = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=1e-2))
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    losses = {"ref": [], "ours": []}
    for _ in range(20):
        for name, model, o in (("ref", ref, ref_opt), ("ours", ours, opt)):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            losses[name].append(loss.item())
    diff = max((p.detach() - q.detach()).abs().max().item() for p, q in zip(ref.parameters(), ours.parameters()))
    pid = daemon.connect().ping()["pid"]
    print(json.dumps({"losses": losses, "max_param_diff": diff, "pid": pid,
                      "exe": os.readlink(f"/proc/{pid}/exe"), "package": trainstream.__file__,
                      "C": C().__file__, "optimizer": type(opt).__name__}))
    trainstream.unwrap(ours)
""")


def test_train_outside_the_checkout_with_the_installed_daemon(venv, tmp_path):
    work = tmp_path / "elsewhere"
    work.mkdir()
    runtime = tmp_path / "run"  # the embedded daemon's socket dir: this test's own daemon
    runtime.mkdir(mode=0o700)
    env = _clean_env(XDG_RUNTIME_DIR=str(runtime), TRAINSTREAM_IDLE_EXIT_S="60")
    (work / "train.py").write_text(TRAIN)
    r = _run([venv, "train.py"], cwd=work, env=env, timeout=300)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    site = _site_packages(venv)
    try:
        assert out["package"] == str(site / "trainstream" / "__init__.py"), "the installed package is the one imported"
        assert out["C"].startswith(str(site / "trainstream" / "_C.")), out["C"]
        assert out["exe"] == str(site / "trainstream" / "bin" / "trainstreamd"), \
            f"the daemon started on demand is the installed one, not {out['exe']}"
        assert out["optimizer"] == "OffloadAdamW"
        ref, ours = out["losses"]["ref"], out["losses"]["ours"]
        assert ours[-1] < 0.8 * ours[0], f"the model should learn: {ours}"
        for i, (a, b) in enumerate(zip(ref, ours)):
            assert abs(a - b) <= 1e-5 * abs(a), f"step {i}: loss {b} vs torch.optim.AdamW's {a}"
        assert out["max_param_diff"] <= 1e-6, out["max_param_diff"]

        st = _run([VENV / "bin" / "trainstreamctl", "status", "--json"], cwd=work, env=env)
        status = json.loads(st.stdout)
        assert status["pid"] == out["pid"]
        assert status["socket_path"] == str(runtime / "trainstream" / "trainstreamd.sock")
        assert status["sessions"] == [], "the training process detached when it exited"
    finally:
        _run([VENV / "bin" / "trainstreamctl", "--socket", runtime / "trainstream" / "trainstreamd.sock",
              "shutdown"], check=False, env=env, timeout=30)


def test_a_different_torch_is_refused_at_import(venv, tmp_path):
    site = _site_packages(venv)
    info = site / "trainstream" / "_build_info.py"
    saved = info.read_text()
    try:
        info.write_text(saved.replace("TORCH_VERSION = ", 'TORCH_VERSION = "1.0.0"  # '))
        r = _run([venv, "-c", "import trainstream"], cwd=tmp_path, env=_clean_env(), check=False)
    finally:
        info.write_text(saved)
    assert r.returncode != 0
    import torch
    assert "ImportError: trainstream was built for torch 1.0.0" in r.stderr, r.stderr
    assert f"this environment runs torch {torch.__version__}" in r.stderr, r.stderr
    assert "--no-build-isolation --force-reinstall" in r.stderr, r.stderr


def test_an_isolated_build_stops_at_configure(venv, tmp_path):
    # pip's isolated build environment has scikit-build-core and pybind11 but no torch.
    r = _run([venv, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-v", "-w", tmp_path,
              f"-Cbuild-dir={tmp_path / 'iso'}", REPO], check=False, env=_clean_env(), timeout=600, cwd=tmp_path)
    text = r.stdout + r.stderr
    assert r.returncode != 0, text[-3000:]
    assert "torch is not importable" in text and "pip install --no-build-isolation ." in text, text[-3000:]
    assert "Building CXX object" not in text, "it must stop before compiling anything"


def test_uninstall_leaves_no_trainstream_file(venv):
    _run([venv, "-m", "pip", "uninstall", "-y", "trainstream"], env=_clean_env())
    left = [str(p) for p in VENV.rglob("*") if "trainstream" in p.name.lower() and p.name != PARENT_PTH]
    assert not left, f"pip uninstall left: {left}"
    assert not (VENV / "bin" / "trainstreamd").exists() and not (VENV / "bin" / "trainstreamctl").exists()
