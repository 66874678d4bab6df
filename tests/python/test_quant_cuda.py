"""Quantization on CUDA: identical bytes to the CPU kernels for every format, on random
and adversarial tensors; CUDA dequantize equals CPU dequantize; QuantLinear on the GPU
(the FP8 tensor-core path where torch accepts it). Run on the GPU host:
    PYTHONPATH=<build>/python python -m pytest tests/python/test_quant_cuda.py -v
"""
import pytest
import torch

from quant_helpers import FORMATS, TinyTransformer, adversarial, gaussian, on_grid
from trainstream import _C
from trainstream.quantization import QuantLinear, quant_report, quantize_model, quantize_tensor

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and getattr(_C, "with_cuda", False)),
    reason="needs a CUDA GPU and trainstream._C built with CUDA (run on the GPU host)")


def _cases():
    cases = list(adversarial())
    cases.append(("gaussian 1M", gaussian(1 << 20, seed=5)))
    cases.append(("bf16 weights", gaussian(123_457, seed=6).to(torch.bfloat16)))
    cases.extend((f"grid {f}", on_grid(f)) for f in FORMATS)
    return cases


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block", [64, 2, 126, 128])
def test_cpu_and_cuda_produce_identical_bytes(fmt, block):
    for name, t in _cases():
        cpu = _C.quant.quantize(t, fmt, block)
        gpu = _C.quant.quantize(t.cuda(), fmt, block)
        for what, a, b in zip(("data", "scales", "tensor_scale"), cpu, gpu):
            b = b.cpu()
            if not torch.equal(a, b):
                diff = (a != b).nonzero().flatten()[:8].tolist()
                pytest.fail(f"{fmt} block {block} {name}: {what} differ at {diff}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_dequantize_equals_cpu(fmt, dtype):
    for name, t in _cases():
        for block in (64, 2):
            q = _C.quant.quantize(t, fmt, block)
            cpu = _C.quant.dequantize(*q, fmt, t.numel(), block, dtype)
            gpu = _C.quant.dequantize(*(x.cuda() for x in q), fmt, t.numel(), block, dtype)
            assert torch.equal(cpu.view(torch.uint8) if dtype == torch.bfloat16 else cpu,
                               (gpu.view(torch.uint8) if dtype == torch.bfloat16 else gpu).cpu()), \
                f"{fmt} {name} block {block} {dtype}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_unaligned_buffers_take_the_generic_kernel(fmt):
    t = gaussian(10_000, seed=9)
    q = _C.quant.quantize(t, fmt, 64)
    data = torch.empty(q[0].numel() + 1, dtype=torch.uint8, device="cuda")[1:]
    data.copy_(q[0])  # 1-byte offset: not 16-byte aligned
    gpu = _C.quant.dequantize(data, q[1].cuda(), q[2].cuda(), fmt, t.numel(), 64, torch.float32)
    cpu = _C.quant.dequantize(*q, fmt, t.numel(), 64, torch.float32)
    assert torch.equal(gpu.cpu(), cpu)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_tensor_same_bytes_on_cpu_and_cuda(fmt):
    w = gaussian(4096 * 3 + 5, seed=2).view(-1)
    a, b = quantize_tensor(w, fmt), quantize_tensor(w.cuda(), fmt)
    assert torch.equal(a.data, b.data.cpu()) and torch.equal(a.scales, b.scales.cpu())
    assert torch.equal(a.dequantize(torch.bfloat16), b.dequantize(torch.bfloat16).cpu())


@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_linear_on_cuda(fmt):
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 256, device="cuda").requires_grad_(False)
    ql = QuantLinear.from_linear(lin, fmt)
    w = ql.qweight.dequantize(torch.bfloat16)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = ql(x)
    ref = torch.nn.functional.linear(x.detach(), w, ql.bias.to(torch.bfloat16))
    rel = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    if fmt == "fp8" and torch.cuda.get_device_capability() >= (8, 9):
        assert ql.matmul_path == "fp8-scaled-mm-rowwise", ql.matmul_note
        assert rel < 0.05  # activations are quantized to e4m3 too
    else:
        assert ql.matmul_path == "dequantize-bf16"
        assert rel < 1e-2
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad.float(), torch.ones_like(y).float() @ w.float(),
                               rtol=2e-2, atol=2e-2)


def test_quantize_model_on_cuda():
    torch.manual_seed(0)
    model = TinyTransformer().cuda().requires_grad_(False)
    result = quantize_model(model, quantize="nf4")
    assert result["tensors"] == 12
    tokens = torch.randint(0, 100, (2, 16), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(tokens)
    assert torch.isfinite(out).all()
    assert all(r["matmul_path"] == "dequantize-bf16" for r in quant_report(model))
