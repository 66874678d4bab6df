"""PEFT LoRA on TrainStream's quantized bases (trainstream.integrations.peft): the
reference's QLoRA recipe, load_model(quantize=...) + peft.get_peft_model +
TrainStreamTrainer, on a tiny Qwen2 checkpoint the test writes itself."""
import copy
import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_load_model import TOKENS, save_model  # noqa: E402
from trainstream.frozen.quantization import QuantLinear, quantize_model  # noqa: E402
from trainstream.integrations.huggingface import TrainStreamTrainer, load_model  # noqa: E402
from trainstream.integrations.peft import QuantLoraLinear  # noqa: E402

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora(model, seed=0, r=4):
    torch.manual_seed(seed)
    return peft.get_peft_model(model, peft.LoraConfig(
        r=r, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=PROJECTIONS))


def loaded(path, fmt, daemon):
    return load_model(path, quantize=fmt, quant_block_size=32, socket=daemon.socket)


def quantized_copy(ref, fmt):
    """The same checkpoint quantized in place by quantize_model (no daemon)."""
    model = copy.deepcopy(ref)
    for layer in model.model.layers:
        layer.requires_grad_(False)
    quantize_model(model, fmt, block_size=32)
    return model


def adapters(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def randomize_b(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
def test_every_projection_of_a_load_model_base_becomes_a_lora_layer(daemon, tmp_path, fmt):
    save_model(str(tmp_path), seed=1)
    base = loaded(str(tmp_path), fmt, daemon)
    with torch.no_grad():
        before = base(TOKENS).logits.float()
    start = base.trainstream_base._region.address
    end = start + base.trainstream_base._region.size
    model = lora(base)
    layers = [m for m in model.modules() if isinstance(m, QuantLoraLinear)]
    assert len(layers) == 3 * 7
    for m in layers:
        q = m.get_base_layer()
        assert isinstance(q, QuantLinear) and q.format == fmt
        assert start <= q.qdata.data_ptr() < end  # still a view of the daemon's segment
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():  # lora_B starts at zero: the model is unchanged
        assert torch.equal(model(TOKENS).logits.float(), before)
    model.base_model.model.trainstream_base.release()


@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
def test_lora_output_is_dequantized_base_plus_scaled_update(daemon, tmp_path, fmt):
    save_model(str(tmp_path), seed=1)
    model = lora(loaded(str(tmp_path), fmt, daemon))
    randomize_b(model)
    layer = model.base_model.model.model.layers[1].mlp.up_proj
    x = torch.randn(2, 5, layer.in_features)
    q = layer.get_base_layer()
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    w = q.qweight.dequantize(torch.bfloat16).float()
    expected = x @ w.t() + (x @ a.t() @ b.t()) * layer.scaling["default"]
    if q.bias is not None:
        expected = expected + q.bias.float()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    model.base_model.model.trainstream_base.release()


def _train(model, daemon, steps=3, out=None):
    # The same two sequences every step, so the loss must fall.
    ids = torch.randint(256, (2, 12), generator=torch.Generator().manual_seed(5))
    data = [{"input_ids": ids[i % 2], "labels": ids[i % 2]} for i in range(steps * 2)]
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, max_steps=steps, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = TrainStreamTrainer(model=model, args=args, train_dataset=data,
                                 trainstream={"socket": daemon.socket})
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_qlora_trains_and_matches_the_same_adapters_on_a_quantize_model_base(daemon, tmp_path, fmt):
    ref = save_model(str(tmp_path / "ckpt"), seed=1)
    ours = lora(loaded(str(tmp_path / "ckpt"), fmt, daemon))
    theirs = lora(quantized_copy(ref, fmt))
    init = adapters(ours)
    assert init.keys() == adapters(theirs).keys()
    for k, v in adapters(theirs).items():
        assert torch.equal(init[k], v), k  # same seed, same targets: the same start
    q0 = ours.base_model.model.model.layers[0].self_attn.q_proj.get_base_layer().qdata.clone()
    losses = _train(ours, daemon, out=str(tmp_path / "a"))
    ref_losses = _train(theirs, daemon, out=str(tmp_path / "b"))
    assert losses[-1] < losses[0], losses
    trained = adapters(ours)
    assert any(not torch.equal(trained[k], init[k]) for k in trained if "lora_B" in k)
    for k, v in adapters(theirs).items():
        torch.testing.assert_close(trained[k], v, rtol=1e-5, atol=1e-6, msg=k)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    q = ours.base_model.model.model.layers[0].self_attn.q_proj.get_base_layer().qdata
    assert torch.equal(q, q0)  # the shared base is read-only and untouched
    ours.base_model.model.trainstream_base.release()


def test_adapter_saves_and_loads_onto_a_fresh_load_model_base(daemon, tmp_path):
    save_model(str(tmp_path / "ckpt"), seed=1)
    model = lora(loaded(str(tmp_path / "ckpt"), "nf4", daemon))
    randomize_b(model)
    with torch.no_grad():
        expected = model(TOKENS).logits.float()
    model.save_pretrained(str(tmp_path / "adapter"))
    assert os.path.exists(tmp_path / "adapter" / "adapter_model.safetensors")
    fresh = loaded(str(tmp_path / "ckpt"), "nf4", daemon)
    again = peft.PeftModel.from_pretrained(fresh, str(tmp_path / "adapter"))
    assert sum(isinstance(m, QuantLoraLinear) for m in again.modules()) == 3 * 7
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits.float(), expected, rtol=0, atol=0)
    fresh.trainstream_base.release()
    model.base_model.model.trainstream_base.release()


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_merge_and_unload_requantizes_with_a_warning(daemon, tmp_path, fmt):
    save_model(str(tmp_path), seed=1)
    base = loaded(str(tmp_path), fmt, daemon)
    with torch.no_grad():
        plain = base(TOKENS).logits.float()
    model = lora(base)
    randomize_b(model)
    with torch.no_grad():
        adapted = model(TOKENS).logits.float()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merged = model.merge_and_unload()
    assert any("quantizes the sum again" in str(w.message) for w in caught)
    assert not any(isinstance(m, QuantLoraLinear) for m in merged.modules())
    up = merged.model.layers[1].mlp.up_proj
    assert isinstance(up, QuantLinear) and up.format == fmt
    with torch.no_grad():
        out = merged(TOKENS).logits.float()
    # The merged weights are rounded to the format again: nearer the adapted model than
    # the plain base.
    assert (out - adapted).abs().mean() < (plain - adapted).abs().mean()
    base.trainstream_base.release()


def test_merge_and_unmerge_keep_the_layers_fp8_matmul_mode_and_paging(tmp_path):
    # A merge or unmerge builds a fresh QuantLinear: it keeps the mode wrap() or the user
    # set (an FP8 base with fp8_matmul="dequantize" stays off the tensor-core path, whose
    # copy the plan did not count) and the pager's paged flag.
    from trainstream.quantization import set_fp8_matmul
    save_model(str(tmp_path), seed=1)
    model = lora(quantized_copy(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)),
                                "fp8"))
    randomize_b(model)
    assert set_fp8_matmul(model, "dequantize") == 3 * 7
    up = model.base_model.model.model.layers[1].mlp.up_proj
    up.get_base_layer().set_paged(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.merge_adapter()
        merged = up.get_base_layer()
        model.unmerge_adapter()
    bases = [m.get_base_layer() for m in model.modules() if isinstance(m, QuantLoraLinear)]
    assert merged is not up.get_base_layer() and len(bases) == 3 * 7
    assert merged.fp8_matmul == "dequantize" and merged._paged
    assert all(b.fp8_matmul == "dequantize" for b in bases)
    assert up.get_base_layer()._paged and sum(b._paged for b in bases) == 1


def test_dora_on_a_quantized_base_names_what_is_accepted(daemon, tmp_path):
    save_model(str(tmp_path), seed=1)
    base = loaded(str(tmp_path), "nf4", daemon)
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    base.trainstream_base.release()


@pytest.mark.parametrize("value", [False, "none", None])
def test_load_model_quantize_false_and_none_mean_no_quantization(daemon, tmp_path, value):
    save_model(str(tmp_path), seed=1)
    model = load_model(str(tmp_path), quantize=value, socket=daemon.socket)
    assert model.trainstream_load["format"] == "none"
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    model.trainstream_base.release()


def test_load_model_rejects_other_quantize_values(tmp_path):
    save_model(str(tmp_path), seed=1)
    with pytest.raises(ValueError, match="None or False"):
        load_model(str(tmp_path), quantize="fp4")
