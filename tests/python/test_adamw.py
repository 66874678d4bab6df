"""AdamW kernel and engine (the test-only trainstream_testing) against torch.optim.AdamW.

Run: PYTHONPATH=<build>/python TRAINSTREAM_BUILD_DIR=<build> python -m pytest tests/python/test_adamw*.py
Every dispatch path is forced in turn; paths this CPU lacks are skipped with the
reason. docs/adamw.md states the guarantees tested here.
"""

import pytest
import torch

# The test-only extension (tests/python/ext, on sys.path through conftest.py); a
# missing module is a failure, not a skip.
import trainstream_testing as ext

ISAS = ["scalar", "avx2", "avx512"]
SIZES = [1, 7, 4097, 2**20 + 3]
RTOL, ATOL = 1e-6, 1e-7
STEPS = 20
# Two parameter groups: sizes 1 and 4097 in group 0, 7 and 2^20+3 in group 1.
GROUPS = [
    dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
    dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0),
]
GROUP_OF = [0, 1, 0, 1]


def isa_param(name):
    return pytest.param(
        name,
        marks=pytest.mark.skipif(
            not ext.adamw_isa_supported(name),
            reason=f"this CPU cannot run the {name} path "
            f"(needs {'AVX-512 F/BW/VL/DQ' if name == 'avx512' else 'AVX2+FMA+F16C'})",
        ),
    )


ALL_ISAS = [isa_param(i) for i in ISAS]


def lr_at(group, step):
    """A per-step schedule, as the daemon's ring records deliver it."""
    return group["lr"] * (1.0 - 0.02 * step)


def assert_close(got, want, what):
    got, want = got.double(), want.double()
    bad = (got - want).abs() > ATOL + RTOL * want.abs()
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {got.numel()} elements differ; first at {i}: "
            f"got {got.view(-1)[i].item()!r}, torch {want.view(-1)[i].item()!r}"
        )


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in SIZES]


def make_grads(step, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(n, generator=g) * scale).to(dtype) for n in SIZES]


def torch_reference(init, grad_dtype=torch.float32, steps=STEPS, max_norm=None, scale=1.0):
    params = [torch.nn.Parameter(p.clone()) for p in init]
    groups = [
        dict(params=[params[i] for i in range(len(SIZES)) if GROUP_OF[i] == k], **GROUPS[k])
        for k in range(2)
    ]
    opt = torch.optim.AdamW(groups, foreach=False)
    for step in range(1, steps + 1):
        for k, group in enumerate(opt.param_groups):
            group["lr"] = lr_at(GROUPS[k], step)
        for p, g in zip(params, make_grads(step, grad_dtype, scale)):
            p.grad = g.float()  # torch is given the same upcast gradients
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
    return params, opt


def hyper(i, step):
    grp = GROUPS[GROUP_OF[i]]
    return dict(
        lr=lr_at(grp, step),
        beta1=grp["betas"][0],
        beta2=grp["betas"][1],
        eps=grp["eps"],
        weight_decay=grp["weight_decay"],
    )


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_torch_adamw(isa, grad_dtype):
    init = make_params()
    params, opt = torch_reference(init, grad_dtype)
    masters = [p.clone() for p in init]
    ms = [torch.zeros_like(p) for p in init]
    vs = [torch.zeros_like(p) for p in init]
    outs = [torch.empty(p.numel(), dtype=torch.bfloat16) for p in init]
    for step in range(1, STEPS + 1):
        for i, g in enumerate(make_grads(step, grad_dtype)):
            ext.adamw_step(masters[i], ms[i], vs[i], g, outs[i], step=step, isa=isa, **hyper(i, step))
    for i, p in enumerate(params):
        st = opt.state[p]
        assert_close(masters[i], p.detach(), f"param {SIZES[i]}")
        assert_close(ms[i], st["exp_avg"], f"exp_avg {SIZES[i]}")
        assert_close(vs[i], st["exp_avg_sq"], f"exp_avg_sq {SIZES[i]}")
        # The bf16 weight copy is the master rounded to nearest even, like .to(bfloat16).
        assert torch.equal(outs[i], masters[i].to(torch.bfloat16))


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_weight_output_dtypes(isa, out_dtype):
    master = torch.randn(4099) * 10
    out = torch.empty(4099, dtype=out_dtype)
    ext.adamw_step(master, torch.zeros(4099), torch.zeros(4099), torch.randn(4099), out,
                  step=1, isa=isa, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    assert torch.equal(out, master.to(out_dtype))


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_paths_bit_identical_with_bf16_moments(isa):
    def run(which):
        g = torch.Generator().manual_seed(3)
        master = torch.randn(10007, generator=g)
        m = torch.zeros(10007, dtype=torch.bfloat16)
        v = torch.zeros(10007, dtype=torch.bfloat16)
        for step in range(1, 6):
            grad = torch.randn(10007, generator=g).to(torch.bfloat16)
            ext.adamw_step(master, m, v, grad, None, step=step, lr=1e-2, beta1=0.9, beta2=0.999,
                          eps=1e-8, weight_decay=0.1, seed=11, param_key=5, isa=which)
        return master, m, v

    ref, got = run("scalar"), run(isa)
    for a, b in zip(ref, got):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32))


def test_rejects_unknown_or_unsupported_isa():
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="unknown isa"):
        ext.adamw_step(x, x.clone(), x.clone(), x.clone(), None, step=1, lr=1e-3, beta1=0.9,
                      beta2=0.999, eps=1e-8, weight_decay=0.0, isa="sse9")
