"""Cached plans: a repeated operation on an unchanged optimizer reuses its plan and its adoption decisions.

The first build under a key leaves a marker only (a one-off operation pays nothing), the second is kept in the
session; every reuse re-validates the :func:`layout`, each site's tensor (same object, key and meta) and, for the
decisions, :func:`optimshift._adopt.still_valid`, and rebuilds on any mismatch. A reload is keyed by the build of
the offload plan it undoes (``Cached.serial``: :func:`undoing`), kept at its first build once that one is
(``eager``) and dropped with it. Keys
name what the target function depends on besides the optimizer (the operation, the target device, the offload a
reload undoes): a cached plan is never asked a question it was not built for.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _device_streams, _session
from . import policy as _policy
from ._adopt import Mechanism
from ._devices import HOSTS, _fake_mode_active
from ._plan import Ident, Plan, TargetFn, Transfer, _new_transfer, build_plan, iter_holders
from ._probe import group_kinds
from ._state import GROUP_SKIP, Path, by_id, group_flags, group_tensors, leaves, untensored

__all__ = ["Cached", "plan_for", "undoing"]

MAX_KEYS = 8  # per optimizer: an offload, a reload, a few move targets
PER_KEY = 2  # layouts kept per key: a move that follows params back and forth between two devices
_serials = itertools.count()


@dataclass(eq=False)
class Cached:
    """A plan's decisions and what they were built over, by ids and metas, never a tensor or param: one the state
    let go must be freed with it, not pinned here until this key is planned again (an offload would free no memory)."""

    layout: tuple[Any, ...] | None  # None: the first call's marker, which stands for any layout
    # per transfer: (ident, name, target, source); None: a marker (built once under this key and layout)
    template: list[tuple[Ident, str | None, torch.device, str]] | None = None
    keys: list[Any] = field(default_factory=list)  # per transfer: its top-level key (containers: the full path)
    metas: list[tuple[Any, ...]] = field(default_factory=list)  # per transfer: _meta() of its tensor
    ids: list[int] = field(default_factory=list)  # per transfer: id() of its tensor when the plan was last used
    sources: dict[Ident, torch.device] = field(default_factory=dict)  # per site: its tensor's device
    repeats: bool = True  # Plan.repeats: the same ids at the same sites give the same answer
    # transfers whose path goes through a mapping keyed by a tensor (TRAC's state["_trac"][param]): kept with the
    # key by id (_state.untensored), their ident taken from each use's walk
    named: frozenset[int] = frozenset()
    hows: list[Mechanism] | None = None  # the commit's adoption decisions, in its order (read on a hit only)
    hits: int = 0
    # NOTE: new at each (re)build, what the reload undoing this offload is keyed by. Not id(): the marker stays one
    # object when it is kept, and a freed entry's id can be reused.
    serial: int = field(default_factory=lambda: next(_serials))

    @property
    def kept(self) -> bool:
        """Whether a plan is kept here (not a marker)."""
        return self.template is not None

    def keep(self, plan: Plan) -> None:
        """Keep ``plan`` (the second build under this key, or this key and layout) for the calls that follow."""
        keys: list[Any] = []
        metas: list[tuple[Any, ...]] = []
        sources: dict[Ident, torch.device] = {}
        template: list[tuple[Ident, str | None, torch.device, str]] = []
        named: list[int] = []
        for i, tr in enumerate(plan.transfers):
            ident, tensor = tr[0], tr[2]
            path = untensored(ident[2])
            if path is not ident[2]:
                named.append(i)
                ident = (ident[0], ident[1], path)
            keys.append(path[0][1] if len(path) == 1 else path)
            metas.append(_meta(tensor))
            sources.setdefault(ident, tensor.device)
            template.append((ident, tr[1], tr[4], tr[5]))
        self.keys, self.metas, self.sources, self.template = keys, metas, sources, template
        self.named = frozenset(named)
        self.ids = [id(tr[2]) for tr in plan.transfers]
        self.repeats, self.hows, self.serial = plan.repeats, None, next(_serials)

    def sources_of(self, plan: Plan) -> dict[Ident, torch.device]:
        """Each site's device (``sources``) as ``plan``, this entry's plan for this call, names the sites."""
        if not self.named:
            return self.sources
        assert self.template is not None  # (named: kept)
        out = {ident: d for ident, d in self.sources.items() if not by_id(ident[2])}
        for i in sorted(self.named):  # (the device it had when kept: the meta each use checks)
            out.setdefault(plan.transfers[i][0], self.sources[self.template[i][0]])
        return out


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    # NOTE: the class and inference-ness too: sites are matched by id, and a tensor created where a freed one
    # was can reuse its id; the cached decisions (a Parameter or an inference tensor is replaced, never changed
    # in place) depend on both.
    return (type(t), t.device, t.dtype, t.shape, t.stride(), t.is_inference())


def layout(optimizer: Any, grads: bool = False) -> tuple[Any, ...]:
    """What a cached plan of ``optimizer`` depends on besides its state tensors: policy generation, fake mode, per
    group its dict, params and their devices, flags, entries by kind, tensor hyperparameters, grads; streams."""
    parts: list[Any] = [_policy.generation(), _fake_mode_active()]
    devices: set[torch.device] = set()
    for group in optimizer.param_groups:
        params = group["params"]
        param_devices = tuple(p.device for p in params)
        devices.update(param_devices)
        parts.append(
            (
                id(group),
                tuple(map(id, params)),
                param_devices,
                group_flags(group),
                group_kinds(group),  # (a probed placement depends on the group's entries by kind)
                tuple((path, t.device, t.dtype) for path, t in group_tensors(group)),
                tuple(p.grad is not None and p.grad.device for p in params) if grads else (),
            )
        )
    # (known, not probed: a blocking loop never needs streams, and probing creates one)
    parts.append(tuple(sorted((str(d), _device_streams.known(d)) for d in devices if d.type not in HOSTS)))
    return tuple(parts)


def _current(
    optimizer: Any, cached: Cached, live: dict[int, Path]
) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
    """The state's tensors, each with its param, in plan order if every site still holds the tensor the plan was
    last used with, unchanged (build_plan's walk, no decision); else None. ``live``: each ``named`` site's path."""
    ids, keys, metas, named = cached.ids, cached.keys, cached.metas, cached.named
    n = len(ids)
    out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    append = out.append
    i = 0
    for _, pi, param, _, entries, _ in iter_holders(optimizer):
        for key, value in entries.items():
            if pi is None and key in GROUP_SKIP:
                continue
            if isinstance(value, torch.Tensor):
                if i >= n or ids[i] != id(value) or keys[i] != key or _meta(value) != metas[i]:
                    return None
                append((value, param))
                i += 1
                continue
            for path, tensor in leaves(value, (("key", key),)):
                if i >= n or ids[i] != id(tensor) or _meta(tensor) != metas[i]:
                    return None
                if i in named:
                    if keys[i] != untensored(path):
                        return None
                    live[i] = path
                elif keys[i] != path:
                    return None
                append((tensor, param))
                i += 1
    return out if i == n else None


def plan_for(
    optimizer: Any, target: TargetFn, key: Hashable | None = None, *, grads: bool = False, eager: bool = False
) -> tuple[Plan, Cached | None]:
    """The plan of ``target`` over ``optimizer``: the one cached under ``key`` if still valid, else a new one
    (``key=None``: nothing kept), and the cache entry of ``key`` and this layout. ``eager``: keep a first build
    at once (the operation this one undoes was kept: a loop is under way)."""
    session = None if key is None else _session.get(optimizer)
    if session is None:
        return build_plan(optimizer, target), None
    plans = session.plans
    kept: list[Cached] = plans.get(key) or []
    # NOTE: the first call under a key asks no layout (~0.5 us per tensor): its marker stands for any.
    shape = layout(optimizer, grads) if kept or eager else None
    for cached in kept:
        if cached.layout is None or cached.layout == shape:
            if cached.template is None:  # the second build under this key (and layout): keep it from now on
                plan = build_plan(optimizer, target)
                cached.layout = shape
                cached.keep(plan)
                plans[key] = plans.pop(key)  # (the most recently used key is evicted last)
                return plan, cached
            live: dict[int, Path] = {}
            tensors = _current(optimizer, cached, live)
            if tensors is not None:
                cached.hits += 1
                plans[key] = plans.pop(key)
                new = _new_transfer
                transfers = [
                    new(Transfer, (ident, name, t, param, device, source, None))
                    for (ident, name, device, source), (t, param) in zip(cached.template, tensors)
                ]
                for i, path in live.items():  # (sites named through a param: the param of today's walk)
                    tr = transfers[i]
                    transfers[i] = new(Transfer, ((tr[0][0], tr[0][1], path), *tr[1:]))
                return Plan(optimizer, transfers, cached.repeats), cached
            kept = [c for c in kept if c is not cached]  # the same layout with other state: this one is stale
            break
    plan = build_plan(optimizer, target)  # (first: a build that raises leaves the cache as it was)
    cached = Cached(shape)
    if eager:
        cached.keep(plan)
    _drop(plans, plans.pop(key, []), keep=kept[: PER_KEY - 1])
    if len(plans) >= MAX_KEYS:
        _drop(plans, plans.pop(next(iter(plans))))  # the least recently used
    plans[key] = [cached] + kept[: PER_KEY - 1]
    return plan, cached


def undoing(serial: int) -> Hashable:
    """The key of the plan undoing the build ``serial`` (a reload's, of the offload it undoes): dropped with it."""
    return ("reload", serial)


def _drop(plans: dict[Hashable, list[Cached]], gone: Sequence[Cached], keep: Sequence[Cached] = ()) -> None:
    """The plans undoing builds no longer kept go too: no build of theirs can be made again (a new one has a
    new serial), and they would push out plans still in use."""
    for c in gone:
        if not any(c is k for k in keep):
            plans.pop(undoing(c.serial), None)
