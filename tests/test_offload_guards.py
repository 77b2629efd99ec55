"""What offload guards while the state is away: no step, compact state_dicts, one operation at a time, and
no move to a device that holds no data."""

import contextlib
import io
import struct
import threading
import time

import pytest
import torch

import optimshift
from _matrix import Model, as_it_is, assert_as_it_was, bitwise_equal, snapshot, state_layout, train
from optimshift.pool import host_pool


def _adam(sim, shapes=((3, 2), (2,)), **kw):
    model = Model(list(shapes)).to(sim)
    opt = torch.optim.Adam(model.parameters(), **kw)
    train(model, opt, range(1))
    return model, opt


@pytest.mark.parametrize("kwargs", [{"foreach": False}, {"foreach": True}, {"fused": True}])
def test_step_while_offloaded_refuses_before_any_counter_moves(sim, kwargs):
    model, opt = _adam(sim, **kwargs)
    optimshift.offload(opt)
    before = snapshot([dict(st) for st in opt.state.values()])
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=r"Adam.step\(\) while its state is offloaded.*optimshift.reload"):
        opt.step()
    assert bitwise_equal([dict(st) for st in opt.state.values()], before), "no step counter moved"
    optimshift.reload(opt)
    opt.step()  # the guard went with the reload


def test_offloading_a_host_optimizer_does_not_block_its_step():
    params = [torch.nn.Parameter(torch.zeros(3))]
    opt = torch.optim.Adam(params)
    params[0].grad = torch.ones(3)
    opt.step()
    optimshift.offload(opt)  # everything already on the host: nothing was taken away
    opt.step()


def test_state_dict_while_offloaded_is_compact_and_holds_no_other_bytes(sim, tmp_path):
    host_pool.release_idle()
    _, big = _adam(sim, shapes=[(256, 256)] * 4)
    optimshift.offload(big)  # fills a pool buffer
    optimshift.reload(big)  # ... and gives it back
    marker = torch.full((256, 256), 12345.0)
    for st in big.state.values():
        st["exp_avg"].copy_(marker.to(sim))
    optimshift.offload(big)
    optimshift.reload(big)  # the idle buffer now holds the marker bytes
    model, small = _adam(sim, shapes=[(2, 2), (2,)])
    plain = io.BytesIO()
    torch.save(small.state_dict(), plain)
    optimshift.offload(small)  # its host copies are views into the (1 MiB) buffer that held the marker
    for i, save in enumerate((lambda f: torch.save(small.state_dict(), f), lambda f: optimshift.save(small, f))):
        path = tmp_path / f"offloaded-{i}.pt"
        save(path)
        data = path.read_bytes()
        limit = len(plain.getvalue()) * 1.01 + (1024 if i else 0)  # optimshift.save adds the class record
        assert len(data) <= limit, (len(data), len(plain.getvalue()))
        assert struct.pack("<f", 12345.0) * 4 not in data, "the bytes of another optimizer's state leaked in"
    live = [dict(st) for st in small.state.values()]
    assert all(v.untyped_storage().nbytes() >= 1 << 20 for st in live for k, v in st.items() if k != "step"), (
        "the live state still sits in the pool (only the state_dict is compact)"
    )
    optimshift.reload(small)
    assert state_layout(small)


def test_operations_from_two_threads_never_interleave(sim, monkeypatch):
    """An offload paused mid-copy in one thread, and a reload issued meanwhile from another: the reload waits
    for the offload to finish (then undoes it), instead of running in the middle and being overwritten."""
    from optimshift import _engine as engine

    model, opt = _adam(sim)
    layout = state_layout(opt)
    reload_started = threading.Event()
    real_run = engine.run

    def slow_run(*args, **kwargs):
        if threading.current_thread().name == "offloader":
            reload_started.wait(timeout=2)  # let the other thread try its reload in the middle
            time.sleep(0.2)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(engine, "run", slow_run)
    done = []
    offloader = threading.Thread(target=lambda: done.append(("offload", optimshift.offload(opt))), name="offloader")
    offloader.start()

    def reloader():
        reload_started.set()
        optimshift.reload(opt)
        done.append(("reload", None))

    second = threading.Thread(target=reloader)
    second.start()
    offloader.join(5)
    second.join(5)
    assert [what for what, _ in done] == ["offload", "reload"], "the reload ran in the middle of the offload"
    assert not optimshift.is_offloaded(opt) and state_layout(opt) == layout
    train(model, opt, range(1, 2))


@pytest.mark.parametrize("device", ["meta", torch.device("meta")])
def test_meta_is_refused(sim, device):
    _, opt = _adam(sim)
    with pytest.raises(ValueError, match="meta holds no data"):
        optimshift.move(opt, device)
    with pytest.raises(ValueError, match="meta holds no data"):
        optimshift.reload(opt, device)


def _to_meta(params):
    """``model.to("meta")`` keeping the param objects (as under ``set_swap_module_params_on_conversion``)."""
    for p in params:
        torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty_like(p, device="meta")))


@pytest.mark.parametrize("road", ["move", "reload", "rebind", "move, an offloaded grad"])
def test_state_that_would_follow_its_param_to_meta_is_refused_as_a_move_there_is(sim, road):
    """``model.to("meta")`` and then ``move(opt)`` (or a reload, or a rebind onto meta params): the state followed
    its params to meta and every value was lost, where ``move(opt, "meta")`` is refused. Refused the same way,
    naming the entry; nothing changes."""
    model, opt = _adam(sim)
    params = list(model.parameters())
    if road == "move, an offloaded grad":
        opt = torch.optim.Adam(params)  # (no state: the grad is all that would be lost)
        optimshift.offload(opt, include=("grads",))
    elif road == "reload":
        optimshift.offload(opt)
    layout, values = state_layout(opt), snapshot([dict(st) for st in opt.state.values()])
    new = [torch.nn.Parameter(torch.empty_like(p, device="meta")) for p in params]
    if road != "rebind":
        _to_meta(params)
    with pytest.raises(ValueError) as raised:
        if road == "rebind":
            optimshift.rebind(opt, new)
        elif road == "reload":
            optimshift.reload(opt)
        else:
            optimshift.move(opt)
    message = str(raised.value)
    entry = "group 0, param 0, state['exp_avg']"
    if road.endswith("grad"):
        entry = "the offloaded .grad of group 0, param 0 (on cpu)"
    assert message.startswith(f"Adam: {road.split(',')[0]}: {entry}"), message
    assert "follows its param, whose device meta holds no data: optimizer state moved there would lose" in message
    assert state_layout(opt) == layout and bitwise_equal([dict(st) for st in opt.state.values()], values)
    assert optimshift.is_offloaded(opt) == (road != "move" and road != "rebind")
    assert opt.param_groups[0]["params"] == params


@pytest.mark.parametrize("where", ["an entry", "params and state"])
def test_state_on_meta_stays_there_in_an_offload_and_a_move_that_needs_its_values_is_refused(sim, where):
    """A state entry on meta (left there while its param is on the device), or params and state on meta (a model
    built on meta): offload raised torch's "Cannot copy out of meta tensor; no data!", naming nothing. Meta holds
    no memory to free and no values to take: an offload leaves such a tensor where it is, the same object, and the
    reload leaves it there; a move that would take it to a device with storage is refused, naming the entry, with
    nothing changed."""
    if where == "an entry":
        model, opt = _adam(sim)
        param = next(iter(model.parameters()))
        opt.state[param]["exp_avg"] = meta = torch.zeros_like(param, device="meta")
    else:
        param = torch.nn.Parameter(torch.ones(3, device="meta"))
        param.grad = torch.ones(3, device="meta")
        opt = torch.optim.Adam([param])
        opt.step()
        meta = opt.state[param]["exp_avg"]
    layout = state_layout(opt)
    for _ in range(2):
        optimshift.offload(opt, include=("grads",))
        assert opt.state[param]["exp_avg"] is meta and meta.is_meta
        devices = {str(t.device) for st in opt.state.values() for t in st.values()}
        assert devices <= {"cpu", "meta"}
        optimshift.reload(opt)
        assert state_layout(opt) == layout and opt.state[param]["exp_avg"] is meta
    assert param.grad is not None and param.grad.device == param.device

    def real():  # (a meta tensor has no values to compare)
        return [{k: v for k, v in st.items() if not v.is_meta} for st in opt.state.values()]

    values = snapshot(real())
    for road, target in [("move", "cpu"), ("move", sim), ("move", None), ("reload", sim)]:
        if road == "move" and target is None and where != "an entry":
            continue  # (params on meta: their state is where it belongs already)
        with pytest.raises(ValueError) as raised:
            getattr(optimshift, road)(opt, target)
        expected = torch.device("cpu") if target == "cpu" else sim
        assert str(raised.value).startswith(
            f"Adam: move: group 0, param 0, state['exp_avg']{'' if where == 'an entry' else ' (and 1 more)'} is on "
            f"meta, which holds no data: it has no values to take to {expected}"
        ), str(raised.value)
        assert state_layout(opt) == layout and bitwise_equal(real(), values)
        assert opt.state[param]["exp_avg"] is meta and not optimshift.is_offloaded(opt)


def test_a_wrapper_and_its_optimizer_share_one_lock(sim, monkeypatch):
    """move() given a delegating wrapper (Lightning's, Accelerate's) locks the optimizer it wraps, as
    load_state_dict does, so the two never interleave."""
    import optimshift.api as api

    _, opt = _adam(sim)

    class Wrapper:
        def __init__(self, inner):
            self.optimizer, self.param_groups, self.state = inner, inner.param_groups, inner.state

    keys = []
    real = api.exclusive
    monkeypatch.setattr(api, "exclusive", lambda o: keys.append(o) or real(o))
    optimshift.move(Wrapper(opt))
    assert keys == [opt]


def _interrupt_after(monkeypatch, owner, name, calls=1):
    """A real SIGINT right after ``owner.name`` returns for the ``calls``-th time (a Ctrl-C landing there)."""
    import os
    import signal

    real, count = getattr(owner, name), [0]

    def wrapped(*args, **kwargs):
        out = real(*args, **kwargs)
        count[0] += 1
        if count[0] == calls:
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(owner, name, wrapped)


def test_a_ctrl_c_inside_keep_addresses_is_held_until_the_state_is_back(sim, monkeypatch):
    """keep_addresses(opt) is an offload and a reload: a Ctrl-C between them left the optimizer offloaded (its
    rollback caught Exception only) and the next step refused. It is one operation now: the interrupt comes once
    the state is laid out."""
    from optimshift import _addresses

    model = Model([(4, 3), (3,)]).to(sim)
    opt = torch.optim.Adam(model.parameters())
    train(model, opt, range(1))
    layout = state_layout(opt)
    _interrupt_after(monkeypatch, _addresses, "stage")
    with pytest.raises(KeyboardInterrupt):
        optimshift.keep_addresses(opt)
    assert not optimshift.is_offloaded(opt) and state_layout(opt) == layout
    train(model, opt, range(1, 2))


@pytest.mark.parametrize("after", ["registered_first", "copy_guard"])
def test_a_ctrl_c_while_the_offload_guards_are_installed_leaves_none(sim, monkeypatch, after):
    """An offload registers its guards (a step pre-hook that refuses a step, moved first; a state_dict post-hook;
    a __getstate__ front) before it copies, and removes them if it fails: a Ctrl-C landing in the registration
    (once the pre-hook was moved first, or the front put in place) left them on an optimizer not offloaded, where
    nothing removed them. It is raised once the offload holds them, and they go."""
    from optimshift import _offload

    _, opt = _adam(sim)
    hooks = (dict(opt._optimizer_step_pre_hooks), dict(opt._optimizer_state_dict_post_hooks))
    _interrupt_after(monkeypatch, _offload, after)
    with pytest.raises(KeyboardInterrupt):
        optimshift.offload(opt)
    monkeypatch.undo()
    assert not optimshift.is_offloaded(opt)
    assert (dict(opt._optimizer_step_pre_hooks), dict(opt._optimizer_state_dict_post_hooks)) == hooks
    assert "__getstate__" not in vars(opt)
    optimshift.offload(opt)
    optimshift.reload(opt)
    assert (dict(opt._optimizer_step_pre_hooks), dict(opt._optimizer_state_dict_post_hooks)) == hooks


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_offload_whose_zero_grad_front_fails_leaves_the_optimizer_as_it_was(sim, monkeypatch, error):
    """offload(include=("grads",)) put its zero_grad front in place once the state and grads were committed on the
    host: one failing there raised with no record kept (a reload gave nothing back: the grads were lost). It is
    installed with the other guards, before anything is copied, and removed with them."""
    from optimshift import _offload

    model, opt = _adam(sim)
    assert all(p.grad is not None for p in model.parameters())
    before = as_it_is(opt)

    class Failing(_offload.Front):
        def __init__(self, optimizer, name, front):
            if name == "zero_grad":
                raise error("injected")
            super().__init__(optimizer, name, front)

    monkeypatch.setattr(_offload, "Front", Failing)
    with pytest.raises(TypeError if error is RuntimeError else error) as raised:
        optimshift.offload(opt, include=("grads",))
    monkeypatch.undo()
    assert "injected" in str(raised.value) + str(raised.value.__cause__)
    assert not optimshift.is_offloaded(opt)
    assert_as_it_was(opt, before)
    optimshift.offload(opt, include=("grads",))
    opt.zero_grad()  # (through the front: the offloaded grads go too)
    optimshift.reload(opt)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_non_blocking_offload_whose_waiting_hooks_fail_is_offloaded_and_waited_for(sim, monkeypatch, error):
    """A non-blocking offload registers the hooks that wait for its copies once they are committed: a failure
    there raised an error for an offload that had happened, its transfer unguarded. The copies are waited for
    instead: the offload stands, complete (a Ctrl-C is raised once it is), and reloads as it was."""
    from optimshift import _offload, _session
    from optimshift.testing import deferred_streams

    model, opt = _adam(sim)
    before = as_it_is(opt)
    real = _offload.install_guards

    def failing(optimizer, pre, wait, *, compact):
        if not compact:  # (the waiting hooks: the offload's own guards are compact)
            raise error("injected")
        return real(optimizer, pre, wait, compact=compact)

    with deferred_streams(seed=0, progress=0.0):  # (its copies still queued once committed)
        monkeypatch.setattr(_offload, "install_guards", failing)
        if error is KeyboardInterrupt:
            with pytest.raises(KeyboardInterrupt, match="injected"):
                optimshift.offload(opt, non_blocking=True)
        else:
            assert optimshift.offload(opt, non_blocking=True).done()
        monkeypatch.undo()
        session = _session.of(opt)
        assert optimshift.is_offloaded(opt) and session.pending is None and not session.guards
        assert {d.type for d in state_layout(opt).values()} == {"cpu"}
        optimshift.reload(opt)
    assert_as_it_was(opt, before)
    train(model, opt, range(1, 2))


@pytest.mark.parametrize("block", ["offloaded", "streamed"])
@pytest.mark.parametrize("after", ["adopt", "operation"])
def test_a_ctrl_c_entering_a_block_leaves_the_state_where_it_was(sim, monkeypatch, block, after):
    """offloaded() offloads, streamed() streams, then each enters its block: a Ctrl-C in that operation's commit
    (held until the operation is in place) or right after it raised before the block was entered, so its exit
    never undid it: the optimizer stayed offloaded (the next step refused) or streamed. It is undone before the
    interrupt propagates."""
    from optimshift import _engine, _session, _streaming, api

    model, opt = _adam(sim)
    layout = state_layout(opt)
    hooks = (dict(opt._optimizer_step_pre_hooks), dict(opt._optimizer_state_dict_post_hooks))
    owner, name = (
        (_engine, "adopt") if after == "adopt" else (api, "offload") if block == "offloaded" else (_streaming, "stream")
    )
    _interrupt_after(monkeypatch, owner, name)
    entered = []
    with pytest.raises(KeyboardInterrupt):
        with getattr(optimshift, block)(opt):
            entered.append(True)
    monkeypatch.undo()
    assert not entered and not optimshift.is_offloaded(opt) and not optimshift.is_streamed(opt)
    assert state_layout(opt) == layout
    assert (dict(opt._optimizer_step_pre_hooks), dict(opt._optimizer_state_dict_post_hooks)) == hooks
    assert "__getstate__" not in vars(opt) and _session.get(opt).offloaded_in == 0
    train(model, opt, range(1, 2))


@pytest.mark.parametrize("how", ["sigint", "RuntimeError", "KeyboardInterrupt"])
@pytest.mark.parametrize("at", ["on", "count"])
@pytest.mark.parametrize("block", ["offloaded", "streamed"])
def test_an_interrupt_between_a_blocks_operation_and_its_body_leaves_the_optimizer_as_it_was(
    sim, monkeypatch, block, at, how
):
    """offloaded()/streamed() asked whether the mode was on, then counted the block, after its operation and before
    the try whose exit undoes it: a Ctrl-C landing there (right after either), or either failing, left the optimizer
    offloaded or streamed for good, its block never entered (counted: later blocks took it for theirs). It is
    undone before the error propagates."""
    import os
    import signal

    from optimshift import _streaming, api

    model, opt = _adam(sim)
    before = as_it_is(opt)
    owner, name, calls = {
        "on": (api, "is_offloaded", 2) if block == "offloaded" else (_streaming, "_mode_of", 2),  # (2: after it)
        "count": (api, "setattr", 1),  # (api's builtin: its first call counts the block)
    }[at]
    real, count = getattr(owner, name, setattr), [0]

    def wrapped(*args, **kwargs):
        count[0] += 1
        if count[0] == calls and how != "sigint":  # (the call fails)
            raise {"RuntimeError": RuntimeError, "KeyboardInterrupt": KeyboardInterrupt}[how]("injected")
        out = real(*args, **kwargs)
        if count[0] == calls:
            os.kill(os.getpid(), signal.SIGINT)  # (a real Ctrl-C, landing once the call returned)
        return out

    monkeypatch.setattr(owner, name, wrapped, raising=False)
    entered = []
    with pytest.raises(RuntimeError if how == "RuntimeError" else KeyboardInterrupt):
        with getattr(optimshift, block)(opt):
            entered.append(True)
    monkeypatch.undo()
    assert not entered and count[0] >= calls
    assert_as_it_was(opt, before)
    with getattr(optimshift, block)(opt):
        assert optimshift.is_offloaded(opt) or optimshift.is_streamed(opt)
    assert_as_it_was(opt, before)
    train(model, opt, range(1, 2))


@pytest.mark.parametrize("block", ["offloaded", "streamed"])
def test_a_ctrl_c_at_a_blocks_exit_leaves_it_uncounted_and_the_mode_ended(sim, monkeypatch, block):
    """A Ctrl-C landing at an offloaded()/streamed() block's exit, before it was uncounted (once the lock was taken,
    or while waiting for it), left it counted for good: the mode stayed on, and no later block was ever the last out
    (an offloaded() block's count outlives a reload by hand). It is raised once the block is out and the mode ended."""
    import os
    import signal

    from optimshift import _session, _streaming, api

    model, opt = _adam(sim)
    before = as_it_is(opt)
    real, armed = api.exclusive, [False]

    @contextlib.contextmanager
    def exclusive(optimizer):
        with real(optimizer):
            if armed[0]:  # (the exit's: a real Ctrl-C, landing once the lock is taken)
                armed[0] = False
                os.kill(os.getpid(), signal.SIGINT)
            yield

    monkeypatch.setattr(api, "exclusive", exclusive)
    with pytest.raises(KeyboardInterrupt):
        with getattr(optimshift, block)(opt):
            armed[0] = True
    monkeypatch.undo()
    mode = _streaming._mode_of(opt)
    assert (_session.of(opt).offloaded_in, 0 if mode is None else mode.blocks) == (0, 0)
    assert not optimshift.is_offloaded(opt) and not optimshift.is_streamed(opt)
    assert_as_it_was(opt, before)
    with getattr(optimshift, block)(opt):
        assert optimshift.is_offloaded(opt) or optimshift.is_streamed(opt)
    assert not optimshift.is_offloaded(opt) and not optimshift.is_streamed(opt)
    train(model, opt, range(1, 2))


def test_a_ctrl_c_inside_a_streamed_step_is_held_until_its_chunks_are_written_back(sim, monkeypatch):
    """A Ctrl-C between a chunk's step and its write-back kept the chunk's old moments (the params moved, the
    moments did not: a silent divergence), or left an entry on its device window. It comes once the step is done,
    its state as a step without it leaves it."""
    from optimshift import _engine

    def trained():
        model = Model([(4, 3), (3,), (2, 2)]).to(sim)
        opt = torch.optim.Adam(model.parameters(), foreach=False)
        train(model, opt, range(1))
        return model, opt

    ref_model, ref = trained()
    train(ref_model, ref, range(1, 2))
    model, opt = trained()
    optimshift.stream(opt, chunk_bytes=64)
    _interrupt_after(monkeypatch, _engine, "adopt", calls=2)
    with pytest.raises(KeyboardInterrupt):
        train(model, opt, range(1, 2))
    monkeypatch.undo()
    optimshift.unstream(opt)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert bitwise_equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            assert bitwise_equal(opt.state[p][key], ref.state[q][key]), key


def test_stream_refuses_an_optimizer_it_cannot_remember_before_changing_it(sim):
    """stream() of an optimizer class that defines __eq__ (unhashable) moved the state to the host and installed
    its step, then failed: half streamed, and unstream() could not undo it."""

    class Comparable(torch.optim.Adam):
        def __eq__(self, other):
            return self is other

    model = Model([(4, 3)]).to(sim)
    opt = Comparable(model.parameters())
    train(model, opt, range(1))
    layout = state_layout(opt)
    with pytest.raises(TypeError, match="stream needs an optimizer it can remember weakly"):
        optimshift.stream(opt)
    assert state_layout(opt) == layout and "step" not in opt.__dict__


def test_a_zero_grad_that_raises_keeps_the_offloaded_grads(sim):
    """With grads offloaded, opt.zero_grad(set_to_None=False) (a typo) raised as torch's does, but had already
    dropped the offloaded grads: the reload gave none back."""
    model = Model([(4, 3)]).to(sim)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt, range(1))
    (p,) = model.parameters()
    grad = p.grad.clone()
    optimshift.offload(opt, include=("grads",))
    with pytest.raises(TypeError):
        opt.zero_grad(set_to_None=False)
    optimshift.reload(opt)
    assert p.grad is not None and bitwise_equal(p.grad, grad)


def test_a_ctrl_c_in_a_streamed_steps_closure_interrupts_it_at_once(sim):
    """Holding a Ctrl-C for the whole streamed step held it through the closure too (a forward and backward, or a
    stuck data fetch): the step ran to its end and updated the params first. Nothing is streamed while the closure
    runs: it stays interruptible, and nothing is updated."""
    import os
    import signal
    import threading
    import time

    model = Model([(4, 3)]).to(sim)
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    train(model, opt, range(1))
    optimshift.stream(opt)
    (p,) = model.parameters()
    before = p.detach().cpu().clone()

    def closure():
        p.grad = torch.ones_like(p)
        end = time.monotonic() + 10
        while time.monotonic() < end:  # (a Python loop: where a signal is delivered)
            time.sleep(0.01)
        return torch.zeros(())

    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        opt.step(closure)
    timer.join()
    assert time.monotonic() - start < 5 and bitwise_equal(p.detach().cpu(), before)
    optimshift.unstream(opt)
