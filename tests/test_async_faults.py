"""A fault in the middle of a non-blocking transfer leaves nothing queued that touches freed memory (issue 17,
item 3).

Fault injection during ``offload(non_blocking=True)`` and ``reload(non_blocking=True)`` of an optimizer whose
state holds containers, a ``requires_grad`` tensor and a transposed (strided) tensor: a ``RuntimeError``,
``MemoryError`` or ``KeyboardInterrupt`` raised at the n-th call of ``copy_tensor``, ``requires_grad_`` and
``Tensor.to`` (the offload) or ``Tensor.copy_`` (the reload), for every n the transfer reaches. Each time the
rollback is bitwise, and once the optimizer is dropped and collected, synchronizing the device raises no
``StreamRaceError``: every error path waited for what it had queued.
"""

import gc

import pytest
import torch

import optimshift
from _matrix import Model, bitwise_equal, snapshot, tensor_ids, train
from _schedules import drain_queued  # noqa: F401  (drain_queued: an autouse fixture)
from optimshift import _copy
from optimshift.pool import host_pool
from optimshift.testing import deferred_streams

SHAPES = [(3, 2), (4,), (2, 5)]
ERRORS = [RuntimeError, MemoryError, KeyboardInterrupt]
# (a non-blocking reload allocates every device tensor itself and fills it with copy_: it calls no Tensor.to)
CASES = [
    (site, operation)
    for operation in ("offload", "reload")
    for site in ("copy_tensor", "Tensor.to" if operation == "offload" else "Tensor.copy_", "requires_grad_")
]


def _awkward(sim):
    """Adam on the device, with extra entries: a list and a dict of tensors, a requires_grad tensor and a
    transposed one (each copied tensor by tensor, not grouped)."""
    model = Model(SHAPES).to(sim)
    opt = torch.optim.Adam(list(model.parameters()), foreach=True)
    train(model, opt, range(2))
    p0, p1, p2 = model.parameters()
    opt.state[p0]["history"] = [torch.arange(3.0, device=sim), (torch.ones(2, device=sim) * 7, 5)]
    opt.state[p1]["extra"] = {"a": torch.full((2, 2), 3.0, device=sim), "b": "text"}
    opt.state[p1]["trained"] = torch.linspace(0, 1, 3, device=sim).requires_grad_(True)
    opt.state[p2]["transposed"] = torch.arange(6.0, device=sim).reshape(2, 3).t()
    return model, opt


def _inject(monkeypatch, site, error, at):
    """Make the ``at``-th call of ``site`` raise ``error``; returns the list of calls seen."""
    calls = []

    def failing(real):
        def wrapper(*args, **kwargs):
            calls.append(1)
            if len(calls) == at:
                raise error(f"injected at call {at} of {site}")
            return real(*args, **kwargs)

        return wrapper

    if site == "copy_tensor":
        monkeypatch.setattr(_copy, "copy_tensor", failing(_copy.copy_tensor))
    elif site in ("Tensor.to", "Tensor.copy_"):
        name = site.split(".")[1]
        monkeypatch.setattr(torch.Tensor, name, failing(getattr(torch.Tensor, name)))
    else:
        monkeypatch.setattr(torch.Tensor, "requires_grad_", failing(torch.Tensor.requires_grad_))
    return calls


def _count_calls(sim, monkeypatch, site, operation):
    """How many times ``operation`` calls ``site`` (to inject a fault at each of them)."""
    with deferred_streams(progress=0.0):
        _, opt = _awkward(sim)
        if operation == "reload":
            optimshift.offload(opt)
        calls = _inject(monkeypatch, site, RuntimeError, at=-1)
        getattr(optimshift, operation)(opt, non_blocking=True).wait()
        monkeypatch.undo()
        optimshift.reload(opt)
    return len(calls)


@pytest.mark.parametrize("site, operation", CASES)
def test_a_fault_part_way_leaves_nothing_queued_on_freed_memory(sim, monkeypatch, site, operation):
    n = _count_calls(sim, monkeypatch, site, operation)
    assert n > 0, f"{operation} calls {site}"
    for at in range(1, n + 1):
        for error in ERRORS:
            with deferred_streams(seed=at, progress=0.0):
                _, opt = _awkward(sim)
                if operation == "reload":
                    optimshift.offload(opt)
                in_use = host_pool.stats().in_use
                values = [snapshot(dict(st)) for st in opt.state.values()]
                objects = tensor_ids(opt)
                calls = _inject(monkeypatch, site, error, at)
                try:
                    getattr(optimshift, operation)(opt, non_blocking=True)
                except error as e:
                    assert "injected" in str(e)
                else:  # (a warm pool stages less than the counting run did: fewer calls this time)
                    monkeypatch.undo()
                    assert len(calls) < at
                    optimshift.wait(opt)
                    optimshift.reload(opt)
                    continue
                monkeypatch.undo()
                assert host_pool.stats().in_use == in_use, "every buffer the transfer took went back"
                assert tensor_ids(opt) == objects, (site, at, error)
                for st, before in zip(opt.state.values(), values):
                    assert bitwise_equal(dict(st), before), (site, at, error)
                assert optimshift.is_offloaded(opt) == (operation == "reload")
                del opt
                gc.collect()
                torch.sim.synchronize(0)  # raises StreamRaceError for memory freed under queued work
