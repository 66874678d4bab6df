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
import numbers
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from transformers import Trainer, TrainerCallback

from .. import memory
from ..api import wrap_planned
from ..optim import OffloadAdamW
from ..options import default, validate
from .hf_callback import StepFigures, end_abandoned_step
from .hf_loss import chunked_causal_lm_loss, find_causal_lm_head, workspace_bytes

__all__ = ["TrainStreamTrainer"]

_ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")
# Options Trainer's own arguments decide; given twice they could disagree.
_FROM_ARGS = {"max_grad_norm": "max_grad_norm", "accumulation_steps": "gradient_accumulation_steps",
              "lr": "learning_rate"}
# Weight and activation paging: the model stays on the CPU until wrap() places it
# (docs/huggingface-trainer.md, point 3). False and "auto" ask for nothing.
_PAGING_OPTIONS = ("param_offload", "activation_offload", "recompute", "vram_limit")
# TrainStreamTrainer's own options, taken out before the rest goes to wrap().
_LOSS_OPTIONS = {"chunked_loss": True, "loss_chunk_size": None}


class _TrainStreamSteps(TrainerCallback):
    """Fills the trainer's grad-norm tensor with the daemon's figure once a step is done
    (Trainer reads it with ``.item()`` only when it logs, after the step), samples the
    step's memory peak, and ends a step a failed ``train()`` left pending."""

    def __init__(self, trainer: "TrainStreamTrainer"):
        self._trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        end_abandoned_step(self._trainer.optimizer)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._trainer._report_grad_norm()

    def on_step_end(self, args, state, control, **kwargs):
        self._trainer._figures.sample_peak(self._trainer.model)


def _loss_options(options: Dict[str, Any]) -> Dict[str, Any]:
    out = {k: options.pop(k, v) for k, v in _LOSS_OPTIONS.items()}
    if not isinstance(out["chunked_loss"], bool):
        raise ValueError(f"option chunked_loss={out['chunked_loss']!r} is not accepted; "
                         "accepted: True or False")
    size = out["loss_chunk_size"]
    if size is not None and (not isinstance(size, numbers.Integral) or isinstance(size, bool)
                             or size < 1):
        raise ValueError(f"option loss_chunk_size={size!r} is not accepted; accepted: None "
                         "(256) or an integer >= 1 (tokens per chunk)")
    return out


def _asks_for_paging(options: Dict[str, Any]) -> bool:
    return any(options.get(k, "auto") not in ("auto", False, None) for k in _PAGING_OPTIONS)


@dataclass
class _JobPlan:
    """wrap()'s measurement and plan of ``model`` with ``options``, made once per job:
    before Trainer places the model (does it page?) and handed to wrap() at
    create_optimizer (api.wrap_planned). ``error``: the planner's MemoryError, which
    wrap() raises before anything is copied."""
    model: Any
    options: Dict[str, Any]
    config: Dict[str, Any]
    measured: Any            # memory.measure's Measured
    decided: Any             # memory.decide's Plan (None: no block stack, or the error)
    error: Optional[MemoryError]

    def pages(self) -> bool:
        """A plan that cannot fit counts as paging: the model stays on the host until
        wrap() raises."""
        return self.error is not None or bool(self.decided is not None and self.decided.paged)


class TrainStreamTrainer(Trainer):
    """``transformers.Trainer`` whose optimizer is ``OffloadAdamW`` (``trainstream.wrap``).

    ``trainstream`` (or its other name, ``trainstream_options``; one of the two): further
    ``wrap()`` options (docs/options.md), paging included, for example
    ``{"moment_dtype": "bf16", "param_offload": True}``, plus this class's own:

    * ``chunked_loss`` (default True): a causal LM's loss is computed from its last
      hidden state in chunks, so the full logits never exist (hf_loss.py); other models
      keep their own loss;
    * ``loss_chunk_size`` (default None: 256, as ``chunked_cross_entropy``; TrainStream
      0.5 used 1024): tokens per chunk.

    Not accepted there: what the ``TrainingArguments`` already say (``max_grad_norm``,
    ``gradient_accumulation_steps``, ``learning_rate``, and the device). With paging
    (asked for, or the planner finding the model too big for the device) the model
    stays on the CPU until ``create_optimizer()``'s ``wrap()`` places it. The machine is
    measured and the plan made once per job, before Trainer places the model, and
    ``wrap()`` carries out that plan; it keeps the chunked loss's workspace free
    (``vram_headroom``) wherever a device limit is known.
    """

    def __init__(self, *args, trainstream: Optional[Dict[str, Any]] = None,
                 trainstream_options: Optional[Dict[str, Any]] = None, **kwargs):
        if trainstream is not None and trainstream_options is not None:
            raise ValueError("trainstream= and trainstream_options= are two names of one "
                             "dict of wrap() options; give one of them")
        given = trainstream if trainstream is not None else trainstream_options
        if given is not None and not isinstance(given, dict):
            raise ValueError(f"trainstream={given!r}: accepted: a dict of wrap() options "
                             "(docs/options.md) or None")
        options = dict(given or {})
        loss = _loss_options(options)
        for key, arg in _FROM_ARGS.items():
            if key in options:
                raise ValueError(f"trainstream_options[{key!r}]: set TrainingArguments.{arg} "
                                 "instead; TrainStreamTrainer passes it to wrap()")
        validate({k: v for k, v in options.items() if k != "device"})
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
        self.chunked_loss, self.loss_chunk_size = loss["chunked_loss"], loss["loss_chunk_size"]
        self._lm_head: Any = None  # find_causal_lm_head's answer, once asked (False: none)
        self._defers_placement: Optional[bool] = None  # decided on first use
        self._job: Optional[_JobPlan] = None  # the job's measurement and plan (_job_plan)
        self._figures = StepFigures()
        super().__init__(*args, **kwargs)
        if "device" in options and torch.device(options["device"]) != self.args.device:
            raise ValueError(f"trainstream_options['device']={options['device']!r}: the "
                             f"TrainingArguments train on {self.args.device} (use_cpu, "
                             "CUDA_VISIBLE_DEVICES); set the device there")
        optim = str(getattr(self.args.optim, "value", self.args.optim))
        if self.optimizer is None and cls_kwargs is None and optim not in _ADAMW_OPTIMS:
            raise ValueError(f"TrainingArguments.optim={optim!r}: TrainStreamTrainer runs AdamW "
                             f"in the daemon; accepted: {', '.join(_ADAMW_OPTIMS)}")
        if self.args.fp16:
            raise ValueError("TrainingArguments.fp16=True: its gradient scaler unscales every "
                             "gradient in place after backward, once the daemon has it; use "
                             "bf16=True (no scaler)")
        self._grad_norm = torch.full((), math.nan)
        self.add_callback(_TrainStreamSteps(self))

    def create_accelerator_and_postprocess(self) -> None:
        # (Trainer makes a new accelerator in __init__ and for each hyperparameter trial.)
        super().create_accelerator_and_postprocess()
        # accelerate's prepare would copy the optimizer's whole state (fp32 masters and
        # moments) out of the daemon, onto the device and back; it stays where it is.
        prepare = self.accelerator.prepare_optimizer

        def prepare_optimizer(optimizer, device_placement=None):
            return prepare(optimizer, device_placement=False)
        self.accelerator.prepare_optimizer = prepare_optimizer
        # With paging, wrap() has placed the model (what pages stays on the host);
        # accelerate's prepare would move all of it to the device.
        prepare_model = self.accelerator.prepare_model

        def prepare_model_in_place(model, device_placement=None, evaluation_mode=False):
            if self.defers_placement(model):
                device_placement = False
            return prepare_model(model, device_placement=device_placement,
                                 evaluation_mode=evaluation_mode)
        self.accelerator.prepare_model = prepare_model_in_place

    def defers_placement(self, model=None) -> bool:
        """Whether the model stays where it is until ``create_optimizer()``'s ``wrap()``
        places it: paging asked for in the options, or wrap()'s plan (made here, once,
        and handed to wrap()) paging the model or finding that it does not fit. Decided
        once, before the first move."""
        if self._defers_placement is None:
            model = self.model if model is None else model
            options = self.trainstream_options
            self._defers_placement = bool(
                model is not None and getattr(model, "_trainstream_session", None) is None
                and (_asks_for_paging(options) or "device" in options
                     or self._job_plan(model).pages()))
        return self._defers_placement

    def _job_plan(self, model) -> _JobPlan:
        """wrap()'s measurement and plan for ``model``, made once: the one already made
        when it was for this model and the same options (a new model from model_init,
        or TrainingArguments changed since, is a new job)."""
        options = self._wrap_options(model)
        job = self._job
        if job is None or job.model is not model or job.options != options:
            config = validate(options)
            measured = memory.measure(model, config)
            try:
                decided, error = memory.decide(model, measured, config), None
            except MemoryError as e:
                decided, error = None, e
            job = self._job = _JobPlan(model, options, config, measured, decided, error)
        return job

    def _wrap_options(self, model) -> Dict[str, Any]:
        """What wrap() gets: the trainstream options, the TrainingArguments' device,
        clipping and accumulation, and the chunked loss's workspace in vram_headroom."""
        args = self.args
        options = dict(self.trainstream_options, device=args.device)
        options.update(self._loss_headroom(model, options))
        options["max_grad_norm"] = args.max_grad_norm if args.max_grad_norm and \
            args.max_grad_norm > 0 else None
        options["accumulation_steps"] = args.gradient_accumulation_steps
        return options

    def _move_model_to_device(self, model, device) -> None:
        # (Trainer's __init__, a model_init in train(), and bf16_full_eval's train().)
        if not self.defers_placement(model):
            super()._move_model_to_device(model, device)

    def evaluation_loop(self, *args, **kwargs):
        # An evaluation before train() of a model left on the CPU for paging: wrap() (with
        # the optimizer train() goes on with) places it first.
        if self.defers_placement() and getattr(self.model, "_trainstream_session", None) is None:
            self.create_optimizer()
        return super().evaluation_loop(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Trainer's loss; for a causal LM with ``chunked_loss``, the same next-token loss
        from the last hidden state in chunks (hf_loss.py), so the logits never exist.
        Evaluation asking for the outputs (the logits) keeps the model's own loss."""
        if (return_outputs or not self.chunked_loss or "labels" not in inputs
                or "shift_labels" in inputs or self.label_smoother is not None
                or self.compute_loss_func is not None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        lm = self._causal_lm_head(self.accelerator.unwrap_model(model))
        if lm is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # As Trainer's own: the model divides by num_items_in_batch when it takes loss
        # kwargs, else takes the mean (training_step then divides by the accumulation).
        num_items = num_items_in_batch if self.model_accepts_loss_kwargs else None
        with self.accelerator.autocast():  # the model's forward runs under it too
            loss = chunked_causal_lm_loss(model, lm, inputs, num_items,
                                          self.loss_chunk_size)
        if (self.args.average_tokens_across_devices and self.model_accepts_loss_kwargs
                and num_items_in_batch is not None):
            loss = loss * self.accelerator.num_processes
        return loss

    def log(self, logs, start_time=None) -> None:
        """Trainer's log, with the ``ts_*`` figures (hf_callback.py) added."""
        if self.optimizer is not None:
            logs.update(self._figures.read(self.optimizer, self.model))
        super().log(logs, start_time)

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
        model = self.model if model is None else model
        self.defers_placement(model)
        optimizer = super().create_optimizer(model)
        # wrap() places the model (what pages stays on the host) with the plan made
        # when Trainer was about to place it: the machine is measured once per job.
        job = self._job_plan(model)
        if job.error is not None:
            raise job.error
        _, self.optimizer = wrap_planned(model, optimizer, job.config, job.measured,
                                         job.decided)
        self._job = None  # spent: a later wrap (after an unwrap) measures the machine anew
        return self.optimizer

    def _causal_lm_head(self, model):
        """``find_causal_lm_head``'s answer for the model, asked once (None: no head the
        chunked loss can read); the loss and the headroom share it."""
        if self._lm_head is None:
            self._lm_head = find_causal_lm_head(model) or False
        return self._lm_head or None

    def _loss_headroom(self, model, options) -> Dict[str, Any]:
        """The planner plans weights and activations, not the chunked loss's logits and
        head gradient, which are live at the end of forward when activations peak: their
        bytes are added to ``vram_headroom`` (as a share of the VRAM limit, or of the
        device), so the plan leaves room for them. H200, 24 GiB cap: without this the
        1.5B full fine-tune at 4x1024 and 14B QLoRA at 2,048 tokens ran out of memory in
        the loss's first chunk."""
        lm = self._causal_lm_head(model) if self.chunked_loss else None
        if lm is None:
            return {}
        cap = validate(dict(options)).get("vram_limit")
        if cap is None and torch.cuda.is_available() and self.args.device.type == "cuda":
            cap = torch.cuda.get_device_properties(self.args.device).total_memory
        if not cap:
            return {}
        dtype = torch.bfloat16 if self.args.bf16 else lm.head.weight.dtype
        extra = workspace_bytes(lm, self.loss_chunk_size, dtype) / cap
        headroom = options.get("vram_headroom", default("vram_headroom"))
        return {"vram_headroom": min(0.9, headroom + extra)}

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
