"""Training bigger than VRAM (issue 6): random-weight Qwen2.5 shapes under a VRAM cap.

Cases (each in its own process, so caps and peaks don't mix):

  7b-full       Qwen2.5-7B-shaped full fine-tune, bf16 weights, bf16 moments
  32b-lora-nf4  LoRA r=16 (all projections) on a Qwen2.5-32B-shaped NF4 base
  oom           a Qwen2.5-72B-shaped full fine-tune: must raise MemoryError at wrap()
  14b-lora-bf16 LoRA r=16 on a Qwen2.5-14B-shaped bf16 base, capped, plus the floors
  14b-lora-nf4  the same on an NF4 base

Each prints s/step, peak VRAM, host RSS and the daemon's shared memory, PCIe bytes and
GB/s, the loss per step and the planner's decisions, then a JSON line (RESULT ...).
The 14B cases also run uncapped with everything resident (the compute floor) and
compute the PCIe floor (bytes that must cross per step / 55 GB/s); goal: within 1.2x of
the larger.

    python benchmarks/paging/bench_paging.py --cases 7b-full,32b-lora-nf4,oom --cap-gib 24
    python benchmarks/paging/bench_paging.py --cases 14b-lora-bf16,14b-lora-nf4 --cap-gib 24
    python benchmarks/paging/bench_paging.py --tiny        # every case, tiny shapes, CPU ok

Models are built from transformers' Qwen2Config with random weights (nothing is
downloaded), layer by layer on the GPU when there is one (NF4 quantized there with
trainstream.quantization) and then moved to host memory, so building a 32B base
needs one layer's bf16 weights at a time, not 65 GB.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
try:
    import trainstream  # noqa: F401
except ImportError:  # run from the repository without PYTHONPATH: use build/python
    sys.path.insert(0, os.path.join(REPO, "build", "python"))
    os.environ["PYTHONPATH"] = os.path.join(REPO, "build", "python") + os.pathsep + \
        os.environ.get("PYTHONPATH", "")
PCIE_GB_S = 55.0

SHAPES = {  # Qwen2.5 published shapes
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
}
TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)
CASES = ("7b-full", "32b-lora-nf4", "oom", "14b-lora-bf16", "14b-lora-nf4")


def qwen_config(size: str, tiny: bool, vocab: int):
    from transformers import Qwen2Config
    shape = TINY if tiny else SHAPES[size]
    cfg = Qwen2Config(vocab_size=vocab, max_position_embeddings=32768, rope_theta=1e6,
                      rms_norm_eps=1e-6, **shape)
    cfg._attn_implementation = "sdpa"
    return cfg


def lora(linear, r: int, alpha: float = 32.0):
    """``linear`` (an nn.Linear or a QuantLinear, frozen) with a LoRA adapter:
    y = base(x) + (x A^T) B^T * (alpha / r); A and B (fp32) are trained."""
    import torch
    from torch import nn

    class LoRA(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base
            inp, out = _features(base)
            dev = next(base.buffers(), None)
            dev = dev.device if dev is not None else base.weight.device
            self.lora_A = nn.Parameter(torch.empty(r, inp, device=dev))
            self.lora_B = nn.Parameter(torch.zeros(out, r, device=dev))
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            self.scale = alpha / r

        def forward(self, x):
            y = self.base(x)
            a = x.to(self.lora_A.dtype) if not torch.is_autocast_enabled(x.device.type) else x
            return y + (a @ self.lora_A.t() @ self.lora_B.t()).to(y.dtype) * self.scale
    return LoRA(linear)


def _features(m):
    if hasattr(m, "in_features"):
        return m.in_features, m.out_features
    raise ValueError(type(m))


def build(size: str, *, tiny: bool, dtype, mode: str, init_device: str, vocab: int,
          lora_r: int = 16):
    """mode: 'full' (every weight trained), 'lora-bf16' or 'lora-nf4' (frozen base)."""
    import torch
    from torch import nn
    from transformers import Qwen2ForCausalLM
    from trainstream.frozen.quantization import QuantLinear
    cfg = qwen_config(size, tiny, vocab)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    rotary = type(model.model.rotary_emb)(config=cfg)  # real buffers, not meta
    model.model.rotary_emb = rotary
    g = torch.Generator(device=init_device).manual_seed(0)

    def materialize(module):
        module.to_empty(device=init_device, recurse=True)
        with torch.no_grad():
            for name, p in module.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02, generator=g)
                elif "norm" in name or name.endswith("weight"):
                    p.fill_(1.0)
                else:
                    p.zero_()
        module.to(dtype)
    for m in (model.model.embed_tokens, model.model.norm, model.lm_head):
        materialize(m)
        m.to("cpu")
    for layer in model.model.layers:
        materialize(layer)
        if mode != "full":
            layer.requires_grad_(False)
            for parent in list(layer.modules()):
                for name, child in list(parent.named_children()):
                    if isinstance(child, nn.Linear):
                        base = QuantLinear.from_linear(child, "nf4") if mode == "lora-nf4" \
                            else child
                        setattr(parent, name, lora(base, lora_r))
        layer.to("cpu")
    if mode != "full":
        for m in (model.model.embed_tokens, model.model.norm, model.lm_head):
            m.requires_grad_(False)
    if init_device == "cuda":
        torch.cuda.empty_cache()
    return model


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _gib(n) -> float:
    return round(n / 2**30, 2)


_WRAPPED = {}  # the wrapped model, so a failed case can still report the plan


def _failure_report(torch) -> dict:
    """What a failed case leaves to diagnose it: the plan and events, and with
    TS_BENCH_SNAPSHOT=path the allocator's history (torch.cuda.memory._dump_snapshot)."""
    r = {}
    model = _WRAPPED.get("model")
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


def _alloc_stats(cuda: bool) -> dict:
    if not cuda:
        return {}
    import torch
    s = torch.cuda.memory_stats()
    return {k: s.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free",
                                     "num_sync_all_streams")}


def _train_step(model, opt, ids, dev, mode):
    """One training step of the benchmark (bf16 autocast unless a full fine-tune);
    returns the loss."""
    import torch
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=mode != "full"):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _profile_step(model, opt, ids, dev, mode, cuda) -> dict:
    """One more step under torch.profiler: the device's busy time against the wall time
    (a step far longer than its kernels waits on the host or on copies), and the
    costliest operators."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        _train_step(model, opt, ids, dev, mode)
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


def _pin_to_gpu_local_cpus(torch) -> dict:
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


def run_case(args) -> dict:
    import torch
    import trainstream
    if os.environ.get("TS_BENCH_SNAPSHOT") and torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(max_entries=30000)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    case = args.case
    size = case.split("-")[0]
    mode = {"7b-full": "full", "oom": "full", "32b-lora-nf4": "lora-nf4",
            "14b-lora-bf16": "lora-bf16", "14b-lora-nf4": "lora-nf4"}[case]
    result = {"case": case, "tiny": args.tiny, "cap_gib": None if args.uncapped else args.cap_gib,
              "uncapped": args.uncapped}
    if cuda and args.pin:
        result["cpus"] = _pin_to_gpu_local_cpus(torch)
    vocab = 512 if args.tiny else 152064
    cap = None if args.uncapped else (args.cap_gib * 2**30 if cuda else
                                      (args.tiny_cap_kib << 10))
    options = dict(socket=args.socket, device=dev, vram_limit=cap, verbose=False)
    if args.uncapped:
        options.update(param_offload=False, activation_offload=False)
    elif args.tiny:
        # Tiny tensors: page them anyway, and (no measured peaks on a CPU) page activations.
        options.update(min_offload_bytes=1024, activation_offload=True if not cuda else "auto")
    if mode == "full":
        options["moment_dtype"] = "bfloat16" if case == "7b-full" else "auto"
    if case == "oom":
        from transformers import Qwen2ForCausalLM
        with torch.device("meta"):
            model = Qwen2ForCausalLM(qwen_config("72b", args.tiny, vocab)).to(torch.bfloat16)
        if args.tiny:  # a tiny model "cannot fit" a 4 KiB cap
            options["vram_limit"] = 4096
        t0 = time.perf_counter()
        try:
            trainstream.wrap(model, **options)
            result["error"] = "wrap() did not raise MemoryError"
        except MemoryError as e:
            result.update(memory_error=str(e), wrap_s=round(time.perf_counter() - t0, 3))
        return result
    t0 = time.perf_counter()
    model = build(size, tiny=args.tiny, dtype=torch.bfloat16, mode=mode,
                  init_device=dev, vocab=vocab)
    result["build_s"] = round(time.perf_counter() - t0, 1)
    result["params"] = sum(p.numel() for p in model.parameters())
    result["trained_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model, opt = trainstream.wrap(model, lr=args.lr, **options)
    result["wrap_s"] = round(time.perf_counter() - t0, 1)
    _WRAPPED["model"] = model
    session = model._trainstream_session
    seq, batch = (32, 2) if args.tiny else (args.seq, args.batch)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(vocab, (batch, seq), generator=g).to(dev)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def moved():
        rep = trainstream.memory_report(model)
        act = rep["activations"]
        t = rep["transfers"]
        return (rep["params"].get("bytes_h2d", 0) + t["bytes_d2h"] + t["bytes_h2d"]
                + t.get("bytes_pcie", 0) + 2 * act.get("bytes_offloaded", 0))
    losses, times = [], []
    peak = 0
    # Warm up for --warmup steps, and on while the plan still adapts (up to
    # --max-warmup): the measured steps are the settled plan's.
    warmup, step = None, 0
    while warmup is None or step < warmup + args.steps:
        if warmup is None and step >= args.warmup and (not session.adapting
                                                         or step >= args.max_warmup):
            warmup = step
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            bytes0 = moved()
            alloc0 = _alloc_stats(cuda)
        step += 1
        sync()
        t = time.perf_counter()
        loss = _train_step(model, opt, ids, dev, mode)
        sync()
        times.append(time.perf_counter() - t)
        losses.append(round(loss.item(), 4))
    measured = times[warmup:]
    # Allocator churn over the measured steps: retries (the cap made the caching
    # allocator free its cache and synchronize) and cudaMalloc/cudaFree calls.
    alloc = {k: v - alloc0.get(k, 0) for k, v in _alloc_stats(cuda).items()}
    if cuda:
        alloc["max_reserved_gib"] = _gib(torch.cuda.max_memory_reserved())
    profile = _profile_step(model, opt, ids, dev, mode, cuda) if args.profile else None
    step_s = sorted(measured)[len(measured) // 2]
    per_step = (moved() - bytes0) / max(1, args.steps)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    rep = trainstream.memory_report(model)
    status = json.loads(trainstream._native.daemon.connect(args.socket).status_json())
    result.update(
        step_s=round(step_s, 4), warmup_steps=warmup,
        step_times=[round(t, 4) for t in measured], allocator=alloc, losses=losses,
        loss_decreased=losses[-1] < losses[0],
        peak_vram_gib=_gib(peak), within_cap=(cap is None or peak <= cap),
        host_rss_gib=_gib(_rss()), daemon_shm_gib=_gib(status["budget"]["used"]),
        # Issue 20's figure: the daemon's state and staging plus this process's private
        # memory, per trained parameter (activation pages and bases not counted).
        host_per_param=rep.get("host_per_param"),
        pcie_bytes_per_step=int(per_step), pcie_gb_s=round(per_step / step_s / 1e9, 2),
        adapting=session.adapting, optimizer_mode=opt.optimizer_mode,
        plan={k: rep["plan"].get(k) for k in ("paged_blocks", "moment_dtype", "quantize",
                                              "usable_vram", "decisions")},
        activation_policy=rep["activations"].get("policy"),
        attention=rep["attention"],
        events=[{k: v for k, v in e.items() if k != "time"} for e in rep["events"]
                if e["kind"] in ("plan", "watchdog", "attention")])
    # Issue 20's figure: the daemon's shared memory plus this process's private pages
    # (not RSS, which counts the shared segments again) per trained parameter, and the
    # gradient pool (docs/staging-pool.md) with the time backward waited for its room.
    hpp, st = rep.get("host_per_param") or {}, opt.stats()
    private = (hpp.get("bytes") or {}).get("process private memory", 0)
    trained = result["trained_params"]
    result.update(
        host_private_gib=_gib(private),
        host_bytes_per_trained_param=(round((status["budget"]["used"] + private) / trained, 3)
                                      if trained else None),
        grad_pool_gib=_gib(st.get("grad_pool_bytes", 0)), pool_waits=st.get("pool_waits", 0),
        pool_wait_s=round(st.get("pool_wait_s", 0.0), 3),
        staging_per_param=hpp.get("staging_per_param"))
    if profile is not None:
        result["profile"] = profile
    if case.startswith("14b"):
        paged = rep["params"]
        # What must cross per step: the paged weights twice (forward, backward); LoRA
        # gradients and updates are negligible; activation paging is counted too.
        result["pcie_floor_s"] = round(per_step / (PCIE_GB_S * 1e9), 4)
        result["paged_blocks"] = len(paged.get("paged_blocks", []))
    # No unwrap(): it would copy the paged trained weights out of the daemon's slots,
    # and the process ends here anyway.
    return result


def run_case_process(cmd, case: str, timeout: float, stderr_tail: int = 800,
                     on_line=None, env=None) -> dict:
    """Runs one case's process (``cmd``): its last ``RESULT {json}`` line, or an error
    naming its exit status and the end of its stderr, or the timeout; with ``wall_s``.
    ``on_line``: called with each line of the process's stdout as it is printed (the
    case's live records), else stdout is read once the process ends. A result that
    comes from the exit status, not a RESULT line, carries it as ``exit_code``."""
    t0 = time.perf_counter()
    if on_line is None:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            r = json.loads(lines[-1][7:]) if lines else {
                "case": case, "error": f"exit {out.returncode}: {out.stderr[-stderr_tail:]}",
                "exit_code": out.returncode}
        except subprocess.TimeoutExpired:
            r = {"case": case, "error": f"timed out after {timeout} s"}
    else:
        r = _stream_case_process(cmd, case, timeout, stderr_tail, on_line, env)
    r["wall_s"] = round(time.perf_counter() - t0, 1)
    return r


def _stream_case_process(cmd, case, timeout, stderr_tail, on_line, env) -> dict:
    import threading
    with tempfile.TemporaryFile("w+") as err:
        # The caller's process group (no session of its own): a `timeout` around the
        # whole run, which signals its group, ends the case too.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        results = []

        def pump():  # a thread, so the timeout below holds while no line comes
            for line in proc.stdout:
                line = line.rstrip("\n")
                if line.startswith("RESULT "):
                    results.append(line[7:])
                on_line(line)
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            timed_out = True
        reader.join(timeout=10)
        err.seek(0)
        tail = err.read()[-stderr_tail:]
    if timed_out:
        return {"case": case, "error": f"timed out after {timeout} s"}
    if results:
        return json.loads(results[-1])
    return {"case": case, "error": f"exit {proc.returncode}: {tail}", "exit_code": proc.returncode}


def start_daemon(budget: str):
    """A private trainstreamd (the cases need a large shared-memory budget)."""
    from trainstream._native import daemon as _daemon
    binary = _daemon.daemon_binary() or os.path.join(REPO, "build", "bin", "trainstreamd")
    tmp = tempfile.mkdtemp(prefix="ts-bench-")
    shm = tempfile.mkdtemp(prefix="ts-bench-", dir="/dev/shm")
    sock = os.path.join(tmp, "trainstreamd.sock")
    log = open(os.path.join(tmp, "trainstreamd.log"), "w")
    proc = subprocess.Popen([binary, "--foreground", "--socket", sock, "--shm-dir", shm,
                             "--budget", budget], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            _daemon.connect(sock, spawn=False)
            break
        except Exception:  # noqa: BLE001 (not up yet)
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"trainstreamd did not start; log in {tmp}") from None
            time.sleep(0.1)
    return proc, sock, [tmp, shm]


def stop_daemon(proc, dirs, timeout: float = 30) -> None:
    """Stops what start_daemon started (``proc`` may be None: no daemon of ours) and
    removes ``dirs``."""
    if proc is not None:
        proc.terminate()
        proc.wait(timeout=timeout)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5, help="measured steps; the median is reported")
    ap.add_argument("--warmup", type=int, default=3,
                    help="steps before measuring, at least (default 3)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="14B cases: capped and uncapped runs, alternated, this many times each")
    ap.add_argument("--profile", action="store_true",
                    help="profile one extra step: device busy time and the top operators")
    ap.add_argument("--max-warmup", type=int, default=16,
                    help="warm up on while the plan adapts, up to this many steps (default 16)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: checks the script on CPU")
    ap.add_argument("--tiny-cap-kib", type=int, default=1024,
                    help="declared device capacity for --tiny on a CPU machine")
    ap.add_argument("--socket", default=None, help="an existing daemon (else a private one)")
    ap.add_argument("--budget", default="90%", help="shared-memory budget of the private daemon")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="do not pin each run to the CPUs local to the GPU")
    ap.add_argument("--uncapped", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        try:
            r = run_case(args)
        except Exception as e:  # noqa: BLE001 (reported, not hidden)
            import traceback
            import torch
            r = {"case": args.case, "error": f"{type(e).__name__}: {str(e)[:600]}",
                 "trace": traceback.format_exc()[-1500:]}
            if torch.cuda.is_available():
                r["peak_vram_gib"] = _gib(torch.cuda.max_memory_allocated())
            r.update(_failure_report(torch))
        print("RESULT " + json.dumps(r), flush=True)
        return 0
    proc = None
    cleanup = []
    if args.socket is None:
        proc, args.socket, cleanup = start_daemon(args.budget)
    results = []
    try:
        for case in args.cases.split(","):
            # The 14B cases alternate capped and uncapped runs (--repeat pairs): the
            # host's speed drifts between processes, and each pair sees the same drift.
            variants = [False, True] * args.repeat if case.startswith("14b") else [False]
            for uncapped in variants:
                cmd = [sys.executable, __file__, "--case", case, "--cap-gib", str(args.cap_gib),
                       "--batch", str(args.batch), "--seq", str(args.seq), "--steps",
                       str(args.steps), "--warmup", str(args.warmup), "--max-warmup",
                       str(args.max_warmup), "--lr", str(args.lr),
                       *(["--profile"] if args.profile else []),
                       *([] if args.pin else ["--no-pin"]),
                       "--socket", args.socket, "--tiny-cap-kib", str(args.tiny_cap_kib)]
                cmd += ["--tiny"] if args.tiny else []
                cmd += ["--uncapped"] if uncapped else []
                r = run_case_process(cmd, case, args.timeout)
                results.append(r)
                print(json.dumps(r, indent=1), flush=True)
    finally:
        stop_daemon(proc, cleanup)
    print_summary(results)
    return 0 if all("error" not in r for r in results) else 1


def _per_param(r) -> str:
    """memory_report's host bytes per trained parameter: state + staging + private."""
    hp = r.get("host_per_param") or {}
    per = hp.get("total_bytes_per_param")
    return "" if per is None else f"{per:.2f}"


def print_summary(results) -> None:
    print("\n| case | cap | s/step | peak VRAM GiB | RSS GiB | daemon shm GiB | host B/param | "
          "PCIe GB/step | PCIe GB/s | loss first -> last | paged blocks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    by = {}
    for r in results:
        if "error" in r:
            print(f"| {r['case']} | | error: {r['error'][:120]} |")
            continue
        if r["case"] == "oom":
            print(f"| oom | | MemoryError at wrap() ({r.get('wrap_s')} s): "
                  f"{r.get('memory_error', '')[:300]} |")
            continue
        cap = "none" if r["uncapped"] else f"{r['cap_gib']} GiB"
        print(f"| {r['case']} | {cap} | {r['step_s']} | {r['peak_vram_gib']} | "
              f"{r['host_rss_gib']} | {r['daemon_shm_gib']} | {_per_param(r)} | "
              f"{r['pcie_bytes_per_step'] / 1e9:.2f} | {r['pcie_gb_s']} | "
              f"{r['losses'][0]} -> {r['losses'][-1]} | "
              f"{len(r['plan']['paged_blocks'] or [])} |")
        by.setdefault((r["case"], r["uncapped"]), []).append(r)
    for case in ("14b-lora-bf16", "14b-lora-nf4"):
        capped, free = by.get((case, False)), by.get((case, True))
        if not (capped and free):
            continue
        # Every measured step of every run of a variant, pooled: its median and its best.
        times = {k: sorted(t for r in rs for t in r["step_times"])
                 for k, rs in (("capped", capped), ("free", free))}
        pcie = max(r["pcie_floor_s"] for r in capped)
        for name, pick in (("median", lambda t: t[len(t) // 2]), ("best", lambda t: t[0])):
            ours, compute = pick(times["capped"]), pick(times["free"])
            floor = max(pcie, compute)
            print(f"{case} ({name} of {len(times['capped'])} capped and {len(times['free'])} "
                  f"uncapped steps): {ours:.4f} s/step against floor {floor:.4f} s "
                  f"(PCIe {pcie} s, compute {compute:.4f} s): {ours / floor:.2f}x (goal 1.2x)")


if __name__ == "__main__":
    sys.exit(main())
