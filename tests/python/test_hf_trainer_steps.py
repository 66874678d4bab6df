"""TrainStreamTrainer and TrainStreamCallback around the steps (CPU): the ts_* figures in
Trainer's logs, the end of a step that a train() which raised part way left pending
(Trainer clears gradients with model.zero_grad()), wrap_hf, and the refusals."""
import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

import trainstream  # noqa: E402
from test_hf_trainer import _Tokens, _args, _assert_same_weights, _logged, _model  # noqa: E402
from trainstream.integrations.hf_callback import GIB  # noqa: E402
from trainstream.integrations.huggingface import (TrainStreamCallback,  # noqa: E402
                                                   TrainStreamTrainer, decoder_layers, wrap_hf)
from trainstream.optim import OffloadAdamW  # noqa: E402

FIGURES = ("ts_vram_alloc_gb", "ts_vram_peak_gb", "ts_pinned_gb", "ts_host_state_gb",
           "ts_d2h_gb", "ts_h2d_gb")


def _check_figures(trainer, opt):
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == trainer.state.global_step
    for h in logs:
        assert set(FIGURES) <= set(h), f"missing: {set(FIGURES) - set(h)}"
        if not torch.cuda.is_available():
            assert h["ts_vram_alloc_gb"] == h["ts_vram_peak_gb"] == 0.0
        assert h["ts_pinned_gb"] * GIB == trainstream.pinned_stats(opt)["mapped_bytes"] > 0
        assert h["ts_host_state_gb"] * GIB == opt.state_bytes() > 0
    # Each log counts the bytes since the previous one: they add up to the totals.
    moved = trainstream.transfer_stats(opt)
    for key, total in (("ts_d2h_gb", moved["bytes_d2h"]), ("ts_h2d_gb", moved["bytes_h2d"])):
        logged = sum(h.get(key, 0.0) for h in trainer.state.log_history) * GIB
        assert total > 0 and math.isclose(logged, total, rel_tol=1e-9), (key, logged, total)
    step = opt.stats()["bytes_d2h"] / trainer.state.global_step
    assert all(math.isclose(h["ts_d2h_gb"] * GIB, step, rel_tol=1e-9) for h in logs)


def test_trainer_logs_the_trainstream_figures(daemon, tmp_path):
    trainer = TrainStreamTrainer(model=_model(), args=_args(tmp_path, max_steps=3),
                                 train_dataset=_Tokens(), trainstream={"socket": daemon.socket})
    trainer.train()
    _check_figures(trainer, trainer.optimizer.optimizer)


def test_callback_adds_the_figures_to_a_stock_trainer(daemon, tmp_path):
    # A stock Trainer measures the norm with clip_grad_norm_(inf), which rewrites the
    # gradients: they are handed over in step() (grad_post="step").
    model = _model()
    _, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                              socket=daemon.socket, grad_post="step", accumulation_steps=2,
                              offload=True)
    trainer = transformers.Trainer(model=model, args=_args(tmp_path, max_steps=3, max_grad_norm=0),
                                   train_dataset=_Tokens(), optimizers=(opt, None),
                                   callbacks=[TrainStreamCallback(opt)])
    trainer.train()
    _check_figures(trainer, opt)
    with pytest.raises(ValueError, match="accepted: a trainstream OffloadAdamW"):
        TrainStreamCallback(torch.optim.AdamW(model.parameters()))


class _Fail(Exception):
    pass


def _fail_in_backward(model, at_call):
    """Raises in the backward pass reaching layer 0's down_proj for the at_call-th time:
    the head, the norm and layer 1 have their gradients by then (hooks run)."""
    calls = []

    def hook(grad):
        calls.append(1)
        if len(calls) == at_call:
            raise _Fail(f"injected in backward {at_call}")
    return model.model.layers[0].mlp.down_proj.weight.register_hook(hook)


@pytest.mark.parametrize("accumulation, grad_post", [(2, "backward"), (1, "step")])
def test_a_train_that_raised_in_backward_is_ended_and_the_next_trains_as_trainer(
        daemon, tmp_path, accumulation, grad_post):
    """The third backward raises (accumulating 2: the first micro-batch of step 2, after
    some gradients were counted), train() stops; a second train() then matches a stock
    Trainer that went through the same. Before, the leftover counts handed the next
    step's gradients over a micro-batch early."""
    ref_model = _model()
    our_model = copy.deepcopy(ref_model)
    args = dict(max_steps=3, gradient_accumulation_steps=accumulation)
    ref = transformers.Trainer(model=ref_model, args=_args(tmp_path / "ref", **args),
                               train_dataset=_Tokens())
    ours = TrainStreamTrainer(model=our_model, args=_args(tmp_path / "ours", **args),
                              train_dataset=_Tokens(),
                              trainstream={"socket": daemon.socket, "grad_post": grad_post})
    for trainer, model in ((ref, ref_model), (ours, our_model)):
        handle = _fail_in_backward(model, at_call=3)
        with pytest.raises(_Fail):
            trainer.train()
        handle.remove()
    opt = ours.optimizer.optimizer
    assert not opt.between_steps(), "the failed backward left nothing pending: no test"
    ref.train()
    ours.train()
    assert ours.state.global_step == 3 and opt.between_steps()
    for i, (a, b) in enumerate(zip(_logged(ref, "loss")[-3:], _logged(ours, "loss")[-3:])):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {i}: loss {b} vs Trainer {a}"
    _assert_same_weights(ref_model, our_model, 1e-5)


def test_zero_grad_ends_a_step_whose_backward_raised_after_posting(daemon):
    """Without accumulation the head's gradient is posted (and, without clipping,
    applied: an update in the daemon cannot be undone) before the backward raises;
    zero_grad() ends the step with what was posted, as torch's AdamW steps the
    parameters that have a gradient, and the next step matches torch's."""
    ref_model = _model()
    our_model = copy.deepcopy(ref_model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    _, opt = trainstream.wrap(our_model, torch.optim.AdamW(our_model.parameters(), lr=1e-2),
                              socket=daemon.socket, offload=True)
    batch = _Tokens()[0]
    x = batch["input_ids"][None]
    for model, o in ((ref_model, ref_opt), (our_model, opt)):
        handle = _fail_in_backward(model, at_call=1)
        with pytest.raises(_Fail):
            model(input_ids=x, labels=x).loss.backward()
        handle.remove()
        got = [n for n, p in model.named_parameters() if p.grad is not None]
        assert "lm_head.weight" in got and "model.embed_tokens.weight" not in got
        if o is ref_opt:
            o.step()  # what the daemon has done: the parameters with a gradient
        o.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        o.step()
        o.zero_grad()
    assert opt.step_id == 2 and opt.between_steps()
    _assert_same_weights(ref_model, our_model, 1e-5)


def test_wrap_hf_presets_the_decoder_layers(daemon):
    model = _model()
    layers = decoder_layers(model)
    assert layers == list(model.model.layers)
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(_model(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert decoder_layers(lora) == list(lora.get_base_model().model.layers)
    wrapped, opt = wrap_hf(model, socket=daemon.socket, param_offload=True, min_offload_bytes=0)
    assert isinstance(opt, OffloadAdamW)
    report = trainstream.memory_report(wrapped)
    assert report["params"]["paged_blocks"] == [0, 1]
    plan = next(ev for ev in report["events"] if ev["kind"] == "plan")
    assert plan["blocks"] == len(layers)
    trainstream.unwrap(wrapped)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"trainstream": {}, "trainstream_options": {}}, "give one of them"),
    ({"trainstream": ["lr"]}, r"trainstream=\['lr'\]: accepted: a dict"),
    ({"trainstream": {"loss_chunk_size": 0}}, "loss_chunk_size=0 is not accepted"),
    ({"trainstream": {"chunked_loss": "yes"}}, "chunked_loss='yes' is not accepted"),
    ({"trainstream": {"param_offload": "all"}}, "param_offload='all' is not accepted"),
    ({"trainstream": {"device": "meta"}}, r"\['device'\]='meta': the TrainingArguments"),
    ({"trainstream": {"accumulation_steps": 2}}, "set TrainingArguments.gradient_accum"),
])
def test_bad_trainstream_options_are_refused_by_name(daemon, tmp_path, kwargs, fragment):
    for key in kwargs:
        if isinstance(kwargs[key], dict):
            kwargs[key] = {"socket": daemon.socket, **kwargs[key]}
    with pytest.raises(ValueError, match=fragment):
        TrainStreamTrainer(model=_model(), args=_args(tmp_path), train_dataset=_Tokens(), **kwargs)
