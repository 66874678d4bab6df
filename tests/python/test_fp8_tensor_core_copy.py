"""The fp8 tensor-core copy (Note [The fp8 tensor-core copy lives only with resident
weights], frozen/quantization.py): counted by the planner, never outliving a block's
residency, built in row chunks with the same bytes as the whole-weight build. The path
decision is forced (no _scaled_mm runs); the CUDA matmul itself is test_quant_cuda's."""
import torch
from torch import nn

from paging_helpers import _config
from trainstream.frozen import fp8_matmul, quantization
from trainstream.memory import planner
from trainstream.memory.capacity import Capacity
from trainstream.streaming.weights import BlockPager

OUT, IN = 96, 64  # multiples of 16 (the path's rule) and 32 (fp8 blocks)


def _blocks(n=4):
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(IN, OUT, bias=False), nn.ReLU(),
                                         nn.Linear(OUT, IN, bias=False)) for _ in range(n))
    blocks.requires_grad_(False)
    quantization.quantize_model(nn.Sequential(blocks), "fp8", blocks=blocks)
    return blocks


def _force_tensor_cores(monkeypatch):
    def probe(device):
        return device.type == "cuda", "forced by the test"
    monkeypatch.setattr(quantization, "_fp8_rowwise_supported", probe)
    monkeypatch.setattr(fp8_matmul, "_fp8_rowwise_supported", probe)


def _copy_bytes_per_block():
    return (OUT * IN + 4 * OUT) + (IN * OUT + 4 * IN)


def test_planner_counts_the_tensor_core_copy_of_resident_fp8_blocks(monkeypatch):
    _force_tensor_cores(monkeypatch)
    blocks = _blocks()
    model = nn.Sequential(blocks)
    s = planner.summarize(model, blocks, 1 << 10, "fp8", 64, device=torch.device("cuda"))
    assert all(b.derived_bytes == _copy_bytes_per_block() for b in s.blocks)
    stored = sum(t.numel() * t.element_size() for t in blocks[0].buffers())
    assert s.blocks[0].weight_bytes(False) == stored + _copy_bytes_per_block()
    assert s.blocks[0].paged_bytes(False) == stored  # a paged block builds no copy
    cap = Capacity("cuda:0", 1 << 30, 64 << 30, None)
    p = planner.plan(s, cap, _config(param_offload=[0], quantize=None))
    assert p.device_bytes["resident blocks (weights + gradients)"] == \
        3 * (stored + _copy_bytes_per_block())
    # On the CPU (or where the path is refused) nothing is derived.
    cpu = planner.summarize(model, blocks, 1 << 10, "fp8", 64, device=torch.device("cpu"))
    assert all(b.derived_bytes == 0 for b in cpu.blocks)


def test_planner_counts_the_copy_when_wrap_quantizes_to_fp8(monkeypatch):
    _force_tensor_cores(monkeypatch)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(IN, OUT, bias=False), nn.ReLU(),
                                         nn.Linear(OUT, IN, bias=False)) for _ in range(4))
    blocks.requires_grad_(False)
    s = planner.summarize(nn.Sequential(blocks), blocks, 1 << 10, "fp8", 64,
                          device=torch.device("cuda"))
    b = s.blocks[0]
    assert b.quantized_derived_bytes == _copy_bytes_per_block() and b.derived_bytes == 0
    assert b.weight_bytes(True) == b.quantized_bytes + _copy_bytes_per_block()
    assert b.paged_bytes(True) == b.quantized_bytes
    assert b.weight_bytes(False) == b.frozen_bytes  # not quantized: no copy
    nf4 = planner.summarize(nn.Sequential(blocks), blocks, 1 << 10, "nf4", 64,
                            device=torch.device("cuda"))
    assert nf4.blocks[0].quantized_derived_bytes == 0


def _linears(block):
    return [m for m in block.modules() if isinstance(m, quantization.QuantLinear)]


def test_a_paged_block_drops_its_tensor_core_copy_and_builds_none():
    blocks = _blocks()
    for block in blocks:  # as a resident forward on a GPU would have left them
        for m in _linears(block):
            m._fp8_weight(torch.device("cpu"))
    pager = BlockPager(blocks, "cpu", paged=[0], min_paged_bytes=1 << 10)
    assert all(m._fp8_cache is None for m in _linears(blocks[0]))
    assert all(m._fp8_cache is not None for m in _linears(blocks[1]))
    assert pager.page_out(1)
    assert all(m._fp8_cache is None for m in _linears(blocks[1]))
    assert pager.page_in(1)
    assert all(not m._paged for m in _linears(blocks[1]))
    assert all(m._paged for m in _linears(blocks[0]))


def test_page_in_cost_counts_the_copy_a_resident_block_will_build(monkeypatch):
    _force_tensor_cores(monkeypatch)
    blocks = _blocks(2)
    pager = BlockPager(blocks, "cpu", paged=[0], min_paged_bytes=1 << 10)
    on_cpu = pager.page_in_cost(0)  # no copy is built on the CPU
    pager.device = torch.device("cuda")  # the device the copy would be built on
    assert pager.page_in_cost(0) == on_cpu + _copy_bytes_per_block()


def test_chunked_build_gives_the_whole_weight_build_bytes(monkeypatch):
    blocks = _blocks(1)
    m = _linears(blocks[0])[0]
    w = m.qweight.dequantize(torch.float32)
    amax = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    scale = quantization._pow2_at_least(amax / 448.0)
    want = (w / scale[:, None]).to(torch.float8_e4m3fn)
    monkeypatch.setattr(quantization, "_FP8_BUILD_CHUNK", 5 * IN)  # 5 rows a chunk: uneven
    got, got_scale = m._fp8_weight(torch.device("cpu"))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got_scale, scale[None, :])


def test_fp8_matmul_dequantize_derives_no_copy_for_the_planner(monkeypatch):
    # The switch (wrap's fp8_matmul option): a base quantized before wrap() and one wrap
    # would quantize both plan without the tensor-core copy, where "auto" counts it.
    _force_tensor_cores(monkeypatch)
    cuda = torch.device("cuda")
    blocks = _blocks()
    model = nn.Sequential(blocks)
    assert quantization.set_fp8_matmul(model, "dequantize") == 2 * len(blocks)
    s = planner.summarize(model, blocks, 1 << 10, "fp8", 64, device=cuda)
    assert all(b.derived_bytes == 0 for b in s.blocks)
    quantization.set_fp8_matmul(model, "auto")
    s = planner.summarize(model, blocks, 1 << 10, "fp8", 64, device=cuda)
    assert all(b.derived_bytes == _copy_bytes_per_block() for b in s.blocks)

    plain = nn.ModuleList(nn.Linear(IN, OUT, bias=False) for _ in range(2)).requires_grad_(False)
    for mode, expected in (("auto", OUT * IN + 4 * OUT), ("dequantize", 0)):
        s = planner.summarize(nn.Sequential(plain), plain, 1 << 10, "fp8", 64, device=cuda,
                              fp8_matmul=mode)
        assert s.blocks[0].quantized_derived_bytes == expected, mode


def _measured(blocks, device):
    """What wrap()'s measure step would hand its plan: ``blocks`` on ``device``, 1 GiB of
    it and 64 GiB of host memory."""
    from trainstream.memory import install
    from trainstream.memory.capacity import Capacity
    return install.Measured(torch.device(device), list(blocks), False,
                            Capacity(str(device), 1 << 30, 64 << 30, None))


def test_wraps_summary_counts_the_copy_as_the_option_says(monkeypatch):
    # install.summarize (wrap()'s plan and benchmarks' plan_only): the option reaches the
    # bytes of layers already quantized and of those wrap() would quantize to FP8.
    from trainstream.memory import install
    from trainstream.options import validate
    _force_tensor_cores(monkeypatch)
    found = _blocks(2)
    plain = nn.ModuleList(nn.Sequential(nn.Linear(IN, OUT, bias=False)) for _ in range(2))
    plain.requires_grad_(False)
    for option, copies in ((None, 1), ("auto", 1), ("dequantize", 0)):
        for blocks, quantize, per_block in ((found, None, _copy_bytes_per_block()),
                                            (plain, "fp8", OUT * IN + 4 * OUT)):
            s = install.summarize(nn.Sequential(blocks), _measured(blocks, "cuda:0"),
                                  validate({"quantize": quantize, "fp8_matmul": option}))
            derived = s.blocks[0].derived_bytes if quantize is None else \
                s.blocks[0].quantized_derived_bytes
            assert derived == copies * per_block, (option, quantize)


def test_wraps_plan_sets_fp8_matmul_on_the_layers_it_quantizes_and_on_those_it_found():
    from trainstream.memory import install
    from trainstream.options import validate

    def plan(blocks, **options):  # wrap()'s plan step on the CPU
        model = nn.Sequential(blocks)
        install.plan(model, _measured(blocks, "cpu"), validate({"profile": False, **options}))
        return model
    found = _blocks(2)  # quantized before wrap(), as load_model's bases are
    fresh = nn.ModuleList(nn.Sequential(nn.Linear(IN, OUT, bias=False)) for _ in range(2))
    fresh.requires_grad_(False)
    for blocks, quantize in ((found, None), (fresh, "fp8")):
        model = plan(blocks, quantize=quantize, fp8_matmul="dequantize")
        layers = [m for m in model.modules() if isinstance(m, quantization.QuantLinear)]
        assert layers and all(m.fp8_matmul == "dequantize" for m in layers), quantize
    # Without the option (None) a mode set before wrap() holds; given, it overrides.
    for option, expected in ((None, "dequantize"), ("auto", "auto")):
        blocks = _blocks(2)
        quantization.set_fp8_matmul(nn.Sequential(blocks), "dequantize")
        model = plan(blocks, quantize=None, fp8_matmul=option)
        assert all(m.fp8_matmul == expected for m in _linears(model)), option
