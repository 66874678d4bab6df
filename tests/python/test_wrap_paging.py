"""Paging through wrap() (trainstream/memory/install.py: measure, plan, stream, adapt),
with the daemon's optimizer: paged training is bit-identical to unpaged training, and a
plan that cannot fit raises before anything is copied (docs/paging.md)."""
import pytest
import torch

import trainstream
from paging_helpers import STEPS, _pair
from tiny_gpt import GPTConfig, TinyGPT, corpus, text_batches
from trainstream.streaming.weights import RECOMPUTE


def _train(model, opt, batches, accumulation=1):
    losses = []
    for x, y in batches:
        for xm, ym in zip(x.chunk(accumulation), y.chunk(accumulation)):
            loss = model(xm, ym) / accumulation
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.parametrize("accumulation", [1, 2])
def test_wrap_everything_paged_matches_unpaged_bit_for_bit(daemon, accumulation):
    cfg, ref, ours = _pair(seed=1)
    steps = STEPS if accumulation == 1 else 4
    batches = text_batches(corpus(), cfg, batch=4, steps=steps, seed=1)
    ref, ref_opt = trainstream.wrap(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3),
                                    socket=daemon.socket, accumulation_steps=accumulation)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 socket=daemon.socket, accumulation_steps=accumulation,
                                 param_offload=True, activation_offload=True,
                                 min_offload_bytes=0, recompute=[1])
    session = ours._trainstream_session
    # A trained paged weight's home is its param slot in the session's shared memory.
    e = opt._table.entries[id(ours.blocks[0].mlp[0].weight)]
    assert ours.blocks[0].mlp[0].weight.data_ptr() == e.param_slot.data_ptr()
    ref_losses = _train(ref, ref_opt, batches, accumulation)
    our_losses = _train(ours, opt, batches, accumulation)
    assert ref_losses == our_losses
    assert our_losses[-1] < our_losses[0]
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(p, q), f"{name} differs after {steps} steps"
    report = trainstream.memory_report(ours)
    assert report["params"]["paged_blocks"] == [0, 1, 2, 3]
    assert report["params"]["bytes_h2d"] > 0
    assert report["activations"]["policy"][RECOMPUTE] == [1]
    assert report["activations"]["bytes_offloaded"] > 0
    assert report["plan"]["paged_blocks"] == [0, 1, 2, 3]
    assert any(ev["kind"] == "plan" for ev in report["events"])
    assert session.adapting is False
    trainstream.unwrap(ours)
    x, y = batches[0]
    assert torch.isfinite(ours(x, y)), "an unwrapped model still runs on its own copies"


def test_a_forward_that_raised_leaves_no_stale_prefetch(daemon):
    """A training forward prefetches the first paged blocks before block 0; if it raises
    before block 0 and the weights change, an evaluation forward used the old copies."""
    cfg, ref, ours = _pair(seed=2)
    ours, _ = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=1e-3),
                               socket=daemon.socket, param_offload=True, min_offload_bytes=0)
    (x, y), = text_batches(corpus(), cfg, batch=2, steps=1)
    with pytest.raises(IndexError):
        ours(x + cfg.vocab_size, y)  # out-of-range ids: raises in the embedding
    with torch.no_grad():
        for a, b in zip(ref.parameters(), ours.parameters()):
            a.mul_(1.5)
            b.mul_(1.5)  # a paged weight's host home
        assert ref(x, y).item() == ours(x, y).item()
    trainstream.unwrap(ours)


def test_paged_gradients_are_not_held_after_they_are_posted(daemon):
    # A paged weight's gradient goes to the daemon in backward; holding it until step()
    # kept every paged block's gradient on the device at once.
    cfg, _, ours = _pair(seed=1)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 socket=daemon.socket, param_offload=True, min_offload_bytes=0)
    (x, y), = text_batches(corpus(), cfg, batch=4, steps=1, seed=1)
    ours(x, y).backward()
    external = [e for e in opt._table.entries.values() if e.external]
    assert external, "paged weights hand their gradients over in backward"
    assert all(e.posted_step == 1 for e in external)
    held = [e.name for e in external if e.posted_grad is not None or e.external_grad is not None]
    assert not held, f"gradients still referenced after posting: {held}"
    opt.step()
    opt.zero_grad()


def test_paged_blocks_brought_back_in_train_exactly(daemon):
    # page_in between steps: the block's weights leave their host homes (a trained
    # weight's param slot) for the device, and training goes on bit for bit.
    cfg, ref, ours = _pair(seed=3)
    batches = text_batches(corpus(), cfg, batch=4, steps=6, seed=3)
    ref, ref_opt = trainstream.wrap(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3),
                                    socket=daemon.socket)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 socket=daemon.socket, param_offload=True, min_offload_bytes=0)
    pager = ours._trainstream_session.pager
    assert _train(ref, ref_opt, batches[:3]) == _train(ours, opt, batches[:3])
    weight = ours.blocks[3].mlp[0].weight
    slot = opt._table.entries[id(weight)].param_slot
    assert weight.data_ptr() == slot.data_ptr()
    cost = pager.page_in_cost(3)
    assert cost == 2 * sum(p.numel() * 4 for p in ours.blocks[3].parameters())
    assert pager.page_in(3) and pager.page_in(2) and not pager.page_in(3)
    assert pager.paged == [0, 1] and weight.data_ptr() != slot.data_ptr()
    assert torch.equal(weight, slot.view(weight.shape))
    # A view of a brought-in weight that autograd saves is a weight, not an activation.
    assert pager.offloader is not None and not pager.offloader.wants(weight.detach().t())
    assert _train(ref, ref_opt, batches[3:]) == _train(ours, opt, batches[3:])
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(p, q), f"{name} differs after bringing blocks 2 and 3 back in"
    assert trainstream.memory_report(ours)["params"]["paged_blocks"] == [0, 1]


def test_optimizer_reports_when_no_gradient_is_pending(daemon):
    # The adapter moves weight blocks only then (not between accumulated micro-batches).
    cfg, _, ours = _pair(seed=1)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 socket=daemon.socket, param_offload=True, min_offload_bytes=0,
                                 accumulation_steps=2)
    (x, y), = text_batches(corpus(), cfg, batch=4, steps=1, seed=1)
    assert opt.between_steps()
    ours(x[:2], y[:2]).backward()
    assert not opt.between_steps(), "one micro-batch of two has run"
    ours(x[2:], y[2:]).backward()
    opt.step()
    opt.zero_grad()
    assert opt.between_steps()


def test_declared_vram_limit_pages_some_blocks_and_stays_exact(daemon):
    cfg, ref, ours = _pair(seed=2, n_layer=6)
    block_bytes = sum(p.numel() * 4 for p in ours.blocks[0].parameters())
    outside = sum(p.numel() * 4 for n, p in ours.named_parameters() if not n.startswith("blocks"))
    # Room for the outside weights and gradients, paging, and about 3 resident blocks.
    limit = int((2 * outside + 4 * block_bytes + 3 * 2 * block_bytes) / 0.9 / 0.75) + 1
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=1e-3),
                                 socket=daemon.socket, vram_limit=limit, min_offload_bytes=0)
    plan = ours._trainstream_session.plan
    assert 0 < len(plan.paged) < 6, plan.decisions
    offloader = ours._trainstream_session.pager.offloader
    assert offloader.max_inflight_bytes == plan.max_inflight_bytes < 1 << 30
    assert plan.paged == list(range(len(plan.paged))), "the first blocks page"
    ref, ref_opt = trainstream.wrap(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3),
                                    socket=daemon.socket)
    batches = text_batches(corpus(), cfg, batch=2, steps=3, seed=2)
    assert _train(ref, ref_opt, batches) == _train(ours, opt, batches)


def test_vram_limit_too_small_raises_memory_error_with_numbers(daemon):
    _, _, model = _pair()
    with pytest.raises(MemoryError) as info:
        trainstream.wrap(model, socket=daemon.socket, vram_limit=64 << 10, min_offload_bytes=0)
    msg = str(info.value)
    for fragment in ("does not fit", "needs", "usable", "weights outside the blocks",
                     "paged weights in flight", "vram_limit"):
        assert fragment in msg, msg
    assert daemon.status()["sessions"] == [], "nothing attached when the plan fails"


def test_env_vram_limit(monkeypatch):
    from trainstream.options import validate
    monkeypatch.setenv("TRAINSTREAM_VRAM_LIMIT", "24GiB")
    assert validate({})["vram_limit"] == 24 << 30
    assert validate({"vram_limit": "1G"})["vram_limit"] == 1 << 30
    monkeypatch.setenv("TRAINSTREAM_VRAM_LIMIT", "lots")
    with pytest.raises(ValueError, match="TRAINSTREAM_VRAM_LIMIT"):
        validate({})


def test_meta_model_that_cannot_fit_raises_memory_error_at_wrap(daemon):
    """A 72B-shaped full fine-tune, built on the meta device: refused at wrap() with the
    numbers, before a byte is allocated."""
    transformers = pytest.importorskip("transformers", reason="builds a Qwen2 shape from its config")
    cfg = transformers.Qwen2Config(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8, vocab_size=152064)
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    with pytest.raises(MemoryError) as info:
        trainstream.wrap(model, socket=daemon.socket, device="cpu", vram_limit="24GiB",
                         moment_dtype="auto")
    msg = str(info.value)
    assert "host memory does not fit" in msg and "daemon masters" in msg, msg
    # Bytes per trained parameter, by category, adding up to the total.
    import re
    total = float(re.search(r"= ([0-9.]+) B per trained parameter", msg).group(1))
    parts = [float(x) for x in re.findall(r"= ([0-9.]+) B/param", msg)]
    # bf16 weights: the master's low halves (Note [One host copy of a trained weight]).
    assert re.search(r"daemon masters beyond the weight slots [0-9.]+ GiB = 2.00 B/param", msg), msg
    assert len(parts) >= 3 and abs(sum(parts) - total) < 0.01 * len(parts), msg


@pytest.mark.parametrize("options, fragment", [
    ({"param_offload": 1.5}, "param_offload"),
    ({"param_offload": [-1]}, "param_offload"),
    ({"activation_offload": [0]}, "activation_offload"),
    ({"recompute": "sometimes"}, "recompute"),
    ({"attention": "fast"}, "attention"),
    ({"vram_limit": "abc"}, "vram_limit"),
    ({"vram_headroom": 0.95}, "vram_headroom"),
    ({"quantize": "int4"}, "quantize"),
    ({"prefer": "fast"}, "prefer"),
    ({"max_activation_slowdown": -0.1}, "max_activation_slowdown"),
    ({"max_inflight_bytes": 0}, "max_inflight_bytes"),
])
def test_bad_paging_options_raise_value_error(options, fragment):
    with pytest.raises(ValueError, match=f"option {fragment}=.*accepted"):
        trainstream.wrap(TinyGPT(GPTConfig()), **options)
