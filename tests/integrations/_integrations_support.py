"""Shared by the integration tests: placement layouts, fresh-optimizer references and bitwise snapshots.
(The Lightning strategies and the Accelerate recipe for the simulated device ship in optimshift.testing.)"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

import optimshift

Layout = list[tuple[str, str, str, str, tuple[int, ...]]]


def layout(optimizer: Any) -> Layout:
    """Every tensor the optimizer holds (state and param groups): (param, key, device, dtype, shape)."""
    return [(r.param, r.key, r.device, r.dtype, r.shape) for r in optimshift.placement(optimizer)]


def devices(optimizer: Any) -> set[str]:
    return {row[2] for row in layout(optimizer)}


def step_with_grads(params: Iterable[torch.Tensor], optimizer: Any, seed: int) -> None:
    """One optimizer step with deterministic grads (generated on the host, then put on each param's device)."""
    for i, p in enumerate(params):
        g = torch.Generator().manual_seed(seed * 100 + i)
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device)
    optimizer.step()


def fresh_layout(make: Callable[[list[torch.Tensor]], Any], params: list[torch.Tensor]) -> Layout:
    """Where a fresh optimizer (``make(params)``) over params shaped and placed like ``params`` keeps its state
    after one step: the reference every test compares with."""
    twins = [torch.nn.Parameter(torch.zeros(p.shape, dtype=p.dtype, device=p.device)) for p in params]
    optimizer = make(twins)
    step_with_grads(twins, optimizer, seed=0)
    return layout(optimizer)


def snapshot(optimizer: Any) -> dict:
    """A host copy of every state tensor, keyed by (group, index, key), for bitwise comparisons."""
    out = {}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            for key, value in optimizer.state.get(p, {}).items():
                out[(gi, pi, key)] = value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def bitwise_same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not (
                isinstance(y, torch.Tensor)
                and x.dtype == y.dtype
                and x.shape == y.shape
                and torch.equal(_bits(x), _bits(y))
            ):
                return False
        elif x != y:
            return False
    return True


def count_step_syncs(params: list[torch.Tensor], optimizer: Any, seed: int) -> int:
    """Host syncs of one optimizer step (the grads are placed before counting starts)."""
    for i, p in enumerate(params):
        g = torch.Generator().manual_seed(seed * 100 + i)
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device)
    with optimshift.count_syncs() as syncs:
        optimizer.step()
    return syncs.total
