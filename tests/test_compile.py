"""A ``torch.compile``d ``optimizer.step()`` survives optimshift operations without recompiling.

Dynamo guards on the identity of every state tensor; optimshift keeps every tensor object, so the compiled
step keeps its graph. Graphs are counted with a counting backend (eager, no inductor: the guards are the same).
"""

from __future__ import annotations

import copy

import pytest
import torch

import optimshift
from _matrix import bitwise_equal

CYCLES = 20

CONFIGS = [
    pytest.param(torch.optim.Adam, {"foreach": False}, id="Adam"),
    pytest.param(torch.optim.AdamW, {"foreach": True}, id="AdamW-foreach"),
    pytest.param(torch.optim.SGD, {"momentum": 0.9}, id="SGD-momentum"),
]


class Compiled:
    """``opt.step()`` compiled with a backend that counts the graphs it is given."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.graphs = 0

        def backend(gm, example_inputs):
            self.graphs += 1
            return gm.forward

        @torch.compile(backend=backend)
        def step() -> None:
            opt.step()

        self.step = step


def _setup(cls, kwargs, seed=0):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(8, 4), (4,)]]
    opt = cls(params, **kwargs)
    compiled = Compiled(opt)
    for step in range(2):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i))
        compiled.step()
    return params, opt, compiled


def _grads(params, step):
    for i, p in enumerate(params):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 + 10 * step + i))


@pytest.mark.parametrize("cls, kwargs", CONFIGS)
def test_load_state_dict_into_existing_state_does_not_recompile(cls, kwargs):
    params, opt, compiled = _setup(cls, kwargs)
    saved = copy.deepcopy(opt.state_dict())
    graphs = compiled.graphs
    objects = [id(v) for st in opt.state.values() for v in st.values()]
    for cycle in range(CYCLES):
        optimshift.load_state_dict(opt, saved)
        _grads(params, cycle)
        compiled.step()
    assert compiled.graphs == graphs, f"{compiled.graphs - graphs} recompiles over {CYCLES} loads"
    assert [id(v) for st in opt.state.values() for v in st.values()] == objects

    # The kept objects really hold the loaded values, and the compiled step uses them: it computes what an
    # eager optimizer loaded with the same state computes (compiled and eager arithmetic may round apart).
    optimshift.load_state_dict(opt, saved)
    for st, saved_st in zip(opt.state.values(), saved["state"].values()):
        assert bitwise_equal(dict(st), dict(saved_st))
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = cls(ref_params, **kwargs)
    optimshift.load_state_dict(ref, saved)
    _grads(params, 99)
    _grads(ref_params, 99)
    compiled.step()
    ref.step()
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q)
    assert compiled.graphs == graphs


@pytest.mark.parametrize("cls, kwargs", CONFIGS[:1])
def test_replacing_the_tensors_does_recompile(cls, kwargs):
    """The control: what other libraries do (new tensor objects in the state) recompiles the step, so the
    test above can fail."""
    params, opt, compiled = _setup(cls, kwargs)
    graphs = compiled.graphs
    for cycle in range(3):
        for st in opt.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    st[k] = v.clone()
        _grads(params, cycle)
        compiled.step()
    assert compiled.graphs > graphs


@pytest.mark.parametrize("cls, kwargs", CONFIGS[:1])
def test_move_and_offload_round_trips_do_not_recompile(cls, kwargs):
    """On a CPU-only machine every target is the host: the operations run the whole path and commit nothing
    new; the step keeps its graph."""
    params, opt, compiled = _setup(cls, kwargs)
    graphs = compiled.graphs
    for cycle in range(CYCLES):
        optimshift.move(opt, "cpu")
        with optimshift.offloaded(opt):
            pass
        _grads(params, cycle)
        compiled.step()
    assert compiled.graphs == graphs
