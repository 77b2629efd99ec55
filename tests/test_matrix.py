"""The core guarantee over the whole optimizer matrix, on the simulated accelerator.

For every torch.optim class, in every mode it supports, in every direction (host->device, device->host,
device 0->1, params split over host and device, ``device=None`` after ``model.to``): after ``move``

- placement equals a fresh optimizer trained on the target from the start;
- the next steps give params and state bitwise equal to the same optimizer never moved;
- ``count_syncs`` over those steps equals the fresh optimizer's count;
- no dtype changed, and every tensor the optimizer holds is the same Python object as before.
"""

from __future__ import annotations

import pytest
import torch

import optimshift
from _matrix import CASES, Model, bitwise_equal, state_dtypes, state_layout, tensor_ids, train

K, N = 2, 2  # steps before the move, steps after it


def _devices(direction, sim, n):
    cpu, d0, d1 = torch.device("cpu"), torch.device(sim.type, 0), torch.device(sim.type, 1)
    return {
        "h2d": ([cpu] * n, [d0] * n),
        "d2h": ([d0] * n, [cpu] * n),
        "d0d1": ([d0] * n, [d1] * n),
        "split": ([cpu] * n, [d0 if i % 2 == 0 else cpu for i in range(n)]),
        "follow": ([cpu] * n, [d0] * n),
    }[direction]


def _place(model, devices):
    model.zero_grad(set_to_none=True)
    for part, device in zip(model.parts, devices):
        part.to(device)  # keeps Parameter identity (swap_module_params_on_conversion, as on CUDA)


def _run(cls, kwargs, shapes, src, dst, *, move):
    model = Model(shapes)
    _place(model, src)
    params = [h.weight for h in model.parts]
    opt = cls(params, **kwargs)
    train(model, opt, range(K))
    if dst is not None:
        dtypes = state_dtypes(opt)
        _place(model, dst)
        assert [h.weight for h in model.parts] == params, "module.to must keep Parameter identity"
        objects = tensor_ids(opt)
        move(opt)
        assert state_dtypes(opt) == dtypes, "a move must never change a dtype"
        assert tensor_ids(opt) == objects, "every tensor the optimizer holds must stay the same object"
    layout = state_layout(opt)
    with optimshift.count_syncs() as syncs:
        train(model, opt, range(K, K + N))
    return model, opt, layout, syncs.total


def _ids():
    for name, cls, kwargs, directions, shapes in CASES:
        for direction in directions:
            yield pytest.param(cls, kwargs, direction, shapes, id=f"{name}-{direction}")


@pytest.mark.parametrize("cls, kwargs, direction, shapes", list(_ids()))
def test_move_matrix(sim, cls, kwargs, direction, shapes):
    src, dst = _devices(direction, sim, len(shapes))
    explicit = None if direction in ("split", "follow") else dst[0]

    moved_model, moved, layout, moved_syncs = _run(
        cls, kwargs, shapes, src, dst, move=lambda opt: optimshift.move(opt, explicit)
    )
    # The fresh optimizer: same class and flags, trained on the target placement from the start.
    fresh_model, fresh, fresh_layout, fresh_syncs = _run(cls, kwargs, shapes, dst, None, move=None)
    # The same optimizer never moved (for a bitwise reference on the source placement).
    still_model, still, _, _ = _run(cls, kwargs, shapes, src, None, move=None)

    assert layout == fresh_layout, "placement after move must equal a fresh optimizer's"
    assert moved_syncs == fresh_syncs, f"host syncs after move {moved_syncs} != fresh {fresh_syncs}"
    assert optimshift.check(moved).ok
    for a, b in zip(moved_model.parameters(), still_model.parameters()):
        assert bitwise_equal(a, b), "params after move diverged from the optimizer that never moved"
    for pa, pb in zip(moved_model.parameters(), still_model.parameters()):
        assert bitwise_equal(
            {k: v for k, v in moved.state[pa].items()},
            {k: v for k, v in still.state[pb].items()},
        )


def test_sparse_adam_round_trip_keeps_its_int_step(sim):
    """SparseAdam's `step` is a Python int and stays one; its moments follow the param. (The simulated device
    has no sparse kernels, so the sparse step itself runs on the host: device -> host -> continue.)"""

    def run(moved):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 4, sparse=True)
        opt = torch.optim.SparseAdam(emb.parameters())
        for step in range(4):
            if step == 2 and moved:
                optimshift.move(opt, sim)
                st = opt.state[emb.weight]
                assert type(st["step"]) is int and st["exp_avg"].device == sim
                assert optimshift.move(opt, 0) is opt  # an int names the current accelerator's index
                optimshift.move(opt, "cpu")
                assert type(st["step"]) is int and st["step"] == 2
            opt.zero_grad()
            emb(torch.tensor([step, step + 1, 7])).sum().backward()
            opt.step()
        return emb.weight, opt.state[emb.weight]

    (w_moved, st_moved), (w_still, st_still) = run(True), run(False)
    assert bitwise_equal(w_moved, w_still) and bitwise_equal(dict(st_moved), dict(st_still))
