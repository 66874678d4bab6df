"""Quantized storage on the CPU: formats, bytes, errors, QuantLinear and quantize_model.
GPU checks (CPU/CUDA identical bytes) are in test_quant_cuda.py."""
import copy

import pytest
import torch
import torch.nn.functional as F

from quant_helpers import (FORMATS, NF4_TABLE, TinyTransformer, adversarial, documented_errors,
                           gaussian, mean_relative_error, on_grid)
from trainstream import _C
from trainstream.frozen.quantization import QuantizedTensor, QuantLinear, quant_report, quantize_model, \
    quantize_tensor


def test_nf4_hand_computed_example_matches_bitsandbytes_layout():
    # Block 4: {2, -2, 0, 1} / absmax 2 = {1, -1, 0, 0.5} -> codes {15, 0, 7, 12}; element
    # 2j is the high nibble. Block 2: {0.25, pad, pad, pad} -> {15, 7, 7, 7}.
    qt = quantize_tensor(torch.tensor([2.0, -2.0, 0.0, 1.0, 0.25]), "nf4", block_size=4)
    assert qt.data.tolist() == [0xF0, 0x7C, 0xF7, 0x77]
    assert qt.scales.tolist() == [2.0, 0.25]
    assert qt.padding == 3 and qt.shape == torch.Size([5])
    expect = torch.tensor([1.0, -1.0, 0.0, 0.44070982933044434, 1.0]) * torch.tensor([2.0] * 4 + [0.25])
    assert torch.equal(qt.dequantize(torch.float32), expect)


def test_nf4_code_table_is_bitsandbytes():
    table = torch.tensor(NF4_TABLE)
    qt = quantize_tensor(table, "nf4", block_size=16)
    assert qt.data.tolist() == [0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF]
    assert torch.equal(qt.dequantize(torch.float32), table)


def test_nf4_all_zero_block_is_code_zero_like_bitsandbytes():
    qt = quantize_tensor(torch.zeros(64), "nf4")
    assert qt.data.tolist() == [0] * 32 and qt.scales.tolist() == [0.0]
    assert torch.equal(qt.dequantize(torch.float32), torch.zeros(64))


@pytest.mark.parametrize("fmt", FORMATS)
def test_vectorized_cpu_paths_equal_scalar_reference(fmt):
    isas = [i for i in ("avx2", "avx512") if _C.quant.isa_supported(i)]
    if not isas:
        pytest.skip("this CPU has neither AVX2 nor AVX-512")
    for name, t in adversarial():
        for block in (64, 2, 126):
            ref = _C.quant.quantize(t, fmt, block, "scalar")
            for isa in isas:
                got = _C.quant.quantize(t, fmt, block, isa)
                for a, b in zip(ref, got):
                    assert torch.equal(a, b), f"{fmt} {name} block {block} {isa}"
                args = (fmt, t.numel(), block, torch.float32)
                assert torch.equal(_C.quant.dequantize(*ref, *args, "scalar"),
                                   _C.quant.dequantize(*got, *args, isa))


@pytest.mark.parametrize("fmt", FORMATS)
def test_values_on_the_grid_round_trip_exactly(fmt):
    x = on_grid(fmt)
    qt = quantize_tensor(x, fmt)
    assert torch.equal(qt.dequantize(torch.float32), x)
    again = quantize_tensor(qt.dequantize(torch.float32), fmt)
    assert torch.equal(again.data, qt.data) and torch.equal(again.scales, qt.scales)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gaussian_error_within_10_percent_of_docs(fmt):
    table = documented_errors()
    assert set(table) == set(FORMATS), f"docs table lists {sorted(table)}"
    x = gaussian()
    err = mean_relative_error(x, quantize_tensor(x, fmt).dequantize(torch.float32))
    assert abs(err - table[fmt]) <= 0.10 * table[fmt], f"{fmt}: measured {err:.5f}, " \
                                                       f"docs {table[fmt]:.5f}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_padding_is_recorded_and_dropped(fmt):
    x = gaussian(1001)
    qt = quantize_tensor(x.view(7, 143), fmt)
    block = {"fp8": 32, "nvfp4": 16}.get(fmt, 64)
    assert qt.block_size == block
    assert qt.padding == (-1001) % block
    padded = 1001 + qt.padding
    assert qt.data.numel() == (padded // 2 if fmt in ("nf4", "nvfp4") else padded)
    assert qt.scales.numel() == padded // block
    y = qt.dequantize(torch.bfloat16)
    assert y.shape == (7, 143) and y.dtype == torch.bfloat16
    assert torch.equal(y, qt.dequantize(torch.float32).to(torch.bfloat16))


@pytest.mark.parametrize("fmt", FORMATS)
def test_input_dtypes_give_the_same_bytes(fmt):
    # bf16 and fp16 widen to fp32 exactly; fp64 values that are fp32 values too.
    for x in (gaussian(4096).to(torch.bfloat16), gaussian(4096, seed=1).half()):
        for t in (x, x.double()):
            q, ref = quantize_tensor(t, fmt), quantize_tensor(x.float(), fmt)
            assert torch.equal(q.data, ref.data) and torch.equal(q.scales, ref.scales)
            assert torch.equal(q.tensor_scale, ref.tensor_scale)


def test_bytes_per_weight_match_the_format_table():
    n = 64 * 1024
    x = gaussian(n)
    expect = {"int8": 1.0625, "nf4": 0.5625, "fp8": 1.03125, "nvfp4": 0.5625}
    for fmt, bpw in expect.items():
        qt = quantize_tensor(x, fmt)
        assert abs(qt.nbytes / n - bpw) < 1e-3, fmt


@pytest.mark.parametrize("bad,match", [
    (dict(fmt="int4"), r"fmt='int4'.*'int8', 'nf4', 'fp8', 'nvfp4'"),
    (dict(block_size=63), r"block_size=63.*even integer >= 2"),
    (dict(block_size=0), r"block_size=0"),
    (dict(t=torch.arange(10)), r"dtype torch.int64.*floating-point"),
    (dict(t=torch.tensor([1.0, float("nan")])), r"non-finite"),
    (dict(t=torch.tensor([1.0, float("inf")])), r"non-finite"),
])
def test_quantize_tensor_bad_input_raises_value_error(bad, match):
    args = dict(t=torch.ones(64), fmt="nf4", block_size=64)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        quantize_tensor(args["t"], args["fmt"], block_size=args["block_size"])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_matches_dequantized_f_linear(fmt, dtype):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 40).requires_grad_(False)
    lin.bias.requires_grad_(True)
    ql = QuantLinear.from_linear(lin, fmt)
    w = ql.qweight.dequantize(torch.bfloat16).to(dtype)
    x = torch.randn(3, 5, 96, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    b_ref = ql.bias.detach().clone().requires_grad_(True)
    y = ql(x)
    y_ref = F.linear(x_ref, w, b_ref.to(dtype))
    assert y.dtype == dtype and torch.equal(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(ql.bias.grad, b_ref.grad, **tol)
    assert ql.matmul_path == "dequantize-bf16"


@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_linear_no_grad_fast_path_equals_autograd_forward(fmt):
    # forward skips the autograd Function when no gradient is wanted; same values.
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 48).requires_grad_(False)
    ql = QuantLinear.from_linear(lin, fmt)
    x = torch.randn(2, 3, 64)
    with torch.no_grad():
        fast = ql(x)
    slow = ql(x.clone().requires_grad_(True))
    assert slow.requires_grad and not fast.requires_grad
    assert torch.equal(fast, slow.detach())
    assert ql.matmul_path == "dequantize-bf16" and ql.matmul_note != "not run yet"


def _frozen_model(seed=0):
    torch.manual_seed(seed)
    model = TinyTransformer()
    model.requires_grad_(False)
    return model


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_model_forward_backward_match_dequantized_model(fmt):
    model = _frozen_model()
    reference = copy.deepcopy(model)
    result = quantize_model(model, quantize=fmt)
    assert result["tensors"] == 3 * 4  # qkv, proj, up, down per block; head is outside
    assert result["bytes_after"] < result["bytes_before"]
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 12 and isinstance(model.head, torch.nn.Linear)
    # The reference: the same model with each weight replaced by its bf16 dequantization.
    for m, ref in zip(model.blocks.modules(), reference.blocks.modules()):
        if isinstance(m, QuantLinear):
            ref.weight.copy_(m.qweight.dequantize(torch.bfloat16).float())
    tokens = torch.randint(0, 100, (2, 12))
    h = model.embed(tokens).detach().requires_grad_(True)
    h_ref = h.detach().clone().requires_grad_(True)

    def run(m, x):
        for b in m.blocks:
            x = b(x)
        return x

    out, out_ref = run(model, h), run(reference, h_ref)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=1e-5)
    report = quant_report(model)
    assert len(report) == 12 and report[0]["name"].startswith("blocks.0.")


def test_quantize_model_rejects_trainable_weights_by_name():
    model = _frozen_model()
    model.blocks[1].up.weight.requires_grad_(True)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"blocks\.1\.up\.weight.*requires_grad=True"):
        quantize_model(model, quantize="nf4")
    # Nothing changed: every check runs before the first replacement.
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("kwargs,match", [
    (dict(quantize="q4"), r"quantize='q4'.*'nf4'"),
    (dict(block_size=7), r"block_size=7"),
    (dict(pin_budget=10), r"pin_budget=10 bytes is too small"),
    (dict(pin_budget=-1), r"pin_budget=-1"),
])
def test_quantize_model_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize_model(_frozen_model(), **kwargs)


def test_quantize_model_non_finite_weight_named():
    model = _frozen_model()
    model.blocks[2].down.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"blocks\.2\.down\.weight has 1 non-finite"):
        quantize_model(model, quantize="int8")


def test_quantize_model_explicit_blocks_and_no_stack():
    model = _frozen_model()
    result = quantize_model(model, quantize="int8", blocks=model.blocks[:1])
    assert result["tensors"] == 4
    with pytest.raises(ValueError, match=r"no repeated block stack.*blocks="):
        quantize_model(torch.nn.Sequential(torch.nn.Linear(4, 4)).requires_grad_(False))


def test_module_exports():
    import trainstream.quantization as q
    assert q.QuantizedTensor is QuantizedTensor
    assert callable(q.quantize_model) and callable(q.quantize_tensor)


# ---- the row-wise scaled_mm probe (the FP8 tensor-core path's runtime check) ------------

def _emulated_scaled_mm(wrong=None):
    """torch._scaled_mm's row-wise arithmetic in fp32 on any device, or one way of
    getting it wrong: "scale_b" dropped, "scales reversed" (row i given row m-1-i's),
    "bias" dropped, "bias refused" (an error when a bias is passed)."""
    def scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, **_):
        y = a.float() @ b.float()
        if wrong == "scales reversed":
            y = y * scale_a.flip(0) * scale_b.flip(1)
        elif wrong == "scale_b":
            y = y * scale_a
        else:
            y = y * scale_a * scale_b
        if bias is not None:
            if wrong == "bias refused":
                raise RuntimeError("bias is not supported with row-wise scaling")
            if wrong != "bias":
                y = y + bias.float()
        return y.to(out_dtype)
    return scaled_mm


def test_rowwise_probe_accepts_correct_arithmetic_and_rejects_wrong_scales():
    from trainstream.frozen.fp8_matmul import check_rowwise_scaled_mm
    cpu = torch.device("cpu")
    assert check_rowwise_scaled_mm(_emulated_scaled_mm(), cpu) == (True, "row-wise torch._scaled_mm", True)
    for wrong in ("scale_b", "scales reversed"):
        ok, why, _ = check_rowwise_scaled_mm(_emulated_scaled_mm(wrong), cpu)
        assert not ok and "wrong values in the probe" in why and "max error" in why, (wrong, why)
    for wrong in ("bias", "bias refused"):
        ok, why, fused = check_rowwise_scaled_mm(_emulated_scaled_mm(wrong), cpu)
        assert ok and not fused and "bias added after the matmul" in why, (wrong, why)

    def refuses(*a, **k):
        raise RuntimeError("Only per-tensor scaling is supported")
    ok, why, fused = check_rowwise_scaled_mm(refuses, cpu)
    assert not ok and "refused: Only per-tensor scaling" in why and not fused


def _emulate_fp8_path(monkeypatch, bias_fused=True):
    """The tensor-core path's arithmetic on the CPU: _scaled_mm emulated in fp32, the
    eager activation quantizer in place of the CUDA-only row kernel."""
    from trainstream.frozen import quantization as q
    monkeypatch.setattr(q, "_fp8_bias_fused", lambda device: bias_fused)
    monkeypatch.setattr(torch, "_scaled_mm", _emulated_scaled_mm(None if bias_fused else "bias"))
    real = q._kernels()

    class NoRowKernel:
        def __getattr__(self, name):
            if name == "quantize_rows_e4m3":
                raise AttributeError(name)
            return getattr(real, name)
    monkeypatch.setattr(q, "_kernels", NoRowKernel)


@pytest.mark.parametrize("bias_fused", [True, False])
def test_fp8_forward_with_bias_added_after_the_matmul_equals_the_fused_bias(monkeypatch, bias_fused):
    # Where the probe finds the bias epilogue wrong, the path adds the bias itself; the
    # forward stays the dequantized matmul up to the e4m3 rounding of the activations.
    from trainstream.frozen import quantization as q
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32).requires_grad_(False)
    lin.bias.data.mul_(50)  # a bias that would show if it were dropped or doubled
    ql = QuantLinear.from_linear(lin, "fp8")
    monkeypatch.setattr(QuantLinear, "_use_fp8", lambda self, x: True)
    _emulate_fp8_path(monkeypatch, bias_fused)
    x = torch.randn(8, 64)
    with torch.no_grad():
        y = ql(x)
        ref = F.linear(x, ql.qweight.dequantize(torch.float32), ql.bias.float())
    assert ql.matmul_path == "fp8-scaled-mm-rowwise" and ql._fp8_bias_fused is bias_fused
    assert ql._rows_e4m3 is q._quantize_rows_e4m3_eager
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert rel < 0.03, rel


def test_fp8_matmul_dequantize_runs_the_exact_dequantized_matmul_and_switches_back(monkeypatch):
    # wrap()'s fp8_matmul option and set_fp8_matmul: "dequantize" takes an FP8 layer off
    # the tensor-core path (no e4m3 rounding of its input, no copy kept), "auto" puts it
    # back; the switch counts FP8 layers only and refuses a wrong mode before any change.
    from trainstream.frozen import quantization as q
    from trainstream.quantization import set_fp8_matmul
    torch.manual_seed(0)
    fp8 = QuantLinear.from_linear(torch.nn.Linear(64, 32).requires_grad_(False), "fp8")
    int8 = QuantLinear.from_linear(torch.nn.Linear(64, 32).requires_grad_(False), "int8")
    model = torch.nn.ModuleList([fp8, int8])
    # The CPU input stands for a CUDA one whose probe passed: the mode alone decides.
    monkeypatch.setattr(q, "_fp8_rowwise_supported", lambda device: (True, "forced by the test"))
    def use_fp8(self, x):  # _use_fp8's last lines, for a CUDA device
        ok, self.matmul_note = self._fp8_path_allowed(torch.device("cuda"))
        return ok
    monkeypatch.setattr(QuantLinear, "_use_fp8", use_fp8)
    _emulate_fp8_path(monkeypatch)
    x = torch.randn(8, 64)
    exact = F.linear(x, fp8.qweight.dequantize(torch.bfloat16).float(), fp8.bias.float())

    def forward():
        with torch.no_grad():
            return fp8(x)
    y = forward()
    assert fp8.matmul_path == "fp8-scaled-mm-rowwise" and fp8._fp8_cache is not None
    assert 1e-3 < ((y.float() - exact).norm() / exact.norm()).item() < 0.03  # e4m3 inputs
    assert set_fp8_matmul(model, "dequantize") == 1
    assert fp8.fp8_matmul == int8.fp8_matmul == "dequantize" and fp8._fp8_cache is None
    assert fp8.tensor_core_bytes("cuda") == 0
    y = forward()
    assert fp8.matmul_path == "dequantize-bf16" and "fp8_matmul='dequantize'" in fp8.matmul_note
    assert torch.equal(y, exact)
    with pytest.raises(ValueError, match=r"fp8_matmul='bf16' is not accepted; accepted: 'auto'"):
        set_fp8_matmul(model, "bf16")
    assert fp8.fp8_matmul == "dequantize"
    set_fp8_matmul(model, "auto")
    forward()
    assert fp8.matmul_path == "fp8-scaled-mm-rowwise" and fp8.tensor_core_bytes("cuda") > 0


def test_fp8_matmul_option_is_validated():
    from trainstream.options import validate
    assert validate({})["fp8_matmul"] is None
    assert validate({"fp8_matmul": "dequantize"})["fp8_matmul"] == "dequantize"
    with pytest.raises(ValueError, match=r"option fp8_matmul='bf16' is not accepted; accepted: "
                                         r"None \(each FP8 layer as it is"):
        validate({"fp8_matmul": "bf16"})
