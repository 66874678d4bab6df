"""Data parallel (docs/data-parallel.md): ranks launched with torchrun share one optimizer
state in the daemon and end up with the weights of one process training on the
concatenated batch. CPU only (gloo); the same script runs with CUDA models in
benchmarks/dp/bench_dp.py on the GPU host."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

import trainstream
from conftest import wait_until
from tiny_gpt import GPTConfig, TinyGPT, corpus, text_batches

HERE = Path(__file__).resolve().parent
WORKER = HERE / "dp_worker.py"
STEPS = 10
BATCH = 4
LR = 3e-3
PARAM_TOL = 1e-6
LAUNCH_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(daemon, **extra) -> dict:
    env = dict(os.environ)
    env["TRAINSTREAM_SOCKET"] = daemon.socket
    env["OMP_NUM_THREADS"] = "1"
    env.pop("TRAINSTREAM_SHM", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _torchrun(daemon, out: Path, nproc: int, *worker_args, nnodes: int = 1, node_rank: int = 0,
              port: int | None = None, env_extra=None) -> subprocess.Popen:
    if nnodes == 1:
        rdzv = ["--standalone"]
    else:  # static rendezvous: --node-rank is honoured, so each launch knows its daemon
        rdzv = ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr",
                "127.0.0.1", "--master-port", str(port)]
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, "--nproc-per-node", str(nproc),
           "--monitor-interval", "0.1", str(WORKER), "--out", str(out), "--steps", str(STEPS),
           "--batch", str(BATCH), "--lr", str(LR), *worker_args]
    return subprocess.Popen(cmd, env=_env(daemon, **(env_extra or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, what: str) -> str:
    try:
        out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"{what} did not finish within {LAUNCH_TIMEOUT_S} s:\n{out}") from None
    assert proc.returncode == 0, f"{what} exited with {proc.returncode}:\n{out}"
    return out


def _results(out: Path, ranks: int) -> list:
    res = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(ranks)]
    for r, x in enumerate(res):
        assert x["error"] is None, f"rank {r}: {x['error']}"
    return res


def _reference(world: int, device: str = "cpu", max_grad_norm=None, halve_after=0):
    """One process, plain torch.optim.AdamW, on the concatenated batch of `world` ranks
    (halving the weights after step ``halve_after``, as dp_worker's --halve-after)."""
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = TinyGPT(cfg).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR, foreach=False)
    batches = text_batches(corpus(), cfg, batch=BATCH * world, steps=STEPS)
    for step, (x, y) in enumerate(batches, start=1):
        model(x.to(device), y.to(device)).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad()
        if step == halve_after:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
    model.reference_optimizer = opt
    return model


def _assert_equal_to_reference(ref, params: dict, who: str):
    for name, p in ref.state_dict().items():
        diff = (p.cpu() - params[name]).abs().max().item()
        assert diff <= PARAM_TOL, f"{who}: {name} max |diff| {diff:.3g} > {PARAM_TOL}"


def _wait_released(daemon):
    """Sessions end when the daemon notices their processes are gone (pidfd)."""
    def released():
        s = daemon.status()
        return s["groups"] == [] and s["sessions"] == [] and s["segments"] == []
    wait_until(released, 10, interval=0.05, what=f"the daemon to release everything: "
               f"{daemon.status()}")


def _state_bytes(status: dict) -> int:
    return status["segments_by_kind"]["state"]["bytes"]


def _one_rank_state_bytes(daemon) -> int:
    """The daemon's state memory for the same model and optimizer in one process."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig())
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=LR),
                                  socket=daemon.socket)
    try:
        return _state_bytes(daemon.status())
    finally:
        trainstream.unwrap(model)


def test_two_ranks_share_one_state_and_match_one_process(daemon, tmp_path):
    proc = _torchrun(daemon, tmp_path, 2)
    ref = _reference(2)
    _finish(proc, "torchrun --nproc-per-node 2")
    r0, r1 = _results(tmp_path, 2)
    _assert_equal_to_reference(ref, r0["params"], "rank 0")
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), f"{name}: ranks 0 and 1 differ"
    assert r0["stats"]["data_parallel"]["mode"] == "group"
    assert r0["losses"][-1] < r0["losses"][0], "the model should learn"
    # The group's one optimizer state, exported through rank 0, is torch's.
    theirs = ref.reference_optimizer.state_dict()["state"]
    ours = r0["opt_state"]["state"]
    assert sorted(ours) == sorted(theirs)
    for idx, st in theirs.items():
        assert int(ours[idx]["step"]) == int(st["step"]) == STEPS
        for k in ("exp_avg", "exp_avg_sq"):
            # Summing two half-batch gradients rounds differently from one full batch.
            err = (ours[idx][k] - st[k]).abs().max().item()
            assert err <= 1e-5 * st[k].abs().max().item(), (idx, k, err)

    status = r0["status"]
    groups = [g for g in status["groups"] if g["state"] == "running"]
    assert len(groups) == 1 and groups[0]["members"] == 2 and groups[0]["local_world_size"] == 2
    two = _state_bytes(status)
    one = _one_rank_state_bytes(daemon)
    assert two <= 1.1 * one, f"state memory with 2 ranks {two} B, with 1 rank {one} B"
    # Everything of the group is released once its ranks are gone.
    _wait_released(daemon)


def test_per_rank_copies_with_trainstream_shm_0(daemon, tmp_path):
    proc = _torchrun(daemon, tmp_path, 2, env_extra={"TRAINSTREAM_SHM": "0"})
    ref = _reference(2)
    _finish(proc, "torchrun --nproc-per-node 2 with TRAINSTREAM_SHM=0")
    r0, r1 = _results(tmp_path, 2)
    assert r0["stats"]["data_parallel"]["mode"] == "replicated"
    _assert_equal_to_reference(ref, r0["params"], "rank 0")
    _assert_equal_to_reference(ref, r1["params"], "rank 1")
    status = r0["status"]
    assert status["groups"] == []
    one = _one_rank_state_bytes(daemon)
    assert _state_bytes(status) >= 1.9 * one, "per-rank copies hold one state per rank"


@pytest.mark.parametrize("shm", ["1", "0"])
def test_paged_weights_match_one_process(daemon, tmp_path, shm):
    """Paged weights hand their gradients over in backward, past p.grad: the group must
    still sum them, and per-rank copies (replicated) must still average them."""
    proc = _torchrun(daemon, tmp_path, 2, "--param-offload", env_extra={"TRAINSTREAM_SHM": shm})
    ref = _reference(2)
    _finish(proc, f"torchrun --nproc-per-node 2 --param-offload, TRAINSTREAM_SHM={shm}")
    r0, r1 = _results(tmp_path, 2)
    assert r0["stats"]["data_parallel"]["mode"] == ("group" if shm == "1" else "replicated")
    _assert_equal_to_reference(ref, r0["params"], "rank 0")
    _assert_equal_to_reference(ref, r1["params"], "rank 1")


@pytest.mark.parametrize("shm,late", [("1", 0), ("1", 2), ("0", 0)],
                         ids=["group", "group, rank 1 copies late", "replicated"])
def test_weights_written_on_every_rank_are_taken(daemon, tmp_path, shm, late):
    """Every rank halves its weights in place after step 4 (Note [Weights written from
    outside the engine]): the group's one master takes local rank 0's, per-rank copies
    their own, and training goes on as one process's torch.optim.AdamW does. In a group
    the weights wait for the next gradients (Note [A group takes written weights with
    its next gradient]): a rank that copies step 4's weights late still copies step 4's."""
    proc = _torchrun(daemon, tmp_path, 2, "--halve-after", "4", "--late-copy", str(late),
                     env_extra={"TRAINSTREAM_SHM": shm})
    ref = _reference(2, halve_after=4)
    _finish(proc, f"torchrun --nproc-per-node 2 --halve-after 4, TRAINSTREAM_SHM={shm}")
    r0, r1 = _results(tmp_path, 2)
    assert r0["stats"]["data_parallel"]["mode"] == ("group" if shm == "1" else "replicated")
    _assert_equal_to_reference(ref, r0["params"], "rank 0")
    _assert_equal_to_reference(ref, r1["params"], "rank 1")


def test_paged_weights_wait_for_local_rank_0s_initial_weights(daemon, tmp_path):
    """A paged weight's home is the group's param slot, which local rank 0 alone fills
    with the initial weights: the other rank's registration must not end before that
    (Note [A member waits for the first weights]), however late local rank 0 writes."""
    proc = _torchrun(daemon, tmp_path, 2, "--param-offload", "--leader-late-slots", "2",
                     env_extra={"TRAINSTREAM_SHM": "1"})
    ref = _reference(2)
    _finish(proc, "torchrun --nproc-per-node 2 --param-offload --leader-late-slots 2")
    r0, r1 = _results(tmp_path, 2)
    assert r0["stats"]["data_parallel"]["mode"] == "group"
    _assert_equal_to_reference(ref, r1["params"], "rank 1")
    _assert_equal_to_reference(ref, r0["params"], "rank 0")


def test_two_machines_two_daemons(daemon_factory, tmp_path):
    """Also clips: the global norm is that of the gradient all-reduced across machines."""
    daemons = [daemon_factory(), daemon_factory()]
    port = _free_port()
    outs = [tmp_path / "node0", tmp_path / "node1"]
    procs = []
    for node, (d, out) in enumerate(zip(daemons, outs)):
        out.mkdir()
        procs.append(_torchrun(d, out, 2, "--max-grad-norm", "0.5", nnodes=2, node_rank=node,
                               port=port))
    ref = _reference(4, max_grad_norm=0.5)
    for node, p in enumerate(procs):
        _finish(p, f"torchrun node {node}")
    # Global ranks 0-1 ran on node 0, 2-3 on node 1 (static rendezvous).
    r = _results(outs[0], 2) + [torch.load(outs[1] / f"rank{k}.pt", weights_only=False)
                                for k in (2, 3)]
    for k, x in enumerate(r):
        assert x["error"] is None, f"rank {k}: {x['error']}"
        _assert_equal_to_reference(ref, x["params"], f"rank {k}")
    for node in range(len(daemons)):
        status = r[2 * node]["status"]
        g = [g for g in status["groups"] if g["state"] == "running"]
        assert len(g) == 1 and g[0]["nnodes"] == 2 and g[0]["node_rank"] == node, status
    assert r[0]["stats"]["data_parallel"]["allreduce_bytes"] > 0


def _plain_ranks(daemon, out: Path, world: int, per_rank_args, timeout_s=20):
    """`world` worker processes without torchrun or a process group (distributed=True)."""
    run_id = uuid.uuid4().hex
    procs = []
    for rank in range(world):
        env = _env(daemon, RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world,
                   TORCHELASTIC_RUN_ID=run_id)
        cmd = [sys.executable, str(WORKER), "--out", str(out), "--steps", "6", "--batch", "2",
               "--no-process-group", "--timeout-s", str(timeout_s), *per_rank_args(rank)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=LAUNCH_TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a rank hung") from None
    return procs, outputs


def test_dying_rank_gives_the_other_a_clear_error(daemon, tmp_path):
    timeout_s = 20
    procs, outputs = _plain_ranks(
        daemon, tmp_path, 2,
        lambda rank: ["--die-after-backward", "3"] if rank == 1 else [], timeout_s)
    assert procs[1].returncode == 1, outputs[1]
    assert procs[0].returncode == 3, outputs[0]
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    err = r0["error"]
    assert err.startswith("DaemonError"), err
    assert "local rank 1" in err and "data-parallel group" in err and "left" in err, err
    died = float((tmp_path / "died1").read_text())
    assert r0["error_time"] - died < timeout_s / 2, "the error should come at once, not on timeout"
    _wait_released(daemon)


def test_ranks_with_different_initial_weights_are_refused(daemon, tmp_path):
    procs, outputs = _plain_ranks(daemon, tmp_path, 2,
                                  lambda rank: ["--model-seed", str(rank)])
    for rank in range(2):
        assert procs[rank].returncode == 3, outputs[rank]
        err = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)["error"]
        assert "local rank 1's initial weights differ from local rank 0's" in err, err
    _wait_released(daemon)


def test_ranks_with_different_parameters_are_refused(daemon, tmp_path):
    procs, outputs = _plain_ranks(daemon, tmp_path, 2,
                                  lambda rank: ["--n-embd", str(32 + 16 * rank)])
    for rank in range(2):
        assert procs[rank].returncode == 3, outputs[rank]
        err = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)["error"]
        assert "registered different parameters" in err and "shape" in err, err


def test_distributed_option_is_validated():
    with pytest.raises(ValueError, match="distributed"):
        trainstream.OffloadAdamW([torch.nn.Parameter(torch.zeros(2))], distributed="yes",
                                 attach=False)
    with pytest.raises(ValueError, match="shared_state"):
        trainstream.OffloadAdamW([torch.nn.Parameter(torch.zeros(2))], shared_state=1,
                                 attach=False)


def test_distributed_true_without_launcher_names_what_is_missing(daemon, monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_NTASKS",
              "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        trainstream.OffloadAdamW([torch.nn.Parameter(torch.zeros(2))], distributed=True,
                                 socket=daemon.socket)


def test_cross_machine_reduce_backend_choice():
    from trainstream.optim.data_parallel import choose_reduce_backend as choose
    assert choose("auto", "nccl", cuda=True) == "nccl"
    assert choose("auto", "cpu:gloo,cuda:nccl", cuda=True) == "nccl"
    assert choose("auto", "gloo", cuda=True) == "gloo"      # the job chose gloo
    assert choose("auto", "nccl", cuda=False) == "gloo"
    assert choose("gloo", "nccl", cuda=True) == "gloo"
    assert choose("nccl", "gloo", cuda=True) == "nccl"
    with pytest.raises(ValueError, match="needs CUDA"):
        choose("nccl", "gloo", cuda=False)
    with pytest.raises(ValueError, match="TRAINSTREAM_DP_REDUCE='mpi'.*accepted"):
        choose("mpi", "gloo", cuda=True)
