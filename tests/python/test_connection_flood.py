"""A connection flood must not wedge the daemon (docs/security.md): one uid is
capped at max_connections_per_uid, running out of fds neither spins the accept
loop nor floods the log, and the sessions already attached keep being served.
Note [Accepting under a connection flood] (daemon/transport/control_listener.h).

The flood comes from another uid (as a runaway user's would), so these run as
root like test_daemon_permissions.py."""
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from conftest import NOBODY, as_user, wait_until


pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to flood from another uid")

def open_socket(d):
    os.chmod(d.socket, 0o666)


class Flood:
    """A forked child of this process, as `uid`, holding `n` connections to the
    daemon that never say anything, until stop(). (Forked, not exec'd: the
    interpreter running the tests may not be readable by that uid.)"""

    def __init__(self, d, n, uid=NOBODY):
        ready_r, ready_w = os.pipe()
        self._stop_r, self._stop_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns
            code = 1
            try:
                os.close(ready_r)
                os.close(self._stop_w)
                resource.setrlimit(resource.RLIMIT_NOFILE, (n + 64, n + 64))
                as_user(uid)()
                held, failed = [], 0
                for _ in range(n):
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.setblocking(False)
                    try:
                        s.connect(d.socket)
                        held.append(s)
                    except OSError:
                        failed += 1
                        s.close()
                os.write(ready_w, f"{len(held)} {failed}\n".encode())
                os.read(self._stop_r, 1)
                code = 0
            finally:
                os._exit(code)
        os.close(ready_w)
        os.close(self._stop_r)
        self.connected = os.read(ready_r, 64).decode().split()
        os.close(ready_r)
        assert self.connected, "the flooding child failed"

    def stop(self):
        os.close(self._stop_w)
        os.waitpid(self.pid, 0)


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def open_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def ctl_as(d, uid, *args):
    return subprocess.run([str(d.bin_dir / "trainstreamctl"), "--socket", d.socket, *args],
                          capture_output=True, text=True, timeout=30, preexec_fn=as_user(uid))


def watch(d, seconds, during=lambda: None):
    """The daemon's CPU seconds over `seconds` of wall time, calling `during` meanwhile."""
    cpu0, t0 = cpu_seconds(d.proc.pid), time.monotonic()
    while time.monotonic() - t0 < seconds:
        during()
        time.sleep(0.1)
    return cpu_seconds(d.proc.pid) - cpu0


def test_open_file_limit_is_raised_to_the_hard_limit(daemon):
    soft, hard = resource.prlimit(daemon.proc.pid, resource.RLIMIT_NOFILE)
    assert soft == hard
    assert "open-file limit" in daemon.log()


def test_flood_from_one_uid_is_capped_and_everyone_else_is_served(daemon_factory):
    d = daemon_factory("--max-connections-per-uid", "16")
    open_socket(d)
    c = d.client()
    assert c.send("attach before-the-flood 0")["ok"]
    fds_before = open_fds(d.proc.pid)
    log_before = os.path.getsize(d.log_path)
    flood = Flood(d, 1140)
    try:
        pings = []
        cpu = watch(d, 2.0, lambda: pings.append(d.ctl("--timeout-ms", "2000", "ping").returncode))
        assert pings and all(rc == 0 for rc in pings), pings
        assert cpu < 0.3, f"the daemon used {cpu:.2f} s of CPU in 2 s of flood"
        assert open_fds(d.proc.pid) <= fds_before + 16 + 4, "the cap holds the flood's fds"
        # The existing session goes on, a new one from another uid attaches.
        assert c.send("alloc 65536")["ok"]
        assert d.client().send("attach during-the-flood 0")["ok"]
        # The flooding uid is told why its next connection closes (RESOURCE_EXHAUSTED:
        # a daemon runs, so nobody should start one).
        r = ctl_as(d, NOBODY, "--timeout-ms", "1000", "ping")
        assert r.returncode == 1 and "RESOURCE_EXHAUSTED" in r.stderr, (r.stdout, r.stderr)
        assert "closed it at once" in r.stderr and "max_connections_per_uid" in r.stderr, r.stderr
    finally:
        flood.stop()
    grown = os.path.getsize(d.log_path) - log_before
    assert grown < 16384, f"the log grew by {grown} bytes during the flood"
    log = d.log()
    assert "already holds 16 connections (max_connections_per_uid = 16)" in log
    assert log.count("closed a connection from uid 65534") <= 8, "refusals are rate limited"
    # Once gRPC has closed the flood's connections they no longer count.
    wait_until(lambda: ctl_as(d, NOBODY, "--timeout-ms", "1000", "ping").returncode == 4, 20,
               interval=0.2, what="the flooding uid to be answered again (PERMISSION_DENIED)")
    assert d.client().send("attach after-the-flood 0")["ok"]


def test_out_of_fds_does_not_spin_and_existing_sessions_go_on(daemon_factory):
    d = daemon_factory("--max-connections-per-uid", "0")
    open_socket(d)
    c = d.client()
    assert c.send("attach before-the-flood 0")["ok"]
    # A lowered limit stands in for 1,140 connections against 1,024 fds.
    limit = open_fds(d.proc.pid) + 24
    resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (limit, limit))
    log_before = os.path.getsize(d.log_path)
    flood = Flood(d, 400)
    try:
        wait_until(lambda: "Too many open files" in d.log()[log_before:], 20, interval=0.05,
                   what="the daemon to run out of fds")
        cpu = watch(d, 2.0, lambda: None)
        assert cpu < 0.3, f"the daemon used {cpu:.2f} s of CPU in 2 s at its fd limit"
        # The session's own connection needs no new fd: it is still served.
        assert c.send("ping")["ok"]
        assert c.send("status")["ok"]
        # A new client is refused quickly, and not told that no daemon runs.
        t0 = time.monotonic()
        r = d.ctl("--timeout-ms", "1000", "ping")
        assert r.returncode != 0 and time.monotonic() - t0 < 10, (r.stdout, r.stderr)
        assert "does not exist" not in r.stderr and "stale" not in r.stderr, r.stderr
    finally:
        flood.stop()
    grown = os.path.getsize(d.log_path) - log_before
    assert grown < 16384, f"the log grew by {grown} bytes at the fd limit"
    assert d.log().count("Too many open files") <= 5, "out-of-fd lines are rate limited"
    wait_until(lambda: d.ctl("--timeout-ms", "1000", "ping").returncode == 0, 20, interval=0.2,
               what="ping once the flood closed")
    after = d.client()
    assert after.send("attach after-the-flood 0")["ok"]
    assert after.send("alloc 65536")["ok"]
    assert c.send("alloc 65536")["ok"]


def test_a_uid_over_its_cap_is_told_and_starts_no_daemon(daemon_factory, build_dir):
    runtime = Path(tempfile.mkdtemp(prefix="tsd-run-"))
    try:
        sock = runtime / "trainstream" / "trainstreamd.sock"
        d = daemon_factory("--max-connections-per-uid", "1", socket=str(sock))
        held = d.client()
        assert held.send("attach holds-the-one 0")["ok"]
        env = {"PATH": os.environ["PATH"], "XDG_RUNTIME_DIR": str(runtime),
               "PYTHONPATH": str(build_dir / "python"),
               "TRAINSTREAM_DAEMON": str(build_dir / "bin" / "trainstreamd")}
        # The embedded path is where this daemon runs: connect() must not start another.
        r = subprocess.run([sys.executable, "-c", textwrap.dedent("""
            import sys, types
            pkg = types.ModuleType("trainstream")  # no torch needed for this
            pkg.__path__ = [sys.argv[1]]
            sys.modules["trainstream"] = pkg
            from trainstream import _control
            from trainstream._native import daemon as _daemon
            try:
                _daemon.connect()
            except _control.ResourceExhausted as e:
                print("ResourceExhausted:", e)
        """), str(build_dir / "python" / "trainstream")], capture_output=True, text=True,
            timeout=60, env=env)
        assert "ResourceExhausted: cannot reach trainstreamd" in r.stdout, r.stdout + r.stderr
        assert "max_connections_per_uid" in r.stdout, r.stdout
        assert not (sock.parent / "trainstreamd.log").exists(), "no embedded daemon was started"
        held.close()
        wait_until(lambda: d.ctl("--timeout-ms", "1000", "ping").returncode == 0, 20, interval=0.2,
                   what="the uid's one connection to be free again")
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
