"""BlockPager (trainstream/streaming/weights.py): weight paging and the per-block
activation policy, compared bit for bit with unpaged training on CPU (the CPU is the
"device"); test_paging_cuda.py does the same on a GPU."""
import contextlib

import pytest
import torch

from paging_helpers import STEPS, _pair, _assert_grads_equal, _config
from tiny_gpt import corpus, text_batches
from trainstream.memory import planner
from trainstream.streaming.activations import ActivationOffloader
from trainstream.streaming.weights import KEEP, OFFLOAD, RECOMPUTE, BlockPager, in_backward


@pytest.mark.parametrize("policy, steps", [("mixed", STEPS), (OFFLOAD, 3), (RECOMPUTE, 3)])
def test_everything_paged_is_bit_identical_over_10_steps(policy, steps):
    """Weights and activations of every block paged (no daemon: gradients land in
    p.grad on the host) against plain PyTorch: fp32 losses and gradients identical
    (10 steps with keep, offload and recompute blocks; 3 with one policy throughout)."""
    cfg, ref, ours = _pair(n_layer=4)
    policies = [OFFLOAD, "keep", RECOMPUTE, OFFLOAD] if policy == "mixed" else [policy] * 4
    off = ActivationOffloader(ours, device="cpu", min_offload_bytes=0)
    pager = BlockPager(list(ours.blocks), "cpu", paged=range(4), policy=policies, offloader=off,
                       min_paged_bytes=0)
    assert pager.report()["paged_bytes"] == sum(
        p.numel() * 4 for b in ours.blocks for p in b.parameters())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
    our_opt = torch.optim.AdamW(ours.parameters(), lr=3e-3, foreach=False)
    for step, (x, y) in enumerate(text_batches(corpus(), cfg, batch=4, steps=steps)):
        a, b = ref(x, y), ours(x, y)
        assert a.item() == b.item(), f"step {step}: loss {b.item()} vs {a.item()}"
        a.backward()
        b.backward()
        _assert_grads_equal(ref, ours, step)
        for o in (ref_opt, our_opt):
            o.step()
            o.zero_grad()
    stats = pager.report()
    assert stats["bytes_h2d"] > 0 and stats["fetches_backward"] > 0
    if policy != RECOMPUTE:
        assert off.stats["bytes_offloaded"] > 0
    pager.remove()
    assert "forward" not in ours.blocks[0].__dict__


class _RunningCopy:
    """A D2H copy's event that reports the copy running until ``synchronize()``."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


def test_finished_activation_copies_are_released_by_the_next_blocks():
    """The offloader holds each paged tensor on the device until its D2H copy is seen to
    finish. Only block 0 pages here: nothing packs after it, so unless the later blocks
    poll, its tensors stay on the device through the whole forward."""
    cfg, ref, ours = _pair(n_layer=4)
    off = ActivationOffloader(ours, device="cpu", min_offload_bytes=0)
    copies = []

    def to_host(src, dst):
        dst.copy_(src)
        copies.append(_RunningCopy())
        return copies[-1]
    off.engine.to_host = to_host
    BlockPager(list(ours.blocks), "cpu", policy=[OFFLOAD, KEEP, KEEP, KEEP], offloader=off)
    held = []

    def finish_copies(*_):
        held.append(off.inflight_bytes)
        for c in copies:
            c.synchronize()
    ours.blocks[2].register_forward_pre_hook(finish_copies)
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1)
    loss = ours(x, y)
    assert copies and held[0] > 0, "block 0's copies were in flight when block 2 began"
    assert off.inflight_bytes == 0, "block 3 must release the copies that finished"
    loss.backward()
    ref(x, y).backward()
    _assert_grads_equal(ref, ours, 0)


def test_pager_holds_only_a_few_blocks_at_a_time():
    cfg, _, ours = _pair(n_layer=6)
    pager = BlockPager(list(ours.blocks), "cpu", paged=range(6), prefetch_depth=2,
                       min_paged_bytes=0)
    seen = []
    real = pager._fetch

    def counting(i):
        f = real(i)
        seen.append(len(pager._fetches) + 1)
        return f
    pager._fetch = counting
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1)
    ours(x, y).backward()
    assert max(seen) <= 2 + 2, f"blocks on the device at once: {max(seen)}"
    assert pager._fetches == {} or set(pager._fetches) <= {0}


def test_recomputed_blocks_release_their_weights_in_backward():
    """Checkpoint reruns a block's forward in backward and stops it, by raising, once
    backward has what it needs. The pager released a block's weights after its forward
    returned, so every recomputed paged block's weights stayed on the device until the
    next forward (on the H200 a 14B bf16-base LoRA ran out of memory 2.6 GiB over its plan
    when 23 paged blocks tried recompute)."""
    cfg, ref, ours = _pair(n_layer=6)
    pager = BlockPager(list(ours.blocks), "cpu", paged=range(6), policy=[RECOMPUTE] * 6,
                       prefetch_depth=2, min_paged_bytes=0)
    held = []
    real = pager._fetch

    def counting(i):
        if in_backward():
            held.append(len(pager._fetches) + 1)
        return real(i)
    pager._fetch = counting
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1)
    ours(x, y).backward()
    ref(x, y).backward()
    _assert_grads_equal(ref, ours, 0)
    assert held, "backward fetched the blocks it recomputed"
    assert max(held) <= 2 + 2, f"blocks on the device at once in backward: {max(held)}"
    assert set(pager._fetches) <= {0}, f"blocks still held after backward: {sorted(pager._fetches)}"


@pytest.mark.parametrize("frozen", [False, True])
def test_pager_frees_each_blocks_weights_after_its_forward(frozen):
    """Counting the pager's own table is not enough: autograd keeps the pack hook of every
    tensor it saves, so the hook must not hold a block's device copies until backward."""
    import gc
    import weakref
    cfg, _, ours = _pair(n_layer=6)
    if frozen:
        ours.blocks.requires_grad_(False)
    off = ActivationOffloader(ours, device="cpu", min_offload_bytes=0)
    pager = BlockPager(list(ours.blocks), "cpu", paged=range(6), prefetch_depth=2,
                       policy=[OFFLOAD] * 6, offloader=off, min_paged_bytes=0)
    fetched = []
    real = pager._fetch

    def recording(i):
        f = real(i)
        fetched.extend((i, weakref.ref(t)) for t in f.tensors)
        return f
    pager._fetch = recording
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1)
    loss = ours(x, y)
    gc.collect()
    alive = sorted({i for i, t in fetched if t() is not None})
    assert alive == [5], f"blocks whose weight copies outlive their forward: {alive}"
    loss.backward()
    gc.collect()
    assert not any(t() is not None for _, t in fetched), "weight copies left after backward"


def test_pager_counts_weight_references_per_forward():
    """Two forwards before one backward (accumulation): the second forward wiped the
    first's reference counts, and its backward fetched each block again for every
    saved weight (29 extra fetches on this model)."""
    cfg, ref, ours = _pair(n_layer=4)
    pager = BlockPager(list(ours.blocks), "cpu", paged=range(4), min_paged_bytes=0)
    (x, y), (x2, y2) = text_batches(corpus(), cfg, batch=2, steps=2)
    a, b = ours(x, y), ours(x2, y2)
    assert pager.weights_referenced()
    before = pager.stats["fetch_misses"]
    a.backward()
    b.backward()
    assert pager.stats["fetch_misses"] - before <= 2
    ref(x, y).backward()
    ref(x2, y2).backward()
    _assert_grads_equal(ref, ours, 0)
    assert not pager.weights_referenced()
    # A graph dropped without backward (evaluation with grad on) holds nothing either.
    c = ours(x, y)
    assert pager.weights_referenced(3)
    del c
    assert not pager.weights_referenced()


@pytest.mark.parametrize("hooks", ["pager", "offloader"])
def test_a_graph_dropped_without_backward_is_freed(hooks):
    """Evaluation with grad on: the graph goes when its loss does. A pack hook that kept a
    saved output as itself made a cycle through autograd's C++ nodes, which no
    collection breaks: every block's activations stayed alive for good."""
    import gc
    import weakref
    cfg, _, ours = _pair(n_layer=4)
    if hooks == "pager":
        BlockPager(list(ours.blocks), "cpu", paged=range(4), min_paged_bytes=0)
        context = contextlib.nullcontext()
    else:  # tensors under min_offload_bytes are kept on the device
        context = ActivationOffloader(ours, device="cpu", min_offload_bytes=1 << 30)
    outs = []
    for b in ours.blocks:
        b.register_forward_hook(lambda m, i, o: outs.append(weakref.ref(o)))
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1)
    with context:
        loss = ours(x, y)
    del loss
    gc.collect()
    assert [o() is None for o in outs] == [True] * 4


def test_a_retained_graphs_second_backward_fetches_each_block_once():
    cfg, ref, ours = _pair(n_layer=4)
    pager = BlockPager(list(ours.blocks), "cpu", paged=range(4), min_paged_bytes=0)
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1)
    loss = ours(x, y)
    loss.backward(retain_graph=True)
    first = pager.stats["fetch_misses"]
    loss.backward()
    assert pager.stats["fetch_misses"] - first <= 2, "it fetched a block per saved weight"
    r = ref(x, y)
    r.backward(retain_graph=True)
    r.backward()
    _assert_grads_equal(ref, ours, 0)


def test_page_in_waits_for_graphs_and_survives_a_failed_copy(monkeypatch):
    cfg, ref, ours = _pair(n_layer=4)
    pager = BlockPager(list(ours.blocks), "cpu", paged=range(4), min_paged_bytes=0)
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1)
    loss = ours(x, y)
    assert not pager.page_in(3), "a live graph still looks for block 3's paged weights"
    loss.backward()
    # A copy that fails part-way (out of memory) leaves the block paged and usable.
    real, calls = torch.Tensor.to, [0]

    def failing_to(self, *a, **k):
        calls[0] += 1
        if calls[0] == 2:
            raise torch.OutOfMemoryError("simulated")
        return real(self, *a, **k)
    monkeypatch.setattr(torch.Tensor, "to", failing_to)
    with pytest.raises(torch.OutOfMemoryError):
        pager.page_in(3)
    monkeypatch.setattr(torch.Tensor, "to", real)
    assert 3 in pager.paged and 3 in pager._slots
    ours.zero_grad()
    ref(x, y).backward()
    ours(x, y).backward()
    _assert_grads_equal(ref, ours, 1)
    assert pager.page_in(3) and 3 not in pager.paged


def test_page_out_forgets_the_blocks_device_weights():
    """The activation offloader keeps weights on the device and pages everything else;
    a block paged out frees its weights' memory, so those addresses stop being weights
    (an activation the allocator puts there later was kept instead of paged)."""
    cfg, _, ours = _pair(n_layer=4)
    off = ActivationOffloader(ours, device="cpu", min_offload_bytes=0)
    first = {p.data_ptr() for p in ours.blocks[0].parameters()}
    pager = BlockPager(list(ours.blocks), "cpu", paged=[0], offloader=off, min_paged_bytes=0)
    assert not (first & off._weights), "paged at construction (wrap() builds the offloader first)"
    old = {p.data_ptr() for p in ours.blocks[1].parameters()}
    assert old <= off._weights
    assert pager.page_out(1)
    assert not (old & off._weights)


def test_pager_rejects_bad_block_indices():
    _, _, ours = _pair()
    with pytest.raises(ValueError, match="out of range"):
        BlockPager(list(ours.blocks), "cpu", paged=[7])


def test_frozen_and_quantized_weights_page_exactly():
    """A frozen base (plain and NF4 QuantLinear weights) with small trained adapters:
    paged (frozen tensors in the block's host buffer, adapters resident) vs not."""
    from trainstream.frozen.quantization import QuantLinear
    cfg, ref, ours = _pair(seed=5)
    for model in (ref, ours):
        model.requires_grad_(False)
        for block in model.blocks:
            block.mlp[0] = QuantLinear.from_linear(block.mlp[0], "nf4")  # same bytes in both
            block.ln1.requires_grad_(True)  # small trained tensors stay on the device
    ours_blocks = list(ours.blocks)
    pager = BlockPager(ours_blocks, "cpu", paged=range(4), min_paged_bytes=1024,
                       offloader=ActivationOffloader(ours, device="cpu", min_offload_bytes=0),
                       policy=[OFFLOAD, "keep", RECOMPUTE, OFFLOAD])
    homes = {s.name for s in pager._slots[0]}
    assert {"weight", "qdata"} <= homes, homes
    assert pager._slots[0][0].host.data_ptr() != 0
    for step, (x, y) in enumerate(text_batches(corpus(), cfg, batch=4, steps=3, seed=5)):
        a, b = ref(x, y), ours(x, y)
        assert a.item() == b.item(), f"step {step}"
        a.backward()
        b.backward()
        _assert_grads_equal(ref, ours, step)
        for m in (ref, ours):
            m.zero_grad()
    assert pager.report()["fetches_backward"] > 0


def test_frozen_weights_in_registered_host_memory_page_from_where_they_are(monkeypatch):
    """A shared base's mapping (load_model) is registered host memory: its blocks page
    straight from it, with no per-process copy. Registration is faked here (no CUDA)."""
    from trainstream.streaming import weights as paging
    cfg, ref, ours = _pair(seed=5)
    ours.blocks.requires_grad_(False)
    ref.blocks.requires_grad_(False)
    shared = {t.data_ptr() for t in list(ours.blocks.parameters()) + list(ours.blocks.buffers())}

    def registered(t):
        return t.data_ptr() in shared
    monkeypatch.setattr(paging, "registered_host", registered)
    monkeypatch.setattr(planner, "registered_host", registered)
    buffers = []
    real = BlockPager._host_buffer
    monkeypatch.setattr(BlockPager, "_host_buffer",
                        lambda self, n: buffers.append(n) or real(self, n))
    pager = BlockPager(list(ours.blocks), "cpu", paged=range(4), min_paged_bytes=0)
    assert buffers == [], "frozen weights in registered memory were copied"
    homes = {s.host.data_ptr() for slots in pager._slots.values() for s in slots}
    assert homes and homes <= shared
    for step, (x, y) in enumerate(text_batches(corpus(), cfg, batch=2, steps=3, seed=5)):
        a, b = ref(x, y), ours(x, y)
        assert a.item() == b.item(), f"step {step}"
        a.backward()
        b.backward()
        _assert_grads_equal(ref, ours, step)
    summary = planner.summarize(ours, list(ours.blocks), 0)
    assert all(b.frozen_registered_bytes == b.frozen_bytes > 0 for b in summary.blocks)
    plan = planner.plan(summary, planner.Capacity("cpu", 1 << 20, 64 << 30, None), _config(
        param_offload=True, check_memory=False))
    assert plan.host_bytes["pinned frozen weights of paged blocks"] == 0
