"""The memory controller (trainstream/memory/controller.py): measured peaks move blocks
between keeping, paging and recomputing their activations, and weight blocks between
residence and paging; the recompute trial."""
import pytest
import torch

from paging_helpers import _config, _pair
from tiny_gpt import GPTConfig, corpus, text_batches
from trainstream.memory import planner
from trainstream.streaming.weights import KEEP, OFFLOAD, RECOMPUTE, BlockPager


class _Session:
    def __init__(self):
        self.adapting = True
        self.events = []

    def event(self, kind, **details):
        self.events.append(dict(details, kind=kind))


def _adapter(n=8, usable=2000 << 20):
    from trainstream.memory.controller import MemoryController
    _, _, ours = _pair(n_layer=n)
    pager = BlockPager(list(ours.blocks), "cpu")
    plan = planner.Plan(paged=[], moment_dtype="float32", quantize=None,
                        activation_offload="auto", recompute=False, usable_vram=usable)
    session = _Session()
    config = _config(activation_offload="auto", recompute=False, max_activation_slowdown=0.15)
    adapter = MemoryController(session, pager, plan, config, h2d_gb_s=0.0)
    for i in range(n):  # what calibration does on a CUDA device
        pager.set_policy(i, OFFLOAD)
    return adapter, pager, session


def test_adapter_moves_blocks_back_in_when_measured_room_allows():
    MiB = 1 << 20
    adapter, pager, session = _adapter()
    steps = [(1400, 8 * 100), (1500, 0), (1700, 0), (1800, 0), (1800, 0)]
    for step, (peak, offloaded) in enumerate(steps):
        adapter.step = step
        adapter._decide(peak * MiB, 1.0, offloaded * MiB)
        if step == 0:  # 600 MiB of room at 100 MiB a block: the last 5 keep theirs
            assert pager.policy == [OFFLOAD] * 3 + [KEEP] * 5
        if step == 1:  # 500 MiB of room, half of it spent: 2 more blocks keep
            assert pager.policy == [OFFLOAD] + [KEEP] * 7
    assert pager.policy == [KEEP] * 8
    loosened = [e for e in session.events if e.get("what") == "loosen"]
    assert len(loosened) == 2 and "offload -> keep" in loosened[0]["moved"]
    assert adapter.settled and not session.adapting


def _weight_adapter():
    """An adapter over 8 blocks whose weights all page and whose activations are kept
    (param_offload="auto"): what loosening does once no block pages activations."""
    adapter, _, session = _adapter()
    _, _, model = _pair(n_layer=8)
    pager = BlockPager(list(model.blocks), "cpu", paged=range(8), min_paged_bytes=0)
    adapter.pager = pager
    adapter.config["param_offload"] = "auto"
    for i in range(8):
        pager.set_policy(i, KEEP)
    return adapter, pager, session, model


def test_adapter_brings_paged_weight_blocks_back_when_no_block_pages_activations():
    MiB = 1 << 20
    adapter, pager, session, _ = _weight_adapter()
    cost = pager.page_in_cost(7)
    assert cost > 0
    adapter.step = 1
    # Room for 2.5 blocks at LOOSEN_SHARE 0.5: the last 2 paged blocks come back.
    peak = 2000 * MiB - int(5 * cost)
    adapter._decide(peak, 1.0, 0)
    assert pager.paged == [0, 1, 2, 3, 4, 5]
    loosen = [e for e in session.events if e.get("what") == "loosen"]
    assert loosen and "weights: paged -> resident" in loosen[0]["moved"], loosen
    adapter.between_steps = lambda: False     # between accumulated micro-batches
    adapter.step = 2
    adapter._decide(peak, 1.0, 0)
    assert pager.paged == [0, 1, 2, 3, 4, 5], "weights move only between steps"
    adapter.between_steps = lambda: True
    adapter.config["param_offload"] = True   # an explicit choice is left alone
    adapter.step = 3
    adapter._decide(peak, 1.0, 0)
    assert pager.paged == [0, 1, 2, 3, 4, 5]


def test_adapter_moves_no_weight_block_while_a_graph_holds_paged_weights():
    """A second micro-batch's forward before the first one's backward: no gradient is
    pending yet, but the first graph will look for its blocks where they were (a block
    brought in then made that backward fail with KeyError)."""
    MiB = 1 << 20
    adapter, pager, session, model = _weight_adapter()
    (x, y), = text_batches(corpus(), GPTConfig(n_layer=8), batch=2, steps=1)
    loss = model(x, y)
    adapter.step = 1
    adapter._decide(2000 * MiB - int(5 * pager.page_in_cost(7)), 1.0, 0)
    assert pager.paged == list(range(8)), "nothing moves while the graph is live"
    loss.backward()
    adapter.step = 2
    adapter._decide(2000 * MiB - int(5 * pager.page_in_cost(7)), 1.0, 0)
    assert pager.paged == [0, 1, 2, 3, 4, 5]


def _settle_steps(adapter, peak_mib):
    """Calibration (1800 MiB peak, 100 MiB of activations a block), then two steps at
    ``peak_mib``, each recorded in the history first, as on_forward does."""
    MiB = 1 << 20
    for step, (peak, offloaded) in enumerate([(1800, 800), (peak_mib, 0), (peak_mib, 0)]):
        adapter.step = step
        adapter.history.append({"seconds": 1.0})
        adapter._decide(peak * MiB, 1.0, offloaded * MiB)


def _trial_adapter():
    adapter, pager, session = _adapter()
    adapter.config["recompute"] = "auto"
    return adapter, pager, session


@pytest.mark.parametrize("recompute_s, chosen", [(0.8, RECOMPUTE), (0.99, OFFLOAD),
                                                 (1.3, OFFLOAD)])
def test_adapter_tries_recompute_for_paging_blocks_and_keeps_the_faster(recompute_s, chosen):
    MiB = 1 << 20
    adapter, pager, session = _trial_adapter()
    # Calibration leaves 200 MiB of room at 100 MiB a block: the last 1 keeps (0.9 x room).
    # (on_forward records each step in the history, then decides.)
    steps = [(1800, 5.0, 800), (1890, 1.0, 0), (1890, 1.0, 0)]
    for step, (peak, seconds, offloaded) in enumerate(steps):
        adapter.step = step
        adapter.history.append({"seconds": seconds})
        adapter._decide(peak * MiB, seconds, offloaded * MiB)
    trial = [e for e in session.events if e.get("what") == "trial"]
    assert trial and pager.policy == [RECOMPUTE] * 7 + [KEEP], session.events[-1]
    for step in (3, 4):
        adapter.step = step
        adapter.history.append({"seconds": recompute_s})
        adapter._decide(1500 * MiB, recompute_s, 0)
    result = [e for e in session.events if e.get("what") == "trial result"]
    assert len(result) == 1 and result[0]["chosen"] == chosen, result
    assert result[0]["recompute_s"] == [recompute_s] * 2 and result[0]["offload_s"] == 1.0
    assert pager.policy == [chosen] * 7 + [KEEP]
    for step in (5, 6):
        adapter.step = step
        adapter.history.append({"seconds": 1.0})
        adapter._decide(1950 * MiB, 1.0, 0)
    assert adapter.settled and not session.adapting
    assert len([e for e in session.events if e.get("what") == "trial"]) == 1, "one trial"


def test_recompute_trial_that_goes_over_restores_paging():
    MiB = 1 << 20
    adapter, pager, session = _trial_adapter()
    _settle_steps(adapter, 1890)
    assert pager.policy == [RECOMPUTE] * 7 + [KEEP]
    adapter.step = 3
    adapter._decide(2100 * MiB, 0.5, 0)         # over the usable 2000 MiB, and faster
    result = [e for e in session.events if e.get("what") == "trial result"]
    assert result and result[0]["chosen"] == OFFLOAD
    # The paging plan, which fitted, comes back as it was: no tightening, and loosening
    # is still allowed.
    assert pager.policy == [OFFLOAD] * 7 + [KEEP]
    assert not [e for e in session.events if e.get("what") == "tighten"]
    assert not adapter.went_over and not adapter.settled


def test_no_recompute_trial_without_room_for_one_blocks_activations():
    # Recompute brings a block's activations (100 MiB here) back at once in backward;
    # with 50 MiB of room a trial step could run out of memory, ending the training.
    adapter, pager, session = _trial_adapter()
    _settle_steps(adapter, 1950)
    assert pager.policy == [OFFLOAD] * 7 + [KEEP] and adapter.settled
    skipped = [e for e in session.events if e.get("what") == "no trial"]
    assert skipped and "one block's activations" in skipped[0]["why"], session.events
    assert not [e for e in session.events if e.get("what") == "trial"]


def test_no_recompute_trial_unless_recompute_is_auto():
    adapter, pager, session = _adapter()         # recompute=False
    _settle_steps(adapter, 1950)
    assert RECOMPUTE not in pager.policy and adapter.settled


def test_settled_adapter_does_not_synchronize_the_device(monkeypatch):
    # Adapting, each step is timed (a device sync); settled, only the peak is read.
    MiB = 1 << 20
    adapter, pager, session = _adapter()
    adapter.measure = True
    calls = {"sync": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.__setitem__(
        "sync", calls["sync"] + 1))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 1500 * MiB)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    for _ in range(6):
        adapter.on_forward(None, ())
    assert adapter.settled and calls["sync"] > 0
    before = calls["sync"]
    adapter.on_forward(None, ())
    adapter.on_forward(None, ())
    assert calls["sync"] == before, "a settled step must not wait for the device"
    assert adapter.history[-1]["seconds"] is None and adapter.history[-1]["peak"] == 1500 * MiB
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 2100 * MiB)
    adapter.on_forward(None, ())                 # the watchdog still sees a step going over
    assert not adapter.settled and session.adapting
    assert [e for e in session.events if e.get("what") == "tighten"]


def test_adapter_does_not_move_blocks_back_in_after_a_step_went_over():
    MiB = 1 << 20
    adapter, pager, session = _adapter()
    adapter._decide(1400 * MiB, 1.0, 800 * MiB)
    adapter.step = 1
    adapter._decide(2100 * MiB, 1.0, 0)          # over: a kept block pages again
    assert pager.policy == [OFFLOAD] * 4 + [KEEP] * 4
    for step in (2, 3):
        adapter.step = step
        adapter._decide(1000 * MiB, 1.0, 0)      # room, but no more loosening
    assert pager.policy == [OFFLOAD] * 4 + [KEEP] * 4
    assert not [e for e in session.events if e.get("what") == "loosen"]
    assert adapter.settled


# ---------------------------------------------------------------- offload="auto"
class _FakeCudaParam:
    """What decide_offload reads of a parameter, on a CUDA device this machine lacks."""
    device = torch.device("cuda", 0)
    requires_grad = True

    def __init__(self, numel):
        self._numel = numel

    def numel(self):
        return self._numel

    def element_size(self):
        return 2


def _fake_device(monkeypatch, total, peak):
    class Props:
        total_memory = total
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (total, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: peak)


def test_going_local_keeps_vram_headroom_free(monkeypatch):
    """offload="auto"'s decision (decide_offload, optim/local.py) needs the second step's
    peak plus torch's two moments to fit in the capacity less vram_headroom (it hard-coded 0.10,
    the option's default)."""
    from trainstream.optim.local import decide_offload
    from trainstream.options import default
    _fake_device(monkeypatch, total=1000 << 20, peak=700 << 20)
    params = [_FakeCudaParam(50 << 20)]  # bf16: 2 x 100 MiB of moments
    fits = decide_offload(params, data_parallel=False, extra_grads=False,
                          headroom=default("vram_headroom"))
    assert default("vram_headroom") == 0.10
    assert fits["offload"] is False and fits["headroom"] == 0.10
    assert fits["needed_bytes"] == 900 << 20 and fits["capacity_bytes"] == 1000 << 20
    tight = decide_offload(params, data_parallel=False, extra_grads=False, headroom=0.2)
    assert tight["offload"] is True and "keeps offloading" in tight["reason"]
    grads = decide_offload(params, data_parallel=False, extra_grads=True, headroom=0.10)
    assert grads["offload"] is True and grads["extra_grad_bytes"] == 100 << 20
    dp = decide_offload(params, data_parallel=True, extra_grads=False, headroom=0.10)
    assert dp["offload"] is True and "data parallel" in dp["reason"]


def test_a_step_whose_peak_counter_was_reset_outside_decides_nothing(monkeypatch):
    """Note [A peak counter reset by someone else]: a peak below what the forward left
    allocated means someone reset CUDA's counter mid-step; that step must not loosen
    the plan (on the H200 such a step led to an out-of-memory backward)."""
    MiB = 1 << 20
    adapter, pager, session = _adapter()
    adapter.measure = True
    counters = {"peak": 1400 * MiB, "allocated": 1300 * MiB}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: counters["peak"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    paged = {"bytes": 0}  # the offloader's running total: 800 MiB more per step
    monkeypatch.setattr(adapter, "_offloaded", lambda: paged["bytes"])

    def step():  # the blocks page their activations during the forward
        adapter.on_forward(None, ())
        paged["bytes"] += 8 * 100 * MiB
        adapter.on_forward_end()
    step()
    step()  # calibration: 600 MiB of room at 100 MiB a block, the last 5 keep
    assert pager.policy == [OFFLOAD] * 3 + [KEEP] * 5
    counters["peak"] = 200 * MiB  # reset outside after the forward: nearly empty
    step()
    assert pager.policy == [OFFLOAD] * 3 + [KEEP] * 5, "an unmeasured step moved blocks"
    skipped = [e for e in session.events if e.get("what") == "not measured"]
    assert len(skipped) == 1 and "reset_peak_memory_stats" in skipped[0]["why"]
    assert not adapter.settled
    counters["peak"] = 1500 * MiB  # a real reading again: loosening goes on
    step()
    assert pager.policy.count(KEEP) > 5
