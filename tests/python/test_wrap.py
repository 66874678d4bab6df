"""trainstream.wrap() against plain torch.optim.AdamW on a small GPT (CPU; the same code
path runs on CUDA models on the GPU host, see test_wrap_cuda.py)."""
import copy
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import trainstream
from conftest import wait_until
from tiny_gpt import GPTConfig, TinyGPT, corpus, text_batches

STEPS = 20


def _models(seed=0, cfg=None):
    torch.manual_seed(seed)
    cfg = cfg or GPTConfig()
    ref = TinyGPT(cfg)
    ours = copy.deepcopy(ref)
    return cfg, ref, ours


def _param_groups(model, lr):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _max_rel(a, b):
    return ((a - b).abs() / b.abs().clamp_min(1e-30)).max().item()


def _train(model, opt, batches, *, accumulation=1, clip=None):
    losses = []
    for x, y in batches:
        xs, ys = x.chunk(accumulation), y.chunk(accumulation)
        total = 0.0
        for xm, ym in zip(xs, ys):
            loss = model(xm, ym) / accumulation
            loss.backward()
            total += loss.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _assert_same(ref, ours, ref_losses, our_losses, param_tol=1e-6):
    for i, (a, b) in enumerate(zip(ref_losses, our_losses)):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {i}: loss {b} vs torch {a}"
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        diff = (p.detach() - q.detach()).abs().max().item()
        assert diff <= param_tol, f"{name}: max |diff| {diff:.3g} > {param_tol}"


@pytest.mark.parametrize("grad_post", ["backward", "step"])
def test_losses_and_params_match_torch_adamw(daemon, grad_post):
    cfg, ref, ours = _models()
    batches = text_batches(corpus(), cfg, batch=4, steps=STEPS)
    ref_opt = torch.optim.AdamW(_param_groups(ref, 3e-3), lr=3e-3, foreach=False)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(_param_groups(ours, 3e-3), lr=3e-3),
                                 socket=daemon.socket, grad_post=grad_post)
    assert isinstance(opt, trainstream.OffloadAdamW)
    ref_losses = _train(ref, ref_opt, batches)
    our_losses = _train(ours, opt, batches)
    assert our_losses[-1] < our_losses[0], "the model should learn"
    _assert_same(ref, ours, ref_losses, our_losses)
    assert ours._trainstream_session.steps == STEPS
    trainstream.unwrap(ours)


def test_gradient_accumulation_matches_torch(daemon):
    cfg, ref, ours = _models(seed=1)
    batches = text_batches(corpus(), cfg, batch=8, steps=10, seed=1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=2e-3, foreach=False)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=2e-3),
                                 socket=daemon.socket, accumulation_steps=2)
    _assert_same(ref, ours, _train(ref, ref_opt, batches, accumulation=2),
                 _train(ours, opt, batches, accumulation=2))


def test_clipping_matches_torch(daemon):
    cfg, ref, ours = _models(seed=2)
    batches = text_batches(corpus(), cfg, batch=4, steps=10, seed=2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 socket=daemon.socket, max_grad_norm=0.05)
    ref_losses = _train(ref, ref_opt, batches, clip=0.05)
    our_losses = _train(ours, opt, batches)
    _assert_same(ref, ours, ref_losses, our_losses)
    assert opt.last_grad_norm is not None and opt.last_grad_norm > 0.05, "clipping must engage"


def _numpy_lambda_lr(o):
    # float * np.float32 stays np.float32: the group's lr becomes a numpy scalar, a
    # number that must be taken as one.
    import numpy as np
    sched = torch.optim.lr_scheduler.LambdaLR(o, lambda s: np.float32(0.5) ** s)
    assert isinstance(o.param_groups[0]["lr"], np.floating)
    return sched


@pytest.mark.parametrize("make_sched", [
    lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.3), _numpy_lambda_lr],
    ids=["step_lr", "numpy_lambda_lr"])
def test_lr_scheduler_takes_effect(daemon, make_sched):
    cfg, ref, ours = _models(seed=3)
    batches = text_batches(corpus(), cfg, batch=4, steps=8, seed=3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 socket=daemon.socket)
    scheds = [make_sched(o) for o in (ref_opt, opt)]
    losses = []
    for model, o, sched in ((ref, ref_opt, scheds[0]), (ours, opt, scheds[1])):
        run = []
        for x, y in batches:
            loss = model(x, y)
            loss.backward()
            o.step()
            o.zero_grad()
            sched.step()
            run.append(loss.item())
        losses.append(run)
    _assert_same(ref, ours, *losses)


def test_state_dict_matches_torch_and_round_trips(daemon):
    cfg, ref, ours = _models(seed=4)
    batches = text_batches(corpus(), cfg, batch=4, steps=6, seed=4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=1e-3),
                                 socket=daemon.socket)
    _train(ref, ref_opt, batches[:3])
    _train(ours, opt, batches[:3])
    ref_sd, our_sd = ref_opt.state_dict(), opt.state_dict()
    assert set(ref_sd["state"]) == set(our_sd["state"])
    for idx, s in ref_sd["state"].items():
        o = our_sd["state"][idx]
        assert float(o["step"]) == float(s["step"]) == 3.0
        for key in ("exp_avg", "exp_avg_sq"):
            diff = (o[key] - s[key]).abs().max().item()
            assert diff <= 1e-6 * max(1.0, s[key].abs().max().item()), f"{idx}.{key}: {diff}"
        assert o["master_weight"].dtype == torch.float32
    # Our state dict loads into plain torch AdamW, which then continues in step.
    fresh = copy.deepcopy(ours)
    assert fresh._trainstream_session is None, "a copy of a wrapped model is not attached"
    torch_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3, foreach=False)
    torch_opt.load_state_dict(our_sd)
    ref_losses = _train(ref, ref_opt, batches[3:])
    _assert_same(ref, fresh, ref_losses, _train(fresh, torch_opt, batches[3:]))
    # And torch's state dict loads into a fresh wrapped optimizer.
    _, ref2, ours2 = _models(seed=4)
    ref2.load_state_dict(ref.state_dict())
    ours2.load_state_dict(ref.state_dict())
    ref2_opt = torch.optim.AdamW(ref2.parameters(), lr=1e-3, foreach=False)
    ref2_opt.load_state_dict(ref_opt.state_dict())
    ours2, opt2 = trainstream.wrap(ours2, socket=daemon.socket, lr=1e-3)
    opt2.load_state_dict(ref_opt.state_dict())
    more = text_batches(corpus(), cfg, batch=4, steps=3, seed=5)
    _assert_same(ref2, ours2, _train(ref2, ref2_opt, more), _train(ours2, opt2, more))


def test_existing_torch_state_is_migrated(daemon):
    cfg, ref, ours = _models(seed=6)
    batches = text_batches(corpus(), cfg, batch=4, steps=6, seed=6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    torch_opt = torch.optim.AdamW(ours.parameters(), lr=1e-3, foreach=False)
    _train(ref, ref_opt, batches[:3])
    _train(ours, torch_opt, batches[:3])
    ours, opt = trainstream.wrap(ours, torch_opt, socket=daemon.socket)
    _assert_same(ref, ours, _train(ref, ref_opt, batches[3:]), _train(ours, opt, batches[3:]))


def test_extra_backward_before_step_raises(daemon):
    cfg, _, ours = _models()
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1)
    ours, opt = trainstream.wrap(ours, socket=daemon.socket)
    ours(x, y).backward()
    with pytest.raises(RuntimeError, match="accumulation_steps=1"):
        ours(x, y).backward()


def test_modified_gradient_after_backward_raises(daemon):
    cfg, _, ours = _models()
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1)
    ours, opt = trainstream.wrap(ours, socket=daemon.socket)
    ours(x, y).backward()
    torch.nn.utils.clip_grad_norm_(ours.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="max_grad_norm"):
        opt.step()


def test_training_goes_on_after_a_step_that_raised(daemon):
    """A step that raised (the gradient changed after backward handed it over) left every
    parameter pending: each later backward raised "reached ... 2 times". zero_grad()
    ends that step with what the daemon holds (already applied: eager updates cannot be
    undone), copies those weights in, and the next iteration trains."""
    cfg, _, ours = _models()
    batches = text_batches(corpus(), cfg, batch=2, steps=3)
    ours, opt = trainstream.wrap(ours, socket=daemon.socket)
    x, y = batches[0]
    ours(x, y).backward()
    torch.nn.utils.clip_grad_norm_(ours.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="max_grad_norm"):
        opt.step()
    assert not opt.between_steps()
    opt.zero_grad()
    assert opt.between_steps()
    losses = _train(ours, opt, batches[1:])
    assert all(math.isfinite(v) for v in losses)
    # The model's weights are the daemon's masters (rounded to the parameters' dtype).
    sd = opt.state_dict()["state"]
    for i, p in enumerate(ours.parameters()):
        assert torch.equal(sd[i]["master_weight"].to(p.dtype).view_as(p), p.detach())
    assert sd[0]["step"].item() == 3.0


@pytest.mark.parametrize("grad_post", ["backward", "step"])
def test_a_bad_learning_rate_from_a_scheduler_is_named_and_training_goes_on(daemon, grad_post):
    """A scheduler (or a user) that sets a group's lr to a value the daemon rejects gets
    a ValueError naming the group and the value before any gradient of the step reaches
    the daemon (the bad group is the second: the first must not be posted either); with
    the lr fixed, the next iteration trains."""
    cfg, _, ours = _models()
    batches = text_batches(corpus(), cfg, batch=2, steps=3)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(_param_groups(ours, 1e-3), lr=1e-3),
                                 socket=daemon.socket, grad_post=grad_post)
    opt.param_groups[1]["lr"] = -1.0
    x, y = batches[0]
    with pytest.raises(ValueError, match=r"param_groups\[1\]: lr=-1.0: accepted: a finite number >= 0"):
        ours(x, y).backward()
        opt.step()
    assert opt.stats()["grads_posted"] == 0
    opt.param_groups[1]["lr"] = 1e-3
    opt.zero_grad()
    assert opt.between_steps()
    losses = _train(ours, opt, batches[1:])
    assert all(math.isfinite(v) for v in losses)
    assert opt.stats()["steps"] == 2


def test_a_gradient_the_daemon_rejects_ends_its_step(daemon, monkeypatch):
    """The daemon leaves a gradient it rejects out of the step. step() used to raise at
    the first ERROR with the other replies queued and the step half-ended (its StepEnd
    sent), so the next step could not finish. It now names the parameters once the step
    is over, the other group's parameters are updated, and the next iteration trains.
    (The client's own check is switched off so that lr=-1 reaches the daemon, standing
    in for any rejection.)"""
    from trainstream.optim import backend as optim_module  # where the client checks hyperparameters
    cfg, _, ours = _models()
    batches = text_batches(corpus(), cfg, batch=2, steps=3)
    groups = _param_groups(ours, 1e-3)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(groups, lr=1e-3),
                                 socket=daemon.socket, timeout_s=20)
    rejected = [p for p in opt.param_groups[0]["params"]]
    updated = [p for p in opt.param_groups[1]["params"]]
    before = {id(p): p.detach().clone() for p in rejected + updated}
    monkeypatch.setattr(optim_module, "check_adamw_hyper", lambda *a, **k: None, raising=False)
    opt.param_groups[0]["lr"] = -1.0
    x, y = batches[0]
    ours(x, y).backward()
    with pytest.raises(trainstream.TrainStreamError,
                       match=rf"step 1: the daemon rejected the gradient of {len(rejected)} "
                             r"parameter\(s\).*invalid learning rate.*the other "
                             rf"{len(updated)} were"):
        opt.step()
    assert opt.between_steps()
    assert all(torch.equal(before[id(p)], p.detach()) for p in rejected)
    assert not any(torch.equal(before[id(p)], p.detach()) for p in updated)
    monkeypatch.undo()
    opt.param_groups[0]["lr"] = 1e-3
    opt.zero_grad()
    losses = _train(ours, opt, batches[1:])
    assert all(math.isfinite(v) for v in losses)
    sd = opt.state_dict()
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        assert torch.equal(sd["state"][i]["master_weight"].to(p.dtype).view_as(p), p.detach())
    # The rejected parameters took two steps, the others three.
    first_rejected = sd["param_groups"][0]["params"][0]
    first_updated = sd["param_groups"][1]["params"][0]
    assert sd["state"][first_rejected]["step"].item() == 2.0
    assert sd["state"][first_updated]["step"].item() == 3.0


def _rejected_then_synchronized(daemon, monkeypatch):
    """A wrapped model after a backward whose gradients the daemon rejected (lr=-1 with
    the client's own check off) and a synchronize() that read the rejections; the lr is
    good again and the check back on."""
    from trainstream.optim import backend as optim_module  # where the client checks hyperparameters
    cfg, _, ours = _models()
    batches = text_batches(corpus(), cfg, batch=2, steps=2)
    ours, opt = trainstream.wrap(ours, socket=daemon.socket, timeout_s=20)
    monkeypatch.setattr(optim_module, "check_adamw_hyper", lambda *a, **k: None)
    opt.param_groups[0]["lr"] = -1.0
    x, y = batches[0]
    ours(x, y).backward()
    opt.synchronize()
    monkeypatch.undo()
    opt.param_groups[0]["lr"] = 1e-3
    return ours, opt, batches[1:]


def test_a_rejection_seen_while_synchronizing_is_kept_for_step(daemon, monkeypatch):
    """synchronize() or state_dict() between backward and step() may read the daemon's
    ERROR for a gradient; it is kept for step(), which reports it and ends the step."""
    ours, opt, batches = _rejected_then_synchronized(daemon, monkeypatch)
    opt.state_dict()
    with pytest.raises(trainstream.TrainStreamError, match="rejected the gradient"):
        opt.step()
    opt.zero_grad()
    assert all(math.isfinite(v) for v in _train(ours, opt, batches))


def test_kept_rejections_do_not_outlive_their_session(daemon, monkeypatch):
    """ERRORs kept for step() belonged to the session that detach() ends; the new
    session's step must not report them."""
    ours, opt, batches = _rejected_then_synchronized(daemon, monkeypatch)
    opt.detach()
    opt.attach()
    opt.zero_grad()
    assert all(math.isfinite(v) for v in _train(ours, opt, batches))


@pytest.mark.parametrize("recover", ["step", "zero_grad"])
def test_an_interrupted_step_is_finished_by_the_next_call(daemon, recover):
    """Ctrl-C while step() waits for the daemon, after the step end was sent. The next
    step() (or zero_grad()) used to send a second step end, whose ERROR ("already
    ended", param_id 0) was taken for parameter 0's gradient, and to wait again for
    replies already taken. It now finishes the step where the first call stopped."""
    w0 = torch.nn.Parameter(torch.randn(4 * 1024 * 1024))
    w1 = torch.nn.Parameter(torch.randn(16))
    opt = trainstream.OffloadAdamW([w0, w1], lr=1e-2, socket=daemon.socket, timeout_s=20,
                                   grad_post="step", names={id(w0): "w0", id(w1): "w1"})
    ref = [w0.detach().clone(), w1.detach().clone()]
    real_wait = opt._session.wait
    interrupted = []

    def wait(want, keep=(), on_error=None):
        if on_error is not None and not interrupted:  # the step's own wait, once
            interrupted.append(True)
            raise KeyboardInterrupt
        return real_wait(want, keep, on_error)
    opt._session.wait = wait
    for it in range(3):
        (w0.sum() * 1e-3 + (w1 ** 2).sum()).backward()
        if it == 0:
            with pytest.raises(KeyboardInterrupt):
                opt.step()
            if recover == "step":
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
    assert opt._session.backlog == [] and opt.stats()["steps"] == 3 - (recover == "zero_grad")
    # Against torch, three steps on the same gradients.
    q0, q1 = (torch.nn.Parameter(t) for t in ref)
    ref_opt = torch.optim.AdamW([q0, q1], lr=1e-2, foreach=False)
    for _ in range(3):
        (q0.sum() * 1e-3 + (q1 ** 2).sum()).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert (q0 - w0).abs().max().item() <= 1e-6
    assert (q1 - w1).abs().max().item() <= 1e-6
    assert opt.state_dict()["state"][0]["step"].item() == 3.0


def test_last_grad_norm_is_reported_each_step_after_going_local(daemon):
    """offload="auto" may hand the optimizer to torch (its local mode); without clipping
    last_grad_norm used to stay at the last daemon step's value."""
    cfg, _, ours = _models()
    batches = text_batches(corpus(), cfg, batch=2, steps=3)
    ours, opt = trainstream.wrap(ours, socket=daemon.socket)
    _train(ours, opt, batches[:1])
    opt.go_local()
    for x, y in batches[1:]:
        ours(x, y).backward()
        grads = [p.grad.detach().clone() for p in ours.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad()
        want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        assert opt.last_grad_norm == pytest.approx(want.item(), rel=1e-6)


def test_synchronize_between_backward_and_step(daemon):
    """synchronize() and state_dict() read the daemon's replies; they used to drop the
    step's own (each parameter's PARAM_READY), and step() then waited for them until
    timeout_s."""
    cfg, ref, ours = _models()
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1)
    ours, opt = trainstream.wrap(ours, socket=daemon.socket, timeout_s=5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=opt.param_groups[0]["lr"], foreach=False)
    ours(x, y).backward()
    opt.synchronize()
    opt.state_dict()
    opt.step()
    ref(x, y).backward()
    ref_opt.step()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert (p.detach() - q.detach()).abs().max().item() <= 1e-6, name


def test_a_discarded_optimizer_lets_go_of_the_parameters(daemon):
    """Its gradient hooks held the optimizer, so it outlived `del` with its daemon session
    and kept counting the gradients of the optimizer built after it."""
    import gc
    import weakref
    cfg, _, ours = _models()
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1)
    first = trainstream.OffloadAdamW(ours.parameters(), socket=daemon.socket)
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None
    opt = trainstream.OffloadAdamW(ours.parameters(), socket=daemon.socket)
    for _ in range(2):
        ours(x, y).backward()
        opt.step()
        opt.zero_grad()
    assert opt.stats()["steps"] == 2


def test_non_finite_gradient_skips_step(daemon):
    cfg, _, ours = _models()
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1)
    ours, opt = trainstream.wrap(ours, socket=daemon.socket, grad_post="step",
                                 max_grad_norm=1.0)
    before = [p.detach().clone() for p in ours.parameters()]
    ours(x, y).backward()
    next(ours.parameters()).grad[0, 0] = float("nan")
    with pytest.raises(trainstream.NonFiniteGradientError):
        opt.step()
    for b, p in zip(before, ours.parameters()):
        assert torch.equal(b, p.detach())
    assert all(int(s["step"]) == 0 for s in opt.state_dict()["state"].values())


@pytest.mark.parametrize("options, fragment", [
    ({"optimizer_mode": "fast"}, "optimizer_mode='fast'"),
    ({"moment_dtype": "int8"}, "moment_dtype"),
    ({"accumulation_steps": 0}, "accumulation_steps"),
    ({"max_grad_norm": -1.0}, "max_grad_norm"),
    ({"colour": "blue"}, "unknown option"),
    ({"guard_params": "yes"}, "guard_params"),
])
def test_bad_options_raise_value_error(options, fragment):
    model = TinyGPT(GPTConfig())
    with pytest.raises(ValueError, match=fragment):
        trainstream.wrap(model, **options)


def test_adam_with_l2_weight_decay_is_refused(daemon):
    model = TinyGPT(GPTConfig())
    with pytest.raises(ValueError, match="L2"):
        trainstream.wrap(model, torch.optim.Adam(model.parameters(), weight_decay=0.1),
                         socket=daemon.socket)


def test_memory_report_sections(daemon):
    cfg, _, ours = _models()
    batches = text_batches(corpus(), cfg, batch=2, steps=2)
    ours, opt = trainstream.wrap(ours, socket=daemon.socket)
    _train(ours, opt, batches)
    report = trainstream.memory_report(ours)
    for key in ("events", "gpu", "pinned", "transfers", "optimizer", "resident"):
        assert key in report
    numel = sum(p.numel() for p in ours.parameters())
    assert report["optimizer"]["numel"] == numel
    assert report["transfers"]["bytes_d2h"] == 2 * 4 * numel
    assert report["transfers"]["bytes_h2d"] == 2 * 4 * numel
    assert report["pinned"]["mapped_bytes"] >= 2 * 4 * numel
    assert trainstream.find_blocks(ours) == list(ours.blocks)


def test_daemon_death_raises_daemon_error(daemon_factory):
    d = daemon_factory()
    cfg, _, ours = _models()
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1)
    ours, opt = trainstream.wrap(ours, socket=d.socket, timeout_s=10.0, reconnect=False)
    ours(x, y).backward()
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    t0 = time.monotonic()
    with pytest.raises(trainstream.DaemonError):
        opt.step()
    assert time.monotonic() - t0 < 15, "step() must not hang when the daemon dies"


def test_killed_client_session_is_reclaimed(daemon):
    script = textwrap.dedent(f"""
        import sys, torch, trainstream
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from tiny_gpt import GPTConfig, TinyGPT
        model, opt = trainstream.wrap(TinyGPT(GPTConfig()), socket={daemon.socket!r})
        print("attached", flush=True)
        sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=dict(os.environ))
    assert proc.stdout.readline().strip() == b"attached"
    assert len(daemon.status()["sessions"]) == 1
    proc.kill()
    proc.wait()
    # The daemon hears of the death at once (a pidfd, then the stream's end); the bound
    # only catches a session that is never reclaimed, however slow the machine.
    wait_until(lambda: daemon.status()["sessions"] == [], 20,
               what="the killed client's session to be reclaimed")


def test_lr_option_overrides_every_group(daemon):
    model = TinyGPT(GPTConfig())
    groups = _param_groups(model, 1e-3)
    groups[1]["lr"] = 1e-2
    model, opt = trainstream.wrap(model, torch.optim.AdamW(groups, lr=1e-3), socket=daemon.socket,
                                  lr=5e-4)
    assert [g["lr"] for g in opt.param_groups] == [5e-4, 5e-4]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_non_contiguous_parameter_is_updated_in_place(daemon):
    torch.manual_seed(7)
    w0 = torch.randn(8, 4).t()  # a transposed view: not contiguous
    ref = torch.nn.Parameter(w0.clone().t().contiguous().t())
    ours = torch.nn.Parameter(w0.clone().t().contiguous().t())
    assert not ours.is_contiguous()
    holder = torch.nn.Module()
    holder.w = ours
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, foreach=False)
    _, opt = trainstream.wrap(holder, torch.optim.AdamW([ours], lr=1e-2), socket=daemon.socket)
    x = torch.randn(5, 8)
    for _ in range(3):
        for p, o in ((ref, ref_opt), (ours, opt)):
            (x @ p.t()).square().sum().backward()
            o.step()
            o.zero_grad()
    assert holder.w is ours and not ours.is_contiguous()
    assert (ref - ours).abs().max().item() <= 1e-6


def test_unwrap_removes_the_gradient_hooks(daemon):
    cfg, ref, ours = _models(seed=7)
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1, seed=7)
    ours, opt = trainstream.wrap(ours, socket=daemon.socket)
    assert all(e.hook is not None for e in opt._table.entries.values())
    trainstream.unwrap(ours)
    assert all(e.hook is None for e in opt._table.entries.values())
    # The model trains with a plain optimizer afterwards; nothing is posted anywhere.
    plain = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    ours(x, y).backward()
    plain.step()
    assert opt.stats()["grads_posted"] == 0


def _adamw_worker_cpu(pid: int) -> dict[str, int]:
    """CPU ticks (utime + stime) of each of the daemon's AdamW workers ("ts-adamw-<i>")."""
    ticks = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        if name.startswith("ts-adamw-"):
            ticks[name] = int(fields[11]) + int(fields[12])  # utime, stime (stat fields 14, 15)
    return ticks


def _workers_used(daemon, threads: int) -> int:
    """How many AdamW workers grew busier while a session limited to `threads` stepped
    a 4 M-element parameter (chunks of it go to every worker unless the limit holds)."""
    model = torch.nn.Linear(2048, 2048, bias=False)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  socket=daemon.socket, threads=threads)
    x = torch.randn(4, 2048)
    model(x).sum().backward()
    opt.step()  # first step: registration and first touch, outside the window
    opt.zero_grad()
    before = _adamw_worker_cpu(daemon.proc.pid)
    for _ in range(30):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    after = _adamw_worker_cpu(daemon.proc.pid)
    trainstream.unwrap(model)
    opt.detach()
    return sum(1 for name, t in after.items() if t > before.get(name, 0))


def test_threads_option_limits_the_session_and_still_matches(daemon_factory):
    daemon = daemon_factory("--threads", "2")
    cfg, ref, ours = _models(seed=8)
    batches = text_batches(corpus(), cfg, batch=2, steps=4, seed=8)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 socket=daemon.socket, threads=1)
    _assert_same(ref, ours, _train(ref, ref_opt, batches), _train(ours, opt, batches))
    opt.detach()
    # The limit holds: with threads=1 the updates run on one of the daemon's two
    # workers; without a limit the same parameter's chunks keep both busy (which
    # shows the count can see more than one).
    assert _workers_used(daemon, threads=1) == 1
    assert _workers_used(daemon, threads=None) == 2
