"""A stop keeps what a crash keeps (Note [A restart keeps the optimizer state] in
daemon/process/daemon.cc; docs/recovery.md, "Stops and restarts"): SIGTERM or `trainstreamctl
shutdown` with sessions attached leaves their optimizer state for the next daemon on the
socket, and the client resumes there bit for bit, as after a SIGKILL. `--discard-state`,
`--drain` and recovery_grace 0 are the clean stops."""
from __future__ import annotations

import copy
import signal

import pytest
import torch

import trainstream
from conftest import wait_until
from test_recovery_adoption import Trainee, kill
from test_recovery_resume import _reference, _same_run, _setup, _wrap

KEPT = "optimizer state is kept for the next daemon on this socket"
MIB = 1 << 20


def _stop(d, how: str) -> None:
    """Stops `d` the way `how` names and waits for its exit (0)."""
    if how == "sigterm":
        d.proc.send_signal(signal.SIGTERM)
    else:
        r = d.ctl("shutdown", *({"shutdown": (), "discard": ("--discard-state",)}[how]))
        assert r.returncode == 0, r
        if how == "shutdown":
            assert "kept for the next daemon" in r.stdout, r.stdout
    assert d.proc.wait(timeout=15) == 0, d.log()


@pytest.mark.parametrize("how", ["sigterm", "shutdown"])
def test_a_stopped_daemons_state_is_resumed_bit_identical(daemon_factory, how):
    _, model, batches = _setup()
    ref_weights, ref_state = _reference(daemon_factory, model, batches)
    d = daemon_factory()
    ours, opt = _wrap(copy.deepcopy(model), d.socket)
    for i, (x, y) in enumerate(batches):
        ours(x, y).backward()
        if i == 2:
            _stop(d, how)
            log = d.log()
            assert KEPT in log and "1 sessions attached" in log, log
            assert "shutting down" not in log, log  # not the clean stop
            assert d.segment_files()  # nothing unlinked
            d = daemon_factory(socket=d.socket, shm_dir=d.shm_dir)
        opt.step()
        opt.zero_grad()
    assert opt.stats()["recoveries"] == 1
    _same_run(ours, opt, ref_weights, ref_state)
    assert "adopted the optimizer state of 1 sessions" in d.log()
    assert "that stopped keeping its sessions' state" in d.log()  # not "did not exit cleanly"


def test_discard_state_frees_it_and_the_client_is_told(daemon_factory):
    _, model, batches = _setup()
    d = daemon_factory()
    ours, opt = _wrap(model, d.socket, timeout_s=5.0)
    ours(*batches[0]).backward()
    opt.step()
    opt.zero_grad()
    _stop(d, "discard")
    assert KEPT not in d.log() and "shutting down (shutdown requested)" in d.log(), d.log()
    assert d.segment_files() == []
    nxt = daemon_factory(socket=d.socket, shm_dir=d.shm_dir)
    assert "adopted the optimizer state" not in nxt.log(), nxt.log()
    assert nxt.status()["sessions"] == []
    # What the clean stop always said: the session is over, its state lost (no resume).
    with pytest.raises(trainstream.DaemonError, match=r"is over: .*daemon shut down"):
        ours(*batches[1]).backward()
        opt.step()
    assert opt.stats()["recoveries"] == 0


def test_drain_still_waits_and_then_frees_everything(daemon_factory):
    d = daemon_factory()
    t = Trainee(d.socket)
    t.step(1)
    r = d.ctl("shutdown", "--drain")
    assert r.returncode == 0 and "1 session" in r.stdout, r
    t.step(2)  # the session goes on while the daemon drains
    assert d.proc.poll() is None
    t.session.detach()
    assert d.proc.wait(timeout=15) == 0, d.log()
    assert "shutting down (drained)" in d.log() and KEPT not in d.log()
    assert d.segment_files() == []


def test_recovery_grace_0_makes_sigterm_a_clean_stop(daemon_factory):
    d = daemon_factory("--recovery-grace", "0")
    c = d.client()
    assert c.send("attach term 0")["ok"]
    assert c.send("register " + '{"groups":[{}],"params":[{"id":1,"shape":[64]}]}')["ok"]
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=15) == 0, d.log()
    log = d.log()
    assert "with recovery_grace 0: nothing can be kept for the next daemon, so this is a clean " \
           "stop" in log, log
    assert KEPT not in log
    assert d.segment_files() == []
    dead = c.send("wait_dead 5000")
    assert dead["ok"] and not dead["alive"] and "shut down" in dead["why"], dead


def test_adopted_states_still_waiting_are_kept_by_a_stop(daemon_factory):
    first = daemon_factory()
    t = Trainee(first.socket)
    token = t.session.recovery_token
    t.step(1)
    t.step(2)
    weights_after_2 = t.weights.clone()
    kill(first)
    second = daemon_factory(socket=first.socket, shm_dir=first.shm_dir)
    assert "adopted the optimizer state of 1 sessions" in second.log()
    # Its client has not come back yet: the stop keeps the adopted state too.
    _stop(second, "sigterm")
    assert "0 sessions attached and 1 adopted states waiting" in second.log(), second.log()
    third = daemon_factory(socket=first.socket, shm_dir=first.shm_dir)
    assert "adopted the optimizer state of 1 sessions" in third.log(), third.log()
    from trainstream._native import control
    client = control().Client.connect(third.socket, 2000)
    s = client.attach("recovery-test", -1, -1, None, token)
    (p,) = s.resumed["registrations"][0]["params"]
    assert (p["applied_step"], p["torch_step"]) == (2, 2)
    assert torch.equal(t.weights, weights_after_2)
    s.detach()
    wait_until(lambda: third.segment_files() == [], 5, what="the resumed session's segments freed")


def test_a_stop_with_nothing_to_keep_is_clean(daemon_factory):
    d = daemon_factory()
    c = d.client()
    assert c.send("attach brief 0")["ok"]
    assert c.send(f"alloc {MIB}")["ok"]
    assert c.send("detach")["ok"]
    wait_until(lambda: d.status()["sessions"] == [], 5, what="the session to end")
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=15) == 0, d.log()
    assert "shutting down (signal Terminated): 0 sessions attached" in d.log(), d.log()
    assert d.segment_files() == []
