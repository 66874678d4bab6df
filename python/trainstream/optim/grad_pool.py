"""The client's end of a gradient staging pool (docs/staging-pool.md; the wire format
is trainstream/wire/grad_pool.h): instead of one gradient slot per parameter, every
gradient of a registration streams through one bounded byte ring in its staging
segment, so the host holds a pool sized by bandwidth and latency, not by the model.

The client alone chooses positions (``claim``); the daemon checks each extent a
GRAD_READY names against what it holds (Note [A pool extent a client names],
daemon/planes/grad_pool.h) and publishes ``released`` once an update has committed.
A gradient that finds no room waits for a release, asking the daemon whether it is
alive every tenth of a second, so a daemon that died turns into the recovery path
(Note [Resuming after the daemon died]) instead of a hang."""
from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Callable, Iterable, List, Optional

import torch

from .._native import C
from .._native.wire import (GRAD_POOL_ALIGN, GRAD_POOL_HEADER_OFFSET, GRAD_POOL_RELEASE_SEQ_FIELD,
                            GRAD_POOL_RELEASED_FIELD)
from ..errors import DaemonError
from ..options import parse_bytes

# The auto size: twice the largest gradient, or what PCIe moves while the daemon's
# releases come (about 20 ms at 55 GB/s), whichever is more; never more than the
# gradient slots it replaces.
PCIE_BYTES_S = 55e9
RELEASE_WINDOW_S = 0.020
_PAGE = 4096
_ALIVE_EVERY_S = 0.1
_SLEEP_MS = 20


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


# Note [Clipping keeps gradient slots]
# With max_grad_norm every gradient of a step is held until StepEnd has the global
# norm, so a bounded pool would stop backward for good once it filled; a
# data-parallel group's pool could fill with one rank's gradients waiting for
# another's. Both keep one gradient slot per parameter (the daemon refuses a pool
# with clipping; a group's layout answers slots), and so do TRAINSTREAM_GRAD_POOL=0
# and grad_pool=0 (A/B runs: the results are bit-identical either way).
#
# Note [The pool on a GPU host]
# The pool's copies from a CUDA device into its extents, and backward waiting for room
# on the device's stream, were measured on the H200 host (2026-12-04, bench_paging's
# 7b-full under a 24 GiB cap, benchmarks/results/h200-2026-12-04-paging-7b-full-
# {slots,pool}.log): a 2 GiB pool (auto asks 2.18 GB there) stepped in 2.111 s against
# 2.112 s with gradient slots, with the same losses at every step, and cut the host's
# bytes per trained parameter from 10.22 to 8.50 (daemon shared memory 77.9 -> 65.7 GiB).
# So "auto" uses the pool with or without a GPU. For A/B runs, TRAINSTREAM_GRAD_POOL=0
# keeps slots whatever grad_pool says, and TRAINSTREAM_GRAD_POOL=<size> puts that size
# in the place of "auto" (an explicit grad_pool size wins over it).
def grad_pool_bytes(extents: Iterable[int], option, max_grad_norm, in_group: bool) -> int:
    """Bytes of gradient pool to ask the daemon for, for gradients of ``extents`` bytes
    each; 0 for gradient slots (Note [Clipping keeps gradient slots])."""
    sizes = [_align(int(n), GRAD_POOL_ALIGN) for n in extents]
    env = os.environ.get("TRAINSTREAM_GRAD_POOL", "")
    if env not in ("", "0") and option == "auto":  # A/B runs (Note [The pool on a GPU host])
        option = parse_bytes(env)
        if option is None:
            raise ValueError(f"TRAINSTREAM_GRAD_POOL={env!r}: expected 0 (gradient slots) or a "
                             "size such as 2GiB or 1073741824")
    if not sizes or option == 0 or env == "0" or max_grad_norm is not None or in_group:
        return 0
    largest, total = max(sizes), sum(sizes)
    if option == "auto":
        want = min(max(2 * largest, int(PCIE_BYTES_S * RELEASE_WINDOW_S)), total)
    else:
        want = option if isinstance(option, int) else parse_bytes(option)
    return _align(max(want, largest), _PAGE)


class GradPool:
    """One registration's pool: the claim position (this process's), a view of the
    daemon's ``released`` word, and the wait for room. Must outlive every DataPlane
    that posts into it (it belongs to the staging region, not to a connection)."""

    def __init__(self, base_address: int, offset: int, capacity: int):
        self.base = base_address
        self.header = base_address + GRAD_POOL_HEADER_OFFSET
        self.offset = offset
        self.capacity = capacity
        self.claim = 0  # the end of the last extent handed to the daemon
        self._released = ctypes.c_uint64.from_address(self.header + GRAD_POOL_RELEASED_FIELD)
        self._seq = ctypes.c_uint32.from_address(self.header + GRAD_POOL_RELEASE_SEQ_FIELD)
        # Held from a claim to its GRAD_READY: extents leave in claim order.
        self.lock = threading.Lock()
        self.waits = 0
        self.wait_s = 0.0

    def _place(self, nbytes: int) -> Optional[int]:
        c = self.capacity
        claim = _align(self.claim, GRAD_POOL_ALIGN)
        at = claim % c
        pos = claim if at + nbytes <= c else claim - at + c
        released = self._released.value
        if released == self.claim or (released <= pos and pos + nbytes - released <= c):
            return pos
        return None

    def place(self, nbytes: int, alive: Callable[[], None], timeout_s: float) -> int:
        """A free position for ``nbytes`` (lock held), waiting for the daemon's releases;
        ``alive()`` is called every tenth of a second meanwhile and may raise (nothing is
        claimed then). A daemon that releases nothing for ``timeout_s`` (stopped, say)
        raises DaemonError."""
        if nbytes > self.capacity:
            raise ValueError(f"a gradient of {nbytes} bytes does not fit the gradient pool "
                             f"({self.capacity} bytes)")
        pos = self._place(nbytes)
        if pos is not None:
            return pos
        t0 = last = moved = time.monotonic()
        self.waits += 1
        try:
            while True:
                seen = self._seq.value
                pos = self._place(nbytes)
                if pos is not None:
                    return pos
                C().grad_pool_wait(self.header, seen, _SLEEP_MS)
                now = time.monotonic()
                if now - last >= _ALIVE_EVERY_S:
                    last = now
                    alive()
                if self._seq.value != seen:
                    moved = now
                elif now - moved > timeout_s:
                    raise DaemonError(
                        f"the TrainStream daemon released no gradient pool bytes for "
                        f"{timeout_s:g} s (timeout_s) while a gradient of {nbytes} bytes "
                        "waited for room: it is not answering")
        finally:
            self.wait_s += time.monotonic() - t0

    def view(self, pos: int, numel: int, dtype: str) -> torch.Tensor:
        """The extent at ``pos`` as a flat tensor."""
        return C().tensor_from_address(self.base + self.offset + pos % self.capacity, [numel],
                                       dtype)

    def taken(self, pos: int, nbytes: int) -> None:
        self.claim = pos + nbytes

    def resume(self, replay_positions: List[int]) -> None:
        """After the daemon died (Note [Resuming after the daemon died]): the next daemon
        holds nothing in flight and writes ``released`` only after its first commit, so
        this process says where its window starts: at the first extent it posts again
        (those bytes are still there: nothing was released past them), else at its claim."""
        self._released.value = min(replay_positions) if replay_positions else self.claim
