"""SavedTensorPager: the saved-tensor hooks that page activations to host memory.

    pager = SavedTensorPager(model, min_offload_bytes=1 << 20)
    with pager:
        loss = model(x).loss
    loss.backward()

It is the mechanism under both users of activation paging: wrap()'s ``BlockPager``
enters it around each block whose policy is "offload", and the standalone
``trainstream.ActivationOffloader`` (activations.py, a subclass) adds the per-block
policy and its tuner. While active, every tensor autograd saves for backward that is at least
``min_offload_bytes`` big and on the device, and dense or a non-overlapping strided
view reaching at most ``VIEW_SPAN_RATIO`` times its elements (q, k and v sliced from
one projection), is copied to host memory on a D2H stream (the device copy is released
once the copy has run); in backward each one is copied back on an H2D stream when it is
needed, and the next ``prefetch_depth`` ones (in reverse order of saving, the order
backward reads them) are fetched ahead. ``max_inflight_bytes`` bounds the device memory
held by copies in flight each way (the training thread waits for the oldest copy beyond
it).

Exactness: the bytes come back unchanged, with the original sizes and strides, so
backward computes exactly what it would have without paging. (A strided view is paged
compactly and comes back inside a fresh buffer of its span.)

Host memory: pinned memory from torch's caching host allocator, or, when a
``HostArena`` is given (``wrap()`` gives one over shared-memory regions of the
daemon session), bump-allocated pages of it, reused every step.
"""
from __future__ import annotations

import weakref
from collections import deque
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .._native.host_memory import track
from .._native.streams import CopyEngine
from ..options import check_value, default

_ALIGN = 256


class HostArena:
    """Bump allocator over host chunks, reset when every page of a step is consumed.

    ``new_chunk(nbytes)`` returns a flat uint8 host tensor (pinned or registered
    shared memory); chunks are kept and reused. Caller owns the arena; pages handed
    out are valid until ``reset()``.
    """

    def __init__(self, new_chunk: Callable[[int], torch.Tensor], chunk_bytes: int = 64 << 20,
                 tag: str = "activations"):
        self._new_chunk = new_chunk
        self._tag = tag  # pinned_stats()["by_tag"]
        self._chunk_bytes = chunk_bytes
        self._chunks: List[torch.Tensor] = []
        self._current = 0
        self._offset = 0

    @property
    def capacity(self) -> int:
        return sum(c.numel() for c in self._chunks)

    def allocate(self, nbytes: int) -> torch.Tensor:
        while self._current < len(self._chunks):
            chunk = self._chunks[self._current]
            if self._offset + nbytes <= chunk.numel():
                page = chunk[self._offset:self._offset + nbytes]
                self._offset = (self._offset + nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
                return page
            self._current += 1
            self._offset = 0
        chunk = self._new_chunk(max(nbytes, self._chunk_bytes))
        track(chunk, chunk.numel(), self._tag)
        self._chunks.append(chunk)
        self._current, self._offset = len(self._chunks) - 1, 0
        return self.allocate(nbytes)

    def reset(self) -> None:
        self._current = 0
        self._offset = 0


# A saved view that is not dense is paged when the storage its strides reach is at most
# this many times its elements (q, k, v split from one projection: about 3). Kept on the
# device, it would hold the whole base there; paged, it comes back in a buffer of its span.
VIEW_SPAN_RATIO = 4


class _Page:
    """One saved tensor that lives on the host until backward needs it."""
    __slots__ = ("host", "size", "stride", "dtype", "nbytes", "span", "device_bytes", "copied",
                 "device_copy", "fetched", "saves", "uses", "task", "index", "done",
                 "__weakref__")

    def __init__(self, host, size, stride, dtype, nbytes, index, span=None):
        self.host = host          # same strides as the tensor, or compact when span is set
        self.size, self.stride, self.dtype, self.nbytes = size, stride, dtype, nbytes
        self.span = span          # a strided view's span in elements, else None
        # Device memory the page occupies when fetched (a view comes back in its span).
        self.device_bytes = nbytes if span is None else span * host.element_size()
        self.copied = None        # event: D2H done (None on CPU or once observed)
        self.device_copy = None   # the tensor back on the device, once fetched
        self.fetched = None       # event: H2D done
        self.saves = 0            # times autograd saved it (the same tensor saved twice)
        self.uses = 0             # unpacks still expected in the backward under way
        self.task = None          # that backward (autograd's graph task id)
        self.index = index
        # [the graph that saved it is freed (after its backward, or without one),
        #  device bytes of a fetched copy counted in _prefetched_bytes]; shared with the
        # finalizer, which cannot see the page itself.
        self.done = [False, 0]


def _non_overlapping(t: torch.Tensor) -> bool:
    """Whether no two of t's elements share memory (an expand()ed view's do): only
    such a view can be rebuilt by copying its elements into a buffer of its span."""
    dims = sorted((st, sz) for sz, st in zip(t.size(), t.stride()) if sz != 1)
    reach = 1
    for stride, size in dims:
        if stride < reach:
            return False
        reach = stride * size
    return True


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill its storage span without gaps or overlap (any dim
    order), so a page of ``numel`` elements holds it with the same strides."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.size(), t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class SavedTensorPager:
    """Pages saved activations to host memory (module docstring). Use as a context
    manager (re-enterable, nestable) or call ``pack``/``unpack`` from your own
    ``saved_tensors_hooks``; ``remove()`` releases its host memory."""

    def __init__(self, model: Optional[nn.Module] = None, *, device=None,
                 min_offload_bytes: int = default("min_offload_bytes"),
                 prefetch_depth: int = default("prefetch_depth"),
                 max_inflight_bytes: int = default("max_inflight_bytes"),
                 arena: Optional[HostArena] = None):
        check_value("min_offload_bytes", min_offload_bytes)
        check_value("prefetch_depth", prefetch_depth)
        check_value("max_inflight_bytes", max_inflight_bytes)
        if device is None:
            first = next(model.parameters(), None) if model is not None else None
            device = first.device if first is not None else (
                "cuda" if torch.cuda.is_available() else "cpu")
        self.engine = CopyEngine(device)
        self.min_offload_bytes = min_offload_bytes
        self.prefetch_depth = prefetch_depth
        self.max_inflight_bytes = max_inflight_bytes
        self._arena = arena or HostArena(self.engine.host_empty)
        self._weights = set()
        if model is not None:
            self._weights = {t.data_ptr() for t in list(model.parameters()) + list(model.buffers())}
        self._pages: List[Any] = []              # weakrefs to this step's pages, in pack order
        self._live = 0                           # pages not yet done
        self._inflight: deque = deque()          # (event, device tensor, nbytes): D2H running
        self._inflight_bytes = 0
        self._prefetched_bytes = 0
        self._seen: Dict[int, Tuple[Any, int, _Page]] = {}  # id(t) -> (weakref, version, page)
        self._hooks: List[Any] = []  # one saved_tensors_hooks per entered context
        self.stats: Dict[str, int] = {"tensors_offloaded": 0, "bytes_offloaded": 0,
                                      "tensors_kept": 0, "bytes_kept": 0, "prefetch_hits": 0,
                                      "prefetch_misses": 0, "peak_host_bytes": 0}

    # ------------------------------------------------------------ context manager
    def __enter__(self) -> "SavedTensorPager":
        # A stack: a block's pager context may open inside the user's own one.
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, *exc) -> None:
        if self._hooks:
            self._hooks.pop().__exit__(*exc)

    def remove(self) -> None:
        """Stops paging (if active as a context) and frees the host memory it holds.
        Saved tensors already paged stay valid until their backward has run."""
        while self._hooks:
            self.__exit__(None, None, None)
        self._drain()
        self._seen.clear()
        if self._live == 0:
            self._pages.clear()
            self._arena = HostArena(self.engine.host_empty)

    def replace_arena(self, arena: HostArena) -> bool:
        """Takes host pages from ``arena`` from now on. Returns whether pages of the old
        one are still live (saved by a graph whose backward has not run): the caller
        keeps its memory mapped until then."""
        self._drain()
        self._arena = arena
        return self._live > 0

    # ----------------------------------------------------------------- the hooks
    def wants(self, t: torch.Tensor) -> bool:
        """Whether ``pack`` would page ``t`` (rather than keep it on the device)."""
        nbytes = t.numel() * t.element_size()
        return (nbytes >= self.min_offload_bytes and t.device == self.engine.device
                and not isinstance(t, nn.Parameter) and not t.is_sparse
                and t.layout == torch.strided and t.data_ptr() not in self._weights
                and (_dense(t) or (_non_overlapping(t)
                                   and _span(t) <= VIEW_SPAN_RATIO * t.numel())))

    def pack(self, t: torch.Tensor):
        if not self.wants(t):
            self.stats["tensors_kept"] += 1
            self.stats["bytes_kept"] += t.numel() * t.element_size()
            return t.detach()  # not itself: see BlockPager._pack (a cycle that leaks graphs)
        seen = self._seen.get(id(t))
        page = seen[2]() if seen is not None else None
        if page is not None and seen[0]() is t and seen[1] == t._version and not page.done[0]:
            page.saves += 1  # the same tensor saved again (e.g. by two ops): one copy
            return page
        if self._live == 0:
            self._arena.reset()
            self._pages.clear()
        nbytes = t.numel() * t.element_size()
        if _dense(t):
            raw = self._arena.allocate(_span(t) * t.element_size())
            host = raw.view(t.dtype).as_strided(t.size(), t.stride())
            page = _Page(host, t.size(), t.stride(), t.dtype, nbytes, len(self._pages))
        else:  # a strided view: only its elements cross
            host = self._arena.allocate(nbytes).view(t.dtype).view(t.size())
            page = _Page(host, t.size(), t.stride(), t.dtype, nbytes, len(self._pages),
                         span=_span(t))
        page.copied = self.engine.to_host(t, host)
        page.saves = 1
        self._pages.append(weakref.ref(page))
        self._live += 1
        # A graph freed without backward (evaluation with grad on) must not pin the arena.
        weakref.finalize(page, self._page_done, page.done)
        self._seen[id(t)] = (weakref.ref(t), t._version, weakref.ref(page))
        self.stats["tensors_offloaded"] += 1
        self.stats["bytes_offloaded"] += nbytes
        self.stats["peak_host_bytes"] = max(self.stats["peak_host_bytes"], self._arena.capacity)
        if page.copied is not None:
            self._inflight.append((page.copied, t, page.device_bytes))
            self._inflight_bytes += page.device_bytes
            self._retire(self.max_inflight_bytes)
        return page

    def unpack(self, packed):
        if not isinstance(packed, _Page):
            return packed
        page = packed
        task = torch._C._current_graph_task_id()
        if page.task != task:  # this backward's first unpack of the page (a retained
            page.task = task   # graph's second backward reads it all again)
            page.uses = page.saves
        if page.device_copy is None:
            self.stats["prefetch_misses"] += 1
            self._fetch(page)
        else:
            self.stats["prefetch_hits"] += 1
        self.engine.wait(page.fetched)
        out = page.device_copy
        page.uses -= 1
        if page.uses == 0:  # this backward is done with it; the host copy stays until
            self._drop_copy(page)  # the graph goes (retain_graph may read it again)
        self._prefetch_before(page.index, task)
        return out

    def _drop_copy(self, page: _Page) -> None:
        self._prefetched_bytes -= page.done[1]
        page.done[1] = 0
        page.device_copy = None

    def _page_done(self, done: List[Any]) -> None:
        """The graph that saved the page is gone: its host memory may be reused."""
        if done[0]:
            return
        done[0] = True
        self._prefetched_bytes -= done[1]  # a backward that raised left it fetched
        done[1] = 0
        self._live -= 1
        if self._live == 0:
            self._seen.clear()

    def poll(self) -> None:
        """Releases the device tensors whose D2H copy has finished; never waits.
        ``pack`` polls as it goes, but after the last paged tensor of a forward nothing
        would: whoever runs more work after it (``BlockPager``, before each block) polls,
        or those tensors stay on the device until backward reaches them."""
        if self._inflight:
            self._retire(float("inf"))

    @property
    def inflight_bytes(self) -> int:
        """Device bytes held by D2H copies not yet seen to finish."""
        return self._inflight_bytes

    # ---------------------------------------------------------------- internals
    def _retire(self, limit: float) -> None:
        """Drops device tensors whose D2H copy has finished; waits for the oldest
        while more than ``limit`` bytes are in flight."""
        while self._inflight:
            event, _, nbytes = self._inflight[0]
            if self._inflight_bytes > limit:
                event.synchronize()
            elif not event.query():
                break
            self._inflight.popleft()
            self._inflight_bytes -= nbytes

    def _drain(self) -> None:
        self._retire(0)

    def _fetch(self, page: _Page) -> None:
        if self.engine.cuda:
            self._retire(self.max_inflight_bytes)
            if page.copied is not None:
                # The host copy must be complete before it is read back.
                self.engine.h2d.wait_event(page.copied)
        out = _empty_like_page(page, self.engine.device)
        page.fetched = self.engine.to_device(page.host, out)
        page.device_copy = out
        self._prefetched_bytes += page.device_bytes
        page.done[1] = page.device_bytes

    def _prefetch_before(self, index: int, task: int) -> None:
        """Fetches the ``prefetch_depth`` pages saved just before ``index`` that the
        backward under way (``task``) has not finished with."""
        fetched = 0
        j = index - 1
        while j >= 0 and fetched < self.prefetch_depth:
            page = self._pages[j]()
            j -= 1
            if (page is None or page.done[0] or page.device_copy is not None
                    or (page.task == task and page.uses == 0)):
                continue
            if self._prefetched_bytes + page.device_bytes > self.max_inflight_bytes:
                break
            self._fetch(page)
            fetched += 1


def _empty_like_page(page: _Page, device) -> torch.Tensor:
    """A tensor with the page's sizes and strides (a strided view's inside a fresh
    buffer of its span)."""
    if page.span is None:
        return torch.empty_strided(page.size, page.stride, dtype=page.dtype, device=device)
    buf = torch.empty(page.span, dtype=page.dtype, device=device)
    return buf.as_strided(page.size, page.stride)


def _span(t: torch.Tensor) -> int:
    """Elements of storage the tensor's sizes and strides reach (dense: numel)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.size(), t.stride()))
