"""OffloadAdamW: an AdamW whose master weights, moments and update live in the daemon.

The flow for one step (DESIGN.md, "Optimizer flow"):

1. As each gradient becomes final during backward (a post-accumulate-grad hook),
   it is copied into its staging slot in shared memory and GRAD_READY is posted
   on the session's command ring (``grad_post="backward"``, the default); with
   ``grad_post="step"`` that happens in ``step()`` instead.
2. ``step()`` posts STEP_END; the daemon's workers update each parameter (at
   once for each gradient when no clipping is asked for, else after the global
   norm is known) and answer PARAM_READY.
3. The new weights are copied from the param slots back into the parameters.

Hyper-parameters travel with every GRAD_READY, so LR schedulers and edits of
``param_groups`` take effect on the next step, as with torch's optimizers.
"""
from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch

from . import _daemon, _gpu_adamw
from . import distributed as _distributed
from ._options import check_adamw_hyper, validate
from ._pinning import register_fresh
from .errors import DaemonError, NonFiniteGradientError, TrainStreamError

from ._wire import (  # the wire format, pinned to the C++ headers by test_wire_constants.py
    FIELD_EXP_AVG as _FIELD_EXP_AVG,
    FIELD_EXP_AVG_SQ as _FIELD_EXP_AVG_SQ,
    FIELD_MASTER as _FIELD_MASTER,
    FIELD_PARAM_FROM_SLOT as _FIELD_PARAM_FROM_SLOT,
    FIELD_STEP as _FIELD_STEP,
    OP_ERROR as _OP_ERROR,
    OP_GROUP_BROKEN as _OP_GROUP_BROKEN,
    OP_PARAM_READY as _OP_PARAM_READY,
    OP_STATE_DONE as _OP_STATE_DONE,
    OP_STEP_DONE as _OP_STEP_DONE,
    OP_SYNC_DONE as _OP_SYNC_DONE,
    STATUS_OK as _STATUS_OK,
    STATUS_SKIPPED_NONFINITE as _STATUS_SKIPPED_NONFINITE,
)

_STEP_REPLIES = (_OP_PARAM_READY, _OP_STEP_DONE)  # what a step() waits for

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _C():
    from . import _C as c  # noqa: PLC0415
    return c


@dataclass
class _Param:
    """One parameter known to the daemon. Guarded by the GIL (hooks and step())."""
    param_id: int
    param: torch.Tensor
    name: str
    group: int
    grad_slot: Optional[torch.Tensor] = None
    param_slot: Optional[torch.Tensor] = None
    sum_slot: Optional[torch.Tensor] = None  # data-parallel group: the fp32 machine sum
    backward_count: int = 0      # backward passes that reached this param since the last step
    posted_step: int = 0         # the step whose gradient was posted, 0 if none pending
    posted_seq: int = 0          # its GRAD_READY command's seq (the daemon's ERROR names it)
    posted_grad: Optional[torch.Tensor] = None
    posted_version: int = -1
    hook: Any = None
    # Weight paging (paging.py): the gradient arrives through accept_grad, never in
    # p.grad; with accumulation it is summed here until it is final.
    external: bool = False
    external_grad: Optional[torch.Tensor] = None


@dataclass
class _Finishing:
    """A step being ended (_finish_step): what is still awaited, and what came."""
    step: int
    pending: Set[int]  # param_ids whose PARAM_READY has not come
    result: Dict[str, Any] = field(default_factory=dict)  # the STEP_DONE completion
    rejected: List[Tuple[str, str]] = field(default_factory=list)  # (name, why)
    end_sent: bool = False


def _weak_hook(opt: "OffloadAdamW") -> Callable[[torch.Tensor], None]:
    """The gradient hook, holding its optimizer weakly: the parameters must not keep a
    discarded optimizer (and its daemon session) alive, nor let it take the gradients
    of the optimizer that replaced it."""
    ref = weakref.ref(opt)

    def hook(p: torch.Tensor) -> None:
        o = ref()
        if o is not None:
            o._on_grad_final(p)
    return hook


class OffloadAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` with its state and update in the TrainStream daemon.

    Same hyper-parameters and ``state_dict`` format as ``torch.optim.AdamW`` (plus
    each parameter's fp32 ``master_weight``). Extra keyword options are those of
    ``trainstream.wrap`` (README, "Options").
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, amsgrad: bool = False, maximize: bool = False,
                 names: Optional[Dict[int, str]] = None, attach: bool = True, **options):
        if amsgrad or maximize:
            raise ValueError("OffloadAdamW supports amsgrad=False and maximize=False only")
        check_adamw_hyper(lr, betas, eps, weight_decay)
        self._options = validate(options)
        self._names = names or {}
        self._entries: Dict[int, _Param] = {}   # id(param) -> entry
        self._by_id: Dict[int, _Param] = {}     # param_id -> entry
        self._next_param_id = 0
        self._client = None
        self._session = None
        self._plane = None
        self._regions: List[Any] = []  # mappings the slot tensors view; kept alive
        self._scratch = None
        self._registered_host: List[int] = []
        # Called before the daemon session ends (offload="auto" going local, unwrap):
        # users of the session's memory outside the optimizer (activation pages) move out.
        self.before_detach: List[Callable[[], None]] = []
        self._step_id = 0
        self._backlog: List[Dict[str, Any]] = []  # completions kept for a later wait
        self._finishing: Optional[_Finishing] = None  # the step being ended, if interrupted
        self._groups_checked = 0  # the step whose hyperparameters were last checked
        # Note [After the daemon is gone]: why, once it is; None while it answers.
        self._daemon_gone: Optional[str] = None
        self._probed_step = 0  # the step whose backward last asked the session if it lives
        self._gpu: Optional[_gpu_adamw.ZeroCopyAdamW] = None  # optimizer_mode="gpu"
        self.optimizer_mode: Optional[str] = None  # resolved at attach()
        # offload="auto": after two steps, torch's fused AdamW on the GPU when it fits.
        self._local: Optional[torch.optim.Optimizer] = None
        self.offload_decision: Optional[Dict[str, Any]] = None
        self._event_sink = None  # wrap() points this at the session's event log
        self._dp: Optional[_distributed.DataParallelPlan] = None
        self._last_grad_norm: Any = None  # a float, or in local mode a 0-dim tensor
        self._stats = {"steps": 0, "skipped_steps": 0, "grads_posted": 0, "bytes_d2h": 0,
                       "bytes_h2d": 0, "step_wait_s": 0.0}
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        if attach:
            self.attach()

    # ------------------------------------------------------------------ setup
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group_index = len(self.param_groups) - 1
        g = self.param_groups[group_index]
        check_adamw_hyper(g["lr"], g["betas"], g["eps"], g["weight_decay"])
        new = []
        for p in g["params"]:
            if p.dtype not in _DTYPE_NAMES:
                raise ValueError(f"parameter dtype {p.dtype} is not supported; accepted: "
                                 f"{', '.join(str(d) for d in _DTYPE_NAMES)}")
            e = _Param(self._next_param_id, p, self._names.get(id(p), f"param{self._next_param_id}"),
                       group_index)
            self._next_param_id += 1
            self._entries[id(p)] = e
            self._by_id[e.param_id] = e
            if p.requires_grad:
                e.hook = p.register_post_accumulate_grad_hook(_weak_hook(self))
            new.append(e)
        if self._session is not None:
            self._register(new)

    def _resolve_mode(self) -> str:
        mode = self._options["optimizer_mode"]
        if mode == "cpu":
            return "cpu"
        if self._dp is not None:
            if mode == "gpu":
                raise ValueError("option optimizer_mode='gpu' cannot run with data parallel "
                                 "(the ranks share the daemon's one optimizer state); accepted "
                                 "here: 'cpu' or 'auto'")
            return "cpu"
        params = [e.param for e in self._entries.values()]
        why = _gpu_adamw.unavailable_reason(params)
        if mode == "gpu":
            if why is not None:
                raise ValueError(f"option optimizer_mode='gpu' cannot run here: {why}; "
                                 "accepted here: 'cpu' or 'auto'")
            return "gpu"
        # "auto": the zero-copy CUDA update when it can run (it beat the daemon's host
        # AdamW on the 1.5B benchmark, docs/offload.md); the daemon's AdamW otherwise,
        # and always for data-parallel ranks, which share the daemon's one state.
        if why is not None or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return "cpu"
        if any(not p.is_contiguous() for p in params if p.requires_grad):
            return "cpu"
        return "gpu"

    def attach(self) -> None:
        """Connects to the daemon (starting one if needed) and registers every parameter."""
        if self._session is not None:
            return
        opts = self._options
        self._dp = _distributed.plan(opts)
        if self._dp is not None:
            self._dp.setup_collectives()
        self._client = _daemon.connect(opts["socket"])
        rank = int(os.environ.get("RANK", -1))
        local_rank = int(os.environ.get("LOCAL_RANK", -1))
        job = opts["job"] or os.environ.get("TORCHELASTIC_RUN_ID") or f"pid{os.getpid()}"
        for e in self._entries.values():  # hooks removed by release_hooks()
            if e.hook is None and e.param.requires_grad:
                e.hook = e.param.register_post_accumulate_grad_hook(_weak_hook(self))
        group = self._dp.membership() if self._in_group() else None
        self._session = self._call(self._client.attach, job, rank, local_rank, group)
        control = self._session.control
        self._plane = _C().DataPlane(control.address, control.size, int(opts["timeout_s"] * 1000))
        try:
            self.optimizer_mode = self._resolve_mode()
            if self.optimizer_mode == "gpu":
                moment = "float32" if opts["moment_dtype"] == "auto" else opts["moment_dtype"]
                self._gpu = _gpu_adamw.ZeroCopyAdamW(self, moment, int(opts["seed"]))
            self._register(list(self._entries.values()))
        except BaseException:
            self.detach()
            raise

    def detach(self) -> None:
        """Ends the daemon session (its memory is freed). ``attach()`` starts a new one
        with the current weights as masters and fresh moments."""
        try:
            for leave in self.before_detach:
                leave()
        finally:
            self._end_session()

    def _end_session(self) -> None:
        if self._gpu is not None:
            self._gpu.close(self._session)
            self._gpu = None
        for addr in self._registered_host:
            _C().unregister_host(addr)
        self._registered_host.clear()
        for e in self._entries.values():
            e.grad_slot = e.param_slot = None
            e.posted_step = 0
        self._backlog = []  # the old session's replies
        self._finishing = None
        self._clear_pending()  # a step of the old session never completes
        self._daemon_gone = None
        self._probed_step = 0
        self._plane = None
        self._scratch = None
        self._regions.clear()
        if self._session is not None:
            self._session.detach()
        self._session = None
        self._client = None

    def release_hooks(self) -> None:
        """Removes the gradient hooks from the parameters (``unwrap()`` does this after
        ``detach()``; ``attach()`` puts them back)."""
        for e in self._entries.values():
            if e.hook is not None:
                e.hook.remove()
                e.hook = None

    def __del__(self):
        try:
            self.detach()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass

    def _register(self, entries: List[_Param]) -> None:
        if not entries:
            return
        if self._gpu is not None:
            self._gpu.register(self._session, entries, self._options["verbose"])
            return
        groups = [dict(lr=float(g["lr"]), beta1=float(g["betas"][0]), beta2=float(g["betas"][1]),
                       eps=float(g["eps"]), weight_decay=float(g["weight_decay"]))
                  for g in self.param_groups]
        specs = [dict(param_id=e.param_id, name=e.name, shape=list(e.param.shape) or [1],
                      dtype=_DTYPE_NAMES[e.param.dtype], grad_dtype=_DTYPE_NAMES[e.param.dtype],
                      group=e.group) for e in entries]
        moment = self._options["moment_dtype"]
        moment = "float32" if moment == "auto" else moment
        checksum = _distributed.weights_checksum([(e.name, e.param) for e in entries]) \
            if self._dp is not None else ""
        if self._dp is not None:
            self._dp.check_same_weights(checksum)
        staging, slots = self._call(self._session.register_parameters, groups, specs, moment,
                                    float(self._options["max_grad_norm"] or 0.0),
                                    int(self._options["seed"]), checksum,
                                    int(self._options["threads"] or 0))
        self._regions.append(staging)
        c = _C()
        if any(e.param.is_cuda for e in entries) and c.with_cuda:
            ok, why = register_fresh(staging.base_address, staging.segment_size)
            if ok:
                self._registered_host.append(staging.base_address)
            elif self._options["verbose"]:
                print(f"trainstream: cudaHostRegister of the staging segment failed ({why}); "
                      "copies will be pageable and slower")
        for s in slots:
            e = self._by_id[s["param_id"]]
            name = _DTYPE_NAMES[e.param.dtype]
            e.grad_slot = c.tensor_from_address(staging.base_address + s["grad_offset"],
                                                [s["numel"]], name)
            e.param_slot = c.tensor_from_address(staging.base_address + s["param_offset"],
                                                 [s["numel"]], name)
            if self._in_group():
                e.sum_slot = c.tensor_from_address(staging.base_address + s["sum_offset"],
                                                   [s["numel"]], "float32")
        # A group's masters come from local rank 0's weights (the daemon checked
        # every rank's checksum against them); the param slot is the group's one.
        writes_slots = not self._in_group() or self._dp.leader
        if writes_slots:
            with torch.no_grad():
                for s in slots:
                    e = self._by_id[s["param_id"]]
                    e.param_slot.copy_(e.param.detach().reshape(-1))
            # Every slot is written before the daemon initialises the masters from them.
            for s in slots:
                self._plane.post_state(True, s["param_id"], _FIELD_PARAM_FROM_SLOT, 0, 0, 0, 0)
        self._sync()

    # -------------------------------------------------------------- data plane
    def _on_grad_final(self, p: torch.Tensor) -> None:
        e = self._entries.get(id(p))
        if e is None or self._plane is None or p.grad is None:
            # (None: a paged weight, whose gradient went to accept_grad; autograd still
            # runs the hook with nothing accumulated.)
            return
        self._ensure_daemon(in_backward=True)
        if self._count_backward(e):
            if self._gpu is not None:
                self._gpu.on_grad_final(e)
            else:
                self._post_grad(e)

    def accept_grad(self, p: torch.Tensor, grad: torch.Tensor) -> bool:
        """Takes a gradient of ``p`` computed where ``p.grad`` never holds it (weight
        paging: the weight's device copy is gone once its block's backward ran).
        Counted like the post-accumulate-grad hook and posted when final. Returns
        False when ``p`` is not this optimizer's (the caller then keeps the gradient)."""
        e = self._entries.get(id(p))
        if e is None or self._plane is None:
            return False
        self._ensure_daemon(in_backward=True)
        final = self._count_backward(e)
        e.external = True
        # The same sum AccumulateGrad computes for p.grad.
        e.external_grad = grad if e.external_grad is None else e.external_grad + grad
        if final:
            self._post_grad(e, e.external_grad)
            e.external_grad = None
            # Nothing reads it again (p.grad never held it, so step() has no change to
            # check) and the copy keeps its memory until done: held here, every paged
            # block's gradient would stay on the device until step().
            e.posted_grad = None
        return True

    def _post_grad(self, e: _Param, grad: Optional[torch.Tensor] = None) -> None:
        g = self.param_groups[e.group]
        grad = p_grad = e.param.grad if grad is None else grad
        if grad.is_sparse:
            raise RuntimeError("OffloadAdamW does not support sparse gradients")
        if grad.dtype != e.grad_slot.dtype:
            grad = grad.to(e.grad_slot.dtype)
        step = self._step_id + 1
        try:
            e.posted_seq = self._plane.post_grad(
                e.param_id, grad, e.grad_slot, step, float(g["lr"]), float(g["betas"][0]),
                float(g["betas"][1]), float(g["eps"]), float(g["weight_decay"]))
        except _C().DaemonGone as exc:
            raise self._gone(str(exc)) from None
        e.posted_step = step
        e.posted_grad = p_grad
        e.posted_version = p_grad._version
        self._stats["grads_posted"] += 1
        self._stats["bytes_d2h"] += grad.numel() * grad.element_size()

    def _count_backward(self, e: _Param) -> bool:
        """Counts one backward pass reaching ``e``. True when that makes its gradient
        final and it leaves now, in backward (posted or, in gpu mode, launched); then
        every group's hyperparameters are checked first, before anything of the step
        is counted or sent. Replicated data parallel averages every gradient across
        ranks in step() first."""
        n = self._options["accumulation_steps"]
        leaves = e.backward_count + 1 == n and self._posts_in_backward()
        if leaves:
            self._check_groups()
        e.backward_count += 1
        if e.backward_count > n:
            raise RuntimeError(
                f"trainstream: backward() reached {e.name} {e.backward_count} times since the last "
                f"optimizer.step(), but accumulation_steps={n}; call step() after every {n} "
                f"backward pass(es) or pass accumulation_steps=<micro-batches> to wrap()")
        return leaves

    def _posts_in_backward(self) -> bool:
        """Whether a final gradient leaves in backward (posted or, in gpu mode, launched)
        rather than in step()."""
        return self._options["grad_post"] == "backward" and not self._replicated()

    def _check_groups(self, force: bool = False) -> None:
        """Every group's hyperparameters, before the first gradient of a step leaves (and
        again in step()): a scheduler may have set a value AdamW does not take, and
        finding it part way through would leave the step half-posted."""
        step = self._step_id + 1
        if self._groups_checked == step and not force:
            return
        for i, g in enumerate(self.param_groups):
            check_adamw_hyper(g["lr"], g["betas"], g["eps"], g["weight_decay"],
                              where=f"param_groups[{i}]: ")
        self._groups_checked = step

    def _rejected_grad(self, c) -> Optional[_Param]:
        """The parameter whose gradient, posted for the pending step, the ERROR ``c``
        rejects; None when ``c`` rejects something else (matched by the command's seq:
        the daemon reports other errors with param_id 0, which is a parameter too)."""
        e = self._by_id.get(c["param_id"])
        if e is None or e.posted_step != self._step_id + 1 or c["step"] != e.posted_step \
                or c["seq"] != e.posted_seq:
            return None
        return e

    def _call(self, fn, *args):
        """Runs a control-plane call, turning an unreachable daemon into DaemonError."""
        c = _daemon._control()
        try:
            return fn(*args)
        except c.Unavailable as e:
            if self._session is not None:  # it answered this session before
                raise self._gone(str(e)) from None
            raise DaemonError(f"the TrainStream daemon is unreachable: {e}") from None

    # Note [After the daemon is gone]
    # Once the daemon has died (or ended the session), nothing this optimizer holds
    # there comes back, so every later call raises the same DaemonError, saying so and
    # what to do: the gradient hook (which would otherwise count a second backward of
    # the step that never ended and raise "backward() reached ... 2 times", issue 16),
    # step(), zero_grad(), synchronize(), state_dict() and load_state_dict(). Each of
    # those asks the session whether it lives (a pybind call; the hook only at the
    # first gradient of a step), so once the client has seen the session's stream end
    # (milliseconds after a death) even the first backward raises, before a gradient
    # is posted into a ring nobody reads. A backward that runs before that posts as
    # usual, and the step() after it raises. detach() clears the state: attach() then
    # starts a fresh session.
    def _gone(self, why: str) -> DaemonError:
        """Records that the daemon is gone and returns the DaemonError to raise."""
        if self._daemon_gone is None:
            self._daemon_gone = (
                f"this optimizer's session with the TrainStream daemon is over: the daemon is "
                f"gone or ended it ({why}), and the optimizer state it held (master weights, "
                "moments) is lost. Start a daemon again if none runs (trainstreamd, or let "
                "trainstream.wrap() start one), then build a new optimizer and load_state_dict() "
                "from your last checkpoint, or call detach() and attach() to go on from the "
                "current weights with fresh moments")
        return DaemonError(self._daemon_gone)

    def _ensure_daemon(self, in_backward: bool = False) -> None:
        """Raises DaemonError when the daemon is known to be gone, asking the session
        first (in backward, only at the first gradient of a step: Note [After the
        daemon is gone])."""
        if self._daemon_gone is not None:
            raise DaemonError(self._daemon_gone)
        if self._session is None:
            return
        if in_backward:
            step = self._step_id + 1
            if self._probed_step == step:
                return
            self._probed_step = step
        alive, why = self._session.alive()
        if alive and not (self._plane is not None and self._plane.closing):
            return
        # What the daemon said last (a data-parallel group's end, say) goes first:
        # _wait reads what is left on the ring, then finds the session over.
        if self._plane is not None:
            self._wait(lambda c: False, keep=_STEP_REPLIES)
        raise self._gone(why or "the session is closed")

    def _check_alive(self, waited_s: float) -> None:
        alive, why = self._session.alive()
        if not alive or self._plane.closing:
            raise self._gone(f"it ended this session: {why or 'closed'}")
        if waited_s > self._options["timeout_s"]:
            raise DaemonError(f"no answer from the TrainStream daemon for {waited_s:.0f} s "
                              f"(timeout_s={self._options['timeout_s']})")

    def _wait(self, want, keep=(), on_error=None) -> None:
        """Polls completions, handing each to ``want(c)`` until it returns True. One that
        ``want`` passes over with an opcode in ``keep`` is kept for a later wait (a step's
        PARAM_READY arriving while synchronize() or state_dict() waits for its own);
        kept ones are offered first. A rejected command (ERROR) goes to ``on_error(c)``;
        unless that returns True (the caller takes it), it raises, except that a rejected
        gradient of the pending step is kept for step() when ``keep`` holds step replies."""
        def offer(c) -> bool:
            op = c["opcode"]
            if op == _OP_ERROR:
                if on_error is not None and on_error(c):
                    return False
                if _OP_PARAM_READY in keep and self._rejected_grad(c) is not None:
                    self._backlog.append(c)
                    return False
                raise TrainStreamError(f"the daemon rejected a command: {c['message']}")
            if op == _OP_GROUP_BROKEN:
                who = self._dp.describe() if self._dp is not None else "data-parallel group"
                raise DaemonError(f"{who} cannot continue: {c['message']}; the daemon has ended "
                                  "the group (restart every rank of the job)")
            if want(c):
                return True
            if op in keep:
                self._backlog.append(c)
            return False

        kept, self._backlog = self._backlog, []
        for i, c in enumerate(kept):
            try:
                done = offer(c)
            except BaseException:
                self._backlog += kept[i + 1:]
                raise
            if done:
                self._backlog += kept[i + 1:]
                return
        start = time.monotonic()
        while True:
            try:
                c = self._plane.poll(100)
            except _C().DaemonGone as e:
                raise self._gone(str(e)) from None
            if c is None:
                self._check_alive(time.monotonic() - start)
                continue
            if offer(c):
                return

    def _sync(self) -> None:
        self._require_attached()
        try:
            seq = self._plane.post_sync()
        except _C().DaemonGone as e:
            raise self._gone(str(e)) from None
        errors = []

        def want(c):
            if c["opcode"] == _OP_STATE_DONE and c["status"] != _STATUS_OK:
                errors.append(c["message"])
            return c["opcode"] == _OP_SYNC_DONE and c["seq"] == seq
        self._wait(want, keep=_STEP_REPLIES)
        if errors:
            raise TrainStreamError("the daemon could not apply optimizer state: " + "; ".join(errors))

    def between_steps(self) -> bool:
        """True when no backward has run since the last step() (no gradient pending:
        not between the micro-batches of an accumulated step)."""
        return all(e.backward_count == 0 and e.external_grad is None
                   for e in self._entries.values())

    def _in_group(self) -> bool:
        return self._dp is not None and self._dp.mode == "group"

    def _replicated(self) -> bool:
        return self._dp is not None and self._dp.mode == "replicated"

    def _require_attached(self) -> None:
        if self._plane is None:
            raise TrainStreamError("OffloadAdamW is detached; call attach() first")
        self._ensure_daemon()

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        if self._local is not None:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            params = [p for g in self.param_groups for p in g["params"]]
            if self._options["max_grad_norm"] is not None:
                norm = torch.nn.utils.clip_grad_norm_(params, self._options["max_grad_norm"])
            else:  # reported as the daemon does, without changing a gradient
                norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            self._last_grad_norm = norm  # a tensor: read (synchronizing) only when asked
            self._local.step()
            self._step_id += 1
            self._stats["steps"] += 1
            return loss
        self._require_attached()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = self._step_id + 1
        self._check_groups(force=True)
        if self._gpu is not None:
            loss = self._gpu_step(step, loss)
            self._maybe_go_local()
            return loss
        posted = []
        if self._replicated():
            # A paged weight's gradient is its external one (p.grad never holds it).
            grads = (e.external_grad if e.external else e.param.grad
                     for e in self._entries.values())
            self._dp.average_gradients([g for g in grads if g is not None])
        try:
            for e in self._entries.values():
                p = e.param
                if e.posted_step == step:
                    if not e.external and (p.grad is not e.posted_grad
                                           or p.grad._version != e.posted_version):
                        raise RuntimeError(
                            f"trainstream: the gradient of {e.name} changed after backward handed it "
                            "to the daemon (e.g. clip_grad_norm_ or GradScaler.unscale_). Pass "
                            "max_grad_norm=... to wrap() for clipping, or grad_post='step' to hand "
                            "gradients over in step()")
                    posted.append(e)
                elif e.external_grad is not None:
                    self._post_grad(e, e.external_grad)
                    e.external_grad = None
                    posted.append(e)
                elif p.grad is not None:
                    self._post_grad(e)
                    posted.append(e)
            t0 = time.monotonic()
        except _C().DaemonGone as e:
            raise self._gone(str(e)) from None
        result = self._finish_step(step, posted, t0)
        norm = result.get("grad_norm", float("nan"))
        self._last_grad_norm = norm if norm >= 0 else None
        if result.get("rejected"):
            self._stats["steps"] += 1
            names = [name for name, _ in result["rejected"]]
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise TrainStreamError(
                f"step {step}: the daemon rejected the gradient of {len(names)} parameter(s) "
                f"({shown}): {result['rejected'][0][1]}. Those were not updated; the other "
                f"{len(posted) - len(names)} were. The step is over: training can go on once "
                "the cause is fixed")
        if result["status"] == _STATUS_SKIPPED_NONFINITE:
            self._stats["skipped_steps"] += 1
            raise NonFiniteGradientError(
                f"step {step} was not applied: {result['message'] or 'a gradient held NaN or Inf'}")
        if result["status"] != _STATUS_OK:
            raise TrainStreamError(f"step {step} failed in the daemon: {result['message']}")
        self._stats["steps"] += 1
        self._maybe_go_local()
        return loss

    # Note [A rejected gradient ends its step]
    # The daemon's engine leaves a gradient it rejects (a bad hyperparameter, an update
    # still in flight) out of the step and answers ERROR; the step then completes with
    # the others when StepEnd arrives. So the client takes the rejected parameter off
    # the step's pending set, waits for the rest as usual, clears every pending count
    # and only then raises: the step is over in both places, and the next iteration
    # starts clean. (Raising at the ERROR left the others' replies queued and the step
    # half-ended: its StepEnd was sent, so zero_grad() could not end it again.) A
    # rejection is matched by its command's seq, since the daemon reports other errors
    # (a second StepEnd) with param_id 0, which is also a parameter's id. The client
    # checks every group's hyperparameters before the first gradient of a step leaves
    # and again in step() (_check_groups), so a scheduler's bad value raises ValueError
    # before the daemon sees any of the step; the daemon's own check remains for the
    # rest. A wait interrupted part way (Ctrl-C) leaves self._finishing, so the next
    # step() or zero_grad() sends no second StepEnd and waits only for what is missing.
    def _finish_step(self, step: int, posted: List[_Param], t0: float) -> Dict[str, Any]:
        """Ends ``step`` in the daemon with the gradients in ``posted``, copies each new
        weight in as it is ready, and clears every parameter's pending state. Returns the
        step's completion (status, grad_norm, message, and "rejected": (name, why) for
        each gradient the daemon left out). Interrupted (Ctrl-C, a timeout), a later call
        for the same step goes on where this one stopped: the step end is sent once, and
        the replies already taken are not waited for again."""
        f = self._finishing
        if f is None or f.step != step:
            f = self._finishing = _Finishing(step, {e.param_id for e in posted})

        def on_completion(c):
            op = c["opcode"]
            if op == _OP_PARAM_READY and c["step"] == step:
                e = self._by_id[c["param_id"]]
                if e.param.data_ptr() != e.param_slot.data_ptr():
                    # (A paged weight's home is its param slot: nothing to copy.)
                    self._plane.copy_param(e.param, e.param_slot)
                    self._stats["bytes_h2d"] += e.param_slot.numel() * e.param_slot.element_size()
                f.pending.discard(e.param_id)
            elif op == _OP_STEP_DONE and c["step"] == step:
                f.result.update(c)
        if not f.end_sent:
            try:
                if self._in_group() and self._dp.nnodes > 1 and self._dp.leader:
                    self._dp.reduce_machine_sums(self._wait, self._plane.post_grad_reduced, step,
                                                 posted, on_completion)
                self._plane.post_step_end(step, len(posted))
            except _C().DaemonGone as e:
                raise self._gone(str(e)) from None
            f.end_sent = True

        def want(c):
            on_completion(c)
            return "opcode" in f.result and not f.pending

        def on_error(c):
            # A gradient the daemon rejected is not part of the step: the step ends with
            # the others, which step() reports (Note [A rejected gradient ends its step]).
            e = self._rejected_grad(c)
            if e is None or e.param_id not in f.pending:
                return False
            f.pending.discard(e.param_id)
            f.rejected.append((e.name, c["message"]))
            return True
        self._wait(want, on_error=on_error)
        self._finishing = None
        self._stats["step_wait_s"] += time.monotonic() - t0
        self._clear_pending()
        self._step_id = step
        result = f.result
        if f.rejected:
            result["rejected"] = f.rejected
        return result

    def _clear_pending(self) -> None:
        for e in self._entries.values():
            e.backward_count = 0
            e.posted_step = 0
            e.posted_grad = None
            e.external = False
            e.external_grad = None

    def _abandon_step(self) -> None:
        """A step that never completed: a backward or step() raised part way. The
        daemon holds the gradients already handed to it (and, without clipping, has
        applied them: an eager update cannot be undone), so the step is ended with
        those, their new weights copied back, and every pending count cleared, so that
        the next iteration starts clean."""
        step = self._step_id + 1
        posted = [e for e in self._entries.values() if e.posted_step == step]
        if not posted:
            self._clear_pending()
            return
        result = self._finish_step(step, posted, time.monotonic())
        rejected = [name for name, _ in result.get("rejected", [])]
        self._event("abandoned step", step=step, params_applied=len(posted) - len(rejected),
                    rejected=rejected)

    def _event(self, kind: str, **details) -> None:
        if self._event_sink is not None:
            self._event_sink(kind, **details)
        elif self._options["verbose"]:
            print(f"trainstream: {kind}: {details}")

    def _maybe_go_local(self) -> None:
        """offload="auto": after the second step, measure whether torch's fused AdamW
        would fit on the GPU next to what the two steps used; if so, move the state
        there and stop offloading (the daemon session is closed)."""
        if self._options["offload"] != "auto" or self._step_id != 2 or self._local is not None:
            return
        params = [e.param for e in self._entries.values()]
        devices = {p.device for p in params}
        if self._dp is not None:
            # Ranks share (or average into) the daemon's state; a rank-local torch
            # optimizer would silently stop the averaging.
            self.offload_decision = {"offload": True, "reason": "data parallel: the ranks' "
                                     "gradients are combined through the daemon"}
            self._event("offload", **self.offload_decision)
            return
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            self.offload_decision = {"offload": True, "reason": "the parameters are not all on "
                                     "one CUDA device; the daemon's AdamW is the host path"}
            self._event("offload", **self.offload_decision)
            return
        dev = next(iter(devices))
        total = torch.cuda.get_device_properties(dev).total_memory
        cap = total * torch.cuda.get_per_process_memory_fraction(dev)
        free, _ = torch.cuda.mem_get_info(dev)
        cap = min(cap, torch.cuda.memory_reserved(dev) + free)
        peak = torch.cuda.max_memory_allocated(dev)
        trained = [p for p in params if p.requires_grad]
        state = sum(2 * p.numel() * p.element_size() for p in trained)
        grads = (sum(p.numel() * p.element_size() for p in trained)
                 if self._gpu is not None and self._options["free_grads"] else 0)
        headroom = 0.10
        need = peak + state + grads
        fits = need <= cap * (1 - headroom)
        self.offload_decision = {
            "offload": not fits, "peak_bytes": peak, "optimizer_state_bytes": state,
            "extra_grad_bytes": grads, "needed_bytes": need, "capacity_bytes": int(cap),
            "headroom": headroom,
            "reason": ("fits in VRAM: switched to torch.optim.AdamW(fused=True) on the GPU"
                       if fits else "does not fit in VRAM with torch's AdamW: keeps offloading")}
        self._event("offload", **self.offload_decision)
        if fits:
            self._go_local()

    def _go_local(self) -> None:
        sd = self.state_dict()
        local = torch.optim.AdamW([{"params": g["params"]} for g in self.param_groups],
                                  lr=self.param_groups[0]["lr"], fused=True)
        # Share the group dicts, so schedulers that edit self.param_groups still work.
        for mine, theirs in zip(self.param_groups, local.param_groups):
            for k, v in theirs.items():
                mine.setdefault(k, v)
            mine["fused"] = True
        local.param_groups = self.param_groups
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, st in sd["state"].items():
            p = params[idx]
            local.state[p] = {
                "step": st["step"].to(p.device, torch.float32),
                "exp_avg": st["exp_avg"].to(p.device, p.dtype),
                "exp_avg_sq": st["exp_avg_sq"].to(p.device, p.dtype)}
        self.detach()
        self.release_hooks()
        for e in self._entries.values():
            e.backward_count = 0
        self._local = local
        self.optimizer_mode = "local"

    def _gpu_step(self, step: int, loss):
        result = self._gpu.step(list(self._entries.values()))
        for e in self._entries.values():
            e.backward_count = 0
        self._step_id = step
        self._last_grad_norm = result["grad_norm"]
        self._stats["bytes_pcie"] = self._gpu.bytes_pcie
        if result["skipped"]:
            self._stats["skipped_steps"] += 1
            names = result["skipped"]
            raise NonFiniteGradientError(
                f"step {step}: {len(names)} parameter(s) were not updated because their gradient "
                f"held NaN or Inf (first: {', '.join(names[:5])})")
        self._stats["steps"] += 1
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``. Called with a step pending that will not
        come (a backward or step() raised part way), it ends that step first: see
        ``_abandon_step``."""
        if self._local is None and self._plane is not None:
            self._ensure_daemon()
        if (self._local is None and self._gpu is None and self._plane is not None
                and self._dp is None and not self.between_steps()):
            self._abandon_step()
        super().zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Waits until every update posted so far is finished (the daemon's, or with
        optimizer_mode="gpu" the side stream's)."""
        if self._local is not None:
            return
        if self._gpu is not None:
            self._require_attached()
            self._gpu.synchronize()
            return
        self._sync()

    @property
    def last_grad_norm(self) -> Optional[float]:
        """Global L2 norm of the gradients of the last step, before clipping."""
        if torch.is_tensor(self._last_grad_norm):
            self._last_grad_norm = float(self._last_grad_norm)
        return self._last_grad_norm

    def stats(self) -> Dict[str, Any]:
        s = dict(self._stats)
        s["params"] = len(self._entries)
        s["numel"] = sum(e.param.numel() for e in self._entries.values())
        s["attached"] = self._session is not None
        s["session_id"] = self._session.id if self._session is not None else None
        s["moment_dtype"] = self._options["moment_dtype"]
        s["optimizer_mode"] = self.optimizer_mode
        s["offloaded"] = self._local is None
        s["data_parallel"] = None if self._dp is None else {
            "mode": self._dp.mode, "group": self._dp.key, "local_rank": self._dp.local_rank,
            "local_world_size": self._dp.local_world_size, "nnodes": self._dp.nnodes,
            **self._dp.stats}
        return s

    # ------------------------------------------------------------- state dict
    def _scratch_region(self, numel: int):
        need = max(4 * numel, 4096)
        if self._scratch is None or self._scratch.size < need:
            if self._scratch is not None:
                self._call(self._session.free_region, self._scratch.region_id)
            self._scratch = self._call(self._session.allocate_region, need, "state-transfer")
        return self._scratch

    def _move_fields(self, load: bool, e: _Param, fields: List[int],
                     data: Optional[List[torch.Tensor]] = None) -> Optional[List[torch.Tensor]]:
        """Moves whole fp32 state arrays of `e` through the scratch region: all of
        `fields` in one round trip to the daemon."""
        n = e.param.numel()
        region = self._scratch_region(n * len(fields))
        view = _C().tensor_from_address(region.address, [len(fields), n], "float32")
        if load:
            for i, t in enumerate(data):
                view[i].copy_(t.reshape(-1).to(torch.float32))
        for i, field_id in enumerate(fields):
            self._plane.post_state(load, e.param_id, field_id, region.region_id, 4 * n * i, 4 * n, 0)
        self._sync()
        return None if load else [view[i].clone().view(e.param.shape) for i in range(len(fields))]

    def _export_step(self, e: _Param) -> int:
        seq_box = {}
        self._plane.post_state(False, e.param_id, _FIELD_STEP, 0, 0, 0, 0)

        def want(c):
            if c["opcode"] == _OP_STATE_DONE and c["param_id"] == e.param_id:
                if c["status"] != _STATUS_OK:
                    raise TrainStreamError(f"exporting the step of {e.name}: {c['message']}")
                seq_box["step"] = c["step"]
                return True
            return False
        self._wait(want, keep=_STEP_REPLIES)
        return int(seq_box["step"])

    def state_dict(self) -> Dict[str, Any]:
        """``torch.optim.AdamW``'s format, plus ``master_weight`` (fp32) per parameter
        (without it once ``offload="auto"`` has moved the optimizer to the GPU)."""
        if self._local is not None:
            return self._local.state_dict()
        self._require_attached()
        order = {}
        groups = []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = []
            for p in g["params"]:
                order.setdefault(id(p), len(order))
                packed["params"].append(order[id(p)])
            groups.append(packed)
        state = {}
        for e in self._entries.values():
            if self._gpu is not None:
                exported = self._gpu.export(e)
                if exported is not None:
                    state[order[id(e.param)]] = exported
                continue
            step = self._export_step(e)
            if step == 0:
                continue
            dtype = e.param.dtype
            m, v, w = self._move_fields(False, e, [_FIELD_EXP_AVG, _FIELD_EXP_AVG_SQ, _FIELD_MASTER])
            state[order[id(e.param)]] = {
                "step": torch.tensor(float(step), dtype=torch.float32),
                "exp_avg": m.to(dtype),
                "exp_avg_sq": v.to(dtype),
                "master_weight": w,
            }
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a ``torch.optim.AdamW`` (or ``OffloadAdamW``) state dict."""
        if self._local is not None:
            state_dict = {"state": {k: {f: v for f, v in s.items() if f != "master_weight"}
                                    for k, s in state_dict["state"].items()},
                          "param_groups": state_dict["param_groups"]}
            self._local.load_state_dict(state_dict)
            return
        self._require_attached()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(groups)} parameter groups, this optimizer "
                             f"{len(self.param_groups)}")
        params = [p for g in self.param_groups for p in g["params"]]
        for mine, theirs in zip(self.param_groups, groups):
            if len(mine["params"]) != len(theirs["params"]):
                raise ValueError("state_dict's parameter groups differ in size from this optimizer's")
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = tuple(v) if k == "betas" else v
        index_of = {}
        for theirs in groups:
            for idx in theirs["params"]:
                index_of[idx] = len(index_of)
        for idx, s in state_dict["state"].items():
            e = self._entries[id(params[index_of[idx]])]
            if self._gpu is not None:
                self._gpu.load(e, s)
                continue
            master = s.get("master_weight", e.param.detach())
            self._move_fields(True, e, [_FIELD_MASTER, _FIELD_EXP_AVG, _FIELD_EXP_AVG_SQ],
                              [master, s["exp_avg"], s["exp_avg_sq"]])
            step = s["step"]
            step = int(step.item() if torch.is_tensor(step) else step)
            self._plane.post_state(True, e.param_id, _FIELD_STEP, 0, 0, 0, step)
        if self._gpu is None:  # gpu mode registers nothing with the daemon's engine
            self._sync()
