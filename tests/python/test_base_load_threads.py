"""The daemon reads and quantizes a base on several threads (docs/base-cache.md,
"Loading, memory and speed"). The segment a load writes is the same byte for byte with
1 thread and with N, for every format, and its quantized tensors are quantize_tensor's;
the daemon caps the threads at its load_threads; progress reaches the caller's callback,
and the built-in bar draws only where it should."""
import ctypes
import io
import json
import sys

import pytest
import torch

from safetensors_writer import write_safetensors

import trainstream._control as control
from trainstream.frozen.load_progress import LoadProgressBar, check_progress, resolve_progress
from trainstream.frozen.quantization import quantize_tensor
from trainstream.frozen.shared_base import FORMATS, load_base

SEGMENT_HEADER_BYTES = 4096  # the header holds the creation time; the rest must match


def big_tensors():
    """Block weights larger than a piece (1 MiB) (none a whole number of blocks), in three
    dtypes, and small ones."""
    g = torch.Generator().manual_seed(4)
    return {
        "model.embed_tokens.weight": torch.randn(300, 64, generator=g).bfloat16(),
        "model.layers.0.mlp.up_proj.weight": torch.randn(1537, 2050, generator=g).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.rand(64, generator=g).bfloat16(),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(40, 25, generator=g).half(),
        "model.layers.1.mlp.down_proj.weight": torch.randn(700, 1601, generator=g),
        "model.layers.1.self_attn.q_proj.weight": torch.randn(1200, 1999, generator=g).half(),
        "model.norm.weight": torch.rand(64, generator=g).bfloat16(),
    }


def segment_bytes(base) -> bytes:
    r = base._region
    return ctypes.string_at(r.address + SEGMENT_HEADER_BYTES, r.size - SEGMENT_HEADER_BYTES)


def load_drop(socket, path, fmt, threads):
    """Loads, copies the segment out, releases and drops it: (info, bytes, tensors)."""
    base = load_base(path, fmt, 64, socket=socket, threads=threads, progress=False)
    try:
        info = dict(base.info)
        raw = segment_bytes(base)
        quantized = {n: base.quantized(n) for n in base.names() if base.is_quantized(n)}
        quantized = {n: (q.data.clone(), q.scales.clone(), q.tensor_scale.clone())
                     for n, q in quantized.items()}
    finally:
        base.release()
    control.Client.connect(socket, 2000).drop_base(info["key"])
    return info, raw, quantized


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_and_four_threads_write_the_same_segment(daemon_factory, tmp_path, fmt):
    d = daemon_factory("--load-threads", "4")
    tensors = big_tensors()
    path = str(tmp_path / "m.safetensors")
    write_safetensors(path, tensors)
    one, one_raw, one_q = load_drop(d.socket, path, fmt, 1)
    four, four_raw, four_q = load_drop(d.socket, path, fmt, 4)
    assert (one["load_threads"], four["load_threads"]) == (1, 4)
    assert one["key"] == four["key"]
    assert len(one_raw) == len(four_raw)
    assert one_raw == four_raw, "the segments differ"
    assert four["quantized_tensors"] == (0 if fmt == "none" else 4)
    for name, (data, scales, tensor_scale) in four_q.items():
        ref = quantize_tensor(tensors[name], fmt, 64)
        assert torch.equal(data, ref.data), name
        assert torch.equal(scales, ref.scales), name
        assert torch.equal(tensor_scale, ref.tensor_scale), name
    assert one_q.keys() == four_q.keys()
    if fmt != "none":
        # One piece of scratch per thread (1 MiB of checkpoint, plus the fp32 copy of
        # an F16 piece), not a tensor per thread.
        assert 0 < four["scratch_peak_bytes"] <= 4 * (1 << 20) * 3
        assert one["scratch_peak_bytes"] <= (1 << 20) * 3
    assert four["allocate_seconds"] <= four["load_seconds"]


def test_the_daemon_caps_the_threads_at_its_load_threads(daemon_factory, tmp_path):
    d = daemon_factory("--load-threads", "2")
    path = str(tmp_path / "m.safetensors")
    write_safetensors(path, big_tensors())
    c = control.Client.connect(d.socket, 2000)
    info = c.load_base(path, "nf4", 64, None, 8)
    assert info["load_threads"] == 2
    c.drop_base(info["key"])
    info = c.load_base(path, "nf4", 64)  # 0: the daemon's load_threads
    assert info["load_threads"] == 2
    r = d.ctl("base", "load", path, "--format", "int8", "--threads", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["load_threads"] == 1 and out["allocate_seconds"] >= 0
    r = d.ctl("base", "load", path, "--format", "fp8")
    assert r.returncode == 0 and "on 2 threads" in r.stdout, r.stdout


def test_progress_reaches_the_callback(daemon, tmp_path):
    path = str(tmp_path / "m.safetensors")
    tensors = big_tensors()
    write_safetensors(path, tensors)
    calls = []
    base = load_base(path, "nf4", socket=daemon.socket, progress=lambda *a: calls.append(a))
    try:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        assert calls, "no progress was reported"
        assert calls[-1] == (total, total, len(tensors), len(tensors))
        assert all(a[0] <= b[0] and a[2] <= b[2] for a, b in zip(calls, calls[1:]))
    finally:
        base.release()


def test_bad_threads_and_progress_are_value_errors(tmp_path):
    for bad in (0, -1, 4097, 1.5, True, "2"):
        with pytest.raises(ValueError, match="threads="):
            load_base(str(tmp_path / "m.safetensors"), threads=bad)
    for bad in ("yes", 3, object()):
        with pytest.raises(ValueError, match="progress="):
            check_progress(bad)
    for good in ("auto", True, False, None, print):
        check_progress(good)


def test_auto_progress_draws_only_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal
    callback, close = resolve_progress("auto", "loading")
    assert callback is None
    close()
    callback, close = resolve_progress(True, "loading")
    assert isinstance(callback, LoadProgressBar)
    own = print
    assert resolve_progress(own, "loading")[0] is own
    assert resolve_progress(False, "loading")[0] is None


def test_the_bar_without_tqdm_is_one_plain_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import fails
    out = io.StringIO()
    bar = LoadProgressBar("loading nf4 base", stream=out)
    bar(0, 0, 0, 10)  # headers still being read: nothing to draw
    assert out.getvalue() == ""
    bar(5 * 10**9, 10 * 10**9, 4, 10)
    bar(10 * 10**9, 10 * 10**9, 10, 10)  # the last one is always drawn
    bar.close()
    text = out.getvalue()
    assert "\rloading nf4 base: 5.00/10.00 GB (50%)" in text
    assert "10.00/10.00 GB (100%)" in text and "10/10 tensors" in text
    assert text.endswith("\n") and text.count("\n") == 1


def test_the_bar_with_tqdm_counts_bytes():
    pytest.importorskip("tqdm")
    out = io.StringIO()
    bar = LoadProgressBar("loading", stream=out)
    bar(1000, 4000, 1, 4)
    bar(4000, 4000, 4, 4)
    assert bar._bar.n == 4000 and bar._bar.total == 4000
    bar.close()
    assert "loading" in out.getvalue() and "4/4 tensors" in out.getvalue()
