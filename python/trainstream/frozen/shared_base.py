"""Frozen bases shared through the daemon (docs/base-cache.md).

    base = trainstream.base.load_base("/models/qwen2.5-14b", format="nf4")
    w = base.tensor("model.embed_tokens.weight")          # a view, no copy
    q = base.quantized("model.layers.0.mlp.up_proj.weight")  # QuantizedTensor of views

The daemon reads the checkpoint once (quantizing the block-stack linear weights
when ``format`` is given) into a read-only shared-memory segment; every process
on the machine that loads the same files with the same format maps that one
copy. A ``SharedBase`` holds its session's reference: the daemon keeps the base
while any session holds it, and may evict it (least recently used) once none
does and memory is needed.

With ``share_vram`` the daemon also copies the base once to a GPU and hands out a
CUDA IPC handle; every process on that GPU views the one VRAM copy:

    base = trainstream.base.load_base(path, format="nf4", share_vram=True)
    w = base.tensor("model.layers.0.self_attn.o_proj.weight", device="cuda")  # a VRAM view
"""
from __future__ import annotations

import ctypes
import json
import struct
import warnings
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from .._native import C
from .._native.wire import BASE_MANIFEST_HEADER_BYTES as _MANIFEST_HEADER_BYTES
from .._native.wire import BASE_MANIFEST_MAGIC as _MANIFEST_MAGIC
from .._native.wire import SEGMENT_MAGIC as _SEGMENT_MAGIC
from .._native.wire import SEGMENT_MANIFEST_OFFSET_FIELD as _MANIFEST_OFFSET_FIELD
from ..errors import DaemonError
from .load_progress import resolve_progress

__all__ = ["SharedBase", "load_base", "FORMATS"]

FORMATS = ("none", "int8", "nf4", "fp8", "nvfp4")

_TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _cuda_device(device: Any) -> torch.device:
    """``device`` (True, None, an index, "cuda[:N]" or a torch.device) as a CUDA
    device with its index, or ValueError."""
    if device is True or device is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return torch.device("cuda", index)
    if isinstance(device, bool):
        raise ValueError(f"device={device!r}: give True, a CUDA index or 'cuda:N'")
    try:
        d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r}: give a CUDA device (an index or 'cuda:N')") from None
    if d.type != "cuda":
        raise ValueError(f"device={device!r}: share_vram needs a CUDA device, not {d.type}")
    if d.index is None:
        d = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return d


def _check_format(format: Any) -> str:
    if format is None:
        return "none"
    if not isinstance(format, str) or format not in FORMATS:
        raise ValueError(f"format={format!r}: use one of {', '.join(FORMATS)}")
    return format


class SharedBase:
    """A base mapped read-only from the daemon. Tensors it returns are views of
    the shared mapping: keep this object alive while they are used (models that
    ``load_model`` builds hold it as ``model.trainstream_base``)."""

    def __init__(self, session, info: Dict[str, Any], region, owns_session: bool = False):
        self.session = session
        self.info = info
        self.key: str = info["key"]
        self._region = region
        self._owns_session = owns_session
        self._released = False
        addr, size = region.address, region.size
        magic, = struct.unpack_from("<I", ctypes.string_at(addr, 4))
        if magic != _SEGMENT_MAGIC:
            raise DaemonError(f"base segment {region.segment_name} has no segment header")
        moff, mbytes = struct.unpack("<QQ", ctypes.string_at(addr + _MANIFEST_OFFSET_FIELD, 16))
        if moff + mbytes > size or mbytes < _MANIFEST_HEADER_BYTES:
            raise DaemonError(f"base segment {region.segment_name}: manifest out of range")
        mmagic, _version, json_bytes, _data = struct.unpack("<IIQQ", ctypes.string_at(addr + moff, 24))
        if mmagic != _MANIFEST_MAGIC or _MANIFEST_HEADER_BYTES + json_bytes > mbytes:
            raise DaemonError(f"base segment {region.segment_name}: bad manifest")
        self.manifest = json.loads(ctypes.string_at(addr + moff + _MANIFEST_HEADER_BYTES, json_bytes))
        self.entries: Dict[str, Dict[str, Any]] = {t["name"]: t for t in self.manifest["tensors"]}
        _C = C()
        # One uint8 tensor over the whole (read-only) segment; every tensor is a view of it.
        self._bytes = _C.tensor_from_address(addr, [size], "uint8")
        self._cuda_chunks: List[int] = []  # addresses registered with CUDA
        # share_vram: per CUDA device index, one uint8 tensor over the daemon's VRAM
        # copy of the whole segment (same offsets as self._bytes), and what the
        # daemon answered.
        self._vram: Dict[int, torch.Tensor] = {}
        self.vram_info: Dict[int, Dict[str, Any]] = {}

    def share_vram(self, device: Any = True) -> torch.Tensor:
        """The daemon's VRAM copy of this base on ``device`` (True: the current CUDA
        device), opened through CUDA IPC: a uint8 CUDA tensor over the whole segment.
        The first process asking for a GPU makes the daemon copy the base there; the
        others map the same memory, so the base's VRAM is counted once per GPU. The
        copy lives while any session that asked for it holds the base."""
        _C = C()
        dev = _cuda_device(device)
        if dev.index in self._vram:
            return self._vram[dev.index]
        if self._released:
            raise RuntimeError(f"base {self.key} was released")
        if not getattr(_C, "with_cuda", False):
            raise RuntimeError("share_vram needs CUDA: trainstream._C was built without it "
                               "(load the base without share_vram)")
        if not torch.cuda.is_available():
            raise RuntimeError("share_vram needs a CUDA device in this process, and "
                               "torch.cuda.is_available() is False (load the base without "
                               "share_vram)")
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={dev}: this process sees {torch.cuda.device_count()} "
                             "CUDA device(s)")
        torch.cuda.init()  # the context must exist before the handle is opened
        share = self.session.share_base_vram(self.key, _C.cuda_pci_bus_id(dev.index), -1)
        if share["bytes"] != self._region.size:
            raise DaemonError(f"base {self.key}: the daemon's VRAM copy has {share['bytes']} "
                              f"bytes, the segment {self._region.size}")
        self._vram[dev.index] = _C.open_ipc_handle(share["ipc_handle"], share["bytes"],
                                                   dev.index)
        self.vram_info[dev.index] = share
        return self._vram[dev.index]

    def _raw(self, device: Any) -> torch.Tensor:
        if device is None:
            return self._bytes
        d = torch.device(device)
        if d.type == "cpu":
            return self._bytes
        dev = _cuda_device(d)
        if dev.index not in self._vram:
            raise ValueError(f"base {self.key} has no VRAM copy on {dev}: call "
                             "share_vram(device) first (or load_base(..., share_vram=...))")
        return self._vram[dev.index]

    @property
    def cuda_registered(self) -> bool:
        return bool(self._cuda_chunks)

    def register_cuda(self) -> Tuple[bool, str]:
        """Registers the mapping with CUDA read-only (cudaHostRegisterReadOnly, in
        chunks of at most 64 GiB), so copies to the GPU run at pinned speed. Returns
        (registered, why not). Costs about 0.8 s/GiB once per process (docs/design.md, "Measured facts")."""
        _C = C()
        if self._cuda_chunks:
            return True, ""
        if not getattr(_C, "with_cuda", False) or not torch.cuda.is_available():
            return False, "no CUDA device (or trainstream._C built without CUDA)"
        addr, size, chunk = self._region.address, self._region.size, 64 << 30
        for start in range(0, size, chunk):
            ok, why = _C.register_host(addr + start, min(chunk, size - start), read_only=True)
            if not ok:
                self._unregister_cuda()
                return False, why
            self._cuda_chunks.append(addr + start)
        return True, ""

    def _unregister_cuda(self) -> None:
        _C = C()
        for a in self._cuda_chunks:
            _C.unregister_host(a)
        self._cuda_chunks = []

    @property
    def format(self) -> str:
        return self.manifest["format"]

    def names(self) -> List[str]:
        return list(self.entries)

    def is_quantized(self, name: str) -> bool:
        return "quant" in self._entry(name)

    def _entry(self, name: str) -> Dict[str, Any]:
        try:
            return self.entries[name]
        except KeyError:
            raise KeyError(f"base {self.key} has no tensor {name!r}") from None

    def _view(self, offset: int, nbytes: int, dtype: torch.dtype, shape,
              raw: Optional[torch.Tensor] = None) -> torch.Tensor:
        raw = (self._bytes if raw is None else raw)[offset:offset + nbytes]
        if dtype != torch.uint8:
            raw = raw.view(dtype)
        return raw.view(tuple(shape))

    def tensor(self, name: str, device: Union[None, str, torch.device] = None) -> torch.Tensor:
        """The stored tensor, as a view (raises for quantized tensors: use
        ``quantized`` or ``dequantized``). ``device`` None / "cpu": a read-only view of
        the host mapping; a CUDA device: a view of the VRAM copy (``share_vram``),
        which is writable but shared: never write to it."""
        e = self._entry(name)
        if "quant" in e:
            raise ValueError(f"{name} is stored quantized ({e['quant']['format']}); use "
                             "quantized() or dequantized()")
        return self._view(e["offset"], e["bytes"], _TORCH_DTYPES[e["dtype"]], e["shape"],
                          self._raw(device))

    def quantized(self, name: str, device: Union[None, str, torch.device] = None):
        """A ``QuantizedTensor`` whose codes and scales are views of the base (of its
        VRAM copy when ``device`` is a CUDA device, as in ``tensor``)."""
        from .quantization import QuantizedTensor
        raw = self._raw(device)
        e = self._entry(name)
        q = e.get("quant")
        if q is None:
            raise ValueError(f"{name} is not quantized in base {self.key} (format "
                             f"{self.format}); use tensor()")
        data = self._view(q["data_offset"], q["data_bytes"], torch.uint8, [q["data_bytes"]], raw)
        scale_dtype = torch.float32 if q["scale_dtype"] == "F32" else torch.uint8
        n_scales = q["scales_bytes"] // (4 if scale_dtype == torch.float32 else 1)
        scales = self._view(q["scales_offset"], q["scales_bytes"], scale_dtype, [n_scales], raw)
        tensor_scale = self._view(q["tensor_scale_offset"], 4, torch.float32, [1], raw)
        return QuantizedTensor(data, scales, tensor_scale, e["shape"], q["format"],
                               q["block_size"], q["padding"], _TORCH_DTYPES[e["dtype"]])

    def dequantized(self, name: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """A new tensor in ``dtype`` (a copy, for either kind of entry)."""
        if self.is_quantized(name):
            return self.quantized(name).dequantize(dtype)
        return self.tensor(name).to(dtype, copy=True)

    def release(self) -> None:
        """Gives the session's reference back (views must not be used afterwards)."""
        if self._released:
            return
        self._released = True
        self._unregister_cuda()
        self._vram.clear()  # the IPC mapping closes once the last view is gone
        try:
            self.session.release_base(self.key)
        finally:
            if self._owns_session:
                self.session.detach()

    def __del__(self):
        # The mapping goes away with this object: drop its CUDA registration first.
        try:
            self._unregister_cuda()
        except Exception:  # noqa: BLE001 (interpreter shutdown: nothing left to report to)
            pass

    def __repr__(self) -> str:
        return (f"SharedBase(key={self.key!r}, format={self.format!r}, "
                f"tensors={len(self.entries)}, bytes={self.info['segment_bytes']})")


def check_load_threads(threads: Any, name: str) -> None:
    """ValueError unless ``threads`` is None or an integer in [1, 4096] (``name``: the
    option's name in the message)."""
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 4096:
        raise ValueError(f"{name}={threads!r}: use None (the daemon's load_threads) or an "
                         "integer in [1, 4096]")


def load_base(path: str, format: str = "none", block_size: int = 64, *,
              socket: Optional[str] = None, session=None, job: str = "",
              progress: Any = "auto", threads: Optional[int] = None,
              register_cuda: Any = "auto", share_vram: Any = False) -> SharedBase:
    """Loads (or finds cached) the checkpoint at ``path`` in the daemon and maps it.

    ``path``: a ``.safetensors`` file or a model folder. ``format``: "none" (keep
    the checkpoint's dtypes), "int8", "nf4", "fp8" or "nvfp4" (block-stack linear
    weights only). ``block_size``: int8 / nf4 (even, >= 2). ``session``: an attached
    ``_control.Session`` to hold the reference (default: a new one, ended by
    ``release()`` or when the process exits). ``progress``: "auto" (a bar on stderr
    when it is a terminal), True, False/None, or a callable ``progress(bytes_read,
    bytes_total, tensors_done, tensors_total)`` called while the daemon loads
    (``load_progress.py``). ``threads``: how many threads the daemon reads and
    quantizes on (None: its ``load_threads``, also the most it runs; the bytes do not
    depend on it).
    ``register_cuda``: "auto" registers the mapping with CUDA read-only when a GPU is
    present (a failure only warns), True requires it, False skips it. ``share_vram``:
    False, or a CUDA device (True: the current one) on which the daemon keeps one VRAM
    copy of the base for every process (``SharedBase.share_vram``); "auto" then skips
    the host registration, since the weights are read from VRAM.
    """
    if share_vram is not False:
        _cuda_device(share_vram)  # a bad value fails before anything is loaded
    if register_cuda not in ("auto", True, False):
        raise ValueError(f"register_cuda={register_cuda!r}: use 'auto', True or False")
    fmt = _check_format(format)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 \
            or block_size % 2:
        raise ValueError(f"block_size={block_size!r}: use an even integer >= 2 (int8 and nf4; "
                         "fp8 and nvfp4 use fixed blocks)")
    if not isinstance(path, str) or not path:
        raise ValueError(f"path={path!r}: give a .safetensors file or a model folder")
    check_load_threads(threads, "threads")
    callback, close_progress = resolve_progress(progress, f"loading {fmt} base")
    owns = session is None
    if owns:
        from .._native.daemon import connect
        session = connect(socket).attach(job=job or "load_base")
    try:
        info, region = session.load_base(path, fmt, block_size, callback, threads or 0)
    except Exception:
        if owns:
            session.detach()
        raise
    finally:
        close_progress()
    base = SharedBase(session, info, region, owns_session=owns)
    if share_vram is not False:
        try:
            base.share_vram(share_vram)
        except BaseException:
            base.release()
            raise
        if register_cuda == "auto":
            return base
    if register_cuda is not False and torch.cuda.is_available():
        ok, why = base.register_cuda()
        if not ok and register_cuda is True:
            base.release()
            raise RuntimeError(f"cannot register base {base.key} with CUDA: {why}")
        if not ok:
            warnings.warn(f"base {base.key} is not registered with CUDA ({why}): copies to "
                          "the GPU run at pageable speed", stacklevel=2)
    return base
