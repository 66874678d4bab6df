"""Weight and activation paging, recompute, the memory planner and attention selection
(docs/paging.md). On CPU the paged code path runs with the CPU as the "device", so
paged training is compared bit for bit with unpaged training here; test_paging_cuda.py
does the same on a GPU."""
import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import trainstream
from tiny_gpt import GPTConfig, TinyGPT, corpus, text_batches
from trainstream import planner
from trainstream.activations import ActivationOffloader
from trainstream.attention import AttentionSelector, allowed_backends
from trainstream.paging import KEEP, OFFLOAD, RECOMPUTE, BlockPager, in_backward

STEPS = 10


def _pair(seed=0, n_layer=4):
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=n_layer)
    ref = TinyGPT(cfg)
    return cfg, ref, copy.deepcopy(ref)


def _assert_grads_equal(ref, ours, step):
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        assert (a.grad is None) == (b.grad is None), f"step {step}: {name}"
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), f"step {step}: gradient of {name} differs"


# ------------------------------------------------------------------ ActivationOffloader
def test_activation_offloader_alone_is_exact_and_pages():
    cfg, ref, ours = _pair()
    (x, y), = text_batches(corpus(), cfg, batch=4, steps=1)
    ref(x, y).backward()
    off = ActivationOffloader(ours, device="cpu", min_offload_bytes=4096, prefetch_depth=2)
    with off:
        loss = ours(x, y)
    assert off.stats["tensors_offloaded"] > 0 and off.stats["bytes_offloaded"] > 0
    assert off.stats["tensors_kept"] > 0, "tensors under min_offload_bytes stay"
    loss.backward()
    _assert_grads_equal(ref, ours, 0)
    assert off.stats["prefetch_hits"] > 0, "backward must find prefetched pages"
    assert off._live == 0, "every page consumed by backward"
    before = dict(off.stats)
    off.remove()
    ours(x, y).backward()  # no longer paging
    assert off.stats["tensors_offloaded"] == before["tensors_offloaded"]


def test_activation_offloader_pages_split_views():
    # q, k and v sliced from one fused projection are not dense: kept on the device,
    # any of them would hold the whole projection output there.
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 3 * 64)
    x = torch.randn(8, 16, 64)

    def run(offloader):
        lin.zero_grad()
        ctx = offloader if offloader is not None else torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: t)
        with ctx:
            q, k, v = lin(x).split(64, dim=-1)
            assert not q.is_contiguous() and q._base is not None
            loss = ((q * k).softmax(-1) * v).sum()
        loss.backward()
        return lin.weight.grad.clone(), lin.bias.grad.clone()

    ref = run(None)
    off = ActivationOffloader(device="cpu", min_offload_bytes=1024)
    ours = run(off)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref)), "paged views rebuilt exactly"
    assert off.stats["tensors_kept"] == 0, off.stats
    assert off._live == 0, "every page consumed by backward"
    # The projection saves x; q * k saves q and k: pages of their own elements, not
    # of the whole projection output.
    off = ActivationOffloader(device="cpu", min_offload_bytes=1024)
    with off:
        q, k, _ = lin(x).split(64, dim=-1)
        saved = q * k
    assert off.stats["tensors_offloaded"] == 3
    assert off.stats["bytes_offloaded"] == x.numel() * 4 + 2 * q.numel() * 4
    del saved


def test_activation_offloader_keeps_views_of_much_larger_bases():
    big = torch.randn(64, 1024, requires_grad=True)
    off = ActivationOffloader(device="cpu", min_offload_bytes=0)
    with off:
        y = big * 1.0
        part = y[:, :8]             # 1/128 of y: paging y for it would move 128x the bytes
        z = part * part
    # part * part saves part twice; both stay.
    assert off.stats["tensors_kept"] == 2 and off.stats["tensors_offloaded"] == 0, off.stats
    z.sum().backward()
    assert torch.equal(big.grad[:, :8], 2 * big.detach()[:, :8])


def test_activation_offloader_keeps_overlapping_views():
    # An expand()ed view's elements share memory: copied into a buffer of its span they
    # could not be rebuilt, so it stays on the device (and backward still works).
    torch.manual_seed(0)
    x = torch.randn(1, 256, requires_grad=True)
    b = torch.randn(32, 256, 4, requires_grad=True)

    def run(offloader):
        x.grad = b.grad = None
        ctx = offloader if offloader is not None else torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: t)
        with ctx:
            e = (x * 1.0).expand(32, 256)
            w = (x * 2.0).t().unfold(0, 4, 1)   # overlapping windows, no zero stride
            y = torch.bmm(e.unsqueeze(1), b).sum() + (w * w).sum()
        y.backward()
        return x.grad.clone(), b.grad.clone()

    ref = run(None)
    off = ActivationOffloader(device="cpu", min_offload_bytes=0)
    ours = run(off)
    assert all(torch.equal(a, c) for a, c in zip(ours, ref))
    assert off.stats["tensors_kept"] >= 2, off.stats


def test_activation_offloader_frees_pages_of_a_graph_dropped_without_backward():
    cfg, _, ours = _pair()
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1)
    off = ActivationOffloader(ours, device="cpu", min_offload_bytes=0)
    with off:
        loss = ours(x, y)
    assert off._live > 0
    del loss
    assert off._live == 0, "a freed graph must release its pages (arena reuse)"


def test_activation_offloader_keeps_a_retained_graphs_pages_through_a_new_forward():
    """A retained graph's second backward reads its pages again: a forward in between
    must not reuse their host memory (it reset the arena once every page had been
    unpacked once, and 48 of 48 gradients came out wrong)."""
    cfg, ref, ours = _pair()
    (x, y), (x2, y2) = text_batches(corpus(), cfg, batch=2, steps=2)
    off = ActivationOffloader(ours, device="cpu", min_offload_bytes=0)
    with off:
        a = ours(x, y)
    a.backward(retain_graph=True)
    with off:
        b = ours(x2, y2)
    ours.zero_grad()
    a.backward()
    ref(x, y).backward()
    _assert_grads_equal(ref, ours, 0)
    assert off.stats["prefetch_hits"] > 0, "the second backward prefetches too"
    del a, b
    assert off._live == 0 and off._prefetched_bytes == 0


def test_activation_offloader_accounts_a_backward_that_raised():
    """Pages fetched by a backward that raised, then dropped with their graph, give their
    bytes back to the prefetch budget (they stayed counted, and prefetch stopped once the
    leftovers passed max_inflight_bytes)."""
    cfg, _, ours = _pair()
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1)
    off = ActivationOffloader(ours, device="cpu", min_offload_bytes=0)

    def boom(_):
        raise RuntimeError("stands in for an out-of-memory error in backward")
    hook = ours.blocks[1].register_forward_hook(lambda m, i, o: o.register_hook(boom) and None)
    with off:
        loss = ours(x, y)
    with pytest.raises(RuntimeError, match="stands in"):
        loss.backward()
    assert off._prefetched_bytes > 0, "the backward had fetched pages when it raised"
    del loss
    assert off._live == 0 and off._prefetched_bytes == 0
    hook.remove()


def test_activation_offloader_rejects_bad_values():
    with pytest.raises(ValueError, match="prefetch_depth"):
        ActivationOffloader(device="cpu", prefetch_depth=0)
    with pytest.raises(ValueError, match="min_offload_bytes"):
        ActivationOffloader(device="cpu", min_offload_bytes=-1)


# ------------------------------------------------------------------------- BlockPager
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


# ------------------------------------------------------------------------- via wrap()
def _train(model, opt, batches, accumulation=1):
    losses = []
    for x, y in batches:
        for xm, ym in zip(x.chunk(accumulation), y.chunk(accumulation)):
            loss = model(xm, ym) / accumulation
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.parametrize("accumulation", [1, 2])
def test_wrap_everything_paged_matches_unpaged_bit_for_bit(daemon, accumulation):
    cfg, ref, ours = _pair(seed=1)
    steps = STEPS if accumulation == 1 else 4
    batches = text_batches(corpus(), cfg, batch=4, steps=steps, seed=1)
    ref, ref_opt = trainstream.wrap(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3),
                                    socket=daemon.socket, accumulation_steps=accumulation)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 socket=daemon.socket, accumulation_steps=accumulation,
                                 param_offload=True, activation_offload=True,
                                 min_offload_bytes=0, recompute=[1])
    session = ours._trainstream_session
    # A trained paged weight's home is its param slot in the session's shared memory.
    e = opt._entries[id(ours.blocks[0].mlp[0].weight)]
    assert ours.blocks[0].mlp[0].weight.data_ptr() == e.param_slot.data_ptr()
    ref_losses = _train(ref, ref_opt, batches, accumulation)
    our_losses = _train(ours, opt, batches, accumulation)
    assert ref_losses == our_losses
    assert our_losses[-1] < our_losses[0]
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(p, q), f"{name} differs after {steps} steps"
    report = trainstream.memory_report(ours)
    assert report["params"]["paged_blocks"] == [0, 1, 2, 3]
    assert report["params"]["bytes_h2d"] > 0
    assert report["activations"]["policy"][RECOMPUTE] == [1]
    assert report["activations"]["bytes_offloaded"] > 0
    assert report["plan"]["paged_blocks"] == [0, 1, 2, 3]
    assert any(ev["kind"] == "plan" for ev in report["events"])
    assert session.adapting is False
    trainstream.unwrap(ours)
    x, y = batches[0]
    assert torch.isfinite(ours(x, y)), "an unwrapped model still runs on its own copies"


def test_a_forward_that_raised_leaves_no_stale_prefetch(daemon):
    """A training forward prefetches the first paged blocks before block 0; if it raises
    before block 0 and the weights change, an evaluation forward used the old copies."""
    cfg, ref, ours = _pair(seed=2)
    ours, _ = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=1e-3),
                               socket=daemon.socket, param_offload=True, min_offload_bytes=0)
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1)
    with pytest.raises(IndexError):
        ours(x + cfg.vocab_size, y)  # out-of-range ids: raises in the embedding
    with torch.no_grad():
        for a, b in zip(ref.parameters(), ours.parameters()):
            a.mul_(1.5)
            b.mul_(1.5)  # a paged weight's host home
        assert ref(x, y).item() == ours(x, y).item()
    trainstream.unwrap(ours)


def test_paged_gradients_are_not_held_after_they_are_posted(daemon):
    # A paged weight's gradient goes to the daemon in backward; holding it until step()
    # kept every paged block's gradient on the device at once.
    cfg, _, ours = _pair(seed=1)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 socket=daemon.socket, param_offload=True, min_offload_bytes=0)
    (x, y), = text_batches(corpus(), cfg, batch=4, steps=1, seed=1)
    ours(x, y).backward()
    external = [e for e in opt._entries.values() if e.external]
    assert external, "paged weights hand their gradients over in backward"
    assert all(e.posted_step == 1 for e in external)
    held = [e.name for e in external if e.posted_grad is not None or e.external_grad is not None]
    assert not held, f"gradients still referenced after posting: {held}"
    opt.step()
    opt.zero_grad()


def test_paged_blocks_brought_back_in_train_exactly(daemon):
    # page_in between steps: the block's weights leave their host homes (a trained
    # weight's param slot) for the device, and training goes on bit for bit.
    cfg, ref, ours = _pair(seed=3)
    batches = text_batches(corpus(), cfg, batch=4, steps=6, seed=3)
    ref, ref_opt = trainstream.wrap(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3),
                                    socket=daemon.socket)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 socket=daemon.socket, param_offload=True, min_offload_bytes=0)
    pager = ours._trainstream_session.pager
    assert _train(ref, ref_opt, batches[:3]) == _train(ours, opt, batches[:3])
    weight = ours.blocks[3].mlp[0].weight
    slot = opt._entries[id(weight)].param_slot
    assert weight.data_ptr() == slot.data_ptr()
    cost = pager.page_in_cost(3)
    assert cost == 2 * sum(p.numel() * 4 for p in ours.blocks[3].parameters())
    assert pager.page_in(3) and pager.page_in(2) and not pager.page_in(3)
    assert pager.paged == [0, 1] and weight.data_ptr() != slot.data_ptr()
    assert torch.equal(weight, slot.view(weight.shape))
    # A view of a brought-in weight that autograd saves is a weight, not an activation.
    assert pager.offloader is not None and not pager.offloader.wants(weight.detach().t())
    assert _train(ref, ref_opt, batches[3:]) == _train(ours, opt, batches[3:])
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(p, q), f"{name} differs after bringing blocks 2 and 3 back in"
    assert trainstream.memory_report(ours)["params"]["paged_blocks"] == [0, 1]


def test_optimizer_reports_when_no_gradient_is_pending(daemon):
    # The adapter moves weight blocks only then (not between accumulated micro-batches).
    cfg, _, ours = _pair(seed=1)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 socket=daemon.socket, param_offload=True, min_offload_bytes=0,
                                 accumulation_steps=2)
    (x, y), = text_batches(corpus(), cfg, batch=4, steps=1, seed=1)
    assert opt.between_steps()
    ours(x[:2], y[:2]).backward()
    assert not opt.between_steps(), "one micro-batch of two has run"
    ours(x[2:], y[2:]).backward()
    opt.step()
    opt.zero_grad()
    assert opt.between_steps()


def test_declared_vram_limit_pages_some_blocks_and_stays_exact(daemon):
    cfg, ref, ours = _pair(seed=2, n_layer=6)
    block_bytes = sum(p.numel() * 4 for p in ours.blocks[0].parameters())
    outside = sum(p.numel() * 4 for n, p in ours.named_parameters() if not n.startswith("blocks"))
    # Room for the outside weights and gradients, paging, and about 3 resident blocks.
    limit = int((2 * outside + 4 * block_bytes + 3 * 2 * block_bytes) / 0.9 / 0.75) + 1
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=1e-3),
                                 socket=daemon.socket, vram_limit=limit, min_offload_bytes=0)
    plan = ours._trainstream_session.plan
    assert 0 < len(plan.paged) < 6, plan.decisions
    offloader = ours._trainstream_session.pager.offloader
    assert offloader.max_inflight_bytes == plan.max_inflight_bytes < 1 << 30
    assert plan.paged == list(range(len(plan.paged))), "the first blocks page"
    ref, ref_opt = trainstream.wrap(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3),
                                    socket=daemon.socket)
    batches = text_batches(corpus(), cfg, batch=2, steps=3, seed=2)
    assert _train(ref, ref_opt, batches) == _train(ours, opt, batches)


def test_vram_limit_too_small_raises_memory_error_with_numbers(daemon):
    _, _, model = _pair()
    with pytest.raises(MemoryError) as info:
        trainstream.wrap(model, socket=daemon.socket, vram_limit=64 << 10, min_offload_bytes=0)
    msg = str(info.value)
    for fragment in ("does not fit", "needs", "usable", "weights outside the blocks",
                     "paged weights in flight", "vram_limit"):
        assert fragment in msg, msg
    assert daemon.status()["sessions"] == [], "nothing attached when the plan fails"


def test_env_vram_limit(monkeypatch):
    from trainstream._options import validate
    monkeypatch.setenv("TRAINSTREAM_VRAM_LIMIT", "24GiB")
    assert validate({})["vram_limit"] == 24 << 30
    assert validate({"vram_limit": "1G"})["vram_limit"] == 1 << 30
    monkeypatch.setenv("TRAINSTREAM_VRAM_LIMIT", "lots")
    with pytest.raises(ValueError, match="TRAINSTREAM_VRAM_LIMIT"):
        validate({})


def test_meta_model_that_cannot_fit_raises_memory_error_at_wrap(daemon):
    """A 72B-shaped full fine-tune, built on the meta device: refused at wrap() with the
    numbers, before a byte is allocated."""
    transformers = pytest.importorskip("transformers", reason="builds a Qwen2 shape from its config")
    cfg = transformers.Qwen2Config(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8, vocab_size=152064)
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    with pytest.raises(MemoryError) as info:
        trainstream.wrap(model, socket=daemon.socket, device="cpu", vram_limit="24GiB",
                         moment_dtype="auto")
    msg = str(info.value)
    assert "host memory does not fit" in msg and "daemon master weights" in msg, msg


@pytest.mark.parametrize("options, fragment", [
    ({"param_offload": 1.5}, "param_offload"),
    ({"param_offload": [-1]}, "param_offload"),
    ({"activation_offload": [0]}, "activation_offload"),
    ({"recompute": "sometimes"}, "recompute"),
    ({"attention": "fast"}, "attention"),
    ({"vram_limit": "abc"}, "vram_limit"),
    ({"vram_headroom": 0.95}, "vram_headroom"),
    ({"quantize": "int4"}, "quantize"),
    ({"prefer": "fast"}, "prefer"),
    ({"max_activation_slowdown": -0.1}, "max_activation_slowdown"),
    ({"max_inflight_bytes": 0}, "max_inflight_bytes"),
])
def test_bad_paging_options_raise_value_error(options, fragment):
    with pytest.raises(ValueError, match=f"option {fragment}=.*accepted"):
        trainstream.wrap(TinyGPT(GPTConfig()), **options)


# --------------------------------------------------------------------------- planner
def _summary(n=8, trained=100 << 20, frozen=0, outside=50 << 20):
    blocks = [planner.BlockSummary(trained_bytes=trained, trained_numel=trained // 4,
                                   frozen_bytes=frozen, quantizable_bytes=frozen,
                                   quantized_bytes=frozen // 4 + 1) for _ in range(n)]
    return planner.ModelSummary(blocks, outside, outside, n * trained // 4 + outside // 4,
                                n * trained + outside)


def _config(**kw):
    from trainstream._options import validate
    return validate(kw)


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
    # fp32: master 8 + moments 16 + slots 16 GiB; bf16 moments: 32 GiB.
    bf16 = planner.plan(s, _cap(100, ram_gib=100, daemon_gib=35), _config(moment_dtype="auto"))
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


# ------------------------------------------------------------------------- attention
def test_allowed_backends_follow_determinism():
    assert allowed_backends(False, False) == ["cudnn", "flash", "efficient", "math"]
    assert allowed_backends(True, False) == ["efficient", "math"]
    assert allowed_backends(True, True) == ["math"]


def test_attention_choice_is_reread_each_time():
    events = []
    sel = AttentionSelector("flash", torch.device("cpu"), lambda *a, **k: events.append(k))
    assert sel.order[0] == "flash"
    try:
        torch.use_deterministic_algorithms(True)
        sel.refresh()
        assert sel.order == ["math"], "flash is left out; math remains"
        torch.use_deterministic_algorithms(True, warn_only=True)
        sel.refresh()
        assert sel.order == ["math"]
    finally:
        torch.use_deterministic_algorithms(False)
    sel.refresh()
    assert sel.order[0] == "flash"
    assert any("not deterministic" in str(e.get("why", "")) for e in events)


def test_attention_math_backend_applies_inside_blocks(daemon):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    cfg, ref, ours = _pair(seed=3)
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1)
    with sdpa_kernel([SDPBackend.MATH]):
        want = ref(x, y)
    ours, _ = trainstream.wrap(ours, socket=daemon.socket, attention="math")
    calls = []
    orig = F.scaled_dot_product_attention

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is orig:
                calls.append(torch._C._get_math_sdp_enabled()
                             and not torch._C._get_flash_sdp_enabled())
            return func(*args, **(kwargs or {}))
    with Spy():
        got = ours(x, y)
    assert calls and all(calls), "every attention call runs with only the math backend"
    assert torch.equal(want, got)
    assert trainstream.memory_report(ours)["attention"]["order"][0] == "math"


def test_frozen_and_quantized_weights_page_exactly():
    """A frozen base (plain and NF4 QuantLinear weights) with small trained adapters:
    paged (frozen tensors in the block's host buffer, adapters resident) vs not."""
    from trainstream.quantization import QuantLinear
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


class _Session:
    def __init__(self):
        self.adapting = True
        self.events = []

    def event(self, kind, **details):
        self.events.append(dict(details, kind=kind))


def _adapter(n=8, usable=2000 << 20):
    from trainstream.adapter import Adapter
    _, _, ours = _pair(n_layer=n)
    pager = BlockPager(list(ours.blocks), "cpu")
    plan = planner.Plan(paged=[], moment_dtype="float32", quantize=None,
                        activation_offload="auto", recompute=False, usable_vram=usable)
    session = _Session()
    config = dict(activation_offload="auto", recompute=False, max_activation_slowdown=0.15)
    adapter = Adapter(session, pager, plan, config, h2d_gb_s=0.0)
    for i in range(n):  # what calibration does on a CUDA device
        pager.set_policy(i, OFFLOAD)
    return adapter, pager, session


def test_adapter_moves_blocks_back_in_when_measured_room_allows():
    MiB = 1 << 20
    adapter, pager, session = _adapter()
    steps = [(1400, 8 * 100), (1500, 0), (1700, 0), (1800, 0), (1800, 0)]
    for step, (peak, offloaded) in enumerate(steps):
        adapter.step = step
        adapter._decide(peak * MiB, 1.0, offloaded * MiB)
        if step == 0:  # 600 MiB of room at 100 MiB a block: the last 5 keep theirs
            assert pager.policy == [OFFLOAD] * 3 + [KEEP] * 5
        if step == 1:  # 500 MiB of room, half of it spent: 2 more blocks keep
            assert pager.policy == [OFFLOAD] + [KEEP] * 7
    assert pager.policy == [KEEP] * 8
    loosened = [e for e in session.events if e.get("what") == "loosen"]
    assert len(loosened) == 2 and "offload -> keep" in loosened[0]["moved"]
    assert adapter.settled and not session.adapting


def _weight_adapter():
    """An adapter over 8 blocks whose weights all page and whose activations are kept
    (param_offload="auto"): what loosening does once no block pages activations."""
    adapter, _, session = _adapter()
    _, _, model = _pair(n_layer=8)
    pager = BlockPager(list(model.blocks), "cpu", paged=range(8), min_paged_bytes=0)
    adapter.pager = pager
    adapter.config["param_offload"] = "auto"
    for i in range(8):
        pager.set_policy(i, KEEP)
    return adapter, pager, session, model


def test_adapter_brings_paged_weight_blocks_back_when_no_block_pages_activations():
    MiB = 1 << 20
    adapter, pager, session, _ = _weight_adapter()
    cost = pager.page_in_cost(7)
    assert cost > 0
    adapter.step = 1
    # Room for 2.5 blocks at LOOSEN_SHARE 0.5: the last 2 paged blocks come back.
    peak = 2000 * MiB - int(5 * cost)
    adapter._decide(peak, 1.0, 0)
    assert pager.paged == [0, 1, 2, 3, 4, 5]
    loosen = [e for e in session.events if e.get("what") == "loosen"]
    assert loosen and "weights: paged -> resident" in loosen[0]["moved"], loosen
    adapter.between_steps = lambda: False     # between accumulated micro-batches
    adapter.step = 2
    adapter._decide(peak, 1.0, 0)
    assert pager.paged == [0, 1, 2, 3, 4, 5], "weights move only between steps"
    adapter.between_steps = lambda: True
    adapter.config["param_offload"] = True   # an explicit choice is left alone
    adapter.step = 3
    adapter._decide(peak, 1.0, 0)
    assert pager.paged == [0, 1, 2, 3, 4, 5]


def test_adapter_moves_no_weight_block_while_a_graph_holds_paged_weights():
    """A second micro-batch's forward before the first one's backward: no gradient is
    pending yet, but the first graph will look for its blocks where they were (a block
    brought in then made that backward fail with KeyError)."""
    MiB = 1 << 20
    adapter, pager, session, model = _weight_adapter()
    (x, y), = text_batches(corpus(), GPTConfig(n_layer=8), batch=2, steps=1)
    loss = model(x, y)
    adapter.step = 1
    adapter._decide(2000 * MiB - int(5 * pager.page_in_cost(7)), 1.0, 0)
    assert pager.paged == list(range(8)), "nothing moves while the graph is live"
    loss.backward()
    adapter.step = 2
    adapter._decide(2000 * MiB - int(5 * pager.page_in_cost(7)), 1.0, 0)
    assert pager.paged == [0, 1, 2, 3, 4, 5]


def _settle_steps(adapter, peak_mib):
    """Calibration (1800 MiB peak, 100 MiB of activations a block), then two steps at
    ``peak_mib``, each recorded in the history first, as on_forward does."""
    MiB = 1 << 20
    for step, (peak, offloaded) in enumerate([(1800, 800), (peak_mib, 0), (peak_mib, 0)]):
        adapter.step = step
        adapter.history.append({"seconds": 1.0})
        adapter._decide(peak * MiB, 1.0, offloaded * MiB)


def _trial_adapter():
    adapter, pager, session = _adapter()
    adapter.config["recompute"] = "auto"
    return adapter, pager, session


@pytest.mark.parametrize("recompute_s, chosen", [(0.8, RECOMPUTE), (0.99, OFFLOAD),
                                                 (1.3, OFFLOAD)])
def test_adapter_tries_recompute_for_paging_blocks_and_keeps_the_faster(recompute_s, chosen):
    MiB = 1 << 20
    adapter, pager, session = _trial_adapter()
    # Calibration leaves 200 MiB of room at 100 MiB a block: the last 1 keeps (0.9 x room).
    # (on_forward records each step in the history, then decides.)
    steps = [(1800, 5.0, 800), (1890, 1.0, 0), (1890, 1.0, 0)]
    for step, (peak, seconds, offloaded) in enumerate(steps):
        adapter.step = step
        adapter.history.append({"seconds": seconds})
        adapter._decide(peak * MiB, seconds, offloaded * MiB)
    trial = [e for e in session.events if e.get("what") == "trial"]
    assert trial and pager.policy == [RECOMPUTE] * 7 + [KEEP], session.events[-1]
    for step in (3, 4):
        adapter.step = step
        adapter.history.append({"seconds": recompute_s})
        adapter._decide(1500 * MiB, recompute_s, 0)
    result = [e for e in session.events if e.get("what") == "trial result"]
    assert len(result) == 1 and result[0]["chosen"] == chosen, result
    assert result[0]["recompute_s"] == [recompute_s] * 2 and result[0]["offload_s"] == 1.0
    assert pager.policy == [chosen] * 7 + [KEEP]
    for step in (5, 6):
        adapter.step = step
        adapter.history.append({"seconds": 1.0})
        adapter._decide(1950 * MiB, 1.0, 0)
    assert adapter.settled and not session.adapting
    assert len([e for e in session.events if e.get("what") == "trial"]) == 1, "one trial"


def test_recompute_trial_that_goes_over_restores_paging():
    MiB = 1 << 20
    adapter, pager, session = _trial_adapter()
    _settle_steps(adapter, 1890)
    assert pager.policy == [RECOMPUTE] * 7 + [KEEP]
    adapter.step = 3
    adapter._decide(2100 * MiB, 0.5, 0)         # over the usable 2000 MiB, and faster
    result = [e for e in session.events if e.get("what") == "trial result"]
    assert result and result[0]["chosen"] == OFFLOAD
    # The paging plan, which fitted, comes back as it was: no tightening, and loosening
    # is still allowed.
    assert pager.policy == [OFFLOAD] * 7 + [KEEP]
    assert not [e for e in session.events if e.get("what") == "tighten"]
    assert not adapter.went_over and not adapter.settled


def test_no_recompute_trial_without_room_for_one_blocks_activations():
    # Recompute brings a block's activations (100 MiB here) back at once in backward;
    # with 50 MiB of room a trial step could run out of memory, ending the training.
    adapter, pager, session = _trial_adapter()
    _settle_steps(adapter, 1950)
    assert pager.policy == [OFFLOAD] * 7 + [KEEP] and adapter.settled
    skipped = [e for e in session.events if e.get("what") == "no trial"]
    assert skipped and "one block's activations" in skipped[0]["why"], session.events
    assert not [e for e in session.events if e.get("what") == "trial"]


def test_no_recompute_trial_unless_recompute_is_auto():
    adapter, pager, session = _adapter()         # recompute=False
    _settle_steps(adapter, 1950)
    assert RECOMPUTE not in pager.policy and adapter.settled


def test_settled_adapter_does_not_synchronize_the_device(monkeypatch):
    # Adapting, each step is timed (a device sync); settled, only the peak is read.
    MiB = 1 << 20
    adapter, pager, session = _adapter()
    adapter.measure = True
    calls = {"sync": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.__setitem__(
        "sync", calls["sync"] + 1))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 1500 * MiB)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    for _ in range(6):
        adapter.on_forward(None, ())
    assert adapter.settled and calls["sync"] > 0
    before = calls["sync"]
    adapter.on_forward(None, ())
    adapter.on_forward(None, ())
    assert calls["sync"] == before, "a settled step must not wait for the device"
    assert adapter.history[-1]["seconds"] is None and adapter.history[-1]["peak"] == 1500 * MiB
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 2100 * MiB)
    adapter.on_forward(None, ())                 # the watchdog still sees a step going over
    assert not adapter.settled and session.adapting
    assert [e for e in session.events if e.get("what") == "tighten"]


def test_adapter_does_not_move_blocks_back_in_after_a_step_went_over():
    MiB = 1 << 20
    adapter, pager, session = _adapter()
    adapter._decide(1400 * MiB, 1.0, 800 * MiB)
    adapter.step = 1
    adapter._decide(2100 * MiB, 1.0, 0)          # over: a kept block pages again
    assert pager.policy == [OFFLOAD] * 4 + [KEEP] * 4
    for step in (2, 3):
        adapter.step = step
        adapter._decide(1000 * MiB, 1.0, 0)      # room, but no more loosening
    assert pager.policy == [OFFLOAD] * 4 + [KEEP] * 4
    assert not [e for e in session.events if e.get("what") == "loosen"]
    assert adapter.settled


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


def test_frozen_weights_in_registered_host_memory_page_from_where_they_are(monkeypatch):
    """A shared base's mapping (load_model) is registered host memory: its blocks page
    straight from it, with no per-process copy. Registration is faked here (no CUDA)."""
    from trainstream import paging
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
