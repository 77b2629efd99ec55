"""Non-blocking offload and reload on the simulated accelerator's deferred streams: the code CUDA runs.

Every copy issued on the engine's side stream is queued and runs only when something orders it (or at random
points of a seeded schedule), and any access that nothing orders raises (optimshift.testing). Each scenario
runs under several seeds, bitwise against the blocking path; the mutation tests take one ordering call of the
engine's device interface away and show that the matching scenario fails.
"""

import copy
import gc

import pytest
import torch

import optimshift
from _matrix import Model, bitwise_equal, snapshot, tensor_ids, train
from _schedules import SCHEDULES, drain_queued  # noqa: F401  (drain_queued: an autouse fixture)
from optimshift import _device_streams, _offload
from optimshift.testing import StreamRaceError, deferred_streams

CONFIGS = [
    pytest.param(torch.optim.Adam, {"foreach": True}, id="Adam-foreach"),
    pytest.param(torch.optim.AdamW, {"fused": True}, id="AdamW-fused"),  # a device `step` goes to the host too
    pytest.param(torch.optim.SGD, {"momentum": 0.9, "foreach": False}, id="SGD-momentum"),
]
SHAPES = [(3, 2), (4,), (2, 5), (1,)]


def _trained(sim, cls, kwargs, steps=2):
    model = Model(SHAPES).to(sim)
    opt = cls(list(model.parameters()), **kwargs)
    train(model, opt, range(steps))
    return model, opt


def _forward_backward(model):
    """A forward and backward pass on the default stream (only params and grads: no optimizer state)."""
    loss = sum(((p * (i + 1)).sin() ** 2).sum() for i, p in enumerate(model.parameters()))
    for p in model.parameters():
        p.grad = None
    loss.backward()


# -- the scenarios (each raises AssertionError, or StreamRaceError, when something is wrong) ---------------


def offload_round_trip(sim, cls, kwargs, *, strict=True):
    """Non-blocking offload, wait, non-blocking reload, train on: bitwise like the blocking path, every
    tensor object kept. ``strict``: the schedule runs nothing unordered, so the transfers must be pending."""
    # NOTE: the blocking reference runs first: its synchronizations would order the transfers under test.
    ref_model, ref = _trained(sim, cls, kwargs)
    optimshift.offload(ref)
    optimshift.reload(ref)
    train(ref_model, ref, range(2, 4))
    model, opt = _trained(sim, cls, kwargs)  # its last step is still "in flight" when the offload is issued
    values = [snapshot(dict(st)) for st in opt.state.values()]
    objects = tensor_ids(opt)
    handle = optimshift.offload(opt, non_blocking=True)
    assert isinstance(handle, optimshift.PendingTransfer)
    assert not (strict and handle.done()), "the offload is in flight"
    handle.wait()
    assert handle.done() and optimshift.is_offloaded(opt)
    assert all(row.device == "cpu" for row in optimshift.placement(opt))
    for st, before in zip(opt.state.values(), values):
        assert bitwise_equal(dict(st), before), "the host copies, after wait()"
    handle = optimshift.reload(opt, non_blocking=True)
    assert not (strict and handle.done()), "the reload is in flight"
    handle.wait()
    assert tensor_ids(opt) == objects
    for st, before in zip(opt.state.values(), values):
        assert bitwise_equal(dict(st), before), "the reloaded state"
    train(model, opt, range(2, 4))
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert bitwise_equal(a, b)


def reload_then_step(sim, cls, kwargs, *, forward=False, strict=True):
    """A non-blocking reload and, without waiting for it, (a forward and backward pass and) the step: the step
    pre-hook makes the step wait on the device. Bitwise like the blocking path."""

    # NOTE: the blocking reference runs first: its synchronize would order the pending reload too.
    def step(model, opt):
        if forward:
            _forward_backward(model)
            opt.step()
        else:
            train(model, opt, range(2, 3))

    ref_model, ref = _trained(sim, cls, kwargs)
    optimshift.offload(ref)
    optimshift.reload(ref)
    step(ref_model, ref)
    train(ref_model, ref, range(3, 4))
    model, opt = _trained(sim, cls, kwargs)
    optimshift.offload(opt)
    handle = optimshift.reload(opt, non_blocking=True)  # issued before the forward pass: overlaps it
    assert not (strict and handle.done()), "the reload is in flight"
    step(model, opt)
    assert handle.done(), "the step waited for the reload"
    train(model, opt, range(3, 4))
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert bitwise_equal(a, b)
    for st, st_ref in zip(opt.state.values(), ref.state.values()):
        assert bitwise_equal(dict(st), dict(st_ref))


# -- the scenarios under several schedules ----------------------------------------------------------------


@pytest.mark.parametrize("seed, progress", SCHEDULES)
@pytest.mark.parametrize("cls, kwargs", CONFIGS)
def test_async_offload_reload_round_trip_is_bitwise(sim, cls, kwargs, seed, progress):
    with deferred_streams(seed=seed, progress=progress):
        offload_round_trip(sim, cls, kwargs, strict=progress == 0.0)


@pytest.mark.parametrize("seed, progress", SCHEDULES)
@pytest.mark.parametrize("cls, kwargs", CONFIGS)
def test_step_pre_hook_waits_for_a_pending_reload(sim, cls, kwargs, seed, progress):
    with deferred_streams(seed=seed, progress=progress):
        reload_then_step(sim, cls, kwargs, strict=progress == 0.0)


@pytest.mark.parametrize("seed, progress", SCHEDULES)
@pytest.mark.parametrize("cls, kwargs", CONFIGS[:2])
def test_reload_issued_before_the_forward_pass(sim, cls, kwargs, seed, progress):
    with deferred_streams(seed=seed, progress=progress):
        reload_then_step(sim, cls, kwargs, forward=True, strict=progress == 0.0)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_pending_transfer_wait_and_done(sim, seed):
    """With nothing ordering them the copies have not run: done() is False and the host copies hold no value
    yet; wait() runs them. Under a schedule with progress, polling done() alone eventually sees them done."""
    with deferred_streams(seed=seed, progress=0.0):
        model, opt = _trained(sim, torch.optim.Adam, {"foreach": True})
        values = [snapshot(dict(st)) for st in opt.state.values()]
        handle = optimshift.offload(opt, non_blocking=True)
        assert not handle.done() and handle.event is not None and handle.device == sim
        assert all(torch.isnan(st["exp_avg"]).all() for st in opt.state.values()), "not copied yet"
        handle.wait()
        assert handle.done() and handle.event is None
        for st, before in zip(opt.state.values(), values):
            assert bitwise_equal(dict(st), before)
        handle = optimshift.reload(opt, non_blocking=True)
        assert not handle.done()
        handle.wait()
        assert handle.done()
        for st, before in zip(opt.state.values(), values):
            assert bitwise_equal(dict(st), before)
    with deferred_streams(seed=seed, progress=0.5):
        handle = optimshift.offload(opt, non_blocking=True)
        polls = 0
        while not handle.done():
            polls += 1
            assert polls < 1000, "queued copies never ran on their own"
        for st, before in zip(opt.state.values(), values):
            assert bitwise_equal(dict(st), before)
        optimshift.reload(opt)


@pytest.mark.parametrize("seed, progress", SCHEDULES)
def test_the_callbacks_of_a_reload_in_flight_run_once_the_next_operation_ends_it(sim, seed, progress):
    """A device-bound transfer in flight, which the next operation orders itself after on the device (no host
    wait), runs its done-callbacks then, once: it is not dropped with them (what a move's release of reserved
    ranges relies on: its handle is in no one else's hands)."""
    with deferred_streams(seed=seed, progress=progress):
        model, opt = _trained(sim, torch.optim.Adam, {"foreach": True})
        optimshift.offload(opt)
        handle = optimshift.reload(opt, non_blocking=True)
        calls = []
        handle.add_done_callback(lambda: calls.append(1))
        optimshift.move(opt)  # (the next operation, which ends it: ordered after it on the device)
        assert calls == [1]
        handle.wait()
        assert handle.done() and calls == [1], "once"


def test_the_step_pre_hook_is_one_per_optimizer_and_goes_with_the_next_operation(sim):
    """A non-blocking offload and then a non-blocking reload share one step pre-hook; it stays harmless after
    the step (torch iterates its hooks while calling them: removing itself there raised), and the next
    optimshift operation removes it."""
    with deferred_streams(progress=0.0):
        model, opt = _trained(sim, torch.optim.Adam, {"foreach": True})
        before = len(opt._optimizer_step_pre_hooks)
        optimshift.offload(opt, non_blocking=True)
        optimshift.reload(opt, non_blocking=True)
        assert len(opt._optimizer_step_pre_hooks) == before + 1
        calls = []
        opt.register_step_pre_hook(lambda *args: calls.append(1))  # a user's hook after optimshift's
        train(model, opt, range(2, 4))
        assert calls == [1, 1]
        optimshift.offload(opt)
        from optimshift._offload import _refuse_step  # (the hook that refuses step() while offloaded)

        hooks = [h for h in opt._optimizer_step_pre_hooks.values() if h is not _refuse_step]
        assert len(hooks) == before + 1  # the user's hook alone
        optimshift.reload(opt)


@pytest.mark.parametrize("seed, progress", [(0, 0.0), (1, 0.3), (2, 0.7)])
def test_a_users_pre_hooks_registered_first_read_finished_state(sim, seed, progress):
    """A user's step, state_dict and load_state_dict pre-hooks registered before a non-blocking reload or
    offload: torch ran them before optimshift's wait (appended after them), so they read state still being
    copied (a race on a reload, NaN from an offload's host buffers), and one registered before offload() ran
    before its refusal of step(). Each of optimshift's hooks now goes first."""
    model, opt = _trained(sim, torch.optim.Adam, {"foreach": True})
    seen: list[str] = []

    def read(name):
        def hook(optimizer, *args):
            total = sum(float(st["exp_avg"].sum()) for st in optimizer.state.values())
            seen.append(name if total == total else f"{name}: NaN")  # (NaN: a host buffer not written yet)

        return hook

    opt.register_step_pre_hook(read("step"))
    opt.register_state_dict_pre_hook(read("state_dict"))
    opt.register_load_state_dict_pre_hook(read("load_state_dict"))
    saved = copy.deepcopy(opt.state_dict())
    seen.clear()
    with deferred_streams(seed=seed, progress=progress):
        optimshift.offload(opt, non_blocking=True)
        opt.state_dict()
        with pytest.raises(RuntimeError, match="offloaded"):
            opt.step()
        optimshift.reload(opt, non_blocking=True)
        train(model, opt, range(2, 3))
        optimshift.offload(opt, non_blocking=True)
        opt.load_state_dict(saved)
        optimshift.reload(opt, non_blocking=True)
        opt.state_dict()
    assert seen == ["state_dict", "step", "load_state_dict", "state_dict"]


def test_without_streams_a_non_blocking_transfer_is_synchronous(sim, monkeypatch):
    """A device type whose streams are unknown (or failed the probe) gets the blocking path, and a handle that
    is done from the start."""
    monkeypatch.setitem(_device_streams._chosen, sim.type, None)
    model, opt = _trained(sim, torch.optim.Adam, {"foreach": True})
    values = [snapshot(dict(st)) for st in opt.state.values()]
    handle = optimshift.offload(opt, non_blocking=True)
    assert handle.done() and handle.event is None
    handle = optimshift.reload(opt, non_blocking=True)
    assert handle.done()
    for st, before in zip(opt.state.values(), values):
        assert bitwise_equal(dict(st), before)


# -- mutation checks: each ordering call of the engine, taken away, makes its scenario fail -----------------
# (progress=0: queued work runs only when ordered, so the check does not depend on a lucky schedule)


def _without(monkeypatch, name):
    monkeypatch.setattr(_device_streams.Streams, name, lambda self, *args: None)


def test_mutation_without_the_wait_the_step_races(sim, monkeypatch):
    """The engine's device wait (the step pre-hook's stream wait on the reload's event) removed: the step reads
    state the side stream is still writing (Megatron #3140: waiting on the wrong stream is the same bug)."""
    with deferred_streams(progress=0.0):
        reload_then_step(sim, *CONFIGS[0].values)  # the scenario passes as is
    _without(monkeypatch, "wait_event")
    with pytest.raises(StreamRaceError, match=r"default stream reads .* stream \d+ writes"):
        with deferred_streams(progress=0.0):
            reload_then_step(sim, *CONFIGS[0].values)


def test_mutation_without_record_stream_the_offload_frees_memory_in_use(sim, monkeypatch):
    """record_stream removed: the commit frees device state that the side stream's copies still read
    (DeepSpeed #8256); the allocator may reuse it at once."""
    with deferred_streams(progress=0.0):
        offload_round_trip(sim, *CONFIGS[0].values)
    _without(monkeypatch, "record_stream")
    with pytest.raises(StreamRaceError, match=r"freed while .* may still (read|write) it"):
        with deferred_streams(progress=0.0):
            offload_round_trip(sim, *CONFIGS[0].values)


def test_mutation_without_the_event_record_wait_returns_before_the_copies(sim, monkeypatch):
    """The side stream's event record removed: wait() returns before the device-to-host copies ran (prime-rl
    #3109: an asynchronous copy with nothing to wait on), so the host reads copies that hold no value."""
    with deferred_streams(progress=0.0):
        offload_round_trip(sim, *CONFIGS[0].values)
    _without(monkeypatch, "record")
    with pytest.raises(AssertionError, match="the host copies, after wait"):
        with deferred_streams(progress=0.0):
            # (strict=False: not stopped earlier by done(), which an event never recorded answers True)
            offload_round_trip(sim, *CONFIGS[0].values, strict=False)


def test_mutation_without_the_event_record_the_step_races(sim, monkeypatch):
    _without(monkeypatch, "record")
    with pytest.raises(StreamRaceError, match=r"default stream reads .* stream \d+ writes"):
        with deferred_streams(progress=0.0):
            reload_then_step(sim, *CONFIGS[0].values, strict=False)


def test_mutation_without_the_side_stream_waiting_for_the_step_the_offload_races(sim, monkeypatch):
    """The side stream's wait for the default stream removed: the offload's copies read state the last step
    may still be writing."""
    _without(monkeypatch, "wait_stream")
    with pytest.raises(StreamRaceError, match=r"stream \d+ reads .* default stream writes"):
        with deferred_streams(progress=0.0):
            offload_round_trip(sim, *CONFIGS[0].values)


def test_mutation_without_the_pool_waiting_a_reused_buffer_is_overwritten(sim, monkeypatch):
    """The pool hands out a staging buffer whose host-to-device copy has not run (its event ignored): the next
    transfer overwrites it on the host and the queued copy would read the wrong bytes."""
    from optimshift.pool import host_pool

    host_pool.release_idle()

    def fresh_on_host():
        model = Model(SHAPES)  # host state, in separate tensors: a move to the device stages them
        opt = torch.optim.Adam(model.parameters(), foreach=False)
        train(model, opt, range(1))
        model.to(sim)
        return model, opt

    def two_moves():
        _, a = fresh_on_host()
        _, b = fresh_on_host()
        for st in b.state.values():
            for k, v in st.items():
                if k != "step":
                    v.add_(1.0)  # b's bytes differ from a's
        optimshift.move(a, non_blocking=True)  # staging buffer released with the copy's event
        optimshift.move(b, non_blocking=True)  # ...must not be overwritten before that copy ran
        torch.sim.synchronize(sim)

    with deferred_streams(progress=0.0):
        two_moves()
    real_release = type(host_pool).release

    def release_without_event(pool, buf, event=None):
        real_release(pool, buf, None)  # as if the copy reading the buffer were complete

    monkeypatch.setattr(type(host_pool), "release", release_without_event)
    with pytest.raises(StreamRaceError, match=r"reads host memory .* that the host changed before the copy ran"):
        with deferred_streams(progress=0.0):
            two_moves()


def test_a_reload_allocates_on_the_current_stream_and_records_for_the_side_one(sim, monkeypatch):
    """A non-blocking reload allocates the new device state on the current stream (the one that steps it) and
    records it for the side stream that fills it: dropped before anything waited, it is safe only because of
    that record (and the block goes back to the current stream's cache, where the next step can reuse it)."""

    def reload_drop():
        model, opt = _trained(sim, torch.optim.Adam, {"foreach": True})
        optimshift.offload(opt)
        optimshift.reload(opt, non_blocking=True)
        _offload.end_pending(opt)  # (ordered on the device only: the copies are still queued under the strict schedule)
        del model, opt
        gc.collect()
        torch.sim.synchronize(sim)

    with deferred_streams(progress=0.0):
        reload_drop()
    # (a reload reads host memory only: every device tensor it records is one it allocated and fills)
    _without(monkeypatch, "record_stream")
    with pytest.raises(StreamRaceError, match=r"allocated on sim:0 default stream was freed while .* may still write"):
        with deferred_streams(progress=0.0):
            reload_drop()


def test_a_transfer_between_two_devices_is_synchronous(sim):
    """Copies between sim:0 and sim:1 would need both devices' streams ordered: the engine copies them on the
    blocking path (one side stream serves one device)."""
    sim1 = torch.device(sim.type, 1)
    with deferred_streams(progress=0.0):
        model, opt = _trained(sim, torch.optim.Adam, {"foreach": True})
        values = [snapshot(dict(st)) for st in opt.state.values()]
        model.to(sim1)
        optimshift.move(opt, non_blocking=True)
        assert _offload.pending_of(opt).done()
        assert {row.device for row in optimshift.placement(opt) if row.key != "step"} == {str(sim1)}
        for st, before in zip(opt.state.values(), values):
            assert bitwise_equal(dict(st), before)


def test_a_non_blocking_offload_that_fails_part_way_changes_nothing(sim, monkeypatch):
    """All or nothing on the side stream too: copies already queued are run and their buffers given back, the
    optimizer keeps its device state, and the next (blocking) round trip is bitwise."""
    from optimshift import _copy
    from optimshift.pool import host_pool

    with deferred_streams(progress=0.0):
        model, opt = _trained(sim, torch.optim.Adam, {"foreach": True})
        values = [snapshot(dict(st)) for st in opt.state.values()]
        objects = tensor_ids(opt)
        in_use = host_pool.stats().in_use
        real_cat, calls = torch.cat, []

        def cat_then_fail(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise MemoryError("injected: out of device memory in the second staging cat")
            return real_cat(*args, **kwargs)

        monkeypatch.setattr(_copy.torch, "cat", cat_then_fail)
        monkeypatch.setattr(_copy, "CHUNK_BYTES", 48)  # several chunks: the first is queued when the second fails
        with pytest.raises(MemoryError):
            optimshift.offload(opt, non_blocking=True)
        monkeypatch.undo()
        assert len(calls) == 2 and host_pool.stats().in_use == in_use
        assert not optimshift.is_offloaded(opt) and tensor_ids(opt) == objects
        assert {row.device for row in optimshift.placement(opt) if row.key != "step"} == {str(sim)}
        optimshift.offload(opt)
        optimshift.reload(opt)
        for st, before in zip(opt.state.values(), values):
            assert bitwise_equal(dict(st), before)


def _offload_interrupted_in_its_commit(monkeypatch, opt) -> None:
    """A non-blocking offload whose commit a Ctrl-C stops after its copies were queued."""
    from optimshift import _engine

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt("injected: Ctrl-C in the commit")

    monkeypatch.setattr(_engine, "adoptions", interrupted)
    with pytest.raises(KeyboardInterrupt):
        optimshift.offload(opt, non_blocking=True)
    monkeypatch.undo()


@pytest.mark.parametrize("seed, progress", SCHEDULES)
def test_a_non_blocking_offload_whose_commit_fails_gives_its_buffers_back_to_the_pool(sim, monkeypatch, seed, progress):
    """A commit that fails (a Ctrl-C) after the copies were queued: the pool buffers they write go back to the
    pool, reused by the next offload, not freed (the next offload pinned new ones)."""
    from optimshift.pool import host_pool

    def idle():
        with host_pool._locked():
            return sorted(id(buf) for buf, _, _ in host_pool._idle)

    with deferred_streams(seed, progress):
        model, opt = _trained(sim, torch.optim.Adam, {"foreach": True})
        optimshift.offload(opt)
        optimshift.reload(opt)  # (the pool now holds the offload's buffers, idle)
        values = [snapshot(dict(st)) for st in opt.state.values()]
        before, allocations = idle(), host_pool.stats().allocations
        assert before

        _offload_interrupted_in_its_commit(monkeypatch, opt)
        gc.collect()
        assert idle() == before, "the failed offload's buffers are idle in the pool again"
        assert not optimshift.is_offloaded(opt)
        optimshift.offload(opt)
        assert host_pool.stats().allocations == allocations, "the next offload reused them"
        optimshift.reload(opt)
        for st, before_values in zip(opt.state.values(), values):
            assert bitwise_equal(dict(st), before_values)


@pytest.mark.parametrize("seed, progress", SCHEDULES)
def test_the_step_after_a_non_blocking_offload_whose_commit_failed_waits_for_its_copies(
    sim, monkeypatch, seed, progress
):
    """A commit that fails (a Ctrl-C) after the offload's copies were queued: the next step, on the current
    stream, writes the state those copies still read on the side stream; it is ordered after them (it raced)."""
    ref_model, ref = _trained(sim, torch.optim.Adam, {"foreach": True})
    train(ref_model, ref, range(2, 4))
    with deferred_streams(seed, progress):
        model, opt = _trained(sim, torch.optim.Adam, {"foreach": True})

        _offload_interrupted_in_its_commit(monkeypatch, opt)
        train(model, opt, range(2, 4))
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert bitwise_equal(a, b)
        assert bitwise_equal(dict(opt.state[a]), dict(ref.state[b]))


def test_the_reload_leaves_no_memory_cached_for_the_side_stream(sim):
    """CUDA's caching allocator keeps a freed block for the stream that allocated it. Over offload/reload
    cycles (non-blocking, as an RL loop runs them), every device tensor the transfers make is allocated on the
    current stream: what an offload frees is cached for the stream that steps next, none for the side stream
    (which nothing else allocates on)."""
    from optimshift.testing import simulated_memory_cached

    with deferred_streams(progress=0.0):
        model, opt = _trained(sim, torch.optim.Adam, {"foreach": True})
        _device_streams.of(sim)  # (the one-time probe of the backend's streams allocates on a stream of its own)
        torch.sim.empty_cache()
        state_bytes = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.dim())
        for step in range(3):
            optimshift.offload(opt, non_blocking=True)
            gc.collect()
            optimshift.reload(opt, non_blocking=True)
            train(model, opt, range(2 + step, 3 + step))
        optimshift.offload(opt, non_blocking=True).wait()
        gc.collect()
        cached = simulated_memory_cached(sim.index)
        assert set(cached) <= {0}, f"memory kept for a side stream: {cached}"
        assert cached.get(0, 0) >= state_bytes, "the offloaded state's device memory, reusable by the next step"
        optimshift.reload(opt)


@pytest.mark.parametrize("seed, progress", [(0, 0.0), (1, 0.3), (2, 0.7)])
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_the_whole_optimizer_waits_for_the_copies_in_flight(sim, seed, progress, how):
    """copy.deepcopy, pickle and torch.save of the optimizer read its state through __getstate__, which no hook
    reaches: right after a non-blocking offload they copied host buffers not written yet (NaN on the simulator),
    after a non-blocking reload they raced the copies. They now wait first, as state_dict() does."""
    import io

    def copied(opt):
        if how == "deepcopy":
            return copy.deepcopy(opt)
        buffer = io.BytesIO()
        torch.save(opt, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    model, opt = _trained(sim, torch.optim.Adam, {"foreach": True})
    expected = [snapshot(dict(st)) for st in opt.state.values()]
    with deferred_streams(seed=seed, progress=progress):
        optimshift.offload(opt, non_blocking=True)
        offloaded = copied(opt)
        optimshift.reload(opt, non_blocking=True)
        reloaded = copied(opt)
    assert "__getstate__" not in offloaded.__dict__ and "__getstate__" not in reloaded.__dict__
    for other in (offloaded, reloaded):
        got = [snapshot(dict(st)) for st in other.state.values()]
        assert all(bitwise_equal(a, b) for a, b in zip(got, expected))
    optimshift.reload(opt)
    assert "__getstate__" not in opt.__dict__  # (taken away with the transfer's hooks)


@pytest.mark.parametrize("seed, progress", [(0, 0.0), (1, 0.3)])
def test_a_copy_of_a_streamed_optimizer_waits_for_its_write_backs(sim, seed, progress):
    """Right after a streamed step its write-backs to the host are still queued: a deepcopy of the optimizer
    copied host chunks not written yet (NaN on the simulator)."""
    model, opt = _trained(sim, torch.optim.Adam, {"foreach": True})
    ref_model, ref = _trained(sim, torch.optim.Adam, {"foreach": True})
    train(ref_model, ref, range(2, 3))
    expected = [snapshot(dict(st)) for st in ref.state.values()]
    with deferred_streams(seed=seed, progress=progress):
        optimshift.stream(opt)
        train(model, opt, range(2, 3))
        other = copy.deepcopy(opt)
        optimshift.unstream(opt)
    got = [snapshot(dict(st)) for st in other.state.values()]
    assert all(bitwise_equal(a, b) for a, b in zip(got, expected))
    assert "__getstate__" not in opt.__dict__
