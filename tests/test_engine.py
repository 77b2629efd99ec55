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


_DTENSOR_ONE_BY_ONE = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
import optimshift
from optimshift.testing import simulated_accelerator
sim = simulated_accelerator()
mesh = init_device_mesh("cpu", (2,))
def sharded(local, shape, stride):
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
class Holder(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})
    def step(self, closure=None):
        pass
p = torch.nn.Parameter(sharded(torch.zeros(0, 3), (1, 3), (3, 1)))
opt = Holder([p])
st = opt.state[p]
st["empty"] = sharded(torch.zeros(0, 3), (1, 3), (3, 1))  # rank 1's shard of an uneven FSDP2 split: no rows
st["transposed"] = sharded(torch.arange(6.0).reshape(3, 2).t(), (4, 3), (3, 1))  # not contiguous
objects = {k: v for k, v in st.items()}
out = []
for op in ("move sim:0", "move sim:1", "offload", "reload"):
    if op == "offload":
        optimshift.offload(opt)
    elif op == "reload":
        optimshift.reload(opt)
    else:
        optimshift.move(opt, torch.device(op.split()[1]))
    out.append((op, {k: (type(v).__name__, str(v.device), tuple(v.shape), v is objects[k],
                     v.to_local().cpu().tolist()) for k, v in st.items()}))
dist.destroy_process_group()
print(repr(out))
"""


def test_dtensor_state_copied_one_by_one_stays_dtensor(tmp_path):
    """DTensor entries the grouped copies do not take (an empty local shard, a non-contiguous one, a move
    between two devices) are copied whole: each stays the same DTensor object with its global shape, its shard
    on the target. (A plain-tensor shortcut once copied the bare shard, and the commit replaced the DTensor
    with it.) A fake process group in a subprocess: no collective runs."""
    import ast
    import subprocess
    import sys

    script = tmp_path / "dtensor_one_by_one.py"
    script.write_text(_DTENSOR_ONE_BY_ONE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    devices = {"move sim:0": "sim:0", "move sim:1": "sim:1", "offload": "cpu", "reload": "sim:1"}
    for op, entries in steps:
        assert entries["empty"] == ("DTensor", devices[op], (1, 3), True, []), op
        assert entries["transposed"] == ("DTensor", devices[op], (4, 3), True, [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]]), op


@pytest.mark.parametrize("non_blocking", [False, True])
def test_run_copies_into_the_callers_destinations_and_commit_installs_them(sim, non_blocking):
    """``engine.run(into=...)``: each transfer given a destination (a streamed chunk's host view) is copied into
    it wherever the tensor is, the others as usual; the commit gives each object its destination's contents."""
    from optimshift import _engine
    from optimshift._plan import build_plan

    model, opt = _adam_on(sim, n=3, foreach=False)
    ids = [id(t) for st in opt.state.values() for t in st.values()]
    values = [t.detach().cpu().clone() for st in opt.state.values() for t in st.values()]
    host = torch.device("cpu")
    plan = build_plan(opt, lambda ident, param, group, key, tensor: (host, "test"))
    into = [torch.empty_like(tr.tensor, device=host) if tr.tensor.dim() else None for tr in plan.transfers]
    places = [None if dst is None else dst.untyped_storage().data_ptr() for dst in into]
    options = batch_mod.Options(non_blocking=non_blocking, lane="stream")
    copies = _engine.run(plan, options, into=into)
    if copies.event is not None:
        copies.event.synchronize()
    given = [id(d) for d in into if d is not None]
    assert [id(c) for _, c in copies.pairs][-len(given) :] == given, "the destinations are the copies"
    _engine.commit(opt, copies)
    tensors = [t for st in opt.state.values() for t in st.values()]
    assert [id(t) for t in tensors] == ids and all(t.device == host for t in tensors)
    assert all(bitwise_equal(t, v) for t, v in zip(tensors, values))
    by_tensor = {id(tr.tensor): place for tr, place in zip(plan.transfers, places)}
    for t in tensors:
        if by_tensor[id(t)] is not None:
            assert t.untyped_storage().data_ptr() == by_tensor[id(t)], "the object holds its destination's bytes"


def test_lend_gives_each_object_its_window_and_back(sim):
    """``engine.lend``: one adoption in (the commit's decisions and loop), one back; where no mechanism keeps
    the object (a weakly referenced tensor on the simulator needs a swap), the window view stands in at its
    site and the object is put back there."""
    import weakref

    from optimshift import _engine

    homes = [torch.arange(4.0), torch.arange(4.0, 8.0)]
    # (the objects hold their host views' bytes, as laid-out entries do)
    objs = [torch.empty(0).set_(h.untyped_storage(), h.storage_offset(), h.shape, h.stride()) for h in homes]
    held = weakref.ref(objs[1])  # noqa: F841  # (a weak reference: no swap for this one)
    window = torch.zeros(8, device=sim)
    views = [window[:4], window[4:]]
    state = {"a": objs[0], "b": objs[1]}
    back = _engine.lend(list(zip(objs, views)), homes, [(state, "a"), (state, "b")])
    assert state["a"] is objs[0] and objs[0].device == sim, "swapped in: the object holds its window view"
    assert state["b"] is views[1], "no mechanism keeps it: the window view stands in at its site"
    state["a"].add_(1)
    state["b"].add_(2)
    back()
    assert state == {"a": objs[0], "b": objs[1]} and objs[0].device.type == "cpu" and objs[1].device.type == "cpu"
    assert torch.equal(window.cpu(), torch.tensor([1.0, 1, 1, 1, 2, 2, 2, 2])), "the step wrote the window"
    assert torch.equal(objs[0], torch.arange(4.0)) and torch.equal(objs[1], torch.arange(4.0, 8.0)), (
        "back home: the host views, which the write-back fills"
    )


def test_in_place_writes_on_the_host_bump_versions_and_leave_normal_tensors():
    """``_write_in_place`` (a load's commit) copies host pairs under inference mode (cheaper dispatch): the live
    tensors stay normal tensors, take the values, and their version counters move (autograd sees the write)."""
    from optimshift import _engine

    olds = [torch.zeros(3), torch.zeros(()), torch.zeros(2, 2)]
    news = [torch.arange(3.0), torch.tensor(7.0), torch.ones(2, 2)]
    versions = [t._version for t in olds]
    _engine._write_in_place({torch.device("cpu"): (olds, news)})
    assert all(torch.equal(a, b) for a, b in zip(olds, news))
    assert not any(t.is_inference() for t in olds)
    assert all(t._version > v for t, v in zip(olds, versions))
    w = torch.ones(3, requires_grad=True)
    (w * olds[0]).sum().backward()  # (usable by autograd afterwards)
    assert torch.equal(w.grad, news[0])


def test_a_plan_of_columns_is_copied_alone(sim):
    """``run`` copies a plan of columns whole and nothing beside it: ``extra`` grads, ``into`` destinations or ``own``
    given with one were dropped without a word (no copy made, nothing said); it refuses them."""
    from optimshift import _engine
    from optimshift._plan import Plan

    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    column = ([torch.ones(3), torch.zeros(3)], sim)
    copies = _engine.run(Plan(opt, columns=[column], entry=lambda j, n: None)).batch.copies
    assert [(t.device, t.tolist()) for t in copies] == [(sim, [1.0] * 3), (sim, [0.0] * 3)]
    for extra in (
        {"extra": [(torch.ones(3), sim, "a grad")]},
        {"into": [torch.empty(3)]},
        {"own": {id(column[0][0])}},
    ):
        with pytest.raises(AssertionError, match="a plan of columns is copied whole, alone"):
            _engine.run(Plan(opt, columns=[column], entry=lambda j, n: None), **extra)


@pytest.mark.parametrize("hinted", [False, True])
def test_a_protected_tensor_is_replaced_where_it_could_take_its_copy_in_place(hinted):
    """``adoptions(protect=...)``: a tensor the model owns (a param or its grad kept as state) is replaced even where
    set_data would keep it (two host tensors), also when an earlier commit's decisions are offered for reuse."""
    from optimshift import _engine

    olds, news = [torch.zeros(2) for _ in range(3)], [torch.ones(2) for _ in range(3)]
    pairs = list(zip(olds, news))
    hint = _engine.adoptions(pairs)[2] if hinted else None
    assert hint is None or hint == ["data"] * 3
    replaced, _, hows = _engine.adoptions(pairs, protect={id(olds[1])}, hint=hint)
    assert hows == ["data", "replace", "data"] and replaced == [pairs[1]]
