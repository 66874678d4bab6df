"""Data parallel (docs/data-parallel.md): the ranks of a job on one machine share one
optimizer state in the daemon.

``OffloadAdamW`` asks :func:`plan` what to do:

* ``None``: an independent session (no process group, ``distributed=False``).
* mode ``"group"`` (default): the session joins the machine's group. Every rank
  posts its gradient to its own slot; the daemon sums them (divided by the world
  size), updates once, and every rank copies the one new weight back. With
  several machines, local rank 0 all-reduces each machine sum with
  ``torch.distributed`` (NCCL through a GPU buffer, or gloo over the shared-memory
  slot: :func:`choose_reduce_backend`) before the update:
  :meth:`DataParallelPlan.reduce_machine_sums`.
* mode ``"replicated"`` (``TRAINSTREAM_SHM=0`` or ``shared_state=False``): each
  rank keeps its own session and state; gradients are averaged with
  ``torch.distributed.all_reduce`` before they are posted (the comparison and
  fallback).

Either way every rank checks that it starts from the same weights as rank 0.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch

from .._native.wire import OP_REDUCE_READY as _OP_REDUCE_READY

_MAX_KEY_BYTES = 200


def _dist():
    import torch.distributed as dist  # noqa: PLC0415
    return dist


def _process_group_ready() -> bool:
    dist = _dist()
    return dist.is_available() and dist.is_initialized()


def _env_int(*names: str) -> Optional[int]:
    """The first of `names` set in the environment, as an int (SLURM's "2(x3)" -> 2)."""
    for n in names:
        v = os.environ.get(n)
        if v:
            digits = v.split("(")[0].split(",")[0]
            try:
                return int(digits)
            except ValueError:
                raise ValueError(f"environment variable {n}={v!r} is not an integer") from None
    return None


@dataclass
class DataParallelPlan:
    """How this rank takes part in data parallel (see the module docstring)."""
    mode: str                 # "group" or "replicated"
    key: str                  # the group's key on this machine
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    nnodes: int
    timeout_s: float
    leaders: Any = None       # process group of the local rank 0s (group mode, nnodes > 1)
    reduce_backend: str = "gloo"  # how the leaders all-reduce (choose_reduce_backend)
    stats: Dict[str, float] = field(default_factory=lambda: {"allreduce_s": 0.0,
                                                             "allreduce_bytes": 0})

    @property
    def leader(self) -> bool:
        return self.local_rank == 0

    def describe(self) -> str:
        return (f"data-parallel group {self.key!r} (local rank {self.local_rank} of "
                f"{self.local_world_size}, node {self.node_rank} of {self.nnodes})")

    def membership(self) -> Dict[str, Any]:
        """The ``group`` argument of ``_control.Client.attach``."""
        return dict(key=self.key, local_rank=self.local_rank,
                    local_world_size=self.local_world_size, node_rank=self.node_rank,
                    nnodes=self.nnodes, world_size=self.world_size, timeout_s=self.timeout_s)

    # ------------------------------------------------------------ set-up
    def setup_collectives(self) -> None:
        """Creates the local-rank-0 process group (every rank must call this)."""
        if self.mode != "group" or self.nnodes == 1:
            return
        dist = _dist()
        self.reduce_backend = choose_reduce_backend(
            os.environ.get("TRAINSTREAM_DP_REDUCE", "auto"), str(dist.get_backend()),
            torch.cuda.is_available())
        ranks = [n * self.local_world_size for n in range(self.nnodes)]
        self.leaders = dist.new_group(ranks=ranks, backend=self.reduce_backend,
                                      timeout=timedelta(seconds=self.timeout_s))

    def check_same_weights(self, checksum: str) -> None:
        """Replicated mode: every rank must hold rank 0's initial weights (the group
        mode's daemon checks this itself). Raises ValueError on every rank otherwise."""
        if self.mode != "replicated":
            return
        dist = _dist()
        sums: List[Optional[str]] = [None] * self.world_size
        dist.all_gather_object(sums, checksum)
        bad = [r for r, s in enumerate(sums) if s != sums[0]]
        if bad:
            raise ValueError(
                f"trainstream: rank(s) {bad} start from other weights than rank 0 (checksums "
                f"differ); every rank must start from the same weights (seed the model the same "
                f"way, or load the same checkpoint, before wrap())")

    # ------------------------------------------------------------ per step
    def average_gradients(self, grads: List[torch.Tensor]) -> None:
        """Replicated mode: grads := mean over all ranks (as DDP), in place."""
        dist = _dist()
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.div_(self.world_size)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n

    def reduce_machine_sums(self, wait: Callable, post_reduced: Callable, step: int,
                            posted: List[Any], on_other: Callable[[dict], None]) -> None:
        """Local rank 0 with several machines: all-reduce every machine sum of `step`.

        The daemon answers REDUCE_READY per parameter once all local ranks posted
        it. Every machine's leader reduces in the same order (descending param id,
        roughly backward's order) so the collectives pair up. Completions other than
        REDUCE_READY go to `on_other`.
        """
        dist = _dist()
        order = sorted(posted, key=lambda e: -e.param_id)
        ready = set()
        done = [0]

        def want(c):
            if c["opcode"] == _OP_REDUCE_READY and c["step"] == step:
                ready.add(c["param_id"])
            else:
                on_other(c)
            while done[0] < len(order) and order[done[0]].param_id in ready:
                e = order[done[0]]
                t0 = time.monotonic()
                if self.reduce_backend == "nccl":
                    buf = e.sum_slot.to(torch.cuda.current_device())
                    dist.all_reduce(buf, group=self.leaders)
                    e.sum_slot.copy_(buf)  # synchronous: the daemon reads it next
                else:
                    dist.all_reduce(e.sum_slot, group=self.leaders)
                self.stats["allreduce_s"] += time.monotonic() - t0
                self.stats["allreduce_bytes"] += e.sum_slot.numel() * 4
                post_reduced(e.param_id, step)
                done[0] += 1
            return done[0] == len(order)
        if order:
            wait(want)


def choose_reduce_backend(requested: str, default_group_backend: str, cuda: bool) -> str:
    """How machines' local rank 0s all-reduce their sums ($TRAINSTREAM_DP_REDUCE).
    "auto": NCCL when the job's default process group uses NCCL (its ranks then have
    their GPUs set), since on the 2-GPU H200 host NCCL through a GPU buffer took 0.35 s
    a step where gloo on the shared-memory sum took 1.13 s (docs/data-parallel.md);
    else gloo."""
    if requested not in ("auto", "gloo", "nccl"):
        raise ValueError(f"TRAINSTREAM_DP_REDUCE={requested!r}: accepted: 'auto' (NCCL when "
                         "the default process group uses it), 'gloo' (on the shared-memory "
                         "sum) or 'nccl' (through a GPU buffer)")
    if requested == "nccl" and not cuda:
        raise ValueError("TRAINSTREAM_DP_REDUCE='nccl' needs CUDA; use 'gloo'")
    if requested == "auto":
        return "nccl" if cuda and "nccl" in default_group_backend else "gloo"
    return requested


def weights_checksum(named: List[tuple]) -> str:
    """A digest of (name, tensor) pairs: names, shapes, dtypes and bytes."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in named:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def plan(options: Dict[str, Any]) -> Optional[DataParallelPlan]:
    """What ``options`` (validated) and the environment ask for; None when not
    data parallel. Raises ValueError naming what is missing."""
    want = options["distributed"]
    if want is False:
        return None
    ready = _process_group_ready()
    dist = _dist()
    if want is None and not (ready and dist.get_world_size() > 1):
        return None
    world_size = dist.get_world_size() if ready else _env_int("WORLD_SIZE", "SLURM_NTASKS")
    rank = dist.get_rank() if ready else _env_int("RANK", "SLURM_PROCID")
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID")
    local_world_size = _env_int("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")
    missing = [n for n, v in (("WORLD_SIZE", world_size), ("RANK", rank),
                              ("LOCAL_RANK", local_rank),
                              ("LOCAL_WORLD_SIZE (or SLURM_NTASKS_PER_NODE)", local_world_size))
               if v is None]
    if missing:
        raise ValueError(
            f"option distributed={want!r}: {', '.join(missing)} not set; launch with torchrun "
            "(or srun), or pass distributed=False")
    if local_world_size < 1 or world_size % local_world_size != 0:
        raise ValueError(
            f"option distributed: WORLD_SIZE={world_size} is not a multiple of LOCAL_WORLD_SIZE="
            f"{local_world_size}; machines with different numbers of ranks are not supported")
    nnodes = world_size // local_world_size
    node_rank = _env_int("GROUP_RANK", "SLURM_NODEID")
    if node_rank is None:
        node_rank = rank // local_world_size
    if rank != node_rank * local_world_size + local_rank:
        raise ValueError(
            f"option distributed: rank {rank} is not node_rank * LOCAL_WORLD_SIZE + LOCAL_RANK "
            f"({node_rank} * {local_world_size} + {local_rank}); ranks must be numbered machine "
            "by machine, as torchrun does")
    shared = options["shared_state"]
    if shared is None:
        shared = os.environ.get("TRAINSTREAM_SHM", "1") != "0"
    mode = "group" if shared else "replicated"
    if not ready and (mode == "replicated" or nnodes > 1):
        why = "per-rank copies (TRAINSTREAM_SHM=0)" if mode == "replicated" else \
            f"{nnodes} machines"
        raise ValueError(
            f"option distributed: {why} need torch.distributed to average gradients; call "
            "torch.distributed.init_process_group() before wrap()")
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    master = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    key = f"{options['job'] or 'job'}|{run}|{master}|node{node_rank}"
    if len(key.encode()) > _MAX_KEY_BYTES:
        key = key[:80] + "#" + hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
    return DataParallelPlan(mode=mode, key=key, rank=rank, world_size=world_size,
                            local_rank=local_rank, local_world_size=local_world_size,
                            node_rank=node_rank, nnodes=nnodes,
                            timeout_s=float(options["timeout_s"]))
