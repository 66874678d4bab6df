"""The FP8 tensor-core helpers of ``QuantLinear`` (quantization.py): whether row-wise
scaled ``torch._scaled_mm`` runs on a device, exact power-of-two row scales and the
eager per-row e4m3 activation quantizer."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch


def _fp8_rowwise_supported(device: torch.device) -> Tuple[bool, str]:
    """Whether torch._scaled_mm with row-wise scales runs here (probed once per device)."""
    key = (device.type, device.index)
    if key in _FP8_PROBE:
        return _FP8_PROBE[key]
    result: Tuple[bool, str]
    if device.type != "cuda":
        result = (False, "fp8 tensor cores need a CUDA device")
    elif torch.cuda.get_device_capability(device) < (8, 9):
        result = (False, "fp8 tensor cores need sm_89 or newer")
    elif not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        result = (False, "this torch has no torch._scaled_mm")
    else:
        try:
            a = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
            b = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
            sa = torch.ones(16, 1, device=device)
            sb = torch.ones(1, 16, device=device)
            out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            ok = bool((out.float() == 32.0).all())
            result = (ok, "row-wise torch._scaled_mm" if ok else "torch._scaled_mm gave wrong "
                      "values in the probe")
        except Exception as e:  # noqa: BLE001 - any refusal means "not here"
            result = (False, f"torch._scaled_mm with row-wise scales refused: {e}".strip())
    _FP8_PROBE[key] = result
    return result


_FP8_PROBE: Dict[Tuple[str, Optional[int]], Tuple[bool, str]] = {}


def _pow2_at_least(r: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= r (elementwise, r > 0), exactly (no log2 rounding)."""
    mantissa, exponent = torch.frexp(r)  # r = m * 2^e, m in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(r), exponent)


_ROW_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Elements per row chunk when the fp8 tensor-core copy is built: the fp32 transient is
# 4 B times this (64 MiB), not the whole weight.
_FP8_BUILD_CHUNK = 1 << 24


def _quantize_rows_e4m3_eager(x2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 activations in plain PyTorch: the fallback of, and the same values
    as, the fused kernel ``_C.quant.quantize_rows_e4m3``. Scale amax * fp32(1/448) per
    row (what ``/ 448.0`` computes on CUDA), so |x / scale| <= 448 up to roundings, which
    e4m3's round-to-nearest keeps at 448."""
    x_scale = (x2.abs().amax(dim=1, keepdim=True).float() * (1.0 / 448.0)).clamp_min(1e-30)
    return (x2.float() / x_scale).to(torch.float8_e4m3fn), x_scale


def _fp8_allowed(out_features: int, in_features: int, device: torch.device,
                 probe=None) -> Tuple[bool, str]:
    """Whether the tensor-core path runs for a layer of this shape on ``device``."""
    if device.type != "cuda":
        return False, "fp8 on CPU dequantizes"
    ok, why = (probe or _fp8_rowwise_supported)(device)
    if ok and (in_features % 16 or out_features % 16):
        ok, why = False, "torch._scaled_mm needs in/out features that are multiples of 16"
    return ok, why


def fp8_copy_bytes(out_features: int, in_features: int, device: torch.device,
                   probe=None) -> int:
    """Device bytes of a resident fp8 layer's tensor-core copy on ``device`` (0: none)."""
    ok = _fp8_allowed(out_features, in_features, device, probe)[0]
    return out_features * in_features + 4 * out_features if ok else 0
