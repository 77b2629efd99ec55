"""Nothing reads a transfer still in flight: every read through the optimizer and every optimshift operation
waits for a pending non-blocking offload or reload first (issue 17, item 1).

Each scenario issues a non-blocking transfer and, without waiting, reads or changes the state the way a user
would. Under the strict schedule (nothing queued runs until something orders it) an unordered read sees the
poisoned destination (NaN) of a copy that has not run, and an unordered device access raises
StreamRaceError; the seeded schedules show the same result whatever interleaving the device picks.
"""

import gc
import os
import signal
import weakref

import pytest
import torch

import optimshift
from _matrix import Model, bitwise_equal, snapshot, tensor_ids, train
from _schedules import SCHEDULES, drain_queued  # noqa: F401  (drain_queued: an autouse fixture)
from optimshift import _offload, api
from optimshift.testing import deferred_streams

SHAPES = [(3, 2), (4,), (2, 5)]


def _trained(sim, cls=torch.optim.Adam, **kwargs):
    model = Model(SHAPES).to(sim)
    opt = cls(list(model.parameters()), **({"foreach": True} | kwargs))
    train(model, opt, range(2))
    return model, opt


def _values(opt):
    return [snapshot(dict(st)) for st in opt.state.values()]


def _same(opt, values):
    return all(bitwise_equal(dict(st), before) for st, before in zip(opt.state.values(), values))


def _in_flight_offload(sim, strict):
    model, opt = _trained(sim)
    values = _values(opt)
    handle = optimshift.offload(opt, non_blocking=True)
    assert not (strict and handle.done()), "the offload is in flight"
    return model, opt, values, handle


def _in_flight_reload(sim, strict):
    model, opt = _trained(sim)
    values = _values(opt)
    optimshift.offload(opt)
    handle = optimshift.reload(opt, non_blocking=True)
    assert not (strict and handle.done()), "the reload is in flight"
    return model, opt, values, handle


# -- reads on the host: state_dict(), save, check, placement, wait -----------------------------------------


@pytest.mark.parametrize("seed, progress", SCHEDULES)
def test_state_dict_during_an_offload_holds_the_values(sim, seed, progress):
    with deferred_streams(seed=seed, progress=progress):
        _, opt, values, handle = _in_flight_offload(sim, progress == 0.0)
        sd = opt.state_dict()  # the state_dict pre-hook waits on the host
        assert handle.done()
        for st, before in zip(sd["state"].values(), values):
            assert bitwise_equal(dict(st), before)
        optimshift.reload(opt)


@pytest.mark.parametrize("seed, progress", SCHEDULES)
def test_save_during_an_offload_writes_the_values(sim, seed, progress, tmp_path):
    with deferred_streams(seed=seed, progress=progress):
        _, opt, values, _ = _in_flight_offload(sim, progress == 0.0)
        optimshift.save(opt.state_dict(), tmp_path / "a.pt")
        _, opt2, values2, _ = _in_flight_offload(sim, progress == 0.0)
        optimshift.save({"optimizer": opt2}, tmp_path / "b.pt")  # the optimizer itself, inside a dict
    for name, vals in (("a.pt", values), ("b.pt", values2)):
        loaded = optimshift.load(tmp_path / name)
        sd = loaded if "state" in loaded else loaded["optimizer"]
        for st, before in zip(sd["state"].values(), vals):
            assert bitwise_equal(dict(st), before), name
    optimshift.reload(opt)
    optimshift.reload(opt2)


@pytest.mark.parametrize("read", ["check", "placement", "wait"])
@pytest.mark.parametrize("seed, progress", SCHEDULES)
def test_check_placement_and_wait_order_host_reads_after_an_offload(sim, seed, progress, read):
    with deferred_streams(seed=seed, progress=progress):
        _, opt, values, handle = _in_flight_offload(sim, progress == 0.0)
        getattr(optimshift, read)(opt)
        assert handle.done()
        assert _same(opt, values), "the host copies, read directly after optimshift." + read
        optimshift.reload(opt)


@pytest.mark.parametrize("seed, progress", SCHEDULES)
def test_wait_blocks_until_a_reload_is_complete(sim, seed, progress):
    with deferred_streams(seed=seed, progress=progress):
        _, opt, values, handle = _in_flight_reload(sim, progress == 0.0)
        optimshift.wait(opt)
        assert handle.done()
        assert _same(opt, values)
        optimshift.wait(opt)  # nothing in flight: a no-op


@pytest.mark.parametrize("seed, progress", SCHEDULES)
def test_state_dict_during_a_reload_waits_on_the_device_only(sim, seed, progress, monkeypatch):
    """A reload writes device memory: state_dict() orders the current stream after it, with no host sync;
    reading the tensors (on the current stream) then sees the values."""
    with deferred_streams(seed=seed, progress=progress):
        _, opt, values, handle = _in_flight_reload(sim, progress == 0.0)
        host_waits = []
        monkeypatch.setattr(_offload.PendingTransfer, "wait", lambda self: host_waits.append(self))
        sd = opt.state_dict()
        monkeypatch.undo()
        assert host_waits == [], "a device-side wait, not a host one"
        for st, before in zip(sd["state"].values(), values):
            assert bitwise_equal(dict(st), before)  # reads on the default stream, ordered after the copies


# -- operations that change the state ------------------------------------------------------------------


@pytest.mark.parametrize("how", ["optimshift", "torch"])
@pytest.mark.parametrize("seed, progress", SCHEDULES)
def test_load_state_dict_during_an_offload_is_not_overwritten_by_it(sim, seed, progress, how):
    """The load replaces the live (offloaded) state; the copies still in flight write into it: the load must
    come after them, or the old values land on top of the loaded ones."""
    with deferred_streams(seed=seed, progress=progress):
        _, other = _trained(sim)
        for st in other.state.values():
            st["exp_avg"].add_(1.0)
        loaded = other.state_dict()
        expected = _values(other)
        _, opt, _, _ = _in_flight_offload(sim, progress == 0.0)
        objects = tensor_ids(opt)
        if how == "optimshift":
            optimshift.load_state_dict(opt, loaded)
        else:
            opt.load_state_dict(loaded)
        torch.sim.synchronize(0)
        assert _same(opt, expected)
        if how == "optimshift":
            assert tensor_ids(opt) == objects


@pytest.mark.parametrize("seed, progress", SCHEDULES)
def test_offload_during_a_reload_waits_on_the_device(sim, seed, progress):
    """offload right after a non-blocking reload: ordered on the device (the next user is the copies), bitwise."""
    with deferred_streams(seed=seed, progress=progress):
        _, opt, values, reload_handle = _in_flight_reload(sim, progress == 0.0)
        objects = tensor_ids(opt)
        handle = optimshift.offload(opt, non_blocking=True)
        handle.wait()
        assert _same(opt, values) and tensor_ids(opt) == objects
        optimshift.reload(opt)
        assert _same(opt, values) and tensor_ids(opt) == objects


@pytest.mark.parametrize("op", ["move", "rebind", "stream"])
@pytest.mark.parametrize("seed, progress", SCHEDULES)
def test_operations_during_a_reload_are_ordered_after_it(sim, seed, progress, op):
    with deferred_streams(seed=seed, progress=progress):
        model, opt, values, _ = _in_flight_reload(sim, progress == 0.0)
        if op == "move":
            optimshift.move(opt, "cpu")
        elif op == "rebind":
            optimshift.rebind(opt, list(model.parameters()))
        else:
            optimshift.stream(opt)
        torch.sim.synchronize(0)
        assert _same(opt, values)
        if op == "stream":
            optimshift.unstream(opt)


@pytest.mark.parametrize("seed, progress", SCHEDULES)
def test_dcp_save_during_an_offload_writes_the_values(sim, seed, progress, tmp_path):
    pytest.importorskip("torch.distributed.checkpoint")
    import optimshift.distributed as od

    with deferred_streams(seed=seed, progress=progress):
        model = Model(SHAPES)
        opt = torch.optim.Adam(list(model.parameters()), foreach=True)
        train(model, opt, range(2))
        values = _values(opt)
        reference = optimshift.placement(opt)
        model.to(sim)
        optimshift.move(opt)
        handle = optimshift.offload(opt, non_blocking=True)
        assert not (progress == 0.0 and handle.done())
        model.to("cpu")  # DCP reads the model on the host
        od.save(tmp_path / "ckpt", model, opt)
        assert handle.done()
    fresh_model = Model(SHAPES)
    fresh = torch.optim.Adam(list(fresh_model.parameters()), foreach=True)
    od.load(tmp_path / "ckpt", fresh_model, fresh)
    assert [r.key for r in optimshift.placement(fresh)] == [r.key for r in reference]
    assert _same(fresh, values)


def test_the_hooks_that_wait_go_with_the_next_operation(sim):
    """While a transfer is in flight the optimizer carries one step, state_dict and load_state_dict pre-hook
    each; the next optimshift operation removes all three."""
    with deferred_streams(progress=0.0):
        _, opt = _trained(sim)
        counts = (
            len(opt._optimizer_step_pre_hooks),
            len(opt._optimizer_state_dict_pre_hooks),
            len(opt._optimizer_load_state_dict_pre_hooks),
        )
        optimshift.offload(opt, non_blocking=True)
        optimshift.reload(opt, non_blocking=True)
        with_pending = (
            len(opt._optimizer_step_pre_hooks),
            len(opt._optimizer_state_dict_pre_hooks),
            len(opt._optimizer_load_state_dict_pre_hooks),
        )
        # (+1 step pre-hook and +1 state_dict post-hook belong to the offload record, gone after reload)
        assert with_pending == (counts[0] + 1, counts[1] + 1, counts[2] + 1)
        _offload.end_pending(opt)
        assert (
            len(opt._optimizer_step_pre_hooks),
            len(opt._optimizer_state_dict_pre_hooks),
            len(opt._optimizer_load_state_dict_pre_hooks),
        ) == counts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_ctrl_c_while_the_next_operation_waits_for_an_offload_leaves_it_in_flight_and_guarded(sim, seed, monkeypatch):
    """A Ctrl-C while an operation's host wait for an offload still in flight (``end_pending``) runs: the offload
    stays remembered and guarded, so ``state_dict()`` still waits for its copies, and its done-callbacks run
    once, with the next operation. (The transfer was forgotten and its hooks removed before the wait: the read
    saw host buffers the copies had not written, and the callbacks, a keep_addresses release, never ran.)"""
    with deferred_streams(seed=seed, progress=0.0):
        _, opt, values, handle = _in_flight_offload(sim, strict=True)
        calls = []
        handle.add_done_callback(lambda: calls.append(1))
        event = handle.event
        synchronize = type(event).synchronize

        def interrupted(self):
            if self is event:
                monkeypatch.setattr(type(event), "synchronize", synchronize)
                raise KeyboardInterrupt("injected: Ctrl-C in the host wait")
            synchronize(self)

        monkeypatch.setattr(type(event), "synchronize", interrupted)
        with pytest.raises(KeyboardInterrupt):
            optimshift.reload(opt)
        assert calls == [] and not handle.done()
        sd = opt.state_dict()  # the state_dict pre-hook waits on the host
        for st, before in zip(sd["state"].values(), values):
            assert bitwise_equal(dict(st), before)
        optimshift.reload(opt)
        assert calls == [1] and _same(opt, values)


def test_a_raising_done_callback_skips_none_after_it(sim):
    """Every done-callback runs, then the first error is raised (a raising one dropped those after it)."""
    with deferred_streams(progress=0.0):
        _, opt, _, handle = _in_flight_offload(sim, strict=True)
        calls = []

        def fails():
            calls.append("fails")
            raise RuntimeError("injected: a failing callback")

        handle.add_done_callback(fails)
        handle.add_done_callback(lambda: calls.append("after"))
        with pytest.raises(RuntimeError, match="injected"):
            handle.wait()
        assert calls == ["fails", "after"] and handle.done()
        optimshift.reload(opt)
        assert calls == ["fails", "after"]


def test_a_done_callback_s_error_once_dropped_keeps_nothing_its_frames_held(sim):
    """The error a raising done-callback raised frees, once the caller drops it, what its frames held, without
    waiting for the cyclic collector (the list of errors, a local of the frame that raised, held the error: a cycle
    through every frame of the traceback, an operation's included, and their locals)."""
    refs = []

    def fails():
        held = torch.empty(1)  # (a local of the callback's frame, in the error's traceback)
        refs.append(weakref.ref(held))
        raise RuntimeError("injected: a failing callback")

    with deferred_streams(progress=0.0):
        _, opt, _, handle = _in_flight_offload(sim, strict=True)
        handle.add_done_callback(fails)
        gc.disable()
        try:
            try:
                handle.wait()
            except RuntimeError:
                pass
            assert refs[0]() is None, "the error's frames outlived it"
        finally:
            gc.enable()
        optimshift.reload(opt)


def test_a_ctrl_c_in_a_done_callback_is_raised_even_after_another_callback_s_error(sim):
    """A Ctrl-C that lands in a done-callback is what the wait raises, after every callback ran, even where an earlier
    callback failed: the first error raised in its place turned the interrupt into an Exception, which a caller's
    ``except Exception`` swallows."""
    with deferred_streams(progress=0.0):
        _, opt, _, handle = _in_flight_offload(sim, strict=True)
        calls = []

        def fails():
            calls.append("fails")
            raise RuntimeError("injected: a failing callback")

        def interrupted():
            calls.append("interrupted")
            raise KeyboardInterrupt("injected: Ctrl-C in a callback")

        handle.add_done_callback(fails)
        handle.add_done_callback(interrupted)
        handle.add_done_callback(lambda: calls.append("after"))
        with pytest.raises(KeyboardInterrupt, match="injected"):
            handle.wait()
        assert calls == ["fails", "interrupted", "after"] and handle.done()
        optimshift.reload(opt)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("op", ["reload", "move"])
def test_a_ctrl_c_between_forgetting_the_record_and_remembering_the_transfer_waits_for_it(sim, seed, op, monkeypatch):
    """A SIGINT that arrives after a non-blocking reload or move forgot the offload record, before it remembered its
    transfer, is held by the commit's section until the operation's end: the transfer is remembered and guarded,
    and ``state_dict()`` waits for its copies."""
    with deferred_streams(seed=seed, progress=0.0):
        _, opt = _trained(sim)
        values = _values(opt)
        optimshift.offload(opt)
        forget = api.forget

        def forget_then_sigint(*args, **kwargs):
            forget(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGINT)

        monkeypatch.setattr(api, "forget", forget_then_sigint)
        with pytest.raises(KeyboardInterrupt):
            if op == "reload":
                optimshift.reload(opt, non_blocking=True)
            else:
                optimshift.move(opt, sim, non_blocking=True)
        monkeypatch.setattr(api, "forget", forget)
        assert _offload.record_of(opt) is None and not _offload.pending_of(opt).done(), "forgotten, still in flight"
        sd = opt.state_dict()  # the state_dict pre-hook orders it after the copies
        for st, before in zip(sd["state"].values(), values):
            assert bitwise_equal(dict(st), before)
        assert _same(opt, values)
