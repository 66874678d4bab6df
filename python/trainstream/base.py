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
from typing import Any, Callable, Dict, List, Optional

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
        try:
            self.session.release_base(self.key)
        finally:
            if self._owns_session:
                self.session.detach()

    def __repr__(self) -> str:
        return (f"SharedBase(key={self.key!r}, format={self.format!r}, "
                f"tensors={len(self.entries)}, bytes={self.info['segment_bytes']})")


def load_base(path: str, format: str = "none", block_size: int = 64, *,
              socket: Optional[str] = None, session=None, job: str = "",
              progress: Optional[Callable[[int, int, int, int], None]] = None) -> SharedBase:
    """Loads (or finds cached) the checkpoint at ``path`` in the daemon and maps it.

    ``path``: a ``.safetensors`` file or a model folder. ``format``: "none" (keep
    the checkpoint's dtypes), "int8", "nf4", "fp8" or "nvfp4" (block-stack linear
    weights only). ``block_size``: int8 / nf4 (even, >= 2). ``session``: an attached
    ``_control.Session`` to hold the reference (default: a new one, ended by
    ``release()`` or when the process exits). ``progress(bytes_read, bytes_total,
    tensors_done, tensors_total)`` is called while the daemon loads.
    """
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
    return SharedBase(session, info, region, owns_session=owns)
