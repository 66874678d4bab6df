"""The daemon's frozen-base cache (docs/base-cache.md): bases read through the
shared segment equal a plain reader (or quantize_tensor), bad checkpoints are
refused without harming the daemon, two processes share one copy, and the
refcount / eviction rules hold."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from conftest import wait_until
from safetensors_writer import read_safetensors, write_raw, write_safetensors, write_sharded

import trainstream._control as control
from trainstream.frozen.shared_base import load_base
from trainstream.frozen.quantization import quantize_tensor

NOBODY = 65534


def block_tensors(layers=2, rows=96, cols=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": torch.randn(50, cols, generator=g).to(dtype),
         "model.norm.weight": torch.rand(cols, generator=g).to(dtype)}
    for i in range(layers):
        t[f"model.layers.{i}.mlp.up_proj.weight"] = torch.randn(rows, cols, generator=g).to(dtype)
        # 1000 elements: not a multiple of any block (padding is exercised)
        t[f"model.layers.{i}.self_attn.o_proj.weight"] = torch.randn(40, 25, generator=g).to(dtype)
        t[f"model.layers.{i}.input_layernorm.weight"] = torch.rand(cols, generator=g).to(dtype)
    return t


def inside(view: torch.Tensor, base) -> bool:
    start = base._region.address
    return start <= view.data_ptr() < start + base._region.size


def test_unquantized_base_equals_plain_reader_and_is_a_view(daemon, tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {
        "a.bf16": torch.randn(7, 9, generator=g).bfloat16(),
        "b.f32": torch.randn(3, 5, 2, generator=g),
        "c.f16": torch.randn(11, generator=g).half(),
        "d.i64": torch.arange(-5, 5, dtype=torch.int64),
        "e.bool": torch.tensor([True, False, True]),
        "f.u8": torch.arange(0, 200, dtype=torch.uint8),
        "g.scalar": torch.tensor(3.5, dtype=torch.float32),
        "h.empty": torch.empty(0, 4, dtype=torch.bfloat16),
        "i.fp8": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
    }
    path = tmp_path / "m.safetensors"
    write_safetensors(path, tensors, metadata={"format": "pt"})
    plain = read_safetensors(path)
    base = load_base(str(path), socket=daemon.socket)
    try:
        assert base.format == "none" and sorted(base.names()) == sorted(tensors)
        for name, ref in plain.items():
            v = base.tensor(name)
            assert v.dtype == ref.dtype and v.shape == ref.shape, name
            assert torch.equal(v.view(torch.uint8) if v.dtype.is_floating_point and v.element_size() == 1
                               else v, ref.view(torch.uint8) if ref.dtype.is_floating_point and ref.element_size() == 1
                               else ref), name
            if v.numel():
                assert inside(v, base), f"{name} is not a view of the shared segment"
        assert base._region.read_only
        assert base.cuda_registered == torch.cuda.is_available()
        info = base.info
        assert info["tensors"] == len(tensors) and info["quantized_tensors"] == 0
        assert info["refcount"] == 1 and info["source_bytes"] == sum(
            t.numel() * t.element_size() for t in tensors.values())
    finally:
        base.release()


@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_quantized_base_equals_quantize_tensor(daemon, tmp_path, fmt, dtype):
    tensors = block_tensors(dtype=dtype)
    path = tmp_path / "m.safetensors"
    write_safetensors(path, tensors)
    block = 32 if fmt in ("int8", "nf4") else 64
    base = load_base(str(path), fmt, block, socket=daemon.socket)
    try:
        quantized = {n for n in tensors if ".layers." in n and n.endswith("proj.weight")}
        assert base.info["quantized_tensors"] == len(quantized) == 4
        for name, t in tensors.items():
            if name not in quantized:
                assert not base.is_quantized(name)
                assert torch.equal(base.tensor(name), t), name
                continue
            q = base.quantized(name)
            ref = quantize_tensor(t, fmt, block)
            assert (q.format, q.block_size, q.padding, tuple(q.shape), q.dtype) == \
                (ref.format, ref.block_size, ref.padding, tuple(ref.shape), ref.dtype), name
            assert torch.equal(q.data, ref.data), name
            assert torch.equal(q.scales, ref.scales), name
            assert torch.equal(q.tensor_scale, ref.tensor_scale), name
            assert inside(q.data, base) and inside(q.scales, base)
            assert torch.equal(base.dequantized(name), ref.dequantize(torch.bfloat16))
    finally:
        base.release()


def test_sharded_folder_with_index(daemon, tmp_path):
    tensors = block_tensors(layers=3)
    write_sharded(tmp_path, tensors, shards=3)
    base = load_base(str(tmp_path), "nf4", socket=daemon.socket)
    try:
        assert sorted(base.names()) == sorted(tensors)
        assert torch.equal(base.tensor("model.norm.weight"), tensors["model.norm.weight"])
    finally:
        base.release()
    # The index must agree with the shards.
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00003-of-00003.safetensors"
    index["weight_map"]["ghost"] = "model-00001-of-00003.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(control.InvalidArgument, match="disagrees with the shards|does not hold it"):
        load_base(str(tmp_path), "nf4", socket=daemon.socket)


def test_same_files_and_format_load_once(daemon, tmp_path):
    write_safetensors(tmp_path / "m.safetensors", block_tensors())
    a = load_base(str(tmp_path / "m.safetensors"), "int8", socket=daemon.socket)
    b = load_base(str(tmp_path), "int8", socket=daemon.socket)  # the folder: same file
    n = load_base(str(tmp_path), "nf4", socket=daemon.socket)  # another format: another base
    try:
        assert a.key == b.key and b.info["cached"] and not a.info["cached"]
        assert n.key != a.key
        st = daemon.status()
        refs = {x["key"]: x["refcount"] for x in st["bases"]}
        assert refs == {a.key: 2, n.key: 1}
        assert st["segments_by_kind"]["base"]["count"] == 2
    finally:
        for x in (a, b, n):
            x.release()
    # A changed file is a different base (size / mtime / header hash are in the key).
    write_safetensors(tmp_path / "m.safetensors", block_tensors(seed=5))
    d = load_base(str(tmp_path), "int8", socket=daemon.socket)
    try:
        assert d.key != a.key and not d.info["cached"]
    finally:
        d.release()


BAD_CASES = [
    ("truncated", lambda p: p.write_bytes(b"\x10\x00\x00"), "truncated: 3 bytes"),
    ("header_past_end", lambda p: write_raw(p, {"a": {}}, b"", header_len=4096),
     "runs past the end of the file"),
    ("malformed_json", lambda p: write_raw(p, b'{"a": {"dtype": ', b""), "malformed JSON"),
    ("overlap", lambda p: write_raw(p, {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                                        "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}},
                                    b"x" * 6), 'tensors "a" [0, 4) and "b" [2, 6) overlap'),
    ("out_of_range", lambda p: write_raw(p, {"a": {"dtype": "U8", "shape": [8],
                                                   "data_offsets": [0, 8]}}, b"x" * 4),
     'tensor "a": data_offsets [0, 8] run past the data area'),
    ("unknown_dtype", lambda p: write_raw(p, {"w": {"dtype": "F4", "shape": [2],
                                                    "data_offsets": [0, 1]}}, b"x"),
     'tensor "w": dtype "F4" is not one this reader knows (accepted: F64'),
    ("shape_mismatch", lambda p: write_raw(p, {"w": {"dtype": "BF16", "shape": [3, 3],
                                                     "data_offsets": [0, 16]}}, b"x" * 16),
     'tensor "w": shape [3,3] of BF16 is 18 bytes but data_offsets [0, 16] span 16'),
    ("nan_weight", lambda p: write_safetensors(p, {"model.layers.0.q.weight":
                                                   torch.tensor([[1.0, float("nan")]])}),
     "non-finite value"),
]


@pytest.mark.parametrize("case,make,expected", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_checkpoint_is_refused_and_harms_nobody(daemon, tmp_path, case, make, expected):
    good = tmp_path / "good.safetensors"
    write_safetensors(good, block_tensors())
    keeper = load_base(str(good), "nf4", socket=daemon.socket)
    bad = tmp_path / f"{case}.safetensors"
    make(bad)
    with pytest.raises(control.InvalidArgument) as e:
        load_base(str(bad), "nf4", socket=daemon.socket)
    assert expected in str(e.value) and str(bad) in str(e.value), str(e.value)
    # The daemon still serves, the other session's base is intact, nothing leaked.
    assert daemon.ctl("ping").returncode == 0
    st = daemon.status()
    assert [b["key"] for b in st["bases"]] == [keeper.key] and st["bases"][0]["refcount"] == 1
    assert st["budget"]["used"] == sum(s["bytes"] for s in st["segments"])
    assert torch.equal(keeper.tensor("model.norm.weight"), block_tensors()["model.norm.weight"])
    keeper.release()


def test_bad_requests_name_the_field(daemon, tmp_path):
    write_safetensors(tmp_path / "m.safetensors", block_tensors())
    c = control.Client.connect(daemon.socket)
    with pytest.raises(control.InvalidArgument, match="format: 'q3' is not a base format"):
        c.load_base(str(tmp_path), "q3")
    with pytest.raises(control.InvalidArgument, match="block_size"):
        c.load_base(str(tmp_path), "nf4", 7)
    with pytest.raises(control.NotFound, match="No such file"):
        c.load_base(str(tmp_path / "missing"))
    os.mkfifo(tmp_path / "fifo.safetensors")
    with pytest.raises(control.InvalidArgument, match="not a regular file"):
        c.load_base(str(tmp_path / "fifo.safetensors"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(control.NotFound, match="no model.safetensors.index.json"):
        c.load_base(str(tmp_path / "empty"))
    with pytest.raises(control.NotFound, match="no base 'nope'"):
        c.drop_base("nope")
    with pytest.raises(ValueError, match="format='q3'"):
        load_base(str(tmp_path), "q3", socket=daemon.socket)
    with pytest.raises(ValueError, match="register_cuda='x'"):
        load_base(str(tmp_path), socket=daemon.socket, register_cuda="x")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client under another uid")
def test_path_is_checked_with_the_callers_credentials(daemon_factory):
    import grp
    import pathlib
    import shutil
    import tempfile
    d = daemon_factory("--allow-group", grp.getgrgid(NOBODY).gr_name)
    os.chmod(d.socket, 0o666)
    os.chmod(d.shm_dir, 0o1777)
    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="ts-perm-", dir="/tmp"))  # pytest's is 0700
    os.chmod(tmp_path, 0o755)
    secret = tmp_path / "secret.safetensors"
    public = tmp_path / "public.safetensors"
    write_safetensors(secret, block_tensors())
    write_safetensors(public, block_tensors())
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)

    def ctl_as_nobody(*args):
        def drop():
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        return subprocess.run([str(d.bin_dir / "trainstreamctl"), "--socket", d.socket, *args],
                              capture_output=True, text=True, timeout=60, preexec_fn=drop)

    r = ctl_as_nobody("base", "load", str(secret))
    assert r.returncode == 4 and "PERMISSION_DENIED" in r.stderr, r.stderr
    assert f"permission denied for uid {NOBODY}" in r.stderr and str(secret) in r.stderr
    # root (the daemon's own identity) could read it: the check used the caller's.
    assert d.status()["bases"] == []
    r = ctl_as_nobody("base", "load", str(public), "--format", "nf4", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    st = os.stat(os.path.join(d.shm_dir, info["segment"]))
    # Note [Who may open a segment]: root's, readable by its owner through an ACL
    # (the owner's own 0400 file where the file system has no ACLs).
    assert (st.st_uid, st.st_mode & 0o777) in ((0, 0o440), (NOBODY, 0o400)), st
    assert info["owner_uid"] == NOBODY
    # Another uid does not see or drop it.
    assert d.ctl("base", "list", "--json").returncode == 0  # root: admin sees all
    r = ctl_as_nobody("base", "drop", info["key"])
    assert r.returncode == 0, r.stderr
    shutil.rmtree(tmp_path)


def _child_script(socket, path, fmt, out):
    return textwrap.dedent(f"""
        import json, sys, time
        import torch
        from trainstream.frozen.shared_base import load_base
        import trainstream._C, trainstream._control  # loaded before the first measurement
        def status():
            d = {{}}
            for line in open('/proc/self/status'):
                k, v = line.split(':', 1)
                if k in ('VmRSS', 'RssAnon', 'RssFile', 'RssShmem'):
                    d[k] = int(v.split()[0]) * 1024
            return d
        before = status()
        base = load_base({path!r}, {fmt!r}, socket={socket!r})
        total = 0
        for name in base.names():   # touch every byte of every view
            t = base.quantized(name).data if base.is_quantized(name) else base.tensor(name)
            total += int(t.view(torch.uint8).sum()) if t.numel() else 0
        after = status()
        json.dump({{"before": before, "after": after, "key": base.key,
                   "segment_bytes": base.info["segment_bytes"], "sum": total}}, open({out!r}, "w"))
        print("ready", flush=True)
        sys.stdin.readline()
    """)


def test_two_processes_share_one_copy(daemon, tmp_path):
    g = torch.Generator().manual_seed(3)
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(2048, 1024, generator=g).bfloat16()
               for i in range(8)}  # 32 MiB of bf16
    write_safetensors(tmp_path / "m.safetensors", tensors)
    env = dict(os.environ)
    procs, outs = [], []
    for i in range(2):
        out = tmp_path / f"out{i}.json"
        p = subprocess.Popen([sys.executable, "-c", _child_script(daemon.socket, str(tmp_path), "none",
                                                                   str(out))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert p.stdout.readline().strip() == "ready"
        procs.append(p)
        outs.append(json.loads(out.read_text()))
    try:
        seg = outs[0]["segment_bytes"]
        assert outs[0]["key"] == outs[1]["key"] and outs[0]["sum"] == outs[1]["sum"]
        st = daemon.status()
        assert len(st["bases"]) == 1 and st["bases"][0]["refcount"] == 2
        base_files = [s for s in st["segments"] if s["kind"] == "base"]
        assert len(base_files) == 1
        # The machine holds one copy: the daemon's shm dir has one base file of `seg`
        # bytes, and neither process copied the weights into its private memory.
        on_disk = sum(os.stat(os.path.join(daemon.shm_dir, s["name"])).st_blocks * 512
                      for s in base_files)
        assert seg <= on_disk < seg + (1 << 20)
        for o in outs:
            anon = o["after"]["RssAnon"] - o["before"]["RssAnon"]
            shmem = o["after"]["RssShmem"] - o["before"]["RssShmem"]
            assert shmem >= 0.9 * 32 * 2**20, o   # it maps and reads the shared pages...
            assert anon < 0.25 * 32 * 2**20, o    # ...without a private copy
        print(f"\nbase {seg} bytes; per process RssShmem +"
              f"{[o['after']['RssShmem'] - o['before']['RssShmem'] for o in outs]}, RssAnon +"
              f"{[o['after']['RssAnon'] - o['before']['RssAnon'] for o in outs]}")
    finally:
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
            p.wait(timeout=30)
    wait_until(lambda: daemon.status()["bases"][0]["refcount"] == 0, 10, what="refcount 0")


def test_session_death_releases_its_reference(daemon, tmp_path):
    write_safetensors(tmp_path / "m.safetensors", block_tensors())
    out = tmp_path / "o.json"
    p = subprocess.Popen([sys.executable, "-c", _child_script(daemon.socket, str(tmp_path), "nf4",
                                                               str(out))],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    assert daemon.status()["bases"][0]["refcount"] == 1
    p.kill()
    p.wait()
    wait_until(lambda: daemon.status()["bases"][0]["refcount"] == 0, 10, what="refcount 0")
    # Unreferenced bases stay cached until dropped or evicted.
    assert len(daemon.status()["bases"]) == 1


def _mib_file(path, mib, seed):
    g = torch.Generator().manual_seed(seed)
    write_safetensors(path, {"model.layers.0.w.weight":
                             torch.randn(mib * 512, 1024, generator=g).bfloat16()})


def test_eviction_takes_unreferenced_lru_bases_never_referenced_ones(daemon_factory, tmp_path):
    d = daemon_factory("--budget", "40M")
    paths = []
    for i in range(5):
        paths.append(tmp_path / f"m{i}.safetensors")
        _mib_file(paths[-1], 10, i)  # 10 MiB each (+ header pages)
    c = control.Client.connect(d.socket)
    held = load_base(str(paths[0]), socket=d.socket)          # referenced
    k1 = c.load_base(str(paths[1]))["key"]                     # cached, unreferenced
    k2 = c.load_base(str(paths[2]))["key"]                     # cached, unreferenced
    c.load_base(str(paths[1]))                                 # k1 is now more recent than k2
    k3 = c.load_base(str(paths[3]))["key"]                     # needs room: evicts k2 (LRU)
    keys = {b["key"] for b in c.list_bases()}
    assert keys == {held.key, k1, k3} and k2 not in keys, keys
    # A session allocation evicts unreferenced bases too, never the held one.
    s = c.attach("alloc")
    s.allocate_region(25 << 20, "activations")
    keys = {b["key"] for b in c.list_bases()}
    assert held.key in keys and k1 not in keys and k3 not in keys, keys
    # Nothing unreferenced is left: the next base does not fit, and the held one stays.
    with pytest.raises(control.ResourceExhausted, match="memory budget exhausted"):
        c.load_base(str(paths[4]))
    assert {b["key"] for b in c.list_bases()} == {held.key}
    with pytest.raises(control.FailedPrecondition, match="in use by session"):
        c.drop_base(held.key)
    s.detach()
    held.release()
    wait_until(lambda: c.list_bases()[0]["refcount"] == 0, 10, what="refcount 0")
    assert c.drop_base(held.key) > 10 << 20
    assert c.list_bases() == []
    wait_until(lambda: d.status()["budget"]["used"] == 0, 10, what="budget back to 0")


def test_release_base_gives_the_reference_back(daemon, tmp_path):
    write_safetensors(tmp_path / "m.safetensors", block_tensors())
    c = control.Client.connect(daemon.socket)
    s = c.attach("r")
    info, region = s.load_base(str(tmp_path), "int8", 64)
    assert info["refcount"] == 1 and region.read_only and region.size == info["segment_bytes"]
    s.release_base(info["key"])
    assert c.list_bases()[0]["refcount"] == 0
    with pytest.raises(control.NotFound, match="holds no reference"):
        s.release_base(info["key"])
    s.detach()


def test_base_segment_is_read_only_for_clients(daemon, tmp_path):
    write_safetensors(tmp_path / "m.safetensors", block_tensors())
    base = load_base(str(tmp_path), socket=daemon.socket)
    try:
        path = os.path.join(daemon.shm_dir, base.info["segment_name"])
        assert (os.stat(path).st_mode & 0o777) == 0o400
        # A write through the view faults (PROT_READ): check it in a child.
        code = textwrap.dedent(f"""
            from trainstream.frozen.shared_base import load_base
            b = load_base({str(tmp_path)!r}, socket={daemon.socket!r})
            b.tensor("model.norm.weight").fill_(0)
        """)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
        assert r.returncode == -11, r  # SIGSEGV
        assert torch.equal(base.tensor("model.norm.weight"), block_tensors()["model.norm.weight"])
    finally:
        base.release()


def test_ctl_base_commands(daemon, tmp_path):
    write_safetensors(tmp_path / "m.safetensors", block_tensors())
    r = daemon.ctl("base", "load", str(tmp_path), "--format", "nf4")
    assert r.returncode == 0 and "loaded" in r.stdout and "4 quantized, nf4" in r.stdout, r
    r = daemon.ctl("base", "list")
    assert r.returncode == 0 and str(tmp_path) in r.stdout
    key = daemon.status()["bases"][0]["key"]
    r = daemon.ctl("status")
    assert "CACHED BASES (1)" in r.stdout and key in r.stdout
    r = daemon.ctl("base", "drop", key)
    assert r.returncode == 0 and "dropped" in r.stdout
    r = daemon.ctl("base", "load", str(tmp_path / "nope"))
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr


def test_concurrent_loads_of_one_base_load_it_once(daemon, tmp_path):
    import threading
    g = torch.Generator().manual_seed(9)
    write_safetensors(tmp_path / "m.safetensors",
                      {f"model.layers.{i}.w.weight": torch.randn(1024, 1024, generator=g).bfloat16()
                       for i in range(16)})
    results, errors = [], []

    def load():
        try:
            results.append(load_base(str(tmp_path), "nf4", socket=daemon.socket))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len({b.key for b in results}) == 1
    assert sum(not b.info["cached"] for b in results) == 1
    st = daemon.status()
    assert len(st["bases"]) == 1 and st["bases"][0]["refcount"] == 3
    for b in results:
        b.release()


def test_client_dying_mid_load_leaves_nothing_behind(daemon, tmp_path):
    # 2 GiB of holes: a load of seconds, long enough on any machine to be killed mid-way.
    _sparse_checkpoint(tmp_path / "m.safetensors")
    code = textwrap.dedent(f"""
        import trainstream._control as c
        client = c.Client.connect({daemon.socket!r})
        def progress(done, total, tensors, ntensors):
            print(tensors, ntensors, flush=True)
        client.load_base({str(tmp_path)!r}, "nf4", 64, progress)
        print("finished", flush=True)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    first = p.stdout.readline().split()
    p.kill()
    p.wait()
    assert first and first[0] != "finished" and int(first[0]) < int(first[1]), first
    # The load stops (cancelled), its segment and budget are freed, the key is not
    # left "loading": a new load of the same files works.
    wait_until(lambda: "cancelled" in daemon.log(), 30, what="the load to be cancelled")
    wait_until(lambda: daemon.status()["budget"]["used"] == 0, 30, what="budget back to 0")
    assert daemon.status()["bases"] == [] and daemon.segment_files() == []
    base = load_base(str(tmp_path), "nf4", socket=daemon.socket)
    assert base.info["tensors"] == 128 and not base.info["cached"]
    base.release()


# Crafted headers, and loads that must stop when asked (docs/base-cache.md, "Bad input"
# and "Cancelling a load").
MAX_TENSORS = 1 << 18  # kMaxTensors, daemon/base/safetensors.h


def _sparse_checkpoint(path, tensors=128, rows=2048, cols=4096):
    """`tensors` bf16 block weights of rows x cols whose bytes are a hole in the
    file (zeros: no disk is read): 2 GiB by default, a load of seconds that
    quantizes into a ~600 MB nf4 segment (under the fixtures' 1G budget)."""
    each = rows * cols * 2
    header = {f"model.layers.{i}.mlp.up_proj.weight":
              {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [i * each, (i + 1) * each]}
              for i in range(tensors)}
    raw = json.dumps(header).encode()
    write_raw(path, raw, b"")
    os.truncate(path, 8 + len(raw) + tensors * each)


def _start_load(load):
    """Runs load(progress) in a thread. Returns the thread, an Event set at the
    first progress event (or when the call ends), and the outcome: {"result": ...}
    or {"error": exception}."""
    first = threading.Event()
    outcome = {}

    def run():
        try:
            outcome["result"] = load(lambda *progress: first.set())
        except Exception as e:  # noqa: BLE001 (these loads are meant to fail; the tests read it)
            outcome["error"] = e
        first.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, first, outcome


def test_header_over_the_tensor_cap_is_refused(daemon, tmp_path):
    path = tmp_path / "many.safetensors"
    header = {f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
              for i in range(MAX_TENSORS)}
    header["last"] = {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}
    write_raw(path, header, b"x")
    with pytest.raises(control.InvalidArgument) as e:
        load_base(str(path), socket=daemon.socket)
    assert (f"lists {MAX_TENSORS + 1} tensors, more than the {MAX_TENSORS}" in str(e.value)
            and str(path) in str(e.value)), str(e.value)
    # One fewer is a checkpoint like any other (the parse is linear: a header
    # this size used to take minutes).
    del header["t0"]
    write_raw(path, header, b"x")
    base = load_base(str(path), socket=daemon.socket)
    assert base.info["tensors"] == MAX_TENSORS and base.tensor("last").tolist() == [ord("x")]
    base.release()


def _metadata_shards(folder, shards=64, header_mib=16):
    """A folder of `shards` hard links to one file whose header is `header_mib`
    MiB of __metadata__ and no tensor: every header must be parsed before the
    load can fail ("holds no tensors"), so planning alone takes many seconds."""
    os.makedirs(folder)
    entries = header_mib * (1 << 20) // 110
    raw = json.dumps({"__metadata__": {f"k{i}": "v" * 96 for i in range(entries)}}).encode()
    write_raw(f"{folder}/s0000.safetensors", raw, b"")
    for i in range(1, shards):
        os.link(f"{folder}/s0000.safetensors", f"{folder}/s{i:04d}.safetensors")


@pytest.mark.parametrize("phase", ["parsing_headers", "reading_tensors"])
def test_sigterm_during_a_load_stops_the_daemon_promptly(daemon, tmp_path, phase):
    client = control.Client.connect(daemon.socket)
    if phase == "parsing_headers":
        path = tmp_path / "shards"
        _metadata_shards(path)
        t, first, outcome = _start_load(lambda progress: client.load_base(str(path), "none", 64,
                                                                          progress))
        # No progress event while headers are parsed: the daemon's log says when.
        wait_until(lambda: "reading the headers of 64 files" in daemon.log(), 30,
                   what="the load to start")
    else:
        path = tmp_path / "big.safetensors"
        _sparse_checkpoint(path)
        t, first, outcome = _start_load(lambda progress: client.load_base(str(path), "nf4", 64,
                                                                          progress))
        assert first.wait(60), "the load sent no progress"
    assert "error" not in outcome, outcome
    sent = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    code = daemon.proc.wait(timeout=10)
    took = time.monotonic() - sent
    assert code == 0, daemon.log()
    t.join(10)
    # The load was stopped, not finished or refused, and left nothing behind.
    log = daemon.log()
    assert "result" not in outcome and "error" in outcome, outcome
    assert "base load cancelled: the daemon is shutting down" in log, log
    assert "loaded from" not in log and "holds no tensors" not in log, log
    assert daemon.segment_files() == []
    assert took < 10, took


def test_client_going_away_mid_load_gives_the_reservation_back(daemon, tmp_path):
    path = tmp_path / "big.safetensors"
    _sparse_checkpoint(path)
    # Another client holds memory, so "back to baseline" is not "back to zero".
    keeper = control.Client.connect(daemon.socket).attach("keeper")
    keeper.allocate_region(8 << 20, "held")
    baseline = daemon.status()["budget"]["used"]
    segments = daemon.segment_files()
    assert baseline >= 8 << 20
    code = textwrap.dedent(f"""
        import trainstream._control as c
        s = c.Client.connect({daemon.socket!r}).attach("loader")
        def progress(done, total, tensors, ntensors):
            print(tensors, ntensors, flush=True)
        s.load_base({str(path)!r}, "nf4", 64, progress)
        print("finished", flush=True)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    first = p.stdout.readline().split()
    assert first and first[0] != "finished", first
    wait_until(lambda: daemon.status()["budget"]["used"] > baseline, 30, what="the reservation")
    p.kill()  # its connection and its session go at once
    p.wait()
    wait_until(lambda: "base load cancelled: " in daemon.log(), 30, what="the load to stop")
    wait_until(lambda: daemon.status()["budget"]["used"] == baseline, 30,
               what="the budget back to its baseline")
    log = daemon.log()
    assert ("cancelled: the client went away" in log or "cancelled: its session ended" in log), log
    assert daemon.status()["bases"] == [] and daemon.segment_files() == segments
    keeper.detach()


def test_session_ending_mid_load_stops_its_load(daemon, tmp_path):
    path = tmp_path / "big.safetensors"
    _sparse_checkpoint(path)
    s = control.Client.connect(daemon.socket).attach("loader")
    t, first, outcome = _start_load(lambda progress: s.load_base(str(path), "nf4", 64, progress))
    assert first.wait(60) and "error" not in outcome, outcome
    s.detach()  # ends the session; the load's own call stays open
    t.join(30)
    assert "result" not in outcome and "error" in outcome, outcome
    assert "base load cancelled: its session ended" in daemon.log(), daemon.log()
    wait_until(lambda: daemon.status()["budget"]["used"] == 0, 30, what="budget back to 0")
    assert daemon.status()["bases"] == [] and daemon.segment_files() == []
