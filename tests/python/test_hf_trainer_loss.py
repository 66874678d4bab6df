"""TrainStreamTrainer's chunked causal-LM loss (hf_loss.py) against transformers.Trainer
with torch's AdamW and the model's own loss (full logits), on the CPU: the same losses
and weights with gradient accumulation (num_items_in_batch), a tied output head and a
PEFT LoRA model; the head never makes more than one position's logits."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_trainer import _Tokens, _args, _assert_same_weights, _logged  # noqa: E402
from trainstream.integrations.hf_loss import find_causal_lm_head  # noqa: E402
from trainstream.integrations.huggingface import TrainStreamTrainer  # noqa: E402

# Tolerances: the chunked loss sums the same fp32 terms in another order.
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-5


def _model(seed=0, tied=False):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, vocab_size=128,
                                   max_position_embeddings=64, tie_word_embeddings=tied)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


class _Padded(_Tokens):
    """Rows whose last quarter is padding (-100 labels), so micro-batches count
    different numbers of tokens and num_items_in_batch matters."""

    def __getitem__(self, i):
        row = super().__getitem__(i)
        labels = row["labels"].clone()
        labels[-(1 + i % 8):] = -100
        return {"input_ids": row["input_ids"], "labels": labels}


def _logit_positions(model):
    seen = []
    model.get_output_embeddings().register_forward_hook(
        lambda m, a, out: seen.append(out.shape[-2]))
    return seen


def _compare(daemon, tmp_path, make, accumulation, options=None):
    ref_model = make()
    our_model = copy.deepcopy(ref_model)
    seen = _logit_positions(our_model)
    args = dict(gradient_accumulation_steps=accumulation, max_steps=4)
    ref = transformers.Trainer(model=ref_model, args=_args(tmp_path / "ref", **args),
                               train_dataset=_Padded())
    ours = TrainStreamTrainer(model=our_model, args=_args(tmp_path / "ours", **args),
                              train_dataset=_Padded(),
                              trainstream={"socket": daemon.socket, **(options or {})})
    ref.train()
    ours.train()
    ref_loss, our_loss = _logged(ref, "loss"), _logged(ours, "loss")
    assert len(our_loss) == 4
    for i, (a, b) in enumerate(zip(ref_loss, our_loss)):
        assert abs(a - b) <= LOSS_RTOL * abs(a), f"step {i}: loss {b} vs Trainer {a}"
    _assert_same_weights(ref_model, our_model, WEIGHT_ATOL)
    return ours, seen


@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_chunked_loss_trains_as_trainer_with_the_models_own_loss(daemon, tmp_path,
                                                                 accumulation, tied):
    ours, seen = _compare(daemon, tmp_path, lambda: _model(tied=tied), accumulation,
                          {"loss_chunk_size": 7})  # chunks that do not divide 4 x 32 tokens
    assert ours.chunked_loss and ours._lm_head
    assert seen and set(seen) == {1}, f"the head made logits of {set(seen)} positions"


def test_chunked_loss_false_keeps_the_models_loss(daemon, tmp_path):
    ours, seen = _compare(daemon, tmp_path, _model, 2, {"chunked_loss": False})
    assert set(seen) == {32}


def test_chunked_loss_of_a_peft_lora_model(daemon, tmp_path):
    peft = pytest.importorskip("peft")

    def make():
        model = _model()
        return peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    ours, seen = _compare(daemon, tmp_path, make, 2)
    assert set(seen) == {1}


def test_only_models_whose_logits_are_the_head_of_the_hidden_state_are_chunked():
    assert find_causal_lm_head(_model()) is not None
    gemma = transformers.Gemma2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64,
                                      vocab_size=128, head_dim=8)
    assert gemma.final_logit_softcapping is not None
    assert find_causal_lm_head(transformers.AutoModelForCausalLM.from_config(gemma)) is None
    bert = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, vocab_size=128)
    assert find_causal_lm_head(transformers.BertForSequenceClassification(bert)) is None
