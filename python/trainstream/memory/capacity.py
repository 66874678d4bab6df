"""Measure: what the machine offers the memory planner.

``measure_capacity(device, ...)`` reads the device memory free for this process (and,
with ``vram_limit``, caps the allocator there), the host RAM available and the PCIe
H2D bandwidth; ``profile_hardware()`` measures the bandwidths and throughputs once
and caches them. The planner (planner.py) decides from a ``Capacity`` and touches no
device itself.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

GiB = float(1 << 30)


@dataclass
class Capacity:
    device: str
    vram_bytes: Optional[int]     # usable device memory before headroom; None: unlimited
    ram_available: int
    daemon_free: Optional[int]    # None: not known (no daemon asked)
    h2d_gb_s: float = 0.0
    source: str = ""


def format_bytes(n: float) -> str:
    """``n`` bytes as the planner's messages write them ("1.50 GiB")."""
    for unit, size in (("GiB", GiB), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if abs(n) >= size or unit == "KiB":
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


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


def ram_available() -> int:
    """MemAvailable from /proc/meminfo (bytes); available physical pages elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def measure_capacity(device, vram_limit: Optional[int], daemon_free: Optional[int],
                     model_device_bytes: int = 0, profile: bool = True) -> Capacity:
    """Capacity of ``device`` now. With CUDA, ``vram_limit`` also caps this process's
    allocator (``torch.cuda.set_per_process_memory_fraction``). ``profile=False`` (wrap's
    option): no PCIe measurement, and the planner sees no bandwidth figure."""
    device = torch.device(device)
    ram = ram_available()
    if device.type != "cuda":
        return Capacity(str(device), vram_limit, ram, daemon_free,
                        source="declared vram_limit" if vram_limit else "")
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    free, _ = torch.cuda.mem_get_info(index)
    reserved = torch.cuda.memory_reserved(index)
    allocated = torch.cuda.memory_allocated(index)
    h2d = profile_hardware().get("h2d_gb_s", 0.0) if profile else 0.0  # before the cap: it copies 256 MiB
    cap = total
    source = f"{format_bytes(total)} device"
    if vram_limit is not None:
        cap = min(vram_limit, total)
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), index)
        source = f"vram_limit {format_bytes(cap)}"
    usable = min(cap, free + reserved) - max(0, allocated - model_device_bytes)
    return Capacity(str(device), max(0, usable), ram, daemon_free, h2d_gb_s=h2d, source=source)
