"""Conformance with the reference API's option tables (TrainStream 0.5's README,
"Options" and "OffloadAdamW"): every documented value of every option is accepted by
wrap() / OffloadAdamW on CPU (or, where it needs CUDA, refused with the documented
error), has its documented effect where CPU can show it, and a bad value raises a
ValueError naming the option and what is accepted. Each case's id names the option and
the value it tries."""
import pytest
import torch
from torch import nn

import trainstream
from conftest import Daemon, _build_dir

CUDA = torch.cuda.is_available()


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


@pytest.fixture(scope="module")
def socket():
    d = Daemon(_build_dir() / "bin", ())
    d.wait_ready()
    yield d.socket
    d.stop()
    d.cleanup()


def _wrap(socket, **options):
    torch.manual_seed(0)
    model = Tiny()
    return trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                            socket=socket, **options)


# (option, value, id, observe(model, opt) -> asserted, or None)
def _stat(key, want):
    return lambda m, o: o.stats()[key] == want


WRAP_CASES = [
    ("optimizer", None, "None", None),
    ("optimizer_mode", "cpu", "cpu", lambda m, o: o.optimizer_mode == "cpu"),
    ("optimizer_mode", "auto", "auto", lambda m, o: o.optimizer_mode == "cpu"),  # CPU model
    ("offload", "auto", "auto", None),
    ("offload", True, "True", None),
    ("activation_offload", "auto", "auto", None),
    ("activation_offload", True, "True", None),
    ("activation_offload", False, "False", None),
    ("activation_offload", 0.5, "fraction", None),
    ("param_offload", "auto", "auto", None),
    ("param_offload", False, "False", None),
    ("param_offload", 0.5, "fraction", None),
    ("param_offload", [0], "list", None),
    ("quantize", "auto", "auto", None),
    ("quantize", "none", "none", lambda m, o: m._trainstream_session.config["quantize"] is None),
    ("quantize", None, "None", lambda m, o: m._trainstream_session.config["quantize"] is None),
    ("quantize", False, "False", lambda m, o: m._trainstream_session.config["quantize"] is None),
    ("quant_block_size", 2, "2", None),
    ("quant_block_size", 64, "64", None),
    ("prefer", "exact", "exact", None),
    ("prefer", "speed", "speed", None),
    ("recompute", "auto", "auto", None),
    ("recompute", True, "True", None),
    ("recompute", False, "False", None),
    ("recompute", 0.5, "fraction", None),
    ("recompute", [1], "list", None),
    ("attention", "auto", "auto", None),
    ("attention", "math", "math", None),
    ("attention", None, "None", None),
    ("moment_dtype", "auto", "auto", None),
    ("moment_dtype", "float32", "float32", _stat("moment_dtype", "float32")),
    ("moment_dtype", "fp32", "fp32", _stat("moment_dtype", "float32")),
    ("moment_dtype", "bfloat16", "bfloat16", _stat("moment_dtype", "bfloat16")),
    ("moment_dtype", "bf16", "bf16", _stat("moment_dtype", "bfloat16")),
    ("moment_dtype", torch.bfloat16, "torch.bfloat16", _stat("moment_dtype", "bfloat16")),
    ("moment_dtype", torch.float32, "torch.float32", _stat("moment_dtype", "float32")),
    ("device", None, "None", None),
    ("device", "cpu", "cpu", None),
    ("device", torch.device("cpu"), "torch.device", None),
    ("distributed", None, "None", lambda m, o: o.stats()["data_parallel"] is None),
    ("distributed", False, "False", lambda m, o: o.stats()["data_parallel"] is None),
    ("guard_params", True, "True", _stat("guard_params", True)),
    ("guard_params", False, "False", _stat("guard_params", False)),
    ("max_grad_norm", None, "None", None),
    ("max_grad_norm", 1.0, "float", None),
    ("accumulation_steps", 2, "2", None),
    ("vram_headroom", 0.1, "0.1", None),
    ("check_memory", True, "True", None),
    ("check_memory", False, "False", None),
    ("max_inflight_bytes", None, "None",
     lambda m, o: m._trainstream_session.config["max_inflight_bytes"] == 1 << 30),  # no CUDA
    ("max_inflight_bytes", 1 << 20, "bytes",
     lambda m, o: m._trainstream_session.config["max_inflight_bytes"] == 1 << 20),
    ("max_activation_slowdown", 0.15, "0.15", None),
    ("prefetch_depth", 1, "1", None),
    ("min_offload_bytes", 1 << 20, "bytes", None),
    ("threads", None, "None", None),
    ("threads", 1, "1", None),
    ("profile", True, "True", None),
    ("profile", False, "False", None),
    ("lr", 1e-3, "float", lambda m, o: o.param_groups[0]["lr"] == 1e-3),
    ("verbose", False, "False", None),
]


@pytest.mark.parametrize("name,value,observe",
                         [pytest.param(n, v, f, id=f"wrap-{n}-{i}") for n, v, i, f in WRAP_CASES])
def test_wrap_accepts_reference_value(socket, name, value, observe):
    torch.manual_seed(0)
    model = Tiny()
    opt = None if name == "optimizer" else torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = {} if name == "optimizer" else {name: value}
    model, opt = trainstream.wrap(model, opt, socket=socket, **options)
    try:
        model(torch.randn(4, 8)).sum().backward()
        if name != "accumulation_steps":
            opt.step()
        if observe is not None:
            assert observe(model, opt)
    finally:
        trainstream.unwrap(model)


def test_wrap_blocks_used_by_plan(socket):
    torch.manual_seed(0)
    model = Tiny()
    model, opt = trainstream.wrap(model, None, socket=socket, blocks=list(model.layers[:2]))
    try:
        plan = [e for e in model._trainstream_session.events if e["kind"] == "plan"]
        assert plan and plan[0]["blocks"] == 2
    finally:
        trainstream.unwrap(model)


@pytest.mark.skipif(CUDA, reason="the CPU refusal of optimizer_mode='gpu'")
def test_wrap_optimizer_mode_gpu_refused_on_cpu(socket):
    with pytest.raises(ValueError, match="optimizer_mode='gpu' cannot run here"):
        _wrap(socket, optimizer_mode="gpu")


BAD = [
    ("quantize", "fp4"), ("moment_dtype", "fp16"), ("moment_dtype", torch.float16),
    ("quant_block_size", 3), ("quant_block_size", 0), ("quant_block_size", True),
    ("profile", "yes"), ("blocks", "layers"), ("blocks", []), ("max_inflight_bytes", 0),
    ("mode", "auto"), ("eager", 1), ("pin_moments", "on"), ("chunk_elems", 0),
    ("compute_grad_norm", None), ("optimizer_mode", "tpu"), ("attention", "fast"),
]


@pytest.mark.parametrize("name,value", [pytest.param(n, v, id=f"bad-{n}-{v!r}") for n, v in BAD])
def test_bad_value_names_option(name, value):
    from trainstream.options import validate
    with pytest.raises(ValueError, match=rf"option {name}=.*accepted"):
        validate({name: value})


def test_blocks_outside_model_refused(socket):
    with pytest.raises(ValueError, match="option blocks: blocks\\[0\\].*not a submodule"):
        _wrap(socket, blocks=[nn.Linear(8, 8)])


def _adamw(socket, **options):
    torch.manual_seed(0)
    model = Tiny()
    return model, trainstream.OffloadAdamW(model.parameters(), lr=1e-3, socket=socket, **options)


ADAMW_CASES = [
    ("mode", "cpu", "cpu", lambda o: o.optimizer_mode == "cpu"),
    ("max_grad_norm", None, "None", None),
    ("max_grad_norm", 0.5, "float", None),
    ("compute_grad_norm", False, "False", None),
    ("compute_grad_norm", True, "True", lambda o: o.last_grad_norm is not None),
    ("threads", None, "None", None),
    ("threads", 2, "2", None),
    ("chunk_elems", 1048576, "1048576", lambda o: o.stats()["chunk_elems"] == 1048576),
    ("accumulation_steps", 1, "1", None),
    ("eager", None, "None", lambda o: o.stats()["grad_post"] == "backward"),
    ("eager", True, "True", lambda o: o.stats()["grad_post"] == "backward"),
    ("eager", False, "False", lambda o: o.stats()["grad_post"] == "step"),
    ("pin_moments", None, "None", _stat_pin := (lambda o: o.optimizer_mode == "cpu")),
    ("pin_moments", True, "True", _stat_pin),
    ("pin_moments", False, "False", lambda o: o.stats()["pin_moments"] is False),
    ("moment_dtype", "float32", "float32", lambda o: o.stats()["moment_dtype"] == "float32"),
    ("moment_dtype", "fp32", "fp32", lambda o: o.stats()["moment_dtype"] == "float32"),
    ("moment_dtype", "bfloat16", "bfloat16", lambda o: o.stats()["moment_dtype"] == "bfloat16"),
    ("moment_dtype", "bf16", "bf16", lambda o: o.stats()["moment_dtype"] == "bfloat16"),
    ("moment_dtype", torch.float32, "torch.float32",
     lambda o: o.stats()["moment_dtype"] == "float32"),
    ("moment_dtype", torch.bfloat16, "torch.bfloat16",
     lambda o: o.stats()["moment_dtype"] == "bfloat16"),
    ("distributed", False, "False", lambda o: o.stats()["data_parallel"] is None),
]


@pytest.mark.parametrize("name,value,observe", [pytest.param(n, v, f, id=f"adamw-{n}-{i}")
                                                for n, v, i, f in ADAMW_CASES])
def test_offload_adamw_accepts_reference_value(socket, name, value, observe):
    model, opt = _adamw(socket, **{name: value})
    try:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        if observe is not None:
            assert observe(opt)
    finally:
        opt.detach()
        opt.release_hooks()


@pytest.mark.skipif(CUDA, reason="the CPU refusal of mode='gpu'")
def test_offload_adamw_mode_gpu_refused_on_cpu(socket):
    with pytest.raises(ValueError, match="optimizer_mode='gpu' cannot run here"):
        _adamw(socket, mode="gpu")


def test_mode_and_optimizer_mode_conflict(socket):
    with pytest.raises(ValueError, match="mode='cpu' and optimizer_mode='gpu' disagree"):
        _adamw(socket, mode="cpu", optimizer_mode="gpu")


def test_eager_and_grad_post_conflict(socket):
    with pytest.raises(ValueError, match="eager=True and grad_post='step' disagree"):
        _adamw(socket, eager=True, grad_post="step")


def test_compute_grad_norm_matches_torch(socket):
    model, opt = _adamw(socket, compute_grad_norm=True)
    ref = Tiny()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4, 8)
    try:
        model(x).sum().backward()
        ref(x).sum().backward()
        want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")))
        opt.step()
        assert opt.last_grad_norm == pytest.approx(want, rel=1e-5)
    finally:
        opt.detach()
        opt.release_hooks()


def test_methods_and_attach_model_guard(socket):
    model, opt = _adamw(socket, attach=False)
    opt.attach(model, guard=False)
    try:
        assert opt.stats()["guard_params"] is False
        for name in ("step", "zero_grad", "detach", "synchronize", "stats", "state_dict",
                     "load_state_dict", "add_param_group"):
            assert callable(getattr(opt, name))
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.synchronize()
        assert opt.last_grad_norm is not None
    finally:
        opt.detach()
        opt.release_hooks()
    with pytest.raises(ValueError, match="attach\\(model=...\\): none of this optimizer"):
        opt.attach(Tiny())
