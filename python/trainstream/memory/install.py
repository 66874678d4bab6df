"""wrap()'s memory steps, in the order wrap() runs them (docs/paging.md):

1. ``measure``: the device, the block stack and the capacity the machine offers;
2. ``plan``: what stays on the device, what pages, in which precision (``decide``;
   MemoryError when nothing fits, before anything is copied); the frozen linears are
   quantized and every tensor that does not page moves to the device;
3. (the optimizer attaches: its staging slots are the paged trained weights' homes)
4. ``stream``: the weight pager, the activation offloader and the attention choice;
5. ``adapt``: the memory controller, which moves blocks from measured peaks.

``uninstall`` undoes 4 and 5 (unwrap); ``report_sections`` is memory_report()'s part.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from .._native import C
from .._native.pinning import register_fresh
from ..blocks import find_blocks
from ..frozen.fp8_matmul import set_fp8_matmul
from ..streaming.saved_tensors import HostArena, SavedTensorPager
from ..streaming.attention import AttentionSelector, selector_report
from ..streaming.weights import BlockPager, in_backward
from . import planner
from .capacity import Capacity, measure_capacity
from .controller import MemoryController


@dataclass
class Measured:
    """What ``measure`` found: where the model trains and what the machine offers there
    (``capacity`` None: nothing to plan, no block stack)."""
    device: torch.device
    blocks: List[nn.Module]
    meta: bool
    capacity: Optional[Capacity]


@dataclass
class Prepared:
    """What ``plan`` decided and did (``plan`` None: nothing to plan)."""
    device: torch.device
    blocks: List[nn.Module]
    plan: Optional[planner.Plan]
    capacity: Optional[Capacity]
    moment_dtype: str
    quantized: int = 0


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _daemon_free(config) -> Optional[int]:
    from .._native import daemon as _daemon
    try:
        client = _daemon.connect(config["socket"])
        return int(json.loads(client.status_json())["budget"]["free"])
    except Exception:  # noqa: BLE001 (no answer: the optimizer's attach reports it)
        return None


def measure(model: nn.Module, config: Dict[str, Any]) -> Measured:
    """Finds the block stack and, when there is one (or the model is on the meta
    device), measures the capacity of the training device: its free memory (capped by
    ``vram_limit``), host RAM, the daemon's free budget (when anything trains) and the
    PCIe bandwidth."""
    device = torch.device(config["device"]) if config["device"] is not None \
        else _model_device(model)
    blocks = _chosen_blocks(model, config["blocks"])
    meta = any(p.is_meta for p in model.parameters())
    if not blocks and not meta:
        return Measured(device, [], False, None)
    trained = any(p.requires_grad for p in model.parameters())
    on_device = sum(t.numel() * t.element_size() for t in model.parameters()
                    if t.device == device and device.type == "cuda")
    capacity = measure_capacity(device, config["vram_limit"],
                                _daemon_free(config) if trained else None, on_device,
                                profile=config["profile"])
    return Measured(device, blocks, meta, capacity)


def _chosen_blocks(model: nn.Module, blocks) -> List[nn.Module]:
    """The ``blocks`` option (each a submodule of ``model``, none twice), else
    ``find_blocks``'s stack."""
    if blocks is None:
        return find_blocks(model)
    mine = {id(m) for m in model.modules()}
    chosen = list(blocks)
    for i, m in enumerate(chosen):
        if id(m) not in mine or m is model:
            raise ValueError(f"option blocks: blocks[{i}] ({type(m).__name__}) is not a submodule "
                             "of the model; accepted: None or a list of the model's layer modules")
    if len({id(m) for m in chosen}) != len(chosen):
        raise ValueError("option blocks: a module is listed twice; accepted: None or a list of "
                         "distinct layer modules of the model")
    return chosen


def decide(model: nn.Module, measured: Measured, config: Dict[str, Any]) -> Optional[planner.Plan]:
    """Step 2's decision alone, nothing moved: the planner's plan for what ``measure``
    found (MemoryError when nothing fits; None without a block stack). ``plan`` carries
    it out. TrainStreamTrainer decides once per job, to know whether the model stays on
    the host, and hands the decision to wrap() (api.wrap_planned)."""
    if measured.capacity is None:
        return None
    return planner.plan(summarize(model, measured, config), measured.capacity, config)


def plan(model: nn.Module, measured: Measured, config: Dict[str, Any],
         decided: Optional[planner.Plan] = None) -> Prepared:
    """Plans (raising MemoryError when nothing fits and ValueError for a meta model),
    quantizes the frozen linears the plan names and moves everything that is not paged
    to the training device. Without a block stack only the move is left. ``decided``:
    ``decide``'s answer for ``measured`` and ``config`` when made already (None: made
    here)."""
    device, blocks = measured.device, measured.blocks
    if measured.capacity is None:
        _apply_fp8_matmul(model, config)
        if config["device"] is not None:
            model.to(device)
        moment = config["moment_dtype"]
        return Prepared(device, [], None, None, "float32" if moment == "auto" else moment)
    if decided is None:
        decided = decide(model, measured, config)
    if measured.meta:
        raise ValueError("the model is on the meta device: wrap() planned it (it would fit: "
                         f"{decided.decisions}) but cannot train it; materialize it first")
    quantized = 0
    if decided.quantize:
        from ..frozen.quantization import quantize_model
        # Trained linears (LoRA adapters) stay as they are.
        quantized = quantize_model(model, decided.quantize, blocks=blocks,
                                   block_size=config["quant_block_size"],
                                   skip_trained=True)["tensors"]
        _apply_fp8_matmul(model, config)
    paged_ids = {id(t) for i in decided.paged
                 for t in list(blocks[i].parameters()) + list(blocks[i].buffers())}
    _move_except(model, paged_ids, device)
    return Prepared(device, blocks, decided, measured.capacity, decided.moment_dtype, quantized)


def summarize(model: nn.Module, measured: Measured, config: Dict[str, Any]) -> planner.ModelSummary:
    """What the planner reads of ``model`` (``measured.capacity`` set), as wrap() plans it:
    the fp8_matmul option applied first to layers already quantized (load_model's base),
    since the device copy a resident FP8 layer builds depends on it."""
    _apply_fp8_matmul(model, config)
    fmt = config["quantize"] if config["quantize"] not in ("auto", None) else "nf4"
    return planner.summarize(model, measured.blocks, config["min_offload_bytes"], fmt,
                             config["quant_block_size"], measured.device,
                             config["fp8_matmul"] or "auto")


def _apply_fp8_matmul(model: nn.Module, config: Dict[str, Any]) -> None:
    if config["fp8_matmul"] is not None:  # None: each FP8 layer keeps its mode
        set_fp8_matmul(model, config["fp8_matmul"])


def _move_except(model: nn.Module, exclude: set, device: torch.device) -> None:
    with torch.no_grad():
        for m in model.modules():
            for p in m._parameters.values():
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


def stream(model: nn.Module, opt, session, prepared: Prepared) -> Optional[BlockPager]:
    """Records the plan and, when anything is to page (or the device is a GPU, where the
    controller may page later), installs the streaming: the activation offloader over
    pages in the daemon session's memory, the weight pager (a paged trained weight's
    home is its param slot; its gradient goes to the optimizer's ``accept_grad``) and
    the attention choice. Returns the pager (None: nothing streams)."""
    plan, config = prepared.plan, session.config
    session.plan = plan
    if plan is None:
        return None
    session.event("plan", what="weights", paged_blocks=list(plan.paged),
                  blocks=len(prepared.blocks), moment_dtype=plan.moment_dtype,
                  quantize=plan.quantize, quantized_linears=prepared.quantized,
                  device_bytes=plan.device_bytes, host_bytes=plan.host_bytes,
                  usable_vram=plan.usable_vram, why="; ".join(plan.decisions))
    if not _wants_pager(prepared, config):
        return None
    cuda = prepared.device.type == "cuda"
    if cuda and C().with_cuda:
        opt.register_regions_with_cuda()
    regions = session.activation_regions
    registered: List[int] = []  # arena chunks registered with CUDA (not the optimizer's)
    chunk_bytes = (256 if cuda else 64) << 20
    arena = HostArena(lambda n: _session_chunk(opt, n, regions, registered, cuda),
                      chunk_bytes=chunk_bytes)
    offloader = SavedTensorPager(model, device=prepared.device,
                                 min_offload_bytes=config["min_offload_bytes"],
                                 prefetch_depth=config["prefetch_depth"],
                                 max_inflight_bytes=plan.max_inflight_bytes
                                 or config["max_inflight_bytes"], arena=arena)

    def leave_session():
        # The daemon session ends (offload="auto" moved the optimizer to the GPU, or
        # unwrap): activation pages move to pinned process memory. Left in the session's
        # regions they would outlive its budget and, unregistered, copy at pageable speed.
        # Copies into the old pages finish first (replace_arena drains them).
        in_flight = offloader.replace_arena(HostArena(offloader.engine.host_empty,
                                                      chunk_bytes=chunk_bytes))
        for address in registered:
            C().unregister_host(address)
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
                       grad_sink=opt.accept_grad, host_home=opt.host_home,
                       before_read=opt.weights_ready,
                       min_paged_bytes=config["min_offload_bytes"])
    attention = AttentionSelector(config["attention"], prepared.device, session.event)
    pager.attention_context = attention.context
    # The daemon's AdamW takes a paged weight's gradient (accept_grad); the GPU and
    # local modes update weights on the device, so resident trained blocks stay there.
    pager.can_page_trained = lambda: opt.optimizer_mode == "cpu"
    session.pager, session.attention = pager, attention
    return pager


def adapt(model: nn.Module, opt, session, prepared: Prepared) -> None:
    """Installs the memory controller (memory/controller.py): a forward pre-hook that,
    every training step, refreshes the attention choice, reads the last step's peak and
    moves blocks between keeping, paging and recomputing their activations, and weight
    blocks between residence and paging. Nothing when nothing streams."""
    pager, attention = session.pager, session.attention
    if pager is None:
        return
    plan = prepared.plan
    controller = MemoryController(session, pager, plan, session.config,
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
            controller.on_forward(module, args)
        # Every forward, evaluation too: a prefetch left by a forward that raised before
        # its first block must not serve a later forward after the weights changed.
        pager.begin_forward()
    def after_forward(module, args, output):
        if getattr(module, "_trainstream_session", None) is session:
            controller.on_forward_end()
    session.controller = controller
    session.hooks.append(model.register_forward_pre_hook(before_forward))
    session.hooks.append(model.register_forward_hook(after_forward))


def _session_chunk(opt, nbytes: int, regions: List[Any], registered: List[int],
                   cuda: bool) -> torch.Tensor:
    """Activation pages in a shared-memory region of the daemon session (registered
    with CUDA); pinned process memory when the daemon's budget refuses."""
    try:
        region = opt.allocate_region(nbytes, "activations")
    except Exception:  # noqa: BLE001 (budget refused: fall back, still pinned)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    regions.append(region)
    if cuda:
        ok, _ = register_fresh(region.base_address, region.segment_size)  # False without CUDA
        if ok:
            registered.append(region.base_address)
    return C().tensor_from_address(region.address, [nbytes], "uint8")


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
    plan, pager, controller = session.plan, session.pager, session.controller
    out: Dict[str, Any] = {"plan": dict(plan.as_dict() if plan else {}, adapting=session.adapting)}
    out["params"] = pager.report() if pager is not None else {"paged_blocks": []}
    act: Dict[str, Any] = {}
    if pager is not None:
        act["policy"] = controller.policies() if controller is not None else {}
        if pager.offloader is not None:
            act.update(pager.offloader.stats)
            act["host_capacity_bytes"] = pager.offloader._arena.capacity
        if controller is not None:
            act["steps"] = list(controller.history)
    out["activations"] = act
    out["attention"] = selector_report(session.attention)
    return out
