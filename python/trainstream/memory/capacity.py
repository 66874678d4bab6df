"""Measure: what the machine offers the memory planner.

``measure_capacity(device, ...)`` reads the device memory free for this process (and,
with ``vram_limit``, caps the allocator there), the host RAM available and the PCIe
H2D bandwidth; ``profile_hardware()`` measures the bandwidths and throughputs once
and caches them (a ``HardwareProfile``). The planner (planner.py) decides from a ``Capacity`` and touches no
device itself.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, fields
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


def _key(device: Optional[torch.device]) -> str:
    dev = torch.cuda.get_device_name(device) if device is not None else "cpu"
    return f"{dev}|torch {torch.__version__}|{os.cpu_count()} cpus"


def _timed(fn, repeat: int, cuda: bool) -> float:
    fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeat


# The figures a HardwareProfile holds, in the order summary() writes them.
_FIGURES = (("h2d_gb_s", "PCIe host to device", "GB/s"),
            ("d2h_gb_s", "PCIe device to host", "GB/s"),
            ("matmul_bf16_tflops", "bf16 matmul 4096^3", "TFLOP/s"),
            ("host_adamw_torch_gparams_s", "host AdamW (torch, CPU)", "Gparam/s"))


@dataclass
class HardwareProfile:
    """What ``profile_hardware()`` measured on this machine. A GPU figure is None when
    there was no CUDA device to measure. Reads also as the dict it was before
    (``profile["h2d_gb_s"]``, ``.get(name, default)``; a None figure is absent)."""
    key: str
    measured_at: float
    device: str = "cpu"
    h2d_gb_s: Optional[float] = None
    d2h_gb_s: Optional[float] = None
    matmul_bf16_tflops: Optional[float] = None
    host_adamw_torch_gparams_s: Optional[float] = None
    host_adamw_torch_impl: Optional[str] = None
    threads: Optional[int] = None      # torch CPU threads the AdamW benchmark ran with
    quick: bool = True                 # measured with the shorter benchmarks

    def as_dict(self) -> Dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "HardwareProfile":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def __getitem__(self, name: str) -> Any:
        value = self.as_dict().get(name)
        if value is None:
            raise KeyError(name)
        return value

    def __contains__(self, name: object) -> bool:
        return name in self.as_dict()

    def get(self, name: str, default: Any = None) -> Any:
        return self.as_dict().get(name, default)

    def keys(self):
        return self.as_dict().keys()

    def summary(self, print_it: bool = True) -> str:
        """The figures as readable lines (printed too unless ``print_it=False``)."""
        lines = [f"TrainStream hardware profile ({self.key}; "
                 f"{'quick' if self.quick else 'full'} benchmarks, "
                 f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(self.measured_at))})"]
        for name, what, unit in _FIGURES:
            value = getattr(self, name)
            shown = f"{value:.2f} {unit}" if value is not None else "absent (no CUDA device)"
            lines.append(f"  {what:<26} {shown}")
        if self.host_adamw_torch_impl:
            lines[-1] += f" ({self.host_adamw_torch_impl}, {self.threads} threads)"
        text = "\n".join(lines)
        if print_it:
            print(text)
        return text


def _profile_device(device) -> Optional[torch.device]:
    """The CUDA device to measure (None: none, host figures only); ValueError for a
    device this process cannot measure."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else None
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cuda", "cpu"):
        raise ValueError(f"profile_hardware(device={device!r}) is not accepted; accepted: None "
                         "(the current GPU), 'cuda', 'cuda:N', an int N, 'cpu' or a torch.device")
    if dev.type == "cpu":
        return None
    if not torch.cuda.is_available():
        raise ValueError(f"profile_hardware(device={device!r}): CUDA is not available in this "
                         "process; accepted here: None or 'cpu' (host figures only)")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(f"profile_hardware(device={device!r}): this process sees "
                         f"{torch.cuda.device_count()} GPU(s) (0..{torch.cuda.device_count() - 1})")
    return torch.device("cuda", index)


def profile_hardware(device=None, quick: bool = True, force: bool = False,
                     threads: Optional[int] = None) -> HardwareProfile:
    """Measures PCIe H2D/D2H GB/s (pinned), bf16 matmul TFLOP/s on ``device`` (default
    the current GPU; none without CUDA) and host AdamW Gparam/s (torch's CPU AdamW, the
    baseline the daemon's engine is compared with) with ``threads`` CPU threads
    (default torch's). ``quick``: shorter benchmarks (64 MiB copies instead of 256).

    Cached per (device, torch version, CPU count) in ~/.cache/trainstream/hardware.json
    ($XDG_CACHE_HOME): a cached profile is returned unless ``force``, or it was quick and
    a full one is asked for, or it ran with other ``threads``.
    """
    for name, value in (("quick", quick), ("force", force)):
        if not isinstance(value, bool):
            raise ValueError(f"profile_hardware({name}={value!r}) is not accepted; accepted: "
                             "True or False")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ValueError(f"profile_hardware(threads={threads!r}) is not accepted; accepted: "
                         "None (torch's thread count) or an integer >= 1")
    dev = _profile_device(device)
    path, key = _cache_path(), _key(dev)
    cache: Dict[str, Any] = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                cache = json.load(f)
        except (OSError, ValueError):
            cache = {}
    cached = cache.get(key)
    if isinstance(cached, dict) and not force:
        hit = HardwareProfile.from_dict(cached) if "key" in cached and "measured_at" in cached \
            else None
        if hit is not None and (quick or not hit.quick) and \
                (threads is None or hit.threads == threads):
            return hit
    out = HardwareProfile(key=key, measured_at=time.time(), device=str(dev or "cpu"),
                          quick=quick)
    if dev is not None:
        with torch.cuda.device(dev):
            n = (64 if quick else 256) * (1 << 20) // 4
            host = torch.empty(n, dtype=torch.float32, pin_memory=True)
            on_dev = torch.empty(n, dtype=torch.float32, device=dev)
            repeat = 3 if quick else 5
            t = _timed(lambda: on_dev.copy_(host, non_blocking=True), repeat, True)
            out.h2d_gb_s = host.numel() * 4 / t / 1e9
            t = _timed(lambda: host.copy_(on_dev, non_blocking=True), repeat, True)
            out.d2h_gb_s = host.numel() * 4 / t / 1e9
            a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
            t = _timed(lambda: a @ a, 5 if quick else 10, True)
            out.matmul_bf16_tflops = 2 * 4096 ** 3 / t / 1e12
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        numel = 1 << (20 if quick else 22)
        p = torch.zeros(numel, requires_grad=True)
        p.grad = torch.randn(numel)
        kwargs = {"fused": True} if _cpu_fused_adamw() else {"foreach": True}
        opt = torch.optim.AdamW([p], lr=1e-3, **kwargs)
        t = _timed(opt.step, 3 if quick else 5, False)
        out.host_adamw_torch_gparams_s = numel / t / 1e9
        out.host_adamw_torch_impl = next(iter(kwargs))
        out.threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    cache[key] = out.as_dict()
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
    # profile=False (wrap's option): no measurement, no bandwidth figure for the planner.
    h2d = profile_hardware(index).get("h2d_gb_s", 0.0) if profile else 0.0  # before the cap
    cap = total
    source = f"{format_bytes(total)} device"
    if vram_limit is not None:
        cap = min(vram_limit, total)
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), index)
        source = f"vram_limit {format_bytes(cap)}"
    usable = min(cap, free + reserved) - max(0, allocated - model_device_bytes)
    return Capacity(str(device), max(0, usable), ram, daemon_free, h2d_gb_s=h2d, source=source)
