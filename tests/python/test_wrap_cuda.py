"""wrap() on CUDA models: the same data plane with async D2H/H2D copies on dedicated
streams and registered staging memory. Runs on the GPU host (scripts/gpu-check.sh)."""
import copy

import pytest
import torch

import trainstream
from tiny_gpt import GPTConfig, TinyGPT, corpus, text_batches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (run scripts/gpu-check.sh on the GPU host)")


def _pair(seed):
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=64)
    ref = TinyGPT(cfg).cuda()
    return cfg, ref, copy.deepcopy(ref)


def _run(model, opt, batches, autocast=False, clip=None):
    losses = []
    for x, y in batches:
        x, y = x.cuda(), y.cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_cuda_fp32_matches_torch_adamw(daemon):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg, ref, ours = _pair(0)
    batches = text_batches(corpus(), cfg, batch=4, steps=20)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 socket=daemon.socket, offload=True, optimizer_mode="cpu")
    a, b = _run(ref, ref_opt, batches), _run(ours, opt, batches)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= 1e-5 * abs(x), f"step {i}: {y} vs {x}"
    for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert (p - q).abs().max().item() <= 1e-6, n
    assert trainstream.pinned_stats(opt)["registered_bytes"] > 0, "staging must be registered"


def test_cuda_bf16_autocast_tracks_torch(daemon):
    cfg, ref, ours = _pair(1)
    batches = text_batches(corpus(), cfg, batch=4, steps=20, seed=1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 socket=daemon.socket, offload=True, optimizer_mode="cpu")
    a, b = _run(ref, ref_opt, batches, True), _run(ours, opt, batches, True)
    assert b[-1] < b[0]
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= 0.02 * abs(x), f"step {i}: {y} vs {x}"


def test_cuda_bf16_params_with_bf16_moments(daemon):
    cfg, ref, ours = _pair(2)
    ref = ref.to(torch.float32)
    ours = ours.to(torch.bfloat16)
    batches = text_batches(corpus(), cfg, batch=4, steps=20, seed=2)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 socket=daemon.socket, moment_dtype="bfloat16", offload=True,
                                 optimizer_mode="cpu")
    losses = _run(ours, opt, batches)
    assert losses[-1] < losses[0] - 0.3, losses
    master = opt.state_dict()["state"][0]["master_weight"]
    assert master.dtype == torch.float32
