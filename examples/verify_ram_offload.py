"""Where does training memory live? A PASS/FAIL verdict, measured from outside torch.

Each engine trains in a child process of its own (so one's allocations cannot hide in
the other's): ``baseline`` is plain ``torch.optim.AdamW``, ``trainstream`` the same
model through ``trainstream.wrap()``. Each child reads, before and after training:

* VRAM: its own GPU memory from NVML (pynvml), else the device's used memory from
  ``torch.cuda.mem_get_info``, else ``nvidia-smi``;
* its memory: RSS and shared RSS (``/proc/self/status``) and USS, the private pages
  (``/proc/self/smaps_rollup``);
* the daemon's: its pid from the control API (``trainstreamctl status --json``'s
  document), its shared RSS (``/proc/<pid>/status``) and the space its segment
  files take in its ``/dev/shm`` directory, and the bytes of this session's
  optimizer-state segments.

Readings are taken with the gradients freed and the CUDA cache emptied, so what is
left beside the weights is the optimizer state. PASS when, for TrainStream, the state
segments hold the two fp32 moments (8 bytes per trained parameter) and what the fp32
masters take beyond the weight slots (none for fp32 weights, 2 bytes for bf16, 4 for
fp16), up to 4 bytes per parameter more (alignment and recovery records), the
daemon's shared memory grew by them, and neither VRAM (a quarter of them) nor the
process's private memory (less than them) grew enough to hold them.

    python examples/verify_ram_offload.py                 # a GPT, both engines
    python examples/verify_ram_offload.py --hf --vram-cap-gb 24
    python examples/verify_ram_offload.py --tiny          # small shapes; CPU is fine

Without a GPU the VRAM check is skipped (and says so); the verdict covers what was
measured: the process against the daemon.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys

import torch

from _common import daemon_status, gib, pick_device, session_state_bytes

import trainstream
from trainstream.optim.backend import master_state_bytes

MOMENT_BYTES_PER_PARAM = 8.0  # two fp32 moments
SLACK_BYTES_PER_PARAM = 4.0  # alignment and recovery records, at most
TOLERANCE = 0.05
# What VRAM and the process's private memory may grow by, as a fraction of the state:
# less than the state itself cannot hold it. VRAM is read with the CUDA cache emptied;
# private memory keeps about 10 B/param more in both engines on the CPU (the same in
# the baseline, so not optimizer state), hence the looser bound there.
VRAM_GROWTH_LIMIT = 0.25
USS_GROWTH_LIMIT = 1.0


def _status_kib(pid, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _uss(pid="self") -> int:
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1]) * 1024
    return total


def _vram_used(device: str):
    """(bytes, source) of GPU memory: this process's (NVML, nvidia-smi), else the device's."""
    if device != "cuda":
        return None, "no GPU"
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid():
                return int(proc.usedGpuMemory), "NVML (this process)"
        return 0, "NVML (this process)"
    except Exception:  # noqa: BLE001 (not installed, or no per-process figures here)
        pass
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True)
        for line in out.stdout.splitlines():
            pid, _, mib = line.partition(",")
            if pid.strip() == str(os.getpid()):
                return int(mib) * 2**20, "nvidia-smi (this process)"
    free, total = torch.cuda.mem_get_info()
    return total - free, "torch.cuda.mem_get_info (whole device)"


def _shm_dir_bytes(path: str) -> int:
    total = 0
    for name in os.listdir(path):
        if name.startswith("trainstream-"):
            try:
                total += os.stat(os.path.join(path, name)).st_blocks * 512
            except FileNotFoundError:
                pass  # a segment freed while we looked
    return total


def _release_freed_heap() -> None:
    # glibc keeps freed gradients and activations in its heap (its mmap threshold grows
    # with the sizes freed), where they would count as private memory; hand them back.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: readings then include the allocator's cache


def _readings(device: str, socket):
    _release_freed_heap()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    vram, source = _vram_used(device)
    r = {"vram": vram, "vram_source": source, "rss": _status_kib("self", "VmRSS"),
         "rss_shmem": _status_kib("self", "RssShmem"), "uss": _uss()}
    status = daemon_status(socket)
    r.update(daemon_pid=status["pid"], daemon_shmem=_status_kib(status["pid"], "RssShmem"),
             shm_files=_shm_dir_bytes(status["shm_dir"]),
             state_segments=session_state_bytes(status, os.getpid()))
    return r


def _model(args, device):
    torch.manual_seed(0)
    if args.hf:
        from transformers import AutoModelForCausalLM, Qwen2Config
        shape = (dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
                 if args.tiny else  # Qwen2.5-0.5B's shape
                 dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, vocab_size=151936))
        cfg = Qwen2Config(tie_word_embeddings=True, max_position_embeddings=4096, **shape)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        vocab = shape["vocab_size"]

        def loss_fn(ids):
            return model(input_ids=ids, labels=ids).loss
    else:
        from tiny_gpt import GPTConfig, TinyGPT
        vocab = 256 if args.tiny else 50304
        cfg = GPTConfig(vocab_size=vocab, block_size=args.seq, n_layer=4 if args.tiny else 24,
                        n_head=4 if args.tiny else 16, n_embd=384 if args.tiny else 1024)
        model = TinyGPT(cfg)

        def loss_fn(ids):
            return model(ids, torch.roll(ids, -1, dims=1))
    return model.to(device), vocab, loss_fn


def child(args) -> dict:
    device = pick_device(args.device)
    if device == "cuda":
        torch.cuda.init()
        torch.empty(1, device="cuda")  # the context exists before the first reading
    model, vocab, loss_fn = _model(args, device)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # The daemon's masters beyond the weight slots, by the weights' dtypes (an fp32
    # weight slot is its own master: Note [One host copy of a trained weight]).
    masters = sum(master_state_bytes(p) for p in model.parameters() if p.requires_grad)
    ids = torch.randint(vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    loss_fn(ids).backward()  # warms autograd and the allocators up, before the baseline
    model.zero_grad(set_to_none=True)
    # Both engines load TrainStream's compiled modules (and start the gRPC client's
    # threads) before the first reading: their code and heap are not optimizer state.
    from trainstream._native import C
    C()
    cap = int(args.vram_cap_gb * 2**30) if args.vram_cap_gb and device == "cuda" else None
    before = _readings(device, args.socket)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if args.engine == "trainstream":
        model, optimizer = trainstream.wrap(model, optimizer, socket=args.socket,
                                            vram_limit=cap, job="verify_ram_offload")
    elif cap is not None:
        torch.cuda.set_per_process_memory_fraction(
            cap / torch.cuda.get_device_properties(0).total_memory)
    losses = []
    for _ in range(args.steps):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = loss_fn(ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    after = _readings(device, args.socket)
    return {"engine": args.engine, "device": device, "trained_params": trained,
            "master_bytes": masters,
            "losses": losses, "before": before, "after": after}


def verdict(r: dict) -> list:
    """(check, passed or None when skipped, detail) for a TrainStream run."""
    b, a, n = r["before"], r["after"], r["trained_params"]
    state = a["state_segments"]
    low = MOMENT_BYTES_PER_PARAM * n + r["master_bytes"]
    high = low + SLACK_BYTES_PER_PARAM * n
    checks = [("optimizer state in the daemon's segments",
               low * (1 - TOLERANCE) <= state <= high * (1 + TOLERANCE),
               f"{gib(state)} = {state / n:.2f} B/param (expected {low / n:.3g}-{high / n:.3g})")]
    grew = a["shm_files"] - b["shm_files"]
    checks.append(("the daemon's /dev/shm files grew by it", grew >= (1 - TOLERANCE) * state,
                   f"+{gib(grew)}"))
    grew = a["daemon_shmem"] - b["daemon_shmem"]
    checks.append((f"the daemon's (pid {a['daemon_pid']}) shared RSS grew by it",
                   grew >= (1 - TOLERANCE) * state, f"+{gib(grew)}"))
    grew = a["uss"] - b["uss"]
    checks.append(("not in the process's private memory (USS)",
                   grew < USS_GROWTH_LIMIT * state, f"+{gib(grew)} = {grew / n:.2f} B/param "
                   f"(limit {USS_GROWTH_LIMIT * state / n:.2f})"))
    if a["vram"] is None:
        checks.append(("not in VRAM", None, "skipped: no GPU on this machine"))
    else:
        grew = a["vram"] - b["vram"]
        checks.append((f"not in VRAM ({a['vram_source']})", grew <= VRAM_GROWTH_LIMIT * state,
                       f"+{gib(grew)} = {grew / n:.2f} B/param (limit "
                       f"{VRAM_GROWTH_LIMIT * state / n:.2f})"))
    return checks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    kind = ap.add_mutually_exclusive_group()
    kind.add_argument("--gpt", action="store_true", help="a GPT (tests/python/tiny_gpt.py; default)")
    kind.add_argument("--hf", action="store_true", help="a Qwen2 built from a transformers config")
    ap.add_argument("--engine", choices=("both", "baseline", "trainstream"), default="both")
    ap.add_argument("--vram-cap-gb", type=float, default=None, help="GPU memory cap, GiB")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=None, help="tokens (default 256; --tiny 32)")
    ap.add_argument("--device", default="auto", help="auto, cuda or cpu")
    ap.add_argument("--tiny", action="store_true", help="small shapes (implied without a GPU)")
    ap.add_argument("--socket", default=None, help="the daemon's socket (else the default)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.vram_cap_gb is not None and args.vram_cap_gb <= 0:
        ap.error(f"--vram-cap-gb must be > 0, got {args.vram_cap_gb}")
    if pick_device(args.device) == "cpu":
        args.tiny = True
    if args.seq is None:
        args.seq = 32 if args.tiny else 256
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    engines = ("baseline", "trainstream") if args.engine == "both" else (args.engine,)
    results = {}
    for engine in engines:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--engine", engine,
               "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
               "--device", args.device, *(["--hf"] if args.hf else []),
               *(["--tiny"] if args.tiny else []), *(["--socket", args.socket] if args.socket else []),
               *(["--vram-cap-gb", str(args.vram_cap_gb)] if args.vram_cap_gb else [])]
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            print(f"{engine}: the run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
            print("VERDICT: FAIL (a run did not finish)")
            return 1
        results[engine] = r = json.loads(lines[-1][7:])
        b, a = r["before"], r["after"]
        print(f"\n{engine} ({r['device']}, {r['trained_params'] / 1e6:.1f}M trained parameters; "
              f"losses {', '.join(f'{v:.4f}' for v in r['losses'])}); growth during training:")
        for label, key in (("VRAM", "vram"), ("process USS (private)", "uss"),
                           ("process RSS", "rss"), ("process shared RSS", "rss_shmem"),
                           ("daemon shared RSS", "daemon_shmem"), ("/dev/shm segment files", "shm_files")):
            if a[key] is None:
                print(f"  {label:<24} n/a ({a['vram_source']})")
            else:
                print(f"  {label:<24} {gib(a[key] - b[key]):>11}  (now {gib(a[key])})")
        print(f"  {'session state segments':<24} {gib(a['state_segments']):>11}")
    if "trainstream" not in results:
        print("\nVERDICT: none (no TrainStream run: nothing to judge)")
        return 0
    checks = verdict(results["trainstream"])
    print("\nTrainStream checks:")
    for name, ok, detail in checks:
        mark = "skip" if ok is None else ("ok" if ok else "FAIL")
        print(f"  [{mark:>4}] {name}: {detail}")
    failed = [name for name, ok, _ in checks if ok is False]
    skipped = [name for name, ok, _ in checks if ok is None]
    note = f" ({len(skipped)} skipped: {'; '.join(skipped)})" if skipped else ""
    print(f"VERDICT: {'FAIL' if failed else 'PASS'}: the optimizer state "
          f"{'is not only' if failed else 'is'} in the daemon's shared memory{note}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
