"""Training bigger than VRAM: random-weight Qwen2.5 shapes under a VRAM cap.

Cases (each in its own process, so caps and peaks don't mix):

  7b-full       Qwen2.5-7B-shaped full fine-tune, bf16 weights, bf16 moments
  32b-lora-nf4  LoRA r=16 (all projections) on a Qwen2.5-32B-shaped NF4 base
  oom           a Qwen2.5-72B-shaped full fine-tune: must raise MemoryError at wrap()
  14b-lora-bf16 LoRA r=16 on a Qwen2.5-14B-shaped bf16 base, capped, plus the floors
  14b-lora-nf4  the same on an NF4 base
  full-layers   Qwen2.5-14B widths with --layers blocks (40: 12.6B parameters), full
                fine-tune with bf16 moments, --layer-steps steps (10), loss checked
                decreasing
  full-layers-refuse  the same shape grown block by block from --layers + 1 until the
                planner refuses it; wrap() must then raise MemoryError, whose categories
                are parsed and summed against its total
  70b-lora-nf4  LoRA r=16 on a Qwen2.5-72B-shaped NF4 base (39.5 GB of NF4 blocks)

Each prints s/step, peak VRAM, host RSS and the daemon's shared memory, PCIe bytes and
GB/s against the PCIe floor (bytes that crossed per step / 55 GB/s), the loss per step,
the planner's decisions and the host figure, host bytes per trained parameter
(paging_memory.py says exactly what it counts), then a JSON line (RESULT ...). The full
cases run once per --grad-pool variant (pool: wrap's default; slots: grad_pool=0; or a
size in bytes).

    python benchmarks/paging/bench_paging.py --cases 7b-full --grad-pool slots,pool
    python benchmarks/paging/bench_paging.py --cases full-layers,full-layers-refuse \\
        --grad-pool pool --layers 40
    python benchmarks/paging/bench_paging.py --cases 70b-lora-nf4,32b-lora-nf4
    python benchmarks/paging/bench_paging.py --tiny        # every case, tiny shapes, CPU ok

Models are built from transformers' Qwen2Config with random weights (nothing is
downloaded or written to disk), layer by layer on the GPU when there is one (NF4
quantized there), so building a 72B base needs one layer's bf16 weights at a time. A
LoRA case's frozen base lives in one region of the daemon's shared memory
(paging_models.py), which wrap() pages from without a copy of its own.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
try:
    import trainstream  # noqa: F401
except ImportError:  # run from the repository without PYTHONPATH: use build/python
    sys.path.insert(0, os.path.join(REPO, "build", "python"))
    os.environ["PYTHONPATH"] = os.path.join(REPO, "build", "python") + os.pathsep + \
        os.environ.get("PYTHONPATH", "")
# Re-exported: compare.py, bench_trainer.py, quality.py, diag_cap.py and scenarios.py
# import these from here.
from paging_models import SHAPES, TINY, build, grow, qwen_config, shrink  # noqa: E402,F401
from paging_procs import run_case_process, start_daemon, stop_daemon  # noqa: E402,F401
from paging_steps import WRAPPED, gib as _gib, rss as _rss  # noqa: E402,F401
import paging_memory  # noqa: E402
import paging_steps as steps  # noqa: E402
from paging_summary import print_summary  # noqa: E402

PCIE_GB_S = 55.0
CASES = ("7b-full", "32b-lora-nf4", "oom", "14b-lora-bf16", "14b-lora-nf4", "full-layers",
         "full-layers-refuse", "70b-lora-nf4")
SIZE = {"7b-full": "7b", "32b-lora-nf4": "32b", "oom": "72b", "14b-lora-bf16": "14b",
        "14b-lora-nf4": "14b", "full-layers": "14b", "full-layers-refuse": "14b",
        "70b-lora-nf4": "72b"}
MODE = {"32b-lora-nf4": "lora-nf4", "14b-lora-bf16": "lora-bf16", "14b-lora-nf4": "lora-nf4",
        "70b-lora-nf4": "lora-nf4"}  # the others: "full"
FULL = ("7b-full", "full-layers", "full-layers-refuse")  # run once per --grad-pool variant
DEFAULT_LAYERS = 40  # docs/paging.md: the largest 14B-width depth estimated to fit 128 GiB


def pool_option(variant: str, model) -> dict:
    """wrap()'s grad_pool option for a --grad-pool variant: "pool" (or "auto": wrap's
    default, the pool sized by its rule on any machine since Note [The pool on a GPU
    host]), "slots" (grad_pool=0) or a size."""
    if variant in ("auto", "pool"):
        return {}
    if variant == "slots":
        return {"grad_pool": 0}
    return {"grad_pool": int(variant) if variant.isdigit() else variant}


def case_options(args, case: str, cuda: bool) -> dict:
    cap = None if args.uncapped else (args.cap_gib * 2**30 if cuda else
                                      (args.tiny_cap_kib << 10))
    options = dict(socket=args.socket, device="cuda" if cuda else "cpu", vram_limit=cap,
                   verbose=False)
    if args.uncapped:
        options.update(param_offload=False, activation_offload=False)
    elif args.tiny:
        # Tiny tensors: page them anyway, and (no measured peaks on a CPU) page activations.
        options.update(min_offload_bytes=1024, activation_offload=True if not cuda else "auto")
    if MODE.get(case, "full") == "full":
        options["moment_dtype"] = "auto" if case == "oom" else "bfloat16"
    return options


def run_oom(args, options, vocab, result) -> dict:
    import torch
    import trainstream
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


def run_refusal(args, options, vocab, dev, result) -> dict:
    """Grows the full-layers shape from --layers + 1 block by block, each built and held
    in host memory as full-layers' model is, until the planner refuses it (at most
    --refuse-search blocks more); then wrap() must raise that MemoryError."""
    import torch
    import trainstream
    layers = (args.layers or TINY["num_hidden_layers"]) + 1
    t0 = time.perf_counter()
    model, _ = build("14b", tiny=args.tiny, dtype=torch.bfloat16, mode="full", init_device=dev,
                     vocab=vocab, layers=layers)
    accepted, refused = [], None
    for _ in range(args.refuse_search):
        opts = dict(options, **pool_option(args.grad_pool, model))
        refused = paging_memory.plan_only(model, opts)
        if refused is not None:
            break
        accepted.append(len(model.model.layers))
        grow(model, dev, torch.bfloat16)
    result.update(build_s=round(time.perf_counter() - t0, 1), accepted_layers=accepted,
                  params=sum(p.numel() for p in model.parameters()))
    if refused is None:
        result["error"] = (f"the planner accepted every shape up to "
                           f"{len(model.model.layers) - 1} blocks (--refuse-search)")
        return result
    result["refused_layers"] = len(model.model.layers)
    t0 = time.perf_counter()
    try:
        trainstream.wrap(model, **opts)
        result["error"] = "wrap() did not raise MemoryError where the planner refused"
        return result
    except MemoryError as e:
        result.update(memory_error=str(e), wrap_s=round(time.perf_counter() - t0, 3))
    parsed = paging_memory.parse_memory_error(result["memory_error"])
    result["memory_error_parts"] = parsed
    if not parsed.get("adds_up"):
        result["error"] = f"the MemoryError's numbers do not add up: {parsed}"
    return result


def run_case(args) -> dict:
    import torch
    import trainstream
    if os.environ.get("TS_BENCH_SNAPSHOT") and torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(max_entries=30000)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    case, mode = args.case, MODE.get(args.case, "full")
    result = {"case": case, "tiny": args.tiny, "cap_gib": None if args.uncapped else args.cap_gib,
              "uncapped": args.uncapped}
    if case in FULL:
        result["grads"] = args.grad_pool
    if cuda and args.pin:
        result["cpus"] = steps.pin_to_gpu_local_cpus(torch)
    vocab = 512 if args.tiny else 152064
    options = case_options(args, case, cuda)
    if case == "oom":
        return run_oom(args, options, vocab, result)
    if case == "full-layers-refuse":
        return run_refusal(args, options, vocab, dev, result)
    layers = (args.layers or None) if case == "full-layers" else None
    t0 = time.perf_counter()
    model, base = build(SIZE[case], tiny=args.tiny, dtype=torch.bfloat16, mode=mode,
                        init_device=dev, vocab=vocab, layers=layers, socket=args.socket,
                        min_bytes=options.get("min_offload_bytes", 1 << 20))
    WRAPPED["base"] = base
    result["build_s"] = round(time.perf_counter() - t0, 1)
    result["layers"] = len(model.model.layers)
    result["params"] = sum(p.numel() for p in model.parameters())
    result["trained_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if case in FULL:
        options.update(pool_option(args.grad_pool, model))
    if case == "full-layers":
        # The deepest shape that trains: --layers, or fewer blocks while the planner
        # refuses it (each refused depth is recorded; full-layers-refuse then starts
        # above the depth trained).
        result["refused_above"] = []
        for _ in range(args.refuse_search):  # at most as many blocks as the refusal grows
            if len(model.model.layers) == 1 or not paging_memory.plan_only(model, options):
                break
            result["refused_above"].append(len(model.model.layers))
            shrink(model)
            options.update(pool_option(args.grad_pool, model))
        result["layers"] = len(model.model.layers)
        result["params"] = result["trained_params"] = sum(p.numel() for p in model.parameters())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model, opt = trainstream.wrap(model, lr=args.lr, **options)
    result["wrap_s"] = round(time.perf_counter() - t0, 1)
    WRAPPED["model"] = model
    train(args, case, model, opt, vocab, dev, cuda, result)
    if base is not None:
        rep = trainstream.memory_report(model)
        result["frozen_base"] = {
            "daemon_region_bytes": base.capacity, "placed_bytes": base.placed,
            "registered": base.registered, "why_not": None if base.registered else base.why,
            # A per-process copy of frozen weights would show here: the pager's own
            # host buffers (pinned "weights"), none when it pages from the region.
            "process_weight_buffers_bytes": rep["pinned_by_tag"].get("weights", 0),
            "pager_host_buffers": rep["params"].get("host_buffers_registered", 0)}
    # No unwrap(): it would copy the paged trained weights out of the daemon's slots,
    # and the process ends here anyway.
    return result


def train(args, case, model, opt, vocab, dev, cuda, result) -> None:
    """The training loop and everything measured around it, into ``result``."""
    import torch
    import trainstream
    session = model._trainstream_session
    seq, batch = (32, 2) if args.tiny else (args.seq, args.batch)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(vocab, (batch, seq), generator=g).to(dev)
    mode = MODE.get(case, "full")
    # full-layers: exactly --layer-steps steps, the first two as warm-up (every loss kept).
    warmup_min, max_warmup, measure = (2, 2, args.layer_steps - 2) if case == "full-layers" \
        else (args.warmup, args.max_warmup, args.steps)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def moved():
        rep = trainstream.memory_report(model)
        act, t = rep["activations"], rep["transfers"]
        return (rep["params"].get("bytes_h2d", 0) + t["bytes_d2h"] + t["bytes_h2d"]
                + t.get("bytes_pcie", 0) + 2 * act.get("bytes_offloaded", 0))
    losses, times = [], []
    # Warm up for warmup_min steps, and on while the plan still adapts (up to
    # max_warmup): the measured steps are the settled plan's.
    warmup, step = None, 0
    while warmup is None or step < warmup + measure:
        if warmup is None and step >= warmup_min and (not session.adapting
                                                      or step >= max_warmup):
            warmup = step
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            bytes0, alloc0 = moved(), steps.alloc_stats(cuda)
        step += 1
        sync()
        t = time.perf_counter()
        loss = steps.train_step(model, opt, ids, dev, mode)
        sync()
        times.append(time.perf_counter() - t)
        losses.append(round(loss.item(), 4))
        print(f"step {step} loss {losses[-1]} {times[-1]:.3f} s", flush=True)
    measured = times[warmup:]
    # Allocator churn over the measured steps: retries (the cap made the caching
    # allocator free its cache and synchronize) and cudaMalloc/cudaFree calls.
    alloc = {k: v - alloc0.get(k, 0) for k, v in steps.alloc_stats(cuda).items()}
    if cuda:
        alloc["max_reserved_gib"] = _gib(torch.cuda.max_memory_reserved())
    profile = steps.profile_step(model, opt, ids, dev, mode, cuda) if args.profile else None
    step_s = sorted(measured)[len(measured) // 2]
    per_step = (moved() - bytes0) / max(1, measure)
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    cap = None if args.uncapped else (args.cap_gib * 2**30 if cuda else args.tiny_cap_kib << 10)
    rep = trainstream.memory_report(model)
    status = json.loads(trainstream._native.daemon.connect(args.socket).status_json())
    st = opt.stats()
    paged = rep["params"]
    result.update(
        step_s=round(step_s, 4), warmup_steps=warmup,
        step_times=[round(t, 4) for t in measured], allocator=alloc, losses=losses,
        loss_decreased=losses[-1] < losses[0],
        peak_vram_gib=_gib(peak), within_cap=(cap is None or peak <= cap),
        host_rss_gib=_gib(_rss()), daemon_shm_gib=_gib(status["budget"]["used"]),
        pcie_bytes_per_step=int(per_step), pcie_gb_s=round(per_step / step_s / 1e9, 2),
        # The PCIe floor: the bytes that crossed per step at 55 GB/s; and the weights'
        # share alone (every paged block's bytes H2D twice: forward and backward).
        pcie_floor_s=round(per_step / (PCIE_GB_S * 1e9), 4),
        paged_weight_bytes=paged.get("paged_bytes", 0),
        weights_floor_s=round(2 * paged.get("paged_bytes", 0) / (PCIE_GB_S * 1e9), 4),
        paged_blocks=len(paged.get("paged_blocks", [])),
        adapting=session.adapting, optimizer_mode=opt.optimizer_mode,
        plan={k: rep["plan"].get(k) for k in ("paged_blocks", "moment_dtype", "quantize",
                                              "usable_vram", "host_bytes", "decisions")},
        activation_policy=rep["activations"].get("policy"),
        attention=rep["attention"],
        grad_pool_bytes=st.get("grad_pool_bytes", 0),
        grad_pool_gib=_gib(st.get("grad_pool_bytes", 0)), pool_waits=st.get("pool_waits", 0),
        pool_wait_s=round(st.get("pool_wait_s", 0.0), 3),
        events=[{k: v for k, v in e.items() if k != "time"} for e in rep["events"]
                if e["kind"] in ("plan", "watchdog", "attention")])
    # The host figure: paging_memory.py's docstring says what it counts.
    base = WRAPPED.get("base")
    result.update(paging_memory.host_figure(status, result["trained_params"],
                                            base.session.id if base is not None else None))
    if case == "full-layers" and not result["loss_decreased"]:
        result["error"] = f"loss did not decrease over {len(losses)} steps: {losses}"
    if profile is not None:
        result["profile"] = profile


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
    ap.add_argument("--grad-pool", default="pool",
                    help="full cases: comma-separated variants, one run each: pool (wrap's "
                         "default 'auto', the gradient pool; 'auto' is the same), slots "
                         "(grad_pool=0) or a size (default pool)")
    ap.add_argument("--layers", type=int, default=None,
                    help=f"full-layers: blocks of the 14B shape (default {DEFAULT_LAYERS}; "
                         "--tiny: 4); full-layers-refuse starts one above")
    ap.add_argument("--layer-steps", type=int, default=10, help="full-layers: steps (default 10)")
    ap.add_argument("--refuse-search", type=int, default=12,
                    help="full-layers-refuse: blocks to grow at most; full-layers: blocks "
                         "to drop at most while the planner refuses --layers (default 12)")
    ap.add_argument("--refuse-budget", default="2900K",
                    help="--tiny: the budget of full-layers-refuse's own daemon (default "
                         "2900K: 5 tiny blocks fit, 6 do not, so the search grows once)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: checks the script on CPU")
    ap.add_argument("--tiny-cap-kib", type=int, default=1024,
                    help="declared device capacity for --tiny on a CPU machine")
    ap.add_argument("--socket", default=None, help="an existing daemon (else a private one)")
    ap.add_argument("--budget", default="90%", help="shared-memory budget of the private daemon")
    ap.add_argument("--daemon-args", default="",
                    help="more flags for the private daemon, one string (e.g. '--recovery-grace 0': "
                         "no redo journal, to time the update without it)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--jsonl", default=None, help="also append each run's result to this file")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="do not pin each run to the CPUs local to the GPU")
    ap.add_argument("--uncapped", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.layers is None and not args.tiny:
        args.layers = DEFAULT_LAYERS
    if args.case:
        own, dirs = None, []  # a case given no daemon starts its own (with --budget)
        if args.socket is None:
            own, args.socket, dirs = start_daemon(args.budget, shlex.split(args.daemon_args))
        try:
            r = run_case(args)
        except Exception as e:  # noqa: BLE001 (reported, not hidden)
            import traceback
            import torch
            r = {"case": args.case, "error": f"{type(e).__name__}: {str(e)[:600]}",
                 "trace": traceback.format_exc()[-1500:]}
            if torch.cuda.is_available():
                r["peak_vram_gib"] = _gib(torch.cuda.max_memory_allocated())
            r.update(steps.failure_report(torch))
        print("RESULT " + json.dumps(r), flush=True)
        steps.WRAPPED.clear()  # the model and its base's session before the daemon
        stop_daemon(own, dirs)
        return 0
    proc, cleanup, results = None, [], []
    if args.socket is None:
        proc, args.socket, cleanup = start_daemon(args.budget, shlex.split(args.daemon_args))
    try:
        for case in args.cases.split(","):
            if case not in CASES:
                raise SystemExit(f"--cases: {case!r} is not one of {', '.join(CASES)}")
            for cmd in case_commands(args, case):
                r = run_case_process(cmd, case, args.timeout)
                results.append(r)
                if case == "full-layers" and r.get("layers") and "error" not in r:
                    args.layers = r["layers"]  # full-layers-refuse starts above it
                print(json.dumps(r, indent=1), flush=True)
                if args.jsonl:
                    with open(args.jsonl, "a") as f:
                        f.write(json.dumps(r) + "\n")
    finally:
        stop_daemon(proc, cleanup)
    print_summary(results)
    return 0 if all("error" not in r for r in results) else 1


def case_commands(args, case: str):
    """One command line per run of ``case``: the 14B cases alternate capped and uncapped
    runs (--repeat pairs: the host's speed drifts between processes, and each pair sees
    the same drift), the full cases run once per --grad-pool variant."""
    variants = [False, True] * args.repeat if case.startswith("14b") else [False]
    pools = args.grad_pool.split(",") if case in FULL else [args.grad_pool]
    socket = args.socket
    if case == "full-layers-refuse" and args.tiny:
        socket = None  # its own daemon with a small budget: a tiny model fits any host
    for pool in pools:
        for uncapped in variants:
            cmd = [sys.executable, __file__, "--case", case, "--cap-gib", str(args.cap_gib),
                   "--batch", str(args.batch), "--seq", str(args.seq), "--steps",
                   str(args.steps), "--warmup", str(args.warmup), "--max-warmup",
                   str(args.max_warmup), "--lr", str(args.lr), "--grad-pool", pool,
                   "--layer-steps", str(args.layer_steps), "--refuse-search",
                   str(args.refuse_search), "--tiny-cap-kib", str(args.tiny_cap_kib),
                   *(["--layers", str(args.layers)] if args.layers else []),
                   *(["--profile"] if args.profile else []),
                   *([] if args.pin else ["--no-pin"]),
                   *(["--tiny"] if args.tiny else []),
                   *(["--uncapped"] if uncapped else [])]
            yield cmd + (["--socket", socket] if socket else
                         ["--budget", args.refuse_budget])


if __name__ == "__main__":
    sys.exit(main())
