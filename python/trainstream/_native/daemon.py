"""Finding the daemon, or starting one for this user (docs/design.md, "Process model")."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import Optional

from ..errors import DaemonError
from . import control as _control
from .runtime_check import explain_missing_library

_EMBEDDED_IDLE_EXIT_S = 300  # TRAINSTREAM_IDLE_EXIT_S overrides


def daemon_binary() -> Optional[str]:
    """The trainstreamd to start, first found of: $TRAINSTREAM_DAEMON (which must then be
    an executable file), the installed package's ``trainstream/bin``, the build tree
    beside this package (``build/python/trainstream`` -> ``build/bin``),
    $TRAINSTREAM_BUILD_DIR/bin, then PATH."""
    override = os.environ.get("TRAINSTREAM_DAEMON")
    if override:
        if os.path.isfile(override) and os.access(override, os.X_OK):
            return os.path.abspath(override)
        raise DaemonError(f"TRAINSTREAM_DAEMON={override!r} is not an executable file; set it to "
                          f"a trainstreamd binary, or unset it to use the installed one")
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../trainstream
    candidates = [os.path.join(package, "bin", "trainstreamd"),
                  os.path.join(package, "..", "..", "bin", "trainstreamd")]
    if os.environ.get("TRAINSTREAM_BUILD_DIR"):
        candidates.append(os.path.join(os.environ["TRAINSTREAM_BUILD_DIR"], "bin", "trainstreamd"))
    candidates.append(shutil.which("trainstreamd"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.abspath(c)
    return None


def connect(socket: Optional[str] = None, *, spawn: bool = True, timeout_s: float = 20.0):
    """A connected ``_control.Client``.

    ``socket`` (else $TRAINSTREAM_SOCKET, else the system or per-user default).
    When nothing answers at the per-user default, starts an embedded daemon
    there (it exits after being idle for 5 minutes). An explicit socket that
    does not answer is an error: that daemon is someone else's to start.

    A socket this user may not open raises ``trainstream._control.PermissionDenied``
    (a ``PermissionError`` and a ``TrainStreamError``) naming the socket's group to
    join, and a daemon that closes this user's connections at once (its
    max_connections_per_uid) ``ResourceExhausted``; no daemon is started then: one
    runs there, and an embedded one of our own would hide it.
    """
    c = _control()
    explicit = socket or os.environ.get("TRAINSTREAM_SOCKET")
    path = explicit or c.default_socket_path()
    try:  # (PermissionDenied and ResourceExhausted pass through: see above)
        return c.Client.connect(path, 2000)
    except c.Unavailable as e:
        if explicit or not spawn:
            raise DaemonError(
                f"no TrainStream daemon answers at {path} ({e}); start one with "
                f"`trainstreamd --socket {path}` or unset TRAINSTREAM_SOCKET") from None
    path = c.embedded_socket_path()
    if path != c.default_socket_path():
        try:
            return c.Client.connect(path, 2000)
        except c.Unavailable:
            pass
    return _spawn_embedded(c, path, timeout_s)


def connect_embedded(path: str, timeout_s: float = 20.0):
    """A connected ``_control.Client`` at the per-user embedded socket ``path``, starting
    a daemon there when none answers (a client whose embedded daemon died restarts it:
    docs/recovery.md)."""
    c = _control()
    try:
        return c.Client.connect(path, 500)
    except c.Unavailable:
        return _spawn_embedded(c, path, timeout_s)


def _spawn_embedded(c, path: str, timeout_s: float):
    binary = daemon_binary()
    if binary is None:
        raise DaemonError(
            "no TrainStream daemon is running and trainstreamd was not found (looked at "
            "$TRAINSTREAM_DAEMON, the installed package's bin/, the build tree, "
            "$TRAINSTREAM_BUILD_DIR/bin and PATH); `pip install --no-build-isolation .` installs it")
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    log_path = os.path.join(os.path.dirname(path), "trainstreamd.log")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [binary, "--foreground", "--socket", path, "--idle-exit",
             os.environ.get("TRAINSTREAM_IDLE_EXIT_S", str(_EMBEDDED_IDLE_EXIT_S))],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        try:
            return c.Client.connect(path, 500)
        except c.Unavailable:
            pass
        code = proc.poll()
        # A daemon another process started at the same moment wins the socket;
        # ours then exits, and the loop connects to theirs.
        if code is not None and code != 0 and time.monotonic() > deadline - timeout_s + 2:
            tail = _tail(log_path)
            hint = explain_missing_library(tail)  # the loader's "cannot open shared object file"
            raise DaemonError(f"the embedded trainstreamd ({binary}) exited with code {code}"
                              f"{': ' + hint if hint else ''}; its log: {log_path}\n{tail}")
        if time.monotonic() > deadline:
            raise DaemonError(f"the embedded trainstreamd did not answer at {path} within "
                              f"{timeout_s:.0f} s; its log: {log_path}\n{_tail(log_path)}")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _tail(path: str, n: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            return b"".join(f.readlines()[-n:]).decode(errors="replace")
    except OSError:
        return ""
