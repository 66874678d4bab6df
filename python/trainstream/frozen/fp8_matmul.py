"""The FP8 tensor-core helpers of ``QuantLinear`` (quantization.py): whether row-wise
scaled ``torch._scaled_mm`` runs on a device, exact power-of-two row scales and the
eager per-row e4m3 activation quantizer; and the switch that keeps an FP8 layer off that
path (``fp8_matmul``: the check of a mode, ``set_fp8_matmul`` over a model; the modes are
the options table's, options.py)."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

# The modes and their meaning are the options table's (the fp8_matmul option), read here
# for set_fp8_matmul's check and error.
from ..options import FP8_MATMUL_ACCEPTED, FP8_MATMUL_MODES


def _fp8_rowwise_supported(device: torch.device) -> Tuple[bool, str]:
    """Whether torch._scaled_mm with row-wise scales runs here and gives the right values
    (probed once per device; ``_fp8_bias_fused`` says whether it also adds a bias)."""
    return _fp8_probe(device)[:2]


def _fp8_bias_fused(device: torch.device) -> bool:
    """Whether row-wise torch._scaled_mm adds its ``bias`` argument correctly here; where it
    does not, the tensor-core path adds the bias after the matmul."""
    return _fp8_probe(device)[2]


def _fp8_probe(device: torch.device) -> Tuple[bool, str, bool]:
    key = (device.type, device.index)
    if key not in _FP8_PROBE:
        if device.type != "cuda":
            result = (False, "fp8 tensor cores need a CUDA device", False)
        elif torch.cuda.get_device_capability(device) < (8, 9):
            result = (False, "fp8 tensor cores need sm_89 or newer", False)
        elif not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
            result = (False, "this torch has no torch._scaled_mm", False)
        else:
            result = check_rowwise_scaled_mm(torch._scaled_mm, device)
        _FP8_PROBE[key] = result
    return _FP8_PROBE[key]


_FP8_PROBE: Dict[Tuple[str, Optional[int]], Tuple[bool, str, bool]] = {}


def check_rowwise_scaled_mm(scaled_mm, device: torch.device) -> Tuple[bool, str, bool]:
    """Runs ``scaled_mm`` (torch._scaled_mm's signature) row-wise on inputs whose exact
    result is known: e4m3 codes in -2..2, a distinct power-of-two scale per row of A and
    per column of B (so a scale applied to the wrong axis, or not at all, shows), then
    again with a bias. Every product, sum and scale is exact in fp32 and the result
    (an integer |sum| <= 64 times a power of two) is exact in bf16, so without a bias the
    output must equal the expected one bit for bit. Returns (usable, why, bias_fused)."""
    m, n, k = 32, 16, 32
    rows = torch.arange(m, dtype=torch.float32)[:, None]
    cols = torch.arange(n, dtype=torch.float32)[:, None]
    inner = torch.arange(k, dtype=torch.float32)[None, :]
    a = torch.remainder(rows * 3 + inner, 5) - 2
    b = torch.remainder(cols * 7 + inner * 3, 5) - 2
    scale_a = torch.ldexp(torch.ones(m, 1), torch.remainder(rows, 4).int() - 1)
    scale_b = torch.ldexp(torch.ones(1, n), torch.remainder(cols.t(), 3).int() - 1)
    sign = 1 - 2 * torch.remainder(torch.arange(n), 2)
    bias = ((torch.remainder(torch.arange(n), 4) + 1) * 64 * sign).float()
    expected = (a @ b.t()) * scale_a * scale_b
    a8 = a.to(device).to(torch.float8_e4m3fn)
    b8 = b.to(device).to(torch.float8_e4m3fn)
    sa, sb = scale_a.to(device), scale_b.to(device)
    try:
        out = scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    except Exception as e:  # noqa: BLE001 - any refusal means "not here"
        return False, f"torch._scaled_mm with row-wise scales refused: {e}".strip(), False
    got = out.float().cpu()
    if got.shape != expected.shape or not torch.equal(got, expected):
        err = (got - expected).abs().max().item() if got.shape == expected.shape else "shape"
        return (False, "torch._scaled_mm gave wrong values in the probe (distinct row and "
                f"column scales; max error {err}): dequantizes", False)
    try:
        out_b = scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb,
                          bias=bias.to(device, torch.bfloat16), out_dtype=torch.bfloat16)
        fused = bool(torch.allclose(out_b.float().cpu(), expected + bias, rtol=2 ** -7, atol=0))
    except Exception:  # noqa: BLE001 - a refused bias is added after the matmul instead
        fused = False
    why = "row-wise torch._scaled_mm" + ("" if fused else " (bias added after the matmul)")
    return True, why, fused


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


def check_fp8_matmul(mode) -> str:
    """``mode`` when it is one of FP8_MATMUL_MODES, else ValueError naming what is accepted."""
    if not isinstance(mode, str) or mode not in FP8_MATMUL_MODES:
        raise ValueError(f"fp8_matmul={mode!r} is not accepted; accepted: {FP8_MATMUL_ACCEPTED}")
    return mode


def set_fp8_matmul(model: torch.nn.Module, mode: str) -> int:
    """Sets how every ``QuantLinear`` in ``model`` multiplies when its format is FP8 ('auto'
    or 'dequantize'; see FP8_MATMUL_MODES). Each chooses its path again at its next forward
    (a tensor-core copy already built is freed). Returns the number of FP8 layers."""
    check_fp8_matmul(mode)
    count = 0
    for m in model.modules():
        if callable(getattr(m, "set_fp8_matmul", None)):
            m.set_fp8_matmul(mode)
            count += getattr(m, "format", None) == "fp8"
    return count


def _fp8_allowed(out_features: int, in_features: int, device: torch.device,
                 probe=None, mode: str = "auto", paged: bool = False) -> Tuple[bool, str]:
    """Whether the tensor-core path runs for a layer of this shape on ``device`` (in
    ``mode``; ``paged``: its block's weights page), and why not: the first reason of the
    mode, the device, paging, the probe and the shape."""
    if mode == "dequantize":
        return False, "fp8_matmul='dequantize': the bf16 matmul on the dequantized weight"
    if device.type != "cuda":
        return False, "fp8 on CPU dequantizes"
    if paged:
        return False, ("fp8 of a paged block dequantizes (Note [The fp8 tensor-core copy lives "
                       "only with resident weights])")
    ok, why = (probe or _fp8_rowwise_supported)(device)
    if ok and (in_features % 16 or out_features % 16):
        ok, why = False, "torch._scaled_mm needs in/out features that are multiples of 16"
    return ok, why


def fp8_copy_bytes(out_features: int, in_features: int, device: torch.device,
                   probe=None, mode: str = "auto") -> int:
    """Device bytes of a resident fp8 layer's tensor-core copy on ``device`` (0: none)."""
    ok = _fp8_allowed(out_features, in_features, device, probe, mode)[0]
    return out_features * in_features + 4 * out_features if ok else 0


def rowwise_fp8_linear(x: torch.Tensor, rows_e4m3, w_fp8_t: torch.Tensor, w_scale: torch.Tensor,
                       bias: Optional[torch.Tensor], bias_fused: bool) -> torch.Tensor:
    """The tensor-core forward of a resident fp8 layer: ``x``'s rows in e4m3 (``rows_e4m3``,
    the fused kernel, for its dtypes), row-wise ``torch._scaled_mm`` against the row-scaled
    weight (transposed view ``w_fp8_t``, scales ``w_scale`` [1, out]), the bias in the
    matmul's epilogue where the probe found that right (``bias_fused``), else after it."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype in _ROW_KERNEL_DTYPES:
        # One kernel: per-row amax, scale amax/448, e4m3 codes (quant_rows_fp8.cu).
        x_fp8, x_scale = rows_e4m3(x2)
    else:
        x_fp8, x_scale = _quantize_rows_e4m3_eager(x2)
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    if bias is not None and bias.dtype != out_dtype:
        bias = bias.to(out_dtype)
    fused = bias if bias_fused else None
    y = torch._scaled_mm(x_fp8, w_fp8_t, scale_a=x_scale, scale_b=w_scale, bias=fused,
                         out_dtype=out_dtype)
    if bias is not None and fused is None:
        y = y + bias
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], w_fp8_t.shape[1])
