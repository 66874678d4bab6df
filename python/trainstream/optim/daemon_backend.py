"""optimizer_mode="cpu": the daemon's AdamW, over the session's command ring.

The flow for one step (docs/design.md, "Optimizer plane"):

1. As each gradient becomes final during backward (a post-accumulate-grad hook),
   it is copied into its staging slot in shared memory and GRAD_READY is posted
   on the session's command ring (``grad_post="backward"``, the default); with
   ``grad_post="step"`` that happens in ``step()`` instead.
2. ``step()`` posts STEP_END; the daemon's workers update each parameter (at
   once for each gradient when no clipping is asked for, else after the global
   norm is known) and answer PARAM_READY.
3. The new weights are copied from the param slots back into the parameters.

Hyper-parameters travel with every GRAD_READY, so LR schedulers and edits of
``param_groups`` take effect on the next step, as with torch's optimizers. Weights
written in place since the last step become their masters' values before the first
gradient of a step leaves (weight_writes.py).

When the daemon dies, every entry point (backward's hooks, ``step()``,
``zero_grad()``, ``synchronize()``, ``state_dict()``, ``load_state_dict()``)
reconnects to the daemon that comes back, resumes the state it adopted and finishes
what it was doing: Note [Resuming after the daemon died].
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from .._native import C
from .._native.wire import (FIELD_PARAM_FROM_SLOT, OP_PARAM_READY, OP_STEP_DONE, STATUS_OK,
                            STATUS_SKIPPED_NONFINITE)
from ..errors import NonFiniteGradientError, TrainStreamError
from . import data_parallel
from .backend import DTYPE_NAMES, ParamEntry, ParamTable, begin_step
from .daemon_recovery import RecoveryMixin
from .daemon_session import DaemonSession, SessionLost
from .daemon_state import StateDictMixin
from .grad_pool import GradPool, grad_pool_bytes
from .weight_writes import WeightWritesMixin


@dataclass
class _StepReplies:
    """What the daemon has answered for the pending step: the PARAM_READYs taken (by
    ``land`` before step(), or by _finish_step), the gradients it rejected and the
    STEP_DONE (Note [Replies taken before step()])."""
    step: int
    ready: Set[int] = field(default_factory=set)  # param_ids whose PARAM_READY came
    result: Dict[str, Any] = field(default_factory=dict)  # the STEP_DONE completion
    rejected: Dict[int, Tuple[str, str]] = field(default_factory=dict)  # id -> (name, why)
    end_sent: bool = False


class DaemonBackend(RecoveryMixin, StateDictMixin, WeightWritesMixin):
    """The daemon's AdamW for one ``OffloadAdamW`` (see the module docstring).

    Exported as ``trainstream.GradientOffloader``: it is what posts each gradient to
    the daemon as backward makes it final (``grad_final``, ``accept_grad``). Built by
    ``OffloadAdamW.attach()``; not meant to be constructed by hand."""
    mode = "cpu"

    def __init__(self, table: ParamTable, session: DaemonSession):
        self._table = table
        self._session = session
        # The pending step's replies taken so far (by land(), or by a _finish_step that
        # was interrupted); None when none was.
        self._replies: Optional[_StepReplies] = None
        self._last_grad_norm: Optional[float] = None
        self._registrations = 0  # RegisterParameters calls that finished
        session.rejected_grad = self._rejected_grad
        # A group's ranks resume its one state together (docs/recovery.md, "Data
        # parallel"); ranks with copies of their own (replicated) resume like one process;
        # across machines, the all-reduce of a step in flight is not replayed.
        session.resumable = bool(table.options["reconnect"]) and not (
            table.dp is not None and table.dp.nnodes > 1)
        table.stats.update(recoveries=0, replayed_grads=0, landed_grads=0, resume_s=0.0,
                           grad_pool_bytes=0, pool_waits=0, pool_wait_s=0.0, weights_adopted=0)

    # ------------------------------------------------------------------ setup
    def register(self, entries: List[ParamEntry]) -> None:
        if not entries:
            return
        done = self._registrations
        while True:
            try:
                self._register(entries)
                break
            except SessionLost:
                # A registration that never finished is made again (its parameters
                # have no optimizer state yet); the ones before it are resumed.
                self._session.forget_regions_after(done)
                for e in entries:
                    e.grad_slot = e.param_slot = e.sum_slot = e.pool = None
                self._recover_until_resumed()
        self._registrations += 1

    def _register(self, entries: List[ParamEntry]) -> None:
        t, session = self._table, self._session
        opts = t.options
        groups = [dict(lr=float(g["lr"]), beta1=float(g["betas"][0]), beta2=float(g["betas"][1]),
                       eps=float(g["eps"]), weight_decay=float(g["weight_decay"]))
                  for g in t.param_groups]
        specs = [dict(param_id=e.param_id, name=e.name, shape=list(e.param.shape) or [1],
                      dtype=DTYPE_NAMES[e.param.dtype], grad_dtype=DTYPE_NAMES[e.param.dtype],
                      group=e.group) for e in entries]
        moment = "float32" if opts["moment_dtype"] == "auto" else opts["moment_dtype"]
        checksum = data_parallel.weights_checksum([(e.name, e.param) for e in entries]) \
            if t.dp is not None else ""
        if t.dp is not None:
            t.dp.check_same_weights(checksum)
        pool_ask = grad_pool_bytes((e.param.numel() * e.param.element_size() for e in entries),
                                   opts["grad_pool"], opts["max_grad_norm"], t.dp is not None)
        staging, slots = session.register_parameters(
            groups, specs, moment, float(opts["max_grad_norm"] or 0.0), int(opts["seed"]),
            checksum, int(opts["threads"] or 0), pool_ask)
        session.map_staging(staging, any(e.param.is_cuda for e in entries))
        c = C()
        granted = slots[0]["grad_pool_bytes"] if slots else 0
        pool = GradPool(staging.base_address, slots[0]["grad_pool_offset"], granted) \
            if granted else None  # an old daemon (or a group) answers 0: gradient slots
        t.stats["grad_pool_bytes"] += granted
        for s in slots:
            e = t.by_id[s["param_id"]]
            name = DTYPE_NAMES[e.param.dtype]
            e.pool = pool
            e.grad_slot = pool.view(0, s["numel"], name) if pool else c.tensor_from_address(
                staging.base_address + s["grad_offset"], [s["numel"]], name)
            e.param_slot = c.tensor_from_address(staging.base_address + s["param_offset"],
                                                 [s["numel"]], name)
            if t.in_group():
                e.sum_slot = c.tensor_from_address(staging.base_address + s["sum_offset"],
                                                   [s["numel"]], "float32")
        # A group's masters come from local rank 0's weights (the daemon checked
        # every rank's checksum against them); the param slot is the group's one, and
        # the other ranks' sync below ends only once local rank 0 has written it (a
        # paged weight reads its slot from the first forward on): Note [A member waits
        # for the first weights] (optimizer_plane.cc).
        writes_slots = not t.in_group() or t.dp.leader
        if writes_slots:
            with torch.no_grad():
                for s in slots:
                    e = t.by_id[s["param_id"]]
                    e.param_slot.copy_(e.param.detach().reshape(-1))
            # Every slot is written before the daemon initialises the masters from them.
            for s in slots:
                session.post_state(True, s["param_id"], FIELD_PARAM_FROM_SLOT, 0, 0, 0, 0)
        session.sync()
        for s in slots:  # the masters are these weights
            t.by_id[s["param_id"]].mark_weight()

    def close(self) -> None:
        for e in self._table.entries.values():
            e.grad_slot = e.param_slot = e.pool = None
            e.posted_step = 0
        self._replies = None

    # -------------------------------------------------------------- data plane
    def check_alive(self, in_backward: bool = False) -> None:
        self._resumable(self._session.ensure_alive, in_backward)

    def grad_final(self, e: ParamEntry) -> None:
        self._resumable(self._session.ensure_alive, True)
        if self._table.count_backward(e):
            self._resumable(self._post_unless_posted, e, None)
            self._mark_in_flight(e)

    def _post_unless_posted(self, e: ParamEntry, grad: Optional[torch.Tensor]) -> None:
        # A recovery between the two re-posts what was posted (Note [Resuming ...]).
        if e.posted_step != self._table.step_id + 1:
            self._post_grad(e, grad)

    def accept_grad(self, e: ParamEntry, grad: torch.Tensor) -> bool:
        self._resumable(self._session.ensure_alive, True)
        final = self._table.count_backward(e)
        e.external = True
        # The same sum AccumulateGrad computes for p.grad.
        e.external_grad = grad if e.external_grad is None else e.external_grad + grad
        if final:
            self._resumable(self._post_unless_posted, e, e.external_grad)
            self._mark_in_flight(e)
            e.external_grad = None
            # Nothing reads it again (p.grad never held it, so step() has no change to
            # check) and the copy keeps its memory until done: held here, every paged
            # block's gradient would stay on the device until step().
            e.posted_grad = None
        return True

    def _post_grad(self, e: ParamEntry, grad: Optional[torch.Tensor] = None,
                   replay: bool = False) -> None:
        t = self._table
        if not replay:
            self._adopt_written()  # Note [A written weight is found by its version counter]
        g = t.param_groups[e.group]
        grad = p_grad = e.param.grad if grad is None else grad
        if grad.is_sparse:
            raise RuntimeError("OffloadAdamW does not support sparse gradients")
        if grad.dtype != e.grad_slot.dtype:
            grad = grad.to(e.grad_slot.dtype)
        step = t.step_id + 1
        hp = (float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]), float(g["eps"]),
              float(g["weight_decay"]))
        if e.pool is not None:
            e.posted_seq = self._post_pooled(e, grad, step, hp)
        else:
            e.posted_seq = self._session.data_plane(
                self._session.plane.post_grad, e.param_id, grad, e.grad_slot, step, *hp)
        e.posted_step = step
        if replay and p_grad is e.grad_slot:
            return  # a paged weight's: nothing of it is kept (accept_grad)
        e.posted_grad = p_grad
        e.posted_version = p_grad._version
        if replay:
            return
        t.stats["grads_posted"] += 1
        t.stats["bytes_d2h"] += grad.numel() * grad.element_size()

    def _post_pooled(self, e: ParamEntry, grad: torch.Tensor, step: int, hp) -> int:
        """Copies ``grad`` into a free extent of its pool (waiting for room) and posts it;
        extents leave in claim order (the pool's lock)."""
        pool, session, t = e.pool, self._session, self._table
        nbytes = grad.numel() * grad.element_size()
        waits, wait_s = pool.waits, pool.wait_s
        with pool.lock:
            try:
                pos = pool.place(nbytes, session.ensure_alive, float(t.options["timeout_s"]))
            finally:
                t.stats["pool_waits"] += pool.waits - waits
                t.stats["pool_wait_s"] += pool.wait_s - wait_s
            slot = pool.view(pos, grad.numel(), DTYPE_NAMES[grad.dtype])
            seq = session.data_plane(session.plane.post_grad, e.param_id, grad, slot, step, *hp,
                                     pos, True)
            pool.taken(pos, nbytes)
        e.grad_slot, e.pool_pos = slot, pos
        return seq

    def lands_early(self) -> bool:
        """Whether the daemon can update a weight whose gradient backward posted before
        step() ends: in eager mode (no clipping, whose updates wait for StepEnd), except
        on local rank 0 of a group spanning machines, whose own step() all-reduces the
        sums the updates wait for (its other ranks can see them land any time)."""
        t = self._table
        if not t.posts_in_backward() or t.options["max_grad_norm"] is not None:
            return False
        return not (t.in_group() and t.dp.nnodes > 1 and t.dp.leader)

    def _mark_in_flight(self, e: ParamEntry) -> None:
        if self.lands_early():
            self._table.in_flight[id(e.param)] = e

    def _rejected_grad(self, c) -> Optional[ParamEntry]:
        """The parameter whose gradient, posted for the pending step, the ERROR ``c``
        rejects; None when ``c`` rejects something else (matched by the command's seq:
        the daemon reports other errors with param_id 0, which is a parameter too)."""
        e = self._table.by_id.get(c["param_id"])
        if e is None or e.posted_step != self._table.step_id + 1 or c["step"] != e.posted_step \
                or c["seq"] != e.posted_seq:
            return None
        return e

    # ------------------------------------------------------------------ step
    def step(self, closure):
        t = self._table
        # Every ask whether the daemon lives is resumable: one outside _resumable lost
        # a step to a daemon killed between two asks (the CI kill loop, step 36).
        loss, step = begin_step(t, lambda: self._resumable(self._session.require_attached),
                                closure)
        if t.replicated():
            # A paged weight's gradient is its external one (p.grad never holds it).
            grads = (e.external_grad if e.external else e.param.grad
                     for e in t.entries.values())
            t.dp.average_gradients([g for g in grads if g is not None])
        for e in t.entries.values():
            if e.posted_step == step and not e.external:
                t.check_unchanged(e)
        self._weights_before_step(step)
        posted = self._resumable(self._post_rest, step)
        t0 = time.monotonic()
        result = self._resumable(self._finish_step, step, posted, t0)
        norm = result.get("grad_norm", float("nan"))
        self._last_grad_norm = norm if norm >= 0 else None
        if result.get("rejected"):
            t.stats["steps"] += 1
            names = [name for name, _ in result["rejected"]]
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise TrainStreamError(
                f"step {step}: the daemon rejected the gradient of {len(names)} parameter(s) "
                f"({shown}): {result['rejected'][0][1]}. Those were not updated; the other "
                f"{len(posted) - len(names)} were. The step is over: training can go on once "
                "the cause is fixed")
        if result["status"] == STATUS_SKIPPED_NONFINITE:
            t.stats["skipped_steps"] += 1
            raise NonFiniteGradientError(
                f"step {step} was not applied: {result['message'] or 'a gradient held NaN or Inf'}")
        if result["status"] != STATUS_OK:
            raise TrainStreamError(f"step {step} failed in the daemon: {result['message']}")
        t.stats["steps"] += 1
        return loss

    def _post_rest(self, step: int) -> List[ParamEntry]:
        """Posts every gradient of ``step`` not posted in backward; returns all of the
        step's. Safe to run again after a recovery (what is posted is skipped)."""
        posted = []
        for e in self._table.entries.values():
            if e.posted_step == step:
                posted.append(e)
            elif e.external_grad is not None:
                self._post_grad(e, e.external_grad)
                e.external_grad = None
                posted.append(e)
            elif e.param.grad is not None:
                self._post_grad(e)
                posted.append(e)
        return posted

    # Note [A rejected gradient ends its step]
    # The daemon's engine leaves a gradient it rejects (a bad hyperparameter, an update
    # still in flight) out of the step and answers ERROR; the step then completes with
    # the others when StepEnd arrives. So the client takes the rejected parameter off
    # the step's pending set, waits for the rest as usual, clears every pending count
    # and only then raises: the step is over in both places, and the next iteration
    # starts clean. (Raising at the ERROR left the others' replies queued and the step
    # half-ended: its StepEnd was sent, so zero_grad() could not end it again.) A
    # rejection is matched by its command's seq, since the daemon reports other errors
    # (a second StepEnd) with param_id 0, which is also a parameter's id. The client
    # checks every group's hyperparameters before the first gradient of a step leaves
    # and again in step() (ParamTable.check_groups), so a scheduler's bad value raises
    # ValueError before the daemon sees any of the step; the daemon's own check remains
    # for the rest. A wait interrupted part way (Ctrl-C) leaves self._replies, so the
    # next step() or zero_grad() sends no second StepEnd and waits only for what is
    # missing.
    #
    # Note [Replies taken before step()]
    # In eager mode the daemon answers PARAM_READY for each parameter as soon as its
    # update is written, during backward. ParamReadyHooks (param_ready.py) may take some
    # of those before step(), through land(): a read of a weight between backward and
    # step() waits for its update. land() and _finish_step share one _StepReplies per
    # step and apply a reply the same way (_take: the new weight is copied in, once), so
    # _finish_step waits only for what neither has taken, and a rejection land() took
    # is still reported by step(). land() keeps no reply for later (keep=()): every one
    # it reads is applied or recorded here, so none is applied twice.
    def _replies_for(self, step: int) -> _StepReplies:
        r = self._replies
        if r is None or r.step != step:
            r = self._replies = _StepReplies(step)
        return r

    def _take(self, c, r: _StepReplies) -> Optional[int]:
        """Applies one reply of step ``r.step``: a PARAM_READY copies the new weight into
        the parameter (a paged weight's home is its param slot: nothing to copy) and
        returns its param_id; a STEP_DONE is recorded. Anything else: None."""
        op = c["opcode"]
        if op == OP_STEP_DONE and c["step"] == r.step:
            r.result.update(c)
            return None
        if op != OP_PARAM_READY or c["step"] != r.step:
            return None
        t = self._table
        e = t.by_id[c["param_id"]]
        if e.param_id not in r.ready:
            self._took_weight(e)
            if e.param.data_ptr() != e.param_slot.data_ptr():
                self._session.plane.copy_param(e.param, e.param_slot)
                e.mark_weight()
                t.stats["bytes_h2d"] += e.param_slot.numel() * e.param_slot.element_size()
            r.ready.add(e.param_id)
        t.in_flight.pop(id(e.param), None)
        return e.param_id

    def land(self, entries: List[ParamEntry]) -> None:
        """Waits for the PARAM_READY of each of ``entries`` whose update is in flight and
        copies the new weight in, as _finish_step would; every other reply of the step
        read meanwhile is applied too (Note [Replies taken before step()]). A gradient
        the daemon rejected meanwhile stops the wait for it; step() reports it. A daemon
        that dies meanwhile is recovered from (Note [Resuming after the daemon died]) and
        the wait goes on for what is still in flight."""
        self._resumable(self._land, entries)

    def _land(self, entries: List[ParamEntry]) -> None:
        t = self._table
        waiting = {e.param_id for e in entries if id(e.param) in t.in_flight}
        if not waiting:
            return
        r = self._replies_for(t.step_id + 1)

        def want(c):
            waiting.discard(self._take(c, r))
            return not waiting

        def on_error(c):
            e = self._rejected_grad(c)
            if e is None:
                return False
            r.rejected[e.param_id] = (e.name, c["message"])
            t.in_flight.pop(id(e.param), None)
            waiting.discard(e.param_id)
            return True
        self._session.wait(want, on_error=on_error)

    def _finish_step(self, step: int, posted: List[ParamEntry], t0: float) -> Dict[str, Any]:
        """Ends ``step`` in the daemon with the gradients in ``posted``, copies each new
        weight in as it is ready, and clears every parameter's pending state. Returns the
        step's completion (status, grad_norm, message, and "rejected": (name, why) for
        each gradient the daemon left out). Interrupted (Ctrl-C, a timeout), a later call
        for the same step goes on where this one stopped: the step end is sent once, and
        the replies already taken (here or by land()) are not waited for again."""
        t, session = self._table, self._session
        plane = session.plane
        r = self._replies_for(step)
        missing = {e.param_id for e in posted} - r.ready - r.rejected.keys()

        def on_completion(c):
            missing.discard(self._take(c, r))
        if not r.end_sent:
            if t.in_group() and t.dp.nnodes > 1 and t.dp.leader:
                session.data_plane(t.dp.reduce_machine_sums, session.wait,
                                   plane.post_grad_reduced, step, posted, on_completion)
            session.data_plane(plane.post_step_end, step, len(posted))
            r.end_sent = True

        def want(c):
            on_completion(c)
            return "opcode" in r.result and not missing

        def on_error(c):
            # A gradient the daemon rejected is not part of the step: the step ends with
            # the others, which step() reports (Note [A rejected gradient ends its step]).
            e = self._rejected_grad(c)
            if e is None or e.param_id not in missing:
                return False
            missing.discard(e.param_id)
            r.rejected[e.param_id] = (e.name, c["message"])
            return True
        if not ("opcode" in r.result and not missing):  # (an interrupted wait took it all)
            session.wait(want, on_error=on_error)
        self._replies = None
        t.stats["step_wait_s"] += time.monotonic() - t0
        t.clear_pending()
        t.step_id = step
        result = r.result
        if r.rejected:
            result["rejected"] = list(r.rejected.values())
        return result

    def before_zero_grad(self) -> None:
        """Called with a step pending that will not come (a backward or step() raised
        part way), it ends that step first: the daemon holds the gradients already
        handed to it (and, without clipping, has applied them: an eager update cannot
        be undone), so the step is ended with those, their new weights copied back, and
        every pending count cleared, so that the next iteration starts clean."""
        t = self._table
        self._resumable(self._session.ensure_alive)
        if t.dp is not None or t.between_steps():
            return
        step = t.step_id + 1
        posted = [e for e in t.entries.values() if e.posted_step == step]
        if not posted:
            t.clear_pending()
            return
        result = self._resumable(self._finish_step, step, posted, time.monotonic())
        rejected = [name for name, _ in result.get("rejected", [])]
        t.event("abandoned step", step=step, params_applied=len(posted) - len(rejected),
                rejected=rejected)

    def synchronize(self) -> None:
        self._resumable(self._session.sync)

    def last_grad_norm(self) -> Optional[float]:
        return self._last_grad_norm

    # ------------------------------------------------------------------ report
    def regions(self) -> List[Dict[str, Any]]:
        return self._session.regions()

    def stats(self) -> Dict[str, Any]:
        return {}
