"""attention= (trainstream/streaming/attention.py): which SDPA backend the blocks run,
following the determinism flags."""
import torch
import torch.nn.functional as F

import trainstream
from paging_helpers import _pair
from tiny_gpt import corpus, text_batches
from trainstream.streaming.attention import AttentionSelector, allowed_backends


def test_allowed_backends_follow_determinism():
    assert allowed_backends(False, False) == ["cudnn", "flash", "efficient", "math"]
    assert allowed_backends(True, False) == ["efficient", "math"]
    assert allowed_backends(True, True) == ["math"]


def test_attention_choice_is_reread_each_time():
    events = []
    sel = AttentionSelector("flash", torch.device("cpu"), lambda *a, **k: events.append(k))
    assert sel.order[0] == "flash"
    try:
        torch.use_deterministic_algorithms(True)
        sel.refresh()
        assert sel.order == ["math"], "flash is left out; math remains"
        torch.use_deterministic_algorithms(True, warn_only=True)
        sel.refresh()
        assert sel.order == ["math"]
    finally:
        torch.use_deterministic_algorithms(False)
    sel.refresh()
    assert sel.order[0] == "flash"
    assert any("not deterministic" in str(e.get("why", "")) for e in events)


def test_attention_math_backend_applies_inside_blocks(daemon):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    cfg, ref, ours = _pair(seed=3)
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1)
    with sdpa_kernel([SDPBackend.MATH]):
        want = ref(x, y)
    ours, _ = trainstream.wrap(ours, socket=daemon.socket, attention="math")
    calls = []
    orig = F.scaled_dot_product_attention

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is orig:
                calls.append(torch._C._get_math_sdp_enabled()
                             and not torch._C._get_flash_sdp_enabled())
            return func(*args, **(kwargs or {}))
    with Spy():
        got = ours(x, y)
    assert calls and all(calls), "every attention call runs with only the math backend"
    assert torch.equal(want, got)
    assert trainstream.memory_report(ours)["attention"]["order"][0] == "math"
