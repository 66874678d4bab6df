"""Weight paging and the per-block activation policy of a block stack.

``BlockPager(blocks, device, paged=[...], policy=[...])`` takes over each block's
``forward``:

* A paged block's weights live in host memory: a trained weight in its home (the
  optimizer's param slot in the daemon session, which the daemon rewrites after
  each update, or pinned memory without a session), a frozen weight or buffer in
  pinned memory. Before the block runs, its weights are copied to the device on a
  dedicated H2D stream, ``prefetch_depth`` blocks ahead, and the compute stream
  waits on the copy's event (never the host). The block runs on the device copies,
  substituted for its parameters and buffers for the duration of the call; the
  copies are dropped when it returns.
* Saved-tensor hooks turn a weight that autograd saves for backward into a
  reference; backward fetches the block again (prefetching the blocks before it)
  and the reference resolves to the new device copy. So the device holds the
  weights of a few blocks at a time, in forward and in backward.
* A trained weight enters the block through ``_PagedWeight``: its gradient goes to
  ``grad_sink`` (``OffloadAdamW.accept_grad``: D2H into the param's grad slot),
  never into ``p.grad`` on the device; with no sink it is accumulated into ``p.grad``
  on the host like any gradient.
* Before a block's trained weights are copied from their homes (a prefetch too),
  ``before_read`` (``OffloadAdamW.weights_ready``) waits for any update of theirs
  still in flight: the daemon writes a home while it applies an eager update
  (optim/param_ready.py, Note [When a weight's update is in flight]).
* Per block, activations are kept, paged (``SavedTensorPager``) or recomputed
  (``torch.utils.checkpoint``, non-reentrant: the recomputation fetches the weights
  again).

With a CPU ``device`` the same code runs with synchronous copies (CI's exactness
test). Everything is undone by ``remove()``.
"""
from __future__ import annotations

import contextlib
import types
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .._native.pinning import registered_empty, registered_host
from .._native.streams import CopyEngine
from ..options import default
from .saved_tensors import SavedTensorPager
from .weight_refs import _Fetch, _Holder, _PagedWeight, _Slot, _WeightRef, in_backward

KEEP, OFFLOAD, RECOMPUTE = "keep", "offload", "recompute"


def _set_paged(block: nn.Module, paged: bool) -> None:
    """Tells the block's modules that derive device copies from their weights (QuantLinear's
    fp8 tensor-core copy) that the weights page now, or are resident again."""
    for m in block.modules():
        if hasattr(m, "set_paged"):
            m.set_paged(paged)


def tensor_core_bytes(block: nn.Module, device) -> int:
    """Device bytes the block's modules derive from their weights when resident on
    ``device`` (Note [The fp8 tensor-core copy lives only with resident weights])."""
    return sum(m.tensor_core_bytes(device) for m in block.modules()
               if hasattr(m, "tensor_core_bytes"))
POLICIES = (KEEP, OFFLOAD, RECOMPUTE)


class BlockPager:
    """Pages the weights of ``paged`` blocks and applies ``policy[i]`` (keep /
    offload / recompute) to each block's activations. Caller owns it; ``remove()``
    restores the blocks (their paged tensors stay in host memory).

    Exported as ``trainstream.ParamPager``: wrap() builds it (memory/install.py), and
    ``ActivationOffloader`` builds one with no paged weights; not meant to be
    constructed by hand."""

    def __init__(self, blocks: Sequence[nn.Module], device, *, paged: Sequence[int] = (),
                 policy: Optional[Sequence[str]] = None,
                 prefetch_depth: int = default("prefetch_depth"),
                 offloader: Optional[SavedTensorPager] = None,
                 grad_sink: Optional[Callable[[nn.Parameter, torch.Tensor], bool]] = None,
                 host_home: Optional[Callable[[nn.Parameter], Optional[torch.Tensor]]] = None,
                 before_read: Optional[Callable[[List[nn.Parameter]], None]] = None,
                 min_paged_bytes: int = default("min_offload_bytes")):
        self.blocks = list(blocks)
        self.engine = offloader.engine if offloader is not None else CopyEngine(device)
        self.device = self.engine.device
        n = len(self.blocks)
        self.paged = sorted(set(paged))
        if any(i < 0 or i >= n for i in self.paged):
            raise ValueError(f"param_offload block indices {self.paged} out of range: the model "
                             f"has {n} blocks (0..{n - 1})")
        self.policy = list(policy) if policy is not None else [KEEP] * n
        if len(self.policy) != n or any(p not in POLICIES for p in self.policy):
            raise ValueError(f"policy must list one of {POLICIES} per block ({n} blocks)")
        self.prefetch_depth = prefetch_depth
        self.offloader = offloader
        self.grad_sink = grad_sink
        # Smaller tensors of a paged block stay on the device (LoRA adapters, norms):
        # trained ones then take the optimizer's ordinary path, accumulation included.
        self.min_paged_bytes = min_paged_bytes
        self._slots: Dict[int, List[_Slot]] = {}
        self._fetches: Dict[int, _Fetch] = {}
        # (forward, block) -> weight references that forward's graph saved and backward has
        # not unpacked yet: per forward, so a second forward before the first one's
        # backward (accumulation with retained graphs) does not reset the first's counts.
        self._refs: Dict[Tuple[int, int], int] = {}
        # The references each forward saved, and the backward now unpacking them: a
        # retained graph's next backward counts them all again.
        self._saved: Dict[Tuple[int, int], int] = {}
        self._ref_task: Dict[Tuple[int, int], int] = {}
        # Each block's saved references still held by a graph (autograd holds them until
        # their node has run in backward, or until the graph is freed without one).
        self._held: Dict[int, "weakref.WeakSet[_WeightRef]"] = {}
        self._gen = 0                     # the current forward
        self._began = False               # begin_forward() ran for the coming forward
        self._forwards: Dict[int, Any] = {}
        self.stats = {"fetches_forward": 0, "fetches_backward": 0, "fetch_misses": 0,
                      "bytes_h2d": 0}
        self.block_bytes: Dict[int, int] = {}
        self._host_home = host_home
        self._before_read = before_read
        self._registered: List[int] = []  # host buffers registered with CUDA (block homes)
        # attention.py's choice, entered around every block call (recomputation too).
        self.attention_context: Callable[[], Any] = contextlib.nullcontext
        self.can_page_trained: Callable[[], bool] = lambda: True
        for i, block in enumerate(self.blocks):
            if i in self.paged:
                self._slots[i] = self._paged_out(block)
                self.block_bytes[i] = sum(s.nbytes for s in self._slots[i])
            else:
                block.to(self.device)
            self._forwards[i] = block.forward
            block.forward = self._make_forward(i)

    # ------------------------------------------------------------------ setup
    def _page_out(self, block: nn.Module, host_home) -> List[_Slot]:
        """Moves the block's small tensors to the device and its big ones to their host
        homes: a trained weight's home from ``host_home`` (the param slot); a frozen
        tensor already in registered host memory (a shared base's mapping,
        ``load_model``) stays where it is and pages from there, so every process on the
        machine streams one copy; the others go into one host buffer for the block,
        registered with CUDA (pinned without the power-of-two rounding of torch's
        pinned allocator)."""
        slots: List[_Slot] = []
        pending = []  # (module, kind, name, tensor, param): need a home in the block buffer
        for module in block.modules():
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                if p.numel() * p.element_size() < self.min_paged_bytes:
                    p.data = p.data.to(self.device)
                    continue
                home = host_home(p) if (host_home is not None and p.requires_grad) else None
                if home is None and not p.requires_grad and registered_host(p.data):
                    home = p.data
                if home is None:
                    pending.append((module, "param", name, p.data, p))
                    continue
                p.data = home
                slots.append(_Slot(module, "param", name, home, p))
            for name, b in list(module._buffers.items()):
                if b is None:
                    continue
                if b.numel() * b.element_size() < self.min_paged_bytes:
                    module._buffers[name] = b.to(self.device)
                    continue
                if registered_host(b):
                    slots.append(_Slot(module, "buffer", name, b, None))
                    continue
                pending.append((module, "buffer", name, b, None))
        if pending:
            align = 256
            offsets, total = [], 0
            for *_, t, _p in pending:
                offsets.append(total)
                total += (t.numel() * t.element_size() + align - 1) // align * align
            buf = self._host_buffer(total)
            with torch.no_grad():
                for (module, kind, name, t, p), off in zip(pending, offsets):
                    n = t.numel() * t.element_size()
                    home = buf[off:off + n].view(t.dtype).view(t.shape)
                    home.copy_(t)
                    if p is not None:
                        p.data = home
                    else:
                        module._buffers[name] = home
                    slots.append(_Slot(module, kind, name, home, p))
        return slots

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        if not self.engine.cuda:
            return torch.empty(nbytes, dtype=torch.uint8)
        # Registered for as long as the block's tensors view it (after unwrap too);
        # unregistered before it is unmapped.
        buf = registered_empty(nbytes, tag="weights")
        if buf is None:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self._registered.append(buf.data_ptr())
        return buf

    def remove(self) -> None:
        """Gives each block its own forward back."""
        for block in self.blocks:
            if "forward" in block.__dict__:
                del block.forward
        self._fetches.clear()

    def page_out(self, i: int) -> bool:
        """Moves resident block i's tensors to host memory and pages them from now on.
        False (nothing moved) when the block has big trained tensors and
        ``can_page_trained()`` says the optimizer cannot take their gradients
        through ``grad_sink`` (its GPU or local modes update weights on the device)."""
        if i in self._slots:
            return False
        big_trained = any(p.requires_grad and p.numel() * p.element_size() >= self.min_paged_bytes
                          for p in self.blocks[i].parameters())
        if big_trained and not self.can_page_trained():
            return False
        self._slots[i] = self._paged_out(self.blocks[i])
        self.block_bytes[i] = sum(s.nbytes for s in self._slots[i])
        self.paged = sorted(self.paged + [i])
        return True

    def _paged_out(self, block: nn.Module) -> List[_Slot]:
        """_page_out, and the activation offloader stops treating the block's former
        device tensors as weights: their memory is freed, and an activation the allocator
        later puts there must be paged like any other."""
        before = {t.data_ptr() for t in list(block.parameters()) + list(block.buffers())}
        slots = self._page_out(block, self._host_home)
        _set_paged(block, True)
        if self.offloader is not None:
            self.offloader._weights -= before - {
                t.data_ptr() for t in list(block.parameters()) + list(block.buffers())}
        return slots

    def weights_referenced(self, block: Optional[int] = None) -> bool:
        """Whether a live graph (awaiting its backward, or retained for another one) holds
        references to paged weights, of ``block`` or of any block: weight blocks must not
        move then, since that backward would look for them where they were."""
        sets = self._held.values() if block is None else [self._held.get(block, ())]
        return any(len(held) > 0 for held in sets)

    def page_in(self, i: int) -> bool:
        """Brings paged block i back to residence: its tensors are copied to the device
        and no longer paged. A trained weight leaves its host home (the param slot),
        which the optimizer then copies each update from, as for any resident weight.
        Call between steps. False when block i is not paged, or when a graph still
        holds references to its paged weights."""
        slots = self._slots.get(i)
        if slots is None or self.weights_referenced(i):
            return False  # not paged, or a graph's backward will look for it paged
        with torch.no_grad():  # every copy first: one that fails leaves the block paged
            resident = [s.host.to(self.device, copy=True) for s in slots]
        del self._slots[i]
        for s, t in zip(slots, resident):
            if self.offloader is not None:  # a weight, not an activation to page
                self.offloader._weights.add(t.data_ptr())
            if s.param is not None:
                s.param.data = t
            else:
                s.module._buffers[s.name] = t
        self.block_bytes.pop(i, None)
        _set_paged(self.blocks[i], False)
        self.paged = [j for j in self.paged if j != i]
        self._fetches.pop(i, None)
        self._drop_counts(lambda gen, block: block == i)
        self._held.pop(i, None)
        return True

    def page_in_cost(self, i: int) -> int:
        """Device bytes block i takes resident: its paged tensors, plus gradients for
        the trained ones, plus the fp8 tensor-core copies its quantized linears build
        once resident (Note [The fp8 tensor-core copy lives only with resident weights])."""
        if i not in self._slots:
            return 0
        return sum(s.nbytes * (2 if s.param is not None and s.param.requires_grad else 1)
                   for s in self._slots[i]) + tensor_core_bytes(self.blocks[i], self.device)

    def restore_to_host(self) -> None:
        """Leaves every paged tensor in host memory it owns (unwrap): trained weights get
        a private copy of their home, the session's param slot, which is about to be
        unmapped; frozen ones keep the block's host buffer (still registered with CUDA,
        so the model can be paged again)."""
        with torch.no_grad():
            for slots in self._slots.values():
                for s in slots:
                    if s.param is not None and s.param.requires_grad:
                        s.param.data = s.host.clone()
        self._slots.clear()
        self.paged = []

    def set_policy(self, i: int, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: accepted: {POLICIES}")
        self.policy[i] = policy

    # ---------------------------------------------------------------- fetching
    def _fetch(self, i: int) -> _Fetch:
        slots = self._slots[i]
        if self._before_read is not None:
            self._before_read([s.param for s in slots
                               if s.param is not None and s.param.requires_grad])
        if self.engine.cuda:
            tensors = [torch.empty_like(s.host, device=self.device) for s in slots]
        else:
            tensors = [torch.empty_like(s.host) for s in slots]
        event = self.engine.to_device_many([(s.host, t) for s, t in zip(slots, tensors)])
        self.stats["bytes_h2d"] += self.block_bytes[i]
        return _Fetch(tensors, event)

    def _acquire(self, i: int, backward: bool) -> _Fetch:
        """Block i's weights on the device (fetched now if no prefetch was issued),
        after issuing prefetches for the next ``prefetch_depth`` paged blocks in the
        direction of travel."""
        f = self._fetches.get(i)
        if f is None:
            self.stats["fetch_misses"] += 1
            f = self._fetches[i] = self._fetch(i)
        self.stats["fetches_backward" if backward else "fetches_forward"] += 1
        step = -1 if backward else 1
        ahead = [j for j in self.paged if (j - i) * step > 0]
        ahead.sort(key=lambda j: (j - i) * step)
        for j in ahead[:self.prefetch_depth]:
            if j not in self._fetches:
                self._fetches[j] = self._fetch(j)
        self.engine.wait(f.event)
        return f

    def begin_forward(self) -> None:
        """Called as a training forward starts (before the layers that precede the
        blocks): drops what the last step left and prefetches the first paged blocks,
        so their copies overlap the embedding instead of stalling block 0."""
        self._fetches.clear()
        self._new_forward()
        for j in self.paged[:self.prefetch_depth + 1]:
            self._fetches[j] = self._fetch(j)
        self._began = bool(self.paged)

    def _release(self, i: int) -> None:
        self._fetches.pop(i, None)

    # Counts of graphs this many forwards old are dropped (a graph freed without
    # backward never unpacks its references).
    KEPT_FORWARDS = 8

    def _new_forward(self) -> None:
        self._gen += 1
        old = self._gen - self.KEPT_FORWARDS
        self._drop_counts(lambda gen, block: gen < old)

    def _drop_counts(self, drop: Callable[[int, int], bool]) -> None:
        """Forgets the reference counts of each (forward, block) that ``drop`` names."""
        for table in (self._refs, self._saved, self._ref_task):
            for key in [k for k in table if drop(*k)]:
                del table[key]

    # ---------------------------------------------------------------- forward
    def _make_forward(self, i: int):
        # A method bound to the block, not a plain closure: copy.deepcopy of the model
        # (an EMA copy, a checkpoint clone) rebinds it to the copied block, which then
        # runs its own class's forward instead of this pager's block i.
        def forward(block, *args, **kwargs):
            if block is not self.blocks[i]:
                return type(block).forward(block, *args, **kwargs)
            if self.policy[i] == RECOMPUTE and torch.is_grad_enabled():
                return checkpoint(self._run, i, False, *args, use_reentrant=False, **kwargs)
            return self._run(i, True, *args, **kwargs)
        return types.MethodType(forward, self.blocks[i])

    def _run(self, i: int, hooks: bool, *args, **kwargs):
        forward = self._forwards[i]
        if self.offloader is not None:
            self.offloader.poll()  # earlier blocks' finished activation copies

        def original(*a, **k):
            with self.attention_context():
                return forward(*a, **k)
        if i not in self._slots:
            if hooks and self.policy[i] == OFFLOAD and self.offloader is not None \
                    and torch.is_grad_enabled():
                with self.offloader:
                    return original(*args, **kwargs)
            return original(*args, **kwargs)
        backward = in_backward()
        if not backward and i == self.paged[0]:
            if not self._began:  # a new forward: whatever the last one left is stale
                self._fetches.clear()
                self._new_forward()
            self._began = False
        f = self._acquire(i, backward)
        slots = self._slots[i]
        saved = []
        grad = torch.is_grad_enabled()
        try:
            for k, (s, t) in enumerate(zip(slots, f.tensors)):
                table = s.module._parameters if s.kind == "param" else s.module._buffers
                saved.append((table, s.name, table[s.name]))
                given = t
                if s.param is not None and s.param.requires_grad and grad:
                    given = _PagedWeight.apply(s.param, _Holder(t, self.grad_sink))
                    f.nodes[id(given.grad_fn)] = k
                    f.bases.append(given.grad_fn)
                f.given[id(given)] = k
                f.bases.append(given)
                table[s.name] = given
            if hooks and grad:
                # Autograd keeps the pack hook with every tensor it saves until backward:
                # a strong reference to f here would keep this block's device copies
                # alive through the whole forward (every paged block's weights at once).
                # The hook only runs inside this call, while f is held here.
                fetch = weakref.ref(f)
                with torch.autograd.graph.saved_tensors_hooks(
                        lambda t: self._pack(i, fetch(), t), self._unpack):
                    out = original(*args, **kwargs)
            else:
                out = original(*args, **kwargs)
        finally:
            for table, name, value in saved:
                table[name] = value
            # The saved references hold no device memory: backward fetches again. The last
            # paged block stays, since backward starts with it. In a `finally`: recompute
            # in backward leaves by an exception (checkpoint stops the forward it reruns
            # once backward has what it needs), and each recomputed block's weights would
            # otherwise stay until the next forward.
            if backward or not self._refs.get((self._gen, i)) or i != self.paged[-1]:
                self._release(i)
        return out

    # ------------------------------------------------------------ saved tensors
    def _pack(self, i: int, f: _Fetch, t: torch.Tensor):
        ref = self._weight_ref(i, f, t)
        if ref is not None:
            ref.gen = self._gen
            key = (self._gen, i)
            self._refs[key] = self._refs.get(key, 0) + 1
            self._saved[key] = self._saved.get(key, 0) + 1
            self._held.setdefault(i, weakref.WeakSet()).add(ref)
            return ref
        if self.policy[i] == OFFLOAD and self.offloader is not None:
            return self.offloader.pack(t)
        # Detached (autograd restores what it needs on unpack): a saved output kept as
        # itself would refer back to the node that saved it, a cycle through C++ that no
        # collection breaks, so a graph dropped without backward would never be freed.
        return t.detach()

    def _weight_ref(self, i: int, f: _Fetch, t: torch.Tensor) -> Optional[_WeightRef]:
        k = f.given.get(id(t))
        if k is not None and self._is_given(f, k, t):
            return _WeightRef(i, k, None)
        base = t._base
        if base is not None:
            k = f.given.get(id(base))
            if k is not None and self._is_given(f, k, base):
                return _WeightRef(i, k, t)
        node = t.grad_fn
        if node is not None and type(node).__name__ == "ToCopyBackward0":
            nxt = node.next_functions[0][0] if node.next_functions else None
            k = f.nodes.get(id(nxt))
            if k is not None:
                return _WeightRef(i, k, None, dtype=t.dtype)
        return None

    @staticmethod
    def _is_given(f: _Fetch, k: int, t: torch.Tensor) -> bool:
        return any(b is t for b in f.bases)

    def _unpack(self, packed):
        if isinstance(packed, _WeightRef):
            f = self._acquire(packed.block, True)
            t = f.tensors[packed.index]
            if packed.size is not None:
                t = t.as_strided(packed.size, packed.stride, packed.offset)
            if packed.dtype is not None:
                t = t.to(packed.dtype)
            key = (packed.gen, packed.block)
            task = torch._C._current_graph_task_id()
            if self._ref_task.get(key, task) != task:  # a retained graph's next backward
                self._refs[key] = self._saved.get(key, 0)
            self._ref_task[key] = task
            left = self._refs.get(key, 0) - 1
            self._refs[key] = left
            if left <= 0:
                self._release(packed.block)
            return t
        if self.offloader is not None:
            return self.offloader.unpack(packed)
        return packed

    # ------------------------------------------------------------------ report
    def report(self) -> Dict[str, Any]:
        return {"paged_blocks": list(self.paged), "resident_blocks":
                [i for i in range(len(self.blocks)) if i not in self._slots],
                "paged_bytes": sum(self.block_bytes.values()),
                "bytes_per_paged_block": max(self.block_bytes.values(), default=0),
                "prefetch_depth": self.prefetch_depth,
                "host_buffers_registered": len(self._registered), **self.stats}
