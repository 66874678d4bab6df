"""The memory planner: what stays on the device, what pages, in which precision.

``plan(summary, capacity, config)`` is a pure function of three things, so it can be
tested with any capacity (``tests/python/test_planner.py``):

* ``ModelSummary``: the bytes of every block of the block stack (trained and frozen
  tensors, what quantizing the frozen linear weights would leave) and of everything
  outside it, read from the model's tensors (a model on the ``meta`` device works,
  so a model too big to build can be planned and refused);
* ``Capacity``: usable device memory (``vram_limit`` or the free memory, less
  ``vram_headroom``), available host RAM, the daemon's free budget and PCIe H2D
  bandwidth (``profile_hardware``);
* the validated options.

Device memory model (bytes that are live at the peak of a step):
  outside the blocks: weights + gradients of trained tensors;
  a resident block: weights + gradients of trained tensors;
  paging: (prefetch_depth + 2) blocks of paged weights in flight and in use, one
  block of trained gradients on their way to the host, plus every paged block's
  small resident tensors (and their gradients);
  activations: unknown until a step has run, so ``ACTIVATION_RESERVE`` of the
  usable memory is set aside for them at wrap(); the first steps then measure
  (the memory controller, controller.py) and move blocks. Paged activations hold device
  memory until their copy ends: copies in flight each way are bounded by half the
  reserve (``Plan.max_inflight_bytes``), else a fast forward runs ahead of its D2H
  copies and holds every paged block's activations at once.
Host memory model: per trained element the daemon's two moments, what its master takes
beyond the weight slot (``master_state_bytes``: nothing for an fp32 weight, whose slot is
the master; 2 B for bf16, the low halves; 4 B for fp16), a weight slot in the
parameter's dtype, the gradients' staging (a gradient pool, ``optim/grad_pool.py``, or with
clipping or data parallelism a gradient slot per parameter), and the pinned copies of paged
frozen tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from .._native.pinning import registered_host
from ..optim.backend import master_state_bytes
from ..optim.grad_pool import grad_pool_bytes
from ..blocks import chosen_blocks
from .capacity import Capacity, format_bytes as _fmt

ACTIVATION_RESERVE = 0.25
# The smallest bound on activation copies in flight: one copy of a few MiB must go.
MIN_INFLIGHT = 4 << 20
# On CUDA the plan leaves at least this much free whatever vram_headroom says: the
# caching allocator rounds blocks up and fragments, which at small caps outgrows 10%.
CUDA_MIN_HEADROOM = 128 << 20


@dataclass
class BlockSummary:
    trained_bytes: int = 0        # trained tensors at or above min_paged_bytes (pageable)
    trained_numel: int = 0        # every trained element of the block
    small_trained_bytes: int = 0  # trained tensors below min_paged_bytes (stay on the device)
    frozen_bytes: int = 0         # frozen parameters and buffers as stored now
    quantizable_bytes: int = 0    # frozen nn.Linear weights as stored now
    quantized_bytes: int = 0      # the same after quantization (plan.quantize)
    frozen_registered_bytes: int = 0  # frozen tensors already in registered host memory
    # Device copies derived from the weights while the block is resident (QuantLinear's fp8
    # tensor-core copy; Note [The fp8 tensor-core copy lives only with resident weights]):
    # counted resident, never paged, since a paged block builds none.
    derived_bytes: int = 0
    quantized_derived_bytes: int = 0  # the same, added by quantizing (plan.quantize == "fp8")

    def weight_bytes(self, quantize: bool) -> int:
        frozen = self.frozen_bytes - (self.quantizable_bytes - self.quantized_bytes
                                      if quantize else 0)
        return self.trained_bytes + self.small_trained_bytes + frozen + self.derived(quantize)

    def derived(self, quantize: bool) -> int:
        return self.derived_bytes + (self.quantized_derived_bytes if quantize else 0)

    def paged_bytes(self, quantize: bool) -> int:
        return self.weight_bytes(quantize) - self.small_trained_bytes - self.derived(quantize)

    def grad_bytes(self) -> int:
        return self.trained_bytes + self.small_trained_bytes


@dataclass
class ModelSummary:
    blocks: List[BlockSummary]
    outside_bytes: int            # every tensor outside the block stack
    outside_grad_bytes: int       # trained tensors outside the block stack
    trained_numel: int            # every trained element of the model
    trained_bytes: int            # ... in the parameters' dtype
    master_bytes: int             # the daemon's masters beyond the weight slots (master_state_bytes)
    trained_extents: List[int] = field(default_factory=list)  # each trained tensor's bytes


@dataclass
class Plan:
    paged: List[int]
    moment_dtype: str
    quantize: Optional[str]
    activation_offload: Any
    recompute: Any
    device_bytes: Dict[str, int] = field(default_factory=dict)
    host_bytes: Dict[str, int] = field(default_factory=dict)
    usable_vram: Optional[int] = None
    decisions: List[str] = field(default_factory=list)
    pcie_bytes_per_step: int = 0
    max_inflight_bytes: Optional[int] = None  # the activation copies' bound, or no bound


    def as_dict(self) -> Dict[str, Any]:
        return {"paged_blocks": list(self.paged), "moment_dtype": self.moment_dtype,
                "quantize": self.quantize, "activation_offload": self.activation_offload,
                "recompute": self.recompute, "device_bytes": dict(self.device_bytes),
                "host_bytes": dict(self.host_bytes), "usable_vram": self.usable_vram,
                "pcie_bytes_per_step": self.pcie_bytes_per_step,
                "max_inflight_bytes": self.max_inflight_bytes,
                "decisions": list(self.decisions)}


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def summarize(model: nn.Module, blocks: Sequence[nn.Module], min_paged_bytes: int,
              quant_format: Optional[str] = "nf4", quant_block_size: int = 64,
              device=None, fp8_matmul: str = "auto") -> ModelSummary:
    """Reads the sizes the planner needs from the model's tensors (no data touched);
    ``device``: where it trains (what quantized linears derive there when resident);
    ``fp8_matmul``: the option (no tensor-core copy is derived with 'dequantize')."""
    from ..frozen.quantization import _quantized_bytes, fp8_copy_bytes
    from ..streaming.weights import tensor_core_bytes
    in_blocks = set()
    out: List[BlockSummary] = []
    for block in blocks:
        b = BlockSummary()
        if device is not None:
            b.derived_bytes = tensor_core_bytes(block, device)
        linear_weights = {id(m.weight) for m in block.modules() if isinstance(m, nn.Linear)}
        if device is not None and quant_format == "fp8":
            b.quantized_derived_bytes = sum(
                fp8_copy_bytes(m.out_features, m.in_features, torch.device(device),
                               mode=fp8_matmul)
                for m in block.modules()
                if isinstance(m, nn.Linear) and not m.weight.requires_grad)
        for p in block.parameters():
            in_blocks.add(id(p))
            n = _nbytes(p)
            if p.requires_grad:
                b.trained_numel += p.numel()
                if n >= min_paged_bytes:
                    b.trained_bytes += n
                else:
                    b.small_trained_bytes += n
            else:
                b.frozen_bytes += n
                if registered_host(p.data):
                    b.frozen_registered_bytes += n
                if id(p) in linear_weights:
                    b.quantizable_bytes += n
                    b.quantized_bytes += _quantized_bytes(quant_format or "nf4", p.numel(),
                                                          quant_block_size)
        for m in block.modules():
            for buf in m.buffers(recurse=False):
                in_blocks.add(id(buf))
                b.frozen_bytes += _nbytes(buf)
                if registered_host(buf):
                    b.frozen_registered_bytes += _nbytes(buf)
        out.append(b)
    outside = outside_grad = trained_numel = trained_bytes = master_bytes = 0
    extents: List[int] = []
    seen = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.requires_grad:
            trained_numel += p.numel()
            trained_bytes += _nbytes(p)
            extents.append(_nbytes(p))
            master_bytes += master_state_bytes(p)
        if id(p) not in in_blocks:
            outside += _nbytes(p)
            if p.requires_grad:
                outside_grad += _nbytes(p)
    for buf in model.buffers():
        if id(buf) not in in_blocks:
            outside += _nbytes(buf)
    return ModelSummary(out, outside, outside_grad, trained_numel, trained_bytes, master_bytes,
                        extents)


def _chosen(option, n: int) -> Optional[List[int]]:
    """Block indices an explicit param_offload / recompute value names (None: 'auto')."""
    return chosen_blocks(option, n)


def _by_category(d: Dict[str, int], per: int = 0) -> str:
    """"name 1.2 GiB, ..." of the non-zero categories; with ``per`` (trained parameters)
    each also as bytes per trained parameter."""
    def one(k, v):
        return f"{k} {_fmt(v)}" + (f" = {v / per:.2f} B/param" if per else "")
    return ", ".join(one(k, v) for k, v in d.items() if v)


def plan(summary: ModelSummary, capacity: Capacity, config: Dict[str, Any]) -> Plan:
    """Decides paged blocks, moment precision and quantization; raises MemoryError
    (with the numbers, by category) when nothing fits and ``check_memory`` is on."""
    n = len(summary.blocks)
    decisions: List[str] = []
    check = config["check_memory"]
    depth = config["prefetch_depth"]

    # ---- host side: moments, slots, pinned frozen weights
    pool = grad_pool_bytes(summary.trained_extents, config.get("grad_pool", "auto"),
                           config.get("max_grad_norm"), config.get("distributed") is True)
    grads = ("gradient pool", pool) if pool else (
        "gradient slots" + (" (max_grad_norm holds a whole step)"
                            if config.get("max_grad_norm") is not None else ""),
        summary.trained_bytes)

    def host_need(moment_bytes: int, quantize: bool, paged: Sequence[int]) -> Dict[str, int]:
        # Frozen tensors already in registered host memory (a shared base) page from
        # there and need no new host memory, unless the plan quantizes them.
        frozen = 0
        for i in paged:
            b = summary.blocks[i]
            reused = 0 if quantize else b.frozen_registered_bytes
            frozen += max(0, b.paged_bytes(quantize) - b.trained_bytes - reused)
        return {"daemon masters beyond the weight slots": summary.master_bytes,
                f"daemon moments ({'bf16' if moment_bytes == 2 else 'fp32'})":
                    2 * moment_bytes * summary.trained_numel,
                "weight slots": summary.trained_bytes,
                grads[0]: grads[1],
                "pinned frozen weights of paged blocks": frozen}

    quant_opt = config["quantize"]
    prefer = config["prefer"]
    frozen_quantizable = sum(b.quantizable_bytes for b in summary.blocks)
    quantize: Optional[str] = quant_opt if quant_opt not in ("auto", None) else None

    # ---- device side
    usable = None
    if capacity.vram_bytes is not None:
        usable = int(capacity.vram_bytes * (1.0 - config["vram_headroom"]))
        if capacity.device.startswith("cuda"):
            usable = max(0, min(usable, capacity.vram_bytes - CUDA_MIN_HEADROOM))

    def device_need(paged: Sequence[int], q: bool) -> Dict[str, int]:
        resident = [i for i in range(n) if i not in paged]
        blocks = summary.blocks
        transient = 0
        if paged:
            biggest = max(blocks[i].paged_bytes(q) for i in paged)
            grads = max(blocks[i].trained_bytes for i in paged)
            transient = (depth + 2) * biggest + grads
        return {
            "weights outside the blocks": summary.outside_bytes,
            "gradients outside the blocks": summary.outside_grad_bytes,
            "resident blocks (weights + gradients)":
                sum(blocks[i].weight_bytes(q) + blocks[i].grad_bytes() for i in resident),
            "paged blocks' resident small tensors (+ gradients)":
                sum(2 * blocks[i].small_trained_bytes for i in paged),
            "paged weights in flight": transient,
        }

    wanted = _chosen(config["param_offload"], n)
    q_now = quantize is not None
    if usable is None:
        paged = wanted or []
        if wanted is None:
            decisions.append("no device memory limit known: every block stays resident")
    else:
        reserve = int(usable * ACTIVATION_RESERVE)
        budget = usable - reserve
        if wanted is not None:
            paged = wanted
        else:
            paged = []
            # Page from the first block on: backward starts at the last blocks, which
            # stay resident and give the prefetch of the paged ones time.
            while sum(device_need(paged, q_now).values()) > budget and len(paged) < n:
                paged.append(len(paged))
            if (quant_opt == "auto" and frozen_quantizable and paged and prefer == "speed"
                    and not q_now):
                quantize, q_now = "nf4", True
                decisions.append("quantize='auto', prefer='speed': frozen linear weights of "
                                 "the blocks to NF4 (fewer bytes to page)")
                paged = []
                while sum(device_need(paged, q_now).values()) > budget and len(paged) < n:
                    paged.append(len(paged))
            decisions.append(f"param_offload='auto': {len(paged)} of {n} blocks paged "
                             f"(resident budget {_fmt(budget)} = usable {_fmt(usable)} less "
                             f"{ACTIVATION_RESERVE:.0%} kept for activations)")
        need = device_need(paged, q_now)
        if sum(need.values()) > usable and check:
            raise MemoryError(
                f"trainstream: the model does not fit on {capacity.device}: needs "
                f"{_fmt(sum(need.values()))} with {len(paged)} of {n} blocks paged "
                f"({_by_category(need)}), usable {_fmt(usable)} ({capacity.source}, "
                f"vram_headroom={config['vram_headroom']}"
                + (f", at least {_fmt(CUDA_MIN_HEADROOM)} on CUDA"
                   if capacity.device.startswith("cuda") else "") + "). Options: a larger "
                "vram_limit, "
                + ("param_offload=True, " if len(paged) < n else "")
                + ("quantize='nf4' for a frozen base, " if frozen_quantizable and not q_now
                   else "")
                + "a smaller model; check_memory=False skips this check")

    # ---- moments and host memory
    moment_opt = config["moment_dtype"]
    host_limit = capacity.ram_available
    if capacity.daemon_free is not None:
        host_limit = min(host_limit, capacity.daemon_free)
    moment_bytes = 2 if moment_opt == "bfloat16" else 4
    need_host = host_need(moment_bytes, q_now, paged)
    if moment_opt == "auto":
        if sum(need_host.values()) > host_limit:
            moment_bytes = 2
            need_host = host_need(2, q_now, paged)
            decisions.append("moment_dtype='auto': bf16 moments (fp32 ones would not fit in "
                             f"{_fmt(host_limit)} of host memory)")
        else:
            decisions.append("moment_dtype='auto': fp32 moments")
    if (sum(need_host.values()) > host_limit and quant_opt == "auto" and not q_now
            and frozen_quantizable and paged):
        q_try = host_need(moment_bytes, True, paged)
        if sum(q_try.values()) <= host_limit:
            quantize, q_now, need_host = "nf4", True, q_try
            decisions.append("quantize='auto': frozen linear weights of the blocks to NF4 "
                             "(the pinned bf16 copies would not fit in host memory)")
    if sum(need_host.values()) > host_limit and check:
        where = (f"available RAM {_fmt(capacity.ram_available)}" +
                 (f", daemon budget free {_fmt(capacity.daemon_free)}"
                  if capacity.daemon_free is not None else ""))
        per = summary.trained_numel
        total = sum(need_host.values())
        raise MemoryError(
            f"trainstream: host memory does not fit: needs {_fmt(total)}"
            + (f" = {total / per:.2f} B per trained parameter ({per:,})" if per else "")
            + f" ({_by_category(need_host, per)}), {where}. Options: "
            + ("moment_dtype='bfloat16', " if moment_bytes == 4 else "")
            + ("quantize='nf4' for a frozen base, "
               if frozen_quantizable and not q_now and paged and quant_opt != "auto" else "")
            + "a larger daemon --budget, fewer trained parameters (LoRA); check_memory=False "
            "skips this check")
    if quantize is not None and not any(d.startswith("quantize") for d in decisions):
        decisions.append(f"quantize={quantize!r}: frozen linear weights of the blocks")

    pcie = 0
    for i in paged:
        b = summary.blocks[i]
        pcie += 2 * b.paged_bytes(q_now) + b.trained_bytes  # H2D fwd + bwd, grads D2H
    inflight = None
    if usable is not None:
        inflight = min(config["max_inflight_bytes"],
                       max(MIN_INFLIGHT, int(usable * ACTIVATION_RESERVE) // 2))
        if inflight < config["max_inflight_bytes"]:
            decisions.append(f"max_inflight_bytes: {_fmt(inflight)} (half the activation "
                             "reserve: paged activations hold device memory until copied)")
    return Plan(paged=list(paged), moment_dtype="bfloat16" if moment_bytes == 2 else "float32",
                quantize=quantize, activation_offload=config["activation_offload"],
                recompute=config["recompute"],
                device_bytes=device_need(paged, q_now) if usable is not None else {},
                host_bytes=need_host, usable_vram=usable, decisions=decisions,
                pcie_bytes_per_step=pcie, max_inflight_bytes=inflight)
