"""An optimizer whose daemon dies resumes with the one that comes back (docs/recovery.md,
"Re-attaching"): same weights and state as a run that was never interrupted, or a
DaemonError naming the step when it cannot."""
from __future__ import annotations

import copy
import time

import pytest
import torch

import trainstream
from tiny_gpt import GPTConfig, TinyGPT, corpus, text_batches

STEPS = 6


def _setup(seed=3):
    torch.manual_seed(seed)
    cfg = GPTConfig()
    model = TinyGPT(cfg)
    return cfg, model, text_batches(corpus(), cfg, batch=2, steps=STEPS, seed=seed)


def _wrap(model, socket, **extra):
    return trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            socket=socket, profile=False, check_memory=False, offload=True,
                            **extra)


def _reference(daemon_factory, model, batches, **extra):
    d = daemon_factory()
    ref, opt = _wrap(copy.deepcopy(model), d.socket, **extra)
    for x, y in batches:
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()
    state = opt.state_dict()
    weights = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt.detach()
    return weights, state


def _restart(d, daemon_factory, delay=0.0):
    d.proc.kill()
    d.proc.wait()
    time.sleep(delay)
    return daemon_factory(socket=d.socket, shm_dir=d.shm_dir, wait=False)


def _same_run(model, opt, ref_weights, ref_state):
    """The weights and optimizer state are bit-identical to the uninterrupted run's."""
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), ref_weights[n]), n
    _same_state(opt.state_dict(), ref_state)


def _same_state(a, b):
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for field in ("step", "exp_avg", "exp_avg_sq", "master_weight"):
            assert torch.equal(a["state"][k][field], b["state"][k][field]), (k, field)


@pytest.mark.parametrize("kill_at", ["after_backward", "before_step", "before_state_dict"])
def test_resumed_run_is_bit_identical(daemon_factory, kill_at):
    _, model, batches = _setup()
    ref_weights, ref_state = _reference(daemon_factory, model, batches)
    d = daemon_factory()
    ours, opt = _wrap(copy.deepcopy(model), d.socket)
    for i, (x, y) in enumerate(batches):
        ours(x, y).backward()
        if i == 2 and kill_at == "after_backward":
            d = _restart(d, daemon_factory, delay=0.2)  # the hooks posted; step() resumes
        if i == 3 and kill_at == "before_step":
            time.sleep(0.05)  # the daemon applied the eager updates: they landed
            d = _restart(d, daemon_factory)
        opt.step()
        opt.zero_grad()
        if i == 4 and kill_at == "before_state_dict":
            d = _restart(d, daemon_factory)
            opt.state_dict()
    stats = opt.stats()
    assert stats["recoveries"] == 1
    assert stats["replayed_grads"] + stats["landed_grads"] > 0 or kill_at == "before_state_dict"
    _same_run(ours, opt, ref_weights, ref_state)
    assert "adopted the optimizer state of 1 sessions" in d.log()


def test_clipped_run_resumes_bit_identical(daemon_factory):
    _, model, batches = _setup(seed=4)
    ref_weights, ref_state = _reference(daemon_factory, model, batches, max_grad_norm=0.1)
    d = daemon_factory()
    ours, opt = _wrap(copy.deepcopy(model), d.socket, max_grad_norm=0.1)
    for i, (x, y) in enumerate(batches):
        ours(x, y).backward()
        if i in (1, 3):
            d = _restart(d, daemon_factory, delay=0.1)
        opt.step()
        opt.zero_grad()
    assert opt.stats()["recoveries"] == 2
    _same_run(ours, opt, ref_weights, ref_state)


def test_no_daemon_coming_back_names_the_step(daemon_factory):
    _, model, batches = _setup()
    d = daemon_factory()
    ours, opt = _wrap(model, d.socket, timeout_s=2.0)
    (x, y) = batches[0]
    ours(x, y).backward()
    opt.step()
    opt.zero_grad()
    ours(*batches[1]).backward()
    d.proc.kill()
    d.proc.wait()
    t0 = time.monotonic()
    with pytest.raises(trainstream.DaemonError, match=r"step 2 \(in flight when the daemon "
                       r"died\) and the optimizer state after step 1 are lost"):
        opt.step()
    assert time.monotonic() - t0 < 30  # timeout_s (2 s) and the reconnect's own: no hang


def test_state_the_new_daemon_cannot_resume_names_the_step(daemon_factory):
    _, model, batches = _setup()
    d = daemon_factory()
    ours, opt = _wrap(model, d.socket)
    for x, y in batches[:2]:
        ours(x, y).backward()
        opt.step()
        opt.zero_grad()
    ours(*batches[2]).backward()
    d.proc.kill()
    d.proc.wait()
    # Recovery off in the next daemon: it adopts nothing.
    daemon_factory("--recovery-grace", "0", socket=d.socket, shm_dir=d.shm_dir)
    with pytest.raises(trainstream.DaemonError, match=r"could not resume .*step 3 \(in flight"):
        opt.step()
    with pytest.raises(trainstream.DaemonError):  # and so on, not a hang
        opt.step()


def test_reconnect_false_raises_at_once(daemon_factory):
    _, model, batches = _setup()
    d = daemon_factory()
    ours, opt = _wrap(model, d.socket, reconnect=False, timeout_s=30.0)
    ours(*batches[0]).backward()
    d.proc.kill()
    d.proc.wait()
    t0 = time.monotonic()
    with pytest.raises(trainstream.DaemonError, match="optimizer state it held .* is lost"):
        opt.step()
    # "At once": well inside timeout_s (30 s), which a waiting client would spend first.
    assert time.monotonic() - t0 < 15


def test_daemon_found_dead_at_any_ask_in_step_is_resumed(daemon_factory):
    # step() asks whether the daemon lives before it posts anything. Step k kills the
    # daemon at its k-th ask (as a kill between two asks would land), and each ask
    # must resume: the CI kill loop once lost step 36 of a clipped run to an ask made
    # outside the recovery.
    _, model, batches = _setup(seed=5)
    ref_weights, ref_state = _reference(daemon_factory, model, batches, max_grad_norm=0.1)
    d = daemon_factory()
    ours, opt = _wrap(copy.deepcopy(model), d.socket, max_grad_norm=0.1)
    session = opt._backend._session
    in_step = {"asks": None, "kill_at": 0}

    def require_attached(original=session.require_attached):
        nonlocal d
        if in_step["asks"] is not None:
            in_step["asks"] += 1
            if in_step["asks"] == in_step["kill_at"]:
                d = _restart(d, daemon_factory)
                deadline = time.monotonic() + 10
                while session._session.alive()[0] and time.monotonic() < deadline:
                    time.sleep(0.005)  # until the client has seen the session's end
                assert not session._session.alive()[0]
        return original()
    session.require_attached = require_attached

    kills = 0
    for i, (x, y) in enumerate(batches):
        ours(x, y).backward()
        in_step.update(asks=0, kill_at=i)  # step 0 kills nowhere
        before = opt.stats()["recoveries"]
        opt.step()
        killed = 0 < in_step["kill_at"] <= in_step["asks"]
        in_step["asks"] = None
        kills += killed
        assert opt.stats()["recoveries"] - before == killed, i
        opt.zero_grad()
    assert kills >= 1
    _same_run(ours, opt, ref_weights, ref_state)


class _AttachFailsOnce:
    """A daemon client whose next attach raises ``error`` once (as a daemon killed again
    while it answers the resume's Attach would), then attaches as usual."""

    def __init__(self, client, error):
        self._client, self._error = client, error

    def __getattr__(self, name):
        return getattr(self._client, name)

    def attach(self, *args):
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._client.attach(*args)


def _attach_fails_once(monkeypatch, error):
    from trainstream._native import daemon as native_daemon
    calls = {"connects": 0}
    real = native_daemon.connect

    def connect(*args, **kwargs):
        # Counted once connected: a connect that found the new daemon not yet serving
        # (the resume retries it) must not use up the injected failure.
        client = real(*args, **kwargs)
        calls["connects"] += 1
        return _AttachFailsOnce(client, error if calls["connects"] == 1 else None)
    monkeypatch.setattr(native_daemon, "connect", connect)
    return calls


def test_a_resume_whose_attach_fails_tries_again(daemon_factory, monkeypatch):
    # gRPC's UNKNOWN/INTERNAL (a daemon killed again mid-Attach) is retried within
    # timeout_s, as UNAVAILABLE is: step() resumes once and the run stays bit-identical.
    from trainstream._native import control
    _, model, batches = _setup(seed=6)
    ref_weights, ref_state = _reference(daemon_factory, model, batches)
    d = daemon_factory()
    ours, opt = _wrap(copy.deepcopy(model), d.socket)
    calls = None
    for i, (x, y) in enumerate(batches):
        ours(x, y).backward()
        if i == 2:
            calls = _attach_fails_once(monkeypatch, control().Internal("Stream removed"))
            d = _restart(d, daemon_factory, delay=0.1)
        opt.step()
        opt.zero_grad()
    assert calls["connects"] == 2
    assert opt.stats()["recoveries"] == 1
    _same_run(ours, opt, ref_weights, ref_state)


def test_a_resume_that_raised_part_way_is_tried_again_not_called_detached(daemon_factory,
                                                                           monkeypatch):
    # An error the resume does not retry reaches the caller once; the next call resumes
    # (it used to say "OffloadAdamW is detached; call attach() first").
    _, model, batches = _setup(seed=7)
    d = daemon_factory()
    ours, opt = _wrap(model, d.socket)
    ours(*batches[0]).backward()
    opt.step()
    opt.zero_grad()
    ours(*batches[1]).backward()
    _attach_fails_once(monkeypatch, RuntimeError("simulated failure while resuming"))
    d = _restart(d, daemon_factory, delay=0.1)
    with pytest.raises(RuntimeError, match="simulated failure while resuming"):
        opt.step()
    opt.step()  # resumes with the daemon that came back
    opt.zero_grad()
    assert opt.stats()["recoveries"] == 1
    ours(*batches[2]).backward()
    opt.step()
    assert opt.stats()["steps"] == 3
