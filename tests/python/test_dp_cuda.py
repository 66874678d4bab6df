"""Data parallel with CUDA models (GPU host with at least 2 GPUs): torchrun with 2 ranks,
one GPU each, sharing one optimizer state, against one process on the concatenated
batch. The CPU version of every check is test_dp.py."""
from __future__ import annotations

import pytest
import torch

from test_dp import _finish, _reference, _results, _torchrun, _assert_equal_to_reference

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs (data parallel across GPUs of one machine)")


@pytest.mark.parametrize("shm", ["1", "0"])
def test_two_gpu_ranks_match_one_process(daemon, tmp_path, shm):
    proc = _torchrun(daemon, tmp_path, 2, "--cuda", env_extra={"TRAINSTREAM_SHM": shm})
    # Full fp32 matmuls on both sides, so only summation order differs.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref = _reference(2, device="cuda:0")
    _finish(proc, "torchrun --nproc-per-node 2 --cuda")
    r0, r1 = _results(tmp_path, 2)
    _assert_equal_to_reference(ref, r0["params"], "rank 0")
    _assert_equal_to_reference(ref, r1["params"], "rank 1")
