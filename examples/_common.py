"""What the examples share: the device to use, memory readings, the daemon's status and
one line per training step. Kept small: each example reads top to bottom on its own."""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# The small GPT the tests and `make demo` train (tests/python/tiny_gpt.py).
sys.path.insert(0, os.path.join(REPO, "tests", "python"))


def pick_device(requested: str) -> str:
    """``requested`` ("auto", "cuda" or "cpu") as a device that exists here."""
    if requested not in ("auto", "cuda", "cpu"):
        raise ValueError(f"--device {requested!r}: accepted: auto, cuda, cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to this torch "
                         f"({torch.__version__}); use --device cpu (or auto)")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def gib(n: Optional[float]) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def peak_vram(device: str) -> Optional[int]:
    """Peak bytes torch allocated on the GPU since the last reset (None on the CPU)."""
    return torch.cuda.max_memory_allocated() if device == "cuda" else None


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def daemon_status(socket: Optional[str] = None) -> dict:
    """``trainstreamctl status --json``'s document, read through the control API."""
    from trainstream._native import daemon
    return json.loads(daemon.connect(socket).status_json())


def session_state_bytes(status: dict, pid: int) -> int:
    """Bytes of the optimizer-state segments of the sessions of process ``pid``."""
    ids = {s["session_id"] for s in status["sessions"] if s["pid"] == pid}
    return sum(seg["bytes"] for seg in status["segments"]
               if seg["session_id"] in ids and seg["kind"] == "state")


class StepLog:
    """Prints one line per step (time, loss, peak VRAM) and keeps the figures."""

    def __init__(self, device: str):
        self.device = device
        self.losses: List[float] = []
        self.times: List[float] = []
        print(f"{'step':>4} {'s/step':>8} {'loss':>10} {'peak VRAM':>12}", flush=True)

    def start(self) -> None:
        sync(self.device)
        self._t0 = time.perf_counter()

    def end(self, step: int, loss: torch.Tensor) -> None:
        value = loss.item()  # waits for the step's work
        sync(self.device)
        dt = time.perf_counter() - self._t0
        self.times.append(dt)
        self.losses.append(value)
        print(f"{step:>4} {dt:>8.3f} {value:>10.4f} {gib(peak_vram(self.device)):>12}", flush=True)

    def summary(self, label: str) -> None:
        """The ``LOSSES`` and ``SUMMARY`` lines tests and logs read."""
        finite = all(math.isfinite(v) for v in self.losses)
        later = self.times[1:] or self.times
        median = sorted(later)[len(later) // 2]
        print("LOSSES " + " ".join(f"{v:.6f}" for v in self.losses))
        print(f"SUMMARY {label}: {len(self.losses)} steps, median {median:.3f} s/step (after the "
              f"first), loss {self.losses[0]:.4f} -> {self.losses[-1]:.4f}, finite={finite}, "
              f"peak VRAM {gib(peak_vram(self.device))}", flush=True)
