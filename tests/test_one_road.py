"""Every public operation goes the one road (issue 27, item 8): spies on the engine show which of its functions
each operation calls.

- ``move``, ``offload``, ``reload``, ``rebind``, ``unstream`` and verl's patched functions: the plan's
  ``engine.run`` (copy) and ``engine.commit`` (adopt, all or nothing);
- every operation, ``load_state_dict`` and ``stream`` included: the commit's one uninterrupted section
  (``engine.uninterrupted``), where an interrupt waits for the commit to end.

``load_state_dict`` and ``stream`` still stage their copies and adoptions themselves (through
``engine.copy_items`` and ``engine.adoptions``/``adopt_all``); ARCHITECTURE.md names the tests that make their
placement agree with the plan's (``tests/test_roads.py``, ``tests/checkpoint/test_uniform.py``).
"""

from __future__ import annotations

import collections

import pytest
import torch

import optimshift
from optimshift import engine

O = torch.optim


@pytest.fixture
def calls(monkeypatch):
    seen: collections.Counter[str] = collections.Counter()
    for name in ("run", "commit", "uninterrupted"):
        real = getattr(engine, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(engine, name, spy)
    return seen


def _trained(device):
    params = [torch.nn.Parameter(torch.randn(4, 3, device=device)) for _ in range(2)]
    opt = O.Adam(params, foreach=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return params, opt


def _ops(sim, tmp_path):
    def move(opt, params):
        optimshift.move(opt, "cpu")

    def offload(opt, params):
        optimshift.offload(opt)

    def reload(opt, params):
        optimshift.offload(opt)
        optimshift.reload(opt)

    def rebind(opt, params):
        optimshift.rebind(opt, [torch.nn.Parameter(p.detach().clone()) for p in params])

    def load(opt, params):
        _, other = _trained(sim)
        optimshift.load_state_dict(opt, other.state_dict())

    def stream(opt, params):
        optimshift.stream(opt)

    def unstream(opt, params):
        optimshift.stream(opt)
        optimshift.unstream(opt)

    return {
        "move": move,
        "offload": offload,
        "reload": reload,
        "rebind": rebind,
        "load_state_dict": load,
        "stream": stream,
        "unstream": unstream,
    }


PLANNED = ("move", "offload", "reload", "rebind", "unstream")
ALL = PLANNED + ("load_state_dict", "stream")


@pytest.mark.parametrize("op", ALL)
def test_every_operation_commits_through_the_engine(sim, tmp_path, calls, op):
    params, opt = _trained(sim)
    calls.clear()
    _ops(sim, tmp_path)[op](opt, params)
    if op in PLANNED:
        assert calls["run"] >= 1 and calls["commit"] >= 1, f"{op} does not go plan -> engine.run -> engine.commit"
    assert calls["uninterrupted"] >= 1, f"{op} commits outside the engine's commit section"


def test_verls_patched_functions_go_the_one_road(sim, calls):
    pytest.importorskip("verl")
    import optimshift.integrations.verl as osv

    osv.patch()
    try:
        with osv._quiet_verl_import():
            from verl.workers.engine.fsdp import transformer_impl

        params, opt = _trained(sim)
        calls.clear()
        transformer_impl.offload_fsdp_optimizer(opt)
        assert calls["run"] == 1 and calls["commit"] == 1
        transformer_impl.load_fsdp_optimizer(opt, "sim")
        assert calls["run"] == 2 and calls["commit"] == 2
    finally:
        osv.unpatch()
