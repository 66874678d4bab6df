"""What ``OffloadAdamW`` and its backends share: the parameter table and the protocol.

``OffloadAdamW`` (offload_adamw.py) is a ``torch.optim.Optimizer`` facade: it keeps the
parameter groups and one ``ParamEntry`` per parameter (its gradient hook, how many
backward passes reached it, what was posted), validates hyperparameters, and hands
every update to one ``Backend``:

* ``DaemonBackend`` (daemon_backend.py, ``optimizer_mode="cpu"``): the daemon's AdamW
  over the session's command ring; gradients go through staging slots.
* ``ZeroCopyBackend`` (zero_copy.py, ``optimizer_mode="gpu"``): a CUDA kernel updates
  the weights in VRAM with the moments in the daemon's pinned memory.
* ``LocalBackend`` (local.py, ``"local"``): torch's fused AdamW on the GPU, once
  ``offload="auto"`` found that it fits (``decide_offload``, local.py).

Backends see the parameters through a ``ParamTable``, never through the facade's
attributes, and answer through the protocol below.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Tuple

import torch

from .._native.wire import (MASTER_STATE_BYTES_BFLOAT16, MASTER_STATE_BYTES_FLOAT16,
                            MASTER_STATE_BYTES_FLOAT32)
from ..options import check_adamw_hyper

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Bytes per element of the daemon's master beyond the weight slot, by the weight's dtype
# (Note [One host copy of a trained weight], trainstream/wire/segment_header.h).
_MASTER_STATE_BYTES = {torch.float32: MASTER_STATE_BYTES_FLOAT32,
                       torch.bfloat16: MASTER_STATE_BYTES_BFLOAT16,
                       torch.float16: MASTER_STATE_BYTES_FLOAT16}


def master_state_bytes(p: torch.Tensor) -> int:
    """Bytes the daemon's fp32 master of trained tensor ``p`` takes in its state segment
    beyond the weight slot: 0 for fp32 (the slot is the master), 2 an element for bf16
    (the low halves), 4 for fp16 (a whole fp32 master)."""
    return p.numel() * _MASTER_STATE_BYTES[p.dtype]


@dataclass
class ParamEntry:
    """One parameter known to the optimizer. Guarded by the GIL (hooks and step())."""
    param_id: int
    param: torch.Tensor
    name: str
    group: int
    grad_slot: Optional[torch.Tensor] = None
    param_slot: Optional[torch.Tensor] = None
    sum_slot: Optional[torch.Tensor] = None  # data-parallel group: the fp32 machine sum
    # A gradient staging pool (grad_pool.py): the registration's GradPool, and where the
    # last posted gradient lies in it (grad_slot is then that extent).
    pool: Any = None
    pool_pos: int = 0
    backward_count: int = 0      # backward passes that reached this param since the last step
    posted_step: int = 0         # the step whose gradient was posted, 0 if none pending
    posted_seq: int = 0          # its GRAD_READY command's seq (the daemon's ERROR names it)
    posted_grad: Optional[torch.Tensor] = None
    posted_version: int = -1
    hook: Any = None
    # Weight paging (streaming/weights.py): the gradient arrives through accept_grad,
    # never in p.grad; with accumulation it is summed here until it is final.
    external: bool = False
    external_grad: Optional[torch.Tensor] = None
    # Note [Weights written from outside the engine] (weight_writes.py): the parameter's
    # version counter when the optimizer last wrote it or took it as its master's value,
    # and whether it was written while its update was in flight.
    weight_version: int = -1
    weight_written_in_flight: bool = False

    def mark_weight(self) -> None:
        """The weight is what the optimizer holds as its value (after writing it)."""
        self.weight_version = self.param._version

    def weight_written(self) -> bool:
        """Whether an in-place write (``copy_``, ``load_state_dict``, ``torch.nn.init``,
        ``mul_`` under ``no_grad``) changed the weight since ``mark_weight``."""
        return self.param._version != self.weight_version


class ParamTable:
    """The parameters of one ``OffloadAdamW`` as its backends see them: entries by
    ``id(param)`` and by ``param_id``, the validated options, the step counter and the
    statistics. Holds the optimizer weakly (the parameters' hooks must not keep a
    discarded optimizer, and its daemon session, alive)."""

    def __init__(self, optimizer: torch.optim.Optimizer, options: Dict[str, Any]):
        self._optimizer = weakref.ref(optimizer)
        self.options = options
        self.entries: Dict[int, ParamEntry] = {}   # id(param) -> entry
        self.by_id: Dict[int, ParamEntry] = {}     # param_id -> entry
        self.step_id = 0  # the last step ended (applied, skipped or rejected)
        self._groups_checked = 0  # the step whose hyperparameters were last checked
        self.dp: Any = None  # data_parallel.DataParallelPlan, or None
        # Updates handed over in backward that can land before step() ends (the window
        # ParamReadyHooks guards, param_ready.py), not landed yet: id(param) -> entry.
        # Cleared, never replaced: the hooks hold this dict.
        self.in_flight: Dict[int, ParamEntry] = {}
        self.event: Callable[..., None] = self._print_event
        self.stats: Dict[str, Any] = {"steps": 0, "skipped_steps": 0, "grads_posted": 0,
                                      "bytes_d2h": 0, "bytes_h2d": 0, "step_wait_s": 0.0}

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self._optimizer().param_groups

    def _print_event(self, kind: str, **details) -> None:
        if self.options["verbose"]:
            print(f"trainstream: {kind}: {details}")

    def in_group(self) -> bool:
        """A data-parallel rank whose session shares the machine's one state."""
        return self.dp is not None and self.dp.mode == "group"

    def replicated(self) -> bool:
        """A data-parallel rank with its own state, averaging gradients itself."""
        return self.dp is not None and self.dp.mode == "replicated"

    def posts_in_backward(self) -> bool:
        """Whether a final gradient leaves in backward (posted or, in gpu mode, launched)
        rather than in step()."""
        return self.options["grad_post"] == "backward" and not self.replicated()

    def between_steps(self) -> bool:
        """True when no backward has run since the last step() (no gradient pending)."""
        return all(e.backward_count == 0 and e.external_grad is None
                   for e in self.entries.values())

    def clear_pending(self) -> None:
        self.in_flight.clear()
        for e in self.entries.values():
            e.backward_count = 0
            e.posted_step = 0
            e.posted_grad = None
            e.external = False
            e.external_grad = None
            e.weight_written_in_flight = False

    def check_groups(self, force: bool = False) -> None:
        """Every group's hyperparameters, before the first gradient of a step leaves (and
        again in step()): a scheduler may have set a value AdamW does not take, and
        finding it part way through would leave the step half-posted."""
        step = self.step_id + 1
        if self._groups_checked == step and not force:
            return
        for i, g in enumerate(self.param_groups):
            check_adamw_hyper(g["lr"], g["betas"], g["eps"], g["weight_decay"],
                              where=f"param_groups[{i}]: ")
        self._groups_checked = step

    def count_backward(self, e: ParamEntry) -> bool:
        """Counts one backward pass reaching ``e``. True when that makes its gradient
        final and it leaves now, in backward (posted or, in gpu mode, launched); then
        every group's hyperparameters are checked first, before anything of the step
        is counted or sent. Replicated data parallel averages every gradient across
        ranks in step() first."""
        n = self.options["accumulation_steps"]
        leaves = e.backward_count + 1 == n and self.posts_in_backward()
        if leaves:
            self.check_groups()
        e.backward_count += 1
        if e.backward_count > n:
            raise RuntimeError(
                f"trainstream: backward() reached {e.name} {e.backward_count} times since the last "
                f"optimizer.step(), but accumulation_steps={n}; call step() after every {n} "
                f"backward pass(es) or pass accumulation_steps=<micro-batches> to wrap()")
        return leaves

    def entries_of(self, params, what: str) -> List[ParamEntry]:
        """The entries of ``params`` (None: every one); ValueError naming ``what`` for a
        tensor that is not one of this optimizer's parameters."""
        if params is None:
            return list(self.entries.values())
        out = []
        for p in params:
            e = self.entries.get(id(p))
            if e is None:
                raise ValueError(f"{what}: a tensor of shape {tuple(p.shape)} is not a "
                                 "parameter of this optimizer")
            out.append(e)
        return out

    def require_between_steps(self, what: str) -> None:
        """Raises unless no backward has run since the last step(): ``what`` would take
        weights whose updates may be in flight."""
        if not self.between_steps():
            raise RuntimeError(f"trainstream: {what} was called between backward and step(); "
                               "call it after step() and before the next backward")

    def check_unchanged(self, e: ParamEntry) -> None:
        """Raises when ``e``'s gradient, handed over in backward (posted to the daemon,
        or applied on the GPU), was changed or replaced before step(): the update used
        the gradient as it was. The one error for this in both modes."""
        g = e.param.grad
        if g is not e.posted_grad or g._version != e.posted_version:
            raise RuntimeError(
                f"trainstream: the gradient of {e.name} changed after backward had handed it "
                "over (e.g. clip_grad_norm_ or GradScaler.unscale_). Pass max_grad_norm=... "
                "to wrap() for clipping, or grad_post='step' to hand gradients over in step()")


def begin_step(table: "ParamTable", require_attached, closure) -> Tuple[Any, int]:
    """What every backend's ``step()`` does first: ``require_attached()`` (the session
    must be attached and its daemon alive; a backend that resumes after the daemon died
    passes its resumable form), the closure (if any) runs with gradients enabled, and
    every group's hyper-parameters are checked again. Returns the closure's loss and the
    number of the step taken."""
    require_attached()
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    table.check_groups(force=True)
    return loss, table.step_id + 1


class Backend(Protocol):
    """Where the update runs. One per attached ``OffloadAdamW``; ``close()`` ends it."""
    mode: str  # "cpu", "gpu" or "local": OffloadAdamW.optimizer_mode

    def register(self, entries: List[ParamEntry]) -> None:
        """Takes new parameters (their state starts from the current weights)."""

    def grad_final(self, e: ParamEntry) -> None:
        """``e.param.grad`` is final and leaves now, in backward."""

    def accept_grad(self, e: ParamEntry, grad: torch.Tensor, final: bool) -> bool:
        """A paged weight's gradient (never in ``p.grad``); False: not taken here."""

    def step(self, closure) -> Any:
        """The optimizer step; returns the closure's loss."""

    def before_zero_grad(self) -> None:
        """zero_grad() is about to drop the gradients: end a step left half done."""

    def synchronize(self) -> None:
        """Waits until every update posted so far is finished."""

    def lands_early(self) -> bool:
        """Whether an update handed over in backward can land before step() ends (then
        ``ParamTable.in_flight`` lists those not landed yet); False: nothing changes a
        weight between backward and step(), and ``land`` has nothing to do."""

    def land(self, entries: List[ParamEntry]) -> None:
        """Returns once the in-flight update of each of ``entries`` has landed in the
        weight that the next read sees (taking them off ``ParamTable.in_flight``)."""

    def sync_weights_from_model(self, params: Optional[List[torch.Tensor]]) -> None:
        """Takes the weights of ``params`` (None: all) as their masters' values."""

    def state_dict(self) -> Dict[str, Any]:
        """``torch.optim.AdamW``'s format (plus ``master_weight`` where kept)."""

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a ``torch.optim.AdamW`` (or ``OffloadAdamW``) state dict."""

    def regions(self) -> List[Dict[str, Any]]:
        """The shared-memory regions this backend maps: ``purpose``, ``address``,
        ``bytes`` and ``registered`` (with CUDA)."""

    def stats(self) -> Dict[str, Any]:
        """Figures of this backend, merged into ``OffloadAdamW.stats()``."""

    def last_grad_norm(self) -> Any:
        """The last step's gradient norm (a float, a 0-dim tensor, or None)."""

    def close(self) -> None:
        """Ends the backend (its daemon session, if any)."""


def pack_groups(param_groups) -> Tuple[List[Dict[str, Any]], Dict[int, int]]:
    """``torch.optim.Optimizer.state_dict``'s groups (params as indices) and each
    parameter's index."""
    order: Dict[int, int] = {}
    groups = []
    for g in param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = []
        for p in g["params"]:
            order.setdefault(id(p), len(order))
            packed["params"].append(order[id(p)])
        groups.append(packed)
    return groups, order


def unpack_state(table: ParamTable, state_dict: Dict[str, Any]
                 ) -> Iterator[Tuple[ParamEntry, Dict[str, Any]]]:
    """Checks ``state_dict``'s groups against this optimizer's, takes their
    hyperparameters and yields each parameter's (entry, state)."""
    groups = state_dict["param_groups"]
    mine_groups = table.param_groups
    if len(groups) != len(mine_groups):
        raise ValueError(f"state_dict has {len(groups)} parameter groups, this optimizer "
                         f"{len(mine_groups)}")
    params = [p for g in mine_groups for p in g["params"]]
    for mine, theirs in zip(mine_groups, groups):
        if len(mine["params"]) != len(theirs["params"]):
            raise ValueError("state_dict's parameter groups differ in size from this optimizer's")
        for k, v in theirs.items():
            if k != "params":
                mine[k] = tuple(v) if k == "betas" else v
    index_of: Dict[int, int] = {}
    for theirs in groups:
        for idx in theirs["params"]:
            index_of[idx] = len(index_of)
    for idx, s in state_dict["state"].items():
        yield table.entries[id(params[index_of[idx]])], s
