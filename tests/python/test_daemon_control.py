"""Control-plane behaviour of the real trainstreamd: sessions, regions,
registration, bad input and the budget."""
import json
import os
import re
import stat
import struct

from conftest import wait_until

MIB = 1 << 20


def test_ping_and_status_json(daemon):
    r = daemon.ctl("ping")
    assert r.returncode == 0, r.stderr
    assert f"pid {daemon.proc.pid}" in r.stdout
    s = daemon.status()
    assert s["pid"] == daemon.proc.pid
    assert s["socket_path"] == daemon.socket
    assert s["shm_dir"] == daemon.shm_dir
    assert s["budget"] == {"limit": 1 << 30, "used": 0, "free": 1 << 30}
    assert s["sessions"] == [] and s["segments"] == [] and s["bases"] == []
    assert set(s["segments_by_kind"]) == {"base", "session", "state"}
    table = daemon.ctl("status")
    assert table.returncode == 0 and "SESSIONS (0)" in table.stdout and "budget" in table.stdout


def test_socket_is_0660(daemon):
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o660


def test_attach_allocate_free_detach(daemon):
    c = daemon.client()
    a = c.send("attach job-a 3")
    assert a["ok"], a
    assert a["shm_dir"] == daemon.shm_dir
    control = os.path.join(daemon.shm_dir, a["control"]["segment"])
    st = os.stat(control)
    assert stat.S_IMODE(st.st_mode) == 0o600
    # "trainstream-<daemon tag>-<32 random hex>" (Note [Segments outlive a crashed daemon]).
    assert re.fullmatch(r"trainstream-[0-9a-f]{8}-[0-9a-f]{32}", a["control"]["segment"])

    r = c.send(f"alloc {3 * MIB} activations")
    assert r["ok"], r
    assert r["offset"] == 4096 and r["length"] == 3 * MIB
    assert c.send(f"fill {r['region_id']} 7")["ok"]
    with open(os.path.join(daemon.shm_dir, r["segment"]), "rb") as f:
        f.seek(4096)
        assert f.read(16) == b"\x07" * 16  # the client's writes land in the daemon's segment
        f.seek(0)
        magic, version, kind = struct.unpack("<III", f.read(12))
    assert (magic, version, kind) == (0x54535347, 3, 2)

    s = daemon.status()
    (sess,) = s["sessions"]
    assert sess["pid"] == a["pid"] and sess["job"] == "job-a" and sess["rank"] == 3
    assert sess["uid"] == os.getuid()
    assert sess["bytes_held"] == s["budget"]["used"] > 3 * MIB
    assert s["segments_by_kind"]["session"]["count"] == 2
    assert {seg["label"] for seg in s["segments"]} == {"control", "activations"}

    freed = c.send(f"free {r['region_id']}")
    assert freed["ok"] and freed["bytes_freed"] == 3 * MIB + 4096
    assert r["segment"] not in daemon.segment_files()
    assert c.send("detach")["ok"]
    # detach ends the stream; the daemon's teardown follows (unlink, unmap, then the
    # budget), so each is waited for, not read right after the files go.
    wait_until(lambda: daemon.segment_files() == [], 20, what="segments to go after detach")
    wait_until(lambda: daemon.status()["sessions"] == [], 20, what="the session to go")
    wait_until(lambda: daemon.status()["budget"]["used"] == 0, 20, what="its budget back")


def test_out_of_range_input_names_the_field_and_others_keep_working(daemon):
    good, bad = daemon.client(), daemon.client()
    assert good.send("attach good 0")["ok"]
    b = bad.send("attach bad 1")
    assert b["ok"]

    def refused(reply, field):
        assert not reply["ok"], reply
        assert reply["code"] == "INVALID_ARGUMENT", reply
        assert reply["message"].startswith(field + ":"), reply

    refused(bad.send("alloc 0"), "bytes")
    refused(bad.send(f"alloc {1 << 50}"), "bytes")
    refused(bad.send("raw_alloc 4096 3"), "kind")  # state segments are daemon-only
    refused(bad.send("raw_alloc 4096 1"), "kind")
    refused(bad.send("free 987654"), "region_id")
    refused(bad.send(f"free {b['control']['region_id']}"), "region_id")  # the control region
    group = {"lr": 1e-3}
    p = {"id": 1, "shape": [4, 4]}
    cases = [
        ({"groups": [group], "params": [p, {"id": 2, "shape": [0, 3]}]}, "params[1].shape[0]"),
        ({"groups": [group], "params": [{"id": 1, "shape": [-5]}]}, "params[0].shape[0]"),
        ({"groups": [group], "params": [{"id": 1, "shape": [1 << 30, 1 << 30]}]}, "params[0].shape"),
        ({"groups": [group], "params": [p, dict(p)]}, "params[1].param_id"),
        ({"groups": [group], "params": [{"id": 1, "shape": [2], "dtype": 9}]}, "params[0].dtype"),
        ({"groups": [group], "params": [{"id": 1, "shape": [2], "group": 3}]}, "params[0].group"),
        ({"groups": [{"lr": -1.0}], "params": [p]}, "groups[0].lr"),
        ({"groups": [group, {"beta1": 1.0}], "params": [p]}, "groups[1].beta1"),
        ({"groups": [{"eps": 0.0}], "params": [p]}, "groups[0].eps"),
        ({"groups": [group], "params": [p], "moment_dtype": 3}, "moment_dtype"),
        ({"groups": [], "params": [p]}, "groups"),
        ({"groups": [group], "params": []}, "params"),
    ]
    for spec, field in cases:
        refused(bad.send("register " + json.dumps(spec)), field)
    # Nothing leaked from the refused requests, and both sessions still work.
    r = good.send(f"alloc {MIB} still-fine")
    assert r["ok"], r
    assert bad.send(f"alloc {MIB}")["ok"]
    assert daemon.ctl("ping").returncode == 0
    s = daemon.status()
    assert len(s["sessions"]) == 2
    assert all(x["params"] == 0 for x in s["sessions"])
    assert s["segments_by_kind"]["state"]["count"] == 0


def test_wrong_token_and_unknown_session(daemon):
    c = daemon.client()
    a = c.send("attach t 0")
    r = c.send(f"raw_alloc 4096 2 {a['session_id']} {'0' * 32}")
    assert not r["ok"] and r["code"] == "PERMISSION_DENIED" and "session_token" in r["message"]
    r = c.send(f"raw_alloc 4096 2 {a['session_id'] + 100} {'0' * 32}")
    assert not r["ok"] and r["code"] == "NOT_FOUND" and "session_id" in r["message"]


def test_budget_exhausted_reports_asked_free_and_limit(daemon_factory):
    d = daemon_factory("--budget", "64M")
    c = d.client()
    assert c.send("attach b 0")["ok"]
    used_by_control = d.status()["budget"]["used"]
    first = c.send(f"alloc {40 * MIB}")
    assert first["ok"], first
    r = c.send(f"alloc {40 * MIB}")
    assert not r["ok"] and r["code"] == "RESOURCE_EXHAUSTED", r
    asked = 40 * MIB + 4096
    free = 64 * MIB - used_by_control - (40 * MIB + 4096)
    msg = r["message"]
    assert f"asked {asked} bytes" in msg, msg
    assert f"{free} bytes" in msg and "free" in msg, msg
    assert f"{64 * MIB}-byte" in msg and "limit" in msg, msg
    # The failed request reserved nothing: freeing makes room again.
    assert c.send(f"free {first['region_id']}")["ok"]
    assert c.send(f"alloc {40 * MIB}")["ok"]


def test_register_parameters_layout_and_state_manifest(daemon):
    c = daemon.client()
    a = c.send("attach reg 0")
    spec = {"groups": [{"lr": 1e-3}, {"lr": 1e-4, "weight_decay": 0.0}],
            "params": [{"id": 10, "name": "w", "shape": [3, 5], "dtype": 2, "grad_dtype": 1, "group": 0},
                       {"id": 11, "name": "b", "shape": [7], "dtype": 1, "group": 1},
                       {"id": 12, "name": "scalar", "shape": [], "dtype": 3, "group": 1}],
            "moment_dtype": 2}
    r = c.send("register " + json.dumps(spec))
    assert r["ok"], r
    sizes = {10: (15, 4, 2), 11: (7, 4, 4), 12: (1, 2, 2)}  # numel, grad bytes, param bytes
    spans = []
    for slot in r["slots"]:
        numel, gsz, psz = sizes[slot["param_id"]]
        assert slot["numel"] == numel
        assert slot["grad_offset"] % 64 == 0 and slot["param_offset"] % 64 == 0
        assert slot["grad_offset"] >= 4096
        spans += [(slot["grad_offset"], numel * gsz), (slot["param_offset"], numel * psz)]
    spans.sort()
    for (o1, n1), (o2, _) in zip(spans, spans[1:]):
        assert o1 + n1 <= o2, "staging slots overlap"
    assert spans[-1][0] + spans[-1][1] <= r["staging_size"]

    s = daemon.status()
    assert s["sessions"][0]["params"] == 3
    (state,) = [x for x in s["segments"] if x["kind"] == "state"]
    with open(os.path.join(daemon.shm_dir, state["name"]), "rb") as f:
        data = f.read()
    magic, version, kind, _flags, total, session_id, uid = struct.unpack_from("<IIIIQQI", data, 0)
    assert (magic, version, kind, total, session_id) == (0x54535347, 3, 3, len(data), a["session_id"])
    manifest_offset, manifest_bytes = struct.unpack_from("<QQ", data, 120)
    assert manifest_offset == 4096 and manifest_bytes == 40 + 3 * 176
    mmagic, entries, moment = struct.unpack_from("<III", data, manifest_offset)
    assert (mmagic, entries, moment) == (0x54535347, 3, 2)
    # The recovery header (wire/state_record.h), after the entries: "TSRC", version 4
    # (the redo journal; 5 with a gradient pool).
    (recovery_offset,) = struct.unpack_from("<Q", data, manifest_offset + 32)
    assert recovery_offset >= manifest_offset + manifest_bytes
    assert struct.unpack_from("<II", data, recovery_offset) == (0x54535243, 4)
    ids = []
    # Note [One host copy of a trained weight]: where each master is, and what of it the
    # state segment holds (bf16: the low halves, fp32: nothing, fp16: an fp32 master).
    master_bytes = {1: 2, 2: 0, 0: 4}  # by MasterLayout
    for i in range(3):
        e = manifest_offset + 40 + 176 * i
        pid, numel = struct.unpack_from("<QQ", data, e)
        master, m1, m2 = struct.unpack_from("<QQQ", data, e + 24)
        (layout,) = struct.unpack_from("<I", data, e + 56)
        if master_bytes[layout]:
            assert master % 64 == 0 and master + master_bytes[layout] * numel <= m1
        else:
            assert master == 0
        assert m1 + 2 * numel <= m2 <= len(data)
        name = data[e + 64:e + 176].split(b"\0")[0].decode()
        ids.append((pid, numel, layout, name))
    assert ids == [(10, 15, 1, "w"), (11, 7, 2, "b"), (12, 1, 0, "scalar")]
    # The same ids cannot be registered twice; new ones can.
    again = c.send("register " + json.dumps({"groups": [{}], "params": [{"id": 11, "shape": [1]}]}))
    assert again["code"] == "INVALID_ARGUMENT" and again["message"].startswith("params[0].param_id:")
    more = c.send("register " + json.dumps({"groups": [{}], "params": [{"id": 13, "shape": [1]}], "moment_dtype": 2}))
    assert more["ok"], more
