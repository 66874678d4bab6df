"""Copies between host memory and the training device on dedicated streams.

One seam for weight paging and activation paging (docs/design.md, "Without a GPU"):
with a CUDA device, copies run on a dedicated H2D or D2H stream ordered against the
compute stream with events (the host never waits); with a CPU "device" (CI, or
tests that declare a capacity) the same calls are plain synchronous copies, so the
paged code path runs unchanged and its results can be compared bit for bit.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

# Process-wide copies per device (transfer_stats(device)): every CopyEngine of a device
# adds to one entry, so weight and activation paging and every wrapped model count.
_TOTALS: Dict[str, Dict[str, int]] = {}


def _totals(device: torch.device) -> Dict[str, int]:
    return _TOTALS.setdefault(str(device), {"bytes_h2d": 0, "bytes_d2h": 0, "copies_h2d": 0,
                                            "copies_d2h": 0})


def copy_totals(device) -> Dict[str, int]:
    """Bytes and copies this process's copy engines have issued to (h2d) and from (d2h)
    ``device`` so far (zeros for a device that none used)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return dict(_totals(device))


class CopyEngine:
    """Owns the two copy streams of one device. Not thread-safe: used from the
    training thread and autograd's (one at a time, as autograd runs backward)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self.h2d = torch.cuda.Stream(self.device)
            self.d2h = torch.cuda.Stream(self.device)
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self._totals = _totals(self.device)

    def compute_stream(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def host_empty(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 host buffer, pinned when the device is a GPU."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> Optional[torch.cuda.Event]:
        """dst.copy_(src) after every compute-stream write to src issued so far.
        Returns the event that marks the copy done (None: already done). The caller
        keeps src alive until then."""
        nbytes = src.numel() * src.element_size()
        self.bytes_d2h += nbytes
        self._totals["bytes_d2h"] += nbytes
        self._totals["copies_d2h"] += 1
        if not self.cuda or not src.is_cuda:
            dst.copy_(src)
            return None
        return self._copy_after_compute(self.d2h, [(src, dst)])

    def to_device(self, src: torch.Tensor, dst: torch.Tensor) -> Optional[torch.cuda.Event]:
        """dst.copy_(src) on the H2D stream, after the compute stream has reached this
        point (dst was allocated on it). The compute stream must wait on the returned
        event (``wait``) before reading dst."""
        return self.to_device_many([(src, dst)])

    def to_device_many(self, pairs) -> Optional[torch.cuda.Event]:
        """``to_device`` for several (src, dst) pairs, with one event for all."""
        pairs = list(pairs)
        nbytes = sum(src.numel() * src.element_size() for src, _ in pairs)
        self.bytes_h2d += nbytes
        self._totals["bytes_h2d"] += nbytes
        self._totals["copies_h2d"] += len(pairs)
        if not self.cuda:
            for src, dst in pairs:
                dst.copy_(src)
            return None
        return self._copy_after_compute(self.h2d, pairs)

    def _copy_after_compute(self, stream, pairs) -> torch.cuda.Event:
        """The copies on ``stream`` once the compute stream reaches this point (the
        source was written, or the destination allocated, there); the returned event
        marks them done."""
        reached = torch.cuda.Event()
        reached.record(self.compute_stream())
        with torch.cuda.stream(stream):
            stream.wait_event(reached)
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def wait(self, event: Optional[torch.cuda.Event]) -> None:
        """Orders the compute stream after ``event`` (no host wait)."""
        if event is not None:
            self.compute_stream().wait_event(event)
