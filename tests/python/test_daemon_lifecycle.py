"""Lifecycle of the real trainstreamd: dead clients, signals, a second daemon,
stale sockets, drain, idle exit and bad configuration."""
import os
import signal
import socket
import subprocess
import threading
import time


from conftest import wait_until

MIB = 1 << 20


def test_sigkilled_client_is_reclaimed(daemon):
    c = daemon.client()
    a = c.send("attach victim 0")
    assert a["ok"]
    assert c.send(f"alloc {4 * MIB}")["ok"]
    assert c.send("register " + '{"groups":[{}],"params":[{"id":1,"shape":[1024]}]}')["ok"]
    assert len(daemon.segment_files()) == 4  # control, region, state, staging
    other = daemon.client()
    assert other.send("attach survivor 1")["ok"]
    before = set(daemon.segment_files())

    c.proc.send_signal(signal.SIGKILL)
    c.proc.wait()
    # The daemon hears of the death at once (it watches the client through a pidfd); the
    # bound only catches a session that is never reclaimed, however slow the machine.
    wait_until(lambda: len(daemon.segment_files()) == 1, 20, interval=0.005,
               what="the killed client's segments to be unlinked")
    remaining = set(daemon.segment_files())
    assert remaining < before
    # The budget is given back after the files are unlinked: waited for, not raced.
    def released():
        s = daemon.status()
        held = s["sessions"][0]["bytes_held"] if len(s["sessions"]) == 1 else None
        return s if s["budget"]["used"] == held else None
    s = wait_until(released, 20, what="the killed client's session and budget to be released")
    assert [x["job"] for x in s["sessions"]] == ["survivor"]
    assert a["pid"] not in [x["pid"] for x in s["sessions"]]
    assert other.send(f"alloc {MIB}")["ok"]


def test_discard_state_tells_clients_and_leaves_nothing(daemon_factory):
    d = daemon_factory()
    c = d.client()
    assert c.send("attach term 0")["ok"]
    assert c.send(f"alloc {2 * MIB}")["ok"]
    assert c.send("register " + '{"groups":[{}],"params":[{"id":1,"shape":[64]}]}')["ok"]
    assert d.segment_files()
    r = d.ctl("shutdown", "--discard-state")
    assert r.returncode == 0 and "1 session(s) were attached" in r.stdout, r
    assert d.proc.wait(timeout=15) == 0, d.log()
    assert d.segment_files() == []
    assert not os.path.exists(d.socket)
    dead = c.send("wait_dead 5000")
    assert dead["ok"] and not dead["alive"], dead
    assert "shut down" in dead["why"], dead


def test_sigterm_keeps_the_sessions_state_for_the_next_daemon(daemon_factory):
    # Note [A restart keeps the optimizer state]: what a crash leaves, not a clean stop.
    d = daemon_factory()
    c = d.client()
    assert c.send("attach term 0")["ok"]
    assert c.send(f"alloc {2 * MIB}")["ok"]
    assert c.send("register " + '{"groups":[{}],"params":[{"id":1,"shape":[64]}]}')["ok"]
    left = d.segment_files()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=15) == 0, d.log()
    assert "1 sessions attached and 0 adopted states waiting; their optimizer state is kept" \
        in d.log(), d.log()
    assert d.segment_files() == left
    dead = c.send("wait_dead 5000")
    assert dead["ok"] and not dead["alive"], dead
    assert "shut down" not in dead["why"], dead  # a broken stream, as after a crash
    # The next daemon finds them (this state's masters were never initialised, so it is
    # not adopted: tests/python/test_stop_keeps_state.py resumes a trained one).
    nxt = daemon_factory(socket=d.socket, shm_dir=d.shm_dir)
    assert "its registration never finished" in nxt.log(), nxt.log()
    assert nxt.segment_files() == []


def test_sigint_exits_zero(daemon_factory):
    d = daemon_factory()
    d.proc.send_signal(signal.SIGINT)
    assert d.proc.wait(timeout=15) == 0


def test_second_daemon_on_a_live_socket_is_refused(daemon, build_dir):
    r = subprocess.run([str(build_dir / "bin" / "trainstreamd"), "--foreground", "--socket", daemon.socket,
                        "--shm-dir", daemon.shm_dir], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    assert "already serving" in r.stderr and daemon.socket in r.stderr, r.stderr
    assert f"pid {daemon.proc.pid}" in r.stderr, r.stderr
    assert daemon.ctl("ping").returncode == 0  # the first one is untouched


def test_background_mode_reports_refusal_on_the_terminal(daemon, build_dir):
    r = subprocess.run([str(build_dir / "bin" / "trainstreamd"), "--socket", daemon.socket,
                        "--shm-dir", daemon.shm_dir], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "already serving" in r.stderr, r.stderr


def test_stale_socket_is_replaced(daemon_factory, tmp_path):
    path = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()  # the file stays, nobody listens: what a crashed daemon leaves
    assert os.path.exists(path)
    d = daemon_factory(socket=path)
    assert d.ctl("ping").returncode == 0
    assert "replacing stale socket" in d.log()


def test_refuses_to_replace_a_non_socket(daemon_factory, tmp_path):
    path = tmp_path / "not-a-socket"
    path.write_text("precious")
    d = daemon_factory(socket=str(path), wait=False)
    assert d.proc.wait(timeout=30) == 1
    assert "is not a socket" in d.log()
    assert path.read_text() == "precious"


def test_drain_refuses_new_sessions_and_exits_after_the_last(daemon_factory):
    d = daemon_factory()
    c = d.client()
    assert c.send("attach drainer 0")["ok"]
    r = d.ctl("shutdown", "--drain")
    assert r.returncode == 0 and "1 session" in r.stdout, r
    assert d.status()["draining"] is True
    late = d.client().send("attach late 0")
    assert not late["ok"] and late["code"] == "UNAVAILABLE" and "draining" in late["message"]
    assert c.send(f"alloc {MIB}")["ok"]  # existing sessions continue
    assert d.proc.poll() is None
    assert c.send("detach")["ok"]
    assert d.proc.wait(timeout=15) == 0
    assert d.segment_files() == []


def test_shutdown_rpc_stops_the_daemon(daemon_factory):
    d = daemon_factory()
    c = d.client()
    assert c.send("attach x 0")["ok"]
    r = d.ctl("shutdown")
    assert r.returncode == 0 and "kept for the next daemon" in r.stdout, r
    assert d.proc.wait(timeout=15) == 0
    assert not c.send("wait_dead 5000")["alive"]
    # The session registered nothing: the next daemon adopts nothing and sweeps its files.
    assert d.segment_files()
    nxt = daemon_factory(socket=d.socket, shm_dir=d.shm_dir)
    assert "adopted the optimizer state" not in nxt.log()
    assert nxt.segment_files() == []


def test_idle_exit(daemon_factory):
    # Pings keep the 3 s idle clock from running out while the client starts and
    # attaches (a gRPC binary can take seconds to start on a loaded machine); from
    # then on, only the session keeps the daemon alive.
    d = daemon_factory("--idle-exit", "3")
    attached = threading.Event()

    def keep_awake():
        while not attached.wait(0.5):
            d.ctl("--timeout-ms", "2000", "ping")
    pinger = threading.Thread(target=keep_awake)
    pinger.start()
    try:
        c = d.client()
        assert c.send("attach idle 0")["ok"]
    finally:
        attached.set()
        pinger.join()
    start = time.monotonic()
    # An attached session keeps it alive past the idle timeout.
    wait_until(lambda: time.monotonic() - start > 4.0, 6, what="time to pass")
    assert d.proc.poll() is None
    assert c.send("detach")["ok"]
    assert d.proc.wait(timeout=10) == 0


def test_bad_config_names_file_and_line(build_dir, tmp_path):
    cfg = tmp_path / "trainstreamd.conf"
    cfg.write_text("# comment\nbudget = 2G\nbudjet = 3G\n")
    r = subprocess.run([str(build_dir / "bin" / "trainstreamd"), "--foreground", "--config", str(cfg),
                        "--socket", str(tmp_path / "s.sock")], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert f"{cfg}:3" in r.stderr and "budjet" in r.stderr, r.stderr


def test_config_file_values_apply(daemon_factory, tmp_path):
    cfg = tmp_path / "trainstreamd.conf"
    cfg.write_text("budget = 96M   # flags win over the file\nmax_region_bytes = 2M\nlock_memory = false\n")
    d = daemon_factory("--config", str(cfg))
    assert d.status()["budget"]["limit"] == 1 << 30  # the fixture's --budget 1G
    c = d.client()
    assert c.send("attach cfg 0")["ok"]
    r = c.send(f"alloc {3 * MIB}")
    assert r["code"] == "INVALID_ARGUMENT" and "2097152" in r["message"], r
    assert c.send(f"alloc {2 * MIB}")["ok"]
    assert d.status()["pinned_bytes"] == 0  # lock_memory = false


def test_missing_shm_dir_is_refused(daemon_factory, tmp_path):
    d = daemon_factory(shm_dir=str(tmp_path / "nope"), wait=False)
    assert d.proc.wait(timeout=30) == 1
    assert "nope" in d.log() and "shm directory" in d.log()
