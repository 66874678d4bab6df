"""optimizer_mode="gpu": zero-copy CUDA AdamW over moments in the daemon's memory.

The parameters stay in VRAM and are updated in place by a CUDA kernel
(kernels/cuda/adamw_zero_copy.cu) that reads and writes the moments, and the
fp32 master of a non-fp32 parameter, directly in pinned shared memory the daemon
allocated for this session. Per step only the moments cross PCIe (16 bytes per
parameter with fp32 moments, 8 with bf16); no gradient leaves the GPU and no host
thread runs AdamW.

Without clipping each parameter is updated on a side stream as soon as its
gradient is final (from the post-accumulate-grad hook), overlapping backward; a
gradient holding NaN or Inf skips that parameter's update (checked on the GPU)
and ``step()`` raises ``NonFiniteGradientError`` naming it, as the daemon's eager
mode does. With ``max_grad_norm`` the update waits for ``step()``, which clips
exactly as ``torch.nn.utils.clip_grad_norm_`` does and skips the whole step when
the norm is not finite.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .._native import C as _C
from .._native.host_memory import track
from .._native.pinning import register_fresh
from ..errors import NonFiniteGradientError, TrainStreamError
from .backend import ParamEntry, ParamTable, begin_step, pack_groups, unpack_state
from .daemon_session import DaemonSession

_ALIGN = 256


def unavailable_reason(params: List[torch.Tensor]) -> Optional[str]:
    """Why optimizer_mode="gpu" cannot run for these parameters (None if it can)."""
    c = _C()
    if not getattr(c, "has_adamw_cuda", False):
        return "trainstream._C was built without CUDA"
    bad = [p for p in params if p.requires_grad and not p.is_cuda]
    if bad:
        return (f"{len(bad)} trainable parameter(s) are not on a CUDA device (first: shape "
                f"{tuple(bad[0].shape)} on {bad[0].device}); move the model to CUDA or pass "
                "device='cuda'")
    return None


class _State:
    """Host views of one parameter's state, and its device addresses."""
    __slots__ = ("exp_avg", "exp_avg_sq", "master", "dev_exp_avg", "dev_exp_avg_sq",
                 "dev_master", "step", "index")

    def __init__(self):
        self.step = 0


class ZeroCopyBackend:
    """The GPU-mode backend of one ``OffloadAdamW``: the state lives in regions of its
    daemon session, which registers no parameter with the daemon's engine."""
    mode = "gpu"

    def __init__(self, table: ParamTable, session: DaemonSession):
        self._table = table
        self._session = session
        opts = table.options
        moment_dtype = "float32" if opts["moment_dtype"] == "auto" else opts["moment_dtype"]
        self._moment = moment_dtype
        self._seed = int(opts["seed"])
        self._moment_torch = torch.bfloat16 if moment_dtype == "bfloat16" else torch.float32
        self._msize = self._moment_torch.itemsize  # bytes per moment element
        self._state: Dict[int, _State] = {}  # param_id -> state
        self._regions: List[Any] = []
        self._registered: List[int] = []
        self._stream: Optional[torch.cuda.Stream] = None
        self._flags: Optional[torch.Tensor] = None
        self._norms: Optional[torch.Tensor] = None
        self._launched: Dict[int, int] = {}  # param_id -> step it was launched for
        self._weights_checked = 0  # the step whose weights were checked before its first launch
        table.stats.update(weights_adopted=0)
        self._last_grad_norm: Optional[float] = None
        self.bytes_pcie = 0

    # ---------------------------------------------------------------- setup
    def register(self, entries: List[ParamEntry]) -> None:
        """Allocates state for `entries` in one daemon region, maps it for the GPU."""
        if not entries:
            return
        verbose = self._table.options["verbose"]
        c = _C()
        msize = self._msize
        layout = []
        offset = 0
        for e in entries:
            n = e.param.numel()
            off_m = offset
            offset += -(-n * msize // _ALIGN) * _ALIGN
            off_v = offset
            offset += -(-n * msize // _ALIGN) * _ALIGN
            off_w = None
            if e.param.dtype != torch.float32:
                off_w = offset
                offset += -(-n * 4 // _ALIGN) * _ALIGN
            layout.append((e, off_m, off_v, off_w))
        region = self._session.allocate_region(max(offset, _ALIGN), "gpu-optimizer-state")
        self._regions.append(region)
        track(region, region.segment_size, "state")
        ok, why = register_fresh(region.base_address, region.segment_size)
        if ok:
            self._registered.append(region.base_address)
        else:
            raise TrainStreamError(
                f"optimizer_mode='gpu' needs the optimizer state pinned and mapped for the GPU, "
                f"but cudaHostRegister failed: {why}; use optimizer_mode='cpu'")
        dev_base = c.host_device_address(region.address)
        device = entries[0].param.device
        for e, off_m, off_v, off_w in layout:
            n = e.param.numel()
            s = _State()
            s.exp_avg = c.tensor_from_address(region.address + off_m, [n], self._moment)
            s.exp_avg_sq = c.tensor_from_address(region.address + off_v, [n], self._moment)
            s.exp_avg.zero_()
            s.exp_avg_sq.zero_()
            s.dev_exp_avg = dev_base + off_m
            s.dev_exp_avg_sq = dev_base + off_v
            s.master = None
            s.dev_master = 0
            if off_w is not None:
                s.master = c.tensor_from_address(region.address + off_w, [n], "float32")
                s.master.copy_(e.param.detach().reshape(-1).float())
                s.dev_master = dev_base + off_w
            s.index = len(self._state)
            self._state[e.param_id] = s
            e.mark_weight()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        self._flags = torch.zeros(len(self._state), dtype=torch.int32, device=device)
        self._norms = torch.zeros(len(self._state), dtype=torch.float32, device=device)
        if verbose:
            print(f"trainstream: optimizer_mode='gpu': {offset / 2**20:.1f} MiB of state in "
                  f"daemon memory, mapped for {device}")

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        c = _C()
        for addr in self._registered:
            c.unregister_host(addr)
        self._registered.clear()
        self._state.clear()
        self._regions.clear()

    # ---------------------------------------------------------------- update
    def _launch(self, e, grad: torch.Tensor, grad_scale: float, eager: bool) -> None:
        step = self._table.step_id + 1
        if self._weights_checked != step:  # Note [The gpu mode takes written weights]
            self._adopt_weights(list(self._table.entries.values()))
            self._weights_checked = step
        s = self._state[e.param_id]
        g = self._table.param_groups[e.group]
        param = e.param
        if not param.is_contiguous():
            raise TrainStreamError(f"optimizer_mode='gpu' needs contiguous parameters; {e.name} "
                                   "is not")
        grad = grad.contiguous()
        c = _C()
        flag = self._flags[s.index:s.index + 1]
        if eager:
            c.flag_nonfinite(grad, flag)
            torch.linalg.vector_norm(grad, 2, dtype=torch.float32, out=self._norms[s.index])
        c.adamw_cuda_step(param.detach(), grad, s.dev_master, s.dev_exp_avg, s.dev_exp_avg_sq,
                          self._moment, s.step + 1, float(g["lr"]), float(g["betas"][0]),
                          float(g["betas"][1]), float(g["eps"]), float(g["weight_decay"]),
                          grad_scale, self._seed, e.param_id, flag if eager else None)
        self._launched[e.param_id] = s.step + 1
        self.bytes_pcie += param.numel() * (4 * self._msize + (8 if s.master is not None else 0))

    # -------------------------------------------------------------- data plane
    def check_alive(self, in_backward: bool = False) -> None:
        self._session.ensure_alive(in_backward)

    def grad_final(self, e: ParamEntry) -> None:
        self._session.ensure_alive(in_backward=True)
        if self._table.count_backward(e) and self._launch_now(e):
            self._table.in_flight[id(e.param)] = e

    def accept_grad(self, e: ParamEntry, grad: torch.Tensor) -> bool:
        raise TrainStreamError(
            f"optimizer_mode='gpu' updates weights on the device and cannot take the gradient "
            f"of the paged weight {e.name}; use optimizer_mode='cpu' to page trained weights")

    def lands_early(self) -> bool:
        """Without clipping, each update runs on the side stream from backward on, in
        place in the parameter: a read on another stream before step() races with it."""
        return self._table.posts_in_backward() and self._table.options["max_grad_norm"] is None

    def land(self, entries: List[ParamEntry]) -> None:
        """Orders the current stream after every update launched so far (no host wait),
        so a read issued on it next sees each of those weights whole and new; they are
        all taken off ``in_flight`` (Note [The gpu mode's reads wait on the stream])."""
        if not entries:
            return
        torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        self._table.in_flight.clear()

    # Note [The gpu mode's reads wait on the stream]
    # An eager update writes the parameter in place on the side stream while the main
    # stream goes on. The first guarded read after a launch makes the stream current at
    # that moment wait for the side stream: the host never blocks, and every weight
    # launched so far is then safe on that stream, so the table's in-flight list is
    # emptied and the next reads take the fast path. A read on a different stream after
    # that (a module called under another torch.cuda.stream) is not ordered: step() or
    # synchronize() orders everything.
    def _launch_now(self, e) -> bool:
        """Launches the update of `e` now (eager); False when it must wait for step()."""
        opts = self._table.options
        if opts["max_grad_norm"] is not None:
            return False
        grad = e.param.grad
        main = torch.cuda.current_stream(grad.device)
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            self._launch(e, grad, 1.0, eager=True)
        grad.record_stream(self._stream)
        if opts["free_grads"]:
            e.param.grad = None
        else:
            e.posted_grad = grad
            e.posted_version = grad._version
        return True

    def step(self, closure):
        t = self._table
        loss, step = begin_step(t, self._session.require_attached, closure)
        entries = list(t.entries.values())
        result = self._update(entries)
        for e in entries:
            e.backward_count = 0
        t.step_id = step
        self._last_grad_norm = result["grad_norm"]
        t.stats["bytes_pcie"] = self.bytes_pcie
        if result["skipped"]:
            t.stats["skipped_steps"] += 1
            names = result["skipped"]
            raise NonFiniteGradientError(
                f"step {step}: {len(names)} parameter(s) were not updated because their gradient "
                f"held NaN or Inf (first: {', '.join(names[:5])})")
        t.stats["steps"] += 1
        return loss

    def _update(self, entries) -> Dict[str, Any]:
        """Finishes the step: updates what the hooks did not, then orders the next
        use of every parameter after its update. Returns {"grad_norm", "skipped"}."""
        dev_stream = self._stream
        main = torch.cuda.current_stream(dev_stream.device)
        for e in entries:
            if e.param_id in self._launched and e.posted_grad is not None:
                self._table.check_unchanged(e)
            if e.param_id in self._launched and e.weight_written():
                raise RuntimeError(
                    f"trainstream: the weight of {e.name} was written after backward had "
                    "handed its gradient over, so its update started from the weight as it "
                    "was. Write weights between step() and the next backward, or pass "
                    "grad_post='step' to wrap() (zero_grad() ends this step)")
        pending = [e for e in entries if e.param_id not in self._launched
                   and e.param.grad is not None]
        self._adopt_weights(pending)  # (written after the step's first launch, if any)
        result: Dict[str, Any] = {"grad_norm": None, "skipped": []}
        max_norm = self._table.options["max_grad_norm"]
        if max_norm is not None:
            launched_eagerly = [e for e in entries if e.param_id in self._launched]
            if launched_eagerly:  # cannot happen: hooks defer when clipping
                raise TrainStreamError("internal: eager updates with max_grad_norm")
            grads = [e.param.grad for e in pending]
            if grads:
                norms = torch._foreach_norm(grads, 2.0)
                total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)
                total_f = float(total.item())
            else:
                total_f = 0.0
            result["grad_norm"] = total_f
            if not torch.isfinite(torch.tensor(total_f)):
                result["skipped"] = [e.name for e in pending]
                return result
            # torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped
            # to 1, in fp32, multiplied into each gradient.
            # (number / tensor is reciprocal-then-multiply in torch, as there.)
            coef = max_norm / (torch.tensor(total_f, dtype=torch.float32) + 1e-6)
            coef = float(torch.clamp(coef, max=1.0))
            dev_stream.wait_stream(main)
            with torch.cuda.stream(dev_stream):
                for e in pending:
                    self._launch(e, e.param.grad, coef, eager=False)
            for e in pending:
                self._state[e.param_id].step += 1
        else:
            dev_stream.wait_stream(main)
            with torch.cuda.stream(dev_stream):
                for e in pending:
                    self._launch(e, e.param.grad, 1.0, eager=True)
            ids = list(self._launched)
            if ids:
                idx = torch.tensor([self._state[i].index for i in ids], device=self._flags.device)
                flags = self._flags.index_select(0, idx).cpu()  # syncs the side stream's work
                sq = self._norms.index_select(0, idx).double().square().sum()
                result["grad_norm"] = float(sq.sqrt())
                for pid, bad in zip(ids, flags.tolist()):
                    if bad:
                        result["skipped"].append(self._table.by_id[pid].name)
                    else:
                        self._state[pid].step += 1
                self._flags.zero_()
        self._launched.clear()
        for e in entries:
            e.posted_grad = None
        main.wait_stream(dev_stream)
        self._table.in_flight.clear()
        return result

    def before_zero_grad(self) -> None:
        """Called with a step pending that will not come (a backward or step() raised
        part way, or Trainer's model.zero_grad() before the next train()): the updates
        already launched in backward ran on the device and cannot be undone, so the
        step ends with them (their step counts move on, their flags are read) and every
        pending count is cleared; without that the next step's hooks counted on from the
        old counts and step() found the old launches."""
        self._session.ensure_alive()
        t = self._table
        if t.between_steps():
            return
        if self._launched:
            launched = len(self._launched)
            for e in t.entries.values():
                e.posted_grad = None  # dropped by zero_grad: nothing to check
            result = self._update([])
            t.step_id += 1
            t.event("abandoned step", step=t.step_id,
                    params_applied=launched - len(result["skipped"]), rejected=result["skipped"])
        t.clear_pending()

    def synchronize(self) -> None:
        self._session.require_attached()
        if self._stream is not None:
            self._stream.synchronize()

    def last_grad_norm(self) -> Optional[float]:
        return self._last_grad_norm

    # Note [The gpu mode takes written weights]
    # The kernel reads a non-fp32 parameter's fp32 master from the daemon's memory and
    # writes the parameter from it, so a weight written in place since (the version
    # counter says so: Note [A written weight is found by its version counter],
    # weight_writes.py) would be overwritten by its old master's update. Before the
    # first launch of a step, and before a state dict is taken, each written weight
    # becomes its master's value element by element: an element that is no longer its
    # master's rounding takes its value (on the host, after the side stream's work; a
    # write is rare). An fp32 parameter is its own master. sync_weights_from_model()
    # does it for weights written through .data, which bump no counter.
    def sync_weights_from_model(self, params) -> None:
        t = self._table
        t.require_between_steps("sync_weights_from_model()")
        self._session.require_attached()
        self._adopt_weights(t.entries_of(params, "sync_weights_from_model()"), every=True)

    def _adopt_weights(self, entries: List[ParamEntry], every: bool = False) -> None:
        todo = [e for e in entries if every or e.weight_written()]
        if not todo:
            return
        if self._stream is not None:
            self._stream.synchronize()
        with torch.no_grad():
            for e in todo:
                master = self._state[e.param_id].master
                if master is not None:
                    w = e.param.detach().reshape(-1).to("cpu")
                    changed = w != master.to(w.dtype)
                    master[changed] = w[changed].float()
                e.mark_weight()
        self._table.stats["weights_adopted"] += len(todo)
        self._table.event("weights adopted", params=len(todo), first=todo[0].name)

    # ------------------------------------------------------------ state dict
    def state_dict(self) -> Dict[str, Any]:
        self._session.require_attached()
        if self._table.between_steps():
            self._adopt_weights(list(self._table.entries.values()))
        groups, order = pack_groups(self._table.param_groups)
        state = {}
        for e in self._table.entries.values():
            exported = self._export(e)
            if exported is not None:
                state[order[id(e.param)]] = exported
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        # (Nothing of the state is in the daemon's engine: no sync after.)
        self._session.require_attached()
        loaded = list(unpack_state(self._table, state_dict))
        saved = {id(e) for e, _ in loaded}  # the others keep what was written to them
        self._adopt_weights([e for e in self._table.entries.values() if id(e) not in saved])
        for e, s in loaded:
            self._load(e, s)

    def _export(self, e) -> Optional[Dict[str, torch.Tensor]]:
        self._stream.synchronize()
        s = self._state[e.param_id]
        if s.step == 0:
            return None
        dtype = e.param.dtype
        master = (s.master.clone() if s.master is not None
                  else e.param.detach().reshape(-1).float().cpu())
        # copy=True: never hand out views of the live shared-memory state.
        return {"step": torch.tensor(float(s.step), dtype=torch.float32),
                "exp_avg": s.exp_avg.float().to(dtype, copy=True).view(e.param.shape),
                "exp_avg_sq": s.exp_avg_sq.float().to(dtype, copy=True).view(e.param.shape),
                "master_weight": master.view(e.param.shape)}

    def _load(self, e, state: Dict[str, Any]) -> None:
        self._stream.synchronize()
        s = self._state[e.param_id]
        s.exp_avg.copy_(state["exp_avg"].reshape(-1).to(self._moment_torch))
        s.exp_avg_sq.copy_(state["exp_avg_sq"].reshape(-1).to(self._moment_torch))
        master = state.get("master_weight")
        if master is not None:
            master = master.reshape(-1).float()
            if s.master is not None:
                s.master.copy_(master)
            with torch.no_grad():
                e.param.copy_(master.view(e.param.shape).to(e.param.device, e.param.dtype))
        elif s.master is not None:
            s.master.copy_(e.param.detach().reshape(-1).float())
        e.mark_weight()
        step = state["step"]
        s.step = int(step.item() if torch.is_tensor(step) else step)

    # ------------------------------------------------------------------ report
    def regions(self) -> List[Dict[str, Any]]:
        return self._session.regions() + [
            {"purpose": "gpu-optimizer-state", "address": r.base_address,
             "bytes": r.segment_size, "registered": r.base_address in self._registered}
            for r in self._regions]

    def stats(self) -> Dict[str, Any]:
        return {}
