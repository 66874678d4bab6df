"""``offload="auto"`` for a standalone ``ActivationOffloader``: a search over step times.

The tuner sees only measured steps (seconds, and on a GPU the step's peak), so it is
pure and tested with made-up times. The search:

1. Calibration: ``calibrate_steps`` steps with nothing paged. The first is a warm-up;
   the best of the others is the baseline.
2. A first guess of how many blocks page (every block, or fewer when a hardware
   profile says the link cannot carry every block's activations within the allowed
   slowdown). The first blocks page: backward reads the last ones first, so paging
   those would gain least.
3. Each setting runs ``tune_window`` measured steps after one discarded step (the one
   that ran first with it). If its best step is within ``max_slowdown`` of the
   baseline, the search settles there; else the paged count halves. A setting whose
   peak went over ``vram_target`` ends the search at the setting before it.
4. With a recompute trial (``recompute="auto"`` under memory pressure), the paged
   blocks recompute instead for one more window; recompute stays if its best step is
   ``TRIAL_MARGIN`` faster than paging's, and fits.

wrap() does not use this search: its memory controller (memory/controller.py) moves
blocks from the measured peaks against the planned device budget.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

# Recompute must save this share of the paging steps' time to be chosen (noise).
TRIAL_MARGIN = 0.03

CALIBRATE, TUNE, TRIAL, SETTLED = "calibrate", "tune", "recompute trial", "settled"


class OffloadTuner:
    """The search of the module docstring over ``n`` blocks. ``observe()`` takes each
    finished step; ``count`` (the first ``count`` blocks page) and ``recompute`` (they
    recompute instead) are the setting the next step runs with."""

    def __init__(self, n: int, *, calibrate_steps: int, tune_window: int,
                 max_slowdown: float, first_guess=None, recompute_trial: bool = False,
                 vram_target: Optional[int] = None):
        self.n = n
        self.calibrate_steps = calibrate_steps
        self.tune_window = tune_window
        self.max_slowdown = max_slowdown
        # first_guess(baseline_s) -> blocks to page first (None: every block).
        self.first_guess = first_guess
        self.recompute_trial = recompute_trial
        self.vram_target = vram_target
        self.phase = CALIBRATE
        self.count = 0
        self.recompute = False
        self.baseline_s: Optional[float] = None
        self.history: List[Dict[str, Any]] = []  # one entry per measured setting
        self.why = "calibrating: nothing paged"
        self._times: List[float] = []
        self._peaks: List[int] = []
        self._skip = 1  # steps still to discard (the warm-up, or the first after a change)

    @property
    def settled(self) -> bool:
        return self.phase == SETTLED

    def observe(self, seconds: float, peak: Optional[int] = None) -> Optional[str]:
        """One finished step. Returns what changed (a sentence for the event log), or
        None when the setting stays."""
        if self.settled:
            return None
        if self._skip:
            self._skip -= 1
            return None
        self._times.append(seconds)
        if peak is not None:
            self._peaks.append(peak)
        wanted = self.calibrate_steps - 1 if self.phase == CALIBRATE else self.tune_window
        if len(self._times) < wanted:
            return None
        best, top = min(self._times), max(self._peaks, default=None)
        self._times, self._peaks = [], []
        if self.phase == CALIBRATE:
            return self._calibrated(best)
        if self.phase == TRIAL:
            return self._trial_done(best, top)
        return self._measured(best, top)

    # ------------------------------------------------------------------ steps
    def _change(self, why: str) -> str:
        self._skip = 1
        self.why = why
        return why

    def _settle(self, why: str) -> str:
        self.phase = SETTLED
        self.why = why
        return why

    def _calibrated(self, best: float) -> str:
        self.baseline_s = best
        guess = self.n if self.first_guess is None else self.first_guess(best)
        self.count = max(0, min(self.n, int(guess)))
        self.history.append({"offloaded": 0, "recompute": False, "best_s": best,
                             "slowdown": 0.0})
        if self.count == 0:
            return self._settle(f"baseline {best:.4f} s; the link cannot carry any block's "
                                "activations within max_slowdown: nothing pages")
        self.phase = TUNE
        return self._change(f"baseline {best:.4f} s with nothing paged; trying {self.count} "
                            f"of {self.n} blocks paged")

    def _slowdown(self, best: float) -> float:
        return best / self.baseline_s - 1.0 if self.baseline_s else 0.0

    def _measured(self, best: float, peak: Optional[int]) -> str:
        slowdown = self._slowdown(best)
        self.history.append({"offloaded": self.count, "recompute": False, "best_s": best,
                             "slowdown": slowdown, "peak": peak})
        if self.vram_target is not None and peak is not None and peak > self.vram_target:
            earlier = [h for h in self.history[:-1] if h["offloaded"] > self.count]
            if earlier:
                self.count = min(h["offloaded"] for h in earlier)
                return self._settle(f"peak {peak} B over vram_target {self.vram_target} B: back "
                                    f"to {self.count} blocks paged")
        if slowdown <= self.max_slowdown:
            return self._within(best, slowdown)
        if self.count // 2 == 0:
            self.count = 0
            return self._settle(f"paging 1 block slows the step by {slowdown:.1%} (more than "
                                f"max_slowdown {self.max_slowdown:.0%}): nothing pages")
        self.count //= 2
        return self._change(f"{slowdown:.1%} slower than the baseline (max_slowdown "
                            f"{self.max_slowdown:.0%}): trying {self.count} blocks paged")

    def _within(self, best: float, slowdown: float) -> str:
        text = (f"{self.count} of {self.n} blocks paged: {slowdown:+.1%} against the baseline, "
                f"within max_slowdown {self.max_slowdown:.0%}")
        if self.recompute_trial:
            self.phase, self.recompute = TRIAL, True
            self._paging_best = best
            return self._change(text + f"; trying recompute for those {self.count} blocks")
        return self._settle(text)

    def _trial_done(self, best: float, peak: Optional[int]) -> str:
        self.history.append({"offloaded": self.count, "recompute": True, "best_s": best,
                             "slowdown": self._slowdown(best), "peak": peak})
        fits = self.vram_target is None or peak is None or peak <= self.vram_target
        faster = best < (1.0 - TRIAL_MARGIN) * self._paging_best
        self.recompute = fits and faster
        chosen = "recompute" if self.recompute else "paging"
        return self._settle(f"recompute best step {best:.4f} s against paging "
                            f"{self._paging_best:.4f} s" + ("" if fits else ", over vram_target")
                            + f": {chosen} kept for blocks 0..{self.count - 1}")
