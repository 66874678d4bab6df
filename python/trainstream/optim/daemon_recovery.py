"""Resuming a DaemonBackend after its daemon died (docs/recovery.md): the mixin that
reconnects, takes what landed and posts again what did not. Split from
daemon_backend.py (which inherits it) to keep each module a readable size."""
from __future__ import annotations

from .._native.wire import OP_STEP_DONE
from ..errors import DaemonError
from .daemon_session import SessionLost


class RecoveryMixin:
    """DaemonBackend's recovery: ``_resumable`` runs a piece of work again after a
    recovery; ``_recover`` is one. Uses the backend's ``_table``, ``_session``,
    ``_replies_for`` and ``_post_grad``."""

    # Note [Resuming after the daemon died]
    # A daemon that dies leaves the optimizer state at a known point: each
    # parameter's last update either landed (the daemon committed it before its
    # PARAM_READY, or the next daemon finished it from the journal and the gradient
    # in the staging slot) or never touched the state (docs/recovery.md). So a
    # SessionLost anywhere below is answered by _recover(): reconnect (waiting for the
    # daemon at most timeout_s, in embedded mode starting it; once it found none, it
    # looks once: Note [A daemon gone for good]), resume with the recovery token, and
    # for each gradient of the pending step that had been posted: landed -> its
    # weights are copied in as a PARAM_READY would have done, and it is off the step's
    # pending set; not landed -> posted again (p.grad, or the grad slot, which still
    # holds it, for a paged weight and for a p.grad changed since). A STEP_END that had gone is sent
    # again; the new daemon counts the landed ones' norms into that step. Then the
    # interrupted operation goes on: each piece run through _resumable is safe to run
    # again (posting skips what is posted, _finish_step keeps its progress in
    # self._replies, exports and loads are whole again). What cannot be resumed
    # raises DaemonError naming the step.
    def _resumable(self, fn, *args):
        """Runs ``fn(*args)``, recovering from the daemon's death as often as it happens
        (a daemon may die again while the client resumes with it)."""
        while True:
            try:
                return fn(*args)
            except SessionLost:
                self._recover_until_resumed()

    def _recover_until_resumed(self) -> None:
        while True:
            try:
                return self._recover()
            except SessionLost:
                continue

    def _recover(self) -> None:
        t, session = self._table, self._session
        step = t.step_id + 1
        info = session.reconnect(step)
        applied = {p["param_id"]: p for reg in info["registrations"] for p in reg["params"]}
        missing = [e.name for e in t.entries.values()
                   if e.grad_slot is not None and e.param_id not in applied]
        if missing:
            raise self._unresumable(
                f"the TrainStream daemon came back without the state of {len(missing)} "
                f"parameter(s) ({', '.join(missing[:3])}): step {step} and the state after "
                f"step {step - 1} are lost; load_state_dict() of your last checkpoint is the "
                "way on")
        self._check_pools(info)
        r = self._replies_for(step)
        replayed = landed = 0
        plane = session.plane
        pooled = []
        for e in t.entries.values():
            if e.posted_step != step or e.param_id in r.rejected:
                continue  # (a rejected gradient is out of the step: step() reports it)
            a = applied[e.param_id]
            if a["applied_step"] == step:
                landed += 1
                if e.param_id not in r.ready and not a["skipped"]:
                    self._took_weight(e)  # as _take does for a PARAM_READY
                    if e.param.data_ptr() != e.param_slot.data_ptr():
                        plane.copy_param(e.param, e.param_slot)
                        e.mark_weight()
                # No PARAM_READY comes for it: taken, as land() or _finish_step would.
                r.ready.add(e.param_id)
                t.in_flight.pop(id(e.param), None)
            elif a["applied_step"] < step and e.pool is not None:
                replayed += 1
                pooled.append(e)  # reposted below, in position order
            elif a["applied_step"] < step:
                replayed += 1
                # A paged weight's gradient lives on only in its slot (accept_grad). So
                # does, as it was posted, one that a backward added to since (a backward
                # that raised while no daemon answered: Note [A daemon gone for good]);
                # step() then reports the change, as it would have with the daemon alive.
                g = e.posted_grad
                self._post_grad(e, g if g is not None and g._version == e.posted_version
                                else e.grad_slot, replay=True)
            else:
                raise self._unresumable(
                    f"the TrainStream daemon came back with {e.name} at step "
                    f"{a['applied_step']}, past this optimizer's step {step}")
        self._repost_pooled(pooled, step)
        if info["completed_step"] == step:  # its STEP_DONE went out and was lost
            r.result.update(opcode=OP_STEP_DONE, step=step, seq=0, param_id=0,
                            status=info["completed_status"],
                            grad_norm=info["completed_grad_norm"],
                            params_updated=info["completed_params_updated"], message="")
            r.end_sent = True
        else:
            r.end_sent = False
        t.stats["recoveries"] += 1
        t.stats["replayed_grads"] += replayed
        t.stats["landed_grads"] += landed
        t.stats["resume_s"] += info["seconds"]
        t.event("resumed after the daemon died", step=step, replayed=replayed, landed=landed,
                rolled_forward=info["rolled_forward"], seconds=round(info["seconds"], 3))

    def _unresumable(self, why: str) -> DaemonError:
        """The error for a daemon that came back with state this optimizer cannot take.
        The session stays over (Note [After the daemon is gone]): every later call raises
        the same error instead of training against state that is not this optimizer's."""
        self._session.mark_gone(why)
        return DaemonError(why)

    def _check_pools(self, info) -> None:
        """Every pool is where it was: the adopting daemon answers its registration's."""
        by_segment = {}
        for e in self._table.entries.values():
            if e.pool is not None:
                by_segment[e.pool.base] = e.pool
        granted = {(reg["grad_pool_offset"], reg["grad_pool_bytes"])
                   for reg in info["registrations"] if reg["grad_pool_bytes"]}
        for pool in by_segment.values():
            if (pool.offset, pool.capacity) not in granted:
                raise self._unresumable(
                    "the TrainStream daemon came back without this optimizer's gradient pool; "
                    "load_state_dict() of your last checkpoint is the way on")

    def _repost_pooled(self, entries, step: int) -> None:
        """Posts again the pooled gradients that did not land, each from the extent it was
        posted in (its bytes are still there: nothing past it was released), in position
        order, after telling each pool where its window starts (GradPool.resume)."""
        pools = {}
        for e in self._table.entries.values():
            if e.pool is not None:
                pools.setdefault(id(e.pool), (e.pool, []))
        for e in entries:
            pools[id(e.pool)][1].append(e.pool_pos)
        session = self._session
        for pool, positions in pools.values():
            with pool.lock:
                pool.resume(positions)
                for e in sorted((e for e in entries if e.pool is pool), key=lambda e: e.pool_pos):
                    g = self._table.param_groups[e.group]
                    e.posted_seq = session.data_plane(
                        session.plane.post_grad, e.param_id, e.grad_slot, e.grad_slot, step,
                        float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]),
                        float(g["eps"]), float(g["weight_decay"]), e.pool_pos, False)
                    e.posted_step = step
