"""ActivationOffloader (trainstream/streaming/activations.py): activation paging through
saved-tensor hooks, exact on CPU (the CPU is the "device"); test_paging_cuda.py does the
same on a GPU."""
import pytest
import torch

from paging_helpers import _pair, _assert_grads_equal
from tiny_gpt import corpus, text_batches
from trainstream.streaming.activations import ActivationOffloader


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
