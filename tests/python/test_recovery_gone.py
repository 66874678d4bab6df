"""A client whose daemon is gone for good (docs/recovery.md, "When no daemon comes back"):
no daemon answers within timeout_s, so the call that found it gone raises a DaemonError
naming the socket, and so does every later call (a forward waiting for an update in
flight, backward's hooks, step(), zero_grad()), never an error of the client's own
making; memory_report() and unwrap() still answer. A daemon that comes back later is
resumed by the next call, and the run ends bit-identical to an uninterrupted one.

Six clients: the daemon's AdamW (optimizer_mode="cpu"; "gpu" needs CUDA) with gradients
posted in backward (eager updates, clipped updates, a gradient slot per parameter
instead of the pool, an embedded daemon) or in step() (a daemon of its own socket, an
embedded one)."""
from __future__ import annotations

import copy
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
import torch

import trainstream
from conftest import pause_process, wait_until
from test_recovery_resume import _reference, _same_run, _setup, _wrap

TIMEOUT_S = 1.0  # how long the first call waits for a daemon before it raises

CONFIGS = {
    "backward": {},
    "backward-clipped": {"max_grad_norm": 0.1},
    "backward-slots": {"grad_pool": 0},
    "backward-embedded": {"embedded": True},
    "step": {"grad_post": "step"},
    "step-embedded": {"grad_post": "step", "embedded": True},
}


class _Supervised:
    """A daemon of its own socket (as systemd's is), killed for good: nothing starts it."""

    def __init__(self, daemon_factory):
        self._factory = daemon_factory
        self.daemon = daemon_factory()
        self.socket = self.daemon.socket

    def wrap(self, model, **options):
        return _wrap(model, self.socket, **options)

    def pause(self):
        self.daemon.pause()

    def kill(self):
        self.daemon.proc.kill()
        self.daemon.proc.wait()

    def come_back(self):
        self.daemon = self._factory(socket=self.socket, shm_dir=self.daemon.shm_dir)

    def cleanup(self):
        pass  # daemon_factory stops what runs and removes its shm directory


class _Embedded:
    """The client's own daemon (embedded mode: it starts one at the per-user socket),
    killed, and none can start again: the binary it would start is gone."""

    def __init__(self, monkeypatch, build_dir):
        self._monkeypatch = monkeypatch
        self._ctl = str(build_dir / "bin" / "trainstreamctl")
        self._binary = str(build_dir / "bin" / "trainstreamd")
        self._runtime = tempfile.mkdtemp(prefix="tsg-")  # short: a socket path has 108 bytes
        monkeypatch.delenv("TRAINSTREAM_SOCKET", raising=False)
        monkeypatch.setenv("XDG_RUNTIME_DIR", self._runtime)
        monkeypatch.setenv("TRAINSTREAM_DAEMON", self._binary)
        monkeypatch.setenv("TRAINSTREAM_IDLE_EXIT_S", "60")
        self.socket = os.path.join(self._runtime, "trainstream", "trainstreamd.sock")
        self._stopped = None  # the pid pause() stopped

    def wrap(self, model, **options):
        out = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                               profile=False, check_memory=False, offload=True, **options)
        assert out[1]._session._socket_path == self.socket  # the embedded one
        return out

    def _pid(self):
        from trainstream._native import daemon as native_daemon
        return native_daemon.connect(self.socket).ping()["pid"]

    def pause(self):
        self._stopped = self._pid()
        pause_process(self._stopped)

    def kill(self):
        pid = self._stopped or self._pid()  # (a stopped daemon answers no ping)
        self._stopped = None
        self._monkeypatch.setenv("TRAINSTREAM_DAEMON", os.path.join(self._runtime, "removed"))
        os.kill(pid, signal.SIGKILL)

        def dead():  # (a zombie until this process, which started it, reaps it)
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
            except FileNotFoundError:
                return True
        wait_until(dead, 10, what="the embedded daemon to die")

    def come_back(self):
        self._monkeypatch.setenv("TRAINSTREAM_DAEMON", self._binary)  # the client starts it

    def cleanup(self):
        # A daemon on the socket adopts what the killed one left in /dev/shm; its clean
        # stop frees it.
        from trainstream._native import daemon as native_daemon
        self.come_back()
        native_daemon.connect_embedded(self.socket)
        subprocess.run([self._ctl, "--socket", self.socket, "shutdown"], capture_output=True,
                       timeout=30, check=True)
        shutil.rmtree(self._runtime, ignore_errors=True)


@pytest.fixture
def daemon_kind(daemon_factory, monkeypatch, build_dir):
    made = []

    def make(embedded: bool):
        d = _Embedded(monkeypatch, build_dir) if embedded else _Supervised(daemon_factory)
        made.append(d)
        return d
    yield make
    for d in made:
        d.cleanup()


def _raises_the_same(first, fn):
    """``fn()`` raises an error of ``first``'s class (DaemonError, not an AttributeError
    or TypeError of the client's own); returns it."""
    with pytest.raises(Exception) as info:
        fn()
    assert type(info.value) is type(first), repr(info.value)
    return info.value


def _forward_backward(model, batch):
    model(*batch).backward()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_call_after_the_daemon_is_gone_raises_its_daemon_error(daemon_kind, name):
    options = dict(CONFIGS[name])
    d = daemon_kind(options.pop("embedded", False))
    _, model, batches = _setup()
    ours, opt = d.wrap(model, timeout_s=TIMEOUT_S, **options)
    _forward_backward(ours, batches[0])
    opt.step()
    opt.zero_grad()
    _forward_backward(ours, batches[1])  # (with grad_post="backward" its hooks posted it)
    d.kill()
    with pytest.raises(trainstream.DaemonError) as info:
        opt.step()
    first = info.value
    assert d.socket in str(first) and "none answered there" in str(first)
    assert "step 2 (in flight when the daemon died)" in str(first)
    for batch in batches[2:4]:  # a hostile loop goes on as if nothing had happened
        for fn in (lambda b=batch: _forward_backward(ours, b), opt.step, opt.zero_grad,
                   opt.synchronize, opt.state_dict):
            t0 = time.monotonic()
            e = _raises_the_same(first, fn)
            assert d.socket in str(e) and "step 2 (in flight" in str(e), str(e)
            assert time.monotonic() - t0 < 10  # it looks for a daemon once; no hang
    report = trainstream.memory_report(ours)  # asks the daemon nothing
    assert d.socket in report["optimizer"]["daemon_gone"]
    assert opt.stats()["daemon_gone"] == report["optimizer"]["daemon_gone"]
    assert opt.stats()["recoveries"] == 0

    # A daemon back at the socket: the next call resumes (zero_grad() ends the step
    # that never came), and training goes on.
    d.come_back()
    opt.zero_grad()
    assert opt.stats()["recoveries"] == 1 and opt.stats()["daemon_gone"] is None
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    steps = opt.stats()["steps"]
    _forward_backward(ours, batches[4])
    opt.step()
    assert opt.stats()["steps"] == steps + 1
    assert any(not torch.equal(p.detach(), before[n]) for n, p in ours.named_parameters())
    trainstream.unwrap(ours)


def test_unwrap_and_memory_report_while_the_daemon_is_gone(daemon_kind):
    d = daemon_kind(False)
    _, model, batches = _setup()
    ours, opt = d.wrap(model, timeout_s=TIMEOUT_S)
    _forward_backward(ours, batches[0])
    d.kill()
    with pytest.raises(trainstream.DaemonError, match="none answered there"):
        opt.step()
    assert trainstream.memory_report(ours)["optimizer"]["steps"] == 0
    trainstream.unwrap(ours)  # gives the state up, raising nothing
    assert not opt.stats()["attached"] and opt.stats()["daemon_gone"] is None
    ours.zero_grad()
    ours(*batches[1]).backward()  # a plain torch model again: no hook of the optimizer's
    assert all(p.grad is not None for p in ours.parameters())


@pytest.mark.parametrize("embedded", [False, True], ids=["supervised", "embedded"])
def test_a_daemon_that_comes_back_after_is_resumed_bit_identical(daemon_factory, daemon_kind,
                                                                 embedded):
    # Eager updates (the default): step 3's gradients were posted in backward to a
    # daemon stopped first, so every update is in flight at the kill (whether some
    # landed first is timing: the six clients above meet both). Every call while no
    # daemon answers raises (the forward waits for an update in flight); the first call
    # after one is back resumes step 3.
    _, model, batches = _setup(seed=8)
    ref_weights, ref_state = _reference(daemon_factory, model, batches)
    d = daemon_kind(embedded)
    ours, opt = d.wrap(copy.deepcopy(model), timeout_s=TIMEOUT_S)
    for i, (x, y) in enumerate(batches):
        if i == 2:
            d.pause()
        ours(x, y).backward()
        if i == 2:
            d.kill()
            with pytest.raises(trainstream.DaemonError) as info:
                opt.step()
            for fn in (lambda: ours(*batches[3]), opt.zero_grad, opt.step):
                _raises_the_same(info.value, fn)
            assert opt.stats()["recoveries"] == 0
            d.come_back()
        opt.step()
        opt.zero_grad()
    assert opt.stats()["recoveries"] == 1 and opt.stats()["daemon_gone"] is None
    _same_run(ours, opt, ref_weights, ref_state)
    trainstream.unwrap(ours)


def test_a_backward_that_raised_while_gone_changes_no_update(daemon_factory, daemon_kind):
    # Clipped: step 3's updates wait for step(), so the resume posts every gradient of
    # it again (clipping keeps gradient slots). The backward that raised meanwhile had
    # added its first gradient to p.grad; step 3 still takes what backward handed over
    # (the slot's copy): step() says the gradient changed (as with the daemon alive),
    # zero_grad() ends the step, and the run is bit-identical to one that never saw
    # the extra backward (the resume used to post the changed p.grad, and step() then
    # said nothing).
    _, model, batches = _setup(seed=10)
    ref_weights, ref_state = _reference(daemon_factory, model, batches, max_grad_norm=0.1)
    d = daemon_kind(False)
    ours, opt = d.wrap(copy.deepcopy(model), timeout_s=TIMEOUT_S, max_grad_norm=0.1)
    for i, (x, y) in enumerate(batches):
        ours(x, y).backward()
        if i != 2:
            opt.step()
            opt.zero_grad()
            continue
        d.kill()
        with pytest.raises(trainstream.DaemonError) as info:
            opt.step()
        _raises_the_same(info.value, lambda: _forward_backward(ours, batches[3]))
        d.come_back()
        with pytest.raises(RuntimeError, match="changed after backward had handed it over"):
            opt.step()
        opt.zero_grad()  # ends step 3 with the gradients backward handed over
    assert opt.stats()["recoveries"] == 1 and opt.step_id == len(batches)
    _same_run(ours, opt, ref_weights, ref_state)
    trainstream.unwrap(ours)
