"""Finding the tensors inside optimizer state (any containers, dataclasses and plain objects), and putting new ones
in their place: mutable containers updated in place at commit, immutable ones rebuilt with the same type."""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import types
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from ._errors import with_article

Step = tuple[str, Any]  # ("key", k) | ("index", i) | ("attr", name) | ("elem", i)
Path = tuple[Step, ...]  # a tuple of steps
Setter = Callable[[], None]

_ATOMS = (
    str,
    bytes,
    bytearray,
    int,
    float,
    complex,
    bool,
    type(None),
    torch.dtype,
    torch.device,
    torch.Size,
    enum.Enum,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
)


def format_path(path: Path) -> str:
    return "".join(f"[{s!r}]" if kind == "key" else f".{s}" if kind == "attr" else f"[{s}]" for kind, s in path)


def _object_fields(value: Any) -> list[tuple[str, Any]]:
    """Attribute (name, value) pairs of a plain object: its ``__dict__`` and its ``__slots__``."""
    fields: list[tuple[str, Any]] = []
    d = getattr(value, "__dict__", None)
    if isinstance(d, dict):
        fields.extend(d.items())
    for klass in type(value).__mro__:
        for slot in getattr(klass, "__slots__", ()) or ():
            if isinstance(slot, str) and slot not in ("__dict__", "__weakref__") and hasattr(value, slot):
                fields.append((slot, getattr(value, slot)))
    return fields


def _children(value: Any) -> Iterator[tuple[Step, Any]]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield ("key", k), v
    elif isinstance(value, (list, tuple, deque)):
        for i, v in enumerate(value):
            yield ("index", i), v
    elif isinstance(value, (set, frozenset)):
        for i, v in enumerate(value):
            yield ("elem", i), v
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield ("attr", f.name), getattr(value, f.name)
    elif not isinstance(value, _ATOMS):
        for name, v in _object_fields(value):
            yield ("attr", name), v


def leaves(value: Any, path: Path = ()) -> Iterator[tuple[Path, torch.Tensor]]:
    """Every tensor inside ``value``, with its path, depth first; each container once. Iterative: a hostile file
    nesting 20,000 levels does not overflow the stack."""
    if isinstance(value, torch.Tensor):
        yield path, value
        return
    if isinstance(value, _ATOMS):
        return
    seen: set[int] = {id(value)}
    # NOTE: the path is composed only when a tensor is found (from the steps on the stack): building it per
    # level would be quadratic in the depth.
    steps: list[Step] = []
    stack: list[Iterator[tuple[Step, Any]]] = [_children(value)]
    while stack:
        for step, child in stack[-1]:
            if isinstance(child, torch.Tensor):
                yield path + tuple(steps) + (step,), child
            elif not isinstance(child, _ATOMS) and id(child) not in seen:
                seen.add(id(child))
                steps.append(step)
                stack.append(_children(child))
                break
        else:
            stack.pop()
            if steps:
                steps.pop()


@dataclasses.dataclass(frozen=True)
class ById:
    """A tensor key in a path that is kept (a mapping keyed by params: TRAC's ``state["_trac"][param]``), by its
    id: what keeps the path holds no param."""

    id: int


def untensored(path: Path) -> Path:
    """``path`` with each tensor key as a :class:`ById` (``path`` itself where it has none): how a cache keys a
    site it keeps beyond the operation (a cached plan, a kept address)."""
    for step in path:  # (a loop, not any() over a generator: a cached plan's keep asks once per tensor)
        if isinstance(step[1], torch.Tensor):
            return tuple((kind, ById(id(k))) if isinstance(k, torch.Tensor) else (kind, k) for kind, k in path)
    return path


def by_id(path: Path) -> bool:
    """Whether ``path`` names a site through a key kept by id (:func:`untensored`)."""
    return any(isinstance(step[1], ById) for step in path)


def tensors(value: Any) -> list[torch.Tensor]:
    """The distinct tensors inside ``value`` (each object once), in :func:`leaves` order."""
    out: dict[int, torch.Tensor] = {}
    for _, t in leaves(value):
        out.setdefault(id(t), t)
    return list(out.values())


def holds_tensor(value: Any) -> bool:
    """Whether any tensor is inside ``value``."""
    return next(leaves(value), None) is not None


MAX_DEPTH = 64
"""Containers nested deeper are refused where state is loaded or rewritten: copying them is recursive, and no
optimizer nests state more than a few levels."""


def too_deep(value: Any) -> bool:
    """Whether ``value`` nests the containers :func:`leaves` walks more than :data:`MAX_DEPTH` levels deep."""
    if isinstance(value, (torch.Tensor,) + _ATOMS):
        return False
    stack = [(value, 1)]
    seen: set[int] = set()
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        if id(v) in seen:
            continue
        seen.add(id(v))
        for _, child in _children(v):
            if not isinstance(child, (torch.Tensor,) + _ATOMS):
                stack.append((child, depth + 1))
    return False


def rebuild(value: Any, replace: Mapping[int, torch.Tensor], setters: list[Setter], memo: dict[int, Any]) -> Any:
    """What ``value`` becomes once each tensor whose id is in ``replace`` is swapped for its copy: itself where mutable
    (its updates appended to ``setters``, which cannot fail) or unchanged, else a new object of its type."""
    if isinstance(value, torch.Tensor):
        return replace.get(id(value), value)
    if isinstance(value, _ATOMS):
        return value
    if id(value) in memo:
        return memo[id(value)]
    memo[id(value)] = value  # provisional, for cycles
    memo[id(value)] = result = _rebuild_container(value, replace, setters, memo)
    return result


def _rebuild_container(
    value: Any, replace: Mapping[int, torch.Tensor], setters: list[Setter], memo: dict[int, Any]
) -> Any:
    new = [(step, child, rebuild(child, replace, setters, memo)) for step, child in _children(value)]
    changed = [(step, nv) for step, child, nv in new if nv is not child]
    if not changed:
        return value
    if isinstance(value, (dict, list, deque)) or (isinstance(value, Mapping) and hasattr(value, "__setitem__")):
        setters.extend(functools.partial(value.__setitem__, k, nv) for (_, k), nv in changed)
        return value
    kind: Any = type(value)
    items = [nv for _, _, nv in new]
    if isinstance(value, tuple):  # (a namedtuple by its _make)
        return kind._make(items) if hasattr(kind, "_fields") and hasattr(kind, "_make") else kind(items)
    if isinstance(value, frozenset):
        return kind(items)
    if isinstance(value, set):
        setters.append(_set_replacer(value, items))
        return value
    if dataclasses.is_dataclass(value) and kind.__dataclass_params__.frozen:  # (a mutable one: as any object)
        clone = copy.copy(value)
        for (_, name), nv in changed:
            object.__setattr__(clone, name, nv)
        return clone
    setters.extend(_attr_setter(value, name, nv) for (_, name), nv in changed)
    return value


def keyed_by(roots: Iterable[tuple[Path, Any]], ids: Mapping[int, Any], seen: set[int]) -> Iterator[tuple[Path, Any]]:
    """Every mapping inside each root value (the root too) with a key whose ``id`` is in ``ids`` (TRAC's
    ``state["_trac"][param]``), with its path; each container once across the roots (``seen``: ids to skip)."""
    keys = ids.keys()
    only_tensors = {torch.Tensor}
    for path, value in roots:
        if type(value) is dict and set(map(type, value.values())) <= only_tensors:
            # (a param's state of plain tensors, the common case, at once: this runs over every param's state)
            if not keys.isdisjoint(map(id, value)):
                yield path, value
            continue
        if isinstance(value, (torch.Tensor,) + _ATOMS) or id(value) in seen:
            continue
        seen.add(id(value))
        # (a stack of (path, container); paths are built per container, not per tensor: containers are few)
        stack: list[tuple[Path, Any]] = [(path, value)]
        while stack:
            where, container = stack.pop()
            if isinstance(container, Mapping):
                if not keys.isdisjoint(map(id, container)):  # (in C: this runs over every param's state)
                    yield where, container
                if type(container) is dict and set(map(type, container.values())) <= only_tensors:
                    continue  # (nothing inside to walk)
            children = [
                (where + (step,), child)
                for step, child in _children(container)
                if not isinstance(child, (torch.Tensor,) + _ATOMS) and id(child) not in seen
            ]
            seen.update(id(child) for _, child in children)
            stack.extend(reversed(children))


REKEYABLE = (dict, OrderedDict, defaultdict)
"""The mappings :func:`rekey` renames keys of in place (their ``clear`` and ``update`` cannot fail part-way: a tensor
hashes by its id), and subclasses that override none of the operations it uses."""
_REKEY_OPS = ("__setitem__", "__delitem__", "clear", "update")


def rekey(mapping: Any, renames: Mapping[int, Any]) -> Setter:
    """The in-place update (read when applied, after a commit's replacements; it cannot fail) that renames each key of
    ``mapping`` that ``renames`` names by ``id``, in order. TypeError for a mapping that may refuse part-way (not
    :data:`REKEYABLE`), ValueError where two keys would become one."""
    kind = type(mapping)
    plain = any(
        isinstance(mapping, base) and all(getattr(kind, op) is getattr(base, op) for op in _REKEY_OPS)
        for base in REKEYABLE
    )
    if not plain:
        immutable = not hasattr(mapping, "__setitem__")
        raise TypeError(f"is {f'an immutable {kind.__name__}' if immutable else with_article(kind.__name__)}")
    named = [renames.get(id(k), k) for k in mapping]
    if len({id(k) for k in named}) != len(named):
        raise ValueError("holds entries under both an old param and the new param it is renamed to")

    def apply() -> None:
        items = [(renames.get(id(k), k), v) for k, v in list(mapping.items())]
        mapping.clear()
        mapping.update(items)

    return apply


def _set_replacer(container: set[Any], items: list[Any]) -> Setter:
    def apply() -> None:
        container.clear()
        container.update(items)

    return apply


def _attr_setter(obj: Any, name: str, new: Any) -> Setter:
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict) and name in d:
        return functools.partial(d.__setitem__, name, new)
    return functools.partial(object.__setattr__, obj, name, new)


# --- what every module asks of an optimizer ------------------------------------------------------------------


def like_source(source: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
    """``copy`` (made detached) as its ``source`` is: requiring grad only if it was a leaf that did (a copy of an
    autograd result, ASGD's ``ax``, as a leaf requiring grad would be refused by an in-place step), a Parameter."""
    if source.requires_grad and source.is_leaf:
        copy.requires_grad_(True)
    if isinstance(source, torch.nn.Parameter) and not isinstance(copy, torch.nn.Parameter):
        copy = torch.nn.Parameter(copy, requires_grad=source.requires_grad)
    return copy


GROUP_SKIP = ("params", "param_names")
"""A param group's entries that are not hyperparameters: its params and their names."""
OPTIMIZER_WIDE = -1
"""The "group" of ``optimizer.state`` entries under plain (non-param) keys (MADGRAD's ``k``, TRAC's ``trac``)."""


def group_tensors(group: Mapping[str, Any]) -> Iterator[tuple[Path, torch.Tensor]]:
    """Every tensor among a param group's hyperparameters (a tensor ``lr``, ``betas``), with its path in the group:
    the one walk of a group's own tensors."""
    for key, value in group.items():
        if key not in GROUP_SKIP:
            yield from leaves(value, (("key", key),))


IMPLEMENTATION_FLAGS = ("fused", "capturable", "foreach", "differentiable")
"""Group entries that choose *how* a step is computed, not *what* it computes (and where scalars live)."""


def group_flags(group: Mapping[str, Any]) -> tuple[Any, ...]:
    """A group's :data:`IMPLEMENTATION_FLAGS`, in that order (what a cached plan and an offload record compare)."""
    return tuple(group.get(flag) for flag in IMPLEMENTATION_FLAGS)


def unwrap(optimizer: Any) -> Any:
    """The optimizer a delegating wrapper (Accelerate's, Lightning's, schedulefree's, SAM's) wraps, as far as they
    nest; ``optimizer`` itself otherwise."""
    return wrapping(optimizer)[-1]


def wrapping(optimizer: Any) -> list[Any]:
    """``optimizer`` and each optimizer it delegates to (one it holds under any attribute that shares its
    ``param_groups`` and ``state``), outermost first. NOTE: Lightning's wrapper is also an instance of the class it
    wraps, so "is an Optimizer" does not end the search: sharing param_groups and state does."""
    layers = [optimizer]
    for _ in range(8):
        groups, state = getattr(optimizer, "param_groups", None), getattr(optimizer, "state", None)
        held = getattr(optimizer, "optimizer", None)
        candidates = [held] if isinstance(held, torch.optim.Optimizer) else []
        # (a copy first, made in one C call: another thread's operation adds and removes fronts in __dict__)
        attributes = list(getattr(optimizer, "__dict__", {}).values())
        candidates += [v for v in attributes if isinstance(v, torch.optim.Optimizer)]
        # (an optimizer that refers back to its wrapper shares its groups and state too: the way back is taken
        # only from an object that is no optimizer of its own, one that never ran Optimizer.__init__)
        own = "_optimizer_step_pre_hooks" in getattr(optimizer, "__dict__", {})
        inner = next(
            (
                c
                for c in candidates
                if c.param_groups is groups
                and c.state is state
                and not any(c is layer for layer in layers)
                and not (own and any(v is optimizer for v in list(vars(c).values())))
            ),
            None,
        )
        if inner is None:
            break
        optimizer = inner
        layers.append(inner)
    return layers


def inner_optimizers(optimizer: Any) -> list[tuple[str, torch.optim.Optimizer]]:
    """(attribute, optimizer) of each optimizer ``optimizer`` holds with a state of its own (Lookahead's), which
    walking the wrapper's state does not reach."""
    own = getattr(optimizer, "state", None)
    return [
        (name, value)
        for name, value in (list(vars(optimizer).items()) if hasattr(optimizer, "__dict__") else [])
        if isinstance(value, torch.optim.Optimizer) and value is not optimizer and value.state is not own
    ]


def group_device(group: Mapping[str, Any], fallback: torch.Tensor) -> torch.device:
    """The device of a group's params (the first one's), for tensors kept in the group itself."""
    for p in group.get("params", ()):
        if isinstance(p, torch.Tensor):
            return p.device
    return fallback.device


def param_name(index: int, names: Any) -> Any:
    """The name ``param_names`` gives param ``index`` of a group, or None."""
    return names[index] if isinstance(names, (list, tuple)) and index < len(names) else None


def param_label(group: int, index: int, name: Any = None) -> str:
    """``group 0, param 3``, or ``group 0, param 3 (fc.weight)`` with the param's name: how errors and
    reports name a param everywhere."""
    label = f"group {group}, param {index}"
    return label if name is None or name == "" else f"{label} ({name})"


def param_positions(optimizer: Any) -> dict[int, tuple[int, int]]:
    """``id(param) -> (group, index)`` of every param the optimizer's groups hold now."""
    return {id(p): (gi, pi) for gi, g in enumerate(optimizer.param_groups) for pi, p in enumerate(g["params"])}


def label_in(optimizer: Any, group: int, index: int) -> str:
    """:func:`param_label` of param ``index`` of ``optimizer``'s group ``group``, with the name the group gives it."""
    groups = optimizer.param_groups
    names = groups[group].get("param_names") if group < len(groups) else None
    return param_label(group, index, param_name(index, names))
