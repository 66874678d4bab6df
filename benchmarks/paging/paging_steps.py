"""What bench_paging.py's case processes measure around a training step: the step itself,
a profiled step, the allocator's churn, host RSS, CPU pinning, and what a failed case
leaves to diagnose it.
"""
from __future__ import annotations

import os
import time

def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def gib(n) -> float:
    return round(n / 2**30, 2)


WRAPPED = {}  # the wrapped model (and its frozen base), so a failed case can still report the plan


def failure_report(torch) -> dict:
    """What a failed case leaves to diagnose it: the plan and events, and with
    TS_BENCH_SNAPSHOT=path the allocator's history (torch.cuda.memory._dump_snapshot)."""
    r = {}
    model = WRAPPED.get("model")
    if model is not None:
        import trainstream
        try:
            rep = trainstream.memory_report(model)
            r["plan"] = rep.get("plan")
            r["activations"] = rep.get("activations")
            r["events"] = [{k: v for k, v in e.items() if k != "time"} for e in rep["events"]]
        except Exception as e:  # noqa: BLE001 (best effort while reporting a failure)
            r["plan_error"] = repr(e)
    path = os.environ.get("TS_BENCH_SNAPSHOT")
    if path and torch.cuda.is_available():
        torch.cuda.memory._dump_snapshot(path)
        r["snapshot"] = path
    return r


def alloc_stats(cuda: bool) -> dict:
    if not cuda:
        return {}
    import torch
    s = torch.cuda.memory_stats()
    return {k: s.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free",
                                     "num_sync_all_streams")}


def train_step(model, opt, ids, dev, mode):
    """One training step of the benchmark (bf16 autocast unless a full fine-tune);
    returns the loss."""
    import torch
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=mode != "full"):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def profile_step(model, opt, ids, dev, mode, cuda) -> dict:
    """One more step under torch.profiler: the device's busy time against the wall time
    (a step far longer than its kernels waits on the host or on copies), and the
    costliest operators."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        train_step(model, opt, ids, dev, mode)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    busy = sum(getattr(e, key, 0) for e in events) / 1e6
    top = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:12]
    return {"wall_s": round(wall, 4), "device_busy_s": round(busy, 4),
            "top": [[e.key, e.count, round(getattr(e, key, 0) / 1e3, 2),
                     round(e.self_cpu_time_total / 1e3, 2)] for e in top],
            "columns": ["op", "calls", "self device ms", "self cpu ms"]}


def pin_to_gpu_local_cpus(torch) -> dict:
    """Pins this process to the CPUs local to GPU 0 (sysfs), so that every run launches
    from the same socket: on a two-socket host, where the scheduler puts a process
    otherwise changes a host-bound step's time from run to run."""
    props = torch.cuda.get_device_properties(0)
    bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    where = {"gpu_pci": bus}
    try:
        with open(f"/sys/bus/pci/devices/{bus}/local_cpulist") as f:
            text = f.read().strip()
        with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
            where["gpu_numa_node"] = int(f.read())
    except OSError as e:
        where["pinned"] = f"not pinned: {e}"
        return where
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    cpus &= os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpus)
    where["pinned"] = f"{len(cpus)} CPUs ({text})" if cpus else "not pinned: no allowed local CPU"
    return where
