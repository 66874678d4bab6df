"""Hostile clients (docs/security.md): an attached client that writes into the memory it
shares with the daemon, or misuses its own segment files, must cost only its own session.

Each attack runs against a real daemon while a bystander session trains (see
hostile_bystander.py). The checks are the same for every attack:
  - the daemon survives: still running, answers ping, its RSS and log grow by a bounded
    amount;
  - the attacking session is ended and its client can read why (Session.alive());
  - the bystander's weights and optimizer state are bit-identical to a quiet replay of
    the same steps on the same daemon;
  - the shm dir returns to what it held before.
The attacker is trainstream-test-client (its hostile commands: poke, post, flood,
truncate, try_open, try_chmod), a separate process as a real client would be.
"""
import grp
import json
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import NOBODY, as_user, wait_until
from safetensors_writer import write_safetensors

HERE = Path(__file__).resolve().parent
STEPS = 12
MIB = 1 << 20
# The bounds each attack must stay under.
MAX_RSS_GROWTH = 64 * MIB
MAX_LOG_GROWTH = 256 * 1024

# Control region layout (session_control.h): the header, then the command ring at 64.
HDR_COMMAND_RING_OFFSET = 16
HDR_COMPLETION_RING_OFFSET = 24
RING_HEAD, RING_TAIL = 64, 128
# A segment's header (wire/segment_header.h, segment_kind.h).
SEGMENT_MAGIC, SEGMENT_STAGING = 0x54535347, 2

needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root to run a client under another uid")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Bystander:
    """hostile_bystander.py in its own process, driven one step at a time."""

    def __init__(self, daemon, steps=STEPS):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "hostile_bystander.py"), daemon.socket, str(steps)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=HERE)
        assert self._line() == "ready"
        self.done = 0

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        assert line, f"bystander exited with {self.proc.wait()}"
        return line.strip()

    def step(self):
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        self.done += 1
        assert self._line() == f"ok {self.done}"

    def digest(self) -> str:
        self.proc.stdin.write("done\n")
        self.proc.stdin.flush()
        words = self._line().split()
        assert words[:2] == ["digest", str(self.done)], words
        assert self.proc.wait(timeout=60) == 0
        return words[2]


def quiet_digest(daemon) -> str:
    b = Bystander(daemon)
    for _ in range(STEPS):
        b.step()
    return b.digest()


def under_attack(daemon, attack):
    """Runs `attack()` (on a thread) while a bystander trains; then checks everything the
    module docstring lists but the attacker's own verdict, which `attack` asserts."""
    baseline_files = daemon.segment_files()
    want = quiet_digest(daemon)
    wait_until(lambda: daemon.segment_files() == baseline_files, 10, what="quiet run's segments")
    pid = daemon.proc.pid
    rss0, log0 = rss_bytes(pid), os.path.getsize(daemon.log_path)

    bystander = Bystander(daemon)
    for _ in range(3):
        bystander.step()
    errors = []

    def run():
        try:
            attack()
        except BaseException as e:  # noqa: BLE001 (re-raised on the test's thread)
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    while t.is_alive() and bystander.done < STEPS - 2:
        bystander.step()
    t.join(timeout=120)
    assert not t.is_alive(), "the attack did not finish in 120 s"
    try:
        while bystander.done < STEPS:
            bystander.step()
    except AssertionError:
        print("daemon exit:", daemon.proc.poll(), daemon.log()[-6000:])
        raise
    try:
        got = bystander.digest()
    except AssertionError:
        print("daemon exit:", daemon.proc.poll(), daemon.log()[-6000:])
        raise
    if errors:
        raise errors[0]

    assert daemon.proc.poll() is None, f"the daemon died:\n{daemon.log()[-4000:]}"
    assert daemon.ctl("--timeout-ms", "2000", "ping").returncode == 0
    assert got == want, "the bystander's weights differ from the quiet replay"
    rss_growth = rss_bytes(pid) - rss0
    log_growth = os.path.getsize(daemon.log_path) - log0
    assert rss_growth < MAX_RSS_GROWTH, f"daemon RSS grew by {rss_growth} bytes"
    assert log_growth < MAX_LOG_GROWTH, f"daemon log grew by {log_growth} bytes"
    wait_until(lambda: daemon.segment_files() == baseline_files, 10,
               what="the shm dir to return to its baseline")


def attach(daemon, job="attacker", preexec_fn=None):
    c = daemon.client(preexec_fn=preexec_fn)
    c.daemon_log = daemon.log
    a = c.send(f"attach {job} 0")
    assert a["ok"], a
    return c, a


def expect_ended(c, *words):
    """The attacker's session ends and its client is told why."""
    r = c.send("wait_dead 10000", timeout=20)
    assert r["ok"] and not r["alive"], (r, c.daemon_log())
    for w in words:
        assert w in r["why"], r["why"]
    return r["why"]


def register_one(c, numel=1 << 18):
    spec = {"groups": [{"lr": 1e-3}], "params": [{"id": 0, "name": "w", "shape": [numel],
                                                   "dtype": 1}]}
    r = c.send("register " + json.dumps(spec))
    assert r["ok"], r
    return r


# ----------------------------------------------------------------------------- rings


@pytest.mark.parametrize("offset", [1 << 40, (1 << 64) - 4096, 4096 * 1000])
def test_forged_ring_offsets_are_never_followed(daemon, offset):
    """Finding 1: detach used to re-read command_ring_offset from the client's header and
    write at control + offset + 192 (SIGSEGV, or another session's master changed)."""
    def attack():
        c, _ = attach(daemon)
        assert c.send(f"poke {HDR_COMMAND_RING_OFFSET} {offset}")["value"] == offset
        assert c.send(f"poke {HDR_COMPLETION_RING_OFFSET} {offset}")["ok"]
        assert c.send("detach")["ok"]
        # Ending the session was the old trigger; the daemon must still serve.
        assert daemon.ctl("ping").returncode == 0
    under_attack(daemon, attack)


def test_command_tail_beyond_capacity_ends_the_session(daemon):
    """Finding 3: tail = head + 2^40 replayed stale records forever."""
    def attack():
        c, _ = attach(daemon)
        ring = c.send(f"peek {HDR_COMMAND_RING_OFFSET}")["value"]
        assert c.send(f"poke {ring + RING_TAIL} {1 << 40}")["ok"]
        expect_ended(c, "command ring corrupt")
    under_attack(daemon, attack)


def test_completion_head_ahead_of_tail_ends_the_session(daemon):
    def attack():
        c, _ = attach(daemon)
        ring = c.send(f"peek {HDR_COMPLETION_RING_OFFSET}")["value"]
        assert c.send(f"poke {ring + RING_HEAD} {1 << 40}")["ok"]
        assert c.send('post {"opcode": 5, "seq": 1}')["ok"]  # SYNC: the daemon must answer
        expect_ended(c, "completion ring corrupt")
    under_attack(daemon, attack)


def test_an_undrained_flood_is_bounded_and_ends_the_session(daemon):
    """Finding 3 too: garbage commands from a client that never drains its completions
    were each logged and queued in an uncapped overflow queue."""
    def attack():
        c, _ = attach(daemon)
        r = c.send("flood 80000", timeout=60)
        assert r["pushed"] > 65536, r  # past the queue's bound before the daemon ended it
        expect_ended(c, "completions undrained")
    under_attack(daemon, attack)
    assert daemon.log().count("rejected command") < 200


# --------------------------------------------------------------------------- ftruncate


def test_truncating_the_control_segment_ends_only_that_session(daemon):
    """Finding 2: ftruncate(fd, 0) of one's own control segment killed the daemon (SIGBUS)."""
    def attack():
        c, a = attach(daemon)
        assert c.send(f"truncate {a['control']['segment']} 0")["ok"]
        expect_ended(c, "truncated")
    under_attack(daemon, attack)


def test_truncating_staging_under_an_update_ends_only_that_session(daemon):
    # Note [Client pages can vanish] (daemon/memory/client_memory_guard.h): the daemon's
    # access to the vanished pages lands in private zero pages, never in the file, and
    # ending the session removes the file's name. So the staging file the attacker
    # truncated stays empty (nothing the daemon read or wrote afterwards reached it,
    # nor did the daemon grow it back) and is gone from the shm dir once the session
    # ends; the bystander's weights and state are checked bit for bit by under_attack.
    numel = 1 << 18

    def attack():
        c, _ = attach(daemon)
        reg = register_one(c, numel)
        path = os.path.join(daemon.shm_dir, reg["staging"])
        fd = os.open(path, os.O_RDONLY)  # the file as the daemon leaves it, name or not
        try:
            # What the daemon wrote when it made the segment, and what the client wrote
            # into its weight slot, are the file's bytes.
            magic, _version, kind, _flags, total = struct.unpack("<IIIIQ", os.pread(fd, 24, 0))
            assert (magic, kind, total) == (SEGMENT_MAGIC, SEGMENT_STAGING,
                                            reg["staging_size"]), (magic, kind, total, reg)
            slot = reg["slots"][0]["param_offset"]
            assert c.send(f"fill_staging 0 {slot} {numel * 4} {0x3F}")["ok"]
            assert os.pread(fd, numel * 4, slot) == b"\x3f" * (numel * 4)
            assert c.send(f"truncate {reg['staging']} 0")["ok"]
            # Initialising reads the weights from the param slot, the update reads the
            # gradient slot and writes the weights: all on pages that are gone.
            assert c.send('post {"opcode": 3, "seq": 0, "param_id": 0, "field": 4}')["ok"]
            # The session may already be over when these go: the client then posts nothing.
            c.send('post {"opcode": 1, "seq": 1, "param_id": 0, "step": 1, "lr": 0.001}')
            c.send('post {"opcode": 2, "seq": 2, "step": 1}')
            expect_ended(c, "truncated")
            assert os.fstat(fd).st_size == 0, os.fstat(fd)
            assert os.pread(fd, 4096, 0) == b""
            wait_until(lambda: not os.path.exists(path), 10,
                       what="the ended session's staging file to be removed")
        finally:
            os.close(fd)
    under_attack(daemon, attack)


def test_export_into_a_truncated_region_ends_only_that_session(daemon):
    numel = 1 << 18

    def attack():
        c, _ = attach(daemon)
        register_one(c, numel)
        region = c.send(f"alloc {numel * 4} export")
        assert region["ok"], region
        assert c.send(f"truncate {region['segment']} 0")["ok"]
        cmd = {"opcode": 4, "seq": 1, "param_id": 0, "field": 0,
               "region_id": region["region_id"], "bytes": numel * 4}
        assert c.send("post " + json.dumps(cmd))["ok"]
        expect_ended(c, "truncated")
    under_attack(daemon, attack)


# ------------------------------------------------------------------ a dead daemon's files


def test_a_new_daemon_removes_a_killed_daemons_segments(daemon_factory):
    """Finding 4: kill -9 left every segment in /dev/shm and the next daemon ignored them."""
    first = daemon_factory()
    c, a = attach(first)
    assert c.send("alloc 1048576 x")["ok"]
    register_one(c)
    left = first.segment_files()
    assert len(left) >= 3
    first.proc.kill()
    first.proc.wait()
    assert first.segment_files() == left  # nothing could remove them
    c.close()
    second = daemon_factory(socket=first.socket, shm_dir=first.shm_dir)
    assert second.segment_files() == []
    assert "left by a trainstreamd (pid %d)" % first.proc.pid in second.log()
    # Its optimizer state was looked at for adoption (docs/recovery.md) and let go:
    # a registration that never initialised, whose client is gone too.
    assert "not adopted: " in second.log()


def test_another_sockets_segments_are_left_alone(daemon_factory, tmp_path):
    first = daemon_factory()
    c, _ = attach(first)
    assert c.send("alloc 65536 x")["ok"]
    held = first.segment_files()
    # A second daemon on another socket sharing the shm dir must not take them.
    daemon_factory(socket=str(tmp_path / "other.sock"), shm_dir=first.shm_dir)
    assert set(held) <= set(first.segment_files())
    assert c.send("alive")["alive"]


# ------------------------------------------------------------- as an unprivileged member


as_nobody = as_user(NOBODY)


@pytest.fixture
def member_daemon(daemon_factory):
    d = daemon_factory("--allow-group", grp.getgrgid(NOBODY).gr_name)
    os.chmod(d.socket, 0o666)
    os.chmod(d.shm_dir, 0o1777)
    return d


@needs_root
def test_an_unprivileged_member_truncating_its_segment_cannot_kill_a_root_daemon(member_daemon):
    d = member_daemon

    def attack():
        c, a = attach(d, preexec_fn=as_nobody)
        st = os.stat(os.path.join(d.shm_dir, a["control"]["segment"]))
        assert st.st_uid == NOBODY  # its own file: it may truncate it
        assert c.send(f"truncate {a['control']['segment']} 0")["ok"]
        expect_ended(c, "truncated")
    under_attack(d, attack)


@needs_root
def test_an_unprivileged_member_cannot_open_its_optimizer_state(member_daemon):
    d = member_daemon
    c, a = attach(d, preexec_fn=as_nobody)
    register_one(c)
    state = [s for s in d.status()["segments"]
             if s["kind"] == "state" and s["session_id"] == a["session_id"]]
    assert len(state) == 1, d.status()["segments"]
    name = state[0]["name"]
    assert os.stat(os.path.join(d.shm_dir, name)).st_uid == 0
    for mode in ("r", "rw"):
        r = c.send(f"try_open {name} {mode}")
        assert not r["ok"] and r["errno"] == 13, r  # EACCES
    assert c.send(f"truncate {name} 0")["errno"] == 13
    assert c.send(f"try_chmod {name} 666")["errno"] == 1  # EPERM: not its file
    assert c.send("alive")["alive"]


@needs_root
def test_an_unprivileged_owner_cannot_make_its_base_writable(member_daemon):
    import shutil
    import tempfile
    import torch
    d = member_daemon
    folder = tempfile.mkdtemp(prefix="ts-base-")  # pytest's tmp_path is root's alone
    os.chmod(folder, 0o755)
    path = Path(folder) / "base.safetensors"
    write_safetensors(path, {"w": torch.randn(64, 64)})
    os.chmod(path, 0o644)
    r = subprocess.run([str(d.bin_dir / "trainstreamctl"), "--socket", d.socket, "base", "load",
                        str(path), "--json"], capture_output=True, text=True, timeout=60,
                       preexec_fn=as_nobody)
    assert r.returncode == 0, r.stderr
    name = json.loads(r.stdout)["segment"]
    st = os.stat(os.path.join(d.shm_dir, name))
    if st.st_uid == NOBODY:
        pytest.skip("this file system has no POSIX ACLs: bases fall back to the owner's 0400 file")
    assert st.st_uid == 0 and (st.st_mode & 0o777) == 0o440
    c, _ = attach(d, preexec_fn=as_nobody)
    assert c.send(f"try_open {name} r")["ok"]  # it may map its base read-only
    assert c.send(f"try_open {name} rw")["errno"] == 13
    assert c.send(f"try_chmod {name} 600")["errno"] == 1
    assert c.send(f"truncate {name} 0")["errno"] == 13
    shutil.rmtree(folder)


def test_one_uid_cannot_hold_unbounded_sessions(daemon):
    """Each session costs a gRPC thread, a plane thread and a control segment, and one
    connection can carry many streams: a uid holds at most 256 sessions at once."""
    from trainstream import TrainStreamError, _control as control
    client = control.Client.connect(daemon.socket)
    held = [client.attach(job=f"s{i}") for i in range(256)]
    with pytest.raises(TrainStreamError, match="256 sessions"):
        client.attach(job="one-too-many")
    assert daemon.ctl("ping").returncode == 0
    held.pop().detach()
    held.append(client.attach(job="room-again"))  # the cap counts live sessions only
    for s in held:
        s.detach()


# --------------------------------------------- the listener and the base loader, likewise


def _crafted_header(path, count):
    """A checkpoint of `count` tensors, all but one of them empty: such headers once
    took quadratic parse time (32k: 4.8 s of daemon CPU)."""
    import struct
    parts = [f'"t{i}":{{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}' for i in range(count - 1)]
    parts.append('"last":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}')
    header = ("{" + ",".join(parts) + "}").encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + b"\0" * 4)


@pytest.mark.parametrize("count", [200_000, 300_000])
def test_a_crafted_checkpoint_header_leaves_the_others_alone(daemon, tmp_path, count):
    """Finding 6: 200k empty tensors took over a minute of daemon CPU; now the parse is
    linear, and past the tensor cap the load is refused by name."""
    path = tmp_path / "crafted.safetensors"
    _crafted_header(path, count)

    def attack():
        r = daemon.ctl("base", "load", str(path), timeout=120)
        if count > 1 << 18:
            assert r.returncode != 0 and "tensors" in r.stderr, r.stderr
        else:
            assert r.returncode == 0, r.stderr
            assert daemon.ctl("base", "drop", json.loads(
                daemon.ctl("base", "list", "--json").stdout)[0]["key"]).returncode == 0
    under_attack(daemon, attack)


@needs_root
def test_a_connection_flood_by_a_member_leaves_the_others_alone(member_daemon):
    """Finding 5: idle connections past the fd limit put the accept loop into a spin.
    An unprivileged member opens 1,000 connections and holds them while root's
    bystander trains."""
    d = member_daemon
    script = (
        "import socket, sys, time\n"
        "held = []\n"
        "for _ in range(1000):\n"
        "    s = socket.socket(socket.AF_UNIX)\n"
        "    try:\n"
        "        s.connect(sys.argv[1])\n"
        "    except OSError:\n"
        "        continue\n"
        "    held.append(s)\n"
        "print(len(held), flush=True)\n"
        "time.sleep(3)\n")

    def attack():
        # The system interpreter: the project's venv may sit under root's 0700 home.
        r = subprocess.run(["/usr/bin/python3", "-c", script, d.socket], capture_output=True,
                           text=True, timeout=60, preexec_fn=as_nobody)
        assert r.returncode == 0, r.stderr
        assert int(r.stdout) > 0
        assert d.ctl("--timeout-ms", "2000", "ping").returncode == 0
    under_attack(d, attack)


# ------------------------------------------------------------------ masters in staging


def test_garbage_in_its_weight_slots_changes_only_its_own_masters(daemon):
    # Note [One host copy of a trained weight]: an fp32 weight slot is the master and a
    # bf16 one its high half, in memory the client maps read-write. Writing NaNs, zeros
    # and ones there between and during updates changes that session's masters; the
    # daemon computes on, its session goes on, and nothing else is touched.
    numel = 1 << 17
    spec = {"groups": [{"lr": 1e-3}],
            "params": [{"id": 0, "name": "fp32", "shape": [numel], "dtype": 1},
                       {"id": 1, "name": "bf16", "shape": [numel], "dtype": 2}]}

    def attack():
        c, _ = attach(daemon)
        reg = c.send("register " + json.dumps(spec))
        assert reg["ok"], reg
        slots = {s["param_id"]: s for s in reg["slots"]}
        for pid in (0, 1):
            assert c.send(f'post {{"opcode": 3, "seq": {pid}, "param_id": {pid}, "field": 4}}')["ok"]
        seq = 2
        for step in range(1, 9):
            for pid, size in ((0, 4), (1, 2)):
                fill = (0xFF, 0x00, 0x7F, 0x80)[step % 4]  # NaN, zero, huge, -0/-NaN
                assert c.send(f"fill_staging 0 {slots[pid]['param_offset']} {numel * size} "
                              f"{fill}")["ok"]
                cmd = {"opcode": 1, "seq": seq, "param_id": pid, "step": step, "lr": 1e-3}
                assert c.send("post " + json.dumps(cmd))["ok"]
                seq += 1
            assert c.send('post ' + json.dumps({"opcode": 2, "seq": seq, "step": step}))["ok"]
            seq += 1
        # Its session is not ended for it (given two seconds to be).
        r = c.send("wait_dead 2000", timeout=20)
        assert r["alive"], r
        c.send("detach")
    under_attack(daemon, attack)


# ------------------------------------------------------------------ gradient pool


def test_hostile_pool_extents_are_refused_and_cost_only_their_session(daemon):
    # Note [A pool extent a client names] (daemon/planes/grad_pool.h): every extent a
    # pooled GRAD_READY names is checked against what the daemon holds. Extents past
    # one lap of released, over bytes in flight, wrapping, near 2^64, misaligned or of
    # the wrong length, a pool extent for a slot-less param without the flag, and a
    # scribbled pool header: each is refused (ERROR), the daemon computes on, the
    # attacker's session is not ended and the bystander is bit-identical.
    numel = 1 << 18  # 1 MiB fp32 gradients; the pool holds two
    spec = {"groups": [{"lr": 1e-3}], "grad_pool_bytes": 2 * 4 * numel,
            "params": [{"id": i, "name": f"w{i}", "shape": [numel], "dtype": 1}
                       for i in range(3)]}
    big = 4 * numel

    def attack():
        c, _ = attach(daemon)
        reg = c.send("register " + json.dumps(spec))
        assert reg["ok"], reg
        cap, off = reg["grad_pool_bytes"], reg["grad_pool_offset"]
        assert cap == 2 * big and off == 8192, reg
        for pid in range(3):
            assert c.send(f'post {{"opcode": 3, "seq": {pid}, "param_id": {pid}, "field": 4}}')["ok"]
        seq = 10

        def grad(pid, step, pos, nbytes=big, flags=1):
            nonlocal seq
            seq += 1
            cmd = {"opcode": 1, "flags": flags, "seq": seq, "param_id": pid, "step": step,
                   "lr": 1e-3, "region_offset": pos, "bytes": nbytes}
            assert c.send("post " + json.dumps(cmd))["ok"]

        for step in range(1, 7):
            base = step * 4 * cap
            grad(0, step, base)                       # honest
            grad(1, step, base)                       # the same bytes (in flight or behind)
            grad(1, step, base + 5 * cap)             # many laps past released
            grad(1, step, base + cap - 64)            # wraps
            grad(1, step, (1 << 64) - 64)             # overflows
            grad(1, step, base + 32)                  # misaligned
            grad(1, step, base + big, nbytes=big - 4)  # the wrong length
            grad(1, step, base + big, flags=0)        # no extent named
            grad(2, step, base + big)                 # honest
            grad(2, step, base + big)                 # twice while in flight
            assert c.send(f"fill_staging 0 4096 256 {0xFF if step % 2 else 0}")["ok"]
            assert c.send(f"fill_staging 0 {off} {cap} {0x7F}")["ok"]  # garbage gradients
            assert c.send('post ' + json.dumps({"opcode": 2, "seq": seq + 1, "step": step}))["ok"]
            seq += 1
        r = c.send("wait_dead 2000", timeout=20)
        assert r["alive"], r
        c.send("detach")
    under_attack(daemon, attack)
