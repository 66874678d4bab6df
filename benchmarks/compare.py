#!/usr/bin/env python3
"""Head-to-head (docs/benchmarks-compare.md): TrainStream against the libraries users
would pick instead, on random-weight models with Qwen2.5's shapes, under a VRAM cap and
uncapped.

Scenarios (headtohead/scenarios.py): full1.5b (batch 4x1024), full7b (1x1024),
lora14b (1x512), lora14b_2k (1x2048), lora32b (1x512). Engines (headtohead/engines.py):
stock PyTorch (fused AdamW) with and without activation checkpointing, FSDP2 with
CPUOffloadPolicy, torchao's CPUOffloadOptimizer, DeepSpeed ZeRO-2/3 with CPU offload,
bitsandbytes QLoRA + PEFT, Unsloth, TrainStream (auto, + checkpointing, GPU optimizer,
and each quantized base format for LoRA).

Each engine runs in a fresh process (a timeout each), on the same checkpoint (written
once per run), the same batch, learning rate and loop; docs/benchmarks-compare.md gives
the fairness rules and how to run it on the GPU host.

    python benchmarks/compare.py --scenarios full1.5b --engines stock,trainstream --out /tmp/cmp
    python benchmarks/compare.py --scenarios lora14b --both --live --out $OUT/cmp
    python benchmarks/compare.py --tiny --scenarios full1.5b,lora14b --out /tmp/cmp   # CPU ok
    python benchmarks/compare.py --merge a/results.json b/results.json --out /tmp/all
    python benchmarks/compare.py --readme /tmp/all/results.json [--quality q.json]

Writes OUT/results.json (after every engine, so a cut-off run keeps what finished),
OUT/results.md and OUT/*.png (matplotlib). Human progress goes to stderr; with --live,
stdout carries one JSON object a line: every step and memory sample of every engine.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from headtohead import measure, report  # noqa: E402
from headtohead.engines import ENGINES, Context, parse_engines  # noqa: E402
from headtohead.scenarios import (SCENARIOS, batch_ids, ensure_checkpoint, lora_param_count,  # noqa: E402
                                  param_count, parse_scenarios)
from bench_paging import run_case_process, start_daemon, stop_daemon  # noqa: E402

DEFAULT_SCENARIOS = "full1.5b,full7b,lora14b,lora14b_2k,lora32b"


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


# --------------------------------------------------------------- one engine's process
def _is_oom(e: BaseException) -> bool:
    import torch
    text = str(e).lower()
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text \
        or "cublas_status_alloc_failed" in text


def run_child(spec: dict) -> dict:
    """One engine on one scenario, in this process; the result record."""
    machine0 = measure.machine_used_bytes()
    engine = ENGINES[spec["engine"]]
    scenario = SCENARIOS[spec["scenario"]]
    r = {"scenario": scenario.name, "engine": engine.name, "label": engine.label,
         "capped": spec["cap_gib"] is not None, "cap_gib": spec["cap_gib"]}
    for module in engine.needs:  # first: Unsloth must be imported before transformers
        try:
            importlib.import_module(module)
        except ImportError as e:
            return dict(r, status="not installed", reason=f"not installed: {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 (a package that installs but cannot load)
            return dict(r, status="error", reason=f"import {module} failed: {type(e).__name__}: {e}")
    import torch
    cuda = torch.cuda.is_available()
    if engine.needs_cuda and not cuda:
        return dict(r, status="needs CUDA", reason="needs CUDA: no CUDA device in this process")
    shape = scenario.shape(spec["tiny"])
    sampler = measure.Sampler(spec["sample_s"], cuda, spec.get("socket"), spec["live"], machine0)
    sampler.start()
    cap = None if spec["cap_gib"] is None else int(spec["cap_gib"] * 2**30)
    if cuda and cap is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    ctx = Context(scenario, spec["tiny"], spec["ckpt"], cuda, cap, spec.get("socket"),
                  ids=batch_ids(scenario, spec["tiny"], shape["vocab"], "cuda" if cuda else "cpu"))
    torch.manual_seed(0)
    phase = "setup"
    try:
        t0 = time.perf_counter()
        run = engine.setup(ctx)
        r["setup_s"] = round(time.perf_counter() - t0, 1)
        sampler.torch_peaks()
        r.update(trained_params=run.trained_params, info=run.info)
        phase = "training"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        r.update(measure.train(run.step, steps=spec["steps"], warmup=spec["warmup"],
                               max_warmup=spec["max_warmup"], adapting=run.adapting, sync=sync,
                               sampler=sampler, live=spec["live"]))
        r["report"] = run.report()
        run.close()
        r["status"] = "ok"
    except Exception as e:  # noqa: BLE001 (every failure is a result, with its reason)
        kind = "oom" if _is_oom(e) else "error"
        r.update(status=kind, reason=f"{'out of memory' if kind == 'oom' else 'error'} in {phase}: "
                 f"{type(e).__name__}: {str(e)[:700]}", trace=traceback.format_exc()[-1500:])
    peaks = sampler.stop()
    r.update(peak_vram_bytes=peaks.get("torch_allocated"), peak_reserved_bytes=peaks.get("torch_reserved"),
             peak_nvml_bytes=peaks.get("nvml_used"),
             nvml_source=sampler.device.source if sampler.device is not None else "no CUDA",
             host_bytes=peaks.get("host"), host_own_bytes=peaks.get("host_own"),
             daemon_shm_bytes=peaks.get("daemon_shm"), machine_used_bytes=peaks.get("machine_used"),
             samples=sampler.samples, params=param_count(shape))
    if sampler.daemon_error:
        r["daemon_status_error"] = sampler.daemon_error
    if cap is not None and r["peak_vram_bytes"] is not None:
        r["within_cap"] = r["peak_vram_bytes"] <= cap
    if r.get("trained_params") and r.get("host_bytes"):
        r["host_bytes_per_trained_param"] = round(r["host_bytes"] / r["trained_params"], 2)
    return r


# --------------------------------------------------------------- the run
def _classify(r: dict, steps_seen: int) -> dict:
    """A result the parent made (no RESULT line): timeout, killed by a signal, or an
    exit with an error, each with its reason."""
    if "status" in r:
        return r
    err = r.pop("error", "")
    code = r.pop("exit_code", None)
    if err.startswith("timed out"):
        r.update(status="timeout", reason=f"{err} ({steps_seen} steps done)")
    elif code is not None and code < 0:
        sig = -code
        why = " (SIGKILL: the kernel's out-of-memory killer when host memory runs out)" if sig == 9 else ""
        r.update(status="killed", reason=f"killed by signal {sig}{why} after {steps_seen} steps: {err[-300:]}")
    else:
        r.update(status="error", reason=err[-900:])
    return r


def _machine(args) -> dict:
    r = run_case_process([sys.executable, __file__, "--machine-child"], "machine", 300,
                         env=_child_env(None))
    r.pop("wall_s", None)
    return r


def _child_env(socket):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", HF_DATASETS_OFFLINE="1",
               UNSLOTH_DISABLE_STATISTICS="1")
    if socket:
        env["TRAINSTREAM_SOCKET"] = socket
    return env


def run_all(args) -> dict:
    scenarios = parse_scenarios(args.scenarios)
    engines = list(ENGINES.values()) if args.engines == "all" else parse_engines(args.engines)
    caps = {"capped": [args.cap_gib], "uncapped": [None], "both": [args.cap_gib, None]}[args.caps]
    uncapped = None if args.uncapped_engines == "all" else \
        parse_engines(args.uncapped_engines, "--uncapped-engines")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "results.json")
    doc = {"schema": 1, "tool": "benchmarks/compare.py",
           "created": time.strftime("%Y-%m-%d %H:%M:%S"), "command": args.command,
           "args": {k: v for k, v in vars(args).items() if k not in ("command",)},
           "engines": {e.name: e.label for e in ENGINES.values()}, "scenarios": {}, "results": []}
    log("machine: measuring (GPU, CPU, RAM, pinned PCIe)")
    doc["machine"] = _machine(args)
    log(json.dumps(doc["machine"]))
    ckpt_root = args.ckpt_dir or tempfile.mkdtemp(prefix="compare-ckpt-")
    written = []
    try:
        for sc in scenarios:
            shape = sc.shape(args.tiny)
            batch, seq = sc.tokens(args.tiny)
            entry = {"size": sc.size, "kind": sc.kind, "batch": batch, "seq": seq, "lr": sc.lr,
                     "param_dtype": sc.param_dtype, "shape": shape, "params": param_count(shape),
                     "trained_params": param_count(shape) if sc.kind == "full" else lora_param_count(shape)}
            doc["scenarios"][sc.name] = entry
            runnable = [e for e in engines if sc.kind in e.kinds]
            for e in engines:
                if e not in runnable:
                    doc["results"].append({"scenario": sc.name, "engine": e.name, "label": e.label,
                                           "status": "n/a", "reason": f"trains adapters only: not a "
                                           f"{sc.kind} fine-tune" if sc.kind == "full" else
                                           "full fine-tunes only"})
            if not runnable:
                continue
            t0 = time.perf_counter()
            entry["checkpoint"] = ensure_checkpoint(sc, args.tiny, ckpt_root, log=log)
            entry["checkpoint_write_s"] = round(time.perf_counter() - t0, 1)
            written.append(entry["checkpoint"])
            for cap in caps:
                for e in runnable:
                    if cap is None and uncapped is not None and e not in uncapped:
                        continue
                    r = _run_engine(args, sc, e, cap, entry["checkpoint"])
                    doc["results"].append(r)
                    log(report.one_line(r))
                    _save(doc, path)
    finally:
        if not args.keep_ckpt and not args.ckpt_dir:
            shutil.rmtree(ckpt_root, ignore_errors=True)
    _save(doc, path)
    return doc


def _run_engine(args, sc, engine, cap, ckpt) -> dict:
    spec = {"scenario": sc.name, "engine": engine.name, "cap_gib": cap, "tiny": args.tiny,
            "ckpt": ckpt, "steps": args.steps, "warmup": args.warmup, "max_warmup": args.max_warmup,
            "sample_s": args.sample_s, "live": args.live}
    proc, cleanup = None, []
    if engine.trainstream:
        try:  # a daemon of its own: its shared memory is this engine's alone
            proc, spec["socket"], cleanup = start_daemon(args.budget)
        except Exception as e:  # noqa: BLE001 (reported as the engine's result)
            return {"scenario": sc.name, "engine": engine.name, "label": engine.label,
                    "capped": cap is not None, "cap_gib": cap, "status": "error",
                    "reason": f"trainstreamd did not start: {e}"}
    steps = [0]

    def on_line(line: str) -> None:
        if not line.startswith("LIVE "):
            return
        rec = json.loads(line[5:])
        if rec.get("type") == "step":
            steps[0] += 1
        if args.live:
            print(json.dumps({"scenario": sc.name, "engine": engine.name, "capped": cap is not None,
                              **rec}), flush=True)
    try:
        r = run_case_process([sys.executable, __file__, "--child", json.dumps(spec)],
                             f"{sc.name}/{engine.name}", args.timeout, stderr_tail=2000,
                             on_line=on_line, env=_child_env(spec.get("socket")))
    finally:
        stop_daemon(proc, cleanup, timeout=60)
    r.pop("case", None)
    r = {"scenario": sc.name, "engine": engine.name, "label": engine.label,
         "capped": cap is not None, "cap_gib": cap, **r}
    return _classify(r, steps[0])


def _save(doc: dict, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def write_outputs(doc: dict, out: str, charts: bool = True) -> None:
    _save(doc, os.path.join(out, "results.json"))
    doc["charts"] = report.charts(doc, out) if charts else {"error": "not drawn: --no-charts"}
    _save(doc, os.path.join(out, "results.json"))
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(report.markdown(doc))
    log(f"wrote {out}/results.json, results.md; charts: {doc['charts']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=DEFAULT_SCENARIOS,
                    help=f"comma-separated, of {', '.join(SCENARIOS)} (default: all)")
    ap.add_argument("--engines", default="all", help="'all' or comma-separated names: " + ", ".join(ENGINES))
    ap.add_argument("--cap-gib", type=float, default=24.0, help="the VRAM cap (default 24 GiB)")
    caps = ap.add_mutually_exclusive_group()
    caps.add_argument("--uncapped", dest="caps", action="store_const", const="uncapped",
                      help="run uncapped instead of under --cap-gib")
    caps.add_argument("--both", dest="caps", action="store_const", const="both",
                      help="run under the cap, then uncapped")
    ap.set_defaults(caps="capped")
    ap.add_argument("--uncapped-engines", default="all",
                    help="with --both or --uncapped: the engines that run uncapped (default all)")
    ap.add_argument("--steps", type=int, default=8, help="measured steps; the median is reported")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps before measuring, at least")
    ap.add_argument("--max-warmup", type=int, default=20,
                    help="TrainStream: warm up on while session.adapting, up to this many steps")
    ap.add_argument("--timeout", type=float, default=420, help="seconds per engine process")
    ap.add_argument("--sample-s", type=float, default=0.25, help="memory sampling interval")
    ap.add_argument("--out", default="compare-out", help="folder for results.json, results.md, *.png")
    ap.add_argument("--ckpt-dir", default=None,
                    help="where the random-weight checkpoints are written (kept, reused when the "
                         "shape matches); default a temporary folder, removed")
    ap.add_argument("--keep-ckpt", action="store_true", help="keep the temporary checkpoints")
    ap.add_argument("--budget", default="90%", help="shared-memory budget of each TrainStream daemon")
    ap.add_argument("--no-charts", action="store_true",
                    help="no PNGs (draw them later with --merge; a device call returns at most 8 files)")
    ap.add_argument("--live", action="store_true", help="stream every step and memory sample (JSON lines)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, CPU ok (checks the script)")
    ap.add_argument("--merge", nargs="+", metavar="RESULTS_JSON",
                    help="merge results files (later ones win per scenario, engine and cap) into --out")
    ap.add_argument("--readme", nargs="+", metavar="RESULTS_JSON",
                    help="print the README's results section (Markdown) made from these files")
    ap.add_argument("--quality", default=None, help="with --readme: quality.py's JSON, as a table too")
    ap.add_argument("--charts-prefix", default="benchmarks/results/charts/",
                    help="with --readme: where the README finds the PNGs")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--machine-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        try:
            r = run_child(json.loads(args.child))
        except Exception as e:  # noqa: BLE001 (the harness's own failure, reported)
            spec = json.loads(args.child)
            r = {"scenario": spec.get("scenario"), "engine": spec.get("engine"), "status": "error",
                 "reason": f"harness error: {type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
        measure.emit_line("RESULT " + json.dumps(r))
        return 0
    if args.machine_child:
        measure.emit_line("RESULT " + json.dumps(measure.describe_machine()))
        return 0
    for name in ("steps", "warmup", "max_warmup"):
        if getattr(args, name) < (1 if name == "steps" else 0):
            ap.error(f"--{name.replace('_', '-')} must be >= {1 if name == 'steps' else 0}")
    if args.cap_gib <= 0 or args.timeout <= 0 or args.sample_s <= 0:
        ap.error("--cap-gib, --timeout and --sample-s must be > 0")
    if args.readme:
        doc = report.merge([report.load(p) for p in args.readme])
        quality = report.load(args.quality) if args.quality else None
        print(report.readme(doc, quality, args.charts_prefix))
        return 0
    if args.merge:
        doc = report.merge([report.load(p) for p in args.merge])
        os.makedirs(args.out, exist_ok=True)
        write_outputs(doc, args.out, not args.no_charts)
        return 0
    try:
        parse_scenarios(args.scenarios)
        for flag in ("engines", "uncapped_engines"):
            if getattr(args, flag) != "all":
                parse_engines(getattr(args, flag), "--" + flag.replace("_", "-"))
    except ValueError as e:
        ap.error(str(e))
    args.command = "python benchmarks/compare.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    doc = run_all(args)
    write_outputs(doc, args.out, not args.no_charts)
    print(report.markdown(doc), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
