"""Registering host memory this process has just mapped or allocated with CUDA.

A registration outlives its memory when the memory is unmapped or freed while still
registered (a shared-memory region dropped in an unusual order, a freed pinned
buffer): the driver keeps the old pages pinned, and when the address is reused,
``cudaHostRegister`` of the new memory fails with "already registered" while
``cudaHostGetDevicePointer`` still answers, with the old pages behind it. A kernel
reading through that pointer (``optimizer_mode="gpu"``) would then compute on stale
bytes. Memory that was just created cannot legitimately be registered already, so
``register_fresh`` drops such a stale registration and registers again, and
``registered_empty`` gives a buffer whose registration ends when its memory does.
"""
from __future__ import annotations

import mmap
from typing import Optional, Tuple

import torch

from . import C
from .host_memory import track


def registered_host(t: torch.Tensor) -> bool:
    """Whether ``t`` is dense host memory CUDA copies from as it is (pinned or
    registered: a shared base's mapping, a tensor the user pinned)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return False
    try:
        return t.is_pinned()
    except RuntimeError:  # no CUDA in this process
        return False


def register_fresh(address: int, nbytes: int) -> Tuple[bool, str]:
    """cudaHostRegister (mapped, portable) of memory created just now; returns (ok, why).
    A stale registration found at ``address`` is replaced; one that overlaps the range
    from another start address cannot be, and is reported (ok False)."""
    _C = C()
    if not _C.with_cuda:
        return False, "built without CUDA"
    ok, why = _C.register_host(address, nbytes, False)
    if not ok and "already" in why:
        _C.unregister_host(address)
        ok, why = _C.register_host(address, nbytes, False)
        if not ok:
            why = (f"{why} (a stale registration overlaps [{address:#x}, +{nbytes}) and "
                   "does not start there)")
    return ok, why


class _RegisteredMapping(mmap.mmap):
    """Anonymous memory whose CUDA registration ends with it: ``__del__`` runs before the
    mapping is unmapped, when the last tensor viewing it is gone."""

    def __del__(self):
        address = getattr(self, "registered_address", None)
        if address is not None:
            self.registered_address = None
            self.unregister(address)  # bound at creation: no import at interpreter exit


def registered_empty(nbytes: int, tag: str = "weights") -> Optional[torch.Tensor]:
    """A flat uint8 host tensor of exactly ``nbytes`` (no power-of-two rounding, unlike
    torch's pinned allocator), registered with CUDA for as long as any view of it lives;
    None when registration fails (the caller falls back to ``pin_memory()``). Counted
    under ``tag`` in ``pinned_stats()["by_tag"]`` while it lives."""
    _C = C()
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    # Private: a forked process (a DataLoader worker) gets copy-on-write pages, as with
    # malloc'd memory, not a shared mapping.
    memory = _RegisteredMapping(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes)  # keeps memory alive
    ok, _ = register_fresh(buf.data_ptr(), nbytes)
    if not ok:
        return None
    memory.unregister = _C.unregister_host
    memory.registered_address = buf.data_ptr()
    track(memory, nbytes, tag)  # the mapping lives as long as any view of it
    return buf
