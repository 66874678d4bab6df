"""``trainstream.wrap()``: one line that moves an optimizer's state and update to the daemon
(and pages what does not fit); ``unwrap()``; ``memory_report()`` and its parts."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import memory
from .optim import OffloadAdamW
from .options import validate

_SESSION_ATTR = "_trainstream_session"


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
    parameters is made (``lr`` option, default 1e-3). Options: README, "Options";
    an unknown option or value raises ``ValueError`` naming it.

    Four steps (trainstream/memory/install.py): measure what the machine offers, plan
    what stays, pages and quantizes (MemoryError before anything is copied), stream the
    paged blocks and activations over the optimizer's staging slots, adapt the plan to
    the measured peaks of the first steps.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, _SESSION_ATTR, None) is not None:
        raise ValueError("this model is already wrapped; call trainstream.unwrap(model) first")
    config = validate(options)
    measured = memory.measure(model, config)
    prepared = memory.plan(model, measured, config)
    opt = _offload_optimizer(model, optimizer, config, prepared.moment_dtype)
    session = TrainStreamSession(config=config, optimizer=opt)
    opt.set_event_sink(session.event)
    stats = opt.stats()
    session.event("attached", session_id=stats["session_id"], params=stats["params"],
                  numel=stats["numel"])
    memory.stream(model, opt, session, prepared)
    memory.adapt(model, opt, session, prepared)
    setattr(model, _SESSION_ATTR, session)
    return model, opt


def _offload_optimizer(model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                       config: Dict[str, Any], moment_dtype: str) -> OffloadAdamW:
    """The ``OffloadAdamW`` that takes over ``optimizer`` (or the model's trainable
    parameters), attached to the daemon with the plan's moment precision."""
    names = {id(p): n for n, p in model.named_parameters()}
    opt_options = {k: v for k, v in config.items()
                   if k not in ("device", "lr", "check_memory", "blocks", "mode", "eager")}
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
    """Detaches ``model`` from the daemon (its optimizer's state there is freed)."""
    session = getattr(model, _SESSION_ATTR, None)
    if session is None:
        if hasattr(model, _SESSION_ATTR):
            delattr(model, _SESSION_ATTR)
        return model
    memory.uninstall(model, session)
    if session.optimizer is not None:
        session.optimizer.detach()
        session.optimizer.release_hooks()
    delattr(model, _SESSION_ATTR)
    return model


def memory_report(model: nn.Module) -> Dict[str, Any]:
    """Where the model's training memory is: events, gpu, pinned, transfers, optimizer, resident."""
    session = getattr(model, _SESSION_ATTR, None)
    if session is None:
        raise ValueError("model is not wrapped by trainstream.wrap()")
    opt = session.optimizer
    stats = opt.stats() if opt is not None else {}
    gpu = {}
    if torch.cuda.is_available():
        gpu = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
               "peak_allocated": torch.cuda.max_memory_allocated()}
    params = list(model.parameters())
    return {
        **memory.report_sections(session),
        "events": list(session.events),
        "gpu": gpu,
        "pinned": pinned_stats(opt),
        "transfers": transfer_stats(opt),
        "optimizer": {
            "params": stats.get("params", 0),
            "numel": stats.get("numel", 0),
            "moment_dtype": stats.get("moment_dtype"),
            "optimizer_mode": stats.get("optimizer_mode"),
            "state_bytes_in_daemon": opt.state_bytes() if opt is not None else 0,
            "steps": stats.get("steps", 0),
            "skipped_steps": stats.get("skipped_steps", 0),
            "last_grad_norm": opt.last_grad_norm if opt is not None else None,
        },
        "resident": {
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "devices": sorted({str(p.device) for p in params}),
        },
    }


def pinned_stats(opt: Optional[OffloadAdamW] = None) -> Dict[str, Any]:
    """Staging memory this process maps, and how much of it is registered with CUDA."""
    if opt is None:
        return {"mapped_bytes": 0, "registered_bytes": 0}
    regions = [r for r in opt.regions() if r["purpose"] == "staging"]
    return {"mapped_bytes": sum(r["bytes"] for r in regions),
            "registered_bytes": sum(r["bytes"] for r in regions if r["registered"])}


def transfer_stats(opt: Optional[OffloadAdamW] = None) -> Dict[str, Any]:
    """Bytes copied to (d2h) and from (h2d) the daemon's staging slots so far."""
    if opt is None:
        return {"bytes_d2h": 0, "bytes_h2d": 0, "steps": 0}
    s = opt.stats()
    # bytes_pcie: moments (and masters) the zero-copy kernel moved (optimizer_mode="gpu").
    return {"bytes_d2h": s["bytes_d2h"], "bytes_h2d": s["bytes_h2d"], "steps": s["steps"],
            "step_wait_s": s["step_wait_s"], "bytes_pcie": s.get("bytes_pcie", 0)}
