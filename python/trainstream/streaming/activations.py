"""ActivationOffloader: activation paging of a block stack, without the rest of TrainStream.

    offloader = trainstream.ActivationOffloader(model, trainstream.find_blocks(model))
    for x, y in loader:                  # an ordinary loop; nothing else changes
        model(x, y).backward()
        ...
    offloader.remove()

Each block's activations are kept on the device, paged to host memory (the
``SavedTensorPager`` of saved_tensors.py, on the copy streams) or recomputed in
backward (``torch.utils.checkpoint``), per ``.policy``. With ``offload="auto"`` the
policy is searched from measured step times (activation_tuner.py); ``.events`` logs
the search and ``.decision`` holds where it settled. Without ``blocks`` it is the
plain pager: used as a context manager, it pages every saved tensor in its scope
(what wrap()'s ``BlockPager`` enters around a block whose policy is "offload").

On a CPU "device" paging copies into a host arena synchronously: the same code runs,
exactly, which is what CI checks; the step times it tunes on are then the CPU's.
"""
from __future__ import annotations

import numbers
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from ..blocks import chosen_blocks
from .activation_tuner import OffloadTuner
from .saved_tensors import HostArena, SavedTensorPager
from .weights import KEEP, OFFLOAD, RECOMPUTE, BlockPager, in_backward

__all__ = ["ActivationOffloader", "HostArena", "SavedTensorPager"]

# The standalone class's defaults (docs/inspection.md, "ActivationOffloader"). Paging inside wrap()
# takes wrap()'s options instead (options.py).
DEFAULTS = {"min_bytes": 1 << 20, "prefetch_depth": 1, "calibrate_steps": 3,
            "max_slowdown": 0.15, "tune_window": 3, "max_inflight_bytes": 1 << 30}


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"ActivationOffloader({name}={value!r}) is not accepted; accepted: an "
                         f"integer >= {low}")


def _block_choice(name: str, value: Any, n: int, allow_list: bool = True) -> Optional[List[int]]:
    """The blocks ``offload`` / ``recompute`` names (None: "auto"), or ValueError."""
    ok = (isinstance(value, str) and value == "auto") or isinstance(value, bool) or (
        isinstance(value, numbers.Real) and 0.0 <= value <= 1.0) or (
        allow_list and isinstance(value, (list, tuple, set, frozenset))
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value))
    if not ok:
        raise ValueError(f"ActivationOffloader({name}={value!r}) is not accepted; accepted: "
                         "'auto', True, False, a fraction in [0, 1] of the blocks, or a list or "
                         "set of block indices")
    try:
        return chosen_blocks(value, n)
    except ValueError as e:
        raise ValueError(f"ActivationOffloader({name}={value!r}): {e}") from None


class ActivationOffloader(SavedTensorPager):
    """Pages (or recomputes) the activations of ``blocks`` of ``model``; see the module
    docstring and docs/inspection.md ("ActivationOffloader") for the arguments. ``remove()`` gives
    the blocks their own forward back and frees the host memory.

    ``min_offload_bytes`` is the name wrap()'s option gives ``min_bytes`` (either is
    accepted); ``device`` and ``arena`` are for wrap()'s use."""

    def __init__(self, model: Optional[nn.Module] = None,
                 blocks: Optional[Sequence[nn.Module]] = None, offload: Any = "auto", *,
                 min_bytes: Optional[int] = None, prefetch_depth: int = DEFAULTS["prefetch_depth"],
                 calibrate_steps: int = DEFAULTS["calibrate_steps"], profile: Any = None,
                 max_slowdown: float = DEFAULTS["max_slowdown"],
                 tune_window: int = DEFAULTS["tune_window"],
                 max_inflight_bytes: int = DEFAULTS["max_inflight_bytes"],
                 recompute: Any = "auto", reserved_link_bytes=(0, 0),
                 memory_pressure: bool = False, vram_target: Optional[int] = None,
                 device=None, arena: Optional[HostArena] = None,
                 min_offload_bytes: Optional[int] = None):
        if min_bytes is not None and min_offload_bytes is not None and min_bytes != min_offload_bytes:
            raise ValueError(f"ActivationOffloader: min_bytes={min_bytes!r} and "
                             f"min_offload_bytes={min_offload_bytes!r} are one setting; pass one")
        name = "min_offload_bytes" if min_offload_bytes is not None else "min_bytes"
        size = min_offload_bytes if min_offload_bytes is not None else min_bytes
        size = DEFAULTS["min_bytes"] if size is None else size
        _int_at_least(name, size, 0)
        _int_at_least("prefetch_depth", prefetch_depth, 1)
        _int_at_least("max_inflight_bytes", max_inflight_bytes, 1)
        _int_at_least("calibrate_steps", calibrate_steps, 2)
        _int_at_least("tune_window", tune_window, 1)
        if isinstance(max_slowdown, bool) or not isinstance(max_slowdown, numbers.Real) \
                or max_slowdown < 0:
            raise ValueError(f"ActivationOffloader(max_slowdown={max_slowdown!r}) is not "
                             "accepted; accepted: a number >= 0 (0.15: 15% slower)")
        if not (isinstance(reserved_link_bytes, (tuple, list)) and len(reserved_link_bytes) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b >= 0
                        for b in reserved_link_bytes)):
            raise ValueError(f"ActivationOffloader(reserved_link_bytes={reserved_link_bytes!r}) "
                             "is not accepted; accepted: (d2h bytes, h2d bytes) per step, "
                             "integers >= 0")
        if not isinstance(memory_pressure, bool):
            raise ValueError(f"ActivationOffloader(memory_pressure={memory_pressure!r}) is not "
                             "accepted; accepted: True or False")
        if vram_target is not None and (isinstance(vram_target, bool)
                                        or not isinstance(vram_target, int) or vram_target < 1):
            raise ValueError(f"ActivationOffloader(vram_target={vram_target!r}) is not accepted; "
                             "accepted: None or a number of bytes >= 1")
        if profile is not None and not callable(getattr(profile, "get", None)):
            raise ValueError(f"ActivationOffloader(profile={profile!r}) is not accepted; "
                             "accepted: None or a HardwareProfile (trainstream.profile_hardware())")
        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"ActivationOffloader(model=...): a torch.nn.Module or None, got "
                             f"{type(model).__name__}")
        super().__init__(model, device=device, min_offload_bytes=size,
                         prefetch_depth=prefetch_depth, max_inflight_bytes=max_inflight_bytes,
                         arena=arena)
        self.min_bytes = size
        self.profile = profile
        self.reserved_link_bytes = tuple(reserved_link_bytes)
        self.memory_pressure = memory_pressure
        self.vram_target = vram_target
        self.events: List[Dict[str, Any]] = []
        self.decision: Dict[str, Any] = {}
        self.pager: Optional[BlockPager] = None
        self.tuner: Optional[OffloadTuner] = None
        self._handles: List[Any] = []
        self._t_start: Optional[float] = None
        self._counting: List[Any] = []
        self._saved_bytes: List[int] = []  # per block, counted while calibrating
        if blocks is None:
            if not (offload == "auto" or offload is True) or recompute not in ("auto", False):
                raise ValueError("ActivationOffloader: offload and recompute choose among "
                                 "blocks; pass blocks= (trainstream.find_blocks(model))")
            return
        self._install(model, list(blocks), offload, recompute, calibrate_steps, tune_window,
                      max_slowdown)

    # ----------------------------------------------------------------- setup
    def _install(self, model, blocks, offload, recompute, calibrate_steps, tune_window,
                 max_slowdown) -> None:
        if model is None:
            raise ValueError("ActivationOffloader(blocks=...) needs the model whose forward "
                             "the blocks run in (its step boundaries)")
        if not blocks or not all(isinstance(b, nn.Module) for b in blocks):
            raise ValueError("ActivationOffloader(blocks=...): a non-empty list of the model's "
                             "layer modules (trainstream.find_blocks(model))")
        inside = {id(m) for m in model.modules()}
        if any(id(b) not in inside for b in blocks):
            raise ValueError("ActivationOffloader(blocks=...): every block must be a submodule "
                             "of model")
        n = len(blocks)
        offloaded = _block_choice("offload", offload, n)
        recomputed = _block_choice("recompute", recompute, n)
        rec = set(recomputed or [])
        trial = recompute == "auto" and self.memory_pressure
        policy = [RECOMPUTE if i in rec else
                  OFFLOAD if offloaded is not None and i in offloaded else KEEP for i in range(n)]
        self.pager = BlockPager(blocks, self.engine.device, policy=policy,
                                prefetch_depth=self.prefetch_depth, offloader=self,
                                min_paged_bytes=self.min_bytes)
        self.decision = {"offload": offload, "recompute": recompute, "settled": offloaded is not None,
                         "offloaded_blocks": [i for i, p in enumerate(policy) if p == OFFLOAD],
                         "recompute_blocks": sorted(rec)}
        if offloaded is not None:
            self.event("plan", why=f"offload={offload!r}, recompute={recompute!r}")
            return
        self._saved_bytes = [0] * n
        self.tuner = OffloadTuner(
            n, calibrate_steps=calibrate_steps, tune_window=tune_window,
            max_slowdown=max_slowdown, first_guess=self._first_guess, recompute_trial=trial,
            vram_target=self.vram_target if self.engine.cuda else None)
        self._free = [i for i in range(n) if i not in rec]  # blocks the search may page
        self._handles.append(model.register_forward_pre_hook(self._before_forward))
        for i, b in enumerate(blocks):  # calibration counts what each block saves
            self._handles.append(b.register_forward_pre_hook(
                lambda m, a, i=i: self._count_enter(i)))
            self._handles.append(b.register_forward_hook(
                lambda m, a, o: self._count_exit(), always_call=True))
        self.event("plan", why=f"calibration: nothing paged for {calibrate_steps} steps")

    def event(self, kind: str, **details) -> None:
        self.events.append({"time": time.time(), "kind": kind, "policy": self.policy, **details})

    @property
    def policy(self) -> List[str]:
        """Per block: "keep", "offload" or "recompute" (empty without blocks)."""
        return list(self.pager.policy) if self.pager is not None else []

    @property
    def adapting(self) -> bool:
        """True while offload="auto" is still searching."""
        return self.tuner is not None and not self.tuner.settled

    # ------------------------------------------------------------ calibration
    def _count_enter(self, i: int) -> None:
        if self.tuner is None or self.tuner.phase != "calibrate" or not torch.is_grad_enabled() \
                or in_backward():
            return

        def pack(t):
            if self.wants(t):
                self._saved_bytes[i] += t.numel() * t.element_size()
            return t.detach()  # as BlockPager._pack: no cycle through the saving node
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        hooks.__enter__()
        self._counting.append(hooks)

    def _count_exit(self) -> None:
        if self._counting:
            self._counting.pop().__exit__(None, None, None)

    def _first_guess(self, baseline_s: float) -> int:
        """Blocks the link carries within the allowed slowdown, from the profile's
        bandwidths and what calibration saw each block save; every free block without a
        profile (or with no GPU figures in it)."""
        free = len(self._free)
        h2d, d2h = (self.profile.get("h2d_gb_s") if self.profile is not None else None,
                    self.profile.get("d2h_gb_s") if self.profile is not None else None)
        steps = max(1, self.tuner.calibrate_steps)
        per_block = max(self._saved_bytes[i] for i in self._free) / steps if self._free else 0
        if not (h2d and d2h) or per_block == 0:
            return free
        # Copies overlap compute: the step hides up to its own duration of link time.
        budget = baseline_s * (1 + self.tuner.max_slowdown) \
            - self.reserved_link_bytes[0] / (d2h * 1e9) - self.reserved_link_bytes[1] / (h2d * 1e9)
        per_block_s = per_block / (d2h * 1e9) + per_block / (h2d * 1e9)
        return max(0, min(free, int(budget // per_block_s)))

    # -------------------------------------------------------------- each step
    def _before_forward(self, module, args) -> None:
        """Model forward pre-hook: one training step ended and the next begins."""
        if not torch.is_grad_enabled() or in_backward() or self.tuner is None \
                or self.tuner.settled:
            return
        cuda = self.engine.cuda
        if cuda:
            torch.cuda.synchronize(self.engine.device)
        now = time.perf_counter()
        if self._t_start is not None:
            peak = torch.cuda.max_memory_allocated(self.engine.device) if cuda else None
            changed = self.tuner.observe(now - self._t_start, peak)
            if changed is not None:
                self._apply()
                self.event("tune" if not self.tuner.settled else "settled", why=changed)
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.engine.device)
        self._t_start = now

    def _apply(self) -> None:
        """The tuner's setting on the blocks: the first ``count`` free blocks page (or
        recompute, in the trial), the other free blocks keep."""
        t = self.tuner
        paging = set(self._free[:t.count])
        for i in self._free:
            self.pager.set_policy(i, (RECOMPUTE if t.recompute else OFFLOAD) if i in paging
                                  else KEEP)
        self.decision.update(
            settled=t.settled, baseline_s=t.baseline_s, history=list(t.history), why=t.why,
            activation_bytes_per_block=list(self._saved_bytes),
            offloaded_blocks=[i for i, p in enumerate(self.policy) if p == OFFLOAD],
            recompute_blocks=[i for i, p in enumerate(self.policy) if p == RECOMPUTE])

    # ------------------------------------------------------------------ end
    def remove(self) -> None:
        """Takes the offloader off: hooks removed, each block's own forward back, host
        memory freed (pages a graph still holds stay valid until its backward)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        while self._counting:
            self._count_exit()
        if self.pager is not None:
            self.pager.remove()
        super().remove()
