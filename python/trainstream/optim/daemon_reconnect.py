"""Finding the daemon again after it died (docs/recovery.md, "Re-attaching"): the half
of a DaemonSession that waits for a daemon at its socket (in embedded mode starts one)
and attaches to it with the recovery token. Split from daemon_session.py (which
inherits it) to keep each module a readable size."""
from __future__ import annotations

import socket as _socket
import time
from typing import Any, Dict

from .._native import control
from .._native import daemon as _daemon
from ..errors import DaemonError


class ReconnectMixin:
    """DaemonSession's reconnection. Uses the session's ``_table``, ``_plane``,
    ``_session``, ``_client``, ``_socket_path``, ``_embedded``, ``_attach_args``,
    ``_recovery_token``, ``_regions``, ``_backlog``, ``_scratch``, ``_probed_step``,
    ``recoveries``, ``_open_plane``, ``_daemon_gone`` and ``_unanswered`` (Note [A
    daemon gone for good], daemon_session.py)."""

    def _wait_for_socket(self, deadline: float) -> None:
        """Until something accepts on the socket (a daemon bound it), or the deadline; a
        raw connect costs microseconds, where a gRPC channel to a missing socket backs
        off for a second. In embedded mode, starting the daemon is this client's job."""
        delay = 0.002
        while time.monotonic() < deadline:
            if self._accepts() or self._embedded:  # (embedded: connect() below starts one)
                return
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _accepts(self) -> bool:
        """Whether something accepts a connection on the socket now."""
        probe = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            probe.connect(self._socket_path)
            return True
        except OSError:
            return False
        finally:
            probe.close()

    def reconnect(self, pending_step: int) -> Dict[str, Any]:
        """After the daemon died (SessionLost): waits, at most ``timeout_s``, for a
        daemon at the same socket (in embedded mode starts one, as the first attach
        did), attaches with the recovery token and returns what it resumed
        (``_control.Session.resumed``), with ``seconds`` added. The staging mappings,
        and every slot tensor viewing them, stay: the daemon adopted those files.
        Raises DaemonError naming ``pending_step`` when the state cannot be resumed.
        After a reconnection that found no daemon it looks once, not for ``timeout_s``
        (Note [A daemon gone for good]): nothing accepting on the socket raises that
        error again at once; in embedded mode it tries to start a daemon once."""
        c = control()
        opts = self._table.options
        t0 = time.monotonic()
        again = self._unanswered is not None
        if again and not self._embedded and not self._accepts():
            raise DaemonError(self._unanswered)
        deadline = t0 + (0.0 if again and self._embedded else float(opts["timeout_s"]))
        if self._plane is not None:
            try:
                self._plane.flush()  # the gradient copies in flight land in their slots
            except Exception:  # noqa: BLE001 (a dead ring: nothing more to post)
                pass
        self._plane = None
        if self._session is not None:
            self._session.detach()
        self._session = None
        self._client = None
        self._backlog = []
        self._scratch = None  # the dead daemon's region: not this one's
        self._probed_step = 0
        lost_step = (f"step {pending_step} (in flight when the daemon died) and the optimizer "
                     f"state after step {pending_step - 1}")
        last, tries = "nothing answered", 0
        while True:
            if tries and time.monotonic() > deadline:
                # Not the end of the session: Note [A daemon gone for good].
                self._unanswered = self._unanswered_error(lost_step, last)
                raise DaemonError(self._unanswered)
            tries += 1
            self._wait_for_socket(deadline)
            try:
                left = max(1.0, deadline - time.monotonic())
                client = _daemon.connect_embedded(self._socket_path, left) if self._embedded \
                    else _daemon.connect(self._socket_path, spawn=False, timeout_s=left)
                session = client.attach(*self._attach_args, self._recovery_token)
                break
            except (c.NotFound, c.FailedPrecondition) as e:
                self._daemon_gone = (
                    f"the TrainStream daemon died and the one that came back at "
                    f"{self._socket_path} could not resume this optimizer's state ({e}): "
                    f"{lost_step} are lost. load_state_dict() of your last checkpoint is the way "
                    "on (or detach() and attach() to go on from the current weights with fresh "
                    "moments)")
                raise DaemonError(self._daemon_gone) from None
            except (DaemonError, c.Unavailable, c.ResourceExhausted, c.DeadlineExceeded,
                    c.Internal) as e:
                # (A daemon killed again while it answers Attach ends the call with
                # UNKNOWN or INTERNAL: the next one may be the one that stays.)
                last = str(e)
                time.sleep(0.02)
        self._client, self._session = client, session
        self._daemon_gone = self._unanswered = None
        self._open_plane()
        resumed = dict(session.resumed)
        mine = [r.segment_name for r in self._regions]
        theirs = [r["segment_name"] for r in resumed["registrations"]]
        if theirs != mine:
            self._daemon_gone = (
                f"the TrainStream daemon came back with {len(theirs)} registrations of this "
                f"optimizer where it had {len(mine)} ({theirs} against {mine}): {lost_step} "
                "cannot be resumed; load_state_dict() of your last checkpoint is the way on")
            raise DaemonError(self._daemon_gone)
        resumed["seconds"] = time.monotonic() - t0
        self.recoveries.append({k: v for k, v in resumed.items() if k != "registrations"})
        return resumed

    def _unanswered_error(self, lost_step: str, last: str) -> str:
        path, timeout = self._socket_path, self._table.options["timeout_s"]
        if self._embedded:
            start = ("this client starts that daemon itself: once one can start (the reason "
                     "in parentheses says why none did), the next call starts it and resumes")
        else:
            start = (f"start one there (`trainstreamd --socket {path}`, or `systemctl start "
                     "trainstreamd` for the system's) and call again: the daemon adopts the state "
                     "and the call resumes it")
        return (f"the TrainStream daemon at {path} died and none answered there within "
                f"timeout_s={timeout} ({last}): {lost_step} are lost unless a daemon starts "
                f"there again. To go on, {start}; until one answers, every later call of this "
                "optimizer looks for one once and raises this error. Else load_state_dict() of "
                "your last checkpoint is the way on")
