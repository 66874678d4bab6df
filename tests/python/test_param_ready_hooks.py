"""ParamReadyHooks and the guard_params option (optim/param_ready.py, Note [When a
weight's update is in flight]): a forward issued while the daemon's eager updates are
in flight (between backward and step()) reads the new weights with the guard, the
previous ones (resident) without it; training is unchanged by reads in the window;
the hooks follow attach()/detach(); modes whose updates wait for step() have no window
and the hooks only check. CPU, against a real daemon; the gpu-mode case needs CUDA."""
import copy

import pytest
import torch
from torch import nn

import trainstream
from paging_helpers import _pair
from tiny_gpt import corpus, text_batches

CUDA = torch.cuda.is_available()


class Tiny(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(3)])
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def _adamw(daemon, model, guard, **options):
    opt = trainstream.OffloadAdamW(model.parameters(), lr=1e-2, socket=daemon.socket,
                                   attach=False, **options)
    opt.attach(model, guard=guard)
    return opt


def _close(opt):
    opt.detach()
    opt.release_hooks()


def _hooked(model):
    return [m for m in model.modules() if m._forward_pre_hooks]


def _window_reads(model, opt, x, steps=3):
    """Per step: (output read before backward, read between backward and step(), read
    after step()); every read under no_grad."""
    reads = []
    for _ in range(steps):
        with torch.no_grad():
            before = model(x)
        model(x).square().mean().backward()
        with torch.no_grad():
            window = model(x)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            after = model(x)
        reads.append((before, window, after))
    return reads


# ---------------------------------------------------------------- the window (cpu mode)
@pytest.mark.parametrize("guard", [True, False])
def test_a_read_between_backward_and_step_sees_the_new_weights_only_with_the_guard(
        daemon, guard):
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(16, 64)
    opt = _adamw(daemon, model, guard)
    try:
        reads = _window_reads(model, opt, x)
        for i, (before, window, after) in enumerate(reads):
            assert not torch.equal(before, after), f"step {i}: the step changed nothing"
            if guard:  # the forward waited for each PARAM_READY and copied the weight in
                assert torch.equal(window, after), f"step {i}: the window read old weights"
            else:  # a resident weight changes only in step()
                assert torch.equal(window, before), f"step {i}: the weights moved early"
        ready = opt.stats()["param_ready"]
        if guard:
            assert ready["window"] is True and ready["modules"] == 4
            # The first module waits for its own weight and bias; the replies that come
            # meanwhile land too, so a later module waits only for what has not come.
            assert len(reads) <= ready["waits"] <= 4 * len(reads)
            assert 2 * len(reads) <= ready["params_waited"] <= 8 * len(reads)
        else:
            assert ready is None
    finally:
        _close(opt)


def test_reads_in_the_window_leave_training_unchanged(daemon):
    """Landing updates before step() must not change what step() computes, nor make it
    wait for a PARAM_READY already taken (it would hang until timeout_s)."""
    torch.manual_seed(1)
    ref_model = Tiny()
    model = copy.deepcopy(ref_model)
    xs = [torch.randn(16, 64) for _ in range(5)]
    ref = _adamw(daemon, ref_model, True, timeout_s=20)
    opt = _adamw(daemon, model, True, timeout_s=20)
    try:
        for i, x in enumerate(xs):
            ref_model(x).square().mean().backward()
            ref.step()
            ref.zero_grad()
            model(x).square().mean().backward()
            with torch.no_grad():
                model.layers[0](x)  # lands only layers[0]'s update: step() waits for the rest
            opt.step()
            opt.zero_grad()
            assert opt.last_grad_norm == ref.last_grad_norm, f"step {i}"
        for (name, p), q in zip(ref_model.named_parameters(), model.parameters()):
            assert torch.equal(p, q), name
        assert opt.stats()["param_ready"]["params_waited"] == 2 * len(xs)
    finally:
        _close(ref)
        _close(opt)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not CUDA, reason="the CUDA pager's copies need a CUDA GPU (run this file on the GPU host)"))])
@pytest.mark.parametrize("guard", [True, False])
def test_paged_weights_read_in_the_window_are_the_new_ones(daemon, guard, device):
    """A paged weight's home is its param slot, which the daemon writes during backward:
    with the guard, an evaluation forward before step() fetches the blocks (prefetches
    included) only once their updates landed, and lands the resident weights, so it
    computes what a forward after step() computes. Without it, the resident weights are
    the old ones and the paged ones whatever the daemon has written so far: a mix."""
    cfg, _, ours = _pair(seed=3)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 socket=daemon.socket, param_offload=True,
                                 min_offload_bytes=0, guard_params=guard, device=device,
                                 optimizer_mode="cpu")
    try:
        assert ours._trainstream_session.pager.paged == [0, 1, 2, 3]
        e = opt._table.entries[id(ours.blocks[0].mlp[0].weight)]
        assert ours.blocks[0].mlp[0].weight.data_ptr() == e.param_slot.data_ptr()
        for i, (x, y) in enumerate(text_batches(corpus(), cfg, batch=4, steps=4, seed=3)):
            x, y = x.to(device), y.to(device)
            with torch.no_grad():
                before = ours(x, y).item()
            ours(x, y).backward()
            with torch.no_grad():
                window = ours(x, y).item()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                after = ours(x, y).item()
            assert before != after, f"step {i}"
            if guard:
                assert window == after, f"step {i}: the window read {window}, after {after}"
            else:
                assert window != after, f"step {i}: the resident weights moved early"
        ready = opt.stats()["param_ready"]
        if guard:
            assert ready["window"] is True and ready["waits"] > 0
        else:
            assert ready is None
    finally:
        trainstream.unwrap(ours)


def test_a_gradient_rejected_while_a_read_waits_is_reported_by_step(daemon, monkeypatch):
    """The daemon rejects layers[0]'s gradients (lr=-1, the client's own check off) and
    answers ERROR instead of PARAM_READY: the read waiting for them must stop waiting
    (not hang until timeout_s), and step() still reports the rejection."""
    from trainstream.optim import backend as optim_module  # where the client checks them
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(16, 64)
    first = list(model.layers[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    opt = trainstream.OffloadAdamW([{"params": first}, {"params": rest}], lr=1e-2,
                                   socket=daemon.socket, timeout_s=20, attach=False)
    opt.attach(model)
    try:
        old = [p.detach().clone() for p in model.parameters()]
        monkeypatch.setattr(optim_module, "check_adamw_hyper", lambda *a, **k: None)
        opt.param_groups[0]["lr"] = -1.0
        model(x).square().mean().backward()
        with torch.no_grad():
            window = model(x)  # waits for layers[0] first: its ERRORs end that wait
        with pytest.raises(trainstream.TrainStreamError,
                           match=r"rejected the gradient of 2 parameter\(s\).*the other 6 were"):
            opt.step()
        monkeypatch.undo()
        opt.param_groups[0]["lr"] = 1e-2
        with torch.no_grad():
            assert torch.equal(window, model(x))  # the others had landed in the window
        for p, q in zip(model.parameters(), old):
            assert torch.equal(p, q) == any(p is f for f in first)
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()  # the next step starts clean
    finally:
        _close(opt)


def test_a_read_after_an_interrupted_step_and_the_step_that_finishes_it(daemon):
    """Ctrl-C in step() after the step end was sent; a forward then lands every update
    (and may read the STEP_DONE); the next step() must finish with what was taken,
    not wait for replies that already came."""
    torch.manual_seed(0)
    model = Tiny()
    ref_model = copy.deepcopy(model)
    x = torch.randn(16, 64)
    opt = _adamw(daemon, model, True, timeout_s=20)
    ref = _adamw(daemon, ref_model, True, timeout_s=20)
    real_wait = opt._session.wait
    interrupted = []

    def wait(want, keep=(), on_error=None):
        if opt._backend._replies is not None and opt._backend._replies.end_sent \
                and not interrupted:  # the step's own wait, once
            interrupted.append(True)
            raise KeyboardInterrupt
        return real_wait(want, keep, on_error)
    opt._session.wait = wait
    try:
        for it in range(3):
            model(x).square().mean().backward()
            ref_model(x).square().mean().backward()
            if it == 0:
                with pytest.raises(KeyboardInterrupt):
                    opt.step()
                with torch.no_grad():
                    for layer in model.layers:
                        layer(x)
                    model.head(x)
            opt.step()
            opt.zero_grad()
            ref.step()
            ref.zero_grad()
        assert interrupted and opt.stats()["steps"] == 3
        for p, q in zip(ref_model.parameters(), model.parameters()):
            assert torch.equal(p, q)
    finally:
        _close(opt)
        _close(ref)


# ------------------------------------------------------------------ no window
@pytest.mark.parametrize("options", [{"max_grad_norm": 1.0}, {"grad_post": "step"}],
                         ids=["max_grad_norm", "grad_post=step"])
def test_modes_whose_updates_wait_for_step_have_no_window(daemon, options):
    torch.manual_seed(2)
    model = Tiny()
    x = torch.randn(16, 64)
    opt = _adamw(daemon, model, True, **options)
    try:
        for before, window, after in _window_reads(model, opt, x, steps=2):
            assert torch.equal(window, before) and not torch.equal(before, after)
        ready = opt.stats()["param_ready"]
        assert ready["window"] is False and ready["modules"] == 4
        assert ready["waits"] == 0 and ready["params_waited"] == 0
    finally:
        _close(opt)


# ------------------------------------------------------------- attach / detach
def test_attach_installs_and_detach_removes_the_hooks(daemon):
    torch.manual_seed(0)
    model = Tiny()
    opt = _adamw(daemon, model, True)
    try:
        hooks = opt.param_ready_hooks
        assert isinstance(hooks, trainstream.ParamReadyHooks)
        assert hooks.model is model
        assert _hooked(model) == list(model.layers) + [model.head]  # modules owning params
        assert all(len(m._forward_pre_hooks) == 1 for m in _hooked(model))
        opt.detach()
        assert opt.param_ready_hooks is None and _hooked(model) == []
        opt.attach()  # a new session: the hooks go back on the model attach() was given
        assert opt.param_ready_hooks.model is model and len(_hooked(model)) == 4
        opt.attach(model, guard=False)  # while attached: removes them
        assert opt.param_ready_hooks is None and _hooked(model) == []
        assert opt.stats()["guard_params"] is False
        opt.attach(model, guard=True)
        assert len(_hooked(model)) == 4
    finally:
        _close(opt)
    assert _hooked(model) == []


def test_guard_false_installs_none(daemon):
    torch.manual_seed(0)
    model = Tiny()
    for opt in (_adamw(daemon, model, False),
                _adamw(daemon, model, None, guard_params=False)):
        try:
            assert opt.param_ready_hooks is None and _hooked(model) == []
            assert opt.stats()["param_ready"] is None
        finally:
            _close(opt)


def test_wrap_installs_the_hooks_and_unwrap_removes_them(daemon):
    cfg, _, ours = _pair(seed=0)
    owners = [m for m in ours.modules() if any(True for _ in m.parameters(recurse=False))]
    ours, opt = trainstream.wrap(ours, socket=daemon.socket)
    assert opt.param_ready_hooks.model is ours
    assert opt.param_ready_hooks.modules == len(owners)
    assert all(m._forward_pre_hooks for m in owners)
    trainstream.unwrap(ours)
    assert opt.param_ready_hooks is None
    assert not any(m._forward_pre_hooks for m in owners)
    cfg, _, plain = _pair(seed=0)
    plain, opt = trainstream.wrap(plain, socket=daemon.socket, guard_params=False)
    assert opt.param_ready_hooks is None
    # (the root's one pre-hook is the memory controller's, when it is installed)
    assert not any(m._forward_pre_hooks for m in plain.modules() if m is not plain)
    trainstream.unwrap(plain)


def test_a_deep_copy_of_a_guarded_model_runs_on_its_own(daemon):
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(4, 64)
    opt = _adamw(daemon, model, True)
    try:
        model(x).sum().backward()
        twin = copy.deepcopy(model)  # with updates in flight: its hooks find none of its own
        with torch.no_grad():
            assert torch.equal(twin(x), twin(x))
        assert opt.stats()["param_ready"]["waits"] == 0
        opt.step()
    finally:
        _close(opt)


@pytest.mark.parametrize("bad", ["yes", "True", 1, 0])
def test_bad_guard_values_raise_naming_what_is_accepted(daemon, bad):
    torch.manual_seed(0)
    model = Tiny()
    opt = trainstream.OffloadAdamW(model.parameters(), socket=daemon.socket, attach=False)
    with pytest.raises(ValueError, match=r"attach\(guard=.*\): accepted: True or False"):
        opt.attach(model, guard=bad)
    assert opt.param_ready_hooks is None and _hooked(model) == []
    with pytest.raises(ValueError, match="guard_params"):
        trainstream.OffloadAdamW(model.parameters(), socket=daemon.socket, attach=False,
                                 guard_params=bad)


# ------------------------------------------------------------------ gpu mode
@pytest.mark.skipif(not CUDA, reason="optimizer_mode='gpu' needs a CUDA GPU (run this file "
                                     "on the GPU host)")
@pytest.mark.parametrize("guard", [True, False])
def test_gpu_mode_a_read_in_the_window_waits_for_the_update_stream(daemon, guard):
    """The update kernels run on a side stream from backward on. The side stream is held
    back here (a sleep queued on it first), so a forward right after backward runs while
    every update is still queued: without the guard it reads the old weights, with it
    the compute stream waits for the side stream and reads the new ones."""
    torch.manual_seed(0)
    model = Tiny(width=1024).cuda()
    x = torch.randn(64, 1024, device="cuda")
    opt = _adamw(daemon, model, guard, optimizer_mode="gpu")
    try:
        assert opt.optimizer_mode == "gpu"
        with torch.no_grad():
            before = model(x)
        side = opt._backend._stream  # (the backend's update stream: no public handle)
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(2e9))  # about a second of the side stream's time
        model(x).square().mean().backward()
        with torch.no_grad():
            window = model(x).clone()
        opt.step()
        with torch.no_grad():
            after = model(x)
        torch.cuda.synchronize()
        assert not torch.equal(before, after)
        if guard:
            assert torch.equal(window, after)
            assert opt.stats()["param_ready"]["waits"] >= 1
        else:
            assert torch.equal(window, before)
    finally:
        _close(opt)
