"""share_vram: one VRAM copy of a base per GPU, shared through CUDA IPC
(docs/base-cache.md, "share_vram").

On a machine without a GPU (or a daemon built without CUDA) the request is refused
with FAILED_PRECONDITION naming why, and the daemon stays healthy. On a GPU host two
processes that share one base on one GPU see the base's VRAM counted once, and the
tensors they view equal the host base byte for byte."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import wait_until
from safetensors_writer import write_qwen_folder, write_safetensors

import trainstream._control as control
from trainstream.frozen.shared_base import load_base

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _write_base(path, mib: int, seed: int = 0) -> dict:
    """`mib` MiB of bf16 block weights (1 MiB per 512x1024 tensor)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {f"model.layers.{i}.mlp.up_proj.weight":
               torch.randn(512, 1024, generator=g).bfloat16() for i in range(mib)}
    write_safetensors(path, tensors)
    return tensors


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


@no_gpu
def test_share_vram_without_a_gpu_is_refused_clearly(daemon, tmp_path):
    _write_base(tmp_path / "m.safetensors", 2)
    client = control.Client.connect(daemon.socket)
    s = client.attach(job="vram")
    info, _region = s.load_base(str(tmp_path), "none", 64)
    # Nothing so far asked for VRAM: the daemon has not loaded the CUDA driver.
    assert "libcuda.so" not in _maps(daemon.proc.pid)

    # A base the session holds no reference to is refused before any CUDA call.
    with pytest.raises(control.NotFound, match="holds no reference to base 'nope'"):
        s.share_base_vram("nope", "", 0)
    with pytest.raises(control.FailedPrecondition,
                       match=r"share_vram: (this trainstreamd was built without CUDA|"
                             r"trainstreamd sees no usable CUDA device)") as e:
        s.share_base_vram(info["key"], "", 0)
    assert "load the base without share_vram" in str(e.value)
    # The same again (the daemon cleared CUDA's error state), and by bus id.
    with pytest.raises(control.FailedPrecondition, match="share_vram"):
        s.share_base_vram(info["key"], "0000:01:00.0", -1)

    # The daemon is healthy: nothing was allocated, the reference is intact, and
    # other work goes on.
    assert client.ping()["pid"] == daemon.proc.pid
    (b,) = client.list_bases()
    assert (b["refcount"], b["vram_copies"], b["vram_bytes"]) == (1, 0, 0)
    other = tmp_path / "other"
    other.mkdir()
    _write_base(other / "m.safetensors", 1, seed=1)
    info2, _ = s.load_base(str(other), "int8", 64)
    assert info2["key"] != info["key"]
    s.release_base(info["key"])
    s.release_base(info2["key"])
    assert [x["refcount"] for x in client.list_bases()] == [0, 0]
    s.detach()


@no_gpu
def test_load_base_with_share_vram_fails_and_keeps_no_reference(daemon, tmp_path):
    _write_base(tmp_path / "m.safetensors", 1)
    with pytest.raises(RuntimeError, match="share_vram needs"):
        load_base(str(tmp_path), socket=daemon.socket, share_vram=True)
    client = control.Client.connect(daemon.socket)
    wait_until(lambda: [b["refcount"] for b in client.list_bases()] == [0], 10,
               what="the failed load's reference to be given back")
    with pytest.raises(ValueError, match="share_vram needs a CUDA device, not cpu"):
        load_base(str(tmp_path), socket=daemon.socket, share_vram="cpu")
    base = load_base(str(tmp_path), socket=daemon.socket)
    with pytest.raises(ValueError, match="device=False"):
        base.share_vram(False)
    with pytest.raises(ValueError, match="has no VRAM copy on cuda:0"):
        base.tensor(base.names()[0], device="cuda:0")
    assert base.tensor(base.names()[0], device="cpu").data_ptr() == \
        base.tensor(base.names()[0]).data_ptr()
    base.release()


def _vram_child(socket, path, out):
    return textwrap.dedent(f"""
        import json, sys
        import torch
        from trainstream.frozen.shared_base import load_base
        torch.cuda.init()
        torch.empty(1, device="cuda")          # the context exists before the first reading
        free0, total = torch.cuda.mem_get_info()
        base = load_base({path!r}, "none", socket={socket!r}, share_vram=True)
        views = {{n: base.tensor(n, device="cuda") for n in base.names()}}
        torch.cuda.synchronize()
        free1, _ = torch.cuda.mem_get_info()
        vram = base.share_vram()
        same = bool(torch.equal(vram.cpu(), base._bytes))
        views_ok = all(torch.equal(v.cpu(), base.tensor(n)) for n, v in views.items())
        inside = all(vram.data_ptr() <= v.data_ptr() < vram.data_ptr() + vram.numel()
                     for v in views.values())
        json.dump({{"free_before": free0, "free_after": free1, "total": total,
                   "segment_bytes": base.info["segment_bytes"], "share": {{
                       k: v for k, v in base.vram_info[vram.device.index].items()
                       if k != "ipc_handle"}},
                   "same": same, "views_ok": views_ok, "inside": inside}}, open({out!r}, "w"))
        print("ready", flush=True)
        sys.stdin.readline()
    """)


@needs_gpu
def test_two_processes_share_one_vram_copy(daemon, tmp_path):
    _write_base(tmp_path / "m.safetensors", 512)  # 512 MiB of bf16
    assert "libcuda.so" not in _maps(daemon.proc.pid)  # no CUDA before share_vram
    procs, outs = [], []
    try:
        for i in range(2):
            out = tmp_path / f"out{i}.json"
            p = subprocess.Popen([sys.executable, "-c",
                                  _vram_child(daemon.socket, str(tmp_path), str(out))],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            procs.append(p)
            assert p.stdout.readline().strip() == "ready", f"child {i} failed"
            outs.append(json.loads(out.read_text()))
        assert "libcuda.so" in _maps(daemon.proc.pid)
        seg = outs[0]["segment_bytes"]
        grow = [o["free_before"] - o["free_after"] for o in outs]
        print(f"\nbase {seg} bytes; device-wide VRAM growth seen by process 1: {grow[0]}, "
              f"by process 2: {grow[1]}; shares {[o['share'] for o in outs]}")
        for o in outs:
            assert o["same"] and o["views_ok"] and o["inside"], o
        assert outs[0]["share"]["cached"] is False and outs[1]["share"]["cached"] is True
        assert outs[1]["share"]["holders"] == 2
        # The first request made the daemon's copy (the whole segment)...
        assert grow[0] >= seg, grow
        # ...and the second process's VRAM grew by far less than the base.
        assert grow[1] < seg / 8, grow
        client = control.Client.connect(daemon.socket)
        (b,) = client.list_bases()
        assert (b["refcount"], b["vram_copies"], b["vram_bytes"]) == (2, 1, seg)
    finally:
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
            p.wait(timeout=60)
    client = control.Client.connect(daemon.socket)
    wait_until(lambda: [(b["refcount"], b["vram_copies"]) for b in client.list_bases()] == [(0, 0)],
               15, what="the VRAM copy to be freed once both sessions ended")


@needs_gpu
def test_share_vram_bad_device_and_model_on_gpu(daemon, tmp_path):
    pytest.importorskip("transformers")
    from trainstream.integrations.huggingface import load_model
    from trainstream.frozen.quantization import QuantLinear
    client = control.Client.connect(daemon.socket)
    _write_base(tmp_path / "m.safetensors", 1)
    s = client.attach(job="vram")
    info, _ = s.load_base(str(tmp_path), "none", 64)
    with pytest.raises(control.InvalidArgument, match="no CUDA device 99"):
        s.share_base_vram(info["key"], "", 99)
    with pytest.raises(control.InvalidArgument, match="no CUDA device with PCI bus id"):
        s.share_base_vram(info["key"], "0000:ff:1f.7", -1)
    assert client.ping()["pid"] == daemon.proc.pid
    s.detach()

    folder = tmp_path / "model"
    folder.mkdir()
    write_qwen_folder(folder)
    cpu_model = load_model(str(folder), quantize="nf4", socket=daemon.socket)
    gpu_model = load_model(str(folder), quantize="nf4", socket=daemon.socket, share_vram=True)
    vram = gpu_model.trainstream_base.share_vram()
    up = gpu_model.model.layers[0].mlp.up_proj
    assert isinstance(up, QuantLinear) and up.qdata.is_cuda
    assert vram.data_ptr() <= up.qdata.data_ptr() < vram.data_ptr() + vram.numel()
    assert all(p.is_cuda for p in gpu_model.parameters())
    assert gpu_model.trainstream_load["vram_device"] == str(vram.device)
    tokens = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        cpu = cpu_model(tokens).logits.float()
        gpu = gpu_model(tokens.cuda()).logits.float().cpu()
    assert torch.allclose(cpu, gpu, rtol=5e-2, atol=5e-2), (cpu - gpu).abs().max()
    gpu_model.trainstream_base.release()
    cpu_model.trainstream_base.release()
