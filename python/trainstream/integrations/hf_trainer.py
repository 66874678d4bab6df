"""``TrainStreamTrainer``: ``transformers.Trainer`` with its AdamW in the TrainStream daemon.

    from trainstream.integrations.huggingface import TrainStreamTrainer
    trainer = TrainStreamTrainer(model=model, args=args, train_dataset=ds)   # was: Trainer(...)

Trainer builds its usual AdamW (decay and no-decay groups, ``learning_rate``,
``adam_beta1/2``, ``adam_epsilon``, ``weight_decay``), then ``trainstream.wrap()``
moves it to the daemon with ``max_grad_norm`` and ``gradient_accumulation_steps``
taken from the ``TrainingArguments``. What Trainer does that this class changes, and
why: docs/huggingface-trainer.md.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch
from transformers import Trainer, TrainerCallback

from ..optim import OffloadAdamW
from ..api import wrap

__all__ = ["TrainStreamTrainer"]

_ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")
# Options Trainer's own arguments decide; given twice they could disagree.
_FROM_ARGS = {"max_grad_norm": "max_grad_norm", "accumulation_steps": "gradient_accumulation_steps",
              "lr": "learning_rate"}
# Weight paging needs the model left on the CPU for wrap() to place; Trainer and
# accelerate put all of it on the device first.
_PAGING_OPTIONS = ("device", "param_offload", "activation_offload", "recompute", "vram_limit")


class _ReportGradNorm(TrainerCallback):
    """Fills the trainer's grad-norm tensor with the daemon's figure once a step is done
    (Trainer reads it with ``.item()`` only when it logs, after the step)."""

    def __init__(self, trainer: "TrainStreamTrainer"):
        self._trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._trainer._report_grad_norm()


class TrainStreamTrainer(Trainer):
    """``transformers.Trainer`` whose optimizer is ``OffloadAdamW`` (``trainstream.wrap``).

    ``trainstream_options``: further ``wrap()`` options (README, "Options"), for
    example ``{"moment_dtype": "bf16", "threads": 8}``. Not accepted there: what the
    ``TrainingArguments`` already say (``max_grad_norm``,
    ``gradient_accumulation_steps``, ``learning_rate``) and, in this version, the
    weight and activation paging options (use ``wrap()`` directly for those).
    """

    def __init__(self, *args, trainstream_options: Optional[Dict[str, Any]] = None, **kwargs):
        options = dict(trainstream_options or {})
        for key, arg in _FROM_ARGS.items():
            if key in options:
                raise ValueError(f"trainstream_options[{key!r}]: set TrainingArguments.{arg} "
                                 "instead; TrainStreamTrainer passes it to wrap()")
        paging = [k for k in _PAGING_OPTIONS if k in options]
        if paging:
            raise ValueError(f"trainstream_options {paging}: TrainStreamTrainer does not page "
                             "weights or activations yet (Trainer places the whole model on the "
                             "device first); use trainstream.wrap() directly for that")
        optimizer, scheduler = kwargs.get("optimizers") or (None, None)
        if isinstance(optimizer, OffloadAdamW):
            raise ValueError("optimizers=(OffloadAdamW, ...): pass the torch AdamW; "
                             "TrainStreamTrainer moves it to the daemon itself, with the "
                             "TrainingArguments' max_grad_norm and accumulation")
        if optimizer is not None and not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
            raise ValueError(f"optimizers=({type(optimizer).__name__}, ...): TrainStreamTrainer "
                             "runs AdamW in the daemon; accepted: torch.optim.AdamW (or Adam "
                             "without weight decay)")
        if scheduler is not None:
            raise ValueError("optimizers=(..., scheduler): a scheduler built on the torch "
                             "optimizer would go on editing it after wrap() replaces it; pass "
                             "optimizers=(optimizer, None) and choose the schedule with "
                             "TrainingArguments.lr_scheduler_type")
        cls_kwargs = kwargs.get("optimizer_cls_and_kwargs")
        if cls_kwargs is not None and not (isinstance(cls_kwargs[0], type)
                                           and issubclass(cls_kwargs[0], torch.optim.AdamW)):
            raise ValueError(f"optimizer_cls_and_kwargs=({cls_kwargs[0]!r}, ...): "
                             "TrainStreamTrainer runs AdamW in the daemon; accepted: "
                             "torch.optim.AdamW")
        self.trainstream_options = options
        super().__init__(*args, **kwargs)
        optim = str(getattr(self.args.optim, "value", self.args.optim))
        if self.optimizer is None and cls_kwargs is None and optim not in _ADAMW_OPTIMS:
            raise ValueError(f"TrainingArguments.optim={optim!r}: TrainStreamTrainer runs AdamW "
                             f"in the daemon; accepted: {', '.join(_ADAMW_OPTIMS)}")
        if self.args.fp16:
            raise ValueError("TrainingArguments.fp16=True: its gradient scaler unscales every "
                             "gradient in place after backward, once the daemon has it; use "
                             "bf16=True (no scaler)")
        self._grad_norm = torch.full((), math.nan)
        self.add_callback(_ReportGradNorm(self))

    def create_accelerator_and_postprocess(self) -> None:
        # (Trainer makes a new accelerator in __init__ and for each hyperparameter trial.)
        super().create_accelerator_and_postprocess()
        # accelerate's prepare would copy the optimizer's whole state (fp32 masters and
        # moments) out of the daemon, onto the device and back; it stays where it is.
        prepare = self.accelerator.prepare_optimizer

        def prepare_optimizer(optimizer, device_placement=None):
            return prepare(optimizer, device_placement=False)
        self.accelerator.prepare_optimizer = prepare_optimizer

    def create_optimizer(self, model=None):
        """Trainer's AdamW (its grouping and hyperparameters, or the one passed in
        ``optimizers=``), moved to the daemon by ``wrap()``. Called again (a second
        ``train()``, or its retry with a smaller batch), the same optimizer goes on, as
        Trainer's own would."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper
        if isinstance(inner, OffloadAdamW):
            _take_changed_weights(inner)
            self.optimizer = inner
            return inner
        optimizer = super().create_optimizer(model)
        args = self.args
        _, self.optimizer = wrap(
            self.model if model is None else model, optimizer,
            max_grad_norm=args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0
            else None,
            accumulation_steps=args.gradient_accumulation_steps, **self.trainstream_options)
        return self.optimizer

    # Trainer clips, and even without clipping measures the norm with
    # clip_grad_norm_(inf), which rewrites every gradient in place (a multiply by 1.0).
    # A gradient already handed to the daemon must not change, so the daemon clips
    # (wrap(max_grad_norm=...)) and reports the norm after the step.
    def _clip_grad_norm(self, model):
        return self._grad_norm

    def _get_grad_norm(self, model, grad_norm=None):
        return self._grad_norm

    def _report_grad_norm(self) -> None:
        opt = self.optimizer
        opt = getattr(opt, "optimizer", opt)  # accelerate's wrapper
        norm = opt.last_grad_norm if isinstance(opt, OffloadAdamW) else None
        self._grad_norm.fill_(math.nan if norm is None else norm)


def _take_changed_weights(opt: OffloadAdamW) -> None:
    """Makes each weight changed since the daemon last wrote it (Trainer loading the best
    checkpoint at the end of a run, for one) the new fp32 master, so the next step
    starts from it instead of the daemon's older master. Unchanged weights keep their
    masters' low bits."""
    state = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    changed = False
    for i, p in enumerate(params):
        st = state["state"].get(i)
        if st is None or "master_weight" not in st:
            continue
        master = st["master_weight"]
        weight = p.detach().to(master.device)
        if not torch.equal(master.to(p.dtype).view_as(weight), weight):
            st["master_weight"] = weight.float().reshape(master.shape)
            changed = True
    if changed:
        opt.load_state_dict(state)
