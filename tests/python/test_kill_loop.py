"""The short kill loop (tests/recovery/kill_loop.py; docs/recovery.md, "Measured"): the
daemon is SIGKILLed at random moments (or from inside a step, with its gradients posted
and none applied) while a client trains, and the run must end with the weights of an
uninterrupted run, bit for bit, every lost step reported exactly, and /dev/shm as it
was. The long loop is `tests/recovery/kill_loop.py --long`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO

LOOP = REPO / "tests" / "recovery" / "kill_loop.py"


def run_loop(build_dir: Path, *args: str) -> dict:
    env = dict(os.environ, TRAINSTREAM_BUILD_DIR=str(build_dir))
    r = subprocess.run([sys.executable, str(LOOP), "--build-dir", str(build_dir), *args],
                       capture_output=True, text=True, timeout=600, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"kill_loop.py printed no figures (rc {r.returncode}):\n{r.stdout}\n{r.stderr}"
    figures = json.loads(lines[-1])
    assert r.returncode == 0, figures["failures"]
    return figures


def test_short_loop_supervised_eager(build_dir):
    # The first three kills come from inside a step: the daemon is paused before its
    # backward and SIGKILLed once backward has posted every gradient, so each finds the
    # step's gradients in flight (none landed, all posted again on resume); the other
    # three land at random moments.
    f = run_loop(build_dir, "--short", "--seed", "11", "--in-flight-kills", "3")
    assert f["bit_identical"] and not f["failures"]
    assert f["daemon_kills"] == 6
    assert f["in_flight_kills"] == 3, f
    assert f["replayed_grads"] >= 3, f  # at least one gradient each time
    assert f["recoveries"] >= 4  # two of the random kills close together may be seen as one


def test_short_loop_with_a_gradient_pool_of_one_embedding(build_dir):
    # docs/staging-pool.md: a pool that holds only the largest gradient (the 96 x 64
    # fp32 embedding), so backward waits for room at every step and kills land there
    # too; each gradient that did not land is posted again from its extent.
    f = run_loop(build_dir, "--short", "--grad-pool", str(96 * 64 * 4), "--kills", "4",
                 "--seed", "15")
    assert f["bit_identical"] and not f["failures"]
    assert f["daemon_kills"] == 4
    assert f["recoveries"] >= 2


def test_short_loop_embedded_with_clipping(build_dir):
    # The client restarts the daemon itself; clipping defers every update to step().
    f = run_loop(build_dir, "--short", "--embedded", "--clip", "0.5", "--kills", "4",
                 "--seed", "12")
    assert f["bit_identical"] and not f["failures"]
    assert f["daemon_kills"] == 4
    assert f["recoveries"] >= 2


def test_short_loop_reports_lost_steps_exactly(build_dir):
    # Every second kill also takes the staging segment (the gradients of the step in
    # flight): that step must be reported lost, by number, and the client then goes on
    # from its last checkpoint to the same weights.
    f = run_loop(build_dir, "--short", "--lose-every", "2", "--kills", "4", "--seed", "13")
    assert f["bit_identical"] and not f["failures"]
    assert f["lost_reports"] >= 1 and f["lost_reports_exact"] == f["lost_reports"]
    assert f["worker_restarts"] >= f["lost_reports"]


def test_short_loop_two_data_parallel_ranks(build_dir):
    # Both ranks of a group share the daemon's one state: they resume it together.
    f = run_loop(build_dir, "--short", "--dp", "2", "--kills", "4", "--seed", "14")
    assert f["bit_identical"] and not f["failures"]
    assert f["ranks"] == 2 and f["daemon_kills"] == 4
    assert f["recoveries"] >= 2


def test_short_loop_cuda_model(build_dir):
    # The same resume for a model on the GPU: gradients come off the device into the
    # staging slots, new weights go back over PCIe (the GPU host runs this).
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (the GPU host runs it: scripts/gpu-check.sh)")
    f = run_loop(build_dir, "--short", "--device", "cuda", "--kills", "6", "--seed", "15")
    assert f["bit_identical"] and not f["failures"]
    assert f["daemon_kills"] == 6
    assert f["recoveries"] >= 3


def test_short_loop_restarts_keep_the_state(build_dir):
    # SIGUSR2 is a restart (systemctl restart, a package upgrade): the daemon leaves its
    # sessions' state for the next one, and training goes on to the same weights.
    f = run_loop(build_dir, "--short", "--daemon-signal", "USR2", "--kills", "4",
                 "--seed", "16")
    assert f["bit_identical"] and not f["failures"]
    assert f["signal"] == "USR2" and f["daemon_kills"] == 4
    assert f["restart_exits"] == 4  # the daemon's own exit each time, from its log
    assert f["recoveries"] >= 2 and f["lost_reports"] == 0


def test_short_loop_stops_keep_the_state(build_dir):
    # SIGTERM is a stop (systemctl stop, a package upgrade's stop and start): the daemon
    # keeps its sessions' state for the next one, as SIGUSR2 does, and training goes on
    # to the same weights.
    f = run_loop(build_dir, "--short", "--daemon-signal", "TERM", "--kills", "3",
                 "--seed", "17")
    assert f["bit_identical"] and not f["failures"]
    assert f["signal"] == "TERM" and f["daemon_kills"] == 3
    assert f["restart_exits"] == 3  # the daemon's own exit, keeping the state, each time
    assert f["recoveries"] >= 2 and f["lost_reports"] == 0
