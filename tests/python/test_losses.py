"""trainstream.chunked_cross_entropy / causal_lm_loss against F.cross_entropy on the
full logits (values and gradients, fp32, 1e-6) and against Hugging Face's own causal-LM
loss; the autograd graph never saves a tensor of the logits' shape."""
import pytest
import torch
import torch.nn.functional as F

import trainstream
from trainstream.losses import causal_lm_loss, chunked_cross_entropy

V, D = 37, 16


def _inputs(shape, bias=True, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, D, generator=g, dtype=dtype).float().requires_grad_()
    weight = (torch.randn(V, D, generator=g, dtype=dtype) * 0.5).float().requires_grad_()
    b = (torch.randn(V, generator=g, dtype=dtype) * 0.1).float().requires_grad_() if bias else None
    targets = torch.randint(V, shape, generator=g)
    return hidden, weight, b, targets


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


def _reference(hidden, weight, bias, targets, reduction, ignore_index=-100, num_items=None):
    logits = F.linear(hidden, weight, bias).float().reshape(-1, V)
    t = targets.reshape(-1)
    if num_items is not None:
        return F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="sum") / num_items
    return F.cross_entropy(logits, t, ignore_index=ignore_index, reduction=reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 1024])
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_equal_full_logits(reduction, chunk_size, bias):
    hidden, weight, b, targets = _inputs((3, 10), bias=bias)
    targets[0, :3] = -100
    targets[2, 5] = -100
    ours = chunked_cross_entropy(hidden, weight, targets, b, chunk_size=chunk_size,
                                 reduction=reduction)
    ref = _reference(hidden, weight, b, targets, reduction)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    for a, r in zip(_grads(ours, hidden, weight, b), _grads(ref, hidden, weight, b)):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_items", [7, 23.0, "tensor"])
def test_num_items_divides_the_sum(num_items):
    hidden, weight, b, targets = _inputs((2, 9))
    targets[1, 4:] = 5  # repeated classes
    targets[0, 0] = -1
    n = torch.tensor(11) if num_items == "tensor" else num_items
    ours = chunked_cross_entropy(hidden, weight, targets, b, chunk_size=5, ignore_index=-1,
                                 num_items=n)
    ref = _reference(hidden, weight, b, targets, "mean", ignore_index=-1, num_items=n)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    for a, r in zip(_grads(ours * 3.0, hidden, weight, b), _grads(ref * 3.0, hidden, weight, b)):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)


def test_every_position_ignored_is_nan_for_mean_and_zero_for_sum():
    hidden, weight, b, targets = _inputs((4,))
    targets[:] = -100
    mean = chunked_cross_entropy(hidden, weight, targets, b)
    assert torch.isnan(mean) and torch.isnan(_reference(hidden, weight, b, targets, "mean"))
    total = chunked_cross_entropy(hidden, weight, targets, b, reduction="sum")
    assert total.item() == 0.0
    gh, gw, gb = _grads(total, hidden, weight, b)
    assert not gh.any() and not gw.any() and not gb.any()


def test_frozen_weight_and_hidden_only_grads():
    hidden, weight, _, targets = _inputs((2, 6), bias=False)
    frozen = weight.detach()
    ours = chunked_cross_entropy(hidden, frozen, targets, chunk_size=5)
    (gh,) = torch.autograd.grad(ours, [hidden])
    (rh,) = torch.autograd.grad(_reference(hidden, frozen, None, targets, "mean"), [hidden])
    torch.testing.assert_close(gh, rh, rtol=1e-6, atol=1e-6)
    no_grad = chunked_cross_entropy(hidden.detach(), frozen, targets)
    assert not no_grad.requires_grad


def test_bfloat16_inputs_match_upcast_logits():
    """bf16 hidden and weight: the logits are a bf16 matmul upcast to fp32, as
    ``lm_head(hidden).float()`` then F.cross_entropy (bf16 rounding in the gradients)."""
    hidden, weight, b, targets = _inputs((2, 8))
    h, w = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    ours = chunked_cross_entropy(h, w, targets, chunk_size=3)
    ref = _reference(h, w, None, targets, "mean")
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    for a, r in zip(_grads(ours, h, w), _grads(ref, h, w)):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), r.float(), rtol=2e-2, atol=2e-3)


def test_autocast_runs_the_matmul_in_its_dtype():
    hidden, weight, b, targets = _inputs((2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = chunked_cross_entropy(hidden, weight, targets, b, chunk_size=4)
        ref = _reference(hidden, weight, b, targets, "mean")
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    for a, r in zip(_grads(ours, hidden, weight, b), _grads(ref, hidden, weight, b)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, r, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("chunk_size", [8, 64, None])
def test_nothing_of_the_logits_shape_is_kept_for_backward(chunk_size):
    """Between forward and backward the loss holds its gradients (the sizes of hidden,
    weight and bias) and autograd saves nothing; the reference saves the logits."""
    n = 64
    hidden, weight, b, targets = _inputs((n,))
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = chunked_cross_entropy(hidden, weight, targets, b, chunk_size=chunk_size)
    assert saved == []
    held = [tuple(t.shape) for t in loss.grad_fn.grads]
    assert held == [(n, D), (V, D), (V,)]
    loss.backward()
    assert loss.grad_fn.grads is None  # handed over, not kept beside the .grad
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _reference(hidden, weight, b, targets, "mean")
    assert (n, V) in saved  # what the reference keeps, and we do not


def test_a_second_backward_is_refused_with_a_reason():
    hidden, weight, b, targets = _inputs((6,))
    loss = chunked_cross_entropy(hidden, weight, targets, b)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_default_chunk_is_256_tokens():
    from trainstream.losses import DEFAULT_CHUNK_SIZE
    assert DEFAULT_CHUNK_SIZE == 256
    hidden, weight, b, targets = _inputs((600,))  # three chunks, the last one short
    ours = chunked_cross_entropy(hidden, weight, targets, b)
    ref = _reference(hidden, weight, b, targets, "mean")
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    for a, r in zip(_grads(ours, hidden, weight, b), _grads(ref, hidden, weight, b)):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)


def test_causal_lm_loss_equals_transformers():
    from transformers.loss.loss_utils import ForCausalLMLoss
    hidden, weight, b, labels = _inputs((3, 12), bias=False)
    labels[1, 8:] = -100  # padding
    ours = causal_lm_loss(hidden, weight, labels, chunk_size=5)
    logits = F.linear(hidden, weight)
    ref = ForCausalLMLoss(logits, labels, vocab_size=V)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    for a, r in zip(_grads(ours, hidden, weight), _grads(ref, hidden, weight)):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)
    ours_n = causal_lm_loss(hidden, weight, labels, num_items=torch.tensor(17))
    ref_n = ForCausalLMLoss(logits, labels, vocab_size=V, num_items_in_batch=torch.tensor(17))
    torch.testing.assert_close(ours_n, ref_n, rtol=1e-6, atol=1e-6)


def test_causal_lm_loss_equals_a_qwen2_models_loss():
    import transformers
    cfg = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=101, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    ids = torch.randint(101, (2, 16))
    out = model(input_ids=ids, labels=ids, output_hidden_states=True)
    hidden = out.hidden_states[-1]
    ours = causal_lm_loss(hidden, model.lm_head.weight, ids, chunk_size=7)
    torch.testing.assert_close(ours, out.loss, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("call, match", [
    (lambda h, w, t: chunked_cross_entropy(h, w[:, :3], t), "weight must be"),
    (lambda h, w, t: chunked_cross_entropy(h, w, t[:, :2]), "targets has shape"),
    (lambda h, w, t: chunked_cross_entropy(h, w, t.float()), "integer tensor"),
    (lambda h, w, t: chunked_cross_entropy(h, w, t, chunk_size=0), "chunk_size=0.*None"),
    (lambda h, w, t: chunked_cross_entropy(h, w, t, reduction="none"), "reduction='none'"),
    (lambda h, w, t: chunked_cross_entropy(h, w, t, reduction="sum", num_items=3), "num_items"),
    (lambda h, w, t: chunked_cross_entropy(h, w, t, bias=torch.zeros(3)), "bias must be"),
    (lambda h, w, t: chunked_cross_entropy(h, w, t + V), "outside \\[0, 37\\)"),
    (lambda h, w, t: chunked_cross_entropy(h, w.double(), t), "one dtype"),
])
def test_bad_inputs_name_what_is_wrong(call, match):
    hidden, weight, _, targets = _inputs((2, 5))
    with pytest.raises(ValueError, match=match):
        call(hidden, weight, targets)


def test_exported_from_the_package():
    assert trainstream.chunked_cross_entropy is chunked_cross_entropy
    assert trainstream.causal_lm_loss is causal_lm_loss
