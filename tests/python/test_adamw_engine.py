"""The multi-threaded AdamWEngine (daemon/optimizer) against torch.optim.AdamW:
eager and deferred modes, clipping, non-finite gradients, state export/import."""
import pytest
import torch

from test_adamw import (SIZES, STEPS, assert_close, hyper, make_grads, make_params,
                        torch_reference)

# The test-only extension (tests/python/ext, on sys.path through conftest.py); a
# missing module is a failure, not a skip.
import trainstream_testing as ext

ISAS = [
    pytest.param(
        i, marks=pytest.mark.skipif(not ext.adamw_isa_supported(i), reason=f"this CPU cannot run the {i} path")
    )
    for i in ["scalar", "avx2", "avx512"]
]


class Bound:
    """Engine plus the tensors it borrows (the daemon's segments, here)."""

    def __init__(self, init, grad_dtype=torch.float32, param_dtype=torch.float32, **engine_kw):
        engine_kw.setdefault("chunk_elems", 4096)  # several chunks per large tensor
        self.engine = ext.AdamWEngine(**engine_kw)
        mdt = torch.bfloat16 if engine_kw.get("moment_dtype") == "bf16" else torch.float32
        self.master = [torch.empty(p.numel()) for p in init]
        self.m = [torch.empty(p.numel(), dtype=mdt) for p in init]
        self.v = [torch.empty(p.numel(), dtype=mdt) for p in init]
        self.grad = [torch.empty(p.numel(), dtype=grad_dtype) for p in init]
        self.slot = [p.to(param_dtype) for p in init]
        for i in range(len(init)):
            self.engine.add_param(i, self.master[i], self.m[i], self.v[i], self.grad[i], self.slot[i])
        self.engine.init()

    def step(self, step, grads):
        for i, g in enumerate(grads):
            self.grad[i].copy_(g)
            self.engine.submit(i, step, **hyper(i, step))
        self.engine.step_end(step)
        return self.engine.wait()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_eager_engine_matches_torch(isa, threads):
    init = make_params()
    params, opt = torch_reference(init)
    eng = Bound(init, threads=threads, isa=isa)
    assert not eng.engine.deferred and eng.engine.threads == threads
    for step in range(1, STEPS + 1):
        results = eng.step(step, make_grads(step))
        assert len(results) == 1 and results[0]["params_updated"] == len(SIZES)
        assert not results[0]["skipped_nonfinite"]
    for i, p in enumerate(params):
        assert_close(eng.master[i], p.detach(), f"param {SIZES[i]}")
        assert torch.equal(eng.slot[i], eng.master[i])
        master, exp_avg, exp_avg_sq, step = eng.engine.export_state(i)
        st = opt.state[p]
        assert step == int(st["step"]) == STEPS
        assert_close(exp_avg, st["exp_avg"], "exported exp_avg")
        assert_close(exp_avg_sq, st["exp_avg_sq"], "exported exp_avg_sq")


def test_bf16_slots_and_grads():
    init = make_params()
    eng = Bound(init, grad_dtype=torch.bfloat16, param_dtype=torch.bfloat16, threads=2)
    # Init took the master from the bf16 slot: compare against torch started there too.
    params, _ = torch_reference([p.to(torch.bfloat16).float() for p in init], torch.bfloat16, steps=5)
    for step in range(1, 6):
        eng.step(step, make_grads(step, torch.bfloat16))
    for i, p in enumerate(params):
        assert_close(eng.master[i], p.detach(), f"param {SIZES[i]}")
        assert torch.equal(eng.slot[i], eng.master[i].to(torch.bfloat16))


@pytest.mark.parametrize("threads", [1, 2])
def test_deferred_clipping_matches_clip_grad_norm(threads):
    init = make_params()
    max_norm = 5.0
    params, _ = torch_reference(init, max_norm=max_norm, scale=3.0)
    eng = Bound(init, threads=threads, max_grad_norm=max_norm)
    assert eng.engine.deferred
    for step in range(1, STEPS + 1):
        grads = make_grads(step, scale=3.0)
        (r,) = eng.step(step, grads)
        want = torch.linalg.vector_norm(torch.cat([g.double() for g in grads])).item()
        assert r["grad_norm"] == pytest.approx(want, rel=1e-12)
        assert r["grad_norm"] > max_norm  # clipping is active
    for i, p in enumerate(params):
        assert_close(eng.master[i], p.detach(), f"param {SIZES[i]}")


@pytest.mark.parametrize("mode", ["eager", "deferred", "clipping"])
def test_nonfinite_gradient_is_reported_and_changes_nothing(mode):
    kw = {"eager": {}, "deferred": dict(skip_nonfinite_step=True), "clipping": dict(max_grad_norm=1.0)}[mode]
    init = make_params()
    eng = Bound(init, threads=2, **kw)
    eng.step(1, make_grads(1))
    before = [eng.engine.export_state(i) for i in range(len(SIZES))]
    slots = [s.clone() for s in eng.slot]
    grads = make_grads(2)
    grads[3][123456] = float("nan")
    grads[1][2] = float("inf")
    (r,) = eng.step(2, grads)
    assert r["skipped_nonfinite"] and r["nonfinite_params"] == [1, 3]
    assert "non-finite" in r["error"]
    expect_changed = {"eager": {0, 2}, "deferred": set(), "clipping": set()}[mode]
    assert r["params_updated"] == len(expect_changed)
    for i in range(len(SIZES)):
        after = eng.engine.export_state(i)
        same = all(torch.equal(a, b) for a, b in zip(before[i][:3], after[:3])) and before[i][3] == after[3]
        assert same == (i not in expect_changed), i
        assert torch.equal(slots[i], eng.slot[i]) == (i not in expect_changed)


def test_state_import_resumes_identically():
    init = make_params()
    a = Bound(init, threads=2, moment_dtype="bf16", seed=3)
    for step in range(1, 4):
        a.step(step, make_grads(step))
    b = Bound(init, threads=1, moment_dtype="bf16", seed=3)
    for i in range(len(SIZES)):
        b.engine.import_state(i, *a.engine.export_state(i))
    for step in range(4, 7):
        a.step(step, make_grads(step))
        b.step(step, make_grads(step))
    for i in range(len(SIZES)):
        assert torch.equal(a.master[i], b.master[i])  # same seed, same counters: same bits


def test_errors_are_reported():
    eng = ext.AdamWEngine(threads=1)
    with pytest.raises(ValueError, match="unknown parameter"):
        eng.submit(5, 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="moment_dtype"):
        ext.AdamWEngine(moment_dtype="fp16")
