"""A daemon that dies leaves its optimizer state; the next one on the socket adopts it
(docs/recovery.md, "Adoption"): the protocol, below the optimizer. The test process is
the client: it attaches through trainstream._control, trains a parameter over the
data plane, SIGKILLs the daemon and re-attaches to the next one."""
from __future__ import annotations

import grp
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import NOBODY, as_user, wait_until

from trainstream._native import C, control
from trainstream._native.wire import FIELD_PARAM_FROM_SLOT, OP_PARAM_READY, OP_STEP_DONE
from trainstream._native.wire import OP_SYNC_DONE

N = 70_000  # two chunks of the engine's 64 Ki
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def _wait(plane, want, timeout=20.0):
    """The first completion on ``plane`` that ``want`` takes, within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c = plane.poll(100)
        if c is not None and want(c):
            return c
    raise AssertionError("no such completion")


def _sync(plane) -> None:
    """Waits until the daemon has done every command posted on ``plane``."""
    seq = plane.post_sync()
    _wait(plane, lambda c: c["opcode"] == OP_SYNC_DONE and c["seq"] == seq)


class Trainee:
    """One session training one fp32 parameter by hand over the rings."""

    def __init__(self, socket: str):
        self.client = control().Client.connect(socket, 2000)
        self.session = self.client.attach("recovery-test", -1, -1, None)
        self.plane = C().DataPlane(self.session.control.address, self.session.control.size, 10000)
        self.staging, slots = self.session.register_parameters(
            [HP], [dict(param_id=0, name="w", shape=[N], dtype="float32")], "float32", 0.0, 0, "", 0)
        (slot,) = slots
        self.grad = C().tensor_from_address(self.staging.base_address + slot["grad_offset"], [N],
                                            "float32")
        self.weights = C().tensor_from_address(self.staging.base_address + slot["param_offset"],
                                               [N], "float32")
        self.weights.copy_(torch.linspace(-1, 1, N))
        self.plane.post_state(True, 0, FIELD_PARAM_FROM_SLOT, 0, 0, 0, 0)
        self.sync()

    def sync(self):
        _sync(self.plane)

    def wait(self, want, timeout=20.0):
        return _wait(self.plane, want, timeout)

    def step(self, step: int):
        g = torch.sin(torch.arange(N, dtype=torch.float32) * 0.001 + step)
        self.plane.post_grad(0, g, self.grad, step, HP["lr"], HP["beta1"], HP["beta2"], HP["eps"],
                             HP["weight_decay"])
        self.plane.post_step_end(step, 1)
        self.wait(lambda c: c["opcode"] == OP_PARAM_READY and c["step"] == step)
        return self.wait(lambda c: c["opcode"] == OP_STEP_DONE and c["step"] == step)


def kill(d):
    d.proc.kill()
    d.proc.wait()


def test_a_killed_daemons_state_is_adopted_and_resumed(daemon_factory):
    first = daemon_factory()
    t = Trainee(first.socket)
    token = t.session.recovery_token
    assert len(token) == 32
    done = t.step(1)
    t.step(2)
    weights_after_2 = t.weights.clone()
    kill(first)
    second = daemon_factory(socket=first.socket, shm_dir=first.shm_dir)
    log = second.log()
    assert "adopted the optimizer state of 1 sessions" in log, log
    # The state and its staging wait, counted against the budget; the rest is gone.
    status = second.status()
    adopted = [s for s in status["segments"] if "waiting" in s.get("label", "")]
    assert {s["kind"] for s in adopted} == {"state", "session"}
    assert status["budget"]["used"] == sum(s["bytes"] for s in adopted)
    assert set(second.segment_files()) == {s["name"] for s in adopted}
    assert t.staging.segment_name in second.segment_files()

    client = control().Client.connect(second.socket, 2000)
    resumed_session = client.attach("recovery-test", -1, -1, None, token)
    r = resumed_session.resumed
    assert r["completed_step"] == 2
    assert abs(r["completed_grad_norm"] - done["grad_norm"]) < 10  # a step's norm, not garbage
    (reg,) = r["registrations"]
    assert reg["segment_name"] == t.staging.segment_name  # the same file: the mapping holds
    (p,) = reg["params"]
    assert (p["param_id"], p["applied_step"], p["torch_step"], p["skipped"]) == (0, 2, 2, False)
    assert resumed_session.recovery_token == token  # recovered the same way next time
    assert torch.equal(t.weights, weights_after_2)
    # The claimed state is the new session's now: nothing waits any more.
    status = second.status()
    assert not [s for s in status["segments"] if "waiting" in s.get("label", "")]
    assert len(status["sessions"]) == 1
    resumed_session.detach()
    wait_until(lambda: second.segment_files() == [], 5, what="the resumed session's segments freed")


def test_a_wrong_token_or_another_uid_gets_nothing(daemon_factory):
    group = grp.getgrgid(NOBODY).gr_name
    first = daemon_factory("--allow-group", group)
    os.chmod(first.socket, 0o666)
    t = Trainee(first.socket)
    token = t.session.recovery_token
    t.step(1)
    kill(first)
    second = daemon_factory("--allow-group", group, socket=first.socket,
                            shm_dir=first.shm_dir)
    os.chmod(second.socket, 0o666)
    client = control().Client.connect(second.socket, 2000)
    with pytest.raises(control().NotFound, match="holds no optimizer state"):
        client.attach("x", -1, -1, None, b"0" * 32)
    with pytest.raises(control().InvalidArgument, match="recovery_token"):
        client.attach("x", -1, -1, None, b"short")
    # The right token from another uid: refused alike, and the state still waits.
    other = second.client(preexec_fn=as_user(NOBODY))
    r = other.send(f"attach x -1 {token.decode()}")
    assert not r["ok"] and r["code"] == "NOT_FOUND", r
    s = client.attach("x", -1, -1, None, token)
    assert s.resumed["registrations"][0]["params"][0]["applied_step"] == 1
    s.detach()


def test_unclaimed_state_goes_after_the_grace_period(daemon_factory):
    first = daemon_factory()
    t = Trainee(first.socket)
    t.step(1)
    kill(first)
    second = daemon_factory("--recovery-grace", "1", socket=first.socket, shm_dir=first.shm_dir)
    # (Adopted before it listens; the files may already be gone on a slow machine.)
    assert "adopted the optimizer state of 1 sessions" in second.log()
    wait_until(lambda: second.segment_files() == [], 10, what="the adopted state unlinked")
    assert "not claimed within recovery_grace = 1 s" in second.log()
    assert second.status()["budget"]["used"] == 0
    client = control().Client.connect(second.socket, 2000)
    with pytest.raises(control().NotFound):
        client.attach("x", -1, -1, None, t.session.recovery_token)


def test_state_of_a_dead_client_is_not_kept(daemon_factory, tmp_path):
    first = daemon_factory()
    script = (f"import sys, time; sys.path[:0] = {sys.path!r}\n"
              f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
              "from test_recovery_adoption import Trainee\n"
              f"t = Trainee({first.socket!r}); t.step(1)\n"
              "print('trained', flush=True); time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ))
    assert proc.stdout.readline().strip() == "trained"
    kill(first)
    proc.kill()
    proc.wait()
    second = daemon_factory(socket=first.socket, shm_dir=first.shm_dir)
    assert second.segment_files() == []
    assert "is gone too" in second.log()


def test_recovery_off_removes_everything_as_before(daemon_factory):
    first = daemon_factory("--recovery-grace", "0")
    t = Trainee(first.socket)
    assert t.session.recovery_token == b""
    t.step(1)
    kill(first)
    second = daemon_factory("--recovery-grace", "0", socket=first.socket, shm_dir=first.shm_dir)
    assert second.segment_files() == []
    assert "optimizer state of 1 sessions in them is lost" in second.log()


def _group_sessions(socket: str, timeout_s: float = 30.0):
    """Two local ranks of one data-parallel group, attached and registered from this
    process (registration is a barrier: one thread per rank)."""
    import threading
    client = control().Client.connect(socket, 2000)
    members = [dict(key="recovery-group", local_rank=r, local_world_size=2, world_size=2,
                    timeout_s=timeout_s) for r in range(2)]
    sessions = [client.attach("g", r, r, members[r]) for r in range(2)]
    out = [None, None]

    def register(r):
        out[r] = sessions[r].register_parameters(
            [HP], [dict(param_id=0, name="w", shape=[N], dtype="float32")], "float32", 0.0, 0,
            "same-weights", 0)
    threads = [threading.Thread(target=register, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return client, members, sessions


def test_a_group_resumes_with_every_rank_or_none(daemon_factory):
    import threading
    first = daemon_factory()
    _, members, sessions = _group_sessions(first.socket)
    tokens = {s.recovery_token for s in sessions}
    assert len(tokens) == 1 and len(tokens.pop()) == 32  # the group's one token
    token = sessions[0].recovery_token
    plane = C().DataPlane(sessions[0].control.address, sessions[0].control.size, 10000)
    plane.post_state(True, 0, FIELD_PARAM_FROM_SLOT, 0, 0, 0, 0)
    _sync(plane)
    kill(first)
    second = daemon_factory(socket=first.socket, shm_dir=first.shm_dir)
    client = control().Client.connect(second.socket, 2000)
    results, resumed_sessions = [None, None], [None, None]

    def rejoin(r):
        try:  # (the sessions are kept: one that goes breaks the group)
            resumed_sessions[r] = client.attach("g", r, r, members[r], token)
            results[r] = resumed_sessions[r].resumed
        except control().ControlError as e:
            results[r] = e
    threads = [threading.Thread(target=rejoin, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(2):
        assert isinstance(results[r], dict), results[r]
        (reg,) = results[r]["registrations"]
        assert reg["params"][0]["applied_step"] == 0
    # Each rank its own gradient slot, one weight slot for all.
    a, b = (results[r]["registrations"][0]["params"][0] for r in range(2))
    assert a["grad_offset"] != b["grad_offset"] and a["param_offset"] == b["param_offset"]
    assert [g["state"] for g in second.status()["groups"]] == ["running"]


def test_a_group_rank_that_does_not_come_back_fails_the_resume(daemon_factory):
    first = daemon_factory()
    # The registration waits as long as a loaded machine may need to start both
    # ranks; the resume, whose membership sets its own wait, gives up after 1 s.
    _, members, sessions = _group_sessions(first.socket)
    token = sessions[0].recovery_token
    plane = C().DataPlane(sessions[0].control.address, sessions[0].control.size, 10000)
    plane.post_state(True, 0, FIELD_PARAM_FROM_SLOT, 0, 0, 0, 0)
    _sync(plane)  # the state is initialised (adoptable), not just posted
    kill(first)
    second = daemon_factory(socket=first.socket, shm_dir=first.shm_dir)
    client = control().Client.connect(second.socket, 2000)
    with pytest.raises(control().FailedPrecondition, match="only 1 of 2 local ranks came back"):
        client.attach("g", 0, 0, dict(members[0], timeout_s=1.0), token)
    # The state went with the group: the other rank hears there is none.
    with pytest.raises(control().NotFound):
        client.attach("g", 1, 1, members[1], token)
    wait_until(lambda: second.segment_files() == [], 5, what="the group's segments freed")
