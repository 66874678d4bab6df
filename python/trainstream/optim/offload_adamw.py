"""OffloadAdamW: an AdamW whose master weights, moments and update live in the daemon.

A facade (backend.py says how the parts share the work): this module keeps what any
``torch.optim.Optimizer`` keeps (parameter groups, their hyperparameters, a gradient
hook per parameter) and chooses the backend that updates them, at ``attach()``:

* ``optimizer_mode="cpu"``: ``DaemonBackend``, the daemon's AdamW over the session's
  command ring (daemon_backend.py);
* ``optimizer_mode="gpu"``: ``ZeroCopyBackend``, a CUDA kernel over moments in the
  daemon's pinned memory (zero_copy.py);
* after ``offload="auto"`` found that torch's AdamW fits on the GPU
  (``decide_offload``, local.py): ``LocalBackend`` (local.py).

Data-parallel ranks (data_parallel.py) always take the daemon's AdamW.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from ..errors import TrainStreamError
from ..options import check_adamw_hyper, validate
from . import data_parallel
from .backend import DTYPE_NAMES, Backend, ParamEntry, ParamTable, master_state_bytes
from .daemon_backend import DaemonBackend
from .daemon_session import DaemonSession
from .local import LocalBackend, decide_offload
from .param_ready import ParamReadyHooks
from .zero_copy import ZeroCopyBackend, unavailable_reason


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


def _weak_call(opt: "OffloadAdamW", method: str) -> Callable[..., Any]:
    """``opt.<method>``, holding ``opt`` weakly (for ParamReadyHooks, whose module
    hooks must not keep a discarded optimizer alive either)."""
    ref = weakref.ref(opt)

    def call(*args):
        o = ref()
        return getattr(o, method)(*args) if o is not None else None
    return call


class OffloadAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` with its state and update in the TrainStream daemon.

    Same hyper-parameters and ``state_dict`` format as ``torch.optim.AdamW`` (plus
    each parameter's fp32 ``master_weight``). Extra keyword options are those of
    ``trainstream.wrap`` (docs/options.md), validated once, here.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, amsgrad: bool = False, maximize: bool = False,
                 names: Optional[Dict[int, str]] = None, attach: bool = True, **options):
        if amsgrad or maximize:
            raise ValueError("OffloadAdamW supports amsgrad=False and maximize=False only")
        check_adamw_hyper(lr, betas, eps, weight_decay)
        self._options = validate(options)
        self._names = names or {}
        self._table = ParamTable(self, self._options)
        self._next_param_id = 0
        self._session: Optional[DaemonSession] = None  # while attached to the daemon
        self._backend: Optional[Backend] = None
        # Called before the daemon session ends (offload="auto" going local, unwrap):
        # users of the session's memory outside the optimizer (activation pages) move out.
        self.before_detach: List[Callable[[], None]] = []
        # guard_params: the hooks while attached (module hooks once a model is known),
        # and that model, held weakly, so that attach() after detach() puts them back.
        self._ready: Optional[ParamReadyHooks] = None
        self._guarded: Optional[weakref.ref] = None
        self.optimizer_mode: Optional[str] = None  # resolved at attach()
        # offload="auto": after two steps, decide_offload's answer (local.py).
        self.offload_decision: Optional[Dict[str, Any]] = None
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
        t = self._table
        for p in g["params"]:
            if p.dtype not in DTYPE_NAMES:
                raise ValueError(f"parameter dtype {p.dtype} is not supported; accepted: "
                                 f"{', '.join(str(d) for d in DTYPE_NAMES)}")
            e = ParamEntry(self._next_param_id, p,
                           self._names.get(id(p), f"param{self._next_param_id}"), group_index)
            self._next_param_id += 1
            t.entries[id(p)] = e
            t.by_id[e.param_id] = e
            if p.requires_grad:
                e.hook = p.register_post_accumulate_grad_hook(_weak_hook(self))
            new.append(e)
        if self._session is not None:
            self._backend.register(new)

    def _resolve_mode(self) -> str:
        mode = self._options["optimizer_mode"]
        if mode == "cpu":
            return "cpu"
        if self._options["pin_moments"] is False:
            # The zero-copy kernel reads the moments over PCIe: they must be pinned.
            if mode == "gpu":
                raise ValueError("options optimizer_mode='gpu' and pin_moments=False cannot go "
                                 "together (the GPU update reads page-locked moments); accepted: "
                                 "pin_moments None or True with 'gpu', or optimizer_mode='cpu'")
            return "cpu"
        if self._table.dp is not None:
            if mode == "gpu":
                raise ValueError("option optimizer_mode='gpu' cannot run with data parallel "
                                 "(the ranks share the daemon's one optimizer state); accepted "
                                 "here: 'cpu' or 'auto'")
            return "cpu"
        params = [e.param for e in self._table.entries.values()]
        why = unavailable_reason(params)
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

    def attach(self, model: Optional[torch.nn.Module] = None,
               guard: Optional[bool] = None) -> None:
        """Connects to the daemon (starting one if needed) and registers every parameter;
        the gradient hooks go on the parameters themselves. ``model`` (the reference's
        ``attach(model, guard=True)``): the model those parameters belong to, checked;
        with ``guard_params`` on, ``ParamReadyHooks`` go on its modules (a read of a
        weight waits for its in-flight update). ``guard``: sets ``guard_params``
        (``False`` removes the hooks). Called again while attached, it only does that
        (wrap() attaches first, then passes the model once its pager exists)."""
        if model is not None:
            if not isinstance(model, torch.nn.Module):
                raise ValueError(f"attach(model=...): expected a torch.nn.Module, got "
                                 f"{type(model).__name__}")
            mine = {id(p) for p in model.parameters()}
            if not any(id(e.param) in mine for e in self._table.entries.values()):
                raise ValueError("attach(model=...): none of this optimizer's parameters is a "
                                 "parameter of that model; accepted: the model it trains")
        if guard is not None:
            if not isinstance(guard, bool):
                raise ValueError(f"attach(guard={guard!r}): accepted: True or False")
            self._options["guard_params"] = guard
        if model is not None:
            self._guarded = weakref.ref(model)
        if self._session is not None:
            self._install_guard()
            return
        t = self._table
        t.dp = data_parallel.plan(self._options)
        if t.dp is not None:
            t.dp.setup_collectives()
        session = DaemonSession(t)
        session.open()
        self._session = session
        for e in t.entries.values():  # hooks removed by release_hooks()
            if e.hook is None and e.param.requires_grad:
                e.hook = e.param.register_post_accumulate_grad_hook(_weak_hook(self))
        try:
            self.optimizer_mode = self._resolve_mode()
            backend = ZeroCopyBackend if self.optimizer_mode == "gpu" else DaemonBackend
            self._backend = backend(t, session)
            self._backend.register(list(t.entries.values()))
            self._install_guard()
        except BaseException:
            self.detach()
            raise

    def _install_guard(self) -> None:
        """guard_params: ParamReadyHooks for this session, on the model attach() was
        given (if any); guard_params off: none."""
        if not self._options["guard_params"]:
            self._remove_guard()
            return
        if self._ready is None:
            self._ready = ParamReadyHooks(self._table, _weak_call(self, "_land"),
                                          _weak_call(self, "_lands_early"))
        model = self._guarded() if self._guarded is not None else None
        if model is not None and self._ready.model is not model:
            self._ready.install(model)

    def _remove_guard(self) -> None:
        if self._ready is not None:
            self._ready.remove()
            self._ready = None

    def _land(self, entries: List[ParamEntry]) -> None:
        if self._backend is not None:
            self._backend.land(entries)

    def _lands_early(self) -> bool:
        return self._backend is not None and self._backend.lands_early()

    @property
    def param_ready_hooks(self) -> Optional[ParamReadyHooks]:
        """The ``ParamReadyHooks`` of this session (None: detached, or guard_params off)."""
        return self._ready

    def weights_ready(self, params: Iterable[torch.Tensor]) -> None:
        """Returns once no update of ``params`` is in flight (guard_params; at once when
        it is off or nothing is in flight). The weight pager calls it before it copies a
        paged block from its param slots, which the daemon rewrites."""
        if self._ready is not None:
            self._ready.wait_for(params)

    def detach(self) -> None:
        """Ends the daemon session (its memory is freed). ``attach()`` starts a new one
        with the current weights as masters and fresh moments."""
        try:
            for leave in self.before_detach:
                leave()
        finally:
            self._end_session()

    def _end_session(self) -> None:
        self._remove_guard()
        if self._session is None:
            return
        if self._backend is not None:
            self._backend.close()
            self._backend = None
        self._table.clear_pending()  # a step of the old session never completes
        self._session.close()
        self._session = None

    def release_hooks(self) -> None:
        """Removes the gradient hooks from the parameters (``unwrap()`` does this after
        ``detach()``; ``attach()`` puts them back)."""
        for e in self._table.entries.values():
            if e.hook is not None:
                e.hook.remove()
                e.hook = None

    def __del__(self):
        try:
            self.detach()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass

    def set_event_sink(self, sink: Callable[..., None]) -> None:
        """Where this optimizer's events go (``wrap()``: the session's event log)."""
        self._table.event = sink

    # -------------------------------------------------------------- data plane
    def _on_grad_final(self, p: torch.Tensor) -> None:
        e = self._table.entries.get(id(p))
        if e is None or self._session is None or p.grad is None:
            # (None: a paged weight, whose gradient went to accept_grad; autograd still
            # runs the hook with nothing accumulated.)
            return
        self._backend.grad_final(e)

    def accept_grad(self, p: torch.Tensor, grad: torch.Tensor) -> bool:
        """Takes a gradient of ``p`` computed where ``p.grad`` never holds it (weight
        paging: the weight's device copy is gone once its block's backward ran).
        Counted like the post-accumulate-grad hook and posted when final. Returns
        False when ``p`` is not this optimizer's (the caller then keeps the gradient)."""
        e = self._table.entries.get(id(p))
        if e is None or self._session is None:
            return False
        return self._backend.accept_grad(e, grad)

    def between_steps(self) -> bool:
        """True when no backward has run since the last step() (no gradient pending:
        not between the micro-batches of an accumulated step)."""
        return self._table.between_steps()

    def _require_backend(self) -> Backend:
        if self._backend is None:
            raise TrainStreamError("OffloadAdamW is detached; call attach() first")
        return self._backend

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = self._require_backend().step(closure)
        self._after_step()
        return loss

    def _after_step(self) -> None:
        """offload="auto": after the second step, ``decide_offload`` (local.py) says whether
        torch's fused AdamW fits on the GPU; if so, the state moves there."""
        if (self._options["offload"] != "auto" or self._table.step_id != 2
                or self.optimizer_mode == "local"):
            return
        self.offload_decision = decide_offload(
            [e.param for e in self._table.entries.values()],
            data_parallel=self._table.dp is not None,
            extra_grads=self.optimizer_mode == "gpu" and self._options["free_grads"],
            headroom=self._options["vram_headroom"])
        self._table.event("offload", **self.offload_decision)
        if not self.offload_decision["offload"]:
            self.go_local()

    def go_local(self) -> None:
        """Moves the state to torch's fused AdamW beside the parameters and ends the
        daemon session (``offload="auto"`` does this when it fits)."""
        local = LocalBackend(self._table, self.state_dict(),
                             self._require_backend().last_grad_norm())
        self.detach()
        self.release_hooks()
        for e in self._table.entries.values():
            e.backward_count = 0
        self._backend = local
        self.optimizer_mode = "local"

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``. Called with a step pending that will not
        come (a backward or step() raised part way), it ends that step first (what the
        daemon holds is applied: ``DaemonBackend.before_zero_grad``)."""
        if self._backend is not None:
            self._backend.before_zero_grad()
        super().zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Waits until every update posted so far is finished (the daemon's, or with
        optimizer_mode="gpu" the side stream's)."""
        self._require_backend().synchronize()

    def sync_weights_from_model(self, params: Optional[Iterable[torch.Tensor]] = None) -> None:
        """Takes the current values of ``params`` (default: every parameter) as their fp32
        masters' values, element by element where the weight differs from what the
        optimizer last wrote (docs/adamw.md, "Writing weights after wrap()"). In-place
        writes through a parameter are taken without it at the next step; call it after
        writes through ``.data`` (``p.data.copy_(...)``), which leave no trace. Call it
        between step() and the next backward."""
        self._require_backend().sync_weights_from_model(params)

    @property
    def last_grad_norm(self) -> Optional[float]:
        """Global L2 norm of the gradients of the last step, before clipping."""
        norm = self._backend.last_grad_norm() if self._backend is not None else None
        return float(norm) if torch.is_tensor(norm) else norm

    @property
    def step_id(self) -> int:
        """The last step ended (applied, skipped for a non-finite gradient, or rejected)."""
        return self._table.step_id

    # ------------------------------------------------------------------ report
    def stats(self) -> Dict[str, Any]:
        t = self._table
        s = dict(t.stats)
        s["params"] = len(t.entries)
        s["numel"] = sum(e.param.numel() for e in t.entries.values())
        s["attached"] = self._session is not None
        s["session_id"] = self._session.id if self._session is not None else None
        # Why every call raises DaemonError (Note [A daemon gone for good]); None otherwise.
        s["daemon_gone"] = self._session.gone_reason if self._session is not None else None
        for name in ("moment_dtype", "chunk_elems", "pin_moments", "compute_grad_norm",
                     "guard_params", "grad_post"):
            s[name] = self._options[name]
        s["param_ready"] = self._ready.report() if self._ready is not None else None
        s["eager"] = self._options["grad_post"] == "backward"
        s["optimizer_mode"] = self.optimizer_mode
        s["offloaded"] = self.optimizer_mode != "local"
        dp = t.dp
        s["data_parallel"] = None if dp is None else {
            "mode": dp.mode, "group": dp.key, "local_rank": dp.local_rank,
            "local_world_size": dp.local_world_size, "nnodes": dp.nnodes, **dp.stats}
        if self._backend is not None:
            s.update(self._backend.stats())
        return s

    def regions(self) -> List[Dict[str, Any]]:
        """The shared-memory regions the optimizer maps (``purpose``: "staging" or
        "gpu-optimizer-state"; ``address``, ``bytes``, ``registered`` with CUDA)."""
        return self._backend.regions() if self._backend is not None else []

    def state_bytes(self) -> int:
        """Bytes of optimizer state the daemon holds for this optimizer's parameters
        (the sum of ``state_bytes_by_kind()``)."""
        return sum(self.state_bytes_by_kind().values())

    def state_bytes_by_kind(self) -> Dict[str, int]:
        """``"moments"``: the two moments; ``"masters"``: what the fp32 masters take
        beyond the weight slots (the daemon's: ``backend.master_state_bytes``, none for
        fp32 weights, 2 B a parameter for bf16; with optimizer_mode="gpu" a whole fp32
        master, none for an fp32 parameter, which is its own)."""
        moment = 2 if self._options["moment_dtype"] == "bfloat16" else 4

        def master(p: torch.Tensor) -> int:
            if self.optimizer_mode == "gpu":
                return 0 if p.dtype == torch.float32 else 4 * p.numel()
            return master_state_bytes(p)
        entries = self._table.entries.values()
        return {"masters": sum(master(e.param) for e in entries),
                "moments": sum(2 * moment * e.param.numel() for e in entries)}

    # --------------------------------------------- what the memory layer asks for
    def register_regions_with_cuda(self) -> None:
        """Registers the staging regions with CUDA (weight paging to a CUDA device copies
        from the param slots even when the parameters were on the host)."""
        if self._session is not None:
            self._session.register_regions_with_cuda()

    def allocate_region(self, nbytes: int, purpose: str):
        """A region of the daemon session (activation pages); raises when the budget
        refuses or no session is attached."""
        if self._session is None:
            raise TrainStreamError("OffloadAdamW is detached; call attach() first")
        return self._session.allocate_region(nbytes, purpose)

    def host_home(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """Where a paged trained weight lives in host memory: its param slot, which the
        daemon rewrites after each update (None: it has none in this dtype)."""
        e = self._table.entries.get(id(p))
        if e is None or e.param_slot is None or e.param_slot.dtype != p.dtype:
            return None
        return e.param_slot.view(p.shape)

    # ------------------------------------------------------------- state dict
    def state_dict(self) -> Dict[str, Any]:
        """``torch.optim.AdamW``'s format, plus ``master_weight`` (fp32) per parameter
        (without it once ``offload="auto"`` has moved the optimizer to the GPU)."""
        return self._require_backend().state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a ``torch.optim.AdamW`` (or ``OffloadAdamW``) state dict."""
        self._require_backend().load_state_dict(state_dict)
