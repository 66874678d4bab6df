"""``trainstream.wrap()``: one line that moves an optimizer's state and update to the daemon."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ._options import validate
from .optim import OffloadAdamW

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
    adapter: Any = None
    attention: Any = None
    hooks: List[Any] = field(default_factory=list)
    activation_regions: List[Any] = field(default_factory=list)  # keep the mappings alive
    retired_regions: List[Any] = field(default_factory=list)    # ... after the session ended
    leave_session: Any = None  # moves activation pages out of the daemon session (memory_plan)

    @property
    def steps(self) -> int:
        return self.optimizer._step_id if self.optimizer is not None else 0

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
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, _SESSION_ATTR, None) is not None:
        raise ValueError("this model is already wrapped; call trainstream.unwrap(model) first")
    config = validate(options)
    from . import memory_plan
    prepared = memory_plan.prepare(model, config)   # may raise MemoryError, before any copy
    names = {id(p): n for n, p in model.named_parameters()}
    opt_options = {k: v for k, v in config.items() if k not in ("device", "lr", "check_memory")}
    opt_options["moment_dtype"] = prepared.moment_dtype
    if optimizer is None:
        params = [p for p in model.parameters() if p.requires_grad]
        lr = 1e-3 if config["lr"] is None else config["lr"]
        new = OffloadAdamW(params, lr=lr, names=names, **opt_options)
    else:
        new = _convert(optimizer, names, config, opt_options)
    session = TrainStreamSession(config=config, optimizer=new)
    new._event_sink = session.event
    session.event("attached", session_id=new.stats()["session_id"],
                  params=len(new._entries), numel=new.stats()["numel"])
    memory_plan.install(model, new, session, prepared)
    setattr(model, _SESSION_ATTR, session)
    return model, new


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
    from . import memory_plan
    memory_plan.uninstall(model, session)
    if session.optimizer is not None:
        session.optimizer.detach()
        session.optimizer.release_hooks()
    delattr(model, _SESSION_ATTR)
    return model


def find_blocks(model: nn.Module) -> List[nn.Module]:
    """The repeated block stack: the largest ``nn.ModuleList`` whose children share one type."""
    best: List[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best):
            kinds = {type(c) for c in m}
            if len(kinds) == 1:
                best = list(m)
    return best


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
    from . import memory_plan
    return {
        **memory_plan.report_sections(session),
        "events": list(session.events),
        "gpu": gpu,
        "pinned": pinned_stats(opt),
        "transfers": transfer_stats(opt),
        "optimizer": {
            "params": stats.get("params", 0),
            "numel": stats.get("numel", 0),
            "moment_dtype": stats.get("moment_dtype"),
            "optimizer_mode": stats.get("optimizer_mode"),
            "state_bytes_in_daemon": _state_bytes(opt),
            "steps": stats.get("steps", 0),
            "skipped_steps": stats.get("skipped_steps", 0),
            "last_grad_norm": opt.last_grad_norm if opt is not None else None,
        },
        "resident": {
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "devices": sorted({str(p.device) for p in params}),
        },
    }


def _state_bytes(opt: Optional[OffloadAdamW]) -> int:
    if opt is None:
        return 0
    moment = 2 if opt._options["moment_dtype"] == "bfloat16" else 4
    # optimizer_mode="gpu" keeps no fp32 master for an fp32 parameter (it is its own).
    return sum(e.param.numel() * (2 * moment + (0 if opt.optimizer_mode == "gpu"
                                                and e.param.dtype == torch.float32 else 4))
               for e in opt._entries.values())


def pinned_stats(opt: Optional[OffloadAdamW] = None) -> Dict[str, Any]:
    """Staging memory this process maps, and how much of it is registered with CUDA."""
    if opt is None:
        return {"mapped_bytes": 0, "registered_bytes": 0}
    mapped = sum(r.segment_size for r in opt._regions)
    registered = sum(r.segment_size for r in opt._regions
                     if r.base_address in opt._registered_host)
    return {"mapped_bytes": mapped, "registered_bytes": registered}


def transfer_stats(opt: Optional[OffloadAdamW] = None) -> Dict[str, Any]:
    """Bytes copied to (d2h) and from (h2d) the daemon's staging slots so far."""
    if opt is None:
        return {"bytes_d2h": 0, "bytes_h2d": 0, "steps": 0}
    s = opt.stats()
    # bytes_pcie: moments (and masters) the zero-copy kernel moved (optimizer_mode="gpu").
    return {"bytes_d2h": s["bytes_d2h"], "bytes_h2d": s["bytes_h2d"], "steps": s["steps"],
            "step_wait_s": s["step_wait_s"], "bytes_pcie": s.get("bytes_pcie", 0)}
