"""What a client without permission is told, where control-plane errors sit in the
exception hierarchy, client text in the log, what `status` shows other users, and
OffloadAdamW after the daemon died (docs/security.md)."""
import grp
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

import trainstream
import trainstream._control as control
from conftest import NOBODY, as_user, wait_until

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")


def ctl_as(d, uid, *args):
    return subprocess.run([str(d.bin_dir / "trainstreamctl"), "--socket", d.socket, *args],
                          capture_output=True, text=True, timeout=30,
                          preexec_fn=as_user(uid, uid))


# Imports trainstream's _daemon and _control without the package's __init__ (so
# without torch), then (with a uid) takes that uid as the effective one: the
# interpreter running the tests may sit where that uid cannot read, and
# connect() checks the effective ids.
PRELUDE = """
import os, sys, types
pkg = types.ModuleType("trainstream")
pkg.__path__ = [{pkg!r}]
sys.modules["trainstream"] = pkg
from trainstream import _control, errors
from trainstream._native import daemon as _daemon
uid = {uid!r}
if uid is not None:
    os.setgroups([])
    os.setegid(uid)
    os.seteuid(uid)
"""


def run_python_as(build_dir, uid, code, env=None):
    prelude = PRELUDE.format(pkg=str(build_dir / "python" / "trainstream"), uid=uid)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=60, env=env)


# -- (a) a socket this uid may not open ------------------------------------------

@needs_root
def test_socket_without_permission_names_its_group(daemon):
    # Mode 0660, root's group: nobody may not connect().
    r = ctl_as(daemon, NOBODY, "--timeout-ms", "5000", "ping")
    assert r.returncode == 4, (r.stdout, r.stderr)
    group = grp.getgrgid(os.stat(daemon.socket).st_gid).gr_name
    assert "exists, but uid 65534" in r.stderr and "may not connect" in r.stderr, r.stderr
    assert f"Join group '{group}'" in r.stderr and "TRAINSTREAM_SOCKET" in r.stderr, r.stderr
    assert "start it" not in r.stderr and "does not exist" not in r.stderr, r.stderr
    # A directory on the way that keeps nobody out is named instead.
    os.chmod(daemon.tmp, 0o700)
    r = ctl_as(daemon, NOBODY, "--timeout-ms", "5000", "ping")
    assert r.returncode == 4, (r.stdout, r.stderr)
    assert f"permission denied on the directory {daemon.tmp}" in r.stderr, r.stderr


@needs_root
def test_embedded_path_without_permission_starts_no_daemon(daemon_factory, build_dir):
    # nobody's embedded socket path holds a daemon nobody may not use: connect()
    # must say so, not start a second daemon beside it.
    runtime = Path(tempfile.mkdtemp(prefix="tsd-run-"))
    (runtime / "trainstream").mkdir()
    os.chmod(runtime, 0o755)
    os.chmod(runtime / "trainstream", 0o755)
    sock = runtime / "trainstream" / "trainstreamd.sock"
    d = daemon_factory(socket=str(sock))
    inode = os.stat(sock).st_ino
    env = {"PATH": os.environ["PATH"], "XDG_RUNTIME_DIR": str(runtime),
           "TRAINSTREAM_DAEMON": str(build_dir / "bin" / "trainstreamd")}
    r = run_python_as(build_dir, NOBODY, """
        try:
            _daemon.connect()
        except _control.PermissionDenied as e:
            assert isinstance(e, PermissionError) and isinstance(e, errors.TrainStreamError)
            print("PermissionDenied:", e)
    """, env=env)
    assert "PermissionDenied: trainstreamd's socket" in r.stdout, r.stdout + r.stderr
    assert "may not connect" in r.stdout and "Join group" in r.stdout, r.stdout
    assert os.stat(sock).st_ino == inode, "no embedded daemon replaced the socket"
    assert not (runtime / "trainstream" / "trainstreamd.log").exists(), "no daemon was started"
    assert d.ctl("ping").returncode == 0
    shutil.rmtree(runtime, ignore_errors=True)


# -- (b) control errors are TrainStreamErrors --------------------------------------

def test_control_errors_are_trainstream_errors_and_builtins():
    for name, builtin in [("PermissionDenied", PermissionError), ("ResourceExhausted", MemoryError),
                          ("InvalidArgument", ValueError), ("Unavailable", ConnectionError),
                          ("NotFound", LookupError), ("DeadlineExceeded", TimeoutError)]:
        cls = getattr(control, name)
        assert issubclass(cls, trainstream.TrainStreamError), name
        assert issubclass(cls, control.ControlError) and issubclass(cls, builtin), name
    assert issubclass(control.ControlError, RuntimeError)


def test_budget_refusal_is_caught_as_trainstream_error_and_memory_error(daemon_factory):
    d = daemon_factory("--budget", "64M")
    session = control.Client.connect(d.socket).attach(job="budget")
    for catch in (trainstream.TrainStreamError, MemoryError, control.ResourceExhausted):
        with pytest.raises(catch, match="budget"):
            session.allocate_region(1 << 30, "too-big")
    session.detach()


def test_control_loads_errors_but_not_torch(build_dir):
    r = run_python_as(build_dir, None, """
        assert issubclass(_control.PermissionDenied, errors.TrainStreamError)
        assert _control.PermissionDenied.__mro__[2] is errors.TrainStreamError
        print("torch" in sys.modules)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


# -- (c) client text in the log -----------------------------------------------------

FORGED = "2030-01-01T00:00:00.000 info trainstreamd[1]: session 99 ended"


def forged_lines(log):
    return [line for line in log.splitlines() if line.startswith(FORGED[:10])]


def test_job_name_with_control_characters_is_refused(daemon):
    client = control.Client.connect(daemon.socket)
    # (Invalid UTF-8 never leaves this client: protobuf refuses to serialize it.)
    for job in (f"x\n{FORGED}", "red\x1b[31m", "nul\x00", "c1\u009b2J"):
        with pytest.raises(control.InvalidArgument, match=r"attach.job: .*printable UTF-8"):
            client.attach(job=job)
    assert client.attach(job="plain-job ✓").id > 0
    assert forged_lines(daemon.log()) == []


def test_labels_and_base_paths_are_escaped_or_refused(daemon):
    session = control.Client.connect(daemon.socket).attach(job="labels")
    with pytest.raises(control.InvalidArgument, match="label: .*printable"):
        session.allocate_region(4096, f"l\n{FORGED}")
    with pytest.raises(trainstream.TrainStreamError):
        session.load_base(f"/nonexistent\n{FORGED}")
    log = daemon.log()
    assert forged_lines(log) == [], log
    assert "/nonexistent\\x0a2030-01-01" in log, log
    session.detach()


# -- (d) status shows other users' sessions to admins only ---------------------------

@needs_root
def test_status_shows_a_non_admin_only_their_own(daemon_factory):
    d = daemon_factory("--allow-group", grp.getgrgid(NOBODY).gr_name)
    os.chmod(d.socket, 0o666)
    os.chmod(d.shm_dir, 0o1777)
    mine = d.client()
    assert mine.send("attach root-secret-job 0")["ok"]
    assert mine.send("alloc 65536 root-label")["ok"]
    theirs = d.client(preexec_fn=as_user(NOBODY, NOBODY))
    a = theirs.send("attach nobody-job 0")
    assert a["ok"], a
    assert theirs.send("alloc 65536 nobody-label")["ok"]

    admin = d.status()
    assert {s["job"] for s in admin["sessions"]} == {"root-secret-job", "nobody-job"}
    r = ctl_as(d, NOBODY, "status", "--json")
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert [s["job"] for s in seen["sessions"]] == ["nobody-job"]
    assert {s["session_id"] for s in seen["segments"]} == {a["session_id"]}
    assert "root-secret-job" not in r.stdout and "root-label" not in r.stdout
    assert seen["budget"]["used"] == admin["budget"]["used"], "machine-wide totals stay"
    table = ctl_as(d, NOBODY, "status")
    assert table.returncode == 0 and "root-secret-job" not in table.stdout, table.stdout


# -- (e) OffloadAdamW after the daemon died ----------------------------------------

def _optimizer(d):
    # reconnect=False: the death is final here (waiting for a daemon to come back is
    # tests/python/test_recovery_resume.py's).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = trainstream.OffloadAdamW(model.parameters(), lr=1e-3, socket=d.socket, timeout_s=10.0,
                                   reconnect=False)
    return model, opt


def _backward(model):
    model(torch.randn(4, 8)).sum().backward()


def _kill(d):
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()


@pytest.mark.parametrize("killed", ["between backward and step", "before backward"])
def test_every_call_after_the_daemon_died_raises_daemon_error(daemon_factory, killed):
    d = daemon_factory()
    model, opt = _optimizer(d)
    _backward(model)
    opt.step()
    opt.zero_grad()
    if killed == "between backward and step":
        _backward(model)
        _kill(d)
        with pytest.raises(trainstream.DaemonError, match="daemon is gone"):
            opt.step()
    else:
        _kill(d)
        # The client learns of the death when its session stream ends (within
        # milliseconds); wait for that so the test does not race it.
        wait_until(lambda: not opt._session.alive()[0], 10, what="the client to see the death")
    # The next backward used to fail with "backward() reached ... 2 times".
    with pytest.raises(trainstream.DaemonError, match="daemon is gone.*load_state_dict"):
        _backward(model)
    for call in (opt.step, opt.zero_grad, opt.state_dict, opt.synchronize):
        with pytest.raises(trainstream.DaemonError, match="daemon is gone"):
            call()
    with pytest.raises(trainstream.DaemonError, match="daemon is gone"):
        _backward(model)
    opt.detach()  # still cleans up
