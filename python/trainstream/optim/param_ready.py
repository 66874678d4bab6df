"""ParamReadyHooks: a read of a weight waits for its in-flight update (``guard_params``).

Note [When a weight's update is in flight]
With ``grad_post="backward"`` (the default) and no clipping, a parameter's update
starts as soon as backward makes its gradient final, and ends before ``step()``
returns. Between the two, a read of the weight can meet the update half done:

* ``optimizer_mode="cpu"``: the daemon applies the update at once and writes the new
  weight into the parameter's param slot in shared memory, then answers PARAM_READY.
  A paged weight's storage *is* its param slot (streaming/weights.py), so a fetch of
  its block in that window (a forward between backward and ``step()``: an evaluation,
  a logging pass) copies a slot the daemon may be writing: some elements old, some
  new. A resident weight is its own tensor, which ``step()`` copies the slot into, so
  a read in the window sees the previous weight while its successor is already
  computed; the guard makes it see the new one, as a paged weight then does.
* ``optimizer_mode="gpu"``: the update kernel writes the parameter in place on a side
  stream, which the compute stream waits for only in ``step()``: a read in the window
  races with it on the device.
* In backward, the same holds for a module that reads a weight whose gradient is
  already final, which autograd allows only for a read outside the graph (a
  ``detach()``ed weight in a checkpointed region's recomputation): a weight the graph
  uses has its gradient final only after every use's backward, recomputation included.

There is no window, and the hooks do nothing but their one check per module call,
when updates wait for ``step()``: with ``max_grad_norm`` (the global norm needs every
gradient first), ``grad_post="step"``, replicated data parallel (gradients are
averaged in ``step()``), on local rank 0 of a data-parallel group over several
machines (its own ``step()`` all-reduces what the updates wait for), and after
``offload="auto"`` went local (torch's AdamW runs in ``step()``; ``detach()`` removed
the hooks then). ``report()["window"]`` says which case holds, and ``waits`` stays 0
(tests/python/test_param_ready_hooks.py). What the check costs was measured on the
2-core dev machine: a hooked module call with nothing in flight took what a call with
an empty forward pre-hook takes, 1-2 us more than one without hooks (torch's hook
dispatch; 200 Linear(8, 8) modules under no_grad).
"""
from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
from torch import nn

from .backend import ParamEntry, ParamTable


class ParamReadyHooks:
    """Forward pre-hooks that make a read of a weight wait for its in-flight update.

    One pre-hook per module that owns parameters (module-level: nothing per tensor).
    When nothing is in flight it returns after one check (``ParamTable.in_flight`` is
    empty). Otherwise, for each of the module's own parameters whose update is in
    flight, it waits for that update (``land``: the daemon's PARAM_READY, whose new
    weight it copies in as ``step()`` would; in gpu mode the current stream waits for
    the update stream) before the module runs, so the module reads one whole version.
    The weight pager calls ``wait_for`` before it copies a paged block from its param
    slots, prefetches included (``OffloadAdamW.weights_ready``). Where and when the
    window exists: Note [When a weight's update is in flight] (this module).

    A read that goes around a module's call (a parent reading ``child.weight``
    directly, or ``child.forward(x)`` called by hand) is not seen; ``step()`` and
    ``synchronize()`` end every update.

    Exported as ``trainstream.ParamReadyHooks``: ``OffloadAdamW.attach(model,
    guard=True)`` builds it (wrap() does) and ``detach()`` removes it; not meant to be
    constructed by hand."""

    def __init__(self, table: ParamTable, land: Callable[[List[ParamEntry]], None],
                 lands_early: Callable[[], bool]):
        """``land(entries)``: the backend's (returns once their updates landed);
        ``lands_early()``: whether the backend has a window at all."""
        self._in_flight: Dict[int, ParamEntry] = table.in_flight  # cleared, never replaced
        self._land = land
        self._lands_early = lands_early
        self._handles: List[Any] = []
        self._model: Optional[weakref.ref] = None
        self.stats: Dict[str, Any] = {"waits": 0, "params_waited": 0, "wait_s": 0.0}

    # ------------------------------------------------------------------ install
    def install(self, model: nn.Module) -> None:
        """Puts a pre-hook on every module of ``model`` that owns parameters (those on
        another model are removed first)."""
        self.remove()
        # A closure, not a bound method: copy.deepcopy of the model (an EMA copy) copies
        # its hooks, and would copy this object, the optimizer's entries with it, along
        # with a bound method. The copy's modules own other tensors, which are never in
        # flight: there the hook stays a check.
        in_flight, wait_for = self._in_flight, self.wait_for

        def before_forward(module: nn.Module, args):
            if in_flight:  # the fast path: one check when nothing is in flight
                wait_for(module._parameters.values())
        for m in model.modules():
            if any(p is not None for p in m._parameters.values()):
                self._handles.append(m.register_forward_pre_hook(before_forward, prepend=True))
        self._model = weakref.ref(model)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._model = None

    @property
    def model(self) -> Optional[nn.Module]:
        """The model the hooks are on (None when removed)."""
        return self._model() if self._model is not None else None

    @property
    def modules(self) -> int:
        """How many modules carry a hook."""
        return len(self._handles)

    # ------------------------------------------------------------------ wait
    def wait_for(self, params: Iterable[Optional[torch.Tensor]]) -> None:
        """Returns once no update of ``params`` is in flight (at once when none is)."""
        in_flight = self._in_flight
        if not in_flight:
            return
        entries = [e for e in (in_flight.get(id(p)) for p in params if p is not None)
                   if e is not None]
        if not entries:
            return
        t0 = time.perf_counter()
        self._land(entries)
        s = self.stats
        s["waits"] += 1
        s["params_waited"] += len(entries)
        s["wait_s"] += time.perf_counter() - t0

    def report(self) -> Dict[str, Any]:
        """``modules`` hooked, ``window`` (whether this mode lets an update land before
        ``step()``: Note [When a weight's update is in flight]), ``waits`` (module calls
        or block fetches that waited), ``params_waited`` and ``wait_s``."""
        return {"modules": self.modules, "window": bool(self._lands_early()), **self.stats}
