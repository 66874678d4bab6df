"""The training client of the kill loop (kill_loop.py): trains a small GPT through
trainstream.wrap() for a fixed number of steps on fixed data, checkpoints, loads a base
now and then, and says on stdout where it is, so the harness can kill the daemon (or
this process) at chosen moments and check what it reports.

Lines on stdout (each flushed):
  phase <name> <step>   about to run <name> (backward, step, state_dict, base_load) of
                        optimizer step <step> (the one in flight); "between" after
                        step() returned: <step> is the next one, which is what a
                        daemon killed from then on can lose (never a kill's target)
  resumed <step> <json> the optimizer resumed after the daemon died (replayed and
                        landed gradients, seconds)
  lost <step> <json>    DaemonError: the state could not be resumed; <json> holds the
                        message and the step as the optimizer counts it (from this
                        process's start). The process then exits with code 3.
  done <json>           finished; <json> holds the optimizer's recovery figures
  hold <step> backward  (--in-flight-at) about to run backward of <step>; waits for a
                        line on stdin (the harness pauses the daemon first)
  inflight <step> <json> (--in-flight-at) backward of <step> has posted every gradient
                        (<json>: how many) and step() has not run; waits for a line
                        on stdin (the harness kills the paused daemon first, so none
                        of them was applied)
Started with --resume, it goes on from its last checkpoint (model, optimizer, step):
a killed worker, or one whose state was lost, picks up there.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import trainstream  # noqa: E402
import trainstream.base  # noqa: E402,F401 (load_base)
from tiny_gpt import GPTConfig, TinyGPT, corpus, text_batches  # noqa: E402


def say(*words) -> None:
    print(*words, flush=True)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", default=None, help="daemon socket (default: embedded mode)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--clip", type=float, default=0.0, help="max_grad_norm (0: none)")
    ap.add_argument("--grad-pool", default="auto",
                    help="wrap()'s grad_pool: 'auto', 0 (gradient slots) or bytes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt", required=True, help="checkpoint file (written every --ckpt-every)")
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--base", default=None, help="a .safetensors file to load as a base")
    ap.add_argument("--base-every", type=int, default=25)
    ap.add_argument("--out", required=True, help="where the final weights go")
    ap.add_argument("--resume", action="store_true", help="go on from --ckpt if it exists")
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--device", default="cpu", help="where the model trains (cpu, cuda)")
    ap.add_argument("--optimizer-mode", default="cpu",
                    help="wrap()'s optimizer_mode: cpu (the daemon's host AdamW, whose state "
                         "the daemon keeps) or gpu (zero-copy; its state is a client region)")
    ap.add_argument("--in-flight-at", default="",
                    help="comma-separated steps whose backward waits for the harness before "
                         "it runs and once it has posted its gradients (hold, inflight)")
    ap.add_argument("--dp", action="store_true",
                    help="one rank of a data-parallel job (RANK, WORLD_SIZE, LOCAL_RANK, "
                         "LOCAL_WORLD_SIZE set): the ranks share one state in the daemon")
    return ap.parse_args(argv)


def build(args):
    torch.manual_seed(args.seed)
    cfg = GPTConfig(n_embd=args.n_embd, n_head=2)
    model = TinyGPT(cfg).to(args.device)
    opts = dict(timeout_s=args.timeout_s, profile=False, check_memory=False, offload=True,
                optimizer_mode=args.optimizer_mode)
    if args.socket:
        opts["socket"] = args.socket
    if args.clip > 0:
        opts["max_grad_norm"] = args.clip
    opts["grad_pool"] = args.grad_pool if args.grad_pool == "auto" else int(args.grad_pool)
    world, rank = 1, 0
    if args.dp:
        opts["distributed"] = True
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), **opts)
    # Each rank takes its rows of the global batch (as DDP's sampler would).
    rows = slice(rank * 4, (rank + 1) * 4)
    batches = [(x[rows].to(args.device), y[rows].to(args.device)) for x, y in
               text_batches(corpus(), cfg, batch=4 * world, steps=args.steps, seed=args.seed)]
    return model, opt, batches, rank


def load_base(args, step: int) -> None:
    """Loads and releases the base; a daemon that dies meanwhile fails the load, which is
    then done again (bases are the daemon's cache: nothing of them needs resuming)."""
    deadline = time.monotonic() + args.timeout_s
    while True:
        say("phase", "base_load", step)
        try:
            trainstream.base.load_base(args.base, "int8", socket=args.socket,
                                       register_cuda=False).release()
            return
        except trainstream.TrainStreamError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def checkpoint(args, model, opt, step: int, rank: int) -> None:
    say("phase", "state_dict", step + 1)
    state = {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}
    if rank != 0:  # a group's one state, saved by local rank 0
        return
    tmp = args.ckpt + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, args.ckpt)  # a worker killed while saving leaves the last one whole


def end_together(args, opt, rank: int) -> None:
    """Data parallel: no rank leaves (which ends its session and so its group) before
    every rank is done; a rank waiting here keeps asking the daemon (synchronize), so a
    daemon that dies meanwhile finds every rank back to resume the group."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    world = int(os.environ["WORLD_SIZE"])
    mark = f"{args.ckpt}.{run}.done"
    deadline = time.monotonic() + args.timeout_s

    def barrier(suffix: str, meanwhile) -> None:
        open(f"{mark}{rank}{suffix}", "w").close()
        while not all(os.path.exists(f"{mark}{r}{suffix}") for r in range(world)):
            if time.monotonic() > deadline:
                raise trainstream.DaemonError("the other ranks did not finish")
            meanwhile()
            time.sleep(0.02)
    barrier("", opt.synchronize)
    # Second phase, with no daemon call: no rank detaches (ending the group) before
    # every rank has left the first, however long one of them stalls.
    barrier(".seen", lambda: None)


class Recoveries:
    """Says `resumed` for each recovery the optimizer made since the last look."""

    def __init__(self, opt):
        self.opt = opt
        self.seen = dict(opt.stats())

    def report(self, step: int) -> None:
        now = self.opt.stats()
        for _ in range(now.get("recoveries", 0) - self.seen.get("recoveries", 0)):
            say("resumed", step, json.dumps({
                "replayed": now["replayed_grads"] - self.seen["replayed_grads"],
                "landed": now["landed_grads"] - self.seen["landed_grads"],
                "seconds": now["resume_s"] - self.seen["resume_s"]}))
        self.seen = dict(now)


def wait_for_harness() -> None:
    if not sys.stdin.readline():
        raise SystemExit("the harness closed stdin")


def main(argv=None) -> int:
    args = parse(argv)
    in_flight_at = {int(s) for s in args.in_flight_at.split(",") if s}
    faulthandler.register(signal.SIGUSR1)  # the harness asks a stuck worker where it is
    model, opt, batches, rank = build(args)
    start = 0
    if args.resume and os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, map_location="cpu")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    seen = Recoveries(opt)
    try:
        for i in range(start, args.steps):
            step = i + 1
            if args.base and i % args.base_every == args.base_every // 2:
                load_base(args, step)
            x, y = batches[i]
            say("phase", "backward", step)
            if step in in_flight_at:
                say("hold", step, "backward")
                wait_for_harness()
                posted_before = opt.stats()["grads_posted"]
            loss = model(x, y)
            loss.backward()
            if step in in_flight_at:
                posted = opt.stats()["grads_posted"] - posted_before
                say("inflight", step, json.dumps({"posted": posted}))
                wait_for_harness()
            seen.report(step)
            say("phase", "step", step)
            opt.step()
            say("phase", "between", step + 1)
            opt.zero_grad()
            seen.report(step)
            if step % args.ckpt_every == 0:
                checkpoint(args, model, opt, step, rank)
                seen.report(step + 1)
        out = args.out if rank == 0 else args.out.replace(".pt", f"-rank{rank}.pt")
        torch.save({n: p.detach().cpu().clone() for n, p in model.named_parameters()}, out)
        if args.dp:
            end_together(args, opt, rank)
    except trainstream.DaemonError as e:
        # The optimizer counts its steps from this process's start (the checkpoint's).
        say("lost", start + opt.step_id + 1,
            json.dumps({"message": str(e), "optimizer_step": opt.step_id + 1}))
        return 3
    stats = opt.stats()
    say("done", json.dumps({k: stats.get(k) for k in
                            ("steps", "recoveries", "replayed_grads", "landed_grads", "resume_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
