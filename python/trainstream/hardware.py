"""profile_hardware(): the figures the memory planner needs, measured once and cached."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict

import torch


def _cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    return os.path.join(base, "trainstream", "hardware.json")


def _key() -> str:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return f"{dev}|torch {torch.__version__}|{os.cpu_count()} cpus"


def _timed(fn, repeat: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeat


def profile_hardware(refresh: bool = False, size_mib: int = 256) -> Dict[str, Any]:
    """PCIe H2D/D2H GB/s (pinned), host AdamW Gparam/s (torch's CPU AdamW, the
    baseline the daemon's engine is compared with) and bf16 matmul TFLOP/s.

    Cached per (device, torch version, CPU count) in ~/.cache/trainstream/hardware.json;
    ``refresh=True`` measures again.
    """
    path, key = _cache_path(), _key()
    cache: Dict[str, Any] = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                cache = json.load(f)
        except (OSError, ValueError):
            cache = {}
    if not refresh and key in cache:
        return cache[key]
    out: Dict[str, Any] = {"key": key, "measured_at": time.time()}
    n = size_mib * (1 << 20) // 4
    if torch.cuda.is_available():
        host = torch.empty(n, dtype=torch.float32, pin_memory=True)
        dev = torch.empty(n, dtype=torch.float32, device="cuda")
        t = _timed(lambda: dev.copy_(host, non_blocking=True), 5)
        out["h2d_gb_s"] = host.numel() * 4 / t / 1e9
        t = _timed(lambda: host.copy_(dev, non_blocking=True), 5)
        out["d2h_gb_s"] = host.numel() * 4 / t / 1e9
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        t = _timed(lambda: a @ a, 10)
        out["matmul_bf16_tflops"] = 2 * 4096 ** 3 / t / 1e12
    numel = 1 << 22
    p = torch.zeros(numel, requires_grad=True)
    p.grad = torch.randn(numel)
    kwargs = {"fused": True} if _cpu_fused_adamw() else {"foreach": True}
    opt = torch.optim.AdamW([p], lr=1e-3, **kwargs)
    t = _timed(opt.step, 5)
    out["host_adamw_torch_gparams_s"] = numel / t / 1e9
    out["host_adamw_torch_impl"] = next(iter(kwargs))
    cache[key] = out
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(cache, f, indent=1)
    except OSError:
        pass
    return out


def _cpu_fused_adamw() -> bool:
    try:
        p = torch.zeros(2, requires_grad=True)
        p.grad = torch.zeros(2)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, ValueError):
        return False
