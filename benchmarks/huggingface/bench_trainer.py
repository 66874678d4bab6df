"""The Hugging Face front door under a VRAM cap (docs/huggingface-trainer.md; figures in
docs/benchmarks.md): the reference's recipes run through ``TrainStreamTrainer``, each
case in its own process.

  qlora14b    ``load_model(<14B-shaped checkpoint>, quantize="nf4")`` + PEFT LoRA r=16 on
              all seven projections + ``TrainStreamTrainer(bf16=True)``, batch 1 x --seq
  full1.5b    a Qwen2.5-1.5B-shaped full fine-tune (fp32 weights, bf16 autocast) through
              ``TrainStreamTrainer``, batch 4 x 1024, no user-enabled checkpointing

Each prints s/step (median of the measured steps, after --warmup steps), the peak VRAM
over the measured steps and over the whole run, the process's RSS, the daemon's shared
memory, the losses, then a JSON line (RESULT ...), and a summary table at the end.

    # GPU host (the 14B checkpoint is ~29.5 GB of random bf16 weights, written once):
    python benchmarks/huggingface/bench_trainer.py --cases qlora14b:512,qlora14b:2048,full1.5b \
        --dir /tmp/ts-bench-14b --cap-gib 24
    python benchmarks/huggingface/bench_trainer.py --tiny     # every case, tiny shapes, CPU ok

Nothing is downloaded: the checkpoint is written by benchmarks/base/bench_base_load.py's
writer, the 1.5B model is built from a config with random weights, the data are random
tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "benchmarks", "base"))
sys.path.insert(0, os.path.join(REPO, "benchmarks", "paging"))
from bench_paging import _gib, _rss  # noqa: E402 (the paging benchmark's readings)

SHAPES = {  # Qwen2.5 published shapes
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                 vocab_size=151936),
    "14b": dict(hidden=5120, intermediate=13824, layers=48, heads=40, kv_heads=8, vocab=152064),
}
TINY_1_5B = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True, vocab_size=512)
TINY_14B = dict(hidden=64, intermediate=160, layers=4, heads=4, kv_heads=2, vocab=512)
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _Tokens:
    """Random-token causal-LM examples (labels = inputs, as HF shifts them itself)."""

    def __init__(self, n, seq, vocab, seed=1):
        import torch
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _timer_callback(result, warmup, cuda):
    import torch
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        """Step times with the device synchronized at both ends, and each step's peak
        VRAM read at its end. The counter is never reset here: TrainStream's memory
        controller resets it at each step's first forward and reads the last step's peak
        there, so at a step's end it holds that step's peak (without the controller, the
        peak since the start)."""

        def __init__(self):
            self.t0 = None
            self.times = []
            self.peaks = []

        def on_step_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
                self.peaks.append(torch.cuda.max_memory_allocated())
            self.times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                result.setdefault("losses", []).append(round(float(logs["loss"]), 4))
            if logs:
                ts = {k: v for k, v in logs.items() if k.startswith("ts_")}
                if ts:
                    result["ts_metrics"] = ts
    return Timer()


def _events(model) -> list:
    """memory_report(model)["events"] of the model TrainStream wrapped (a PEFT model's
    base), or [] when it was not wrapped yet."""
    import trainstream
    inner = model
    if getattr(inner, "_trainstream_session", None) is None and hasattr(inner, "get_base_model"):
        inner = inner.get_base_model()
    if getattr(inner, "_trainstream_session", None) is None:
        return []
    return trainstream.memory_report(inner).get("events", [])[-30:]


def run_case(args) -> dict:
    import torch
    import transformers
    from trainstream.integrations.huggingface import TrainStreamTrainer, load_model
    cuda = torch.cuda.is_available()
    name, _, seq = args.case.partition(":")
    result = {"case": args.case, "tiny": args.tiny, "cap_gib": args.cap_gib}
    options = {"socket": args.socket}
    if cuda:
        options["vram_limit"] = int(args.cap_gib * 2**30)
    t0 = time.perf_counter()
    if name == "qlora14b":
        import peft
        model = load_model(args.dir, quantize="nf4", socket=args.socket)
        result["load_s"] = round(time.perf_counter() - t0, 1)
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
            target_modules=PROJECTIONS))
        seq, batch, lr, bf16 = int(seq or 512), 1, 2e-4, True
    elif name == "full1.5b":
        cfg = transformers.Qwen2Config(**(TINY_1_5B if args.tiny else SHAPES["1.5b"]))
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(cfg)  # fp32 weights, on the CPU
        result["build_s"] = round(time.perf_counter() - t0, 1)
        seq, batch, lr, bf16 = int(seq or 1024), 4, 2e-5, cuda
    else:
        raise ValueError(f"unknown case {name!r}")
    if args.tiny:
        seq = 32
    vocab = model.config.vocab_size
    result.update(seq=seq, batch=batch, params=sum(p.numel() for p in model.parameters()),
                  trained_params=sum(p.numel() for p in model.parameters() if p.requires_grad))
    steps = args.warmup + args.steps
    out_dir = tempfile.mkdtemp(prefix="ts-bench-trainer-")
    targs = transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=batch, max_steps=steps,
        learning_rate=lr, logging_steps=1, save_strategy="no", report_to=[], bf16=bf16,
        use_cpu=not cuda, dataloader_num_workers=0, disable_tqdm=True,
        gradient_checkpointing=False)
    timer = _timer_callback(result, args.warmup, cuda)
    trainer = TrainStreamTrainer(model=model, args=targs,
                                 train_dataset=_Tokens(steps * batch, seq, vocab),
                                 trainstream=options, callbacks=[timer])
    t0 = time.perf_counter()
    try:
        trainer.train()
    except Exception as e:
        # What the memory controller decided before the failure, and at which step.
        e.ts_report = {"steps_done": len(timer.times), "events": _events(trainer.model)}
        raise
    result["train_s"] = round(time.perf_counter() - t0, 1)
    measured = timer.times[args.warmup:]
    import trainstream
    status = json.loads(trainstream._native.daemon.connect(args.socket).status_json())
    result.update(
        step_s=round(sorted(measured)[len(measured) // 2], 4),
        step_times=[round(t, 4) for t in measured],
        peak_vram_gib=_gib(max(timer.peaks[args.warmup:], default=0)) if cuda else 0.0,
        peak_vram_run_gib=_gib(max(timer.peaks, default=0)) if cuda else 0.0,
        host_rss_gib=_gib(_rss()), daemon_shm_gib=_gib(status["budget"]["used"]))
    if cuda:
        result["within_cap"] = max(result["peak_vram_gib"], result.get("peak_vram_run_gib", 0)) \
            <= args.cap_gib
    inner = trainer.model
    if getattr(inner, "_trainstream_session", None) is None and hasattr(inner, "get_base_model"):
        inner = inner.get_base_model()
    if getattr(inner, "_trainstream_session", None) is not None:
        rep = trainstream.memory_report(inner)
        result["paged_blocks"] = len(rep.get("params", {}).get("paged_blocks") or [])
        result["activation_policy"] = rep.get("activations", {}).get("policy")
        result["optimizer_state_gib"] = _gib(rep["optimizer"]["state_bytes_in_daemon"])
    shutil.rmtree(out_dir, ignore_errors=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="qlora14b:512,qlora14b:2048,full1.5b")
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument("--steps", type=int, default=6, help="measured steps (median reported)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--dir", default=None, help="the 14B checkpoint folder (written if missing)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: checks the script on CPU")
    ap.add_argument("--socket", default=None, help="an existing daemon (else a private one)")
    ap.add_argument("--budget", default="90%")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        try:
            r = run_case(args)
        except Exception as e:  # noqa: BLE001 (reported, not hidden)
            import traceback
            r = {"case": args.case, "error": f"{type(e).__name__}: {str(e)[:800]}",
                 "trace": traceback.format_exc()[-2000:], **getattr(e, "ts_report", {})}
        print("RESULT " + json.dumps(r), flush=True)
        return 0
    from bench_paging import run_case_process, start_daemon, stop_daemon  # noqa: E402
    cleanup = []
    if any(c.startswith("qlora14b") for c in args.cases.split(",")):
        if args.dir is None:
            args.dir = tempfile.mkdtemp(prefix="ts-bench-ckpt-")
            cleanup.append(args.dir)
        if not os.path.exists(os.path.join(args.dir, "config.json")):
            from bench_base_load import write_checkpoint
            shape = TINY_14B if args.tiny else SHAPES["14b"]
            write_checkpoint(argparse.Namespace(shard_gb=4.0, **shape), args.dir)
    proc = None
    if args.socket is None:
        proc, args.socket, dirs = start_daemon(args.budget)
        cleanup += dirs
    results = []
    try:
        for case in args.cases.split(","):
            cmd = [sys.executable, __file__, "--case", case, "--cap-gib", str(args.cap_gib),
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--socket", args.socket] + (["--dir", args.dir] if args.dir else []) \
                + (["--tiny"] if args.tiny else [])
            r = run_case_process(cmd, case, args.timeout, stderr_tail=1500)
            results.append(r)
            print(json.dumps(r, indent=1), flush=True)
    finally:
        stop_daemon(proc, cleanup)
    print("\n| case | s/step | peak VRAM GiB (measured steps / whole run) | RSS GiB | "
          "daemon shm GiB | loss first -> last | paged blocks |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['case']} | error: {r['error'][:200]} |")
            continue
        losses = r.get("losses") or [None]
        print(f"| {r['case']} (batch {r['batch']}x{r['seq']}) | {r['step_s']} | "
              f"{r['peak_vram_gib']} / {r.get('peak_vram_run_gib', '-')} | {r['host_rss_gib']} | "
              f"{r['daemon_shm_gib']} | {losses[0]} -> {losses[-1]} | "
              f"{r.get('paged_blocks', '-')} |")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
