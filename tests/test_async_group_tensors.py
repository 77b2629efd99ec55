"""A device tensor ``lr`` under a non-blocking transfer: an LR scheduler that steps between the transfer and the
optimizer's step (``sched.step()`` writes ``group["lr"]`` in place, from the host) sees it complete.

The param groups' tensors (hyperparameters) are copied before the operation returns, on the current stream, or
waited for on the host where they land in host memory; the per-param state keeps the side stream. On the
simulated accelerator's deferred streams, under several seeds and the strict schedule, bitwise against the
blocking path."""

import pytest
import torch

import optimshift
from _matrix import Model, bitwise_equal, grad_for
from _schedules import SCHEDULES, drain_queued  # noqa: F401  (drain_queued: an autouse fixture)
from optimshift import _offload
from optimshift.testing import deferred_streams

SHAPES = [(3, 2), (4,), (2, 5), (1,)]

# (a device lr stays on the device for both: each step reads it there)
DEVICE_LR = [
    pytest.param(torch.optim.Adam, {"capturable": True, "foreach": True}, id="Adam-capturable"),
    pytest.param(torch.optim.AdamW, {"fused": True}, id="AdamW-fused"),
]
# the non-blocking transfer the scheduler steps after: each leg of a round trip (the other leg blocking)
# (and a reload into kept addresses: each copy into its slot)
TRANSFERS = ["offload", "reload", "move to the host", "move to the device", "reload at kept addresses"]


def _setup(sim, cls, kwargs):
    model = Model(SHAPES).to(sim)
    opt = cls(list(model.parameters()), lr=torch.tensor(0.01, device=sim), **kwargs)
    # (every scheduler step reads group["lr"] and writes it in place: fill_)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _steps(model, opt, sched, range(2))
    assert opt.param_groups[0]["lr"].device == sim
    return model, opt, sched


def _steps(model, opt, sched, steps):
    params = [h.weight for h in model.parts]
    for k in steps:
        for i, p in enumerate(params):
            p.grad = grad_for(k, i, p.shape).to(p.device)
        opt.step()
        sched.step()


def _round_trip(sim, opt, sched, transfer, non_blocking, strict=False):
    """Away and back, ``transfer`` the leg that is non-blocking (when ``non_blocking``) and followed by a
    scheduler step while its copies are in flight."""
    keep = transfer == "reload at kept addresses"
    away, back = (
        (lambda **kw: optimshift.move(opt, "cpu", **kw), lambda **kw: optimshift.move(opt, sim, **kw))
        if transfer.startswith("move")
        else (
            lambda **kw: optimshift.offload(opt, keep_addresses=keep, **kw),
            lambda **kw: optimshift.reload(opt, **kw),
        )
    )
    first = transfer in ("offload", "move to the host")
    away(non_blocking=non_blocking and first)
    if first:
        sched.step()  # (with the state away: the lr on the host)
        # (a move to the host is complete when it returns: its copies are host tensors of their own)
        in_flight = strict and transfer == "offload"
        assert not (in_flight and _offload.pending_of(opt).done()), "the state's copies are in flight"
    back(non_blocking=non_blocking and not first)
    if not first:
        sched.step()
        assert not (strict and _offload.pending_of(opt).done()), "the state's copies are in flight"


def scheduler_between(sim, cls, kwargs, transfer, *, strict=True):
    """A scheduler step right after a non-blocking transfer, then on with training: bitwise like the blocking
    path, the lr the same object on the device."""
    # NOTE: the blocking reference runs first: its synchronizations would order the transfers under test.
    ref_model, ref, ref_sched = _setup(sim, cls, kwargs)
    _round_trip(sim, ref, ref_sched, transfer, non_blocking=False)
    _steps(ref_model, ref, ref_sched, range(2, 4))
    model, opt, sched = _setup(sim, cls, kwargs)
    lr = opt.param_groups[0]["lr"]
    _round_trip(sim, opt, sched, transfer, non_blocking=True, strict=strict)
    _steps(model, opt, sched, range(2, 4))
    assert opt.param_groups[0]["lr"] is lr and lr.device == sim
    assert bitwise_equal(lr, ref.param_groups[0]["lr"])
    assert sched.get_last_lr() == ref_sched.get_last_lr()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert bitwise_equal(a, b)
    for st, st_ref in zip(opt.state.values(), ref.state.values()):
        assert bitwise_equal(dict(st), dict(st_ref))


@pytest.mark.parametrize("seed, progress", SCHEDULES)
@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("cls, kwargs", DEVICE_LR)
def test_a_scheduler_step_after_a_non_blocking_transfer_sees_its_lr(sim, cls, kwargs, transfer, seed, progress):
    with deferred_streams(seed=seed, progress=progress):
        scheduler_between(sim, cls, kwargs, transfer, strict=progress == 0.0)


@pytest.mark.parametrize("cls, kwargs", DEVICE_LR)
def test_only_a_group_tensor_bound_for_the_host_costs_a_host_wait(sim, cls, kwargs, monkeypatch):
    """A reload's group tensors are ordered on the current stream (the host does not wait); an offload's land in
    host memory, which the host may write at once: it waits for them, once, before the state's copies are
    queued (they stay in flight)."""
    from optimshift import _device_streams

    waits = []
    streams = type(_device_streams.of(sim))
    real = streams.synchronize
    monkeypatch.setattr(streams, "synchronize", lambda self, device: (waits.append(device), real(self, device)))
    with deferred_streams(progress=0.0):
        model, opt, sched = _setup(sim, cls, kwargs)
        waits.clear()
        handle = optimshift.offload(opt, non_blocking=True)
        assert waits == [sim] and not handle.done()
        sched.step()
        waits.clear()
        handle = optimshift.reload(opt, non_blocking=True)  # (ends the offload's transfer on the host first)
        assert waits == [] and not handle.done()
        sched.step()
        _steps(model, opt, sched, range(2, 3))
        assert handle.done()


@pytest.mark.parametrize("seed, progress", SCHEDULES)
def test_lbfgs_device_lr_shared_with_its_state_is_complete_after_a_non_blocking_reload(sim, seed, progress):
    """LBFGS keeps state['t'] = group['lr'] (one tensor, listed with the state before the group): it is the
    group's, copied before the reload returns."""

    def run(non_blocking):
        params = [torch.nn.Parameter(grad_for(0, i, (3,)).to(sim)) for i in range(2)]
        opt = torch.optim.LBFGS(params, lr=torch.tensor(0.5, device=sim))

        def closure():
            opt.zero_grad()
            loss = sum(((p - 1) ** 2).sum() for p in params)
            loss.backward()
            return loss

        opt.step(closure)
        lr = opt.param_groups[0]["lr"]
        assert opt.state[params[0]]["t"] is lr and lr.device == sim
        optimshift.offload(opt)
        handle = optimshift.reload(opt, non_blocking=non_blocking)
        assert not (non_blocking and progress == 0.0 and handle.done()), "the state's copies are in flight"
        lr.mul_(0.5)  # (what a scheduler does)
        opt.step(closure)
        assert opt.state[params[0]]["t"] is lr
        return params

    with deferred_streams(seed=seed, progress=progress):
        ref = run(False)
        params = run(True)
        assert all(bitwise_equal(p, q) for p, q in zip(params, ref))


class _Buffered(torch.optim.Optimizer):
    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                if not st:
                    st["buf"] = torch.zeros_like(p)
                st["buf"].add_(p.grad)
                p.sub_(st["buf"] * g["lr"])


@pytest.mark.parametrize("seed, progress", [(0, 0.0), (1, 0.05)])
def test_a_slotted_lr_is_complete_when_another_group_tensor_shares_a_storage_with_state(sim, seed, progress):
    """A group tensor sharing a storage with a state entry (copied as one, with no slot) pulled its storage-mate
    into the copies made first, their count reached the group tensors', and the slotted lr of a keep_addresses
    reload was left on the side stream: the scheduler's write raced its copy."""

    def built():
        p = torch.nn.Parameter(torch.ones(4, device=sim))
        opt = _Buffered([p], lr=torch.tensor(0.5, device=sim))
        p.grad = torch.ones_like(p)
        opt.step()
        base = torch.zeros(2, device=sim)  # (Parameters: no slot of their own)
        opt.param_groups[0]["aux"] = torch.nn.Parameter(base[0:1], requires_grad=False)
        opt.state[p]["tail"] = torch.nn.Parameter(base[1:2], requires_grad=False)
        return opt

    first = built()  # (the class probed and the device's addresses set up first: each orders the streams)
    optimshift.offload(first, keep_addresses=True)
    optimshift.reload(first)
    opt = built()
    with deferred_streams(seed=seed, progress=progress):
        optimshift.offload(opt, keep_addresses=True)
        optimshift.reload(opt, non_blocking=True)
        lr = opt.param_groups[0]["lr"]
        lr.mul_(0.5)  # what a scheduler does, right after the reload returned
        torch.sim.synchronize(0)
        assert lr.item() == 0.25


@pytest.mark.parametrize("seed, progress", SCHEDULES)
def test_a_reload_of_only_group_tensors_is_complete_for_another_stream_once_its_event_is(sim, seed, progress):
    """A non-blocking reload that moves a device ``lr`` and no state (an optimizer that never stepped) copies it
    on the current stream; a step run on another stream waits for the transfer's event only, so the event must
    come after that copy (the side stream waits for the current one before it is recorded: with no copy of its
    own, nothing else orders it)."""
    model = Model(SHAPES).to(sim)
    opt = torch.optim.Adam(list(model.parameters()), lr=torch.tensor(0.01, device=sim), capturable=True, foreach=True)
    optimshift.offload(opt)  # (the probe and the streams set up outside the schedule)
    optimshift.reload(opt)
    optimshift.offload(opt)
    assert not opt.state and opt.param_groups[0]["lr"].is_cpu
    params = [h.weight for h in model.parts]
    with deferred_streams(seed, progress):
        loading, stepping = torch.sim.Stream(), torch.sim.Stream()
        with torch.sim.stream(loading):
            optimshift.reload(opt, non_blocking=True)
        with torch.sim.stream(stepping):
            for i, p in enumerate(params):
                p.grad = grad_for(0, i, p.shape).to(p.device)
            opt.step()  # (its pre-hook makes this stream wait for the reload's event)
    assert opt.param_groups[0]["lr"].device == sim
