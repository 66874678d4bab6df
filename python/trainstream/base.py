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
"""
from __future__ import annotations

import ctypes
import json
import struct
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .errors import DaemonError

__all__ = ["SharedBase", "load_base", "FORMATS"]

FORMATS = ("none", "int8", "nf4", "fp8", "nvfp4")

_TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_SEGMENT_MAGIC = 0x54535347    # wire/segment_header.h
_MANIFEST_MAGIC = 0x54534246   # wire/base_manifest.h
_MANIFEST_OFFSET_FIELD = 120   # SegmentHeader.manifest_offset


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
        if moff + mbytes > size or mbytes < 64:
            raise DaemonError(f"base segment {region.segment_name}: manifest out of range")
        mmagic, _version, json_bytes, _data = struct.unpack("<IIQQ", ctypes.string_at(addr + moff, 24))
        if mmagic != _MANIFEST_MAGIC or 64 + json_bytes > mbytes:
            raise DaemonError(f"base segment {region.segment_name}: bad manifest")
        self.manifest = json.loads(ctypes.string_at(addr + moff + 64, json_bytes))
        self.entries: Dict[str, Dict[str, Any]] = {t["name"]: t for t in self.manifest["tensors"]}
        from . import _C
        # One uint8 tensor over the whole (read-only) segment; every tensor is a view of it.
        self._bytes = _C.tensor_from_address(addr, [size], "uint8")
        self._cuda_chunks: List[int] = []  # addresses registered with CUDA

    @property
    def cuda_registered(self) -> bool:
        return bool(self._cuda_chunks)

    def register_cuda(self) -> Tuple[bool, str]:
        """Registers the mapping with CUDA read-only (cudaHostRegisterReadOnly, in
        chunks of at most 64 GiB), so copies to the GPU run at pinned speed. Returns
        (registered, why not). Costs about 0.8 s/GiB once per process (DESIGN.md)."""
        from . import _C
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
        from . import _C
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

    def _view(self, offset: int, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
        raw = self._bytes[offset:offset + nbytes]
        if dtype != torch.uint8:
            raw = raw.view(dtype)
        return raw.view(tuple(shape))

    def tensor(self, name: str) -> torch.Tensor:
        """The stored tensor, as a read-only view (raises for quantized tensors:
        use ``quantized`` or ``dequantized``)."""
        e = self._entry(name)
        if "quant" in e:
            raise ValueError(f"{name} is stored quantized ({e['quant']['format']}); use "
                             "quantized() or dequantized()")
        return self._view(e["offset"], e["bytes"], _TORCH_DTYPES[e["dtype"]], e["shape"])

    def quantized(self, name: str):
        """A ``QuantizedTensor`` whose codes and scales are views of the base."""
        from .quantization import QuantizedTensor
        e = self._entry(name)
        q = e.get("quant")
        if q is None:
            raise ValueError(f"{name} is not quantized in base {self.key} (format "
                             f"{self.format}); use tensor()")
        data = self._view(q["data_offset"], q["data_bytes"], torch.uint8, [q["data_bytes"]])
        scale_dtype = torch.float32 if q["scale_dtype"] == "F32" else torch.uint8
        n_scales = q["scales_bytes"] // (4 if scale_dtype == torch.float32 else 1)
        scales = self._view(q["scales_offset"], q["scales_bytes"], scale_dtype, [n_scales])
        tensor_scale = self._view(q["tensor_scale_offset"], 4, torch.float32, [1])
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
        try:
            self.session.release_base(self.key)
        finally:
            if self._owns_session:
                self.session.detach()

    def __del__(self):
        # The mapping goes away with this object: drop its CUDA registration first.
        try:
            self._unregister_cuda()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        return (f"SharedBase(key={self.key!r}, format={self.format!r}, "
                f"tensors={len(self.entries)}, bytes={self.info['segment_bytes']})")


def load_base(path: str, format: str = "none", block_size: int = 64, *,
              socket: Optional[str] = None, session=None, job: str = "",
              progress: Optional[Callable[[int, int, int, int], None]] = None,
              register_cuda: Any = "auto") -> SharedBase:
    """Loads (or finds cached) the checkpoint at ``path`` in the daemon and maps it.

    ``path``: a ``.safetensors`` file or a model folder. ``format``: "none" (keep
    the checkpoint's dtypes), "int8", "nf4", "fp8" or "nvfp4" (block-stack linear
    weights only). ``block_size``: int8 / nf4 (even, >= 2). ``session``: an attached
    ``_control.Session`` to hold the reference (default: a new one, ended by
    ``release()`` or when the process exits). ``progress(bytes_read, bytes_total,
    tensors_done, tensors_total)`` is called while the daemon loads.
    ``register_cuda``: "auto" registers the mapping with CUDA read-only when a GPU is
    present (a failure only warns), True requires it, False skips it.
    """
    if register_cuda not in ("auto", True, False):
        raise ValueError(f"register_cuda={register_cuda!r}: use 'auto', True or False")
    fmt = _check_format(format)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 \
            or block_size % 2:
        raise ValueError(f"block_size={block_size!r}: use an even integer >= 2 (int8 and nf4; "
                         "fp8 and nvfp4 use fixed blocks)")
    if not isinstance(path, str) or not path:
        raise ValueError(f"path={path!r}: give a .safetensors file or a model folder")
    owns = session is None
    if owns:
        from ._daemon import connect
        session = connect(socket).attach(job=job or "load_base")
    try:
        info, region = session.load_base(path, fmt, block_size, progress)
    except Exception:
        if owns:
            session.detach()
        raise
    base = SharedBase(session, info, region, owns_session=owns)
    if register_cuda is not False and torch.cuda.is_available():
        ok, why = base.register_cuda()
        if not ok and register_cuda is True:
            base.release()
            raise RuntimeError(f"cannot register base {base.key} with CUDA: {why}")
        if not ok:
            warnings.warn(f"base {base.key} is not registered with CUDA ({why}): copies to "
                          "the GPU run at pageable speed", stacklevel=2)
    return base
