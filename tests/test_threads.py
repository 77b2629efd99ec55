"""Operations on one optimizer from several threads (found by a concurrency hunt): each test makes the
interleaving that broke deterministic, and fails on the code before its fix."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import optimshift
from optimshift import _device_streams, _engine, _streaming, api
from optimshift.testing import deferred_streams


def _adam(sim, n=2):
    params = [torch.nn.Parameter(torch.randn(64, device=sim)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(64, device=sim)
    opt = torch.optim.Adam(params)
    opt.step()
    return opt


def test_a_handle_finished_by_another_thread_mid_way_orders_nothing_twice(sim, monkeypatch):
    """order_before_use() (the step and state_dict pre-hooks) checked done(), then read the event again: a
    wait() in another thread in between left None there (TypeError from wait_event)."""
    opt = _adam(sim)
    optimshift.offload(opt)
    with deferred_streams(seed=0, progress=0.0):
        handle = optimshift.reload(opt, non_blocking=True)
        real = _device_streams.of

        def finished_meanwhile(device):
            handle.wait()  # (what another thread's wait() does at that moment)
            return real(device)

        monkeypatch.setattr(_device_streams, "of", finished_meanwhile)
        handle.order_before_use()
        monkeypatch.undo()
    assert handle.done()


def test_a_front_added_while_an_operation_reads_the_optimizers_attributes(sim):
    """unwrap() and the inner-optimizer warning iterate the optimizer's __dict__ while checking each value's class
    (Python code: another thread runs meanwhile), and another thread's offload adds and removes fronts there
    (zero_grad, __getstate__): RuntimeError, dictionary changed size during iteration."""
    opt = _adam(sim)

    class Adding:
        @property
        def __class__(self):
            opt.__dict__.setdefault("added_meanwhile", 1)  # (another thread's front)
            return Adding

    opt.tag = Adding()
    optimshift.move(opt, "cpu")
    assert optimshift.is_offloaded(opt) is False and "added_meanwhile" in opt.__dict__


def test_stream_and_an_offload_from_two_threads_take_turns(sim, monkeypatch):
    """stream() took no operation lock: an offload from another thread between its checks and its layout left
    the optimizer streamed and offloaded at once (step() and reload() both refused it)."""
    opt = _adam(sim)
    real = _streaming._check
    outcome: list[str] = []

    def offload_meanwhile(*args, **kwargs):
        checked = real(*args, **kwargs)

        def offload():
            try:
                optimshift.offload(opt)
                outcome.append("offloaded")
            except ValueError as e:
                outcome.append(str(e))

        other = threading.Thread(target=offload)
        other.start()
        other.join(0.5)  # (it waits for the stream: the lock)
        outcome.append("waited" if other.is_alive() else "ran")
        threads.append(other)
        return checked

    threads: list[threading.Thread] = []
    monkeypatch.setattr(_streaming, "_check", offload_meanwhile)
    optimshift.stream(opt)
    threads[0].join(10)
    assert outcome[0] == "waited" and "is streamed" in outcome[1]
    assert optimshift.is_streamed(opt) and not optimshift.is_offloaded(opt)
    optimshift.unstream(opt)


def test_the_collector_is_given_back_by_the_last_operation_out(sim):
    """Each operation paused the collector and gave back what it found: one that began while another ran
    found it paused, and the first to end turned it on under the other."""
    was = gc.isenabled()
    gc.enable()
    try:
        first, second = _engine.no_gc(), _engine.no_gc()
        first.__enter__()
        second.__enter__()  # (another thread's operation)
        first.__exit__(None, None, None)
        assert not gc.isenabled(), "the first out turned the collector on under the other"
        second.__exit__(None, None, None)
        assert gc.isenabled()
    finally:
        if not was:
            gc.disable()


def test_a_ctrl_c_inside_the_collectors_pause_leaves_it_as_it_was(sim, monkeypatch):
    """A Ctrl-C lands after any call returns: one right after no_gc's gc.disable() (its flags pushed, before its
    try) or right after its way out popped them (before gc.enable()) left the collector off, and every later
    operation found it off and kept it so: off for the rest of the process. Each call of the collector's, in
    turn, takes the interrupt; the next operation gives the collector back on."""
    import os
    import signal
    import types

    opt = _adam(sim)
    for k in range(1, 5):
        calls = [0]

        def interrupting(fn):
            def call(*args):
                out = fn(*args)
                calls[0] += 1
                if calls[0] == k:
                    os.kill(os.getpid(), signal.SIGINT)  # (delivered here, as it is once a call returns)
                return out

            return call

        fake = types.SimpleNamespace(**{n: interrupting(getattr(gc, n)) for n in ("isenabled", "enable", "disable")})
        assert gc.isenabled()
        monkeypatch.setattr(_engine, "gc", fake)
        try:
            optimshift.move(opt, sim)
        except KeyboardInterrupt:
            pass
        monkeypatch.undo()
        optimshift.move(opt, sim)
        assert gc.isenabled(), k
        assert not _engine._pausing


def test_a_state_dict_taken_while_another_thread_offloads_holds_the_values(sim):
    """state_dict()'s pre-hook waited for the transfer in flight when it began; an offload from another thread
    after that, before its compaction post-hook, had it copy host buffers not written yet (NaN on the simulator,
    stale pinned bytes on CUDA): a corrupt checkpoint, though the optimizer itself was fine."""
    import collections

    opt = _adam(sim, n=1)
    (p,) = opt.param_groups[0]["params"]
    expected = opt.state[p]["exp_avg"].cpu().clone()
    inside, go = threading.Event(), threading.Event()

    class Pausing(collections.defaultdict):  # (pauses state_dict() in thread A after its pre-hooks ran)
        def items(self):
            if threading.current_thread().name == "A" and not go.is_set():
                inside.set()
                go.wait(5)
            return super().items()

    opt.state = Pausing(dict, opt.state)
    out = {}
    with deferred_streams(seed=0, progress=0.0):
        taker = threading.Thread(target=lambda: out.setdefault("sd", opt.state_dict()), name="A")
        taker.start()
        inside.wait(5)
        handle = optimshift.offload(opt, non_blocking=True)
        go.set()
        taker.join(10)
        handle.wait()
    assert torch.equal(out["sd"]["state"][0]["exp_avg"], expected)


def test_a_state_dict_from_another_thread_waits_for_a_streamed_step(sim):
    """The streamed step took no lock and cuts the groups down to a chunk while it runs: a state_dict() from
    another thread meanwhile raised torch's KeyError (a param its groups did not list)."""
    opt = _adam(sim, n=4)
    mode = optimshift.stream(opt, chunk_bytes=600)  # (a chunk per param)
    raw = mode._raw
    inside, go = threading.Event(), threading.Event()
    calls: list[int] = []

    def pausing(optimizer, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # (inside the second chunk's step)
            inside.set()
            go.wait(5)
        return raw(optimizer, *args, **kwargs)

    mode._raw = pausing
    out: dict[str, object] = {}

    def take():
        try:
            out["sd"] = opt.state_dict()
        except Exception as e:
            out["error"] = e

    stepper = threading.Thread(target=opt.step)
    stepper.start()
    inside.wait(5)
    taker = threading.Thread(target=take)
    taker.start()
    taker.join(0.5)
    assert taker.is_alive(), "the state_dict() ran in the middle of the streamed step"
    go.set()
    stepper.join(10)
    taker.join(10)
    assert "error" not in out and len(out["sd"]["state"]) == 4
    optimshift.unstream(opt)


def test_a_streamed_optimizers_write_backs_are_waited_for_by_every_thread(sim):
    """Streamed.wait() forgot the write-backs' events before it waited for them: a state_dict() in another
    thread meanwhile found nothing to wait for and copied host chunks not written yet (NaN on the simulator)."""
    opt = _adam(sim)
    mode = optimshift.stream(opt, chunk_bytes=512)
    with deferred_streams(seed=0, progress=0.0):
        opt.step()
        inside, go = threading.Event(), threading.Event()

        class Slow:
            def __init__(self, event):
                self.event = event

            def synchronize(self):
                inside.set()
                go.wait(5)
                self.event.synchronize()

            def query(self):
                return self.event.query()

        mode._pending = {d: Slow(e) for d, e in mode._pending.items()}
        waiter = threading.Thread(target=mode.wait)
        waiter.start()
        inside.wait(5)
        taken = opt.state_dict()  # (its pre-hook waits: the events are still pending)
        go.set()
        waiter.join(10)
    assert not any(bool(torch.isnan(st["exp_avg"]).any()) for st in taken["state"].values())
    optimshift.unstream(opt)


def _two_blocks(block, look):
    """Thread A enters ``block()``, then B does; A leaves while B's body runs. What ``look()`` sees in B's body
    after A left, and after B left."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def a():
        with block():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b():
        a_in.wait(5)
        with block():
            b_in.set()
            a_out.wait(5)
            seen["inside"] = look()
        seen["after"] = look()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return seen


def test_offloaded_blocks_in_two_threads_reload_when_the_last_leaves(sim):
    """The second of two offloaded() blocks found the state offloaded and did nothing; the first, leaving while
    the second's body still ran, reloaded under it (the body met device state it meant to run without)."""
    opt = _adam(sim, n=1)
    (p,) = opt.param_groups[0]["params"]
    seen = _two_blocks(
        lambda: optimshift.offloaded(opt), lambda: (optimshift.is_offloaded(opt), opt.state[p]["exp_avg"].device.type)
    )
    assert seen == {"inside": (True, "cpu"), "after": (False, sim.type)}


def test_nested_offloaded_blocks_reload_once_at_the_outer_end(sim):
    opt = _adam(sim, n=1)
    with optimshift.offloaded(opt):
        with optimshift.offloaded(opt):
            pass
        assert optimshift.is_offloaded(opt)
    assert not optimshift.is_offloaded(opt)
    optimshift.offload(opt)  # (a user's own offload: a block inside it leaves it offloaded)
    with optimshift.offloaded(opt):
        pass
    assert optimshift.is_offloaded(opt)
    optimshift.reload(opt)


@pytest.mark.parametrize("block", ["offloaded", "streamed"])
def test_a_block_whose_begin_is_interrupted_once_on_ends_it_unless_another_block_holds_it(sim, monkeypatch, block):
    """A Ctrl-C that an ``offloaded``/``streamed`` block's offload (stream) held, raised once the mode is on: the
    block is never entered, and the mode is ended, but not under another ``offloaded`` block that made it (an explicit
    reload inside that one let this one offload again)."""
    module, name, on = (
        (api, "offload", optimshift.is_offloaded)
        if block == "offloaded"
        else (_streaming, "stream", optimshift.is_streamed)
    )
    begin, end = getattr(module, name), getattr(optimshift, "reload" if block == "offloaded" else "unstream")

    def interrupted(*args, **kwargs):
        begin(*args, **kwargs)
        raise KeyboardInterrupt

    opt = _adam(sim, n=1)
    monkeypatch.setattr(module, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        with getattr(optimshift, block)(opt):
            pytest.fail("the block was entered")
    assert not on(opt)
    monkeypatch.setattr(module, name, begin)
    with getattr(optimshift, block)(opt):
        end(opt)  # (the outer block still counts itself)
        monkeypatch.setattr(module, name, interrupted)
        with pytest.raises(KeyboardInterrupt):
            with getattr(optimshift, block)(opt):
                pytest.fail("the block was entered")
        # (offloaded: the outer block's count keeps it on; streamed: counted on the mode the unstream inside ended)
        assert on(opt) == (block == "offloaded")
    assert not on(opt)


def test_streamed_blocks_in_two_threads_unstream_when_the_last_leaves(sim):
    """As offloaded(): the second streamed() block did nothing, and the first out unstreamed under its body."""
    opt = _adam(sim, n=1)
    seen = _two_blocks(lambda: optimshift.streamed(opt), lambda: optimshift.is_streamed(opt))
    assert seen == {"inside": True, "after": False}
    optimshift.stream(opt)  # (a user's own stream: a block inside it leaves it streamed)
    with optimshift.streamed(opt):
        pass
    assert optimshift.is_streamed(opt)
    optimshift.unstream(opt)


def test_no_operation_of_another_thread_runs_between_keep_addresses_offload_and_reload(monkeypatch):
    """keep_addresses is one operation: an offload another thread asks for meanwhile waits for it, and runs last
    (it ran between the two and was undone by keep_addresses' reload: that thread's offload returned, yet the state
    ended on the device)."""
    from optimshift import api
    from optimshift.testing import simulated_accelerator

    sim = simulated_accelerator()
    model = torch.nn.Linear(4, 4).to(sim)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4, device=sim)).sum().backward()
    opt.step()
    real_offload = api.offload
    other: list[BaseException] = []

    def offload_then_another_thread(optimizer, **kwargs):
        out = real_offload(optimizer, **kwargs)
        monkeypatch.setattr(api, "offload", real_offload)

        def offload_there():
            try:
                optimshift.offload(opt)
            except BaseException as error:
                other.append(error)

        thread = threading.Thread(target=offload_there)
        thread.start()
        thread.join(timeout=1.0)  # (it waits for the lock: keep_addresses goes on)
        threads.append(thread)
        return out

    threads: list[threading.Thread] = []
    monkeypatch.setattr(api, "offload", offload_then_another_thread)
    optimshift.keep_addresses(opt)
    threads[0].join()
    assert other == []
    assert optimshift.is_offloaded(opt), "the other thread's offload ran last: the state is offloaded"
    assert all(t.is_cpu for st in opt.state.values() for t in st.values())
    optimshift.reload(opt)


class _Lookahead(torch.optim.Optimizer):
    """A Lookahead-style wrapper: the inner optimizer's param groups, a state of its own (none here)."""

    def __init__(self, inner):
        self.optimizer = inner
        super().__init__([p for g in inner.param_groups for p in g["params"]], {})
        self.param_groups = inner.param_groups

    def step(self, closure=None):
        self.optimizer.step()


def test_an_offload_of_the_inner_optimizer_from_another_thread_waits_for_the_wrappers_rebind(sim, monkeypatch):
    """rebind of a wrapper re-keys the state of the optimizer it holds over its groups, refused while that one is
    offloaded, but took only the wrapper's lock: an offload of the inner optimizer from another thread between the
    checks and the commit left it offloaded with its state re-keyed under the record, as the refusal guards against."""
    wrapper = _Lookahead(_adam(sim))
    inner, real = wrapper.optimizer, api._rekeys
    new = [torch.nn.Parameter(p.detach().clone()) for p in inner.param_groups[0]["params"]]
    outcome: list[str] = []

    def offload_meanwhile(*args, **kwargs):
        monkeypatch.setattr(api, "_rekeys", real)
        other = threading.Thread(target=optimshift.offload, args=(inner,))
        other.start()
        other.join(0.5)  # (it waits for the rebind: the inner optimizer's lock)
        outcome.append("waited" if other.is_alive() else "ran")
        threads.append(other)
        return real(*args, **kwargs)

    threads: list[threading.Thread] = []
    monkeypatch.setattr(api, "_rekeys", offload_meanwhile)
    with pytest.warns(RuntimeWarning, match=r"optimshift\.rebind on it"):
        optimshift.rebind(wrapper, new)
    threads[0].join(10)
    assert outcome == ["waited"] and optimshift.is_offloaded(inner)
    optimshift.reload(inner)
    assert list(inner.state) == new and optimshift.check(inner).ok
