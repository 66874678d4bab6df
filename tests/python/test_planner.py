"""The memory planner (trainstream/memory/planner.py): a pure function of a model
summary, a capacity and the options, tested with any capacity."""
import pytest
import torch
from torch import nn

from paging_helpers import _config
from trainstream.memory import planner


def _summary(n=8, trained=100 << 20, frozen=0, outside=50 << 20):
    blocks = [planner.BlockSummary(trained_bytes=trained, trained_numel=trained // 4,
                                   frozen_bytes=frozen, quantizable_bytes=frozen,
                                   quantized_bytes=frozen // 4 + 1) for _ in range(n)]
    # fp32 weights: the daemon's masters are their weight slots (no bytes beyond them).
    return planner.ModelSummary(blocks, outside, outside, n * trained // 4 + outside // 4,
                                n * trained + outside, 0)


def _cap(vram_gib, ram_gib=64.0, daemon_gib=None):
    return planner.Capacity("cuda", int(vram_gib * 2**30), int(ram_gib * 2**30),
                            None if daemon_gib is None else int(daemon_gib * 2**30), 50.0,
                            source="test")


def test_planner_pages_fewer_blocks_with_more_memory():
    s = _summary()
    small = planner.plan(s, _cap(1.5), _config())
    large = planner.plan(s, _cap(2.0), _config())
    huge = planner.plan(s, _cap(100.0), _config())
    assert len(small.paged) > len(large.paged) > len(huge.paged) == 0
    usable = small.usable_vram * (1 - planner.ACTIVATION_RESERVE)
    assert sum(small.device_bytes.values()) <= usable
    assert small.pcie_bytes_per_step > large.pcie_bytes_per_step


def test_planner_explicit_choices():
    s = _summary()
    assert planner.plan(s, _cap(100), _config(param_offload=True)).paged == list(range(8))
    assert planner.plan(s, _cap(100), _config(param_offload=0.5)).paged == [0, 1, 2, 3]
    assert planner.plan(s, _cap(100), _config(param_offload=[5, 2])).paged == [2, 5]
    with pytest.raises(ValueError, match="out of range"):
        planner.plan(s, _cap(100), _config(param_offload=[8]))


def test_planner_memory_error_names_device_categories():
    with pytest.raises(MemoryError) as info:
        planner.plan(_summary(outside=4 << 30), _cap(2.0), _config())
    msg = str(info.value)
    assert "weights outside the blocks 4.00 GiB" in msg and "usable 1.80 GiB" in msg, msg
    # check_memory=False: the plan is returned anyway.
    p = planner.plan(_summary(outside=4 << 30), _cap(2.0), _config(check_memory=False))
    assert p.paged == list(range(8))


def test_planner_moment_dtype_auto_and_host_memory_error():
    s = _summary(n=8, trained=1 << 30)  # 8 GiB of fp32 weights trained: 2 Gi elements
    fp32 = planner.plan(s, _cap(100, ram_gib=200), _config(moment_dtype="auto"))
    assert fp32.moment_dtype == "float32"
    # fp32 weights are their own masters: moments 16 + slots 16 GiB; bf16 moments: 24 GiB.
    bf16 = planner.plan(s, _cap(100, ram_gib=100, daemon_gib=30), _config(moment_dtype="auto"))
    assert bf16.moment_dtype == "bfloat16"
    assert any("bf16 moments" in d for d in bf16.decisions)
    with pytest.raises(MemoryError, match="daemon budget free 20.00 GiB"):
        planner.plan(s, _cap(100, ram_gib=100, daemon_gib=20), _config(moment_dtype="auto"))


def test_planner_quantize_auto():
    s = _summary(trained=0, frozen=256 << 20)
    exact = planner.plan(s, _cap(2.0), _config())
    assert exact.quantize is None and exact.paged
    speed = planner.plan(s, _cap(2.0), _config(prefer="speed"))
    assert speed.quantize == "nf4" and len(speed.paged) < len(exact.paged)
    tight_host = planner.plan(s, _cap(2.0, ram_gib=1.0), _config())
    assert tight_host.quantize == "nf4", tight_host.decisions


def test_planner_keeps_at_least_128_mib_free_on_cuda():
    small = planner.Capacity("cuda:0", 512 << 20, 64 << 30, None, 50.0, source="test")
    p = planner.plan(_summary(n=8, trained=8 << 20, outside=8 << 20), small,
                     _config(vram_headroom=0.10))
    assert p.usable_vram == (512 - 128) << 20       # not 90% of 512 MiB
    declared = planner.Capacity("cpu", 512 << 20, 64 << 30, None, 0.0, source="test")
    p = planner.plan(_summary(n=8, trained=8 << 20, outside=8 << 20), declared,
                     _config(vram_headroom=0.10))
    assert p.usable_vram == int((512 << 20) * 0.9)  # a declared CPU capacity: the fraction
    big = planner.Capacity("cuda:0", 24 << 30, 64 << 30, None, 50.0, source="test")
    p = planner.plan(_summary(), big, _config(vram_headroom=0.10))
    assert p.usable_vram == int((24 << 30) * 0.9)


def test_planner_bounds_activation_copies_in_flight_by_half_the_reserve():
    # A fast forward runs ahead of its D2H copies; each copy holds its device tensor.
    s = _summary(n=8, trained=8 << 20, outside=8 << 20)
    small = planner.Capacity("cuda:0", 512 << 20, 64 << 30, None, 50.0, source="test")
    p = planner.plan(s, small, _config())
    assert p.max_inflight_bytes == int(((512 - 128) << 20) * planner.ACTIVATION_RESERVE) // 2
    assert any(d.startswith("max_inflight_bytes") for d in p.decisions), p.decisions
    assert planner.plan(s, small, _config(max_inflight_bytes=1 << 20)).max_inflight_bytes == 1 << 20
    big = planner.plan(s, _cap(24), _config())
    assert big.max_inflight_bytes == 1 << 30   # the option's default is below the bound
    assert not any(d.startswith("max_inflight_bytes") for d in big.decisions)
    unknown = planner.Capacity("cpu", None, 64 << 30, None, 0.0, source="test")
    assert planner.plan(s, unknown, _config()).max_inflight_bytes is None


@pytest.mark.parametrize("dtype,master", [(torch.float32, 0), (torch.bfloat16, 2),
                                          (torch.float16, 4)])
def test_planner_host_error_lists_the_daemons_bytes_per_parameter(dtype, master):
    # Note [One host copy of a trained weight]: beyond its weight slot the daemon's master
    # takes nothing for an fp32 weight, 2 B for bf16 (the low halves), 4 for fp16.
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]).to(dtype)
    s = planner.summarize(model, list(model), min_paged_bytes=0)
    assert s.master_bytes == master * s.trained_numel
    with pytest.raises(MemoryError) as info:
        planner.plan(s, _cap(100, ram_gib=1e-6), _config(moment_dtype="float32", grad_pool=0))
    msg = str(info.value)
    size = torch.finfo(dtype).bits // 8
    assert f"needs {s.trained_numel * (master + 8 + 2 * size) / 2**10:.2f} KiB = " \
           f"{master + 8 + 2 * size:.2f} B per trained parameter" in msg, msg
    assert "daemon moments (fp32) 130.00 KiB = 8.00 B/param" in msg, msg
    assert f"weight slots {s.trained_bytes / 2**10:.2f} KiB = {size:.2f} B/param" in msg, msg
    assert f"gradient slots {s.trained_bytes / 2**10:.2f} KiB = {size:.2f} B/param" in msg, msg
    if master:
        assert f"daemon masters beyond the weight slots {s.master_bytes / 2**10:.2f} KiB = " \
               f"{master:.2f} B/param" in msg, msg
    else:
        assert "daemon masters" not in msg, msg


def test_planner_counts_the_gradient_pool_instead_of_gradient_slots():
    # docs/staging-pool.md: "auto" is at least 20 ms of PCIe but never more than the
    # slots it replaces (here all 16 MiB); a size asks for that much; clipping keeps
    # the slots.
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(4)])
    s = planner.summarize(model, list(model), min_paged_bytes=0)
    assert s.trained_extents == [4 << 20] * 4
    for cfg, want in ((dict(), "gradient pool 16.00 MiB = 4.00 B/param"),
                      (dict(max_grad_norm=1.0),
                       "gradient slots (max_grad_norm holds a whole step) 16.00 MiB = 4.00 B/param"),
                      (dict(grad_pool="4MiB"), "gradient pool 4.00 MiB = 1.00 B/param")):
        with pytest.raises(MemoryError) as info:
            planner.plan(s, _cap(100, ram_gib=1e-6), _config(moment_dtype="float32", **cfg))
        assert want in str(info.value), str(info.value)
