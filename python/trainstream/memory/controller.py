"""The planner's runtime half: measured peaks set the activation policy and move blocks.

wrap() plans weights before any step has run; activations depend on the batch, so
they are decided from measurements:

1. Calibration (first training forward): with ``activation_offload="auto"`` every
   block pages its activations, so calibration itself cannot overcommit the device.
   The step's peak and the bytes each block saved are measured.
2. Second forward: the last blocks keep their activations, as many as the measured
   room allows (backward reads them first, so paging them would gain least); the
   others page. If paging them would cost more than ``max_activation_slowdown`` of
   the step at the measured PCIe bandwidth and ``recompute="auto"``, the excess
   blocks recompute instead.
3. Later steps: a peak above the usable memory moves a kept block to paging (or a
   resident weight block to paged). A peak well below it moves paged blocks back to
   keeping their activations (the calibration's per-block figure is an estimate, and
   every block kept is PCIe traffic saved), and once none pages, paged weight blocks
   back to residence; at most ``LOOSEN_ROUNDS`` times and never after a step went
   over. Two steps in a row within the usable memory, with nothing moved, settle the
   plan (``session.adapting`` becomes False). After that a watchdog
   moves blocks out if a later step grows.
4. Before settling with ``recompute="auto"``, blocks still paging their activations are
   tried with recompute for ``TRIAL_STEPS`` steps, if the room left holds one block's
   activations; the faster of the two measured (best step of each, recompute needing
   ``TRIAL_MARGIN`` less time) is kept.

Every decision is an event in ``memory_report(model)["events"]``. Adaptation needs
measured peaks, so it runs on CUDA devices; elsewhere the policy is the static one.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional

import torch

from ..streaming.weights import KEEP, OFFLOAD, RECOMPUTE, BlockPager, in_backward
from .planner import Plan, _chosen, _fmt

SETTLE_STEPS = 2
# Moving blocks back in spends at most this share of the measured room per step (the
# next step's peak is measured, not predicted), in at most LOOSEN_ROUNDS steps.
LOOSEN_SHARE = 0.5
LOOSEN_ROUNDS = 3
# The recompute trial: steps measured with the paging blocks recomputing instead, and
# the share of the paging steps' time recompute must save to be chosen (noise).
TRIAL_STEPS = 2
TRIAL_MARGIN = 0.03


class MemoryController:
    def __init__(self, session, pager: BlockPager, plan: Plan, config: Dict[str, Any],
                 h2d_gb_s: float, between_steps: Optional[Callable[[], bool]] = None):
        self.session = session
        self.pager = pager
        # Whether no gradient of a step is pending (not between the micro-batches of an
        # accumulated step): only then may weight blocks move between host and device,
        # since a move changes the path a weight's gradient takes.
        self.between_steps = between_steps or (lambda: True)
        self.plan = plan
        self.config = config
        self.h2d_gb_s = h2d_gb_s or 0.0
        self.n = len(pager.blocks)
        self.measure = pager.engine.cuda and plan.usable_vram is not None
        self.step = 0
        self.stable = 0
        self.settled = False
        self.t_start: Optional[float] = None
        self.offloaded_at_start = 0
        self.act_per_block = 0
        self.loosen_rounds = 0
        self.went_over = False  # a step's peak exceeded the usable memory
        self.trial: Optional[Dict[str, Any]] = None  # the recompute trial under way
        self.trial_done = False
        self.history: List[Dict[str, Any]] = []
        self.forward_end_bytes = 0  # allocated at the end of this step's forward
        self._static_policy()

    # -------------------------------------------------------------- policies
    def _static_policy(self) -> None:
        act = self.config["activation_offload"]
        rec = _chosen(self.config["recompute"], self.n) or []
        calibrate = act == "auto" and self.measure
        if act == "auto":
            offload = list(range(self.n)) if calibrate else []
        else:
            offload = _chosen(act, self.n)
        for i in range(self.n):
            policy = RECOMPUTE if i in rec else OFFLOAD if i in offload else KEEP
            self.pager.set_policy(i, policy)
        self.session.adapting = calibrate
        self.session.event("plan", what="activations", policy=self.policies(),
                           why="calibration: every block pages its activations" if calibrate
                           else f"activation_offload={act!r}, recompute={self.config['recompute']!r}")

    def policies(self) -> Dict[str, List[int]]:
        out = {KEEP: [], OFFLOAD: [], RECOMPUTE: []}
        for i, p in enumerate(self.pager.policy):
            out[p].append(i)
        return out

    # ------------------------------------------------------------ each step
    def on_forward(self, module, args) -> None:
        """Model forward pre-hook: runs once per training step, before block 0."""
        if not torch.is_grad_enabled() or in_backward() or not self.measure:
            return
        # Step times count while adapting (calibration weighs paging against the step).
        # Once settled the watchdog needs only the peak, which the allocator knows without
        # waiting for the device: the next step is queued while this one still runs.
        synced = not self.settled
        now = self._sync_time() if synced else time.perf_counter()
        if self.t_start is not None:
            peak = torch.cuda.max_memory_allocated(self.pager.device)
            offloaded = self._offloaded() - self.offloaded_at_start
            self.history.append({"step": self.step, "peak": peak,
                                 "seconds": now - self.t_start if synced else None,
                                 "activation_bytes_paged": offloaded})
            if peak < self.forward_end_bytes:
                # Note [A peak counter reset by someone else]
                self.session.event(
                    "plan", what="not measured", peak=peak,
                    why=f"step {self.step}: CUDA's peak counter reads {_fmt(peak)}, less than "
                        f"the {_fmt(self.forward_end_bytes)} allocated when its forward "
                        "ended: torch.cuda.reset_peak_memory_stats() was called during the "
                        "step outside TrainStream, so the step decides nothing")
                self.stable = 0
            else:
                self._decide(peak, now - self.t_start, offloaded)
            self.step += 1
        torch.cuda.reset_peak_memory_stats(self.pager.device)
        self.forward_end_bytes = 0
        self.t_start = now
        self.offloaded_at_start = self._offloaded()

    # Note [A peak counter reset by someone else]
    # Each step's peak is CUDA's max_memory_allocated since the controller reset it at
    # the step's first forward. Code that resets the counter in between (a benchmark's
    # timer at the end of its warm-up, a profiler) makes the step look nearly empty: on
    # the H200 a Trainer run read such a step, loosened the plan by several GiB and ran
    # out of memory in the next backward. The allocation at the end of the forward (a
    # forward hook, host counters only: no sync) is a floor of the true peak; a counter
    # below it was reset, and that step is not used.
    def on_forward_end(self) -> None:
        """Model forward hook: the bytes allocated once the forward is done."""
        if self.measure and torch.is_grad_enabled() and not in_backward():
            self.forward_end_bytes = max(self.forward_end_bytes,
                                         torch.cuda.memory_allocated(self.pager.device))

    def _sync_time(self) -> float:
        torch.cuda.synchronize(self.pager.device)
        return time.perf_counter()

    def _offloaded(self) -> int:
        off = self.pager.offloader
        return off.stats["bytes_offloaded"] if off is not None else 0

    def _decide(self, peak: int, seconds: float, offloaded: int) -> None:
        usable = self.plan.usable_vram
        ev = self.session.event
        if self.step == 0 and self.config["activation_offload"] == "auto":
            paging_blocks = [i for i, p in enumerate(self.pager.policy) if p == OFFLOAD]
            self.act_per_block = offloaded // max(1, len(paging_blocks))
            room = usable - peak
            keep = 0 if self.act_per_block == 0 else int(0.9 * room // self.act_per_block)
            keep = max(0, min(keep, len(paging_blocks)))
            if self.act_per_block == 0:
                keep = len(paging_blocks)
            kept = paging_blocks[len(paging_blocks) - keep:] if keep else []
            for i in kept:
                self.pager.set_policy(i, KEEP)
            paged = [i for i in paging_blocks if i not in kept]
            why = (f"calibration step: peak {_fmt(peak)} of usable {_fmt(usable)} with every "
                   f"block paged; {self.act_per_block / 2**20:.1f} MiB of activations per block")
            # Paging costs a D2H and an H2D per byte; what the step cannot hide is the excess
            # over its own duration.
            paging_s = 2 * self.act_per_block * len(paged) / (self.h2d_gb_s * 1e9) \
                if self.h2d_gb_s else 0.0
            allowed = self.config["max_activation_slowdown"] * seconds
            if self.config["recompute"] == "auto" and paging_s > seconds + allowed and paged:
                per_block = paging_s / len(paged)
                excess = paging_s - seconds - allowed
                count = min(len(paged), int(excess // per_block) + 1)
                for i in paged[:count]:
                    self.pager.set_policy(i, RECOMPUTE)
                why += (f"; paging {len(paged)} blocks would take {paging_s:.3f} s against a "
                        f"{seconds:.3f} s step: {count} recompute instead")
            ev("plan", what="activations", policy=self.policies(), why=why)
            return
        if self.trial is not None and self._trial_step(peak, seconds, usable):
            return
        if peak > usable:
            self.stable = 0
            self.went_over = True
            moved = self._tighten()
            kind = "watchdog" if self.settled else "plan"
            ev(kind, what="tighten", peak=peak, usable=usable, moved=moved,
               why=f"step peak {_fmt(peak)} above usable {_fmt(usable)}")
            self.session.adapting = True
            self.settled = False
            return
        if not self.settled and self._loosen(peak, usable):
            self.stable = 0
            return
        self.stable += 1
        if not self.settled and self.stable >= SETTLE_STEPS:
            if self._start_trial(peak, usable):
                return
            self.settled = True
            self.session.adapting = False
            ev("plan", what="settled", peak=peak, usable=usable, policy=self.policies(),
               paged_blocks=list(self.pager.paged),
               why=f"{SETTLE_STEPS} steps within usable memory (peak {_fmt(peak)})")

    def _loosen(self, peak: int, usable: int) -> bool:
        """Spends part of the measured room: first on paging blocks (the last ones:
        backward reads them first), which go back to keeping their activations; once
        none page, on paged weight blocks (the last ones), which go back to residence.
        At most ``LOOSEN_ROUNDS`` rounds, never after a step went over; True if it moved
        anything."""
        if self.went_over or self.loosen_rounds >= LOOSEN_ROUNDS:
            return False
        room = int(LOOSEN_SHARE * (usable - peak))
        paging = [i for i, p in enumerate(self.pager.policy) if p == OFFLOAD]
        moved, why = "", ""
        if paging and self.act_per_block and self.config["activation_offload"] == "auto":
            count = min(len(paging), room // self.act_per_block)
            if count > 0:
                for i in paging[len(paging) - count:]:
                    self.pager.set_policy(i, KEEP)
                moved = f"blocks {paging[len(paging) - count:]} activations: offload -> keep"
                why = f"; {self.act_per_block / 2**20:.1f} MiB of activations per block"
        elif (not paging and self.config["param_offload"] == "auto"
              and self._weights_may_move()):
            brought, spent = [], 0
            for i in sorted(self.pager.paged, reverse=True):
                cost = self.pager.page_in_cost(i)
                if spent + cost > room or not self.pager.page_in(i):
                    break
                spent += cost
                brought.append(i)
            if brought:
                moved = f"blocks {sorted(brought)} weights: paged -> resident"
                why = f"; {spent / len(brought) / 2**20:.1f} MiB a block resident"
        if not moved:
            return False
        self.loosen_rounds += 1
        self.session.event("plan", what="loosen", peak=peak, usable=usable, moved=moved,
                           policy=self.policies(), paged_blocks=list(self.pager.paged),
                           why=f"step peak {_fmt(peak)} leaves {_fmt(usable - peak)} of usable "
                               f"{_fmt(usable)}" + why)
        return True

    def _weights_may_move(self) -> bool:
        """Weight blocks move only between steps (no gradient pending: a move would change
        the path a pending gradient takes) and while no forward's graph still holds
        references to paged weights (a second micro-batch's forward before the first's
        backward): that graph's backward would look for the block where it was."""
        return self.between_steps() and not self.pager.weights_referenced()

    # ------------------------------------------------------------- recompute trial
    def _start_trial(self, peak: int, usable: int) -> bool:
        """Switches the blocks that page their activations to recompute for a trial;
        True if a trial began. The paging steps' times are the last stable steps.
        Recompute brings a block's activations back all at once in backward (paging
        brings them page by page), so the trial needs one block's activations of room:
        a trial step that ran out of memory would end the training, not the trial."""
        if (self.trial_done or self.config["recompute"] != "auto"
                or self.config["activation_offload"] != "auto"):
            return False
        self.trial_done = True
        blocks = [i for i, p in enumerate(self.pager.policy) if p == OFFLOAD]
        timed = [h["seconds"] for h in self.history[-SETTLE_STEPS:] if h["seconds"]]
        if not blocks or not timed:
            return False
        if usable - peak < self.act_per_block:
            self.session.event("plan", what="no trial", policy=self.policies(),
                               why=f"recompute not tried: {_fmt(usable - peak)} of room, less "
                                   f"than one block's activations "
                                   f"({self.act_per_block / 2**20:.1f} MiB)")
            return False
        for i in blocks:
            self.pager.set_policy(i, RECOMPUTE)
        self.trial = {"blocks": blocks, "offload_s": min(timed), "recompute_s": []}
        self.stable = 0
        self.session.event("plan", what="trial", policy=self.policies(),
                           why=f"blocks {blocks} recompute for {TRIAL_STEPS} steps instead of "
                               f"paging their activations (paging: best step {min(timed):.3f} s)")
        return True

    def _trial_step(self, peak: int, seconds: float, usable: int) -> bool:
        """One step of the recompute trial measured; True when it consumed the step."""
        trial = self.trial
        if peak <= usable:
            trial["recompute_s"].append(seconds)
            if len(trial["recompute_s"]) < TRIAL_STEPS:
                return True
        recompute_s = min(trial["recompute_s"], default=float("inf"))
        faster = peak <= usable and recompute_s < (1.0 - TRIAL_MARGIN) * trial["offload_s"]
        if not faster:
            for i in trial["blocks"]:
                self.pager.set_policy(i, OFFLOAD)
        self.trial = None
        self.stable = 0
        self.session.event(
            "plan", what="trial result", chosen=RECOMPUTE if faster else OFFLOAD,
            policy=self.policies(), offload_s=trial["offload_s"],
            recompute_s=trial["recompute_s"],
            why=(f"recompute best step {recompute_s:.3f} s against paging "
                 f"{trial['offload_s']:.3f} s" if peak <= usable else
                 f"a recompute step peaked at {_fmt(peak)}, above usable {_fmt(usable)}; "
                 "paging, which fitted, is restored"))
        return True

    def _tighten(self) -> str:
        kept = [i for i, p in enumerate(self.pager.policy) if p == KEEP]
        if kept:
            self.pager.set_policy(kept[0], OFFLOAD)
            return f"block {kept[0]} activations: keep -> offload"
        if self._weights_may_move():
            for i in range(self.n):
                if i not in self.pager.paged and self.pager.page_out(i):
                    return f"block {i} weights: resident -> paged"
        offloaded = [i for i, p in enumerate(self.pager.policy) if p == OFFLOAD]
        if offloaded:
            self.pager.set_policy(offloaded[0], RECOMPUTE)
            return f"block {offloaded[0]} activations: offload -> recompute"
        return "nothing left to move"

