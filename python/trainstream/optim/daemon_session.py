"""One attach to the daemon: the control-plane session, the data plane over its rings,
the regions it maps and the waits on its completions.

Both offloading backends run over one (daemon_backend.py posts gradients on its
command ring; zero_copy.py keeps the moments in its regions). A ``DaemonSession``
turns every way the daemon can go away into the same ``DaemonError`` (Note [After
the daemon is gone]).
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from .._native import C, control
from .._native import daemon as _daemon
from .._native.host_memory import track
from .._native.pinning import register_fresh
from .._native.wire import OP_ERROR, OP_GROUP_BROKEN, OP_PARAM_READY, OP_STATE_DONE
from .._native.wire import FIELD_WEIGHTS, OP_STEP_DONE, OP_SYNC_DONE, STATUS_OK
from ..errors import DaemonError, TrainStreamError
from .backend import DTYPE_NAMES, ParamEntry, ParamTable
from .daemon_reconnect import ReconnectMixin

STEP_REPLIES = (OP_PARAM_READY, OP_STEP_DONE)  # what a step() waits for


class SessionLost(DaemonError):
    """The daemon died, and this session may resume its state with the daemon that
    comes back (docs/recovery.md): ``DaemonBackend`` catches it, reconnects and goes
    on. Whoever does not catch it sees the ``DaemonError`` it is."""


class DaemonSession(ReconnectMixin):
    """Caller owns it; ``close()`` ends the session (the daemon frees its memory). The
    slot tensors of a registration view its regions: they must not outlive it."""

    def __init__(self, table: ParamTable):
        self._table = table
        self._client = None
        self._session = None
        self._plane = None  # _C.DataPlane over the session's control segment (``plane``)
        self._regions: List[Any] = []  # mappings the slot tensors view; kept alive
        self._registered: List[int] = []  # their base addresses registered with CUDA
        self._scratch = None
        self._backlog: List[Dict[str, Any]] = []  # completions kept for a later wait
        # Note [After the daemon is gone]: why, once it is; None while it answers.
        self._daemon_gone: Optional[str] = None
        # Note [A daemon gone for good]: the error of the last reconnection that found no
        # daemon within timeout_s (the next call tries again); None otherwise.
        self._unanswered: Optional[str] = None
        self._probed_step = 0  # the step whose backward last asked the session if it lives
        # The parameter whose pending gradient an ERROR rejects (daemon_backend.py).
        self.rejected_grad: Callable[[Dict[str, Any]], Optional[ParamEntry]] = lambda c: None
        # Recovery (docs/recovery.md): set by a backend whose state the daemon keeps
        # in state segments (DaemonBackend), with the reconnect option on.
        self.resumable = False
        self._recovery_token = b""
        self._socket_path: Optional[str] = None
        self._embedded = False  # the socket is the per-user one this client may start
        self._attach_args: tuple = ()
        self.recoveries: List[Dict[str, Any]] = []  # one per resume: what it found, how long

    # ------------------------------------------------------------ lifetime
    def open(self) -> None:
        """Connects to the daemon (starting one if needed) and attaches."""
        opts = self._table.options
        self._client = _daemon.connect(opts["socket"])
        rank = int(os.environ.get("RANK", -1))
        local_rank = int(os.environ.get("LOCAL_RANK", -1))
        job = opts["job"] or os.environ.get("TORCHELASTIC_RUN_ID") or f"pid{os.getpid()}"
        group = self._table.dp.membership() if self._table.in_group() else None
        self._attach_args = (job, rank, local_rank, group)
        self._session = self.call(self._client.attach, job, rank, local_rank, group)
        self._recovery_token = self._session.recovery_token
        self._socket_path = self._client.socket_path
        self._embedded = not (opts["socket"] or os.environ.get("TRAINSTREAM_SOCKET")) and \
            self._socket_path == control().embedded_socket_path()
        self._open_plane()

    def _open_plane(self) -> None:
        control_region = self._session.control
        self._plane = C().DataPlane(control_region.address, control_region.size,
                                    int(self._table.options["timeout_s"] * 1000))

    def close(self) -> None:
        for addr in self._registered:
            C().unregister_host(addr)
        self._registered.clear()
        self._backlog = []  # the old session's replies
        self._daemon_gone = None
        self._unanswered = None
        self._probed_step = 0
        self._recovery_token = b""  # a detached optimizer has nothing to resume
        self._plane = None
        self._scratch = None
        self._regions.clear()
        if self._session is not None:
            self._session.detach()
        self._session = None
        self._client = None

    @property
    def id(self) -> Optional[int]:
        return self._session.id if self._session is not None else None

    @property
    def backlog(self) -> List[Dict[str, Any]]:
        """Completions read while waiting for others, kept for a later wait."""
        return list(self._backlog)

    def alive(self):
        """(alive, why) as the daemon's session stream last said; (False, why) with no
        session (the daemon gone: Note [A daemon gone for good])."""
        if self._session is None:
            return False, self._daemon_gone or self._unanswered or "no session"
        return self._session.alive()

    @property
    def plane(self):
        """The ``_C.DataPlane`` over the session's control segment. Without one it raises
        what every entry point raises then (Note [A daemon gone for good]): the
        DaemonError of a daemon that is gone, SessionLost while a reconnection is owed
        (a caller inside the recovery tries it), or that the optimizer is detached."""
        if self._plane is None:
            self._no_session()
        return self._plane

    def _attached(self):
        """The control-plane session (``_control.Session``); without one, raises as
        ``plane`` does."""
        if self._session is None:
            self._no_session()
        return self._session

    def _no_session(self):
        self.require_attached()  # raises unless a reconnection is half way (then below)
        raise SessionLost("a reconnection to the TrainStream daemon did not finish")

    @property
    def gone_reason(self) -> Optional[str]:
        """The DaemonError's message while the daemon is gone (Note [A daemon gone for
        good]); None while it answers or when detached."""
        return self._daemon_gone or self._unanswered

    # ------------------------------------------------------------ regions
    def allocate_region(self, nbytes: int, purpose: str):
        """A shared-memory region of ``nbytes`` in the session (the daemon's budget)."""
        return self.call(self._attached().allocate_region, nbytes, purpose)

    def register_parameters(self, *args):
        """RegisterParameters; the staging region it returns is mapped for this session's
        lifetime (``map_staging``). A group's registration hands every rank the group's
        recovery token, which replaces the session's."""
        out = self.call(self._attached().register_parameters, *args)
        self._recovery_token = self._session.recovery_token
        return out

    def map_staging(self, staging, cuda: bool) -> None:
        """Keeps a staging region mapped and, for CUDA parameters, registers it."""
        self._regions.append(staging)
        track(staging, staging.segment_size, "staging")
        if cuda and C().with_cuda:
            ok, why = register_fresh(staging.base_address, staging.segment_size)
            if ok:
                self._registered.append(staging.base_address)
            elif self._table.options["verbose"]:
                print(f"trainstream: cudaHostRegister of the staging segment failed ({why}); "
                      "copies will be pageable and slower")

    def register_regions_with_cuda(self) -> None:
        """Registers every staging region not yet registered (weight paging copies from
        the param slots on a CUDA device even when the parameters were on the host)."""
        for r in self._regions:
            if r.base_address not in self._registered:
                ok, _ = C().register_host(r.base_address, r.segment_size, False)
                if ok:
                    self._registered.append(r.base_address)

    def regions(self) -> List[Dict[str, Any]]:
        return [{"purpose": "staging", "address": r.base_address, "bytes": r.segment_size,
                 "registered": r.base_address in self._registered} for r in self._regions]

    def scratch_region(self, numel: int):
        """A region of at least ``4 * numel`` bytes for moving state (reused)."""
        need = max(4 * numel, 4096)
        if self._scratch is None or self._scratch.size < need:
            if self._scratch is not None:
                self.call(self._attached().free_region, self._scratch.region_id)
            self._scratch = self.allocate_region(need, "state-transfer")
        return self._scratch

    # ------------------------------------------------------------ the daemon's answer
    def call(self, fn, *args):
        """Runs a control-plane call, turning an unreachable daemon into DaemonError."""
        c = control()
        try:
            return fn(*args)
        except c.Unavailable as e:
            if self._session is not None:  # it answered this session before
                raise self.gone(str(e)) from None
            raise DaemonError(f"the TrainStream daemon is unreachable: {e}") from None

    def data_plane(self, fn, *args):
        """Runs a data-plane call, turning a closed ring into DaemonError."""
        try:
            return fn(*args)
        except C().DaemonGone as e:
            raise self.gone(str(e)) from None

    def post_state(self, *args) -> int:
        """Posts a state command (DataPlane.post_state's arguments). A ring that fills
        because the daemon died raises DaemonError (SessionLost when the state may be
        resumed), as a gradient's post does, rather than the ring's own error."""
        return self.data_plane(self.plane.post_state, *args)

    # Note [After the daemon is gone]
    # Once the daemon has died (or ended the session), nothing this optimizer holds
    # there comes back, so every later call raises the same DaemonError, saying so and
    # what to do: the gradient hook (which would otherwise count a second backward of
    # the step that never ended and raise "backward() reached ... 2 times"),
    # step(), zero_grad(), synchronize(), state_dict() and load_state_dict(). Each of
    # those asks the session whether it lives (a pybind call; the hook only at the
    # first gradient of a step), so once the client has seen the session's stream end
    # (milliseconds after a death) even the first backward raises, before a gradient
    # is posted into a ring nobody reads. A backward that runs before that posts as
    # usual, and the step() after it raises. detach() clears the state: attach() then
    # starts a fresh session.
    #
    # Note [A daemon gone for good]
    # A daemon that died and did not come back within timeout_s leaves the state in
    # /dev/shm for the next daemon on the socket to adopt, however late it starts, so
    # the reconnection's DaemonError (naming the socket, the step in flight and what to
    # do) does not end the session: the session keeps its mappings, its recovery token
    # and the step's pending state, and has no control session and no plane. Every
    # later call then raises the same DaemonError, never an error of the missing plane:
    # each entry point (backward's hooks, the forward's ParamReadyHooks waiting for an
    # update in flight, step(), zero_grad(), synchronize(), state_dict(),
    # load_state_dict(), adding a parameter group) reaches ensure_alive() or the
    # ``plane`` property, which raise SessionLost, and the recovery around it looks for
    # a daemon once: nothing accepting on the socket raises the error again at once
    # (the first call waited timeout_s; a loop that goes on should not wait that at
    # every call), something accepting is reconnected to as before (at most timeout_s),
    # and in embedded mode the client tries once to start one. A daemon that came back
    # is resumed (Note [Resuming after the daemon died]) and the call goes on. A call
    # that raised changed nothing the resume reads: a forward's hooks raise before the
    # module runs and zero_grad() before it clears a gradient; a backward's hook raises
    # once autograd has added that one gradient to p.grad, and a gradient posted
    # before is posted again as it was posted (from its slot, _recover) while step()
    # reports the change, as it would have with the daemon alive. stats(),
    # memory_report() and unwrap() ask the daemon nothing and do not raise; unwrap()
    # (detach()) gives the state up. A daemon that came back and cannot take the state
    # ends the session for good (mark_gone, the branches of reconnect()).
    def can_resume(self) -> bool:
        """Whether the session ended because the daemon died (not a clean shutdown, not
        the daemon ending it) and its state may be resumed (docs/recovery.md)."""
        return (self.resumable and bool(self._recovery_token) and self._session is not None
                and self._session.end_kind in ("daemon_gone", "none"))

    def gone(self, why: str) -> DaemonError:
        """Records that the daemon is gone and returns the DaemonError to raise
        (a SessionLost when the state may be resumed)."""
        if self.can_resume():
            return SessionLost(f"the TrainStream daemon died ({why}); reconnecting")
        if self._daemon_gone is None:
            self._daemon_gone = (
                f"this optimizer's session with the TrainStream daemon at {self._socket_path} "
                f"is over: the daemon is gone or ended it ({why}), and the optimizer state it "
                "held (master weights, moments) is lost. Start a daemon again if none runs "
                "(trainstreamd, or let trainstream.wrap() start one), then build a new optimizer "
                "and load_state_dict() from your last checkpoint, or call detach() and attach() "
                "to go on from the current weights with fresh moments")
        return DaemonError(self._daemon_gone)

    def mark_gone(self, why: str) -> None:
        """Ends this optimizer's use of the session with ``why`` (a daemon that came back
        with state it cannot take): every later call raises DaemonError(why)."""
        self._daemon_gone = why

    def ensure_alive(self, in_backward: bool = False) -> None:
        """Raises DaemonError when the daemon is known to be gone, asking the session
        first (in backward, only at the first gradient of a step: Note [After the
        daemon is gone])."""
        if self._daemon_gone is not None:
            raise DaemonError(self._daemon_gone)
        if self._session is None:
            if self._reconnection_unfinished():
                # Note [A daemon gone for good]: the recovery around the caller tries again.
                raise SessionLost(self._unanswered
                                  or "a reconnection to the TrainStream daemon did not finish")
            return
        if in_backward:
            step = self._table.step_id + 1
            if self._probed_step == step:
                return
            self._probed_step = step
        alive, why = self._session.alive()
        if alive and not (self._plane is not None and self._plane.closing):
            return
        # What the daemon said last (a data-parallel group's end, say) goes first:
        # wait reads what is left on the ring, then finds the session over.
        if self._plane is not None:
            self.wait(lambda c: False, keep=STEP_REPLIES)
        raise self.gone(why or "the session is closed")

    def _reconnection_unfinished(self) -> bool:
        """A reconnection raised part way (a daemon killed again while it resumed): the
        next call tries again (SessionLost); the optimizer is not detached."""
        return self._session is None and self.resumable and bool(self._recovery_token)

    def require_attached(self) -> None:
        # Without a plane: a reconnection that could not resume (ensure_alive raises its
        # DaemonError) or that did not finish (SessionLost), else a detach.
        if self._plane is None and self._daemon_gone is None \
                and not self._reconnection_unfinished():
            raise TrainStreamError("OffloadAdamW is detached; call attach() first")
        self.ensure_alive()

    def _check_alive(self, waited_s: float) -> None:
        alive, why = self._session.alive()
        if not alive or self._plane.closing:
            raise self.gone(f"it ended this session: {why or 'closed'}")
        timeout = self._table.options["timeout_s"]
        if waited_s > timeout:
            raise DaemonError(f"no answer from the TrainStream daemon for {waited_s:.0f} s "
                              f"(timeout_s={timeout})")

    def wait(self, want, keep=(), on_error=None) -> None:
        """Polls completions, handing each to ``want(c)`` until it returns True. One that
        ``want`` passes over with an opcode in ``keep`` is kept for a later wait (a step's
        PARAM_READY arriving while synchronize() or state_dict() waits for its own);
        kept ones are offered first. A rejected command (ERROR) goes to ``on_error(c)``;
        when that returns True (the caller takes it), ``want(c)`` then says whether the
        wait is over (the error may have been the last thing awaited); otherwise it
        raises, except that a rejected gradient of the pending step is kept for step()
        when ``keep`` holds step replies."""
        def offer(c) -> bool:
            op = c["opcode"]
            if op == OP_ERROR:
                if on_error is not None and on_error(c):
                    return bool(want(c))
                if OP_PARAM_READY in keep and self.rejected_grad(c) is not None:
                    self._backlog.append(c)
                    return False
                raise TrainStreamError(f"the daemon rejected a command: {c['message']}")
            if op == OP_GROUP_BROKEN:
                dp = self._table.dp
                who = dp.describe() if dp is not None else "data-parallel group"
                raise DaemonError(f"{who} cannot continue: {c['message']}; the daemon has ended "
                                  "the group (restart every rank of the job)")
            if want(c):
                return True
            if op in keep:
                self._backlog.append(c)
            return False

        kept, self._backlog = self._backlog, []
        for i, c in enumerate(kept):
            try:
                done = offer(c)
            except BaseException:
                self._backlog += kept[i + 1:]
                raise
            if done:
                self._backlog += kept[i + 1:]
                return
        start = time.monotonic()
        while True:
            c = self.data_plane(self.plane.poll, 100)
            if c is None:
                self._check_alive(time.monotonic() - start)
                continue
            if offer(c):
                return

    # ------------------------------------------------------------ regions after a resume
    def forget_regions_after(self, count: int) -> None:
        """Drops the staging mappings of registrations after the first ``count`` (one
        that a daemon's death interrupted: it is made again)."""
        del self._regions[count:]

    @property
    def region_count(self) -> int:
        return len(self._regions)

    def sync(self) -> None:
        """Waits until the daemon has done every command posted so far."""
        self.require_attached()
        seq = self.data_plane(self.plane.post_sync)
        errors = []

        def want(c):
            if c["opcode"] == OP_STATE_DONE and c["status"] != STATUS_OK:
                errors.append(c["message"])
            return c["opcode"] == OP_SYNC_DONE and c["seq"] == seq
        self.wait(want, keep=STEP_REPLIES)
        if errors:
            raise TrainStreamError("the daemon could not apply optimizer state: " + "; ".join(errors))

    def move_fields(self, load: bool, e: ParamEntry, fields: List[int],
                    data: Optional[List[torch.Tensor]] = None) -> Optional[List[torch.Tensor]]:
        """Moves whole fp32 state arrays of ``e`` through the scratch region: all of
        ``fields`` in one round trip to the daemon."""
        n = e.param.numel()
        region = self.scratch_region(n * len(fields))
        view = C().tensor_from_address(region.address, [len(fields), n], "float32")
        if load:
            for i, t in enumerate(data):
                view[i].copy_(t.reshape(-1).to(torch.float32))
        for i, field_id in enumerate(fields):
            self.post_state(load, e.param_id, field_id, region.region_id, 4 * n * i, 4 * n, 0)
        self.sync()
        return None if load else [view[i].clone().view(e.param.shape) for i in range(len(fields))]

    def adopt_weights(self, entries: List[ParamEntry]) -> None:
        """Hands the weights of ``entries`` to the daemon as their masters' values (Note
        [Weights written from outside the engine]), in one round trip: a resident
        weight's values through the scratch region, a paged weight's in its slot, its
        home, where they were written."""
        resident = [e for e in entries if e.param.data_ptr() != e.param_slot.data_ptr()]
        offsets, total = {}, 0
        for e in resident:
            offsets[e.param_id] = total
            total += -(-e.param.numel() * e.param.element_size() // 64) * 64
        region = self.scratch_region(-(-total // 4)) if resident else None
        c = C()
        with torch.no_grad():
            for e in resident:
                view = c.tensor_from_address(region.address + offsets[e.param_id],
                                             [e.param.numel()], DTYPE_NAMES[e.param.dtype])
                view.copy_(e.param.detach().reshape(-1))
        for e in entries:
            if e.param_id in offsets:
                self.post_state(True, e.param_id, FIELD_WEIGHTS, region.region_id,
                                offsets[e.param_id], e.param.numel() * e.param.element_size(), 0)
            else:
                self.post_state(True, e.param_id, FIELD_WEIGHTS, 0, 0, 0, 0)
        self.sync()
