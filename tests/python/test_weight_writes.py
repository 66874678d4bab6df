"""Weights changed from outside the optimizer after wrap(): Note [Weights written from
outside the engine] (daemon/optimizer/include/trainstream/optimizer/adamw_engine.h) and
docs/adamw.md, "Writing weights after wrap()".

The reference is plain PyTorch with fp32 masters, as mixed-precision training keeps them
(``Fp32MasterAdamW`` below): ``torch.optim.AdamW`` updates an fp32 copy of each weight and
the weight is that copy rounded to its dtype. A weight written in place (``load_state_dict``,
``copy_``, ``torch.nn.init``, ``mul_`` under ``no_grad``) becomes its master's value: each
element whose value differs from its master's rounding takes the written value as master,
the others keep theirs. Gradients are fed from a recorded list, so the comparison with
torch sees the optimizer alone (no forward pass amplifying one ulp)."""
import copy

import pytest
import torch

import trainstream
from fixtures.make_state_dict_v2 import gradients
from fixtures.make_state_dict_v2 import train as feed  # steps on recorded gradients
from tiny_gpt import GPTConfig, TinyGPT, corpus, text_batches

CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
LR = 3e-3
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# paged: the blocks' weights live in their param slots (weight paging), the embeddings
# stay resident; resident: every weight is the model's own tensor.
LAYOUTS = [pytest.param(False, id="resident"), pytest.param(True, id="paged")]


def _model(dtype, seed=0):
    torch.manual_seed(seed)
    return TinyGPT(CFG).to(dtype)


def _wrap(model, daemon, paged, **options):
    if paged:
        options.update(param_offload=True, min_offload_bytes=0)
    return trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=LR),
                            socket=daemon.socket, **options)


def _bits(t):
    t = t.detach().contiguous()
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _masters(opt):
    return [s["master_weight"].clone() for _, s in sorted(opt.state_dict()["state"].items())]


def _is_paged(opt, p):
    e = opt._table.entries[id(p)]
    return p.data_ptr() == e.param_slot.data_ptr()


class Fp32MasterAdamW:
    """torch.optim.AdamW over fp32 masters of ``params``; ``adopt()`` takes weights
    written since the last step as the masters' new values, element by element."""

    def __init__(self, params):
        self.params = list(params)
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=LR, foreach=False)

    def step(self, grads):
        for m, g in zip(self.masters, grads):
            m.grad = g.float()
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def adopt(self, whole):
        """``whole[i]``: weight i takes its whole tensor as master (a paged bf16 weight's
        case in the daemon, whose old value is gone once written)."""
        with torch.no_grad():
            for p, m, all_of_it in zip(self.params, self.masters, whole):
                changed = torch.ones_like(p, dtype=torch.bool) if all_of_it \
                    else p != m.to(p.dtype)
                m[changed] = p.float()[changed]


def _write(how, model, source):
    """Changes ``model``'s weights in place, as a user would; ``source`` is a model of
    the same shape whose weights some writes take."""
    with torch.no_grad():
        if how == "load_state_dict":
            model.load_state_dict(source.state_dict())
        elif how == "copy_":
            for p, q in zip(model.parameters(), source.parameters()):
                p.copy_(q)
        elif how == "init":
            torch.manual_seed(7)
            for p in model.parameters():
                torch.nn.init.normal_(p, std=0.02) if p.dim() >= 2 else torch.nn.init.zeros_(p)
        elif how == "mul_":
            for p in model.parameters():
                p.mul_(0.5)


def _expected_masters(before, model, paged_flags):
    """What the daemon's masters are after a write: the written weight where its element
    changed, else the master it had; a paged bf16 weight (its slot is the weight itself,
    the old value is gone) takes the whole written tensor."""
    out = []
    for m, p, paged in zip(before, model.parameters(), paged_flags):
        w = p.detach().cpu().reshape(m.shape)
        if paged or p.dtype == torch.float32:
            out.append(w.float())
        else:
            out.append(torch.where(w != m.to(p.dtype), w.float(), m))
    return out


@pytest.mark.parametrize("paged", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("how", ["load_state_dict", "copy_", "init", "mul_"])
def test_a_written_weight_becomes_its_master_as_with_torch(daemon, how, dtype, paged):
    ours = _model(dtype)
    source = _model(dtype, seed=5)
    plain = copy.deepcopy(ours)
    ref = Fp32MasterAdamW(plain.parameters())
    ours, opt = _wrap(ours, daemon, paged)
    flags = [_is_paged(opt, p) for p in ours.parameters()]
    assert any(flags) == paged
    grads = gradients(ours, 1, 6)
    feed(ours, opt, grads[:3])
    for g in grads[:3]:
        ref.step(g)
    before = _masters(opt)
    _write(how, ours, source)
    _write(how, plain, source)
    ref.adopt([f and dtype != torch.float32 for f in flags])
    # A checkpoint taken right after the write holds it, bit for bit.
    for got, want in zip(_masters(opt), _expected_masters(before, ours, flags)):
        assert torch.equal(_bits(got), _bits(want))
    feed(ours, opt, grads[3:])
    for g in grads[3:]:
        ref.step(g)
    for (name, p), m, rm in zip(ours.named_parameters(), _masters(opt), ref.masters):
        torch.testing.assert_close(m, rm.detach(), rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(_bits(p), _bits(m.to(dtype))), name
    trainstream.unwrap(ours)


def _train(model, opt, batches):
    for x, y in batches:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()


def _snapshot(model, opt):
    return copy.deepcopy(opt.state_dict()), {k: v.clone() for k, v in model.state_dict().items()}


def _assert_state_equal(got, want):
    assert set(got["state"]) == set(want["state"])
    for idx, w in want["state"].items():
        for key in ("master_weight", "exp_avg", "exp_avg_sq"):
            assert torch.equal(_bits(got["state"][idx][key]), _bits(w[key])), (idx, key)
        assert float(got["state"][idx]["step"]) == float(w["step"])


def _assert_weights_equal(model, weights):
    for name, w in model.state_dict().items():
        assert torch.equal(_bits(w), _bits(weights[name])), name


ORDERS = ["optimizer", "model, then optimizer", "optimizer, then model"]


@pytest.mark.parametrize("paged", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("order", ORDERS)
def test_loading_a_state_dict_into_a_session_that_trained_on(daemon, order, dtype, paged):
    """Train 5 steps, save, train 5 more, load: the weights and masters are the saved
    ones bit for bit, and 5 more steps give what the uninterrupted run gave. (Moments in
    the weights' dtype, as a torch state dict holds them: fp32 moments of a bf16 weight
    would come back rounded, and training from them would differ.)"""
    moments = "bfloat16" if dtype == torch.bfloat16 else "float32"
    model, opt = _wrap(_model(dtype), daemon, paged, moment_dtype=moments)
    batches = text_batches(corpus(), CFG, batch=2, steps=10, seed=3)
    _train(model, opt, batches[:5])
    saved_opt, saved_model = _snapshot(model, opt)
    for idx, s in saved_opt["state"].items():  # the weights are the masters' rounding
        w = list(model.parameters())[idx]
        assert torch.equal(_bits(w), _bits(s["master_weight"].to(dtype)))
    _train(model, opt, batches[5:])
    after_opt, after_model = _snapshot(model, opt)
    if order.startswith("model"):
        model.load_state_dict(saved_model)
    opt.load_state_dict(copy.deepcopy(saved_opt))
    if order.endswith("model"):
        model.load_state_dict(saved_model)
    _assert_weights_equal(model, saved_model)
    got = opt.state_dict()
    if paged and dtype == torch.bfloat16 and order.endswith("model"):
        # A paged bf16 weight written after its master was loaded (its slot is the
        # weight) takes the written tensor whole: its master is that weight, low halves
        # gone (docs/adamw.md); a resident one compares and keeps its saved master.
        params = list(model.parameters())
        for idx, s in saved_opt["state"].items():
            want = params[idx].detach().float() if _is_paged(opt, params[idx]) \
                else s["master_weight"]
            assert torch.equal(_bits(got["state"][idx]["master_weight"]), _bits(want)), idx
        trainstream.unwrap(model)
        return
    _assert_state_equal(got, saved_opt)
    _train(model, opt, batches[5:])
    _assert_weights_equal(model, after_model)
    _assert_state_equal(opt.state_dict(), after_opt)
    trainstream.unwrap(model)


@pytest.mark.parametrize("paged", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_write_through_data_is_taken_by_sync_weights_from_model(daemon, dtype, paged):
    """``.data`` bypasses the version counter: nothing sees the write until
    ``sync_weights_from_model()``, which takes it as a counted write is taken."""
    model, opt = _wrap(_model(dtype), daemon, paged)
    flags = [_is_paged(opt, p) for p in model.parameters()]
    grads = gradients(model, 1, 4)
    feed(model, opt, grads[:3])
    before = _masters(opt)
    torch.manual_seed(9)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape).to(dtype))
    opt.sync_weights_from_model()
    want = _expected_masters(before, model, flags)
    for got, w in zip(_masters(opt), want):
        assert torch.equal(_bits(got), _bits(w))
    assert opt.stats()["weights_adopted"] == len(flags)
    # Only the parameters named are taken.
    first = next(model.parameters())
    first.data.mul_(2)
    opt.sync_weights_from_model([first])
    assert torch.equal(_bits(_masters(opt)[0]), _bits(first.detach().float()))
    trainstream.unwrap(model)


def test_sync_weights_from_model_refuses_a_stranger_and_a_step_half_done(daemon):
    model, opt = _wrap(_model(torch.bfloat16), daemon, False)
    with pytest.raises(ValueError, match=r"shape \(3,\) is not a parameter of this optimizer"):
        opt.sync_weights_from_model([torch.zeros(3)])
    x, y = text_batches(corpus(), CFG, batch=2, steps=1)[0]
    model(x, y).backward()
    with pytest.raises(RuntimeError, match="between backward and step"):
        opt.sync_weights_from_model()
    opt.step()
    opt.zero_grad()
    opt.sync_weights_from_model()
    trainstream.unwrap(model)


@pytest.mark.parametrize("paged", LAYOUTS)
def test_a_weight_written_after_backward_handed_its_gradient_over_raises(daemon, paged):
    """grad_post='backward': a weight's update starts once its gradient is final, so a
    write between backward and step() cannot be its starting point: step() says so,
    zero_grad() ends the step, and training goes on with the write taken."""
    model, opt = _wrap(_model(torch.bfloat16), daemon, paged)
    batches = text_batches(corpus(), CFG, batch=2, steps=3, seed=4)
    _train(model, opt, batches[:1])
    x, y = batches[1]
    model(x, y).backward()
    w = model.blocks[0].mlp[0].weight
    with torch.no_grad():
        w.mul_(0.5)
    with pytest.raises(RuntimeError, match="blocks.0.mlp.0.weight was written after backward"):
        opt.step()
    opt.zero_grad()
    with torch.no_grad():
        torch.nn.init.zeros_(w)
    _train(model, opt, batches[2:])
    master = _masters(opt)[[n for n, _ in model.named_parameters()].index("blocks.0.mlp.0.weight")]
    assert torch.isfinite(master).all()
    assert master.abs().max() <= 1.01 * LR  # one step from zero (torch: |update| <= lr)
    trainstream.unwrap(model)


cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU (run scripts/gpu-check.sh on the GPU host)")


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("how", ["load_state_dict", "init", "mul_", "data"])
def test_gpu_mode_takes_a_written_weight_as_its_master(daemon, how, dtype):
    """optimizer_mode='gpu' (Note [The gpu mode takes written weights], zero_copy.py):
    the same element-by-element rule, against the same torch reference."""
    ours = _model(dtype).cuda()
    source = _model(dtype, seed=5).cuda()
    plain = copy.deepcopy(ours)
    ref = Fp32MasterAdamW(plain.parameters())
    # offload=True: with "auto" a model this small moves to torch's AdamW on the GPU after
    # its second step (OffloadAdamW._after_step), and that state has no fp32 masters.
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=LR),
                                 socket=daemon.socket, optimizer_mode="gpu", offload=True)
    grads = [[g.cuda() for g in step] for step in gradients(ours, 1, 6)]
    feed(ours, opt, grads[:3])
    assert opt.optimizer_mode == "gpu"
    for g in grads[:3]:
        ref.step(g)
    before = _masters(opt)
    if how == "data":
        for p, q in zip(ours.parameters(), source.parameters()):
            p.data.copy_(q)
        opt.sync_weights_from_model()
        how = "copy_"
    else:
        _write(how, ours, source)
    _write(how, plain, source)
    ref.adopt([False] * len(ref.params))
    for got, want in zip(_masters(opt), _expected_masters(before, ours, [False] * len(before))):
        assert torch.equal(_bits(got), _bits(want.cpu()))
    feed(ours, opt, grads[3:])
    for g in grads[3:]:
        ref.step(g)
    for (name, p), m, rm in zip(ours.named_parameters(), _masters(opt), ref.masters):
        torch.testing.assert_close(m, rm.detach().cpu(), rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(_bits(p.cpu()), _bits(m.to(dtype))), name
    trainstream.unwrap(ours)


def test_weights_of_the_wrong_size_or_outside_the_session_are_refused(daemon):
    """StateField::kWeights checks what a client names (docs/design.md, "Trust boundary"):
    a payload that is not the parameter's size, or a region the session does not have,
    is answered with an error naming it, and nothing changes."""
    from trainstream._native.wire import FIELD_WEIGHTS  # noqa: PLC0415
    from trainstream.errors import TrainStreamError  # noqa: PLC0415
    model, opt = _wrap(_model(torch.bfloat16), daemon, False)
    feed(model, opt, gradients(model, 1, 1))
    before = _masters(opt)
    session = opt._session
    e = opt._table.entries[id(next(model.parameters()))]
    region = session.scratch_region(e.param.numel())
    plane = session.plane
    plane.post_state(True, e.param_id, FIELD_WEIGHTS, region.region_id, 0, 2 * e.param.numel() + 2,
                     0)
    with pytest.raises(TrainStreamError, match="needs"):
        session.sync()
    plane.post_state(True, e.param_id, FIELD_WEIGHTS, region.region_id + 1000, 0,
                     2 * e.param.numel(), 0)
    with pytest.raises(TrainStreamError, match="not a region of this session"):
        session.sync()
    for got, want in zip(_masters(opt), before):
        assert torch.equal(_bits(got), _bits(want))
    feed(model, opt, gradients(model, 2, 1))
    trainstream.unwrap(model)
