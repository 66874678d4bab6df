"""attention=: which PyTorch SDPA backend the blocks' attention runs on.

``"auto"`` times the backends PyTorch has (cuDNN, flash, memory-efficient, math)
once, forward and backward, on the shape of the model's first attention call of a
training forward, and then prefers the fastest (the others follow as fallbacks for
calls it cannot take). A named backend (``"cudnn"``, ``"efficient"``, ``"flash"``,
``"math"``) is used first; ``None`` leaves PyTorch's own choice.

Determinism: under ``torch.use_deterministic_algorithms(True)`` the kernels whose
backward is not deterministic (cuDNN's, flash's atomics) are left out; with
``warn_only=True`` the memory-efficient kernel too (PyTorch would then only warn
and run its non-deterministic backward). The flags are re-read on every training
forward, and the blocks apply the choice inside their forward, so blocks
recomputed in backward follow a later change as well.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

BACKENDS: Dict[str, SDPBackend] = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
NON_DETERMINISTIC = ("cudnn", "flash")


def allowed_backends(deterministic: bool, warn_only: bool) -> List[str]:
    """Backend names usable under the given determinism settings, fastest-first guess."""
    names = list(BACKENDS)
    if deterministic:
        names = [n for n in names if n not in NON_DETERMINISTIC]
        if warn_only:
            names = [n for n in names if n != "efficient"]
    return names


def _determinism() -> tuple:
    return (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled())


class AttentionSelector:
    """Holds the attention choice of one wrapped model (see module docstring)."""

    def __init__(self, choice: Optional[str], device: torch.device,
                 event: Callable[..., None] = lambda *a, **k: None):
        self.choice = choice
        self.device = torch.device(device)
        self.event = event
        self.timings: Optional[Dict[str, float]] = None   # backend -> seconds (auto)
        self.order: List[str] = []                        # backends in use, preferred first
        self._determinism = None
        self.refresh()

    def refresh(self) -> None:
        """Re-reads the determinism flags (every training forward)."""
        det = _determinism()
        if det == self._determinism and self.order:
            return
        self._determinism = det
        allowed = allowed_backends(*det)
        if self.choice is None:
            self.order = []
        elif self.choice == "auto":
            if self.timings is None:
                self.order = []
            else:
                ranked = sorted((t, n) for n, t in self.timings.items() if n in allowed)
                self.order = [n for _, n in ranked]
        else:
            # The named backend, with math (always usable) for calls it cannot take.
            self.order = [n for n in (self.choice, "math") if n in allowed]
            if not self.order:
                self.order = allowed
            if self.choice not in allowed:
                self.event("attention", backend=self.order[0],
                           why=f"attention={self.choice!r} is not deterministic and "
                               "deterministic algorithms are on")
        if self.timings is not None or self.choice not in ("auto", None):
            self.event("attention", order=list(self.order), deterministic=det[0],
                       warn_only=det[1])

    def context(self):
        """What a block's forward runs inside."""
        if self.choice == "auto" and self.timings is None:
            if self.device.type != "cuda":
                return contextlib.nullcontext()
            return _Calibrate(self)
        if not self.order:
            return contextlib.nullcontext()
        return sdpa_kernel([BACKENDS[n] for n in self.order], set_priority=True)

    # --------------------------------------------------------------- timing
    def calibrate(self, args, kwargs) -> None:
        q, k, v = args[:3]
        timings: Dict[str, float] = {}
        needs_grad = any(t.requires_grad for t in (q, k, v))
        for name in allowed_backends(*_determinism()):
            try:
                timings[name] = self._time(name, q, k, v, args[3:], kwargs, needs_grad)
            except RuntimeError:
                continue  # this backend cannot take this shape, dtype or device
        self.timings = timings
        self.event("attention", what="timed", shape=list(q.shape), dtype=str(q.dtype),
                   seconds={n: round(t, 6) for n, t in timings.items()})
        self._determinism = None
        self.refresh()

    @staticmethod
    def _time(name, q, k, v, rest, kwargs, needs_grad, repeat: int = 3) -> float:
        qs, ks, vs = (t.detach().clone().requires_grad_(needs_grad) for t in (q, k, v))

        def once():
            out = F.scaled_dot_product_attention(qs, ks, vs, *rest, **kwargs)
            if needs_grad:
                out.backward(torch.ones_like(out))
        # Inner no-op hooks: a paging block's saved-tensor hooks must not see these.
        with sdpa_kernel([BACKENDS[name]]), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            once()  # warm-up (and the RuntimeError of an unusable backend)
            torch.cuda.synchronize(q.device)
            t0 = time.perf_counter()
            for _ in range(repeat):
                once()
            torch.cuda.synchronize(q.device)
        return (time.perf_counter() - t0) / repeat


class _Calibrate(TorchFunctionMode):
    """Times the backends on the first attention call it sees, then runs the call."""

    def __init__(self, selector: AttentionSelector):
        super().__init__()
        self.selector = selector

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.selector.timings is None:
            with torch.enable_grad():
                self.selector.calibrate(args, kwargs)
            with self.selector.context():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def selector_report(selector: Optional[AttentionSelector]) -> Dict[str, Any]:
    if selector is None:
        return {"choice": None}
    return {"choice": selector.choice, "order": list(selector.order),
            "timings_s": dict(selector.timings or {})}
