"""Conformance with the reference API's "Inspection and utilities" and
"ActivationOffloader" sections (TrainStream 0.5's README),
on CPU: memory_report, pinned_stats, transfer_stats, profile_hardware and
HardwareProfile, find_blocks, the exported internals, TrainStreamSession's
attributes, and ActivationOffloader with each documented argument value. Test ids
name the item."""
import gc

import pytest
import torch
from torch import nn

import trainstream
from paging_helpers import _assert_grads_equal, _pair
from tiny_gpt import corpus, text_batches
from trainstream.streaming.activation_tuner import OffloadTuner

CUDA = torch.cuda.is_available()


def _batches(cfg, steps, batch=2):
    return text_batches(corpus(), cfg, batch=batch, steps=steps)


def _step(model, batch):
    x, y = batch
    loss = model(x, y)
    loss.backward()
    model.zero_grad()
    return loss.item()


# ------------------------------------------------------------------ memory_report
def test_memory_report_without_model_has_gpu_pinned_pinned_by_tag():
    r = trainstream.memory_report()
    assert set(r) == {"gpu", "pinned", "pinned_by_tag"}
    assert set(r["gpu"]) == {"allocated", "reserved", "peak_allocated"}
    assert all(isinstance(v, int) for v in r["gpu"].values())
    if not CUDA:
        assert r["gpu"] == {"allocated": 0, "reserved": 0, "peak_allocated": 0}
    assert r["pinned_by_tag"] == r["pinned"]["by_tag"]


def test_memory_report_with_model_adds_pinned_by_tag_and_keeps_sections(daemon):
    cfg, _, ours = _pair()
    ours, opt = trainstream.wrap(ours, socket=daemon.socket)
    for b in _batches(cfg, 2):
        ours(*b).backward()
        opt.step()
        opt.zero_grad()
    r = trainstream.memory_report(ours)
    for key in ("events", "gpu", "pinned", "pinned_by_tag", "transfers", "optimizer",
                "resident", "plan", "params", "activations", "attention"):
        assert key in r, key
    assert set(r["gpu"]) == {"allocated", "reserved", "peak_allocated"}
    # The optimizer's staging region is live and tagged.
    assert r["pinned_by_tag"].get("staging", 0) >= r["pinned"]["mapped_bytes"] > 0
    # Host memory per trained parameter, by category (docs/inspection.md).
    h = r["host_per_param"]
    n = sum(p.numel() for p in ours.parameters() if p.requires_grad)
    assert h["trained_params"] == n
    assert h["bytes"]["daemon optimizer state"] == opt.state_bytes() > 0
    assert h["bytes"]["staging slots"] == r["pinned"]["mapped_bytes"]
    assert h["bytes"]["process private memory"] > 0
    assert h["total_bytes"] == sum(h["bytes"].values())
    assert h["bytes_per_param"]["daemon optimizer state"] == opt.state_bytes() / n
    assert abs(h["total_bytes_per_param"] * n - h["total_bytes"]) < 1
    # fp32 weights: their slots are the masters (Note [One host copy of a trained weight]).
    assert h["daemon_state"] == {"masters": 0, "moments": 8 * n}
    assert h["daemon_state_per_param"] == {"masters": 0.0, "moments": 8.0}
    assert sum(h["daemon_state"].values()) == h["bytes"]["daemon optimizer state"]
    trainstream.unwrap(ours)


@pytest.mark.parametrize("dtype,master", [(torch.bfloat16, 2.0), (torch.float16, 4.0)])
def test_memory_report_shows_the_daemons_master_bytes_per_parameter(daemon, dtype, master):
    # Beyond its weight slot a bf16 weight's master is its low halves, an fp16 one's a
    # whole fp32 master; bf16 moments take 2 B each.
    cfg, _, ours = _pair()
    ours, opt = trainstream.wrap(ours.to(dtype), socket=daemon.socket, moment_dtype="bfloat16")
    h = trainstream.memory_report(ours)["host_per_param"]
    assert h["daemon_state_per_param"] == {"masters": master, "moments": 4.0}
    assert h["bytes"]["daemon optimizer state"] == (master + 4) * h["trained_params"]
    trainstream.unwrap(ours)


def test_memory_report_bad_arguments():
    with pytest.raises(ValueError, match="not wrapped"):
        trainstream.memory_report(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="wrapped by trainstream.wrap"):
        trainstream.memory_report("model")


# ------------------------------------------------------------------ pinned_stats
def test_pinned_stats_counters_and_by_tag_follow_live_memory():
    s = trainstream.pinned_stats()
    for key in ("allocated_bytes", "peak_allocated_bytes", "active_bytes", "allocations"):
        assert isinstance(s[key], int) and s[key] >= 0, key
    before = s["by_tag"].get("activations", 0)
    cfg, _, model = _pair()
    off = trainstream.ActivationOffloader(model, model.blocks, offload=True, min_bytes=0)
    _step(model, _batches(cfg, 1)[0])
    held = off._arena.capacity
    assert held > 0
    assert trainstream.pinned_stats()["by_tag"]["activations"] == before + held
    off.remove()
    del off
    gc.collect()
    # Weakly held: the arena's chunks are gone, so is their count.
    assert trainstream.pinned_stats()["by_tag"].get("activations", 0) == before


def test_pinned_stats_optimizer_form_kept(daemon):
    cfg, _, ours = _pair()
    ours, opt = trainstream.wrap(ours, socket=daemon.socket)
    s = trainstream.pinned_stats(opt)
    assert set(s) == {"mapped_bytes", "registered_bytes"}
    assert s["mapped_bytes"] > 0
    trainstream.unwrap(ours)
    with pytest.raises(ValueError, match="OffloadAdamW or None"):
        trainstream.pinned_stats(3)


# ---------------------------------------------------------------- transfer_stats
def test_transfer_stats_counts_the_copy_streams_of_the_device():
    # The default device is the current GPU where there is one; the model here is a CPU
    # model, so its copies count under "cpu" (on the H200 too).
    assert trainstream.transfer_stats()["device"].startswith("cuda" if CUDA else "cpu")
    before = trainstream.transfer_stats("cpu")
    cfg, _, model = _pair()
    off = trainstream.ActivationOffloader(model, model.blocks, offload=True, min_bytes=0)
    _step(model, _batches(cfg, 1)[0])
    after = trainstream.transfer_stats("cpu")
    paged = off.stats["bytes_offloaded"]
    assert paged > 0
    assert after["bytes_d2h"] - before["bytes_d2h"] == paged
    assert after["copies_d2h"] - before["copies_d2h"] == off.stats["tensors_offloaded"]
    # Every page came back once in backward.
    assert after["bytes_h2d"] - before["bytes_h2d"] == paged
    assert after["copies_h2d"] > before["copies_h2d"]
    off.remove()


def test_transfer_stats_optimizer_form_kept(daemon):
    cfg, _, ours = _pair()
    ours, opt = trainstream.wrap(ours, socket=daemon.socket)
    ours(*_batches(cfg, 1)[0]).backward()
    opt.step()
    t = trainstream.transfer_stats(opt)
    numel = sum(p.numel() for p in ours.parameters())
    assert t["bytes_d2h"] == 4 * numel and t["bytes_h2d"] == 4 * numel and t["steps"] == 1
    trainstream.unwrap(ours)


@pytest.mark.parametrize("device", ["tpu", 1.5, object()], ids=["tpu", "float", "object"])
def test_transfer_stats_bad_device(device):
    with pytest.raises(ValueError, match="transfer_stats"):
        trainstream.transfer_stats(device)


@pytest.mark.skipif(CUDA, reason="checks the error a CPU-only process gives for a GPU")
def test_transfer_stats_cuda_without_cuda():
    with pytest.raises(ValueError, match="CUDA is not available"):
        trainstream.transfer_stats("cuda")


# ------------------------------------------------------------- profile_hardware
@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def test_profile_hardware_returns_a_hardware_profile(cache_dir):
    p = trainstream.profile_hardware()
    assert isinstance(p, trainstream.HardwareProfile)
    assert p.host_adamw_torch_gparams_s > 0 and p.threads >= 1 and p.quick
    assert p.key and p.measured_at > 0
    assert (cache_dir / "trainstream" / "hardware.json").exists()
    text = p.summary(print_it=False)
    assert "host AdamW" in text and "Gparam/s" in text
    if not CUDA:
        assert p.h2d_gb_s is None and p.d2h_gb_s is None and p.matmul_bf16_tflops is None
        assert text.count("absent (no CUDA device)") == 3
        assert "h2d_gb_s" not in p and p.get("h2d_gb_s", 0.0) == 0.0  # dict reads kept
    else:
        assert p["h2d_gb_s"] > 0 and p.d2h_gb_s > 0 and p.matmul_bf16_tflops > 0
    assert p["host_adamw_torch_gparams_s"] == p.host_adamw_torch_gparams_s


def test_profile_hardware_summary_prints(cache_dir, capsys):
    text = trainstream.profile_hardware().summary()
    assert capsys.readouterr().out.strip() == text.strip()


def test_profile_hardware_cache_and_force(cache_dir):
    first = trainstream.profile_hardware()
    assert trainstream.profile_hardware().measured_at == first.measured_at  # cached
    forced = trainstream.profile_hardware(force=True)
    assert forced.measured_at > first.measured_at
    assert trainstream.profile_hardware().measured_at == forced.measured_at


def test_profile_hardware_quick_false_is_not_served_by_a_quick_profile(cache_dir):
    quick = trainstream.profile_hardware(quick=True)
    full = trainstream.profile_hardware(quick=False)
    assert not full.quick and full.measured_at > quick.measured_at
    # A full profile serves a quick request.
    assert trainstream.profile_hardware(quick=True).measured_at == full.measured_at


def test_profile_hardware_threads(cache_dir):
    before = torch.get_num_threads()
    p = trainstream.profile_hardware(threads=1)
    assert p.threads == 1
    assert torch.get_num_threads() == before, "the thread count is restored"
    assert trainstream.profile_hardware(threads=1).measured_at == p.measured_at


def test_profile_hardware_device_cpu_measures_the_host_only(cache_dir):
    p = trainstream.profile_hardware(device="cpu")
    assert p.device == "cpu" and p.h2d_gb_s is None and p.host_adamw_torch_gparams_s > 0


@pytest.mark.parametrize("kwargs, fragment", [
    ({"device": "tpu"}, "device='tpu'"), ({"quick": 1}, "quick=1"),
    ({"force": "yes"}, "force='yes'"), ({"threads": 0}, "threads=0"),
    ({"threads": True}, "threads=True")], ids=["device", "quick", "force", "threads-0",
                                              "threads-bool"])
def test_profile_hardware_bad_values(cache_dir, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        trainstream.profile_hardware(**kwargs)


@pytest.mark.skipif(CUDA, reason="checks the error a CPU-only process gives for a GPU")
def test_profile_hardware_cuda_without_cuda(cache_dir):
    with pytest.raises(ValueError, match="CUDA is not available"):
        trainstream.profile_hardware(device="cuda")


def test_hardware_profile_reads_an_older_cached_dict():
    old = {"key": "cpu|x", "measured_at": 1.0, "host_adamw_torch_gparams_s": 0.5,
           "host_adamw_torch_impl": "fused", "unknown_field": 3}
    p = trainstream.HardwareProfile.from_dict(old)
    assert p.host_adamw_torch_gparams_s == 0.5 and p.h2d_gb_s is None
    assert set(p.keys()) >= {"key", "measured_at", "host_adamw_torch_gparams_s"}


# ------------------------------------------------------------------- find_blocks
class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


def test_find_blocks_takes_a_sequential_stack():
    model = nn.Sequential(nn.Embedding(8, 4), nn.Sequential(*[_Layer() for _ in range(3)]))
    assert trainstream.find_blocks(model) == list(model[1])


def test_find_blocks_largest_of_modulelist_and_sequential():
    model = nn.Module()
    model.a = nn.ModuleList([_Layer(), _Layer()])
    model.b = nn.Sequential(_Layer(), _Layer(), _Layer())
    assert trainstream.find_blocks(model) == list(model.b)


def test_find_blocks_none_is_empty():
    assert trainstream.find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []
    assert trainstream.find_blocks(nn.Sequential(_Layer())) == []


# --------------------------------------------------------------- exported internals
def test_exported_internals_are_the_real_classes():
    from trainstream.optim.daemon_backend import DaemonBackend
    from trainstream.optim.param_ready import ParamReadyHooks
    from trainstream.streaming.weights import BlockPager
    assert trainstream.ParamPager is BlockPager
    assert trainstream.GradientOffloader is DaemonBackend
    assert trainstream.ParamReadyHooks is ParamReadyHooks
    for name in ("ParamPager", "GradientOffloader", "ParamReadyHooks", "HardwareProfile",
                 "ActivationOffloader"):
        assert name in trainstream.__all__
    for cls in (BlockPager, DaemonBackend, ParamReadyHooks):
        assert "not meant to be constructed by hand" in " ".join(cls.__doc__.split()), cls


def test_wrap_builds_the_exported_internals(daemon):
    cfg, _, ours = _pair()
    ours, opt = trainstream.wrap(ours, socket=daemon.socket, param_offload=True,
                                 min_offload_bytes=0)
    assert isinstance(ours._trainstream_session.pager, trainstream.ParamPager)
    assert opt.optimizer_mode == "cpu"  # DaemonBackend (GradientOffloader) posts the grads
    assert isinstance(opt.param_ready_hooks, trainstream.ParamReadyHooks)  # guard_params
    trainstream.unwrap(ours)


# --------------------------------------------------------------- TrainStreamSession
def test_session_attributes(daemon):
    cfg, _, ours = _pair()
    ours, opt = trainstream.wrap(ours, socket=daemon.socket, accumulation_steps=1)
    s = ours._trainstream_session
    assert isinstance(s, trainstream.TrainStreamSession)
    assert isinstance(s.adapting, bool)
    assert s.config["accumulation_steps"] == 1 and "activation_offload" in s.config
    assert [e["kind"] for e in s.events][0] == "attached"
    assert s.steps == 0
    for b in _batches(cfg, 2):
        ours(*b).backward()
        opt.step()
        opt.zero_grad()
    assert s.steps == 2
    trainstream.unwrap(ours)


# --------------------------------------------------------------- ActivationOffloader
def _offloaded(model, **kwargs):
    return trainstream.ActivationOffloader(model, model.blocks, min_bytes=0, **kwargs)


@pytest.mark.parametrize("offload, policy", [
    (True, ["offload"] * 4), (False, ["keep"] * 4), (0.5, ["offload"] * 2 + ["keep"] * 2),
    ([0, 2], ["offload", "keep", "offload", "keep"]), ({1}, ["keep", "offload", "keep", "keep"]),
], ids=["offload-True", "offload-False", "offload-fraction", "offload-list", "offload-set"])
def test_activation_offloader_offload_values_exact(offload, policy):
    cfg, ref, ours = _pair()
    batch = _batches(cfg, 1)[0]
    ref(*batch).backward()
    off = _offloaded(ours, offload=offload)
    assert off.policy == policy and off.decision["settled"]
    ours(*batch).backward()
    _assert_grads_equal(ref, ours, 0)
    assert (off.stats["bytes_offloaded"] > 0) == ("offload" in policy)
    off.remove()


@pytest.mark.parametrize("recompute, policy", [
    (True, ["recompute"] * 4), (False, ["offload"] * 4),
    (0.25, ["recompute"] + ["offload"] * 3), ([3], ["offload"] * 3 + ["recompute"]),
    ("auto", ["offload"] * 4),
], ids=["recompute-True", "recompute-False", "recompute-fraction", "recompute-list",
        "recompute-auto"])
def test_activation_offloader_recompute_values_exact(recompute, policy):
    cfg, ref, ours = _pair()
    batch = _batches(cfg, 1)[0]
    ref(*batch).backward()
    off = _offloaded(ours, offload=True, recompute=recompute)
    assert off.policy == policy
    ours(*batch).backward()
    _assert_grads_equal(ref, ours, 0)
    off.remove()


def test_activation_offloader_min_bytes():
    cfg, _, model = _pair()
    off = trainstream.ActivationOffloader(model, model.blocks, offload=True, min_bytes=1 << 40)
    _step(model, _batches(cfg, 1)[0])
    assert off.stats["tensors_offloaded"] == 0 and off.stats["tensors_kept"] > 0
    off.remove()
    assert trainstream.ActivationOffloader(model, model.blocks, False).min_bytes == 1 << 20


@pytest.mark.parametrize("depth", [1, 3], ids=["prefetch_depth-1", "prefetch_depth-3"])
def test_activation_offloader_prefetch_depth(depth):
    cfg, _, model = _pair()
    off = _offloaded(model, offload=True, prefetch_depth=depth)
    assert off.prefetch_depth == depth
    _step(model, _batches(cfg, 1)[0])
    assert off.stats["prefetch_hits"] > 0
    off.remove()


def test_activation_offloader_max_inflight_bytes_is_taken():
    cfg, _, model = _pair()
    off = _offloaded(model, offload=True, max_inflight_bytes=4096)
    assert off.max_inflight_bytes == 4096
    _step(model, _batches(cfg, 1)[0])  # (on CPU copies finish at once: nothing waits)
    assert off.inflight_bytes == 0
    off.remove()


def _run_auto(model, cfg, steps, **kwargs):
    off = _offloaded(model, **kwargs)
    for b in _batches(cfg, steps):
        _step(model, b)
    return off


def test_activation_offloader_auto_calibrates_then_settles_within_max_slowdown():
    """offload='auto' with a generous max_slowdown: calibrate_steps steps with nothing
    paged, then every block paged, measured tune_window steps, kept."""
    cfg, _, model = _pair()
    off = _run_auto(model, cfg, 2 + 1 + 2 + 2, offload="auto", calibrate_steps=2,
                    tune_window=2, max_slowdown=100.0)
    kinds = [e["kind"] for e in off.events]
    assert kinds == ["plan", "tune", "settled"], off.events
    assert off.events[0]["policy"] == ["keep"] * 4
    assert off.policy == ["offload"] * 4 and not off.adapting
    assert off.decision["settled"] and off.decision["baseline_s"] > 0
    assert off.decision["offloaded_blocks"] == [0, 1, 2, 3]
    assert [h["offloaded"] for h in off.decision["history"]] == [0, 4]
    assert min(off.decision["activation_bytes_per_block"]) > 0
    assert off.stats["bytes_offloaded"] > 0
    off.remove()


def test_activation_offloader_auto_still_calibrating():
    cfg, _, model = _pair()
    off = _run_auto(model, cfg, 3, offload="auto", calibrate_steps=3)
    assert off.adapting and off.policy == ["keep"] * 4
    assert off.stats["bytes_offloaded"] == 0, "nothing pages while calibrating"
    off.remove()


def test_activation_offloader_profile_sizes_the_first_guess():
    """A link too slow for one block's activations within the allowed slowdown: the
    first guess is no block, and the search settles after calibration."""
    slow = trainstream.HardwareProfile(key="slow", measured_at=0.0, h2d_gb_s=1e-9,
                                       d2h_gb_s=1e-9)
    cfg, _, model = _pair()
    off = _run_auto(model, cfg, 3, offload="auto", calibrate_steps=2, profile=slow)
    assert not off.adapting and off.policy == ["keep"] * 4
    assert "nothing pages" in off.decision["why"]
    fast = trainstream.HardwareProfile(key="fast", measured_at=0.0, h2d_gb_s=1e6, d2h_gb_s=1e6)
    cfg, _, model = _pair()
    off2 = _run_auto(model, cfg, 3, offload="auto", calibrate_steps=2, profile=fast)
    assert off2.policy == ["offload"] * 4 and off2.adapting
    off.remove()
    off2.remove()


def test_activation_offloader_reserved_link_bytes_leave_less_room():
    fast = trainstream.HardwareProfile(key="fast", measured_at=0.0, h2d_gb_s=1.0, d2h_gb_s=1.0)
    cfg, _, model = _pair()
    # 100 GB already crossing the link each step: no room for activations.
    off = _run_auto(model, cfg, 3, offload="auto", calibrate_steps=2, profile=fast,
                    reserved_link_bytes=(100 * 10**9, 100 * 10**9))
    assert off.policy == ["keep"] * 4 and not off.adapting
    off.remove()


def test_activation_offloader_memory_pressure_tries_recompute():
    cfg, ref, model = _pair()
    # Forwards: 2 calibrating, 1 + 1 paging, 1 + 1 recomputing, and the one that ends it.
    off = _run_auto(model, cfg, 2 + 2 + 2 + 1, offload="auto", calibrate_steps=2,
                    tune_window=1, max_slowdown=100.0, memory_pressure=True)
    whys = " ".join(e.get("why", "") for e in off.events)
    assert "trying recompute" in whys and "kept for blocks" in whys, off.events
    assert not off.adapting
    assert set(off.policy) <= {"offload", "recompute"} and len(set(off.policy)) == 1
    assert any(h["recompute"] for h in off.decision["history"])
    off.remove()


def test_activation_offloader_vram_target_is_taken():
    cfg, _, model = _pair()
    off = _offloaded(model, vram_target=1 << 30)
    assert off.vram_target == 1 << 30
    off.remove()


def test_activation_offloader_remove_restores_the_model():
    cfg, ref, model = _pair()
    batch = _batches(cfg, 1)[0]
    off = _offloaded(model, offload=True)
    assert all("forward" in b.__dict__ for b in model.blocks)
    off.remove()
    assert all("forward" not in b.__dict__ for b in model.blocks)
    assert not model._forward_pre_hooks
    before = off.stats["bytes_offloaded"]
    ref(*batch).backward()
    model(*batch).backward()
    _assert_grads_equal(ref, model, 0)
    assert off.stats["bytes_offloaded"] == before


def test_activation_offloader_without_blocks_is_the_context_pager():
    cfg, ref, model = _pair()
    batch = _batches(cfg, 1)[0]
    ref(*batch).backward()
    off = trainstream.ActivationOffloader(model, min_bytes=0)
    assert off.policy == []
    with off:
        loss = model(*batch)
    loss.backward()
    _assert_grads_equal(ref, model, 0)
    assert off.stats["tensors_offloaded"] > 0
    off.remove()


@pytest.mark.parametrize("kwargs, fragment", [
    ({"offload": "always"}, "offload='always'"), ({"offload": 1.5}, "offload=1.5"),
    ({"offload": [9]}, "out of range"), ({"recompute": "some"}, "recompute='some'"),
    ({"min_bytes": -1}, "min_bytes=-1"), ({"prefetch_depth": 0}, "prefetch_depth=0"),
    ({"calibrate_steps": 1}, "calibrate_steps=1"), ({"tune_window": 0}, "tune_window=0"),
    ({"max_slowdown": -0.1}, "max_slowdown=-0.1"),
    ({"max_inflight_bytes": 0}, "max_inflight_bytes=0"),
    ({"profile": 3}, "profile=3"), ({"reserved_link_bytes": (1,)}, "reserved_link_bytes"),
    ({"memory_pressure": 1}, "memory_pressure=1"), ({"vram_target": 0}, "vram_target=0"),
    ({"min_bytes": 1, "min_offload_bytes": 2}, "one setting"),
], ids=lambda v: v if isinstance(v, str) else "-".join(v) if isinstance(v, dict) else None)
def test_activation_offloader_bad_values(kwargs, fragment):
    _, _, model = _pair()
    with pytest.raises(ValueError, match=fragment):
        trainstream.ActivationOffloader(model, model.blocks, **kwargs)


def test_activation_offloader_bad_blocks():
    _, _, model = _pair()
    with pytest.raises(ValueError, match="submodule"):
        trainstream.ActivationOffloader(model, [nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="non-empty"):
        trainstream.ActivationOffloader(model, [])
    with pytest.raises(ValueError, match="pass blocks="):
        trainstream.ActivationOffloader(model, offload=False)


# ------------------------------------------------------------------ the tuner itself
def _feed(tuner, times, peaks=None):
    out = []
    for k, t in enumerate(times):
        out.append(tuner.observe(t, None if peaks is None else peaks[k]))
    return out


def test_tuner_halves_until_within_max_slowdown():
    t = OffloadTuner(8, calibrate_steps=3, tune_window=2, max_slowdown=0.15)
    _feed(t, [9.0, 1.0, 1.1])                 # warm-up, then the baseline: 1.0
    assert t.baseline_s == 1.0 and t.count == 8
    _feed(t, [5.0, 2.0, 2.0])                 # discarded, then 8 blocks: +100%
    assert t.count == 4 and not t.settled
    _feed(t, [5.0, 1.3, 1.25])                # 4 blocks: +25%
    assert t.count == 2
    _feed(t, [5.0, 1.1, 1.2])                 # 2 blocks: +10%: settles
    assert t.settled and t.count == 2
    assert [h["offloaded"] for h in t.history] == [0, 8, 4, 2]
    assert t.observe(100.0) is None and t.count == 2


def test_tuner_gives_up_at_one_block():
    t = OffloadTuner(2, calibrate_steps=2, tune_window=1, max_slowdown=0.0)
    _feed(t, [1.0, 1.0, 9.0, 2.0, 9.0, 2.0])
    assert t.settled and t.count == 0 and "nothing pages" in t.why


def test_tuner_vram_target_goes_back_to_the_setting_that_fitted():
    t = OffloadTuner(8, calibrate_steps=2, tune_window=1, max_slowdown=0.1, vram_target=100)
    _feed(t, [1.0, 1.0], [0, 0])
    _feed(t, [9.0, 2.0], [0, 90])             # 8 blocks: fits, too slow
    assert t.count == 4
    _feed(t, [9.0, 1.05], [0, 150])           # 4 blocks: fast enough but over the target
    assert t.settled and t.count == 8


@pytest.mark.parametrize("recompute_s, chosen", [(0.5, True), (1.19, False), (1.5, False)],
                         ids=["recompute-faster", "recompute-within-margin",
                              "recompute-slower"])
def test_tuner_recompute_trial(recompute_s, chosen):
    t = OffloadTuner(4, calibrate_steps=2, tune_window=1, max_slowdown=0.5,
                     recompute_trial=True)
    _feed(t, [1.0, 1.0, 9.0, 1.2])            # 4 blocks: +20%, within
    assert t.recompute and not t.settled
    _feed(t, [9.0, recompute_s])
    assert t.settled and t.recompute is chosen and t.count == 4


def test_tuner_first_guess():
    t = OffloadTuner(8, calibrate_steps=2, tune_window=1, max_slowdown=0.1,
                     first_guess=lambda baseline: 3)
    _feed(t, [1.0, 1.0])
    assert t.count == 3

