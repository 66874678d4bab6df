"""Shared pytest helpers: start the real trainstreamd on a temporary socket.

Fixtures (usable from any test in tests/python):

  daemon           a running daemon with default options (budget 1G, a fresh
                   shm dir under /dev/shm). Yields a `Daemon`: .socket, .proc,
                   .bin_dir, .shm_dir, .log_path, .ctl(*args), .client(),
                   .stop(). Teardown stops it cleanly (`trainstreamctl shutdown
                   --discard-state`; a SIGTERM would keep attached sessions'
                   state for a next daemon) and asserts exit code 0 and that
                   no segment file is left in its shm dir.
  daemon_factory   call it with extra trainstreamd flags to start more
                   (e.g. daemon_factory("--budget", "64M")); each is torn down
                   like `daemon`.
  build_dir        Path of $TRAINSTREAM_BUILD_DIR (default: <repo>/build, else an
                   installed package's directory, whose bin/ has the binaries).

The test-only torch extension `trainstream_testing` (tests/python/ext: the CPU
AdamW kernel and the daemon's engine on tensors) is built into <build>/testing,
outside the trainstream package; this file puts that directory on sys.path, so
tests `import trainstream_testing` and fail, never skip, when it is missing.

Readiness is detected by polling `trainstreamctl ping`, never by sleeping.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _build_dir() -> Path:
    """$TRAINSTREAM_BUILD_DIR, else <repo>/build; with neither built, an installed
    package (pip install .: its trainstream/bin holds the two binaries), so the tests
    run against what pip installed (scripts/gpu-install-check.sh)."""
    if os.environ.get("TRAINSTREAM_BUILD_DIR"):
        return Path(os.environ["TRAINSTREAM_BUILD_DIR"]).resolve()
    build = (REPO / "build").resolve()
    if not (build / "bin" / "trainstreamd").exists():
        import importlib.util
        spec = importlib.util.find_spec("trainstream")  # the package's location; nothing imported
        if spec is not None and spec.origin is not None:
            installed = Path(spec.origin).resolve().parent
            if (installed / "bin" / "trainstreamd").exists():
                return installed
    return build


sys.path.insert(0, str(_build_dir() / "testing"))  # trainstream_testing (see above)


NOBODY = 65534  # the unprivileged uid (and gid) the permission tests run clients as


def as_user(uid: int, gid: int | None = None):
    """A preexec_fn that drops a child to `uid` (and `gid`, default the same number),
    with no supplementary groups."""
    def drop():
        os.setgroups([])
        os.setgid(uid if gid is None else gid)
        os.setuid(uid)
    return drop


def wait_until(predicate, timeout: float, interval: float = 0.01, what: str = "condition"):
    """Polls `predicate` until it returns a truthy value; fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def pause_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOPs a process and returns once each of its threads has stopped (Note [A
    paused daemon is stopped in every thread])."""
    os.kill(pid, signal.SIGSTOP)

    def stopped():
        tasks = f"/proc/{pid}/task"
        states = []
        for tid in os.listdir(tasks):
            try:
                with open(f"{tasks}/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
        return bool(states) and all(s in ("T", "t") for s in states)
    wait_until(stopped, timeout, interval=0.001, what="every trainstreamd thread to stop")


class TestClient:
    """Drives build/bin/trainstream-test-client: one command per line, one JSON reply."""

    __test__ = False  # not a pytest test class

    def __init__(self, bin_dir: Path, socket: str, preexec_fn=None):
        self.proc = subprocess.Popen(
            [str(bin_dir / "trainstream-test-client"), "--socket", socket],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, bufsize=1, preexec_fn=preexec_fn)

    def send(self, command: str, timeout: float = 30.0) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise AssertionError(f"test client did not answer {command!r} within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"test client exited on {command!r}: {self.proc.stderr.read()}")
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()


class Daemon:
    def __init__(self, bin_dir: Path, extra_args=(), socket: str | None = None,
                 shm_dir: str | None = None):
        self.bin_dir = bin_dir
        self.tmp = tempfile.mkdtemp(prefix="tsd-")
        os.chmod(self.tmp, 0o755)  # so a client under another uid can reach the socket
        self.socket = socket or os.path.join(self.tmp, "trainstreamd.sock")
        self._own_shm = shm_dir is None
        self.shm_dir = shm_dir or tempfile.mkdtemp(prefix="tsd-shm-", dir="/dev/shm")
        self.log_path = os.path.join(self.tmp, "trainstreamd.log")
        self.args = [str(bin_dir / "trainstreamd"), "--foreground", "--socket", self.socket,
                     "--shm-dir", self.shm_dir, "--budget", "1G", "--log-level", "debug",
                     *extra_args]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT)
        self.clients: list[TestClient] = []

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def ctl(self, *args, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bin_dir / "trainstreamctl"), "--socket", self.socket, *args],
                              capture_output=True, text=True, timeout=timeout, **kw)

    def wait_ready(self, timeout: float = 30.0):
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"trainstreamd exited with {self.proc.returncode}:\n{self.log()}")
            return self.ctl("--timeout-ms", "200", "ping").returncode == 0
        wait_until(ready, timeout, interval=0.02, what="trainstreamd to answer ping")
        return self

    def client(self, preexec_fn=None) -> TestClient:
        c = TestClient(self.bin_dir, self.socket, preexec_fn)
        self.clients.append(c)
        return c

    def status(self) -> dict:
        r = self.ctl("status", "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    # Note [A paused daemon is stopped in every thread]
    # kill(SIGSTOP) returns before the daemon stops: one of its threads takes the
    # signal when next scheduled and only then stops the others. Measured on the
    # 2-core CPU machine, idle: in 299 of 300 tries some thread was still running
    # or sleeping right after kill() returned, for up to 26 ms; longer under load.
    # A worker woken meanwhile reads the command ring, so a gradient posted after
    # kill() may still be applied. pause() returns once every thread shows state
    # T (stopped) in /proc.
    def pause(self, timeout: float = 10.0) -> None:
        """SIGSTOPs the daemon and waits until each of its threads has stopped."""
        pause_process(self.proc.pid, timeout)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def segment_files(self) -> list[str]:
        return sorted(n for n in os.listdir(self.shm_dir) if n.startswith("trainstream-"))

    def stop(self, timeout: float = 15.0) -> int:
        """The clean stop: sessions ended, everything freed (Note [A restart keeps the
        optimizer state] in daemon/process/daemon.cc). SIGTERM where the daemon does not answer
        the request (a paused one is killed after `timeout`)."""
        if self.proc.poll() is None:
            r = self.ctl("--timeout-ms", "2000", "shutdown", "--discard-state", timeout=10)
            if r.returncode != 0 and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"trainstreamd did not stop within {timeout} s:\n{self.log()}") from None

    def cleanup(self):
        for c in self.clients:
            c.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        if self._own_shm:
            shutil.rmtree(self.shm_dir, ignore_errors=True)
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture
def build_dir() -> Path:
    d = _build_dir()
    if not (d / "bin" / "trainstreamd").exists():
        pytest.fail(f"{d}/bin/trainstreamd is missing: build first (make build) or set TRAINSTREAM_BUILD_DIR")
    return d


@pytest.fixture
def daemon_factory(build_dir):
    started: list[Daemon] = []

    def start(*extra_args, wait: bool = True, socket: str | None = None, shm_dir: str | None = None):
        d = Daemon(build_dir / "bin", extra_args, socket=socket, shm_dir=shm_dir)
        started.append(d)
        if wait:
            d.wait_ready()
        return d

    yield start
    failures = []
    for d in started:
        try:
            was_running = d.proc.poll() is None
            code = d.stop()
            if was_running and code != 0:
                failures.append(f"trainstreamd exited with {code} on a clean stop:\n{d.log()}")
            if was_running and d._own_shm and d.segment_files():
                failures.append(f"segments left in {d.shm_dir}: {d.segment_files()}")
        finally:
            d.cleanup()
    assert not failures, "\n".join(failures)


@pytest.fixture
def daemon(daemon_factory) -> Daemon:
    return daemon_factory()
