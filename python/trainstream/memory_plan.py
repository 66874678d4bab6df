"""wrap()'s memory steps: plan before anything is copied, install paging after the
optimizer has its staging slots, report, and undo on unwrap (docs/paging.md)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from . import planner
from ._pinning import register_fresh
from .activations import ActivationOffloader, HostArena
from .adapter import Adapter
from .attention import AttentionSelector, selector_report
from .paging import BlockPager, in_backward


@dataclass
class Prepared:
    device: torch.device
    blocks: List[nn.Module]
    plan: Optional[planner.Plan]
    capacity: Optional[planner.Capacity]
    moment_dtype: str
    quantized: int = 0


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _daemon_free(config) -> Optional[int]:
    from . import _daemon
    try:
        client = _daemon.connect(config["socket"])
        return int(json.loads(client.status_json())["budget"]["free"])
    except Exception:  # noqa: BLE001 (no answer: the optimizer's attach reports it)
        return None


def prepare(model: nn.Module, config: Dict[str, Any]) -> Prepared:
    """Plans (raising MemoryError when nothing fits), quantizes what the plan says and
    moves everything that is not paged to the target device."""
    from .wrap import find_blocks
    device = torch.device(config["device"]) if config["device"] is not None \
        else _model_device(model)
    blocks = find_blocks(model)
    meta = any(p.is_meta for p in model.parameters())
    moment = config["moment_dtype"]
    if not blocks and not meta:
        if config["device"] is not None:
            model.to(device)
        return Prepared(device, [], None, None, "float32" if moment == "auto" else moment)
    trained = any(p.requires_grad for p in model.parameters())
    on_device = sum(t.numel() * t.element_size() for t in model.parameters()
                    if t.device == device and device.type == "cuda")
    capacity = planner.measure_capacity(device, config["vram_limit"],
                                        _daemon_free(config) if trained else None, on_device)
    fmt = config["quantize"] if config["quantize"] not in ("auto", None) else "nf4"
    summary = planner.summarize(model, blocks, config["min_offload_bytes"], fmt)
    plan = planner.plan(summary, capacity, config)
    if meta:
        raise ValueError("the model is on the meta device: wrap() planned it (it would fit: "
                         f"{plan.decisions}) but cannot train it; materialize it first")
    quantized = _quantize_frozen(blocks, plan.quantize) if plan.quantize else 0
    paged_ids = {id(t) for i in plan.paged
                 for t in list(blocks[i].parameters()) + list(blocks[i].buffers())}
    _move_except(model, paged_ids, device)
    return Prepared(device, blocks, plan, capacity, plan.moment_dtype, quantized)


def _quantize_frozen(blocks: List[nn.Module], fmt: str) -> int:
    """Frozen nn.Linear weights of the blocks become QuantLinear (trained ones, such as
    LoRA adapters, stay)."""
    from .quantization import QuantLinear
    count = 0
    for block in blocks:
        for module in list(block.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear) and not child.weight.requires_grad:
                    setattr(module, name, QuantLinear.from_linear(child, fmt))
                    count += 1
    return count


def _move_except(model: nn.Module, exclude: set, device: torch.device) -> None:
    with torch.no_grad():
        for m in model.modules():
            for name, p in m._parameters.items():
                if p is not None and id(p) not in exclude and p.device != device:
                    p.data = p.data.to(device)
            for name, b in m._buffers.items():
                if b is not None and id(b) not in exclude and b.device != device:
                    m._buffers[name] = b.to(device)


def _wants_pager(prepared: Prepared, config) -> bool:
    if prepared.plan is None:
        return False
    return bool(prepared.plan.paged or prepared.device.type == "cuda"
                or config["activation_offload"] not in ("auto", False)
                or config["recompute"] not in ("auto", False)
                or config["attention"] not in ("auto", None))


def install(model: nn.Module, opt, session, prepared: Prepared) -> None:
    """Installs paging, the adapter and the attention choice on the wrapped model."""
    plan, config = prepared.plan, session.config
    session.plan = plan
    if plan is None:
        return
    session.event("plan", what="weights", paged_blocks=list(plan.paged),
                  blocks=len(prepared.blocks), moment_dtype=plan.moment_dtype,
                  quantize=plan.quantize, quantized_linears=prepared.quantized,
                  device_bytes=plan.device_bytes, host_bytes=plan.host_bytes,
                  usable_vram=plan.usable_vram, why="; ".join(plan.decisions))
    if not _wants_pager(prepared, config):
        return
    from . import _C
    cuda = prepared.device.type == "cuda"
    if cuda and _C.with_cuda:
        for r in opt._regions:
            if r.base_address not in opt._registered_host:
                ok, _ = _C.register_host(r.base_address, r.segment_size, False)
                if ok:
                    opt._registered_host.append(r.base_address)
    regions = session.activation_regions
    registered: List[int] = []  # arena chunks registered with CUDA (not the optimizer's)
    chunk_bytes = (256 if cuda else 64) << 20
    arena = HostArena(lambda n: _session_chunk(opt, n, regions, registered, cuda),
                      chunk_bytes=chunk_bytes)
    offloader = ActivationOffloader(model, device=prepared.device,
                                    min_offload_bytes=config["min_offload_bytes"],
                                    prefetch_depth=config["prefetch_depth"],
                                    max_inflight_bytes=plan.max_inflight_bytes
                                    or config["max_inflight_bytes"], arena=arena)

    def host_home(p):
        e = opt._entries.get(id(p))
        if e is None or e.param_slot is None or e.param_slot.dtype != p.dtype:
            return None
        return e.param_slot.view(p.shape)

    def leave_session():
        # The daemon session ends (offload="auto" moved the optimizer to the GPU, or
        # unwrap): activation pages move to pinned process memory. Left in the session's
        # regions they would outlive its budget and, unregistered, copy at pageable speed.
        # Copies into the old pages finish first (replace_arena drains them).
        in_flight = offloader.replace_arena(HostArena(offloader.engine.host_empty,
                                                      chunk_bytes=chunk_bytes))
        for address in registered:
            _C.unregister_host(address)
        registered.clear()
        if in_flight:  # pages of a graph not yet run backward stay mapped
            session.retired_regions.extend(regions)
        else:
            session.retired_regions.clear()
        regions.clear()
    opt.before_detach.append(leave_session)
    session.leave_session = leave_session

    pager = BlockPager(prepared.blocks, prepared.device, paged=plan.paged,
                       prefetch_depth=config["prefetch_depth"], offloader=offloader,
                       grad_sink=opt.accept_grad, host_home=host_home,
                       min_paged_bytes=config["min_offload_bytes"])
    attention = AttentionSelector(config["attention"], prepared.device, session.event)
    pager.attention_context = attention.context
    # The daemon's AdamW takes a paged weight's gradient (accept_grad); the GPU and
    # local modes update weights on the device, so resident trained blocks stay there.
    pager.can_page_trained = lambda: opt.optimizer_mode == "cpu"
    adapter = Adapter(session, pager, plan, config,
                      prepared.capacity.h2d_gb_s if prepared.capacity else 0.0,
                      between_steps=opt.between_steps)

    def before_forward(module, args):
        # A deepcopy of the wrapped model carries this hook; it is not this session's.
        if getattr(module, "_trainstream_session", None) is not session:
            return
        if in_backward():
            return
        if torch.is_grad_enabled():
            attention.refresh()
            adapter.on_forward(module, args)
        # Every forward, evaluation too: a prefetch left by a forward that raised before
        # its first block must not serve a later forward after the weights changed.
        pager.begin_forward()
    session.pager, session.adapter, session.attention = pager, adapter, attention
    session.hooks.append(model.register_forward_pre_hook(before_forward))


def _session_chunk(opt, nbytes: int, regions: List[Any], registered: List[int],
                   cuda: bool) -> torch.Tensor:
    """Activation pages in a shared-memory region of the daemon session (registered
    with CUDA); pinned process memory when the daemon's budget refuses."""
    from . import _C
    try:
        region = opt._session.allocate_region(nbytes, "activations")
    except Exception:  # noqa: BLE001 (budget refused: fall back, still pinned)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    regions.append(region)
    if cuda:
        ok, _ = register_fresh(region.base_address, region.segment_size)  # False without CUDA
        if ok:
            registered.append(region.base_address)
    return _C.tensor_from_address(region.address, [nbytes], "uint8")


def uninstall(model: nn.Module, session) -> None:
    cap = session.plan is not None and session.config["vram_limit"] is not None
    if cap and session.pager is not None and session.pager.engine.cuda:
        # wrap() capped this process's allocator; the cap goes with the session.
        torch.cuda.set_per_process_memory_fraction(1.0, session.pager.device)
    for h in session.hooks:
        h.remove()
    session.hooks.clear()
    leave = session.leave_session
    if leave is not None:  # the activation pages leave the daemon session now, once
        leave()
        if session.optimizer is not None and leave in session.optimizer.before_detach:
            session.optimizer.before_detach.remove(leave)
        session.leave_session = None
    pager = session.pager
    if pager is not None:
        pager.remove()
        pager.restore_to_host()
        if pager.offloader is not None:
            pager.offloader.remove()
    session.pager = None


def report_sections(session) -> Dict[str, Any]:
    """memory_report()'s "plan", "params", "activations" and "attention" sections."""
    plan, pager, adapter = session.plan, session.pager, session.adapter
    out: Dict[str, Any] = {"plan": dict(plan.as_dict() if plan else {}, adapting=session.adapting)}
    out["params"] = pager.report() if pager is not None else {"paged_blocks": []}
    act: Dict[str, Any] = {}
    if pager is not None:
        act["policy"] = adapter.policies() if adapter is not None else {}
        if pager.offloader is not None:
            act.update(pager.offloader.stats)
            act["host_capacity_bytes"] = pager.offloader._arena.capacity
        if adapter is not None:
            act["steps"] = list(adapter.history)
    out["activations"] = act
    out["attention"] = selector_report(session.attention)
    return out
