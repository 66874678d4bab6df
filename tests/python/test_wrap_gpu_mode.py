"""optimizer_mode="gpu": the zero-copy CUDA AdamW over moments in the daemon's
shared memory. CUDA tests run on the GPU host (scripts/gpu-check.sh); the refusal
on a CPU model runs everywhere."""
import copy
import gc
import json

import pytest
import torch

import trainstream
from test_wrap_cuda import _run
from tiny_gpt import GPTConfig, TinyGPT, corpus, text_batches

cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU (run scripts/gpu-check.sh on the GPU host)")


def _model(seed):
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=64)
    return cfg, TinyGPT(cfg).cuda()


@pytest.fixture(autouse=True)
def _no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def test_gpu_mode_refuses_a_cpu_model(daemon):
    model = TinyGPT(GPTConfig())
    with pytest.raises(ValueError, match="optimizer_mode='gpu'"):
        trainstream.wrap(model, socket=daemon.socket, optimizer_mode="gpu")


@cuda
@pytest.mark.parametrize("clip", [None, 0.05])
def test_gpu_mode_matches_torch_adamw(daemon, clip):
    cfg, ref = _model(0)
    ours = copy.deepcopy(ref)
    batches = text_batches(corpus(), cfg, batch=4, steps=20)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 socket=daemon.socket, optimizer_mode="gpu", offload=True,
                                 max_grad_norm=clip)
    assert opt.optimizer_mode == "gpu"
    a, b = _run(ref, ref_opt, batches, clip=clip), _run(ours, opt, batches)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= 1e-5 * abs(x), f"step {i}: {y} vs {x}"
    for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert (p - q).abs().max().item() <= 1e-6, n
    if clip is not None:
        assert opt.last_grad_norm > clip, "clipping must engage"
    report = trainstream.memory_report(ours)
    assert report["optimizer"]["optimizer_mode"] == "gpu"
    assert report["transfers"]["bytes_pcie"] > 0
    assert report["transfers"]["bytes_d2h"] == 0, "no gradient leaves the GPU in gpu mode"


@cuda
@pytest.mark.parametrize("moment_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_gpu_mode_is_bit_identical_to_the_daemons_engine(daemon, moment_dtype, param_dtype):
    """Same gradients, same arithmetic, same rounding keys: the same bits as CPU mode.
    (Gradients are set directly: CUDA's embedding backward sums with atomics, so two
    backward passes need not agree bit for bit.)"""
    _, base = _model(3)
    base = base.to(param_dtype)
    results = []
    for mode in ("cpu", "gpu"):
        model = copy.deepcopy(base)
        model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                                      socket=daemon.socket, optimizer_mode=mode, offload=True,
                                      moment_dtype=moment_dtype, seed=7)
        gen = torch.Generator(device="cuda").manual_seed(3)
        for _ in range(8):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, device="cuda", generator=gen).to(param_dtype)
            opt.step()
            opt.zero_grad()
        state = opt.state_dict()["state"]
        results.append(([p.detach().clone() for p in model.parameters()], state))
        trainstream.unwrap(model)
    (p_cpu, s_cpu), (p_gpu, s_gpu) = results
    for i, (a, b) in enumerate(zip(p_cpu, p_gpu)):
        assert torch.equal(a, b), f"param {i}: max diff {(a.float() - b.float()).abs().max()}"
    ties = 0
    for k in s_cpu:
        for field in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(s_cpu[k][field].cpu(), s_gpu[k][field].cpu()), (k, field)
        a, b = s_cpu[k]["master_weight"].cpu(), s_gpu[k]["master_weight"].cpu()
        if param_dtype == torch.float32:
            assert torch.equal(a, b), (k, "master_weight")
        else:
            # CPU mode keeps a bf16 parameter's master split (Note [Split master],
            # kernels/bf16.h): a rounding tie that went up moves its master one fp32 ulp
            # away from zero (about one element in 2^17 a step); GPU mode's master is
            # whole. So a master may differ by an ulp or two, in a few elements.
            ulps = (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()
            assert int(ulps.max()) <= 2, (k, int(ulps.max()))
            ties += int((ulps != 0).sum())
        assert float(s_cpu[k]["step"]) == float(s_gpu[k]["step"]) == 8.0
    total = sum(s["master_weight"].numel() for s in s_cpu.values())
    assert ties <= max(8, total * 8 // 2**14), (ties, total)  # 8 steps: ~8 in 2^17 each


@cuda
def test_gpu_mode_skips_a_parameter_with_a_non_finite_gradient(daemon):
    cfg, model = _model(4)
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1, seed=4)
    x, y = x.cuda(), y.cuda()
    first = next(model.parameters())
    # Poison one gradient before its post-accumulate hook launches the update.
    first.register_hook(lambda g: g.index_fill(0, torch.tensor([0], device=g.device),
                                               float("nan")))
    model, opt = trainstream.wrap(model, socket=daemon.socket, optimizer_mode="gpu", offload=True)
    before = [p.detach().clone() for p in model.parameters()]
    model(x, y).backward()
    with pytest.raises(trainstream.NonFiniteGradientError, match="1 parameter"):
        opt.step()
    after = list(model.parameters())
    assert torch.equal(before[0], after[0].detach()), "the poisoned parameter must not move"
    assert not torch.equal(before[1], after[1].detach()), "the others are updated"
    state = opt.state_dict()["state"]
    assert 0 not in state and float(state[1]["step"]) == 1.0


@cuda
def test_gpu_mode_state_dict_continues_in_torch(daemon):
    cfg, ref = _model(5)
    ours = copy.deepcopy(ref)
    batches = text_batches(corpus(), cfg, batch=4, steps=10, seed=5)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 socket=daemon.socket, optimizer_mode="gpu", offload=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
    _run(ref, ref_opt, batches[:5])
    _run(ours, opt, batches[:5])
    sd = opt.state_dict()
    # A fresh torch AdamW from our state dict continues exactly like the reference.
    cont = copy.deepcopy(ours)
    trainstream.unwrap(cont)
    cont_opt = torch.optim.AdamW(cont.parameters(), lr=3e-3, foreach=False)
    cont_opt.load_state_dict({"state": {k: {f: v.cuda() if f != "step" else v
                                            for f, v in s.items() if f != "master_weight"}
                                        for k, s in sd["state"].items()},
                              "param_groups": sd["param_groups"]})
    _run(ref, ref_opt, batches[5:])
    _run(cont, cont_opt, batches[5:])
    for (n, p), q in zip(ref.named_parameters(), cont.parameters()):
        assert (p - q).abs().max().item() <= 1e-6, n
    # And our state dict loads back into a gpu-mode optimizer.
    other = copy.deepcopy(ours)
    trainstream.unwrap(other)
    other, other_opt = trainstream.wrap(other, torch.optim.AdamW(other.parameters(), lr=3e-3),
                                        socket=daemon.socket, optimizer_mode="gpu", offload=True)
    other_opt.load_state_dict(sd)
    back = other_opt.state_dict()["state"]
    for k, s in sd["state"].items():
        assert torch.equal(s["exp_avg"].cpu(), back[k]["exp_avg"].cpu())
        assert float(s["step"]) == float(back[k]["step"])


@cuda
def test_free_grads_drops_gradients_and_matches(daemon):
    cfg, ref = _model(6)
    ours = copy.deepcopy(ref)
    batches = text_batches(corpus(), cfg, batch=4, steps=5, seed=6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 socket=daemon.socket, optimizer_mode="gpu", offload=True,
                                 free_grads=True)
    x, y = batches[0]
    loss = ours(x.cuda(), y.cuda())
    loss.backward()
    assert all(p.grad is None for p in ours.parameters()), "gradients are dropped after backward"
    opt.step()
    opt.zero_grad()
    _run(ref, ref_opt, batches[:1])
    _run(ref, ref_opt, batches[1:])
    _run(ours, opt, batches[1:])
    for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert (p - q).abs().max().item() <= 1e-6, n


@cuda
@pytest.mark.parametrize("mode", ["cpu", "gpu"])
def test_offload_auto_moves_a_small_model_to_torch_fused_adamw(daemon, mode):
    cfg, ref = _model(8)
    ours = copy.deepcopy(ref)
    batches = text_batches(corpus(), cfg, batch=4, steps=10, seed=8)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 socket=daemon.socket, optimizer_mode=mode)
    a = _run(ref, ref_opt, batches)
    b = _run(ours, opt, batches[:2])
    assert opt.offload_decision["offload"] is False, opt.offload_decision
    assert opt.stats()["offloaded"] is False and opt.optimizer_mode == "local"
    status = json.loads(daemon.ctl("status", "--json").stdout)
    assert status["sessions"] == [], "the daemon session is closed"
    b += _run(ours, opt, batches[2:])
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= 1e-5 * abs(x), f"step {i}: {y} vs {x}"
    for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert (p - q).abs().max().item() <= 1e-5, n
    kinds = [e["kind"] for e in trainstream.memory_report(ours)["events"]]
    assert "offload" in kinds


@cuda
def test_offload_auto_keeps_offloading_when_the_state_would_not_fit(daemon):
    torch.manual_seed(9)
    cfg = GPTConfig(vocab_size=128, block_size=64, n_layer=4, n_head=8, n_embd=1024)
    model = TinyGPT(cfg).cuda()
    gc.collect()
    torch.cuda.empty_cache()
    batches = text_batches(corpus(), cfg, batch=4, steps=3, seed=9)
    total = torch.cuda.get_device_properties(0).total_memory
    old = torch.cuda.get_per_process_memory_fraction(0)
    weights = sum(p.numel() * 4 for p in model.parameters())
    torch.cuda.reset_peak_memory_stats()
    # Room for the gradients and activations (+128 MiB) but not for two fp32 moments.
    torch.cuda.set_per_process_memory_fraction(
        min(1.0, (torch.cuda.memory_allocated() + weights + 128 * 2**20) / total))
    try:
        model, opt = trainstream.wrap(model, socket=daemon.socket, optimizer_mode="cpu",
                                      param_offload=False, activation_offload=False,
                                      recompute=False, attention=None)
        _run(model, opt, batches)
        decision = opt.offload_decision
        assert decision["offload"] is True, decision
        assert decision["needed_bytes"] > decision["capacity_bytes"] * 0.9
        assert opt.stats()["offloaded"] is True
    finally:
        torch.cuda.set_per_process_memory_fraction(old)


@cuda
@pytest.mark.parametrize("moment_dtype", ["float32", "bfloat16"])
def test_gpu_mode_awkward_sizes_match_the_daemons_engine(daemon, moment_dtype):
    """Sizes that exercise the vectorised body and the scalar tail of the kernel."""
    torch.manual_seed(10)
    shapes = [(1,), (7,), (4097,), (3, 5), (1 << 20) + 3]
    results = []
    for mode in ("cpu", "gpu"):
        torch.manual_seed(10)
        holder = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes])
        _, opt = trainstream.wrap(holder, torch.optim.AdamW(holder.parameters(), lr=1e-2),
                                  socket=daemon.socket, optimizer_mode=mode, offload=True,
                                  moment_dtype=moment_dtype)
        gen = torch.Generator(device="cuda").manual_seed(11)
        for _ in range(5):
            loss = sum((p * torch.randn(p.shape, device="cuda", generator=gen)).sum()
                       for p in holder)
            loss.backward()
            opt.step()
            opt.zero_grad()
        results.append([p.detach().clone() for p in holder])
        trainstream.unwrap(holder)
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"shape {shapes[i]}: {(a - b).abs().max()}"


@cuda
def test_auto_mode_picks_the_gpu_update_for_a_cuda_model(daemon):
    _, model = _model(12)
    model, opt = trainstream.wrap(model, socket=daemon.socket, offload=True)
    assert opt.optimizer_mode == "gpu"
    cpu_model = TinyGPT(GPTConfig())
    cpu_model, cpu_opt = trainstream.wrap(cpu_model, socket=daemon.socket)
    assert cpu_opt.optimizer_mode == "cpu"


@cuda
def test_gpu_mode_refuses_a_gradient_edited_after_backward(daemon):
    cfg, model = _model(13)
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1, seed=13)
    model, opt = trainstream.wrap(model, socket=daemon.socket, optimizer_mode="gpu",
                                  offload=True)
    model(x.cuda(), y.cuda()).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="max_grad_norm"):
        opt.step()
