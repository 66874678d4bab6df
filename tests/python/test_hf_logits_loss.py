"""wrap()'s loss for Hugging Face causal LMs (hf_logits_loss.py) against
transformers' own ForCausalLMLoss and torch's F.cross_entropy on the CPU: the same loss
and gradients (fp32 sums in another order: 1e-6 relative), padding (-100),
num_items_in_batch, shift_labels, bf16 logits, and wrap()/unwrap() putting it in place
and back; on CUDA (the GPU host) the Triton kernels against the torch path and against
transformers' loss, and the memory the loss adds."""
import copy

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import trainstream  # noqa: E402
from trainstream import hf_logits_loss  # noqa: E402
from trainstream.hf_logits_loss import logits_cross_entropy  # noqa: E402


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, vocab_size=300,
                                   max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def _batch(seed=1, rows=3, tokens=40, vocab=300):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (rows, tokens), generator=g)
    labels = ids.clone()
    labels[0, -7:] = -100  # padding: rows count different numbers of tokens
    labels[2, :5] = -100
    return ids, labels


def _ours(loss) -> bool:
    return type(loss.grad_fn).__name__ == "_LogitsCrossEntropyBackward"


def _ours_fn(fn) -> bool:
    return isinstance(fn, hf_logits_loss.CausalLMLoss)


def _loss_and_grads(model, ids, labels, **kw):
    model.zero_grad()
    loss = model(input_ids=ids, labels=labels, **kw).loss
    loss.backward()
    _loss_and_grads.ours = _ours(loss)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


@pytest.mark.parametrize("rows", [1, 257, 600])  # under, at and over the torch path's block
def test_matches_cross_entropy_rows_and_padding(rows):
    g = torch.Generator().manual_seed(rows)
    z = torch.randn(rows, 97, generator=g, dtype=torch.float64).float() * 3
    t = torch.randint(97, (rows,), generator=g)
    t[1::5] = -100
    a = z.clone().requires_grad_()
    b = z.clone().requires_grad_()
    ref = F.cross_entropy(a, t, ignore_index=-100)
    got = logits_cross_entropy(b, t)
    ref.backward()
    got.backward()
    assert torch.allclose(got, ref, rtol=1e-6, atol=0)
    assert torch.allclose(b.grad, a.grad, rtol=1e-5, atol=1e-8)


def test_num_items_in_batch_and_bf16_logits():
    g = torch.Generator().manual_seed(3)
    z = (torch.randn(64, 50, generator=g) * 4).to(torch.bfloat16)
    t = torch.randint(50, (64,), generator=g)
    t[:10] = -100
    a = z.clone().requires_grad_()
    b = z.clone().requires_grad_()
    # transformers' way: fp32 copy, sum, divided by the items of the whole accumulated batch.
    ref = F.cross_entropy(a.float(), t, ignore_index=-100, reduction="sum") / 123
    got = logits_cross_entropy(b, t, num_items_in_batch=torch.tensor(123))
    ref.backward()
    got.backward()
    assert got.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=1e-6)
    assert b.grad.dtype == torch.bfloat16
    # Both gradients are the same fp32 values rounded once to bf16.
    assert torch.equal(b.grad, a.grad) or (b.grad.float() - a.grad.float()).abs().max() <= \
        a.grad.float().abs().max() * 2 ** -8


def test_nothing_counted_is_nan_like_torch():
    z = torch.randn(4, 10, requires_grad=True)
    t = torch.full((4,), -100)
    assert torch.isnan(F.cross_entropy(z, t)) and torch.isnan(logits_cross_entropy(z, t))


def test_bad_target_names_the_range():
    with pytest.raises(ValueError, match=r"targets must be in \[0, 10\)"):
        logits_cross_entropy(torch.randn(4, 10), torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="logits must be"):
        logits_cross_entropy(torch.randn(4, 10), torch.tensor([0, 1]))


@pytest.mark.parametrize("kw", [{}, {"num_items_in_batch": 97}])
def test_model_loss_function_matches_transformers(kw):
    ref_model = _model()
    our_model = copy.deepcopy(ref_model)
    restore = hf_logits_loss.install(our_model)
    assert restore is not None and _ours_fn(our_model.loss_function)
    ids, labels = _batch()
    ref_loss, ref_grads = _loss_and_grads(ref_model, ids, labels, **kw)
    assert not _loss_and_grads.ours
    our_loss, our_grads = _loss_and_grads(our_model, ids, labels, **kw)
    assert _loss_and_grads.ours
    assert torch.allclose(our_loss, ref_loss, rtol=1e-6)
    for n, g in ref_grads.items():
        assert torch.allclose(our_grads[n], g, rtol=1e-4, atol=1e-7), n
    restore()
    assert not _ours_fn(our_model.loss_function)


def test_shift_labels_and_unknown_keywords_go_where_they_should():
    model = _model()
    hf_logits_loss.install(model)
    ids, labels = _batch()
    logits = model(input_ids=ids).logits
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    a = model.loss_function(logits, None, 300, shift_labels=shifted)
    b = F.cross_entropy(logits.reshape(-1, 300).float(), shifted.reshape(-1), ignore_index=-100)
    assert torch.allclose(a, b, rtol=1e-6)
    assert _ours(a)
    # transformers' loss ignores the model's other keywords (its forward hands them all
    # on), so ours does; a loss function of another kind gets them.
    assert _ours(model.loss_function(logits, labels, 300, output_hidden_states=True))
    seen = {}

    def custom(logits, labels, vocab_size, **kw):
        seen.update(kw)
        return logits.float().mean()
    wrapped = hf_logits_loss.CausalLMLoss(custom)
    wrapped(logits, labels, 300, z_loss=0.1)
    assert seen["z_loss"] == 0.1


def test_a_loss_the_user_set_is_left_alone():
    model = _model()

    def mine(logits, labels, vocab_size, **kw):
        return logits.float().pow(2).mean()
    model.loss_function = mine
    assert hf_logits_loss.install(model) is None
    assert model.loss_function is mine


def test_a_wrapped_model_pickles():
    import pickle
    model = _model()
    hf_logits_loss.install(model)
    again = pickle.loads(pickle.dumps(model))
    assert _ours_fn(again.loss_function)


def test_wrap_installs_it_and_unwrap_restores(daemon):
    model = _model()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  socket=daemon.socket, profile=False)
    try:
        assert _ours_fn(model.loss_function)
        kinds = [e["kind"] for e in model._trainstream_session.events]
        assert "lm_loss" in kinds
        ids, labels = _batch()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        assert torch.isfinite(loss) and _ours(loss)
    finally:
        trainstream.unwrap(model)
    assert not _ours_fn(model.loss_function)


def test_wrap_model_loss_keeps_the_models(daemon):
    model = _model()
    model, _ = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                socket=daemon.socket, profile=False, lm_loss="model")
    try:
        assert not _ours_fn(model.loss_function)
    finally:
        trainstream.unwrap(model)
    with pytest.raises(ValueError, match="lm_loss"):
        trainstream.wrap(_model(), lm_loss="fast")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton kernels)")
@pytest.mark.parametrize("kernel", ["triton", "torch"])
def test_cuda_kernels_match_transformers_and_add_no_fp32_copy(kernel, monkeypatch):
    from trainstream import _ce_kernels
    if kernel == "triton" and _ce_kernels.triton is None:
        pytest.skip("this torch has no Triton")
    monkeypatch.setenv("TRAINSTREAM_CE_KERNEL", kernel)
    from transformers.loss.loss_utils import ForCausalLMLoss
    g = torch.Generator(device="cuda").manual_seed(5)
    rows, vocab = 2 * 1024, 32768
    z = (torch.randn(2, 1024, vocab, device="cuda", generator=g) * 3).to(torch.bfloat16)
    labels = torch.randint(vocab, (2, 1024), device="cuda", generator=g)
    labels[:, :100] = -100
    a = z.clone().requires_grad_()
    b = z.clone().requires_grad_()
    ref = ForCausalLMLoss(a, labels, vocab)
    ref.backward()
    loss_fn = hf_logits_loss.causal_lm_loss_function(ForCausalLMLoss)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = loss_fn(b, labels, vocab)
    got.backward()
    torch.cuda.synchronize()
    assert _ours(got)
    extra = torch.cuda.max_memory_allocated() - base
    assert torch.allclose(got, ref, rtol=1e-5)
    diff = (b.grad.float() - a.grad.float()).abs().max()
    assert diff <= a.grad.float().abs().max() * 2 ** -7, diff
    # The gradient (bf16, the logits' size) plus per-row fp32 figures; the torch path
    # adds one fp32 copy of a block of rows. transformers' loss holds three fp32 copies.
    logits_bytes = rows * vocab * 2
    block = 0 if kernel == "triton" else 256 * vocab * 4
    assert extra <= logits_bytes + block + 64 * rows + (8 << 20), extra


def test_peft_model_gets_it_on_the_causal_lm_inside():
    peft = pytest.importorskip("peft")
    ref = peft.get_peft_model(_model(), peft.LoraConfig(task_type="CAUSAL_LM", r=4,
                                                        target_modules=["q_proj", "v_proj"]))
    ours = copy.deepcopy(ref)
    restore = hf_logits_loss.install(ours)
    assert restore is not None
    assert _ours_fn(ours.base_model.model.loss_function)
    ids, labels = _batch()
    ref_loss, ref_grads = _loss_and_grads(ref, ids, labels)
    our_loss, our_grads = _loss_and_grads(ours, ids, labels)
    assert _loss_and_grads.ours
    assert torch.allclose(our_loss, ref_loss, rtol=1e-6)
    assert ref_grads.keys() == our_grads.keys() and ref_grads  # the adapters'
    for n, g in ref_grads.items():
        assert torch.allclose(our_grads[n], g, rtol=1e-4, atol=1e-7), n
