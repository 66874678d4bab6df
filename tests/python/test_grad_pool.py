"""The gradient staging pool (docs/staging-pool.md) against one gradient slot per
parameter: the same model on the same data trains bit for bit the same (CPU), however
small the pool, with accumulation, two param groups and add_param_group; clipping and
TRAINSTREAM_GRAD_POOL=0 keep slots; a daemon that stops answering while backward waits
for room ends in DaemonError, not a hang."""
import os
import signal
import threading

import pytest
import torch

import trainstream
from conftest import wait_until
from tiny_gpt import GPTConfig, TinyGPT, text_batches
from trainstream.errors import DaemonError
from trainstream.optim.grad_pool import grad_pool_bytes

CFG = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32)
TEXT = "the staging pool streams every gradient through a bounded ring of bytes " * 20
LARGEST = CFG.vocab_size * CFG.n_embd * 4  # the tied embedding / head, fp32


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return TinyGPT(CFG).to(dtype)


def _groups(model, lr=3e-3):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _train(daemon, pool, steps=6, accumulation=1, dtype=torch.float32, split=False, **options):
    model = _model(dtype)
    groups = _groups(model)
    opt = trainstream.OffloadAdamW(groups[:1] if split else groups, lr=3e-3,
                                   socket=daemon.socket, grad_pool=pool,
                                   accumulation_steps=accumulation, **options)
    if split:  # the second group arrives by add_param_group: a second registration
        opt.add_param_group(groups[1])
    batches = text_batches(TEXT, CFG, batch=4, steps=steps * accumulation)
    for i, (x, y) in enumerate(batches):
        (model(x, y) / accumulation).backward()
        if (i + 1) % accumulation == 0:
            opt.step()
            opt.zero_grad()
    stats = opt.stats()
    opt.detach()
    return model, stats


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def _same(a, b):
    wa, wb = _weights(a), _weights(b)
    assert len(wa) == len(wb)
    for x, y in zip(wa, wb):
        assert torch.equal(x, y)


def _pool_waits(opt) -> int:
    """How often backward has waited for room, counted as each wait begins (the stats'
    pool_waits counts it when it ends)."""
    pools = {id(e.pool): e.pool for e in opt._table.entries.values() if e.pool is not None}
    return sum(p.waits for p in pools.values())


def _when_waiting(opt, then) -> threading.Thread:
    """A started thread that runs ``then()`` once backward next waits for room."""
    before = _pool_waits(opt)

    def run():
        wait_until(lambda: _pool_waits(opt) > before, 30,
                   what="backward to wait for room in the gradient pool")
        then()
    t = threading.Thread(target=run)
    t.start()
    return t


def test_the_size_rule():
    assert grad_pool_bytes([100, 5000], 0, None, False) == 0
    assert grad_pool_bytes([100, 5000], "auto", 1.0, False) == 0  # clipping: slots
    assert grad_pool_bytes([100, 5000], "auto", None, True) == 0  # data parallel: slots
    assert grad_pool_bytes([100, 5000], "auto", None, False) == 8192  # the slots' total, paged
    assert grad_pool_bytes([100, 5000], 64, None, False) == 8192  # at least the largest
    assert grad_pool_bytes([10 << 30] * 3, "auto", None, False) == 20 << 30  # twice the largest
    assert grad_pool_bytes([1 << 20] * 4096, "auto", None, False) == 1100001280  # 20 ms of PCIe
    assert grad_pool_bytes([100], "1MiB", None, False) == 1 << 20


def test_the_environment_sizes_auto_or_keeps_slots(monkeypatch):
    # Note [The pool on a GPU host]: a size in place of "auto"; an explicit size wins.
    monkeypatch.setenv("TRAINSTREAM_GRAD_POOL", "64KiB")
    assert grad_pool_bytes([100, 5000], "auto", None, False) == 64 << 10
    assert grad_pool_bytes([100, 5000], 64, None, False) == 8192
    monkeypatch.setenv("TRAINSTREAM_GRAD_POOL", "0")
    assert grad_pool_bytes([100, 5000], "1MiB", None, False) == 0
    monkeypatch.setenv("TRAINSTREAM_GRAD_POOL", "lots")
    with pytest.raises(ValueError, match="TRAINSTREAM_GRAD_POOL='lots'.*2GiB"):
        grad_pool_bytes([100, 5000], "auto", None, False)


@pytest.mark.parametrize("pool", [LARGEST, 3 * LARGEST, "auto"])
def test_the_pool_trains_bit_identically_to_gradient_slots(daemon, pool):
    want, slots = _train(daemon, 0)
    got, pooled = _train(daemon, pool)
    _same(got, want)
    assert slots["grad_pool_bytes"] == 0
    assert pooled["grad_pool_bytes"] >= LARGEST
    # Whether a pool of one largest gradient makes backward wait here depends on how fast
    # the daemon frees it; the next test holds the daemon so that it must wait.


def test_a_full_pool_makes_backward_wait_until_the_daemon_frees_room(daemon_factory):
    # The daemon is paused (every thread stopped) before the second step's forward, so
    # it releases no extent; the tied embedding's gradient, the pool's whole size and
    # the last to finish, cannot fit beside any earlier one, so backward must wait for
    # room. Once it waits, the test checks that backward does not return while the
    # daemon stays paused, then resumes it: backward returns only after that, and the
    # run trains as gradient slots do.
    d = daemon_factory()
    want, _ = _train(d, 0, steps=2)
    model = _model()
    opt = trainstream.OffloadAdamW(_groups(model), lr=3e-3, socket=d.socket, grad_pool=LARGEST)
    order = []  # what happened, in order, on either thread

    def resume():
        # With every daemon thread stopped no room can come, so backward cannot return
        # however long one looks; 0.2 s bounds the look (a daemon that frees room
        # returns it within milliseconds), it is never waited out otherwise.
        order.append("backward returned" if returned.wait(0.2) else "backward still waiting")
        order.append("resumed")
        d.resume()
    returned = threading.Event()
    try:
        for i, (x, y) in enumerate(text_batches(TEXT, CFG, batch=4, steps=2)):
            if i == 1:
                d.pause()
                t = _when_waiting(opt, resume)
            model(x, y).backward()
            if i == 1:
                order.append("backward returned")
                returned.set()
                t.join()
            opt.step()
            opt.zero_grad()
    finally:
        d.resume()  # again, harmless, should the loop have failed
    stats = opt.stats()
    opt.detach()
    assert stats["grad_pool_bytes"] >= LARGEST
    assert order == ["backward still waiting", "resumed", "backward returned"], (order, stats)
    assert stats["pool_waits"] >= 1, stats
    _same(model, want)


@pytest.mark.parametrize("case", ["accumulation", "split", "bf16", "grad_post_step"])
def test_the_pool_is_bit_identical_in_each_mode(daemon, case):
    kw = {"accumulation": dict(accumulation=2), "split": dict(split=True),
          "bf16": dict(dtype=torch.bfloat16), "grad_post_step": dict(grad_post="step")}[case]
    want, _ = _train(daemon, 0, **kw)
    got, pooled = _train(daemon, LARGEST, **kw)
    _same(got, want)
    assert pooled["grad_pool_bytes"] >= LARGEST * (2 if case == "split" else 1) // 2


def test_clipping_and_the_environment_switch_keep_slots(daemon, monkeypatch):
    _, clipped = _train(daemon, LARGEST, steps=2, max_grad_norm=1.0)
    assert clipped["grad_pool_bytes"] == 0
    monkeypatch.setenv("TRAINSTREAM_GRAD_POOL", "0")
    _, off = _train(daemon, LARGEST, steps=2)
    assert off["grad_pool_bytes"] == 0


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL])
def test_a_daemon_that_stops_or_dies_ends_a_wait_for_room_in_daemon_error(daemon_factory, sig):
    # The tied embedding's gradient fills the pool, so backward waits for every earlier
    # extent's release: a stopped daemon releases none (DaemonError after timeout_s), a
    # dead one is found by the wait's liveness probe (reconnect off: DaemonError).
    d = daemon_factory()
    model = _model()
    opt = trainstream.OffloadAdamW(_groups(model), lr=3e-3, socket=d.socket, grad_pool=LARGEST,
                                   timeout_s=2, reconnect=False)
    (x, y), = text_batches(TEXT, CFG, batch=4, steps=1)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    if sig == signal.SIGSTOP:
        d.pause()
    else:
        os.kill(d.proc.pid, sig)
    try:
        with pytest.raises(DaemonError):
            model(x, y).backward()
            opt.step()
    finally:
        if sig == signal.SIGSTOP:
            d.resume()


@pytest.mark.parametrize("pool", ["auto", 2 * LARGEST])
def test_gradients_that_did_not_land_are_posted_again_from_their_extents(daemon_factory, pool):
    # Note [Resuming after the daemon died]: the daemon is paused (every thread stopped,
    # Note [A paused daemon is stopped in every thread]) before step 3's forward, so none
    # of that step's gradients is applied, then SIGKILLed: with the pool of a whole step
    # once backward has posted all of them, with the small pool once backward waits for
    # room (the wait's liveness probe then finds the daemon gone and resumes; the rest
    # of backward posts to the next daemon). The next daemon adopts the state, the client
    # posts each gradient again from the extent it was copied to, and the run equals one
    # with gradient slots that was never interrupted. Nothing here depends on timing.
    def posted(opt, step):
        return sum(e.posted_step == step for e in opt._table.entries.values())

    def run(d, grad_pool, kill):
        model = _model()
        opt = trainstream.OffloadAdamW(_groups(model), lr=3e-3, socket=d.socket,
                                       grad_pool=grad_pool, timeout_s=30)
        killed = {}

        def restart(old):
            old.proc.kill()
            old.proc.wait()
            killed["posted"] = posted(opt, 3)
            killed["d"] = daemon_factory(socket=old.socket, shm_dir=old.shm_dir, wait=False)

        for i, (x, y) in enumerate(text_batches(TEXT, CFG, batch=4, steps=5)):
            if i == 2 and kill:
                d.pause()
                if grad_pool == "auto":
                    model(x, y).backward()
                    restart(d)
                else:  # killed while backward waits for room
                    t = _when_waiting(opt, lambda old=d: restart(old))
                    model(x, y).backward()
                    t.join()
                d = killed["d"]
            else:
                model(x, y).backward()
            opt.step()
            opt.zero_grad()
        stats = opt.stats()
        opt.detach()
        return model, stats, killed.get("posted")

    n = len(list(_model().parameters()))
    want, _, _ = run(daemon_factory(), 0, False)
    got, stats, posted_when_killed = run(daemon_factory(), pool, True)
    _same(got, want)
    seen = (posted_when_killed, stats)
    assert stats["recoveries"] == 1 and stats["grad_pool_bytes"] > 0, seen
    assert stats["landed_grads"] == 0, seen  # paused before the step's first gradient
    # Each gradient posted to the dead daemon is posted again; the rest went to the next.
    assert stats["replayed_grads"] == posted_when_killed, seen
    if pool == "auto":  # the pool holds the whole step: every gradient was posted
        assert posted_when_killed == n and stats["pool_waits"] == 0, seen
    else:
        assert 0 < posted_when_killed < n and stats["pool_waits"] > 0, seen
