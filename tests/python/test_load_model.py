"""trainstream.integrations.huggingface.load_model over the daemon's shared base:
a tiny Qwen2 written by the test itself, loaded without allocating weights, gives
the same logits as the original (bf16) or as quantize_model on it (quantized)."""
import copy
import os

import pytest
import torch

from safetensors_writer import write_safetensors

transformers = pytest.importorskip("transformers")

from trainstream.integrations.huggingface import load_model, resolve_quantize  # noqa: E402
from trainstream.frozen.quantization import QuantLinear, quantize_model  # noqa: E402


def tiny_config(tie=False):
    return transformers.Qwen2Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                    max_position_embeddings=128, tie_word_embeddings=tie)


def save_model(folder, tie=False, seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config(tie)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():  # larger values than the default init, so logits differ visibly
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.tie_weights()
    cfg.save_pretrained(folder)
    sd = {k: v for k, v in model.state_dict().items()}
    if tie:
        sd.pop("lm_head.weight")  # Hugging Face does not save tied weights twice
    write_safetensors(os.path.join(folder, "model.safetensors"), sd, metadata={"format": "pt"})
    return model


TOKENS = torch.tensor([[1, 5, 9, 200, 3, 77, 4, 0]])


def logits(model):
    with torch.no_grad():
        return model(TOKENS).logits.float()


def test_bf16_model_matches_the_original_and_shares_block_weights(daemon, tmp_path):
    ref = save_model(str(tmp_path))
    model = load_model(str(tmp_path), quantize="none", socket=daemon.socket)
    base = model.trainstream_base
    assert torch.equal(logits(model), logits(ref))
    start, end = base._region.address, base._region.address + base._region.size
    layer = model.model.layers[1]
    for lin in (layer.self_attn.q_proj, layer.mlp.down_proj):
        assert start <= lin.weight.data_ptr() < end  # a view of the shared base
        assert not lin.weight.requires_grad
    emb = model.model.embed_tokens.weight
    assert emb.requires_grad and not (start <= emb.data_ptr() < end)  # the rest: own copies
    assert model.lm_head.weight.requires_grad
    assert layer.self_attn.q_proj.bias.requires_grad
    stats = model.trainstream_load
    assert stats["shared_views"] == 3 * 7 and stats["shared_quantized"] == 0
    assert daemon.status()["bases"][0]["refcount"] == 1
    # Training what is trainable works; the frozen base gets no gradient.
    out = model(TOKENS).logits.float().sum()
    out.backward()
    assert emb.grad is not None and layer.self_attn.q_proj.weight.grad is None
    base.release()
    assert daemon.status()["bases"][0]["refcount"] == 0


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_quantized_model_matches_quantize_model(daemon, tmp_path, fmt):
    ref = save_model(str(tmp_path), seed=1)
    for layer in ref.model.layers:
        layer.requires_grad_(False)
    expected = copy.deepcopy(ref)
    quantize_model(expected, fmt, block_size=32)
    model = load_model(str(tmp_path), quantize=fmt, quant_block_size=32, socket=daemon.socket)
    assert model.trainstream_load["shared_quantized"] == 3 * 7
    q = model.model.layers[2].mlp.up_proj
    assert isinstance(q, QuantLinear) and q.format == fmt
    r = expected.model.layers[2].mlp.up_proj
    assert torch.equal(q.qdata, r.qdata) and torch.equal(q.qscales, r.qscales)
    assert torch.equal(logits(model), logits(expected))
    model.trainstream_base.release()


def test_load_threads_and_the_progress_callback(daemon, tmp_path):
    save_model(str(tmp_path))
    calls = []
    model = load_model(str(tmp_path), quantize="nf4", socket=daemon.socket, load_threads=1,
                       progress=lambda *a: calls.append(a))
    info = model.trainstream_base.info
    assert info["load_threads"] == 1
    assert calls and calls[-1][0] == calls[-1][1] == info["source_bytes"]
    assert calls[-1][2] == calls[-1][3] == info["tensors"]


def test_tied_embeddings_and_config_overrides(daemon, tmp_path):
    ref = save_model(str(tmp_path), tie=True, seed=2)
    model = load_model(str(tmp_path), quantize="none", socket=daemon.socket)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(logits(model), logits(ref))
    model.trainstream_base.release()
    with pytest.raises(ValueError, match="config has no field 'no_such_field'"):
        load_model(str(tmp_path), socket=daemon.socket, no_such_field=1)
    # Fewer layers than the checkpoint: the extra tensors are simply not used.
    small = load_model(str(tmp_path), quantize="none", socket=daemon.socket, num_hidden_layers=1)
    assert len(small.model.layers) == 1
    small.trainstream_base.release()


def test_random_weights_need_only_the_config(tmp_path):
    tiny_config().save_pretrained(tmp_path)
    model = load_model(str(tmp_path), quantize="nf4", random_weights=True)
    assert isinstance(model.model.layers[0].mlp.gate_proj, QuantLinear)
    assert not any(p.is_meta for p in model.parameters())
    assert torch.isfinite(logits(model)).all()


def test_bad_options_are_value_errors(tmp_path):
    tiny_config().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="share_vram needs a CUDA device, not cpu"):
        load_model(str(tmp_path), share_vram="cpu")
    with pytest.raises(ValueError, match="share_vram needs a checkpoint"):
        load_model(str(tmp_path), share_vram=True, random_weights=True)
    with pytest.raises(ValueError, match="quantize='q3'"):
        load_model(str(tmp_path), quantize="q3")
    with pytest.raises(ValueError, match="block_size"):
        load_model(str(tmp_path), quant_block_size=3)
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tmp_path), dtype=torch.int8)
    with pytest.raises(ValueError, match="load_threads=0"):
        load_model(str(tmp_path), load_threads=0)
    with pytest.raises(ValueError, match="progress='bar'"):
        load_model(str(tmp_path), progress="bar")
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "missing"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_share_vram_without_a_gpu_says_why_and_releases_the_base(daemon, tmp_path):
    save_model(str(tmp_path))
    with pytest.raises(RuntimeError, match="share_vram needs (CUDA|a CUDA device in this process)"):
        load_model(str(tmp_path), quantize="nf4", socket=daemon.socket, share_vram=True)
    (b,) = daemon.status()["bases"]
    assert b["refcount"] == 0  # the failed call kept no reference
    model = load_model(str(tmp_path), quantize="nf4", socket=daemon.socket)  # and CPU works
    assert model.trainstream_load["vram_device"] is None
    model.trainstream_base.release()


def test_auto_quantize_rule():
    gib = 2**30
    # 10 Gparam of block weights + 1 Gparam of the rest.
    n, rest = 10 * 10**9, 10**9
    assert resolve_quantize("auto", n, rest, available=100 * gib) == "none"      # 22 GB fits
    assert resolve_quantize("auto", n, rest, available=16 * gib) == "int8"       # ~12.6 GB fits
    assert resolve_quantize("auto", n, rest, available=9 * gib) == "nf4"
    assert resolve_quantize("auto", n, rest, ram_fraction=0.5, available=30 * gib) == "int8"
    assert resolve_quantize("nf4", n, rest, available=1000 * gib) == "nf4"
    assert resolve_quantize(None, n, rest) == "none"
    with pytest.raises(ValueError, match="ram_fraction"):
        resolve_quantize("auto", n, rest, ram_fraction=1.5)
