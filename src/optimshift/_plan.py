"""Turn an optimizer and a target into a plan: every tensor it holds, where it is, and where it must go.

Pure data, built and validated before anything is copied: bad input is refused while the optimizer is untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import itemgetter
from typing import Any, NamedTuple, cast

import torch

from . import _session
from . import policy as _policy
from ._errors import with_article
from ._state import GROUP_SKIP, OPTIMIZER_WIDE, Path, format_path, inner_optimizers, label_in, leaves, param_label

__all__ = [
    "Site",
    "Transfer",
    "Plan",
    "TargetFn",
    "build_plan",
    "policy_target",
    "iter_holders",
    "check_optimizer",
]


class Site:
    """Where a tensor sits in an optimizer: param group, param index (``None`` for a group entry), path."""

    __slots__ = ("group", "index", "key", "path", "name")

    def __init__(self, group: int, index: int | None, key: Any, path: Path, name: str | None = None) -> None:
        self.group, self.index, self.key, self.path, self.name = group, index, str(key), path, name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Site) and self.ident == other.ident and self.name == other.name

    def __hash__(self) -> int:
        return hash(self.ident)

    @property
    def ident(self) -> Ident:
        """A hashable identity, stable while the optimizer's groups keep their order."""
        return (self.group, self.index, self.path)

    @property
    def param_label(self) -> str:
        if self.group == OPTIMIZER_WIDE:
            return "optimizer-wide"
        if self.index is None:
            return f"group {self.group}"
        return param_label(self.group, self.index, self.name)

    @property
    def key_label(self) -> str:
        """The state key, with the path inside it for nested tensors: ``exp_avg``, ``old_dirs[3]``."""
        return self.key + format_path(self.path[1:])

    def __str__(self) -> str:
        where = "param_groups" if self.index is None and self.group != OPTIMIZER_WIDE else "state"
        return f"{self.param_label}, {where}{format_path(self.path)}"

    __repr__ = __str__


Ident = tuple[int, int | None, Path]
"""Where a tensor sits: (group index, param index or None, path)."""


class Transfer(NamedTuple):
    """One tensor of the plan: where it sits (``ident`` = group, index, path), the param it belongs to, where it
    must go (``target``, decided by ``source``: a policy rule, a record, offload), and in which dtype (``dtype``:
    a load's cast; None keeps the tensor's)."""

    # NOTE: built with tuple.__new__ (``_new_transfer``): a plan holds one per tensor (50k for a large model), and a
    # Python-level __new__ per tensor would cost more than the rest of the plan.
    ident: Ident
    name: str | None
    tensor: torch.Tensor
    param: torch.Tensor | None
    target: torch.device
    source: str
    dtype: torch.dtype | None

    @property
    def site(self) -> Site:
        group, index, path = self[0]
        return Site(group, index, path[0][1], path, self[1])


_new_transfer = tuple.__new__


@dataclass
class Plan:
    """``repeats``: some tensor is held by several entries (copied once); ``casts``: some transfer carries a dtype.
    ``columns``, in a plan of no transfers: ``(tensors, target)`` copied whole (a fresh load's, checked alike);
    ``entry(j, n)``: the transfer of column ``j``'s ``n``-th tensor, built only for an error naming it."""

    optimizer: torch.optim.Optimizer
    transfers: list[Transfer] = field(default_factory=list)
    repeats: bool = True
    casts: bool = False
    columns: Sequence[tuple[Sequence[torch.Tensor], torch.device]] = ()
    entry: Callable[[int, int], Transfer] | None = None

    def group_entries(self) -> list[Transfer]:
        """The transfers of the param groups' own tensors (a tensor ``lr``), last first: build_plan lists them after
        every param's (before the optimizer-wide ones), so they are walked from the end."""
        out = []
        for tr in reversed(self.transfers):
            ident = tr[0]
            if ident[1] is not None:
                break
            if ident[0] != OPTIMIZER_WIDE:
                out.append(tr)
        return out

    def group_moves(self) -> list[tuple[Ident, torch.device, torch.device]]:
        """(site, from, to) of each group tensor, asked before the commit (what ``_offload.remember_sides`` takes)."""
        return [(tr[0], tr[2].device, tr[4]) for tr in self.group_entries()]


def optimizer_name(optimizer: Any) -> str:
    return type(optimizer).__name__


def check_optimizer(optimizer: Any, what: str = "optimizer", *, groups: bool = True) -> torch.optim.Optimizer:
    """TypeError unless ``optimizer`` looks like a torch optimizer with well-formed groups and state (what every
    operation asks first). ``groups=False``: not what each group holds (a caller that walks none: ``wait``)."""
    param_groups = getattr(optimizer, "param_groups", None)
    state = getattr(optimizer, "state", None)
    if not isinstance(optimizer, torch.optim.Optimizer) and not (
        isinstance(param_groups, list) and isinstance(state, Mapping)
    ):
        # (duck-typed: e.g. a wrapper exposing the inner optimizer's groups and state)
        raise TypeError(
            f"{what} must be a torch.optim.Optimizer (with param_groups and state), got {type(optimizer).__name__}"
        )
    _check_groups(optimizer, param_groups, state, groups)
    return cast(torch.optim.Optimizer, optimizer)


def _check_groups(optimizer: Any, groups: Any, state: Any, contents: bool = True) -> None:
    """TypeError naming the group (and param) unless the groups are a list of dicts each holding a list or tuple of
    tensors and the state a mapping (else a raw error from deep inside, an offload's after its record was begun)."""
    if _well_formed(groups, state, contents):
        return
    name = optimizer_name(optimizer)
    for attribute, value, kind, expected in [("param_groups", groups, list, "list"), ("state", state, Mapping, "dict")]:
        if not isinstance(value, kind):
            got = "None" if value is None else with_article(type(value).__name__)
            raise TypeError(f"{name}: {attribute} is {got}, not a {expected}; nothing was changed")
    for gi, group in enumerate(groups):
        params = group.get("params") if isinstance(group, dict) else None
        if isinstance(params, (list, tuple)):
            # (their classes first, one pass in C: the param is looked for only when one is not a tensor)
            if all(issubclass(kind, torch.Tensor) for kind in set(map(type, params))):
                continue
            pi = next(i for i, p in enumerate(params) if not isinstance(p, torch.Tensor))
            raise TypeError(
                f"{name}: {label_in(optimizer, gi, pi)} is {with_article(type(params[pi]).__name__)}, not a tensor; "
                f"nothing was changed"
            )
        if not isinstance(group, dict):
            wrong = f"param group {gi} is {with_article(type(group).__name__)}, not a dict"
        elif "params" not in group:
            wrong = f"param group {gi} has no 'params'"
        else:
            wrong = f"group {gi}'s params are {with_article(type(params).__name__)}, not a list"
        raise TypeError(
            f"{name}: {wrong} (torch's add_param_group makes a dict holding a list of the params); nothing was changed"
        )


def _well_formed(groups: Any, state: Any, contents: bool = True) -> bool:
    """Whether :func:`_check_groups` has nothing to say, in a few passes in C over all groups (one call per group
    was 10 ms per operation for 15k groups); False for any doubt, which the group-by-group check then names."""
    if not isinstance(groups, list) or not isinstance(state, Mapping):
        return False
    if not contents:
        return True
    if not all(map(isinstance, groups, repeat(dict))):
        return False
    params: list[Any] = list(map(dict.get, groups, repeat("params")))  # (dict's own: a defaultdict's adds no key)
    if not all(map(isinstance, params, repeat((list, tuple)))):
        return False
    return all(issubclass(kind, torch.Tensor) for kind in set(map(type, chain.from_iterable(params))))


def iter_holders(
    optimizer: torch.optim.Optimizer,
    groups: list[dict[str, Any]] | None = None,
    state: Mapping[Any, Any] | None = None,
) -> Iterator[tuple[int, int | None, torch.Tensor | None, Mapping[str, Any], Mapping[Any, Any], str | None]]:
    """Yield (group index, param index, param, group, entries, param name) for every param with state, then every
    group (index and param None, entries the group: skip ``GROUP_SKIP``), then the optimizer-wide entries (MADGRAD's
    ``"k"``) as group ``OPTIMIZER_WIDE`` with the first group. ``groups``/``state``: walk these instead (a load's)."""
    name = optimizer_name(optimizer)
    param_groups = optimizer.param_groups if groups is None else groups
    by_id, wide = states_by_id(optimizer, groups, state)
    get = by_id.get
    for gi, group in enumerate(param_groups):
        names = group.get("param_names")
        if not isinstance(names, (list, tuple)):
            names = ()
        for pi, p in enumerate(group["params"]):
            held = get(id(p))
            if held is None or type(held) is dict and not held:
                continue
            # NOTE: `pname`, not `name`: that one is the optimizer's, in every error above and below.
            pname = str(names[pi]) if pi < len(names) and names[pi] is not None else None
            if type(held) is not dict and not isinstance(held, Mapping):
                # (before its truth is asked: a tensor's, of several elements, raises an ambiguous RuntimeError)
                raise TypeError(
                    f"{name}: state of {param_label(gi, pi, pname)} is {with_article(type(held).__name__)}, "
                    f"expected a dict of its entries (optimizer.state[param] = {{key: value}}); nothing was changed"
                )
            yield gi, pi, p, group, held, pname
    for gi, group in enumerate(param_groups):
        yield gi, None, None, group, group, None
    if wide and param_groups:
        yield OPTIMIZER_WIDE, None, None, param_groups[0], wide, None


def states_by_id(
    optimizer: torch.optim.Optimizer,
    groups: list[dict[str, Any]] | None = None,
    state: Mapping[Any, Any] | None = None,
) -> tuple[dict[int, Any], dict[Any, Any]]:
    """Each param's state by the param's id, and the optimizer-wide entries (under plain keys). ValueError for a
    param listed twice, or state for a param in no group (nothing can place it, ``state_dict()`` cannot name it)."""
    name = optimizer_name(optimizer)
    param_groups = optimizer.param_groups if groups is None else groups
    # NOTE: dict and set operations over ids first, one pass each in C; the loops that name the culprit run
    # only when one of them finds something wrong (this runs once per operation over every param).
    located = {id(p): None for group in param_groups for p in group["params"]}
    if len(located) != sum(len(group["params"]) for group in param_groups):
        raise ValueError(f"{name}: {listed_twice(param_groups)}")
    entries_of = optimizer.state if state is None else state
    by_id: dict[int, Any] = {id(p): entries for p, entries in entries_of.items()}  # (a tensor's hash is a Python call)
    wide: dict[Any, Any] = {}
    if len(by_id) != len(entries_of) or not by_id.keys() <= located.keys():
        by_id = {}
        for p, entries in entries_of.items():
            if not isinstance(p, torch.Tensor):
                wide[p] = entries  # an optimizer-wide entry under a plain key
            elif id(p) not in located:
                shape = tuple(p.shape)
                keys = list(entries) if isinstance(entries, Mapping) else []
                # (a rebind of an optimizer it holds over its groups, Lookahead's inner one, replaced the param by
                # one with no state here: what api._stale re-keys)
                keyed = {id(k) for k in entries_of}
                by = [
                    f"{attr}: {optimizer_name(held)}"
                    for attr, held in inner_optimizers(optimizer)
                    if (s := _session.of(held)) is not None
                    and (r := s.rebound.get(p)) is not None
                    and id(q := r()) in located
                    and id(q) not in keyed
                ]
                fix = (
                    f"A rebind of the optimizer it holds ({by[0]}) replaced that param in the groups they share: "
                    f"optimshift.rebind {name} to the same params to re-key it (removing it would lose it)"
                    if by
                    else "Remove it (del optimizer.state[param]) or add the param to a group"
                )
                raise ValueError(
                    f"{name}: state holds an entry (keys {keys}) for a param of shape {shape} that is in no param "
                    f"group: nothing can place it, and state_dict() cannot name it. {fix}; nothing was changed"
                )
            else:
                by_id[id(p)] = entries
    return by_id, wide


def listed_twice(param_groups: Sequence[Mapping[str, Any]]) -> str | None:
    """What is wrong where ``param_groups`` list one param twice (its first two places), or None: the one wording
    of that error, every operation's and the load's."""
    located: dict[int, tuple[int, int]] = {}
    for gi, group in enumerate(param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) in located:
                g0, i0 = located[id(p)]
                return f"the same param is listed twice (group {g0}, param {i0} and group {gi}, param {pi})"
            located[id(p)] = (gi, pi)
    return None


# target(ident, param, group, key, tensor) -> (device, source); ident = (group index, param index, path).
TargetFn = Callable[[Ident, torch.Tensor | None, Mapping[str, Any], str, torch.Tensor], tuple[torch.device, str]]

_top_paths: dict[Any, Path] = {}


def _top_path(key: Any) -> Path:
    path = _top_paths.get(key)
    if path is None:
        path = (("key", key),)
        if len(_top_paths) < 4096:
            _top_paths[key] = path
    return path


def build_plan(
    optimizer: torch.optim.Optimizer,
    target: TargetFn,
    *,
    groups: list[dict[str, Any]] | None = None,
    state: Mapping[Any, Any] | None = None,
) -> Plan:
    """Every tensor in ``optimizer``'s state and param groups (or in ``groups`` and ``state``, for a load), with
    the device ``target`` assigns it; ValueError for a tensor shared by entries sent to two places."""
    plan = Plan(optimizer)
    transfers = plan.transfers
    append = transfers.append
    paths = _top_paths
    tensor_type = torch.Tensor
    # (a policy's target places a param's entries through its memo, asked once per param: see policy.Placer)
    placer = target if isinstance(target, _policy.Placer) else None
    for gi, pi, param, group, entries, pname in iter_holders(optimizer, groups, state):
        if placer is not None and param is not None:
            holder = placer.holder(param, group)
            entry = placer.entry
        else:
            holder, entry = None, None
        for key, value in entries.items():
            if pi is None and key in GROUP_SKIP:  # (a group's params, or an optimizer-wide entry so named)
                continue
            if type(value) is tensor_type or isinstance(value, tensor_type):
                # (the common case, a tensor right under its key, inlined: this runs once per tensor)
                ident: Ident = (gi, pi, paths.get(key) or _top_path(key))
                if entry is not None:
                    device, source = entry(holder, param, group, key, value)  # type: ignore[arg-type]
                else:
                    device, source = target(ident, param, group, key, value)
                append(_new_transfer(Transfer, (ident, pname, value, param, device, source, None)))
            else:
                for where, tensor in leaves(value, paths.get(key) or _top_path(key)):
                    ident = (gi, pi, where)
                    device, source = target(ident, param, group, key, tensor)
                    append(_new_transfer(Transfer, (ident, pname, tensor, param, device, source, None)))
    # NOTE: a tensor held by several entries is rare: one pass in C finds none (the common case).
    ids = list(map(id, map(_tensor_of, transfers)))
    plan.repeats = len(set(ids)) != len(ids)
    if plan.repeats:
        _one_place_each(optimizer, transfers, ids)
    return plan


_tensor_of = itemgetter(2)


def _one_place_each(optimizer: Any, transfers: list[Transfer], ids: list[int]) -> None:
    """Validate (and, for LBFGS's shared lr, settle) where each tensor held by several entries goes."""
    held: dict[int, list[int]] = {}
    for i, key in enumerate(ids):
        held.setdefault(key, []).append(i)
    for indices in held.values():
        if len(indices) < 2:
            continue
        shared = indices[:1]
        for n in indices[1:]:
            tr = transfers[n]
            if transfers[shared[0]][4] != tr[4]:
                _share(optimizer, transfers, shared, tr)
            shared.append(n)


def _share(optimizer: Any, transfers: list[Transfer], shared: list[int], tr: Transfer) -> None:
    """One tensor held by several entries that belong on different devices: state entries holding their group's
    own tensor go where the group entry goes (LBFGS's ``state['t'] = group['lr']``, kept where a fresh LBFGS
    keeps lr; iter_holders yields the group entry last); any other sharing cannot be placed for both."""

    def is_group(t: Transfer) -> bool:
        return t[0][1] is None and t[0][0] != OPTIMIZER_WIDE

    if is_group(tr) and not any(is_group(transfers[i]) for i in shared):
        for i in shared:
            t = transfers[i]
            transfers[i] = _new_transfer(Transfer, (t[0], t[1], t[2], t[3], tr[4], tr[5], t[6]))
        return
    prior = transfers[shared[0]]
    raise ValueError(
        f"{optimizer_name(optimizer)}: one tensor is shared by {prior.site} and {tr.site}, which belong "
        f"on different devices ({prior.target} and {tr.target}); it cannot be placed for both"
    )


def policy_target(
    optimizer: torch.optim.Optimizer, device: torch.device | None, *, remembered: bool = True
) -> _policy.Placer:
    """Targets by the policy: each entry where a fresh optimizer with its param on ``device`` (None: where it is)
    keeps it. ``remembered=False``: group tensors placed from where they are, not where a move took them from."""
    session = _session.of(optimizer) if remembered else None
    return _policy.Placer(optimizer, device, None if session is None else session.group_sides)
