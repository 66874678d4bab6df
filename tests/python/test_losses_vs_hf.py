"""chunked_cross_entropy and causal_lm_loss against F.cross_entropy on the full logits,
Hugging Face's ForCausalLMLoss and a tiny model's own loss (values and gradients)."""
import pytest
import torch
import torch.nn.functional as F

from trainstream import causal_lm_loss, chunked_cross_entropy

N, D, V = 37, 16, 50
TOL = dict(rtol=1e-6, atol=1e-6)


def _inputs(shape=(N,), dtype=torch.float32, bias=True, seed=0, device="cpu", ignore_every=5):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, D, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) / D ** 0.5).to(device, dtype).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.1).to(device, dtype).requires_grad_() if bias else None
    targets = torch.randint(0, V, shape, generator=g)
    if ignore_every:
        targets.view(-1)[::ignore_every] = -100
    return hidden, weight, b, targets.to(device)


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None and t.requires_grad])


def _reference(hidden, weight, bias, targets, reduction="mean", num_items=None):
    logits = (hidden @ weight.t() if bias is None else hidden @ weight.t() + bias).float()
    logits, flat = logits.reshape(-1, V), targets.reshape(-1)
    if num_items is not None:
        return F.cross_entropy(logits, flat, reduction="sum") / num_items
    return F.cross_entropy(logits, flat, reduction=reduction)


def _assert_same(inputs, ours, ref, **tol):
    tol = tol or TOL
    torch.testing.assert_close(ours, ref, **tol)
    for a, b in zip(_grads(ours, inputs), _grads(ref, inputs)):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_size", [1, 8, 37, 64])  # 8 does not divide 37; 64 > N
@pytest.mark.parametrize("bias", [True, False])
def test_matches_cross_entropy_on_full_logits(reduction, chunk_size, bias):
    h, w, b, t = _inputs(bias=bias)
    ours = chunked_cross_entropy(h, w, t, b, chunk_size=chunk_size, reduction=reduction)
    _assert_same((h, w, b), ours, _reference(h, w, b, t, reduction))


@pytest.mark.parametrize("chunk_size", [4, 7, 1024])
def test_3d_hidden(chunk_size):
    h, w, b, t = _inputs(shape=(3, 13))
    ours = chunked_cross_entropy(h, w, t, b, chunk_size=chunk_size)
    _assert_same((h, w, b), ours, _reference(h, w, b, t))


@pytest.mark.parametrize("num_items", [11, 29.0, "tensor"])
def test_num_items_divides_the_sum(num_items):
    h, w, b, t = _inputs(shape=(2, 19))
    if num_items == "tensor":
        num_items = torch.tensor(23)
    ours = chunked_cross_entropy(h, w, t, b, chunk_size=6, num_items=num_items)
    _assert_same((h, w, b), ours, _reference(h, w, b, t, num_items=num_items))


def test_other_ignore_index():
    h, w, b, t = _inputs(ignore_every=0)
    t[::3] = 7  # a real class, here marked as ignored
    ours = chunked_cross_entropy(h, w, t, b, chunk_size=10, ignore_index=7)
    ref = F.cross_entropy((h @ w.t() + b), t, ignore_index=7)
    _assert_same((h, w, b), ours, ref)


def test_frozen_weight_and_hidden_without_grad():
    h, w, b, t = _inputs()
    w.requires_grad_(False)
    ours = chunked_cross_entropy(h, w, t, b, chunk_size=8)
    _assert_same((h, b), ours, _reference(h, w, b, t))
    chunked_cross_entropy(h, w, t, b, chunk_size=8).backward()
    assert w.grad is None and h.grad is not None

    h2 = h.detach()
    w.requires_grad_(True)
    ours = chunked_cross_entropy(h2, w, t, None, chunk_size=8)
    _assert_same((w,), ours, _reference(h2, w, None, t))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_upcast_logits(dtype):
    # HF's recipe: the product in the half dtype, upcast to fp32 for the loss. The CPU's
    # half-precision matmul may round a chunk's logits differently from the whole
    # product's (blocking), hence half-precision tolerances.
    h, w, b, t = _inputs(dtype=dtype)
    ours = chunked_cross_entropy(h, w, t, b, chunk_size=8)
    assert ours.dtype == torch.float32
    ref = _reference(h, w, b, t)
    torch.testing.assert_close(ours, ref, rtol=1e-3, atol=1e-3)
    for a, r in zip(_grads(ours, (h, w, b)), _grads(ref, (h, w, b))):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), r.float(), rtol=2e-2, atol=2e-3)


def test_all_ignored_is_nan_with_zero_grads_like_cross_entropy():
    h, w, b, t = _inputs()
    t.fill_(-100)
    ours = chunked_cross_entropy(h, w, t, b, chunk_size=8)
    ref = _reference(h, w, b, t)
    assert torch.isnan(ours) and torch.isnan(ref)
    for a, r in zip(_grads(ours, (h, w, b)), _grads(ref, (h, w, b))):
        assert torch.equal(a, torch.zeros_like(a)) and torch.equal(r, torch.zeros_like(r))
    ours_sum = chunked_cross_entropy(h, w, t, b, reduction="sum")
    assert ours_sum.item() == 0.0 == _reference(h, w, b, t, "sum").item()


def test_empty_input():
    h, w, b, t = _inputs(shape=(0,))
    mean = chunked_cross_entropy(h, w, t, b)
    assert torch.isnan(mean) and torch.isnan(_reference(h, w, b, t))
    total = chunked_cross_entropy(h, w, t, b, reduction="sum")
    assert total.item() == 0.0
    gh, gw, gb = _grads(total, (h, w, b))
    assert gh.shape == (0, D) and torch.equal(gw, torch.zeros_like(w)) and torch.equal(gb, torch.zeros_like(b))


@pytest.mark.parametrize("kwargs, match", [
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=-4), "chunk_size"),
    (dict(chunk_size=2.5), "chunk_size"),
    (dict(chunk_size=True), "chunk_size"),
    (dict(reduction="none"), "reduction"),
    (dict(ignore_index=1.5), "ignore_index"),
    (dict(num_items="7"), "num_items"),
    (dict(num_items=torch.tensor([1, 2])), "num_items"),
])
def test_bad_options(kwargs, match):
    h, w, b, t = _inputs()
    with pytest.raises(ValueError, match=match):
        chunked_cross_entropy(h, w, t, b, **kwargs)


# --- causal_lm_loss against Hugging Face ------------------------------------------------

transformers = pytest.importorskip("transformers")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402


def _labels(shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, shape, generator=g)
    labels[0, -4:] = -100  # right padding
    labels[-1, :2] = -100  # a prompt that does not count
    return labels


@pytest.mark.parametrize("num_items", [None, 17, "tensor"])
def test_causal_lm_loss_matches_hf_for_causal_lm_loss(num_items):
    h, w, _, _ = _inputs(shape=(3, 11), bias=False)
    labels = _labels((3, 11))
    if num_items == "tensor":
        num_items = torch.tensor(19)
    ours = causal_lm_loss(h, w, labels, chunk_size=5, num_items=num_items)
    ref = ForCausalLMLoss(h @ w.t(), labels, vocab_size=V, num_items_in_batch=num_items)
    _assert_same((h, w), ours, ref)


def test_causal_lm_loss_shift_labels_as_hf():
    h, w, b, _ = _inputs(shape=(2, 9))
    shifted = _labels((2, 9))
    ours = causal_lm_loss(h, w, None, b, shift_labels=shifted, chunk_size=4)
    ref = ForCausalLMLoss(h @ w.t() + b, None, vocab_size=V, shift_labels=shifted)
    _assert_same((h, w, b), ours, ref)


def test_causal_lm_loss_rejects_mismatched_labels():
    h, w, _, _ = _inputs(shape=(2, 9), bias=False)
    with pytest.raises(ValueError, match=r"labels must have hidden's leading shape \(2, 9\)"):
        causal_lm_loss(h, w, torch.zeros(2, 8, dtype=torch.long))


def _tiny(kind):
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, vocab_size=V, max_position_embeddings=64)
    cfg = transformers.Qwen2Config(**common) if kind == "qwen2" else transformers.LlamaConfig(**common)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("num_items", [None, 13])
def test_causal_lm_loss_matches_a_tiny_models_loss(kind, num_items):
    model = _tiny(kind)
    g = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, V, (2, 12), generator=g)
    labels = input_ids.clone()
    labels[1, -3:] = -100
    extra = {} if num_items is None else {"num_items_in_batch": num_items}
    params = [p for p in model.parameters() if p.requires_grad]

    ref = model(input_ids=input_ids, labels=labels, **extra).loss
    ref_grads = torch.autograd.grad(ref, params)

    hidden = model.model(input_ids=input_ids).last_hidden_state
    ours = causal_lm_loss(hidden, model.lm_head.weight, labels, chunk_size=7, num_items=num_items)
    our_grads = torch.autograd.grad(ours, params)

    torch.testing.assert_close(ours, ref, **TOL)
    for p_ref, p_ours in zip(ref_grads, our_grads):
        torch.testing.assert_close(p_ours, p_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the fp32-accumulating addmm path)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_matches_upcast_logits(dtype):
    h, w, b, t = _inputs(shape=(4, 300), dtype=dtype, device="cuda")
    ours = chunked_cross_entropy(h, w, t, b, chunk_size=128)
    ref = _reference(h, w, b, t)
    half = dtype != torch.float32
    # TF32 may be on for fp32 matmuls; the tolerance covers it.
    torch.testing.assert_close(ours, ref, rtol=1e-4 if not half else 1e-3, atol=1e-4)
    for a, r in zip(_grads(ours, (h, w, b)), _grads(ref, (h, w, b))):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), r.float(), rtol=2e-2, atol=2e-3 if half else 1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton kernels)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_kernels_equal_the_torch_ones(monkeypatch, dtype):
    """The fused row kernels (python/trainstream/_ce_kernels.py) against the torch
    version of the same arithmetic; 5003 columns are not a multiple of the block."""
    from trainstream import _ce_kernels
    if _ce_kernels.triton is None:
        pytest.fail("CUDA without Triton: torch's CUDA wheels ship it")
    g = torch.Generator(device="cuda").manual_seed(3)
    n, d, v = 300, 64, 5003
    h = torch.randn(n, d, device="cuda", generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, d, device="cuda", generator=g) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(v, device="cuda", generator=g) * 0.1).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[::7] = -100
    out = {}
    for kernel in ("triton", "torch"):
        monkeypatch.setenv("TRAINSTREAM_CE_KERNEL", kernel)
        loss = chunked_cross_entropy(h, w, t, b, chunk_size=37)
        out[kernel] = (loss.detach(), *torch.autograd.grad(loss, (h, w, b)))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-4)
    for a, r in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(a.float(), r.float(), **tol)
