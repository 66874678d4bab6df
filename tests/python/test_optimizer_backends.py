"""OffloadAdamW as a facade (trainstream/optim/): the public methods wrap()'s memory
steps use instead of the optimizer's attributes, and the backend it runs on."""
import pytest
import torch

import trainstream


def test_the_memory_layer_asks_the_optimizer_through_public_methods(daemon):
    w = torch.nn.Parameter(torch.randn(1024))
    opt = trainstream.OffloadAdamW([w], socket=daemon.socket)
    assert opt.optimizer_mode == "cpu" and opt.step_id == 0  # no CUDA here: the daemon's
    regions = opt.regions()
    assert [r["purpose"] for r in regions] == ["staging"]
    assert regions[0]["bytes"] >= 2 * 4 * 1024 and regions[0]["registered"] is False
    assert trainstream.pinned_stats(opt) == {"mapped_bytes": regions[0]["bytes"],
                                             "registered_bytes": 0}
    home = opt.host_home(w)  # the param slot: where a paged weight lives
    assert home.shape == w.shape and torch.equal(home, w.detach())
    assert opt.host_home(torch.nn.Parameter(torch.zeros(3))) is None
    # fp32 moments; the fp32 weight slot is the master (Note [One host copy of a trained
    # weight])
    assert opt.state_bytes() == 1024 * 2 * 4
    page = opt.allocate_region(1 << 20, "activations")
    assert page.size >= 1 << 20
    w.grad = torch.ones_like(w)
    opt.step()
    assert opt.step_id == 1 and opt.stats()["steps"] == 1
    opt.detach()
    assert opt.regions() == [] and opt.host_home(w) is None
    with pytest.raises(trainstream.TrainStreamError, match="detached"):
        opt.allocate_region(1 << 20, "activations")
    with pytest.raises(trainstream.TrainStreamError, match="detached"):
        opt.step()
