"""Peer credentials: who may use and who may stop trainstreamd. The daemon
checks SO_PEERCRED itself, so these tests open the socket's file mode (0660 by
default) to let another uid connect at all; the refusal must be the daemon's."""
import grp
import os
import subprocess

import pytest

from conftest import NOBODY, as_user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client under another uid")


def open_socket(d):
    os.chmod(d.socket, 0o666)
    os.chmod(d.shm_dir, 0o1777)


def ctl_as(d, uid, gid, *args):
    return subprocess.run([str(d.bin_dir / "trainstreamctl"), "--socket", d.socket, *args],
                          capture_output=True, text=True, timeout=30, preexec_fn=as_user(uid, gid))


def test_other_uid_is_permission_denied(daemon):
    open_socket(daemon)
    r = ctl_as(daemon, NOBODY, NOBODY, "ping")
    assert r.returncode == 4, (r.stdout, r.stderr)
    assert "PERMISSION_DENIED" in r.stderr and f"uid {NOBODY}" in r.stderr, r.stderr
    c = daemon.client(preexec_fn=as_user(NOBODY, NOBODY))
    a = c.send("attach intruder 0")
    assert not a["ok"] and a["code"] == "PERMISSION_DENIED", a
    assert daemon.status()["sessions"] == []
    assert daemon.ctl("ping").returncode == 0  # root still served


def test_allow_group_admits_members_but_not_to_admin(daemon_factory):
    group = grp.getgrgid(NOBODY).gr_name
    d = daemon_factory("--allow-group", group)
    open_socket(d)
    assert ctl_as(d, NOBODY, NOBODY, "ping").returncode == 0
    c = d.client(preexec_fn=as_user(NOBODY, NOBODY))
    a = c.send("attach member 0")
    assert a["ok"], a
    r = c.send("alloc 65536")
    assert r["ok"], r
    # Segments belong to the attaching user (the daemon runs as root).
    st = os.stat(os.path.join(d.shm_dir, r["segment"]))
    assert st.st_uid == NOBODY and (st.st_mode & 0o777) == 0o600
    s = d.status()
    assert s["sessions"][0]["uid"] == NOBODY
    denied = ctl_as(d, NOBODY, NOBODY, "shutdown")
    assert denied.returncode == 4 and "may not shut" in denied.stderr, denied.stderr
    assert d.proc.poll() is None
    # Another user cannot use a member's session even with its id.
    r = d.client().send(f"raw_alloc 4096 2 {a['session_id']} {'0' * 32}")
    assert r["code"] == "PERMISSION_DENIED"


def test_socket_group_is_the_allow_group(daemon_factory):
    group = grp.getgrgid(NOBODY)
    d = daemon_factory("--allow-group", group.gr_name)
    assert os.stat(d.socket).st_gid == group.gr_gid


def test_unknown_group_is_refused(daemon_factory):
    d = daemon_factory("--allow-group", "no-such-group-xyz", wait=False)
    assert d.proc.wait(timeout=30) == 1
    assert "unknown group 'no-such-group-xyz'" in d.log()
