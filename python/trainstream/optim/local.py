"""``"local"``: torch's fused AdamW on the GPU, after ``offload="auto"`` found that the
optimizer fits in VRAM next to what the first steps used (``decide_offload``, after the
second step); the daemon session is over by then.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from .backend import ParamEntry, ParamTable


class LocalBackend:
    """Holds the ``torch.optim.AdamW(fused=True)`` that took over the state. It shares
    the facade's ``param_groups``, so schedulers that edit them still work."""
    mode = "local"

    def __init__(self, table: ParamTable, state_dict: Dict[str, Any], last_grad_norm: Any = None):
        """``state_dict``: the offloaded optimizer's, moved here (moments to the device);
        ``last_grad_norm``: its last step's, reported until this backend's first step."""
        self._table = table
        param_groups = table.param_groups
        local = torch.optim.AdamW([{"params": g["params"]} for g in param_groups],
                                  lr=param_groups[0]["lr"], fused=True)
        for mine, theirs in zip(param_groups, local.param_groups):
            for k, v in theirs.items():
                mine.setdefault(k, v)
            mine["fused"] = True
        local.param_groups = param_groups
        params = [p for g in param_groups for p in g["params"]]
        for idx, st in state_dict["state"].items():
            p = params[idx]
            local.state[p] = {
                "step": st["step"].to(p.device, torch.float32),
                "exp_avg": st["exp_avg"].to(p.device, p.dtype),
                "exp_avg_sq": st["exp_avg_sq"].to(p.device, p.dtype)}
        self._local = local
        self._last_grad_norm: Any = last_grad_norm  # then a 0-dim tensor: read only when asked

    def register(self, entries: List[ParamEntry]) -> None:
        pass  # (a new group is in the shared param_groups, where torch's AdamW reads it)

    def check_alive(self, in_backward: bool = False) -> None:
        pass

    def grad_final(self, e: ParamEntry) -> None:
        pass  # (the gradient hooks are removed: torch's AdamW reads p.grad in step())

    def accept_grad(self, e: ParamEntry, grad: torch.Tensor) -> bool:
        return False

    def step(self, closure):
        t = self._table
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in t.param_groups for p in g["params"]]
        if t.options["max_grad_norm"] is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, t.options["max_grad_norm"])
        else:  # reported as the daemon does, without changing a gradient
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        self._last_grad_norm = norm
        self._local.step()
        t.step_id += 1
        t.stats["steps"] += 1
        return loss

    def before_zero_grad(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def lands_early(self) -> bool:
        return False  # torch's AdamW updates in step(), on the current stream

    def land(self, entries: List[ParamEntry]) -> None:
        pass

    def last_grad_norm(self) -> Any:
        return self._last_grad_norm

    def sync_weights_from_model(self, params) -> None:
        pass  # (torch's AdamW updates the weights themselves: a written one is its value)

    def state_dict(self) -> Dict[str, Any]:
        return self._local.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        state_dict = {"state": {k: {f: v for f, v in s.items() if f != "master_weight"}
                                for k, s in state_dict["state"].items()},
                      "param_groups": state_dict["param_groups"]}
        self._local.load_state_dict(state_dict)

    def regions(self) -> List[Dict[str, Any]]:
        return []

    def stats(self) -> Dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def decide_offload(params: List[torch.Tensor], *, data_parallel: bool, extra_grads: bool,
                   headroom: float) -> Dict[str, Any]:
    """offload="auto", after the second step: whether torch's fused AdamW would fit on
    the GPU next to what the two steps used (their peak, the moments in the parameters'
    dtype and, with ``extra_grads``, gradients kept that gpu mode with free_grads
    dropped), keeping ``headroom`` (the vram_headroom option) of the capacity free.
    Returns the decision (``offload``: keep offloading) with its figures and reason;
    OffloadAdamW moves the state when it says ``offload=False``."""
    if data_parallel:
        # Ranks share (or average into) the daemon's state; a rank-local torch
        # optimizer would silently stop the averaging.
        return {"offload": True, "reason": "data parallel: the ranks' gradients are "
                "combined through the daemon"}
    devices = {p.device for p in params}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return {"offload": True, "reason": "the parameters are not all on one CUDA device; "
                "the daemon's AdamW is the host path"}
    dev = next(iter(devices))
    total = torch.cuda.get_device_properties(dev).total_memory
    cap = total * torch.cuda.get_per_process_memory_fraction(dev)
    free, _ = torch.cuda.mem_get_info(dev)
    cap = min(cap, torch.cuda.memory_reserved(dev) + free)
    peak = torch.cuda.max_memory_allocated(dev)
    trained = [p for p in params if p.requires_grad]
    state = sum(2 * p.numel() * p.element_size() for p in trained)
    grads = sum(p.numel() * p.element_size() for p in trained) if extra_grads else 0
    need = peak + state + grads
    fits = need <= cap * (1 - headroom)
    return {
        "offload": not fits, "peak_bytes": peak, "optimizer_state_bytes": state,
        "extra_grad_bytes": grads, "needed_bytes": need, "capacity_bytes": int(cap),
        "headroom": headroom,
        "reason": ("fits in VRAM: switched to torch.optim.AdamW(fused=True) on the GPU"
                   if fits else "does not fit in VRAM with torch's AdamW: keeps offloading")}
