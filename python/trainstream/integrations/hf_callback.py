"""TrainStream's figures in Trainer's logs, and the end of a step a failed ``train()`` left.

    from trainstream.integrations.huggingface import TrainStreamCallback
    trainer = Trainer(model, args, optimizers=(offload_adamw, None),
                      callbacks=[TrainStreamCallback(offload_adamw)])

``TrainStreamTrainer`` does both itself. The figures (GiB, 2**30 bytes):

* ``ts_vram_alloc_gb``: device memory allocated now; ``ts_vram_peak_gb``: the highest
  since the previous log (0 on a CPU);
* ``ts_pinned_gb``: the staging memory the optimizer maps; ``ts_host_state_gb``: the
  optimizer state the daemon holds (``OffloadAdamW.state_bytes()``);
* ``ts_d2h_gb`` / ``ts_h2d_gb``: bytes copied to and from the daemon since the previous
  log (``trainstream.transfer_stats``).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from transformers import TrainerCallback

from ..api import pinned_stats, transfer_stats
from ..optim import OffloadAdamW

__all__ = ["TrainStreamCallback", "StepFigures", "end_abandoned_step"]

GIB = float(1 << 30)


def _offload_adamw(optimizer) -> Optional[OffloadAdamW]:
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    return inner if isinstance(inner, OffloadAdamW) else None


def end_abandoned_step(optimizer) -> None:
    """Ends a step that a ``train()`` which raised part way left pending (gradients
    posted to the daemon, backward passes counted). Trainer clears gradients with
    ``model.zero_grad()``, which the optimizer does not see, and calls it at the start
    of every ``train()`` (and of its retry with a smaller batch) just before
    ``on_train_begin``; there ``OffloadAdamW.zero_grad()`` ends that step, so the first
    step of the new run counts from zero."""
    opt = _offload_adamw(optimizer)
    if opt is not None and not opt.between_steps():
        opt.zero_grad(set_to_none=True)


class StepFigures:
    """The ``ts_*`` figures of one optimizer, each transfer and peak counted since the
    previous ``read()``."""

    def __init__(self):
        self._last: Dict[str, int] = {"bytes_d2h": 0, "bytes_h2d": 0}
        self._peak = 0

    def sample_peak(self, model=None) -> None:
        """After each optimizer step: the step's peak joins the running one. The memory
        controller (wrap()'s paging on a GPU) resets CUDA's peak before each forward to
        read the last step's; without it, this does."""
        if not torch.cuda.is_available():
            return
        self._peak = max(self._peak, torch.cuda.max_memory_allocated())
        session = getattr(model, "_trainstream_session", None)
        if getattr(session, "controller", None) is None:
            torch.cuda.reset_peak_memory_stats()

    def read(self, optimizer, model=None) -> Dict[str, float]:
        opt = _offload_adamw(optimizer)
        out = {"ts_vram_alloc_gb": 0.0, "ts_vram_peak_gb": 0.0}
        if torch.cuda.is_available():
            self.sample_peak(model)
            out["ts_vram_alloc_gb"] = torch.cuda.memory_allocated() / GIB
            out["ts_vram_peak_gb"] = self._peak / GIB
            self._peak = 0
        moved = transfer_stats(opt)
        out["ts_pinned_gb"] = pinned_stats(opt)["mapped_bytes"] / GIB
        out["ts_host_state_gb"] = (opt.state_bytes() if opt is not None
                                   and opt.optimizer_mode != "local" else 0) / GIB
        out["ts_d2h_gb"] = (moved["bytes_d2h"] - self._last["bytes_d2h"]) / GIB
        out["ts_h2d_gb"] = (moved["bytes_h2d"] - self._last["bytes_h2d"]) / GIB
        self._last = {k: moved[k] for k in self._last}
        return out


class TrainStreamCallback(TrainerCallback):
    """For a stock ``transformers.Trainer`` given an ``OffloadAdamW``: adds the ``ts_*``
    figures to each log (the ``logs`` the later callbacks see and ``state.log_history``;
    callbacks that ran before this one, such as the reporting integrations, log without
    them) and ends a step a failed ``train()`` left pending (``end_abandoned_step``)."""

    def __init__(self, optimizer):
        if _offload_adamw(optimizer) is None:
            raise ValueError(f"TrainStreamCallback(optimizer={type(optimizer).__name__}): "
                             "accepted: a trainstream OffloadAdamW (what wrap() returns)")
        self._optimizer = optimizer
        self._figures = StepFigures()

    def on_train_begin(self, args, state, control, **kwargs):
        end_abandoned_step(self._optimizer)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._figures.sample_peak(model)

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if logs is None:
            return
        figures = self._figures.read(self._optimizer, model)
        logs.update(figures)
        # Trainer appended {**logs, "step": ...} to the history just before on_log.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)
