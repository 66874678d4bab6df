"""Quantized storage for frozen weights: int8, NF4, FP8 and NVFP4 (docs/quantization.md).

    qt = quantize_tensor(weight, "nf4")          # QuantizedTensor, same bytes on CPU and CUDA
    w = qt.dequantize(torch.bfloat16)
    quantize_model(model, quantize="nf4")        # frozen Linear weights of the block stack

The byte formats are defined once in kernels/include/trainstream/kernels/quant_format.h;
this module validates arguments, calls the kernels in ``trainstream._C`` and provides
``QuantLinear``, the module that replaces ``nn.Linear`` over a quantized frozen weight.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .._native import C
from ..blocks import find_block_stack
from .fp8_matmul import (_FP8_BUILD_CHUNK, _fp8_allowed, _fp8_bias_fused,  # noqa: F401
                         _fp8_rowwise_supported, _pow2_at_least, _quantize_rows_e4m3_eager,
                         check_fp8_matmul, fp8_copy_bytes, rowwise_fp8_linear, set_fp8_matmul)

try:  # The package stays importable without the extension (docs, CPU-less tooling).
    _ext = C()
except ImportError as _import_error:  # pragma: no cover - exercised only without a build
    _ext = None
    _EXT_ERROR: Optional[BaseException] = _import_error
else:
    _EXT_ERROR = None

__all__ = ["FORMATS", "QuantizedTensor", "QuantLinear", "quantize_tensor", "quantize_model",
           "quant_report", "set_fp8_matmul"]

FORMATS: Tuple[str, ...] = ("int8", "nf4", "fp8", "nvfp4")
# Blocks fixed by the format; int8 and nf4 take block_size (any even integer >= 2).
_FIXED_BLOCK = {"fp8": 32, "nvfp4": 16}
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _kernels():
    if _ext is None:
        raise RuntimeError(f"trainstream._C is not available ({_EXT_ERROR}); build the package "
                           "(`make` or cmake --build) to quantize")
    return _ext.quant


def _check_format(fmt: Any, what: str = "fmt") -> str:
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ValueError(f"{what}={fmt!r} is not a quantization format: use one of "
                         f"{', '.join(repr(f) for f in FORMATS)}")
    return fmt


def _check_block_size(block_size: Any) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 \
            or block_size % 2:
        raise ValueError(f"block_size={block_size!r} is not accepted: use an even integer >= 2 "
                         "(default 64; fp8 and nvfp4 always use their fixed blocks of 32 and 16)")
    return block_size


def _check_weight(t: Any, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"{name} has dtype {t.dtype}: only floating-point tensors "
                         "(float32, bfloat16, float16, float64) can be quantized")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {t.device}: quantization runs on cpu or cuda tensors")
    if t.numel() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{name} has {bad} non-finite value(s) (NaN or inf): only finite "
                         "weights can be quantized")


class QuantizedTensor:
    """A quantized tensor: packed codes, scales and the metadata to undo padding.

    Attributes:
        data: uint8 tensor of packed codes (``padded_numel`` bytes for int8/fp8, half that
            for nf4/nvfp4; element 2j in the high nibble).
        scales: per-block scales: float32 absmax (int8, nf4), uint8 e8m0 (fp8), uint8
            e4m3 (nvfp4).
        tensor_scale: float32 tensor of one element (nvfp4's per-tensor scale; 0 otherwise).
        shape: the original shape. dtype: the original dtype.
        format, block_size (the block really used), padding (zero elements appended to
        fill the last block; dropped by ``dequantize``).
    """

    def __init__(self, data: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor,
                 shape: Sequence[int], fmt: str, block_size: int, padding: int,
                 dtype: torch.dtype = torch.float32):
        self.data = data
        self.scales = scales
        self.tensor_scale = tensor_scale
        self.shape = torch.Size(shape)
        self.format = fmt
        self.block_size = block_size
        self.padding = padding
        self.dtype = dtype

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes stored: codes + scales (+ the nvfp4 tensor scale)."""
        extra = 4 if self.format == "nvfp4" else 0
        return self.data.numel() + self.scales.numel() * self.scales.element_size() + extra

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The tensor in ``dtype`` (original shape, padding dropped), on this tensor's device."""
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype={dtype!r}: dequantize to a floating dtype "
                             "(bfloat16, float32, float16, float64)")
        kernel_dtype = dtype if dtype in _KERNEL_DTYPES else torch.float32
        out = _kernels().dequantize(self.data, self.scales, self.tensor_scale, self.format,
                                    self.numel, self.block_size, kernel_dtype)
        return out.view(self.shape).to(dtype)

    def to(self, device) -> "QuantizedTensor":
        """A copy on ``device`` (the bytes do not change)."""
        return QuantizedTensor(self.data.to(device), self.scales.to(device),
                               self.tensor_scale.to(device), self.shape, self.format,
                               self.block_size, self.padding, self.dtype)

    def __repr__(self) -> str:
        return (f"QuantizedTensor(format={self.format!r}, shape={tuple(self.shape)}, "
                f"block_size={self.block_size}, padding={self.padding}, bytes={self.nbytes}, "
                f"device={self.device})")


def quantize_tensor(t: torch.Tensor, fmt: str, block_size: int = 64) -> QuantizedTensor:
    """Quantizes ``t`` (any floating dtype, CPU or CUDA) to ``fmt``.

    ``fmt``: "int8", "nf4", "fp8" or "nvfp4". ``block_size`` applies to int8 and nf4
    (any even integer >= 2); fp8 uses blocks of 32 and nvfp4 blocks of 16. CPU and CUDA
    produce identical bytes. Bad input raises ``ValueError`` naming the problem.
    """
    fmt = _check_format(fmt)
    block_size = _check_block_size(block_size)
    _check_weight(t, "tensor")
    src = t.detach()
    if src.dtype not in _KERNEL_DTYPES:
        # fp16 -> fp32 is exact; fp64 -> fp32 rounds (and may overflow: checked again).
        src = src.to(torch.float32)
        if src.dtype != t.dtype and t.dtype == torch.float64 and src.numel() \
                and not bool(torch.isfinite(src).all()):
            raise ValueError("tensor has float64 values beyond float32's range: only values "
                             "representable in float32 can be quantized")
    if src.is_cuda and not getattr(_ext, "with_cuda", False):
        raise ValueError("tensor is on CUDA but trainstream._C was built without CUDA: "
                         "quantize on the CPU (tensor.cpu()) or rebuild with CUDA")
    data, scales, tensor_scale = _kernels().quantize(src.contiguous().view(-1), fmt, block_size)
    used_block = _FIXED_BLOCK.get(fmt, block_size)
    padding = (-t.numel()) % used_block
    return QuantizedTensor(data, scales, tensor_scale, t.shape, fmt, used_block, padding,
                           t.dtype)


# ---- QuantLinear ------------------------------------------------------------------------

class _QuantLinearFunction(torch.autograd.Function):
    """y = x W^T + b with W dequantized on the fly in forward and again in backward (only the
    quantized bytes are kept between the two). W is frozen: no weight gradient."""

    @staticmethod
    def forward(ctx, x, bias, module):
        ctx.module = module
        ctx.has_bias = bias is not None
        # Saved (references, no copies) rather than read from the module in backward:
        # under weight paging (streaming/weights.py) the module's buffers are host tensors again by
        # then, and the saved-tensor hooks fetch these back to the device.
        ctx.save_for_backward(module.qdata, module.qscales, module.qtensor_scale)
        return module._matmul(x, bias)

    @staticmethod
    def backward(ctx, grad_out):
        module = ctx.module
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            data, scales, tensor_scale = ctx.saved_tensors
            q = QuantizedTensor(data, scales, tensor_scale, (module.out_features,
                                module.in_features), module.format, module.block_size,
                                module.padding, module.weight_dtype)
            w = q.dequantize(torch.bfloat16).to(device=grad_out.device, dtype=grad_out.dtype)
            grad_x = grad_out.matmul(w)
        if ctx.has_bias and ctx.needs_input_grad[1]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0, dtype=torch.float32)
        return grad_x, grad_bias, None


class QuantLinear(nn.Module):
    """``nn.Linear`` over a frozen quantized weight (``quantize_model`` installs these).

    Forward and backward (to the input, for adapters) dequantize the weight to bfloat16
    on the fly; the matmul runs in the input's dtype (bfloat16 under autocast). FP8
    weights on GPUs whose torch accepts row-wise scaled ``torch._scaled_mm`` (sm_89+,
    e.g. the H200) use FP8 tensor cores in forward: the per-32 block scales are not
    accepted there, so the first CUDA forward re-expresses the weight with one
    power-of-two scale per output row (exact wherever a block's values stay in e4m3's
    normal range) and quantizes activations per row. ``matmul_path`` says what runs and
    ``matmul_note`` why; ``fp8_matmul="dequantize"`` (``set_fp8_matmul``) turns the FP8
    path off. NVFP4 always dequantizes (its tensor cores need Blackwell).
    """

    def __init__(self, qweight: QuantizedTensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        if len(qweight.shape) != 2:
            raise ValueError(f"QuantLinear needs a 2-D weight, got shape {tuple(qweight.shape)}")
        self.out_features, self.in_features = qweight.shape
        self.format = qweight.format
        self.block_size = qweight.block_size
        self.padding = qweight.padding
        self.weight_dtype = qweight.dtype
        self.register_buffer("qdata", qweight.data)
        self.register_buffer("qscales", qweight.scales)
        self.register_buffer("qtensor_scale", qweight.tensor_scale)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad) \
            if bias is not None else None
        self._fp8_cache: Optional[Tuple[torch.device, torch.Tensor, torch.Tensor]] = None
        self._paged = False  # set_paged: the block's weights are paged (no tensor-core copy)
        self.fp8_matmul = "auto"  # set_fp8_matmul: FP8_MATMUL_MODES (options.py)
        # Set by _prepare at the first forward on a device (the hot path reads only these).
        self._plan_device: Optional[torch.device] = None
        self._plan_fp8 = False
        self._fp8_wt: Optional[torch.Tensor] = None        # fp8 weight, transposed view
        self._fp8_w_scale: Optional[torch.Tensor] = None   # [1, out_features] fp32
        self._rows_e4m3 = None                             # activation quantizer
        self._fp8_bias_fused = False  # _scaled_mm adds the bias (else added after it)
        self.matmul_path = "dequantize-bf16"
        self.matmul_note = "not run yet"

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str = "nf4", block_size: int = 64,
                    name: str = "weight") -> "QuantLinear":
        if linear.weight.requires_grad:
            raise ValueError(f"{name} is trainable (requires_grad=True): only frozen weights "
                             "are quantized; call requires_grad_(False) on it first")
        _check_weight(linear.weight, name)
        return cls(quantize_tensor(linear.weight, fmt, block_size), linear.bias)

    @property
    def qweight(self) -> QuantizedTensor:
        return QuantizedTensor(self.qdata, self.qscales, self.qtensor_scale,
                               (self.out_features, self.in_features), self.format,
                               self.block_size, self.padding, self.weight_dtype)

    def _weight(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        w = self.qweight.dequantize(torch.bfloat16)
        return w.to(device=device, dtype=dtype)

    # Note [The fp8 tensor-core copy lives only with resident weights]
    # torch._scaled_mm on sm_90 refuses per-32 block scales, so the tensor-core path
    # needs a second device copy of the weight, row-scaled e4m3 (1 B per element plus
    # 4 B per row). Rules: (1) it is built only for a weight the module keeps on the
    # device (a resident block); a paged block (BlockPager calls set_paged) dequantizes,
    # since rebuilding the copy every residency costs more passes over the weight than
    # the fp8 matmul saves, and a copy kept past the residency would leak its size in
    # VRAM for every paged block; (2) the planner counts it (tensor_core_bytes, in
    # "resident blocks"); (3) it is built in row chunks, so the transient is bounded by
    # _FP8_BUILD_CHUNK elements of fp32, not the whole weight.
    def _fp8_weight(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._fp8_cache is None or self._fp8_cache[0] != device:
            rows = max(1, _FP8_BUILD_CHUNK // max(1, self.in_features))
            w_fp8 = torch.empty(self.out_features, self.in_features, device=device,
                                dtype=torch.float8_e4m3fn)
            row_scale = torch.empty(self.out_features, device=device, dtype=torch.float32)
            for r0 in range(0, self.out_features, rows):
                w = self._rows_fp32(r0, min(self.out_features, r0 + rows)).to(device)
                amax = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
                scale = _pow2_at_least(amax / 448.0)  # every |w / scale| <= 448
                w_fp8[r0:r0 + w.shape[0]] = (w / scale[:, None]).to(torch.float8_e4m3fn)
                row_scale[r0:r0 + w.shape[0]] = scale
            self._fp8_cache = (device, w_fp8, row_scale[None, :].contiguous())
        return self._fp8_cache[1], self._fp8_cache[2]

    def _rows_fp32(self, r0: int, r1: int) -> torch.Tensor:
        """Rows r0:r1 of the weight in fp32 (whole-weight dequantize if blocks straddle rows)."""
        if self.in_features % self.block_size:
            return self.qweight.dequantize(torch.float32)[r0:r1]
        k, b = self.in_features, self.block_size
        part = QuantizedTensor(self.qdata[r0 * k:r1 * k], self.qscales[r0 * k // b:r1 * k // b],
                               self.qtensor_scale, (r1 - r0, k), self.format, b, 0,
                               self.weight_dtype)
        return part.dequantize(torch.float32)

    def set_paged(self, paged: bool) -> None:
        """The weight pager's call as this module's block starts (True) or stops being
        paged: a paged weight dequantizes, and its tensor-core copy is freed now."""
        self._paged = bool(paged)
        self._reset_plan()

    def _reset_plan(self) -> None:
        """Frees the tensor-core copy; the next forward chooses the path again."""
        self._fp8_cache = None
        self._fp8_wt = self._fp8_w_scale = self._rows_e4m3 = None
        self._plan_device = None
        self._plan_fp8 = False

    def tensor_core_bytes(self, device) -> int:
        """Device bytes of the fp8 tensor-core copy this module builds when resident on
        ``device`` (0 where that path is not taken): what the planner adds to a resident
        block (Note [The fp8 tensor-core copy lives only with resident weights])."""
        if self.format != "fp8":
            return 0
        return fp8_copy_bytes(self.out_features, self.in_features, torch.device(device),
                              _fp8_rowwise_supported, self.fp8_matmul)

    def set_fp8_matmul(self, mode: str) -> None:
        """'auto' or 'dequantize' (options.FP8_MATMUL_MODES); the next forward chooses the path again."""
        self.fp8_matmul = check_fp8_matmul(mode)
        self._reset_plan()

    def _fp8_path_allowed(self, device: torch.device) -> Tuple[bool, str]:
        return _fp8_allowed(self.out_features, self.in_features, device, _fp8_rowwise_supported,
                            self.fp8_matmul, self._paged)

    def _use_fp8(self, x: torch.Tensor) -> bool:
        if self.format != "fp8":
            if self.format == "nvfp4":
                self.matmul_note = "nvfp4 dequantizes: its tensor-core matmul needs Blackwell"
            else:
                self.matmul_note = f"{self.format} has no tensor-core path: dequantizes"
            return False
        ok, why = self._fp8_path_allowed(x.device)
        self.matmul_note = why
        return ok

    def _prepare(self, x: torch.Tensor) -> None:
        """First forward on a device: choose the matmul path once and precompute what it
        needs (the fp8 weight with row scales, its transposed view, the activation
        quantizer), so later calls do no checks, no host syncs and no re-derivation."""
        use_fp8 = self._use_fp8(x)
        if use_fp8:
            w_fp8, w_scale = self._fp8_weight(x.device)
            self._fp8_wt, self._fp8_w_scale = w_fp8.t(), w_scale
            kernel = getattr(_kernels(), "quantize_rows_e4m3", None)
            self._rows_e4m3 = kernel if kernel is not None else _quantize_rows_e4m3_eager
            self._fp8_bias_fused = _fp8_bias_fused(x.device)
            self.matmul_path = "fp8-scaled-mm-rowwise"
        else:
            self._fp8_wt = self._fp8_w_scale = self._rows_e4m3 = None
            self._fp8_bias_fused = False
            self.matmul_path = "dequantize-bf16"
        self._plan_fp8 = use_fp8
        self._plan_device = x.device

    def _tensor_core_matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return rowwise_fp8_linear(x, self._rows_e4m3, self._fp8_wt, self._fp8_w_scale, bias,
                                  self._fp8_bias_fused)

    def _matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self._plan_device != x.device:
            self._prepare(x)
        if self._plan_fp8:
            return self._tensor_core_matmul(x, bias)
        return F.linear(x, self._weight(x.dtype, x.device),
                        bias.to(x.dtype) if bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            x = x.to(torch.get_autocast_dtype(device_type))
        if self._plan_device != x.device:
            self._prepare(x)
        bias = self.bias
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or (bias is not None and bias.requires_grad))
        if self._plan_fp8 and not needs_grad:
            # Hot path (inference, or no gradient wanted): no autograd node, no autocast
            # context; _scaled_mm and the row kernel are not autocast ops.
            return self._tensor_core_matmul(x, bias)
        with torch.autocast(device_type, enabled=False):
            if not needs_grad:
                return self._matmul(x, bias)
            return _QuantLinearFunction.apply(x, bias, self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.format!r}, block_size={self.block_size}, "
                f"bias={self.bias is not None}, matmul_path={self.matmul_path!r}")


# ---- quantize_model ---------------------------------------------------------------------

def _linears(blocks: Iterable[nn.Module], prefix: str):
    seen = set()
    for i, block in enumerate(blocks):
        for name, m in block.named_modules():
            for child_name, child in m.named_children():
                if isinstance(child, nn.Linear) and id(child) not in seen:
                    seen.add(id(child))
                    full = ".".join(x for x in (prefix, str(i), name, child_name) if x)
                    yield m, child_name, child, full


def quantize_model(model: nn.Module, quantize: str = "nf4", *, blocks=None,
                   block_size: int = 64, pin_budget: Optional[int] = None,
                   skip_trained: bool = False) -> Dict[str, int]:
    """Quantizes, in place, the frozen ``nn.Linear`` weights of the model's repeated blocks.

    Args:
        quantize: "int8", "nf4", "fp8" or "nvfp4".
        blocks: the block stack (an ``nn.ModuleList`` or a list of modules); by default
            ``trainstream.find_blocks``'s: the largest ``nn.ModuleList`` of at least two
            children of one type.
        block_size: for int8 and nf4 (even, >= 2).
        pin_budget: optional byte budget for the quantized weights (the pinned host memory
            they will occupy); exceeding it raises ``ValueError`` before anything changes.
        skip_trained: leave trained Linears (LoRA adapters beside a frozen base) as they
            are instead of refusing them (``wrap()``'s plan quantizes this way).

    Each Linear becomes a ``QuantLinear``, one tensor at a time (peak extra memory: one
    tensor's packed bytes). Every check runs before the first change. Returns
    ``{"tensors", "bytes_before", "bytes_after"}``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    fmt = _check_format(quantize, "quantize")
    block_size = _check_block_size(block_size)
    if pin_budget is not None and (isinstance(pin_budget, bool) or not isinstance(pin_budget, int)
                                   or pin_budget < 0):
        raise ValueError(f"pin_budget={pin_budget!r}: use None or a number of bytes >= 0")
    if blocks is None:
        prefix, stack = find_block_stack(model)
        if not stack:
            raise ValueError("no repeated block stack found (an nn.ModuleList of at least two "
                             "modules of one type); pass blocks=")
    elif isinstance(blocks, nn.Module) and not isinstance(blocks, nn.ModuleList):
        prefix, stack = "blocks", [blocks]
    else:
        try:
            stack = list(blocks)
        except TypeError:
            raise ValueError(f"blocks={type(blocks).__name__}: pass an nn.ModuleList or a list "
                             "of modules") from None
        if not all(isinstance(b, nn.Module) for b in stack):
            raise ValueError("blocks must contain only nn.Module instances")
        names = {id(m): n for n, m in model.named_modules()}
        prefix = names.get(id(blocks), "blocks")
    targets = list(_linears(stack, prefix))
    if skip_trained:
        targets = [t for t in targets if not t[2].weight.requires_grad]
    trainable = [name for _, _, lin, name in targets if lin.weight.requires_grad]
    if trainable:
        shown = ", ".join(f"{n}.weight" for n in trainable[:5])
        more = f" (and {len(trainable) - 5} more)" if len(trainable) > 5 else ""
        raise ValueError(f"trainable weight(s) {shown}{more} (requires_grad=True): quantize_model "
                         "only quantizes frozen weights; freeze the base first "
                         "(requires_grad_(False)) and add adapters afterwards")
    for _, _, lin, name in targets:
        _check_weight(lin.weight, f"{name}.weight")
    bytes_before = sum(lin.weight.numel() * lin.weight.element_size() for _, _, lin, _ in targets)
    if pin_budget is not None:
        need = sum(_quantized_bytes(fmt, lin.weight.numel(), block_size) for _, _, lin, _ in targets)
        if need > pin_budget:
            raise ValueError(f"pin_budget={pin_budget} bytes is too small: the quantized weights "
                             f"need {need} bytes in {fmt}")
    bytes_after, count = 0, len(targets)
    targets.reverse()
    while targets:
        # Pop, so that once the parent points at the QuantLinear nothing here keeps the
        # full-precision weight alive: memory is released tensor by tensor.
        parent, child_name, lin, name = targets.pop()
        q = QuantLinear.from_linear(lin, fmt, block_size, name=f"{name}.weight")
        setattr(parent, child_name, q)
        bytes_after += q.qweight.nbytes
        del lin, q
    return {"tensors": count, "bytes_before": bytes_before, "bytes_after": bytes_after}


def _quantized_bytes(fmt: str, numel: int, block_size: int) -> int:
    block = _FIXED_BLOCK.get(fmt, block_size)
    blocks = math.ceil(numel / block)
    data = blocks * block // (2 if fmt in ("nf4", "nvfp4") else 1)
    scale = 4 if fmt in ("int8", "nf4") else 1
    return data + blocks * scale + (4 if fmt == "nvfp4" else 0)


def quant_report(model: nn.Module) -> List[Dict[str, Any]]:
    """Per QuantLinear: name, format, bytes and which matmul path runs (and why)."""
    return [{"name": n, "format": m.format, "shape": (m.out_features, m.in_features),
             "bytes": m.qweight.nbytes, "matmul_path": m.matmul_path, "note": m.matmul_note}
            for n, m in model.named_modules() if isinstance(m, QuantLinear)]
