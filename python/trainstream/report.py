"""Inspection: ``memory_report``, ``pinned_stats`` and ``transfer_stats``.

(Named ``report``, not ``inspect``, so it cannot shadow the standard library's module.)
Each works with no model wrapped: the process-wide figures come from the host-memory
registry (_native/host_memory.py), torch's pinned allocator and the copy engines'
totals (_native/streams.py). Passing the optimizer, as before, gives its own figures.
On a machine without CUDA the GPU figures are zeros, not absent, so code that reads
them runs the same everywhere.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import nn

from . import memory
from ._native.host_memory import live_bytes_by_tag
from ._native.streams import copy_totals

# The attribute wrap() sets on a model (api.py).
SESSION_ATTR = "_trainstream_session"


def _gpu() -> Dict[str, int]:
    """The current device's allocator figures (zeros without CUDA)."""
    if not torch.cuda.is_available():
        return {"allocated": 0, "reserved": 0, "peak_allocated": 0}
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "peak_allocated": torch.cuda.max_memory_allocated()}


def memory_report(model: Optional[nn.Module] = None) -> Dict[str, Any]:
    """Where training memory is. Without a model: "gpu" (allocated, reserved,
    peak_allocated bytes of the current device), "pinned" (``pinned_stats()``) and
    "pinned_by_tag". With a wrapped model also "events", "transfers", "optimizer",
    "resident", "plan", "params", "activations" and "attention", and "pinned" is then
    the model's optimizer's staging memory (``pinned_stats(optimizer)``). It asks the
    daemon nothing, so it answers while the daemon is gone too: "optimizer"'s
    "daemon_gone" then holds the DaemonError every optimizer call raises (None while
    the daemon answers)."""
    if model is None:
        pinned = pinned_stats()
        return {"gpu": _gpu(), "pinned": pinned, "pinned_by_tag": dict(pinned["by_tag"])}
    if not isinstance(model, nn.Module):
        raise ValueError(f"memory_report(model): a model wrapped by trainstream.wrap() or None, "
                         f"got {type(model).__name__}")
    session = getattr(model, SESSION_ATTR, None)
    if session is None:
        raise ValueError("model is not wrapped by trainstream.wrap(); call memory_report() "
                         "without a model for the process-wide figures")
    opt = session.optimizer
    stats = opt.stats() if opt is not None else {}
    params = list(model.parameters())
    return {
        **memory.report_sections(session),
        "events": list(session.events),
        "gpu": _gpu(),
        "pinned": pinned_stats(opt),
        "pinned_by_tag": live_bytes_by_tag(),
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
            "daemon_gone": stats.get("daemon_gone"),
        },
        "resident": {
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "devices": sorted({str(p.device) for p in params}),
        },
        "host_per_param": _host_per_param(opt, stats.get("numel", 0)),
    }


def _private_bytes() -> Optional[int]:
    """This process's own resident memory (Linux: smaps_rollup's Pss less Pss_Shmem), or
    None. Not Private_Clean + Private_Dirty: a page of a daemon segment that only this
    process has touched (activation pages, say) is private there, and the daemon's
    figures count it already. Kernels without Pss_Shmem (before 5.9): the private pages."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            kb = {k.rstrip(":"): int(v) for k, v, *_ in (line.split() for line in f)
                  if k.endswith(":") and v.isdigit()}
    except (OSError, ValueError):
        return None
    if "Pss_Shmem" in kb:
        return max(0, kb["Pss"] - kb["Pss_Shmem"]) * 1024
    return (kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)) * 1024


def _host_per_param(opt, numel: int) -> Dict[str, Any]:
    """Host memory of the training by category, in bytes and per trained parameter: the
    daemon's optimizer state (masters, moments), the staging slots this optimizer maps,
    and the process's private memory (everything else it holds: the Python heap, any
    host copy of a weight, pinned buffers). "daemon_state" splits the first: what the
    masters take beyond the weight slots (none for fp32 weights, whose slots are their
    masters; 2 B a parameter for bf16) and the moments; "staging" splits the staging
    slots: the gradient pool the gradients stream through (docs/staging-pool.md), or,
    without one, a gradient slot per parameter, and the weight slots (with the
    segments' headers)."""
    state = opt.state_bytes_by_kind() if opt is not None else {"masters": 0, "moments": 0}
    bytes_ = {
        "daemon optimizer state": opt.state_bytes() if opt is not None else 0,
        "staging slots": pinned_stats(opt)["mapped_bytes"] if opt is not None else 0,
        "process private memory": _private_bytes() or 0,
    }
    staging = _staging_split(opt, bytes_["staging slots"])
    per = {k: (v / numel if numel else None) for k, v in bytes_.items()}
    total = sum(bytes_.values())
    return {"trained_params": numel, "bytes": bytes_, "bytes_per_param": per,
            "total_bytes": total, "total_bytes_per_param": total / numel if numel else None,
            "daemon_state": state,
            "staging": staging,
            "staging_per_param": {k: (v / numel if numel else None) for k, v in staging.items()},
            "daemon_state_per_param": {k: (v / numel if numel else None)
                                       for k, v in state.items()}}


def _staging_split(opt, mapped: int) -> Dict[str, int]:
    if opt is None:
        return {"gradient pool": 0, "gradient slots": 0, "weight slots": 0}
    pool = opt.stats().get("grad_pool_bytes", 0)
    trained = sum(p.numel() * p.element_size() for g in opt.param_groups for p in g["params"])
    grads = 0 if pool else min(trained, mapped)
    return {"gradient pool": pool, "gradient slots": grads,
            "weight slots": max(0, mapped - pool - grads)}


def _is_optimizer(obj) -> bool:
    return callable(getattr(obj, "regions", None)) and callable(getattr(obj, "stats", None))


def pinned_stats(opt=None) -> Dict[str, Any]:
    """Page-locked host memory of this process: torch's pinned allocator counters
    (``allocated_bytes``, ``active_bytes``, ``allocations``: blocks it holds; zeros
    before CUDA is used) and, in "by_tag", the bytes TrainStream maps or pins that are
    still live ("staging", "state", "activations", "weights").

    ``pinned_stats(optimizer)``: that ``OffloadAdamW``'s staging memory, and how much
    of it is registered with CUDA (``mapped_bytes``, ``registered_bytes``)."""
    if opt is not None:
        if not _is_optimizer(opt):
            raise ValueError(f"pinned_stats(opt): an OffloadAdamW or None, got "
                             f"{type(opt).__name__}")
        regions = [r for r in opt.regions() if r["purpose"] == "staging"]
        return {"mapped_bytes": sum(r["bytes"] for r in regions),
                "registered_bytes": sum(r["bytes"] for r in regions if r["registered"])}
    host = torch.cuda.host_memory_stats() if torch.cuda.is_available() else {}
    return {"allocated_bytes": int(host.get("allocated_bytes.current", 0)),
            "peak_allocated_bytes": int(host.get("allocated_bytes.peak", 0)),
            "active_bytes": int(host.get("active_bytes.current", 0)),
            "allocations": int(host.get("allocations.current", 0)),
            "by_tag": live_bytes_by_tag()}


def _transfer_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cuda", "cpu"):
        raise ValueError(f"transfer_stats(device={device!r}) is not accepted; accepted: None "
                         "(the current GPU), 'cuda', 'cuda:N', an int N, 'cpu' (paging to a CPU "
                         "'device', as in tests), a torch.device, or an OffloadAdamW")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"transfer_stats(device={device!r}): CUDA is not available in this "
                         "process; accepted here: None or 'cpu'")
    return dev


def transfer_stats(device=None) -> Dict[str, Any]:
    """Bytes and copies TrainStream's copy streams have moved for ``device`` (default
    the current GPU; "cpu" where there is none) so far, summed over every wrapped model
    and ``ActivationOffloader`` of this process: ``bytes_d2h``/``copies_d2h`` to host
    memory, ``bytes_h2d``/``copies_h2d`` back.

    ``transfer_stats(optimizer)``: that ``OffloadAdamW``'s gradient (d2h) and weight
    (h2d) copies to and from the daemon's staging slots, and its steps."""
    if device is not None and _is_optimizer(device):
        s = device.stats()
        # bytes_pcie: moments (and masters) the zero-copy kernel moved (optimizer_mode="gpu").
        return {"bytes_d2h": s["bytes_d2h"], "bytes_h2d": s["bytes_h2d"], "steps": s["steps"],
                "step_wait_s": s["step_wait_s"], "bytes_pcie": s.get("bytes_pcie", 0)}
    dev = _transfer_device(device)
    return {"device": str(dev), **copy_totals(dev)}
