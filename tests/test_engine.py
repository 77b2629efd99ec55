"""The transfer engine: grouped copies, the persistent host pool, grads, non-blocking handles."""

import gc

import pytest
import torch

import optimshift
from _matrix import Model, bitwise_equal, snapshot, state_layout, train
from optimshift import _copy as batch_mod
from optimshift.pool import HostPool, host_pool
from optimshift.testing import simulated_memory_allocated


def _adam_on(sim, n=20, **kw):
    model = Model([(3, 2)] * n).to(sim)
    opt = torch.optim.Adam(model.parameters(), **kw)
    train(model, opt, range(1))
    return model, opt


def test_offload_copies_each_dtype_in_one_transfer(sim):
    """60 small tensors leave the device in one device-to-host copy, not 60 (the verl/NeMo-RL loop)."""
    model, opt = _adam_on(sim, foreach=False)
    with optimshift.count_syncs() as grouped:
        optimshift.offload(opt)
    optimshift.reload(opt)
    naive = {k: v for st in opt.state.values() for k, v in st.items()}
    with optimshift.count_syncs() as per_tensor:
        for st in opt.state.values():
            for k, v in st.items():
                st[k] = v.to("cpu")
    assert grouped.by_op == {"copy_to_host": 1}
    assert per_tensor.by_op["copy_to_host"] == 2 * 20 and naive


def test_mixed_dtypes_are_grouped_apart_and_keep_their_dtype(sim):
    params = [torch.nn.Parameter(torch.randn(3, 2, device=sim, dtype=d)) for d in (torch.float32, torch.bfloat16) * 3]
    opt = torch.optim.Adam(params, capturable=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = {i: snapshot(dict(st)) for i, st in enumerate(opt.state.values())}
    with optimshift.count_syncs() as syncs:
        optimshift.offload(opt)
    assert syncs.by_op == {"copy_to_host": 2}  # one per dtype: float32 (incl. the steps), bfloat16
    optimshift.reload(opt)
    for i, st in enumerate(opt.state.values()):
        assert bitwise_equal(dict(st), before[i])


def test_offloaded_state_lives_in_the_pool_and_is_reused_across_cycles(sim):
    host_pool.release_idle()
    start = host_pool.stats()
    model, opt = _adam_on(sim, fused=True)
    optimshift.offload(opt)
    busy = host_pool.stats()
    assert busy.in_use > start.in_use
    optimshift.reload(opt)
    warm = host_pool.stats()
    assert warm.in_use == start.in_use and warm.idle >= 1
    for step in range(10):
        optimshift.offload(opt)
        optimshift.reload(opt)
        train(model, opt, range(step + 1, step + 2))
    after = host_pool.stats()
    assert after.allocations == warm.allocations, f"no new host buffer in steady state: {warm} -> {after}"
    assert after.reuses >= warm.reuses + 10
    freed = host_pool.release_idle()
    assert freed > 0 and host_pool.stats().idle == 0


def test_pool_hands_out_a_fitting_buffer_and_waits_for_its_event():
    pool = HostPool()
    a = pool.acquire(100, pinned=False)
    assert a.numel() >= 100 and pool.stats().allocations == 1

    class Event:
        waited = False

        def query(self):
            return False

        def synchronize(self):
            Event.waited = True

    pool.release(a, Event())
    b = pool.acquire(200, pinned=False)
    assert b is a and Event.waited and pool.stats().reuses == 1
    c = pool.acquire(64 << 20, pinned=False)  # too big for `a`'s size class: a new buffer
    assert c is not a and pool.stats().allocations == 2


def test_pool_prefers_a_buffer_no_copy_still_uses():
    """Of two fitting idle buffers, the one whose event is complete is handed out (no host wait), even when
    the other is smaller; the host waits only when every fitting buffer is still in use by a copy."""
    pool = HostPool()
    small, big = pool.acquire(1 << 20, pinned=False), pool.acquire(2 << 20, pinned=False)

    class Event:
        def __init__(self, complete):
            self.complete, self.waited = complete, False

        def query(self):
            return self.complete

        def synchronize(self):
            self.waited = True

    in_flight, complete = Event(False), Event(True)
    pool.release(small, in_flight)
    pool.release(big, complete)
    assert pool.acquire(1 << 20, pinned=False) is big and not in_flight.waited
    assert pool.acquire(1 << 20, pinned=False) is small and in_flight.waited


def test_include_grads_frees_everything_the_optimizer_holds_on_the_device(sim):
    model = Model([(32, 32), (32,)]).to(sim)
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    train(model, opt, range(1))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    grads = [p.grad.cpu() for p in model.parameters()]
    held = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.device == sim)
    held += sum(p.grad.numel() * 4 for p in model.parameters())
    gc.collect()
    before = simulated_memory_allocated(0)
    optimshift.offload(opt, include=("grads",))
    gc.collect()
    assert all(p.grad is None for p in model.parameters())
    assert before - simulated_memory_allocated(0) == held  # only the params remain on the device
    optimshift.reload(opt)
    for p, g in zip(model.parameters(), grads):
        assert p.grad.device == sim and bitwise_equal(p.grad, g)
    with pytest.raises(ValueError, match=r"Adam: offload include= may contain"):
        optimshift.offload(opt, include=("activations",))


def test_move_to_host_gives_separate_tensors_not_views(sim):
    model, opt = _adam_on(sim, n=4, foreach=False)
    optimshift.move(opt, "cpu")
    storages = {v.untyped_storage().data_ptr() for st in opt.state.values() for v in st.values()}
    assert len(storages) == 4 * 3, "each moved tensor owns its memory, as a fresh optimizer's does"


def test_grouped_copy_is_bitwise_for_big_and_small_tensors(sim, monkeypatch):
    monkeypatch.setattr(batch_mod, "SOLO_BYTES", 64)  # force both paths with small tensors
    monkeypatch.setattr(batch_mod, "CHUNK_BYTES", 100)
    shapes = [(2, 2), (5, 5), (3,), (7, 3), (1,)]
    model = Model(shapes).to(sim)
    opt = torch.optim.RMSprop(model.parameters(), centered=True, momentum=0.9, foreach=True)
    train(model, opt, range(2))
    before = {i: snapshot(dict(st)) for i, st in enumerate(opt.state.values())}
    layout = state_layout(opt)
    optimshift.offload(opt)
    optimshift.reload(opt)
    assert state_layout(opt) == layout
    for i, st in enumerate(opt.state.values()):
        assert bitwise_equal(dict(st), before[i])


def test_an_offloaded_optimizer_that_dies_leaves_no_buffer_in_use(sim):
    start = host_pool.stats().in_use
    model, opt = _adam_on(sim, foreach=False)
    optimshift.offload(opt)
    assert host_pool.stats().in_use == start + 1
    del model, opt
    gc.collect()
    assert host_pool.stats().in_use == start
