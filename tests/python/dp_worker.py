"""One rank of the data-parallel tests (test_dp.py): run under torchrun, or as a plain
process with RANK/LOCAL_RANK/... set by the test (then with --no-process-group).

Trains TinyGPT for --steps steps. Each step's global batch has batch * WORLD_SIZE rows
(text_batches with seed 0, the same batches the test's single-process reference
trains on); this rank takes rows [rank * batch, (rank + 1) * batch). Writes
<out>/rank<R>.pt: {"params", "losses", "status" and "opt_state" (local rank 0, while
every rank is still attached), "stats", "error", "error_time"}; exits 3 on an error.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_gpt import GPTConfig, TinyGPT, corpus, text_batches  # noqa: E402

import trainstream  # noqa: E402
from trainstream._native import daemon as _daemon  # noqa: E402


def param_groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _late_slot_writes(delay_s: float) -> None:
    """Delays this rank (local rank 0) after the daemon has mapped the group's staging
    slots and before it writes the initial weights into them (DaemonBackend.register):
    the other ranks must not train on the slots before that."""
    from trainstream.optim.daemon_session import DaemonSession  # noqa: PLC0415
    map_staging = DaemonSession.map_staging

    def late(self, *a, **k):
        map_staging(self, *a, **k)
        time.sleep(delay_s)
    DaemonSession.map_staging = late


def _late_copy(step: int, delay_s: float) -> None:
    """Delays this rank's first copy of new weights after ``step`` (its PARAM_READYs), so
    the other ranks go on to the next step first."""
    from trainstream._native.wire import OP_PARAM_READY  # noqa: PLC0415
    from trainstream.optim.daemon_backend import DaemonBackend  # noqa: PLC0415
    take = DaemonBackend._take
    late = {"done": False}

    def slow(self, c, r):
        if c["opcode"] == OP_PARAM_READY and c["step"] == step and not late["done"]:
            late["done"] = True
            time.sleep(delay_s)
        return take(self, c, r)
    DaemonBackend._take = slow


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-grad-norm", type=float, default=None)
    ap.add_argument("--model-seed", type=int, default=0)
    ap.add_argument("--n-embd", type=int, default=32)
    ap.add_argument("--die-after-backward", type=int, default=0,
                    help="exit abruptly after this step's backward (the dying-rank test)")
    ap.add_argument("--timeout-s", type=float, default=30.0)
    ap.add_argument("--no-process-group", action="store_true")
    ap.add_argument("--cuda", action="store_true", help="the model on cuda:<LOCAL_RANK>")
    ap.add_argument("--param-offload", action="store_true",
                    help="page every block's weights (their gradients bypass p.grad)")
    ap.add_argument("--halve-after", type=int, default=0,
                    help="every rank halves its weights in place after this step")
    ap.add_argument("--late-copy", type=float, default=0.0,
                    help="local rank 1 copies the new weights of step --halve-after this late")
    ap.add_argument("--leader-late-slots", type=float, default=0.0,
                    help="local rank 0 waits this long between its registration's answer and "
                         "writing the group's initial weights into the param slots")
    args = ap.parse_args()

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}" if args.cuda else "cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    dist = None
    if not args.no_process_group:
        import torch.distributed as dist  # noqa: PLC0415
        dist.init_process_group("nccl" if args.cuda else "gloo")
    result = {"params": None, "losses": [], "status": None, "stats": None, "error": None,
              "error_time": None}
    code = 0
    try:
        torch.manual_seed(args.model_seed)
        cfg = GPTConfig(n_embd=args.n_embd)
        model = TinyGPT(cfg)
        if args.cuda:
            model.to(device)
        opt = torch.optim.AdamW(param_groups(model), lr=args.lr)
        options = dict(timeout_s=args.timeout_s, distributed=True)
        if args.max_grad_norm:
            options["max_grad_norm"] = args.max_grad_norm
        if args.param_offload:
            options.update(param_offload=True, min_offload_bytes=0)
        if args.leader_late_slots and local_rank == 0:
            _late_slot_writes(args.leader_late_slots)
        if args.late_copy and local_rank == 1:
            _late_copy(args.halve_after, args.late_copy)
        model, opt = trainstream.wrap(model, opt, **options)
        batches = text_batches(corpus(), cfg, batch=args.batch * world, steps=args.steps)
        for step, (x, y) in enumerate(batches, start=1):
            rows = slice(rank * args.batch, (rank + 1) * args.batch)
            loss = model(x[rows].to(device), y[rows].to(device))
            loss.backward()
            if step == args.die_after_backward:
                with open(os.path.join(args.out, f"died{rank}"), "w") as f:
                    f.write(str(time.time()))
                os._exit(1)  # mid-step: gradients posted, no step()
            opt.step()
            opt.zero_grad()
            result["losses"].append(loss.item())
            if step == args.halve_after:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.5)
        result["stats"] = opt.stats()
        if local_rank == 0:  # the group's one state, read through this rank
            result["opt_state"] = opt.state_dict()
        if dist is not None:
            dist.barrier()  # every rank still attached while local rank 0 reads status
        if local_rank == 0:
            result["status"] = json.loads(_daemon.connect(None, spawn=False).status_json())
        if dist is not None:
            dist.barrier()
        result["params"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    except Exception as e:  # noqa: BLE001 (reported to the test)
        result["error"] = f"{type(e).__name__}: {e}"
        result["error_time"] = time.time()
        code = 3
    torch.save(result, os.path.join(args.out, f"rank{rank}.pt"))
    if dist is not None and code == 0:
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
