"""Host-memory registration that cannot outlive its memory (trainstream._native.pinning).
CUDA's register/unregister calls are replaced by recorders, so this runs anywhere;
the CUDA behaviour itself is exercised by the GPU tests (paging, optimizer_mode="gpu")."""
import gc

import pytest
import torch

from trainstream import _C
from trainstream._native import pinning as _pinning


@pytest.fixture
def cuda_calls(monkeypatch):
    calls = {"register": [], "unregister": [], "already": set()}

    def register(address, nbytes, read_only=False):
        if address in calls["already"]:
            calls["already"].discard(address)
            return False, "part or all of the requested memory range is already mapped"
        calls["register"].append((address, nbytes))
        return True, ""

    monkeypatch.setattr(_C, "with_cuda", True, raising=False)
    monkeypatch.setattr(_C, "register_host", register)
    monkeypatch.setattr(_C, "unregister_host", lambda a: calls["unregister"].append(a))
    return calls


def test_registration_ends_when_the_last_view_of_the_memory_does(cuda_calls):
    buf = _pinning.registered_empty(1 << 20)
    address = buf.data_ptr()
    assert cuda_calls["register"] == [(address, 1 << 20)] and buf.numel() == 1 << 20
    view = buf[4096:8192].view(torch.float32)
    view.fill_(1.5)
    del buf
    gc.collect()
    assert cuda_calls["unregister"] == [], "unregistered while a view still uses the memory"
    assert float(view.sum()) == 1.5 * 1024
    del view
    gc.collect()
    assert cuda_calls["unregister"] == [address]


def test_a_stale_registration_at_the_address_is_replaced(cuda_calls):
    cuda_calls["already"].add(0x7000_0000)
    ok, why = _pinning.register_fresh(0x7000_0000, 4096)
    assert ok, why
    assert cuda_calls["unregister"] == [0x7000_0000]
    assert cuda_calls["register"] == [(0x7000_0000, 4096)]


def test_failed_registration_gives_no_buffer(monkeypatch, cuda_calls):
    monkeypatch.setattr(_C, "register_host", lambda a, n, r=False: (False, "out of memory"))
    assert _pinning.registered_empty(4096) is None
