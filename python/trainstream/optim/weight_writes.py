"""Weights written from outside the optimizer after wrap(): DaemonBackend's side of Note
[Weights written from outside the engine] (daemon/optimizer/include/trainstream/optimizer/
adamw_engine.h); docs/adamw.md, "Writing weights after wrap()", says what a user sees.
Split from daemon_backend.py (which inherits it) to keep each module a readable size."""
from __future__ import annotations

from typing import Iterable, List, Optional

import torch

from .backend import ParamEntry

# The most bytes of weights one round trip hands over (a larger weight goes alone): the
# scratch region grows to the largest batch and is kept for the session.
_BATCH_BYTES = 64 << 20


class WeightWritesMixin:
    """DaemonBackend's handling of written weights. Uses the backend's ``_table``,
    ``_session`` and ``_resumable``."""

    # Note [A written weight is found by its version counter]
    # A weight written in place must become its master's value before its next gradient
    # is applied, or the update starts from the old master (the daemon's engine says
    # why). Every in-place write through the parameter, a view or a detach() of it
    # (load_state_dict, torch.nn.init, copy_, mul_ under no_grad) bumps its version
    # counter, which costs nothing to read; the optimizer's own writes (a new weight
    # copied in, a state dict loaded) mark the version they leave (ParamEntry.
    # mark_weight). So before the first gradient of a step leaves, and before a state
    # dict is taken or loaded, every weight whose version moved is handed to the
    # daemon (DaemonSession.adopt_weights), which compares a resident weight with its
    # slot element by element and takes a paged one's slot whole. A write through
    # .data (p.data.copy_, p.data = t) bumps no counter: sync_weights_from_model()
    # hands weights over whether or not they moved. A weight written after backward
    # handed its gradient over (grad_post="backward": its update may be applied
    # already) cannot be taken for that update: step() raises, naming it.
    _weights_checked = 0  # the step whose weights were checked before its first gradient

    def sync_weights_from_model(self, params: Optional[Iterable[torch.Tensor]] = None) -> None:
        t = self._table
        t.require_between_steps("sync_weights_from_model()")
        self._resumable(self._adopt_weights, t.entries_of(params, "sync_weights_from_model()"),
                        True)

    def _adopt_written(self) -> None:
        """Before the first gradient of a step leaves: hands every written weight over."""
        step = self._table.step_id + 1
        if self._weights_checked != step:
            self._adopt_weights(list(self._table.entries.values()))
            self._weights_checked = step

    def _adopt_weights(self, entries: List[ParamEntry], every: bool = False) -> None:
        t, session = self._table, self._session
        session.require_attached()
        todo = [e for e in entries if every or e.weight_written()]
        if not todo:
            return
        # A group's one master takes local rank 0's weights, as at registration (the
        # ranks hold the same weights); the others' copies follow at the next update.
        if not t.in_group() or t.dp.leader:
            batch: List[ParamEntry] = []
            nbytes = 0
            for e in todo:
                size = e.param.numel() * e.param.element_size()
                if batch and nbytes + size > _BATCH_BYTES:
                    session.adopt_weights(batch)
                    batch, nbytes = [], 0
                batch.append(e)
                nbytes += size
            session.adopt_weights(batch)
        for e in todo:
            e.mark_weight()
        t.stats["weights_adopted"] += len(todo)
        t.event("weights adopted", params=len(todo), first=todo[0].name)

    def _took_weight(self, e: ParamEntry) -> None:
        """A PARAM_READY of ``e`` is taken: a write since its gradient left is noted for
        step() (the update did not start from it)."""
        if e.weight_written():
            e.weight_written_in_flight = True

    def _weights_before_step(self, step: int) -> None:
        """step(), before the gradients of ``step`` that backward did not hand over leave:
        raises when a weight whose gradient it did hand over was written since (Note [A
        written weight is found by its version counter]); the others' writes are taken."""
        entries = self._table.entries.values()
        for e in entries:
            if e.posted_step == step and (e.weight_written_in_flight or e.weight_written()):
                raise RuntimeError(
                    f"trainstream: the weight of {e.name} was written after backward had "
                    "handed its gradient over, so its update started from the weight as it "
                    "was. Write weights between step() and the next backward, or pass "
                    "grad_post='step' to wrap() (zero_grad() ends this step)")
        self._resumable(self._adopt_weights, [e for e in entries if e.posted_step != step])
