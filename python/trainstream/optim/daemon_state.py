"""A DaemonBackend's state_dict() and load_state_dict(): the mixin that moves each
parameter's master, moments and step between the daemon and torch's format. Split from
daemon_backend.py (which inherits it) to keep each module a readable size."""
from __future__ import annotations

from typing import Any, Dict

import torch

from .._native.wire import (FIELD_EXP_AVG, FIELD_EXP_AVG_SQ, FIELD_MASTER, FIELD_STEP,
                            OP_STATE_DONE, STATUS_OK)
from ..errors import TrainStreamError
from .backend import ParamEntry, pack_groups, unpack_state
from .daemon_session import STEP_REPLIES


class StateDictMixin:
    """DaemonBackend's state dict. Uses the backend's ``_table``, ``_session``,
    ``_resumable`` and ``_adopt_weights``.

    A state dict is taken with every weight written since the optimizer last wrote it
    taken as its master first (Note [A written weight is found by its version counter]),
    so a checkpoint holds what the next step would start from. Loading one sets each
    saved parameter's master, moments and step, and its weight, which the daemon writes
    from the master into the param slot, is copied into the parameter: after
    ``load_state_dict`` the model holds the saved weights whatever it held before, and
    a ``model.load_state_dict`` of the same checkpoint before or after it changes no
    master (equal weights are not written ones, Note [Weights written from outside the
    engine])."""

    def _export_step(self, e: ParamEntry) -> int:
        seq_box = {}
        self._session.post_state(False, e.param_id, FIELD_STEP, 0, 0, 0, 0)

        def want(c):
            if c["opcode"] == OP_STATE_DONE and c["param_id"] == e.param_id:
                if c["status"] != STATUS_OK:
                    raise TrainStreamError(f"exporting the step of {e.name}: {c['message']}")
                seq_box["step"] = c["step"]
                return True
            return False
        self._session.wait(want, keep=STEP_REPLIES)
        return int(seq_box["step"])

    def state_dict(self) -> Dict[str, Any]:
        return self._resumable(self._state_dict)

    def _state_dict(self) -> Dict[str, Any]:
        self._session.require_attached()
        if self._table.between_steps():  # (mid-step, the step's first gradient took them)
            self._adopt_weights(list(self._table.entries.values()))
        groups, order = pack_groups(self._table.param_groups)
        state = {}
        for e in self._table.entries.values():
            step = self._export_step(e)
            if step == 0:
                continue
            dtype = e.param.dtype
            m, v, w = self._session.move_fields(False, e, [FIELD_EXP_AVG, FIELD_EXP_AVG_SQ,
                                                           FIELD_MASTER])
            state[order[id(e.param)]] = {
                "step": torch.tensor(float(step), dtype=torch.float32),
                "exp_avg": m.to(dtype),
                "exp_avg_sq": v.to(dtype),
                "master_weight": w,
            }
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._resumable(self._load_state_dict, state_dict)

    def _load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        session = self._session
        session.require_attached()
        loaded = list(unpack_state(self._table, state_dict))
        # The weights the state dict leaves alone keep what was written to them.
        saved = {id(e) for e, _ in loaded}
        self._adopt_weights([e for e in self._table.entries.values() if id(e) not in saved])
        for e, s in loaded:
            master = s.get("master_weight", e.param.detach())
            session.move_fields(True, e, [FIELD_MASTER, FIELD_EXP_AVG, FIELD_EXP_AVG_SQ],
                                [master, s["exp_avg"], s["exp_avg_sq"]])
            step = s["step"]
            step = int(step.item() if torch.is_tensor(step) else step)
            session.post_state(True, e.param_id, FIELD_STEP, 0, 0, 0, step)
        session.sync()
        for e, _ in loaded:  # the saved weights, as the daemon wrote them from the masters
            if e.param.data_ptr() != e.param_slot.data_ptr():
                session.plane.copy_param(e.param, e.param_slot)
            e.mark_weight()
