"""TrainStreamTrainer with wrap()'s paging options (CPU: the pager and the activation
offloader run with memcpy, so paged training is bit for bit the unpaged one): losses,
evaluation, checkpoints, resume and load_best_model_at_end as without paging; on a GPU
the model stays on the CPU until wrap() places it (CUDA tests, run on the GPU host), and
the machine is measured and planned for once per job."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import trainstream  # noqa: E402
from test_hf_trainer import _Tokens, _args, _assert_same_weights, _logged, _model  # noqa: E402
from trainstream.integrations.huggingface import TrainStreamTrainer  # noqa: E402

PAGING = {"param_offload": True, "activation_offload": True, "min_offload_bytes": 0}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (runs on the GPU host)")


def _trainer(model, out, daemon, options=None, **overrides):
    return TrainStreamTrainer(model=model, args=_args(out, **overrides), train_dataset=_Tokens(),
                              eval_dataset=_Tokens(n=8, seed=1),
                              trainstream={"socket": daemon.socket, **(options or {})})


def test_paged_training_with_evaluation_and_best_model_matches_unpaged(daemon, tmp_path):
    """Every block paged, activations offloaded: the same losses, evaluation losses and
    weights as the unpaged trainer, through evaluation, checkpoints every 2 steps and
    load_best_model_at_end (the best weights become the masters)."""
    plain_model = _model()
    paged_model = copy.deepcopy(plain_model)
    run = dict(max_steps=6, eval_strategy="steps", eval_steps=2, save_strategy="steps",
               save_steps=2, load_best_model_at_end=True, metric_for_best_model="loss",
               greater_is_better=True)  # the worst eval loss: usually not the last checkpoint
    plain = _trainer(plain_model, tmp_path / "plain", daemon, **run)
    paged = _trainer(paged_model, tmp_path / "paged", daemon, PAGING, **run)
    plain.train()
    paged.train()
    report = trainstream.memory_report(paged_model)
    assert report["params"]["paged_blocks"] == [0, 1]
    assert report["activations"]["bytes_offloaded"] > 0
    assert _logged(paged, "loss") == _logged(plain, "loss")
    evals = _logged(paged, "eval_loss")
    assert len(evals) == 3 and evals == _logged(plain, "eval_loss")
    # Which evaluation is the worst depends on the machine's arithmetic (CPU or GPU).
    best = 2 * (evals.index(max(evals)) + 1)
    assert paged.state.best_model_checkpoint.endswith(f"checkpoint-{best}")
    assert plain.state.best_model_checkpoint.endswith(f"checkpoint-{best}")
    _assert_same_weights(plain_model, paged_model, 0.0)
    # The weights now are the best checkpoint's, in the pager's host homes too.
    assert paged.evaluate()["eval_loss"] == max(evals)
    # The loaded best weights are where a further run starts, as unpaged.
    plain.args.max_steps = paged.args.max_steps = 2
    plain.args.load_best_model_at_end = paged.args.load_best_model_at_end = False
    plain.train()
    paged.train()
    _assert_same_weights(plain_model, paged_model, 0.0)


def test_a_paged_run_resumed_from_a_checkpoint_ends_where_the_whole_run_does(daemon, tmp_path):
    whole = _model()
    first, resumed = copy.deepcopy(whole), copy.deepcopy(whole)
    _trainer(whole, tmp_path / "whole", daemon, PAGING, max_steps=4).train()
    _trainer(first, tmp_path / "run", daemon, PAGING, max_steps=4, save_strategy="steps",
             save_steps=2).train()
    trainer = _trainer(resumed, tmp_path / "run", daemon, PAGING, max_steps=4)
    trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert trainer.state.global_step == 4
    assert trainstream.memory_report(resumed)["params"]["paged_blocks"] == [0, 1]
    _assert_same_weights(whole, resumed, 1e-6)


def test_evaluate_before_train_wraps_a_paged_model_first(daemon, tmp_path):
    plain_model = _model()
    paged_model = copy.deepcopy(plain_model)
    plain = _trainer(plain_model, tmp_path / "plain", daemon, max_steps=2)
    # The plain model is not wrapped before train(), so its evaluation runs the model's
    # own loss; lm_loss="model" keeps the paged one on it too, for a bit-for-bit check
    # of paging alone (wrap()'s lm_loss is the same loss to float rounding).
    paged = _trainer(paged_model, tmp_path / "paged", daemon, {**PAGING, "lm_loss": "model"},
                     max_steps=2)
    before = paged.evaluate()["eval_loss"]
    assert trainstream.memory_report(paged_model)["params"]["paged_blocks"] == [0, 1]
    assert before == plain.evaluate()["eval_loss"]
    plain.train()
    paged.train()
    assert paged.optimizer.optimizer.stats()["steps"] == 2
    _assert_same_weights(plain_model, paged_model, 0.0)


def _wide_model(seed=0):
    """8 blocks of 61k parameters beside 8k outside them: a cap can fit the paged plan
    and not the resident one."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=256, vocab_size=128,
                                   max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


@needs_cuda
@pytest.mark.parametrize("how", ["options", "planner"])
def test_on_a_gpu_the_model_stays_on_the_cpu_until_wrap_places_it(daemon, tmp_path,
                                                                  monkeypatch, how):
    """Paging asked for (param_offload=True), or no paging option and a
    TRAINSTREAM_VRAM_LIMIT the resident model does not fit in, so that wrap()'s planner
    pages: Trainer and accelerate leave the model on the CPU, wrap() puts what does not
    page on the GPU, and training matches the unpaged trainer on the GPU."""
    plain_model = _wide_model()
    paged_model = copy.deepcopy(plain_model)
    plain = _trainer(plain_model, tmp_path / "plain", daemon, {"offload": True}, use_cpu=False,
                     max_steps=3)
    options = {"optimizer_mode": "cpu", "min_offload_bytes": 0}
    if how == "options":
        options.update(PAGING)
    else:
        # The planner keeps 128 MiB free on CUDA and a quarter for activations: 2.5 MiB
        # above that holds the paged plan (~1.4 MiB), not the resident one (~4.3 MiB).
        limit = (128 << 20) + (5 << 19) + torch.cuda.memory_allocated()
        monkeypatch.setenv("TRAINSTREAM_VRAM_LIMIT", str(limit))
    try:
        paged = _trainer(paged_model, tmp_path / "paged", daemon, options, use_cpu=False,
                         max_steps=3)
        assert paged.defers_placement()
        assert {p.device.type for p in paged_model.parameters()} == {"cpu"}
        plain.train()
        paged.train()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    report = trainstream.memory_report(paged_model)
    assert report["params"]["paged_blocks"]
    assert paged_model.lm_head.weight.device.type == "cuda"
    for a, b in zip(_logged(plain, "loss"), _logged(paged, "loss")):
        assert abs(a - b) <= 1e-4 * abs(a)
    _assert_same_weights(plain_model.cpu(), paged_model.cpu(), 1e-4)  # one device


def test_without_paging_the_model_is_not_held_back(daemon, tmp_path):
    trainer = _trainer(_model(), tmp_path, daemon, {"param_offload": False})
    assert trainer.defers_placement() is False
    paged = _trainer(_model(), tmp_path, daemon, {"param_offload": [1]})
    assert paged.defers_placement() is True


@pytest.mark.parametrize("chunked", [True, False])
def test_the_chunked_loss_workspace_is_added_to_the_headroom(daemon, tmp_path, chunked):
    """A VRAM limit with the chunked loss: vram_headroom grows by the loss's logits (a
    chunk, in the matmul dtype and as fp32 log-probabilities) and head gradient, as a
    share of the limit; without the chunked loss it stays as given."""
    from trainstream.integrations.hf_loss import find_causal_lm_head, workspace_bytes
    model = _model()
    limit = 64 << 20
    trainer = _trainer(model, tmp_path / "out", daemon,
                       {"vram_limit": limit, "vram_headroom": 0.05, "chunked_loss": chunked,
                        "loss_chunk_size": 16}, max_steps=1)
    trainer.train()
    lm = find_causal_lm_head(model)
    vocab, hidden = lm.head.weight.shape
    ws = workspace_bytes(lm, 16, lm.head.weight.dtype)
    assert ws == 16 * vocab * (lm.head.weight.element_size() + 4) + \
        (vocab * hidden * lm.head.weight.element_size() if lm.head.weight.requires_grad else 0)
    headroom = model._trainstream_session.config["vram_headroom"]
    assert headroom == pytest.approx(0.05 + ws / limit if chunked else 0.05)


@pytest.mark.parametrize("limit", [None, 300_000])
def test_the_machine_is_measured_and_the_plan_made_once_per_job(daemon, tmp_path, monkeypatch,
                                                                limit):
    """TrainStreamTrainer plans before Trainer places the model (does it page?) and hands
    that plan to wrap(): one capacity measurement and one plan per job, whether the model
    fits (no limit) or, under a TRAINSTREAM_VRAM_LIMIT its resident blocks do not fit in,
    pages (and stays where it is until wrap() places it). Before, create_optimizer's
    wrap() measured the machine and planned again."""
    from trainstream.memory import install, planner
    calls = {"measure_capacity": 0, "plan": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call
    monkeypatch.setattr(install, "measure_capacity",
                        counted("measure_capacity", install.measure_capacity))
    monkeypatch.setattr(planner, "plan", counted("plan", planner.plan))
    if limit is not None:
        monkeypatch.setenv("TRAINSTREAM_VRAM_LIMIT", str(limit))
    model = _model()
    trainer = _trainer(model, tmp_path, daemon, {"min_offload_bytes": 0, "chunked_loss": False},
                       max_steps=2)
    assert trainer.defers_placement() is (limit is not None)
    trainer.train()
    assert calls == {"measure_capacity": 1, "plan": 1}
    paged = trainstream.memory_report(model)["params"]["paged_blocks"]
    assert paged == ([0, 1] if limit is not None else [])
