"""TrainStreamTrainer against transformers.Trainer with its own torch AdamW (CPU): a tiny
random-weight Qwen2 trained with weight decay groups, a warm-up schedule, clipping and
gradient accumulation gives the same losses, gradient norms and weights; a run resumed
from a checkpoint ends where the uninterrupted one does."""
import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from trainstream.integrations.huggingface import TrainStreamTrainer  # noqa: E402
from trainstream.optim import OffloadAdamW  # noqa: E402


class _Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences; labels are the inputs (causal LM)."""

    def __init__(self, n=64, seq=32, vocab=128, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, vocab_size=128,
                                   max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def _args(out, **overrides):
    base = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=6,
                learning_rate=3e-3, weight_decay=0.1, warmup_steps=2, lr_scheduler_type="linear",
                max_grad_norm=0.5, gradient_accumulation_steps=2, logging_steps=1,
                save_strategy="no", report_to=[], use_cpu=True, seed=0,
                dataloader_num_workers=0, disable_tqdm=True)
    base.update(overrides)
    return transformers.TrainingArguments(**base)


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def _trainer(trainer_cls, model, out, daemon=None, options=None, **overrides):
    kwargs = {}
    if daemon is not None:
        kwargs["trainstream_options"] = {"socket": daemon.socket, **(options or {})}
    return trainer_cls(model=model, args=_args(out, **overrides), train_dataset=_Tokens(),
                       **kwargs)


def _run(trainer_cls, model, out, daemon=None, options=None, **overrides):
    trainer = _trainer(trainer_cls, model, out, daemon, options, **overrides)
    trainer.train()
    return trainer


def _assert_same_weights(ref, ours, tol):
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        diff = (p.detach() - q.detach()).abs().max().item()
        assert diff <= tol, f"{name}: max |diff| {diff:.3g}"


def _count_state_loads(monkeypatch):
    loads = []
    real_load = OffloadAdamW.load_state_dict
    monkeypatch.setattr(OffloadAdamW, "load_state_dict",
                        lambda self, sd: (loads.append(1), real_load(self, sd))[1])
    return loads


# 16 micro-batches an epoch: accumulating 3, the epoch's last step has only one, which
# reaches step() with its gradients not yet handed over.
@pytest.mark.parametrize("device, accumulation", [
    ("cpu", 2), ("cpu", 3),
    pytest.param("cuda", 2, marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the GPU host)"))])
def test_trainer_matches_transformers_trainer_with_torch_adamw(daemon, tmp_path, monkeypatch,
                                                              device, accumulation):
    ref_model = _model()
    our_model = copy.deepcopy(ref_model)
    device_args = dict(gradient_accumulation_steps=accumulation, use_cpu=device == "cpu")
    ref = _run(transformers.Trainer, ref_model, tmp_path / "ref", **device_args)
    # accelerate's prepare would copy the daemon's whole state out and back in.
    loads = _count_state_loads(monkeypatch)
    # offload=True: on a GPU, "auto" would hand a model this small to torch's fused AdamW.
    ours = _run(TrainStreamTrainer, our_model, tmp_path / "ours", daemon, {"offload": True},
                **device_args)
    assert loads == []
    assert next(our_model.parameters()).device.type == device
    opt = ours.optimizer.optimizer
    assert isinstance(opt, OffloadAdamW) and opt.optimizer_mode != "local"
    assert opt.stats()["steps"] == 6
    ref_loss, our_loss = _logged(ref, "loss"), _logged(ours, "loss")
    assert len(ref_loss) == len(our_loss) == 6
    for i, (a, b) in enumerate(zip(ref_loss, our_loss)):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {i}: loss {b} vs Trainer {a}"
    # The daemon's pre-clip norm is what Trainer logs from clip_grad_norm_.
    ref_norm, our_norm = _logged(ref, "grad_norm"), _logged(ours, "grad_norm")
    assert len(our_norm) == 6 and all(math.isfinite(v) for v in our_norm)
    for i, (a, b) in enumerate(zip(ref_norm, our_norm)):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {i}: grad_norm {b} vs Trainer {a}"
    assert any(a > 0.5 for a in ref_norm), "clipping never engaged: the test would not see it"
    _assert_same_weights(ref_model, our_model, 1e-5)


def test_a_second_train_goes_on_with_the_same_optimizer_as_trainers_does(daemon, tmp_path,
                                                                         monkeypatch):
    """Trainer keeps its optimizer (and its moments) for a second train(); so does this
    one, with the daemon's masters, and no state round trip through a new accelerator
    (Trainer makes one per hyperparameter trial)."""
    ref_model = _model()
    our_model = copy.deepcopy(ref_model)
    ref = _trainer(transformers.Trainer, ref_model, tmp_path / "ref", max_steps=3)
    ours = _trainer(TrainStreamTrainer, our_model, tmp_path / "ours", daemon, max_steps=3)
    ref.train()
    ours.train()
    first = ours.optimizer.optimizer
    ours.create_accelerator_and_postprocess()
    loads = _count_state_loads(monkeypatch)
    ref.train()
    ours.train()
    assert loads == []
    assert ours.optimizer.optimizer is first and first.stats()["steps"] == 6
    _assert_same_weights(ref_model, our_model, 1e-5)


def test_weights_loaded_between_runs_become_the_masters(daemon, tmp_path):
    """A weight changed outside the optimizer between two train() calls (Trainer loading
    its best checkpoint) is where the next run starts, not the daemon's older master."""
    model = _model()
    trainer = _trainer(TrainStreamTrainer, model, tmp_path, daemon, max_steps=2)
    trainer.train()
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)
    halved = model.lm_head.weight.detach().clone()
    trainer.create_optimizer()
    state = trainer.optimizer.state_dict()["state"]
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    index = next(i for i, p in enumerate(params) if p is model.lm_head.weight)
    assert torch.equal(state[index]["master_weight"].view_as(halved), halved)


def test_a_resumed_run_ends_where_the_uninterrupted_one_does(daemon, tmp_path):
    whole = _model()
    resumed = copy.deepcopy(whole)
    _run(TrainStreamTrainer, whole, tmp_path / "whole", daemon, max_steps=4)
    # Stop at step 2 (a checkpoint with the daemon's optimizer state), then resume in a
    # new trainer over a new model.
    first = copy.deepcopy(resumed)
    _run(TrainStreamTrainer, first, tmp_path / "run", daemon, max_steps=4, save_strategy="steps",
         save_steps=2)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert (checkpoint / "optimizer.pt").exists()
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=False)
    assert "master_weight" in saved["state"][0] and saved["state"][0]["step"].item() == 2.0
    trainer = TrainStreamTrainer(model=resumed, args=_args(tmp_path / "run", max_steps=4),
                                 train_dataset=_Tokens(),
                                 trainstream_options={"socket": daemon.socket})
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 4
    _assert_same_weights(whole, resumed, 1e-6)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"args_overrides": {"optim": "adafactor"}}, "optim='adafactor'.*accepted: adamw_torch"),
    ({"optimizer": "sgd"}, r"optimizers=\(SGD, ...\).*accepted: torch.optim.AdamW"),
    ({"optimizer": "adamw", "scheduler": True}, r"optimizers=\(..., scheduler\)"),
    ({"trainer": {"optimizer_cls_and_kwargs": (torch.optim.SGD, {})}},
     r"optimizer_cls_and_kwargs=\(<class 'torch.optim.sgd.SGD'>"),
    ({"options": {"max_grad_norm": 1.0}}, "set TrainingArguments.max_grad_norm"),
    ({"options": {"chunked_loss": 1}}, "chunked_loss=1 is not accepted"),
    ({"args_overrides": {"fp16": True}}, "fp16=True: its gradient scaler"),
])
def test_what_it_cannot_do_is_refused_by_name(daemon, tmp_path, kwargs, fragment):
    options = {"socket": daemon.socket, **kwargs.get("options", {})}
    model = _model()
    trainer_kwargs = dict(kwargs.get("trainer", {}))
    if "optimizer" in kwargs:
        cls = torch.optim.SGD if kwargs["optimizer"] == "sgd" else torch.optim.AdamW
        opt = cls(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0) if "scheduler" in kwargs \
            else None
        trainer_kwargs["optimizers"] = (opt, sched)
    with pytest.raises(ValueError, match=fragment):
        TrainStreamTrainer(model=model, args=_args(tmp_path, **kwargs.get("args_overrides", {})),
                           train_dataset=_Tokens(), trainstream_options=options, **trainer_kwargs)
