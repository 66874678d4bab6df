"""benchmarks/paging/bench_paging.py at --tiny on the CPU (docs/paging.md, "On the GPU
host: host bytes per trained parameter"): the 7B
full fine-tune with gradient slots and with the pool in one invocation, each with one
host-bytes-per-trained-parameter figure whose parts add up to it; the full-layers depth
trains with its loss decreasing and the next depth is refused at wrap() with a
MemoryError whose categories add up; the 70B-shaped NF4 LoRA's frozen base sits in the
daemon's shared memory. The real shapes are the GPU host's (docs/paging.md); these
check the script end to end."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "paging" / "bench_paging.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("paging") / "results.jsonl"
    stdout = ""
    # Two invocations, five case processes: the 7B case with slots and with the pool, the
    # others with the pool only (at --tiny full-layers is the 7B case's shape).
    for cases, pools in (("7b-full", "slots,pool"),
                         ("full-layers,full-layers-refuse,70b-lora-nf4", "pool")):
        proc = subprocess.run(
            [sys.executable, str(BENCH), "--tiny", "--cases", cases, "--grad-pool", pools,
             "--steps", "2", "--warmup", "1", "--max-warmup", "1", "--layer-steps", "4",
             "--jsonl", str(out), "--timeout", "240"],
            capture_output=True, text=True, timeout=600,
            env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
        rows = [json.loads(line) for line in out.read_text().splitlines()] \
            if out.exists() else []
        assert proc.returncode == 0, f"exit {proc.returncode}: {rows}\n{proc.stderr[-3000:]}"
        stdout += proc.stdout
    return rows, stdout


def _runs(rows, case):
    return [r for r in rows if r["case"] == case]


def test_7b_full_pool_and_slots_in_one_invocation(results):
    rows, stdout = results
    runs = {r["grads"]: r for r in _runs(rows, "7b-full")}
    assert set(runs) == {"slots", "pool"}
    assert runs["slots"]["grad_pool_bytes"] == 0 and runs["pool"]["grad_pool_bytes"] > 0
    for r in runs.values():
        parts = r["host_bytes"]
        # One figure: its parts (daemon segments by label, the process's own) sum to it.
        assert sum(parts.values()) == r["host_total_bytes"]
        assert r["host_bytes_per_trained_param"] == pytest.approx(
            r["host_total_bytes"] / r["trained_params"], abs=1e-3)
        assert "daemon optimizer-state" in parts and "daemon staging" in parts
        assert not any("activations" in k for k in parts), parts
        assert r["step_s"] > 0
    # Slots hold every gradient; the pool at most as many bytes (the tiny model's "auto"
    # pool is all of them), plus its header's page and the pool's page alignment.
    assert runs["pool"]["host_bytes"]["daemon staging"] <= runs["slots"]["host_bytes"][
        "daemon staging"] + 2 * 4096
    assert "7b-full, gradients slots" in stdout and "7b-full, gradients pool" in stdout


def test_full_layers_trains_and_the_next_depth_is_refused(results):
    rows, stdout = results
    (train,) = _runs(rows, "full-layers")
    assert len(train["losses"]) == 4 and train["loss_decreased"], train["losses"]
    assert train["refused_above"] == [] and train["layers"] == 4  # --tiny: TINY's 4 blocks
    assert train["plan"]["moment_dtype"] == "bfloat16"
    (refused,) = _runs(rows, "full-layers-refuse")
    assert "error" not in refused, refused
    # Its own daemon's budget takes one more tiny block, not two: the search grows once.
    assert refused["accepted_layers"] == [train["layers"] + 1]
    assert refused["refused_layers"] == train["layers"] + 2
    parts = refused["memory_error_parts"]
    assert parts["parsed"] and parts["adds_up"], parts
    assert {c["category"] for c in parts["categories"]} >= {"weight slots"}
    assert "adds up: True" in stdout


def test_70b_lora_base_is_in_the_daemon(results):
    rows, stdout = results
    (r,) = _runs(rows, "70b-lora-nf4")
    assert "error" not in r, r
    fb = r["frozen_base"]
    assert fb["placed_bytes"] > 0 and fb["daemon_region_bytes"] >= fb["placed_bytes"]
    # The base's region is the daemon's, and left out of the per-parameter figure.
    assert r["host_bytes_left_out"]["daemon frozen base"] >= fb["placed_bytes"]
    assert "daemon frozen base" not in r["host_bytes"]
    assert 0 < r["trained_params"] < r["params"]
    assert r["pcie_floor_s"] >= 0 and "70b-lora-nf4:" in stdout
