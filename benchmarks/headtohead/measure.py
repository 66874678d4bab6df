"""What compare.py measures in an engine's process, the same way for every engine.

- Step time: the device synchronized before and after each step; the median of
  ``steps`` steps taken after the warm-up (``warmup`` steps, and for TrainStream on
  until ``session.adapting`` is False, at most ``max_warmup`` steps).
- Peak VRAM over the whole run, three readings: torch's allocated and reserved bytes
  (``max_memory_allocated`` read after setup and after every step and sampled by a
  thread, so a library that resets torch's peak counter cannot hide a peak from
  before its reset), and the device's used memory from NVML (pynvml, else
  ``nvidia-smi``) sampled by the thread, less what was in use before this process
  touched CUDA (it counts the CUDA context and allocations outside torch's allocator).
- Host memory: the process's proportional set size less its shared-memory pages
  (``/proc/self/smaps_rollup``: Pss - Pss_Shmem; a page shared with another process
  counts by its share, never twice) plus the TrainStream daemon's shared memory
  (``budget.used`` of its status: each TrainStream engine gets a daemon of its own, so
  that is this engine's), sampled by the thread, peak kept. Beside it the machine's
  used memory (MemTotal - MemAvailable) over what was used when the process started:
  a cross-check that also sees pinned host allocations.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional


# Note [One line, one write]
# The training loop and the Sampler's thread both print LIVE lines, and the child's
# last line is its RESULT. print() writes the text and its newline in two calls, so two
# threads could interleave ("LIVE {..}LIVE {..}\n\n"); the parent then could not parse
# the merged line, and a RESULT glued behind a LIVE record was lost (seen in CI under
# load: an engine that trained and exited 0 reported "exit 0" and no result). Every
# line goes out whole, in one write under one lock.
_STDOUT_LOCK = threading.Lock()


def emit_line(text: str) -> None:
    """Writes ``text`` and its newline to stdout in one write, and flushes."""
    with _STDOUT_LOCK:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def _emit(record: dict) -> None:
    emit_line("LIVE " + json.dumps(record))


def smaps_rollup(pid="self") -> Dict[str, int]:
    """The kB fields of /proc/<pid>/smaps_rollup, in bytes ({} where it is absent)."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except OSError:
        pass
    return out


def own_host_bytes(rollup: Dict[str, int]) -> int:
    """The process's own share of host memory: Pss less Pss_Shmem (shared-memory pages,
    which the daemon's figure counts)."""
    return max(0, rollup.get("Pss", 0) - rollup.get("Pss_Shmem", 0))


def machine_used_bytes() -> int:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0]) * 1024
    return info["MemTotal"] - info.get("MemAvailable", info.get("MemFree", 0))


class DeviceMemory:
    """The used memory of one GPU from NVML (pynvml) or, without it, nvidia-smi;
    ``source`` says which, or why neither ("" while not asked)."""

    def __init__(self, index):
        self.index = index  # a number, or a GPU's UUID ("GPU-...")
        self.source = ""
        self._handle = None
        try:
            import pynvml
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(index) if isinstance(index, str) \
                else pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
            self.source = "nvml"
        except Exception as e:  # noqa: BLE001 (no NVML: nvidia-smi, else none)
            why = f"pynvml: {type(e).__name__}: {e}"
            if self._smi() is not None:
                self.source = "nvidia-smi"
            else:
                self.source = f"none ({why}; nvidia-smi failed too)"

    def _smi(self) -> Optional[int]:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                                  "--format=csv,noheader,nounits", "-i", str(self.index)],
                                 capture_output=True, text=True, timeout=10)
            return int(out.stdout.strip().splitlines()[0]) << 20 if out.returncode == 0 else None
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def used(self) -> Optional[int]:
        if self._handle is not None:
            return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        if self.source == "nvidia-smi":
            return self._smi()
        return None


def visible_gpu_index():
    """The GPU this process's cuda:0 is, for NVML: CUDA_VISIBLE_DEVICES's first entry
    (its physical index, or its UUID), else 0."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    if first.isdigit():
        return int(first)
    return first if first.startswith("GPU-") else 0


class Sampler(threading.Thread):
    """Samples memory every ``interval`` s until ``stop()``; keeps the peaks. Made
    before the engine's setup touches CUDA (NVML's baseline is read then)."""

    def __init__(self, interval: float, cuda: bool, socket: Optional[str], live: bool,
                 machine_baseline: int):
        super().__init__(daemon=True)
        self.interval = interval
        self.cuda = cuda
        self.live = live
        self.socket = socket
        self.machine_baseline = machine_baseline
        self.device = DeviceMemory(visible_gpu_index()) if cuda else None
        self.nvml_baseline = self.device.used() if self.device is not None else None
        self.peaks: Dict[str, int] = {}
        self.samples = 0
        self._halt = threading.Event()
        self._daemon = None
        self.daemon_error = ""

    def _daemon_used(self) -> int:
        if self.socket is None:
            return 0
        try:
            if self._daemon is None:
                from trainstream._native import daemon
                self._daemon = daemon.connect(self.socket, spawn=False)
            return int(json.loads(self._daemon.status_json())["budget"]["used"])
        except Exception as e:  # noqa: BLE001 (reported in the result; sampling goes on)
            self.daemon_error = f"{type(e).__name__}: {e}"
            return 0

    def note(self, **readings: int) -> None:
        for k, v in readings.items():
            if v is not None and v > self.peaks.get(k, -1):
                self.peaks[k] = int(v)

    def torch_peaks(self) -> None:
        """torch's peak counters now (called after setup and after each step)."""
        if self.cuda:
            import torch
            self.note(torch_allocated=torch.cuda.max_memory_allocated(),
                      torch_reserved=torch.cuda.max_memory_reserved())

    def sample(self) -> Dict[str, Any]:
        rec: Dict[str, Any] = {}
        if self.cuda:
            import torch
            rec["torch_allocated"] = torch.cuda.memory_allocated()
            rec["torch_reserved"] = torch.cuda.memory_reserved()
            used = self.device.used()
            if used is not None and self.nvml_baseline is not None:
                rec["nvml_used"] = max(0, used - self.nvml_baseline)
        own = own_host_bytes(smaps_rollup())
        shm = self._daemon_used()
        rec.update(host_own=own, daemon_shm=shm, host=own + shm,
                   machine_used=max(0, machine_used_bytes() - self.machine_baseline))
        self.note(**rec)
        self.samples += 1
        if self.live:
            _emit({"type": "memory", "t": round(time.time(), 3), **rec})
        return rec

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            self.sample()

    def stop(self) -> Dict[str, int]:
        self._halt.set()
        self.join(timeout=10)
        self.sample()
        self.torch_peaks()
        return dict(self.peaks)


def train(step: Callable[[], Any], *, steps: int, warmup: int, max_warmup: int,
          adapting: Callable[[], bool], sync: Callable[[], None], sampler: Sampler,
          live: bool) -> Dict[str, Any]:
    """Runs the warm-up and ``steps`` measured steps; returns the times and losses.
    The warm-up ends at the first step >= ``warmup`` where ``adapting()`` is False, or
    at ``max_warmup`` (``still_adapting`` then says so)."""
    times: List[float] = []
    losses: List[float] = []
    warm: Optional[int] = None
    still_adapting = False
    n = 0
    while warm is None or n < warm + steps:
        if warm is None and n >= warmup:
            busy = adapting()
            if not busy or n >= max_warmup:
                warm, still_adapting = n, busy
        sync()
        t = time.perf_counter()
        loss = step()
        sync()
        dt = time.perf_counter() - t
        value = float(loss.detach().float().item())
        times.append(dt)
        losses.append(round(value, 4))
        sampler.torch_peaks()
        if live:
            _emit({"type": "step", "step": n, "s": round(dt, 4), "loss": round(value, 4),
                   "warmup": warm is None, "adapting": bool(adapting())})
        n += 1
    measured = sorted(times[warm:])
    return {"step_s": round(measured[len(measured) // 2], 4),
            "step_times": [round(t, 4) for t in times[warm:]],
            "warmup_times": [round(t, 4) for t in times[:warm]],
            "warmup_steps": warm, "still_adapting": still_adapting, "losses": losses,
            "loss_decreased": losses[-1] < losses[0]}


def matmul_paths(model) -> Dict[str, int]:
    """How many of the model's quantized linears ran each matmul path (``quant_report``'s
    ``matmul_path``; an FP8 base on Hopper: the tensor cores or dequantized to bf16);
    empty for a model with none."""
    from trainstream.frozen.quantization import quant_report
    paths: Dict[str, int] = {}
    for q in quant_report(model):
        paths[q["matmul_path"]] = paths.get(q["matmul_path"], 0) + 1
    return paths


def fp8_copies_checked(model) -> Dict[str, int]:
    """For each quantized linear holding an FP8 tensor-core copy (a resident block's,
    quantization.py), whether that copy still equals one rebuilt now from the weight it
    stands for: "fresh" and "stale" counts (both 0 without such copies). A stale copy
    means the forward ran on other weights than the backward's dequantized ones. Out of
    device memory for the rebuild: the counts so far and "error"."""
    import torch
    from trainstream.frozen.quantization import QuantLinear
    counts = {"fresh": 0, "stale": 0}
    for m in model.modules():
        if not isinstance(m, QuantLinear) or m._fp8_cache is None:
            continue
        kept = m._fp8_cache
        m._fp8_cache = None
        try:
            w, s = m._fp8_weight(kept[0])
            same = torch.equal(w.view(torch.uint8), kept[1].view(torch.uint8)) and torch.equal(s, kept[2])
        except torch.OutOfMemoryError as e:
            return dict(counts, error=f"out of device memory rebuilding a copy: {e}"[:200])
        finally:
            m._fp8_cache = kept
        counts["fresh" if same else "stale"] += 1
        del w, s
    return counts


def describe_machine() -> Dict[str, Any]:
    """The machine the results come from: GPU, driver, CPU model and cores, RAM, torch
    and CUDA versions, and pinned PCIe H2D / D2H GB/s measured now (256 MiB copies,
    trainstream.profile_hardware)."""
    import platform

    import torch
    out: Dict[str, Any] = {"cpu_cores": os.cpu_count(), "python": platform.python_version(),
                           "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        with open("/proc/cpuinfo") as f:
            out["cpu"] = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        out["cpu"] = platform.processor() or "unknown"
    with open("/proc/meminfo") as f:
        out["ram_bytes"] = int(f.readline().split()[1]) * 1024
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_count=torch.cuda.device_count(),
                   vram_bytes=props.total_memory, capability=f"{props.major}.{props.minor}")
        try:
            import pynvml
            pynvml.nvmlInit()
            out["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # noqa: BLE001 (the driver version is a detail)
            pass
        import trainstream
        prof = trainstream.profile_hardware(quick=False, force=True)
        out.update(pcie_h2d_gb_s=round(prof.h2d_gb_s, 1), pcie_d2h_gb_s=round(prof.d2h_gb_s, 1),
                   matmul_bf16_tflops=round(prof.matmul_bf16_tflops, 1))
    else:
        out["gpu"] = None
    return out
