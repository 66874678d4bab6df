"""Note [One host copy of a trained weight] (proto/include/trainstream/wire/segment_header.h):
an fp32 weight slot is its own master and a bf16 one its master's high half,
so the daemon's state segments hold 4 and 2 bytes a parameter less than they did.

A state_dict saved by the daemon that kept a whole fp32 master per parameter in its
state segment loads into this one, and training goes on bit for bit as it went on
there. The fixture was written by that daemon (fixtures/make_state_dict_v2.py says
how): the state after 3 steps, and what that daemon made of it: the state_dict it gave
right after loading it, the gradients of 3 more steps and the state after them."""
from pathlib import Path

import pytest
import torch

import trainstream
from fixtures.make_state_dict_v2 import CFG, param_groups, train
from tiny_gpt import TinyGPT

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "state_dict_v2.pt"
NUMEL = 1 << 20


def _state_segment_bytes(daemon, dtype: torch.dtype) -> int:
    """The size the daemon reports for the state segment of one registered parameter
    of NUMEL elements in ``dtype`` (fp32 moments)."""
    w = torch.nn.Parameter(torch.randn(NUMEL).to(dtype))
    opt = trainstream.OffloadAdamW([w], socket=daemon.socket, moment_dtype="float32")
    (state,) = [s for s in daemon.status()["segments"] if s["kind"] == "state"]
    opt.detach()
    return state["bytes"]


def test_the_state_segment_holds_no_second_copy_of_a_weight(daemon):
    fp32, bf16, fp16 = (_state_segment_bytes(daemon, d)
                        for d in (torch.float32, torch.bfloat16, torch.float16))
    # Everything but the state arrays (header, manifest, recovery records, journals) is
    # the same for the three; the arrays are the moments (8 B a parameter) and the
    # master beyond the weight slot: none for fp32, 2 B for bf16, 4 B for fp16 (before,
    # 4 B for every dtype).
    assert bf16 - fp32 == 2 * NUMEL
    assert fp16 - fp32 == 4 * NUMEL
    assert 8 * NUMEL < fp32 < 8 * NUMEL + (1 << 20)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def _assert_same_state(ours: dict, want: dict) -> None:
    assert ours["param_groups"] == want["param_groups"]
    assert set(ours["state"]) == set(want["state"])
    for idx, w in want["state"].items():
        o = ours["state"][idx]
        assert set(o) == set(w), idx
        assert float(o["step"]) == float(w["step"])
        assert o["master_weight"].dtype == torch.float32
        for key in ("master_weight", "exp_avg", "exp_avg_sq"):
            assert o[key].dtype == w[key].dtype, (idx, key)
            assert torch.equal(_bits(o[key]), _bits(w[key])), f"param {idx} {key} differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_state_dict_with_fp32_masters_loads_and_trains_on_bit_identically(daemon, dtype):
    rec = torch.load(FIXTURE)[str(dtype).removeprefix("torch.")]
    model = TinyGPT(CFG).to(dtype)
    model.load_state_dict(rec["saved"]["model"])
    model, opt = trainstream.wrap(model, torch.optim.AdamW(param_groups(model), lr=3e-3),
                                  socket=daemon.socket, grad_post="step")
    opt.load_state_dict(rec["saved"]["optimizer"])
    # The masters come back as they were saved, bit for bit (a bf16 one decoded from
    # its two halves): as that daemon gave them back.
    loaded = opt.state_dict()
    _assert_same_state(loaded, rec["after"]["loaded"])
    for idx, w in rec["saved"]["optimizer"]["state"].items():
        assert torch.equal(_bits(loaded["state"][idx]["master_weight"]), _bits(w["master_weight"]))
    train(model, opt, rec["grads"])
    _assert_same_state(opt.state_dict(), rec["after"]["optimizer"])
    for name, want in rec["after"]["model"].items():
        assert torch.equal(_bits(model.state_dict()[name]), _bits(want)), name
