"""Shared by the paging tests (test_weight_paging.py, test_activation_offload.py,
test_wrap_paging.py, test_memory_controller.py, test_attention.py, test_planner.py)."""
import copy

import torch

from tiny_gpt import GPTConfig, TinyGPT

STEPS = 10


def _pair(seed=0, n_layer=4):
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=n_layer)
    ref = TinyGPT(cfg)
    return cfg, ref, copy.deepcopy(ref)


def _assert_grads_equal(ref, ours, step):
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        assert (a.grad is None) == (b.grad is None), f"step {step}: {name}"
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), f"step {step}: gradient of {name} differs"


def _config(**kw):
    from trainstream.options import validate
    return validate(kw)
