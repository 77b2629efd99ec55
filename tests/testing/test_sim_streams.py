"""The simulated accelerator's streams and events: deferred execution, and races that raise."""

from __future__ import annotations

import gc

import pytest
import torch

from optimshift.testing import StreamRaceError, _sim_streams, deferred_streams, simulated_accelerator


@pytest.fixture()
def dev():
    device = simulated_accelerator(0)
    yield device
    # A test that provoked a race leaves work queued (or a violation unreported): run it all, quietly.
    for _ in range(10):
        try:
            for index in (0, 1):
                torch.sim.synchronize(index)
            break
        except StreamRaceError:
            continue


def _host(n=6, dtype=torch.float32):
    return torch.arange(n, dtype=dtype) + 1


def test_side_stream_work_waits_until_an_event_orders_it(dev):
    with deferred_streams(progress=0.0):
        x = _host().to(dev)
        side = torch.sim.Stream(dev)
        out = torch.zeros(6)
        with torch.sim.stream(side):
            y = x * 2  # an op: its result is allocated now and filled when it runs
            out.copy_(y, non_blocking=True)  # a device-to-host copy into an existing buffer
        done = torch.sim.Event()
        done.record(side)
        assert not done.query() and not side.query()
        assert torch.isnan(out).all(), "until the copy ran, its destination holds no value"
        done.synchronize()
        assert done.query() and side.query()
        assert torch.equal(out, _host() * 2)


def test_the_default_stream_runs_at_once(dev):
    with deferred_streams(progress=0.0):
        x = _host().to(dev)
        out = torch.zeros(6)
        out.copy_(x * 3, non_blocking=True)
        assert torch.equal(out, _host() * 3)
        event = torch.sim.Event()
        event.record()  # on the current (default) stream: complete at once
        assert event.query()
        assert torch.sim.current_stream(dev) == torch.sim.default_stream(dev)


def test_an_unordered_read_raises_when_issued_and_a_wait_orders_it(dev):
    with deferred_streams(progress=0.0):
        x = _host().to(dev)
        side = torch.sim.Stream(dev)
        with torch.sim.stream(side):
            y = x + 1
        with pytest.raises(StreamRaceError, match=r"reads a sim:0 tensor.*that aten::add .*writes"):
            y.cpu()
        torch.sim.current_stream(dev).wait_stream(side)
        assert torch.equal(y.cpu(), _host() + 1)


def test_a_write_while_another_stream_reads_raises(dev):
    """Write-after-read: the default stream overwrites a tensor a queued copy still reads (double buffering
    without a wait)."""
    with deferred_streams(progress=0.0):
        x = _host().to(dev)
        side = torch.sim.Stream(dev)
        side.wait_stream(torch.sim.current_stream(dev))
        with torch.sim.stream(side):
            y = x.clone()
        with pytest.raises(StreamRaceError, match=r"writes a sim:0 tensor.*reads"):
            x.mul_(0)
        side.synchronize()
        x.mul_(0)  # once the host waited for the reader, the write is ordered after it
        assert torch.equal(y.cpu(), _host())


def test_a_side_stream_must_wait_for_what_the_default_stream_wrote(dev):
    with deferred_streams(progress=0.0):
        x = _host().to(dev)
        x.add_(1)  # the default stream writes x; the host has not waited for it
        side = torch.sim.Stream(dev)
        with torch.sim.stream(side):
            with pytest.raises(StreamRaceError, match=r"on sim:0 stream \d+ reads .* default stream writes"):
                x.to("cpu", non_blocking=True)
        side.wait_stream(torch.sim.current_stream(dev))
        host = torch.empty(6)
        with torch.sim.stream(side):
            host.copy_(x, non_blocking=True)
        side.synchronize()
        assert torch.equal(host, _host() + 1)


def test_a_wait_on_the_wrong_stream_does_not_order(dev):
    with deferred_streams(progress=0.0):
        x = _host().to(dev)
        a, b = torch.sim.Stream(dev), torch.sim.Stream(dev)
        with torch.sim.stream(a):
            y = x * 5
        torch.sim.current_stream(dev).wait_stream(b)  # the wrong stream: y is written on a
        with pytest.raises(StreamRaceError, match=r"stream \d+ writes"):
            y.sum()
        torch.sim.current_stream(dev).wait_event(a.record_event())
        assert float(y.sum().cpu()) == float((_host() * 5).sum())


def test_waits_chain_across_side_streams(dev):
    """b waits for an event of a: when b's work runs, a's work before the event runs first."""
    with deferred_streams(progress=0.0):
        x = _host().to(dev)
        a, b = torch.sim.Stream(dev), torch.sim.Stream(dev)
        a.wait_stream(torch.sim.current_stream(dev))
        with torch.sim.stream(a):
            y = x * 2
        b.wait_event(a.record_event())
        out = torch.empty(6)
        with torch.sim.stream(b):
            out.copy_(y + 1, non_blocking=True)
        assert not a.query()
        b.synchronize()  # runs a's work first
        assert a.query() and torch.equal(out, _host() * 2 + 1)


def test_device_memory_freed_while_another_stream_reads_it_raises(dev):
    """The DeepSpeed #8256 bug: the source of a copy still queued on a side stream is freed on the host. Without
    record_stream the caching allocator would hand the block out at once: the memory is poisoned and the next
    call into the simulator raises."""
    with deferred_streams(progress=0.0):
        side = torch.sim.Stream(dev)
        x = _host().to(dev)
        side.wait_stream(torch.sim.current_stream(dev))
        host = torch.empty(6)
        with torch.sim.stream(side):
            host.copy_(x, non_blocking=True)
        del x
        gc.collect()
        with pytest.raises(StreamRaceError, match=r"freed while aten::_copy_from .* may still read it.*record_stream"):
            side.synchronize()
        side.synchronize()
        assert torch.isnan(host).all(), "the copy read memory the allocator reused"


def test_record_stream_keeps_freed_memory_until_the_stream_used_it(dev):
    with deferred_streams(progress=0.0):
        side = torch.sim.Stream(dev)
        x = _host().to(dev)
        side.wait_stream(torch.sim.current_stream(dev))
        host = torch.empty(6)
        with torch.sim.stream(side):
            host.copy_(x, non_blocking=True)
        x.record_stream(side)
        del x
        gc.collect()
        side.synchronize()
        assert torch.equal(host, _host())


def test_memory_freed_on_its_own_stream_needs_no_record_stream(dev):
    """A temporary allocated and used on the side stream itself (a staging buffer) may be dropped at once."""
    with deferred_streams(progress=0.0):
        side = torch.sim.Stream(dev)
        x = _host().to(dev)
        side.wait_stream(torch.sim.current_stream(dev))
        host = torch.empty(6)
        with torch.sim.stream(side):
            staging = x * 1
            host.copy_(staging, non_blocking=True)
            del staging
        gc.collect()
        side.synchronize()
        assert torch.equal(host, _host())


def test_host_memory_changed_before_its_queued_copy_ran_raises(dev):
    """A pinned buffer reused too early: the host overwrites the source of a host-to-device copy that has not
    run yet."""
    with deferred_streams(progress=0.0):
        side = torch.sim.Stream(dev)
        staging = _host()
        with torch.sim.stream(side):
            x = staging.to(dev, non_blocking=True)
        staging.fill_(0.0)  # plain host code: the simulator cannot see it now, only when the copy runs
        with pytest.raises(StreamRaceError, match=r"reads host memory .* that the host changed before the copy ran"):
            side.synchronize()
        del x


def test_host_reads_and_blocking_copies_run_the_queue_first(dev):
    with deferred_streams(progress=0.0):
        side = torch.sim.Stream(dev)
        x = _host().to(dev)
        side.wait_stream(torch.sim.current_stream(dev))
        with torch.sim.stream(side):
            y = x * 4
            assert float(y[1].item()) == 8.0  # .item() waits for the work queued before it
            z = x + 7
            host = z.to("cpu")  # a blocking copy to the host waits too
        assert torch.equal(host, _host() + 7)


def test_in_place_and_out_ops_queue_on_the_callers_tensors(dev):
    with deferred_streams(progress=0.0):
        side = torch.sim.Stream(dev)
        x = _host().to(dev)
        out = torch.empty(6, device=dev)
        side.wait_stream(torch.sim.current_stream(dev))
        with torch.sim.stream(side):
            r1 = x.mul_(2)
            r2 = torch.add(x, 1, out=out)
            parts = torch._foreach_add([x, out], 1.0)
        assert r1 is x and r2 is out
        torch.sim.current_stream(dev).wait_stream(side)
        assert torch.equal(x.cpu(), _host() * 2) and torch.equal(out.cpu(), _host() * 2 + 1)
        assert torch.equal(parts[1].cpu(), _host() * 2 + 2)


def test_host_scalars_are_read_when_the_op_is_issued(dev):
    """A 0-dim host tensor is passed by value at launch (as CUDA does): changing it afterwards does not change
    the queued op."""
    with deferred_streams(progress=0.0):
        side = torch.sim.Stream(dev)
        x = _host().to(dev)
        scale = torch.tensor(3.0)
        side.wait_stream(torch.sim.current_stream(dev))
        with torch.sim.stream(side):
            y = x * scale
        scale.fill_(100.0)
        torch.sim.current_stream(dev).wait_stream(side)
        assert torch.equal(y.cpu(), _host() * 3)


def test_an_unrecorded_event_orders_nothing(dev):
    with deferred_streams(progress=0.0):
        side = torch.sim.Stream(dev)
        x = _host().to(dev)
        side.wait_stream(torch.sim.current_stream(dev))
        with torch.sim.stream(side):
            y = x - 1
        never = torch.sim.Event()
        assert never.query()  # as on CUDA: an event never recorded counts as complete
        never.synchronize()
        torch.sim.current_stream(dev).wait_event(never)
        with pytest.raises(StreamRaceError):
            y.cpu()


def test_seeds_give_different_schedules_and_the_same_values(dev):
    """Random progress: under one seed queued work runs at the same points; different seeds interleave
    differently; correct code gets the same values under all of them."""

    def schedule(seed):
        polls = []
        with deferred_streams(seed=seed, progress=0.5):
            side = torch.sim.Stream(dev)
            x0 = _host(64).to(dev)  # kept: freeing it while the side stream reads it would be a race
            side.wait_stream(torch.sim.current_stream(dev))
            x = x0
            with torch.sim.stream(side):
                for _ in range(6):
                    x = x * 2  # the intermediates are allocated and freed on the side stream itself
            event = side.record_event()
            for _ in range(30):
                polls.append(event.query())
            torch.sim.current_stream(dev).wait_event(event)
            values = x.cpu()
        return polls, values

    runs = {seed: schedule(seed) for seed in range(6)}
    assert schedule(3)[0] == runs[3][0], "a seed fixes the schedule"
    assert len({tuple(polls) for polls, _ in runs.values()}) > 1, "seeds interleave differently"
    for _, values in runs.values():
        assert torch.equal(values, _host(64) * 64)


def test_torch_sim_synchronize_runs_every_stream_of_the_device(dev):
    with deferred_streams(progress=0.0):
        a, b = torch.sim.Stream(dev), torch.sim.Stream(dev)
        x = _host().to(dev)
        outs = [torch.empty(6), torch.empty(6)]
        for s in (a, b):
            s.wait_stream(torch.sim.current_stream(dev))
        for s, out in zip((a, b), outs):
            with torch.sim.stream(s):
                out.copy_(x, non_blocking=True)
        torch.sim.synchronize(dev)
        assert all(torch.equal(out, _host()) for out in outs) and a.query() and b.query()


def test_stream_objects_are_torch_streams_and_events_torch_events(dev):
    side = torch.sim.Stream(dev)
    assert isinstance(side, torch.Stream) and side.device == dev
    assert isinstance(torch.sim.Event(), torch.Event)
    assert torch.get_device_module(dev).Stream is _sim_streams.SimStream
    with torch.sim.stream(side):
        assert torch.sim.current_stream(dev) == side
    assert torch.sim.current_stream(dev) == torch.sim.default_stream(dev)


def test_the_documented_recipe_catches_a_missing_wait(dev):
    """The example of optimshift.testing's docstring, with and without its wait."""

    def prefetch(host, device, wait=True):
        mod = torch.get_device_module(device)
        side = mod.Stream(device)
        with mod.stream(side):
            x = host.to(device, non_blocking=True)
        if wait:
            mod.current_stream(device).wait_stream(side)
        x.record_stream(mod.current_stream(device))
        return x

    for seed in range(4):
        with deferred_streams(seed=seed, progress=0.3):
            y = prefetch(torch.arange(4.0), dev) * 2
            assert torch.equal(y.cpu(), torch.arange(4.0) * 2)
    for seed in range(4):
        with pytest.raises(StreamRaceError):
            with deferred_streams(seed=seed, progress=0.3):
                prefetch(torch.arange(4.0), dev, wait=False) * 2


def test_threads_offloading_their_own_optimizers_are_each_tracked(sim):
    """While one thread ran queued work, the simulator's 'inside queued work' flag was one for the process: the
    other threads' ops skipped the stream bookkeeping and ran eagerly (record_stream failed on the CPU backend,
    copies escaped the race checks, values changed). The flag is per thread."""
    import threading

    import optimshift

    torch.manual_seed(0)
    models = [torch.nn.Linear(64, 64).to(sim) for _ in range(4)]
    opts = [torch.optim.Adam(m.parameters(), foreach=True) for m in models]
    for m, o in zip(models, opts):
        m(torch.randn(4, 64, device=sim)).sum().backward()
        o.step()
    before = [[(id(v), v.cpu().clone()) for st in o.state.values() for v in st.values()] for o in opts]
    errors: list[BaseException] = []

    def cycles(opt):
        try:
            for c in range(60):
                optimshift.offload(opt, non_blocking=c % 2 == 0, include=("grads",))
                optimshift.reload(opt, non_blocking=c % 2 == 1)
                optimshift.wait(opt)
        except BaseException as e:  # (reported below, in the test's thread)
            errors.append(e)

    with deferred_streams(seed=0, progress=0.5):  # (queued work run at random points: threads overlap it often)
        threads = [threading.Thread(target=cycles, args=(o,)) for o in opts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    for o, was in zip(opts, before):
        now = [v for st in o.state.values() for v in st.values()]
        assert [i for i, _ in was] == list(map(id, now))
        assert all(torch.equal(a, b.cpu()) for (_, a), b in zip(was, now))


def test_record_stream_takes_a_sim_stream_before_any_side_stream_exists_and_refuses_another(dev, monkeypatch):
    """``record_stream`` of the current stream works before any side stream was made (it reached the host
    kernel, which has none: NotImplementedError), and a stream of another device type is refused, as CUDA's
    ``record_stream`` takes only a CUDA stream (it was recorded and ignored)."""
    x = torch.ones(4, device=dev)
    monkeypatch.setattr(_sim_streams._state, "tracking", False)  # (as in a process that made no side stream)
    x.record_stream(torch.sim.current_stream())
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="record_stream needs a sim stream, got one of cpu"):
        x.record_stream(torch.Stream("cpu"))
    x.record_stream(torch.sim.Stream(dev))


def test_elapsed_time_is_measured_with_cudas_checks(dev):
    """``Event.elapsed_time`` gives milliseconds between two timing events that completed (it always raised),
    and refuses what CUDA refuses: events without ``enable_timing``, an unrecorded one, and work not yet
    complete (the missing synchronize CUDA reports as "device not ready")."""
    with deferred_streams(progress=0.0):
        start, end = torch.sim.Event(enable_timing=True), torch.sim.Event(enable_timing=True)
        with pytest.raises(RuntimeError, match="must be recorded"):
            start.elapsed_time(end)
        side = torch.sim.Stream(dev)
        with torch.sim.stream(side):
            start.record()
            torch.ones(8, device=dev).mul_(2)
            end.record()
        with pytest.raises(RuntimeError, match="device not ready"):
            start.elapsed_time(end)
        end.synchronize()
        assert start.elapsed_time(end) >= 0.0
        untimed = torch.sim.Event()
        untimed.record()
        with pytest.raises(RuntimeError, match="enable_timing=True"):
            start.elapsed_time(untimed)
