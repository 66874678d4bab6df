"""``trainstream.wrap()``: one line that moves an optimizer's state and update to the daemon
(and pages what does not fit); ``unwrap()``. ``memory_report()``, ``pinned_stats()`` and
``transfer_stats()`` live in report.py and are re-exported here."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import hf_logits_loss, memory
from .optim import OffloadAdamW
from .options import validate
from .report import SESSION_ATTR as _SESSION_ATTR
from .report import memory_report, pinned_stats, transfer_stats

__all__ = ["TrainStreamSession", "wrap", "unwrap", "memory_report", "pinned_stats",
           "transfer_stats"]


@dataclass
class TrainStreamSession:
    """What ``wrap()`` attached to a model (``model._trainstream_session``)."""
    config: Dict[str, Any]
    optimizer: Optional[OffloadAdamW]
    events: List[Dict[str, Any]] = field(default_factory=list)
    adapting: bool = False
    # Paging (docs/paging.md); None when wrap() decided nothing pages.
    plan: Any = None
    pager: Any = None
    controller: Any = None  # the memory controller (memory/controller.py)
    attention: Any = None
    hooks: List[Any] = field(default_factory=list)
    activation_regions: List[Any] = field(default_factory=list)  # keep the mappings alive
    retired_regions: List[Any] = field(default_factory=list)    # ... after the session ended
    leave_session: Any = None  # moves activation pages out of the daemon session (memory.stream)
    restore_loss: Any = None  # puts the model's own loss_function back (hf_logits_loss.py)

    @property
    def steps(self) -> int:
        return self.optimizer.step_id if self.optimizer is not None else 0

    def __deepcopy__(self, memo):
        # A copy of a wrapped model (an EMA copy, a checkpoint clone) is a plain
        # model: the daemon session belongs to the original only.
        return None

    def event(self, kind: str, **details) -> None:
        self.events.append({"time": time.time(), "kind": kind, **details})
        if self.config.get("verbose"):
            print(f"trainstream: {kind}: {details}")


def wrap(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
         **options) -> Tuple[nn.Module, Optional[OffloadAdamW]]:
    """Returns ``(model, optimizer)`` with the optimizer's state and update in the daemon.

    A ``torch.optim.AdamW`` (or ``Adam`` without weight decay) is converted to
    ``OffloadAdamW`` with its hyper-parameters and any existing state migrated.
    With ``optimizer=None`` an ``OffloadAdamW`` over the model's trainable
    parameters is made (``lr`` option, default 1e-3). Options: docs/options.md;
    an unknown option or value raises ``ValueError`` naming it.

    Four steps (trainstream/memory/install.py): measure what the machine offers, plan
    what stays, pages and quantizes (MemoryError before anything is copied), stream the
    paged blocks and activations over the optimizer's staging slots, adapt the plan to
    the measured peaks of the first steps.
    """
    _check_unwrapped(model)
    config = validate(options)
    measured = memory.measure(model, config)
    return wrap_planned(model, optimizer, config, measured, memory.decide(model, measured, config))


def wrap_planned(model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 config: Dict[str, Any], measured: "memory.install.Measured",
                 decided: "Optional[memory.planner.Plan]",
                 ) -> Tuple[nn.Module, Optional[OffloadAdamW]]:
    """``wrap()`` with its measurement and plan made already: ``config`` is
    ``validate(options)``, ``measured`` ``memory.measure(model, config)`` and ``decided``
    ``memory.decide(model, measured, config)``. TrainStreamTrainer measures and plans once
    per job, before Trainer places the model (a model that pages stays on the host), and
    hands both here, so the machine is not measured twice."""
    _check_unwrapped(model)
    prepared = memory.plan(model, measured, config, decided)
    opt = _offload_optimizer(model, optimizer, config, prepared.moment_dtype)
    session = TrainStreamSession(config=config, optimizer=opt)
    opt.set_event_sink(session.event)
    stats = opt.stats()
    session.event("attached", session_id=stats["session_id"], params=stats["params"],
                  numel=stats["numel"])
    memory.stream(model, opt, session, prepared)
    memory.adapt(model, opt, session, prepared)
    opt.attach(model)  # guard_params: ParamReadyHooks on the model's modules
    if config["lm_loss"] == "trainstream":
        session.restore_loss = hf_logits_loss.install(model)
        if session.restore_loss is not None:
            session.event("lm_loss", what="the model's loss_function computes the causal-LM "
                                          "loss without fp32 copies of the logits")
    setattr(model, _SESSION_ATTR, session)
    return model, opt


def _check_unwrapped(model) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, _SESSION_ATTR, None) is not None:
        raise ValueError("this model is already wrapped; call trainstream.unwrap(model) first")


def _offload_optimizer(model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                       config: Dict[str, Any], moment_dtype: str) -> OffloadAdamW:
    """The ``OffloadAdamW`` that takes over ``optimizer`` (or the model's trainable
    parameters), attached to the daemon with the plan's moment precision."""
    names = {id(p): n for n, p in model.named_parameters()}
    opt_options = {k: v for k, v in config.items()
                   if k not in ("device", "lr", "check_memory", "blocks", "mode", "eager",
                                 "lm_loss")}
    opt_options["moment_dtype"] = moment_dtype
    if optimizer is None:
        params = [p for p in model.parameters() if p.requires_grad]
        lr = 1e-3 if config["lr"] is None else config["lr"]
        return OffloadAdamW(params, lr=lr, names=names, **opt_options)
    return _convert(optimizer, names, config, opt_options)


def _convert(optimizer, names, config, opt_options) -> OffloadAdamW:
    if isinstance(optimizer, OffloadAdamW):
        return optimizer
    if isinstance(optimizer, torch.optim.AdamW):
        pass
    elif isinstance(optimizer, torch.optim.Adam):
        if any(g.get("weight_decay", 0) for g in optimizer.param_groups):
            raise ValueError(
                "torch.optim.Adam with weight_decay != 0 applies L2 regularisation, which "
                "OffloadAdamW (decoupled weight decay) does not reproduce; use torch.optim.AdamW "
                "or weight_decay=0")
    else:
        raise ValueError(f"optimizer must be torch.optim.AdamW, torch.optim.Adam or None; got "
                         f"{type(optimizer).__name__}")
    for g in optimizer.param_groups:
        for flag in ("amsgrad", "maximize"):
            if g.get(flag):
                raise ValueError(f"optimizer option {flag}=True is not supported by OffloadAdamW")
        if g.get("capturable") or g.get("differentiable"):
            raise ValueError("capturable/differentiable optimizers are not supported by OffloadAdamW")
    old_state = optimizer.state_dict()
    first, rest = optimizer.param_groups[0], optimizer.param_groups[1:]

    def group_args(g):
        # The `lr` option, when given, overrides every group's learning rate.
        lr = g["lr"] if config["lr"] is None else config["lr"]
        return dict(lr=float(lr.item()) if torch.is_tensor(lr) else float(lr),
                    betas=tuple(g["betas"]), eps=g["eps"], weight_decay=g["weight_decay"])
    new = OffloadAdamW([{"params": list(first["params"])}], names=names, attach=False,
                       **group_args(first), **opt_options)
    for g in rest:
        new.add_param_group({"params": list(g["params"]), **group_args(g)})
    new.attach()
    if old_state["state"]:
        # torch stores moments in the parameter's dtype; the daemon keeps fp32 masters
        # initialised from the current weights (no master in a torch state dict).
        for g in old_state["param_groups"]:
            if config["lr"] is not None:
                g["lr"] = config["lr"]
        new.load_state_dict(old_state)
    return new


def unwrap(model: nn.Module) -> nn.Module:
    """Detaches ``model`` from the daemon (its optimizer's state there is freed). It
    does not raise when the daemon is gone: the state left for a daemon that comes back
    is given up (Note [A daemon gone for good])."""
    session = getattr(model, _SESSION_ATTR, None)
    if session is None:
        if hasattr(model, _SESSION_ATTR):
            delattr(model, _SESSION_ATTR)
        return model
    memory.uninstall(model, session)
    if session.restore_loss is not None:
        session.restore_loss()
    if session.optimizer is not None:
        session.optimizer.detach()
        session.optimizer.release_hooks()
    delattr(model, _SESSION_ATTR)
    return model
