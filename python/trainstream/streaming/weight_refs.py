"""The autograd pieces of weight paging (weights.py): a fetched device copy standing in
for a host parameter, a block's tensors and their host homes, one fetch of a block, and
a saved weight that backward resolves against a new fetch."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


class _PagedWeight(torch.autograd.Function):
    """Makes a fetched device copy stand in for a host parameter in autograd."""

    @staticmethod
    def forward(ctx, param, holder):
        ctx.param = param
        ctx.sink = holder.sink
        return holder.tensor

    @staticmethod
    def backward(ctx, grad):
        if ctx.sink is not None and ctx.sink(ctx.param, grad):
            return None, None
        return grad.to(ctx.param.device), None


class _Holder:  # carries non-tensor arguments into _PagedWeight
    __slots__ = ("tensor", "sink")

    def __init__(self, tensor, sink):
        self.tensor, self.sink = tensor, sink


class _Slot:
    """One paged tensor of a block: where it is substituted and its host home."""
    __slots__ = ("module", "kind", "name", "host", "param", "nbytes")

    def __init__(self, module, kind, name, host, param):
        self.module, self.kind, self.name, self.host, self.param = module, kind, name, host, param
        self.nbytes = host.numel() * host.element_size()


class _Fetch:
    """A block's weights on the device: one fetch, used by forward or by backward."""
    __slots__ = ("tensors", "event", "given", "nodes", "bases", "__weakref__")

    def __init__(self, tensors, event):
        self.tensors = tensors
        self.event = event
        self.given: Dict[int, int] = {}   # id(tensor handed to the block) -> slot index
        self.nodes: Dict[int, int] = {}   # id(_PagedWeight node) -> slot index
        self.bases: List[Any] = []        # keeps the handed tensors alive while mapped


class _WeightRef:
    """A saved weight (or a view or cast of one), resolved again in backward. ``gen``
    is the forward that saved it: each forward's graph counts its own references."""
    __slots__ = ("block", "index", "size", "stride", "offset", "dtype", "gen", "__weakref__")

    def __init__(self, block, index, t: Optional[torch.Tensor], dtype=None, gen=0):
        self.block, self.index, self.gen = block, index, gen
        self.size = self.stride = self.offset = None
        if t is not None:
            self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        self.dtype = dtype
