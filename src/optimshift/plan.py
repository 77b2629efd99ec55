"""Turn an optimizer and a target into a plan: every tensor it holds, where it is, and where it must go.

A plan is pure data, built and validated before anything is copied: errors about bad input are raised here,
while the optimizer is untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from . import policy as _policy
from ._state import Path, format_path, leaves

__all__ = ["Site", "Transfer", "Plan", "build_plan", "simple_moves", "policy_target", "iter_entries", "param_label",
           "check_optimizer"]


class Site:
    """Where a tensor sits in an optimizer: param group, param index (``None`` for a group entry), path."""

    __slots__ = ("group", "index", "key", "path", "name")

    def __init__(self, group: int, index: Optional[int], key: Any, path: Path, name: Optional[str] = None) -> None:
        self.group, self.index, self.key, self.path, self.name = group, index, str(key), path, name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Site) and self.ident == other.ident and self.name == other.name

    def __hash__(self) -> int:
        return hash(self.ident)

    @property
    def ident(self) -> tuple:
        """A hashable identity, stable while the optimizer's groups keep their order."""
        return (self.group, self.index, self.path)

    @property
    def param_label(self) -> str:
        if self.group == OPTIMIZER_WIDE:
            return "optimizer-wide"
        if self.index is None:
            return f"group {self.group}"
        label = f"group {self.group}, param {self.index}"
        return f"{label} ({self.name})" if self.name else label

    @property
    def key_label(self) -> str:
        """The state key, with the path inside it for nested tensors: ``exp_avg``, ``old_dirs[3]``."""
        return self.key + format_path(self.path[1:])

    def __str__(self) -> str:
        if self.group == OPTIMIZER_WIDE:
            return f"optimizer-wide, state{format_path(self.path)}"
        where = "param_groups" if self.index is None else "state"
        return f"{self.param_label}, {where}{format_path(self.path)}"

    __repr__ = __str__


class Transfer:
    """One tensor of the plan: where it sits, the param it belongs to, and where it must go."""

    __slots__ = ("ident", "name", "tensor", "param", "target", "source")

    def __init__(self, ident: tuple, name: Optional[str], tensor: torch.Tensor, param: Optional[torch.Tensor],
                 target: torch.device, source: str) -> None:
        self.ident, self.name, self.tensor, self.param, self.target, self.source = ident, name, tensor, param, target, source

    @property
    def site(self) -> Site:
        group, index, path = self.ident
        return Site(group, index, path[0][1], path, self.name)

    @property
    def moves(self) -> bool:
        return self.tensor.device != self.target


@dataclass
class Plan:
    optimizer: torch.optim.Optimizer
    transfers: list[Transfer] = field(default_factory=list)


def optimizer_name(optimizer: Any) -> str:
    return type(optimizer).__name__


def check_optimizer(optimizer: Any, what: str = "optimizer") -> torch.optim.Optimizer:
    """TypeError unless ``optimizer`` looks like a torch optimizer (param_groups and state)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    groups = getattr(optimizer, "param_groups", None)
    state = getattr(optimizer, "state", None)
    if isinstance(groups, list) and isinstance(state, Mapping):
        return optimizer  # duck-typed (e.g. a wrapper exposing the inner optimizer's groups and state)
    raise TypeError(
        f"{what} must be a torch.optim.Optimizer (with param_groups and state), got {type(optimizer).__name__}"
    )


OPTIMIZER_WIDE = -1  # the "group" of optimizer.state entries under plain (non-param) keys


def param_label(group: int, index: int, names: Optional[list]) -> Optional[str]:
    if names is not None and index < len(names):
        return str(names[index])
    return None


def iter_entries(
    optimizer: torch.optim.Optimizer,
) -> Iterator[tuple[int, Optional[int], Optional[torch.Tensor], Mapping[str, Any], str, Any, Optional[str]]]:
    """Yield (group, index, param, group dict, key, value, param name) for every state entry of every param,
    then for every param-group entry other than ``params``/``param_names``, then for optimizer-wide entries
    (``optimizer.state`` keys that are not tensors, e.g. MADGRAD's ``"k"``) as group ``OPTIMIZER_WIDE``.

    Raises ValueError if the state holds a param that no group holds (it could never be placed).
    """
    name = optimizer_name(optimizer)
    located: dict[int, tuple[int, int]] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) in located:
                g0, i0 = located[id(p)]
                raise ValueError(f"{name}: the same param is listed twice (group {g0}, param {i0} and group {gi}, param {pi})")
            located[id(p)] = (gi, pi)
    wide: list[Any] = []
    for p in optimizer.state:
        if not isinstance(p, torch.Tensor):
            wide.append(p)  # an optimizer-wide entry under a plain key
        elif id(p) not in located:
            shape = tuple(p.shape)
            keys = list(optimizer.state[p]) if isinstance(optimizer.state[p], Mapping) else []
            raise ValueError(
                f"{name}: state holds an entry (keys {keys}) for a param of shape {shape} that is in no param "
                f"group; it cannot be placed. Remove it (del optimizer.state[param]) or add the param to a group."
            )
    for gi, group in enumerate(optimizer.param_groups):
        names = group.get("param_names")
        for pi, p in enumerate(group["params"]):
            state = optimizer.state.get(p)
            if not state:
                continue
            if not isinstance(state, (dict, Mapping)):
                raise TypeError(f"{name}: state of group {gi}, param {pi} is a {type(state).__name__}, expected a dict")
            for key, value in state.items():
                yield gi, pi, p, group, key, value, param_label(gi, pi, names)
    for gi, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key in ("params", "param_names"):
                continue
            yield gi, None, None, group, key, value, None
    if wide and optimizer.param_groups:
        first = optimizer.param_groups[0]  # optimizer-wide tensors go where the first group's params are
        for key in wide:
            yield OPTIMIZER_WIDE, None, None, first, key, optimizer.state[key], None


# target(ident, param, group, key, tensor) -> (device, source); ident = (group index, param index, path).
TargetFn = Callable[[tuple, Optional[torch.Tensor], Mapping[str, Any], str, torch.Tensor], tuple[torch.device, str]]

_top_paths: dict[Any, Path] = {}


def _top_path(key: Any) -> Path:
    path = _top_paths.get(key)
    if path is None:
        path = (("key", key),)
        if len(_top_paths) < 4096:
            _top_paths[key] = path
    return path


def build_plan(optimizer: torch.optim.Optimizer, target: TargetFn) -> Plan:
    """Every tensor in ``optimizer``'s state and param groups, with the device ``target`` assigns it.

    Validates that a tensor shared between entries is not sent to two places.
    """
    plan = Plan(optimizer)
    transfers = plan.transfers
    sharing: dict[int, list[Transfer]] = {}
    for gi, pi, param, group, key, value, pname in iter_entries(optimizer):
        if isinstance(value, torch.Tensor):
            found: Any = ((_top_path(key), value),)
        else:
            found = leaves(value, _top_path(key))
        for path, tensor in found:
            ident = (gi, pi, path)
            device, source = target(ident, param, group, key, tensor)
            tr = Transfer(ident, pname, tensor, param, device, source)
            shared = sharing.setdefault(id(tensor), [])
            if shared and shared[0].target != device:
                _share(optimizer, shared, tr)
            shared.append(tr)
            transfers.append(tr)
    return plan


def _share(optimizer: Any, shared: list[Transfer], tr: Transfer) -> None:
    """One tensor held by several entries that belong on different devices.

    NOTE: an entry that shares its param group's own tensor holds the group's: LBFGS keeps ``state['t'] =
    group['lr']`` (a tensor lr), and a fresh LBFGS keeps the one tensor where its group keeps lr. So the state
    entries go where the group entry goes (iter_entries yields state first: the group entry comes later). Any
    other sharing across devices cannot be placed for both."""
    def is_group(t: Transfer) -> bool:
        return t.ident[1] is None and t.ident[0] != OPTIMIZER_WIDE

    if is_group(tr) and not any(is_group(t) for t in shared):
        for t in shared:
            t.target, t.source = tr.target, tr.source
        return
    prior = shared[0]
    raise ValueError(
        f"{optimizer_name(optimizer)}: one tensor is shared by {prior.site} and {tr.site}, which belong "
        f"on different devices ({prior.target} and {tr.target}); it cannot be placed for both"
    )


_PLAIN = (int, float, bool, str, type(None))


def simple_moves(
    optimizer: torch.optim.Optimizer, device: Optional[torch.device]
) -> Optional[list[tuple[dict, Any, torch.Tensor, torch.device]]]:
    """The moves of :func:`build_plan` + :func:`policy_target`, for the common case only, in one pass with no
    per-tensor objects: ``[(state dict, key, tensor, target)]`` for every tensor not where it belongs.

    ``None`` (use the general path, which also raises the precise errors) unless every state value is a plain
    tensor or a Python scalar/string, the param groups hold no tensors, every state key is a param of a group,
    no tensor is shared between entries, and no registered policy applies.
    """
    if _policy.has_registered_policy(optimizer):
        return None
    groups, state = optimizer.param_groups, optimizer.state
    group_of: dict[int, Mapping[str, Any]] = {}
    for group in groups:
        for key, value in group.items():
            if key != "params" and key != "param_names" and not isinstance(value, _PLAIN) and not (
                    type(value) is tuple and all(isinstance(v, _PLAIN) for v in value)):
                return None
        for p in group["params"]:
            if id(p) in group_of:
                return None
            group_of[id(p)] = group
    moves = []
    seen: set[int] = set()
    scalars: dict[tuple, torch.device] = {}  # 0-dim decisions, once per (group, key, param rank, device)
    for p, st in state.items():  # (id-keyed lookups: a tensor's __hash__ is a Python call)
        group = group_of.get(id(p))
        if group is None or type(st) is not dict:
            return None
        if not st:
            continue
        param_device = p.device if device is None else device
        for key, value in st.items():
            if type(value) is not torch.Tensor:
                if isinstance(value, _PLAIN):
                    continue
                return None
            if id(value) in seen:
                return None  # shared between entries: the general path keeps it shared
            seen.add(id(value))
            if value.dim():
                target = param_device  # non-scalar state always follows its param
            else:
                memo_key = (id(group), key, p.dim(), param_device)
                target = scalars.get(memo_key)  # type: ignore[assignment]
                if target is None:
                    target = scalars[memo_key] = _policy.decide(optimizer, group, p, key, value,
                                                                param_device).device
            if value.device != target:
                moves.append((st, key, value, target))
    return moves


def policy_target(optimizer: torch.optim.Optimizer, device: Optional[torch.device]) -> TargetFn:
    """Targets by the policy: each entry where a fresh optimizer with its param on ``device`` keeps it
    (``device=None``: the param's current device)."""

    memo: dict[tuple, tuple[torch.device, str]] = {}
    cacheable = not _policy.has_registered_policy(optimizer)  # a user policy may look at anything

    def target(ident: tuple, param: Optional[torch.Tensor], group: Mapping[str, Any], key: str, tensor: torch.Tensor):
        if device is not None:
            param_device = device
        elif param is not None:
            param_device = param.device
        else:
            param_device = group_device(group, tensor)
        # A group's own tensors (tensor lr, betas) are decided one by one: their rule depends on which entry
        # and on where each one is (policy._group_entry).
        memoize = cacheable and param is not None
        if memoize:
            if tensor.dim() != 0:
                return param_device, "rule"  # non-scalar state always follows its param (policy.decide)
            # Built-in rules depend only on these: decide once per distinct combination in this plan.
            memo_key = (id(group), key, param.dim(), param_device)
            hit = memo.get(memo_key)
            if hit is not None:
                return hit
        decision = _policy.decide(optimizer, group, param, key, tensor, param_device)
        result = (decision.device, decision.source)
        if memoize:
            memo[memo_key] = result
        return result

    return target


def group_device(group: Mapping[str, Any], fallback: torch.Tensor) -> torch.device:
    """The device of a group's params (the first one's), for tensors kept in the group itself."""
    for p in group.get("params", ()):
        if isinstance(p, torch.Tensor):
            return p.device
    return fallback.device
